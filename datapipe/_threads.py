"""Scoped changes to torch's process-wide intra-op thread count.

``torch.set_num_threads`` changes the whole process: library code sets it only for the span of
work that needs it and puts the caller's value back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


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
