"""Cache formats: what a JPEG cache and an aspect-preserving cache cost and save, against the square raw cache.

Measured side by side in one run (the machine is shared, so only ratios from the same run count):

1. bytes per sample of a JPEG cache (``--quality``, default 90, 4:2:0) against the raw cache at the
   same ``--size`` (fit crop) — goal <= 1/5;
2. PSNR of the JPEG cache's samples against the raw cache's, both read with ``datapipe.open(path)[i]``
   — goal >= 35 dB (pooled over every sample; the worst sample and the 5th percentile are reported too);
3. the CPU loader (DeviceLoader(device="cpu") + augment.train(224), 2 reader threads) on the JPEG
   cache against the torch DataLoader with the Pillow ImageFolder pipeline (2 workers) on the source
   JPEGs (:class:`datapipe.bench.peers.DataLoaderPeer`) — goal >= 4x;
4. the same JPEG loader against 2 x the one-thread libjpeg-turbo (simplejpeg) decode rate of the
   cache's own stored samples — goal >= 80 %;
5. the raw cache of fit short (aspect kept) against the square raw cache (fit crop), both with
   train(224) on the CPU loader — goal >= 80 %;
6. build images/s per core, JPEG encoding against raw (same source, same Dask workers) — goal >= 75 %.

Loader passes are ``--epochs`` epochs each (default 2), timed with the harness's :func:`datapipe.bench.timing.timed_pass`
and separated by :func:`~datapipe.bench.timing.settle`; a warm-up round is excluded; the systems run
in interleaved rounds and each ratio is computed per round, then its median is reported. Builds
alternate raw, JPEG, raw, JPEG … the same way.

    python benchmarks/formats_bench.py [--source DIR] [--images 1000] [--rounds 5] [--epochs 2] [--build-rounds 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

GOALS = {  # metric: (goal, "min" when the figure must be at least the goal, "max" when at most)
    "jpeg_bytes_ratio": (1 / 5, "max"),
    "psnr_db": (35.0, "min"),
    "jpeg_loader_vs_dataloader": (4.0, "min"),
    "jpeg_loader_vs_2x_decode": (0.80, "min"),
    "short_vs_crop_loader": (0.80, "min"),
    "jpeg_vs_raw_build_per_core": (0.75, "min"),
}


# ----------------------------------------------------------------------------- data


def subset(source: Path, out: Path, images: int) -> Path:
    from datapipe.bench.sample import subset_folder

    return subset_folder(source, out, images)


def build(src: Path, out: Path, *, size: int, fit: str, encoding: str, quality: int | None, workers: int,
          shard_size: int) -> dict:
    """One build from scratch; its images/s (shard phase, cluster start-up excluded) and bytes per sample."""
    import datapipe

    if out.exists():
        shutil.rmtree(out)
    t0 = time.perf_counter()
    report = datapipe.build(src, out, size=size, fit=fit, encoding=encoding, quality=quality, shard_size=shard_size,
                            cluster=datapipe.Cluster(workers=workers), progress=False)
    return {"images_per_s": report.images_per_second, "images_per_s_per_core": report.images_per_second / workers,
            "wall_s": time.perf_counter() - t0, "samples": report.num_samples, "bytes_per_sample": report.bytes_per_sample}


# ----------------------------------------------------------------------------- quality


def psnr_of(mse: float) -> float:
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def compare(jpeg_path: Path, raw_path: Path) -> dict:
    """Bytes per stored sample and PSNR of every JPEG sample against the raw one, read with ``datapipe.open(path)[i]``."""
    import datapipe

    jpeg, raw = datapipe.open(jpeg_path), datapipe.open(raw_path)
    if len(jpeg) != len(raw):
        raise SystemExit(f"{jpeg_path} holds {len(jpeg)} samples but {raw_path} holds {len(raw)}: not the same source")
    mses = []
    for i in range(len(jpeg)):
        (a, la), (b, lb) = jpeg[i], raw[i]
        if la != lb or a.shape != b.shape:
            raise SystemExit(f"sample {i} differs in label or shape between {jpeg_path} and {raw_path}")
        mses.append(float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))
    per_image = np.array([psnr_of(m) for m in mses])
    return {"samples": len(jpeg), "psnr_db": psnr_of(float(np.mean(mses))), "psnr_db_min": float(per_image.min()),
            "psnr_db_p5": float(np.percentile(per_image, 5)), "psnr_db_median": float(np.median(per_image)),
            "jpeg_stored_bytes_per_sample": float(jpeg.sample_nbytes.mean()),
            "raw_stored_bytes_per_sample": float(raw.sample_nbytes.mean())}


# ----------------------------------------------------------------------------- throughput


class DecodeAll:
    """Every stored JPEG sample of a cache decoded once with simplejpeg in this one thread, as a
    "loader" (one pass = one epoch, in batches of ``batch``) so that the harness's timed_pass times it."""

    def __init__(self, cache_path: Path, batch: int = 256) -> None:
        import datapipe

        cache = datapipe.open(cache_path)
        labels = np.empty(len(cache), np.int64)
        self.samples = [bytes(s.data) for s in cache.read_encoded(np.arange(len(cache)), labels)]
        self.batch = batch

    def __iter__(self) -> Iterator[tuple[np.ndarray]]:
        import simplejpeg

        for a in range(0, len(self.samples), self.batch):
            for data in self.samples[a : a + self.batch]:
                simplejpeg.decode_jpeg(data, colorspace="RGB")
            yield (np.empty(len(self.samples[a : a + self.batch])),)


def cpu_loader(cache_path: Path, *, batch_size: int, workers: int, crop: int) -> Iterable:
    import datapipe

    ds = datapipe.StreamingDataset(datapipe.open(cache_path), batch_size=batch_size, shuffle=True, seed=0)
    return datapipe.DeviceLoader(ds, device="cpu", augment=datapipe.augment.train(crop), num_workers=workers)


def dataloader_peer(src: Path, work: Path, *, batch_size: int, workers: int) -> Iterable:
    from datapipe.bench.peers import DataLoaderPeer

    peer = DataLoaderPeer()
    peer.prepare(src, work)
    return peer.loader(src, work, batch_size=batch_size, workers=workers)


class Epochs:
    """``epochs`` epochs of a loader as one pass, so that a pass measures the steady state more than
    an epoch's start (the first batch's latency) on a small subset."""

    def __init__(self, loader: Iterable, epochs: int) -> None:
        self.loader, self.epochs = loader, epochs

    def __iter__(self) -> Iterator:
        for _ in range(self.epochs):
            yield from self.loader


def rounds(systems: dict[str, Iterable], repeats: int, log: Callable[[str], None]) -> dict[str, list[float]]:
    """A warm-up round (in reverse order, so that the DataLoader's workers fork before the others
    warm up, as the harness does), then ``repeats`` rounds timing each system once, in turn."""
    from datapipe.bench.timing import settle, timed_pass

    rates: dict[str, list[float]] = {name: [] for name in systems}
    for rnd in range(repeats + 1):
        order = list(systems)[::-1] if rnd == 0 else list(systems)
        for name in order:
            n, wall, _ = timed_pass(systems[name])
            if rnd:
                rates[name].append(n / wall)
            settle()
        if rnd:
            log("round " + str(rnd) + ": " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()) + " img/s")
    return rates


def ratios(a: list[float], b: list[float], scale: float = 1.0) -> list[float]:
    return [x / (scale * y) for x, y in zip(a, b, strict=True)]


# ----------------------------------------------------------------------------- report


def table(result: dict) -> str:
    rows = [("metric", "figure", "goal", "met", "per round")]
    names = {
        "jpeg_bytes_ratio": "1. JPEG / raw bytes per sample (on disk)",
        "psnr_db": "2. PSNR JPEG vs raw samples, dB (pooled)",
        "jpeg_loader_vs_dataloader": "3. JPEG CPU loader / DataLoader+Pillow",
        "jpeg_loader_vs_2x_decode": "4. JPEG CPU loader / (2 x 1-thread decode)",
        "short_vs_crop_loader": "5. raw fit short / raw fit crop loader",
        "jpeg_vs_raw_build_per_core": "6. build per core, JPEG / raw",
    }
    for key, label in names.items():
        m = result["metrics"][key]
        goal, kind = GOALS[key]
        fmt = (lambda v: f"{v:.1f}") if key == "psnr_db" else (lambda v: f"{v:.3f}")
        rows.append((label, fmt(m["value"]), ("<= " if kind == "max" else ">= ") + fmt(goal), "yes" if m["met"] else "NO",
                     " ".join(fmt(v) for v in m.get("per_round", [])) or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    rates = result["rates"]
    lines.append("")
    lines.append("medians (img/s): " + ", ".join(f"{k} {statistics.median(v):,.0f}" for k, v in rates.items()))
    lines.append("build (img/s per core, medians): " + ", ".join(
        f"{k} {statistics.median(r['images_per_s_per_core'] for r in v):,.0f}" for k, v in result["builds"].items()))
    q = result["quality"]
    lines.append(f"stored bytes per sample: JPEG {q['jpeg_stored_bytes_per_sample']:,.0f}, raw {q['raw_stored_bytes_per_sample']:,.0f}; "
                 f"PSNR per sample: median {q['psnr_db_median']:.1f}, 5th percentile {q['psnr_db_p5']:.1f}, min {q['psnr_db_min']:.1f} dB")
    return "\n".join(lines)


def metric(key: str, per_round: list[float] | None = None, value: float | None = None) -> dict:
    v = statistics.median(per_round) if per_round else value
    assert v is not None
    goal, kind = GOALS[key]
    out: dict[str, Any] = {"value": v, "goal": goal, "met": v <= goal if kind == "max" else v >= goal}
    if per_round:
        out["per_round"] = per_round
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Without --source the default folder is used, or a sample is generated (datapipe sample).")
    p.add_argument("--source", type=Path, default=Path("/tmp/benchdata"), help="image folder in class folders (default /tmp/benchdata)")
    p.add_argument("--images", type=int, default=1000, help="images of the source to use, spread over its listing (default 1000)")
    p.add_argument("--size", type=int, default=256, help="cache --size (default 256)")
    p.add_argument("--quality", type=int, default=None, help="JPEG --quality (default: the build's, 90)")
    p.add_argument("--crop", type=int, default=224, help="augment.train crop (default 224)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="loader reader threads / DataLoader workers / Dask workers (default 2)")
    p.add_argument("--shard-size", type=int, default=125, help="samples per shard, the same for every cache (default 125)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per timed loader pass (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="measured loader rounds after a warm-up round (default 5)")
    p.add_argument("--build-rounds", type=int, default=3, help="measured raw/JPEG build pairs after a warm-up pair (default 3)")
    p.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one, removed at the end)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="formats-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        return _run(args, work, log)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path, log: Callable[[str], None]) -> dict:
    from datapipe.bench.harness import describe_machine

    source = args.source
    if not source.is_dir():
        from datapipe.bench.sample import make_sample_dataset

        log(f"{source} not found: generating {args.images} sample images there")
        make_sample_dataset(source, images=args.images, workers=args.workers)
    src = subset(source, work / "src", args.images)
    common = {"size": args.size, "quality": args.quality, "workers": args.workers, "shard_size": args.shard_size}
    paths = {"raw": work / "raw-crop", "jpeg": work / "jpeg-crop", "short": work / "raw-short"}

    # 6. builds: raw, JPEG alternating (pair 0 is the warm-up); the last builds are the caches measured below.
    builds: dict[str, list[dict]] = {"raw": [], "jpeg": []}
    for rnd in range(args.build_rounds + 1):
        r = build(src, paths["raw"], fit="crop", encoding="raw", **common)
        j = build(src, paths["jpeg"], fit="crop", encoding="jpeg", **common)
        log(f"build pair {rnd}{' (warm-up)' if rnd == 0 else ''}: raw {r['images_per_s_per_core']:,.0f}, "
            f"JPEG {j['images_per_s_per_core']:,.0f} img/s per core")
        if rnd:
            builds["raw"].append(r)
            builds["jpeg"].append(j)
    build(src, paths["short"], fit="short", encoding="raw", **common)

    # 1, 2. size and quality.
    quality = compare(paths["jpeg"], paths["raw"])
    bytes_ratio = builds["jpeg"][-1]["bytes_per_sample"] / builds["raw"][-1]["bytes_per_sample"]
    log(f"bytes per sample on disk: JPEG {builds['jpeg'][-1]['bytes_per_sample']:,.0f}, raw {builds['raw'][-1]['bytes_per_sample']:,.0f}; "
        f"PSNR {quality['psnr_db']:.1f} dB")

    # 3, 4, 5. loaders, interleaved.
    lk = {"batch_size": args.batch_size, "workers": args.workers, "crop": args.crop}
    systems: dict[str, Iterable] = {
        "jpeg_loader": cpu_loader(paths["jpeg"], **lk),
        "dataloader": dataloader_peer(src, work / "peers", batch_size=args.batch_size, workers=args.workers),
        "decode_1thread": DecodeAll(paths["jpeg"], args.batch_size),
        "raw_crop_loader": cpu_loader(paths["raw"], **lk),
        "raw_short_loader": cpu_loader(paths["short"], **lk),
    }
    rates = rounds({name: Epochs(loader, args.epochs) for name, loader in systems.items()}, args.rounds, log)
    metrics = {
        "jpeg_bytes_ratio": metric("jpeg_bytes_ratio", value=bytes_ratio),
        "psnr_db": metric("psnr_db", value=quality["psnr_db"]),
        "jpeg_loader_vs_dataloader": metric("jpeg_loader_vs_dataloader", ratios(rates["jpeg_loader"], rates["dataloader"])),
        "jpeg_loader_vs_2x_decode": metric("jpeg_loader_vs_2x_decode", ratios(rates["jpeg_loader"], rates["decode_1thread"], 2.0)),
        "short_vs_crop_loader": metric("short_vs_crop_loader", ratios(rates["raw_short_loader"], rates["raw_crop_loader"])),
        "jpeg_vs_raw_build_per_core": metric("jpeg_vs_raw_build_per_core", ratios(
            [b["images_per_s_per_core"] for b in builds["jpeg"]], [b["images_per_s_per_core"] for b in builds["raw"]])),
    }
    result = {"machine": describe_machine(), "config": {**vars(args), "source": str(args.source), "work": str(work),
                                                         "json": str(args.json) if args.json else None, "images_used": quality["samples"]},
              "metrics": metrics, "rates": rates, "builds": builds, "quality": quality}
    print()
    print(table(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
