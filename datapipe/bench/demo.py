"""`datapipe demo`: the whole way on an embedded default, in one command.

Generates an ImageNet-like sample dataset, builds it on a LocalCluster (printing the dashboard
URL), reads it back through the streaming loader, and measures it against the plain DataLoader.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from ..text import plural

log = logging.getLogger("datapipe.demo")


def run_demo(folder: str | os.PathLike = "datapipe-demo", *, images: int = 2000, workers: int | None = None,
             bench: bool = True) -> dict:
    from .. import augment
    from ..builder import Cluster, build
    from ..cache import Cache
    from ..dataset import StreamingDataset
    from ..device import DeviceLoader
    from .sample import make_sample_dataset

    root = Path(folder).absolute()
    source, cache_dir = root / "images", root / "cache"
    cores = os.cpu_count() or 1
    log.info(f"[1/4] sample dataset: {images} ImageNet-like JPEGs (real photographs, recoloured, ~430x340) in {source}")
    t0 = time.perf_counter()
    existing = sum(1 for _ in source.glob("*/*.jpg")) if source.exists() else 0
    if existing != images:
        make_sample_dataset(source, images=images, classes=10, workers=cores)
        log.info(f"      generated in {time.perf_counter() - t0:.1f} s")
    else:
        log.info("      already there")

    log.info(f"[2/4] build on a Dask LocalCluster -> {cache_dir}")
    report = build(source, cache_dir, size=256, shard_size=max(50, images // (4 * (workers or cores))),
                   cluster=Cluster(workers=workers))
    log.info(f"      {report.summary()}")

    log.info("[3/4] read it back")
    cache = Cache(cache_dir)
    for i in (0, len(cache) // 2, len(cache) - 1):
        image, label = cache[i]
        log.info(f"      sample {i}: {cache.path(i)} -> {image.shape} {image.dtype}, class {cache.classes[label]!r}")
    ds = StreamingDataset(cache, batch_size=256, shuffle=True, seed=0)
    loader = DeviceLoader(ds, device="auto", num_workers=min(2, cores), augment=augment.train(224))
    for epoch in range(2):
        loader.set_epoch(epoch)
        n = sum(int(labels.shape[0]) for _, labels in loader)
        s = loader.stats()
        log.info(f"      epoch {epoch}: {plural(n, 'sample')} in {plural(len(loader), 'batch', 'batches')} of float [256, 3, 224, 224] on "
              f"{loader.device}; {s['images_per_s']:,.0f} img/s since start")
    loader.close()
    result = {"build": report, "loader": s}
    if bench:
        from .harness import BenchSpec, format_table, run

        log.info("[4/4] bench against the plain torch DataLoader + Pillow ImageFolder pipeline (same output)")
        res = run(cache_dir, BenchSpec(workers=min(2, cores), repeats=2, batches=min(len(ds), 8)), source=source,
                  against=["dataloader"], progress=False)
        log.info(format_table(res))
        peer = res.systems["dataloader"]
        if peer.ratio:
            log.info(f"\ndatapipe delivered {res.systems['datapipe'].median:,.0f} img/s, {peer.ratio:.1f}x the plain "
                  f"DataLoader's {peer.median:,.0f} img/s on this machine.")
        else:
            log.info(f"\nno comparison: the plain DataLoader {peer.status}: {peer.reason}")
        result["bench"] = res
    return result
