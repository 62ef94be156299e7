"""The partial JPEG decoder of crops (datapipe/_jpegcrop.c) against whole-image decodes, on a JPEG cache.

Measured side by side in one run (the machine is shared, so only ratios from the same run count):

1. one thread, an epoch's RandomResizedCrop boxes of augment.train(``--crop``): img/s of
   ``decode_crop`` with the partial decoder (only the crop's region decoded), of the whole-image
   ``decode_crop`` (simplejpeg, DCT-scaled the same way), and of a plain full decode with simplejpeg
   (the rate the loader figure compares with); also the decoded pixels per sample, as a share of the
   sample's, and augment.train's ``decode`` of the same samples in batches (decode, crop, resize,
   mirror, normalise: a reader thread's work), with and without the partial decoder;
2. the CPU loader (DeviceLoader(device="cpu") + augment.train(``--crop``), ``--workers`` reader
   threads) on the JPEG cache with and without the partial decoder, against ``--workers`` x the
   one-thread full-decode rate of the same samples (the limit of formats_bench.py's figure 4) —
   goal >= 80 %.

Each figure runs in interleaved rounds after a warm-up round; ratios are computed per round and
their median reported.

    python benchmarks/jpegcrop_bench.py [--source DIR] [--images 1000] [--rounds 5] [--epochs 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from unittest import mock

import numpy as np
from formats_bench import DecodeAll, Epochs, build, cpu_loader, ratios, rounds, subset

from datapipe import samples


def whole_images() -> AbstractContextManager:
    """decode_crop without the partial decoder (today's whole-image path), while the context lasts."""
    return mock.patch.object(samples, "partial_decoder", lambda: None)


class Switched:
    """A loader iterated under a context (the partial decoder switched off, or nothing)."""

    def __init__(self, loader: Iterable, context: Callable[[], AbstractContextManager]) -> None:
        self.loader, self.context = loader, context

    def __iter__(self) -> Iterator:
        with self.context():
            yield from self.loader


def one_thread(cache_path: Path, crop: int, repeats: int, log: Callable[[str], None]) -> dict:
    """Figure 1: img/s of the three decodes over one epoch's boxes, interleaved rounds."""
    import simplejpeg
    import torch

    import datapipe

    cache = datapipe.open(cache_path)
    encoded = cache.read_encoded(np.arange(len(cache)), np.empty(len(cache), np.int64))
    heights = np.array([e.height for e in encoded])
    widths = np.array([e.width for e in encoded])
    boxes = datapipe.augment.train(crop).sample(len(encoded), torch.from_numpy(heights), torch.from_numpy(widths), 0)["crops"].tolist()
    jobs = list(zip(encoded, [tuple(b) for b in boxes], strict=True))

    def full() -> None:
        for e, _ in jobs:
            simplejpeg.decode_jpeg(e.data, colorspace="RGB")

    def crops() -> None:
        for e, box in jobs:
            samples.decode_crop(e.data, e.height, e.width, box, crop, where=e.where)

    def whole() -> None:
        with whole_images():
            crops()

    train = datapipe.augment.train(crop)
    out = torch.empty((256, 3, crop, crop))

    def augment() -> None:  # what a reader thread does per batch: decode, crop, resize, mirror, normalise
        for a in range(0, len(encoded), 256):
            train.decode(encoded[a : a + 256], seed=a, out=out[: len(encoded[a : a + 256])])

    def augment_whole() -> None:
        with whole_images():
            augment()

    decoded = [samples.decode_crop(e.data, e.height, e.width, box, crop, where=e.where)[0] for e, box in jobs[:2000]]
    pixel_share = sum(d.shape[0] * d.shape[1] for d in decoded) / sum(e.height * e.width for e, _ in jobs[: len(decoded)])
    systems = {"partial": crops, "whole": whole, "full_decode": full, "augment_partial": augment, "augment_whole": augment_whole}
    rates: dict[str, list[float]] = {k: [] for k in systems}
    for rnd in range(repeats + 1):
        for name, fn in systems.items():
            t = time.perf_counter()
            fn()
            if rnd:
                rates[name].append(len(jobs) / (time.perf_counter() - t))
        if rnd:
            log(f"one thread, round {rnd}: " + ", ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()) + " img/s")
    return {"rates": rates, "decoded_pixel_share": pixel_share, "partial_decoder": samples.describe_decoder()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, default=Path("/tmp/benchdata"), help="image folder in class folders (default /tmp/benchdata)")
    p.add_argument("--images", type=int, default=1000, help="images of the source to use (default 1000)")
    p.add_argument("--size", type=int, default=256, help="cache --size (default 256)")
    p.add_argument("--quality", type=int, default=None, help="JPEG --quality (default: the build's, 90)")
    p.add_argument("--crop", type=int, default=224, help="augment.train crop (default 224)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="loader reader threads (default 2)")
    p.add_argument("--shard-size", type=int, default=125)
    p.add_argument("--epochs", type=int, default=2, help="epochs per timed loader pass (default 2)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds after a warm-up round (default 5)")
    p.add_argument("--work", type=Path, default=None, help="working folder (default: a temporary one, removed at the end)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    return p.parse_args(argv)


def median_ratio(a: list[float], b: list[float], scale: float = 1.0) -> float:
    return statistics.median(ratios(a, b, scale))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="jpegcrop-bench-"))

    def log(msg: str) -> None:
        print(msg, flush=True)

    try:
        if not args.source.is_dir():
            from datapipe.bench.sample import make_sample_dataset

            log(f"{args.source} not found: generating {args.images} sample images there")
            make_sample_dataset(args.source, images=args.images, workers=args.workers)
        src = subset(args.source, work / "src", args.images)
        path = work / "jpeg-crop"
        build(src, path, size=args.size, fit="crop", encoding="jpeg", quality=args.quality, workers=args.workers,
              shard_size=args.shard_size)
        log(f"partial decoder: {samples.describe_decoder()}")
        single = one_thread(path, args.crop, args.rounds, log)
        lk = {"batch_size": args.batch_size, "workers": args.workers, "crop": args.crop}
        systems: dict[str, Iterable] = {
            "loader_partial": Switched(cpu_loader(path, **lk), nullcontext),
            "loader_whole": Switched(cpu_loader(path, **lk), whole_images),
            "decode_1thread": DecodeAll(path, args.batch_size),
        }
        rates = rounds({name: Epochs(loader, args.epochs) for name, loader in systems.items()}, args.rounds, log)
        r1 = single["rates"]
        figures = {
            "partial_vs_full_decode_1thread": median_ratio(r1["partial"], r1["full_decode"]),
            "partial_vs_whole_1thread": median_ratio(r1["partial"], r1["whole"]),
            "augment_partial_vs_full_decode_1thread": median_ratio(r1["augment_partial"], r1["full_decode"]),
            "augment_whole_vs_full_decode_1thread": median_ratio(r1["augment_whole"], r1["full_decode"]),
            "decoded_pixel_share": single["decoded_pixel_share"],
            "loader_partial_vs_2x_decode": median_ratio(rates["loader_partial"], rates["decode_1thread"], args.workers),
            "loader_whole_vs_2x_decode": median_ratio(rates["loader_whole"], rates["decode_1thread"], args.workers),
        }
        result = {"config": {**vars(args), "source": str(args.source), "work": str(work), "json": str(args.json) if args.json else None},
                  "partial_decoder": single["partial_decoder"], "one_thread_rates": r1, "loader_rates": rates, "figures": figures}
        print()
        for k, v in figures.items():
            print(f"{k:32s} {v:6.3f}")
        print("one thread, median img/s: " + ", ".join(f"{k} {statistics.median(v):,.0f}" for k, v in r1.items()))
        print("loader, median img/s: " + ", ".join(f"{k} {statistics.median(v):,.0f}" for k, v in rates.items()))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1, default=str))
        return result
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
