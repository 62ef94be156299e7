"""The Python API takes what its docs say, numpy's numbers included, and refuses the rest with one ArgumentError
naming the parameter, before anything is written: never a truthy string taken for True on a destructive flag,
never a bool taken for 1, never a raw TypeError from pathlib, numpy or torch."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import datapipe
from datapipe import augment
from datapipe.errors import ArgumentError
from datapipe.testing import build_index_cache


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return build_index_cache(tmp_path_factory.mktemp("api"), 14, shard_size=7)


def _sync() -> datapipe.Cluster:
    return datapipe.Cluster(scheduler="sync")


@pytest.mark.parametrize("flag", ["force", "verify", "progress"])
@pytest.mark.parametrize("value", ["false", None, 1, "no"])
def test_a_build_flag_takes_true_or_false_only(cache, flag, value):
    """build(force="false") rebuilt a cache of another configuration (every earlier shard removed): a string is
    a true value. A flag takes a bool; anything else is refused before the output is touched."""
    manifest = (cache / "manifest.json").read_bytes()
    with pytest.raises(ArgumentError, match=f"{flag} must be True or False"):
        datapipe.build(cache.parent / "source", cache, size=24, shard_size=7, cluster=_sync(), **{flag: value})
    assert (cache / "manifest.json").read_bytes() == manifest


def test_numpy_integers_are_numbers_and_bools_are_not(tmp_path):
    """A numpy integer (a size computed with numpy) was refused by the build and the sample, and taken by the
    loader; max_pixels=True was taken as 1 (every image then quarantined as too large), workers=True as 1."""
    spec = datapipe.BuildSpec(size=np.int64(16), shard_size=np.int32(5), max_pixels=np.int64(10**6),
                              encoding="jpeg", quality=np.int64(80), fit="short", max_aspect=np.float32(1.5))
    assert (spec.size, spec.shard_size, spec.quality, spec.max_aspect) == (16, 5, 80, 1.5)
    assert type(spec.size) is int and datapipe.Cluster(workers=np.int64(2)).workers == 2
    for bad, flag in ((dict(max_pixels=True), "--max-pixels"), (dict(size=True), "--size")):
        with pytest.raises(ArgumentError, match=flag):
            datapipe.BuildSpec(**bad)
    with pytest.raises(ArgumentError, match="--workers"):
        datapipe.Cluster(workers=True)
    root = datapipe.make_sample_dataset(tmp_path / "sample", images=np.int64(4), classes=np.int64(2))
    assert len(list(root.glob("*/*.jpg"))) == 4


def test_augment_takes_numpy_numbers_and_refuses_unordered_channels():
    """np.float32 was refused for flip, scale and color_jitter; an array or tensor of four jitter amounts raised
    numpy's or torch's truth-value error; a set for mean iterated in another order (G and B swapped), a string
    as its characters."""
    assert augment.train(32, flip=np.float32(0.5), scale=(np.float32(0.1), 1.0)).flip == 0.5
    tuple_jitter = augment.train(32, color_jitter=(0.4, 0.3, 0.2, 0.1))
    for given in (np.array([0.4, 0.3, 0.2, 0.1]), torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)):
        assert augment.train(32, color_jitter=given).color_jitter == tuple_jitter.color_jitter
    assert augment.train(32, color_jitter=np.float32(0.4)).color_jitter is not None
    for mean in ({0.485, 0.456, 0.406}, "123", [0.5, 0.5]):
        with pytest.raises(ArgumentError, match="mean must be three finite numbers"):
            augment.train(32, mean=mean)
    with pytest.raises(ArgumentError, match="color_jitter must be"):
        augment.train(32, color_jitter="abc")
    assert augment.train(32, mean=np.array([0.5, 0.5, 0.5])).mean == (0.5, 0.5, 0.5)
    assert augment.train(32, mean=torch.tensor([0.5, 0.25, 0.5]), std=(v for v in (1, 2, 1))).mean == (0.5, 0.25, 0.5)
    assert augment.train(32, color_jitter=np.array(0.4)).color_jitter == augment.train(32, color_jitter=0.4).color_jitter


@pytest.mark.parametrize(("given", "words"), [
    ({"color_jitter": 1e39}, "color_jitter must be"), ({"color_jitter": (0, 1e39, 0, 0)}, "color_jitter must be"),
    ({"scale": (0.5, 1e39)}, "scale must be (min, max)"), ({"ratio": (0.5, 1e39)}, "ratio must be (min, max)"),
], ids=["jitter", "contrast", "scale", "ratio"])
def test_augment_refuses_bounds_float32_cannot_hold_when_made(given, words):
    """Finite in Python, infinite in float32: accepted, then the first batch raised torch's "to is out of bounds"."""
    with pytest.raises(ArgumentError, match=re.escape(words)):
        augment.train(32, **given)


@pytest.mark.parametrize(("args", "kwargs", "words"), [
    ((4, 10, 10), {"scale": (0.9, 0.1)}, "scale must be (min, max)"),
    ((4, 10, 10), {"ratio": (0, 0)}, "ratio must be (min, max)"),
    ((4, 10, 10), {"ratio": (-1, 1)}, "ratio must be (min, max)"),
    ((4, 10, 10), {"scale": (float("nan"), 1)}, "scale must be (min, max)"),
    ((4, 10, 10), {"scale": (-1, 1)}, "scale must be (min, max)"),
    ((-1, 10, 10), {}, "batch must be >= 0"), ((2.5, 10, 10), {}, "batch must be an integer"),
    ((4, 2.7, 10), {}, "height must be an integer"), ((4, 10, "10"), {}, "width must be an integer"),
    ((4, 0, 10), {}, "at least 1 pixel"),
    ((2, 10**20, 10), {}, "height must be at most 2,147,483,647 pixels"),
    ((2, 10, torch.full((2,), 2**62)), {}, "width must be at most 2,147,483,647 pixels"),
    ((4, 10, 10), {"ratio": (1e-300, 1e-299)}, "ratio must be (min, max)"),
], ids=["scale-reversed", "ratio-zero", "ratio-negative", "scale-nan", "scale-negative", "batch-negative",
        "batch-float", "height-float", "width-text", "height-zero", "height-past-int64", "widths-past-int64",
        "ratio-no-float32-holds"])
def test_sample_resized_crops_checks_its_arguments_as_train_does(args, kwargs, words):
    """The public sampler raised torch's uniform_ error, a math domain error, or used -1 and 2.7 (as 2) silently."""
    with pytest.raises(ArgumentError, match=re.escape(words)):
        augment.sample_resized_crops(*args, generator=torch.Generator(), **kwargs)
    with pytest.raises(ArgumentError, match="generator must be a torch.Generator"):
        augment.sample_resized_crops(4, 10, 10, generator=7)


@pytest.mark.parametrize("given", [np.array([0.08, 1.0]), torch.tensor([0.08, 1.0]), (torch.tensor(0.08), 1.0),
                                   (np.float64(0.08), np.array(1.0))], ids=["array", "tensor", "0-d-tensor", "0-d-array"])
def test_scale_and_ratio_take_arrays_and_tensors_of_numbers(given):
    """A range given as a numpy array or a torch tensor (as a config loader hands it) was refused with "got
    array([0.08, 1.])", the very pair it asks for."""
    crops = augment.sample_resized_crops(4, 32, 32, scale=given, generator=torch.Generator().manual_seed(0))
    assert torch.equal(crops, augment.sample_resized_crops(4, 32, 32, scale=(0.08, 1.0),
                                                           generator=torch.Generator().manual_seed(0)))
    assert augment.train(32, scale=given).scale == pytest.approx((0.08, 1.0))


def test_a_ratio_far_from_the_images_falls_back_to_a_crop_of_a_pixel_at_least():
    """ratio=(1e-30, 1e-29): the fallback crop rounded its width to 0 pixels, and the first batch failed with "crop
    (top 0, left 16, 32x0) outside a sample"."""
    crops = augment.sample_resized_crops(3, 32, 32, ratio=(1e-30, 1e-29), generator=torch.Generator().manual_seed(0))
    assert (crops[:, 2:] >= 1).all()
    out = augment.train(16, ratio=(1e-30, 1e-29))(torch.zeros(3, 32, 32, 3, dtype=torch.uint8), seed=0)
    assert out.shape == (3, 3, 16, 16)


@pytest.mark.parametrize("path", [None, 5, b"cache", ""])
def test_a_cache_or_sample_path_of_another_type_is_an_argument_error(tmp_path, path):
    """datapipe.open(None) and make_sample_dataset(None) raised pathlib's TypeError; "" is the working folder."""
    with pytest.raises(ArgumentError, match="must be a"):
        datapipe.open(path)
    with pytest.raises(ArgumentError, match="must be a path"):
        datapipe.make_sample_dataset(path)
    with pytest.raises(ArgumentError, match="must be a path or a URL"):
        datapipe.build(path, tmp_path / "out", cluster=_sync())


def test_a_node_cache_in_the_working_folder_or_a_timeout_past_the_clock_is_refused(cache, tmp_path, monkeypatch):
    """local_cache="" wrote the node's copy into whatever folder the process ran in; a timeout of 1e10 s overflowed
    the clock, reported as the store's failure."""
    monkeypatch.chdir(tmp_path)
    url = "file://" + str(cache)
    with pytest.raises(ArgumentError, match="local_cache must be a local folder"):
        datapipe.StreamingDataset(url, batch_size=4, local_cache="")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ArgumentError, match=r"timeout must be a positive number of seconds, at most 86,400"):
        datapipe.open(url, local_cache=tmp_path / "node", timeout=1e10)
    assert len(datapipe.open(url, local_cache=tmp_path / "node", timeout=np.int64(30))) == 14


def test_datapipe_errors_is_there_right_after_import():
    """The docs name datapipe.errors.RankMismatchError and RepeatedEpochWarning; right after `import datapipe` the
    module was no attribute until something else had imported it."""
    code = ("import warnings, datapipe; "
            "warnings.filterwarnings('ignore', category=datapipe.errors.RepeatedEpochWarning); "
            "print(datapipe.errors.RankMismatchError.__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "RankMismatchError", done.stderr


def test_read_batch_checks_its_buffers_before_writing_any(cache):
    """A labels_out shorter than the indices raised numpy's broadcast error; an out of the wrong kind was found
    after labels_out had been overwritten."""
    opened = datapipe.open(cache)
    labels = np.full(4, -7, np.int64)
    with pytest.raises(ValueError, match="out must be a writable numpy uint8 array"):
        opened.read_batch(np.arange(4), [], labels)
    with pytest.raises(ValueError, match="out must be a writable numpy uint8 array"):
        opened.read_batch(np.arange(4), np.empty((4, 8, 8, 3), np.uint8), labels)
    assert (labels == -7).all()  # nothing written
    out = np.empty((4, *opened.shape), np.uint8)
    with pytest.raises(ValueError, match="labels_out must be a writable 1-D numpy array of at least 4"):
        opened.read_batch(np.arange(4), out, np.empty(2, np.int64))
    with pytest.raises(ValueError, match="index_out must be"):
        opened.read_batch(np.arange(4), out, labels, np.empty((4, 1), np.int64))
    assert opened.read_batch(np.arange(4), out, labels) == 4 and (labels != -7).all()
    floats = np.zeros(4)
    assert opened.read_batch(np.arange(4), out, floats) == 4 and floats.tolist() == labels.tolist()  # as before
    assert opened.read_batch([], None, np.empty(0, np.int64)) == 0  # an empty read needs no buffer
    frozen = out.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a writable"):
        opened.read_batch(np.arange(4), frozen, labels)


def test_read_batch_refuses_a_float_buffer_that_cannot_hold_every_index_exactly(tmp_path):
    """A float16 index_out wrote sample 2049 as 2048 and 2051 as 2052, without a word."""
    opened = datapipe.open(build_index_cache(tmp_path, 2100, classes=2, size=8, shard_size=1024))
    wanted = np.arange(2047, 2052)
    out = np.empty((5, *opened.shape), np.uint8)
    for kind in (np.float16, np.int8):
        with pytest.raises(ValueError, match="index_out must be .* of a type that holds 2,100"):
            opened.read_batch(wanted, out, np.zeros(5, np.int64), np.zeros(5, kind))
    for kind in (np.float32, np.float64, np.int16):  # every index exactly: as before
        index = np.zeros(5, kind)
        opened.read_batch(wanted, out, np.zeros(5, np.float16), index)
        assert index.tolist() == wanted.tolist()


def test_the_sample_refuses_what_the_machine_cannot_hold_before_writing(tmp_path):
    """workers=10**6 would fork a million processes; images=10**12 wrote until the disk was full."""
    with pytest.raises(ArgumentError, match="workers must be at most"):
        datapipe.make_sample_dataset(tmp_path / "a", images=4, classes=2, workers=10**6)
    with pytest.raises(ArgumentError, match=r"--images 1,000,000,000,000 needs about .* GiB free"):
        datapipe.make_sample_dataset(tmp_path / "b", images=10**12, classes=2)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("value", ["abc", ""])
def test_a_rank_variable_that_is_no_number_is_named(cache, monkeypatch, value):
    monkeypatch.setenv("RANK", value)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ArgumentError, match="the environment variable RANK must be a whole number"):
        datapipe.StreamingDataset(cache, batch_size=4)



@pytest.mark.parametrize("world_size", [0, -1])
def test_a_world_of_no_rank_is_refused_as_such(cache, world_size):
    """world_size=-1 was refused as "must be >= 0", and 0, which that allowed, then as a rank out of range."""
    with pytest.raises(ArgumentError, match=rf"world_size must be 1 <= world_size <= 1048576, got {world_size}"):
        datapipe.StreamingDataset(cache, batch_size=4, rank=0, world_size=world_size)


@pytest.mark.parametrize("size", [10**6, 10**9])
def test_an_output_batch_larger_than_the_memory_is_named_before_the_first_batch(cache, size):
    """augment.eval(100000) failed at the first batch with torch's "DefaultCPUAllocator: can't allocate memory",
    10**9 with "Storage size calculation overflowed": neither names the augmentation's size. (10**6: 44 TiB a batch,
    more than any machine's memory.)"""
    ds = datapipe.StreamingDataset(cache, batch_size=4)
    with pytest.raises(ArgumentError, match=rf"up to 6 output batches of 4 x 3 x {size} x {size} float32 .* GiB.*lower the "
                                            "augmentation's size"):
        datapipe.DeviceLoader(ds, device="cpu", augment=augment.eval(size))
    with datapipe.DeviceLoader(ds, device="cpu", augment=augment.eval(512)) as loader:  # a large size that fits
        assert next(iter(loader))[0].shape == (4, 3, 512, 512)


def test_cache_is_a_local_folder_and_its_flags_take_bools(cache, tmp_path, monkeypatch):
    """Cache("s3://bucket/x") looked for the folder ./s3:/bucket/x; check_sizes="no" and verify(progress="no")
    were taken as true."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgumentError, match=r"Cache opens a local folder, got the URL 's3://bucket/x': .*datapipe.open"):
        datapipe.Cache("s3://bucket/x")
    with pytest.raises(ArgumentError, match="check_sizes must be True or False"):
        datapipe.Cache(cache, check_sizes="no")
    with pytest.raises(ArgumentError, match="progress must be True or False"):
        datapipe.Cache(cache).verify(progress="no")
    assert datapipe.Cache(cache, check_sizes=np.bool_(False)).verify() == []


def test_a_given_rank_or_world_size_is_not_read_from_the_environment(cache, monkeypatch):
    """With rank= given, a RANK variable that is no number still failed the dataset (and WORLD_SIZE likewise)."""
    monkeypatch.setenv("RANK", "abc")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert datapipe.StreamingDataset(cache, batch_size=4, rank=1).world_size == 2
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert datapipe.StreamingDataset(cache, batch_size=4, world_size=3).rank == 1


@pytest.mark.parametrize("size, max_aspect, most", [(4097, 2.0, "1.999"), (1025, 8.0, "7.992"), (8192, 1.01, "1")])
def test_a_short_side_whose_longer_cap_passes_the_largest_sample_is_refused_before_the_scan(tmp_path, size, max_aspect,
                                                                                             most):
    """--fit short --size 4097 (cap 8194) passed each option's range, decoded and wrote every shard, and then the
    manifest was refused as a cache no reader takes; a rerun blamed build.json. The product is checked first."""
    with pytest.raises(ArgumentError, match=rf"longer side of up to .* over the 8,192 .*--max-aspect to at most {most},"):
        datapipe.BuildSpec(size=size, fit="short", max_aspect=max_aspect)
    assert datapipe.BuildSpec(size=1024, fit="short", max_aspect=8.0).max_side == 8192
    assert datapipe.BuildSpec(size=size, fit="crop").max_side == size  # the cap is short's only
    (tmp_path / "src" / "a").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(tmp_path / "src"), str(tmp_path / "out"),
                           "--fit", "short", "--size", str(size), "--max-aspect", str(max_aspect), "--scheduler", "sync"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "over the 8,192" in done.stderr and not (tmp_path / "out").exists(), done.stderr


def test_a_world_of_several_without_a_rank_is_refused_wherever_its_size_comes_from(cache, monkeypatch):
    """world_size=1 was refused when WORLD_SIZE=4 was set (the given size is the one in effect); world_size=4 given
    with no rank anywhere read rank 0's part in every process."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert datapipe.StreamingDataset(cache, batch_size=4, world_size=1).world_size == 1
    with pytest.raises(ArgumentError, match="WORLD_SIZE=4 is set but no rank"):
        datapipe.StreamingDataset(cache, batch_size=4)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ArgumentError, match=r"world_size=4 is given but no rank \(rank=, torch.distributed or RANK\)"):
        datapipe.StreamingDataset(cache, batch_size=4, world_size=4)
    assert datapipe.StreamingDataset(cache, batch_size=4, rank=2, world_size=4).rank == 2


@pytest.mark.parametrize("scheduler", ["sync", "tcp://127.0.0.1:8786"])
def test_workers_beside_a_scheduler_is_refused_not_ignored(scheduler):
    """Cluster(workers=8, scheduler="sync") built serially and `--workers 8 --scheduler tcp://...` on the cluster's
    own workers: the count was dropped in silence."""
    with pytest.raises(ArgumentError, match=rf"--workers 8 sets the LocalCluster a build starts, but --scheduler "
                                            rf"{scheduler} .*: leave one of them out"):
        datapipe.Cluster(workers=8, scheduler=scheduler)
    assert datapipe.Cluster(workers=8).workers == 8 and datapipe.Cluster(scheduler=scheduler).scheduler == scheduler


def test_the_memory_check_counts_every_batch_the_loader_holds_within_the_process_limit(cache):
    """One batch of 0.94 GiB passed a check against the machine's 23 GiB; under `ulimit -v 6000000` the loop then
    died of torch's "can't allocate memory" (the loader holds a batch per reader, the prefetched and two more), and
    under a container's limit it would be killed. The check counts them all, against the limit the process has."""
    code = """
import resource, sys
import datapipe
from datapipe import augment
from datapipe.errors import ArgumentError
ds = datapipe.StreamingDataset(sys.argv[1], batch_size=20)
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2 * 2**30, resource.RLIM_INFINITY))  # 2 GiB more
try:
    datapipe.DeviceLoader(ds, device="cpu", augment=augment.eval(1600))  # 6 batches of 0.4 GiB
except ArgumentError as exc:
    print(exc)
else:
    print("accepted")
datapipe.DeviceLoader(ds, device="cpu", augment=augment.eval(1600), num_workers=0).close()  # 3 of them fit
print("fits")
"""
    done = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stdout + done.stderr
    assert lines[0].startswith("the loader holds up to 6 output batches of 14 x 3 x 1600 x 1600 float32 (0.40 GiB each)"), lines[0]
    assert "the address space the process's limit (ulimit -v) leaves it" in lines[0], lines[0]
    assert lines[1] == "fits"


def test_the_memory_check_counts_the_float32_batches_a_narrower_output_is_converted_from(cache):
    """A bfloat16 preset on the CPU fills a float32 buffer in each reader, then converts it: the check counted the
    bfloat16 batches alone, passed, and the loop ran out of memory (killed, under a container's limit)."""
    code = """
import resource, sys
import torch
import datapipe
from datapipe import augment
from datapipe.errors import ArgumentError
ds = datapipe.StreamingDataset(sys.argv[1], batch_size=20)
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2 * 2**30, resource.RLIM_INFINITY))  # 2 GiB more
half = augment.eval(1600, dtype=torch.bfloat16)  # 0.20 GiB a batch, made from 0.40 GiB of float32
try:
    datapipe.DeviceLoader(ds, device="cpu", augment=half, num_workers=3, prefetch=1)  # 6 + 3 of float32: 2.4 GiB
except ArgumentError as exc:
    print(exc)
else:
    print("accepted")
datapipe.DeviceLoader(ds, device="cpu", augment=half, num_workers=0).close()  # 3 + 1 of float32: 1.0 GiB
print("fits")
"""
    done = subprocess.run([sys.executable, "-c", code, str(cache)], capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stdout + done.stderr
    assert lines[0].startswith("the loader holds up to 6 output batches of 14 x 3 x 1600 x 1600 bfloat16 (0.20 GiB "
                               "each) and 3 float32 batches it converts them from, 2.4 GiB in all"), lines[0]
    assert lines[1] == "fits"


@pytest.mark.parametrize("timeout", [1e10, float("inf"), 0])
def test_a_loader_timeout_past_the_longest_wait_is_named(cache, timeout):
    """timeout=1e10 was taken, and the first batch raised OverflowError ("timestamp out of range") from threading."""
    ds = datapipe.StreamingDataset(cache, batch_size=4)
    with pytest.raises(ArgumentError, match=r"timeout must be a positive number of seconds, at most 9,223,372,036"):
        datapipe.DeviceLoader(ds, device="cpu", timeout=timeout)
    with datapipe.DeviceLoader(ds, device="cpu", timeout=threading.TIMEOUT_MAX) as loader:
        assert next(iter(loader))[0].shape[0] == 4


def test_a_batch_size_past_the_samples_is_sized_by_the_samples_it_holds(cache):
    """batch_size=10**9 (a whole evaluation set in one batch) must not be refused as needing 10**9 outputs."""
    ds = datapipe.StreamingDataset(cache, batch_size=10**9, shuffle=False)
    with datapipe.DeviceLoader(ds, device="cpu", augment=augment.eval(32)) as loader:
        assert [b[0].shape for b in loader] == [(14, 3, 32, 32)]


@pytest.mark.parametrize(("files", "expected"), [
    ({"/proc/self/cgroup": "0::/a/b\n", "/sys/fs/cgroup/a/b/memory.max": "max\n", "/sys/fs/cgroup/a/memory.max": "4294967296\n"},
     4294967296),  # v2: the parent's limit holds for its child
    ({"/proc/self/cgroup": "0::/a/b\n", "/sys/fs/cgroup/a/b/memory.max": "2147483648\n",
      "/sys/fs/cgroup/a/memory.max": "4294967296\n"}, 2147483648),
    ({"/proc/self/cgroup": "4:memory:/job\n0::/\n", "/sys/fs/cgroup/memory/job/memory.limit_in_bytes": "9223372036854771712\n",
      "/sys/fs/cgroup/memory/memory.limit_in_bytes": "1073741824\n"}, 1073741824),  # v1: unlimited leaf, limited root
    ({"/proc/self/cgroup": "0::/\n", "/sys/fs/cgroup/memory.max": "max\n"}, None),
    ({}, None),
])
def test_the_memory_limit_is_the_smallest_of_the_process_group_and_those_above_it(monkeypatch, files, expected):
    """Only the group's own file was read: a limit set on a parent group (a job's, a pod's) was missed."""
    from datapipe import environment

    def fake_open(path, *args, **kwargs):
        if str(path) not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[str(path)])

    monkeypatch.setattr(environment, "open", fake_open, raising=False)
    limits = [environment._cgroup_value("", "memory.max"), environment._cgroup_value("memory", "memory.limit_in_bytes")]
    assert next((v for v in limits if v is not None), None) == expected


def test_a_batch_the_memory_cannot_hold_is_named_with_what_to_lower(cache):
    """Past the check (which counts output batches only), the loop died of torch's "DefaultCPUAllocator: can't
    allocate memory", naming neither the batch nor what to change."""
    class Greedy(torch.nn.Module):  # a generic module's temporaries: 4 TiB
        def forward(self, x):
            return x + torch.empty(2**40, dtype=torch.float32)[:1]

    ds = datapipe.StreamingDataset(cache, batch_size=4)
    with datapipe.DeviceLoader(ds, device="cpu", augment=Greedy()) as loader, pytest.raises(RuntimeError) as info:
        next(iter(loader))
    assert "can't allocate memory" in str(info.value)  # torch's own error, of its own type: batch-size finders catch it
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith("datapipe: the DeviceLoader ran out of ") and \
        "making batches of 4 samples" in notes[0] and notes[0].endswith("lower the batch size, or num_workers and prefetch")


@pytest.mark.parametrize(("classes", "words"), [
    ("cat", "classes must be a non-empty list"), ([], "classes must be a non-empty list"),
    (["cat", ""], "classes must be a non-empty list"), (["cat", 1], "classes must be a non-empty list"),
    (["cat", "cat"], "classes names 'cat' more than once"),
    (["cat", "caf\udce9"], "holds what is not valid UTF-8 text"), (["cat", "d\x00g"], "holds a NUL character"),
], ids=["text", "empty", "empty-name", "number", "twice", "undecoded-folder-name", "nul"])
def test_a_class_list_the_manifest_cannot_hold_is_refused_before_any_work(classes, words):
    """A name with a lone surrogate (a folder name os.listdir gave undecoded) was accepted: every shard was written,
    then the manifest could not be encoded, on every rerun."""
    with pytest.raises(ArgumentError, match=re.escape(words)):
        datapipe.BuildSpec(classes=classes)


@pytest.mark.parametrize(("given", "words"), [
    ({"batch_size": 2**63}, "batch_size must be 1 <= batch_size <= 4398046511104"),
    ({"batch_size": 2**62, "world_size": 2, "rank": 1}, "batch_size must be 1 <= batch_size <= 4398046511104"),
    ({"batch_size": 4, "world_size": 10**11, "rank": 5}, "world_size must be 1 <= world_size <= 1048576"),
], ids=["batch", "batch-times-ranks", "ranks"])
def test_a_batch_or_world_too_large_for_any_job_is_refused_when_the_dataset_is_made(cache, given, words):
    """Accepted, with len() 1, then the first iteration died of numpy's OverflowError (positions past int64) or a
    MemoryError (one entry per rank)."""
    with pytest.raises(ArgumentError, match=re.escape(words)):
        datapipe.StreamingDataset(cache, **given)


def test_a_world_size_too_large_from_the_environment_is_refused(cache, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", str(10**11))
    with pytest.raises(ArgumentError, match=r"world_size must be at most 1,048,576, got 100,000,000,000 \(from the "
                                            r"arguments, torch.distributed or RANK/WORLD_SIZE\)"):
        datapipe.StreamingDataset(cache, batch_size=4)


_BAD_PATHS = {"nul": ("{d}/cache\x00x", "holds a NUL character"),
              "long-name": ("{d}/" + "x" * 300, "holds a name of 300 bytes, longer than a file system takes"),
              "long-path": ("{d}/" + "/".join(["y" * 200] * 21), r"\d bytes, longer than a file system takes"),
              "file-url-long-name": ("file://{d}/" + "x" * 300, "holds a name of 300 bytes"),
              "lone-surrogate": ("{d}/caf\ud800", "holds a character no file name can (a lone surrogate)")}


@pytest.mark.parametrize("bad", sorted(_BAD_PATHS))
@pytest.mark.parametrize("entry", ["open", "Cache", "StreamingDataset", "local_cache", "build-source", "build-output"])
def test_a_path_no_file_system_takes_is_one_argument_error_at_every_entry(cache, tmp_path, entry, bad):
    """A NUL gave ValueError 'embedded null byte', a name over 255 bytes OSError ENAMETOOLONG, from deep inside."""
    path, words = _BAD_PATHS[bad]
    path = path.format(d=tmp_path)
    if entry == "local_cache" and bad == "file-url-long-name":
        words = "local_cache must be a local folder"  # a URL is none, whatever its length
    sync = datapipe.Cluster(scheduler="sync")
    call = {"open": lambda: datapipe.open(path), "Cache": lambda: datapipe.Cache(path),
            "StreamingDataset": lambda: datapipe.StreamingDataset(path),
            "local_cache": lambda: datapipe.StreamingDataset(f"file://{cache}", local_cache=path),
            "build-source": lambda: datapipe.build(path, tmp_path / "out", cluster=sync, progress=False),
            "build-output": lambda: datapipe.build(cache, path, cluster=sync, progress=False)}[entry]
    with pytest.raises(ArgumentError, match=words if words.startswith("\\") else re.escape(words)):
        call()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["build", "{src}", "{d}/o", "--classes-from", ""], ["build", "", "{d}/o"],
                                  ["build", "{src}", ""], ["info", ""], ["verify", ""], ["bench", "{cache}", "--source", ""],
                                  ["bench", "", "--repeats", "1"], ["sample", ""]],
                         ids=["classes-from", "source", "output", "info", "verify", "bench-source", "bench-cache", "sample"])
def test_an_empty_path_flag_is_refused_not_taken_as_the_working_folder(cache, tmp_path, capsys, monkeypatch, argv):
    """`--classes-from "$TRAIN"` with TRAIN unset, run from inside another cache, labelled the new cache with that
    cache's classes; the others named a '.' the user never typed."""
    from datapipe import cli

    monkeypatch.chdir(cache)  # inside a cache: the working folder would be taken for it
    args = [a.format(src=cache, d=tmp_path, cache=cache) for a in argv]
    with pytest.raises(SystemExit) as done:
        cli.main(args)
    assert done.value.code == 2
    assert "is empty (an unset variable?)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
