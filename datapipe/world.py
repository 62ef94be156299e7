"""Who am I: rank and world size (torch.distributed or RANK/WORLD_SIZE) and DataLoader worker."""

from __future__ import annotations

import os
from dataclasses import dataclass


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
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size), got rank={self.rank}, world_size={self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise ValueError(f"worker must be in [0, num_workers), got worker={self.worker}, "
                             f"num_workers={self.num_workers}")


def detect_ranks(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Rank and world size: the arguments if given, else torch.distributed, else RANK/WORLD_SIZE."""
    if rank is not None and world_size is not None:
        return int(rank), int(world_size)
    det_rank, det_world = 0, 1
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            det_rank, det_world = dist.get_rank(), dist.get_world_size()
        else:
            raise RuntimeError
    except (ImportError, RuntimeError):
        det_rank = int(os.environ.get("RANK", "0"))
        det_world = int(os.environ.get("WORLD_SIZE", "1"))
    return (det_rank if rank is None else int(rank)), (det_world if world_size is None else int(world_size))


def detect_worker() -> tuple[int, int]:
    """(worker id, number of workers) inside a torch DataLoader worker; (0, 1) elsewhere."""
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0, 1
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)
