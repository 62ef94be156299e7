"""Streaming from object storage: a remote cache on moto's S3 server read through the node-local shard cache.

Figures (docs/benchmarks.md, "Streaming from object storage"):
  steady   — an epoch from the local cache of a remote dataset vs the same folder opened as a local cache (img/s)
  cold     — the first epoch's download bandwidth vs a plain parallel download of the same shards (8 threads)
  bytes    — bytes downloaded per node in a steady epoch with cache_limit = 25 % of the dataset, two ranks,
             order "shards" and order "global", against the bytes the ranks read
  first    — time to the first batch from a cold cache vs one shard's download + one batch's read

    python benchmarks/stream_bench.py [--samples 2000 --size 128 --shard-size 100]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from s3_server import running_server

import datapipe
from datapipe import fetch
from datapipe.testing import build_index_cache


def epoch(ds) -> tuple[int, float]:
    t = time.perf_counter()
    n = sum(len(b[1]) for b in ds)
    return n, time.perf_counter() - t


def remote(s3, url, local, **kw):
    kw.setdefault("batch_size", 64)
    return datapipe.StreamingDataset(url, local_cache=local, storage_options=s3.storage_options, **kw)


def shard_bytes(folder: Path, since: int = 0) -> int:
    return sum(d["bytes"] for d in fetch.downloads(folder)[since:] if "/images/" in d["file"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--shard-size", type=int, default=100)
    ap.add_argument("--prefetch", type=int, default=8)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="stream-bench-"))
    try:
        t = time.perf_counter()
        local = build_index_cache(work / "build", args.samples, size=args.size, shard_size=args.shard_size)
        cache = datapipe.open(local)
        total = cache.manifest.data_bytes if hasattr(cache.manifest, "data_bytes") else int(sum(s.nbytes for s in cache.manifest.shards))
        print(f"cache: {args.samples} samples {args.size}px, {len(cache.counts)} shards, {total / 1e6:.1f} MB "
              f"(built in {time.perf_counter() - t:.1f} s)")
        with running_server() as s3:
            url = s3.bucket() + "/cache"
            fs = s3.filesystem()
            fs.put(str(local), url.removeprefix("s3://"), recursive=True)
            rels = [fetch.images_path(Path("shards") / s.name, cache.layout).as_posix() for s in cache.manifest.shards if s.count]

            # plain parallel download of the same shards
            def get(rel: str, dest: Path) -> None:
                fs.get_file(f"{url.removeprefix('s3://')}/{rel}", str(dest / rel.replace("/", "_")))
            plain = []
            for r in range(2):
                dest = work / f"plain{r}"
                dest.mkdir()
                t = time.perf_counter()
                with ThreadPoolExecutor(args.prefetch) as pool:
                    list(pool.map(lambda rel, dest=dest: get(rel, dest), rels))
                plain.append(total / (time.perf_counter() - t))
            plain_bw = max(plain)

            # first batch, cold
            one = work / "one"
            one.mkdir()
            t = time.perf_counter()
            get(rels[0], one)
            shard_s = time.perf_counter() - t
            ds = remote(s3, url, work / "first", prefetch=args.prefetch)
            t = time.perf_counter()
            next(iter(ds))
            first_s = time.perf_counter() - t
            ds_local = datapipe.StreamingDataset(ds.cache.root, batch_size=64, order=ds.order)
            it = iter(ds_local)
            next(it)
            t = time.perf_counter()
            next(it)
            batch_s = time.perf_counter() - t

            # cold epoch bandwidth, then steady epochs: remote local cache vs the same folder as a local cache
            colds = []
            for r in range(2):
                ds = remote(s3, url, work / f"cold{r}", prefetch=args.prefetch)
                n, secs = epoch(ds)
                colds.append(shard_bytes(ds.cache.remote.folder) / secs)
            cold_bw = max(colds)
            ratios, r_rates, l_rates = [], [], []
            loc = datapipe.StreamingDataset(ds.cache.root, batch_size=64, order=ds.order)
            for e in range(1, 4):
                ds.set_epoch(e)
                loc.set_epoch(e)
                n, rs = epoch(ds)
                n, ls = epoch(loc)
                r_rates.append(n / rs)
                l_rates.append(n / ls)
                ratios.append(ls / rs)

            # bytes per node per epoch with cache_limit = 25 %, two ranks on one node (threads)
            moved = {}
            for order in ("shards", "global"):
                node = work / f"node-{order}"
                limit = total // 4 + 200_000
                kw = dict(cache_limit=limit, order=order, world_size=2, prefetch=2, window=max(1, len(rels) // 16))
                if order == "global":
                    kw.pop("window")
                ranks = [remote(s3, url, node, rank=r, **kw) for r in range(2)]
                folder = ranks[0].cache.remote.folder
                for e in range(2):
                    before = len(fetch.downloads(folder))
                    threads = [threading.Thread(target=lambda d=d, e=e: (d.set_epoch(e), epoch(d))) for d in ranks]
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                moved[order] = shard_bytes(folder, before) / total

        print(f"steady epoch: remote local cache {np.median(r_rates):,.0f} img/s, same folder local {np.median(l_rates):,.0f} "
              f"img/s: {np.median(ratios):.0%} (epochs: {', '.join(f'{x:.0%}' for x in ratios)})")
        print(f"cold epoch: {cold_bw / 1e6:,.0f} MB/s vs plain parallel download ({args.prefetch} threads) "
              f"{plain_bw / 1e6:,.0f} MB/s: {cold_bw / plain_bw:.0%}")
        for order, ratio in moved.items():
            print(f"bytes downloaded per node in a steady epoch, cache_limit 25 %, order {order!r}: {ratio:.2f} x the bytes read")
        print(f"first batch, cold: {first_s * 1e3:.0f} ms vs one shard's download {shard_s * 1e3:.0f} ms + one batch's "
              f"read {batch_s * 1e3:.1f} ms = {(shard_s + batch_s) * 1e3:.0f} ms")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
