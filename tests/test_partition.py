"""Property tests of the pure partition over ranks × workers × sizes, without starting a process.

Requirements 1 (exactly once), 2 (equal batch counts), 3 (exact lengths), 5 (order independent of
the number of workers), 7 (global shuffle quality) and 8 (resume = tail of the stream).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from loader_fixtures import index_cache_info

from datapipe import partition as part

RANKS = (1, 2, 3, 4, 8)
WORKERS = (0, 1, 2, 3, 4)  # 0: iterated in the main process
BATCHES = (1, 3, 8)
DROP = (False, True)


@pytest.fixture(scope="session")
def wide_cache(tmp_path_factory):
    """600 index-encoding samples of 8×8 in 12 shards of 50."""
    return index_cache_info(tmp_path_factory, 600, shard_size=50, size=8)


def sizes_for(ranks: int, batch: int) -> list[int]:
    """0, 1, fewer than R, fewer than R·W, not a multiple of B or R·B, exact multiples, large."""
    step = ranks * batch
    return sorted({0, 1, max(ranks - 1, 1), ranks + 1, 3 * ranks - 1, step - 1, step, step + 1,
                   5 * step + 3, 7 * batch + 2, 1001})


def cases():
    for ranks, batch, drop_last in itertools.product(RANKS, BATCHES, DROP):
        for n in sizes_for(ranks, batch):
            yield ranks, batch, drop_last, n


def dataloader_order(num_batches: int, num_workers: int) -> list[int]:
    """The rank-local batch numbers in the order a DataLoader with ``num_workers`` yields them.

    Workers yield their own batches in order; the DataLoader asks them round-robin and skips a
    worker once it has run out (exactly what ``torch.utils.data`` does for an IterableDataset).
    """
    if num_workers == 0:
        return list(part.worker_batches(num_batches, worker=0, num_workers=1))
    its = [iter(part.worker_batches(num_batches, worker=w, num_workers=num_workers).tolist())
           for w in range(num_workers)]
    active = list(range(num_workers))
    out: list[int] = []
    while active:
        for w in list(active):
            try:
                out.append(next(its[w]))
            except StopIteration:
                active.remove(w)
    return out


def rank_batches(n: int, *, ranks: int, rank: int, batch: int, drop_last: bool, order: np.ndarray,
                 start: int = 0) -> list[np.ndarray]:
    bounds = part.batch_bounds(n, batch_size=batch, world_size=ranks, rank=rank, drop_last=drop_last, start=start)
    return [order[b:e] for b, e in bounds]


# ----------------------------------------------------------------------------- counts and coverage


@pytest.mark.parametrize("ranks", RANKS)
def test_equal_exact_batch_counts_on_every_rank(ranks):
    for _, batch, drop_last, n in (c for c in cases() if c[0] == ranks):
        step = ranks * batch
        expected = n // step if drop_last else -(-n // step)
        nb = part.num_batches(n, batch_size=batch, world_size=ranks, drop_last=drop_last)
        assert nb == expected, (n, batch, ranks, drop_last)
        for rank in range(ranks):
            bounds = part.batch_bounds(n, batch_size=batch, world_size=ranks, rank=rank, drop_last=drop_last)
            assert bounds.shape == (nb, 2) and bounds.dtype == np.int64
            sizes = bounds[:, 1] - bounds[:, 0]
            assert (sizes >= 0).all() and (sizes <= batch).all()
            if drop_last:
                assert (sizes == batch).all()
            else:
                assert (sizes[:-1] == batch).all(), "only the last batch of a rank may be short"


@pytest.mark.parametrize(("ranks", "drop_last"), list(itertools.product(RANKS, DROP)))
def test_exactly_once_over_ranks_and_workers(ranks, drop_last):
    for _, batch, _, n in (c for c in cases() if c[0] == ranks and c[2] == drop_last):
        order = part.epoch_order(n, seed=7, epoch=1, shuffle=True)
        nb = part.num_batches(n, batch_size=batch, world_size=ranks, drop_last=drop_last)
        for workers in WORKERS:
            seen = []
            for rank in range(ranks):
                bounds = part.batch_bounds(n, batch_size=batch, world_size=ranks, rank=rank, drop_last=drop_last)
                per_worker = ([part.worker_batches(nb, worker=0, num_workers=1)] if workers == 0 else
                              [part.worker_batches(nb, worker=w, num_workers=workers) for w in range(workers)])
                assert sum(len(js) for js in per_worker) == nb
                for js in per_worker:
                    for j in js:
                        seen.append(order[bounds[j, 0]:bounds[j, 1]])
            seen = np.concatenate(seen) if seen else np.empty(0, np.int64)
            counts = np.bincount(seen, minlength=n)
            where = {"n": n, "batch": batch, "ranks": ranks, "workers": workers}
            if drop_last:
                assert counts.max(initial=0) <= 1, where
                assert n - len(seen) == n % (ranks * batch), where
                # What is dropped is the tail of the epoch's order, nothing else.
                assert set(order[len(seen):].tolist()) == set(range(n)) - set(seen.tolist()), where
            else:
                assert (counts == 1).all(), where


def test_last_partial_step_is_balanced_over_ranks():
    # 2 left over for 4 ranks: two ranks get one sample, two get an empty last batch (no duplicate).
    n, batch, ranks = 4 * 3 + 2, 3, 4
    last = [part.batch_bounds(n, batch_size=batch, world_size=ranks, rank=r, drop_last=False)[-1] for r in range(ranks)]
    sizes = [int(e - b) for b, e in last]
    assert sizes == [1, 1, 0, 0]
    # 7 left over for 3 ranks of batch 8: sizes 3, 2, 2.
    last = [part.batch_bounds(31, batch_size=8, world_size=3, rank=r, drop_last=False)[-1] for r in range(3)]
    assert [int(e - b) for b, e in last] == [3, 2, 2]


# ----------------------------------------------------------------------------- order


@pytest.mark.parametrize("workers", WORKERS[1:])
def test_worker_order_equals_single_process_order(workers):
    for nb in (0, 1, 2, 3, 4, 5, 7, 8, 13, 100):
        assert dataloader_order(nb, workers) == list(range(nb)), (nb, workers)
        assert dataloader_order(nb, workers) == dataloader_order(nb, 0)


def test_worker_batches_rejects_bad_worker():
    with pytest.raises(ValueError, match="worker 3 out of range"):
        part.worker_batches(10, worker=3, num_workers=3)


def test_bad_batch_or_world_size_named():
    with pytest.raises(ValueError, match="batch_size"):
        part.num_batches(10, batch_size=0, world_size=1, drop_last=False)
    with pytest.raises(ValueError, match="world_size"):
        part.batch_bounds(10, batch_size=2, world_size=0, rank=0, drop_last=False)


@pytest.mark.parametrize("n", [0, 1, 2, 17, 1000])
def test_shuffle_is_a_reproducible_permutation(n):
    a = part.epoch_order(n, seed=3, epoch=0, shuffle=True)
    assert a.dtype == np.int64 and a.shape == (n,)
    assert np.array_equal(np.sort(a), np.arange(n))
    assert np.array_equal(a, part.epoch_order(n, seed=3, epoch=0, shuffle=True))
    assert np.array_equal(part.epoch_order(n, seed=3, epoch=0, shuffle=False), np.arange(n))
    if n >= 17:
        others = [part.epoch_order(n, seed=3, epoch=1, shuffle=True), part.epoch_order(n, seed=4, epoch=0, shuffle=True)]
        for other in others:
            assert not np.array_equal(a, other)
        assert not np.array_equal(a, np.arange(n))


def test_epochs_and_seeds_give_distinct_orders():
    n = 64
    orders = {part.epoch_order(n, seed=s, epoch=e, shuffle=True).tobytes() for s in range(4) for e in range(8)}
    assert len(orders) == 32


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("ranks", RANKS)
def test_resume_at_a_step_boundary_is_the_tail(ranks):
    for _, batch, drop_last, n in (c for c in cases() if c[0] == ranks):
        order = part.epoch_order(n, seed=1, epoch=2, shuffle=True)
        step = ranks * batch
        nb = part.num_batches(n, batch_size=batch, world_size=ranks, drop_last=drop_last)
        for k in sorted({0, min(1, nb), nb // 2, max(nb - 1, 0), nb}):
            start = k * step
            assert part.num_batches(n, batch_size=batch, world_size=ranks, drop_last=drop_last, start=start) == nb - k
            for rank in range(ranks):
                full = rank_batches(n, ranks=ranks, rank=rank, batch=batch, drop_last=drop_last, order=order)
                tail = rank_batches(n, ranks=ranks, rank=rank, batch=batch, drop_last=drop_last, order=order,
                                    start=start)
                assert len(tail) == nb - k
                for x, y in zip(full[k:], tail, strict=True):
                    assert np.array_equal(x, y), (n, batch, ranks, drop_last, k, rank)


def test_resume_past_the_end_is_empty():
    assert part.num_batches(10, batch_size=4, world_size=1, drop_last=False, start=12) == 0
    assert part.batch_bounds(10, batch_size=4, world_size=2, rank=1, drop_last=False, start=16).shape == (0, 2)


# ----------------------------------------------------------------------------- shuffle quality


def test_shuffle_mixes_shards_and_is_uncorrelated(wide_cache):
    """Every batch of 32 from 12 shards of 50 draws from most shards; the order ignores the index.

    Drawing b = 32 of N = 600 without replacement, a given shard of s = 50 is missed with
    probability C(N - s, b) / C(N, b) ≈ (1 - s/N)^b ≈ 0.06, so a batch touches about
    12 · 0.94 ≈ 11.3 distinct shards on average. A shuffle that only mixed inside a few shards
    would give 1–3. We require a mean of at least 9 and no batch below 6.
    """
    import datapipe

    cache = datapipe.open(wide_cache.path)
    n, batch = len(cache), 32
    shards = np.searchsorted(cache.starts, np.arange(n), side="right") - 1  # [N]: shard of each sample
    ds = datapipe.StreamingDataset(cache, batch_size=batch, shuffle=True, seed=0, return_index=True)
    for epoch in range(3):
        ds.set_epoch(epoch)
        distinct = [len(np.unique(shards[idx.numpy()])) for _, _, idx in ds]
        full = distinct[:-1]  # the last batch is short (600 = 18·32 + 24)
        assert np.mean(full) >= 9, distinct
        assert min(full) >= 6, distinct
        order, _ = ds.plan()
        # Rank correlation of position and index (both are permutations of 0..N-1: Pearson = Spearman).
        r = np.corrcoef(np.arange(n), order)[0, 1]
        assert abs(r) < 0.1, r
    ds_plain = datapipe.StreamingDataset(cache, batch_size=batch, shuffle=False, return_index=True)
    first = next(iter(ds_plain))[2].numpy()
    assert np.array_equal(first, np.arange(batch)), "without shuffle the stream is the cache's order"
