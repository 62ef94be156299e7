"""StreamingDataset and DeviceLoader on the CPU, checked sample by sample with index-encoding images.

Requirements 1–6 and 8–12 (exactly once, equal counts, exact lengths, automatic rank detection,
deterministic order and augmentation, resume), 15 (damaged shards named), 22 (no hang on a reader
error) and 25 (batched augmentation in fp32/bf16 and under autocast).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from loader_fixtures import concat, index_cache_info
from torch.utils.data import DataLoader

import datapipe
from datapipe import augment, native
from datapipe.device import _seed_for
from datapipe.errors import CacheError, CorruptShardError, StateError
from datapipe.testing import index_of, to_uint8

B = 8
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers, 2 cores


@pytest.fixture(scope="session")
def index_cache(tmp_path_factory):
    """101 index-encoding samples of 32×32 in shards of 7 (built once per session)."""
    return index_cache_info(tmp_path_factory)


def dataset(info, **kwargs) -> datapipe.StreamingDataset:
    kwargs.setdefault("batch_size", B)
    kwargs.setdefault("seed", 3)
    kwargs.setdefault("return_index", True)
    return datapipe.StreamingDataset(info.path, **kwargs)


def take(ds, num_workers: int, k: int | None = None) -> list:
    """The first ``k`` (default: all) batches of a DataLoader over ``ds``; the iterator is then dropped."""
    it = iter(DataLoader(ds, batch_size=None, num_workers=num_workers))
    try:
        return list(itertools.islice(it, k))  # never asks for batch k + 1
    finally:
        del it


def check_batches(info, batches) -> np.ndarray:
    """Every batch's pixels, labels and indices agree with the cache; returns all indices."""
    cache = datapipe.open(info.path)
    for images, labels, idx in batches:
        assert images.dtype == torch.uint8 and images.shape[1:] == (info.size, info.size, 3)
        assert labels.dtype == torch.int64 and idx.dtype == torch.int64
        idx = idx.numpy()
        assert np.array_equal(index_of(images.numpy()), info.ids[idx])
        assert np.array_equal(labels.numpy(), info.ids[idx] % 3)
        expected = [cache[int(i)] for i in idx]
        assert np.array_equal(images.numpy(), np.stack([img for img, _ in expected]))
        assert labels.tolist() == [lab for _, lab in expected]
    return concat(batches, 2)


def same_stream(a, b) -> bool:
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in zip(p, q)) for p, q in zip(a, b))


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
    third.load_state_dict(second.state_dict(batches_consumed=3))
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
    assert len(take(ds, 0)) == len(ds) - 4
    assert same_stream(take(ds, 0), reference), "the next iteration of the epoch is whole again"


def test_state_after_resume_and_next_epoch_with_workers(index_cache):
    ds = dataset(index_cache)
    ds.load_state_dict({**ds.state_dict(), "position": 3 * B})
    take(ds, 2)  # the rest of epoch 0, read by workers
    ds.set_epoch(1)
    take(ds, 2, 2)
    assert ds.state_dict(batches_consumed=2)["position"] == 2 * B


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
    assert len(take(ds, 2)) == len(ds) - 4
    assert len(take(ds, 2)) == len(ds) - 4
    ds.set_epoch(1)
    assert len(take(ds, 2)) == len(ds)


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
        return [np.sort(np.concatenate(step)) for step in zip(*streams)]  # samples of each global step

    uninterrupted = global_steps(2, 8)
    ds = dataset(index_cache, rank=1, world_size=2)
    take(ds, 0, 2)
    state = ds.state_dict()
    assert state["position"] == 32
    resumed = global_steps(4, 4, state)
    assert len(resumed) == len(uninterrupted) - 2
    for a, b in zip(uninterrupted[2:], resumed):
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
    assert len(reads) == len(rest) == len(ds) - 9


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


# ----------------------------------------------------------------------------- DeviceLoader


def run_loader(info, *, workers: int = 2, epoch: int = 0, k: int | None = None, state=None, **kwargs):
    """Batches of one epoch of a fresh DeviceLoader (cloned), and the loader (closed)."""
    ds_kwargs = {key: kwargs.pop(key) for key in ("seed", "shuffle", "return_index", "batch_size") if key in kwargs}
    ds = dataset(info, **ds_kwargs)
    loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=workers, **kwargs)
    try:
        loader.set_epoch(epoch)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for batch in loader:
            out.append(tuple(t.clone() for t in batch))
            if k is not None and len(out) == k:
                break
        return out, loader
    finally:
        loader.close()


def test_device_loader_train_end_to_end(index_cache):
    batches, loader = run_loader(index_cache, augment=augment.train(24))
    assert len(batches) == len(loader) == -(-index_cache.n // B)
    for images, labels, idx in batches:
        assert images.shape == (len(idx), 3, 24, 24) and images.dtype == torch.float32
        assert torch.isfinite(images).all()
        ids = index_cache.ids[idx.numpy()]
        assert np.array_equal(index_of(to_uint8(images)), ids), "the red and green channels survive the crop"
        assert np.array_equal(labels.numpy(), ids % 3)
    assert np.array_equal(np.sort(concat(batches, 2)), np.arange(index_cache.n))
    stats = loader.stats()
    assert stats["images"] == index_cache.n and stats["batches"] == len(loader)
    assert 0.0 <= stats["wait_share"] <= 1.0 and stats["images_per_s"] > 0


@pytest.mark.parametrize("preset", ["train", "train+jitter", "eval", "none", "uint8"])
def test_a_rank_with_an_empty_last_batch(tmp_path_factory, preset):
    """3 samples on 4 ranks in batches of 2: every rank yields one batch, the last rank an empty one."""
    info = index_cache_info(tmp_path_factory, 3, shard_size=2)
    augs = {"train": augment.train(24), "train+jitter": augment.train(24, color_jitter=(0.4, 0.4, 0.4, 0.1)),
            "eval": augment.eval(24), "none": None, "uint8": None}
    seen = []
    for rank in range(4):
        ds = datapipe.StreamingDataset(info.path, batch_size=2, rank=rank, world_size=4, return_index=True)
        kwargs = {"output": "uint8"} if preset == "uint8" else {"augment": augs[preset]}
        loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=2, **kwargs)
        try:
            batches = list(loader)
        finally:
            loader.close()
        assert len(batches) == len(loader) == 1
        images, labels, idx = batches[0]
        assert len(images) == len(labels) == len(idx) == (1 if rank < 3 else 0)
        side = 24 if augs[preset] else info.size
        assert images.shape[1:] == ((side, side, 3) if preset == "uint8" else (3, side, side))
        seen += idx.tolist()
    assert sorted(seen) == [0, 1, 2]


def test_device_loader_eval_values_are_exact(index_cache):
    batches, _ = run_loader(index_cache, augment=augment.eval(24), shuffle=False)
    cache = datapipe.open(index_cache.path)
    mean = torch.tensor(augment.IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(augment.IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    for images, _, idx in batches:
        raw = torch.from_numpy(np.stack([cache[int(i)][0] for i in idx]))[:, 4:28, 4:28]  # center 24 of 32
        expected = (raw.permute(0, 3, 1, 2).to(torch.float64) / 255.0 - mean) / std
        torch.testing.assert_close(images.to(torch.float64), expected, rtol=0, atol=1e-5)
        red = torch.tensor((index_cache.ids[idx.numpy()] % 256) / 255.0)
        torch.testing.assert_close(images[:, 0].to(torch.float64),
                                   ((red - 0.485) / 0.229).view(-1, 1, 1).expand(-1, 24, 24), rtol=0, atol=1e-5)


def test_device_loader_without_augment_normalises(index_cache):
    batches, _ = run_loader(index_cache, shuffle=False, k=2)
    images, _, idx = batches[0]
    assert images.shape == (B, 3, 32, 32)
    assert np.array_equal(to_uint8(images), np.stack([datapipe.open(index_cache.path)[int(i)][0] for i in idx]))


def test_channels_last(index_cache):
    (images, *_), = run_loader(index_cache, k=1, channels_last=True)[0]
    assert images.is_contiguous(memory_format=torch.channels_last)
    (images, *_), = run_loader(index_cache, k=1, augment=augment.eval(24, channels_last=True))[0]
    assert images.is_contiguous(memory_format=torch.channels_last)
    (images, *_), = run_loader(index_cache, k=1, augment=augment.train(24, channels_last=True))[0]
    assert images.is_contiguous(memory_format=torch.channels_last) and images.shape == (B, 3, 24, 24)
    for preset in (augment.train(24), augment.eval(24)):  # the loader's flag applies to presets too
        (images, *_), = run_loader(index_cache, k=1, channels_last=True, augment=preset)[0]
        assert images.is_contiguous(memory_format=torch.channels_last)
    (images, *_), = run_loader(index_cache, k=1, augment=augment.train(24))[0]
    assert images.is_contiguous()


@pytest.mark.parametrize("preset", [augment.train(24), augment.train(24, color_jitter=0.4), augment.eval(24)])
def test_cpu_presets_crop_straight_from_the_shards_like_a_gathered_batch(index_cache, preset):
    """On the CPU a preset reads each sample's crop from the memory maps (no gathered batch); the
    result is exactly what the preset gives for the same samples gathered into one tensor."""
    direct, loader = run_loader(index_cache, workers=2, augment=preset, epoch=1)
    assert loader._direct
    cache = datapipe.open(index_cache.path)
    ds = dataset(index_cache)
    ds.set_epoch(1)
    order, bounds = ds.begin_iteration()
    for j, (images, labels, idx) in enumerate(direct):
        begin, end = bounds[j]
        assert np.array_equal(idx.numpy(), np.sort(order[begin:end]))
        gathered = torch.from_numpy(np.stack([cache[int(i)][0] for i in idx]))
        expected = preset(gathered, seed=_seed_for(ds.seed, 1, begin))
        assert torch.equal(images, expected), f"batch {j}"


def test_sample_views_are_private_maps_of_the_shards(index_cache):
    cache = datapipe.open(index_cache.path)
    labels = np.empty(3, np.int64)
    views = cache.sample_views(np.array([7, 2, index_cache.n - 1]), labels)
    assert [tuple(v.shape) for v in views] == [(32, 32, 3)] * 3 and all(v.dtype == torch.uint8 for v in views)
    for v, i in zip(views, [2, 7, index_cache.n - 1]):  # sorted, as read_batch orders them
        assert np.array_equal(v.numpy(), cache[i][0])
    assert np.array_equal(labels, index_cache.ids[[2, 7, index_cache.n - 1]] % 3)
    before = cache[2][0].copy()
    views[0].zero_()  # copy-on-write: the file is never touched
    assert np.array_equal(datapipe.open(index_cache.path)[2][0], before)


def test_batches_are_read_through_the_page_cache_and_opening_reads_no_per_sample_file(index_cache, tmp_path):
    """The loader reads the shard files through the page cache (one copy for every process and rank
    on a node): from memory maps only under the compiled SIGBUS guard, with positioned reads
    otherwise, so a file shrinking under a reader is an error, never a SIGBUS (tests/test_guarded_reads.py);
    and neither opening a cache nor reading an epoch parses the per-sample path list (its cost
    would grow with the dataset)."""
    cache = datapipe.open(index_cache.path)
    out, labels = np.empty((index_cache.n, *cache.shape), np.uint8), np.empty(index_cache.n, np.int64)
    cache.read_batch(np.arange(index_cache.n), out, labels)
    with open("/proc/self/maps") as f:
        assert (str(index_cache.path) in f.read()) == cache.mapped == native.guard_available()
    copy = tmp_path / "cache"
    shutil.copytree(index_cache.path, copy)
    (copy / "paths.json").write_text("not json: never parsed unless a path is asked for")
    ds = datapipe.StreamingDataset(copy, batch_size=B, return_index=True)
    assert np.array_equal(np.sort(concat(list(ds), 2)), np.arange(index_cache.n))
    with pytest.raises(ValueError):
        ds.cache.path(0)


def test_augment_takes_a_list_of_samples():
    images = smooth_batch(4)
    for aug in (augment.train(24), augment.train(24, color_jitter=0.4), augment.eval(24),
                augment.train(24, path="kornia")):
        assert torch.equal(aug(list(images), seed=3), aug(images, seed=3))
    with pytest.raises(ValueError, match="one shape"):
        augment.train(24)([images[0], images[1, :30]], seed=0)
    assert augment.eval(24)([], seed=0).shape == (0, 3, 24, 24)


def test_augmentation_is_deterministic_for_any_reader_count(index_cache):
    one, _ = run_loader(index_cache, workers=1, augment=augment.train(24))
    three, _ = run_loader(index_cache, workers=3, prefetch=3, augment=augment.train(24))
    again, _ = run_loader(index_cache, workers=1, augment=augment.train(24))
    assert same_stream(one, three) and same_stream(one, again)
    other_seed, _ = run_loader(index_cache, workers=1, augment=augment.train(24), seed=4, shuffle=False)
    other_epoch, _ = run_loader(index_cache, workers=1, augment=augment.train(24), seed=4, shuffle=False, epoch=1)
    # Same samples in the same batches (no shuffle), another epoch: other crops and flips.
    assert all(torch.equal(a[2], b[2]) for a, b in zip(other_seed, other_epoch))
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(other_seed, other_epoch))


def test_device_loader_resume_gives_identical_augmented_batches(index_cache):
    full, _ = run_loader(index_cache, epoch=2, augment=augment.train(24, color_jitter=0.4))
    head, loader = run_loader(index_cache, epoch=2, k=5, augment=augment.train(24, color_jitter=0.4))
    state = loader.state_dict()
    assert state["position"] == 5 * B and state["epoch"] == 2
    tail, _ = run_loader(index_cache, workers=3, epoch=2, state=state, augment=augment.train(24, color_jitter=0.4))
    assert len(tail) == len(full) - 5
    assert same_stream(head + tail, full)


def test_state_counts_consumed_not_prefetched_batches(index_cache):
    ds = dataset(index_cache)
    loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=2, prefetch=4)
    try:
        it = iter(loader)
        next(it)
        next(it)
        time.sleep(0.2)  # let the readers run ahead
        assert loader.state_dict()["position"] == 2 * B
        del it
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_reader_exception_reaches_the_loop(index_cache, monkeypatch):
    ds = dataset(index_cache)
    calls = []
    original = ds.cache.read_batch

    def failing(indices, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("injected failure in the third read")
        return original(indices, *args, **kwargs)

    def failing_views(indices, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("injected failure in the third read")
        return original_views(indices, *args, **kwargs)

    original_views = ds.cache.sample_views
    monkeypatch.setattr(ds.cache, "read_batch", failing)
    monkeypatch.setattr(ds.cache, "sample_views", failing_views)  # the CPU path of the presets
    loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=2, augment=augment.train(24))
    started = time.perf_counter()
    try:
        with pytest.raises(KeyError, match="injected failure in the third read") as excinfo:
            for _ in loader:
                pass
    finally:
        loader.close()
    assert time.perf_counter() - started < 10
    assert any(entry.name == "failing_views" for entry in excinfo.traceback), "the reader's traceback is kept"


@pytest.mark.timeout(60)
def test_abandoned_iterator_does_not_break_a_newer_one(index_cache):
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", timeout=3)
    try:
        first = iter(loader)
        next(first)
        second = iter(loader)
        got = [next(second)]
        del first  # finalised only now, while the second iteration runs
        got.extend(second)
        assert len(got) == len(loader)
    finally:
        loader.close()


_EXIT_WHILE_READING = """
import sys
import datapipe
from datapipe import augment
ds = datapipe.StreamingDataset(sys.argv[1], batch_size=16, shuffle=True, seed=0)
loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=2, prefetch=4, augment=augment.train(224))
for images, labels in loader:
    break  # the readers are still resizing the prefetched batches as the script ends
print("finished", tuple(images.shape))
"""


@pytest.mark.timeout(120)
def test_a_script_may_end_while_readers_are_busy(index_cache):
    """Python ends daemon threads when they next take the GIL; torch takes it inside a noexcept
    destructor, which aborted the process (exit 134) unless the readers are stopped at exit."""
    import subprocess
    import sys

    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", _EXIT_WHILE_READING, str(index_cache.path)],
                              capture_output=True, text=True, timeout=100)
        assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-500:]}"
        assert "finished (16, 3, 224, 224)" in proc.stdout


_INTERRUPTED = """
import sys, time
import datapipe
from datapipe import augment
from torch.utils.data import DataLoader

kind, path = sys.argv[1], sys.argv[2]
ds = datapipe.StreamingDataset(path, batch_size=8)
if kind == "device":
    loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=2, augment=augment.train(24))
else:
    loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True)
for epoch in range(1000):
    for i, batch in enumerate(loader):
        if epoch == 0 and i == 0:
            print("ready", flush=True)
        time.sleep(0.05)
"""


@pytest.mark.parametrize("kind", ["device", "dataloader"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupted_training_script_ends_and_leaves_no_process(index_cache, kind, sig):
    """Ctrl-C or a scheduler's SIGTERM mid-epoch: the script ends promptly (no hang in a reader
    thread or a worker) and leaves no worker process behind."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, kind, str(index_cache.path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(0.3)  # mid-epoch, readers or workers busy
        proc.send_signal(getattr(signal, sig))
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        err = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode != 0
    if sig == "SIGINT":
        assert "KeyboardInterrupt" in err, err[-800:]
    deadline = time.monotonic() + 30  # orphaned DataLoader workers notice within torch's 5 s status check
    while True:  # the session's other processes (DataLoader workers) exit too
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a worker process outlived the interrupted script"
        time.sleep(0.1)


def test_bfloat16_output_and_autocast(index_cache):
    batches, _ = run_loader(index_cache, k=3, dtype=torch.bfloat16, augment=augment.train(24))
    plain, _ = run_loader(index_cache, k=3, dtype=torch.bfloat16)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 3))
    for (images, labels, idx), (raw, _, _) in zip(batches, plain):
        assert images.dtype == torch.bfloat16 and images.shape == (B, 3, 24, 24)
        assert raw.dtype == torch.bfloat16 and raw.shape == (B, 3, 32, 32)
        assert np.array_equal(index_of(to_uint8(images)), index_cache.ids[idx.numpy()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(images)
            loss = torch.nn.functional.cross_entropy(logits, labels)
        assert logits.dtype == torch.bfloat16
        loss.backward()
    autocast_batches = []
    ds = dataset(index_cache)
    loader = datapipe.DeviceLoader(ds, device="cpu", augment=augment.train(24))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the loop runs under autocast
            for images, labels, _ in loader:
                autocast_batches.append(images)
                assert model(images).dtype == torch.bfloat16
    finally:
        loader.close()
    assert len(autocast_batches) == len(loader) and autocast_batches[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["uint8", "kornia"])
def test_half_precision_outputs_on_both_augment_paths(index_cache, dtype, path):
    """fp16 and bf16 batches from the CPU (uint8) path and the batched Kornia path that CUDA uses."""
    batches, _ = run_loader(index_cache, k=2, dtype=dtype, augment=augment.train(24, path=path))
    for images, _, idx in batches:
        assert images.dtype == dtype and images.shape == (B, 3, 24, 24) and torch.isfinite(images).all()
        assert np.array_equal(index_of(to_uint8(images.float())), index_cache.ids[idx.numpy()])


class RandomFlip(torch.nn.Module):
    """A plain module drawing from torch's global generator (as most third-party augmentations do)."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)  # work before the random draw, as a real module has
        flip = torch.rand(x.shape[0]) < 0.5
        return torch.where(flip[:, None, None, None], x.flip(-1), x)


def test_generic_module_is_seeded_per_batch(index_cache):
    a, _ = run_loader(index_cache, workers=1, augment=RandomFlip(), shuffle=False)
    b, _ = run_loader(index_cache, workers=1, augment=RandomFlip(), shuffle=False)
    plain, _ = run_loader(index_cache, workers=1, shuffle=False)
    assert same_stream(a, b)

    def flip_masks(batches) -> list[tuple[bool, ...]]:
        masks = []
        for (x, *_), (y, *_) in zip(batches, plain):
            mask = []
            for xi, yi in zip(x, y):
                # Normalised by the module path (float) and by the plain path (uint8): equal to rounding.
                if torch.allclose(xi, yi, atol=1e-5):
                    mask.append(False)
                else:
                    torch.testing.assert_close(xi, yi.flip(-1), rtol=0, atol=1e-5)
                    mask.append(True)
            masks.append(tuple(mask))
        return masks

    masks = flip_masks(a)
    flipped = sum(map(sum, masks))
    assert flipped > 20 and sum(map(len, masks)) - flipped > 20
    full = [m for m in masks if len(m) == B]
    assert len(set(full)) == len(full), "two batches of the epoch drew the same random numbers"
    later, _ = run_loader(index_cache, workers=1, augment=RandomFlip(), shuffle=False, epoch=1)
    assert all(m != n for m, n in zip(full, flip_masks(later))), "a batch drew the same numbers in two epochs"


@pytest.mark.parametrize("slow", ["readers", "module", "model"])
def test_the_stall_meter_tells_a_slow_loader_from_a_slow_model(index_cache, slow, monkeypatch):
    """wait_share is most of the time when the data is the bottleneck — slow reader threads, or a
    generic augmentation module (which runs in the loop's thread) — and little when the loop is."""
    ds = dataset(index_cache)
    aug, step = augment.train(24), 0.0
    if slow == "readers":
        crop = augment.TrainAugment._crop_normalize_uint8

        def slow_crop(self, *args):
            time.sleep(0.03)  # in a reader thread
            return crop(self, *args)

        monkeypatch.setattr(augment.TrainAugment, "_crop_normalize_uint8", slow_crop)
    elif slow == "module":
        aug = RandomFlip(delay=0.03)
    else:
        step = 0.03
    loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=1, augment=aug)
    try:
        for _ in loader:
            time.sleep(step)
        stats = loader.stats()
    finally:
        loader.close()
    assert stats["batches"] == len(loader)
    if slow == "model":
        assert stats["wait_share"] < 0.4, stats  # batches are ready while the loop works
    else:
        assert stats["wait_share"] > 0.6, stats  # the loop waits ~30 ms for each batch


def test_close_and_garbage_collection_stop_the_reader_threads(index_cache):
    import gc

    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=2, augment=augment.train(24))
    next(iter(loader))
    threads = list(loader._threads)
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    loader.close()
    assert not any(t.is_alive() for t in threads)
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=2)
    it = iter(loader)
    next(it)
    threads = list(loader._threads)
    del it, loader  # never closed: dropping the last reference stops them
    gc.collect()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def test_a_stuck_reader_raises_instead_of_hanging(index_cache, monkeypatch):
    crop, release = augment.TrainAugment._crop_normalize_uint8, threading.Event()

    def stuck(self, *args):
        release.wait(30)  # a read that never returns (a hung network mount)
        return crop(self, *args)

    monkeypatch.setattr(augment.TrainAugment, "_crop_normalize_uint8", stuck)
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=1, augment=augment.train(24),
                                   timeout=0.5)
    started = time.perf_counter()
    try:
        with pytest.raises(TimeoutError, match=r"batch 0 .* within 0.5 s; a reader thread is stuck"):
            next(iter(loader))
        assert time.perf_counter() - started < 5
    finally:
        release.set()
        loader.close()


def test_generic_module_is_deterministic_across_reader_threads(index_cache):
    one, _ = run_loader(index_cache, workers=1, augment=RandomFlip(delay=0.002))
    three, _ = run_loader(index_cache, workers=3, augment=RandomFlip(delay=0.002))
    assert same_stream(one, three)


def test_uint8_output_mode(index_cache):
    batches, _ = run_loader(index_cache, output="uint8")
    cache = datapipe.open(index_cache.path)
    for images, labels, idx in batches:
        assert images.dtype == torch.uint8 and images.shape == (len(idx), 32, 32, 3)
        assert np.array_equal(images.numpy(), np.stack([cache[int(i)][0] for i in idx]))
        assert np.array_equal(index_of(images.numpy()), index_cache.ids[idx.numpy()])
    assert np.array_equal(np.sort(concat(batches, 2)), np.arange(index_cache.n))
    with pytest.raises(ValueError, match="augment=None"):
        datapipe.DeviceLoader(dataset(index_cache), device="cpu", output="uint8", augment=augment.train(24))


# ----------------------------------------------------------------------------- augment units


@pytest.mark.parametrize(("height", "width"), [(32, 32), (20, 50), (50, 20), (4, 300)])
def test_sample_resized_crops_respects_bounds(height, width):
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    g = torch.Generator().manual_seed(0)
    crops = augment.sample_resized_crops(4000, height, width, scale=scale, ratio=ratio, generator=g)
    assert crops.shape == (4000, 4) and crops.dtype == torch.int64
    top, left, h, w = crops.T
    assert (top >= 0).all() and (left >= 0).all() and (h >= 1).all() and (w >= 1).all()
    assert (top + h <= height).all() and (left + w <= width).all()
    # Crops found by sampling: some real (h', w') within rounding of (h, w) meets the area and ratio.
    area = height * width
    fallback = (h == h[0]) & (w == w[0]) & (top == top[0]) & (left == left[0]) if height == 4 else torch.zeros_like(h, dtype=bool)
    hf, wf = h.double(), w.double()
    found = ~fallback
    assert ((hf + 0.5) * (wf + 0.5) >= scale[0] * area)[found].all()
    assert ((hf - 0.5) * (wf - 0.5) <= scale[1] * area)[found].all()
    assert ((wf + 0.5) / (hf - 0.5).clamp(min=1e-9) >= ratio[0])[found].all()
    assert ((wf - 0.5) / (hf + 0.5) <= ratio[1])[found].all()
    # Reproducible from the generator's seed, different for another seed.
    again = augment.sample_resized_crops(4000, height, width, scale=scale, ratio=ratio,
                                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(crops, again)
    other = augment.sample_resized_crops(4000, height, width, scale=scale, ratio=ratio,
                                         generator=torch.Generator().manual_seed(1))
    if height != 4:
        assert not torch.equal(crops, other)
        assert len({tuple(c) for c in crops.tolist()}) > 100, "every sample has its own crop"


def test_sample_resized_crops_fallback_is_a_centered_clamped_crop():
    # A 4×300 image cannot hold any crop with aspect ratio ≤ 4/3 and area ≥ 8 %: the fallback
    # is the whole height and a width of round(4 · 4/3) = 5, centered.
    crops = augment.sample_resized_crops(16, 4, 300, generator=torch.Generator().manual_seed(0))
    assert crops.tolist() == [[0, (300 - 5) // 2, 4, 5]] * 16


def smooth_batch(n: int = 6, size: int = 40) -> torch.Tensor:
    y, x = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                          indexing="ij")
    images = torch.stack([128 + 100 * torch.sin(x / 9), 128 + 100 * torch.cos(y / 11),
                          (x + y) * 255 / (2 * size)], dim=-1)  # [size, size, 3]
    return images.round().to(torch.uint8)[None].repeat(n, 1, 1, 1)


def test_uint8_and_kornia_paths_agree():
    pytest.importorskip("kornia")
    images = smooth_batch()
    fast = augment.train(24, path="uint8")
    params = fast.sample(images.shape[0], 40, 40, seed=5)
    a = fast(images, params=params)
    b = augment.train(24, path="kornia")(images, params=params)
    assert a.shape == b.shape == (6, 3, 24, 24)
    diff = (a - b).abs()
    assert diff.mean() < 0.05 and diff.max() < 0.5, (float(diff.mean()), float(diff.max()))


@pytest.mark.parametrize("path", ["uint8", "kornia"])
def test_flip_flag_mirrors(path):
    if path == "kornia":
        pytest.importorskip("kornia")
    images = smooth_batch(4)
    aug = augment.train(24, path=path)
    params = aug.sample(4, 40, 40, seed=9)
    plain = aug(images, params={**params, "flip": torch.zeros(4, dtype=torch.bool)})
    mirrored = aug(images, params={**params, "flip": torch.ones(4, dtype=torch.bool)})
    assert torch.equal(mirrored, plain.flip(-1))
    assert not torch.equal(mirrored, plain)


def test_presets_are_seeded():
    images = smooth_batch(5)
    aug = augment.train(24, color_jitter=0.4)
    assert torch.equal(aug(images, seed=1), aug(images, seed=1))
    assert not torch.equal(aug(images, seed=1), aug(images, seed=2))
    out = augment.eval(24)(images)
    assert out.shape == (5, 3, 24, 24) and out.dtype == torch.float32


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


def test_dataloader_workers_check_shared_memory_before_reading(index_cache, monkeypatch):
    """The check runs in every DataLoader worker: with /dev/shm as small as Docker's default (64 MB)
    and 24 MB batches (4 in flight with 2 workers), the first batch fails with the fix named."""
    from types import SimpleNamespace

    import datapipe.dataset as dataset_module
    from datapipe.errors import DatapipeError

    seen = []

    def statvfs(path):
        seen.append(path)
        return SimpleNamespace(f_bavail=64 * 2**20 // 4096, f_frsize=4096)

    monkeypatch.setattr(dataset_module, "os", SimpleNamespace(statvfs=statvfs))  # inherited by forked workers
    ds = dataset(index_cache, batch_size=8192)  # 24 MB per batch of 32x32 samples, ~128 images at 256x256
    with pytest.raises(DatapipeError, match=r"/dev/shm has 64 MB free.*--shm-size"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")))
    assert next(iter(DataLoader(dataset(index_cache), batch_size=None, num_workers=2,
                                multiprocessing_context="fork")))[0].shape[0] == B  # small batches fit
