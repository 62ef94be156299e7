"""Streaming from object storage: a remote cache on moto's S3 server read through the node-local shard cache.

Figures (docs/benchmarks.md, "Streaming from object storage"):
  steady   — an epoch from the local cache of a remote dataset vs the same folder opened as a local cache (img/s),
             median of 20 alternating epochs (each side first in every other pair)
  cold     — the first epoch's download bandwidth vs a plain parallel download of the same shards (8 threads),
             alternating, the same number of rounds each
  bytes    — bytes downloaded per node in a steady epoch with cache_limit = 25 % of the dataset, two ranks
             stepping together (threads, a barrier per batch), order "shards" (at the largest window two of
             which fit the limit) and order "global", against the bytes the ranks read (the whole dataset)
  first    — time to the first batch from a cold cache vs the plain download of the shards it reads + one batch's
             read (the first batch of a fresh dataset over the local cache, each round): at window 1 (one
             shard) and at the default window (every shard the batch draws from)

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
from datapipe import fetch, partition
from datapipe.testing import build_index_cache


def epoch(ds) -> tuple[int, float]:
    t = time.perf_counter()
    n = sum(len(b[1]) for b in ds)
    return n, time.perf_counter() - t


def lockstep(ds, e: int, step: threading.Barrier) -> None:
    ds.set_epoch(e)
    for _ in ds:
        step.wait()


def remote(s3, url, local, **kw):
    kw.setdefault("batch_size", 64)
    return datapipe.StreamingDataset(url, local_cache=local, storage_options=s3.storage_options, **kw)


def settle(timeout: float = 30.0) -> None:
    """Wait until no prefetch thread runs (a closed dataset's downloads in flight finish in the background)."""
    end = time.monotonic() + timeout
    while any(t.name.startswith("datapipe-prefetch") for t in threading.enumerate()) and time.monotonic() < end:
        time.sleep(0.01)


def shard_bytes(folder: Path, since: int = 0) -> int:
    return sum(d["bytes"] for d in fetch.downloads(folder)[since:] if "/images/" in d["file"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--shard-size", type=int, default=100)
    ap.add_argument("--prefetch", type=int, default=8)
    ap.add_argument("--first-rounds", type=int, default=7, help="rounds of the first-batch figure")
    ap.add_argument("--cold-rounds", type=int, default=5, help="rounds of the cold-epoch figure")
    ap.add_argument("--steady-epochs", type=int, default=20, help="alternating epochs of the steady figure")
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

            def download(names: list[str], dest: Path) -> float:
                """Seconds to download ``names`` into the new folder ``dest`` on ``args.prefetch`` threads."""
                dest.mkdir()
                t = time.perf_counter()
                with ThreadPoolExecutor(args.prefetch) as pool:
                    list(pool.map(lambda rel: get(rel, dest), names))
                return time.perf_counter() - t
            for r in range(2):  # warm-up: the server's and the client's first transfers
                download(rels, work / f"warm{r}")

            # first batch, cold: at window 1 it reads one shard; at the default window, every shard its batch draws
            # from. Rounds alternate it with the plain download of the same shards (each into a fresh folder); each
            # round also times the first batch of a fresh dataset over the built cache (the same plan, its files in
            # the page cache): what a reader costs without the network. The sum it is held to is the plain
            # download + that read; the steady read of a batch (files open) is printed beside it.
            firsts: dict[int, dict[str, list[float]]] = {}
            for window in (1, partition.DEFAULT_WINDOW):
                runs: dict[str, list[float]] = {"first": [], "plain": [], "local": []}
                probe = remote(s3, url, work / f"plan{window}", prefetch=args.prefetch, window=window)
                order, bounds = probe.plan()
                need = sorted({int(s) for s in np.searchsorted(probe.cache.starts, order[bounds[0, 0]:bounds[0, 1]],
                                                               side="right") - 1})
                probe.cache.remote.close()
                for r in range(args.first_rounds):
                    for side in ("first", "plain") if r % 2 == 0 else ("plain", "first"):
                        if side == "plain":
                            runs["plain"].append(download([rels[s] for s in need], work / f"need{window}-{r}"))
                            continue
                        ds = remote(s3, url, work / f"first{window}-{r}", prefetch=args.prefetch, window=window)
                        t = time.perf_counter()
                        next(iter(ds))
                        runs["first"].append(time.perf_counter() - t)
                        ds.cache.remote.close()
                        settle()  # the prefetches it started end before the next measurement
                        local_ds = datapipe.StreamingDataset(local, batch_size=64, order=ds.order, window=window)
                        t = time.perf_counter()
                        next(iter(local_ds))
                        runs["local"].append(time.perf_counter() - t)
                runs["need"] = [float(len(need))]
                firsts[window] = runs
            ds_local = datapipe.StreamingDataset(ds.cache.root, batch_size=64, order=ds.order)
            it = iter(ds_local)
            next(it)
            reads = []
            for _ in range(5):
                t = time.perf_counter()
                next(it)
                reads.append(time.perf_counter() - t)
            batch_s = float(np.median(reads))

            # cold epoch bandwidth (alternating with the plain download), then steady epochs: the remote's local
            # cache vs the same folder as a local cache, alternating
            colds, plain = [], []
            for r in range(args.cold_rounds):
                for side in ("cold", "plain") if r % 2 == 0 else ("plain", "cold"):
                    if side == "plain":
                        plain.append(total / download(rels, work / f"plain{r}"))
                        continue
                    ds = remote(s3, url, work / f"cold{r}", prefetch=args.prefetch)
                    n, secs = epoch(ds)
                    colds.append(shard_bytes(ds.cache.remote.folder) / secs)
                    ds.cache.remote.close()
                    settle()
            plain_bw, cold_bw = max(plain), max(colds)
            cold_ratios = [c / p for c, p in zip(colds, plain, strict=True)]
            ratios, r_rates, l_rates = [], [], []
            loc = datapipe.StreamingDataset(ds.cache.root, batch_size=64, order=ds.order)
            for e in range(1, 2 + args.steady_epochs):
                ds.set_epoch(e)
                loc.set_epoch(e)
                if e % 2:  # each side first in every other pair
                    n, rs = epoch(ds)
                    n, ls = epoch(loc)
                else:
                    n, ls = epoch(loc)
                    n, rs = epoch(ds)
                if e > 1:  # the first epoch after the cold one opens the shards
                    r_rates.append(n / rs)
                    l_rates.append(n / ls)
                    ratios.append(ls / rs)

            # bytes per node per epoch with cache_limit = 25 %, two ranks on one node (threads); the shards order
            # at the largest window two of which fit the limit (docs/loader.md's sizing advice)
            moved = {}
            on_disk: dict[str, list[float]] = {"shards": [], "global": []}  # the shards' files after each epoch / limit
            limit = total // 4 + 200_000
            window = max(1, limit // max(s.nbytes for s in cache.manifest.shards) // 2)
            for order in ("shards", "global"):
                node = work / f"node-{order}"
                kw = dict(cache_limit=limit, order=order, world_size=2, prefetch=2, window=window)
                if order == "global":
                    kw.pop("window")
                ranks = [remote(s3, url, node, rank=r, **kw) for r in range(2)]
                folder = ranks[0].cache.remote.folder
                per_epoch = []
                for e in range(4):
                    before = len(fetch.downloads(folder))
                    step = threading.Barrier(len(ranks))  # the ranks step together, as DDP's gradient all-reduce makes them
                    threads = [threading.Thread(target=lockstep, args=(d, e, step)) for d in ranks]
                    for th in threads:
                        th.start()
                    for th in threads:
                        th.join()
                    per_epoch.append(shard_bytes(folder, before) / total)
                    on_disk[order].append(sum(f.stat().st_size for f in (folder / "shards").rglob("*") if f.is_file()) / limit)
                for d in ranks:
                    d.cache.remote.close()
                moved[order] = per_epoch

        print(f"steady epoch: remote local cache {np.median(r_rates):,.0f} img/s, same folder local {np.median(l_rates):,.0f} "
              f"img/s: {np.median(ratios):.0%} median of {len(ratios)} alternating epochs "
              f"(range {min(ratios):.0%}-{max(ratios):.0%})")
        print(f"cold epoch: {cold_bw / 1e6:,.0f} MB/s vs plain parallel download ({args.prefetch} threads) "
              f"{plain_bw / 1e6:,.0f} MB/s: {cold_bw / plain_bw:.0%} (best of {args.cold_rounds} alternating runs "
              f"each); median of the rounds' ratios {np.median(cold_ratios):.0%} "
              f"({', '.join(f'{x:.0%}' for x in cold_ratios)})")
        for order, per_epoch in moved.items():
            steady = float(np.mean(per_epoch[1:]))
            print(f"bytes downloaded per node per steady epoch, cache_limit 25 %, two ranks, order {order!r}"
                  f"{f' window {window}' if order == 'shards' else ''}: {steady:.2f} x the bytes read "
                  f"(epochs: {', '.join(f'{x:.2f}' for x in per_epoch)}; on disk after each, of the limit: "
                  f"{', '.join(f'{x:.0%}' for x in on_disk[order])})")
        for window, runs in firsts.items():
            ratios = [f / (p + b) for f, p, b in zip(runs["first"], runs["plain"], runs["local"], strict=True)]
            steady = [f / (p + batch_s) for f, p in zip(runs["first"], runs["plain"], strict=True)]
            print(f"first batch, cold, window {window} (it reads {int(runs['need'][0])} shard(s)), {args.first_rounds} "
                  f"alternating rounds: {np.median(runs['first']) * 1e3:.0f} ms (median; "
                  f"{', '.join(f'{x * 1e3:.0f}' for x in runs['first'])}) vs their plain parallel download "
                  f"{np.median(runs['plain']) * 1e3:.0f} ms ({', '.join(f'{x * 1e3:.0f}' for x in runs['plain'])}) + the "
                  f"first batch of a fresh dataset over the local cache {np.median(runs['local']) * 1e3:.1f} ms "
                  f"({', '.join(f'{x * 1e3:.1f}' for x in runs['local'])}): {np.median(ratios):.2f} x their sum (median "
                  f"of per-round ratios); with a steady batch's read ({batch_s * 1e3:.1f} ms, files open) in place of "
                  f"the local first batch: {np.median(steady):.2f} x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
