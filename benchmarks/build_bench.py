"""Build speed: datapipe's decode path against a plain Pillow loop, and 1 vs 2 Dask workers.

Measured side by side in one run (the machine is shared, so only ratios from the same run count):

* per core: ``datapipe.build(..., scheduler="sync")`` (one process, every stage of the build:
  read, sniff, decode with libjpeg-turbo, orient, resize, crop, write the Zarr shard, checksum)
  against a Pillow loop on the same files (open -> convert RGB -> resize shorter side to 256 ->
  center crop), alternating rounds;
* scaling: a LocalCluster build with 1 worker against 2 workers (cluster start-up excluded);
* bytes on disk per sample, peak RSS of a build worker and its page faults per image.

Warm-up (imports, first calls) is excluded; both sides read the same files from the page cache.

    python benchmarks/build_bench.py [--source DIR] [--images 3000] [--rounds 2]
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def _cpu() -> float:
    """CPU seconds of this process (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pillow_loop(files: list[Path], size: int = 256) -> tuple[float, float]:
    """The usual per-image Pillow pipeline; returns (images per wall second, per CPU second)."""
    from PIL import Image

    t, c = time.perf_counter(), _cpu()
    for f in files:
        img = Image.open(io.BytesIO(f.read_bytes())).convert("RGB")
        w, h = img.size
        s = size / min(w, h)
        img = img.resize((max(size, round(w * s)), max(size, round(h * s))), Image.Resampling.BILINEAR)
        w, h = img.size
        left, top = (w - size) // 2, (h - size) // 2
        np.asarray(img.crop((left, top, left + size, top + size)))
    return len(files) / (time.perf_counter() - t), len(files) / (_cpu() - c)


def datapipe_build(source: Path, out: Path, **kwargs) -> dict:
    import datapipe

    shutil.rmtree(out, ignore_errors=True)
    c = _cpu()
    report = datapipe.build(source, out, progress=False, log=lambda line: None, **kwargs)
    return {"images_per_s": report.images_per_second, "images_per_cpu_s": report.num_samples / (_cpu() - c),
            "bytes_per_sample": report.bytes_per_sample,
            "peak_worker_rss_mb": report.peak_worker_rss_mb, "seconds": report.seconds,
            "page_faults_per_image": report.page_faults_per_image}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source", default=None, help="image folder (default: generate one)")
    p.add_argument("--images", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shard-size", type=int, default=None, help="samples per shard (default: datapipe's, ~100 MB)")
    args = p.parse_args()

    import datapipe

    tmp = Path(tempfile.mkdtemp(prefix="datapipe-build-bench-"))
    source = Path(args.source) if args.source else datapipe.make_sample_dataset(
        tmp / "source", images=args.images, workers=2)
    files = sorted(source.glob("*/*"))
    sizes = [f.stat().st_size for f in files]
    from datapipe.builder import default_shard_size

    shard_size = args.shard_size or default_shard_size(256)
    print(f"{len(files)} files, mean {statistics.mean(sizes) / 1e3:.0f} KB; {shard_size} samples per shard")
    from datapipe.codecs import DecodeSpec, decode_sample

    for f in files[:50]:  # warm-up, not timed: imports (torch, zarr) and first-call set-up
        decode_sample(f.read_bytes(), DecodeSpec(size=256))
    pillow_loop(files[:50])
    try:
        pil, dp, pil_cpu, dp_cpu = [], [], [], []
        for _ in range(args.rounds):
            wall, cpu = pillow_loop(files)
            pil.append(wall)
            pil_cpu.append(cpu)
            r = datapipe_build(source, tmp / "sync", scheduler="sync", shard_size=shard_size)
            dp.append(r["images_per_s"])
            dp_cpu.append(r["images_per_cpu_s"])
        per_core = statistics.median(d / q for d, q in zip(dp, pil))
        per_cpu = statistics.median(d / q for d, q in zip(dp_cpu, pil_cpu))
        print(f"per core: Pillow loop {statistics.median(pil):,.0f} img/s, datapipe build (sync, 1 process) "
              f"{statistics.median(dp):,.0f} img/s -> {per_core:.2f}x (per round: "
              f"{', '.join(f'{d / q:.2f}' for d, q in zip(dp, pil))})")
        print(f"per CPU-second (whole build, every thread): Pillow loop {statistics.median(pil_cpu):,.0f}, "
              f"datapipe {statistics.median(dp_cpu):,.0f} -> {per_cpu:.2f}x")
        one, two = [], []
        for _ in range(args.rounds):
            one.append(datapipe_build(source, tmp / "w1", workers=1, shard_size=shard_size))
            two.append(datapipe_build(source, tmp / "w2", workers=2, shard_size=shard_size))
        scale = statistics.median(b["images_per_s"] / a["images_per_s"] for a, b in zip(one, two))
        print(f"LocalCluster: 1 worker {statistics.median(r['images_per_s'] for r in one):,.0f} img/s, "
              f"2 workers {statistics.median(r['images_per_s'] for r in two):,.0f} img/s -> {scale:.2f}x")
        print(f"bytes on disk per sample: {two[0]['bytes_per_sample']:,.0f}; peak build worker RSS: "
              f"{max(r['peak_worker_rss_mb'] for r in one + two):,.0f} MB; page faults per image in a "
              f"worker: {statistics.median(r['page_faults_per_image'] for r in one + two):.1f}")
        print(json.dumps({"pillow_loop": pil, "datapipe_sync": dp, "per_core_ratio": per_core,
                          "pillow_loop_per_cpu_s": pil_cpu, "datapipe_sync_per_cpu_s": dp_cpu, "per_cpu_ratio": per_cpu,
                          "one_worker": [r["images_per_s"] for r in one],
                          "two_workers": [r["images_per_s"] for r in two], "scaling": scale,
                          "bytes_per_sample": two[0]["bytes_per_sample"],
                          "peak_worker_rss_mb": max(r["peak_worker_rss_mb"] for r in one + two)}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
