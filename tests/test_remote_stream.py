"""Streaming a cache from object storage through the node-local shard cache (datapipe.fetch).

A real S3 API (moto's standalone server on loopback, tests/s3_server.py) holds caches built
locally and uploaded file by file (a remote cache has the local layout); ranks are real processes.
Checked: every sample once per epoch over two simulated nodes × two ranks, each node downloading
each shard once; eviction beyond cache_limit that never deletes a file datapipe did not download;
a rank SIGKILLed mid-download leaves no partial shard visible and the next reader completes it; a
shard altered in the store is a CorruptShardError naming it after the retries; a stopped or frozen
store is a RemoteStoreError, not a hang.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_mounts
from s3_server import requires_s3

import datapipe
from datapipe import fetch, partition
from datapipe.errors import ArgumentError, CacheError, CorruptShardError, RemoteStoreError
from datapipe.testing import build_index_cache, index_map

pytestmark = requires_s3

REPO = Path(__file__).resolve().parents[1]
N, SHARD = 101, 7  # 15 shards


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """Local caches to upload: the fixed layout (square raw) and the indexed one (--fit short)."""
    from datapipe.builder import Cluster, build

    root = tmp_path_factory.mktemp("remote-src")
    fixed = build_index_cache(root / "fixed", N, shard_size=SHARD)
    indexed = root / "indexed"
    build(root / "fixed" / "source", indexed, size=32, fit="short", shard_size=SHARD, cluster=Cluster(scheduler="sync"),
          progress=False)
    return {"fixed": fixed, "indexed": indexed, "ids": index_map(fixed)}


def upload(s3, local: Path) -> str:
    """A fresh bucket holding ``local`` under ``cache/``; returns its URL."""
    url = s3.bucket() + "/cache"
    s3.filesystem().put(str(local), url.removeprefix("s3://"), recursive=True)
    return url


def open_remote(s3, url: str, local_cache: Path, **kwargs) -> datapipe.StreamingDataset:
    kwargs.setdefault("batch_size", 8)
    kwargs.setdefault("return_index", True)
    return datapipe.StreamingDataset(url, local_cache=local_cache, storage_options=s3.storage_options, **kwargs)


def shard_downloads(folder: Path) -> Counter:
    """Downloads of each shard's data file (a sample index is downloaded apart from its data file)."""
    return Counter(d["what"] for d in fetch.downloads(folder) if d["what"].startswith("shard ") and "/images/" in d["file"])


def read_epoch(ds) -> list[int]:
    return [i for batch in ds for i in batch[2].tolist()]


# ----------------------------------------------------------------------------- two nodes x two ranks

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    import datapipe
    from torch.utils.data import DataLoader
    url, local_cache, out, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    ds = datapipe.StreamingDataset(url, local_cache=local_cache, storage_options=options, batch_size=4,
                                   return_index=True, window=2, prefetch=2)
    workers = int(os.environ.get("TEST_WORKERS", "0"))
    seen = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        loader = DataLoader(ds, batch_size=None, num_workers=workers)
        seen.append([int(i) for batch in loader for i in batch[2].tolist()])
    json.dump({"seen": seen, "folder": str(ds.cache.remote.folder)}, open(out, "w"))
""")


def test_two_nodes_two_ranks_read_every_sample_once_and_download_each_shard_once_per_node(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    procs = []
    for rank in range(4):
        node = rank // 2
        env = {**os.environ, **s3.env, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
               "LOCAL_WORLD_SIZE": "2", "TEST_WORKERS": "2" if node == 1 else "0",
               "PYTHONPATH": str(REPO)}
        cmd = [sys.executable, str(script), url, str(tmp_path / f"node{node}"), str(tmp_path / f"rank{rank}.json"),
               json.dumps(s3.storage_options)]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    starts = np.array([s.first for s in datapipe.open(built["fixed"]).manifest.shards])
    for epoch in range(2):
        everything = sorted(i for r in results for i in r["seen"][epoch])
        assert everything == list(range(N)), f"epoch {epoch}: not every sample exactly once"
    for node in range(2):
        folder = Path(results[2 * node]["folder"])
        assert folder.parent == tmp_path / f"node{node}"
        counts = shard_downloads(folder)
        read = {int(np.searchsorted(starts, i, side="right") - 1) for r in results[2 * node: 2 * node + 2]
                for epoch in r["seen"] for i in epoch}
        assert counts and max(counts.values()) == 1, counts  # once per node over both epochs: the cache holds it
        assert {f"shard {s:06d}.zarr" for s in read} <= set(counts)


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    import datapipe
    url, local_cache, out, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    dist.init_process_group("gloo")
    ds = datapipe.StreamingDataset(url, local_cache=local_cache, storage_options=options, batch_size=4,
                                   return_index=True, window=2, prefetch=2, cache_limit=int(sys.argv[5]))
    seen = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        mine = []
        for batch in ds:
            mine += batch[2].tolist()
            dist.barrier()  # the ranks step together, as a training step's all-reduce makes them
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        seen.append(everyone)
    if dist.get_rank() == 0:
        json.dump({"seen": seen, "folder": str(ds.cache.remote.folder), "nodes": ds.nodes}, open(out, "w"))
    dist.destroy_process_group()
""")


def test_torchrun_ranks_stream_every_sample_once_per_epoch(s3, built, tmp_path):
    """Real ranks started by torchrun (gloo, one node): every sample once per epoch over the ranks, each shard
    downloaded once per epoch at most while the cache_limit holds four windows."""
    url = upload(s3, built["fixed"])
    script = tmp_path / "rank.py"
    script.write_text(TORCHRUN_SCRIPT)
    shard_bytes = datapipe.open(built["fixed"]).manifest.shards[0].nbytes
    # four windows of two shards: the current window, the one prefetched, and room for the ranks to drift
    # apart by a window on a busy machine (at three windows, 1 run in 6 beside a busy core downloaded a
    # shard twice in one epoch)
    limit = 8 * shard_bytes + 20_000
    out = tmp_path / "out.json"
    env = {**os.environ, **s3.env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script), url, str(tmp_path / "lc"),
           str(out), json.dumps(s3.storage_options), str(limit)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["nodes"] == 1
    for epoch, ranks in enumerate(result["seen"]):
        assert len(ranks) == 2 and all(ranks), "both ranks read"
        assert sorted(i for r in ranks for i in r) == list(range(N)), f"epoch {epoch}: not every sample exactly once"
    downloads = [d for d in fetch.downloads(Path(result["folder"])) if "/images/" in d["file"]]
    per_shard = Counter(d["what"] for d in downloads)
    assert set(per_shard) == {f"shard {s:06d}.zarr" for s in range(15)}
    assert max(per_shard.values()) <= 2, per_shard  # at most once per epoch on the node, whichever rank fetched it


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ----------------------------------------------------------------------------- eviction


def test_eviction_keeps_the_limit_and_never_deletes_a_foreign_file(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    local = tmp_path / "lc"
    shard_bytes = datapipe.open(built["fixed"]).manifest.shards[0].nbytes
    limit = 5 * shard_bytes + 20_000  # five shards and the small files
    ds = open_remote(s3, url, local, cache_limit=limit, window=2, prefetch=1)
    folder = ds.cache.remote.folder
    foreign = [local / "notes.txt", folder / "mine.bin", folder / "shards" / "000003.zarr" / "extra.bin"]
    for f in foreign:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 50_000)
    for epoch in range(2):
        ds.set_epoch(epoch)
        assert sorted(read_epoch(ds)) == list(range(N))
        counted = sum(p.stat().st_size for p in folder.rglob("*")
                      if p.is_file() and not p.name.startswith(".") and p not in foreign)
        assert counted <= limit
    assert sum(shard_downloads(folder).values()) > 15  # shards were evicted and downloaded again
    for f in foreign:
        assert f.read_bytes() == b"x" * 50_000


def test_eviction_never_deletes_through_a_folder_linked_into_the_node_cache(s3, built, tmp_path):
    """A shard's images/ moved out of the node cache and linked back keeps each file's inode, size and time: the
    record matched, and eviction deleted the file behind the link, outside the node cache."""
    url = upload(s3, built["fixed"])
    local = tmp_path / "lc"
    shard_bytes = datapipe.open(built["fixed"]).manifest.shards[0].nbytes
    ds = open_remote(s3, url, local, cache_limit=5 * shard_bytes + 20_000, window=2, prefetch=1, shuffle=False)
    next(iter(ds))  # shard 0 downloaded
    images = next(p for p in ds.cache._shard_path(0).parents if p.name == "images")  # .../000000.zarr/images
    elsewhere = tmp_path / "elsewhere"
    images.rename(elsewhere)
    images.symlink_to(elsewhere)
    before = {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()}
    assert before
    with pytest.raises(CacheError, match=r"images is a symbolic link or a mount point inside the node cache .* remove it"):
        for epoch in range(2):
            ds.set_epoch(epoch)
            read_epoch(ds)
    assert {p: p.read_bytes() for p in elsewhere.rglob("*") if p.is_file()} == before


def test_the_node_cache_never_downloads_into_a_folder_behind_a_link(s3, built, tmp_path):
    """The node cache's shards/ linked to a folder elsewhere: each shard was downloaded behind the link (written into
    the user's folder, eight times over), then refused as a link."""
    url = upload(s3, built["fixed"])
    local = tmp_path / "lc"
    ds = open_remote(s3, url, local, shuffle=False, prefetch=0)
    shards = ds.cache.root / "shards"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "mine.txt").write_text("mine")
    if shards.exists():
        shutil.rmtree(shards)
    shards.symlink_to(elsewhere)
    with pytest.raises(CacheError, match=r"shards is a symbolic link or a mount point inside the node cache"):
        read_epoch(ds)
    assert sorted(p.name for p in elsewhere.rglob("*")) == ["mine.txt"]  # nothing written behind the link


def test_a_node_cache_build_folder_linked_elsewhere_is_refused_not_left_out_of_its_limit(s3, built, tmp_path):
    """local_cache/<build> moved to another disk and linked back: eviction skipped it (a link), and the node cache
    held 185 KB against a cache_limit of 119 KB."""
    url = upload(s3, built["fixed"])
    local = tmp_path / "lc"
    ds = open_remote(s3, url, local, shuffle=False, prefetch=0)
    next(iter(ds))
    folder = ds.cache.root
    moved = tmp_path / "other-disk"
    folder.rename(moved)
    folder.symlink_to(moved)
    with pytest.raises(CacheError, match=r"is a symbolic link \(to .*other-disk\): a node cache keeps its shards, and "
                                         r"its limit, in a folder of its own"):
        open_remote(s3, url, local, shuffle=False, prefetch=0)


@pytest.mark.parametrize("damage", ["local_cache removed", "locks removed", "partial made a file"])
def test_a_node_cache_removed_under_a_running_reader_is_one_line_saying_so(s3, built, tmp_path, damage):
    """`rm -rf local_cache` (or of its lock folder) mid-epoch ended the loop with a raw FileNotFoundError of a lock
    file, and a file where its download folder belongs with a raw FileExistsError."""
    url = upload(s3, built["fixed"])
    local = tmp_path / "lc"
    ds = open_remote(s3, url, local, shuffle=False, prefetch=0)
    it = iter(ds)
    next(it)
    folder = ds.cache.root
    if damage == "local_cache removed":
        shutil.rmtree(local)
    elif damage == "locks removed":
        shutil.rmtree(folder / ".datapipe-locks")
    else:
        shutil.rmtree(folder / ".datapipe-partial", ignore_errors=True)
        (folder / ".datapipe-partial").write_text("x")
    with pytest.raises(CacheError, match=r"(is gone|is in the way \(a file where a folder of it belongs\)) while shard "
                                         r"\d+\.zarr was made local: its folders were removed or replaced while readers "
                                         r"used it"):
        for _ in it:
            pass
    assert len(read_epoch(open_remote(s3, url, tmp_path / "fresh", shuffle=False, prefetch=0))) == len(ds.cache)


def test_a_node_copy_removed_under_another_processs_reader_is_named_not_blamed_on_the_lock(s3, built, tmp_path):
    """The shards of a node cache removed while a DataLoader worker read one: its sibling waited the whole timeout for
    the lock, then said "never free to download it; raise timeout=", which cannot help."""
    url = upload(s3, built["fixed"])
    local = tmp_path / "lc"
    reader = open_remote(s3, url, local, shuffle=False, prefetch=0)
    read_epoch(reader)
    held = reader.cache.remote.hold(0)  # another reader's hold (a lock of its own open file, as another process's)
    try:
        os.unlink(reader.cache._shard_path(0))
        other = open_remote(s3, url, local, shuffle=False, prefetch=0, timeout=1)
        with pytest.raises(CacheError, match=r"shard 000000\.zarr: this node's copy of it was removed from .* while "
                                             r"another process reads it .* stop the readers and run again"):
            read_epoch(other)
    finally:
        held.release()
    size = len(reader.cache)
    reader.close()  # the readers stopped, as told: the next run downloads it again
    assert len(read_epoch(open_remote(s3, url, local, shuffle=False, prefetch=0, timeout=5))) == size


def test_a_foreign_file_at_a_shard_path_is_refused_not_replaced(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    data = ds.cache._shard_path(0)
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_bytes(b"y" * ds.cache.manifest.shards[0].nbytes)
    with pytest.raises(CacheError, match=r"1 file that is not what datapipe downloaded there.*000000\.zarr.*remove the folder"):
        next(iter(ds))
    assert data.read_bytes() == b"y" * ds.cache.manifest.shards[0].nbytes


# ----------------------------------------------------------------------------- faults

KILL_SCRIPT = textwrap.dedent("""
    import json, sys
    import datapipe
    url, local_cache, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    ds = datapipe.StreamingDataset(url, local_cache=local_cache, storage_options=options, batch_size=4,
                                   shuffle=False, prefetch=0)
    print("opened", flush=True)
    sys.stdin.readline()
    for batch in ds:
        pass
""")


def test_a_rank_killed_mid_download_leaves_no_partial_shard_and_the_next_reader_completes_it(s3, tmp_path):
    big = build_index_cache(tmp_path / "big", 48, size=320, shard_size=48)  # one shard of ~15 MB
    url = upload(s3, big)
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    local = tmp_path / "lc"
    proc = subprocess.Popen([sys.executable, str(script), url, str(local), json.dumps(s3.storage_options)],
                            env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "opened"
        folder = next(p for p in local.iterdir() if p.is_dir())
        final = folder / "shards" / "000000.zarr" / "images" / "c" / "0" / "0" / "0" / "0"
        s3.pause()  # the download starts and stalls: killed with nothing (or part) of the shard written
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        lock = folder / fetch.LOCKS / "000000.zarr.lock"
        for _ in range(1000):  # until the rank holds the shard's download lock
            if lock.exists() and _locked(lock):
                break
            time.sleep(0.01)
        else:
            pytest.fail("the rank never started downloading")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        s3.resume()
    assert not final.exists()
    ds = datapipe.StreamingDataset(url, local_cache=local, storage_options=s3.storage_options, batch_size=16,
                                   return_index=True, shuffle=False, prefetch=0)
    assert sorted(read_epoch(ds)) == list(range(48))
    assert final.stat().st_size == ds.cache.manifest.shards[0].nbytes
    assert not [p for p in folder.rglob("*") if fetch.PART in p.name]  # the killed download's temporary file too


def _locked(path: Path) -> bool:
    import fcntl

    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.mark.parametrize("layout,altered", [("fixed", "data"), ("indexed", "data"), ("indexed", "index")])
def test_a_shard_altered_in_the_store_is_an_error_naming_it_after_the_retries(s3, built, tmp_path, layout, altered):
    url = upload(s3, built[layout])
    fs = s3.filesystem()
    rel = "shards/000002.zarr/images/c/0" + ("/0/0/0" if layout == "fixed" else "")
    if altered == "index":  # downloaded beside the data file, at the same time
        rel = fetch.index_path(Path("shards/000002.zarr")).as_posix()
    data = bytearray(fs.cat_file(f"{url.removeprefix('s3://')}/{rel}"))
    data[100] ^= 0xFF  # same size, another checksum
    fs.pipe_file(f"{url.removeprefix('s3://')}/{rel}", bytes(data))
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    with pytest.raises(CorruptShardError, match=r"shard 000002\.zarr.*3 downloads in a row; the object was altered "
                                                r"after the build: rerun the same `datapipe build` with --verify"):
        read_epoch(ds)
    folder = ds.cache.remote.folder
    assert not (folder / rel).exists()
    assert not [p for p in folder.rglob("*") if fetch.PART in p.name]
    assert shard_downloads(folder)["shard 000001.zarr"] == 1  # the shards before it were read


@pytest.mark.parametrize("layout", ["fixed", "indexed"])
def test_an_s3_download_is_checked_as_it_is_written_and_never_read_back(s3, built, tmp_path, monkeypatch, layout):
    """On S3 the transfer takes each chunk's crc32c as it writes it (on the event loop): a whole epoch's downloads
    (data files and sample indexes, prefetched and read) read no file back for a checksum, and each file in
    place is byte for byte the built one. (A shard altered in the store is still found: the test above.)"""
    url = upload(s3, built[layout])
    read_back: list[str] = []
    for name in ("crc32c_range", "file_crc32c"):
        real = getattr(fetch, name)
        monkeypatch.setattr(fetch, name, lambda *a, real=real, name=name, **k: (read_back.append(name), real(*a, **k))[1])
    ds = open_remote(s3, url, tmp_path / "lc", prefetch=2)
    assert sorted(read_epoch(ds)) == list(range(N))
    ds.cache.remote.close()
    folder = ds.cache.remote.folder
    files = [d["file"] for d in fetch.downloads(folder) if d["what"].startswith("shard ")]
    assert len({f for f in files if "/images/" in f}) == 15, files
    assert read_back == []
    for rel in files:
        assert (folder / rel).read_bytes() == (built[layout] / rel).read_bytes(), rel


@pytest.mark.parametrize("fault", ["stop", "pause"])
def test_a_store_that_stops_answering_mid_epoch_is_an_error_not_a_hang(s3, built, tmp_path, fault):
    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)  # a loaded store may take over 2 s to open
    batches = iter(ds)
    next(batches)  # the first shard is downloaded and read under the default deadline
    ds.cache.remote.timeout = 2.0  # then a download that receives nothing for 2 s ends
    (s3.stop if fault == "stop" else s3.pause)()
    try:
        with pytest.raises(RemoteStoreError, match=r"shard 0000\d\d\.zarr"):
            for _ in batches:
                pass
    finally:
        if fault == "pause":
            s3.resume()


# ----------------------------------------------------------------------------- arguments


def test_remote_arguments_are_checked(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    with pytest.raises(ArgumentError, match="local_cache"):
        datapipe.StreamingDataset(url, storage_options=s3.storage_options)
    with pytest.raises(ArgumentError, match="object storage"):
        datapipe.StreamingDataset(built["fixed"], local_cache=tmp_path)
    with pytest.raises(ArgumentError, match="cache_limit"):
        open_remote(s3, url, tmp_path / "a", cache_limit="lots")
    with pytest.raises(ArgumentError, match="prefetch"):
        open_remote(s3, url, tmp_path / "a", prefetch=-1)
    with pytest.raises(CacheError, match="not a finished datapipe cache"):
        open_remote(s3, url + "-missing", tmp_path / "a")


def test_open_reads_a_cache_in_object_storage_through_a_node_local_folder(s3, built, tmp_path):
    """datapipe.open takes the URLs StreamingDataset takes (a URL without local_cache, or object-storage
    arguments for a folder, are one ArgumentError each), and reads the samples the local cache holds."""
    url = upload(s3, built["indexed"])
    local = datapipe.open(built["indexed"])
    remote = datapipe.open(url, local_cache=tmp_path / "lc", storage_options=s3.storage_options)
    assert remote.classes == local.classes and len(remote) == len(local) and remote.encoding == local.encoding
    for i in (0, len(local) // 2, len(local) - 1):
        assert np.array_equal(remote[i][0], local[i][0]) and remote[i][1] == local[i][1]
        assert remote.path(i) == local.path(i)
    with pytest.raises(ArgumentError, match="pass local_cache="):
        datapipe.open(url, storage_options=s3.storage_options)
    with pytest.raises(ArgumentError, match="storage_options, timeout: for a cache in object storage"):
        datapipe.open(built["indexed"], storage_options={}, timeout=5)
    with pytest.raises(ArgumentError, match="a datapipe.Cache is already open"):
        datapipe.StreamingDataset(local, local_cache=tmp_path / "lc")


@pytest.mark.parametrize(("text", "value"), [("200GB", 200 * 10**9), ("1.5 GiB", 3 * 2**29), ("500mb", 500 * 10**6),
                                             ("1024", 1024), (4096, 4096), ("0", 0), ("0.1 KB", 100),
                                             ("9" * 30 + "GB", int("9" * 30) * 10**9)])
def test_sizes_parse(text, value):
    assert fetch.parse_size(text, "cache_limit") == value


@pytest.mark.parametrize("bad", ["-1GB", "GB", "1 parsec", True, 1.5, None, -5, "9" * 400 + "GB", "1" * 5000])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ArgumentError, match="cache_limit"):
        fetch.parse_size(bad, "cache_limit")


def test_indexed_cache_reads_samples_at_their_shapes(s3, built, tmp_path):
    url = upload(s3, built["indexed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False)
    local = datapipe.open(built["indexed"])
    assert np.array_equal(ds.cache.shapes, local.shapes)  # every sample index downloaded and checked
    for images, _, index in ds:
        for image, i in zip(images, index.tolist(), strict=True):
            assert np.array_equal(image.numpy(), local[i][0])


def test_prefetch_runs_ahead_of_the_reader_after_the_first_batch_and_no_further_than_its_depth(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    # one shard a batch (window 1, the cache's own order, batches of a shard's size): batch k reads shard k
    ds = open_remote(s3, url, tmp_path / "lc", order="shards", window=1, shuffle=False, batch_size=SHARD, prefetch=3)
    it = iter(ds)
    first = next(it)
    assert first[2].tolist() == list(range(SHARD))
    folder = ds.cache.remote.folder
    end = time.monotonic() + 30
    while len(shard_downloads(folder)) < 4 and time.monotonic() < end:
        time.sleep(0.02)
    time.sleep(0.3)  # a prefetch beyond the depth would have started by now
    names = sorted(s.name for s in ds.cache.manifest.shards)
    assert set(shard_downloads(folder)) == {f"shard {name}" for name in names[:4]}  # the one read and 3 ahead
    rest = [i for batch in it for i in batch[2].tolist()]
    assert rest == list(range(SHARD, N))
    assert sorted(shard_downloads(folder).values()) == [1] * len(names)


def prefetch_threads(besides: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("datapipe-prefetch") and t not in besides]


@pytest.mark.parametrize("how", ["close", "collected"])
def test_a_reader_closed_or_collected_mid_epoch_leaves_no_prefetch_thread_behind(s3, built, tmp_path, how):
    url = upload(s3, built["fixed"])
    earlier = frozenset(prefetch_threads())  # another test's reader, not collected yet
    ds = open_remote(s3, url, tmp_path / "lc", order="shards", window=1, shuffle=False, batch_size=SHARD, prefetch=2)
    it = iter(ds)
    next(it)
    end = time.monotonic() + 30
    while not prefetch_threads(earlier) and time.monotonic() < end:
        time.sleep(0.02)
    assert prefetch_threads(earlier), "the plan's prefetch threads wait for the reader to move on"
    if how == "close":
        ds.close()
    else:
        del it, ds
        gc.collect()
    end = time.monotonic() + 10
    while prefetch_threads(earlier) and time.monotonic() < end:
        time.sleep(0.05)
    assert not prefetch_threads(earlier)


def test_a_store_that_stops_answering_mid_epoch_is_one_error_after_the_timeout_not_two(s3, built, tmp_path):
    """The reader met a shard whose prefetch was stalled by the silent store: it waited out that download's
    timeout, then downloaded the shard itself for a second one; the prefetch's RemoteStoreError is the answer."""
    url = upload(s3, built["fixed"])
    timeout = 4.0
    ds = open_remote(s3, url, tmp_path / "lc", order="shards", window=1, shuffle=False, batch_size=SHARD, prefetch=2,
                     timeout=timeout)
    it = iter(ds)
    next(it)
    s3.pause()
    started = time.monotonic()
    try:
        with pytest.raises(datapipe.errors.RemoteStoreError, match=r"check that (the store|it) is up, or raise timeout="):
            for _ in it:
                pass
        took = time.monotonic() - started
    finally:
        s3.resume()
        ds.close()
    assert took < 1.75 * timeout, took


def test_the_temporary_files_killed_downloads_left_are_removed_by_the_next_download(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    fetcher = ds.cache.remote
    folder = fetcher.folder
    rel = fetcher._rel_data(1)
    left = [folder / fetch.PARTIAL / f"{fetcher._temp_name(rel)}999999-deadbeef",  # a killed download's
            folder / f"{rel}{fetch.PART}999999-deadbeef"]  # beside the file's place (earlier versions)
    foreign = folder / fetch.PARTIAL / "notes.txt"
    for path in (*left, foreign):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    assert sorted(read_epoch(ds)) == list(range(N))
    assert not any(path.exists() for path in left)
    assert foreign.read_bytes() == b"partial"  # not a temporary file of a download: kept
    assert not [p for p in folder.rglob("*") if fetch.PART in p.name]


@pytest.mark.parametrize("layout", ["fixed", "indexed"])
def test_a_node_local_cache_folder_verifies_what_was_downloaded_and_names_its_url_when_opened_alone(
        s3, built, tmp_path, layout):
    url = upload(s3, built[layout])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0, batch_size=SHARD)
    it = iter(ds)
    next(it), next(it)  # two shards downloaded, the rest not
    ds.cache.remote.close()
    folder = ds.cache.remote.folder

    def verify() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "datapipe.cli", "verify", str(folder)], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)

    proc = verify()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"the node-local cache of {url}: 2 of 15 shards downloaded, checked against the manifest: OK" in proc.stdout
    with pytest.raises(CacheError, match=rf"shard 000002\.zarr .* has not been downloaded: .* node-local cache of {url}"):
        datapipe.open(folder)
    data = folder / ds.cache.remote._rel_data(1)
    damaged = bytearray(data.read_bytes())
    damaged[10] ^= 0xFF
    os.chmod(data, 0o644)
    data.write_bytes(bytes(damaged))
    proc = verify()
    assert proc.returncode == 1
    assert "shard 000001.zarr: checksum" in proc.stdout and f"({data}); delete it" in proc.stdout
    assert "1 problem" in proc.stdout


EXIT_MID_DOWNLOAD = textwrap.dedent("""
    import json, sys, threading
    import datapipe
    from datapipe import fetch
    url, local_cache, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    ds = datapipe.StreamingDataset(url, local_cache=local_cache, storage_options=options, batch_size=8, prefetch=0)
    fetcher = ds.cache.remote
    begun = threading.Event()

    def stalled(rel, tmp, what, progress, meanwhile=None):  # the store sends part of the object, then nothing
        with open(tmp, "wb") as f:
            f.write(b"part of a shard")
        begun.set()
        threading.Event().wait()

    fetcher._transfer = stalled
    threading.Thread(target=fetcher.download, args=(3,), daemon=True).start()  # as a prefetch thread does
    assert begun.wait(60)
    print(len([p for p in (fetcher.folder / fetch.PARTIAL).iterdir() if fetch.PART in p.name]), flush=True)
""")


def test_a_process_ending_while_a_thread_downloads_leaves_no_temporary_file(s3, built, tmp_path):
    """The script ends while a daemon thread's download is in flight (its clean-up never runs: the interpreter
    stops such threads where they are): the temporary file is removed at exit all the same."""
    url = upload(s3, built["fixed"])
    script = tmp_path / "exit_mid_download.py"
    script.write_text(EXIT_MID_DOWNLOAD)
    proc = subprocess.run([sys.executable, str(script), url, str(tmp_path / "lc"), json.dumps(s3.storage_options)],
                          env={**os.environ, **s3.env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["1"], proc.stdout + proc.stderr
    [folder] = [p for p in (tmp_path / "lc").iterdir() if p.is_dir()]
    assert not [p.name for p in (folder / fetch.PARTIAL).iterdir()]


def test_opening_reclaims_the_temporary_files_of_killed_downloads_that_no_process_is_downloading(s3, built, tmp_path):
    import fcntl

    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    fetcher = ds.cache.remote
    partial = fetcher.folder / fetch.PARTIAL
    partial.mkdir(exist_ok=True)
    stale = [partial / f"{fetcher._temp_name(fetcher._rel_data(5))}999999-deadbeef",  # a shard never read again
             partial / f"{fetcher._temp_name('labels.npy')}999999-deadbeef"]  # a file of the manifest's
    busy = partial / f"{fetcher._temp_name(fetcher._rel_data(6))}999998-cafecafe"  # its download runs now
    foreign = [partial / "notes.txt", partial / f"{fetcher._temp_name('shards/other.zarr/x/y')}1-00000000"]
    for path in (*stale, busy, *foreign):
        path.write_bytes(b"partial")
    holder = os.open(fetcher._lock_path(ds.cache.manifest.shards[6].name), os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # as the downloading process holds it
        open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    finally:
        os.close(holder)
    assert not any(path.exists() for path in stale)
    assert busy.exists() and all(path.exists() for path in foreign)


def test_a_folder_over_its_limit_is_brought_back_under_it_when_an_iteration_starts(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    everything = open_remote(s3, url, tmp_path / "lc", shuffle=False)
    assert sorted(read_epoch(everything)) == list(range(N))  # every shard local: nothing more to download
    folder = everything.cache.remote.folder
    shard = max(s.nbytes for s in everything.cache.manifest.shards)
    limit = 4 * shard + 100_000
    everything.cache.remote.close()
    del everything  # its open shard files closed: they may be evicted
    gc.collect()

    def shard_bytes() -> int:
        return sum(p.stat().st_size for p in (folder / "shards").rglob("*") if p.is_file() and "/images/" in p.as_posix())

    assert shard_bytes() > limit
    limited = open_remote(s3, url, tmp_path / "lc", shuffle=False, cache_limit=limit, order="shards", window=1,
                          batch_size=SHARD, prefetch=1)
    it = iter(limited)
    next(it)
    assert shard_bytes() <= limit  # evicted down to the limit, though no download asked for room
    assert sorted(i for batch in it for i in batch[2].tolist()) == list(range(SHARD, N))


def test_a_cache_limit_below_one_shard_reads_every_sample_and_its_warning_adds_up(s3, built, tmp_path, caplog):
    """The warning said "holds 8,625 bytes ...; the cache_limit of 160,000 is exceeded": it left out the shard
    being downloaded, which is what exceeds the limit."""
    import re

    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False)
    limit = min(s.nbytes for s in ds.cache.manifest.shards if s.count) // 2
    ds = open_remote(s3, url, tmp_path / "lc2", shuffle=False, cache_limit=limit, prefetch=0)
    with caplog.at_level("WARNING", logger="datapipe"):
        assert sorted(read_epoch(ds)) == list(range(N))
    [line] = [r.getMessage() for r in caplog.records if "cache_limit" in r.getMessage()]
    held, coming, told = (int((x or "0").replace(",", "")) for x in re.search(
        r"holds ([\d,]+) bytes in files open for reading(?:, and ([\d,]+) more are being downloaded)?; the "
        r"cache_limit of ([\d,]+) is exceeded", line).groups())
    assert told == limit and held + coming > limit, line


def test_datasets_of_a_process_share_one_client_per_store_and_options(s3, built, tmp_path):
    """A client costs 0.2-0.4 s of CPU to make, and each dropped one left botocore's service model to the
    garbage collector (a collection of about a second, seen in a reader's batch): the datasets of a process
    with the same store, options and timeout share one filesystem; another timeout gets its own."""
    url = upload(s3, built["fixed"])
    a = open_remote(s3, url, tmp_path / "a")
    b = open_remote(s3, url, tmp_path / "b")
    c = open_remote(s3, url, tmp_path / "c", timeout=7)
    assert sorted(read_epoch(a)) == sorted(read_epoch(b)) == list(range(N))
    fs = [ds.cache.remote.filesystem()[0] for ds in (a, b, c)]
    assert fs[0] is fs[1] and fs[2] is not fs[0]


# ----------------------------------------------------------------------------- a cache rebuilt in place


def test_a_node_cache_of_a_cache_rebuilt_in_place_serves_the_new_shards(tmp_path):
    """An incremental rebuild (a source image removed, then one added) keeps the build id, so the node's
    folder is reused: every shard the rebuild changed is downloaded again, never served with the new labels
    (the node cache served the earlier build's pixels for every sample of a changed shard)."""
    from datapipe.builder import Cluster, build

    cache = build_index_cache(tmp_path / "b", 40, shard_size=SHARD)
    source = cache.parent / "source"
    url, node = "file://" + str(cache), tmp_path / "node"

    def epoch(ds) -> tuple[np.ndarray, np.ndarray]:
        batches = list(ds)
        return np.concatenate([b[0].numpy() for b in batches]), np.concatenate([b[1].numpy() for b in batches])

    def streamed_equals_in_place() -> int:
        images, labels = epoch(datapipe.StreamingDataset(url, batch_size=8, shuffle=False, local_cache=node))
        want_images, want_labels = epoch(datapipe.StreamingDataset(cache, batch_size=8, shuffle=False))
        assert np.array_equal(labels, want_labels)
        assert np.array_equal(images, want_images), "the node cache served another build's pixels"
        return len(labels)

    assert streamed_equals_in_place() == 40
    build_id = json.loads((cache / "manifest.json").read_text())["build_id"]
    first = sorted(p for p in source.rglob("*") if p.is_file())[0]
    first.unlink()
    for _ in range(2):
        report = build(source, cache, size=32, shard_size=SHARD, cluster=Cluster(scheduler="sync"), progress=False)
        assert report.shards_built > 0 and json.loads((cache / "manifest.json").read_text())["build_id"] == build_id
        assert streamed_equals_in_place() == report.num_samples
        (first.parent / ("z" + first.name)).write_bytes(sorted(p for p in source.rglob("*") if p.is_file())[-1].read_bytes())


# ----------------------------------------------------------------------------- a node cache copied, damaged, full, read-only


def _fill(s3, url: str, local: Path, **kwargs) -> Path:
    """Read a whole epoch into the node cache ``local``; returns the build's folder in it."""
    ds = open_remote(s3, url, local, shuffle=False, **kwargs)
    assert sorted(read_epoch(ds)) == list(range(N))
    ds.cache.remote.close()
    return ds.cache.remote.folder


@pytest.mark.parametrize("layout", ["fixed", "indexed"])
def test_a_copied_node_cache_is_read_without_downloading_anything_again(s3, built, tmp_path, layout):
    """A node cache copied with its times (cp -a: new inodes), as when it is moved, restored or baked into an
    image: each file in place whose size and crc32c are the manifest's is taken as this node's download."""
    import shutil

    url = upload(s3, built[layout])
    first = _fill(s3, url, tmp_path / "lc", prefetch=0)
    shutil.copytree(tmp_path / "lc", tmp_path / "copy", symlinks=True)
    folder = tmp_path / "copy" / first.name
    logged = len(fetch.downloads(folder))
    for _ in range(2):
        ds = open_remote(s3, url, tmp_path / "copy", shuffle=False, prefetch=2)
        assert sorted(read_epoch(ds)) == list(range(N))
        ds.cache.remote.close()
    assert len(fetch.downloads(folder)) == logged  # nothing downloaded
    for rel in {d["file"] for d in fetch.downloads(folder)}:
        assert (folder / rel).read_bytes() == (built[layout] / rel).read_bytes(), rel


def test_damaged_files_in_a_node_cache_are_named_together_and_never_deleted(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    folder = _fill(s3, url, tmp_path / "lc", prefetch=0)
    flipped = folder / "shards/000000.zarr/images/c/0/0/0/0"  # same size: found by its checksum when it is read
    truncated = folder / "shards/000009.zarr/images/c/0/0/0/0"  # found by a stat
    data = bytearray(flipped.read_bytes())
    data[100] ^= 0xFF
    flipped.write_bytes(bytes(data))
    os.truncate(truncated, 1000)
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    with pytest.raises(CacheError) as caught:
        next(iter(ds))
    message = str(caught.value)
    assert "2 files that are not what datapipe downloaded there" in message, message
    assert "shards/000000.zarr/images/c/0/0/0/0 (checksum" in message, message
    assert "shards/000009.zarr/images/c/0/0/0/0 (1,000 bytes, the manifest's" in message, message
    assert f"remove the folder {folder}" in message and "\n" not in message, message
    assert flipped.read_bytes() == bytes(data) and truncated.stat().st_size == 1000


def test_a_full_local_disk_is_a_local_error_naming_the_folder_not_the_store(s3, built, tmp_path, monkeypatch):
    import errno

    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)

    async def full(fs, rpath, lpath, progress):
        with open(lpath, "wb") as f:
            f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fetch, "_s3_get", full)
    started = time.monotonic()
    with pytest.raises(CacheError, match=rf"local_cache {tmp_path / 'lc'}: No space left on device while shard 000000\.zarr "
                                         r".*MiB free on its disk now; no cache_limit is set"):
        next(iter(ds))
    assert time.monotonic() - started < 2  # not retried until the timeout, as a store's failure is
    assert not [p for p in (tmp_path / "lc").rglob("*") if fetch.PART in p.name]


@pytest.mark.parametrize(("disk", "limit", "advice"), [
    ("few entries", 10**9, r"; 7 file entries \(inodes\) are left on its disk, whatever its free bytes \(`df -i` shows "
                           r"them\): free some there, or put local_cache on another file system"),
    ("small", 10**9, r", 0.4 MiB free on its disk now; its cache_limit of 1,000,000,000 bytes is more than its disk holds: "
                     r"lower it"),
    ("large", 10**4, r", 3,906.2 MiB free on its disk now, [\d,]+ bytes held by its downloaded shards, though its cache_limit of "
                     r"10,000 bytes is within what the disk holds: the shards open for reading at once .* or other files "
                     r"there outgrew the disk; free space there, or read fewer shards at once"),
])
def test_a_full_node_cache_disk_is_told_apart_from_a_limit_set_too_high(s3, built, tmp_path, monkeypatch, disk, limit,
                                                                        advice):
    """Every full disk under a cache_limit was "its cache_limit is more than its disk holds: lower it": also a disk
    out of file entries (inodes), and a limit well within the disk, which the shards open for reading (never
    evicted) or other files outgrew, where lowering it changes nothing."""
    import errno
    import types

    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0, cache_limit=limit)
    blocks = {"few entries": 10**6, "small": 100, "large": 10**6}[disk]  # of 4 KiB: 4 GB, or 400 KB, free
    statvfs = types.SimpleNamespace(f_bavail=blocks, f_blocks=2 * 10**6, f_frsize=4096, f_files=10**6,
                                    f_favail=7 if disk == "few entries" else 10**5)
    monkeypatch.setattr(fetch.os, "statvfs", lambda _: statvfs)

    async def full(fs, rpath, lpath, progress):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fetch, "_s3_get", full)
    with pytest.raises(CacheError, match=rf"local_cache {tmp_path / 'lc'}: No space left on device while shard 000000\.zarr "
                                         rf"was downloaded into it{advice}"):
        next(iter(ds))


def test_a_node_cache_disk_full_at_its_eviction_lock_is_a_cache_error(s3, built, tmp_path, monkeypatch):
    """Making room before a plan opens the eviction's lock file on the node's disk: out of file entries there, the
    iteration ended in a raw OSError traceback."""
    import errno

    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0, cache_limit=10**9)
    real = fetch._open_step_lock

    def no_entry_left(path):
        if path.endswith(fetch.EVICT_LOCK):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path)

    monkeypatch.setattr(fetch, "_open_step_lock", no_entry_left)
    with pytest.raises(CacheError, match=rf"local_cache {tmp_path / 'lc'}: No space left on device while making room "
                                         "for the shards to read"):
        next(iter(ds))


@needs_mounts
def test_a_node_cache_on_a_disk_full_before_it_is_opened_is_a_full_disk_not_an_unwritable_folder(s3, built, tmp_path):
    """The disk a previous job filled: opening said "cannot be used (No space left on device); pass a writable local
    folder" (an ArgumentError), where the folder is writable and the disk is full."""
    url = upload(s3, built["fixed"])
    script = textwrap.dedent("""
        import json, sys
        import datapipe
        try:
            datapipe.StreamingDataset(sys.argv[1], local_cache=sys.argv[2], storage_options=json.loads(sys.argv[3]),
                                      batch_size=8, timeout=30)
        except datapipe.errors.DatapipeError as exc:
            print(type(exc).__name__, exc)
    """)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$1" && '
                           '(head -c 1000000 /dev/zero > "$1/another-job"; exec "$2" -c "$3" "$4" "$1/lc" "$5")', "sh",
                           str(mnt), sys.executable, script, url, json.dumps(s3.storage_options)],
                          capture_output=True, text=True, env={**os.environ, **s3.env}, timeout=120)
    kind, _, message = proc.stdout.strip().partition(" ")
    assert kind == "CacheError", proc.stdout + proc.stderr[-2000:]
    assert message.startswith(f"local_cache {mnt}/lc: No space left on device while its folders were made, 0.0 MiB "
                              "free on its disk now; no cache_limit is set"), message


def test_a_file_size_limit_on_the_node_cache_is_a_local_error_at_once(s3, built, tmp_path):
    """A real RLIMIT_FSIZE (`ulimit -f`) below a shard's size: the download fails with EFBIG, which is this machine's
    limit, not the store's failure: one CacheError naming local_cache and the limit, with no retry until the timeout,
    and no temporary file left."""
    import resource

    url = upload(s3, built["fixed"])
    script = textwrap.dedent("""
        import json, sys, time
        import datapipe
        ds = datapipe.StreamingDataset(sys.argv[1], local_cache=sys.argv[2], storage_options=json.loads(sys.argv[3]),
                                       batch_size=8, timeout=30)
        started = time.monotonic()
        try:
            next(iter(ds))
        except datapipe.errors.CacheError as exc:
            print(f"{time.monotonic() - started:.1f}", type(exc).__name__, exc)
    """)
    shard = max(s.nbytes for s in datapipe.open(built["fixed"]).manifest.shards)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (shard // 2, shard // 2))

    proc = subprocess.run([sys.executable, "-c", script, url, str(tmp_path / "lc"), json.dumps(s3.storage_options)],
                          capture_output=True, text=True, env={**os.environ, **s3.env}, timeout=120, preexec_fn=limit)
    seconds, kind, message = proc.stdout.strip().split(" ", 2)
    assert kind == "CacheError" and float(seconds) < 10, proc.stdout + proc.stderr
    assert message.startswith(f"local_cache {tmp_path / 'lc'}: File too large while shard ") and "`ulimit -f`" in message
    assert not [p for p in (tmp_path / "lc").rglob("*") if fetch.PART in p.name]


def test_a_read_only_node_cache_is_one_argument_error_even_when_every_shard_is_local(s3, built, tmp_path, monkeypatch):
    import errno

    url = upload(s3, built["fixed"])
    _fill(s3, url, tmp_path / "lc", prefetch=0)

    def read_only(self, name):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self._lock_path(name)))

    monkeypatch.setattr(fetch.ShardFetcher, "_lock_fd", read_only)
    with pytest.raises(ArgumentError, match=rf"^local_cache {tmp_path / 'lc'} cannot be used \(Read-only file system\); "
                                            "pass a writable local folder$"):
        open_remote(s3, url, tmp_path / "lc")


def test_the_wait_for_another_process_download_names_the_lock_file(s3, built, tmp_path):
    import fcntl

    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)  # opened under the default deadline:
    ds.cache.remote.timeout = 1  # the store's requests on a loaded machine may take over a second; the wait is local
    lock = ds.cache.remote.folder / fetch.LOCKS / "000003.zarr.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process downloading shard 3, with nothing arriving
        with pytest.raises(RemoteStoreError) as caught:
            ds.cache.remote.hold(3)
    finally:
        os.close(fd)
    assert f"(lock {lock})" in str(caught.value), str(caught.value)


def test_storage_options_the_filesystem_does_not_take_are_argument_errors(s3, built, tmp_path):
    url = upload(s3, built["fixed"])
    with pytest.raises(ArgumentError, match=r"storage option 'bogus' is not an option of the s3:// filesystem"):
        datapipe.StreamingDataset(url, local_cache=tmp_path / "lc", storage_options={**s3.storage_options, "bogus": 1})
    with pytest.raises(ArgumentError, match=r"'endpoint' is not an option .*did you mean 'endpoint_url'"):
        datapipe.StreamingDataset(url, local_cache=tmp_path / "lc", storage_options={"endpoint": s3.storage_options["endpoint_url"]})
    with pytest.raises(ArgumentError, match=r"storage option 'key' must be a string, got 12345678 \(int\)"):
        datapipe.StreamingDataset(url, local_cache=tmp_path / "lc", storage_options={**s3.storage_options, "key": 12345678})
    with pytest.raises(ArgumentError, match=r"storage option 'client_kwargs' must be a mapping"):
        datapipe.StreamingDataset(url, local_cache=tmp_path / "lc", storage_options={**s3.storage_options, "client_kwargs": 5})
    assert not (tmp_path / "lc").exists()


def test_a_bucket_that_does_not_exist_is_said_so(s3, tmp_path):
    with pytest.raises(CacheError, match=r"s3://no-such-bucket-here/cache: cannot read the manifest \(FileNotFoundError: "
                                         r"The specified bucket does not exist\)"):
        open_remote(s3, "s3://no-such-bucket-here/cache", tmp_path / "lc")
    url = s3.bucket() + "/cache"
    with pytest.raises(CacheError, match=rf"{url} is not a finished datapipe cache \(no manifest.json\); build it"):
        open_remote(s3, url, tmp_path / "lc")


@pytest.mark.parametrize("change", ["rebuilt", "rebuilding"])
def test_a_cache_rebuilt_under_a_reader_says_so_and_to_reopen_it(s3, built, tmp_path, change):
    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    fs, root = s3.filesystem(), url.removeprefix("s3://")
    rel = "shards/000000.zarr/images/c/0/0/0/0"
    if change == "rebuilt":  # another build's objects under the same names
        manifest = json.loads(fs.cat_file(f"{root}/manifest.json"))
        manifest["build_id"] = "0" * 32
        fs.pipe_file(f"{root}/manifest.json", json.dumps(manifest).encode())
        data = bytearray(fs.cat_file(f"{root}/{rel}"))
        data[100] ^= 0xFF
        fs.pipe_file(f"{root}/{rel}", bytes(data))
    else:  # a rebuild removes the manifest, then the earlier build's shards
        fs.rm([f"{root}/manifest.json", f"{root}/{rel}"])
    now = "its manifest is another build's now" if change == "rebuilt" else "it has no manifest now"
    with pytest.raises(CorruptShardError, match=rf"shard 000000\.zarr: .*the cache changed since it was opened "
                                                rf"\({url} was rebuilt: {now}.*reopen the cache"):
        next(iter(ds))
    assert shard_downloads(ds.cache.remote.folder)["shard 000000.zarr"] == 0


def test_a_shard_of_a_node_cache_cut_short_under_a_reader_says_to_drop_the_nodes_copy(s3, built, tmp_path):
    """The advice was the one for a cache in a folder ("rerun the same datapipe build if it is damaged"): the store's
    objects are sound, and no build mends a node's copy."""
    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    read_epoch(ds)
    path = ds.cache._shard_path(0)
    os.truncate(path, os.path.getsize(path) // 2)
    ds.set_epoch(1)
    with pytest.raises(CorruptShardError, match=r"shard 000000\.zarr .* this node's copy changed since it was read; "
                                                r"remove the folder .*lc.* \(this node's copy of s3://"):
        read_epoch(ds)


def test_a_node_copy_opened_as_a_folder_with_a_shard_cut_short_says_to_delete_it(s3, built, tmp_path):
    """The advice was a local cache's ("move the shard's folder away and rerun the same datapipe build"): a node's
    copy has no build, and its reader downloads a deleted shard again."""
    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    read_epoch(ds)
    path = ds.cache._shard_path(0)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CacheError, match=rf"is .* bytes, expected .*: truncated or altered after the build; delete "
                                         rf".*000000\.zarr.*: the next reader of {url} downloads it again"):
        datapipe.open(ds.cache.root)


def test_an_index_altered_in_a_node_cache_says_to_drop_the_nodes_copy(s3, built, tmp_path):
    """A sample index altered in place in a node's copy (its size and times kept, so still recorded as
    downloaded) is caught by its checksum on open; the advice is to remove that node's copy, not to
    rebuild the cache in the store, whose objects are sound."""
    url = upload(s3, built["indexed"])
    folder = _fill(s3, url, tmp_path / "lc", prefetch=0)
    index = sorted(folder.glob("shards/*/index/c/0/0"))[0]
    st = index.stat()
    data = bytearray(index.read_bytes())
    data[3] ^= 0xFF
    index.write_bytes(bytes(data))
    os.utime(index, ns=(st.st_atime_ns, st.st_mtime_ns))
    ds = open_remote(s3, url, tmp_path / "lc", shuffle=False, prefetch=0)
    with pytest.raises(CorruptShardError) as err:
        read_epoch(ds)
    message = str(err.value)
    assert "sample index checksum" in message and f"remove the folder {folder}" in message, message
    assert "rerun the same `datapipe build`" not in message


@requires_s3
def test_a_child_forked_while_a_download_holds_its_lock_file_does_not_keep_it(s3, built, tmp_path):
    """A DataLoader worker forked while a thread of the parent downloaded a shard under its lock file inherited the
    descriptor, and with it the flock, after the parent's download ended: the worker's own read of that shard then
    waited for it and failed ("another process on this node has been downloading it for 60 s"). The lock files a
    thread holds for a step are closed in a forked child."""
    import fcntl

    url = upload(s3, built["fixed"])
    ds = open_remote(s3, url, tmp_path / "node", shuffle=False, timeout=5)
    fetcher = ds.cache.remote
    name = fetcher.manifest.shards[0].name
    held, release = threading.Event(), threading.Event()

    def download() -> None:  # a step of a download in a thread: the shard's lock file held exclusively
        with fetcher._locked(name, fcntl.LOCK_EX, f"shard {name}"):
            held.set()
            release.wait()

    thread = threading.Thread(target=download)
    thread.start()
    assert held.wait(30)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: once the parent's step is over, read the epoch
        code = 1
        try:
            os.close(ready_w)
            os.read(ready_r, 1)
            code = 0 if sorted(read_epoch(ds)) == list(range(N)) else 2
        finally:
            os._exit(code)
    os.close(ready_r)
    release.set()
    thread.join()
    os.write(ready_w, b"x")
    os.close(ready_w)
    deadline = time.monotonic() + 120
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child never finished its epoch")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_a_resumed_epoch_downloads_only_the_shards_read_after_its_position(built, tmp_path):
    """A rank of a node resumed mid-epoch planned its node's other ranks from the epoch's start (the resumed
    position was cleared before the plan was made): it downloaded every shard that only the part before the
    checkpoint had read. The plan starts every rank at the resumed position."""
    kwargs = dict(batch_size=8, order="shards", window=2, nodes=1, rank=0, world_size=2, return_index=True)
    ds = datapipe.StreamingDataset(built["fixed"], **kwargs)
    ds.set_epoch(1)
    before = [i for batch in itertools.islice(iter(ds), 4) for i in batch[2].tolist()]
    state = ds.state_dict()
    node = tmp_path / "node"
    resumed = datapipe.StreamingDataset("file://" + str(built["fixed"]), local_cache=node, prefetch=8, **kwargs)
    resumed.load_state_dict(state)
    after = read_epoch(resumed)
    cache = datapipe.open(built["fixed"])
    order = resumed.epoch_order()
    needed = {f"shard {cache.shard_names[s]}" for r in range(2) for b, e in partition.batch_bounds(
        N, batch_size=8, world_size=2, rank=r, drop_last=False, start=state["position"])
        for s in np.searchsorted(cache.starts, order[b:e], side="right") - 1}
    [folder] = [p for p in node.iterdir() if p.is_dir()]  # local_cache/<build id>
    downloaded = shard_downloads(folder)
    assert set(downloaded) == needed and max(downloaded.values()) == 1, (sorted(downloaded), sorted(needed))
    assert not set(before) & set(after) and len(before) == 4 * 8
