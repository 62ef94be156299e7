"""The stored sample encodings and the sample index (datapipe/samples.py)."""

from __future__ import annotations

import numpy as np
import pytest

from datapipe import samples
from datapipe.errors import CorruptShardError


def _photo(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A smooth image (JPEG-friendly, like a photo) with a gradient and some texture."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([128 + 100 * np.sin(x / 17 + c) * np.cos(y / 23 - c) for c in range(3)], axis=-1)
    return np.clip(base + rng.normal(0, 4, (h, w, 3)), 0, 255).astype(np.uint8)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / max(mse, 1e-12)))


@pytest.mark.parametrize("shape", [(256, 256), (256, 341), (341, 256), (17, 9), (1, 1)])
def test_raw_encoding_is_the_pixels_byte_for_byte(shape):
    img = _photo(*shape)
    data = bytes(samples.encode(img, "raw"))
    assert data == img.tobytes()


@pytest.mark.parametrize("shape", [(256, 256), (256, 341), (341, 256), (33, 17)])
def test_jpeg_round_trip_keeps_the_shape_and_the_picture(shape):
    img = _photo(*shape)
    data = bytes(samples.encode(img, "jpeg", 90))
    assert data[:2] == b"\xff\xd8"
    out = samples.decode_jpeg(data, *shape, where="s")
    assert out.shape == (*shape, 3) and out.dtype == np.uint8
    assert _psnr(out, img) > 30


def test_jpeg_quality_trades_bytes_for_fidelity():
    img = _photo(256, 320)
    low, high = (bytes(samples.encode(img, "jpeg", q)) for q in (50, 95))
    assert len(low) < len(high)
    assert _psnr(samples.decode_jpeg(low, 256, 320, where="s"), img) < _psnr(samples.decode_jpeg(high, 256, 320, where="s"), img)


def test_decode_into_a_given_buffer():
    img = _photo(64, 48)
    out = np.zeros((64, 48, 3), np.uint8)
    res = samples.decode_jpeg(bytes(samples.encode(img, "jpeg")), 64, 48, where="s", out=out)
    assert np.shares_memory(res, out) and out.any()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_damaged_jpeg_is_an_error_naming_the_sample(damage, crop_path):
    data = bytes(samples.encode(_photo(64, 64), "jpeg"))
    bad = {"truncate": data[: len(data) // 3], "garbage": b"\x00" * 200, "empty": b""}[damage]
    with pytest.raises(CorruptShardError, match="shard 7, sample 3"):
        samples.decode_jpeg(bad, 64, 64, where="shard 7, sample 3")
    for box in ((0, 0, 64, 64), (0, 0, 40, 40)):  # with and without DCT scaling
        with pytest.raises(CorruptShardError, match="shard 7, sample 3"):
            samples.decode_crop(bad, 64, 64, box, 16, where="shard 7, sample 3")


def test_a_jpeg_of_another_shape_than_the_index_says_is_an_error():
    data = bytes(samples.encode(_photo(64, 80), "jpeg"))
    with pytest.raises(CorruptShardError, match="64x80"):
        samples.decode_jpeg(data, 80, 64, where="s")


@pytest.fixture(params=["partial", "whole"])
def crop_path(request, monkeypatch):
    """decode_crop with the partial decoder (skipped where it is not available) and with whole-image decodes."""
    if request.param == "whole":
        monkeypatch.setattr(samples, "partial_decoder", lambda: None)
    elif samples.partial_decoder() is None:
        pytest.skip(f"partial decoder: {samples.describe_decoder()}")
    return request.param


def test_decode_crop_without_downscale_is_the_full_decodes_crop(crop_path):
    img = _photo(200, 300)
    data = bytes(samples.encode(img, "jpeg"))
    full = samples.decode_jpeg(data, 200, 300, where="s")
    box = (10, 20, 150, 180)  # under twice the output: no DCT scaling
    dec, (t, lf, h, w) = samples.decode_crop(data, 200, 300, box, 100, where="s")
    assert (h, w) == box[2:] and np.array_equal(dec[t:t + h, lf:lf + w], full[10:160, 20:200])
    if crop_path == "whole":
        assert dec.shape[:2] == (200, 300) and (t, lf) == box[:2]
    else:  # only the crop's rows, and its columns from an iMCU boundary
        assert dec.shape[0] == 150 and dec.shape[1] < 300


@pytest.mark.parametrize("box,out", [((0, 0, 400, 600), 100), ((40, 60, 320, 400), 64), ((0, 0, 400, 400), 50),
                                     ((100, 200, 256, 300), 128)])
def test_decode_crop_scales_down_in_the_dct_and_maps_the_box(box, out, crop_path):
    """A crop at least twice the output is decoded smaller; the mapped crop keeps >= ``out`` pixels a
    side, and shows the same region as the full-size crop."""
    h, w = 400, 600
    img = _photo(h, w, seed=3)
    data = bytes(samples.encode(img, "jpeg", 95))
    dec, (t, lf, ch, cw) = samples.decode_crop(data, h, w, box, out, where="s")
    dec = dec.copy()  # the decoder's buffer is reused by this thread's next decode
    assert dec.shape[0] < h and dec.shape[1] < w  # decoded at a reduced scale
    assert ch >= out - 1 and cw >= out - 1
    assert 0 <= t and t + ch <= dec.shape[0] and 0 <= lf and lf + cw <= dec.shape[1]
    import simplejpeg

    whole, (wt, wl, wh, ww) = samples._decode_crop_whole(data, h, w, box, samples._scale_eighths(box, out, h, w), "s")
    sy, sx = whole.shape[0] / h, whole.shape[1] / w
    assert sy < 1 and abs(wt - box[0] * sy) <= 1 and abs(wl - box[1] * sx) <= 1
    assert (ch, cw) == (wh, ww) and abs(ch - box[2] * sy) <= 1 and abs(cw - box[3] * sx) <= 1
    # the pixels of simplejpeg's scaled decode of the whole image, there
    scaled = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=whole.shape[0], min_width=whole.shape[1])
    assert np.array_equal(dec[t:t + ch, lf:lf + cw], scaled[wt:wt + wh, wl:wl + ww])
    # the same picture: the scaled crop against the full crop block-averaged to the same size
    import torch

    ref = torch.from_numpy(img[box[0]:box[0] + box[2], box[1]:box[1] + box[3]]).permute(2, 0, 1)[None].float()
    ref = torch.nn.functional.interpolate(ref, size=(ch, cw), mode="area")[0].permute(1, 2, 0).numpy()
    assert _psnr(dec[t:t + ch, lf:lf + cw], ref) > 24


def _index(shapes, encoding="raw", sizes=None):
    nbytes = np.array(sizes if sizes is not None else [h * w * 3 for h, w in shapes], np.int64)
    offsets = np.concatenate([[0], np.cumsum(nbytes[:-1])]).astype(np.int64)
    rows = np.column_stack([offsets, nbytes, [h for h, _ in shapes], [w for _, w in shapes]])
    return samples.SampleIndex.of(rows)


def test_index_round_trip():
    idx = _index([(256, 341), (300, 256), (256, 256)])
    back = samples.SampleIndex.parse(idx.to_bytes(), count=3, encoding="raw", max_side=512, where="f")
    for a, b in zip((idx.offsets, idx.nbytes, idx.heights, idx.widths), (back.offsets, back.nbytes, back.heights, back.widths),
                    strict=True):
        assert np.array_equal(a, b)
    assert back.data_size == sum(h * w * 3 for h, w in [(256, 341), (300, 256), (256, 256)])
    empty = samples.SampleIndex.parse(b"", count=0, encoding="jpeg", max_side=512, where="f")
    assert len(empty) == 0 and empty.data_size == 0


@pytest.mark.parametrize("edit,match", [
    (lambda r: r[:-8], "bytes, expected"),                       # truncated
    (lambda r: r + b"\0" * 32, "bytes, expected"),               # a row too many
    (lambda r: _set(r, 1, 2, 0), "shape 0x"),                    # zero height
    (lambda r: _set(r, 0, 3, 99999), "outside 1..512"),          # absurd width
    (lambda r: _set(r, 2, 1, 5), "bytes, expected"),             # raw size that disagrees with the shape
    (lambda r: _set(r, 1, 0, 3), "at byte 3"),                   # overlapping samples
])
def test_an_impossible_index_is_an_error_naming_the_file(edit, match):
    raw = _index([(256, 341), (300, 256), (256, 256)]).to_bytes()
    with pytest.raises(CorruptShardError, match=match) as info:
        samples.SampleIndex.parse(edit(raw), count=3, encoding="raw", max_side=512, where="shards/000004.zarr/index")
    assert "shards/000004.zarr/index" in str(info.value) and "rerun" in str(info.value)


def test_a_jpeg_index_needs_bytes_but_not_the_raw_size():
    idx = _index([(256, 341), (300, 256)], sizes=[1234, 999])
    assert len(samples.SampleIndex.parse(idx.to_bytes(), count=2, encoding="jpeg", max_side=512, where="f")) == 2
    bad = _index([(256, 341), (300, 256)], sizes=[1234, 0])
    with pytest.raises(CorruptShardError, match="sample 1 0 bytes"):
        samples.SampleIndex.parse(bad.to_bytes(), count=2, encoding="jpeg", max_side=512, where="f")


def _set(raw: bytes, row: int, col: int, value: int) -> bytes:
    arr = np.frombuffer(raw, "<i8").copy().reshape(-1, 4)
    arr[row, col] = value
    return arr.tobytes()
