"""How much of datapipe's lead over the peers is its build's one-off decode and resize.

`datapipe bench` gives every system the same images: the peers read the source files as a user has them
and decode each one every epoch, datapipe reads the pixels its build decoded and resized once. Here the
peers also get sources pre-resized once to what the cache stores (short side 256, the centred 256x256,
JPEG quality 90, as a preprocessing step would write them), and both comparisons run one after the other.

    python benchmarks/peers_resized_bench.py [--images 300] [--repeats 3] [--batch-size 64] [--work DIR]

Prints both tables and the ratios, and writes benchmarks/results/peers-resized.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pre_resized(src: Path, dst: Path, size: int = 256) -> Path:
    """Each image of ``src`` resized so its shorter side is ``size``, centre-cropped to a square, as JPEG q90."""
    from PIL import Image

    for f in sorted(src.glob("*/*")):
        with Image.open(f) as img:
            rgb = img.convert("RGB")
        w, h = rgb.size
        scale = size / min(w, h)
        rgb = rgb.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BILINEAR)
        w, h = rgb.size
        left, top = (w - size) // 2, (h - size) // 2
        out = dst / f.parent.name / (f.stem + ".jpg")
        out.parent.mkdir(parents=True, exist_ok=True)
        rgb.crop((left, top, left + size, top + size)).save(out, "JPEG", quality=90)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--work", default="peers-resized-work")
    args = parser.parse_args()

    import datapipe
    from datapipe.bench.harness import BenchSpec, format_table, run

    work = Path(args.work)
    sources = {"originals": work / "data", "pre-resized": work / "data256"}
    if not sources["originals"].exists():
        datapipe.make_sample_dataset(sources["originals"], images=args.images, classes=3)
    if not sources["pre-resized"].exists():
        pre_resized(sources["originals"], sources["pre-resized"])
    spec = BenchSpec(batch_size=args.batch_size, repeats=args.repeats, workers=2)
    found = {}
    for name, source in sources.items():
        cache = work / f"cache-{name}"
        datapipe.build(source, cache, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
        result = run(cache, spec, source=source, against=["dataloader", "webdataset"], work_dir=work / f"peers-{name}",
                     progress=False)
        print(f"peers on the {name} sources:")
        print(format_table(result))
        found[name] = result.to_dict()
    for peer in ("dataloader", "webdataset"):
        a, b = (found[n]["systems"][peer] for n in sources)
        print(f"{peer}: datapipe {a['ratio']:.1f}x against the originals, {b['ratio']:.1f}x against pre-resized "
              f"sources; the peer's CPU per image {1e3 * a['cpu_s_per_image']:.2f} -> {1e3 * b['cpu_s_per_image']:.2f} ms")
    out = Path(__file__).resolve().parent / "results" / "peers-resized.json"
    out.write_text(json.dumps(found, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
