"""The partial JPEG decoder of crops (datapipe/_jpegcrop.c, through datapipe.samples.decode_crop).

It decodes only a crop's region of a stored JPEG sample, and its pixels must be those of
libjpeg-turbo's whole decode there, byte for byte: simplejpeg's decode of the whole image (at the
same DCT scale) is the reference, over many random boxes (edges and corners included), odd sizes,
4:2:0 (what a cache stores), the other subsamplings, grey-looking samples and every scale the crops
use. Damaged data is a CorruptShardError naming the sample, never a crash; and the training augment
gives the same values with and without it.
"""

from __future__ import annotations

import os
import platform
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import simplejpeg
import torch

from datapipe import augment, native, samples
from datapipe.errors import CorruptShardError

decoder = samples.partial_decoder()
needs_decoder = pytest.mark.skipif(decoder is None, reason=f"partial decoder: {samples.describe_decoder()}")


def _image(h: int, w: int, seed: int, grey: bool = False) -> np.ndarray:
    """A smooth picture with texture and sharp edges (chroma that changes across blocks)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([128 + 90 * np.sin(x / (5 + 7 * c) + c) * np.cos(y / (9 + 3 * c) - c) for c in range(3)], axis=-1)
    img += rng.normal(0, 12, (h, w, 3))
    img[(x.astype(int) // 11 + y.astype(int) // 7) % 5 == 0] = (250, 20, 40)
    if grey:
        img[...] = img[..., :1]
    return np.clip(img, 0, 255).astype(np.uint8)


def _encode(img: np.ndarray, subsampling: str = "420", quality: int = 90) -> bytes:
    return simplejpeg.encode_jpeg(img, quality=quality, colorspace="RGB", colorsubsampling=subsampling)


def _boxes(sh: int, sw: int, n: int, rng: np.random.Generator) -> list[tuple[int, int, int, int]]:
    """Random boxes of a sh x sw image, plus the whole image, its corners, a row and a column."""
    boxes = [(0, 0, sh, sw), (0, 0, 1, 1), (sh - 1, sw - 1, 1, 1), (sh // 2, 0, 1, sw), (0, sw // 2, sh, 1)]
    for _ in range(n):
        h, w = int(rng.integers(1, sh + 1)), int(rng.integers(1, sw + 1))
        boxes.append((int(rng.integers(0, sh - h + 1)), int(rng.integers(0, sw - w + 1)), h, w))
    return boxes


def _check_crops(data: bytes, h: int, w: int, eighths: int, boxes_per_scale: int, seed: int) -> None:
    assert decoder is not None
    sh, sw = samples._scaled(h, eighths), samples._scaled(w, eighths)
    whole = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=sh, min_width=sw) if eighths < 8 else \
        simplejpeg.decode_jpeg(data, colorspace="RGB")
    assert whole.shape[:2] == (sh, sw)
    for box in _boxes(sh, sw, boxes_per_scale, np.random.default_rng(seed)):
        img, (t, lf, bh, bw) = decoder.crop(data, h, w, eighths, box, "s")
        top, left, _, _ = box
        assert (bh, bw) == box[2:] and 0 <= t and t + bh <= img.shape[0] and 0 <= lf and lf + bw <= img.shape[1]
        assert img.shape[0] == bh, "only the crop's rows are decoded"
        np.testing.assert_array_equal(img[t:t + bh, lf:lf + bw], whole[top:top + bh, left:left + bw], err_msg=f"{box} at {eighths}/8")


def test_the_partial_decoder_is_built_where_a_compiler_exists():
    if os.environ.get("DATAPIPE_NATIVE") == "0":
        assert decoder is None and "DATAPIPE_NATIVE=0" in samples.describe_decoder()
        return
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    bundled = [p for p in samples._libjpeg_candidates() if Path(p).is_file()]
    if compiler and platform.system() == "Linux" and bundled:
        assert decoder is not None, samples.describe_decoder()
        assert "crops decoded alone" in samples.describe_decoder()


@needs_decoder
@pytest.mark.parametrize("shape", [(256, 256), (257, 199), (33, 65), (300, 451), (17, 17), (1, 1), (9, 700), (700, 9)])
def test_crops_are_the_whole_decodes_pixels_at_every_scale(shape):
    h, w = shape
    data = _encode(_image(h, w, seed=h * 1000 + w))
    for eighths in (8, 4, 2, 1, 3, 5, 6, 7):
        _check_crops(data, h, w, eighths, 25, seed=eighths)


@needs_decoder
@pytest.mark.parametrize("subsampling", ["444", "422", "440", "411"])
@pytest.mark.parametrize("shape", [(256, 256), (123, 301)])
def test_crops_are_exact_for_every_subsampling(subsampling, shape):
    h, w = shape
    data = _encode(_image(h, w, seed=7), subsampling)
    for eighths in (8, 4, 3, 1):
        _check_crops(data, h, w, eighths, 25, seed=eighths + 10)


@needs_decoder
def test_crops_of_a_one_component_jpeg_are_exact():
    """Stored samples have three components, but a greyscale stream decodes to RGB the same way in both."""
    img = _image(99, 131, seed=8)[..., :1].copy()
    data = simplejpeg.encode_jpeg(img, quality=90, colorspace="GRAY")
    for eighths in (8, 4, 3):
        _check_crops(data, 99, 131, eighths, 25, seed=eighths + 20)


@needs_decoder
@pytest.mark.parametrize("quality", [50, 95])
def test_crops_are_exact_for_grey_samples_stored_as_rgb_and_other_qualities(quality):
    data = _encode(_image(150, 211, seed=3, grey=True), quality=quality)
    for eighths in (8, 2):
        _check_crops(data, 150, 211, eighths, 30, seed=quality + eighths)


@needs_decoder
def test_decode_crop_gives_the_whole_image_paths_crops_for_training_boxes(monkeypatch):
    """decode_crop with the partial decoder against decode_crop without it, on RandomResizedCrop boxes
    (several scales) of 4:2:0 samples of varied shapes: the same crop's pixels, the same DCT scale."""
    shapes = [(256, 256), (256, 341), (341, 256), (97, 131), (480, 640)]
    data = [_encode(_image(h, w, seed=i)) for i, (h, w) in enumerate(shapes)]
    hs, ws = torch.tensor([h for h, _ in shapes]), torch.tensor([w for _, w in shapes])
    for out in (224, 64, 32):
        for seed in range(6):
            boxes = augment.train(out).sample(len(shapes), hs, ws, seed)["crops"].tolist()
            for (h, w), d, box in zip(shapes, data, boxes, strict=True):
                img, (t, lf, bh, bw) = samples.decode_crop(d, h, w, tuple(box), out, where="s")
                got = img[t:t + bh, lf:lf + bw].copy()
                with monkeypatch.context() as m:
                    m.setattr(samples, "partial_decoder", lambda: None)
                    whole, (wt, wl, wh, ww) = samples.decode_crop(d, h, w, tuple(box), out, where="s")
                assert (bh, bw) == (wh, ww) and img.size <= whole.size
                np.testing.assert_array_equal(got, whole[wt:wt + wh, wl:wl + ww])


@needs_decoder
def test_the_training_augment_gives_the_same_values_with_and_without_it(monkeypatch):
    from datapipe.cache import EncodedSample

    shapes = [(256, 256), (200, 300), (300, 200), (64, 64)]
    encoded = [EncodedSample(np.frombuffer(_encode(_image(h, w, seed=i)), np.uint8), h, w, f"sample {i}")
               for i, (h, w) in enumerate(shapes)]
    train = augment.train(64)
    partial = train.decode(encoded, seed=5)
    monkeypatch.setattr(samples, "partial_decoder", lambda: None)
    assert torch.equal(partial, train.decode(encoded, seed=5))


@needs_decoder
def test_threads_decode_at_once_with_the_same_results():
    """ctypes releases the GIL; each thread has its own buffers, so concurrent crops stay exact."""
    data = _encode(_image(256, 320, seed=1))
    whole = simplejpeg.decode_jpeg(data, colorspace="RGB")
    boxes = _boxes(256, 320, 200, np.random.default_rng(2))
    failures: list[str] = []

    def work(part: list[tuple[int, int, int, int]]) -> None:
        assert decoder is not None
        for box in part:
            img, (t, lf, bh, bw) = decoder.crop(data, 256, 320, 8, box, "s")
            if not np.array_equal(img[t:t + bh, lf:lf + bw], whole[box[0]:box[0] + bh, box[1]:box[1] + bw]):
                failures.append(str(box))

    threads = [threading.Thread(target=work, args=(boxes[k::4],)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not failures


def _damaged(data: bytes) -> dict[str, bytes]:
    """Ways a stored sample can be damaged that any crop detects: cut short (in the header, in the scan, by
    the last bytes only), stray markers, or not a JPEG at all."""
    scan = data.index(b"\xff\xda")
    junk = bytearray(data)
    junk[scan + 30 : scan + 34] = b"\xff\xd0\xff\xc4"  # stray markers in the scan
    return {"header": data[: scan // 2], "early": data[: scan + 100], "mid": data[: len(data) // 2], "last byte": data[:-1],
            "markers": bytes(junk), "garbage": b"\x00" * 300, "not a jpeg": b"GIF89a" + data[6:],
            "empty": b"", "soi only": b"\xff\xd8"}


@pytest.mark.parametrize("kind", ["header", "early", "mid", "last byte", "markers", "garbage", "not a jpeg", "empty", "soi only"])
@pytest.mark.parametrize("box,out", [((0, 0, 200, 240), 224), ((0, 0, 40, 40), 32), ((150, 100, 90, 120), 64),
                                     ((0, 0, 240, 240), 32)])
def test_damaged_data_is_an_error_naming_the_sample(kind, box, out):
    """Every damage raises CorruptShardError with the sample's name, whatever part of the image the crop
    covers (its top rows, where reading stops early, or its bottom); never another exception."""
    data = _damaged(_encode(_image(240, 320, seed=4)))[kind]
    with pytest.raises(CorruptShardError, match="shard 3, sample 9"):
        samples.decode_crop(data, 240, 320, box, out, where="shard 3, sample 9")


@needs_decoder
@pytest.mark.parametrize("box,out", [((150, 100, 90, 120), 64), ((0, 0, 240, 240), 32), ((0, 0, 240, 320), 224)])
def test_entropy_data_damaged_in_place_is_an_error_for_crops_reaching_the_last_row(box, out):
    """Zeroed coded data desynchronises the decoder, which a whole decode notices at the end marker (data left
    over); a crop reaching the last row reads on to it too. A crop that stops above reads no further: its
    pixels may be wrong where the damage is, as they would be in a whole decode of a damage that keeps sync."""
    data = bytearray(_encode(_image(240, 320, seed=4)))
    scan = data.index(b"\xff\xda")
    data[scan + 40 : scan + 200] = bytes(160)
    with pytest.raises(CorruptShardError, match="shard 3, sample 9.*extraneous bytes"):
        samples.decode_crop(bytes(data), 240, 320, box, out, where="shard 3, sample 9")


@needs_decoder
def test_a_header_of_another_shape_than_the_index_is_an_error():
    data = _encode(_image(64, 80, seed=0))
    with pytest.raises(CorruptShardError, match="64x80"):
        samples.decode_crop(data, 80, 64, (0, 0, 40, 40), 32, where="s")


@needs_decoder
def test_a_box_outside_the_image_is_refused():
    assert decoder is not None
    data = _encode(_image(64, 80, seed=0))
    for box in ((0, 0, 65, 10), (0, 75, 10, 10), (60, 0, 10, 10), (0, 0, 0, 5)):
        with pytest.raises(ValueError, match="cannot decode the crop"):
            decoder.crop(data, 64, 80, 8, box, "s")
    with pytest.raises(ValueError, match="cannot decode the crop"):
        decoder.crop(data, 64, 80, 4, (0, 0, 33, 10), "s")  # the image is 32 x 40 at 4/8


@needs_decoder
def test_a_progressive_jpeg_decodes_and_repeated_scans_are_refused():
    """Stored samples are baseline, but a progressive stream must decode exactly too; one that repeats its
    scans hundreds of times (a decode that would run long) is refused."""
    from io import BytesIO

    from PIL import Image

    img = _image(120, 160, seed=6)
    buf = BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90, progressive=True, subsampling=2)
    data = buf.getvalue()
    assert decoder is not None
    whole = simplejpeg.decode_jpeg(data, colorspace="RGB")
    crop, (t, lf, bh, bw) = decoder.crop(data, 120, 160, 8, (30, 41, 50, 70), "s")
    np.testing.assert_array_equal(crop[t:t + bh, lf:lf + bw], whole[30:80, 41:111])
    # its first scan's header, with no data, 600 times over
    scan = data.index(b"\xff\xda")
    sos_len = int.from_bytes(data[scan + 2 : scan + 4], "big")
    one_scan = data[scan : scan + 2 + sos_len] + b"\x00"  # an empty DC scan of all components
    bombed = data[:scan] + one_scan * 600 + b"\xff\xd9"
    with pytest.raises(CorruptShardError, match="s"):
        decoder.crop(bombed, 120, 160, 8, (0, 0, 10, 10), "s")


# ----------------------------------------------------------------------------- restart markers: tiles spliced out

def _encode_tiled(img: np.ndarray, subsampling: int = 2, interval: int = 1) -> bytes:
    """A baseline JPEG with a restart marker every ``interval`` MCUs (Pillow's encoder, as a cache's samples)."""
    from io import BytesIO

    from PIL import Image

    buf = BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90, subsampling=subsampling, restart_marker_blocks=interval)
    return buf.getvalue()


def _tiles(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each restart interval's coded data."""
    start = data.index(b"\xff\xda")
    start += 2 + int.from_bytes(data[start + 2 : start + 4], "big")
    spans, i = [], start
    while True:
        i = data.index(b"\xff", i)
        if data[i + 1] == 0:
            i += 2
            continue
        spans.append((start, i))
        if not 0xD0 <= data[i + 1] <= 0xD7:
            return spans
        start = i = i + 2


def test_stored_samples_carry_a_restart_marker_every_mcu_and_decode_anywhere():
    from io import BytesIO

    from PIL import Image

    img = _image(70, 90, seed=11)
    data = bytes(samples.encode(img, "jpeg"))
    dri = data.index(b"\xff\xdd")
    assert int.from_bytes(data[dri + 4 : dri + 6], "big") == samples.RESTART_INTERVAL == 1
    assert len(_tiles(data)) == 5 * 6  # 16x16 MCUs (4:2:0)
    ours = simplejpeg.decode_jpeg(data, colorspace="RGB")
    np.testing.assert_array_equal(ours, np.asarray(Image.open(BytesIO(data)).convert("RGB")))

    def psnr(decoded: np.ndarray) -> float:
        return float(10 * np.log10(255**2 / np.mean((decoded.astype(float) - img) ** 2)))

    plain = simplejpeg.decode_jpeg(_encode(img), colorspace="RGB")  # libjpeg-turbo, same quality, no markers
    assert psnr(ours) > psnr(plain) - 0.5


@needs_decoder
@pytest.mark.parametrize("subsampling", [2, 1, 0])  # 4:2:0 (what a cache stores), 4:2:2, 4:4:4
@pytest.mark.parametrize("interval", [1, 2, 4, 3])  # 3 does not divide the 4:2:0 rows of 256 or 301: not spliced
@pytest.mark.parametrize("shape", [(256, 256), (123, 301), (17, 300), (300, 17), (40, 40)])
def test_crops_of_samples_with_restart_markers_are_exact(subsampling, interval, shape):
    """The tiles under a crop are decoded alone at every DCT scale; the pixels are the whole decode's."""
    h, w = shape
    data = _encode_tiled(_image(h, w, seed=h + w), subsampling, interval)
    for eighths in (8, 4, 2, 1, 7, 5):
        _check_crops(data, h, w, eighths, 20, seed=interval * 10 + eighths)


@needs_decoder
@pytest.mark.parametrize("subsampling", [2, 1])
def test_narrow_crops_of_samples_with_restart_markers_are_exact_at_every_scale(subsampling):
    """Crops one to three pixels wide or high, along every edge and across the image: a spliced image of one
    tile, a few pixels wide once scaled, would upsample differently at its edge (at least two are decoded)."""
    assert decoder is not None
    for h, w in ((37, 53), (300, 17), (17, 300)):
        data = _encode_tiled(_image(h, w, seed=h * w), subsampling)
        for eighths in range(1, 9):
            sh, sw = samples._scaled(h, eighths), samples._scaled(w, eighths)
            whole = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=sh, min_width=sw)
            boxes = [(0, left, sh, n) for left in range(sw) for n in (1, 2, 3) if left + n <= sw]
            boxes += [(top, 0, n, sw) for top in range(0, sh, 3) for n in (1, 2, 3) if top + n <= sh]
            for box in boxes:
                img, (t, lf, bh, bw) = decoder.crop(data, h, w, eighths, box, "s")
                np.testing.assert_array_equal(img[t:t + bh, lf:lf + bw], whole[box[0]:box[0] + bh, box[1]:box[1] + bw],
                                              err_msg=f"{(h, w)} at {eighths}/8: {box}")


@needs_decoder
@pytest.mark.parametrize("tiled", [False, True])
def test_crops_one_pixel_wide_at_the_left_edge_are_exact(tiled):
    """A region one 4:2:0 chroma column wide upsamples differently in libjpeg-turbo: two are decoded."""
    for h, w in ((16, 8), (40, 9), (33, 16), (64, 17), (50, 48)):
        img = _image(h, w, seed=w)
        data = _encode_tiled(img) if tiled else _encode(img)
        whole = simplejpeg.decode_jpeg(data, colorspace="RGB")
        assert decoder is not None
        for box in ((0, 0, h, 1), (h // 3, 0, h // 2, 1), (0, 1, h, 1), (0, 0, 1, 1), (0, w - 1, h, 1)):
            img_, (t, lf, bh, bw) = decoder.crop(data, h, w, 8, box, "s")
            np.testing.assert_array_equal(img_[t:t + bh, lf:lf + bw], whole[box[0]:box[0] + bh, box[1]:box[1] + bw],
                                          err_msg=f"{(h, w)} {box}")


@needs_decoder
def test_only_the_tiles_of_a_crop_are_decoded():
    """With restart markers, a crop's Huffman decoding skips the tiles away from it: a tile made undecodable
    (all-ones bits: an invalid code) fails the crops that cover it and no other, while a decoder that read
    the whole scan (or every row above the crop) would fail them all."""
    img = _image(64, 64, seed=12)
    data = bytearray(_encode_tiled(img))
    clean_data = bytes(data)
    clean = simplejpeg.decode_jpeg(clean_data, colorspace="RGB")
    start, end = _tiles(bytes(data))[0]  # the top-left MCU, pixels [0, 16) x [0, 16)
    data[start:end - (end - start) % 2] = b"\xff\x00" * ((end - start) // 2)
    broken = bytes(data)
    with pytest.raises(ValueError):
        simplejpeg.decode_jpeg(broken, colorspace="RGB", strict=True)
    for box in ((40, 40, 20, 20), (20, 0, 44, 64), (0, 20, 64, 44), (17, 17, 40, 40)):
        got, (t, lf, bh, bw) = samples.decode_crop(broken, 64, 64, box, 64, where="s")  # full scale: no DCT scaling
        np.testing.assert_array_equal(got[t:t + bh, lf:lf + bw], clean[box[0]:box[0] + bh, box[1]:box[1] + bw])
    for box in ((20, 0, 44, 64), (0, 20, 64, 44)):  # at least twice the output: decoded at 4/8, tiles spliced too
        whole, (t, lf, bh, bw) = samples.decode_crop(clean_data, 64, 64, box, 16, where="s")
        whole = whole.copy()  # the decoder's buffer is reused by the next decode
        got, mapped = samples.decode_crop(broken, 64, 64, box, 16, where="s")
        assert mapped == (t, lf, bh, bw) and got.shape[0] == bh < 64
        np.testing.assert_array_equal(got[t:t + bh, lf:lf + bw], whole[t:t + bh, lf:lf + bw])
    for box in ((0, 0, 8, 8), (10, 10, 30, 30), (0, 0, 64, 64)):
        with pytest.raises(CorruptShardError, match="shard 1, sample 2"):
            samples.decode_crop(broken, 64, 64, box, 16, where="shard 1, sample 2")


@needs_decoder
def test_restart_markers_out_of_order_are_not_spliced_and_are_an_error():
    """A renumbered marker breaks the tiles' order: the crop is decoded from the data as it is, where
    libjpeg-turbo reports the broken sequence."""
    data = bytearray(_encode_tiled(_image(64, 64, seed=13)))
    _, end = _tiles(bytes(data))[5]
    assert data[end] == 0xFF and data[end + 1] == 0xD5
    data[end + 1] = 0xD2
    with pytest.raises(CorruptShardError, match="s"):
        samples.decode_crop(bytes(data), 64, 64, (40, 40, 20, 20), 16, where="s")


@needs_decoder
@pytest.mark.parametrize("kind", ["header", "early", "mid", "last byte", "markers", "garbage", "not a jpeg", "empty", "soi only"])
@pytest.mark.parametrize("box,out", [((0, 0, 200, 240), 224), ((150, 100, 90, 120), 64), ((100, 140, 30, 30), 16)])
def test_damaged_samples_with_restart_markers_are_errors_naming_the_sample(kind, box, out):
    data = _damaged(bytes(samples.encode(_image(240, 320, seed=4), "jpeg")))[kind]
    with pytest.raises(CorruptShardError, match="shard 3, sample 9"):
        samples.decode_crop(data, 240, 320, box, out, where="shard 3, sample 9")


# ----------------------------------------------------------------------------- a batch in one call

def _encoded(shapes: list[tuple[int, int]], seed: int = 0) -> list:
    from datapipe.cache import EncodedSample

    return [EncodedSample(np.frombuffer(bytes(samples.encode(_image(h, w, seed=seed + i), "jpeg")), np.uint8), h, w,
                          f"shard 7, sample {i}") for i, (h, w) in enumerate(shapes)]


@needs_decoder
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_batch_call_gives_the_values_of_the_sample_by_sample_path(monkeypatch, channels_last):
    """train.decode crops a JPEG batch in one compiled call (decode, resize, mirror, normalise); its values
    are those of the per-sample path, at full scale and DCT-scaled, for samples of varied shapes."""
    if native.kernel_addresses() is None:
        pytest.skip(f"kernels: {native.describe()}")
    encoded = _encoded([(256, 256), (256, 341), (341, 256), (97, 131), (480, 640), (64, 64), (300, 17)])
    for size in (224, 64, 24):
        train = augment.train(size, channels_last=channels_last)
        params = train.sample(len(encoded), torch.tensor([e.height for e in encoded]), torch.tensor([e.width for e in encoded]), 9)
        batch = train._decode_batch(encoded, params, None, len(encoded))
        assert batch is not None and batch.shape == (len(encoded), 3, size, size)
        assert batch.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        with monkeypatch.context() as m:
            m.setattr(augment.TrainAugment, "_decode_batch", lambda *a, **k: None)
            per_sample = train.decode(encoded, seed=9)
        assert torch.equal(train.decode(encoded, seed=9), per_sample)
        assert torch.equal(batch, per_sample)


@needs_decoder
@pytest.mark.parametrize("kind", ["header", "mid", "last byte", "garbage", "not a jpeg", "empty"])  # seen by every crop
def test_a_damaged_sample_in_a_batch_call_is_an_error_naming_it(kind):
    from datapipe.cache import EncodedSample

    encoded = _encoded([(120, 160)] * 5, seed=3)
    bad = _damaged(bytes(encoded[3].data))[kind]
    encoded[3] = EncodedSample(np.frombuffer(bad, np.uint8), 120, 160, "shard 7, sample 3")
    with pytest.raises(CorruptShardError, match="shard 7, sample 3"):
        augment.train(64).decode(encoded, seed=1)


def test_the_batch_crop_regions_are_the_per_crop_scales_and_boxes():
    """samples.crop_regions (what the batch call decodes) equals _scale_eighths and _map_box crop by crop,
    over RandomResizedCrop boxes of many shapes and output sizes (DCT scales 1/8 to 8/8)."""
    rng = np.random.default_rng(0)
    scales = set()
    for out in (224, 64, 16):
        hs, ws = rng.integers(1, 900, 300), rng.integers(1, 900, 300)
        boxes = augment.train(out).sample(300, torch.from_numpy(hs), torch.from_numpy(ws), out)["crops"].numpy()
        regions, eighths = samples.crop_regions(boxes, hs, ws, out)
        for box, h, w, region, m in zip(boxes.tolist(), hs.tolist(), ws.tolist(), regions.tolist(), eighths.tolist(), strict=True):
            want = samples._scale_eighths(tuple(box), out, h, w)
            mapped = tuple(box) if want == 8 else samples._map_box(tuple(box), h, w, samples._scaled(h, want), samples._scaled(w, want))
            assert (m, tuple(region)) == (want, mapped), (out, h, w, box)
            scales.add(m)
    assert {1, 2, 8} <= scales


@needs_decoder
def test_samples_are_encoded_to_pillows_bytes_with_or_without_the_compiled_encoder(monkeypatch):
    """The build encodes through the library the partial decoder opened (a third less time than Pillow's
    per-image work) and writes exactly Pillow's bytes for the same options, so a cache's bytes do not
    depend on whether the extension was built."""
    assert decoder is not None and decoder.encodes_as_pillow, samples.describe_decoder()
    assert "samples encoded by it too" in samples.describe_decoder()
    cases = [(_image(h, w, seed=h + w), q) for h, w in ((256, 256), (256, 341), (97, 131), (1, 1), (300, 17), (16, 17))
             for q in (90, 50, 100)]
    wide = _image(64, 90, seed=1)
    cases.append((wide[:, 10:80], 90))  # rows strided: not contiguous
    compiled = [bytes(samples.encode(img, "jpeg", q)) for img, q in cases]
    monkeypatch.setattr(samples, "partial_decoder", lambda: None)
    assert compiled == [bytes(samples.encode(img, "jpeg", q)) for img, q in cases]
    for (img, _), data in zip(cases, compiled, strict=True):
        assert simplejpeg.decode_jpeg(data, colorspace="RGB").shape == img.shape
