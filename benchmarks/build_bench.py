"""Build speed: datapipe's decode path against a plain Pillow loop, and 1 vs 2 Dask workers.

Measured side by side in one run (the machine is shared, so only ratios from the same run count):

* per core: datapipe's shard task (``build_shard``, the function every Dask worker runs: read, sniff,
  decode with libjpeg-turbo, orient, resize, crop, write the Zarr shard, checksum, fsync, commit) in
  this one process against a Pillow loop on the same files (open -> convert RGB -> resize shorter
  side to 256 -> center crop). The two alternate shard by shard (~1-2 s each), so that the machine's
  drift, which here moves speeds by tens of percent over minutes, hits both alike;
* scaling: a LocalCluster build with 1 worker against 2 workers (cluster start-up excluded);
* bytes on disk per sample, peak RSS of a build worker and its page faults per image.

Warm-up (imports, first calls) is excluded; every file is read once before the clock starts, so both
sides read the same files from the page cache. The set should hold many more shards than workers:
each worker's last shard is a tail the other worker does not share (with 6 shards on 2 workers that
tail alone caps the speed-up near 1.85x; the default 12,000 images make 23 shards).

    python benchmarks/build_bench.py [--source DIR] [--images 12000] [--rounds 2] [--only per-core|scaling]
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


def datapipe_build(source: Path, out: Path, *, workers: int, shard_size: int) -> dict:
    import datapipe

    shutil.rmtree(out, ignore_errors=True)
    c = _cpu()
    report = datapipe.build(source, out, datapipe.BuildSpec(size=256, shard_size=shard_size),
                            cluster=datapipe.Cluster(workers=workers), progress=False)
    # Removed at once, so that every build starts on the same disk: on this VM a 2-worker build ran
    # ~25% slower while the previous build's 2.4 GB output was still there.
    shutil.rmtree(out, ignore_errors=True)
    return {"images_per_s": report.images_per_second, "images_per_cpu_s": report.num_samples / (_cpu() - c),
            "bytes_per_sample": report.bytes_per_sample,
            "peak_worker_rss_mb": report.peak_worker_rss_mb, "seconds": report.seconds,
            "page_faults_per_image": report.page_faults_per_image}


def per_core(source: Path, tmp: Path, shard_size: int, rounds: int):
    """Pillow loop and datapipe's shard task, alternating shard by shard; per round: images per
    wall second and per CPU second of each side."""
    from dataclasses import asdict

    from datapipe import manifest as mf
    from datapipe.builder import BuildSpec, build_shard
    from datapipe.sources import plan_shards, scan

    listing = scan(source)
    spec = BuildSpec(size=256, shard_size=shard_size)
    plans = plan_shards(listing, spec.samples_per_shard)
    out = tmp / "shards-bench"
    kwargs = {"root": str(listing.root.absolute()), "output": str(out), "spec": asdict(spec.decode),
              "config_hash": mf.config_hash(spec.config(listing.kind))}
    pil, dp, pil_cpu, dp_cpu = [], [], [], []
    for _ in range(rounds):
        shutil.rmtree(out, ignore_errors=True)
        (out / "shards").mkdir(parents=True)
        wall = {"pil": 0.0, "dp": 0.0}
        cpu = {"pil": 0.0, "dp": 0.0}
        n = 0
        for plan in plans:
            files = [listing.root / p for p in plan["paths"]]
            t, c = time.perf_counter(), _cpu()
            pillow_loop(files)
            wall["pil"] += time.perf_counter() - t
            cpu["pil"] += _cpu() - c
            t, c = time.perf_counter(), _cpu()
            record = build_shard(plan, **kwargs)
            wall["dp"] += time.perf_counter() - t
            cpu["dp"] += _cpu() - c
            assert record["count"] == len(files) and not record["skipped"], record
            n += len(files)
        pil.append(n / wall["pil"])
        dp.append(n / wall["dp"])
        pil_cpu.append(n / cpu["pil"])
        dp_cpu.append(n / cpu["dp"])
    shutil.rmtree(out, ignore_errors=True)
    return pil, dp, pil_cpu, dp_cpu


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--source", default=None, help="image folder (default: generate one)")
    p.add_argument("--images", type=int, default=12000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shard-size", type=int, default=None, help="samples per shard (default: datapipe's, ~100 MB)")
    p.add_argument("--only", choices=("per-core", "scaling"), default=None, help="run one of the two parts")
    args = p.parse_args()

    import datapipe

    tmp = Path(tempfile.mkdtemp(prefix="datapipe-build-bench-"))
    source = Path(args.source) if args.source else datapipe.make_sample_dataset(
        tmp / "source", images=args.images, workers=2)
    files = sorted(source.glob("*/*"))
    sizes = [f.stat().st_size for f in files]
    from datapipe.builder import default_shard_size

    shard_size = args.shard_size or default_shard_size(256)
    shards = -(-len(files) // shard_size)
    print(f"{len(files)} files, mean {statistics.mean(sizes) / 1e3:.0f} KB; {shard_size} samples per shard, "
          f"{shards} shards")
    for f in files:  # into the page cache: neither side pays for the disk
        f.read_bytes()
    from datapipe.codecs import DecodeSpec, decode_sample

    for f in files[:50]:  # warm-up, not timed: imports (torch, zarr) and first-call set-up
        decode_sample(f.read_bytes(), DecodeSpec(size=256))
    pillow_loop(files[:50])
    results: dict = {}
    try:
        if args.only != "scaling":
            pil, dp, pil_cpu, dp_cpu = per_core(source, tmp, shard_size, args.rounds)
            per_core_ratio = statistics.median(d / q for d, q in zip(dp, pil, strict=True))
            per_cpu = statistics.median(d / q for d, q in zip(dp_cpu, pil_cpu, strict=True))
            print(f"per core: Pillow loop {statistics.median(pil):,.0f} img/s, datapipe shard tasks (1 process) "
                  f"{statistics.median(dp):,.0f} img/s -> {per_core_ratio:.2f}x (per round: "
                  f"{', '.join(f'{d / q:.2f}' for d, q in zip(dp, pil, strict=True))})")
            print(f"per CPU-second (every thread): Pillow loop {statistics.median(pil_cpu):,.0f}, "
                  f"datapipe {statistics.median(dp_cpu):,.0f} -> {per_cpu:.2f}x")
            results.update({"pillow_loop": pil, "datapipe_shards": dp, "per_core_ratio": per_core_ratio,
                            "pillow_loop_per_cpu_s": pil_cpu, "datapipe_shards_per_cpu_s": dp_cpu,
                            "per_cpu_ratio": per_cpu})
        if args.only != "per-core":
            one, two = [], []
            for _ in range(args.rounds):
                one.append(datapipe_build(source, tmp / "w1", workers=1, shard_size=shard_size))
                two.append(datapipe_build(source, tmp / "w2", workers=2, shard_size=shard_size))
            ratios = [b["images_per_s"] / a["images_per_s"] for a, b in zip(one, two, strict=True)]
            scale = statistics.median(ratios)
            print(f"LocalCluster: 1 worker {statistics.median(r['images_per_s'] for r in one):,.0f} img/s, "
                  f"2 workers {statistics.median(r['images_per_s'] for r in two):,.0f} img/s -> {scale:.2f}x "
                  f"(per round: {', '.join(f'{r:.2f}' for r in ratios)})")
            print(f"bytes on disk per sample: {two[0]['bytes_per_sample']:,.0f}; peak build worker RSS: "
                  f"{max(r['peak_worker_rss_mb'] for r in one + two):,.0f} MB; page faults per image in a "
                  f"worker: {statistics.median(r['page_faults_per_image'] for r in one + two):.1f}")
            results.update({"one_worker": [r["images_per_s"] for r in one],
                            "two_workers": [r["images_per_s"] for r in two], "scaling": scale,
                            "bytes_per_sample": two[0]["bytes_per_sample"],
                            "peak_worker_rss_mb": max(r["peak_worker_rss_mb"] for r in one + two)})
        print(json.dumps(results))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
