"""The data loaders people use today, run on the same data with the same output.

``datapipe bench`` compares itself against these peers. Every peer reads exactly the cache's
samples — the source files the cache holds (``cache.path(i)`` under the source root, with the
cache's labels; never a file the build quarantined), see :func:`cache_samples` — and yields the
same batches:
``(images, labels)`` with ``images`` a float32 tensor ``[B, 3, 224, 224]`` in ``[0, 1]`` and
``labels`` an int64 tensor ``[B]``.

Every peer decodes and augments with the same Pillow pipeline, :class:`ImageFolderTransform`,
the standard ImageNet training recipe: ``open -> convert('RGB') -> RandomResizedCrop(224) ->
RandomHorizontalFlip -> ToTensor``. The crop parameters come from the sampler datapipe's own
loader uses, :func:`datapipe.augment.sample_resized_crops` — torchvision's algorithm (10 tries, then
the centre-crop fallback), so every system crops from the same distribution — drawn from torch's
random number generator; the crop and resize are torchvision's, in Pillow, without importing torchvision.

Peers:

``dataloader``
    ``torch.utils.data.DataLoader`` over a map-style ImageFolder dataset (JPEG files on disk).
``webdataset``
    tar shards written with ``webdataset.ShardWriter``, read with ``wds.WebDataset`` +
    ``wds.WebLoader``.
``litdata``
    chunks written with ``litdata.optimize``, read with ``litdata.StreamingDataset`` +
    ``litdata.StreamingDataLoader``.
``streaming``
    MosaicML Streaming: MDS shards written with ``streaming.MDSWriter``, read with
    ``streaming.StreamingDataset`` in a torch ``DataLoader``.

The shard-based peers store the raw JPEG bytes, so all peers do the same decoding work per sample.
Third-party libraries (and torch) are imported lazily, inside the methods that need them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import json
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..files import listed_files, remove_empty_folders
from ..sources import IMAGE_EXTENSIONS
from .timing import timed_pass

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from PIL import Image as PILImage

    from ..cache import Cache

__all__ = [
    "IMG_EXTENSIONS",
    "PEERS",
    "DataLoaderPeer",
    "ImageFolderTransform",
    "LitDataPeer",
    "Peer",
    "PeerResult",
    "SampleList",
    "StreamingPeer",
    "WebDatasetPeer",
    "cache_samples",
    "collate_pairs",
    "get_peer",
    "list_image_folder",
    "measure",
]

#: File extensions a folder source is listed with: the build's (:data:`datapipe.sources.IMAGE_EXTENSIONS`).
IMG_EXTENSIONS = IMAGE_EXTENSIONS

#: datapipe's marker in a peer's folder: written first (``state: writing``), completed with the list of
#: the files written once the shards are complete. Only a folder carrying it is datapipe's to write.
_MARKER = "_datapipe_peer.json"
_MARKER_FORMAT = "datapipe-peer-shards"
#: Fixed seed of the order in which samples are written into shards (shards hold a shuffled mix of
#: classes, as is usual for shard formats; the readers shuffle again every epoch).
_WRITE_SEED = 0


# --------------------------------------------------------------------------------------------
# Source listing
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleList:
    """The files a peer reads: ``(absolute path, label)`` in order, under the source ``root``."""

    root: Path
    samples: tuple[tuple[Path, int], ...]

    def __len__(self) -> int:
        return len(self.samples)


def cache_samples(cache: Cache, source: str | os.PathLike, *, check: int = 8) -> SampleList:
    """A cache's own samples as the source files they were built from, for the peers to read.

    Every peer then decodes exactly the files the cache holds, with the cache's labels: files the
    build quarantined are not read, and a source other than the one the cache was built from is
    refused instead of measured.

    Args:
        cache: an opened :class:`~datapipe.Cache`.
        source: the folder the cache was built from (or its CSV list: paths are relative to the
            CSV's folder). It may have moved; its files must be the cache's.
        check: this many samples, spread over the cache, are decoded again with the build's
            configuration and must give the cache's pixels (byte for byte; a JPEG cache's within its encoding's loss).

    Raises:
        SourceError: a sample's file is missing under ``source``, or its content is not the
            cache's (another dataset with the same file names, a file changed since the build).
    """
    from ..errors import SourceError

    src = Path(source).expanduser()
    root = src.parent if src.is_file() else src
    if not root.is_dir():
        raise SourceError(f"--source {src} is not a folder (or a CSV list); pass the source the cache was built from")
    rel = [cache.path(i) for i in range(len(cache))]
    labels = [int(v) for v in cache.labels]
    from ..sources import locale_error

    # under a locale that reads file names otherwise than UTF-8, a name that is not ASCII is another file's: say so
    wrong = next((why for p in rel if not p.isascii() and (why := locale_error(p, text=True)) is not None), None)
    if wrong is not None:
        raise SourceError(f"--source {src}: the cache's sample {wrong}")
    missing = [p for p in rel if not (root / p).is_file()]
    built_from = cache.manifest.source.root
    if missing:
        raise SourceError(f"--source {src} does not hold the cache's samples: {len(missing):,} of {len(rel):,} files are "
                          f"missing (first: {missing[0]}); pass the source the cache was built from ({built_from})")
    for i in sorted({round(k * (len(rel) - 1) / max(check - 1, 1)) for k in range(check)} if rel else ()):
        if not _same_pixels(cache, i, root / rel[i]):
            raise SourceError(f"--source {src}: {rel[i]} is not the file sample {i} of the cache was built from (its "
                              f"pixels differ); pass the source the cache was built from ({built_from}), or rebuild (into "
                              "a new folder, if an earlier datapipe built the cache: its decode rules may differ)")
    return SampleList(root=root, samples=tuple((root / p, lab) for p, lab in zip(rel, labels, strict=True)))


# A JPEG cache's sample against the build's decode of its source file: the encoding's loss (35–37 dB at the
# default quality 90, ~30 at quality 50) is well above this; another picture is under 15 dB.
SAME_PICTURE_PSNR = 25.0


def _same_pixels(cache: Cache, index: int, file: Path) -> bool:
    """Does ``file``, decoded as the build decoded it (every field of its decoding configuration), give sample
    ``index``'s pixels: byte for byte in a raw cache, within the encoding's loss (SAME_PICTURE_PSNR) in a JPEG one?"""
    import dataclasses

    import numpy as np

    from ..codecs import DecodeSpec, decode_sample
    from ..errors import DecodeError

    config = cache.manifest.config
    spec = DecodeSpec(**{f.name: config[f.name] for f in dataclasses.fields(DecodeSpec) if f.name in config})
    try:
        with open(file, "rb") as f:
            pixels = decode_sample(f.read(), spec)
    except (DecodeError, OSError):
        return False
    stored = cache[index][0]
    if pixels.shape != stored.shape:
        return False
    if cache.encoding == "raw":
        return bool((pixels == stored).all())
    mse = float(np.mean((pixels.astype(np.float64) - stored) ** 2))
    return mse == 0 or 10 * np.log10(255.0**2 / mse) >= SAME_PICTURE_PSNR


def _as_samples(source: str | os.PathLike | SampleList) -> SampleList:
    """A SampleList as is; a folder listed the way torchvision's ImageFolder lists it."""
    if isinstance(source, SampleList):
        return source
    _, samples = list_image_folder(source)
    return SampleList(root=Path(source), samples=tuple(samples))


def list_image_folder(source: str | os.PathLike) -> tuple[list[str], list[tuple[Path, int]]]:
    """List an ImageNet-layout folder exactly as ``datapipe build`` does (:func:`datapipe.sources.scan`).

    Returns:
        ``(classes, samples)``: the sorted class-folder names, and ``(path, class_index)`` for
        every image file the build would read, sorted by path.

    Raises:
        SourceError: ``source`` is missing or holds no image file (a ``FileNotFoundError``).
    """
    from ..sources import scan

    listing = scan(source)
    return list(listing.classes), [(listing.root / p, label) for p, label in zip(listing.paths, listing.labels, strict=True)]


def _fingerprint(source: Path, samples: Sequence[tuple[Path, int]]) -> str:
    """The peer's shards are reused only for the same files (relative paths) with the same labels."""
    digest = hashlib.sha1()
    for path, label in samples:
        digest.update(f"{os.path.relpath(path, source)}\t{label}\n".encode())
    return digest.hexdigest()


def _write_order(n: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(_WRITE_SEED).permutation(n).tolist()


# --------------------------------------------------------------------------------------------
# The shared transform
# --------------------------------------------------------------------------------------------


class ImageFolderTransform:
    """The ImageNet training transform every peer uses, in Pillow, without torchvision.

    ``open -> convert('RGB') -> RandomResizedCrop(size, scale, ratio, bilinear, antialiased) ->
    RandomHorizontalFlip(flip_p) -> ToTensor`` (float32 ``[3, size, size]`` in ``[0, 1]``).

    Picklable (plain attributes only), so spawned DataLoader workers can use it. Randomness comes
    from torch's global generator (which DataLoader seeds in each worker) unless a
    ``torch.Generator`` is passed to :meth:`__call__`: first the crop (:meth:`crop_params`), then
    one draw for the flip.

    The crop parameters follow torchvision's distribution, not its random stream (a seed gives
    other crops than torchvision's for the same seed). By default the crop is cut out and then
    resized (``img.crop(box).resize(size)``), which is what torchvision does: for the same crop
    and flip the output is bit-identical to torchvision's ``resized_crop``, ``hflip`` and
    ``to_tensor``. With ``resize_box=True`` it resizes straight from the full image
    (``img.resize(size, box=box)``), which skips a copy; the interior is the same to within 1/255, but the filter then
    reads real pixels beyond the crop edges instead of repeating the edge, so the outermost
    1-2 pixel rows and columns differ from torchvision's.
    """

    def __init__(
        self,
        size: int = 224,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip_p: float = 0.5,
        resize_box: bool = False,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not (0 < scale[0] <= scale[1]):
            raise ValueError(f"scale must be 0 < min <= max, got {scale}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"ratio must be 0 < min <= max, got {ratio}")
        self.size = int(size)
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.flip_p = float(flip_p)
        self.resize_box = bool(resize_box)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio}, "
            f"flip_p={self.flip_p}, resize_box={self.resize_box})"
        )

    def crop_params(self, width: int, height: int, generator: torch.Generator | None = None) -> tuple[int, int, int, int]:
        """The crop ``(top, left, height, width)`` of a ``width`` x ``height`` image, drawn as torchvision's
        ``RandomResizedCrop.get_params`` draws it for each image (ten tries, then the centre crop of the clamped
        ratio), with this transform's ``scale`` and ``ratio``, from ``generator`` (default: torch's global one):
        the per-image sampler an ImageFolder pipeline runs (datapipe draws a batch's crops in one call)."""
        import math

        import torch

        area = height * width
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1], generator=generator).item()
            aspect_ratio = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator).item())
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
                j = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
                return i, j, h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w = width
            h = int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h = height
            w = int(round(h * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    @staticmethod
    def load(src: str | os.PathLike | bytes | bytearray | memoryview | PILImage.Image) -> PILImage.Image:
        """Open a path, encoded bytes or a Pillow image and convert it to RGB (ImageFolder's loader)."""
        from PIL import Image

        if isinstance(src, Image.Image):
            return src.convert("RGB")
        if isinstance(src, (bytes, bytearray, memoryview)):
            with Image.open(io.BytesIO(src)) as img:
                return img.convert("RGB")
        with open(src, "rb") as f:
            img = Image.open(f)
            return img.convert("RGB")

    def __call__(
        self,
        src: str | os.PathLike | bytes | bytearray | memoryview | PILImage.Image,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        import numpy as np
        import torch
        from PIL import Image

        img = self.load(src)
        i, j, h, w = self.crop_params(*img.size, generator)
        if self.resize_box:
            img = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=(j, i, j + w, i + h))
        else:
            img = img.crop((j, i, j + w, i + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1, generator=generator).item() < self.flip_p:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        pixels = torch.from_numpy(np.array(img, dtype=np.uint8, copy=True))
        return pixels.permute(2, 0, 1).contiguous().float().div_(255)


# --------------------------------------------------------------------------------------------
# Picklable helpers used inside DataLoader workers
# --------------------------------------------------------------------------------------------


def collate_pairs(samples: Sequence[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(image, label)`` pairs into ``(float32 [B,3,H,W], int64 [B])`` with torch's ``default_collate``,
    which users of a DataLoader get by default: in a worker process it stacks straight into shared memory (a
    stack of its own costs one more copy of every batch, about 0.12 ms an image)."""
    from torch.utils.data import default_collate

    images, labels = default_collate([(image, int(label)) for image, label in samples])
    return images, labels


class _FolderDataset:
    """Map-style ImageFolder dataset: ``(path, label)`` list + the shared transform."""

    def __init__(self, samples: Sequence[tuple[Path, int]], transform: ImageFolderTransform) -> None:
        self.samples = [(str(p), int(c)) for p, c in samples]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return self.transform(path), label


class _DecodeRecord:
    """Turn a stored record (a dict with raw JPEG bytes and a label) into ``(image, label)``."""

    def __init__(self, transform: ImageFolderTransform, image_key: str = "jpg", label_key: str = "cls") -> None:
        self.transform = transform
        self.image_key = image_key
        self.label_key = label_key

    def __call__(self, record: dict[str, Any]) -> tuple[torch.Tensor, int]:
        label = record[self.label_key]
        if isinstance(label, (bytes, bytearray)):  # webdataset stores ``cls`` as text
            label = label.decode("ascii")
        return self.transform(record[self.image_key]), int(label)


class _DecodeCollate:
    """A DataLoader ``collate_fn`` that decodes a list of stored records and stacks them.

    Used for the streaming libraries, whose datasets return the stored records: decoding in the
    collate function still runs inside the DataLoader workers, in parallel.
    """

    def __init__(self, transform: ImageFolderTransform, image_key: str = "jpg", label_key: str = "cls") -> None:
        self.decode = _DecodeRecord(transform, image_key, label_key)

    def __call__(self, records: Sequence[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        return collate_pairs([self.decode(r) for r in records])


def _litdata_record(item: tuple[str, int]) -> dict[str, Any]:
    path, label = item
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": int(label)}


# --------------------------------------------------------------------------------------------
# Peers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerResult:
    """What :func:`measure` saw for one peer."""

    name: str
    batch_size: int
    workers: int
    prepare_s: float  # seconds spent writing this peer's shards (0.0 if none were written)
    epoch_s: tuple[float, ...]  # wall time of each measured epoch
    images: int  # images in one epoch

    @property
    def images_per_s(self) -> float:
        """Throughput of the fastest measured epoch."""
        best = min(self.epoch_s) if self.epoch_s else 0.0
        return self.images / best if best > 0 else 0.0


_import_errors: dict[str, str | None] = {}


def _import_error(module: str) -> str | None:
    """``None`` if ``module`` imports, else ``'ExcType: message'``; cached, never raises."""
    if module not in _import_errors:
        try:
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f"No module named {module!r}", name=module)
            importlib.import_module(module)
            _import_errors[module] = None
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - a broken install can fail in any way
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _import_errors[module] = f"{type(exc).__name__}: {first_line}".rstrip(": ")
    return _import_errors[module]


class Peer:
    """A reference data loader. Subclasses set ``name``, ``install`` and ``modules``."""

    name: str = ""
    #: what to run where the peer's library is missing
    install: str = ""
    #: modules that must import for the peer to run
    modules: tuple[str, ...] = ()
    #: the names of the files this peer's library writes (the files of an interrupted write that are datapipe's)
    patterns: tuple[str, ...] = ()
    #: whether the peer writes shards into ``workdir/<name>/`` (the plain DataLoader reads the source files)
    writes_shards: bool = True

    def __repr__(self) -> str:
        return f"<peer {self.name}>"

    def unavailable(self) -> str | None:
        """``None`` if this peer can run here, else why not (the import error). Never raises."""
        try:
            for module in self.modules:
                reason = _import_error(module)
                if reason is not None:
                    return reason
            return None
        except Exception as exc:  # noqa: BLE001 - documented never to raise
            return f"{type(exc).__name__}: {exc}"

    def _require(self) -> None:
        reason = self.unavailable()
        if reason is not None:
            raise RuntimeError(
                f"peer {self.name!r} cannot run here ({reason}); install it with: {self.install}"
            )

    def folder(self, workdir: Path) -> Path:
        """Where this peer's shards live."""
        return Path(workdir) / self.name

    def prepare(self, source: Path | SampleList, workdir: Path) -> float:
        """Write this peer's shards of ``source`` (a :class:`SampleList`, or a folder listed like
        ImageFolder) into ``workdir/<name>/``, unless they are already there and complete.
        Returns the seconds spent writing (0.0 if nothing was written).

        The folder is datapipe's only while it carries datapipe's marker (``_datapipe_peer.json``),
        written into the new or empty folder before the shards and completed, with the list of
        every file written, after them. Shards of other samples are replaced by deleting exactly
        the files the marker lists (after an interrupted write: the files named as this peer's
        library names its shards); anything else is the user's and is never touched.

        Raises:
            OutputError: the folder is not datapipe's (not empty, no marker of this peer), or holds
                files besides the ones datapipe wrote (see :meth:`check_folder`).
        """
        self._require()
        listing = _as_samples(source)
        samples = list(listing.samples)
        out = self.folder(workdir)
        expected = self._expected(listing, samples)
        if self._is_complete(out, expected):
            return 0.0
        for path in self.check_folder(workdir):  # refuses a folder that is not datapipe's, deleting nothing
            path.unlink(missing_ok=True)
        remove_empty_folders(out)
        out.mkdir(parents=True, exist_ok=True)
        marker = {"format": _MARKER_FORMAT, "peer": self.name, "state": "writing"}
        (out / _MARKER).write_text(json.dumps(marker, indent=1))
        start = time.perf_counter()
        self._write(samples, out)
        seconds = time.perf_counter() - start
        files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != _MARKER)
        done = {**marker, "state": "complete", **expected, "write_s": seconds, "files": files}
        tmp = out / f"{_MARKER}.tmp"
        tmp.write_text(json.dumps(done, indent=1))
        os.replace(tmp, out / _MARKER)
        return seconds

    def _expected(self, listing: SampleList, samples: list[tuple[Path, int]]) -> dict[str, Any]:
        return {"peer": self.name, "source": str(listing.root.resolve()), "samples": len(samples),
                "fingerprint": _fingerprint(listing.root, samples)}

    def check_folder(self, workdir: Path) -> list[Path]:
        """The files datapipe would delete before writing this peer's shards into ``workdir/<name>/``
        (none where the folder is new or empty); checked before anything is measured or deleted.

        Raises:
            OutputError: the folder is a file, or is not empty and carries no marker of this peer
                (it is the user's), or holds files the marker does not account for.
        """
        from ..errors import OutputError

        out = self.folder(workdir)
        if not out.exists() and not out.is_symlink():
            return []
        if out.is_symlink() or not out.is_dir():
            raise OutputError(f"--work-dir: {out} is not a folder datapipe wrote; move it or choose another --work-dir")
        present = sorted(p for p in out.rglob("*") if not p.is_dir() or p.is_symlink())
        if not present:
            return []
        marker = self._marker(out)
        if marker is None:
            raise OutputError(f"--work-dir: {out} is not empty and is not datapipe's (no {_MARKER} of the {self.name} "
                              "peer); datapipe never deletes files it did not write: move them or choose another --work-dir")
        listed = marker.get("files") if marker.get("state") == "complete" else None
        if isinstance(listed, list) and all(isinstance(f, str) for f in listed):
            ours = listed_files(out, listed)
        else:  # an interrupted write, or a marker of an earlier datapipe: the files named as the library names them
            ours = {p for p in present if any(p.relative_to(out).match(pattern) for pattern in self.patterns)}
        ours.add(out / _MARKER)
        ours.add(out / f"{_MARKER}.tmp")
        foreign = [p for p in present if p not in ours or p.is_symlink()]
        if foreign:
            raise OutputError(f"--work-dir: {out} holds {foreign[0].relative_to(out)}, which datapipe did not write; "
                              "datapipe never deletes files it did not write: move it or choose another --work-dir")
        return [p for p in present if p.name != _MARKER] + [out / _MARKER]

    def _marker(self, out: Path) -> dict[str, Any] | None:
        """This peer's marker in ``out``: a JSON object naming the peer; None where there is none."""
        try:
            found = json.loads((out / _MARKER).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(found, dict) or found.get("peer") != self.name:
            return None
        return found

    def _is_complete(self, out: Path, expected: dict[str, Any]) -> bool:
        found = self._marker(out)
        if found is None or found.get("state", "complete") != "complete":  # a marker without state is written last
            return False
        return all(found.get(k) == v for k, v in expected.items())

    def _write(self, samples: list[tuple[Path, int]], out: Path) -> None:
        raise NotImplementedError

    def _prepared(self, workdir: Path) -> Path:
        out = self.folder(workdir)
        if not (out / _MARKER).is_file():
            raise FileNotFoundError(f"no complete {self.name} shards in {out}: call prepare() first")
        return out

    def loader(
        self, source: Path | SampleList, workdir: Path, *, batch_size: int, workers: int, seed: int = 0,
        pin_memory: bool = False,
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """An iterable of ``(images, labels)`` batches over ``source``'s samples (as prepared);
        each iteration is one epoch."""
        raise NotImplementedError


def _check_index(out: Path, list_key: str, count_key: str, expected: int) -> None:
    """Raise unless ``out/index.json`` lists ``expected`` samples in total."""
    try:
        index = json.loads((out / "index.json").read_text())
        written = sum(int(entry[count_key]) for entry in index[list_key])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"writing {out} failed: no readable index.json ({exc})") from exc
    if written != expected:
        raise RuntimeError(f"writing {out} failed: index.json lists {written} samples, expected {expected}")


def _check_loader_args(batch_size: int, workers: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")


class DataLoaderPeer(Peer):
    """``torch.utils.data.DataLoader`` over an ImageFolder-style dataset of JPEG files."""

    name = "dataloader"
    install = "pip install torch"
    modules = ("torch", "PIL", "numpy")
    writes_shards = False

    def prepare(self, source: Path | SampleList, workdir: Path) -> float:
        self._require()
        _as_samples(source)  # fail early on a bad source
        return 0.0

    def loader(
        self, source: Path | SampleList, workdir: Path, *, batch_size: int, workers: int, seed: int = 0,
        pin_memory: bool = False,
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        _check_loader_args(batch_size, workers)
        self._require()
        import torch
        from torch.utils.data import DataLoader

        return DataLoader(
            _FolderDataset(_as_samples(source).samples, ImageFolderTransform()),  # type: ignore[arg-type]  # map-style: __getitem__ + __len__
            batch_size=batch_size,
            shuffle=True,
            num_workers=workers,
            persistent_workers=workers > 0,
            drop_last=False,
            collate_fn=collate_pairs,
            generator=torch.Generator().manual_seed(seed),
            pin_memory=pin_memory,
        )


class WebDatasetPeer(Peer):
    """Tar shards (``jpg`` raw bytes + ``cls``) read with ``wds.WebDataset`` + ``wds.WebLoader``.

    Shards hold up to 1000 samples; small sources are cut into at least 16 shards, so up to 16
    DataLoader workers each get a share (webdataset splits whole shards between workers).
    """

    name = "webdataset"
    install = "pip install webdataset"
    modules = ("webdataset", "torch")
    patterns = ("shard-*.tar",)

    max_per_shard = 1000
    min_shards = 16
    shuffle_buffer = 1000

    def _write(self, samples: list[tuple[Path, int]], out: Path) -> None:
        import webdataset as wds

        per_shard = max(1, min(self.max_per_shard, math.ceil(len(samples) / self.min_shards)))
        with wds.ShardWriter(
            str(out / "shard-%06d.tar"), maxcount=per_shard, maxsize=1 << 40, verbose=0
        ) as sink:
            for index in _write_order(len(samples)):
                path, label = samples[index]
                sink.write({"__key__": f"{index:09d}", "jpg": Path(path).read_bytes(), "cls": int(label)})

    def shards(self, workdir: Path) -> list[str]:
        urls = sorted(str(p) for p in self._prepared(workdir).glob("shard-*.tar"))
        if not urls:
            raise FileNotFoundError(f"no shards in {self.folder(workdir)}")
        return urls

    def loader(
        self, source: Path | SampleList, workdir: Path, *, batch_size: int, workers: int, seed: int = 0,
        pin_memory: bool = False,
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        _check_loader_args(batch_size, workers)
        self._require()
        import webdataset as wds

        urls = self.shards(workdir)
        # webdataset 1.x hands each DataLoader worker every num_workers-th shard (split_by_worker),
        # so every sample is read exactly once per epoch; a worker without shards yields nothing
        # (empty_check=False keeps that legal). Each worker batches its own samples, so only the
        # last batch of each worker can be partial.
        dataset = (
            wds.WebDataset(
                urls,
                shardshuffle=len(urls),
                detshuffle=True,
                seed=seed,
                nodesplitter=wds.split_by_node,
                workersplitter=wds.split_by_worker,
                empty_check=False,
            )
            .shuffle(self.shuffle_buffer)
            .map(_DecodeRecord(ImageFolderTransform()))
            .batched(batch_size, collation_fn=collate_pairs, partial=True)
        )
        return wds.WebLoader(dataset, batch_size=None, num_workers=workers, persistent_workers=workers > 0,
                             pin_memory=pin_memory)


class LitDataPeer(Peer):
    """Chunks written with ``litdata.optimize`` (raw JPEG bytes + label), read with
    ``litdata.StreamingDataset`` + ``litdata.StreamingDataLoader``."""

    name = "litdata"
    install = "pip install litdata torchvision"
    modules = ("litdata", "torch")
    patterns = ("chunk-*.bin", "*index.json")

    chunk_bytes = "64MB"

    def _write(self, samples: list[tuple[Path, int]], out: Path) -> None:
        import multiprocessing

        import litdata

        order = _write_order(len(samples))
        inputs = [(str(samples[i][0]), int(samples[i][1])) for i in order]
        # optimize() forces the process-wide multiprocessing start method to 'spawn'; put it back,
        # or every DataLoader made afterwards in this process (any peer's) would spawn its workers.
        # Its writer processes are forked where possible: spawning them re-imports torch in each
        # (seconds) and re-runs an unguarded ``__main__``.
        start_method = multiprocessing.get_start_method(allow_none=True)
        try:
            litdata.optimize(
                fn=_litdata_record,
                inputs=inputs,
                output_dir=str(out.resolve()),
                chunk_bytes=self.chunk_bytes,
                num_workers=max(1, min(2, os.cpu_count() or 1)),
                start_method="fork" if "fork" in multiprocessing.get_all_start_methods() else None,
                verbose=False,
            )
        finally:
            multiprocessing.set_start_method(start_method, force=True)
        # optimize() can return normally although its writer processes died: check the result.
        _check_index(out, "chunks", "chunk_size", len(samples))

    def loader(
        self, source: Path | SampleList, workdir: Path, *, batch_size: int, workers: int, seed: int = 0,
        pin_memory: bool = False,
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        _check_loader_args(batch_size, workers)
        self._require()
        import litdata

        out = self._prepared(workdir)
        dataset = litdata.StreamingDataset(str(out.resolve()), shuffle=True, drop_last=False, seed=seed)
        return litdata.StreamingDataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=workers > 0,
            collate_fn=_DecodeCollate(ImageFolderTransform()),
            pin_memory=pin_memory,
        )


class StreamingPeer(Peer):
    """MosaicML Streaming: MDS shards (``jpg`` bytes + ``cls`` int) read with
    ``streaming.StreamingDataset`` in a torch ``DataLoader``."""

    name = "streaming"
    install = "pip install mosaicml-streaming torchvision"
    modules = ("streaming", "torch")
    patterns = ("shard.*.mds", "shard.*.mds.*", "index.json")

    def _write(self, samples: list[tuple[Path, int]], out: Path) -> None:
        from streaming import MDSWriter

        # MDSWriter refuses a folder that is not empty (and with exist_ok deletes it): it writes into an empty one
        # inside, whose files then join datapipe's marker (left by an interrupted write, they match the patterns)
        staging = out / "mds-writing"
        staging.mkdir()
        with MDSWriter(out=str(staging), columns={"jpg": "bytes", "cls": "int"}, progress_bar=False) as writer:
            for index in _write_order(len(samples)):
                path, label = samples[index]
                writer.write({"jpg": Path(path).read_bytes(), "cls": int(label)})
        for written in staging.iterdir():
            os.replace(written, out / written.name)
        staging.rmdir()
        _check_index(out, "shards", "samples", len(samples))

    def loader(
        self, source: Path | SampleList, workdir: Path, *, batch_size: int, workers: int, seed: int = 0,
        pin_memory: bool = False,
    ) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        _check_loader_args(batch_size, workers)
        self._require()
        import gc

        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory
        from torch.utils.data import DataLoader

        out = self._prepared(workdir)
        # Streaming keeps per-dataset shared memory keyed by the local folder; release what earlier
        # datasets of this process (already dropped) and dead processes left behind, so a second
        # loader over the same folder can be made.
        gc.collect()
        clean_stale_shared_memory()
        dataset = StreamingDataset(
            local=str(out.resolve()), remote=None, shuffle=True, shuffle_seed=seed, batch_size=batch_size
        )
        return DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            persistent_workers=workers > 0,
            drop_last=False,
            collate_fn=_DecodeCollate(ImageFolderTransform()),
            pin_memory=pin_memory,
        )


PEERS: dict[str, Peer] = {
    peer.name: peer for peer in (DataLoaderPeer(), WebDatasetPeer(), LitDataPeer(), StreamingPeer())
}


def get_peer(name: str) -> Peer:
    """The peer called ``name``; :class:`~datapipe.errors.ArgumentError` naming the valid choices otherwise."""
    from ..errors import ArgumentError

    try:
        return PEERS[name]
    except (KeyError, TypeError):
        raise ArgumentError(f"--against: unknown peer {name!r}; choose from: {', '.join(PEERS)}") from None


def measure(
    peer: Peer | str,
    source: Path | SampleList,
    workdir: Path,
    *,
    batch_size: int = 256,
    workers: int = 2,
    epochs: int = 1,
    warmup_epochs: int = 1,
    seed: int = 0,
) -> PeerResult:
    """Prepare ``peer``, run ``warmup_epochs`` untimed epochs, then time ``epochs`` epochs."""
    if isinstance(peer, str):
        peer = get_peer(peer)
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    listing = _as_samples(source)
    prepare_s = peer.prepare(listing, Path(workdir))
    loader = peer.loader(listing, Path(workdir), batch_size=batch_size, workers=workers, seed=seed)
    for _ in range(warmup_epochs):
        timed_pass(loader)
    passes = [timed_pass(loader) for _ in range(epochs)]
    return PeerResult(peer.name, batch_size, workers, prepare_s, tuple(p.seconds for p in passes), passes[-1].images)
