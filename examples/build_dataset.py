"""Decode an image folder once, on a Dask LocalCluster, into a datapipe cache.

    python examples/build_dataset.py                                   # a generated sample dataset
    python examples/build_dataset.py --source ~/imagenet/train --output ~/imagenet-256 --workers 16
    python examples/build_dataset.py --source SRC --output OUT --scheduler tcp://host:8786  # existing cluster

Without ``--source`` it first generates an ImageNet-like sample folder (real photographs, recoloured,
re-encoded as JPEG) next to the output. A rerun is cheap: finished shards are kept.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import datapipe


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default=None,
                   help="folder of class folders or a CSV of path,label (default: generate a sample dataset)")
    p.add_argument("--output", default="datapipe-example/cache", help="cache folder (default %(default)s)")
    p.add_argument("--images", type=int, default=2000, help="images of the generated sample (default %(default)s)")
    p.add_argument("--classes", type=int, default=10, help="classes of the generated sample (default %(default)s)")
    p.add_argument("--size", type=int, default=256, help="side of the square samples (default %(default)s)")
    p.add_argument("--shard-size", type=int, default=None, help="samples per shard (default: ~100 MB shards)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="LocalCluster worker processes (default: one per core)")
    p.add_argument("--scheduler", default=None,
                   help="use an existing Dask scheduler (tcp://host:8786) instead of a LocalCluster, "
                        "or 'sync' to decode serially in this process")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def sample_source(folder: Path, images: int, classes: int) -> Path:
    """Generate the sample dataset, unless a complete one is already there.

    Regenerating would touch every file, and a build decodes changed files again.
    """
    if folder.is_dir() and sum(1 for _ in folder.glob("*/*.jpg")) == images:
        print(f"sample dataset: {images} images already in {folder}")
        return folder
    print(f"sample dataset: writing {images} images in {classes} classes to {folder}")
    return datapipe.make_sample_dataset(folder, images=images, classes=classes, workers=min(4, os.cpu_count() or 1))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return build_and_open(args)
    except datapipe.DatapipeError as exc:  # a mistake in the options or the folders: one line, as the CLI says it
        print(f"build_dataset.py: error: {exc}", file=sys.stderr)
        return 2


def build_and_open(args: argparse.Namespace) -> int:
    logging.getLogger("datapipe").addHandler(logging.StreamHandler())  # the build's progress lines, on stderr
    logging.getLogger("datapipe").setLevel(logging.INFO)
    output = Path(args.output).absolute()
    source = Path(args.source) if args.source else sample_source(output.parent / "images", args.images, args.classes)
    spec = datapipe.BuildSpec(size=args.size, shard_size=args.shard_size)  # what the cache holds

    if args.scheduler:  # an existing cluster (its workers must see these paths), or "sync"
        report = datapipe.build(source, output, spec, cluster=datapipe.Cluster(scheduler=args.scheduler),
                                progress=not args.quiet)
    else:
        from dask.distributed import LocalCluster

        # Single-threaded worker processes, as `datapipe build --workers N` starts them.
        with LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                          dashboard_address=":8787") as cluster:
            print(f"LocalCluster: {args.workers} workers; dashboard: {cluster.dashboard_link}")
            report = datapipe.build(source, output, spec, cluster=datapipe.Cluster(scheduler=cluster.scheduler_address),
                                    progress=not args.quiet)

    cache = datapipe.open(output)
    print(f"{cache!r}")
    print(f"next: torchrun --nproc_per_node=2 examples/train.py --cache {output}")
    return 0 if report.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
