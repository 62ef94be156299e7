"""The shard-aware order ("shards"): property tests of the pure order, then through the loaders.

Exactly once over ranks × workers, every rank reads its own node's part (but for the final,
partial step), windows bounded in shards, a pure function of (seed, epoch, nodes, window, counts),
the same stream for any number of workers, resume by seek; and real ranks (gloo) reading it.
"""

from __future__ import annotations

import multiprocessing
import os
from datetime import timedelta

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loader_fixtures import B, concat, dataset, index_cache_info, same_stream, take
from test_distributed_loader import _read_epochs, _reporting, _run_ranks

import datapipe
from datapipe import partition as part
from datapipe.errors import ArgumentError, StateError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers, 2 cores
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@pytest.fixture(scope="session")
def index_cache(tmp_path_factory):
    """101 index-encoding samples of 32×32 in shards of 7 (built once per session)."""
    return index_cache_info(tmp_path_factory)


@st.composite
def layouts(draw):
    """Shard counts (zeros and unequal shards included) and a batch layout over nodes × ranks per node."""
    counts = draw(st.lists(st.integers(0, 23), min_size=0, max_size=14))
    return {
        "counts": np.array(counts, np.int64),
        "seed": draw(st.integers(0, 2**32 - 1)),
        "epoch": draw(st.integers(0, 2**32 - 1)),
        "nodes": draw(st.integers(1, 4)),
        "window": draw(st.integers(1, 5)),
        "batch_size": draw(st.integers(1, 6)),
        "local_world": draw(st.integers(1, 3)),
        "shuffle": draw(st.booleans()),
    }


def stream_args(lay: dict) -> dict:
    return {k: lay[k] for k in ("seed", "epoch", "nodes", "window", "shuffle")}


def shard_of(counts: np.ndarray) -> np.ndarray:
    """The shard of every sample: int64 [N]."""
    return np.repeat(np.arange(len(counts)), counts)


def rank_bounds(lay: dict, n: int, rank: int, drop_last: bool, start: int = 0) -> np.ndarray:
    return part.batch_bounds(n, batch_size=lay["batch_size"], world_size=lay["nodes"] * lay["local_world"], rank=rank,
                             drop_last=drop_last, start=start)


# ----------------------------------------------------------------------------- the pure order


@PROPS
@given(layouts())
def test_a_permutation_of_all_samples_for_any_layout(lay):
    n = int(lay["counts"].sum())
    order = part.shard_order(lay["counts"], **stream_args(lay), batch_size=lay["batch_size"], local_world=lay["local_world"])
    assert order.dtype == np.int64 and np.array_equal(np.sort(order), np.arange(n))
    streams = part.node_streams(lay["counts"], **stream_args(lay))
    sizes = [len(s.samples) for s in streams]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n, "equal parts"
    assert np.array_equal(np.sort(np.concatenate([s.samples for s in streams])), np.arange(n))


@PROPS
@given(layouts(), st.booleans())
def test_exactly_once_over_ranks_and_each_rank_reads_its_own_node(lay, drop_last):
    """Ranks are node-major: rank r is on node r // local_world; only the final partial step may cross nodes."""
    n = int(lay["counts"].sum())
    order = part.shard_order(lay["counts"], **stream_args(lay), batch_size=lay["batch_size"], local_world=lay["local_world"])
    node_sets = [set(s.samples.tolist()) for s in part.node_streams(lay["counts"], **stream_args(lay))]
    world = lay["nodes"] * lay["local_world"]
    step = world * lay["batch_size"]
    full_steps = n // step
    seen = []
    for rank in range(world):
        bounds = rank_bounds(lay, n, rank, drop_last)
        for j, (b, e) in enumerate(bounds):
            seen.append(order[b:e])
            if j < full_steps:
                assert set(order[b:e].tolist()) <= node_sets[rank // lay["local_world"]], (rank, j)
    seen_all = np.concatenate(seen) if seen else np.empty(0, np.int64)
    if drop_last:
        assert len(np.unique(seen_all)) == len(seen_all) == full_steps * step
    else:
        assert np.array_equal(np.sort(seen_all), np.arange(n))


@PROPS
@given(layouts())
def test_windows_are_bounded_in_shards(lay):
    """A window draws from at most ``window`` shards, and each shard a node reads lies in one window, so a
    node holds one window of shards at a time, two while a step's chunk straddles a boundary."""
    shards = shard_of(lay["counts"])
    for s in part.node_streams(lay["counts"], **stream_args(lay)):
        w = s.windows
        assert w[0] == 0 and w[-1] == len(s.samples) and (np.diff(w) > 0).all()
        window_of = np.repeat(np.arange(len(w) - 1), np.diff(w))  # [n_k]
        for i in range(len(w) - 1):
            assert len(np.unique(shards[s.samples[w[i]:w[i + 1]]])) <= lay["window"]
        for shard in np.unique(shards[s.samples]):
            assert len(np.unique(window_of[shards[s.samples] == shard])) == 1, "a shard split over windows"


@PROPS
@given(layouts())
def test_pure_in_its_arguments_and_streams_independent_of_the_batch_layout(lay):
    args = stream_args(lay)
    a = part.shard_order(lay["counts"], **args, batch_size=lay["batch_size"], local_world=lay["local_world"])
    b = part.shard_order(list(lay["counts"]), **args, batch_size=lay["batch_size"], local_world=lay["local_world"])
    assert np.array_equal(a, b)
    # What a node reads does not depend on batch size or ranks per node: a step boundary is the same
    # set of samples read for any batch layout with these nodes (so a state resumes across them).
    n = int(lay["counts"].sum())
    other = part.shard_order(lay["counts"], **args, batch_size=lay["batch_size"] + 1, local_world=lay["local_world"] + 1)
    g1 = lay["nodes"] * lay["local_world"] * lay["batch_size"]
    g2 = lay["nodes"] * (lay["local_world"] + 1) * (lay["batch_size"] + 1)
    p = int(np.lcm(g1, g2))
    if p <= n:
        assert set(a[:p].tolist()) == set(other[:p].tolist())


def test_epochs_and_seeds_give_distinct_orders_and_shuffle_false_is_the_cache_order():
    counts = [50, 50, 49, 51, 50, 50, 50, 50]
    kw = {"nodes": 2, "window": 3, "batch_size": 4, "local_world": 2}
    orders = {part.shard_order(counts, seed=s, epoch=e, **kw).tobytes() for s in range(3) for e in range(5)}
    assert len(orders) == 15
    plain = part.node_streams(counts, seed=1, epoch=1, nodes=2, window=3, shuffle=False)
    assert np.array_equal(np.concatenate([s.samples for s in plain]), np.arange(sum(counts)))
    # and the shard order itself changes across epochs (not just the samples within windows)
    firsts = {int(part.node_streams(counts, seed=0, epoch=e, nodes=1, window=1)[0].samples[0]) // 50 for e in range(12)}
    assert len(firsts) > 2


def test_the_global_permutation_is_unchanged():
    """The shard-aware order draws from its own streams; the global order is what it was."""
    expected = np.random.Generator(np.random.PCG64([3, 1, 0x5D1A])).permutation(40)
    assert np.array_equal(part.epoch_order(40, seed=3, epoch=1, shuffle=True), expected)


def test_bad_arguments_are_named():
    for kwargs, name in (({"nodes": 0}, "nodes"), ({"window": 0}, "window"), ({"batch_size": 0}, "batch_size"),
                         ({"local_world": 0}, "local_world")):
        args = {"seed": 0, "epoch": 0, "nodes": 1, "window": 1, "batch_size": 1, "local_world": 1} | kwargs
        with pytest.raises(ValueError, match=name):
            part.shard_order([3, 4], **args)
    with pytest.raises(ValueError, match="counts"):
        part.node_streams([3, -1], seed=0, epoch=0, nodes=1, window=1)


def test_order_quality_measures_entropy_and_distinct_shards():
    labels = np.array([0, 0, 1, 1, 2, 3, 4, 5, 6, 6, 6, 6, 7])
    shards = np.arange(13) // 3
    q = part.order_quality(np.arange(13), labels, shards, 4)  # three full batches; the 13th sample is left out
    assert q.batches == 3
    assert q.entropy_bits == pytest.approx((1 + 2 + 0) / 3)
    assert q.distinct_shards == pytest.approx((2 + 2 + 2) / 3)
    short = part.order_quality(np.arange(3), labels, shards, 8)  # no full batch: the one partial batch counts
    assert short.batches == 1 and short.distinct_shards == 1.0
    assert short.entropy_bits == pytest.approx(-(2 / 3) * np.log2(2 / 3) - (1 / 3) * np.log2(1 / 3))
    assert part.order_quality(np.empty(0, np.int64), labels, shards, 4) == (0.0, 0.0, 0)


def test_the_shard_order_mixes_less_than_the_global_one_on_a_class_sorted_layout():
    """Class-sorted shards of one class each: a window of w shards gives batches of at most w classes."""
    counts = np.full(200, 40)
    labels = np.repeat(np.arange(200), 40)
    shards = shard_of(counts)
    glob = part.order_quality(part.epoch_order(8000, seed=0, epoch=0, shuffle=True), labels, shards, 64)
    local = part.order_quality(part.shard_order(counts, seed=0, epoch=0, nodes=1, window=4, batch_size=64,
                                                local_world=1), labels, shards, 64)
    assert local.distinct_shards <= 8 and glob.distinct_shards > 50
    assert local.entropy_bits < glob.entropy_bits <= 6


def test_defaults():
    assert part.default_order(False) == "global" and part.default_order(True) == "shards"
    assert part.ORDERS == ("global", "shards")


# ----------------------------------------------------------------------------- through the dataset


def test_the_dataset_default_is_global_and_arguments_are_checked(index_cache, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    ds = dataset(index_cache)
    assert ds.order == "global" and "order" not in ds.state_dict()
    assert dataset(index_cache, order="shards").nodes == 1
    for kwargs, name in (({"order": "random"}, "order"), ({"order": "shards", "window": 0}, "window"),
                         ({"order": "shards", "nodes": 0}, "nodes"), ({"order": "shards", "window": 2.0}, "window"),
                         ({"order": "shards", "nodes": 3, "world_size": 4, "rank": 0}, "multiple of nodes")):
        with pytest.raises(ArgumentError, match=name):
            dataset(index_cache, **kwargs)


def test_nodes_come_from_torchruns_environment(index_cache, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert dataset(index_cache, order="shards", rank=5, world_size=8).nodes == 4
    assert dataset(index_cache, order="global", rank=5, world_size=6).nodes == 1  # the global order ignores it
    with pytest.raises(ArgumentError, match="LOCAL_WORLD_SIZE=2"):
        dataset(index_cache, order="shards", rank=0, world_size=3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ArgumentError, match="LOCAL_WORLD_SIZE"):
        dataset(index_cache, order="shards")
    assert dataset(index_cache, order="shards", nodes=1).nodes == 1  # an explicit value wins


def test_an_evaluation_dataset_on_one_rank_of_a_launched_job_is_one_node(index_cache, monkeypatch):
    """Under `torchrun --nproc_per_node 2` (WORLD_SIZE=2, LOCAL_WORLD_SIZE=2), an evaluation set read on rank 0
    alone (rank=0, world_size=1) was refused as "world_size=1 is not a multiple of LOCAL_WORLD_SIZE=2" in the
    shards order (the default for a cache in object storage). The launched world keeps its nodes."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert dataset(index_cache, order="shards", rank=0, world_size=1).nodes == 1
    assert dataset(index_cache, order="shards").nodes == 2  # the launched world: 2 nodes of 2 ranks
    assert dataset(index_cache, order="shards", rank=3, world_size=4).nodes == 2
    assert dataset(index_cache, order="shards", rank=0, world_size=3).nodes == 1  # not the launched world: 1 node


def test_every_sample_once_over_simulated_nodes_and_ranks(index_cache):
    """2 nodes × 2 ranks (node-major), read through the dataset: exactly once, each rank in its node's part."""
    n, world = index_cache.n, 4
    node_sets = [set(s.samples.tolist()) for s in
                 part.node_streams(datapipe.open(index_cache.path).counts, seed=3, epoch=2, nodes=2, window=2)]
    seen = []
    for rank in range(world):
        ds = dataset(index_cache, order="shards", window=2, nodes=2, rank=rank, world_size=world)
        ds.set_epoch(2)
        batches = [idx.numpy() for _, _, idx in ds]
        assert len(batches) == len(ds) == -(-n // (world * B))
        for j, idx in enumerate(batches[:-1]):
            assert set(idx.tolist()) <= node_sets[rank // 2], (rank, j)
        seen.extend(batches)
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(n))


@pytest.mark.parametrize("workers", [1, 3])
def test_the_stream_is_the_same_for_any_number_of_dataloader_workers(index_cache, workers):
    ds = dataset(index_cache, order="shards", window=3)
    ds.set_epoch(1)
    reference = take(ds, 0)
    assert same_stream(take(ds, workers), reference)
    assert np.array_equal(np.sort(concat(reference, 2)), np.arange(index_cache.n))


def test_the_device_loader_reads_the_same_batches_with_any_number_of_readers(index_cache):
    runs = []
    for readers in (1, 2):
        ds = dataset(index_cache, order="shards", window=2)
        loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=readers)
        try:
            loader.set_epoch(4)
            runs.append([tuple(sorted(idx.tolist())) for _, _, idx in loader])
        finally:
            loader.close()
    assert runs[0] == runs[1]
    plain = dataset(index_cache, order="shards", window=2)
    plain.set_epoch(4)
    assert runs[0] == [tuple(sorted(idx.tolist())) for _, _, idx in plain]


@pytest.mark.parametrize("k", [0, 1, 5, 13])
def test_resume_mid_epoch_yields_exactly_the_remaining_batches(index_cache, k):
    ds = dataset(index_cache, order="shards", window=2)
    ds.set_epoch(3)
    whole = take(ds, 0)
    ds = dataset(index_cache, order="shards", window=2)
    ds.set_epoch(3)
    assert len(take(ds, 0, k)) == k  # the loop takes k batches
    state = ds.state_dict()
    assert (state["order"], state["window"], state["nodes"]) == ("shards", 2, 1)
    resumed = dataset(index_cache, order="shards", window=2)
    resumed.load_state_dict(state)
    assert same_stream(take(resumed, 2), whole[k:])


def test_resume_with_another_batch_layout_reads_the_rest_once(index_cache):
    """A step boundary of 4 ranks × 4 on 2 nodes is one of 2 ranks × 8 too: the rest, exactly once."""
    n = index_cache.n
    first = []
    for rank in range(4):
        ds = dataset(index_cache, order="shards", window=2, nodes=2, rank=rank, world_size=4, batch_size=4)
        ds.set_epoch(1)
        first.extend(idx.numpy() for _, (_, _, idx) in zip(range(3), ds, strict=False))
        state = ds.state_dict(batches_consumed=3)
    assert state["position"] == 48
    rest = []
    for rank in range(2):
        ds = dataset(index_cache, order="shards", window=2, nodes=2, rank=rank, world_size=2, batch_size=8)
        ds.load_state_dict(state)
        rest.extend(idx.numpy() for _, _, idx in ds)
    assert np.array_equal(np.sort(np.concatenate(first + rest)), np.arange(n))


STATE_MISMATCHES = {
    "a global state into shards": ({}, {"order": "shards"}, "order='global'"),
    "a shards state into global": ({"order": "shards"}, {}, "order='shards'"),
    "another window": ({"order": "shards", "window": 2}, {"order": "shards", "window": 3}, "window=2"),
    "other nodes": ({"order": "shards", "nodes": 1}, {"order": "shards", "nodes": 2, "rank": 0, "world_size": 2},
                    "nodes=1"),
}


@pytest.mark.parametrize("name", list(STATE_MISMATCHES))
def test_a_state_of_another_order_window_or_nodes_is_refused(index_cache, name):
    saved_kw, load_kw, match = STATE_MISMATCHES[name]
    ds = dataset(index_cache, **saved_kw)
    ds.set_epoch(1)
    list(zip(range(1), iter(ds), strict=False))
    state = ds.state_dict()
    with pytest.raises(StateError, match=match) as excinfo:
        dataset(index_cache, **load_kw).load_state_dict(state)
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize("bad", [{"order": "global"}, {"order": 1}, {"window": 0}, {"window": "2"}, {"nodes": True},
                                 {"nodes": 0}])
def test_malformed_order_fields_are_refused(index_cache, bad):
    ds = dataset(index_cache, order="shards", window=2)
    state = ds.state_dict() | bad
    with pytest.raises(StateError):
        dataset(index_cache, order="shards", window=2).load_state_dict(state)
    partial = {k: v for k, v in ds.state_dict().items() if k != "nodes"}
    with pytest.raises(StateError, match="lacks nodes"):
        ds.load_state_dict(partial)


# ----------------------------------------------------------------------------- real ranks


@_reporting
def _rank_main(rank: int, port: int, cache: str, out: str) -> dict:
    """One rank of 2 nodes × 1 (LOCAL_WORLD_SIZE=1), 2 DataLoader workers, two epochs."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE="1")
    multiprocessing.set_start_method("fork", force=True)
    import torch
    import torch.distributed as dist

    from datapipe.testing import index_map

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    ids = index_map(cache)
    ds = datapipe.StreamingDataset(cache, batch_size=B, seed=5, return_index=True, order="shards", window=2)
    result: dict = {"nodes": ds.nodes, "epochs": _read_epochs(ds, ids)}
    return result


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_gloo_ranks_on_two_nodes_read_each_sample_once_from_their_own_part(index_cache, tmp_path):
    n = index_cache.n
    results = _run_ranks(index_cache.path, tmp_path, target=_rank_main)
    assert [r["nodes"] for r in results] == [2, 2]
    counts = datapipe.open(index_cache.path).counts
    for epoch in range(2):
        streams = part.node_streams(counts, seed=5, epoch=epoch, nodes=2, window=2)
        per_rank = [r["epochs"][epoch] for r in results]
        assert [len(b) for b in per_rank] == [-(-n // (2 * B))] * 2
        seen = np.concatenate([np.concatenate(b) for b in per_rank])
        assert np.array_equal(np.sort(seen), np.arange(n)), f"epoch {epoch}: not exactly once"
        for rank, batches in enumerate(per_rank):
            assert set(np.concatenate(batches[:-1]).tolist()) <= set(streams[rank].samples.tolist())
    assert results[0]["epochs"][0] != results[0]["epochs"][1]
