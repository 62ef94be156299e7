"""The cache reader against an earlier datapipe, side by side: interleaved rounds, ratios per round.

Each measurement is a fresh process (``PYTHONPATH`` picks the datapipe it imports), so the two
versions never share a page table, a thread pool or an allocator; within a round the order of the
sides alternates, and the figure is the median over rounds of new / old. Two figures per side:
images/s (wall clock), and CPU seconds (user + system, all threads) per 1,000 images — on a
machine other processes share, the wall clock swings with their load while the CPU cost per image
barely moves, so the ratio of CPU costs (old / new: above 1 is faster) is the steadier one.

* ``uint8``: DeviceLoader(device="cpu", output="uint8"): whole uint8 batches gathered from the cache;
* ``train224``: DeviceLoader(device="cpu", augment=augment.train(224)): each sample's random crop
  resized and normalised on the CPU (the CPU train preset);
* ``read256`` and ``crop256`` (one thread, no loader): ``Cache.read_batch`` of 256 shuffled samples,
  and the train preset on 256 shuffled samples handed over by ``Cache.sample_views`` (views of the
  maps where the reader has them), for the reader's own cost without the loader's threads.

Sides: ``old`` (the checkout at --old, reading its own cache --old-cache), ``new`` (this checkout,
--new-cache) and, with --pread, ``pread`` (this checkout with DATAPIPE_NATIVE=0: positioned reads
and torch kernels, what an install without a compiler gets).

    python benchmarks/reader_bench.py --old /tmp/dp-base --old-cache /tmp/benchcache-base \\
        --new-cache /tmp/benchcache-new [--rounds 7] [--seconds 3] [--workers 2] [--batch 256] [--pread]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def child(mode: str, cache: str, seconds: float, workers: int, batch: int) -> None:
    """One measurement: a warm-up epoch, then whole epochs until ``seconds`` have passed; prints one JSON line."""
    import torch

    import datapipe
    from datapipe import augment

    if mode in ("read256", "crop256"):
        return single_thread(mode, cache, seconds, batch)
    ds = datapipe.StreamingDataset(cache, batch_size=batch, seed=0)
    if mode == "uint8":
        loader = datapipe.DeviceLoader(ds, device="cpu", output="uint8", num_workers=workers)
    else:
        loader = datapipe.DeviceLoader(ds, device="cpu", augment=augment.train(224), num_workers=workers)
    n, spent, cpu, epoch = 0, 0.0, 0.0, 0
    while spent < seconds:
        loader.set_epoch(epoch)
        t, c, k = time.perf_counter(), _cpu(), 0
        for images, _ in loader:
            k += int(images.shape[0])
        if epoch:  # epoch 0 warms the page cache, the maps and the buffers
            n, spent, cpu = n + k, spent + time.perf_counter() - t, cpu + _cpu() - c
        epoch += 1
    loader.close()
    print(json.dumps({"images_per_s": n / spent, "cpu_s_per_1k": 1000 * cpu / n, "epochs": epoch - 1,
                      "datapipe": str(Path(datapipe.__file__).parent),
                      "mapped": bool(getattr(ds.cache, "mapped", True)), "torch_threads": torch.get_num_threads()}))


def single_thread(mode: str, path: str, seconds: float, batch: int) -> None:
    """``read256``/``crop256`` in this thread, batch after batch until ``seconds`` have passed."""
    import contextlib
    import inspect

    import numpy as np
    import torch

    import datapipe
    from datapipe import augment

    torch.set_num_threads(1)
    cache = datapipe.open(path)
    preset, rng = augment.train(224), np.random.default_rng(0)
    images, labels = np.empty((batch, *cache.shape), np.uint8), np.empty(batch, np.int64)
    out = torch.empty((batch, 3, 224, 224))
    mapped = "mapped" in inspect.signature(cache.sample_views).parameters  # the reader's own views, where it has them

    def one() -> None:
        idx = rng.choice(len(cache), batch, replace=False)
        if mode == "read256":
            cache.read_batch(idx, images, labels)
            return
        views = cache.sample_views(idx, labels, mapped=True) if mapped else cache.sample_views(idx, labels)
        with cache.mapped_reads(idx) if mapped and cache.mapped else contextlib.nullcontext():
            preset(views, seed=1, out=out)

    for _ in range(3):
        one()
    n, t, c = 0, time.perf_counter(), _cpu()
    while time.perf_counter() - t < seconds:
        one()
        n += batch
    spent, cpu = time.perf_counter() - t, _cpu() - c
    print(json.dumps({"images_per_s": n / spent, "cpu_s_per_1k": 1000 * cpu / n,
                      "datapipe": str(Path(datapipe.__file__).parent)}))


def _cpu() -> float:
    """CPU seconds of this process so far, every thread, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _ratios(top: list[dict], bottom: list[dict], key: str) -> list[float]:
    """Round by round, top[key] / bottom[key]."""
    return [t[key] / b[key] for t, b in zip(top, bottom, strict=True)]


def measure(side: str, mode: str, args) -> dict:
    env = dict(os.environ)
    env.pop("DATAPIPE_NATIVE", None)
    path, cache = (args.old, args.old_cache) if side == "old" else (str(HERE), args.new_cache)
    if side == "pread":
        env["DATAPIPE_NATIVE"] = "0"
    env["PYTHONPATH"] = path
    cmd = [sys.executable, __file__, "--child", mode, cache, "--seconds", str(args.seconds), "--workers", str(args.workers),
           "--batch", str(args.batch)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/", check=False)
    if done.returncode:
        raise SystemExit(f"{side} {mode} failed (rc {done.returncode}): {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    want = Path(path).resolve() / "datapipe"
    if Path(result["datapipe"]).resolve() != want:
        raise SystemExit(f"{side} imported {result['datapipe']}, not {want}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=2, metavar=("MODE", "CACHE"), help=argparse.SUPPRESS)
    p.add_argument("--old", help="a checkout of the earlier datapipe (its package folder is imported)")
    p.add_argument("--old-cache", help="a cache built by the earlier datapipe")
    p.add_argument("--new-cache", help="the same source built by this datapipe")
    p.add_argument("--modes", default="uint8,train224", help="any of uint8, train224, read256, crop256")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=3.0, help="timed whole epochs per process, at least this long")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--pread", action="store_true", help="also this checkout with DATAPIPE_NATIVE=0")
    p.add_argument("--json", help="write every measurement and the summary here")
    args = p.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.seconds, args.workers, args.batch)
        return
    if not (args.old and args.old_cache and args.new_cache):
        p.error("--old, --old-cache and --new-cache are required")
    modes = args.modes.split(",")
    sides = ["old", "new"] + (["pread"] if args.pread else [])
    runs: dict[str, dict[str, list[dict]]] = {m: {s: [] for s in sides} for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                runs[mode][side].append(measure(side, mode, args))
            last = {s: runs[mode][s][-1] for s in sides}
            line = "  ".join(f"{s} {last[s]['images_per_s']:7.0f} img/s {last[s]['cpu_s_per_1k']:6.3f} cpu-s/1k" for s in sides)
            print(f"round {r + 1}/{args.rounds} {mode:9s} {line}", flush=True)
    summary = {}
    print(f"\nmedians over {args.rounds} rounds ({args.workers} workers, batch {args.batch}, "
          f">= {args.seconds:g} s of whole epochs per process); ratios are per round, then the median")
    for mode in modes:
        r = runs[mode]
        summary[mode] = {
            "images_per_s": {s: statistics.median(m["images_per_s"] for m in r[s]) for s in sides},
            "cpu_s_per_1k": {s: statistics.median(m["cpu_s_per_1k"] for m in r[s]) for s in sides},
            "wall_ratio_to_old": {s: statistics.median(_ratios(r[s], r["old"], "images_per_s")) for s in sides if s != "old"},
            "cpu_ratio_to_old": {s: statistics.median(_ratios(r["old"], r[s], "cpu_s_per_1k")) for s in sides if s != "old"},
        }
        m = summary[mode]
        rates = "  ".join(f"{s} {m['images_per_s'][s]:.0f}" for s in sides)
        costs = "  ".join(f"{s} {m['cpu_s_per_1k'][s]:.3f}" for s in sides)
        wall = "  ".join(f"{s}/old {m['wall_ratio_to_old'][s]:.3f}" for s in sides if s != "old")
        cpu = "  ".join(f"{s}/old {m['cpu_ratio_to_old'][s]:.3f}" for s in sides if s != "old")
        print(f"{mode:9s} img/s: {rates}  ({wall})\n{'':9s} cpu-s per 1k images: {costs}  (speed from CPU cost: {cpu})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
