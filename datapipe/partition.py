"""Which samples does each rank read, in which order: pure functions of integers.

The epoch's order is one global permutation of all samples, a function of (seed, epoch) alone.
The stream from ``start`` on is cut into global steps of ``world_size × batch_size`` samples;
in each step rank r takes the r-th slice of ``batch_size``. So every rank yields the same number
of batches and the split does not depend on shards or workers. DataLoader workers then take this
rank's batches round-robin (batch j goes to worker j mod W), which the DataLoader reassembles in
order: the stream is identical for any number of workers.

The last, partial step (``drop_last=False``) is split as evenly as possible over the ranks: each
rank's last batch holds ⌊m/R⌋ or ⌈m/R⌉ of the m remaining samples, so every sample is read exactly
once. If m < R, the ranks past m get an empty last batch (batch size 0) rather than a duplicate.
With ``drop_last=True`` the final m samples of the epoch's order are skipped (read at most once).
"""

from __future__ import annotations

import numpy as np


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's global order of sample indices: int64 [num_samples]."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, 0x5D1A]))
    return rng.permutation(num_samples).astype(np.int64)


def num_batches(num_samples: int, *, batch_size: int, world_size: int, drop_last: bool, start: int = 0) -> int:
    """Batches each rank yields for the stream ``order[start:]`` (the same on every rank)."""
    _check(batch_size, world_size)
    remaining = max(0, num_samples - start)
    step = batch_size * world_size
    return remaining // step if drop_last else -(-remaining // step)


def batch_bounds(num_samples: int, *, batch_size: int, world_size: int, rank: int, drop_last: bool,
                 start: int = 0) -> np.ndarray:
    """Positions in the epoch's order of each of this rank's batches: int64 [batches, 2] (begin, end).

    Shape notes: R = world_size, B = batch_size, n = batches on every rank.
    """
    n = num_batches(num_samples, batch_size=batch_size, world_size=world_size, drop_last=drop_last, start=start)
    step = batch_size * world_size
    begin = start + np.arange(n, dtype=np.int64) * step + rank * batch_size  # [n]
    end = begin + batch_size  # [n]
    if n and not drop_last:
        last_start = start + (n - 1) * step
        m = num_samples - last_start  # samples in the last global step, 1 <= m <= R*B
        if m < step:
            sizes = np.full(world_size, m // world_size, np.int64)  # [R]
            sizes[: m % world_size] += 1
            offsets = np.concatenate([[0], np.cumsum(sizes)])  # [R+1]
            begin[-1] = last_start + offsets[rank]
            end[-1] = last_start + offsets[rank + 1]
    return np.stack([begin, end], axis=1) if n else np.empty((0, 2), np.int64)


def worker_batches(num_batches_: int, *, worker: int, num_workers: int, first: int = 0) -> np.ndarray:
    """The rank-local batch numbers (from ``first`` on) that DataLoader worker ``worker`` yields."""
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} out of range for num_workers={num_workers}")
    return np.arange(first + worker, num_batches_, num_workers, dtype=np.int64)


def _check(batch_size: int, world_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
