"""Who am I: rank and world size (torch.distributed or RANK/WORLD_SIZE) and DataLoader worker.

And do the ranks agree: values published in the default process group's store, compared without waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The most processes a job may read with: more than any job runs, and few enough that a rank's arithmetic (positions
# of batch_size × world_size samples, a list of one entry per rank) stays within int64 and in memory.
MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class World:
    """One reader's place: ``rank`` of ``world_size`` processes, ``worker`` of ``num_workers``.

    ``num_workers`` is 1 (and ``worker`` 0) in the main process, i.e. with ``num_workers=0``.
    """

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be at most {MAX_WORLD_SIZE:,}, got {self.world_size:,}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={self.rank}, world_size={self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker must be in [0, num_workers), got worker={self.worker}, "
                             f"num_workers={self.num_workers}")


def detect_ranks(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Rank and world size: the arguments if given, else torch.distributed, else RANK/WORLD_SIZE."""
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    detected = distributed_ranks()
    if detected is None and rank is None and "RANK" not in os.environ:
        # no rank anywhere: one process alone is rank 0, but of a world of several, each would read rank 0's part
        if world_size is not None:
            given = f"world_size={int(world_size)} is given" if int(world_size) != 1 else None
        else:
            given = f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set" if os.environ.get("WORLD_SIZE", "1").strip() != "1" else None
        if given is not None:
            raise ValueError(f"{given} but no rank (rank=, torch.distributed or RANK): every process would read rank "
                             "0's part; set RANK in each process (torchrun does), or pass rank=")
    if detected is not None:
        det_rank, det_world = detected
    else:  # only the variable that is used is read: a RANK that is no number does not fail a given rank=
        det_rank = _env_int("RANK", "0") if rank is None else 0
        det_world = _env_int("WORLD_SIZE", "1") if world_size is None else 1
    return (det_rank if rank is None else int(rank)), (det_world if world_size is None else int(world_size))


def _env_int(name: str, default: str) -> int:
    """The whole number in environment variable ``name`` (``default`` where unset); ValueError naming it."""
    text = os.environ.get(name, default)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"the environment variable {name} must be a whole number (torchrun sets it), got "
                         f"{text!r}; unset it, or set it as torchrun does") from None


def distributed_ranks() -> tuple[int, int] | None:
    """(rank, world size) of torch.distributed's default group when it is initialised in this process, else None."""
    with contextlib.suppress(ImportError, RuntimeError):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    return None


def _default_store() -> Any:
    """The default process group's key-value store, or None (no group, or a torch without one)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except (ImportError, AttributeError, RuntimeError, ValueError):
        return None


def _scoped(key: str) -> str:
    """``key`` in this attempt's namespace of the store. torchrun's workers share its agent's store, which outlives
    them: after a restart (``--max-restarts``), the keys the failed attempt published are still there, and the
    restarted ranks, resuming alike, were compared with them and refused. On one node, one agent numbers the
    attempts for every rank (``TORCHELASTIC_RESTART_COUNT``): its keys are named by it. Over several nodes each
    agent counts its own restarts, so the count is no name all ranks share: the keys stay as they are, and a
    restarted job needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a store for each attempt), as torch's own set-up
    of the process group does (pytorch/pytorch#135712)."""
    env = os.environ
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("GROUP_WORLD_SIZE") != "1"
            or "TORCHELASTIC_RESTART_COUNT" not in env):
        return key
    return f"attempt-{env['TORCHELASTIC_RESTART_COUNT']}/{key}"


def first_published(key: str, mine: Mapping[str, Any]) -> dict | None:
    """What the first rank to publish ``key`` in the default process group's store published there
    (``mine`` when this rank is the first), or None when there is no store to ask.

    One atomic set-if-absent (``compare_set`` with an empty expected value), so it never waits for
    another rank and is no collective: ranks may get here at different times, or some never. Every
    rank that publishes something else than the first learns it; which rank is first does not matter.
    """
    store = _default_store()
    if store is None:
        return None
    try:
        value = store.compare_set(_scoped(key), "", json.dumps(dict(mine), sort_keys=True))
        first = json.loads(value)
    except (RuntimeError, NotImplementedError, ValueError, OSError):  # a store without it, or gone: no check
        return None
    return first if isinstance(first, dict) else None


def announce(key: str) -> None:
    """Set ``key`` in the default store (that this rank got somewhere), if there is a store."""
    store = _default_store()
    if store is None:
        return
    with contextlib.suppress(RuntimeError, NotImplementedError, ValueError, OSError):
        store.set(_scoped(key), "1")


def all_announced(keys: list[str]) -> bool | None:
    """Whether every one of ``keys`` is in the default store (one request; never waits), or None when there is no
    store to ask."""
    store = _default_store()
    if store is None:
        return None
    try:
        return bool(store.check([_scoped(key) for key in keys]))
    except (RuntimeError, NotImplementedError, ValueError, OSError):
        return None


def forget(key: str) -> None:
    """Remove ``key`` from the default store, if it is there (a rank that has not published it yet
    publishes it anew: the check is lost for it, never a false alarm)."""
    store = _default_store()
    if store is None:
        return
    with contextlib.suppress(RuntimeError, NotImplementedError, ValueError, OSError):
        store.delete_key(_scoped(key))


def detect_worker() -> tuple[int, int]:
    """(worker id, number of workers) inside a torch DataLoader worker; (0, 1) elsewhere."""
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0, 1
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
