"""Two real torch.distributed ranks (gloo, CPU) reading one index cache.

Each rank detects its place from torch.distributed alone (no rank/world_size arguments and no
RANK/WORLD_SIZE in its environment), reads two epochs through a DataLoader with two persistent
workers, a drop_last epoch, and one epoch through a DeviceLoader. The parent checks exactly once
per epoch over both ranks, equal and exact batch counts, and different orders across epochs
(requirements 1–5, 24).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from loader_fixtures import index_cache_info

import datapipe
from datapipe.testing import build_index_cache

B = 8
WORLD = 2
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


@pytest.fixture(scope="session")
def index_cache(tmp_path_factory):
    """101 index-encoding samples of 32×32 in shards of 7 (built once per session)."""
    return index_cache_info(tmp_path_factory)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_pixels(ids: np.ndarray, images, labels, idx) -> None:
    from datapipe.testing import index_of

    idx = np.asarray(idx)
    if not np.array_equal(index_of(np.asarray(images)), ids[idx]):
        raise AssertionError(f"pixels disagree with indices {idx.tolist()}")
    if not np.array_equal(np.asarray(labels), ids[idx] % 3):
        raise AssertionError(f"labels disagree with indices {idx.tolist()}")


def _read_epochs(ds, ids: np.ndarray, epochs: int = 2) -> list[list[list[int]]]:
    """Each epoch's batches (their sample indices) of StreamingDataset ``ds`` through a DataLoader with two
    workers, every batch's pixels and labels checked against the samples they claim to be."""
    from torch.utils.data import DataLoader  # imported in the rank's process, as its main function does

    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
    result = []
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        batches = []
        for images, labels, idx in loader:
            _check_pixels(ids, images, labels, idx)
            batches.append(idx.tolist())
        result.append(batches)
    del loader
    return result


def _reporting(body):
    """A rank's target from ``body(rank, port, cache, out) -> result``: after it, a barrier and the end of the
    process group, then the result in ``out/rank<r>.json`` (or the traceback in ``out/rank<r>.err``)."""

    @functools.wraps(body)
    def target(rank: int, port: int, cache: str, out: str) -> None:
        try:
            result = body(rank, port, cache, out)
            import torch.distributed as dist

            dist.barrier()
            dist.destroy_process_group()
            Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        except BaseException:
            Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
            raise

    return target


@_reporting
def _rank_main(rank: int, port: int, cache: str, out: str) -> dict:
    """One rank: runs in a spawned process, writes what it read to ``out/rank{rank}.json``."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(key, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A spawned child inherits "spawn"; ranks started by torchrun have the platform default,
    # under which DataLoader workers fork instead of re-importing torch (seconds each).
    multiprocessing.set_start_method("fork", force=True)
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import datapipe
    from datapipe.testing import index_map, to_uint8

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    ids = index_map(cache)
    result: dict = {}

    ds = datapipe.StreamingDataset(cache, batch_size=B, seed=5, return_index=True)
    result["detected"] = [ds.rank, ds.world_size]
    result["len"] = len(ds)
    result["epochs"] = _read_epochs(ds, ids)

    dropping = datapipe.StreamingDataset(cache, batch_size=B, seed=5, drop_last=True, return_index=True)
    result["drop_len"] = len(dropping)
    result["drop"] = [idx.tolist() for _, _, idx in DataLoader(dropping, batch_size=None, num_workers=2)]

    device_ds = datapipe.StreamingDataset(cache, batch_size=B, seed=5, return_index=True)
    device = datapipe.DeviceLoader(device_ds, device="cpu", num_workers=2, augment=datapipe.augment.train(24))
    device.set_epoch(1)
    result["device_len"] = len(device)
    result["device"] = []
    try:
        for images, labels, idx in device:
            _check_pixels(ids, to_uint8(images), labels, idx)
            result["device"].append(idx.tolist())
    finally:
        device.close()

    # What DDP needs: every rank steps the same number of times (gathered, not assumed).
    counts = [len(e) for e in result["epochs"]] + [len(result["drop"]), len(result["device"])]
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, counts)
    result["gathered_counts"] = gathered
    return result


def _run_ranks(cache: Path, out: Path, timeout: float = 100.0, target=None) -> list[dict]:
    """Start WORLD ranks running ``target`` (default: ``_rank_main``) and return what each wrote."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=target or _rank_main, args=(r, port, str(cache), str(out))) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
    errors = {r: (out / f"rank{r}.err").read_text() for r in range(WORLD) if (out / f"rank{r}.err").exists()}
    assert not errors, "\n".join(f"rank {r}:\n{tb}" for r, tb in errors.items())
    assert [p.exitcode for p in procs] == [0] * WORLD, "a rank hung or died"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_two_gloo_ranks_read_each_sample_once_per_epoch(index_cache, tmp_path):
    n = index_cache.n  # 101 = 6 steps of 16 + 5
    results = _run_ranks(index_cache.path, tmp_path)
    assert [r["detected"] for r in results] == [[0, WORLD], [1, WORLD]]
    expected_len = -(-n // (WORLD * B))
    orders = []
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in results]
        assert [len(batches) for batches in per_rank] == [expected_len] * WORLD
        assert [r["len"] for r in results] == [expected_len] * WORLD
        seen = np.concatenate([np.concatenate(batches) for batches in per_rank])
        assert np.array_equal(np.sort(seen), np.arange(n)), f"epoch {epoch}: not exactly once"
        # The global order: step by step, rank 0's batch then rank 1's.
        orders.append(np.concatenate([np.concatenate(step) for step in zip(*per_rank, strict=True)]))
    assert not np.array_equal(orders[0], orders[1]), "epochs must be shuffled differently"
    assert results[0]["gathered_counts"] == results[1]["gathered_counts"]

    drop_len = n // (WORLD * B)
    assert [r["drop_len"] for r in results] == [drop_len] * WORLD
    assert [len(r["drop"]) for r in results] == [drop_len] * WORLD
    dropped = np.concatenate([np.concatenate(r["drop"]) for r in results])
    assert len(dropped) == n - n % (WORLD * B) and len(np.unique(dropped)) == len(dropped)
    assert all(len(b) == B for r in results for b in r["drop"])

    assert [r["device_len"] for r in results] == [expected_len] * WORLD
    assert [len(r["device"]) for r in results] == [expected_len] * WORLD
    device_seen = np.concatenate([np.concatenate(r["device"]) for r in results])
    assert np.array_equal(np.sort(device_seen), np.arange(n))
    # The DeviceLoader (epoch 1) reads the same per-rank batches as the DataLoader did in epoch 1.
    for r in results:
        assert [sorted(b) for b in r["device"]] == [sorted(b) for b in r["epochs"][1]]


def _attempt(action) -> str | None:
    """None when ``action()`` runs through, else the RankMismatchError it raised, as 'Name: message'."""
    from datapipe.errors import RankMismatchError

    try:
        action()
    except RankMismatchError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@_reporting
def _disagreeing_main(rank: int, port: int, cache: str, out: str) -> dict:
    """One rank of runs whose datasets differ on one rank (and of runs that must pass): what each raised.

    A barrier after each run keeps every rank (and rank 0's store) up until all have checked, so the
    outcome does not depend on which rank gets where first."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    multiprocessing.set_start_method("fork", force=True)
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import datapipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))

    def make(**kwargs) -> datapipe.StreamingDataset:
        return datapipe.StreamingDataset(cache, **{"batch_size": B, "seed": 5, "return_index": True, **kwargs})

    def device_epoch(ds, state=None, load_after_set_epoch=False, passes=1) -> None:
        loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=0, output="uint8")
        if state is not None and not load_after_set_epoch:
            loader.load_state_dict(state)
        loader.set_epoch(0)
        if state is not None and load_after_set_epoch:
            loader.load_state_dict(state)
        for _ in range(passes):
            for _batch in loader:
                pass

    def unsplit_on_rank_0() -> None:  # e.g. an evaluation of rank 0's own
        if rank == 0:
            device_epoch(make(rank=0, world_size=1))

    def with_workers() -> None:
        ds = make()
        ds.set_epoch(1)
        list(DataLoader(ds, batch_size=None, num_workers=2))

    def iterate(ds, state=None, epochs=()) -> None:  # load_state_dict (if any), then set_epoch for each of epochs
        loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=0, output="uint8")
        if state is not None:
            loader.load_state_dict(state)
        for epoch in epochs or [None]:
            if epoch is not None:
                loader.set_epoch(epoch)
            for _batch in loader:
                pass

    def set_epoch_on_rank_0_only() -> None:  # rank 1 reads epoch 0's order again where rank 0 reads epoch 1's
        loader = datapipe.DeviceLoader(make(), device="cpu", num_workers=0, output="uint8")
        for epoch in (0, 1):
            if rank == 0:
                loader.set_epoch(epoch)
            for _batch in loader:
                pass

    def peek_on_rank_0() -> None:  # one batch on rank 0 before training (a sample grid): no false alarm
        ds = make()
        if rank == 0:
            next(iter(datapipe.DeviceLoader(ds, device="cpu", num_workers=0, output="uint8")))
        iterate(ds, epochs=[0, 1])

    state = {**make().state_dict(), "position": 2 * B * WORLD}
    later = {**state, "epoch": 1}
    rebuilt, copied = Path(out) / "rebuilt" / "cache", Path(out) / "copied"
    before, after = Path(out) / "inplace-before", Path(out) / "inplace" / "cache"
    runs = {
        "the cache rebuilt in place between the ranks' opening it": lambda: datapipe.StreamingDataset(
            before if rank == 0 else after, batch_size=B, seed=5, return_index=True).set_epoch(0),
        "another cache on rank 1": lambda: make().set_epoch(0) if rank == 0 else datapipe.StreamingDataset(
            rebuilt, batch_size=B, seed=5, return_index=True).set_epoch(0),
        "resumed on rank 0 only, no set_epoch": lambda: iterate(make(), later if rank == 0 else None),
        "an older state on rank 1": lambda: iterate(make(), later if rank == 0 else state,
                                                    epochs=[1 if rank == 0 else 0]),
        "set_epoch per rank": lambda: make().set_epoch(rank),
        "set_epoch on rank 0 only": set_epoch_on_rank_0_only,
        "seed per rank": lambda: device_epoch(make(seed=rank)),
        "batch size": lambda: make(batch_size=2 * B if rank else B).set_epoch(0),
        "drop_last": lambda: len(DataLoader(make(drop_last=rank == 1), batch_size=None, num_workers=2)),
        "order": lambda: make(order="shards" if rank else "global").set_epoch(0),
        "resumed on rank 0 only": lambda: device_epoch(make(), state if rank == 0 else None),
        "resumed on rank 0 only, after set_epoch": lambda: device_epoch(
            make(), state if rank == 0 else None, load_after_set_epoch=True),
        # what must pass: the same state on every rank (loaded after set_epoch, the epoch read twice),
        # a dataset of one rank's own (world_size=1), and a dataset read by DataLoader workers
        "resumed alike": lambda: device_epoch(make(), state, load_after_set_epoch=True, passes=2),
        "rank 0 only, unsplit": unsplit_on_rank_0,
        "alike with workers": with_workers,
        "a copy of the cache on rank 1": lambda: datapipe.StreamingDataset(
            cache if rank == 0 else copied, batch_size=B, seed=5, return_index=True).set_epoch(0),
        "a peek on rank 0": peek_on_rank_0,
    }
    result = {}
    for name, run in runs.items():
        result[name] = _attempt(run)
        dist.barrier()
    return result


def test_ranks_that_read_a_dataset_differently_are_refused_without_waiting(index_cache, tmp_path):
    """A seed per rank, another batch size or drop_last on one rank, a state loaded on one rank only (or an
    older one, or another epoch), another cache on one rank: one rank raises a one-line RankMismatchError
    naming the setting and both values (the other, first to publish, reads on: nothing waits for anything),
    where it would read samples twice or hang DDP. A copy of the cache at another path, or one rank peeking at
    a batch before training, is no disagreement."""
    build_index_cache(tmp_path / "rebuilt", index_cache.n, shard_size=index_cache.shard_size, size=index_cache.size)
    shutil.copytree(index_cache.path, tmp_path / "copied")  # the same build at another path (a node's copy)
    inplace = build_index_cache(tmp_path / "inplace", index_cache.n, shard_size=index_cache.shard_size,
                                size=index_cache.size)
    shutil.copytree(inplace, tmp_path / "inplace-before")  # what rank 0 opened: then one image changed, rebuilt
    images = sorted(p for p in (inplace.parent / "source").rglob("*") if p.is_file())
    shutil.copyfile(images[1], images[0])
    datapipe.build(inplace.parent / "source", inplace, size=index_cache.size, shard_size=index_cache.shard_size,
                   cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    assert datapipe.open(inplace).build_id == datapipe.open(tmp_path / "inplace-before").build_id
    results = _run_ranks(index_cache.path, tmp_path, target=_disagreeing_main)
    expected = {
        "another cache on rank 1": ("reads the cache of build", "every rank must read the same cache"),
        "the cache rebuilt in place between the ranks' opening it": ("holds other samples or labels here",
                                                                     "rebuilt in place", "restart every rank"),
        "resumed on rank 0 only, no set_epoch": ("first iteration", f"epoch 1 from sample {2 * B * WORLD}",
                                                 "epoch 0 from sample 0"),
        "an older state on rank 1": ("set_epoch call #1", "epoch 1 from sample", "epoch 0 from sample",
                                     "load the same state"),
        "set_epoch per rank": ("set_epoch call #1", "epoch 1 from sample 0", "epoch 0 from sample 0"),
        "set_epoch on rank 0 only": ("iteration #1 after 1 iteration read to the end", "epoch 1 from sample 0",
                                     "epoch 0 from sample 0", "call set_epoch alike"),
        "seed per rank": ("seed=", "seed=0", "seed=1", "a seed per rank"),
        "batch size": ("batch_size=", f"batch_size={B}", f"batch_size={2 * B}"),
        "drop_last": ("drop_last=", "drop_last=False", "drop_last=True"),
        "order": ("order='shards'", "order='global'", "; create it"),
        "resumed on rank 0 only": ("epoch 0 from sample", f"sample {2 * B * WORLD}", "sample 0", "load the same state"),
        "resumed on rank 0 only, after set_epoch": ("epoch 0 from sample", f"sample {2 * B * WORLD}", "sample 0"),
    }
    for name, words in expected.items():
        raised = [r[name] for r in results if r[name] is not None]
        assert len(raised) == 1, f"{name}: {[r[name] for r in results]}"
        [message] = raised
        assert message.startswith("RankMismatchError: ") and "\n" not in message and len(message) < 400, message
        assert all(word in message for word in words), message
        assert "None" not in message, message  # the global order has no window nor nodes to compare
    for name in ("resumed alike", "rank 0 only, unsplit", "alike with workers", "a copy of the cache on rank 1",
                 "a peek on rank 0"):
        assert [r[name] for r in results] == [None] * WORLD, name


@_reporting
def _one_rank_reads_main(rank: int, port: int, cache: str, out: str) -> dict:
    """One rank of runs where a split dataset is read on rank 0 while rank 1 never iterates it (as Hugging Face
    Accelerate's dispatch_batches reads the loader on rank 0 and sends its batches to the others), two epochs, and
    of runs that must pass: the ranks taking turns at a barrier, rank 1 reading its part of an evaluation while rank
    0 is busy longer than the timeout (saving a checkpoint), both reading two epochs. What each raised, and how long
    rank 0 took."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DATAPIPE_RANK_TIMEOUT="3")
    import copy

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import datapipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))

    def make(**kwargs) -> datapipe.StreamingDataset:
        return datapipe.StreamingDataset(cache, **{"batch_size": B, "seed": 5, "return_index": True, **kwargs})

    def device(ds) -> datapipe.DeviceLoader:
        return datapipe.DeviceLoader(ds, device="cpu", num_workers=1, output="uint8")

    def epochs(loader, ds, count: int = 2) -> int:
        try:
            read = 0
            for epoch in range(count):
                ds.set_epoch(epoch)
                read += sum(len(batch[-1]) for batch in loader)
            return read
        finally:
            if isinstance(loader, datapipe.DeviceLoader):
                loader.close()

    def on_rank_0(wrap) -> None:  # every rank makes the dataset and its iterator (as Accelerate's dispatcher does)
        ds = make()
        if rank == 0:
            epochs(wrap(ds), ds)
        else:
            loader = wrap(ds)
            for epoch in range(2):
                ds.set_epoch(epoch)
                iter(loader)  # made, never read
            if isinstance(loader, datapipe.DeviceLoader):
                loader.close()

    def turns() -> None:  # rank 0 reads its part while rank 1 waits at a barrier, then rank 1; then both, alike
        ds = make()
        for turn in range(WORLD):
            if rank == turn:
                ds.set_epoch(0)
                sum(1 for _ in ds)
            dist.barrier()
        epochs(ds, ds)

    def evaluation_after_a_save() -> None:  # rank 0 busy past the timeout, rank 1 reads its part meanwhile
        ds = make()
        for epoch in range(2):
            if rank == 0:
                time.sleep(4)
            ds.set_epoch(epoch)
            sum(1 for _ in ds)
            dist.barrier()  # the metric's all-reduce

    def workers_on_rank_1() -> None:  # rank 1 reads through DataLoader workers, which note nothing themselves
        ds = make()
        loader = DataLoader(ds, batch_size=None, num_workers=2 if rank else 0)
        for epoch in range(3):
            ds.set_epoch(epoch)
            sum(1 for _ in loader)
            dist.barrier()

    def copy_after_two_epochs() -> None:  # a copy has a namespace of its own in the store: it checks its own epochs
        ds = make()
        epochs(ds, ds)
        copied = copy.deepcopy(ds)
        for epoch in (2, 3):
            copied.set_epoch(epoch)
            sum(1 for _ in copied)

    runs = {
        "dataset on rank 0 only": lambda: on_rank_0(lambda ds: ds),
        "DataLoader on rank 0 only": lambda: on_rank_0(lambda ds: DataLoader(ds, batch_size=None)),
        "DeviceLoader on rank 0 only": lambda: on_rank_0(device),
        "turns": turns,
        "evaluation after a save": evaluation_after_a_save,
        "every rank, two epochs": lambda: [epochs(device(ds), ds) for ds in [make()]],
        "a copy after two epochs": copy_after_two_epochs,
        "DataLoader workers on rank 1 only": workers_on_rank_1,
        "unsplit on rank 0": lambda: [epochs(ds, ds) for ds in [make(rank=0, world_size=1)]] if rank == 0 else None,
    }
    result: dict = {}
    for name, run in runs.items():
        began = time.monotonic()
        try:
            run()
            result[name] = None
        except Exception as exc:  # noqa: BLE001 - what each run raised is the result
            result[name] = f"{type(exc).__name__}: {exc}"
        result[name + " seconds"] = time.monotonic() - began
        dist.barrier()
    return result


def test_a_split_dataset_read_on_one_rank_only_is_refused(index_cache, tmp_path):
    """Accelerate's default for an iterable dataset reads the loader on rank 0 and sends its batches to the others:
    rank 1's part of a dataset split over the ranks was never read, every epoch, without a word. The rank that read
    its whole part raises a RankMismatchError when it begins to read again, naming the rank that never began and
    what to do, after waiting DATAPIPE_RANK_TIMEOUT (3 s here) for one that lags; ranks that take turns or lag
    without a collective pass."""
    results = _run_ranks(index_cache.path, tmp_path, target=_one_rank_reads_main)
    for name in ("dataset on rank 0 only", "DataLoader on rank 0 only", "DeviceLoader on rank 0 only"):
        message = results[0][name]
        assert message is not None and message.startswith("RankMismatchError: "), (name, message)
        assert "\n" not in message
        for words in ("is split over 2 ranks", "this rank (0) read its part of epoch 0 to the end and begins to read",
                      "rank 1 had not begun reading its part (waited 3 s)", "dispatch_batches", "datapipe.DeviceLoader",
                      "rank=0, world_size=1", "DATAPIPE_RANK_TIMEOUT"):
            assert words in message, (name, words, message)
        assert results[0][name + " seconds"] >= 3, name
        assert results[1][name] is None, name
    for name in ("turns", "evaluation after a save", "every rank, two epochs", "a copy after two epochs",
                 "DataLoader workers on rank 1 only", "unsplit on rank 0"):
        assert [r[name] for r in results] == [None] * WORLD, (name, [r[name] for r in results])
    assert results[0]["unsplit on rank 0 seconds"] < 3  # nothing to wait for: the dataset is rank 0's own


@_reporting
def _created_before_init_main(rank: int, port: int, cache: str, out: str) -> dict:
    """One rank that creates datasets before init_process_group (as mp.spawn + tcp:// allows): from no
    RANK/WORLD_SIZE, from torchrun's variables, and with explicit ranks. What using each raised."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    import torch
    import torch.distributed as dist

    import datapipe

    torch.set_num_threads(1)

    def make(**kwargs) -> datapipe.StreamingDataset:
        return datapipe.StreamingDataset(cache, batch_size=B, seed=5, return_index=True, **kwargs)

    undetected = make()  # rank 0 of 1: nothing says otherwise yet
    explicit = make(rank=rank, world_size=WORLD)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD))
    from_env = make()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))

    def device_epoch(ds) -> int:
        loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=0, output="uint8")
        return sum(1 for _ in loader)

    result = {
        "undetected": [_attempt(lambda: undetected.set_epoch(0)), _attempt(lambda: len(undetected)),
                       _attempt(lambda: device_epoch(undetected))],
        "explicit": [_attempt(lambda: explicit.set_epoch(0)), _attempt(lambda: device_epoch(explicit))],
        "from_env": [_attempt(lambda: from_env.set_epoch(0)), _attempt(lambda: device_epoch(from_env))],
    }
    return result


def test_a_dataset_created_before_init_process_group_is_refused_not_read_whole(index_cache, tmp_path):
    """Detected as rank 0 of 1 before the process group existed, a dataset would read every sample on
    every rank: set_epoch, len() and an iteration say so in one line, naming the fix."""
    results = _run_ranks(index_cache.path, tmp_path, target=_created_before_init_main)
    for rank, r in enumerate(results):
        for message in r["undetected"]:
            assert message is not None and message.startswith("RankMismatchError: ") and "\n" not in message
            assert f"rank {rank} of {WORLD}" in message and "after init_process_group" in message, message
        assert r["explicit"] == [None, None] and r["from_env"] == [None, None]



RESTARTED_MAIN = '''
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
import datapipe

cache, port, rank, attempt, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
# as torchrun sets them for the workers of each attempt of a job on one node, in its agent's store
os.environ.update(TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_USE_AGENT_STORE="True", GROUP_WORLD_SIZE="1")
# the store of every attempt: a client of the one the test holds (torchrun's agent store outlives its workers)
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)  # no peer to connect to: the store is the point
ds = datapipe.StreamingDataset(cache, batch_size=8, seed=5, rank=rank, world_size=2, return_index=True)
checkpoint = os.path.join(out, "loader.pt")
if attempt:
    ds.load_state_dict(torch.load(checkpoint))  # the same state on every rank, as a restarted job does
ds.set_epoch(ds.epoch)
seen = []
try:
    for k, (_, _, index) in enumerate(ds):
        seen.extend(index.tolist())
        if attempt == 0 and k == 2:  # three batches in: checkpoint, then the job fails
            if rank == 0:
                torch.save(ds.state_dict(), checkpoint)
            break
except datapipe.errors.RankMismatchError as exc:
    seen = str(exc)
with open(os.path.join(out, f"seen-{attempt}-{rank}.json"), "w") as f:
    json.dump(seen, f)
'''


@pytest.mark.timeout(300)
def test_ranks_restarted_by_torchrun_are_not_compared_with_the_failed_attempt(index_cache, tmp_path):
    """torchrun --max-restarts on one node: the workers of every attempt share the agent's store, which outlives them. The
    failed attempt's ranks had published their settings and positions there; the restarted ranks, each loading
    the same checkpoint, were compared with those and refused (RankMismatchError on every rank, the job could not
    resume). Each attempt's keys are its own (torchrun's restart count): the resumed epoch reads the samples the
    failed attempt did not, once. (torchrun's own gloo set-up in that shared store fails or hangs on this machine
    at random after a restart, pytorch/pytorch#135712: here the test holds the store, and each rank process is
    its own gloo group of one.)"""
    from torch.distributed import TCPStore

    script = tmp_path / "train.py"
    script.write_text(RESTARTED_MAIN)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                                                            "TORCHELASTIC_USE_AGENT_STORE", "GROUP_WORLD_SIZE")}
    seen = {}
    for attempt in (0, 1):
        ranks = [subprocess.Popen([sys.executable, str(script), str(index_cache.path), str(store.port), str(rank),
                                   str(attempt), str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True)
                 for rank in range(WORLD)]
        for rank, proc in enumerate(ranks):
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            seen[attempt, rank] = json.loads((tmp_path / f"seen-{attempt}-{rank}.json").read_text())
    for rank in range(WORLD):
        assert isinstance(seen[1, rank], list), seen[1, rank]  # no RankMismatchError
        assert len(seen[0, rank]) == 3 * B
    assert sorted(i for part in seen.values() for i in part) == list(range(index_cache.n))  # each sample once
