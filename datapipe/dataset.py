"""The streaming dataset: whole uint8 batches from memory-mapped shards, exactly once per epoch.

``StreamingDataset`` is a ``torch.utils.data.IterableDataset`` that yields whole batches
(``batch_size=None`` in a DataLoader). Its order is a pure function of (seed, epoch, position)
— see :mod:`datapipe.partition` — split over ranks × workers together, so every rank yields the
same number of batches and the stream is identical for any number of DataLoader workers.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset

from . import partition as part
from .cache import Cache
from .errors import DatapipeError, StateError
from .world import World, detect_ranks, detect_worker

STATE_VERSION = 1


def _check_shm(batch_bytes: int, worker_info, path: str = "/dev/shm") -> None:
    """Fail fast, with the fix named, when shared memory cannot hold the batches in flight.

    Worker processes hand batches over through /dev/shm; Docker's default of 64 MB holds less than
    two 256×256 batches of 256, and running out surfaces as a bus error deep in the DataLoader.
    """
    try:
        st = os.statvfs(path)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    in_flight = batch_bytes * max(2, 2 * (worker_info.num_workers if worker_info else 1))
    if free < in_flight:
        raise DatapipeError(
            f"{path} has {free / 2**20:,.0f} MB free, but DataLoader workers need about {in_flight / 2**20:,.0f} MB "
            f"of shared memory for the batches in flight ({batch_bytes / 2**20:,.0f} MB each). Start the container "
            "with a larger --shm-size (e.g. docker run --shm-size=8g), use datapipe.DeviceLoader (threads, no shared "
            "memory), or use fewer workers or a smaller batch.")


class StreamingDataset(IterableDataset):
    """Stream a cache as batches ``(images, labels[, indices])``.

    Args:
        cache: a cache folder (written by ``datapipe build``) or an opened :class:`~datapipe.Cache`.
        batch_size: samples per batch on each rank.
        shuffle: a global shuffle of all samples each epoch (samples inside one batch come in
            index order: one sequential pass per shard they live in).
        seed: the order is a pure function of (seed, epoch, position).
        drop_last: drop the epoch's last partial global step (so every batch is full); otherwise
            every sample comes exactly once and the last batch of each rank may be smaller.
        rank, world_size: override what torch.distributed or RANK/WORLD_SIZE say.
        return_index: also yield the global sample indices (as ``datapipe.open(cache)[i]`` numbers them).

    Yields:
        ``images`` uint8 [B, H, W, 3], ``labels`` int64 [B] (and ``indices`` int64 [B]).
    """

    def __init__(self, cache: str | Path | Cache, /, *, batch_size: int = 256, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, return_index: bool = False) -> None:
        super().__init__()
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.cache = cache if isinstance(cache, Cache) else Cache(cache)
        self.rank, self.world_size = detect_ranks(rank, world_size)
        World(self.rank, self.world_size)  # validates
        self.batch_size = batch_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.return_index = bool(return_index)
        # [epoch, start, read by workers]: shared with DataLoader workers (also persistent ones)
        # through shared memory. The third is set by a worker that reads this epoch: then only the
        # caller knows how many batches the loop received (state_dict(batches_consumed=k)).
        self._shared = torch.zeros(3, dtype=torch.int64).share_memory_()
        self._consumed = 0  # batches the loop received in this epoch (main-process iteration)
        self._iter_base = 0  # where the current iteration began in the epoch's order

    # ----------------------------------------------------------------- epoch, length, plan
    @property
    def epoch(self) -> int:
        return int(self._shared[0])

    @property
    def start(self) -> int:
        """Position in the epoch's order where the next iteration begins (0 unless resumed)."""
        return int(self._shared[1])

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (call before each epoch). A new epoch starts from its beginning.

        A resumed position (``load_state_dict``) holds until the epoch changes. In the main
        process (``num_workers=0``, DeviceLoader) it is also used only once; DataLoader worker
        processes cannot tell the main process that they used it, so there a second pass over the
        resumed epoch without ``set_epoch`` starts at the resumed position again.
        """
        if int(epoch) != self.epoch:
            self._shared[1] = 0
            self._shared[2] = 0
            self._iter_base = 0
            self._consumed = 0
        self._shared[0] = int(epoch)

    def __len__(self) -> int:
        """Batches this rank yields per epoch."""
        return part.num_batches(len(self.cache), batch_size=self.batch_size, world_size=self.world_size,
                                drop_last=self.drop_last)

    def plan(self, start: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The current epoch's global order [N] and this rank's batch bounds [n, 2] from ``start``."""
        order = part.epoch_order(len(self.cache), seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        bounds = part.batch_bounds(len(self.cache), batch_size=self.batch_size, world_size=self.world_size,
                                   rank=self.rank, drop_last=self.drop_last,
                                   start=self.start if start is None else start)
        return order, bounds

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self.cache.shape

    # ----------------------------------------------------------------- iteration
    def begin_iteration(self) -> tuple[np.ndarray, np.ndarray]:
        """Start an iteration of the current epoch in this process: its order and batch bounds.

        A resumed position is used once; the next iteration of the same epoch is whole again.
        """
        order, bounds = self.plan()
        self._iter_base = self.start
        self._shared[1] = 0
        self._shared[2] = 0
        self._consumed = 0
        return order, bounds

    def __iter__(self):
        worker, num_workers = detect_worker()
        in_worker = torch.utils.data.get_worker_info() is not None
        order, bounds = self.plan() if in_worker else self.begin_iteration()
        if in_worker:  # batches go back through shared memory: is there room for them?
            self._shared[2] = 1
            _check_shm(self.batch_size * int(np.prod(self.cache.shape)), torch.utils.data.get_worker_info())
        for j in part.worker_batches(len(bounds), worker=worker, num_workers=num_workers):
            begin, end = bounds[j]
            batch = self._read(order[begin:end], shared=in_worker)
            if not in_worker:
                self._consumed = int(j) + 1
            yield batch

    def _read(self, indices: np.ndarray, *, shared: bool):
        n = len(indices)
        images = torch.empty((n, *self.cache.shape), dtype=torch.uint8)
        if shared and n:
            images.share_memory_()  # filled in place: the DataLoader sends a handle, not a copy
        labels = torch.empty(n, dtype=torch.int64)
        index = torch.empty(n, dtype=torch.int64)
        self.cache.read_batch(indices, images.numpy(), labels.numpy(), index.numpy())
        return (images, labels, index) if self.return_index else (images, labels)

    # ----------------------------------------------------------------- resume
    def state_dict(self, batches_consumed: int | None = None) -> dict:
        """A small, versioned state: load it into a fresh dataset to continue the same stream.

        Args:
            batches_consumed: batches of the current epoch the training loop has received. Default:
                what this dataset counted while iterated in the main process (``num_workers=0``);
                required when the epoch was read through your own multi-worker DataLoader (its
                workers cannot report it): without it that raises StateError.
        """
        if batches_consumed is None and int(self._shared[2]):
            raise StateError(
                "this epoch was read by DataLoader worker processes, which cannot tell this process how "
                "many batches your loop received: pass state_dict(batches_consumed=k), k = the batches "
                "of this epoch the loop took (or use datapipe.DeviceLoader, which counts them)")
        k = self._consumed if batches_consumed is None else int(batches_consumed)
        position = min(len(self.cache), self._iter_base + k * self.batch_size * self.world_size)
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.cache),
            "config_hash": self.cache.manifest["config_hash"],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state (seeks: skipped samples are never read).

        The world size and batch size may differ from the saved run as long as the saved position
        falls on a global step boundary of the new configuration.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise StateError(f"unknown loader state version {state.get('version') if isinstance(state, dict) else state!r}; "
                             f"this datapipe reads version {STATE_VERSION}")
        for key, mine in (("num_samples", len(self.cache)), ("seed", self.seed), ("shuffle", self.shuffle),
                          ("config_hash", self.cache.manifest["config_hash"])):
            if state.get(key) != mine:
                raise StateError(f"the saved state is for {key}={state.get(key)!r}, this dataset has {mine!r}; "
                                 "resume with the same cache, seed and shuffle")
        position, step = int(state["position"]), self.batch_size * self.world_size
        if position < len(self.cache) and position % step:
            raise StateError(
                f"cannot resume at sample {position} of epoch {state['epoch']} with world_size="
                f"{self.world_size} × batch_size={self.batch_size}: it is not a multiple of {step}. "
                "Resume with a global batch that divides the position (e.g. the saved one).")
        self._shared[0] = int(state["epoch"])
        self._shared[1] = position
        self._shared[2] = 0
        self._iter_base = position
        self._consumed = 0

    def __repr__(self) -> str:
        return (f"StreamingDataset({str(self.cache.root)!r}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, seed={self.seed}, rank={self.rank}/{self.world_size}, "
                f"batches={len(self)})")
