"""The GPU path, checked and measured on a machine with CUDA, in one script (under 8 minutes on a
16-core H200 machine):

1. parity: the device augmentation (``augment.train``/``eval`` on CUDA tensors, fp32, fp16 and bf16
   outputs, TF32 off and on) against the float reference torchvision computes —
   ``F.interpolate(crop, bilinear, antialias=True, align_corners=False)`` — and against the CPU
   path with the same parameters, on photographs and noise; exits 1 when it fails;
2. the H2D copy from the DeviceLoader's pinned ring (GB/s);
3. DeviceLoader images/s into the GPU: raw uint8 batches, and the train(224) preset's float batches;
4. the device crop-and-resize cost per image (goal <= 5 µs on an H200), and the whole preset's;
5. a ResNet-50 step (AMP bf16, channels_last) fed by datapipe against synthetic data (goal <= 2%
   slower);
6. the repository's ``-m cuda`` tests (pytest), where tests/ is present; exits 1 when they fail.

    python benchmarks/gpu_check.py [--cache CACHE] [--images 4096] [--workers 16] [--out DIR]
    python benchmarks/gpu_check.py --cpu-smoke      # tiny sizes on the CPU: checks the script itself

Writes gpu_check.json into --out (default: $OUT, else ./gpu_check_out), after every stage, so a run
cut short still reports what it measured. Runs from a checkout without installing datapipe. Needs
no torchvision (ResNet-50 is defined below), no Dask (a missing Dask builds in this process) and no
Kornia (without it the colour-jitter checks are skipped and reported so): a machine with torch and
CUDA alone runs it (the build then runs in this process and decodes with Pillow), e.g.::

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("datapipe") is None:  # a checkout, not installed
    sys.path.insert(0, str(ROOT))

import datapipe  # noqa: E402
from datapipe import augment  # noqa: E402
from datapipe.testing import crop_reference  # noqa: E402

MEAN_TOL, P99_TOL = 0.003, 0.01  # [0, 1] units, as tests/test_gpu_parity.py
FLOAT_MAX = 1e-4  # the device path against the float reference, fp32 matmuls
TF32_MAX = 0.006  # the same with TF32 matmuls (10-bit weights and intermediate; the mean stays <= MEAN_TOL)
# Presets below take path="device": what "auto" is on CUDA, and the same code on CPU tensors (--cpu-smoke).
ROUNDING = {torch.float32: 0.0, torch.float16: 0.0005, torch.bfloat16: 0.0025}  # output dtype's rounding, [0, 1] units


# ----------------------------------------------------------------------------- model


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet50(num_classes: int = 1000) -> nn.Module:
    """torchvision's ResNet-50 architecture (v1.5: the stride on the 3x3), without torchvision."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- helpers


class Timer:
    """Wall time of device work: synchronises the device before reading the clock."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)

    def __call__(self, fn, reps: int, warmup: int = 2) -> float:
        """Median seconds per call of fn over reps calls."""
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            self.sync()
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]


def textured(n: int, size: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, size, size, 3]: half windows of scikit-image's photographs, half noise."""
    import numpy as np

    from datapipe.bench.sample import _load_photos

    rng = np.random.default_rng(seed)
    pics = [p for p in _load_photos() if min(p.shape[:2]) >= size]
    out = []
    for i in range(n - n // 2):
        p = pics[i % len(pics)]
        y, x = int(rng.integers(0, p.shape[0] - size + 1)), int(rng.integers(0, p.shape[1] - size + 1))
        out.append(torch.from_numpy(np.ascontiguousarray(p[y : y + size, x : x + size])))
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.stack(out), torch.randint(0, 256, (n // 2, size, size, 3), generator=g, dtype=torch.uint8)])


def mixed_crops(n: int, side: int) -> torch.Tensor:
    """Boxes of every kind: full, tiny (upscaled), slivers of extreme aspect, 1x1, odd offsets."""
    boxes = [[0, 0, side, side], [3, 5, side // 12, side // 7], [0, 0, side, 9], [side // 3, 0, 6, side],
             [17, 29, 1, 1], [1, 2, side - 3, side - 5], [side // 5, side // 4, side // 2, side // 2 - 1]]
    return torch.tensor([boxes[i % len(boxes)] for i in range(n)], dtype=torch.int64)


def unit(images: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(augment.IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
    std = torch.tensor(augment.IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    return images.detach().to("cpu", torch.float64) * std + mean


def stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a - b).abs().flatten()
    sample = d[:: max(1, d.numel() // 2_000_000)]
    return {"mean": float(d.mean()), "p99": float(torch.quantile(sample, 0.99)), "max": float(d.max())}


# ----------------------------------------------------------------------------- stages


def parity(dev: torch.device, n: int, side: int, sizes: tuple[int, ...]) -> tuple[dict, list[str]]:
    """Device path vs the float reference and vs the CPU path; returns (figures, failures)."""
    res: dict = {}
    failures: list[str] = []
    have_kornia = importlib.util.find_spec("kornia") is not None
    res["kornia"] = have_kornia
    images = textured(n, side)
    on_dev = images.to(dev)
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    for size in sizes:
        params = augment.train(size).sample(n, side, side, seed=size)
        k = max(1, n // 4)
        params["crops"][:k] = mixed_crops(k, side)  # upscales, slivers and 1x1 boxes in the same batch
        ref = crop_reference(on_dev, params["crops"], params["flip"], size)
        for jitter in (None, 0.4) if have_kornia else (None,):
            p = dict(params)
            if jitter:
                drawn = augment.train(size, color_jitter=jitter).sample(n, side, side, seed=1)
                p["jitter"], p["jitter_order"] = drawn["jitter"], drawn["jitter_order"]
            cpu32 = unit(augment.train(size, path="uint8", color_jitter=jitter)(images, params=p))
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for tf32 in (False, True) if dev.type == "cuda" else (False,):
                    torch.backends.cuda.matmul.allow_tf32 = tf32
                    try:
                        aug = augment.train(size, dtype=dtype, channels_last=True, color_jitter=jitter, path="device")
                        out = aug(on_dev, params=p)
                    finally:
                        torch.backends.cuda.matmul.allow_tf32 = old_tf32
                    name = f"{size}/{str(dtype).split('.')[-1]}/{'tf32' if tf32 else 'fp32'}/{'jitter' if jitter else 'plain'}"
                    got = unit(out)
                    row = {"between_paths": stats(got, cpu32)}
                    ok = (out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
                          and row["between_paths"]["mean"] <= MEAN_TOL
                          and row["between_paths"]["p99"] <= (2 if jitter else 1) * P99_TOL + ROUNDING[dtype])
                    if not jitter:
                        row["vs_reference"] = stats(got, ref)
                        limit = (TF32_MAX if tf32 else FLOAT_MAX) + ROUNDING[dtype]
                        ok = ok and row["vs_reference"]["max"] <= limit and row["vs_reference"]["mean"] <= MEAN_TOL
                    row["ok"] = bool(ok)
                    res[name] = row
                    if not ok:
                        failures.append(name)
    # eval: a center crop (a copy) and, for samples smaller than the output, the resize
    for s in (side, side // 2):
        small = images[:, :s, :s].contiguous()
        got = unit(augment.eval(min(224, side - 8), path="device")(small.to(dev)))
        cpu = unit(augment.eval(min(224, side - 8), path="uint8")(small))
        row = {"between_paths": stats(got, cpu)}
        row["ok"] = bool(row["between_paths"]["max"] <= FLOAT_MAX)
        res[f"eval/{s}"] = row
        if not row["ok"]:
            failures.append(f"eval/{s}")
    return res, failures


def h2d_from_ring(loader, dev: torch.device, reps: int) -> float:
    """GB/s of copies from the loader's pinned host buffers into one device buffer, on a side stream."""
    slots = loader._slots
    if dev.type != "cuda":
        dst = torch.empty_like(slots[0].images)
        copy = lambda: [dst.copy_(s.images) for s in slots]  # noqa: E731
        return len(slots) * slots[0].images.numel() / Timer(dev)(copy, reps) / 1e9
    assert all(s.images.is_pinned() for s in slots), "the ring's host buffers are not pinned"
    dst = torch.empty(slots[0].images.shape, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)

    def copy():
        with torch.cuda.stream(stream):
            for s in slots:
                dst.copy_(s.images, non_blocking=True)
        stream.synchronize()

    return len(slots) * slots[0].images.numel() / Timer(dev)(copy, reps) / 1e9


def loader_rate(cache, dev, args, *, epochs: int, **kwargs) -> dict:
    """Images/s of a DeviceLoader into ``dev`` after a warm-up epoch (the device synchronised at both ends)."""
    ds = datapipe.StreamingDataset(cache, batch_size=args.batch, shuffle=True, seed=0)
    loader = datapipe.DeviceLoader(ds, device=dev, num_workers=args.workers, prefetch=4, **kwargs)
    timer = Timer(dev)
    try:
        n, t = 0, 0.0
        for epoch in range(epochs + 1):
            loader.set_epoch(epoch)
            if epoch == 1:
                timer.sync()
                n, t = 0, time.perf_counter()
            for images, _labels in loader:
                n += images.shape[0]
        timer.sync()
        return {"images_per_s": n / (time.perf_counter() - t), "wait_share": loader.stats().get("wait_share")}
    finally:
        loader.close()


def resize_cost(dev: torch.device, batch: int, side: int, size: int, reps: int) -> dict:
    """µs per image of crop_and_resize on a [batch, side, side, 3] uint8 batch, and of the whole preset."""
    images = torch.randint(0, 256, (batch, side, side, 3), dtype=torch.uint8, device=dev)
    aug = augment.train(size, channels_last=True, path="device")
    params = aug.sample(batch, side, side, seed=0)
    timer = Timer(dev)
    res = {}
    old = torch.backends.cuda.matmul.allow_tf32
    for tf32 in (False, True) if dev.type == "cuda" else (False,):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            key = "tf32" if tf32 else "fp32"
            sec = timer(lambda: augment.crop_and_resize(images, params["crops"], size, flip=params["flip"]), reps)
            res[f"crop_and_resize_us_per_image_{key}"] = sec / batch * 1e6
            sec = timer(lambda: aug(images, params=params), reps)
            res[f"train_preset_us_per_image_{key}"] = sec / batch * 1e6
            sec = timer(lambda: aug(images, seed=1), reps)  # parameters drawn per call, as the loader does
            res[f"train_preset_with_sampling_us_per_image_{key}"] = sec / batch * 1e6
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    return res


def sync_free(dev: torch.device, batch: int, side: int, size: int) -> dict:
    """Whether each device preset queues its work without making the host wait for the device: a call
    that synchronises (a tensor made from Python numbers on the device, a blocking copy, reading a
    device value) would hold the loader, at every batch, until the training step before has finished.
    Each preset runs once to warm up (its constants are made then), then under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises at a synchronising call."""
    if dev.type != "cuda":
        return {"checked": False, "why": "no CUDA: nothing to wait for"}
    images = torch.randint(0, 256, (batch, side, side, 3), dtype=torch.uint8, device=dev)
    presets = {"train": augment.train(size, channels_last=True, path="device"),
               "train_bf16": augment.train(size, channels_last=True, dtype=torch.bfloat16, path="device"),
               "eval": augment.eval(size, path="device"), "convert": augment.convert()}
    if importlib.util.find_spec("kornia") is not None:
        presets["train_jitter"] = augment.train(size, channels_last=True, color_jitter=0.4, path="device")
    res: dict = {"checked": True}
    for name, aug in presets.items():
        aug(images, seed=0)
        torch.cuda.synchronize(dev)
        torch.cuda.set_sync_debug_mode("error")
        try:
            aug(images, seed=1)
            res[name] = "queued without waiting"
        except RuntimeError as exc:
            res[name] = f"synchronises: {' '.join(str(exc).split())[:300]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize(dev)
    res["ok"] = all(v == "queued without waiting" for k, v in res.items() if k not in ("checked",))
    return res


def resnet_steps(cache, dev, args, size: int) -> dict:
    """Images/s of ResNet-50 training steps on synthetic data and fed by datapipe, and the slowdown."""
    model = resnet50().to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    timer = Timer(dev)

    def step(images, labels):
        with amp:
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    synth = torch.randn(args.batch, 3, size, size, device=dev).contiguous(memory_format=torch.channels_last)
    synth_labels = torch.randint(0, 1000, (args.batch,), device=dev)
    ds = datapipe.StreamingDataset(cache, batch_size=args.batch, shuffle=True, seed=0)
    loader = datapipe.DeviceLoader(ds, device=dev, num_workers=args.workers, prefetch=4,
                                   augment=augment.train(size, channels_last=True, path="device"))

    def fed():
        epoch = 100
        while True:
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    it = fed()
    try:
        rates = {"synthetic": [], "datapipe": []}
        for _ in range(args.warmup):
            step(synth, synth_labels)
            step(*next(it))
        for _ in range(2):  # interleaved rounds: the ratio is measured side by side
            timer.sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(synth, synth_labels)
            timer.sync()
            rates["synthetic"].append(args.steps * args.batch / (time.perf_counter() - t))
            loader.meter.reset()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(*next(it))
            timer.sync()
            rates["datapipe"].append(args.steps * args.batch / (time.perf_counter() - t))
        synthetic, real = max(rates["synthetic"]), max(rates["datapipe"])
        return {"synthetic_images_per_s": synthetic, "datapipe_images_per_s": real, "rounds": rates,
                "step_ms_synthetic": args.batch / synthetic * 1e3, "step_ms_datapipe": args.batch / real * 1e3,
                "slowdown": 1 - real / synthetic, "wait_share": loader.stats().get("wait_share"), "goal_slowdown": 0.02}
    finally:
        loader.close()


def cuda_tests(timeout: float) -> dict:
    """The repository's ``cuda``-marked tests, where tests/ is present (skipped there without a GPU), but for
    tests/test_gpu_decode.py's, which benchmarks/gpu_decode.py runs."""
    tests = ROOT / "tests"
    files = sorted(str(p) for p in tests.glob("test_*.py")
                   if "mark.cuda" in p.read_text() and p.name != "test_gpu_decode.py") if tests.is_dir() else []
    if not files:
        return {"ran": False, "why": "no tests/ with cuda-marked tests here", "ok": True}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider", *files]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"")[-3000:] if isinstance(exc.stdout, bytes) else (exc.stdout or "")[-3000:]
        return {"ran": True, "ok": False, "why": f"timed out after {timeout:g} s", "tail": str(out)}
    tail = (proc.stdout + proc.stderr)[-3000:]
    return {"ran": True, "ok": proc.returncode in (0, 5), "returncode": proc.returncode,  # 5: nothing selected
            "summary": tail.strip().splitlines()[-1] if tail.strip() else "", "tail": tail}


def make_cache(args, dev) -> tuple[Path, dict]:
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check-"))
    t = time.perf_counter()
    workers = min(16, os.cpu_count() or 1)
    src = datapipe.make_sample_dataset(tmp / "src", images=args.images, classes=10, workers=workers)
    gen = time.perf_counter() - t
    t = time.perf_counter()
    have_dask = importlib.util.find_spec("distributed") is not None
    cluster = datapipe.Cluster(workers=workers) if have_dask and not args.cpu_smoke else datapipe.Cluster(scheduler="sync")
    datapipe.build(src, tmp / "cache", size=args.side, shard_size=64, progress=False, cluster=cluster)
    return tmp / "cache", {"images": args.images, "side": args.side, "generate_s": gen,
                           "build_s": time.perf_counter() - t, "scheduler": "sync" if cluster.serial else "dask"}


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=None, help="an existing cache (default: build one of sample photographs)")
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--side", type=int, default=256, help="side of the built cache's samples")
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=30, help="ResNet-50 steps per timed round")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU: checks that the script runs")
    p.add_argument("--skip-tests", action="store_true", help="do not run the cuda-marked tests")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.images, args.side, args.batch, args.steps, args.warmup = 48, 96, 4, 1, 1
        args.workers = min(args.workers, 2)
        dev, size, parity_n, loader_epochs, reps = torch.device("cpu"), 64, 8, 1, 2
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA GPU here; run it on a machine with one, or pass --cpu-smoke", file=sys.stderr)
            return 2
        dev, size, parity_n, loader_epochs, reps = torch.device("cuda"), 224, 64, 4, 20
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    res: dict = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu (smoke)",
                 "torch": torch.__version__, "cpus": os.cpu_count(), "workers": args.workers, "batch": args.batch,
                 "output_size": size, "stage_s": {}}
    failures: list[str] = []

    def save(stage: str, started: float) -> None:
        res["stage_s"][stage] = round(time.perf_counter() - started, 2)
        res["failures"], res["ok"] = failures, not failures
        (out / "gpu_check.json").write_text(json.dumps(res, indent=1))
        print(f"gpu_check: {stage} done ({res['stage_s'][stage]:.1f} s, {time.perf_counter() - t0:.0f} s in all)",
              flush=True)

    t = time.perf_counter()
    res["parity"], bad = parity(dev, parity_n, args.side if args.cpu_smoke else 256,
                                (size, size // 2) if not args.cpu_smoke else (size, 40))
    failures += [f"parity {b}" for b in bad]
    save("parity", t)

    t = time.perf_counter()
    res["resize"] = resize_cost(dev, args.batch, args.side if args.cpu_smoke else 256, size, reps)
    res["resize"]["goal_us_per_image"] = 5.0
    res["sync_free"] = sync_free(dev, args.batch, args.side if args.cpu_smoke else 256, size)
    save("resize", t)

    t = time.perf_counter()
    if args.cache:
        cache = Path(args.cache)
    else:
        cache, res["cache"] = make_cache(args, dev)
    save("cache", t)

    t = time.perf_counter()
    ds = datapipe.StreamingDataset(cache, batch_size=args.batch, shuffle=True, seed=0)
    ring = datapipe.DeviceLoader(ds, device=dev, num_workers=args.workers, prefetch=4, output="uint8")
    try:
        next(iter(ring))  # allocates the ring and starts the readers
        res["h2d_GBps_from_pinned_ring"] = h2d_from_ring(ring, dev, reps)
    finally:
        ring.close()
    save("h2d", t)

    t = time.perf_counter()
    res["deviceloader"] = {"uint8": loader_rate(cache, dev, args, epochs=loader_epochs, output="uint8")}
    for dtype in (torch.float32, torch.bfloat16):
        aug = augment.train(size, channels_last=True, dtype=dtype, path="device")
        res["deviceloader"][f"train{size}_{str(dtype).split('.')[-1]}"] = loader_rate(
            cache, dev, args, epochs=loader_epochs, augment=aug)
    save("deviceloader", t)

    t = time.perf_counter()
    res["resnet50"] = resnet_steps(cache, dev, args, size)
    save("resnet50", t)

    if not args.skip_tests:
        t = time.perf_counter()
        res["cuda_tests"] = cuda_tests(timeout=max(60.0, 420.0 - (time.perf_counter() - t0)))
        if not res["cuda_tests"]["ok"]:
            failures.append("cuda tests")
        save("cuda_tests", t)
    print(json.dumps({k: v for k, v in res.items() if k != "cuda_tests"}, indent=1))
    if "cuda_tests" in res:
        print("cuda tests:", res["cuda_tests"].get("summary") or res["cuda_tests"].get("why"))
    if failures:
        print(f"gpu_check: FAILED: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
