"""JPEG samples decoded on the GPU: which decoder the CUDA loader selects, and what it gives.

On any machine: the choice (``DATAPIPE_GPU_DECODE`` unset, ``0``, a decoder's name, a wrong value),
the fall-back to the host when no decoder works, a forced decoder that cannot run being an error
naming it, the padding of decoded samples of varying shapes into one batch, a failed GPU decode
named by sample (CorruptShardError when the host cannot decode it either), and a loader that is not
on CUDA reporting the host path.

Marked ``cuda`` (skipped without a GPU; benchmarks/gpu_decode.py runs them on the device): each GPU
decoder installed against libjpeg-turbo on a real JPEG cache's samples, within the documented
tolerance (docs/loader.md: per image, mean absolute difference <= 1.5 uint8 levels, 99.9th percentile
<= 32); the CUDA DeviceLoader's train and eval batches on the GPU decode path against the host decode
path with the same seed, within the same tolerance; a damaged sample named by shard file and sample.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import datapipe
from datapipe import augment, gpu_decode
from datapipe.errors import ArgumentError, CorruptShardError
from datapipe.gpu_decode import ENV, MEAN_TOL, P999_TOL, failure, jpeg_decoder, pad_batch, requested, select
from datapipe.samples import encode

# pad_batch goes through a strided nested tensor (the library silences this warning; pytest resets the filters)
pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
HAS_CUDA = torch.cuda.is_available()
N, SIZE, SHARD, B = 40, 64, 12, 8
ASPECTS = ((96, 72), (72, 96), (128, 64), (80, 80))  # (width, height), cycled


# ----------------------------------------------------------------------------- caches


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """N PNG images of several aspects: smooth random colour fields with fine noise (as photographs
    have both), in two classes."""
    root = tmp_path_factory.mktemp("gpu-decode") / "src"
    rng = np.random.default_rng(11)
    for i in range(N):
        w, h = ASPECTS[i % len(ASPECTS)]
        base = rng.integers(0, 256, size=(h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(base).resize((w, h), Image.BICUBIC)).astype(np.int16)
        img = np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
        folder = root / ("a" if i % 2 else "b")
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(img).save(folder / f"{i:03d}.png")
    return root


@pytest.fixture(scope="module")
def jpeg_caches(source, tmp_path_factory):
    """JPEG caches by fit, built on first use: ``short`` (varying shapes) and ``crop`` (square)."""
    base = tmp_path_factory.mktemp("gpu-decode-caches")

    class Caches(dict):
        def __missing__(self, fit: str) -> Path:
            out = base / fit
            datapipe.build(source, out, size=SIZE, fit=fit, encoding="jpeg", shard_size=SHARD,
                           cluster=datapipe.Cluster(scheduler="sync"), progress=False)
            self[fit] = out
            return out

    return Caches()


def _loader(path: Path, device: str, aug, workers: int = 2) -> datapipe.DeviceLoader:
    ds = datapipe.StreamingDataset(path, batch_size=B, shuffle=True, seed=3, return_index=True)
    return datapipe.DeviceLoader(ds, device=device, augment=aug, num_workers=workers)


# ----------------------------------------------------------------------------- the choice (any machine)


@pytest.mark.parametrize(("value", "expected"), [(None, "auto"), ("", "auto"), ("0", "off"), ("nvimgcodec", "nvimgcodec"),
                                                 ("TorchVision", "torchvision"), (" 0 ", "off")])
def test_the_variable_is_read(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert requested() == expected


@pytest.mark.parametrize("value", ["2", "nvjpeg", "gpu", "torchvision,nvimgcodec"])
def test_a_wrong_value_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    for device in ("cuda", "cpu"):
        with pytest.raises(ArgumentError) as err:
            jpeg_decoder(device)
        message = str(err.value)
        assert ENV in message and repr(value.strip().lower()) in message and "nvimgcodec" in message
        assert "\n" not in message


def _works(name: str):
    return lambda: name  # a stand-in for a decoder that constructed and decoded its probe


def _missing(name: str):
    def construct():
        raise ModuleNotFoundError(f"No module named {name!r}")
    return construct


@pytest.mark.parametrize(("nv", "tv", "expected"), [(True, True, "nvimgcodec"), (False, True, "torchvision"),
                                                    (True, False, "nvimgcodec"), (False, False, None)])
def test_automatic_choice_prefers_nvimgcodec_then_torchvision_then_the_host(nv, tv, expected):
    candidates = {"nvimgcodec": _works("nvimgcodec") if nv else _missing("nvidia"),
                  "torchvision": _works("torchvision") if tv else _missing("torchvision")}
    assert select("auto", candidates) == expected


def test_zero_decodes_on_the_host_even_with_decoders_installed():
    assert select("off", {"nvimgcodec": _works("nvimgcodec"), "torchvision": _works("torchvision")}) is None


@pytest.mark.parametrize("name", gpu_decode.DECODERS)
def test_forcing_a_decoder_that_cannot_run_is_an_error_naming_it(name):
    others = {n: _works(n) for n in gpu_decode.DECODERS if n != name}
    with pytest.raises(ArgumentError) as err:
        select(name, {name: _missing(name), **others})  # the other one works: a forced choice never falls back
    message = str(err.value)
    assert f"{ENV}={name}" in message and "ModuleNotFoundError" in message and gpu_decode.INSTALL[name] in message
    assert f"{ENV}=0" in message and "\n" not in message
    assert select(name, {name: _works(name), **others}) == name


@functools.cache
def _why_not_here(name: str) -> str | None:
    """Why decoder ``name`` cannot run here (None: it can): no CUDA, not installed, or installed but unable
    to decode (a build for another CUDA, an API it does not have) — which the automatic choice passes over."""
    module = {"nvimgcodec": "nvidia.nvimgcodec", "torchvision": "torchvision"}[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (nvidia) is missing
        found = False
    if not HAS_CUDA or not found:
        return "no CUDA here" if not HAS_CUDA else f"{name} is not installed"
    make = {"nvimgcodec": gpu_decode.NvImageCodecDecoder, "torchvision": gpu_decode.TorchvisionDecoder}[name]
    try:
        make(torch.device("cuda")).probe()
    except Exception as exc:  # noqa: BLE001 - reported as the reason of the skip
        return f"{name} is installed but cannot decode here ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    return None


def _runs_here(name: str) -> bool:
    return _why_not_here(name) is None


@pytest.mark.parametrize("name", gpu_decode.DECODERS)
def test_the_variable_forcing_an_unavailable_decoder_is_an_error(monkeypatch, name):
    """The real constructors: without the library (or without CUDA) a forced decoder is an ArgumentError."""
    if _runs_here(name):
        pytest.skip(f"{name} is installed and CUDA is present here")
    monkeypatch.setenv(ENV, name)
    with pytest.raises(ArgumentError) as err:
        jpeg_decoder("cuda")
    assert f"{ENV}={name}" in str(err.value) and gpu_decode.INSTALL[name] in str(err.value)


@pytest.mark.skipif(HAS_CUDA, reason="checks the machines without CUDA")
@pytest.mark.parametrize("value", [None, "0"])
def test_without_cuda_there_is_no_gpu_decoder(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert jpeg_decoder("cuda") is None
    assert jpeg_decoder("cpu") is None


@pytest.mark.parametrize("value", [None, "0", "nvimgcodec", "torchvision"])
def test_a_cpu_device_never_decodes_on_a_gpu(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert jpeg_decoder("cpu") is None
    assert jpeg_decoder(torch.device("cpu")) is None


@pytest.mark.parametrize("value", [None, "0"])
def test_a_cpu_loader_reports_the_host_decode(jpeg_caches, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    for fit in ("short", "crop"):
        loader = _loader(jpeg_caches[fit], "cpu", augment.train(32))
        try:
            assert loader.decode_path == "cpu"
            batches = list(loader)
            assert batches and all(b[0].shape[1:] == (3, 32, 32) for b in batches)
        finally:
            loader.close()


def test_a_raw_cache_reports_no_decode(tmp_path):
    from datapipe.testing import build_index_cache

    loader = _loader(build_index_cache(tmp_path, 20, size=16, shard_size=7), "cpu", augment.eval(16))
    try:
        assert loader.decode_path is None
    finally:
        loader.close()


# ----------------------------------------------------------------------------- padding and failures (any machine)


def test_samples_of_one_shape_are_stacked():
    xs = [torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8) for _ in range(4)]
    assert torch.equal(pad_batch(xs), torch.stack(xs))


@pytest.mark.parametrize("shapes", [[(5, 7), (8, 3), (2, 2)], [(1, 9), (9, 1)], [(6, 6), (6, 7)], [(4, 4)]])
def test_samples_of_varying_shapes_are_zero_padded_at_the_bottom_and_right(shapes):
    # [h, w, 3] views of [3, h, w] tensors, as torchvision's decoder hands them over (not contiguous)
    xs = [torch.randint(1, 256, (3, h, w), dtype=torch.uint8).permute(1, 2, 0) for h, w in shapes]
    out = pad_batch(xs)
    hmax, wmax = max(h for h, _ in shapes), max(w for _, w in shapes)
    assert out.shape == (len(xs), hmax, wmax, 3) and out.dtype == torch.uint8
    for i, (x, (h, w)) in enumerate(zip(xs, shapes, strict=True)):
        assert torch.equal(out[i, :h, :w], x)
        assert not out[i, h:].any() and not out[i, :, w:].any()


def _blobs(shapes):
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8) for h, w in shapes]
    return [np.frombuffer(bytes(encode(x, "jpeg")), dtype=np.uint8).copy() for x in images]


def test_a_failed_gpu_decode_of_a_damaged_sample_names_it():
    shapes = [(16, 24), (24, 16), (32, 32)]
    data = _blobs(shapes)
    data[1][len(data[1]) // 3 :: 2] = 0xFF  # its entropy-coded data is now markers
    wheres = [f"/cache/shard-00003/data, sample {i}" for i in (40, 41, 42)]
    # the host decoder's own error, which names the sample (raised while the suspects are checked)
    with pytest.raises(CorruptShardError) as err:
        failure("nvimgcodec", data, shapes, wheres, [1], None)
    assert "sample 41" in str(err.value) and "shard-00003" in str(err.value)
    with pytest.raises(CorruptShardError) as err:
        failure("torchvision", data, shapes, wheres, range(3), RuntimeError("nvjpeg: bitstream error"))
    assert "sample 41" in str(err.value)


def test_a_failed_gpu_decode_of_sound_samples_says_how_to_decode_on_the_host():
    shapes = [(16, 24), (24, 16)]
    wheres = ["/cache/shard-00000/data, sample 0", "/cache/shard-00000/data, sample 1"]
    err = failure("torchvision", _blobs(shapes), shapes, wheres, range(2), RuntimeError("out of\nmemory"))
    message = str(err)
    assert type(err) is RuntimeError and "torchvision" in message and "sample 0" in message
    assert f"{ENV}=0" in message and "out of memory" in message and "\n" not in message


# ----------------------------------------------------------------------------- on a GPU


def _levels(images: torch.Tensor, aug) -> torch.Tensor:
    """A normalised float batch [B, 3, h, w] back in uint8 levels (float64, not rounded)."""
    mean = torch.tensor(aug.mean, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(aug.std, dtype=torch.float64).view(1, 3, 1, 1)
    return (images.detach().cpu().double() * std + mean) * 255.0


def _within_tolerance(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Per-image mean and 99.9th percentile of |a - b| (levels): the largest over the batch."""
    diff = (a.double() - b.double()).abs().reshape(a.shape[0], -1)
    figures = {"mean": float(diff.mean(1).max()), "p999": float(torch.quantile(diff, 0.999, dim=1).max()),
               "max": float(diff.max())}
    assert figures["mean"] <= MEAN_TOL and figures["p999"] <= P999_TOL, figures
    return figures


def _forced(monkeypatch, name: str):
    if not _runs_here(name):
        pytest.skip(str(_why_not_here(name)))
    monkeypatch.setenv(ENV, name)
    decoder = jpeg_decoder("cuda")
    assert decoder is not None and decoder.name == name
    return decoder


def _epoch(path: Path, aug) -> list:
    """One epoch of the CUDA loader (train/eval), the batches copied to the host, and its decode path."""
    loader = _loader(path, "cuda", aug, workers=3)
    try:
        return [loader.decode_path] + [tuple(t.cpu() for t in batch) for batch in loader]
    finally:
        loader.close()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", gpu_decode.DECODERS)
@pytest.mark.parametrize("fit", ["short", "crop"])
def test_gpu_decodes_match_the_host_within_the_tolerance(jpeg_caches, monkeypatch, name, fit):
    """Every stored sample of a real JPEG cache: the GPU decoder's pixels against libjpeg-turbo's."""
    decoder = _forced(monkeypatch, name)
    cache = datapipe.open(jpeg_caches[fit])
    everything = np.arange(len(cache))
    encoded = cache.read_encoded(everything, np.empty(len(cache), np.int64))
    stream = torch.cuda.Stream()
    decoded = decoder.decode([e.data for e in encoded], [(e.height, e.width) for e in encoded],
                             [e.where for e in encoded], torch.device("cuda"), stream)
    stream.synchronize()
    host = cache.read_samples(everything, np.empty(len(cache), np.int64))
    assert len({x.shape for x in host}) == (1 if fit == "crop" else len(ASPECTS))
    for x, ref in zip(decoded, host, strict=True):
        assert x.is_cuda and x.dtype == torch.uint8 and tuple(x.shape) == ref.shape
        _within_tolerance(x.cpu()[None], torch.from_numpy(ref)[None])
    padded = pad_batch(decoded)  # on the device, as the loader pads
    for i, x in enumerate(decoded):
        assert torch.equal(padded[i, : x.shape[0], : x.shape[1]], x)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", gpu_decode.DECODERS)
@pytest.mark.parametrize("fit", ["short", "crop"])
@pytest.mark.parametrize("preset", ["train", "eval"])
def test_the_loader_gives_the_host_decode_paths_batches(jpeg_caches, monkeypatch, name, fit, preset):
    """DeviceLoader on CUDA, same seed: the GPU decode path's batches are the host decode path's (the
    same samples, labels, crops and flips), their pixels within the tolerance."""
    _forced(monkeypatch, name)
    aug = augment.train(48) if preset == "train" else augment.eval(48)
    on_gpu = _epoch(jpeg_caches[fit], aug)
    monkeypatch.setenv(ENV, "0")
    on_host = _epoch(jpeg_caches[fit], aug)
    assert on_gpu[0] == name and on_host[0] == "cpu"
    assert len(on_gpu) == len(on_host) > 1
    for (img_g, lab_g, idx_g), (img_h, lab_h, idx_h) in zip(on_gpu[1:], on_host[1:], strict=True):
        assert torch.equal(idx_g, idx_h) and torch.equal(lab_g, lab_h)
        assert img_g.shape == img_h.shape == (len(idx_h), 3, 48, 48)
        _within_tolerance(_levels(img_g, aug), _levels(img_h, aug))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", gpu_decode.DECODERS)
@pytest.mark.parametrize("fit", ["short", "crop"])
def test_a_damaged_sample_on_the_gpu_path_names_the_shard_and_sample(jpeg_caches, monkeypatch, tmp_path, name, fit):
    _forced(monkeypatch, name)
    path = tmp_path / "cache"
    shutil.copytree(jpeg_caches[fit], path)
    cache = datapipe.open(path)
    shard, sample = 1, 3
    data_file, index = cache._shard_path(shard), cache._index(shard)
    offset, nbytes = int(index.offsets[sample]), int(index.nbytes[sample])
    with open(data_file, "r+b") as f:  # invalid markers in the entropy-coded data; the file keeps its size
        f.seek(offset + nbytes // 4)
        f.write(b"\xff\x01" * (nbytes // 4))
    g = int(cache.starts[shard]) + sample
    with pytest.raises(CorruptShardError) as err:
        _epoch(path, augment.train(48))
    assert str(data_file) in str(err.value) and f"sample {g}" in str(err.value)
