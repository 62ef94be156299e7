"""Build into object storage against the same build into a local folder.

One source (the first N JPEGs of a class-folder tree), one Dask cluster (the same workers for both
sides), builds alternated round by round so that the shared machine's drift hits both alike. The S3
side is moto's server on loopback (tests/s3_server.py): each worker writes its shard into a local
temporary folder and uploads its files, zarr.json last. Reported: the shard-building img/s of each
side (cluster start-up excluded, as in report.json) and the ratio object store / local, and the CPU
seconds each side's build took in the workers, in the client and in moto's server (psutil), since moto
shares the machine's cores with the workers. ``--shard-size 0``: datapipe's default (about 100 MB).
``--store-core``: moto's server gets the machine's last core to itself and the workers (and this client)
the others, on both sides alike, as with a store on other machines: the ratio then counts only what
writing to a store costs the build's own cores.

    python benchmarks/remote_bench.py [--source /tmp/benchdata] [--images 1000] [--rounds 2] [--workers 2] [--size 160] [--shard-size 50]
                                      [--encoding raw|jpeg] [--store-core]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def subset(source: Path, n: int, dest: Path) -> Path:
    """The first ``n`` images of ``source`` (sorted), hard-linked (or copied) into ``dest`` by class."""
    files = sorted(p for p in source.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png") and p.is_file())[:n]
    for p in files:
        target = dest / p.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, target)
        except OSError:
            shutil.copyfile(p, target)
    return dest


def cpu_seconds(moto, workers) -> dict[str, float]:
    """CPU seconds (user + system) so far of the Dask workers (and nannies), this client and moto's server."""
    import psutil

    def of(procs) -> float:
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    return {"workers": of(workers), "client": of([psutil.Process()]), "moto": of([moto])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="/tmp/benchdata")
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--size", type=int, default=160)
    ap.add_argument("--shard-size", type=int, default=50, help="samples per shard (many shards per worker); 0: the default")
    ap.add_argument("--encoding", choices=("raw", "jpeg"), default="raw", help="the samples' encoding (--encoding of datapipe build)")
    ap.add_argument("--store-core", action="store_true",
                    help="pin moto's server to the last core and the workers and this client to the others (both sides)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import psutil
    from s3_server import running_server

    import datapipe
    from datapipe.builder import _local_cluster

    work = Path(tempfile.mkdtemp(prefix="remote-bench-"))
    src = subset(Path(args.source), args.images, work / "src")
    cluster = _local_cluster(args.workers)
    rates: dict[str, list[float]] = {"local": [], "s3": []}
    cpu: dict[str, list[dict[str, float]]] = {"local": [], "s3": []}
    try:
        with running_server() as s3:
            bucket = s3.bucket("bench")
            spec = datapipe.BuildSpec(size=args.size, shard_size=args.shard_size or None, encoding=args.encoding)
            moto = psutil.Process(s3._proc.pid)  # type: ignore[union-attr]
            workers = [p for p in psutil.Process().children(recursive=True) if p.pid != moto.pid]
            if args.store_core:
                cores = sorted(psutil.Process().cpu_affinity() or [])
                if len(cores) <= args.workers:
                    sys.exit(f"--store-core needs more cores than --workers ({args.workers}); this process may use {cores}")
                moto.cpu_affinity(cores[-1:])
                for p in [*workers, psutil.Process()]:
                    p.cpu_affinity(cores[:-1])
            where = datapipe.Cluster(scheduler=cluster.scheduler_address)
            for r in range(args.rounds):
                for side in ("local", "s3") if r % 2 == 0 else ("s3", "local"):
                    out = str(work / f"out-{r}") if side == "local" else f"{bucket}/out-{r}"
                    before = cpu_seconds(moto, workers)
                    report = datapipe.build(src, out, spec, cluster=where, progress=False,
                                            storage_options=s3.storage_options if side == "s3" else None)
                    used = {k: v - before[k] for k, v in cpu_seconds(moto, workers).items()}
                    rates[side].append(report.images_per_second)
                    cpu[side].append(used)
                    print(f"round {r} {side:5s}: {report.images_per_second:,.0f} img/s "
                          f"({report.shards_built} shards, {report.seconds['shards']:.1f} s); CPU s: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in used.items()), flush=True)
                    if side == "local":
                        shutil.rmtree(out)
                    else:
                        s3.filesystem().rm(out.removeprefix("s3://"), recursive=True)
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    local, store = statistics.median(rates["local"]), statistics.median(rates["s3"])
    result = {"images": args.images, "workers": args.workers, "size": args.size, "shard_size": args.shard_size,
              "encoding": args.encoding, "rounds": args.rounds, "store_core": args.store_core,
              "local_img_s": local, "s3_img_s": store, "ratio": store / local, "all": rates, "cpu_seconds": cpu}
    moto_share = sum(c["moto"] for c in cpu["s3"]) / max(sum(sum(c.values()) for c in cpu["s3"]), 1e-9)
    print(f"local {local:,.0f} img/s, s3 (moto on loopback) {store:,.0f} img/s: {store / local:.0%} of local; "
          f"moto's server took {moto_share:.0%} of the CPU time of the s3 builds")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
