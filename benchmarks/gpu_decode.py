"""JPEG caches on a GPU machine: decode rates, host threads, and the DeviceLoader end to end.

For a cache built with ``--encoding jpeg`` (built here from sample photographs unless ``--cache``):

1. the stored samples decoded on the host with libjpeg-turbo (simplejpeg, GIL released): img/s on
   1 thread and on ``--workers`` threads;
2. the same samples decoded on the GPU in batches by each decoder the loader can use
   (:mod:`datapipe.gpu_decode`: ``nvidia-nvimgcodec-cu12`` as ``nvimgcodec``, torchvision's
   ``decode_jpeg(device="cuda")``), as the loader calls them: img/s, the host threads the process had
   while they ran, and the per-image difference to the host decode in uint8 levels (largest mean,
   99.9th percentile and max over the images; the GPU decoders' IDCT and upsampling are not
   libjpeg-turbo's: the difference is measured against the documented tolerance, not assumed);
3. ``DeviceLoader`` + ``augment.train(224)`` img/s into the GPU: from the JPEG cache on the GPU
   decode path (the one selected automatically, ``decode_path`` says which) and on the host decode
   path (``DATAPIPE_GPU_DECODE=0``: libjpeg-turbo in the reader threads, then crop and resize on the
   device), against the same from the raw cache of the same images;
4. the ``cuda``-marked tests of tests/test_gpu_decode.py (pytest), where tests/ is present; the
   script exits 1 when they fail.

    python benchmarks/gpu_decode.py [--cache JPEG_CACHE] [--images 4096] [--workers 16] [--out DIR]
    python benchmarks/gpu_decode.py --cpu-smoke     # tiny sizes, no GPU: checks the script itself

Writes gpu_decode.json into --out (default: $OUT, else ./gpu_decode_out) after every stage.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
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
from datapipe import augment, gpu_decode, samples  # noqa: E402


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


@contextlib.contextmanager
def decode_setting(value: str | None):
    """``DATAPIPE_GPU_DECODE`` set to ``value`` (unset for None) inside the block."""
    old = os.environ.get(gpu_decode.ENV)
    if value is None:
        os.environ.pop(gpu_decode.ENV, None)
    else:
        os.environ[gpu_decode.ENV] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(gpu_decode.ENV, None)
        else:
            os.environ[gpu_decode.ENV] = old


def difference(decoded: list, reference: list) -> dict:
    """Per image |GPU - host| in uint8 levels: the largest mean, 99.9th percentile and max over the images."""
    means, p999, top = [], [], []
    for d, r in zip(decoded, reference, strict=True):
        diff = np.abs(np.asarray(d, dtype=np.int16) - r.astype(np.int16)).ravel()
        means.append(float(diff.mean()))
        p999.append(float(np.quantile(diff, 0.999)))
        top.append(int(diff.max()))
    out = {"mean_abs_diff": max(means), "p999_abs_diff": max(p999), "max_abs_diff": max(top)}
    out["within_tolerance"] = out["mean_abs_diff"] <= gpu_decode.MEAN_TOL and out["p999_abs_diff"] <= gpu_decode.P999_TOL
    return out


def gpu_decoders(encoded: list, dev: torch.device, batch: int, host_threads: int) -> dict:
    """Each GPU decoder of datapipe.gpu_decode: img/s over the samples in batches on a side stream,
    the threads the process had, and the difference to the host decode (on up to 64 samples)."""
    results: dict = {}
    check = encoded[:64]
    reference = [samples.decode_jpeg(e.data, e.height, e.width, where=e.where) for e in check]
    data = [e.data for e in encoded]
    shapes = [(e.height, e.width) for e in encoded]
    wheres = [e.where for e in encoded]
    for name in gpu_decode.DECODERS:
        try:
            with decode_setting(name):  # an ArgumentError saying why when it cannot decode here
                decoder = gpu_decode.jpeg_decoder(dev, host_threads=host_threads)
            assert decoder is not None
            stream = torch.cuda.Stream(device=dev)

            def run(decoder: gpu_decode.GpuJpegDecoder = decoder, stream: torch.cuda.Stream = stream) -> float:
                t = time.perf_counter()
                for i in range(0, len(data), batch):
                    out = decoder.decode(data[i : i + batch], shapes[i : i + batch], wheres[i : i + batch], dev, stream)
                    with torch.cuda.stream(stream):
                        gpu_decode.pad_batch(out)  # as the loader does
                    stream.synchronize()  # the outputs of this batch may go
                return time.perf_counter() - t

            run()  # warm-up: the decoder's buffers and the allocator's pool
            secs, threads = _threads_used(run)
            first = decoder.decode(data[: len(check)], shapes[: len(check)], wheres[: len(check)], dev, stream)
            stream.synchronize()
            results[name] = {"images_per_s": len(data) / secs, "process_threads": threads,
                             "decoder_host_threads": decoder.host_threads,
                             **difference([x.cpu().numpy() for x in first], reference)}
        except Exception as exc:  # noqa: BLE001 - report which decoder is missing and why
            hint = "" if isinstance(exc, datapipe.errors.ArgumentError) else f" ({gpu_decode.INSTALL[name]})"
            results[name] = {"skipped": f"{type(exc).__name__}: {exc}{hint}"}
    return results


def loader_rate(cache: Path, dev: torch.device, workers: int, batch: int, epochs: int, gpu_decode_setting: str | None = None) -> dict:
    """img/s of DeviceLoader + train(224) into ``dev`` after a warm-up epoch, with ``DATAPIPE_GPU_DECODE``
    set to ``gpu_decode_setting`` (unset: the automatic choice)."""
    ds = datapipe.StreamingDataset(cache, batch_size=batch, shuffle=True, seed=0)
    with decode_setting(gpu_decode_setting):
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
                "decode_path": loader.decode_path, "wait_share": loader.stats().get("wait_share")}
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
    p.add_argument("--test-timeout", type=float, default=180.0, help="seconds the cuda-marked tests may take")
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
    # (the smoke run reports each decoder as skipped, with the reason: no CUDA here)
    report["gpu_decode"] = gpu_decoders(encoded, torch.device("cuda") if args.cpu_smoke else dev, args.batch,
                                        max(1, (os.cpu_count() or 1) // args.workers))
    save()
    report["loader"] = {}
    for enc, path in caches.items():
        if enc == "jpeg":  # the automatic choice (GPU decode where a decoder works), then the host decode
            report["loader"]["jpeg"] = loader_rate(path, dev, args.workers, args.batch, args.epochs)
            report["loader"]["jpeg_host_decode"] = loader_rate(path, dev, args.workers, args.batch, args.epochs, "0")
        else:
            report["loader"][enc] = loader_rate(path, dev, args.workers, args.batch, args.epochs)
        save()
    report["tests"] = cuda_tests(args.test_timeout)
    save()
    return 0 if report["tests"]["ok"] else 1


def cuda_tests(timeout: float = 180.0) -> dict:
    """The cuda-marked tests of tests/test_gpu_decode.py (skipped without a GPU), where tests/ is present;
    ``ok`` unless one fails (pytest's 5, nothing selected, is no failure), or they outrun ``timeout`` seconds."""
    tests = ROOT / "tests" / "test_gpu_decode.py"
    if not tests.exists():
        return {"skipped": "no tests/ beside this script", "ok": True}
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider", str(tests)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"ok": False, "why": f"timed out after {timeout:g} s", "tail": out.strip().splitlines()[-40:]}
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    ok = proc.returncode in (0, 5)
    return {"ok": ok, "returncode": proc.returncode, "seconds": time.perf_counter() - t,
            "summary": lines[-1] if lines else "", "tail": lines[-40:]}


if __name__ == "__main__":
    sys.exit(main())
