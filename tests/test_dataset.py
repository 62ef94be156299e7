"""StreamingDataset on the CPU, checked sample by sample with index-encoding images.

Requirements 1–6 and 8–12 (exactly once, equal counts, exact lengths, automatic rank detection,
deterministic order, resume) and 15 (damaged shards named); DataLoader workers check shared memory.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from loader_fixtures import B, check_batches, concat, dataset, index_cache_info, same_stream, take
from torch.utils.data import DataLoader

import datapipe
from datapipe.errors import ArgumentError, CacheError, CorruptShardError, StateError

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers, 2 cores


@pytest.fixture(scope="session")
def index_cache(tmp_path_factory):
    """101 index-encoding samples of 32×32 in shards of 7 (built once per session)."""
    return index_cache_info(tmp_path_factory)


# ----------------------------------------------------------------------------- exactly once, order


@pytest.fixture(scope="module")
def reference(index_cache):
    """The main-process stream of epoch 0 (seed 3, batch 8)."""
    return take(dataset(index_cache), 0)


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_exactly_once_and_same_stream_for_any_workers(index_cache, reference, workers):
    ds = dataset(index_cache)
    batches = take(ds, workers)
    assert len(batches) == len(ds) == -(-index_cache.n // B)
    idx = check_batches(index_cache, batches)
    assert np.array_equal(np.sort(idx), np.arange(index_cache.n))
    assert same_stream(batches, reference)
    sizes = [len(b[1]) for b in batches]
    assert sizes[:-1] == [B] * (len(sizes) - 1), "no per-worker partial batches"


@pytest.mark.lifecycle
def test_the_dataset_pickles_small_and_reads_in_spawned_workers(index_cache, tmp_path_factory, reference):
    """What a DataLoader sends each worker does not grow with the dataset (no per-sample Python
    objects, no open maps), and workers started with spawn (macOS, Windows, CUDA users) read the
    same stream as the main process."""
    import pickle

    small = dataset(index_cache)
    big = datapipe.StreamingDataset(index_cache_info(tmp_path_factory, 3000, shard_size=500, size=8).path,
                                    batch_size=B, seed=3)
    for ds in (small, big):
        next(iter(ds))  # opened: the shard maps exist in this process
    assert len(pickle.dumps(big)) < len(pickle.dumps(small)) + 512 < 8192
    it = iter(DataLoader(dataset(index_cache), batch_size=None, num_workers=2, multiprocessing_context="spawn"))
    assert same_stream(list(it), reference)


def test_epochs_differ_and_repeat(index_cache, reference):
    ds = dataset(index_cache)
    ds.set_epoch(1)
    one = take(ds, 2)
    assert not same_stream(one, reference)
    assert np.array_equal(np.sort(concat(one, 2)), np.arange(index_cache.n))
    ds.set_epoch(0)
    assert same_stream(take(ds, 0), reference)


REPEAT = "epoch 0 was read to its end and begins again in the same shuffled order; call set_epoch"

# Training loops over a dataset ``ds`` (shuffled unless the case says "no shuffle"), each through
# ``loader`` (the dataset itself, a DeviceLoader or a DataLoader with two workers): what they must warn of.
LOOPS = {
    "no set_epoch": ("for e in range(3):\n    assert sum(1 for _ in loader) == full\n", 1),
    "set_epoch each epoch": ("for e in range(3):\n    ds.set_epoch(e)\n    assert sum(1 for _ in loader) == full\n", 0),
    "set_epoch(0) each epoch": ("for e in range(2):\n    ds.set_epoch(0)\n    assert sum(1 for _ in loader) == full\n", 0),
    "no shuffle": ("for e in range(2):\n    assert sum(1 for _ in loader) == full\n", 0),
    # epochs cut short (steps per epoch) are not read to their end
    "a break": ("for e in range(3):\n    assert len(list(itertools.islice(iter(loader), 2))) == 2\n", 0),
    "a peek": ("next(iter(ds))\nfor e in range(2):\n    ds.set_epoch(e)\n    assert sum(1 for _ in loader) == full\n", 0),
    "a resume": ("saved = ds.state_dict(batches_consumed=0)\nassert sum(1 for _ in loader) == full\n"
                 "ds.load_state_dict(saved)\nassert sum(1 for _ in loader) == full\n", 0),
}


def loop_script(path, how: str, case: str) -> str:
    make = {"dataset": "ds",
            "device": "datapipe.DeviceLoader(ds, device='cpu', num_workers=1, output='uint8')",
            "workers": "torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)",
            "workers-persistent": "torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)"}
    return ("import itertools, datapipe, torch\n"
            f"ds = datapipe.StreamingDataset({str(path)!r}, batch_size={B}, seed=3, shuffle={case != 'no shuffle'})\n"
            f"loader = {make[how]}\nfull = len(ds)\n" + LOOPS[case][0])


@pytest.mark.parametrize("how", ["dataset", "device", "workers", "workers-persistent"])
@pytest.mark.parametrize("case", list(LOOPS))
def test_a_shuffled_epoch_begun_again_without_set_epoch_is_warned_once(index_cache, how, case):
    """A loop that never calls set_epoch trains on epoch 0's order every time (LitData and MosaicML
    Streaming move to the next epoch by themselves; a DistributedSampler user forgets it): one
    RepeatedEpochWarning says so, from the main process or from DataLoader worker 0. A repeat asked for
    (set_epoch to the same epoch, a resume), an unshuffled set, epochs cut short and a peek are not warned of.
    Each loop runs as a script of its own, where nothing records warnings (pytest's recorder, copied into a
    forked worker, would keep a worker's warning there)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", loop_script(index_cache.path, how, case)], capture_output=True,
                         text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    seen = [line for line in run.stderr.splitlines() if "RepeatedEpochWarning" in line]
    assert len(seen) == LOOPS[case][1], run.stderr
    assert all(REPEAT in line for line in seen), seen


@pytest.mark.parametrize("drop_last", [False, True])
def test_simulated_ranks_split_exactly(index_cache, drop_last):
    ranks, n = 3, index_cache.n  # 101 = 4·24 + 5
    streams = [take(dataset(index_cache, rank=r, world_size=ranks, drop_last=drop_last), 0) for r in range(ranks)]
    expected = n // (ranks * B) if drop_last else -(-n // (ranks * B))
    for r, stream in enumerate(streams):
        assert len(stream) == len(dataset(index_cache, rank=r, world_size=ranks, drop_last=drop_last)) == expected
        check_batches(index_cache, stream)
    seen = np.concatenate([concat(s, 2) for s in streams])
    if drop_last:
        assert len(seen) == n - n % (ranks * B) and len(np.unique(seen)) == len(seen)
    else:
        assert np.array_equal(np.sort(seen), np.arange(n))
    # A rank read through DataLoader workers yields the same stream as in the main process.
    assert same_stream(take(dataset(index_cache, rank=2, world_size=ranks, drop_last=drop_last), 2), streams[2])


def test_rank_and_world_size_from_environment(index_cache, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ds = dataset(index_cache)
    assert (ds.rank, ds.world_size) == (0, 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    ds = dataset(index_cache)
    assert (ds.rank, ds.world_size) == (1, 3)
    assert len(ds) == len(dataset(index_cache, rank=1, world_size=3))
    assert same_stream(take(ds, 0), take(dataset(index_cache, rank=1, world_size=3), 0))
    assert dataset(index_cache, rank=2).rank == 2  # one argument overrides, the other is detected
    with pytest.raises(ValueError, match="rank"):
        dataset(index_cache, rank=3)
    monkeypatch.delenv("RANK")  # WORLD_SIZE alone: every process was rank 0, reading the same part
    with pytest.raises(ArgumentError, match="WORLD_SIZE=3 is set but no rank .*: every process would read rank 0's"):
        dataset(index_cache)
    assert dataset(index_cache, rank=2).world_size == 3
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert (dataset(index_cache).rank, dataset(index_cache).world_size) == (0, 1)


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize(("k", "workers_before", "workers_after"),
                         [(0, 2, 0), (1, 3, 0), (2, 3, 1), (5, 0, 2), (13, 2, 3)])
def test_resume_into_a_fresh_dataset(index_cache, reference, k, workers_before, workers_after):
    """k=0, k < W, mid-epoch and k = the last batch; the number of workers changes on resume."""
    ds = dataset(index_cache)
    before = take(ds, workers_before, k)
    state = ds.state_dict() if workers_before == 0 else ds.state_dict(batches_consumed=k)
    assert state["position"] == min(k * B, index_cache.n)
    assert len(json.dumps(state)) < 1024
    fresh = dataset(index_cache)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    after = take(fresh, workers_after)
    assert len(after) == len(ds) - k
    assert same_stream(before + after, reference)


def test_two_resumes_in_one_epoch(index_cache, reference):
    first = dataset(index_cache)
    part1 = take(first, 0, 2)
    second = dataset(index_cache)
    second.load_state_dict(first.state_dict())
    part2 = take(second, 2, 3)
    third = dataset(index_cache)
    third.load_state_dict(second.state_dict(batches_consumed=5))  # the epoch's batches: 2 before the resume + 3
    assert third.start == 5 * B
    part3 = take(third, 3)
    assert same_stream(part1 + part2 + part3, reference)


def test_resume_in_a_later_epoch(index_cache):
    ds = dataset(index_cache)
    ds.set_epoch(4)
    full = take(ds, 0)
    part1 = take(ds, 0, 6)
    state = ds.state_dict()
    assert state["epoch"] == 4
    fresh = dataset(index_cache)
    fresh.load_state_dict(state)
    assert fresh.epoch == 4
    assert same_stream(part1 + take(fresh, 0), full)


def test_the_resumed_position_is_used_once(index_cache, reference):
    ds = dataset(index_cache)
    ds.load_state_dict({**dataset(index_cache).state_dict(), "position": 4 * B})
    assert len(ds) == len(reference)  # a whole epoch's batches, also resumed
    assert len(take(ds, 0)) == len(reference) - 4
    assert len(ds) == len(reference)
    assert same_stream(take(ds, 0), reference), "the next iteration of the epoch is whole again"


def test_state_after_resume_and_next_epoch_with_workers(index_cache):
    ds = dataset(index_cache)
    ds.load_state_dict({**ds.state_dict(), "position": 3 * B})
    take(ds, 2)  # the rest of epoch 0, read by workers
    ds.set_epoch(1)
    take(ds, 2, 2)
    assert ds.state_dict(batches_consumed=2)["position"] == 2 * B


@pytest.mark.parametrize("workers", [0, 2])
def test_the_state_through_a_dataloader_follows_epochs_breaks_passes_and_resumes(index_cache, workers):
    """The dataset's own count (num_workers=0) or the loop's (workers: batches_consumed) after every transition."""
    ds = dataset(index_cache)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)

    def where(k: int | None = None) -> tuple[int, int]:
        state = ds.state_dict() if k is None or workers == 0 else ds.state_dict(batches_consumed=k)
        return state["epoch"], state["position"]

    assert where() == (0, 0)
    assert len(list(loader)) == len(ds)
    assert where(len(ds)) == (0, index_cache.n)
    ds.set_epoch(1)
    assert where() == (1, 0), "a new epoch, nothing of it read"
    for k, _ in enumerate(loader, 1):
        if k == 3:
            break
    assert where(3) == (1, 3 * B)
    ds.set_epoch(2)
    assert where() == (2, 0), "after an epoch ended by break"
    ds.load_state_dict({**ds.state_dict(), "position": 5 * B})
    ds.set_epoch(2)
    assert where() == (2, 5 * B)
    it = iter(loader)
    next(it)
    assert where(6) == (2, 6 * B), "the epoch's batches from its start: 5 before the resume, 1 since"
    del it
    ds.set_epoch(3)
    assert where() == (3, 0), "after a resumed epoch"
    if workers == 0:
        list(loader)
        it = iter(loader)  # a new pass over the same epoch begins at iter(), not at its first batch
        assert where() == (3, 0)
        next(it)
        assert where() == (3, B)


def test_an_earlier_iterator_that_goes_on_makes_the_state_ask_for_the_count(index_cache):
    """Two iterations of one epoch in the main process (a peek with next(iter(...)) inside the loop):
    the state cannot tell which one the loop follows, so it asks instead of guessing."""
    ds = dataset(index_cache)
    outer = iter(DataLoader(ds, batch_size=None))
    next(outer)
    next(outer)
    next(iter(DataLoader(ds, batch_size=None)))  # the peek: the newest iteration, one batch received
    assert ds.state_dict()["position"] == B
    next(outer)
    with pytest.raises(StateError, match="batches_consumed"):
        ds.state_dict()
    assert ds.state_dict(batches_consumed=3)["position"] == 3 * B
    ds.set_epoch(1)
    assert ds.state_dict()["position"] == 0


def test_state_after_worker_reads_needs_the_consumed_count(index_cache):
    """Workers cannot report how many batches the loop took: state_dict() without it is refused,
    never a silent position 0; with it, the state resumes the same stream."""
    ds = dataset(index_cache)
    assert ds.state_dict()["position"] == 0  # nothing read yet
    first = take(ds, 2, 2)
    with pytest.raises(StateError, match="batches_consumed"):
        ds.state_dict()
    state = ds.state_dict(batches_consumed=2)
    assert state["position"] == 2 * B
    fresh = dataset(index_cache)
    fresh.load_state_dict(state)
    rest = take(fresh, 0)
    assert same_stream(first + rest, take(dataset(index_cache), 0))
    ds.set_epoch(1)  # a new epoch, not read yet: the default is right again
    assert ds.state_dict()["position"] == 0 and ds.state_dict()["epoch"] == 1
    take(ds, 0, 1)  # read in this process: counted here
    assert ds.state_dict()["position"] == B


def test_the_resumed_position_holds_until_the_epoch_changes_with_workers(index_cache):
    """Documented: worker processes cannot report that they used the resumed position, so it holds
    for the resumed epoch and a new epoch is whole."""
    ds = dataset(index_cache)
    ds.load_state_dict({**ds.state_dict(), "position": 4 * B})
    whole = -(-index_cache.n // B)
    assert len(take(ds, 2)) == whole - 4 and len(ds) == whole
    assert len(take(ds, 2)) == whole - 4 and len(ds) == whole
    ds.set_epoch(1)
    assert len(take(ds, 2)) == len(ds) == whole


def test_batches_consumed_counts_the_epoch_from_its_start_across_resumes(index_cache, reference):
    """Your own DataLoader with workers, checkpointed twice in one epoch: k is the epoch's batches the
    loop has received, those before a resume included; a k short of the resumed position is refused."""
    first = dataset(index_cache)
    part1 = take(first, 2, 5)
    second = dataset(index_cache)
    second.load_state_dict(first.state_dict(batches_consumed=5))
    part2 = take(second, 2, 3)
    with pytest.raises(StateError, match="from the epoch's start") as excinfo:
        second.state_dict(batches_consumed=3)  # the batches since the resume only
    assert "\n" not in str(excinfo.value) and "pass 5 + the batches" in str(excinfo.value)
    third = dataset(index_cache)
    third.load_state_dict(second.state_dict(batches_consumed=8))
    assert third.start == 8 * B
    part3 = take(third, 2)
    assert same_stream(part1 + part2 + part3, reference)


def test_the_counted_batches_include_those_before_the_resume(index_cache):
    """Read in this process, the dataset's own count has the same meaning as batches_consumed."""
    ds = dataset(index_cache)
    ds.load_state_dict({**ds.state_dict(), "position": 4 * B})
    take(ds, 0, 3)
    assert ds.batches_consumed == 7
    assert ds.state_dict() == ds.state_dict(batches_consumed=7)
    assert ds.state_dict()["position"] == 7 * B


@pytest.mark.parametrize("how", ["dataset", "dataloader-0", "dataloader-2", "device-0", "device-2"])
@pytest.mark.parametrize("rank", [0, 2])
def test_len_is_a_whole_epoch_after_a_resume(index_cache, how, rank):
    """After load_state_dict len() is still the whole epoch's batches, before, during and after the resumed
    iteration, on every rank, which yields the rest: Lightning (and torchdata) take len() as the epoch's and
    go on counting from the resumed batch; the rest would end the resumed epoch and every later one early."""
    world = 3
    ds = dataset(index_cache, rank=rank, world_size=world)
    whole = -(-index_cache.n // (B * world))
    ds.load_state_dict({**ds.state_dict(), "position": 2 * B * world})
    if how.startswith("device"):
        loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=int(how[-1]), output="uint8")
    elif how.startswith("dataloader"):
        loader = DataLoader(ds, batch_size=None, num_workers=int(how[-1]))
    else:
        loader = ds
    try:
        assert len(loader) == len(ds) == whole
        lengths = [len(loader) for _ in loader]
        assert lengths == [whole] * (whole - 2)
        assert len(loader) == whole
        ds.set_epoch(1)
        assert len(loader) == whole == sum(1 for _ in loader)
    finally:
        if isinstance(loader, datapipe.DeviceLoader):
            loader.close()


def test_elastic_resume_with_another_world_size(index_cache):
    """R=2, B=8 for two steps, then R=4, B=4: the same global steps (32 samples in, 16 per step)."""
    n = index_cache.n

    def global_steps(ranks, batch, state=None):
        streams = []
        for r in range(ranks):
            ds = dataset(index_cache, rank=r, world_size=ranks, batch_size=batch)
            if state is not None:
                ds.load_state_dict(state)
            streams.append([b[2].numpy() for b in take(ds, 0)])
        assert len({len(s) for s in streams}) == 1, "equal batch counts on every rank"
        return [np.sort(np.concatenate(step)) for step in zip(*streams, strict=True)]  # samples of each global step

    uninterrupted = global_steps(2, 8)
    ds = dataset(index_cache, rank=1, world_size=2)
    take(ds, 0, 2)
    state = ds.state_dict()
    assert state["position"] == 32
    resumed = global_steps(4, 4, state)
    assert len(resumed) == len(uninterrupted) - 2
    for a, b in zip(uninterrupted[2:], resumed, strict=True):
        assert np.array_equal(a, b)
    head = np.concatenate(uninterrupted[:2])
    assert np.array_equal(np.sort(np.concatenate([head, *resumed])), np.arange(n))


def test_refused_states(index_cache):
    ds = dataset(index_cache)
    take(ds, 0, 1)
    state = ds.state_dict()  # position 8
    with pytest.raises(StateError, match="not a multiple of 6"):
        dataset(index_cache, batch_size=3, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(StateError, match="version 999"):
        dataset(index_cache).load_state_dict({**state, "version": 999})
    with pytest.raises(StateError, match="version"):
        dataset(index_cache).load_state_dict({"position": 0})
    with pytest.raises(StateError, match="seed"):
        dataset(index_cache, seed=4).load_state_dict(state)
    assert issubclass(StateError, ValueError)


def test_resume_seeks_without_reading_skipped_samples(index_cache, monkeypatch):
    ds = dataset(index_cache)
    take(ds, 0, 9)
    fresh = dataset(index_cache)
    fresh.load_state_dict(ds.state_dict())
    reads: list[int] = []
    original = fresh.cache.read_batch

    def counting(indices, *args, **kwargs):
        reads.append(len(indices))
        return original(indices, *args, **kwargs)

    monkeypatch.setattr(fresh.cache, "read_batch", counting)
    rest = take(fresh, 0)
    assert sum(reads) == index_cache.n - 9 * B == sum(len(b[1]) for b in rest)
    assert len(reads) == len(rest) == len(fresh) - 9


# ----------------------------------------------------------------------------- damaged caches


def test_truncated_shard_is_named_at_construction(index_cache, tmp_path):
    copy = shutil.copytree(index_cache.path, tmp_path / "cache")
    data = copy / "shards" / "000003.zarr" / "images" / "c" / "0" / "0" / "0" / "0"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 100)
    with pytest.raises(CorruptShardError, match="000003.zarr"):
        datapipe.StreamingDataset(copy, batch_size=B)


def test_unknown_manifest_version_is_refused(index_cache, tmp_path):
    copy = shutil.copytree(index_cache.path, tmp_path / "cache")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "version": 999}))
    with pytest.raises(CacheError, match="999"):
        datapipe.StreamingDataset(copy, batch_size=B)


# ----------------------------------------------------------------------------- augment units


def test_small_shared_memory_fails_fast_naming_the_fix(tmp_path):
    """Docker's 64 MB /dev/shm cannot hold the batches in flight: a clear error, not a bus error."""
    from types import SimpleNamespace

    from datapipe.dataset import _check_shm
    from datapipe.errors import DatapipeError

    small = tmp_path / "shm"
    small.mkdir()
    with pytest.raises(DatapipeError, match="--shm-size"):
        _check_shm(2**62, SimpleNamespace(num_workers=2), str(small))  # more than any disk holds
    _check_shm(1024, SimpleNamespace(num_workers=2), str(small))  # a small batch fits
    free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
    with pytest.raises(DatapipeError, match="--shm-size"):  # 2 workers' two batches each, and the loop's two
        _check_shm(free // 5, SimpleNamespace(num_workers=2), str(small))


def test_shared_memory_running_out_after_the_check_is_the_same_clear_error(index_cache, monkeypatch):
    """More batches in flight than the check foresees (prefetch_factor=8, another process's use): /dev/shm ran
    out in the middle of the epoch with torch's RuntimeError and a traceback; it is the --shm-size error."""
    import torch

    from datapipe.errors import DatapipeError

    real = torch.Tensor.share_memory_
    count = {"n": 0}

    def share_memory_(self):  # torch's own failure, as a full /dev/shm gives it, from the fourth batch on
        count["n"] += 1
        if count["n"] > 9:
            raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1_2>: No space left on device (28)")
        return real(self)

    monkeypatch.setattr(torch.Tensor, "share_memory_", share_memory_)  # inherited by the forked worker
    loader = DataLoader(dataset(index_cache), batch_size=None, num_workers=1, multiprocessing_context="fork",
                        prefetch_factor=8)
    with pytest.raises(DatapipeError, match=r"/dev/shm ran out of shared memory for the batches in flight "
                                            r"\(24.0 KB each\): unable to allocate.*--shm-size"):
        for _ in loader:
            pass


def test_the_shared_memory_check_counts_the_batches_a_worker_yields_not_the_batch_size(index_cache):
    """batch_size=10**9 (an evaluation set in one batch) over a few small samples was refused by DataLoader workers
    as needing terabytes of /dev/shm: the check multiplied batch_size, not the batch each worker yields."""
    ds = dataset(index_cache, batch_size=10**9, shuffle=False)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
    assert [len(b[1]) for b in batches] == [len(ds.cache)]  # one batch of every sample, from one worker


def test_dataloader_workers_check_shared_memory_before_reading(index_cache, monkeypatch):
    """The check runs in every DataLoader worker: with /dev/shm as small as Docker's default (64 MB)
    and batches too large for it (here: 1 MB free, batches of 0.3 MB, 6 in flight with 2 workers), the first batch
    fails with the fix named."""
    from types import SimpleNamespace

    import datapipe.dataset as dataset_module
    from datapipe.errors import DatapipeError

    seen = []

    def statvfs(path):
        seen.append(path)
        return SimpleNamespace(f_bavail=2**20 // 4096, f_frsize=4096)

    # inherited by forked workers
    monkeypatch.setattr(dataset_module, "os", SimpleNamespace(statvfs=statvfs, environ=os.environ, getpid=os.getpid))
    ds = dataset(index_cache, batch_size=8192)  # every sample in one batch: 101 of 32x32 (the largest a worker yields)
    with pytest.raises(DatapipeError, match=r"/dev/shm has 1.00 MB free, but DataLoader workers need about 1.78 MB "
                                            r"of shared memory for the batches in flight \(303 KB each\).*--shm-size"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")))
    assert next(iter(DataLoader(dataset(index_cache), batch_size=None, num_workers=2,
                                multiprocessing_context="fork")))[0].shape[0] == B  # small batches fit


def test_the_dataset_and_its_loader_give_the_class_names_of_its_labels(index_cache):
    """A user checks a validation set's classes against its training set's, or names a prediction, from the
    dataset they train on: label i is classes[i], as the cache's manifest lists them."""
    ds = datapipe.StreamingDataset(index_cache.path, batch_size=8, shuffle=False, return_index=True)
    loader = datapipe.DeviceLoader(ds, device="cpu", output="uint8")
    cache = datapipe.open(index_cache.path)
    assert ds.classes == loader.dataset.classes == list(cache.manifest.classes) and len(ds.classes) == 3
    _, labels, index = next(iter(loader))
    assert [ds.classes[k] for k in labels.tolist()] == [cache.path(i).split("/")[0] for i in index.tolist()]


def test_the_batches_before_an_epoch_end_resume_count_its_short_last_batch(index_cache):
    """The documented count of batches before a resumed position was `position // (batch_size * world_size)`: for a
    state saved at an epoch's end without drop_last (position = the sample count), one short; a loop that passed it
    failed at its next checkpoint. It is `ds.batches_consumed` after loading, the ceiling."""
    assert index_cache.n % B, "the cache must end with a short batch"
    ds = dataset(index_cache)
    take(ds, 0)
    state = ds.state_dict()
    assert state["position"] == index_cache.n
    resumed = dataset(index_cache)
    resumed.load_state_dict(state)
    assert resumed.batches_consumed == -(-index_cache.n // B) == len(take(dataset(index_cache), 0))
    assert resumed.state_dict(batches_consumed=resumed.batches_consumed)["position"] == index_cache.n
    with pytest.raises(StateError, match="batches_consumed"):
        resumed.state_dict(batches_consumed=index_cache.n // B)
