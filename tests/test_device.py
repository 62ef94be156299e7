"""DeviceLoader on the CPU, checked sample by sample with index-encoding images.

Deterministic augmentation and resume through the loader, 22 (no hang on a reader error) and 25
(batched augmentation in fp32/bf16 and under autocast); reads straight from the shard files.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from loader_fixtures import B, concat, dataset, index_cache_info, same_stream

import datapipe
from datapipe import augment, native
from datapipe.device import _seed_for
from datapipe.errors import IterationSupersededError
from datapipe.testing import index_of, to_uint8

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 workers, 2 cores


@pytest.fixture(scope="session")
def index_cache(tmp_path_factory):
    """101 index-encoding samples of 32×32 in shards of 7 (built once per session)."""
    return index_cache_info(tmp_path_factory)


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


def test_a_device_loader_passed_to_another_process_says_so(index_cache):
    """ddp_spawn pickles what the module holds: a DeviceLoader's threads gave "cannot pickle '_thread.lock'
    object", naming neither the loader nor the fix. Its dataset still pickles."""
    import copy
    import pickle

    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=1, output="uint8")
    try:
        for attempt in (pickle.dumps, copy.copy, copy.deepcopy):
            with pytest.raises(TypeError, match=r"a datapipe.DeviceLoader cannot be pickled or copied: .* Make it in "
                                                r"the process that reads it"):
                attempt(loader)
        assert pickle.loads(pickle.dumps(loader.dataset)).batch_size == loader.dataset.batch_size
    finally:
        loader.close()


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


@pytest.mark.parametrize("preset", ["train", "train+jitter", "eval", "convert", "convert-unnormalised", "module"])
def test_an_empty_last_batch_has_the_form_of_a_full_one(tmp_path_factory, preset):
    """The empty batch of the last rank keeps the transform's dtype and memory layout (channels_last)."""
    info = index_cache_info(tmp_path_factory, 3, shard_size=2)
    make = {"train": lambda: augment.train(24, channels_last=True, dtype=torch.bfloat16),
            "train+jitter": lambda: augment.train(24, channels_last=True, color_jitter=0.4, dtype=torch.bfloat16),
            "eval": lambda: augment.eval(24, channels_last=True, dtype=torch.bfloat16),
            "convert": lambda: augment.convert(channels_last=True, dtype=torch.bfloat16),
            "convert-unnormalised": lambda: augment.convert(channels_last=True, normalize=False, dtype=torch.bfloat16),
            "module": lambda: augment.convert(module=RandomFlip(), channels_last=True, dtype=torch.bfloat16)}[preset]
    for workers in (0, 2):
        last = []
        for rank in range(4):
            ds = datapipe.StreamingDataset(info.path, batch_size=2, rank=rank, world_size=4, return_index=True)
            loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=workers, augment=make())
            try:
                (images, _, _), = list(loader)
            finally:
                loader.close()
            last.append(images)
        full, empty = last[0], last[3]
        assert len(full) == 1 and len(empty) == 0
        assert empty.shape[1:] == full.shape[1:] and empty.dtype == full.dtype == torch.bfloat16
        assert full.is_contiguous(memory_format=torch.channels_last)
        assert empty.is_contiguous(memory_format=torch.channels_last), empty.stride()
        assert empty.stride() == torch.empty(empty.shape, memory_format=torch.channels_last).stride()


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
    """The memory layout is the batch transform's: the plain conversion's and the presets'."""
    (images, *_), = run_loader(index_cache, k=1, augment=augment.convert(channels_last=True))[0]
    assert images.is_contiguous(memory_format=torch.channels_last) and images.shape == (B, 3, 32, 32)
    (images, *_), = run_loader(index_cache, k=1, augment=augment.convert(channels_last=True, normalize=False))[0]
    assert images.is_contiguous(memory_format=torch.channels_last)
    (images, *_), = run_loader(index_cache, k=1, augment=augment.convert(channels_last=True, module=RandomFlip()))[0]
    assert images.is_contiguous(memory_format=torch.channels_last)
    (images, *_), = run_loader(index_cache, k=1, augment=augment.eval(24, channels_last=True))[0]
    assert images.is_contiguous(memory_format=torch.channels_last)
    (images, *_), = run_loader(index_cache, k=1, augment=augment.train(24, channels_last=True))[0]
    assert images.is_contiguous(memory_format=torch.channels_last) and images.shape == (B, 3, 24, 24)
    for preset in (augment.train(24), augment.eval(24), None, RandomFlip()):
        (images, *_), = run_loader(index_cache, k=1, augment=preset)[0]
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
    for j, (images, _labels, idx) in enumerate(direct):
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
    for v, i in zip(views, [2, 7, index_cache.n - 1], strict=True):  # sorted, as read_batch orders them
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


def test_augmentation_is_deterministic_for_any_reader_count(index_cache):
    one, _ = run_loader(index_cache, workers=1, augment=augment.train(24))
    three, _ = run_loader(index_cache, workers=3, prefetch=3, augment=augment.train(24))
    again, _ = run_loader(index_cache, workers=1, augment=augment.train(24))
    assert same_stream(one, three) and same_stream(one, again)
    other_seed, _ = run_loader(index_cache, workers=1, augment=augment.train(24), seed=4, shuffle=False)
    other_epoch, _ = run_loader(index_cache, workers=1, augment=augment.train(24), seed=4, shuffle=False, epoch=1)
    # Same samples in the same batches (no shuffle), another epoch: other crops and flips.
    assert all(torch.equal(a[2], b[2]) for a, b in zip(other_seed, other_epoch, strict=True))
    assert not any(torch.equal(a[0], b[0]) for a, b in zip(other_seed, other_epoch, strict=True))


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
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", timeout=20)
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


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_the_state_says_what_the_loop_received_of_the_current_epoch(index_cache, workers):
    """Every transition: a fresh loader, set_epoch, a full epoch, a break, a new pass, load_state_dict."""
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=workers, output="uint8")
    n = len(loader)

    def where() -> tuple[int, int]:
        state = loader.state_dict()
        return state["epoch"], state["position"]

    try:
        assert where() == (0, 0)
        loader.set_epoch(0)
        assert where() == (0, 0)
        for k, _ in enumerate(loader, 1):
            assert where() == (0, min(k * B, index_cache.n))
        assert where() == (0, index_cache.n)
        loader.set_epoch(1)
        assert where() == (1, 0), "a new epoch, nothing of it read"
        for k, _ in enumerate(loader, 1):
            if k == 3:
                break
        assert where() == (1, 3 * B)
        loader.set_epoch(2)
        assert where() == (2, 0), "after an epoch ended by break"
        it = iter(loader)
        assert where() == (2, 0)
        next(it)
        assert where() == (2, B)
        it = iter(loader)  # a new pass over the same epoch begins here, not at its first batch
        assert where() == (2, 0)
        del it
        loader.load_state_dict({**loader.state_dict(), "position": 5 * B})
        assert where() == (2, 5 * B)
        loader.set_epoch(2)
        assert where() == (2, 5 * B), "set_epoch to the loaded epoch keeps the loaded position"
        it = iter(loader)
        assert where() == (2, 5 * B)
        next(it)
        assert where() == (2, 6 * B)
        assert len(list(it)) == n - 6
        assert where() == (2, index_cache.n)
        loader.set_epoch(3)
        assert where() == (3, 0), "after a resumed epoch"
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_saved_at_the_start_of_an_epoch_resumes_all_of_it(index_cache, workers):
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=workers, output="uint8")
    try:
        for epoch, stop in ((0, None), (1, 4)):  # a full epoch, then one ended by break
            loader.set_epoch(epoch)
            for k, _ in enumerate(loader, 1):
                if k == stop:
                    break
        loader.set_epoch(2)
        state = loader.state_dict()
    finally:
        loader.close()
    fresh = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=workers, output="uint8")
    try:
        fresh.load_state_dict(state)
        fresh.set_epoch(2)
        assert np.array_equal(np.sort(concat([tuple(t.clone() for t in b) for b in fresh], 2)), np.arange(index_cache.n))
    finally:
        fresh.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_again_inside_the_loop_ends_the_outer_iteration_at_once(index_cache, workers):
    """next(iter(loader)) inside the loop: the outer iterator's next batch raises one clear line at
    once (not after the timeout, and never blaming a reader thread); the loader goes on working."""
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=workers,
                                   augment=augment.train(24), timeout=30)
    started = time.perf_counter()
    try:
        with pytest.raises(IterationSupersededError, match=r"iterated again .* only the newest iteration runs") as excinfo:
            for step, _ in enumerate(loader):
                if step == 2:
                    peek = next(iter(loader))
        assert time.perf_counter() - started < 15
        message = str(excinfo.value)
        assert "\n" not in message and "reader thread" not in message
        assert isinstance(excinfo.value, RuntimeError) and isinstance(excinfo.value, datapipe.errors.DatapipeError)
        assert peek[0].shape == (B, 3, 24, 24)
        assert len(list(loader)) == len(loader)
    finally:
        loader.close()


@pytest.mark.timeout(60)
def test_an_iterator_left_behind_raises_once_another_begins_or_the_epoch_changes(index_cache):
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=2, output="uint8", timeout=5)
    try:
        first = iter(loader)
        next(first)
        second = iter(loader)
        with pytest.raises(IterationSupersededError, match="iterated again"):
            next(first)  # raised although the second has not yielded yet: it began at iter()
        assert next(second)[2].tolist() == next(iter(dataset(index_cache)))[2].tolist()
        third = iter(loader)
        next(third)
        loader.set_epoch(1)
        with pytest.raises(IterationSupersededError, match="epoch or position changed"):
            next(third)
        assert loader.state_dict()["position"] == 0
        fourth = iter(loader)
        next(fourth)
        loader.load_state_dict({**loader.state_dict(), "position": 2 * B})
        with pytest.raises(IterationSupersededError, match="epoch or position changed"):
            next(fourth)
        assert loader.state_dict()["position"] == 2 * B
        assert len(list(loader)) == len(loader) - 2  # len(): the whole epoch, the iteration the rest
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


@pytest.mark.lifecycle
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


@pytest.mark.lifecycle
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
    batches, _ = run_loader(index_cache, k=3, augment=augment.train(24, dtype=torch.bfloat16))
    plain, _ = run_loader(index_cache, k=3, augment=augment.convert(dtype=torch.bfloat16))
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 3))
    for (images, labels, idx), (raw, _, _) in zip(batches, plain, strict=True):
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
            for images, _, _ in loader:
                autocast_batches.append(images)
                assert model(images).dtype == torch.bfloat16
    finally:
        loader.close()
    assert len(autocast_batches) == len(loader) and autocast_batches[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["uint8", "kornia"])
def test_half_precision_outputs_on_both_augment_paths(index_cache, dtype, path):
    """fp16 and bf16 batches from the CPU (uint8) path and the batched Kornia path that CUDA uses."""
    batches, _ = run_loader(index_cache, k=2, augment=augment.train(24, path=path, dtype=dtype))
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
        for (x, *_), (y, *_) in zip(batches, plain, strict=True):
            mask = []
            for xi, yi in zip(x, y, strict=True):
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
    assert all(m != n for m, n in zip(full, flip_masks(later), strict=False)), "a batch drew the same numbers in two epochs"


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
        step = 0.06  # twice the readers' delay above: a loaded machine's reader thread still keeps ahead
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
    with datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=2) as loader:
        next(iter(loader))
        threads = list(loader._threads)
        assert len(threads) == 2 and all(t.is_alive() for t in threads)
    assert not any(t.is_alive() for t in threads)  # the with block's end closed it
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=2)
    it = iter(loader)
    next(it)
    threads = list(loader._threads)
    del it, loader  # never closed: dropping the last reference stops them
    gc.collect()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)


def held_reader_loader(info, monkeypatch, timeout: float) -> tuple[datapipe.DeviceLoader, threading.Event]:
    """A one-reader loader whose reads wait until the event is set (a hung or slow network mount)."""
    crop, release = augment.TrainAugment._crop_normalize_uint8, threading.Event()

    def held(self, *args):
        release.wait(30)
        return crop(self, *args)

    monkeypatch.setattr(augment.TrainAugment, "_crop_normalize_uint8", held)
    loader = datapipe.DeviceLoader(dataset(info), device="cpu", num_workers=1, augment=augment.train(24),
                                   timeout=timeout)
    return loader, release


def test_a_stuck_reader_raises_instead_of_hanging(index_cache, monkeypatch):
    loader, release = held_reader_loader(index_cache, monkeypatch, timeout=0.5)
    started = time.perf_counter()
    try:
        with pytest.raises(TimeoutError, match=r"batch 0 .* within 0.5 s; a reader thread is stuck"):
            next(iter(loader))
        assert time.perf_counter() - started < 5
    finally:
        release.set()
        loader.close()


def test_a_wait_that_ended_in_a_timeout_and_the_wait_for_the_readers_count_as_waiting(index_cache, monkeypatch):
    """A timeout the loop caught was charged to the model's step (3% waiting where the loop waited 75% of the
    time), and so was an iteration begun while the readers finished the one it replaced."""
    loader, release = held_reader_loader(index_cache, monkeypatch, timeout=2)
    try:
        with pytest.raises(TimeoutError):
            next(iter(loader))
        assert loader.stats()["wait_s"] >= 2  # blocked for the whole timeout, however busy the machine
        threading.Timer(0.6, release.set).start()  # the stuck read ends 0.6 s from now
        iter(loader)  # waits (up to the timeout) for the readers to finish the abandoned iteration's read
        assert loader.stats()["wait_s"] >= 2 + 0.5  # of which at least 0.5 s after iter() began, however late
    finally:
        release.set()
        loader.close()


def test_waits_that_ended_in_a_timeout_with_no_batch_are_the_loops_whole_time(index_cache, monkeypatch):
    """With no batch received, the wall time was 0: after three caught timeouts the meter said 0 % waiting."""
    loader, release = held_reader_loader(index_cache, monkeypatch, timeout=0.3)
    try:
        for _ in range(3):
            with pytest.raises(TimeoutError):
                next(iter(loader))
        stats = loader.stats()
        assert stats["batches"] == 0 and stats["wait_s"] >= 0.9
        assert stats["seconds"] >= stats["wait_s"] and stats["wait_share"] > 0.5, stats
        assert stats["recent"]["wait_share"] == stats["wait_share"], stats
    finally:
        release.set()
        loader.close()


def readers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("datapipe-reader-")]


INTERRUPT_POINTS = ["first-thread-started", "last-thread-started", "waiting-for-readers", "submitting-a-batch"]


@pytest.mark.parametrize("where", INTERRUPT_POINTS)
def test_ctrl_c_while_a_loader_starts_leaves_nothing_behind_and_the_loop_runs_again(index_cache, where, monkeypatch):
    """Ctrl-C can land between any two steps of the loop's thread (a notebook cell stopped as it begins):
    at each step of starting the readers and of handing them a batch, the loader stops what it started,
    keeps the caller's torch thread count, and the loop run again reads the whole epoch (it waited out
    its timeout and said a reader was stuck, and left reader threads behind)."""
    expected, _ = run_loader(index_cache, workers=3)
    before_threads, before_count = set(readers_alive()), torch.get_num_threads()
    ds = dataset(index_cache)
    loader = datapipe.DeviceLoader(ds, device="cpu", num_workers=3, timeout=20)
    main = threading.current_thread()
    start, wait, calls = threading.Thread.start, threading.Barrier.wait, []

    def interrupted_start(self):
        start(self)
        if self.name.startswith("datapipe-reader-"):
            calls.append(self.name)
            if (where == "first-thread-started" and len(calls) == 1) or \
                    (where == "last-thread-started" and len(calls) == 3):
                raise KeyboardInterrupt

    def interrupted_wait(self, *args):
        if threading.current_thread() is main:
            raise KeyboardInterrupt
        return wait(self, *args)

    if where == "submitting-a-batch":
        class Jobs:  # the loop is stopped just before a job reaches the readers
            def __init__(self, jobs):
                self.jobs = jobs

            def put(self, job):
                if job is not None and not calls:
                    calls.append(job)
                    raise KeyboardInterrupt
                self.jobs.put(job)

        iter(loader)  # readers started; the next iteration hands out its batches through the wrapper
        loader._jobs = Jobs(loader._jobs)
    else:
        monkeypatch.setattr(threading.Thread, "start", interrupted_start)
        monkeypatch.setattr(threading.Barrier, "wait", interrupted_wait if where == "waiting-for-readers" else wait)
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                pass
        monkeypatch.undo()
        assert torch.get_num_threads() == before_count
        if where != "submitting-a-batch":  # nothing half-started stays
            for t in set(readers_alive()) - before_threads:
                t.join(10)
            assert set(readers_alive()) == before_threads
        started = time.perf_counter()
        got = [tuple(t.clone() for t in batch) for batch in loader]
        assert time.perf_counter() - started < 10  # no wait for the timeout
        assert same_stream(got, expected)
    finally:
        loader.close()
    for t in set(readers_alive()) - before_threads:
        t.join(10)
    assert set(readers_alive()) == before_threads


@pytest.mark.parametrize("workers", [0, 2])
def test_close_during_an_iteration_ends_it_at_once_with_one_clear_error(index_cache, workers):
    """close() while a loop iterates (the loop's own thread, or another while the loop waits for a batch):
    the next batch says the loader was closed, at once (it waited out the timeout and said a reader was
    stuck); a close() after the last batch ends the loop as usual."""
    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=workers, timeout=60)
    it = iter(loader)
    next(it)
    loader.close()
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"DeviceLoader was closed \(close\(\)\) while an iteration ran"):
        next(it)
    assert time.perf_counter() - started < 5
    with pytest.raises(RuntimeError, match="was closed"):
        iter(loader)

    loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=workers, timeout=60)
    batches = list(loader)
    it = iter(loader)
    for _ in batches:
        next(it)
    loader.close()  # after the last batch
    with pytest.raises(StopIteration):
        next(it)


def test_close_from_another_thread_wakes_a_loop_waiting_for_a_batch(index_cache, monkeypatch):
    loader, release = held_reader_loader(index_cache, monkeypatch, timeout=60)
    closer = threading.Timer(0.3, loader.close)  # a watchdog or shutdown handler
    started = time.perf_counter()
    try:
        closer.start()
        with pytest.raises(RuntimeError, match="DeviceLoader was closed"):
            next(iter(loader))
        assert time.perf_counter() - started < 10
    finally:
        release.set()
        closer.join()
        loader.close()


def test_generic_module_is_deterministic_across_reader_threads(index_cache):
    one, _ = run_loader(index_cache, workers=1, augment=RandomFlip(delay=0.002))
    three, _ = run_loader(index_cache, workers=3, augment=RandomFlip(delay=0.002))
    assert same_stream(one, three)


def test_uint8_output_mode(index_cache):
    batches, _ = run_loader(index_cache, output="uint8")
    cache = datapipe.open(index_cache.path)
    for images, _labels, idx in batches:
        assert images.dtype == torch.uint8 and images.shape == (len(idx), 32, 32, 3)
        assert np.array_equal(images.numpy(), np.stack([cache[int(i)][0] for i in idx]))
        assert np.array_equal(index_of(images.numpy()), index_cache.ids[idx.numpy()])
    assert np.array_equal(np.sort(concat(batches, 2)), np.arange(index_cache.n))
    with pytest.raises(ValueError, match="augment=None"):
        datapipe.DeviceLoader(dataset(index_cache), device="cpu", output="uint8", augment=augment.train(24))


def test_the_stall_meter_counts_every_step_and_not_the_time_after_the_epoch(index_cache):
    """img/s over an epoch counts the loop's step after its last batch too (N batches, N steps), and ends when
    the loop asks for a batch past the last: time spent after the epoch, before stats(), is not counted."""
    ds = dataset(index_cache, batch_size=16)
    loader = datapipe.DeviceLoader(ds, device="cpu", output="uint8", num_workers=1)
    step = 0.05
    try:
        for _ in loader:
            time.sleep(step)
        time.sleep(0.5)  # after the epoch: the meter stopped already
        s = loader.stats()
    finally:
        loader.close()
    n = len(loader)
    assert s["batches"] == n and s["seconds"] >= n * step  # every step, the last one's too
    assert s["seconds"] < n * step + 0.4, s  # without the half second after the epoch
    assert s["images_per_s"] <= 16 / step


def test_cpu_readers_run_one_intra_op_thread_and_leave_the_processes_count_alone(index_cache, monkeypatch):
    """Each reader augments with one intra-op thread; the thread that made and iterated the loader, and threads
    started after it, keep the process's count (torch.set_num_threads in a reader set the process's default,
    which a training loop that had not used torch yet then took: it trained on one core)."""
    seen: set[tuple[str, int]] = set()
    real = augment._resize_crop

    def probe(*args, **kwargs):
        seen.add((threading.current_thread().name, torch.get_num_threads()))
        return real(*args, **kwargs)

    monkeypatch.setattr(augment, "_resize_crop", probe)
    original = torch.get_num_threads()
    count = original + 2  # a count of the user's own, told apart from 1 and from the machine's default
    torch.set_num_threads(count)
    try:
        after: dict[str, int] = {}

        def train_loop() -> None:  # a thread that has not used torch's pool before the loader starts
            loader = datapipe.DeviceLoader(dataset(index_cache), device="cpu", num_workers=2, augment=augment.train(16))
            for _ in loader:
                pass
            loader.close()
            after["loop"] = torch.get_num_threads()
            later = threading.Thread(target=lambda: after.setdefault("later", torch.get_num_threads()))
            later.start()
            later.join()

        loop = threading.Thread(target=train_loop)
        loop.start()
        loop.join(120)
        assert after == {"loop": count, "later": count}
        assert torch.get_num_threads() == count
        readers = {n for name, n in seen if name.startswith("datapipe-reader-")}
        assert readers == {1} and len({name for name, _ in seen}) == 2, seen
    finally:
        torch.set_num_threads(original)
