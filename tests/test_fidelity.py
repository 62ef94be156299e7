"""benchmarks/fidelity_bench.py maps crops of stored samples back to the source image: a crop of the
sample must show what the mapped box of the source shows, for fit crop (the centre square) and fit
short (a pure scale, cut at --max-aspect), on images with a gradient and marked edges."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import datapipe

SIZE = 48
SHAPES = {"wide.png": (96, 192), "tall.png": (150, 90), "square.png": (80, 80), "wider.png": (64, 200)}  # (h, w)
BOXES = [(0, 0, 1.0, 1.0), (0, 0, 0.5, 0.5), (0.5, 0.5, 0.5, 0.5), (0.1, 0.6, 0.4, 0.4), (0.25, 0, 0.5, 0.3)]  # rel. to the sample
TOLERANCE = 6.0  # mean |Δ| of uint8 pixels between the two crops resized alike (right: <= 2; a forgotten cut: > 30)


@pytest.fixture(scope="module")
def fidelity():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity_bench.py"
    spec = importlib.util.spec_from_file_location("fidelity_bench", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["fidelity_bench"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _image(h: int, w: int) -> np.ndarray:
    """Red rising left to right, green top to bottom; a blue band on the left edge, half blue on the top."""
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([255 * x / (w - 1), 255 * y / (h - 1), np.zeros((h, w))], axis=2)
    img[:, : max(2, w // 16), 2] = 255
    img[: max(2, h // 16), :, 2] = 128
    return img.round().astype(np.uint8)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    images = {}
    for name, (h, w) in SHAPES.items():
        images[name] = _image(h, w)
        (root / "src" / "a").mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[name]).save(root / "src" / "a" / name)
    built = {}
    for key, fit, extra in (("crop", "crop", {}), ("short", "short", {}), ("short-1.5", "short", {"max_aspect": 1.5})):
        built[key] = root / key
        datapipe.build(root / "src", built[key], size=SIZE, fit=fit, cluster=datapipe.Cluster(scheduler="sync"),
                       progress=False, **extra)
    return images, built


def _resized(img: np.ndarray, side: int = 16) -> np.ndarray:
    return np.asarray(Image.fromarray(np.ascontiguousarray(img)).resize((side, side), Image.BILINEAR), np.float64)


def _errors(fidelity, images, path: Path, region_of) -> list[float]:
    """For every sample and box: mean |Δ| between the sample's crop and the source's crop at the box mapped back."""
    cache = datapipe.open(path)
    errors = []
    for i in range(len(cache)):
        sample, _ = cache[i]
        source = images[Path(cache.path(i)).name]
        region = region_of(source.shape[:2], cache)
        sh, sw = sample.shape[:2]
        for rt, rl, rh, rw in BOXES:
            box = np.array([[round(rt * sh), round(rl * sw), max(1, round(rh * sh)), max(1, round(rw * sw))]])
            t, lf, h, w = box[0]
            mapped = fidelity.to_source(box, [region])[0]
            st, sl = round(mapped[0]), round(mapped[1])
            sb, sr = round(mapped[0] + mapped[2]), round(mapped[1] + mapped[3])
            assert 0 <= st < sb <= source.shape[0] and 0 <= sl < sr <= source.shape[1], (cache.path(i), mapped)
            errors.append(float(np.abs(_resized(sample[t : t + h, lf : lf + w]) - _resized(source[st:sb, sl:sr])).mean()))
    return errors


@pytest.mark.parametrize("key", ["crop", "short", "short-1.5"])
def test_a_crop_of_the_sample_is_the_mapped_crop_of_the_source(fidelity, caches, key):
    images, built = caches
    cfg = datapipe.open(built[key]).manifest.config

    def region_of(hw, cache):
        return fidelity.sample_region(hw, cfg["fit"], cache.size, float(cfg.get("max_aspect", 2.0)))

    errors = _errors(fidelity, images, built[key], region_of)
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize("key", ["crop", "short-1.5"])
def test_the_check_catches_a_mapping_that_forgets_the_cut(fidelity, caches, key):
    """Mapping as if the sample showed the whole source (a plain rescale) misplaces the crops of cut images."""
    images, built = caches

    def whole(hw, cache):
        sample_hw = cache.shapes[[Path(cache.path(i)).name for i in range(len(cache))].index(name_of[hw])]
        return fidelity.Region(0, 0, hw[0], hw[1], hw[0] / sample_hw[0], hw[1] / sample_hw[1])

    name_of = {tuple(SHAPES[n]): n for n in SHAPES}
    errors = _errors(fidelity, images, built[key], whole)
    assert max(errors) > 3 * TOLERANCE, errors


def test_the_regions_match_the_stored_shapes_and_what_is_cut(fidelity, caches):
    images, built = caches
    for key, path in built.items():
        cache = datapipe.open(path)
        cfg = cache.manifest.config
        for i in range(len(cache)):
            h, w = SHAPES[Path(cache.path(i)).name]
            g = fidelity.sample_region((h, w), cfg["fit"], cache.size, float(cfg.get("max_aspect", 2.0)))
            sh, sw = (int(v) for v in cache.shapes[i])
            assert (g.height / g.sy, g.width / g.sx) == pytest.approx((sh, sw))
            assert 0 <= g.top and g.top + g.height <= h and 0 <= g.left and g.left + g.width <= w
            whole = g.height * g.width == h * w
            if key == "crop":
                assert whole == (h == w) and (g.height, g.width) == (min(h, w), min(h, w))
            else:  # a pure scale of the whole image, unless beyond --max-aspect: then its centre
                assert whole == (max(h, w) / min(h, w) <= float(cfg["max_aspect"])), (key, h, w)
                assert g.sy == pytest.approx(g.sx, rel=0.03)
