"""The cache reader against an earlier datapipe, side by side: interleaved rounds, ratios per round.

Each measurement is a fresh process (``PYTHONPATH`` picks the datapipe it imports), so the two
versions never share a page table, a thread pool or an allocator; within a round the order of the
sides alternates, and the figure is the median over rounds of new / old.

* ``uint8``: DeviceLoader(device="cpu", output="uint8"): whole uint8 batches gathered from the cache;
* ``train224``: DeviceLoader(device="cpu", augment=augment.train(224)): each sample's random crop
  resized and normalised on the CPU (the CPU train preset).

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

    ds = datapipe.StreamingDataset(cache, batch_size=batch, seed=0)
    if mode == "uint8":
        loader = datapipe.DeviceLoader(ds, device="cpu", output="uint8", num_workers=workers)
    else:
        loader = datapipe.DeviceLoader(ds, device="cpu", augment=augment.train(224), num_workers=workers)
    n, spent, epoch = 0, 0.0, 0
    while spent < seconds:
        loader.set_epoch(epoch)
        t, k = time.perf_counter(), 0
        for images, _ in loader:
            k += int(images.shape[0])
        if epoch:  # epoch 0 warms the page cache, the maps and the buffers
            n, spent = n + k, spent + time.perf_counter() - t
        epoch += 1
    loader.close()
    print(json.dumps({"images_per_s": n / spent, "epochs": epoch - 1, "datapipe": str(Path(datapipe.__file__).parent),
                      "mapped": bool(getattr(ds.cache, "mapped", True)), "torch_threads": torch.get_num_threads()}))


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
    p.add_argument("--modes", default="uint8,train224")
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
    runs: dict[str, dict[str, list[float]]] = {m: {s: [] for s in sides} for m in modes}
    for r in range(args.rounds):
        for mode in modes:
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                runs[mode][side].append(measure(side, mode, args)["images_per_s"])
            line = "  ".join(f"{s} {runs[mode][s][-1]:8.0f}" for s in sides)
            print(f"round {r + 1}/{args.rounds} {mode:9s} img/s: {line}  new/old {runs[mode]['new'][-1] / runs[mode]['old'][-1]:.3f}",
                  flush=True)
    summary = {}
    print(f"\nmedians over {args.rounds} rounds ({args.workers} workers, batch {args.batch}, "
          f">= {args.seconds:g} s of whole epochs per process)")
    for mode in modes:
        ratios = {s: [a / b for a, b in zip(runs[mode][s], runs[mode]["old"], strict=True)] for s in sides if s != "old"}
        summary[mode] = {"images_per_s": {s: statistics.median(v) for s, v in runs[mode].items()},
                         "ratio_to_old": {s: statistics.median(v) for s, v in ratios.items()},
                         "ratios_per_round": ratios}
        rates = "  ".join(f"{s} {summary[mode]['images_per_s'][s]:.0f}" for s in sides)
        rel = "  ".join(f"{s}/old {summary[mode]['ratio_to_old'][s]:.3f}" for s in sides if s != "old")
        print(f"{mode:9s} img/s: {rates}   median of per-round ratios: {rel}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
