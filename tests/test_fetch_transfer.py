"""How a shard's bytes reach the node-local cache (datapipe.fetch): the checksum taken as the bytes
arrive, the check of the whole file when a transfer writes out of order, and the transfer threads
shared by a process's datasets.

The stores here are fsspec filesystems that hold objects in memory (fsspec's own MemoryFileSystem)
with transfers that write in different orders; the S3 path is tested against a real S3 server in
test_remote_stream.py.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import datapipe
from datapipe import fetch
from datapipe.files import file_crc32c
from datapipe.testing import build_index_cache


class InOrderFS(MemoryFileSystem):
    """Objects in memory, copied out in small blocks, in order (fsspec's own get_file)."""

    protocol = "dp-inorder"
    root_marker = "/"
    blocksize = 1 << 14

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix(f"{cls.protocol}://"))


class BackwardsFS(InOrderFS):
    """A transfer that sizes the file first and writes its blocks from the last to the first, counting
    each as it goes: the bytes below the count are not final while it runs."""

    protocol = "dp-backwards"
    root_marker = "/"

    def get_file(self, rpath, lpath, callback=None, outfile=None, **kwargs):
        data = self.cat_file(rpath)
        block = 1 << 14
        with open(lpath, "wb") as f:
            f.truncate(len(data))
            for start in reversed(range(0, len(data), block)):
                f.seek(start)
                f.write(data[start:start + block])
                f.flush()
                if callback is not None:
                    callback.relative_update(len(data[start:start + block]))


class WatchedFS(InOrderFS):
    """In-order transfers that note, as each starts, which prefetch threads are alive."""

    protocol = "dp-watched"
    root_marker = "/"
    seen: list[tuple[str, list[str]]] = []
    before: set[int | None] = set()  # threads alive before the test (an earlier test's, winding down): not counted

    def get_file(self, rpath, lpath, callback=None, outfile=None, **kwargs):
        alive = sorted(t.name for t in threading.enumerate()
                       if t.name.startswith("datapipe-prefetch") and t.ident not in WatchedFS.before)
        WatchedFS.seen.append((rpath, alive))
        return super().get_file(rpath, lpath, callback=callback, outfile=outfile, **kwargs)


for fs_class in (InOrderFS, BackwardsFS, WatchedFS):
    fsspec.register_implementation(fs_class.protocol, fs_class, clobber=True)


@pytest.fixture(scope="module")
def local_cache_dir(tmp_path_factory):
    # 3 KiB samples, 40 to a shard: shards of 120 KiB, several blocks of the transfers above
    return build_index_cache(tmp_path_factory.mktemp("fetch-src"), 120, size=32, shard_size=40)


def upload(fs_class: type, local) -> str:
    fs = fs_class()
    root = f"/{uuid.uuid4().hex}/cache"
    fs.put(str(local), root, recursive=True)
    return f"{fs_class.protocol}://{root.lstrip('/')}"


def every_sample(ds) -> dict[int, np.ndarray]:
    return {int(i): image.numpy() for images, _, index in ds for image, i in zip(images, index, strict=True)}


@pytest.mark.parametrize("fs_class", [InOrderFS, BackwardsFS], ids=["in-order", "backwards"])
def test_shards_arrive_whole_and_checked_whatever_order_the_transfer_writes_in(fs_class, local_cache_dir, tmp_path):
    url = upload(fs_class, local_cache_dir)
    CheckEvery = fetch._Progress.CHECK_EVERY
    fetch._Progress.CHECK_EVERY = 1 << 14  # a check at every block of the transfers
    try:
        ds = datapipe.StreamingDataset(url, local_cache=tmp_path / "lc", batch_size=16, return_index=True, prefetch=2)
        got = every_sample(ds)
    finally:
        fetch._Progress.CHECK_EVERY = CheckEvery
    local = datapipe.open(local_cache_dir)
    assert sorted(got) == list(range(len(local)))
    for i, image in got.items():
        assert np.array_equal(image, local[i][0])
    downloaded = [d for d in fetch.downloads(ds.cache.remote.folder) if "/images/" in d["file"]]
    assert len(downloaded) == len(local.counts)  # each shard once: none refused as corrupt and downloaded again


def test_the_checksum_is_taken_as_the_bytes_arrive(tmp_path):
    path = tmp_path / "part"
    data = np.random.default_rng(0).integers(0, 256, 5 * fetch._Progress.CHECK_EVERY + 123, dtype=np.uint8).tobytes()
    progress = fetch._Progress(path)
    wakes = 0
    with open(path, "wb") as f:
        for start in range(0, len(data), 1 << 16):
            f.write(data[start:start + (1 << 16)])
            f.flush()
            progress.relative_update(len(data[start:start + (1 << 16)]))  # the transfer counts
            if progress.ready.is_set():  # the waiting thread is woken and reads what arrived
                progress.ready.clear()
                progress.catch_up()
                wakes += 1
    assert wakes == 5
    assert progress.checked >= len(data) - fetch._Progress.CHECK_EVERY  # read as it arrived, not after
    assert progress.finish() == (file_crc32c(path), len(data))
    progress.close()
    assert progress.finish() is None  # closed: nothing followed any more, the caller reads the file


def test_a_file_that_vanishes_mid_transfer_is_left_to_the_caller(tmp_path):
    path = tmp_path / "part"
    path.write_bytes(b"x" * 10)
    progress = fetch._Progress(path)
    os.unlink(path)
    progress.relative_update(fetch._Progress.CHECK_EVERY)
    progress.catch_up()  # the read-back fails: no error, the file is left to the caller
    assert progress.finish() is None


def test_the_reader_downloads_the_first_shard_itself_and_prefetching_starts_after_the_first_batch(local_cache_dir,
                                                                                                  tmp_path):
    """At the start of an epoch the reader needs one shard: a prefetch thread would only hand it over (its start
    and the hand-over delay the first batch), so the reader downloads it and the threads start once the
    first batch is read; every shard is still downloaded once, ahead of the reader."""
    url = upload(WatchedFS, local_cache_dir)
    WatchedFS.seen.clear()
    WatchedFS.before = {t.ident for t in threading.enumerate()}
    ds = datapipe.StreamingDataset(url, local_cache=tmp_path / "lc", batch_size=40, order="shards", window=1,
                                   shuffle=False, return_index=True, prefetch=2)
    got = [batch[2].tolist() for batch in ds]
    assert got == [list(range(k, k + 40)) for k in range(0, 120, 40)]  # batch k is shard k
    data = [(rpath, alive) for rpath, alive in WatchedFS.seen if "/images/" in rpath]
    assert len(data) == 3 and len({rpath for rpath, _ in data}) == 3
    assert data[0][1] == [], "a prefetch thread was alive when the first shard's transfer started"
    # the threads start once the first batch is read; on a busy machine the reader may reach the second shard
    # before one of them has begun, but not the last one too
    assert data[-1][1], "the later shards are prefetched"


def test_the_shard_left_to_the_reader_is_the_one_it_opens_first_not_the_nodes_first(local_cache_dir, tmp_path):
    """A node's plan lists what every rank of the node reads: the shard the reader leaves to no prefetch
    thread is its own first one; the node's other shards of that batch are prefetched."""
    url = upload(InOrderFS, local_cache_dir)
    ds = datapipe.StreamingDataset(url, local_cache=tmp_path / "lc", batch_size=40, prefetch=2)
    fetcher = ds.cache.remote
    folder = fetcher.folder
    names = [s.name for s in ds.cache.manifest.shards]

    def downloaded() -> set[str]:
        return {d["what"] for d in fetch.downloads(folder) if "/images/" in d["file"]}

    # the first step reads shards 0 and 1 (another rank of the node reads 0), this process opens 1 first
    fetcher.follow([0, 1, 2], [0, 0, 1], [0, 0, 1], reader_first=1)
    deadline = time.monotonic() + 30
    while f"shard {names[0]}" not in downloaded() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # a prefetch of shard 1 would have started by now
    assert downloaded() == {f"shard {names[0]}"}
    hold = fetcher.hold(1)  # the reader downloads its own first shard
    assert hold is not None and downloaded() == {f"shard {names[0]}", f"shard {names[1]}"}
    hold.release()
    fetcher.close()


def test_datasets_of_one_process_share_the_transfer_threads(local_cache_dir, tmp_path):
    url = upload(InOrderFS, local_cache_dir)
    for k in range(6):
        ds = datapipe.StreamingDataset(url, local_cache=tmp_path / f"lc{k}", batch_size=16, prefetch=4)
        assert sum(len(batch[1]) for batch in ds) == 120
        ds.cache.remote.close()
    pool = fetch._transfers()

    def counts() -> tuple[int, int]:
        """(live transfer threads, threads the pool counts), read together under the pool's lock. A thread
        that ends for want of work (after 10 s idle) is uncounted before it has exited: poll past that."""
        with pool._lock:
            return sum(t.name.startswith("datapipe-fetch") for t in threading.enumerate()), pool.threads

    deadline = time.monotonic() + 5
    while (seen := counts())[0] != seen[1] and time.monotonic() < deadline:
        time.sleep(0.01)
    # one dataset's transfers at once (its prefetch threads and its reader), not threads left by each dataset
    assert seen[0] == seen[1] <= 8, seen


def test_the_download_log_stays_bounded_while_every_epoch_downloads_again(local_cache_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "DOWNLOADS_LIMIT", 1500)  # about ten lines
    url = upload(InOrderFS, local_cache_dir)
    shard = max(s.nbytes for s in datapipe.open(local_cache_dir).manifest.shards)
    ds = datapipe.StreamingDataset(url, local_cache=tmp_path / "lc", batch_size=40, cache_limit=int(shard * 1.5),
                                   order="shards", window=1, prefetch=0)  # room for one shard: each epoch downloads all
    for epoch in range(8):
        ds.set_epoch(epoch)
        assert sum(len(batch[1]) for batch in ds) == 120
    folder = ds.cache.remote.folder
    log, older = folder / fetch.DOWNLOADS, folder / (fetch.DOWNLOADS + ".1")
    line = 200  # a JSON line is shorter than this
    assert older.exists() and older.stat().st_size <= 1500 + line and log.stat().st_size <= 1500 + line
    kept = fetch.downloads(folder)
    assert 10 < len(kept) < 8 * 3  # the newest downloads, not all of them
    assert [d["time"] for d in kept] == sorted(d["time"] for d in kept)


REL = "shards/000000.zarr/images/c/0/0/0/0"


def lock_folder(tmp_path):
    """A local cache root with one build folder: (root, the shard's data file, its lock file), neither written."""
    root = tmp_path / "lc"
    folder = root / "build"
    (folder / fetch.LOCKS).mkdir(parents=True)
    for where in (root, folder):
        (where / fetch.MARKER).write_text("{}")
    return root, folder / REL, folder / fetch.LOCKS / "000000.zarr.lock"


def test_the_eviction_scan_follows_downloads_and_evictions_between_calls(tmp_path):
    import json

    root, data, lock = lock_folder(tmp_path)
    rel = REL
    tmp = root / "build" / "download.tmp"
    tmp.write_bytes(b"x" * 1000)
    st = os.stat(tmp)
    record = {"files": [{"path": rel, "ino": st.st_ino, "size": 1000, "mtime_ns": st.st_mtime_ns, "evict": True}]}
    lock.write_text(json.dumps(record))  # a download records the file before it renames it into place
    assert fetch._scan(root) == (0, [])
    data.parent.mkdir(parents=True)
    os.replace(tmp, data)  # renamed: found at the next call, the record unchanged
    usage, candidates = fetch._scan(root)
    assert usage == 1000 and [c[3] for c in candidates] == [rel]
    os.utime(lock)  # a reader's access stamp: read again, still counted
    assert fetch._scan(root)[0] == 1000
    os.unlink(data)  # an eviction deletes, then rewrites the record
    lock.write_text(json.dumps({"files": []}))
    assert fetch._scan(root) == (0, [])


def test_the_eviction_scan_reads_again_a_lock_rewritten_at_the_same_length_at_once(tmp_path):
    import json

    root, data, lock = lock_folder(tmp_path)
    rel = REL
    data.parent.mkdir(parents=True)
    data.write_bytes(b"x" * 1000)
    st = os.stat(data)

    def record(size: int) -> str:
        return json.dumps({"files": [{"path": rel, "ino": st.st_ino, "size": size, "mtime_ns": st.st_mtime_ns,
                                      "evict": True}]})

    lock.write_text(record(1000))
    assert fetch._scan(root)[0] == 1000
    lock.write_text(record(2000))  # same length, same inode, and (within a clock tick) the same times
    assert fetch._scan(root) == (0, [])  # the record no longer names the file in place


_EXIT_SCRIPT = """
import sys, time, uuid
from pathlib import Path
import fsspec
from fsspec.implementations.memory import MemoryFileSystem
import datapipe
from datapipe import fetch

class SlowFS(MemoryFileSystem):
    protocol = "dp-slow"
    root_marker = "/"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("dp-slow://"))

    def get_file(self, rpath, lpath, callback=None, outfile=None, **kwargs):
        data = self.cat_file(rpath)
        with open(lpath, "wb") as f:
            for start in range(0, len(data), 4096):
                f.write(data[start:start + 4096])
                f.flush()
                if callback is not None:
                    callback.relative_update(len(data[start:start + 4096]))
                time.sleep(0.01)

fsspec.register_implementation("dp-slow", SlowFS, clobber=True)
root = f"/{uuid.uuid4().hex}/cache"
SlowFS().put(sys.argv[1], root, recursive=True)
ds = datapipe.StreamingDataset(f"dp-slow://{root.lstrip('/')}", local_cache=sys.argv[2], batch_size=40, prefetch=2,
                               order="shards", window=1, shuffle=False)
batches = iter(ds)
next(batches)  # the prefetch threads now download the next shards, slowly
time.sleep(0.1)
fetch._remove_parts_at_exit()  # what the interpreter runs at exit, before other handlers (and its threads stop)
# the other exit handlers: threads still run meanwhile (the reader below keeps the prefetch threads at work, as
# a thread of the program might, to make any download that may still begin begin)
seen = set()
deadline = time.monotonic() + 1.2
while time.monotonic() < deadline:
    seen |= {p.name for p in Path(sys.argv[2]).rglob("*") if fetch.PART in p.name}
    try:
        next(batches)
    except BaseException:
        time.sleep(0.02)
print(sorted(seen))
sys.stdout.flush()
import os
os._exit(0)
"""


def test_no_download_outlives_the_exit_handler_to_leave_a_partial_file(tmp_path):
    """At exit the prefetch threads stop downloading: a transfer under way stops at its next block and removes its
    file, and none begins. The handler used to remove the files it knew of and return, while the threads, still
    running through the other exit handlers, finished or began downloads and left their temporary files."""
    import subprocess
    import sys

    cache = build_index_cache(tmp_path / "src", 480, size=32, shard_size=40)  # 12 shards, 0.3 s each to download
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(cache), str(tmp_path / "lc")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
