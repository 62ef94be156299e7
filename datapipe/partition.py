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

Two orders (``StreamingDataset(order=...)``):

- ``"global"`` (:func:`epoch_order`): one permutation of all samples. The best mix, but every
  node reads from every shard all epoch long: right when the cache is local (the page cache and
  the disk serve random reads), costly when shards are downloaded into a bounded local cache.
- ``"shards"`` (:func:`shard_order`): per epoch the shards are permuted; their samples, in that
  order, are split into ``nodes`` equal contiguous parts; each part is cut at shard boundaries
  into windows of ``window`` shards, and samples are shuffled within each window only. The
  global order interleaves the parts step by step (node 0's chunk of ``local_world × batch_size``,
  then node 1's ...), so the rank slicing above hands every rank (numbered node-major, as
  torchrun does) samples of its own node's part. A node then holds about one window of shards
  at a time (two while a step straddles windows). Each node's stream depends on
  (counts, seed, epoch, nodes, window) only; batch size and ranks per node only interleave the
  streams, so a step boundary means the same samples read for any batch layout with these nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

ORDERS = ("global", "shards")
# Shards a node's window spans. 64 shards of ~100 MB (the build's default) is ~6 GB of local
# cache per node, and a batch of a class-sorted cache then mixes ~64 classes (docs/loader.md).
DEFAULT_WINDOW = 64
_ORDER_TAG = 0x5D1A  # the global permutation's stream
_SHARDS_TAG = 0x5A4D  # the shard-aware order's streams (shard permutation, then one per node)
_MASK = 0xFFFFFFFF


def default_order(is_remote: bool) -> str:
    """The order a dataset uses unless told: ``"global"`` for a local cache, ``"shards"`` for a remote one.

    A local cache is served by the disk and the page cache, which take random reads: the global
    shuffle costs nothing there. A remote cache is downloaded shard by shard into a bounded local
    cache; a global order would download each shard many times per epoch once the cache is
    smaller than the data, while the shard-aware order downloads each shard about once.
    """
    return "shards" if is_remote else "global"


def epoch_order(num_samples: int, *, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The epoch's global order of sample indices: int64 [num_samples]."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed & _MASK, epoch & _MASK, _ORDER_TAG]))
    return rng.permutation(num_samples).astype(np.int64)


class NodeStream(NamedTuple):
    """What one node reads in an epoch of the shard-aware order.

    ``samples``: int64 [n_k], the node's samples in reading order. ``windows``: int64 [w + 1], the
    boundaries of its windows in ``samples`` (window i is ``samples[windows[i]:windows[i + 1]]``).
    """

    samples: np.ndarray
    windows: np.ndarray


def node_parts(num_samples: int, nodes: int) -> np.ndarray:
    """Where each node's part begins and ends in the concatenated shards: int64 [nodes + 1].

    Equal parts (the first ``num_samples % nodes`` one sample longer), independent of the batch
    layout, so that a saved position means the same samples for any batch size.
    """
    k = np.arange(nodes + 1, dtype=np.int64)
    return k * (num_samples // nodes) + np.minimum(k, num_samples % nodes)


def node_streams(counts: np.ndarray | list[int], *, seed: int, epoch: int, nodes: int, window: int,
                 shuffle: bool = True) -> list[NodeStream]:
    """Each node's samples in the order it reads them in the shard-aware order (see the module notes).

    Args:
        counts: samples in each shard, in the cache's order (shard i holds the next counts[i]
            global indices).
        shuffle: False keeps the shards and samples in the cache's order (each node still reads
            its own contiguous part).
    """
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)  # [S]
    _check_counts(counts)
    _check_positive(nodes=nodes, window=window)
    starts = np.cumsum(counts) - counts  # [S]
    n = int(counts.sum())
    perm = _rng(seed, epoch, 0).permutation(len(counts)) if shuffle else np.arange(len(counts))  # [S]
    c, first = counts[perm], starts[perm]  # [S]
    ends = np.cumsum(c)  # [S]: where each shard ends in the concatenation
    seq = np.arange(n, dtype=np.int64) + np.repeat(first - (ends - c), c)  # [N]: the shards' samples, in order
    edges = node_parts(n, nodes)
    streams = []
    for k in range(nodes):
        a, b = int(edges[k]), int(edges[k + 1])
        pieces = np.unique(np.concatenate([[a], ends[(ends > a) & (ends < b)], [b]]))  # shard boundaries in [a, b]
        windows = pieces[::window]
        if windows[-1] != b:
            windows = np.append(windows, b)
        samples = seq[a:b].copy()
        if shuffle:
            rng = _rng(seed, epoch, 1 + k)
            for lo, hi in zip((windows[:-1] - a).tolist(), (windows[1:] - a).tolist(), strict=True):
                rng.shuffle(samples[lo:hi])
        streams.append(NodeStream(samples, (windows - a).astype(np.int64)))
    return streams


def shard_order(counts: np.ndarray | list[int], *, seed: int, epoch: int, nodes: int, window: int,
                batch_size: int, local_world: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's shard-aware order: int64 [N], a permutation of the sample indices.

    Global step j (``nodes × local_world × batch_size`` samples) is node 0's j-th chunk of
    ``local_world × batch_size`` samples of its stream, then node 1's, and so on; the last,
    partial step is what is left of each node's stream, node by node (so only there may a rank
    read a few samples of another node's part).
    """
    _check_positive(batch_size=batch_size, local_world=local_world)
    streams = [s.samples for s in node_streams(counts, seed=seed, epoch=epoch, nodes=nodes, window=window,
                                               shuffle=shuffle)]
    return interleave(streams, chunk=local_world * batch_size)


def interleave(streams: list[np.ndarray], *, chunk: int) -> np.ndarray:
    """Lay node streams out as global steps of ``len(streams) × chunk``: int64 [N].

    Shape notes: K = nodes, C = chunk, F = full steps. Every stream holds at least F·C samples
    (the streams' lengths differ by at most one and K·F·C <= N).
    """
    n = sum(len(s) for s in streams)
    nodes = len(streams)
    full = n // (nodes * chunk)  # F
    out = np.empty(n, dtype=np.int64)
    steps = out[: full * nodes * chunk].reshape(full, nodes, chunk)  # [F, K, C] view
    for k, s in enumerate(streams):
        steps[:, k, :] = s[: full * chunk].reshape(full, chunk)
    tail = [s[full * chunk:] for s in streams]
    out[full * nodes * chunk:] = np.concatenate(tail) if tail else np.empty(0, np.int64)
    return out


class OrderQuality(NamedTuple):
    """How well an order mixes, over its full batches: mean label entropy (bits) and mean distinct shards."""

    entropy_bits: float
    distinct_shards: float
    batches: int


def order_quality(order: np.ndarray, labels: np.ndarray, shard_of: np.ndarray, batch_size: int) -> OrderQuality:
    """Mix of consecutive batches of ``batch_size`` in ``order`` (a rank's stream, or any order).

    The label entropy of a batch is that of its labels' empirical distribution, in bits (a batch
    of one class: 0; a batch of B different classes: log2 B). Only full batches count, unless
    there is none (then the one partial batch).

    Args:
        order: int64 [n], sample indices. labels, shard_of: int [N], each sample's label and shard.
    """
    _check_positive(batch_size=batch_size)
    order = np.asarray(order, dtype=np.int64)
    nb = max(1, len(order) // batch_size) if len(order) else 0
    if nb == 0:
        return OrderQuality(0.0, 0.0, 0)
    b = min(batch_size, len(order))
    idx = order[: nb * b].reshape(nb, b)  # [nb, b]
    return OrderQuality(float(_row_entropy(np.asarray(labels)[idx]).mean()),
                        float(_row_distinct(np.asarray(shard_of)[idx]).mean()), nb)


def _row_distinct(x: np.ndarray) -> np.ndarray:
    """Distinct values in each row of int [r, b]: float64 [r]."""
    s = np.sort(x, axis=1)
    return (1 + (np.diff(s, axis=1) != 0).sum(axis=1)).astype(np.float64)


def _row_entropy(x: np.ndarray) -> np.ndarray:
    """Entropy in bits of each row's empirical distribution, int [r, b]: float64 [r]."""
    s = np.sort(x, axis=1)
    r, b = s.shape
    new = np.ones((r, b), dtype=bool)
    new[:, 1:] = s[:, 1:] != s[:, :-1]
    run_id = np.cumsum(new.reshape(-1)) - 1  # [r*b]: a run of equal values per row
    sizes = np.bincount(run_id).astype(np.float64)  # [runs]
    row_of_run = np.repeat(np.arange(r), new.sum(axis=1))  # [runs]
    p = sizes / b
    return np.bincount(row_of_run, weights=-p * np.log2(p), minlength=r)


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed & _MASK, epoch & _MASK, _SHARDS_TAG, stream]))


def _check_counts(counts: np.ndarray) -> None:
    if (counts < 0).any():
        raise ValueError(f"shard counts must be >= 0, got {int(counts.min())}")


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


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
