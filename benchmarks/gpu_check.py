"""The GPU path, measured on a machine with CUDA: pinned copies, Kornia on the device, and a
ResNet-50 training step fed by datapipe against the same step on synthetic in-memory data.

    python benchmarks/gpu_check.py [--cache CACHE] [--images 6000] [--workers 16] [--out DIR]

Writes gpu_check.json into --out (default: the current folder). Needs torch with CUDA; uses
torchvision's ResNet-50 when importable, else the same architecture defined below.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn


def resnet50(num_classes: int = 1000) -> nn.Module:
    try:
        import torchvision

        return torchvision.models.resnet50(num_classes=num_classes)
    except Exception:  # noqa: BLE001 - same architecture without torchvision
        pass

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                   nn.MaxPool2d(3, 2, 1)], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", default=None)
    p.add_argument("--images", type=int, default=6000)
    p.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    import datapipe

    dev = torch.device("cuda")
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cpus": os.cpu_count(),
                 "workers": args.workers, "batch": args.batch}
    cache = args.cache
    if cache is None:
        tmp = Path(tempfile.mkdtemp())
        src = datapipe.make_sample_dataset(tmp / "src", images=args.images, workers=os.cpu_count() or 1)
        t = time.perf_counter()
        rep = datapipe.build(src, tmp / "cache", workers=min(16, os.cpu_count() or 1), shard_size=100, progress=False)
        res["build"] = {"images_per_s": rep.images_per_second, "wall_s": time.perf_counter() - t}
        cache = tmp / "cache"

    # pinned host -> device copy
    host = torch.empty((args.batch, 256, 256, 3), dtype=torch.uint8).pin_memory()
    host.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        host.to(dev, non_blocking=True)
    torch.cuda.synchronize()
    res["h2d_GBps"] = 20 * host.numel() / (time.perf_counter() - t) / 1e9

    # Kornia augmentation on the device, whole batch
    aug = datapipe.augment.train(224, channels_last=True)
    x = host.to(dev)
    for _ in range(3):
        aug(x, seed=0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(20):
        aug(x, seed=i)
    torch.cuda.synchronize()
    res["augment_images_per_s"] = 20 * args.batch / (time.perf_counter() - t)

    # DeviceLoader into the GPU, augmentation at 224
    ds = datapipe.StreamingDataset(cache, batch_size=args.batch, shuffle=True, seed=0)
    loader = datapipe.DeviceLoader(ds, device="cuda", num_workers=args.workers, prefetch=4,
                                   augment=datapipe.augment.train(224, channels_last=True))
    n, t = 0, None
    for epoch in range(6):
        loader.set_epoch(epoch)
        if epoch == 1:
            torch.cuda.synchronize()
            n, t = 0, time.perf_counter()
        for images, labels in loader:
            n += images.shape[0]
    torch.cuda.synchronize()
    res["deviceloader_images_per_s"] = n / (time.perf_counter() - t)

    # ResNet-50 step (AMP bf16, channels_last): synthetic data vs datapipe
    model = resnet50().to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(images, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    synth = torch.randn(args.batch, 3, 224, 224, device=dev).contiguous(memory_format=torch.channels_last)
    synth_labels = torch.randint(0, 1000, (args.batch,), device=dev)
    for _ in range(10):
        step(synth, synth_labels)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        step(synth, synth_labels)
    torch.cuda.synchronize()
    synthetic = args.steps * args.batch / (time.perf_counter() - t)

    def fed():
        done, epoch = 0, 100
        while True:
            loader.set_epoch(epoch)
            for images, labels in loader:
                yield images, labels
                done += 1
            epoch += 1

    it = fed()
    for _ in range(10):
        step(*next(it))
    torch.cuda.synchronize()
    loader.meter.reset()
    t = time.perf_counter()
    for _ in range(args.steps):
        step(*next(it))
    torch.cuda.synchronize()
    real = args.steps * args.batch / (time.perf_counter() - t)
    res["resnet50"] = {"synthetic_images_per_s": synthetic, "datapipe_images_per_s": real,
                       "slowdown": 1 - real / synthetic, "wait_share": loader.stats()["wait_share"]}
    loader.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
