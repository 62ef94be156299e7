"""`datapipe demo`: the whole way on an embedded default, in one command.

Generates an ImageNet-like sample dataset, builds it on a LocalCluster (printing the dashboard
URL), reads it back through the streaming loader, and measures it against the plain DataLoader.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from ..text import plural

log = logging.getLogger("datapipe.demo")


#: The sample dataset's classes (one class folder each).
CLASSES = 10
DEMO_SIZE = 256  # the side of the cache the demo builds


def check_demo_args(*, images: object, workers: object) -> None:
    """The demo's options, checked before anything is written; the message names the flag."""
    from ..errors import ArgumentError
    from ..text import show

    if isinstance(images, bool) or not isinstance(images, int) or images < CLASSES:
        raise ArgumentError(f"--images must be a whole number >= {CLASSES} (the sample's {CLASSES} classes each "
                            f"get an image), got {show(images)}; raise --images")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ArgumentError(f"--workers must be a whole number >= 1, got {show(workers)}")
    from ..builder import local_workers

    local_workers(workers)  # a count this machine cannot run


def run_demo(folder: str | os.PathLike = "datapipe-demo", *, images: int = 2000, workers: int | None = None,
             bench: bool = True, out: TextIO | None = None) -> dict:
    """Generate, build, read back and bench; progress goes to the ``datapipe.demo`` logger, the
    results (the bench's table and the verdict) are written to ``out`` (default: standard output).

    Raises:
        ArgumentError: ``images`` below the sample's classes, or ``workers`` below 1 (checked first).
    """
    check_demo_args(images=images, workers=workers)
    from .. import augment
    from ..builder import Cluster, build
    from ..cache import Cache
    from ..dataset import StreamingDataset
    from ..device import DeviceLoader
    from .sample import IMAGE_BYTES, _check_room, make_sample_dataset

    root = Path(folder).absolute()
    source, cache_dir = root / "images", root / "cache"
    cores = os.cpu_count() or 1
    log.info(f"[1/4] sample dataset: {images} ImageNet-like JPEGs (real photographs, recoloured, ~430x340) in {source}")
    t0 = time.perf_counter()
    existing = sum(1 for _ in source.glob("*/*.jpg")) if source.exists() else 0
    # the images left to write and the cache (256² raw pixels a sample), before either is written
    cache_bytes = 0 if (cache_dir / "manifest.json").exists() else images * (DEMO_SIZE * DEMO_SIZE * 3 + 64)
    _check_room(root, images, need=max(0, images - existing) * IMAGE_BYTES + cache_bytes,
                what=" (the sample and its cache)")
    if existing != images:
        make_sample_dataset(source, images=images, classes=CLASSES, workers=cores)
        log.info(f"      generated in {time.perf_counter() - t0:.1f} s")
    else:
        log.info("      already there")

    log.info(f"[2/4] build on a Dask LocalCluster -> {cache_dir}")
    report = build(source, cache_dir, size=DEMO_SIZE, shard_size=max(50, images // (4 * (workers or cores))),
                   cluster=Cluster(workers=workers))
    log.info(f"      {report.summary()}")

    log.info("[3/4] read it back")
    cache = Cache(cache_dir)
    for i in (0, len(cache) // 2, len(cache) - 1):
        image, label = cache[i]
        log.info(f"      sample {i}: {cache.path(i)} -> {image.shape} {image.dtype}, class {cache.classes[label]!r}")
    ds = StreamingDataset(cache, batch_size=256, shuffle=True, seed=0)
    loader = DeviceLoader(ds, device="auto", num_workers=min(2, cores), augment=augment.train(224))
    try:
        for epoch in range(2):
            loader.set_epoch(epoch)
            n, shapes = 0, []
            for images_, labels in loader:
                n += int(labels.shape[0])
                shapes.append(tuple(images_.shape))
            s = loader.stats()  # right after the loop: the last batch's step counts
            log.info(f"      epoch {epoch}: {plural(n, 'sample')} in {plural(len(shapes), 'batch', 'batches')} of float "
                     f"{_shapes(shapes)} on {loader.device}; {s['images_per_s']:,.0f} img/s since start")
    finally:
        loader.close()
    result = {"build": report, "loader": s}
    if bench:
        from .harness import BenchSpec, format_table, run

        log.info("[4/4] bench against the plain torch DataLoader + Pillow ImageFolder pipeline (same output)")
        res = run(cache_dir, BenchSpec(workers=min(2, cores), repeats=2, batches=min(len(ds), 8)), source=source,
                  against=["dataloader"], progress=False)
        out = sys.stdout if out is None else out
        print(format_table(res), file=out)
        peer = res.systems["dataloader"]
        if peer.ratio:
            print(f"\ndatapipe delivered {res.systems['datapipe'].median:,.0f} img/s, {peer.ratio:.1f}x the plain "
                  f"DataLoader's {peer.median:,.0f} img/s on this machine.", file=out)
        else:
            print(f"\nno comparison: the plain DataLoader {peer.status}: {peer.reason}", file=out)
        out.flush()
        result["bench"] = res
    return result


def _shapes(shapes: list[tuple[int, ...]]) -> str:
    """The batches' shapes as a list: ``[256, 3, 224, 224]``, or ``[256|200, 3, 224, 224]`` where the last is smaller."""
    if not shapes:
        return "[]"
    sizes = sorted({s[0] for s in shapes}, reverse=True)
    return f"[{'|'.join(str(n) for n in sizes)}, {', '.join(str(d) for d in shapes[0][1:])}]"
