"""`datapipe bench`: where the time goes, and how far ahead of today's loaders, on this machine.

Every system reads the same data — exactly the cache's samples: the peers decode the source files
the cache was built from, never one the build quarantined — and produces the same output — float
[B, 3, crop, crop] batches after RandomResizedCrop and a horizontal flip — with the same number of
workers and batch size. A system that fails is reported as failed (the others still run), and the
command's exit code says so.
Warm-up passes are excluded; systems are measured in interleaved rounds so that drift on a shared
machine hits them alike; each ratio is computed per round, then the median is reported.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np

from ..environment import environment, memory_limit, physical_memory
from ..errors import FULL_DISK, ArgumentError, CacheError
from ..files import atomic_write_bytes
from ..text import one_line, progress_bar, show
from .timing import settle, timed_pass, timeit

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..cache import Cache
    from ..device import DeviceLoader
    from .peers import SampleList

SYSTEM = "datapipe"
#: The stages on the loader's path, timed again beside the end-to-end passes: {stage: (fn, images per call)}.
StageTimers: TypeAlias = dict[str, tuple[Callable[[], None], int]]
log = logging.getLogger("datapipe.bench")


MAX_STEP_MS = 86_400_000  # a day: time.sleep overflows the clock far beyond it (1e13 ms)

@dataclass
class Measurement:
    """Repeated measurements of one system: images/s per round, with median and spread."""

    name: str
    status: str = "ok"  # "ok", "failed", or "skipped" (a peer of --against all that is not installed)
    reason: str | None = None
    samples: int | None = None  # samples this system reads per epoch (the cache's, for every system)
    install: str | None = None
    images_per_s: list[float] = field(default_factory=list)
    median: float = 0.0
    spread: tuple[float, float] = (0.0, 0.0)  # (min, max) over rounds
    ratio: float | None = None  # datapipe / this, median of per-round ratios
    prepare_s: float | None = None  # time to write this system's shards from the source
    cpu_s_per_image: float | None = None
    bytes_per_sample: float | None = None  # mean stored bytes a sample takes in what this system reads
    cache: str | None = None  # datapipe systems: the cache folder measured
    encoding: str | None = None  # datapipe systems: "raw" or "jpeg"
    fit: str | None = None  # datapipe systems: the build's --fit ("crop", "short", ...)
    notes: str = ""

    @property
    def label(self) -> str:
        """How the table names the system: datapipe on the first cache with its encoding and fit (the
        others' names carry theirs: ``datapipe-jpeg-short``)."""
        return f"{self.name} ({self.encoding}, {self.fit})" if self.encoding and self.name == SYSTEM else self.name

    def finish(self) -> None:
        if self.images_per_s:
            self.median = statistics.median(self.images_per_s)
            self.spread = (min(self.images_per_s), max(self.images_per_s))


@dataclass
class BenchResult:
    machine: dict
    config: dict
    stages: dict
    systems: dict[str, Measurement]
    attribution: dict

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- machine


def describe_machine() -> dict:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    env = environment()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(physical_memory() / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": env["python"],
        "platform": env["platform"],
        "versions": {k: env[k] for k in ("datapipe", "numpy", "torch", "kornia", "zarr", "dask")},
        "decoders": env["decoders"],
        "cpu_kernel": env["cpu_kernel"],  # the CPU loader's resize and float conversion: compiled or torch's
    }


# ----------------------------------------------------------------------------- what to measure


@dataclass(frozen=True)
class BenchSpec:
    """What a bench runs and how it is timed, checked once, here, for the library and the command alike.

    The workload — ``batch_size``, ``workers``, ``crop``, ``batches`` and ``device`` — is the same
    for every system, so that they produce the same output from the same data. The measurement
    plan — ``repeats`` and ``step_ms`` — says how the passes are timed. An out-of-range value is an
    :class:`~datapipe.errors.ArgumentError` naming the ``datapipe bench`` flag that sets it.
    """

    batch_size: int = 256  # samples per batch
    workers: int = 2  # loader workers (0: the loaders read in the calling process)
    crop: int = 224  # RandomResizedCrop's output size
    batches: int | None = None  # batches per pass; None: one epoch, at most 40
    device: str = "auto"  # cuda, cuda:N, cpu or auto
    repeats: int = 3  # measured rounds; each runs every system once, interleaved (after a warm-up round)
    step_ms: float = 0.0  # if > 0, datapipe also runs with a synthetic model step of this many ms

    def __post_init__(self) -> None:
        _check_whole("--batch-size", self.batch_size, least=1)
        _check_whole("--workers", self.workers, least=0)
        _check_whole("--crop", self.crop, least=1)
        if self.batches is not None:
            _check_whole("--batches", self.batches, least=1)
        _check_whole("--repeats", self.repeats, least=1)
        if isinstance(self.step_ms, bool) or not isinstance(self.step_ms, (int, float)) or not 0 <= self.step_ms <= MAX_STEP_MS:
            raise ArgumentError(f"--step-ms must be a number of milliseconds from 0 to {MAX_STEP_MS:,} (a day), got "
                                f"{show(self.step_ms)}")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ArgumentError(f"--device must be cuda, cuda:N, cpu or auto, got {show(self.device)}")
        batch_bytes, (memory, what) = self.batch_size * 3 * self.crop**2 * 4, memory_limit()
        if memory and batch_bytes > memory // 4:  # every system holds a few such batches at once
            raise ArgumentError(f"--crop {self.crop} with --batch-size {self.batch_size} makes float batches of "
                                f"{batch_bytes / 2**30:,.1f} GiB, more than a quarter of the {memory / 2**30:,.1f} GiB "
                                f"of {what}; lower --crop or --batch-size")

    def batches_per_pass(self, samples: int) -> int:
        """``batches``, or one epoch of ``samples`` capped at 40 batches."""
        return self.batches or min(-(-samples // self.batch_size), 40)


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _check_whole(flag: str, value: object, *, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ArgumentError(f"{flag} must be a whole number >= {least}, got {show(value)}")


# ----------------------------------------------------------------------------- stages


def measure_stages(cache: Cache, *, batch_size: int, crop: int, device: torch.device, timers: StageTimers | None = None) -> dict:
    """Each stage on its own, one thread: read, assemble, decode, copy, augment.

    ``timers``, when given, receives ``{stage: (fn, images per call)}`` for the stages on the
    loader's path, so that the attribution can time them again beside the end-to-end passes.
    """
    from .._threads import torch_threads

    with torch_threads(1):
        return _stages(cache, batch_size=batch_size, crop=crop, device=device, timers=timers)


@dataclass
class _Batch:
    """One shuffled batch's buffers, reused by every stage (as the loader reuses its own)."""

    cache: Cache
    size: int
    images: np.ndarray  # uint8 [size, H, W, 3]: the samples' shape, or the largest (padded) where shapes vary
    labels: np.ndarray  # int64 [size]
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    @classmethod
    def of(cls, cache: Cache, batch_size: int) -> _Batch:
        size = min(batch_size, len(cache))
        shape = cache.fixed_shape or (*(max(1, v) for v in cache.shape_range[1]), 3)
        return cls(cache, size, np.empty((size, *shape), np.uint8), np.empty(size, np.int64))

    @property
    def varied(self) -> bool:
        """Whether the cache's samples vary in shape (fit short): read one by one, never one gathered batch."""
        return self.cache.fixed_shape is None

    def shuffled(self) -> np.ndarray:
        """The indices of a fresh shuffled batch, as in an epoch."""
        return self.rng.choice(len(self.cache), self.size, replace=False)


def _stages(cache: Cache, *, batch_size: int, crop: int, device: torch.device, timers: StageTimers | None) -> dict:
    batch = _Batch.of(cache, batch_size)
    stages: dict[str, dict] = {"read": _read_stage(cache)}
    stages["assemble"], assemble = _assemble_stage(batch)
    stages["decode"] = _decode_stage(batch)
    path: StageTimers = {}  # the stages on the loader's path
    if device.type == "cuda":
        stages["h2d"], copy, on_device = _h2d_stage(batch, device)
        path["assemble"], path["h2d"] = (assemble, batch.size), (copy, batch.size)
        stages["augment"], augment = _augment_on_device(on_device, crop, device, _shapes_of(batch))
    else:
        # The CPU loader reads the batch's samples (raw: views of the maps, or copies; JPEG: the stored
        # bytes, each decoded for its own crop) and resizes each crop from there: no gathered batch on
        # this path, the reading (and decoding) is part of the augment stage.
        stages["h2d"] = {"GB_per_s": None, "what": "skipped: no GPU"}
        stages["assemble"]["on_this_path"] = False
        stages["assemble"]["what"] += " (on the CPU path it is part of the augment stage)"
        if stages["decode"].get("images_per_s"):
            stages["decode"]["on_this_path"] = False
            stages["decode"]["what"] += " (on the CPU path each sample is decoded for its crop, in the augment stage)"
        stages["augment"], augment = _augment_on_cpu(batch, crop, device)
    path["augment"] = (augment, batch.size)
    if timers is not None:
        timers.update(path)
    return stages


def _read_stage(cache: Cache) -> dict:
    """Sequential bytes of the shard files: a first pass (disk or page cache), then again from the page cache."""
    files = [cache._shard_path(shard) for shard, count in enumerate(cache.counts) if count]  # the cache's own file names
    buf = bytearray(1 << 24)

    def read_all() -> float:
        t0, nbytes = time.perf_counter(), 0
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while (k := fh.readinto(buf)) > 0:
                    nbytes += k
        return nbytes / (time.perf_counter() - t0) / 1e6

    first = read_all()  # from the disk, or from the page cache if the files are there already
    return {"MB_per_s": first, "MB_per_s_cached": read_all(),
            "what": "sequential read of every shard file: first pass, then again from the page cache"}


def _assemble_stage(batch: _Batch) -> tuple[dict, Callable[[], None]]:
    """A shuffled batch gathered from the shards into the batch's buffer, as the GPU path reads it:
    square samples in one gather (a square JPEG cache decodes each into its slot), samples of varying
    shapes copied out one by one into the rows of a padded buffer."""
    cache = batch.cache

    def gather() -> None:
        cache.read_batch(batch.shuffled(), batch.images, batch.labels)

    def padded() -> None:
        for row, x in zip(batch.images, cache.read_samples(batch.shuffled(), batch.labels), strict=False):
            row[: x.shape[0], : x.shape[1]] = x

    assemble = padded if batch.varied else gather
    sec = timeit(assemble)
    pixels = float(np.mean(np.prod(cache.shapes, axis=1))) * 3 if len(cache) else 0.0
    what = ("copy of a shuffled batch's samples of varying shapes into a padded buffer" if batch.varied
            else "gather of a shuffled batch from memory-mapped shards")
    if cache.encoding == "jpeg":
        what += ", each JPEG decoded"
    return ({"images_per_s": batch.size / sec, "GB_per_s": batch.size * pixels / sec / 1e9, "what": what}, assemble)


def _decode_stage(batch: _Batch) -> dict:
    """A raw cache decodes nothing; a JPEG cache: each stored sample of a shuffled batch decoded whole, one thread."""
    from ..samples import decode_jpeg

    cache = batch.cache
    if cache.encoding != "jpeg":
        return {"images_per_s": None, "what": "none: the cache holds decoded pixels (decoded once at build)"}
    encoded = cache.read_encoded(batch.shuffled(), batch.labels)

    def decode() -> None:
        for e in encoded:
            decode_jpeg(e.data, e.height, e.width, where=e.where)

    sec = timeit(decode)
    return {"images_per_s": len(encoded) / sec, "what": "libjpeg-turbo decode of each stored sample, whole, one thread"}


def _shapes_of(batch: _Batch) -> np.ndarray | None:
    """The (h, w) of the samples in the batch's buffer rows where shapes vary (crops drawn within each), else None."""
    if not batch.varied:
        return None
    return batch.cache.shapes[batch.shuffled()]


def _h2d_stage(batch: _Batch, device: torch.device) -> tuple[dict, Callable[[], None], torch.Tensor]:
    """The gathered batch, pinned, copied to the device; returns the stage, its timer and the batch on the device."""
    import torch

    images = torch.from_numpy(batch.images)
    pinned = images.pin_memory()
    torch.cuda.synchronize()

    def copy() -> None:
        pinned.to(device, non_blocking=True)
        torch.cuda.synchronize()

    sec = timeit(copy)
    stage = {"GB_per_s": pinned.numel() / sec / 1e9, "images_per_s": batch.size / sec, "what": "pinned host -> device copy"}
    return stage, copy, images.to(device)


def _augment_on_device(on_device: torch.Tensor, crop: int, device: torch.device,
                       shapes: np.ndarray | None = None) -> tuple[dict, Callable[[], None]]:
    """The train preset on the whole batch, already on the device (``shapes``: each padded row's
    sample shape, for samples of varying shapes, whose crops are drawn within their own extent)."""
    import torch

    from .. import augment

    aug = augment.train(crop)
    size = int(on_device.shape[0])
    params = None
    if shapes is not None:
        sizes = torch.from_numpy(np.ascontiguousarray(shapes, dtype=np.int64))
        params = aug.sample(size, sizes[:, 0].contiguous(), sizes[:, 1].contiguous(), 1)

    def run_aug() -> None:
        aug(on_device, seed=1, params=params)
        torch.cuda.synchronize()

    sec = timeit(run_aug)
    return ({"images_per_s": size / sec, "where": str(device),
             "what": f"RandomResizedCrop({crop}) + flip + normalise on the whole batch"}, run_aug)


def _augment_on_cpu(batch: _Batch, crop: int, device: torch.device) -> tuple[dict, Callable[[], None]]:
    """Exactly what the CPU loader does per batch (so it includes the reading, and a JPEG cache's
    decoding): a fresh shuffled batch's samples viewed in place (raw) or their stored bytes each
    decoded for its own crop (JPEG), each crop resized into reused output buffers."""
    import torch

    from .. import augment
    from ..device import reads_mapped

    aug = augment.train(crop)
    out = torch.empty((batch.size, 3, crop, crop))
    cache = batch.cache
    mapped = reads_mapped(cache, aug)  # as the loader does: crops read from the maps

    def run_raw() -> None:
        idx = batch.shuffled()
        views = cache.sample_views(idx, batch.labels, out=None if batch.varied else batch.images, mapped=mapped)
        with cache.mapped_reads(idx) if mapped else contextlib.nullcontext():
            aug(views, seed=1, out=out)

    def run_jpeg() -> None:
        aug.decode(cache.read_encoded(batch.shuffled(), batch.labels), seed=1, out=out)

    jpeg = cache.encoding == "jpeg"
    run_aug = run_jpeg if jpeg else run_raw
    sec = timeit(run_aug)
    reading = "read the batch's JPEG samples, each decoded for its crop" if jpeg else "read the batch"
    return ({"images_per_s": batch.size / sec, "where": str(device),
             "what": f"{reading} + RandomResizedCrop({crop}) + flip + normalise"}, run_aug)


# ----------------------------------------------------------------------------- systems


@dataclass(frozen=True)
class _Peers:
    """The peers a bench compares against, and what they read."""

    names: list[str]
    every: bool  # --against all: a peer not installed here is skipped, not failed
    listing: SampleList | None  # the cache's samples as source files (None without peers)
    work: Path  # where the peers write their shards

    @classmethod
    def chosen(cls, cache: Cache, against: Iterable[str], source: str | os.PathLike[str] | None,
               work_dir: str | os.PathLike[str] | None) -> _Peers:
        """The named peers (``["all"]``: every one), checked before anything is measured.

        Raises:
            ArgumentError: an unknown peer name (the message names the choices).
            SourceError: peers without ``source``, or a source that is not the cache's.
        """
        from ..errors import SourceError
        from . import peers as peer_mod

        against = list(against)
        every = against == ["all"]
        names = list(peer_mod.PEERS) if every else [a for a in against if a]
        for name in names:
            peer_mod.get_peer(name)  # raises ArgumentError naming the choices
        listing = None
        if names:
            if source is None:
                raise SourceError("comparing against other loaders needs --source, the folder the cache was built from")
            listing = peer_mod.cache_samples(cache, source)  # refuses a source that is not the cache's
        work = Path(work_dir) if work_dir else cache.root.parent / f"{cache.root.name}-bench-work"
        if names:
            assert listing is not None
            _check_work_dir(work, cache.root, listing.root)
            for name in names:
                peer = peer_mod.get_peer(name)
                if peer.writes_shards:
                    peer.check_folder(work)  # a folder that is not datapipe's is refused before anything runs
        return cls(names, every, listing, work)


def _check_work_dir(work: Path, cache_root: Path, source_root: Path) -> None:
    """Refuse a work folder inside the cache or the source (or one of them): the peers' shards would
    become part of the cache's folder, or a class of the source's next build."""
    from ..errors import ArgumentError

    where = work.expanduser().resolve()
    for what, root in (("cache", cache_root), ("source", source_root)):
        root = root.expanduser().resolve()
        if where == root or where.is_relative_to(root):
            raise ArgumentError(f"--work-dir {work} is inside the {what} folder {root}; the peers' shards must go "
                                f"elsewhere: choose a folder outside it (default: {cache_root.name}-bench-work beside the cache)")


def _check_same_samples(first: Cache, other: Cache) -> None:
    """Refuse an ``--also`` cache that does not hold the first cache's samples: built from the same
    source, the same files with the same labels (only the encoding, fit or size may differ)."""
    def describe(c: Cache) -> str:
        return f"{len(c):,} samples of {c.manifest.source.root}"

    problem = None
    if first.manifest.source.root != other.manifest.source.root:
        problem = "it was built from another source"
    elif len(first) != len(other):
        problem = "it holds another number of samples"
    elif (list(first.classes) != list(other.classes) or not np.array_equal(first.labels, other.labels)
          or any(first.path(i) != other.path(i) for i in range(len(first)))):
        problem = "its files or labels differ"
    if problem:
        raise ArgumentError(f"--also {other.root}: {problem} ({describe(other)}, the cache {first.root} holds "
                            f"{describe(first)}); pass caches built from the same source, with the same samples")


def _datapipe_loader(cache: Cache, spec: BenchSpec, device: torch.device, *, workers: int | None = None,
                     seed: int = 0) -> DeviceLoader:
    from .. import augment
    from ..dataset import StreamingDataset
    from ..device import DeviceLoader

    ds = StreamingDataset(cache, batch_size=spec.batch_size, shuffle=True, seed=seed)
    return DeviceLoader(ds, device=device, num_workers=spec.workers if workers is None else workers, prefetch=2,
                        augment=augment.train(spec.crop))


def _prepare_systems(caches: dict[str, Cache], spec: BenchSpec, device: torch.device,
                     peers: _Peers, loaders: dict[str, Any]) -> dict[str, Measurement]:
    """datapipe's loader on each cache, then each peer's shards and loader (into ``loaders``, as each
    is made); a peer that cannot be prepared is marked failed (or, for ``--against all``, skipped
    where it is not installed) and gets no loader."""
    systems: dict[str, Measurement] = {}
    for name, cache in caches.items():
        systems[name] = _datapipe_measurement(name, cache)
        loaders[name] = _datapipe_loader(cache, spec, device)
    for name in peers.names:
        systems[name], loader = _prepare_peer(name, spec, peers, device)
        if loader is not None:
            loaders[name] = loader
    return systems


def close_loader(loader: Any) -> None:
    """Stop a loader's workers now: a DeviceLoader's threads (``close``), a torch DataLoader's
    persistent worker processes (its iterator's shutdown). Never raises."""
    try:
        close = getattr(loader, "close", None)
        if callable(close):
            close()
        iterator = getattr(loader, "_iterator", None)  # a DataLoader keeps its persistent workers' iterator
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        if iterator is not None:
            loader._iterator = None
    except Exception as exc:  # noqa: BLE001 - closing is best effort; the measurement is what matters
        log.debug(f"datapipe bench: closing a loader: {type(exc).__name__}: {exc}")


def _datapipe_measurement(name: str, cache: Cache) -> Measurement:
    """The record of datapipe on ``cache``: its folder, encoding, fit and stored bytes per sample."""
    fit = str(cache.manifest.config.get("fit", "crop"))
    nbytes = float(cache.sample_nbytes.mean()) if len(cache) else None
    quality = f" quality {cache.manifest.config.get('quality')}" if cache.encoding == "jpeg" else ""
    return Measurement(name, notes=f"DeviceLoader + augment.train on {cache.encoding}{quality}, fit {fit}, size {cache.size}",
                       samples=len(cache), bytes_per_sample=nbytes, cache=str(cache.root), encoding=cache.encoding, fit=fit)


def _system_names(caches: Iterable[Cache]) -> list[str]:
    """``datapipe`` for the first cache; ``datapipe-<encoding>-<fit>`` for each other one (numbered where two share it)."""
    names: list[str] = []
    for k, cache in enumerate(caches):
        base = SYSTEM if k == 0 else f"{SYSTEM}-{cache.encoding}-{cache.manifest.config.get('fit', 'crop')}"
        name, n = base, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names.append(name)
    return names


def _peer_bytes(peer: Any, peers: _Peers) -> float | None:
    """Mean bytes a sample takes in what ``peer`` reads: its shards under the work folder, or for a
    peer that reads the source files (no shards), those files."""
    assert peers.listing is not None
    n = len(peers.listing)
    if not n:
        return None
    folder = peer.folder(peers.work)
    from .peers import _MARKER

    files = [f for f in folder.rglob("*") if f.is_file() and f.name != _MARKER] if folder.is_dir() else []
    if not files:
        files = [Path(path) for path, _ in peers.listing.samples]
    return sum(f.stat().st_size for f in files) / n


class _OnDevice:
    """A peer's loader whose batches are copied to ``device``, from memory its DataLoader pinned, without
    waiting, as a training loop copies each batch: datapipe's batches arrive there, so the peers' go too."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self.loader, self.device = loader, device

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels in self.loader:
            yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)

    def close(self) -> None:
        close_loader(self.loader)


def _prepare_peer(name: str, spec: BenchSpec, peers: _Peers, device: torch.device) -> tuple[Measurement, Any]:
    """One peer's measurement record and loader (None where it is skipped or failed); on a GPU its batches are
    pinned by its DataLoader and copied to the device."""
    from . import peers as peer_mod

    peer = peer_mod.get_peer(name)
    m = Measurement(name, install=peer.install)
    reason = peer.unavailable()
    if reason is not None and peers.every:  # "all": the peers installed here
        m.status, m.reason = "skipped", reason
        log.info(f"datapipe bench: {name} skipped: {reason} (install: {peer.install})")
        return m, None
    try:
        if reason is not None:
            raise RuntimeError(f"{reason}; install it with: {peer.install}")
        assert peers.listing is not None  # there are peers, so the cache's samples were listed
        log.info(f"datapipe bench: preparing {name} …")
        m.prepare_s = peer.prepare(peers.listing, peers.work)
        on_gpu = device.type == "cuda"
        loader = peer.loader(peers.listing, peers.work, batch_size=spec.batch_size, workers=spec.workers,
                             pin_memory=on_gpu)
        if on_gpu:
            loader = _OnDevice(loader, device)
        m.samples = len(peers.listing)
        m.bytes_per_sample = _peer_bytes(peer, peers)
        return m, loader
    except Exception as exc:  # noqa: BLE001 - a failing peer is reported, not fatal
        _failed(m, exc)
        return m, None


# ----------------------------------------------------------------------------- run


def run(cache: str | Path, spec: BenchSpec | None = None, *, source: str | os.PathLike[str] | None = None,
        against: Iterable[str] = (), work_dir: str | os.PathLike[str] | None = None, progress: bool = True,
        also: Iterable[str | os.PathLike[str]] = ()) -> BenchResult:
    """Measure datapipe stage by stage and against ``against`` peers on the same data.

    Args:
        cache: a cache folder written by ``datapipe build``.
        also: more caches (the same source built another way: ``--encoding jpeg``, ``--fit short``),
            each measured as one more datapipe system in the same interleaved rounds — named
            ``datapipe-<encoding>-<fit>``, its bytes per sample, CPU ms per image and images/s
            side by side with the first cache's. The stage breakdown is the first cache's.
        spec: the workload every system runs and the measurement plan (default: :class:`BenchSpec`'s defaults).
        source: the source image folder (needed by every peer).
        against: peer names (``dataloader``, ``webdataset``, ``litdata``, ``streaming``) or ``["all"]``.
            A named peer that cannot run here fails; with ``all``, peers not installed are skipped.
        work_dir: where peers write their shards (default: next to the cache).
        progress: show a progress bar (on stderr).

    Returns:
        A :class:`BenchResult` (``.to_dict()`` is what ``--json`` writes); a system that failed has
        ``status == "failed"`` and the reason. Progress lines go to the ``datapipe.bench`` logger.

    Raises:
        ArgumentError: ``spec`` is not a :class:`BenchSpec`, or an unknown peer is named.
        CacheError: ``cache`` or a cache of ``also`` is not a readable cache, or ``cache`` holds no samples
            (checked before anything is measured).
        SourceError: ``source`` is missing, or does not hold the cache's samples (see
            :func:`datapipe.bench.peers.cache_samples`).
    """
    from ..cache import Cache
    from ..device import _resolve_device

    spec = BenchSpec() if spec is None else spec
    if not isinstance(spec, BenchSpec):
        raise ArgumentError(f"spec must be a datapipe.bench.BenchSpec, got {show(spec)} ({type(spec).__name__})")
    opened = Cache(cache)
    if not len(opened):
        raise CacheError(f"{opened.root} holds no samples (its report.json says what its build quarantined), so there "
                         "is nothing to measure; bench a cache with samples in it")
    others = [Cache(Path(path)) for path in ([also] if isinstance(also, (str, os.PathLike)) else also)]
    for other in others:
        _check_same_samples(opened, other)  # "same samples for all" must hold for every datapipe system too
    caches = dict(zip(_system_names([opened, *others]), [opened, *others], strict=True))
    dev = _resolve_device(spec.device)
    peers = _Peers.chosen(opened, against, source, work_dir)
    batches = spec.batches_per_pass(len(opened))
    log.info(f"datapipe bench: {len(opened):,} samples, batch {spec.batch_size}, {spec.workers} workers, {spec.repeats} "
             f"rounds of {batches} batches on {dev}")

    timers: StageTimers = {}
    stages = measure_stages(opened, batch_size=spec.batch_size, crop=spec.crop, device=dev, timers=timers)
    stages["bytes_on_disk_per_image"] = opened.manifest.nbytes / max(len(opened), 1)
    loaders: dict[str, Any] = {}
    try:
        systems = _prepare_systems(caches, spec, dev, peers, loaders)
        # a pass is as many images for every system: a peer whose workers each end an epoch with a partial batch
        # (webdataset) needs more batches for them
        cpu = _measure_rounds(systems, loaders, repeats=spec.repeats, batches=batches,
                              images=min(batches * spec.batch_size, len(opened)), sync=_sync(dev), progress=progress)
        _summarise(systems, cpu)
        attribution = _attribution(opened, timers, spec, dev, batches=batches)
        if spec.step_ms > 0:
            attribution["model_step"] = _with_step(opened, spec, dev, batches=batches)
    finally:  # also when stopped (SIGTERM, Ctrl-C): worker processes shut down here, not at interpreter exit
        for loader in loaders.values():
            close_loader(loader)
    return BenchResult(machine=describe_machine(), config=_config(caches, spec, source, dev, batches), stages=stages,
                       systems=systems, attribution=attribution)


def _config(caches: dict[str, Cache], spec: BenchSpec, source: str | os.PathLike[str] | None, device: torch.device,
            batches: int) -> dict:
    """What was measured, as the result's ``config`` reports it (``cache``: the first cache; ``also``: the others)."""
    cache, *others = caches.values()
    return {"cache": str(cache.root), "also": [str(c.root) for c in others], "source": str(source) if source else None,
            "samples": len(cache),
            "batch_size": spec.batch_size, "workers": spec.workers, "repeats": spec.repeats, "batches_per_pass": batches,
            "crop": spec.crop, "device": str(device),
            "output": f"float32 [B, 3, {spec.crop}, {spec.crop}] after RandomResizedCrop + flip"}


def _sync(device: torch.device) -> Callable[[], None] | None:
    """What a timed pass calls before its clock stops, so that queued device work counts."""
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else None


def _measure_rounds(systems: dict[str, Measurement], loaders: dict[str, Any], *, repeats: int, batches: int,
                    images: int, sync: Callable[[], None] | None, progress: bool) -> dict[str, list[float]]:
    """A warm-up round, then ``repeats`` rounds that each time every loader once, in turn.

    Each system's images/s go into its :class:`Measurement`; a system whose pass fails is marked
    failed and leaves the rounds. Returns each system's CPU seconds per image, round by round.
    """
    runnable = list(loaders)
    bar = progress_bar(total=(repeats + 1) * len(runnable), desc="bench", unit="pass", disable=not progress)
    cpu: dict[str, list[float]] = {n: [] for n in runnable}
    for rnd in range(repeats + 1):  # round 0 is the warm-up
        # datapipe warms up last: a peer's DataLoader forks its workers (kept alive) during its
        # warm-up, after which every page this process writes is copied once (copy-on-write) —
        # a one-off cost that belongs in the warm-up, not in datapipe's first timed round.
        for name in (runnable[::-1] if rnd == 0 else list(runnable)):
            try:
                n_img, wall, cpu_s = timed_pass(loaders[name], batches, images=images, sync=sync)
            except Exception as exc:  # noqa: BLE001 - reported; the other systems still run
                _failed(systems[name], exc)
                runnable.remove(name)
                continue
            if rnd:
                systems[name].images_per_s.append(n_img / wall)
                cpu[name].append(cpu_s / max(n_img, 1))
            settle()
            bar.update()
    bar.close()
    return cpu


def _summarise(systems: dict[str, Measurement], cpu: dict[str, list[float]]) -> None:
    """Median and spread of each system, its CPU cost per image, and datapipe's lead (median of per-round ratios)."""
    base = systems[SYSTEM]
    for name, m in systems.items():
        m.finish()
        if cpu.get(name):
            m.cpu_s_per_image = statistics.median(cpu[name])
        if name != SYSTEM and m.images_per_s and base.images_per_s:
            m.ratio = statistics.median(a / b for a, b in zip(base.images_per_s, m.images_per_s, strict=True))


def _machine_advice(exc: BaseException) -> str:
    """What to do about a failure that is the machine's (a full disk, a read-only folder, too few open files),
    which an OSError from a peer's own code says without its path: "" for any other."""
    code = getattr(exc, "errno", None)
    if code in FULL_DISK:
        return (" (a disk is full: the bench's work folder's, or /dev/shm, which DataLoader workers use (a "
                "container's --shm-size): free space, or pass --work-dir another folder)")
    if code in (errno.EROFS, errno.EACCES, errno.EPERM) and not getattr(exc, "filename", None):
        return " (the bench's work folder cannot be written: pass --work-dir a writable folder)"
    if code in (errno.EMFILE, errno.ENFILE):
        return " (too many open files: raise the limit, ulimit -n 65536)"
    return ""


def _failed(m: Measurement, exc: BaseException) -> None:
    """Mark a system failed with a one-line reason (a DataLoader's worker traceback is cut to its first line)."""
    text = " ".join(str(exc).strip().splitlines()[0].split()) if str(exc).strip() else ""
    m.status, m.reason = "failed", f"{type(exc).__name__}: {text}"[:300].rstrip(": ") + _machine_advice(exc)
    m.images_per_s = []
    log.warning(f"datapipe bench: {m.name} failed: {m.reason}")


def _attribution(cache: Cache, timers: StageTimers, spec: BenchSpec, device: torch.device, *, batches: int, rounds: int = 3) -> dict:
    """Does the stage breakdown add up? One reader thread end to end vs the sum of the stages.

    The stages on the loader's path and the end-to-end pass are timed alternately, ``rounds``
    times, and the ratio is the median of the per-round ratios: on a machine whose speed drifts,
    stages timed a minute before the end to end would not be comparable with it.
    """
    from .._threads import torch_threads

    loader = _datapipe_loader(cache, spec, device, workers=1)
    sync = _sync(device)
    timed_pass(loader, batches, sync=sync)  # warm-up: output buffers allocated, memory maps faulted in
    per_round: list[dict[str, float]] = []
    ends: list[float] = []
    walls, counts = 0.0, 0
    # One intra-op thread, as in the reader thread: more would compete with it for the cores.
    try:
        with torch_threads(1):
            for _ in range(rounds):
                per_round.append({k: timeit(fn) / images for k, (fn, images) in timers.items()})
                n, wall, _ = timed_pass(loader, batches, sync=sync)
                ends.append(wall / max(n, 1))
                walls, counts = walls + wall, counts + n
    finally:
        loader.close()
    ratios = [sum(p.values()) / e for p, e in zip(per_round, ends, strict=True)]
    per_image = {k: statistics.median(p[k] for p in per_round) for k in timers}
    return {
        "one_reader_images_per_s": counts / walls,
        "stage_seconds_per_image": per_image,
        "sum_of_stages_s_per_image": sum(per_image.values()),
        "end_to_end_s_per_image": statistics.median(ends),
        "sum_over_end_to_end": statistics.median(ratios),
        "rounds": ratios,
        "note": "one reader thread, so the stages run back to back and their sum should match end to end; "
                "stages and end to end timed alternately, median of the per-round ratios",
    }


def _with_step(cache: Cache, spec: BenchSpec, device: torch.device, *, batches: int) -> dict:
    """datapipe with a synthetic model step of ``spec.step_ms`` after each batch: how long the loop waits."""
    loader = _datapipe_loader(cache, spec, device)
    try:
        timed_pass(loader, min(batches, 2))
        loader.meter.reset()
        timed_pass(loader, batches, step_s=spec.step_ms / 1000.0)
        s = loader.stats()  # its wall time ends with the last batch's step: N steps for N batches
    finally:
        loader.close()
    return {"step_ms": spec.step_ms, "images_per_s": s["images_per_s"], "wait_share": s["wait_share"]}


# ----------------------------------------------------------------------------- output


def format_table(result: BenchResult) -> str:
    lines = []
    m = result.machine
    lines.append(f"machine: {m['cpu']}, {m['cores']} cores, GPU: {m['gpu'] or 'none'}; torch {m['versions']['torch']}; "
                 f"CPU kernel: {m.get('cpu_kernel', 'unknown')}")
    c = result.config
    lines.append(f"same output for all: {c['output']}; batch {c['batch_size']}, {c['workers']} workers, "
                 f"{c['repeats']} rounds of {c['batches_per_pass']} batches")
    lines.append(f"same samples for all: the cache's {c['samples']:,} (the peers read their source files)")
    lines.append("")
    width = max([12, *(len(s.label) for s in result.systems.values())])
    lines.append(f"{'system':<{width}} {'images/s (median)':>18} {'min..max':>18} {'datapipe ×':>11} {'prep s':>8} "
                 f"{'CPU ms/img':>11} {'KiB/sample':>11}")
    for s in result.systems.values():
        if s.status == "failed":
            lines.append(f"{s.label:<{width}} FAILED: {s.reason}")
            continue
        if s.status != "ok":
            lines.append(f"{s.label:<{width}} skipped: {s.reason} (install: {s.install})")
            continue
        ratio = f"{s.ratio:.1f}×" if s.ratio else "—"
        prep = f"{s.prepare_s:.1f}" if s.prepare_s is not None else "—"
        cpu = f"{1000 * s.cpu_s_per_image:.2f}" if s.cpu_s_per_image is not None else "—"
        kib = f"{s.bytes_per_sample / 1024:,.1f}" if s.bytes_per_sample is not None else "—"
        lines.append(f"{s.label:<{width}} {s.median:>18,.0f} {f'{s.spread[0]:,.0f}..{s.spread[1]:,.0f}':>18} "
                     f"{ratio:>11} {prep:>8} {cpu:>11} {kib:>11}")
    lines.append("")
    st = result.stages
    first = result.systems.get(SYSTEM)
    lines.append(f"datapipe stages (one thread each){f' on the {first.encoding} cache, fit {first.fit}' if first else ''}:")
    lines.append(f"  read      {st['read']['MB_per_s']:,.0f} MB/s first pass, {st['read']['MB_per_s_cached']:,.0f} MB/s "
                 "again from the page cache (sequential, every shard file)")
    off_path = "" if st["assemble"].get("on_this_path", True) else " (not on this path: crops read from the maps)"
    lines.append(f"  assemble  {st['assemble']['images_per_s']:,.0f} img/s, {st['assemble']['GB_per_s']:.2f} GB/s"
                 f"{off_path}")
    decode = st["decode"]
    lines.append(f"  decode    {decode['images_per_s']:,.0f} img/s, {decode['what']}" if decode.get("images_per_s")
                 else f"  decode    {decode['what']}")
    h2d = st["h2d"]
    h2d_text = f"{h2d['GB_per_s']:.1f} GB/s" if h2d.get("GB_per_s") else h2d["what"]
    lines.append(f"  h2d       {h2d_text}")
    lines.append(f"  augment   {st['augment']['images_per_s']:,.0f} img/s on {st['augment']['where']}")
    lines.append(f"  on disk   {st['bytes_on_disk_per_image'] / 1024:,.0f} KiB per image")
    a = result.attribution
    lines.append(f"  one reader end to end {a['one_reader_images_per_s']:,.0f} img/s; sum of stages / end to end = "
                 f"{a['sum_over_end_to_end']:.2f} (rounds: {', '.join(f'{r:.2f}' for r in a['rounds'])})")
    if "model_step" in a:
        ms = a["model_step"]
        lines.append(f"  with a {ms['step_ms']:g} ms model step: {ms['images_per_s']:,.0f} img/s, the loop waited "
                     f"{100 * ms['wait_share']:.1f}% of the time")
    return "\n".join(lines)


#: The chart formats ``--plot`` writes (by the file's suffix; none: ``.png`` is added).
CHART_FORMATS = ("png", "svg", "pdf", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def chart_path(path: str | os.PathLike[str]) -> Path:
    """The file a chart asked for at ``path`` is written to: ``path`` itself, or ``path.png`` where it
    has no suffix.

    Raises:
        ArgumentError: a suffix that is not one of :data:`CHART_FORMATS`.
        OutputError: ``path`` is a folder.
    """
    from ..errors import OutputError

    p = Path(path)
    if p.expanduser().is_dir():
        raise OutputError(f"--plot {p}: is a folder; name the chart's file (e.g. {p / 'bench.png'})")
    suffix = p.suffix.lower().lstrip(".")
    if not suffix:
        return p.with_name(f"{p.name}.png")
    if suffix not in CHART_FORMATS:
        raise ArgumentError(f"--plot {one_line(str(path), 200)}: .{suffix} is not a chart format; name a file ending in "
                            f"{', '.join('.' + f for f in CHART_FORMATS[:3])} (or another of {', '.join(CHART_FORMATS[3:])})")
    return p


def check_output_file(flag: str, path: str | os.PathLike[str]) -> Path:
    """Check, before anything is measured, that a result file can be written at ``path``.

    Raises:
        OutputError: ``path`` is a folder, or its folder is missing or not writable, or the file
            exists and cannot be overwritten; the message names ``flag``.
    """
    from ..errors import OutputError

    if not os.fspath(path):  # `--json "$OUT"` with OUT unset: never a result silently not written
        raise OutputError(f"{flag} is empty; name a file (e.g. bench{'.json' if flag == '--json' else '.png'})")
    p = Path(path).expanduser()
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise OutputError(f"{flag} {p}: is a folder; name a file (e.g. {p / 'bench'}{'.json' if flag == '--json' else '.png'})")
    if not parent.is_dir():
        there = next((a for a in parent.parents if a.exists()), None) if not parent.exists() else parent
        if there is not None and not there.is_dir():
            raise OutputError(f"{flag} {p}: {there} is a file, not a folder; choose another path")
        raise OutputError(f"{flag} {p}: the folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise OutputError(f"{flag} {p}: cannot be written (permission denied); choose a writable path")
    if p.exists() and not p.is_file():
        raise OutputError(f"{flag} {p}: is not a regular file; choose another path")
    cache = _owning_cache(p)
    if cache is not None:
        raise OutputError(f"{flag} {p}: is one of the datapipe cache {cache}'s own files (or in its shards folder), "
                          "which datapipe never overwrites with anything else; choose another path")
    return p


def _owning_cache(path: Path) -> Path | None:
    """The datapipe cache whose own file (manifest, report, labels... or anything in its shards folder)
    ``path`` would be, or None."""
    from ..records import BUILD_LOCK, LABELS, MANIFEST, PATHS, REPORT, is_datapipe_output
    from ..shards import SHARDS_DIR

    folder = path.absolute().parent
    if path.name in (MANIFEST, REPORT, BUILD_LOCK, LABELS, PATHS) and is_datapipe_output(folder):
        return folder
    for above in (folder, *folder.parents):
        if above.name == SHARDS_DIR and is_datapipe_output(above.parent):
            return above.parent
    return None


def plot(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    """Write the chart of ``result``; returns the file written (see :func:`chart_path`)."""
    path = chart_path(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [s for s in result.systems.values() if s.status == "ok"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [s.name for s in ok]
    values = [s.median for s in ok]
    errs = [[s.median - s.spread[0] for s in ok], [s.spread[1] - s.median for s in ok]]
    colors = ["#2a7ab0" if s.encoding else "#999999" for s in ok]  # datapipe's systems in blue
    ax1.bar(names, values, yerr=errs, color=colors, capsize=4)
    for i, s in enumerate(ok):
        label = f"{s.median:,.0f}" + (f"\n({s.ratio:.1f}× slower)" if s.ratio else "")
        ax1.text(i, s.median, label, ha="center", va="bottom", fontsize=8)
    ax1.set_ylabel("images/s (median, min–max)")
    ax1.set_title(f"Same output, {result.config['workers']} workers, batch {result.config['batch_size']}")
    st = result.stages
    stage_names, rates = [], []
    for key in ("assemble", "h2d", "augment"):
        if st[key].get("images_per_s") and st[key].get("on_this_path", True):
            stage_names.append(key)
            rates.append(st[key]["images_per_s"])
    stage_names.append("end to end\n(1 reader)")
    rates.append(result.attribution["one_reader_images_per_s"])
    ax2.barh(stage_names, rates, color="#2a7ab0")
    ax2.set_xlabel("images/s, one thread")
    ax2.set_title("datapipe stage by stage")
    fig.suptitle(f"{result.machine['cpu']} · {result.machine['cores']} cores · GPU: {result.machine['gpu'] or 'none'}",
                 fontsize=9)
    fig.tight_layout()
    chart = io.BytesIO()
    fig.savefig(chart, dpi=110, format=path.suffix.lower().lstrip("."))
    plt.close(fig)
    # never a half-written chart in place of the file, nor of the chart that was there (a full disk)
    atomic_write_bytes(path.resolve(), chart.getvalue())  # through a link, as --json
    return path
