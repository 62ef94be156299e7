"""Threads and processes: scoped changes to torch's intra-op thread count, and state renewed after a fork.

``torch.set_num_threads`` changes the whole process: library code sets it only for the span of
work that needs it and puts the caller's value back afterwards.

A child made by fork (a DataLoader worker, by default on Linux) inherits every lock as it was at the
fork, but none of the threads: a lock a reader thread of the parent held at that moment stays held for
ever in the child, and the first read there waits without end. Objects whose locks reader threads take
register with :func:`renew_after_fork`; module-level locks are renewed by their module's own
``os.register_at_fork`` hook.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Iterator

_RENEW: dict[int, tuple[weakref.ref, str]] = {}


def renew_after_fork(obj: object, method: str) -> None:
    """Call ``obj.<method>()`` in every child this process forks while ``obj`` lives (it makes the object's
    locks, and whatever else of it belongs to threads of the parent, anew)."""
    key = id(obj)

    def forget(_ref: weakref.ref) -> None:
        _RENEW.pop(key, None)

    _RENEW[key] = (weakref.ref(obj, forget), method)


def _renew_in_child() -> None:
    for ref, method in list(_RENEW.values()):
        obj = ref()
        if obj is not None:
            getattr(obj, method)()


os.register_at_fork(after_in_child=_renew_in_child)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads, then restore the previous count."""
    import torch

    before = torch.get_num_threads()
    if before != count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
