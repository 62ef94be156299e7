"""JPEG caches on a GPU machine: decode rates, host threads, and the DeviceLoader end to end.

For a cache built with ``--encoding jpeg`` (built here from sample photographs unless ``--cache``):

1. the stored samples decoded on the host with libjpeg-turbo (simplejpeg, GIL released): img/s on
   1 thread and on ``--workers`` threads;
2. the same samples decoded on the GPU in batches, with every decoder installed of
   ``nvidia-nvimgcodec-cu12`` (``nvimgcodec``) and torchvision's ``decode_jpeg(device="cuda")``:
   img/s, the host threads they used, and the largest difference to the host decode (the GPU
   decoders' IDCT and upsampling are not libjpeg-turbo's: the difference is reported, not assumed);
3. ``DeviceLoader`` + ``augment.train(224)`` img/s into the GPU from the JPEG cache (host decode for
   each crop in the reader threads, crop, resize on the device) against the same from the raw cache
   of the same images.

    python benchmarks/gpu_decode.py [--cache JPEG_CACHE] [--images 4096] [--workers 16] [--out DIR]
    python benchmarks/gpu_decode.py --cpu-smoke     # tiny sizes, no GPU: checks the script itself

Writes gpu_decode.json into --out (default: $OUT, else ./gpu_decode_out) after every stage.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("datapipe") is None:  # a checkout, not installed
    sys.path.insert(0, str(ROOT))

import datapipe  # noqa: E402
from datapipe import augment, samples  # noqa: E402


def stored(cache: datapipe.Cache, n: int) -> list:
    """The first ``n`` stored JPEG samples of ``cache`` (bytes, height, width)."""
    idx = np.arange(min(n, len(cache)))
    labels = np.empty(len(idx), np.int64)
    return cache.read_encoded(idx, labels)


def host_decode(encoded: list, threads: int) -> dict:
    """img/s of libjpeg-turbo decoding every sample once, split over ``threads`` threads."""
    def work(part: list) -> None:
        for e in part:
            samples.decode_jpeg(e.data, e.height, e.width, where=e.where)

    parts = [encoded[i::threads] for i in range(threads)]
    work(encoded[: min(32, len(encoded))])  # warm-up
    t = time.perf_counter()
    pool = [threading.Thread(target=work, args=(p,)) for p in parts]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return {"threads": threads, "images_per_s": len(encoded) / (time.perf_counter() - t)}


def _threads_used(fn) -> tuple[object, int]:
    """``fn()`` and the most threads this process had while it ran (GPU decoders start their own)."""
    peak = [threading.active_count(), len(os.listdir("/proc/self/task"))]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[1] = max(peak[1], len(os.listdir("/proc/self/task")))
            time.sleep(0.005)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    try:
        out = fn()
    finally:
        done.set()
        w.join()
    return out, peak[1] - 1  # less the watcher


def gpu_decoders(encoded: list, dev: torch.device, batch: int) -> dict:
    """Each installed GPU JPEG decoder: img/s over the samples in batches, threads, difference to the host."""
    results: dict = {}
    reference = [samples.decode_jpeg(e.data, e.height, e.width, where=e.where) for e in encoded[:16]]
    blobs = [bytes(e.data) for e in encoded]

    def compare(decoded: list) -> float:
        diffs = [np.abs(np.asarray(d, dtype=np.int16) - r.astype(np.int16)).mean() for d, r in zip(decoded, reference, strict=False)]
        return float(max(diffs))

    try:
        from nvidia import nvimgcodec

        decoder = nvimgcodec.Decoder()

        def run_nv() -> float:
            t = time.perf_counter()
            for i in range(0, len(blobs), batch):
                decoder.decode(blobs[i : i + batch])
            torch.cuda.synchronize(dev)
            return time.perf_counter() - t

        run_nv()
        secs, threads = _threads_used(run_nv)
        first = [torch.as_tensor(x, device=dev).cpu().numpy() for x in decoder.decode(blobs[:16])]
        results["nvimgcodec"] = {"images_per_s": len(blobs) / secs, "process_threads": threads,
                                 "mean_abs_diff_to_host": compare(first)}
    except Exception as exc:  # noqa: BLE001 - report which decoder is missing and why
        results["nvimgcodec"] = {"skipped": f"{type(exc).__name__}: {exc} (pip install nvidia-nvimgcodec-cu12)"}
    try:
        from torchvision.io import decode_jpeg

        tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]

        def run_tv() -> float:
            t = time.perf_counter()
            for i in range(0, len(tensors), batch):
                decode_jpeg(tensors[i : i + batch], device=dev)
            torch.cuda.synchronize(dev)
            return time.perf_counter() - t

        run_tv()
        secs, threads = _threads_used(run_tv)
        first = [x.permute(1, 2, 0).cpu().numpy() for x in decode_jpeg(tensors[:16], device=dev)]
        results["torchvision"] = {"images_per_s": len(blobs) / secs, "process_threads": threads,
                                  "mean_abs_diff_to_host": compare(first)}
    except Exception as exc:  # noqa: BLE001
        results["torchvision"] = {"skipped": f"{type(exc).__name__}: {exc} (pip install torchvision)"}
    return results


def loader_rate(cache: Path, dev: torch.device, workers: int, batch: int, epochs: int) -> dict:
    """img/s of DeviceLoader + train(224) into ``dev`` after a warm-up epoch."""
    ds = datapipe.StreamingDataset(cache, batch_size=batch, shuffle=True, seed=0)
    loader = datapipe.DeviceLoader(ds, device=dev, augment=augment.train(224 if dev.type == "cuda" else 32),
                                   num_workers=workers, prefetch=4)
    try:
        n, t = 0, 0.0
        for epoch in range(epochs + 1):
            loader.set_epoch(epoch)
            if epoch == 1:
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                n, t = 0, time.perf_counter()
            for images, _ in loader:
                n += images.shape[0]
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return {"images_per_s": n / (time.perf_counter() - t), "reader_threads": workers,
                "wait_share": loader.stats().get("wait_share")}
    finally:
        loader.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=None, help="a cache built with --encoding jpeg (default: build one)")
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--side", type=int, default=256)
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_decode_out")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks that the script runs")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.images, args.side, args.batch, args.workers, args.epochs = 96, 64, 16, 2, 1
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu_smoke else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                    "torch": torch.__version__, "host_cpus": os.cpu_count()}

    def save() -> None:
        (out / "gpu_decode.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1), flush=True)

    caches: dict[str, Path] = {}
    if args.cache:
        caches["jpeg"] = Path(args.cache)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="gpu_decode-"))
        t = time.perf_counter()
        src = datapipe.make_sample_dataset(tmp / "src", images=args.images, classes=10, workers=args.workers)
        have_dask = importlib.util.find_spec("distributed") is not None and not args.cpu_smoke
        cluster = datapipe.Cluster(workers=args.workers) if have_dask else datapipe.Cluster(scheduler="sync")
        for enc in ("jpeg", "raw"):
            datapipe.build(src, tmp / enc, size=args.side, encoding=enc, progress=False, cluster=cluster)
            caches[enc] = tmp / enc
        report["build_s"] = time.perf_counter() - t
    cache = datapipe.open(caches["jpeg"])
    report["cache"] = {"samples": len(cache), "encoding": cache.encoding,
                       "mean_bytes_per_sample": float(cache.sample_nbytes.mean())}
    encoded = stored(cache, args.images)
    report["host_decode"] = [host_decode(encoded, 1), host_decode(encoded, args.workers)]
    save()
    if dev.type == "cuda":
        report["gpu_decode"] = gpu_decoders(encoded, dev, args.batch)
        save()
    report["loader"] = {enc: loader_rate(path, dev, args.workers, args.batch, args.epochs) for enc, path in caches.items()}
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
