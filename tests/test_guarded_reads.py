"""Reads of memory-mapped shard files under the SIGBUS guard: fast, and no signal kills a reader.

The cache copies samples out of memory maps (and hands the CPU train preset views of them) only
where the compiled guard is in place. A page that vanished under a guarded read (the file was
truncated) is the CorruptShardError naming the shard, on every read path — the uint8 gather, the
CPU presets' crops read from mapped views, DataLoader worker processes — and with
DATAPIPE_NATIVE=0 (positioned reads) too. Every other SIGBUS still ends the process as it would
have: the guard chains to the handler installed before it, so Python's faulthandler, enabled
before or after datapipe's import, still reports a genuine one. The guard re-arms after a caught
fault and holds for several threads faulting at once.

Anything that could die of SIGBUS runs in a child process, so a broken guard fails a test instead
of killing the test run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import datapipe
from datapipe import augment, native
from datapipe.errors import CorruptShardError, MappedReadError
from datapipe.shards import images_path
from datapipe.testing import build_index_cache

N, SHARD = 40, 7  # 6 shards of 32x32 samples: 5 of 7 and one of 5
needs_guard = pytest.mark.skipif(not native.guard_available(), reason=f"no SIGBUS guard: {native.describe()}")
BUS_ERROR = "Fatal Python error: Bus error"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_index_cache(tmp_path_factory.mktemp("guarded"), N, shard_size=SHARD)


@pytest.fixture
def cache_dir(built, tmp_path) -> Path:
    """A private copy of the built cache, free to damage."""
    return Path(shutil.copytree(built, tmp_path / "cache"))


def run_child(code: str, *args: str, native_on: bool = True, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DATAPIPE_NATIVE"}
    if not native_on:
        env["DATAPIPE_NATIVE"] = "0"
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def explain(done: subprocess.CompletedProcess) -> str:
    return f"rc {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"


# ----------------------------------------------------------------------------- the guard itself

MAPPED_FILE = """
import os, sys, threading
import numpy as np
from datapipe import native  # numpy's arrays alone: torch is imported only by the cases that use it
from datapipe.errors import MappedReadError

PAGE = os.sysconf("SC_PAGE_SIZE")


def mapped_file(path, pages):
    data = np.random.default_rng(0).integers(0, 256, pages * PAGE, dtype=np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    return native.Mapping(fd, pages * PAGE), data


def faults(fn):
    try:
        fn()
    except MappedReadError as exc:
        return exc
    return None
"""


@needs_guard
def test_a_fault_in_a_guarded_gather_is_an_error_and_the_guard_rearms(tmp_path):
    code = MAPPED_FILE + textwrap.dedent("""
    m, data = mapped_file(sys.argv[1], 16)
    out = np.empty((3, 2 * PAGE), np.uint8)
    native.gather(out.ctypes.data, m, np.array([0, 5 * PAGE, 14 * PAGE]), 2 * PAGE)
    assert np.array_equal(out[1], data[5 * PAGE : 7 * PAGE]) and np.array_equal(out[2], data[14 * PAGE :])
    os.truncate(sys.argv[1], 3 * PAGE + 100)  # pages 0-2 whole, page 3 partly, the rest gone
    for attempt in range(5):  # the same thread, again and again: the guard re-arms each time
        exc = faults(lambda: native.gather(out.ctypes.data, m, np.array([0, 6 * PAGE]), 2 * PAGE))
        assert exc is not None and exc.address == m.address + 6 * PAGE, (attempt, exc)
        assert "\\n" not in str(exc) and "shrank" in str(exc)
    native.gather(out.ctypes.data, m, np.array([PAGE]), 2 * PAGE)  # what is left still reads
    assert np.array_equal(out[0], data[PAGE : 3 * PAGE])
    assert native.guard_faults() == 5
    try:
        native.gather(out.ctypes.data, m, np.array([15 * PAGE]), 2 * PAGE)  # past the end of the map
    except ValueError as exc:
        assert "outside the mapping" in str(exc)
    else:
        raise AssertionError("an offset past the map was read")
    print("OK")
    """)
    done = run_child(code, str(tmp_path / "data.bin"))
    assert done.returncode == 0 and done.stdout.strip() == "OK", explain(done)


@needs_guard
def test_a_guarded_gather_of_spans_copies_samples_of_their_own_sizes_and_faults_as_an_error(tmp_path):
    """JPEG samples (each of its own size) are copied out of a shard's map in one call per shard."""
    code = MAPPED_FILE + textwrap.dedent("""
    m, data = mapped_file(sys.argv[1], 16)
    offsets, sizes = np.array([5, PAGE + 3, 9 * PAGE, 14 * PAGE]), np.array([100, 2 * PAGE, 1, 2 * PAGE])
    dst = np.array([0, 200, 200 + 2 * PAGE, 300 + 2 * PAGE])
    out = np.zeros(300 + 4 * PAGE, np.uint8)
    native.gather_spans(out.ctypes.data, m, offsets, sizes, dst)
    for o, n, d in zip(offsets, sizes, dst):
        assert np.array_equal(out[d : d + n], data[o : o + n]), (o, n, d)
    assert not out[100:200].any(), "bytes between the spans were written"
    os.truncate(sys.argv[1], 3 * PAGE + 100)
    exc = faults(lambda: native.gather_spans(out.ctypes.data, m, offsets, sizes, dst))
    assert exc is not None and exc.address == m.address + 9 * PAGE, exc
    native.gather_spans(out.ctypes.data, m, offsets[:2], sizes[:2], dst[:2])  # what is left still reads
    for bad in ((np.array([15 * PAGE]), np.array([2 * PAGE])), (np.array([-1]), np.array([1])), (np.array([0]), np.array([-1]))):
        try:
            native.gather_spans(out.ctypes.data, m, bad[0], bad[1], np.array([0]))
        except ValueError as exc:
            assert "outside the mapping" in str(exc)
        else:
            raise AssertionError(f"a span outside the map was read: {bad}")
    print("OK")
    """)
    done = run_child(code, str(tmp_path / "data.bin"))
    assert done.returncode == 0 and done.stdout.strip() == "OK", explain(done)


@needs_guard
def test_the_guarded_resize_and_conversion_fault_as_errors_and_read_the_same_pixels(tmp_path):
    code = MAPPED_FILE + textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    m, data = mapped_file(sys.argv[1], 256)  # 1 MiB: a 512 x 512 RGB image
    img = torch.from_numpy(m.array()[: 512 * 512 * 3].reshape(512, 512, 3))
    ref = torch.from_numpy(data[: 512 * 512 * 3].reshape(512, 512, 3)).clone()
    crop = (slice(40, 440), slice(30, 330))
    out = torch.empty((224, 224, 3), dtype=torch.uint8)
    assert native.resize(img[crop], out)
    want = F.interpolate(ref[crop].permute(2, 0, 1)[None], size=(224, 224), mode="bilinear", antialias=True)
    assert torch.equal(out, want[0].permute(1, 2, 0))
    conv = native.converter((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    planes, expected = torch.empty(3, 400, 300), torch.empty(3, 400, 300)
    conv(img[crop], planes, True)
    conv(ref[crop], expected, True)
    assert torch.equal(planes, expected)
    os.truncate(sys.argv[1], 100 * PAGE)  # rows from 133 on are gone
    for _ in range(3):
        exc = faults(lambda: native.resize(img[crop], out))
        assert exc is not None and exc.address in m, exc
        exc = faults(lambda: conv(img[crop], planes, False))
        assert exc is not None and exc.address in m, exc
    assert native.resize(img[:100], torch.empty((50, 60, 3), dtype=torch.uint8))  # rows still there
    conv(img[:100, :300], torch.empty(3, 100, 300), False)
    assert native.guard_faults() == 6
    print("OK")
    """)
    done = run_child(code, str(tmp_path / "image.bin"))
    assert done.returncode == 0 and done.stdout.strip() == "OK", explain(done)


@needs_guard
def test_threads_faulting_at_once_each_get_their_error(tmp_path):
    code = MAPPED_FILE + textwrap.dedent("""
    m, data = mapped_file(sys.argv[1], 64)
    os.truncate(sys.argv[1], 8 * PAGE)
    caught, good, problems = [0] * 4, [0], []

    def faulting(k):
        out = np.empty(4 * PAGE, np.uint8)
        for i in range(300):
            exc = faults(lambda: native.gather(out.ctypes.data, m, np.array([(8 + (i + k) % 50) * PAGE]), 4 * PAGE))
            if exc is None or exc.address < m.address + 8 * PAGE:
                problems.append((k, i, exc))
            caught[k] += 1

    def reading():
        out = np.empty(8 * PAGE, np.uint8)
        for _ in range(300):
            native.gather(out.ctypes.data, m, np.array([0]), 8 * PAGE)
            if not np.array_equal(out, data[: 8 * PAGE]):
                problems.append("bad read")
            good[0] += 1

    threads = [threading.Thread(target=faulting, args=(k,)) for k in range(4)] + [threading.Thread(target=reading)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not problems and caught == [300] * 4 and good == [300], (problems[:3], caught, good)
    assert native.guard_faults() == 1200
    print("OK")
    """)
    done = run_child(code, str(tmp_path / "data.bin"))
    assert done.returncode == 0 and done.stdout.strip() == "OK", explain(done)


@needs_guard
@pytest.mark.parametrize("where", ["destination", "unguarded-numpy", "unguarded-torch-view"])
def test_a_fault_outside_a_guarded_source_still_kills_with_sigbus(tmp_path, where):
    """Only faults in the range a guarded call declared are caught: a truncated map written to, or read
    by numpy or torch outside the guard, still ends the process with SIGBUS (the guard is armed)."""
    code = MAPPED_FILE + textwrap.dedent("""
    if sys.argv[2] == "unguarded-torch-view":
        import torch
    good, _ = mapped_file(sys.argv[1] + ".good", 4)
    bad, _ = mapped_file(sys.argv[1], 4)
    os.truncate(sys.argv[1], 0)
    native.guard_arm()
    exc = faults(lambda: native.gather(np.empty(PAGE, np.uint8).ctypes.data, bad, np.array([PAGE]), PAGE))
    assert exc is not None  # the guard is in place and catches its own reads
    print("armed", flush=True)
    where = sys.argv[2]
    if where == "destination":  # a guarded gather from a good map into a vanished one
        native.gather(bad.address, good, np.array([0]), PAGE)
    elif where == "unguarded-numpy":
        print(int(bad.array()[2 * PAGE]))
    else:
        print(torch.from_numpy(bad.array()).sum())
    print("survived", flush=True)
    """)
    done = run_child(code, str(tmp_path / "data.bin"), where)
    assert done.returncode == -signal.SIGBUS and done.stdout.strip() == "armed", explain(done)


# Python's faulthandler in the child: enabled before datapipe's import, after it (with and without a
# guarded call since, which reinstalls the guard over it), enabled twice, enabled and disabled.
FAULTHANDLER = MAPPED_FILE.replace("import os, sys, threading", """import faulthandler, os, sys, threading
plan = sys.argv[2].split(",")
if "before" in plan:
    faulthandler.enable()""") + """
m, data = mapped_file(sys.argv[1], 8)
os.truncate(sys.argv[1], 2 * PAGE)
out = np.empty(PAGE, np.uint8)
caught = 0
for step in plan:
    if step == "enable":
        faulthandler.enable()
    elif step == "disable":
        faulthandler.disable()
    elif step == "catch":  # a guarded fault: an error, and no report from faulthandler
        assert faults(lambda: native.gather(out.ctypes.data, m, np.array([5 * PAGE]), PAGE)) is not None
        caught += 1
print("caught", caught, flush=True)
print(int(m.array()[6 * PAGE]))  # a genuine SIGBUS: a mapped page read outside any guard
print("survived", flush=True)
"""


@needs_guard
@pytest.mark.parametrize("plan", [
    "catch",
    "before,catch",
    "before,catch,enable,catch",
    "catch,enable",
    "catch,enable,catch",
    "catch,enable,catch,disable,catch",
    "catch,enable,catch,disable,enable,catch",
    "before,catch,disable,catch",
])
def test_faulthandler_still_reports_a_genuine_sigbus(tmp_path, plan):
    done = run_child(FAULTHANDLER, str(tmp_path / "data.bin"), plan)
    steps = plan.split(",")
    enabled = False
    for step in steps:
        enabled = {"before": True, "enable": True, "disable": False}.get(step, enabled)
    assert done.returncode == -signal.SIGBUS, explain(done)
    assert done.stdout.strip() == f"caught {steps.count('catch')}", explain(done)
    # exactly one report when faulthandler is on at the genuine fault, none for the caught ones
    assert done.stderr.count(BUS_ERROR) == (1 if enabled else 0), explain(done)
    if enabled:
        assert "in <module>" in done.stderr.split(BUS_ERROR)[1]


@needs_guard
@pytest.mark.parametrize("order", ["handler-first", "guard-first"])
def test_a_sigbus_sent_to_the_process_reaches_its_python_handler(tmp_path, order):
    """kill(SIGBUS) is no fault of a guarded read: the plain handler installed before goes on to run."""
    code = MAPPED_FILE + textwrap.dedent("""
    import signal
    got = []
    if sys.argv[2] == "handler-first":
        signal.signal(signal.SIGBUS, lambda signum, frame: got.append(signum))
    m, data = mapped_file(sys.argv[1], 4)
    os.truncate(sys.argv[1], PAGE)
    assert faults(lambda: native.gather(np.empty(PAGE, np.uint8).ctypes.data, m, np.array([2 * PAGE]), PAGE))
    if sys.argv[2] == "guard-first":
        signal.signal(signal.SIGBUS, lambda signum, frame: got.append(signum))
        assert faults(lambda: native.gather(np.empty(PAGE, np.uint8).ctypes.data, m, np.array([2 * PAGE]), PAGE))
    os.kill(os.getpid(), signal.SIGBUS)
    for _ in range(100):
        if got:
            break
    assert got == [signal.SIGBUS], got
    print("OK")
    """)
    done = run_child(code, str(tmp_path / "data.bin"), order)
    assert done.returncode == 0 and done.stdout.strip() == "OK", explain(done)


# ----------------------------------------------------------------------------- through the cache

READER = """
import json, os, sys
from pathlib import Path
import numpy as np, torch
import datapipe
import datapipe.cache as cache_module
from datapipe import augment, native
from datapipe.errors import DatapipeError
from datapipe.shards import images_path
from datapipe.testing import index_map, index_of

caches, when, modes = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
DAMAGED = 3  # shard 000003.zarr: samples 21..27
REAL = native.gather, cache_module._pread_full
KEEP = []  # a DataLoader iterator that met the error: its workers end with this process, not at its collection


def read(mode):
    cache_dir = caches / mode  # a private copy per mode
    data = images_path(cache_dir / "shards" / "000003.zarr")
    ids = index_map(cache_dir)
    ds = datapipe.StreamingDataset(cache_dir, batch_size=4, seed=1, return_index=True)
    state = {"damaged": False}

    def damage():
        if not state["damaged"]:
            os.truncate(data, 0)
            state["damaged"] = True

    if when == "inside":
        # The file shrinks after the checks, right before the read itself, so the read faults (mapped)
        # or comes up short (positioned reads): views handed out, then damaged before the preset crops
        # them; the damaged shard's map, or its descriptor, damaged just before it is copied from.
        cache = ds.cache
        real_views = cache.sample_views
        real_gather, real_pread = REAL

        def sample_views(indices, *args, **kwargs):
            views = real_views(indices, *args, **kwargs)
            if np.any((np.asarray(indices) >= 21) & (np.asarray(indices) < 28)):
                damage()
            return views

        def gather(dst, mapping, offsets, nbytes):
            if cache._map_ranges.get(mapping.address, (0, -1))[1] == DAMAGED:
                damage()
            return real_gather(dst, mapping, offsets, nbytes)

        def pread_full(fd, buf, offset):
            entry = cache._files._open.get(DAMAGED)
            if entry is not None and entry.fd == fd:
                damage()
            return real_pread(fd, buf, offset)

        cache.sample_views, native.gather, cache_module._pread_full = sample_views, gather, pread_full

    workers = 1 if when == "inside" else 2  # one reader thread: the damage and the read in one order
    if mode == "uint8":
        loader = datapipe.DeviceLoader(ds, device="cpu", output="uint8", num_workers=workers, prefetch=1)
    elif mode in ("train", "eval"):
        preset = augment.train(24) if mode == "train" else augment.eval(24)
        loader = datapipe.DeviceLoader(ds, device="cpu", augment=preset, num_workers=workers, prefetch=1)
    else:
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=1)
    for epoch in range(4):
        ds.set_epoch(epoch) if mode == "dataloader" else loader.set_epoch(epoch)
        batches = iter(loader)
        KEEP.append(batches)
        for batch, (images, labels, index) in enumerate(batches):
            i = index.numpy()
            assert np.array_equal(labels.numpy(), ids[i] % 3)
            if mode in ("uint8", "dataloader"):  # every image is the sample its index names
                assert np.array_equal(index_of(images.numpy()), ids[i])
            if when == "between" and batch == 1:
                damage()
        KEEP.pop()


for mode in modes:  # one process reads every mode, each from its own copy, its error reported on one line
    faults = native.guard_faults()
    try:
        read(mode)
        result = {"mode": mode, "error": None}
    except DatapipeError as exc:
        result = {"mode": mode, "error": type(exc).__name__, "message": str(exc)}
    finally:
        native.gather, cache_module._pread_full = REAL
    result["caught"] = native.guard_faults() - faults
    print(json.dumps(result), flush=True)
"""
MODES = ("uint8", "train", "eval", "dataloader")  # the DataLoader last: its iterator's workers end with the process


@pytest.mark.parametrize("native_on", [True, False], ids=["mapped", "DATAPIPE_NATIVE=0"])
@pytest.mark.parametrize("when", ["inside", "between"])
def test_a_shard_truncated_under_a_running_reader_is_the_error_naming_it(built, tmp_path, when, native_on):
    """Every read path, in one child process per case: the uint8 gather, the train and eval presets, and
    DataLoader worker processes."""
    if native_on and not native.guard_available():
        pytest.skip(f"no SIGBUS guard: {native.describe()}")
    for mode in MODES:
        shutil.copytree(built, tmp_path / mode)
    done = run_child(READER, str(tmp_path), when, *MODES, native_on=native_on)
    assert done.returncode == 0, explain(done)  # not -7 (SIGBUS), 135, or an AssertionError (1)
    results = {r["mode"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert list(results) == list(MODES), explain(done)
    for mode, result in results.items():
        assert result["error"] == "CorruptShardError" and "000003.zarr" in result["message"], (mode, explain(done))
        if native_on and when == "inside" and mode in ("uint8", "train", "eval"):  # the read itself faulted
            assert "ends early" in result["message"].splitlines()[0] and result["caught"] == 1, (mode, explain(done))
        if not native_on or mode == "dataloader":
            assert result["caught"] == 0, (mode, explain(done))  # no fault in this process


@needs_guard
def test_a_truncated_last_page_that_reads_as_zeros_is_still_an_error(cache_dir):
    """Past the end of a truncated file, the rest of its last page reads as zeros without a fault:
    the shard files are checked again after a gather and after the views are read."""
    cache = datapipe.open(cache_dir)
    data = images_path(cache_dir / "shards" / "000001.zarr")
    out, labels = np.empty((7, 32, 32, 3), np.uint8), np.empty(7, np.int64)
    views = cache.sample_views(np.arange(7, 14), labels, mapped=True)
    page, size = os.sysconf("SC_PAGE_SIZE"), 32 * 32 * 3
    k = next(k for k in range(7) if k * size // page == ((k + 1) * size - 1) // page)  # a sample inside one page
    os.truncate(data, k * size // page * page + 1)  # that page: one byte, then zeros; later pages gone
    with pytest.raises(CorruptShardError, match="000001.zarr"), cache.mapped_reads(np.arange(7, 14)):
        crops = augment.train(24)([views[k]], seed=0)  # no fault: the page exists
        assert crops.shape == (1, 3, 24, 24)
    with pytest.raises(CorruptShardError, match="000001.zarr"):
        cache.read_batch(np.arange(7, 14), out, labels)
    cache.read_batch(np.arange(0, 7), out, labels)  # other shards still read


# ----------------------------------------------------------------------------- who reads mapped pages


class _OwnTrain(augment.TrainAugment):
    """A user's preset: its forward may read samples any way it likes."""


@pytest.mark.parametrize("preset, mapped", [
    (augment.train(24), True),
    (augment.eval(24), True),
    (augment.train(24, color_jitter=0.4), True),
    (augment.train(24, path="device"), False),  # torch reads the stacked batch
    (augment.eval(48), False),  # samples smaller than the crop are stacked and resized by torch
    (_OwnTrain(24), False),
])
def test_only_presets_that_read_through_the_guarded_kernels_get_mapped_views(built, preset, mapped):
    ds = datapipe.StreamingDataset(built, batch_size=8, seed=0, return_index=True)
    asked: list[bool] = []
    real = ds.cache.sample_views

    def sample_views(*args, **kwargs):
        views = real(*args, **kwargs)
        ranges = [(a, end - a) for a, (end, _, _) in ds.cache._map_ranges.items()]
        inside = [any(a <= v.data_ptr() < a + n for a, n in ranges) for v in views]
        asked.append(all(inside) and bool(inside))
        assert all(inside) or not any(inside)
        return views

    ds.cache.sample_views = sample_views
    loader = datapipe.DeviceLoader(ds, device="cpu", augment=preset, num_workers=1)
    batches = list(loader)
    loader.close()
    assert len(batches) == len(ds) and asked and set(asked) == {mapped and native.guard_available()}


def test_mapped_and_positioned_reads_give_the_same_samples_and_crops(built):
    cache = datapipe.open(built)
    order = np.random.default_rng(3).permutation(N)
    a, b = np.empty((N, 32, 32, 3), np.uint8), np.empty((N, 32, 32, 3), np.uint8)
    la, lb = np.empty(N, np.int64), np.empty(N, np.int64)
    cache.read_batch(order, a, la)
    views = cache.sample_views(order[:16], la[:16], mapped=True)
    with cache.mapped_reads(order[:16]):
        crops = augment.train(24)(views, seed=5)
    cache.mapped = False  # positioned reads from here on
    cache.read_batch(order, b, lb)
    copies = cache.sample_views(order[:16], lb[:16], mapped=True)  # copies now: no maps without the guard
    assert np.array_equal(a, b) and np.array_equal(la, lb)
    assert torch.equal(crops, augment.train(24)(copies, seed=5))
    assert torch.equal(torch.stack(copies), torch.from_numpy(b[np.sort(order[:16])]))  # both sorted by index


@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_positioned_reads_of_a_shard_written_over_during_the_read_are_an_error(built, tmp_path, monkeypatch, encoding):
    """Without maps (no compiler, DATAPIPE_NATIVE=0) the file was checked before each read only: a shard written over
    in place between that check and the read gave a batch of the new bytes, and only the next read said so."""
    import datapipe.cache as cache_module

    if encoding == "raw":
        folder = Path(shutil.copytree(built, tmp_path / "cache"))
    else:
        folder = tmp_path / "cache"
        datapipe.build(built.parent / "source", folder, size=32, shard_size=SHARD, encoding="jpeg", progress=False,
                       cluster=datapipe.Cluster(scheduler="sync"))
    cache = datapipe.open(folder)
    cache.mapped = False  # positioned reads from the start
    n = 5
    out, labels = np.empty((n, *cache.shape), np.uint8), np.empty(n, np.int64)
    cache.read_batch(np.arange(n), out, labels)  # shard 0 opened and checked
    shard = cache._shard_path(0)
    reads = cache_module._pread_full
    written = []

    def read_after_another_writer(fd, buf, offset):  # another process writes the shard over, after the check
        if not written:
            with open(shard, "r+b") as f:
                f.write(bytes(4096))
            os.utime(shard, ns=(os.stat(shard).st_atime_ns, os.stat(shard).st_mtime_ns + 1_000_000))
            written.append(1)
        return reads(fd, buf, offset)

    monkeypatch.setattr(cache_module, "_pread_full", read_after_another_writer)
    with pytest.raises(CorruptShardError, match=r"shard 000000\.zarr .* was truncated or altered"):
        cache.read_batch(np.arange(n), out, labels)
    assert written


@needs_guard
def test_a_shard_two_threads_opened_at_once_is_named_when_it_shrinks(cache_dir, monkeypatch):
    """Two reader threads opened one shard at once, each mapping it; the one whose map was kept could have recorded
    the other's (closed) address range: a shard truncated under a read then raised a MappedReadError naming none."""
    cache = datapipe.open(cache_dir)
    opens = cache._open_shard
    first_opened, second_opened, first_kept = threading.Event(), threading.Event(), threading.Event()
    order = iter(["first", "second"])
    lock = threading.Lock()

    def open_interleaved(shard):  # the first maps the file, then the second; the first's entry is kept
        with lock:
            me = next(order)
        if me == "first":
            entry = opens(shard)
            first_opened.set()
            second_opened.wait(timeout=30)
            return entry
        first_opened.wait(timeout=30)
        entry = opens(shard)
        second_opened.set()
        first_kept.wait(timeout=30)  # then finds the first's entry, and closes its own
        return entry

    def first() -> None:
        cache._acquire(0)
        first_kept.set()
        cache._files.release(0)

    def second() -> None:
        first_opened.wait(timeout=30)
        cache._acquire(0)
        cache._files.release(0)

    monkeypatch.setattr(cache, "_open_shard", open_interleaved)
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    monkeypatch.undo()
    entry = cache._acquire(0)  # the map kept
    try:
        os.truncate(cache._shard_path(0), 0)
        with pytest.raises(MappedReadError) as fault:
            native.gather(np.empty(SHARD * 32 * 32 * 3, np.uint8).ctypes.data, entry.mapping,
                          np.arange(SHARD, dtype=np.int64) * 32 * 32 * 3, 32 * 32 * 3)
    finally:
        cache._files.release(0)
    named = cache.shard_error(fault.value)
    assert isinstance(named, CorruptShardError) and "000000.zarr" in str(named), named
