"""Orders: the global shuffle against the shard-aware order — how well each mixes, how much each reads.

For each order (``global``; ``shards`` at several windows) over a class-sorted layout (a real cache
with ``--cache``, else a synthetic ImageNet-size layout: 1.28M samples, 1,000 classes of 1,281
sorted by class, shards of 1,250), on ``--nodes`` nodes × ``--local-world`` ranks of
``--batch-size``, it reports over every rank's batches:

- label entropy: the mean, over batches, of the entropy of a batch's labels in bits
  (:func:`datapipe.partition.order_quality`; log2 of the batch size at most);
- distinct shards per batch;
- the working set: the most distinct shards (and their bytes) one node reads within one window of
  its stream (the shard-aware order's windows; for the global order, spans of the same mean length);
  while a step straddles two windows a node holds both;
- shard reads per node and epoch through an LRU local cache of ``--cache-windows`` × window shards
  (``2``: what the shard-aware order needs), as a multiple of the shards the node needs once:
  1.0 = every shard downloaded (or read from disk) once.

    python benchmarks/order_bench.py [--cache DIR] [--nodes 4] [--local-world 8] [--batch-size 256]
                                     [--windows 16,64,256] [--sample-bytes 110000]

Pure computation on the orders (no image is read), so the figures do not depend on the machine.
"""

from __future__ import annotations

import argparse
import collections
import time
from dataclasses import dataclass

import numpy as np

from datapipe import partition as part


@dataclass(frozen=True)
class Layout:
    """A cache's shard layout: samples per shard, each sample's label, bytes per shard."""

    name: str
    counts: np.ndarray  # int64 [S]
    labels: np.ndarray  # int64 [N]
    shard_bytes: np.ndarray  # int64 [S]

    @property
    def shard_of(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.counts)), self.counts)


def synthetic(samples: int, classes: int, shard_size: int, sample_bytes: int) -> Layout:
    """Class-sorted samples (as a build of class folders writes them) in shards of ``shard_size``."""
    labels = np.arange(samples, dtype=np.int64) * classes // samples  # [N], sorted, equal classes
    counts = np.full(samples // shard_size, shard_size, np.int64)
    if samples % shard_size:
        counts = np.append(counts, samples % shard_size)
    return Layout(f"synthetic: {samples:,} samples, {classes:,} classes, shards of {shard_size:,}", counts, labels,
                  counts * sample_bytes)


def from_cache(path: str) -> Layout:
    import datapipe

    cache = datapipe.open(path)
    nbytes = cache.sample_nbytes
    starts = np.concatenate([[0], np.cumsum(cache.counts)])
    shard_bytes = np.array([nbytes[a:b].sum() for a, b in zip(starts[:-1], starts[1:], strict=True)], np.int64)
    return Layout(f"cache {path}: {len(cache):,} samples, {len(cache.classes)} classes, {len(cache.counts)} shards",
                  cache.counts, np.asarray(cache.labels), shard_bytes)


def node_stream(order: np.ndarray, node: int, nodes: int, chunk: int) -> np.ndarray:
    """What ``node`` reads, in order: its chunk of every full global step (the final partial step left out)."""
    full = len(order) // (nodes * chunk)
    return order[: full * nodes * chunk].reshape(full, nodes, chunk)[:, node, :].reshape(-1)


def rank_quality(order: np.ndarray, lay: Layout, *, world: int, batch: int) -> part.OrderQuality:
    """order_quality over every rank's batches (each rank's stream cut at its own batches)."""
    n = len(order)
    results = []
    for rank in range(world):
        bounds = part.batch_bounds(n, batch_size=batch, world_size=world, rank=rank, drop_last=True)
        if len(bounds):
            stream = np.concatenate([order[b:e] for b, e in bounds])
            results.append(part.order_quality(stream, lay.labels, lay.shard_of, batch))
    total = sum(q.batches for q in results)
    if not total:
        return part.OrderQuality(0.0, 0.0, 0)
    return part.OrderQuality(sum(q.entropy_bits * q.batches for q in results) / total,
                             sum(q.distinct_shards * q.batches for q in results) / total, total)


def working_set(stream: np.ndarray, lay: Layout, edges: np.ndarray) -> tuple[int, int]:
    """(distinct shards, their bytes): the most a node reads within one window, ``stream[edges[i]:edges[i + 1]]``."""
    shards = lay.shard_of[stream]
    worst, worst_bytes = 0, 0
    for a, b in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
        u = np.unique(shards[a:b])
        b = int(lay.shard_bytes[u].sum())
        if b > worst_bytes:
            worst, worst_bytes = len(u), b
    return worst, worst_bytes


def lru_reads(stream: np.ndarray, lay: Layout, capacity: int) -> tuple[int, int]:
    """(shard reads through an LRU of ``capacity`` shards, distinct shards needed) for one node's stream."""
    shards = lay.shard_of[stream]
    runs = shards[np.concatenate([[True], shards[1:] != shards[:-1]])] if len(shards) else shards
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    reads = 0
    for s in runs.tolist():
        if s in cache:
            cache.move_to_end(s)
            continue
        reads += 1
        cache[s] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return reads, len(np.unique(shards))


def measure(lay: Layout, *, order: str, window: int, nodes: int, local_world: int, batch: int,
            cache_windows: float, seed: int = 0, epoch: int = 0) -> dict:
    n = int(lay.counts.sum())
    world, chunk = nodes * local_world, local_world * batch
    started = time.perf_counter()
    if order == "global":
        o = part.epoch_order(n, seed=seed, epoch=epoch, shuffle=True)
    else:
        o = part.shard_order(lay.counts, seed=seed, epoch=epoch, nodes=nodes, window=window, batch_size=batch,
                             local_world=local_world)
    order_s = time.perf_counter() - started
    q = rank_quality(o, lay, world=world, batch=batch)
    capacity = max(1, int(cache_windows * window))
    ws, ws_bytes, reads, needed = 0, 0, 0, 0
    streams = part.node_streams(lay.counts, seed=seed, epoch=epoch, nodes=nodes, window=window)
    for k in range(nodes):
        stream = node_stream(o, k, nodes, chunk)
        edges = streams[k].windows  # the shard-aware order's windows; the global order: spans of their mean length
        if order == "global":
            span = max(1, len(streams[k].samples) // max(1, len(edges) - 1))
            edges = np.arange(0, len(stream) + span, span)
        s, b = working_set(stream, lay, np.minimum(edges, len(stream)))
        if b > ws_bytes:
            ws, ws_bytes = s, b
        r, d = lru_reads(stream, lay, capacity)
        reads, needed = reads + r, needed + d
    return {"order": order, "window": window, "entropy": q.entropy_bits, "shards_per_batch": q.distinct_shards,
            "working_shards": ws, "working_gb": ws_bytes / 1e9, "reads_x": reads / max(needed, 1), "capacity": capacity,
            "reads": reads / nodes,
            "order_s": order_s}


def table(lay: Layout, rows: list[dict], args: argparse.Namespace) -> str:
    head = (f"{lay.name}; {args.nodes} node(s) × {args.local_world} ranks × batch {args.batch_size}; "
            f"shards {lay.shard_bytes.mean() / 1e6:,.0f} MB on average\n\n"
            "| order | window (shards) | label entropy (bits/batch) | distinct shards/batch | node working set "
            "(shards, GB) | shard reads per node and epoch through an LRU cache (× the shards it needs) | order computed (s) |\n"
            "|---|---:|---:|---:|---:|---:|---:|\n")
    lines = []
    for r in rows:
        w = f"— (span, cache of {r['window']})" if r["order"] == "global" else str(r["window"])
        lines.append(f"| {r['order']} | {w} | {r['entropy']:.2f} | {r['shards_per_batch']:.1f} | "
                     f"{r['working_shards']:,} ({r['working_gb']:,.1f} GB) | {r['reads']:,.0f} (× {r['reads_x']:.2f}; LRU of "
                     f"{r['capacity']:,} shards) | "
                     f"{r['order_s']:.2f} |")
    return head + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", help="a cache folder (default: the synthetic ImageNet-size layout)")
    ap.add_argument("--samples", type=int, default=1_281_167)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--shard-size", type=int, default=1250)
    ap.add_argument("--sample-bytes", type=int, default=110_000, help="stored bytes per synthetic sample (JPEG ~110 kB)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--local-world", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--windows", default="16,64,256")
    ap.add_argument("--cache-windows", type=float, default=2.0,
                    help="the LRU local cache, in windows of shards (the global order gets the same cache)")
    args = ap.parse_args()
    lay = from_cache(args.cache) if args.cache else synthetic(args.samples, args.classes, args.shard_size, args.sample_bytes)
    windows = [int(w) for w in args.windows.split(",")]
    common = {"nodes": args.nodes, "local_world": args.local_world, "batch": args.batch_size,
              "cache_windows": args.cache_windows}
    rows = []
    for w in windows:  # the global order once per cache size, so that its reads compare at the same cache
        rows.append(measure(lay, order="global", window=w, **common))
        rows.append(measure(lay, order="shards", window=w, **common))
    print(table(lay, rows, args))


if __name__ == "__main__":
    main()
