"""Builds into and from object storage, against a real S3-API server (moto's, on loopback).

A build into ``s3://`` writes the very shards a local build writes (byte for byte), resumes after the
client or a worker is killed, is a no-op on an unchanged rerun (no shard object rewritten), refuses a
different configuration, never deletes an object it did not write (also with --force); a source in
the store builds the same cache; ``datapipe verify`` finds a shard damaged in the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from build_fixtures import SIZE, build
from PIL import Image
from s3_server import MISSING, REASON, free_port

import datapipe
import datapipe.builder as builder
from datapipe import remote
from datapipe.errors import ArgumentError, ConfigMismatchError, OutputError

pytestmark = pytest.mark.skipif(bool(MISSING), reason=REASON)


def download(s3, url: str, dest: Path) -> Path:
    """Every object under ``url`` as files under ``dest`` (to compare with a local build)."""
    fs = s3.filesystem()
    root = url.removeprefix("s3://")
    for path in fs.find(root):
        target = dest / path[len(root):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(fs.cat_file(path))
    return dest


def shard_files(tree: dict[str, bytes]) -> dict[str, bytes]:
    """The shard files, labels and paths of a cache tree (the manifest and build.json name their source)."""
    return {k: v for k, v in tree.items() if k.startswith("shards/") or k in ("labels.npy", "paths.json")}


def without_inputs_hash(tree: dict[str, bytes]) -> dict[str, bytes]:
    """A tree with the shards' inputs hashes blanked (they cover the files' modification times, which objects lack)."""
    return {k: re.sub(rb'"inputs_hash": "[0-9a-f]+"', b'"inputs_hash": ""', v) for k, v in tree.items()}


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datapipe.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=240)


# ----------------------------------------------------------------------------- storage options and URLs


def test_storage_options_parse_json_values_and_dotted_keys():
    got = remote.parse_storage_options(["anon=false", "client_kwargs.region_name=eu-west-1", "max_concurrency=8",
                                        "endpoint_url=http://127.0.0.1:9000", 'config_kwargs={"retries": {"max_attempts": 2}}'])
    assert got == {"anon": False, "client_kwargs": {"region_name": "eu-west-1"}, "max_concurrency": 8,
                   "endpoint_url": "http://127.0.0.1:9000", "config_kwargs": {"retries": {"max_attempts": 2}}}


@pytest.mark.parametrize("item", ["novalue", "=x", "a..b=1", ".a=1"])
def test_storage_option_errors_name_the_flag(item):
    with pytest.raises(ArgumentError, match="--storage-option"):
        remote.parse_storage_options([item])


def test_storage_option_conflicts_are_refused():
    with pytest.raises(ArgumentError, match="--storage-option"):
        remote.parse_storage_options(["a=1", "a.b=2"])
    with pytest.raises(ArgumentError, match="--storage-option"):
        remote.parse_storage_options(["a.b=2", "a=1"])


def test_cli_storage_option_error_names_the_flag(tmp_path):
    proc = cli("build", str(tmp_path), "s3://bucket/x", "--storage-option", "oops", env={})
    assert proc.returncode == 2 and "--storage-option" in proc.stderr and "Traceback" not in proc.stderr


# A store nothing answers at, and no credentials: each command's one line names the URL and the client's reason
# (the clients' own exceptions, botocore's EndpointConnectionError and NoCredentialsError, are no OSError).
UNREACHABLE = [
    ("build-into", ["build", "{images}", "s3://bucket/cache", "--size", "16", "--scheduler", "sync"], "cannot list the output"),
    ("build-from", ["build", "s3://bucket/images", "{out}", "--size", "16", "--scheduler", "sync"], "cannot list the source"),
    ("info", ["info", "s3://bucket/cache"], "cannot read the manifest"),
    ("verify", ["verify", "s3://bucket/cache"], "cannot read the manifest"),
]


@pytest.mark.parametrize("args, says", [case[1:] for case in UNREACHABLE], ids=[case[0] for case in UNREACHABLE])
def test_a_store_nothing_answers_at_is_one_line_naming_the_url(tmp_path, args, says):
    (tmp_path / "images" / "a").mkdir(parents=True)
    Image.new("RGB", (24, 24), (200, 30, 30)).save(tmp_path / "images" / "a" / "one.jpg")
    argv = [a.format(images=tmp_path / "images", out=tmp_path / "out") for a in args]
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = cli(*argv, "--storage-option", f"endpoint_url={endpoint}", "--storage-option",
               'config_kwargs.retries={"max_attempts": 1}', env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"datapipe {argv[0]}: error: s3://bucket/") and says in lines[0], lines[0]
    assert "EndpointConnectionError" in lines[0] and endpoint in lines[0], lines[0]


def test_missing_credentials_are_one_line_naming_the_url(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1")
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "info", "s3://bucket/cache", "--storage-option",
                           f"endpoint_url=http://127.0.0.1:{free_port()}"], capture_output=True, text=True, env=env,
                          timeout=240)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("datapipe info: error: s3://bucket/cache: cannot read the manifest"), lines[0]
    assert "NoCredentialsError" in lines[0] and "credentials" in lines[0], lines[0]


def test_urls_and_paths_are_told_apart():
    assert remote.is_url("s3://b/p") and remote.is_url("gs://b") and remote.is_url("file:///tmp/x")
    assert not remote.is_url("/tmp/x") and not remote.is_url("relative/s3:/x") and not remote.is_url(Path("/x"))


def test_importing_datapipe_imports_no_fsspec():
    code = "import sys, datapipe; datapipe.build; import datapipe.builder; print('fsspec' in sys.modules, 's3fs' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


# ----------------------------------------------------------------------------- builds into the store


def test_serial_build_into_s3_equals_the_local_build_and_reruns_as_a_no_op(s3, source, built, tmp_path, imaging,
                                                                         synced_paths):
    url = s3.bucket() + "/cache"
    report = build(source[0], url, storage_options=s3.storage_options)
    assert report.status == "ok" and report.output == url and report.shards_built == report.shards_total > 1
    # The shards staged on their way to the store (the store's copy is the durable one) are never flushed to disk.
    assert not [p for p in synced_paths if "datapipe-shard-" in p], synced_paths
    local = imaging.tree_bytes(built[0])
    got = imaging.tree_bytes(download(s3, url, tmp_path / "got"))
    assert shard_files(got) == shard_files(local)
    assert json.loads(got["manifest.json"])["source"]["root"] == str(source[0].absolute())
    before = s3.objects(url)
    time.sleep(1.1)  # LastModified has a resolution of a second
    again = build(source[0], url, storage_options=s3.storage_options)
    assert again.shards_built == 0 and again.shards_skipped == report.shards_total
    # No object written again: not a shard, nor build.json, labels, paths, the manifest, or the report of the build
    # that did the work (a reader with the cache open, a shared read-only bucket)
    assert s3.objects(url) == before and any("/shards/" in k for k in before) and len(before) > 6
    assert ".datapipe.lock" not in {k.split("/", 1)[1] for k in before}
    fs = s3.filesystem()
    assert json.loads(fs.cat_file(url.removeprefix("s3://") + "/report.json"))["shards_built"] == report.shards_total


def test_shards_staged_by_killed_tasks_are_removed_by_the_next_task_and_those_in_use_kept(s3, source, tmp_path,
                                                                                          monkeypatch):
    """A worker SIGKILLed mid-shard cannot remove the folder its shard was staged in (up to a shard's size on the
    worker's disk, once per kill): the next shard task on the machine removes it, once no living task holds
    it (its flock) and it is older than the grace period; a folder in use, or a dead one still in its grace
    period, is kept."""
    import tempfile

    from datapipe import builder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this process's build; the helpers get TMPDIR
    monkeypatch.setattr(builder, "STAGING_GRACE_SECONDS", 3600.0)  # however slow the machine, "young" stays young
    code = ("import sys, time; from datapipe import builder; folder, fd = builder._staging_folder(); "
            "(folder / 'shards').mkdir(); (folder / 'shards' / 'data').write_bytes(bytes(1 << 20)); "
            "print(folder, flush=True); time.sleep(600)")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)}) for _ in range(3)]
    try:
        dead, alive, young = (Path(p.stdout.readline().strip()) for p in procs)  # type: ignore[union-attr]
        for p in (procs[0], procs[2]):
            p.send_signal(signal.SIGKILL)
            p.wait(10)
        old = time.time() - builder.STAGING_GRACE_SECONDS - 60
        for folder in (dead, alive):
            os.utime(folder, (old, old))
        url = s3.bucket() + "/cache"
        assert build(source[0], url, storage_options=s3.storage_options).status == "ok"
        left = sorted(p for p in tmp_path.iterdir() if p.name.startswith(builder.STAGING_PREFIX))
        assert left == sorted([alive, young])  # and none of the build's own
        assert (alive / "shards" / "data").stat().st_size == 1 << 20
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
    assert builder._reclaim_staging(tmp_path) == 1  # the one in use, now that its task is gone (young: its grace)


@pytest.mark.parametrize("killed_after", ["its first removal", "the lock's removal"])
def test_a_task_killed_while_removing_its_staged_shard_leaves_it_for_the_next_task(tmp_path, killed_after):
    """A worker killed while it removes its staging folder (a shard's worth of files) leaves the folder's lock
    until the rest is gone, so that the next task still sees the folder as a dead task's and removes what is
    left; a folder without the lock that is not empty is not one of ours and is kept."""
    from datapipe import builder

    stop = "True" if killed_after == "its first removal" else f"path.endswith({builder.STAGING_LOCK!r})"
    code = ("import os, signal, sys; from datapipe import builder; folder, fd = builder._staging_folder(); "
            "(folder / 'shards' / 'a.zarr').mkdir(parents=True); "
            "[(folder / 'shards' / 'a.zarr' / n).write_bytes(bytes(1000)) for n in 'bcdef']; "
            "(folder / 'zarr.json').write_text('{}'); unlink = os.unlink\n"
            "def killed(path, *a, **k):\n"
            "    unlink(path, *a, **k); path = os.fspath(path)\n"
            f"    if {stop}: os.kill(os.getpid(), signal.SIGKILL)\n"
            "os.unlink = killed; print(folder, flush=True); builder._remove_staging(folder)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    folder = Path(proc.stdout.strip())
    assert folder.is_dir()
    theirs = tmp_path / f"{builder.STAGING_PREFIX}not-ours"
    (theirs / "x").mkdir(parents=True)
    old = time.time() - builder.STAGING_GRACE_SECONDS - 60
    for f in (folder, theirs):
        os.utime(f, (old, old))
    builder._reclaim_staging(tmp_path)
    assert not folder.exists()
    assert (theirs / "x").is_dir()


def test_remote_cache_verify_info_and_a_shard_corrupted_in_the_store(s3, source, tmp_path):
    url = s3.bucket() + "/c"
    build(source[0], url, storage_options=s3.storage_options)
    loc = remote.open_location(url, s3.storage_options)
    assert remote.verify(loc) == []
    proc = cli("verify", url, env=s3.env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr
    proc = cli("info", url, env=s3.env)
    assert proc.returncode == 0 and f"samples    {len(source[1])} of" in proc.stdout, proc.stdout + proc.stderr
    fs = s3.filesystem()
    data = url.removeprefix("s3://") + "/shards/000001.zarr/images/c/0/0/0/0"
    blob = bytearray(fs.cat_file(data))
    blob[100] ^= 0xFF
    fs.pipe_file(data, bytes(blob))  # same size, other bytes
    problems = remote.verify(loc)
    assert len(problems) == 1 and "000001.zarr" in problems[0] and "checksum" in problems[0]
    proc = cli("verify", url, env=s3.env)
    assert proc.returncode == 1 and "000001.zarr" in proc.stdout
    fs.pipe_file(data, bytes(blob[:-10]))  # shorter: the size is named before any byte is read
    assert "bytes, the manifest says" in remote.verify(loc)[0]
    # --verify rebuilds exactly the damaged shard
    report = build(source[0], url, storage_options=s3.storage_options, verify=True)
    assert report.shards_built == 1 and remote.verify(loc) == []


def _edit_doc(fs, key: str, edit) -> None:
    doc = json.loads(fs.cat_file(key))
    edit(doc)
    fs.pipe_file(key, json.dumps(doc, indent=1).encode())


# What verify checks of a remote shard beyond its data and index checksums (each damage keeps the sizes).
REMOTE_DAMAGE = {
    "labels chunk": lambda fs, shard: fs.pipe_file(f"{shard}/labels/c/0", bytes(len(fs.cat_file(f"{shard}/labels/c/0")))),
    "labels document": lambda fs, shard: _edit_doc(fs, f"{shard}/labels/zarr.json", lambda d: d.update(fill_value=3)),
    "images document": lambda fs, shard: _edit_doc(fs, f"{shard}/images/zarr.json", lambda d: d["shape"].__setitem__(0, 1)),
    "group document": lambda fs, shard: _edit_doc(fs, f"{shard}/zarr.json", lambda d: d.update(zarr_format=2)),
    "paths": lambda fs, shard: _edit_doc(fs, f"{shard}/zarr.json",
                                         lambda d: d["attributes"]["datapipe"]["paths"].reverse()),
}


@pytest.mark.parametrize("damage", sorted(REMOTE_DAMAGE))
def test_build_verify_rewrites_every_remote_shard_that_verify_finds_damaged(s3, source, damage):
    """verify of a cache in a store checks each shard's labels chunk, paths and Zarr documents (what
    zarr-python reads) as it does a local cache's; build --verify finds each and rewrites that shard."""
    url = s3.bucket() + "/c"
    build(source[0], url, storage_options=s3.storage_options)
    loc = remote.open_location(url, s3.storage_options)
    fs = s3.filesystem()
    shard = url.removeprefix("s3://") + "/shards/000001.zarr"
    REMOTE_DAMAGE[damage](fs, shard)
    problems = remote.verify(loc)
    assert problems and all("000001.zarr" in p and "--verify" in p for p in problems), problems
    assert build(source[0], url, storage_options=s3.storage_options).shards_built == 0  # a plain rerun sees nothing
    assert build(source[0], url, storage_options=s3.storage_options, verify=True).shards_built == 1
    assert remote.verify(loc) == []


@pytest.mark.parametrize("theirs", ["data object", "labels chunk", "group document"])
def test_a_build_never_overwrites_objects_of_a_shards_names_that_no_build_of_its_wrote(s3, source, theirs):
    """Objects under shards/NNNNNN.zarr/ with a shard's names but no zarr.json of this build (a user's, another
    tool's) are never overwritten: the shard's task refuses before it writes anything there, naming one;
    finished shards are kept, and once they are moved away the rerun finishes."""
    url = s3.bucket() + "/c"
    build(source[0], url, storage_options=s3.storage_options, shard_size=10)
    fs, root = s3.filesystem(), url.removeprefix("s3://")
    folder = f"{root}/shards/000005.zarr"  # a shard that a build with --shard-size 4 writes, this one did not
    key = {"data object": "images/c/0/0/0/0", "labels chunk": "labels/c/0", "group document": "zarr.json"}[theirs]
    fs.pipe_file(f"{folder}/{key}", b'{"theirs": true}')
    with pytest.raises(datapipe.errors.BuildError, match=r"shards/000005\.zarr.* no datapipe build wrote it|"
                                                          r"shards/000005\.zarr/zarr\.json is in the way"):
        build(source[0], url, storage_options=s3.storage_options, shard_size=4, force=True)
    assert sorted(k.removeprefix(f"{root}/") for k in fs.find(folder)) == [f"shards/000005.zarr/{key}"]
    assert fs.cat_file(f"{folder}/{key}") == b'{"theirs": true}'
    fs.rm(f"{folder}/{key}")
    assert build(source[0], url, storage_options=s3.storage_options, shard_size=4, force=True).status == "ok"
    assert remote.verify(remote.open_location(url, s3.storage_options)) == []


def test_a_shard_whose_upload_was_cut_short_is_this_builds_and_rewritten(s3, source):
    """A build killed mid-upload leaves the shard's claim (a zarr.json without a record) and some of its objects:
    the rerun knows them as its own, rewrites that shard, and a reader never took it for whole."""
    url = s3.bucket() + "/c"
    first = build(source[0], url, storage_options=s3.storage_options)
    fs, root = s3.filesystem(), url.removeprefix("s3://")
    fs.pipe_file(f"{root}/shards/000001.zarr/zarr.json", remote.uploading_document(first.build_id, 1))
    loc = remote.open_location(url, s3.storage_options)
    assert any("000001.zarr" in p for p in remote.verify(loc))
    again = build(source[0], url, storage_options=s3.storage_options)
    assert again.shards_built == 1 and remote.verify(loc) == []


def test_a_different_configuration_is_refused_and_force_keeps_foreign_objects(s3, source):
    url = s3.bucket() + "/cache"
    build(source[0], url, storage_options=s3.storage_options)
    fs = s3.filesystem()
    root = url.removeprefix("s3://")
    foreign = [f"{root}/notes.txt", f"{root}/shards/README", f"{root}/shards/000000.zarr/mine.bin",
               f"{root}/shards/999999.zarr/zarr.json"]
    for key in foreign:
        fs.pipe_file(key, b"the user's")
    with pytest.raises(ConfigMismatchError, match="--force"):
        build(source[0], url, storage_options=s3.storage_options, size=SIZE + 8)
    report = build(source[0], url, storage_options=s3.storage_options, size=SIZE + 8, force=True)
    assert report.status == "ok" and report.config["size"] == SIZE + 8
    for key in foreign:
        assert fs.cat_file(key) == b"the user's"
    loc = remote.open_location(url, s3.storage_options)
    assert remote.verify(loc) == []
    assert remote.read_manifest(loc).config["size"] == SIZE + 8


def test_a_prefix_holding_other_objects_is_refused(s3, source):
    url = s3.bucket() + "/data"
    s3.filesystem().pipe_file(url.removeprefix("s3://") + "/x.bin", b"x")
    with pytest.raises(OutputError, match="not a datapipe cache"):
        build(source[0], url, storage_options=s3.storage_options)
    assert set(s3.objects(url)) == {"data/x.bin"}


def test_a_fresh_lock_of_another_build_is_refused_and_a_dead_one_taken_over(s3, source):
    url = s3.bucket() + "/cache"
    fs = s3.filesystem()
    lock = url.removeprefix("s3://") + "/.datapipe.lock"
    fs.pipe_file(lock, json.dumps({"host": "elsewhere", "pid": 1, "refreshed": time.time()}).encode())
    with pytest.raises(datapipe.errors.OutputBusyError, match="elsewhere"):
        build(source[0], url, storage_options=s3.storage_options)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    fs.pipe_file(lock, json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "refreshed": time.time()}).encode())
    assert build(source[0], url, storage_options=s3.storage_options).status == "ok"


@pytest.mark.parametrize("skew", [-600, 86400], ids=["holder-clock-10-min-behind", "holder-clock-a-day-ahead"])
def test_another_hosts_lock_is_judged_by_its_refreshes_not_by_the_two_clocks(s3, source, monkeypatch, skew):
    """A lock's 'refreshed' is its host's clock: a living build on a host 10 minutes behind looked dead (taken over),
    a dead one from a host a day ahead blocked every build for a day ("refreshed -86399 s ago")."""
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_TTL", "2")  # refreshed every 0.5 s, watched for 0.75 s
    url = s3.bucket() + "/cache"
    fs = s3.filesystem()
    lock = url.removeprefix("s3://") + "/.datapipe.lock"

    def write() -> None:
        doc = {"host": "elsewhere", "pid": 1, "token": "elsewhere:1:1", "refreshed": time.time() + skew}
        fs.pipe_file(lock, json.dumps(doc).encode())

    write()
    stop = threading.Event()

    def beat() -> None:  # the living build on the other host: a refresh every TTL / 4
        while not stop.wait(0.5):
            write()

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        with pytest.raises(datapipe.errors.OutputBusyError, match=r"elsewhere, refreshing it while watched \(its host's "
                                                                   r"clock differs from this one's\)"):
            build(source[0], url, storage_options=s3.storage_options)
    finally:
        stop.set()
        beating.join()
    write()  # its build has died: the same lock, no longer refreshed, is taken over after the watch
    assert build(source[0], url, storage_options=s3.storage_options).status == "ok"


def test_a_lock_removed_while_it_is_watched_is_free_not_another_builds(s3, monkeypatch):
    """Another host's lock, stale by this clock, is watched before it is taken over; its build ended and removed it
    meanwhile: the takeover was conditional on the removed object, which the store refused, and the build was
    refused as busy ("holder unknown, which took its lock first") with no build holding the prefix."""
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_TTL", "2")  # watched for 0.75 s
    loc = remote.open_location(s3.bucket() + "/cache", s3.storage_options)
    fs = s3.filesystem()
    key = loc.url.removeprefix("s3://") + "/.datapipe.lock"
    fs.pipe_file(key, json.dumps({"host": "elsewhere", "pid": 1, "token": "elsewhere:1:1",
                                  "refreshed": time.time() - 1000}).encode())
    ends = threading.Timer(0.3, lambda: fs.rm(key))  # the other build ends during the watch
    ends.start()
    lock = remote.RemoteLock(loc)
    try:
        lock.acquire()
        assert json.loads(fs.cat_file(key))["token"] == lock.token
    finally:
        ends.join()
        lock.remove()


def test_the_lock_is_written_with_conditions_so_one_of_builds_that_found_it_free_or_dead_holds_it(s3, monkeypatch):
    """Builds that read the lock free (or dead), then wrote it one after the other, each more than the settle time
    after the other read it back: both read their own token and went on. On S3 the lock is created only where none
    is, and taken over only while it is the object that was read, so the second build is refused whatever the
    timing; the holder's refreshes are conditional too, and stop once another build took the lock over."""
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_SETTLE", "0.001")
    loc = remote.open_location(s3.bucket() + "/cache", s3.storage_options)
    fs = s3.filesystem()
    key = loc.url.removeprefix("s3://") + "/.datapipe.lock"
    first, second = remote.RemoteLock(loc), remote.RemoteLock(loc)
    first.acquire()  # the second build read the lock free before this: its write now comes after the first's
    with pytest.raises(datapipe.errors.OutputBusyError, match=f"pid {os.getpid()}"):
        second._acquire_conditionally()
    assert json.loads(fs.cat_file(key))["token"] == first.token
    first.remove()
    assert not fs.exists(key)

    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fs.pipe_file(key, json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "refreshed": time.time(),
                                  "token": "dead"}).encode())
    stale = fs.info(key)["ETag"]
    third, fourth = remote.RemoteLock(loc), remote.RemoteLock(loc)
    third.acquire()  # takes over the dead build's lock; the fourth read the same dead lock before it did
    with pytest.raises(remote._Lost):
        fourth._put(if_match=stale)
    assert json.loads(fs.cat_file(key))["token"] == third.token
    third.stop()
    third._thread.join()
    refreshed = third._put(if_match=third._etag)  # a refresh of its own lock succeeds ...
    fs.pipe_file(key, json.dumps({"host": "elsewhere", "pid": 1, "refreshed": time.time(), "token": "x"}).encode())
    with pytest.raises(remote._Lost):  # ... and fails once another build took it over (its TTL past)
        third._put(if_match=refreshed)
    assert json.loads(fs.cat_file(key))["token"] == "x"
    with pytest.raises(datapipe.errors.OutputBusyError, match="elsewhere"):
        fourth.acquire()


@pytest.mark.parametrize("lost", ["a refresh's answer", "the create's answer"])
def test_a_lock_write_whose_answer_was_lost_is_still_this_builds(s3, monkeypatch, lost):
    """A PUT of the lock that the store applied but whose answer was lost (a client deadline, or a retry refused
    412 since the first attempt landed): the conditional refresh stopped for good, so after the TTL a second build
    took over a lock whose build still ran; a create so lost refused the build as busy, naming itself. The lock is
    read back: when it holds this build's token, it is this build's."""
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_TTL", "2")
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_SETTLE", "0.01")
    loc = remote.open_location(s3.bucket() + "/cache", s3.storage_options)
    real = remote.Location.call
    dropped = []

    def answer_lost(self, method, *args, **kwargs):
        out = real(self, method, *args, **kwargs)
        condition = "IfMatch" if lost == "a refresh's answer" else "IfNoneMatch"
        if method == "call_s3" and args[:1] == ("put_object",) and condition in kwargs and not dropped:
            dropped.append(kwargs["Key"])  # applied by the store; the answer never arrives
            raise FileExistsError("At least one of the pre-conditions you specified did not hold")
        return out

    first = remote.RemoteLock(loc)
    if lost == "the create's answer":
        monkeypatch.setattr(remote.Location, "call", answer_lost)
    first.acquire()  # not refused as busy by its own lock
    monkeypatch.setattr(remote.Location, "call", answer_lost)
    time.sleep(3)  # past the TTL: the refreshes went on
    assert dropped and first._thread.is_alive()
    with pytest.raises(datapipe.errors.OutputBusyError, match=f"pid {os.getpid()}"):
        remote.RemoteLock(loc).acquire()
    first.remove()


def _held_lock(s3, monkeypatch):
    """A fresh bucket's cache prefix and the lock a build took on it: (location, filesystem, lock key, lock)."""
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_SETTLE", "0.01")
    loc = remote.open_location(s3.bucket() + "/cache", s3.storage_options)
    lock = remote.RemoteLock(loc)
    lock.acquire()
    return loc, s3.filesystem(), loc.url.removeprefix("s3://") + "/.datapipe.lock", lock


@pytest.mark.parametrize("change", ["deleted", "garbage", "another build's"])
def test_a_lock_object_removed_or_damaged_under_a_build_is_put_back_and_one_taken_over_is_named(s3, monkeypatch,
                                                                                               change):
    """The lock object deleted, or written over with garbage, while its build ran: the refreshes stopped for good,
    so a second build took the prefix after the TTL and both wrote it (verify then found 81-133 problems while the
    first said ok). The refresh puts it back; a lock another build wrote is that build's, and this build is told
    (its manifest is then never written)."""
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_TTL", "2")
    loc, fs, key, lock = _held_lock(s3, monkeypatch)
    if change == "deleted":
        fs.rm(key)
    else:
        fs.pipe_file(key, b"{not json" if change == "garbage" else json.dumps(
            {"host": "elsewhere", "pid": 1, "refreshed": time.time(), "token": "other"}).encode())
    time.sleep(1.5)  # three refreshes
    held = json.loads(fs.cat_file(key)) if change != "garbage" or fs.exists(key) else None
    if change == "another build's":
        assert lock.lost and not lock._thread.is_alive() and held["token"] == "other"
    else:
        assert not lock.lost and lock._thread.is_alive() and held["token"] == lock.token
        with pytest.raises(datapipe.errors.OutputBusyError, match=f"pid {os.getpid()}"):
            remote.RemoteLock(loc).acquire()
    lock.remove()


def test_a_build_refused_after_watching_a_lock_names_the_build_that_holds_it_now(s3, source, monkeypatch):
    """Of builds racing for a dead build's lock, the losers named the dead build ('refreshing it while watched')."""
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_TTL", "2")
    url = s3.bucket() + "/cache"
    fs = s3.filesystem()
    key = url.removeprefix("s3://") + "/.datapipe.lock"
    fs.pipe_file(key, json.dumps({"host": "deadhost", "pid": 1, "token": "dead", "refreshed": time.time() - 600}).encode())
    winner = json.dumps({"host": "winner", "pid": 2, "token": "won", "refreshed": time.time()}).encode()
    taker = threading.Timer(0.2, lambda: fs.pipe_file(key, winner))  # another build takes it over during the watch
    taker.start()
    try:
        with pytest.raises(datapipe.errors.OutputBusyError, match=r"\(pid 2 on host winner, refreshed 0 s ago\)"):
            build(source[0], url, storage_options=s3.storage_options)
    finally:
        taker.join()


@pytest.mark.parametrize("still_there", [False, True], ids=["gone", "still-this-builds"])
def test_a_build_paused_past_the_ttl_never_takes_its_lock_back(s3, monkeypatch, still_there):
    """Paused past the TTL (Ctrl-Z, a frozen VM), a build whose lock another build took over, finished and removed
    put the lock object back on resuming, and rewrote that build's cache (exit 0). A lock object gone after such a
    pause is lost for good; one still this build's is refreshed."""
    monkeypatch.setenv("DATAPIPE_REMOTE_LOCK_TTL", "2")
    loc, fs, key, lock = _held_lock(s3, monkeypatch)
    if not still_there:
        fs.rm(key)  # taken over, finished, removed while this build was paused
    real = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real() + 60)  # the pause, as this process's clock sees it
    time.sleep(1.5)  # three refreshes
    monkeypatch.setattr(time, "monotonic", real)
    try:
        if still_there:
            assert not lock.lost and json.loads(fs.cat_file(key))["token"] == lock.token and lock.held_now()
        else:
            assert lock.lost and not fs.exists(key) and not lock.held_now()
    finally:
        lock.remove()


def test_a_build_whose_lock_another_took_over_writes_no_further_shard_nor_a_manifest(s3, source, monkeypatch):
    """A build paused past the TTL (SIGSTOP, a frozen VM) ran on at once when resumed, before its heartbeat looked:
    it overwrote the shards of the build that had taken its lock over, and published its own manifest (exit 0).
    Each shard's task and the publish now read the lock from the store first."""
    url = s3.bucket() + "/cache"
    fs = s3.filesystem()
    key = url.removeprefix("s3://") + "/.datapipe.lock"
    claimed = []
    real = builder._claim_remote_shard

    def claim(loc, name, build_id, shard):
        claimed.append(name)
        real(loc, name, build_id, shard)
        if len(claimed) == 1:  # after the first shard is claimed, another build takes the lock over
            fs.pipe_file(key, json.dumps({"host": "elsewhere", "pid": 1, "token": "other", "refreshed": time.time()}).encode())

    monkeypatch.setattr(builder, "_claim_remote_shard", claim)
    with pytest.raises(datapipe.errors.BuildError, match=r"no longer holds the lock of .*\(pid 1 on host elsewhere holds "
                                                          r"it\)"):
        build(source[0], url, storage_options=s3.storage_options, shard_size=4)
    assert len(claimed) == 1  # no further shard was begun
    assert not fs.exists(url.removeprefix("s3://") + "/manifest.json")
    assert json.loads(fs.cat_file(key))["token"] == "other"  # the other build's lock is left as it is


def test_keys_with_an_empty_folder_name_are_named_not_merged_and_an_output_so_spelled_is_not_a_class(s3, imaging,
                                                                                                      tmp_path):
    """S3 keys are literal: src//cat/c.png is another object than src/cat/c.png. The listing took both for one
    (one image vanished, none quarantined) or read the other object ("gone since the scan"); an output
    s3://b/src//cache inside the source became a class "cache" on the rerun, renumbering every label."""
    url = s3.bucket()
    fs = s3.filesystem()
    key = url.removeprefix("s3://")
    jpeg = imaging.jpeg(imaging.gradient(40, 52))
    for name in ("src/cat/a.jpg", "src/cat/c.jpg", "src//cat/c.jpg", "src//dog/d.jpg", "src/dog/e.jpg"):
        fs.pipe_file(f"{key}/{name}", jpeg)
    out = f"{url}/src//cache"
    first = build(f"{url}/src", out, storage_options=s3.storage_options, max_bad_fraction=0.5)
    assert first.scanned == 5 and first.num_samples == 3
    assert sorted((q["path"], q["error"]) for q in first.quarantined) == [("/cat/c.jpg", "unreadable"),
                                                                          ("/dog/d.jpg", "unreadable")]
    assert all("empty folder name" in q["reason"] for q in first.quarantined)
    cache = datapipe.open(out, local_cache=tmp_path / "node", storage_options=s3.storage_options)
    assert cache.classes == ["cat", "dog"]
    again = build(f"{url}/src", out, storage_options=s3.storage_options, max_bad_fraction=0.5)
    assert again.shards_built == 0 and again.empty_classes == []
    assert datapipe.open(out, local_cache=tmp_path / "node2", storage_options=s3.storage_options).classes == [
        "cat", "dog"]


def test_a_class_folder_holding_only_hidden_files_is_a_class_in_a_store_as_on_disk(s3, imaging, tmp_path):
    """A class folder holding only hidden files (bee/.DS_Store), and __MACOSX/<class>/._x.jpg (what unzipping a
    macOS archive leaves): the local scan keeps each top-level folder as a class (empty, named in the summary),
    as ImageFolder does; the scan of s3:// dropped them, so every later class was renumbered between two builds
    of the same files."""
    url = s3.bucket()
    fs = s3.filesystem()
    key = url.removeprefix("s3://")
    jpeg = imaging.jpeg(imaging.gradient(40, 52))
    files = {"ant/a.jpg": jpeg, "cat/c.jpg": jpeg, "bee/.DS_Store": b"\0" * 10, "__MACOSX/ant/._a.jpg": b"\0" * 64,
             ".git/config": b"x"}
    for name, data in files.items():
        fs.pipe_file(f"{key}/src/{name}", data)
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(data)
    local = build(tmp_path / "src", tmp_path / "local")
    stored = build(f"{url}/src", tmp_path / "stored", storage_options=s3.storage_options)
    want = ["__MACOSX", "ant", "bee", "cat"]  # ImageFolder's classes: every top-level folder but hidden ones
    assert datapipe.open(tmp_path / "local").classes == datapipe.open(tmp_path / "stored").classes == want
    assert local.empty_classes == stored.empty_classes == ["__MACOSX", "bee"]
    assert datapipe.open(tmp_path / "local").labels.tolist() == datapipe.open(tmp_path / "stored").labels.tolist() == [1, 3]


def test_keys_and_prefixes_with_a_double_colon_and_an_upper_case_scheme(s3, imaging, tmp_path):
    """fsspec reads "::" in a URL as a chain of filesystems: an image under such a key was quarantined as a
    decoder-error (AioSession got target_options), an output or cache there was a 44-line traceback; S3:// was
    "the s3:// filesystem refuses the storage options (Protocol not known: S3)"."""
    url = s3.bucket()
    fs = s3.filesystem()
    key = url.removeprefix("s3://")
    jpeg = imaging.jpeg(imaging.gradient(40, 52))
    for name in ("src/cat/a::b.jpg", "src/cat/c.jpg", "src/dog/d.jpg"):
        fs.pipe_file(f"{key}/{name}", jpeg)
    out = f"{url}/out::put"
    report = build(f"{url}/src", out, storage_options=s3.storage_options, max_bad_fraction=0)
    assert report.num_samples == 3 and report.quarantined == []
    for command in ("info", "verify"):
        done = cli(command, out, env=s3.env)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    upper = "S3://" + out.removeprefix("s3://")
    cache = datapipe.open(upper, local_cache=tmp_path / "node", storage_options=s3.storage_options)
    assert len(cache) == 3 and cache.path(0) == "cat/a::b.jpg"
    assert build("S3://" + key + "/src", upper, storage_options=s3.storage_options).shards_built == 0


def test_an_empty_manifest_in_the_store_is_a_cache_error_not_the_stores(s3, source, tmp_path):
    """A zero-byte manifest.json gave RemoteStoreError "The requested range is not satisfiable ... check that the
    store is up"; it is a damaged cache, named with its URL (s3://, not s3:/)."""
    url = s3.bucket() + "/cache"
    build(source[0], url, storage_options=s3.storage_options)
    s3.filesystem().pipe_file(url.removeprefix("s3://") + "/manifest.json", b"")
    with pytest.raises(datapipe.errors.CacheError, match=rf"^{re.escape(url)}/manifest.json is not valid JSON") as info:
        datapipe.open(url, local_cache=tmp_path / "node", storage_options=s3.storage_options)
    assert not isinstance(info.value, datapipe.errors.RemoteStoreError)
    done = cli("verify", url, env=s3.env)
    assert f"{url}/manifest.json" in done.stderr + done.stdout, done.stderr + done.stdout


def test_builds_started_together_leave_one_consistent_cache(s3, source):
    """Three builds of one prefix started at once (the ranks of a job each calling `datapipe build`): they all found
    the lock free and wrote it, and often two went on, leaving build.json of one build and the manifest or a shard of
    another, which no rerun, nor --force, could write over. Now one builds, the others are refused as busy (or find
    it up to date), and the cache is one build's."""
    for attempt in range(3):
        url = s3.bucket() + f"/cache{attempt}"
        args = ["build", str(source[0]), url, "--size", str(SIZE), "--scheduler", "sync", "--quiet"]
        env = {**os.environ, **s3.env, "DATAPIPE_REMOTE_LOCK_SETTLE": "1"}
        procs = [subprocess.Popen([sys.executable, "-m", "datapipe.cli", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
        results = [(p.wait(timeout=240), p.stderr.read()) for p in procs]
        for proc in procs:
            proc.stdout.close()
            proc.stderr.close()
        assert sum(rc == 0 for rc, _ in results) >= 1, results
        for rc, err in results:
            assert rc == 0 or "is being written by another datapipe build" in err, err
        fs = s3.filesystem()
        key = url.removeprefix("s3://")
        ids = {json.loads(fs.cat_file(f"{key}/{name}"))["build_id"] for name in ("build.json", "manifest.json",
                                                                                  "report.json")}
        ids |= {json.loads(fs.cat_file(path))["attributes"]["datapipe"]["build_id"]
                for path in fs.glob(f"{key}/shards/*/zarr.json")}
        assert len(ids) == 1, f"attempt {attempt}: objects of {len(ids)} builds"
        assert remote.verify(remote.open_location(url, s3.storage_options)) == []
        again = cli(*args, "--force", env=s3.env)
        assert again.returncode == 0, again.stderr


def test_a_build_of_a_cache_in_the_store_another_build_holds_is_up_to_date_without_waiting_and_only_then(
        s3, source, tmp_path, imaging):
    """Every rank of a job calling build() on the same cache in the store (the README's pattern under torchrun):
    three of four failed as busy. The ones that find the lock fresh check, without it, that the cache is up to
    date and go on; with something to do they are refused naming the holder; nothing is written either way."""
    url = s3.bucket() + "/cache"
    src = tmp_path / "src"
    shutil.copytree(source[0], src)
    first = build(src, url, storage_options=s3.storage_options)
    lock = url.removeprefix("s3://") + "/.datapipe.lock"
    s3.filesystem().pipe_file(lock, json.dumps({"host": "elsewhere", "pid": 1, "refreshed": time.time()}).encode())
    before = s3.objects(url)
    time.sleep(1.1)  # LastModified has a resolution of a second
    for kwargs in ({}, {"verify": True}):
        again = build(src, url, storage_options=s3.storage_options, **kwargs)
        assert (again.status, again.num_samples, again.shards_built) == ("ok", first.num_samples, 0)
    victim = sorted(src.rglob("*.jpg"))[0]
    victim.write_bytes(imaging.jpeg(imaging.gradient(40, 52, seed=99)))  # a changed input
    for kwargs in ({}, {"size": SIZE + 8}, {"size": SIZE + 8, "force": True}):
        with pytest.raises(datapipe.errors.OutputBusyError, match="elsewhere"):
            build(src, url, storage_options=s3.storage_options, **kwargs)
    assert s3.objects(url) == before


def test_a_cache_in_the_store_that_a_build_is_writing_says_so_rather_than_unfinished(s3, tmp_path):
    """info, verify and the loader on a prefix whose first build runs name that build (its lock object is fresh);
    once its holder is gone, the prefix is a build that did not finish, to be run again."""
    import socket

    url = s3.bucket() + "/cache"
    fs = s3.filesystem()
    key = url.removeprefix("s3://")
    fs.pipe_file(key + "/build.json", b"{}")
    fs.pipe_file(key + "/.datapipe.lock", json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                                      "refreshed": time.time()}).encode())
    for command in ("info", "verify"):
        done = cli(command, url, env=s3.env)
        assert done.returncode == 2 and f"a datapipe build is writing it now (pid {os.getpid()}" in done.stderr, done.stderr
    with pytest.raises(datapipe.errors.CacheError, match="a datapipe build is writing it now"):
        datapipe.StreamingDataset(url, local_cache=tmp_path / "node", storage_options=s3.storage_options)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fs.pipe_file(key + "/.datapipe.lock", json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout),
                                                      "refreshed": time.time()}).encode())
    with pytest.raises(datapipe.errors.CacheError, match="did not finish; run the same `datapipe build` again"):
        datapipe.StreamingDataset(url, local_cache=tmp_path / "node", storage_options=s3.storage_options)
    # another host's lock, old by this clock: a dead build, or a living one on a host whose clock is behind (a watch
    # tells, which only a build waits for): both are named, not "did not finish" alone
    fs.pipe_file(key + "/.datapipe.lock", json.dumps({"host": "elsewhere", "pid": 4242, "token": "elsewhere:4242:1",
                                                      "refreshed": time.time() - 1000}).encode())
    done = cli("info", url, env=s3.env)
    assert done.returncode == 2 and "did not finish, unless the one on host 'elsewhere' (pid 4242) that holds its lock " \
        "is writing it now by a clock other than this one's" in done.stderr, done.stderr


def test_classes_from_a_cache_or_a_text_object_in_the_store(s3, source, tmp_path):
    """--classes-from takes a cache in the store (its manifest's list) or a text object of one name per line, as
    locally (a text object was read as a cache and the advice was to build into it); anything else names the URL."""
    url = s3.bucket() + "/cache"
    build(source[0], url, storage_options=s3.storage_options)
    names = remote.read_manifest(remote.open_location(url, s3.storage_options)).classes
    text = url.rsplit("/", 1)[0] + "/lists/classes.txt"
    s3.filesystem().pipe_file(text.removeprefix("s3://"), ("\n".join(reversed(names)) + "\n").encode())
    for given, want in ((url, list(names)), (text, list(reversed(names)))):
        out = tmp_path / f"out-{len(given)}"
        done = cli("build", str(source[0]), str(out), "--size", str(SIZE), "--scheduler", "sync", "--quiet",
                   "--classes-from", given, env=s3.env)
        assert done.returncode == 0, done.stderr
        assert datapipe.open(out).classes == want
    done = cli("build", str(source[0]), str(tmp_path / "x"), "--size", str(SIZE), "--scheduler", "sync", "--quiet",
               "--classes-from", url + "-missing", env=s3.env)
    assert done.returncode == 2 and "not a finished datapipe cache" in done.stderr and "Traceback" not in done.stderr
    # --storage-option reaches --classes-from when only that is in the store
    done = cli("build", str(source[0]), str(tmp_path / "y"), "--size", str(SIZE), "--scheduler", "sync", "--quiet",
               "--classes-from", url, "--storage-option", f"endpoint_url={s3.storage_options['endpoint_url']}",
               env={k: v for k, v in s3.env.items() if not k.startswith("AWS_ENDPOINT_URL")})
    assert done.returncode == 0, done.stderr
    assert datapipe.open(tmp_path / "y").classes == list(names)


@pytest.mark.parametrize("command", ["build", "info", "verify"])
def test_storage_options_for_nothing_in_object_storage_are_refused(built, tmp_path, command, capsys):
    """--storage-option (storage_options=) with only local paths would do nothing: one line says so,
    naming the paths, and nothing is written."""
    from datapipe.cli import main as cli_main

    argv = {"build": ["build", str(tmp_path / "src"), str(tmp_path / "out"), "--scheduler", "sync"],
            "info": ["info", str(built[0])], "verify": ["verify", str(built[0])]}[command]
    (tmp_path / "src" / "a").mkdir(parents=True)
    assert cli_main([*argv, "--storage-option", "endpoint_url=http://127.0.0.1:1"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--storage-option: for s3:// (gs://, az://) URLs only" in line and argv[1] in line and "leave it out" in line
    assert not (tmp_path / "out").exists()
    if command == "build":
        with pytest.raises(ArgumentError, match="storage_options: for an s3:// .* are local, so leave them out"):
            datapipe.build(tmp_path / "src", tmp_path / "out", storage_options={"anon": True},
                           cluster=datapipe.Cluster(scheduler="sync"))
        assert not (tmp_path / "out").exists()


def test_a_source_in_s3_builds_the_same_cache_as_the_local_source(s3, source, built, tmp_path, imaging):
    src = s3.bucket() + "/images"
    fs = s3.filesystem()
    for path in sorted(source[0].rglob("*")):
        if path.is_file():
            fs.put_file(str(path), src.removeprefix("s3://") + "/" + path.relative_to(source[0]).as_posix())
    out = tmp_path / "from-s3"
    report = build(src, out, storage_options=s3.storage_options)
    assert report.status == "ok"
    got, want = shard_files(imaging.tree_bytes(out)), shard_files(imaging.tree_bytes(built[0]))
    assert got != want and without_inputs_hash(got) == without_inputs_hash(want)
    assert datapipe.open(out).manifest.source.root == src


def test_a_source_in_s3_names_its_classes_and_unused_images_as_a_local_folder_does(s3, source, tmp_path):
    """An image at the top of the prefix is named as outside any class (it was an unreported 'ignored'), a folder
    marker alone (a console's "Create folder") or a folder without images is an empty class, as an empty local
    folder is: the labels of a build from the store and from the same tree on disk agree."""
    local = tmp_path / "tree"
    for path in sorted(source[0].rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            (local / path.relative_to(source[0])).parent.mkdir(parents=True, exist_ok=True)
            (local / path.relative_to(source[0])).write_bytes(path.read_bytes())
    first = sorted(local.rglob("*.jpg"))[0]
    (local / "top.jpg").write_bytes(first.read_bytes())
    (local / "0-empty").mkdir()  # sorts first: a missing empty class would move every label
    (local / "notes").mkdir()
    (local / "notes" / "readme.txt").write_text("no images here")
    src = s3.bucket() + "/images"
    fs = s3.filesystem()
    for path in sorted(local.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), src.removeprefix("s3://") + "/" + path.relative_to(local).as_posix())
    s3.client().put_object(Bucket=src.removeprefix("s3://").split("/")[0], Key="images/0-empty/", Body=b"")
    reports = {"s3": build(src, tmp_path / "from-s3", storage_options=s3.storage_options),
               "local": build(local, tmp_path / "from-disk")}
    for where, report in reports.items():
        assert report.outside_classes == ["top.jpg"], where
        assert report.empty_classes == ["0-empty", "notes"], where
        assert "1 image file at the source's top level not used" in report.summary(), where
    classes = {where: datapipe.open(tmp_path / f"from-{'s3' if where == 's3' else 'disk'}").classes for where in reports}
    assert classes["s3"] == classes["local"] and classes["s3"][0] == "0-empty"
    s3_labels = datapipe.open(tmp_path / "from-s3").labels
    assert np.array_equal(s3_labels, datapipe.open(tmp_path / "from-disk").labels)


def test_an_output_or_another_cache_inside_a_source_in_s3_is_never_a_class(s3, source, built, tmp_path):
    """As for a local source: the build's own output inside the source prefix was listed as a class on the
    rerun (every label moved by one, the cache rebuilt), and so was any other datapipe cache in it."""
    src = s3.bucket() + "/images"
    fs = s3.filesystem()
    for path in sorted(source[0].rglob("*")):
        if path.is_file():
            fs.put_file(str(path), src.removeprefix("s3://") + "/" + path.relative_to(source[0]).as_posix())
    want = datapipe.open(built[0])
    for out in (f"{src}/cache", f"{src}/{want.classes[0]}/cache", f"{src}/zz-old"):
        first = build(src, out, storage_options=s3.storage_options)
        again = build(src, out, storage_options=s3.storage_options)
        assert (first.num_samples, again.num_samples, again.shards_built) == (len(want), len(want), 0), out
        assert first.empty_classes == [] == again.empty_classes, out
        got = datapipe.open(out, local_cache=tmp_path / "node", storage_options=s3.storage_options)
        assert got.classes == want.classes and np.array_equal(got.labels, want.labels), out
    # zz-old stays in the source: a datapipe cache there is never a class of another build either
    elsewhere = build(src, tmp_path / "local", storage_options=s3.storage_options)
    assert datapipe.open(tmp_path / "local").classes == want.classes and elsewhere.num_samples == len(want)
    with pytest.raises(datapipe.errors.SourceError, match="is the output itself"):
        build(src, src + "/", storage_options=s3.storage_options)


def test_a_shard_larger_than_a_part_is_streamed_in_parts_and_equals_the_local_build(s3, big_source, tmp_path, imaging,
                                                                                   monkeypatch):
    monkeypatch.setattr(remote, "PART_BYTES", remote.MIN_PART_BYTES)
    url = s3.bucket() + "/cache"
    spec = datapipe.BuildSpec(size=300, shard_size=24)  # one shard of 24 x 300x300x3 bytes: 6.5 MB, two parts
    assert build(big_source, url, spec, storage_options=s3.storage_options).status == "ok"
    etag = s3.objects(url)["cache/shards/000000.zarr/images/c/0/0/0/0"]["ETag"]
    assert etag.strip('"').endswith("-2")  # a multipart upload of two parts, not one PUT after the shard
    build(big_source, tmp_path / "local", spec)
    got = imaging.tree_bytes(download(s3, url, tmp_path / "got"))
    assert shard_files(got) == shard_files(imaging.tree_bytes(tmp_path / "local"))
    assert remote.verify(remote.open_location(url, s3.storage_options)) == []



@pytest.mark.distributed
def test_a_worker_decodes_its_next_shard_while_the_store_completes_the_last_one(s3, big_source):
    """One worker process with one thread: without leaving the thread pool while a shard's upload completes,
    no two shard tasks could ever run at once there."""
    from dask.distributed import Client, LocalCluster

    url = s3.bucket() + "/cache"
    spec = datapipe.BuildSpec(size=96, shard_size=4)  # 6 shards
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        client.get_task_stream()  # the scheduler records tasks from now on
        report = datapipe.build(big_source, url, spec, cluster=datapipe.Cluster(scheduler=cluster.scheduler_address),
                                progress=False, storage_options=s3.storage_options)
        stream = [t for t in client.get_task_stream() if str(t["key"]).startswith("datapipe-shard-")]
    assert report.shards_built == 6 and len(stream) == 6
    spans = sorted((s["start"], s["stop"]) for t in stream for s in t["startstops"] if s["action"] == "compute")
    assert len(spans) == 6
    # by more than the scheduler's clock could blur (one thread's spans at most touch: [(0, 1.128), (1.128, 1.241), ...])
    overlapping = sum(later[0] < earlier[1] - 0.01 for earlier, later in zip(spans, spans[1:], strict=False))
    assert overlapping >= 1, spans
    loc = remote.open_location(url, s3.storage_options)
    assert remote.verify(loc) == [] and remote.read_manifest(loc).num_samples == 24


def _uploads(s3, bucket: str) -> list:
    return s3.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_an_aborted_shard_upload_leaves_no_object_and_no_unfinished_upload(s3, tmp_path):
    url = s3.bucket()
    bucket = url.removeprefix("s3://")
    loc = remote.open_location(url, s3.storage_options)
    data = tmp_path / "data"
    with open(data, "wb") as f:
        upload = remote.ShardUpload(loc, "shards/000000.zarr", part_bytes=remote.MIN_PART_BYTES)
        upload.follow(data, "images/c/0/0/0/0")
        f.write(os.urandom(remote.MIN_PART_BYTES + 1000))  # one whole part: it leaves while the file is written
        f.flush()
        _wait_for(lambda: len(_uploads(s3, bucket)) == 1, "the first part's upload", timeout=30)
        upload.abort()
    assert _uploads(s3, bucket) == [] and s3.objects(url) == {}


def test_an_upload_finished_after_the_writer_renamed_its_folder_has_every_object_and_zarr_json_last(s3, tmp_path):
    url = s3.bucket()
    loc = remote.open_location(url, s3.storage_options)
    tmp, final = tmp_path / ".tmp-shard", tmp_path / "shard"
    (tmp / "images").mkdir(parents=True)
    payload = os.urandom(remote.MIN_PART_BYTES * 2 + 123)
    upload = remote.ShardUpload(loc, "shards/000003.zarr")
    with open(tmp / "images" / "0", "wb") as f:
        upload.follow(tmp / "images" / "0", "images/0")
        f.write(payload)
    (tmp / "images" / "zarr.json").write_text("{}")
    (tmp / "zarr.json").write_text('{"last": true}')
    tmp.rename(final)  # as ShardWriter.commit does: the upload keeps reading the renamed file
    keys = upload.finish(final)
    assert keys[-1] == "shards/000003.zarr/zarr.json"
    fs = s3.filesystem()
    assert fs.cat_file(f"{url.removeprefix('s3://')}/shards/000003.zarr/images/0") == payload
    assert sorted(s3.objects(url)) == sorted(keys)


@pytest.mark.parametrize("calculation", ["when_supported", "when_required"])
def test_each_part_carries_its_crc32c_unless_the_client_sends_checksums_only_when_required(s3, tmp_path, calculation):
    """botocore's default (``when_supported``) would checksum every part itself (a CRC32 in Python): each part
    carries datapipe's CRC32C instead, which the store checks on receipt; a client configured ``when_required``
    (for stores that refuse checksums) sends none. Read from the requests as they leave the client."""
    options = {**s3.storage_options, "config_kwargs": {"request_checksum_calculation": calculation}}
    url = s3.bucket()
    loc = remote.open_location(url, options)
    parts: list[tuple[dict[str, str], bytes]] = []  # the headers and body of each UploadPart request

    def record(request, **_):
        if "partNumber=" in request.url:
            body = request.body.getvalue() if hasattr(request.body, "getvalue") else bytes(request.body)
            parts.append(({k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}, body))

    loc.call("connect", read=True)
    loc.fs.s3.meta.events.register("before-send.s3", record)
    payload = os.urandom(remote.MIN_PART_BYTES * 2 + 123)
    (tmp_path / "shard" / "images").mkdir(parents=True)
    upload = remote.ShardUpload(loc, "shards/000000.zarr", part_bytes=remote.MIN_PART_BYTES)
    with open(tmp_path / "shard" / "images" / "0", "wb") as f:
        upload.follow(tmp_path / "shard" / "images" / "0", "images/0")
        f.write(payload)
    upload.finish(tmp_path / "shard")
    assert s3.filesystem().cat_file(f"{url.removeprefix('s3://')}/shards/000000.zarr/images/0") == payload

    assert len(parts) == 3 and b"".join(body for _, body in parts) == payload
    for headers, body in parts:
        checksums = {k: v for k, v in headers.items() if k.startswith("x-amz-checksum-")}
        if calculation == "when_supported":
            assert checksums == {"x-amz-checksum-crc32c": remote._b64_crc32c(body)}
        else:
            assert checksums == {}


def test_a_foreign_zarr_json_in_a_shards_place_is_left_alone(s3, source):
    url = s3.bucket() + "/cache"
    build(source[0], url, storage_options=s3.storage_options)
    fs = s3.filesystem()
    key = url.removeprefix("s3://") + "/shards/000001.zarr/zarr.json"
    fs.pipe_file(key, b'{"zarr_format": 3, "node_type": "group"}')
    before = s3.objects(url)
    with pytest.raises(datapipe.errors.BuildError, match="000001.zarr/zarr.json is in the way"):
        build(source[0], url, storage_options=s3.storage_options)
    assert fs.cat_file(key) == b'{"zarr_format": 3, "node_type": "group"}'
    after = s3.objects(url)
    assert {k: v["ETag"] for k, v in after.items() if "/shards/" in k} == {k: v["ETag"] for k, v in before.items() if "/shards/" in k}


def _upload_tree(s3, root: Path, url: str) -> list[str]:
    """Upload every file under ``root``; return the images a class-folder build reads (no hidden names)."""
    fs = s3.filesystem()
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    for rel in rels:
        fs.put_file(str(root / rel), url.removeprefix("s3://") + "/" + rel)
    return [r for r in rels if not any(part.startswith(".") for part in r.split("/"))]


def test_a_csv_object_in_s3_builds_the_same_cache_as_the_local_csv(s3, source, tmp_path, imaging):
    images = s3.bucket() + "/data/images"
    rels = [r for r in _upload_tree(s3, source[0], images) if r.lower().endswith((".jpg", ".jpeg", ".png"))]
    assert len(rels) > 4
    labels = {r: r.split("/")[0] for r in rels}
    local_csv = source[0] / "list.csv"
    rows = ["path,label"] + [f"{r},{labels[r]}" for r in rels]
    try:
        local_csv.write_text("\n".join(rows) + "\n")
        local = build(local_csv, tmp_path / "from-local-csv")
    finally:
        local_csv.unlink()
    # the same rows in the store: relative to the CSV's folder, as full URLs of the bucket, one duplicated
    remote_rows = ["path,label"] + [f"{images}/{r},{labels[r]}" if i % 2 else f"{r},{labels[r]}" for i, r in enumerate(rels)]
    remote_rows.append(f"./{rels[0]},{labels[rels[0]]}")
    s3.filesystem().pipe_file(images.removeprefix("s3://") + "/list.csv", ("\n".join(remote_rows) + "\n").encode())
    out = tmp_path / "from-s3-csv"
    report = build(images + "/list.csv", out, storage_options=s3.storage_options, max_bad_fraction=0.5)
    assert report.status == "ok" and report.num_samples == local.num_samples == len(rels)
    assert [q["error"] for q in report.quarantined] == ["duplicate"]
    got, want = shard_files(imaging.tree_bytes(out)), shard_files(imaging.tree_bytes(tmp_path / "from-local-csv"))
    assert without_inputs_hash(got) == without_inputs_hash(want)
    manifest = datapipe.open(out).manifest
    assert manifest.source.root == images and manifest.source.kind == "csv"
    assert json.loads((out / "build.json").read_text())["source"]["path"] == images + "/list.csv"


def test_a_csv_object_naming_objects_above_its_folder_and_missing_ones(s3, source, tmp_path):
    bucket = s3.bucket()
    rels = [r for r in _upload_tree(s3, source[0], bucket + "/pool") if r.lower().endswith((".jpg", ".jpeg", ".png"))]
    rows = [f"{bucket}/pool/{r},{r.split('/')[0]}" for r in rels] + ["missing.jpg,cat"]
    s3.filesystem().pipe_file(bucket.removeprefix("s3://") + "/lists/train.csv", ("\n".join(rows) + "\n").encode())
    report = build(bucket + "/lists/train.csv", tmp_path / "out", storage_options=s3.storage_options, max_bad_fraction=0.5)
    assert report.num_samples == len(rels)
    assert [q["path"] for q in report.quarantined] == ["lists/missing.jpg"]
    assert datapipe.open(tmp_path / "out").manifest.source.root == bucket  # the folder holding every row


@pytest.mark.parametrize(("row", "message"), [
    ("s3://another-bucket/a.jpg,x", "another bucket"),
    ("gs://b/a.jpg,x", "another kind of store"),
    ("/abs/a.jpg,x", "absolute path"),
    ("../a.jpg,x", "outside the CSV's folder"),
    ("a.jpg,x,extra", "3 columns"),
])
def test_a_bad_row_of_a_csv_object_is_refused_naming_the_object_and_line(s3, tmp_path, row, message):
    url = s3.bucket() + "/lists/train.csv"
    s3.filesystem().pipe_file(url.removeprefix("s3://"), f"path,label\nok.jpg,y\n{row}\n".encode())
    with pytest.raises(datapipe.errors.SourceError, match=message) as info:
        build(url, tmp_path / "out", storage_options=s3.storage_options)
    assert f"{url}:3" in str(info.value)


def test_a_missing_csv_object_is_a_source_error(s3, tmp_path):
    url = s3.bucket() + "/nothing.csv"
    with pytest.raises(datapipe.errors.SourceError, match="does not exist"):
        build(url, tmp_path / "out", storage_options=s3.storage_options)


# ----------------------------------------------------------------------------- a real cluster, killed mid-build


@pytest.fixture(scope="module")
def big_source(tmp_path_factory, imaging) -> Path:
    """Images large enough that a build of one sample per shard takes a few seconds."""
    root = tmp_path_factory.mktemp("bigsrc") / "images"
    imaging.write_source(root, {"a": 12, "b": 12}, shape=(900, 1200), variety=False)
    return root


def _wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def _finished(s3, url: str, *, exact: bool = True) -> set[str]:
    """The shards whose zarr.json is a whole shard's record (an upload begins by writing one that is not); not
    ``exact``: told apart by size, from the listing alone (a quick poll: the claim is less than half a record)."""
    fs, bucket = s3.filesystem(), url.removeprefix("s3://").partition("/")[0]
    claim = len(remote.uploading_document("0" * 32, 999_999))
    keys = [k for k, info in s3.objects(url).items() if k.endswith(".zarr/zarr.json") and info["Size"] > 2 * claim]
    return {k.split("/")[-2] for k in keys if not exact or remote.shard_record(json.loads(fs.cat_file(f"{bucket}/{k}")))}


@pytest.mark.distributed
def test_sigkill_of_the_client_on_a_local_cluster_resumes_uploading_only_unfinished_shards(s3, big_source, tmp_path, imaging):
    url = s3.bucket() + "/cache"
    args = ["build", str(big_source), url, "--size", "32", "--shard-size", "1", "--workers", "2", "--quiet",
            "--storage-option", f"endpoint_url={s3.endpoint_url}"]
    proc = subprocess.Popen([sys.executable, "-m", "datapipe.cli", *args], env={**os.environ, **s3.env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(lambda: len(_finished(s3, url, exact=False)) >= 3, "three finished shards")
        # The store freezes first: no shard finishes between the look and the kill (the whole build of these
        # small shards can take well under a second, more than 20 shards may finish after one listing).
        s3.pause()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the client and its LocalCluster's workers
        proc.wait()
        s3.resume()
    before = s3.objects(url)
    done = _finished(s3, url)
    assert "cache/manifest.json" not in before and 3 <= len(done) < 24
    rerun = cli(*args, env=s3.env)
    assert rerun.returncode == 0, rerun.stderr
    report = json.loads(s3.filesystem().cat_file(url.removeprefix("s3://") + "/report.json"))
    after = s3.objects(url)
    assert report["shards_skipped"] >= len(done) and report["shards_built"] == 24 - report["shards_skipped"]
    for key, info in before.items():  # the finished shards' objects are the very objects uploaded before the kill
        if key.startswith("cache/shards/") and key.split("/")[2] in done:
            assert after[key]["ETag"] == info["ETag"] and after[key]["LastModified"] == info["LastModified"], key
    assert remote.verify(remote.open_location(url, s3.storage_options)) == []
    local = tmp_path / "local"
    build(big_source, local, size=32, shard_size=1)
    got = imaging.tree_bytes(download(s3, url, tmp_path / "got"))
    assert shard_files(got) == shard_files(imaging.tree_bytes(local))  # a Dask build into s3 = a serial local build


def _spawned(process) -> bool:
    """Whether ``process`` was started by multiprocessing's spawn (a nanny's worker process)."""
    try:
        cmdline = process.cmdline()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return False
    return any("spawn_main" in part or part == "--multiprocessing-fork" for part in cmdline)


@pytest.mark.distributed
def test_sigkill_of_a_dask_worker_mid_upload_is_retried_and_the_cache_is_whole(s3, big_source, tmp_path):
    psutil = pytest.importorskip("psutil")
    from distributed import Client

    port = free_port()
    env = {**os.environ, **s3.env}
    scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                  "--port", str(port), "--dashboard-address", ":0"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    workers = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", f"tcp://127.0.0.1:{port}",
                                 "--nthreads", "1", "--no-dashboard", "--name", f"worker{i}"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
               for i in range(2)]
    url = s3.bucket() + "/cache"
    build_proc: subprocess.Popen | None = None
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            def addresses() -> dict[str, str]:
                return {w.get("name"): a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}

            # both workers take part from the first shard on (one slow to start would leave the other all the work)
            _wait_for(lambda: {"worker0", "worker1"} <= set(addresses()), "both workers")
            addr = addresses()["worker0"]
            # The nanny's children are the worker process and multiprocessing's resource tracker: the worker is
            # the one multiprocessing spawned, the process the scheduler knows.
            victim = next((child for child in psutil.Process(workers[0].pid).children(recursive=True)
                           if _spawned(child)), None)
            assert victim is not None, "the dask worker has no worker process"
            assert client.run(os.getpid, workers=[addr])[addr] == victim.pid
            build_proc = subprocess.Popen(
                [sys.executable, "-m", "datapipe.cli", "build", str(big_source), url, "--size", "32", "--shard-size",
                 "1", "--scheduler", f"tcp://127.0.0.1:{port}", "--quiet", "--storage-option",
                 f"endpoint_url={s3.endpoint_url}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            _wait_for(lambda: len(_finished(s3, url, exact=False)) >= 2, "two finished shards")
            assert "cache/manifest.json" not in s3.objects(url), "the build ended before the kill"
            # The store freezes: no shard finishes from here to the kill, so the build is still running then and
            # the worker's task is still uploading (the store's timeout, a minute, is far off).
            s3.pause()
            try:  # the worker to kill must hold shard tasks
                _wait_for(lambda: bool(client.processing(workers=[addr]).get(addr)),
                          "the worker to be running a shard task", 30)
                assert build_proc.poll() is None, "the build ended before the kill"
                victim.kill()
                victim.wait(30)
                assert not victim.is_running(), "the worker process outlived its SIGKILL"
            finally:
                s3.resume()
        out, err = build_proc.communicate(timeout=240)
        assert build_proc.returncode == 0, err
    finally:
        if build_proc is not None and build_proc.poll() is None:
            build_proc.kill()
            build_proc.communicate()
        for p in [*workers, scheduler]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    loc = remote.open_location(url, s3.storage_options)
    assert remote.verify(loc) == [] and remote.read_manifest(loc).num_samples == 24


# ----------------------------------------------------------------------------- a store that freezes mid-write


def _frozen_write(kind: str, loc: remote.Location, tmp_path: Path, nbytes: int, s3) -> None:
    """Freeze the store (``s3.pause()``), then write ``nbytes`` in the way ``kind`` says."""
    data = os.urandom(nbytes)
    if kind != "shard_upload":
        s3.pause()
    if kind == "pipe_file":
        remote.write_bytes(loc, "one", data)
    elif kind == "pipe":
        remote.write_objects(loc, {"one": data, "two": b"{}"})
    elif kind == "put_file":
        (tmp_path / "file").write_bytes(data)
        remote.put_file(loc, tmp_path / "file", "one")
    if kind != "shard_upload":
        return
    # a shard's data object streamed in parts while it is written: the store freezes after the first part
    # (mid multipart upload), or, for a shard of one part, before its single PUT
    folder = tmp_path / "000000.zarr"
    file = folder / "images" / "c" / "0" / "0" / "0" / "0"
    file.parent.mkdir(parents=True)
    (folder / "zarr.json").write_text("{}")
    half = len(data) // 2 if len(data) > 2 * remote.MIN_PART_BYTES else 0
    file.write_bytes(data[:half])
    upload = remote.ShardUpload(loc, "shards/000000.zarr", part_bytes=remote.MIN_PART_BYTES)
    upload.follow(file, "images/c/0/0/0/0")
    try:
        if half:
            bucket, key = loc.path("shards/000000.zarr/images/c/0/0/0/0").split("/", 1)
            client = s3.client()

            def first_part_stored() -> bool:
                ups = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
                return any(u["Key"] == key and client.list_parts(Bucket=bucket, Key=key, UploadId=u["UploadId"])
                           .get("Parts") for u in ups)

            _wait_for(first_part_stored, "the first part", timeout=30)
        s3.pause()
        with open(file, "ab") as f:
            f.write(data[half:])
        upload.finish(folder)
    except BaseException:
        upload.abort()
        raise


@pytest.mark.parametrize("kind", ["pipe_file", "pipe", "put_file", "shard_upload"])
@pytest.mark.parametrize("nbytes", [1000, 12 << 20], ids=["small", "12MiB"])
def test_a_write_to_a_frozen_store_ends_at_its_deadline_naming_the_object(s3, tmp_path, kind, nbytes):
    """A store that stops answering mid-request (SIGSTOP: the connection stays open, nothing is read) would hold
    a write without end: the S3 client has no timeout for sending. Each write datapipe makes has a deadline
    (1 s per 8 MiB here) and then raises RemoteStoreError naming the object; nothing half written appears."""
    url = s3.bucket() + "/cache"
    loc = remote.open_location(url, s3.storage_options)
    remote.write_bytes(loc, "warm", b"{}")  # the client and its connection exist before the store freezes
    loc = dataclasses.replace(loc, timeout=1.0)  # (making the client took up to 1.7 s on a loaded machine)
    t0 = time.monotonic()
    try:
        with pytest.raises(datapipe.errors.RemoteStoreError, match=r"cache/(one|shards/000000\.zarr).*did not take a "
                           r"write of .* within .*DATAPIPE_STORE_TIMEOUT.*finished shards are kept") as caught:
            _frozen_write(kind, loc, tmp_path, nbytes, s3)
        took = time.monotonic() - t0
    finally:
        s3.resume()
    assert "\n" not in str(caught.value)
    # the deadline (1.5 s for 12 MiB), plus an aborted multipart upload's brief attempt (CLEANUP_SECONDS)
    assert took < 1.5 + remote.CLEANUP_SECONDS + 5, took
    assert set(s3.objects(url)) <= {"cache/warm", "cache/one", "cache/two"}  # no shard object, whole or in part
    if "cache/one" in s3.objects(url):  # a single PUT the frozen store had read whole before it froze
        assert s3.objects(url)["cache/one"]["Size"] == nbytes
    give_up = time.monotonic() + 60  # the same client goes on once the store answers again (see the read test)
    while True:
        try:
            remote.write_bytes(loc, "after", b"{}")
            break
        except datapipe.errors.RemoteStoreError:
            if time.monotonic() > give_up:
                raise


@pytest.mark.parametrize("kind", ["listing", "read_doc", "read_docs", "delete", "stream_crc32c"])
def test_a_read_of_a_frozen_store_ends_at_its_deadline(s3, kind):
    """A request the store never answers is retried by botocore and by s3fs for about seven minutes; each
    request datapipe makes (a listing page, a document's 8 MiB range, a delete) ends at the deadline instead."""
    url = s3.bucket() + "/cache"
    loc = remote.open_location(url, s3.storage_options)
    remote.write_bytes(loc, "doc.json", b"{}")
    assert remote.listing(loc) == {"doc.json": 2} and remote.read_doc(loc, "doc.json") == {}
    loc = dataclasses.replace(loc, timeout=1.0)  # the client made under the default deadline, before the freeze
    s3.pause()
    t0 = time.monotonic()
    try:
        with pytest.raises(datapipe.errors.RemoteStoreError, match=r"cache.*the store did not answer within 1 s "
                           r"\(DATAPIPE_STORE_TIMEOUT") as caught:
            if kind == "listing":
                remote.listing(loc)
            elif kind == "read_doc":
                remote.read_doc(loc, "doc.json")
            elif kind == "read_docs":
                remote.read_docs(loc, ["doc.json", "other.json"])
            elif kind == "delete":
                remote.delete(loc, ["doc.json"])
            else:
                remote.stream_crc32c(loc, "doc.json")
        took = time.monotonic() - t0
    finally:
        s3.resume()
    assert "\n" not in str(caught.value) and took < 5, took
    # the same client goes on afterwards (on a loaded machine the thawed store may first answer what it was sent
    # while frozen, later than the 1 s deadline of a read: the client is tried again, never made anew)
    give_up = time.monotonic() + 60
    while True:
        try:
            assert remote.read_doc(loc, "doc.json") == {} or kind == "delete"
            break
        except datapipe.errors.RemoteStoreError:
            if time.monotonic() > give_up:
                raise


@pytest.mark.parametrize("command", ["info", "verify", "build-into", "build-from"])
def test_a_command_on_a_frozen_store_ends_at_the_deadline_with_one_line(s3, source, tmp_path, command):
    """info, verify and build against a store that accepts connections but answers nothing: one line naming the
    URL after DATAPIPE_STORE_TIMEOUT (1 s here) instead of botocore's and s3fs's retries (about seven minutes)."""
    url = s3.bucket() + "/cache"
    args = {"info": ["info", url], "verify": ["verify", url],
            "build-into": ["build", str(source[0]), url, "--size", "16", "--scheduler", "sync"],
            "build-from": ["build", url, str(tmp_path / "out"), "--size", "16", "--scheduler", "sync"]}[command]
    s3.pause()
    try:
        t0 = time.monotonic()
        proc = cli(*args, env={**s3.env, "DATAPIPE_STORE_TIMEOUT": "1"})
        took = time.monotonic() - t0
    finally:
        s3.resume()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"datapipe {args[0]}: error: {url}") and "did not answer within 1 s" in lines[0], lines
    assert took < 20, took
    assert not (tmp_path / "out").exists()


def profile_env(tmp_path: Path, s3, process: str) -> dict[str, str]:
    """An environment whose only credentials come from an AWS profile's ``credential_process`` (the shell
    ``process``, which prints them), with the server's endpoint and no other AWS setting."""
    script = tmp_path / "credentials.sh"
    script.write_text(f"#!/bin/sh\n{process}\n")
    script.chmod(0o755)
    (tmp_path / "config").write_text(f"[default]\ncredential_process = {script}\nregion = us-east-1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_CONFIG_FILE=str(tmp_path / "config"), AWS_EC2_METADATA_DISABLED="true",
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_ENDPOINT_URL=s3.endpoint_url)
    return env


SLOW_CREDENTIALS = 'sleep 6; echo \'{"Version": 1, "AccessKeyId": "testing", "SecretAccessKey": "testing"}\''
STREAM = """
import sys, torch, datapipe
ds = datapipe.StreamingDataset(sys.argv[1], batch_size=4, local_cache=sys.argv[2], timeout=4)
loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=int(sys.argv[3]))
print(sum(len(labels) for _, labels in loader), len(ds.cache))
"""


@pytest.mark.parametrize("command", ["info", "verify", "build-into", "build-from", "stream", "stream-workers"])
def test_a_slow_credential_lookup_counts_against_no_request_deadline(s3, source, tmp_path, command):
    """The S3 client is made (its credentials looked up: here a credential_process that takes 6 s, as SSO or an
    instance's metadata service can) under a deadline of its own, not the first request's: with a 4 s deadline
    per request (room for a loaded store), every command and the loader (in its DataLoader worker too, which
    makes a client of its own) still works."""
    url = s3.bucket() + "/cache"
    assert cli("build", str(source[0]), url, "--size", "16", "--scheduler", "sync", env=s3.env).returncode == 0
    images = s3.bucket() + "/images"
    s3.filesystem().put(str(source[0]) + "/", images.removeprefix("s3://"), recursive=True)
    env = {**profile_env(tmp_path, s3, SLOW_CREDENTIALS), "DATAPIPE_STORE_TIMEOUT": "4"}
    args = {"info": ["info", url], "verify": ["verify", url],
            "build-into": ["build", str(source[0]), s3.bucket() + "/again", "--size", "16", "--scheduler", "sync"],
            "build-from": ["build", images, str(tmp_path / "out"), "--size", "16", "--scheduler", "sync"]}
    if command in args:
        argv = [sys.executable, "-m", "datapipe.cli", *args[command]]
    else:
        argv = [sys.executable, "-c", STREAM, url, str(tmp_path / "node"), "1" if command == "stream-workers" else "0"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if command.startswith("stream"):
        assert proc.stdout.split() == [str(len(source[1]))] * 2, proc.stdout
    elif command == "build-from":
        assert len(datapipe.open(tmp_path / "out")) == len(source[1])


@pytest.mark.parametrize("command", ["info", "build-into"])
def test_credentials_that_cannot_be_had_are_one_line_naming_the_url(s3, source, tmp_path, command):
    """A credential_process that fails: one line naming the URL and the client's reason, no traceback."""
    url = s3.bucket() + "/cache"
    env = profile_env(tmp_path, s3, "echo 'the token expired: log in again' >&2; exit 3")
    args = {"info": ["info", url], "build-into": ["build", str(source[0]), url, "--size", "16", "--scheduler", "sync"]}
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", *args[command]], capture_output=True, text=True,
                          env=env, timeout=240)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"datapipe {args[command][0]}: error: {url}"), lines[0]
    assert "the token expired" in lines[0] and "credential" in lines[0].lower(), lines[0]


def test_a_listing_of_more_than_a_page_and_documents_of_more_than_a_range_read_whole(s3, monkeypatch):
    """listing() on S3 goes page by page (1,000 keys; 10 here) and read_bytes() in 8 MiB ranges: both give it all."""
    monkeypatch.setattr(remote, "LIST_PAGE", 10)
    url = s3.bucket() + "/cache"
    loc = remote.open_location(url, s3.storage_options)
    remote.write_objects(loc, {f"many/{i:05d}": b"x" * (i % 7) for i in range(25)})
    big = os.urandom(remote.PART_BYTES * 2 + 5)
    remote.write_bytes(loc, "big", big)
    s3.client().put_object(Bucket=url.removeprefix("s3://").split("/")[0], Key="cache/folder/", Body=b"")  # a marker
    found = remote.listing(loc)
    assert found == {**{f"many/{i:05d}": i % 7 for i in range(25)}, "big": len(big)}
    assert remote.listing(loc, "many") == {f"many/{i:05d}": i % 7 for i in range(25)}
    assert remote.listing(loc, "nothing-here") == {}
    assert remote.read_bytes(loc, "big") == big and remote.read_bytes(loc, "missing") is None
    assert remote.read_bytes(loc, "big", limit=len(big)) == big
    with pytest.raises(datapipe.errors.CacheError, match="more than the"):
        remote.read_bytes(loc, "big", limit=len(big) - 1)
    assert remote.stream_crc32c(loc, "big") == (len(big), f"{datapipe.files.crc32c(big):08x}")
    assert remote.stream_crc32c(loc, "many/00007") == (0, f"{0:08x}") and remote.read_bytes(loc, "many/00007") == b""
    exact = big[:remote.PART_BYTES * 2]  # a whole number of ranges: the last range asked for starts at its end
    remote.write_bytes(loc, "exact", exact)
    assert remote.read_bytes(loc, "exact") == exact
    assert remote.stream_crc32c(loc, "exact") == (len(exact), f"{datapipe.files.crc32c(exact):08x}")


def test_a_store_frozen_mid_upload_ends_the_build_with_one_line_and_the_rerun_resumes(s3, big_source):
    """The build's workers stream a shard of 10 MiB in two parts; the store freezes while the multipart upload is
    open. The build ends (instead of waiting for ever) with one line naming the object and what to do; the rerun,
    once the store answers again, finishes the cache."""
    url = s3.bucket() + "/cache"
    bucket = url.removeprefix("s3://").split("/")[0]
    args = ["build", str(big_source), url, "--size", "384", "--shard-size", "24", "--workers", "1", "--quiet",
            "--storage-option", f"endpoint_url={s3.endpoint_url}"]
    env = {**os.environ, **s3.env, "DATAPIPE_STORE_TIMEOUT": "5"}  # room for a loaded store before the freeze
    proc = subprocess.Popen([sys.executable, "-m", "datapipe.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    client = s3.client()
    try:
        _wait_for(lambda: client.list_multipart_uploads(Bucket=bucket).get("Uploads"), "a multipart upload")
        s3.pause()
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        s3.resume()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    last = err.strip().splitlines()[-1]
    assert proc.returncode != 0 and last.startswith("datapipe build: error: " + url), err
    assert "Traceback" not in err and "Compute Failed" not in err, err  # the workers' logs stay off the terminal
    assert "DATAPIPE_STORE_TIMEOUT" in last and "finished shards are kept" in last, last
    assert took < 30, took  # the deadline, the workers' end and the lock's brief removal
    assert "cache/manifest.json" not in s3.objects(url)
    rerun = cli(*args[:args.index("--workers")], "--scheduler", "sync", *args[args.index("--workers") + 2:], env=s3.env)
    assert rerun.returncode == 0, rerun.stderr
    loc = remote.open_location(url, s3.storage_options)
    assert remote.verify(loc) == [] and remote.read_manifest(loc).num_samples == 24


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf", "nan"])
def test_a_bad_store_timeout_is_one_line_before_anything_is_read(tmp_path, value):
    """DATAPIPE_STORE_TIMEOUT is checked before the source is scanned (the scan of a large bucket can take minutes)."""
    run = cli("build", str(tmp_path / "no-such-source"), "s3://bucket/cache",
              env={"DATAPIPE_STORE_TIMEOUT": value, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "DATAPIPE_STORE_TIMEOUT must be a positive number of seconds" in run.stderr or \
        "DATAPIPE_STORE_TIMEOUT must be a number" in run.stderr, run.stderr


def test_the_store_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("DATAPIPE_STORE_TIMEOUT", raising=False)
    assert remote.store_timeout() == remote.STORE_TIMEOUT == 60.0
    monkeypatch.setenv("DATAPIPE_STORE_TIMEOUT", "2.5")
    assert remote.store_timeout() == 2.5


@pytest.mark.parametrize("fault", ["frozen", "stopped"])
def test_a_store_that_fails_while_a_source_image_is_read_ends_the_task_instead_of_quarantining_it(s3, imaging, fault):
    """A store that fails (frozen: no answer within the deadline; stopped: no connection) is no fault of the
    image: it would otherwise be quarantined as unreadable and left out of the cache, or called a decoder error.
    A missing object is the object's own fault: it is quarantined."""
    from datapipe import builder
    from datapipe.codecs import DecodeSpec

    src = s3.bucket() + "/images"
    s3.filesystem().pipe_file(src.removeprefix("s3://") + "/a/one.jpg", imaging.jpeg(imaging.gradient(40, 52)))
    spec = DecodeSpec(size=16)
    out = np.zeros((16, 16, 3), np.uint8)
    quarantined: list[dict] = []
    assert builder._load(f"{src}/a/one.jpg", spec, "a/one.jpg", quarantined, out, 1 << 20, s3.storage_options, 1.0)
    assert builder._load(f"{src}/a/gone.jpg", spec, "a/gone.jpg", quarantined, out, 1 << 20, s3.storage_options, 1.0) \
        is None
    assert [q["path"] for q in quarantined] == ["a/gone.jpg"] and quarantined[0]["error"] == "unreadable"
    options = dict(s3.storage_options)
    if fault == "stopped":
        options["endpoint_url"] = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        options["config_kwargs"] = {"retries": {"max_attempts": 1}}
    else:
        s3.pause()
    try:
        t0 = time.monotonic()
        for call in (lambda: builder._load(f"{src}/a/one.jpg", spec, "a/one.jpg", quarantined, out, 1 << 20, options, 1.0),
                     lambda: builder._probe(f"{src}/a/one.jpg", {"max_pixels": 10**8}, options, 1.0)):
            with pytest.raises(datapipe.errors.RemoteStoreError, match=r"a/one\.jpg: the store (failed while the image "
                               r"was read .*no fault of the image|did not answer within 1 s).*finished shards are kept"):
                call()
        took = time.monotonic() - t0
    finally:
        if fault == "frozen":
            s3.resume()
    assert len(quarantined) == 1 and took < 30, (quarantined, took)


# ----------------------------------------------------------------------------- storage options checked, local disks


def test_credentials_names_and_urls_stay_text_whatever_their_characters():
    got = remote.parse_storage_options(["key=12345678", "secret=0042", "token=null", "client_kwargs.region_name=1",
                                        "client_kwargs.aws_access_key_id=007", "s3_additional_kwargs.SSEKMSKeyId=99",
                                        "endpoint_url=http://10.0.0.1:9000", "profile=true", "max_concurrency=8",
                                        "use_ssl=false", "default_cache_type=none"])
    assert got == {"key": "12345678", "secret": "0042", "token": "null",
                   "client_kwargs": {"region_name": "1", "aws_access_key_id": "007"},
                   "s3_additional_kwargs": {"SSEKMSKeyId": "99"}, "endpoint_url": "http://10.0.0.1:9000",
                   "profile": "true", "max_concurrency": 8, "use_ssl": False, "default_cache_type": "none"}


# Each command refuses an option s3fs does not take, or a value of the wrong kind, before any request: one line, exit 2.
BAD_OPTIONS = [
    ("endpoint=http://127.0.0.1:9", r"storage option 'endpoint' is not an option of the s3:// filesystem \(s3fs\) "
                                    r"\(did you mean 'endpoint_url'\?\)"),
    ("client_kwargs=5", r"storage option 'client_kwargs' must be a mapping of keys to values, got 5 \(int\)"),
    ("client_kwargs.region=eu", r"storage option 'client_kwargs.region' is not an argument of the S3 client "
                                r"\(did you mean 'region_name'\?\)"),
    ("config_kwargs.retry=3", r"storage option 'config_kwargs' is refused by botocore's Config"),
    ("use_ssl=maybe", r"storage option 'use_ssl' must be true or false, got 'maybe' \(str\)"),
    ("config_kwargs.connect_timeout=abc", r"storage option 'config_kwargs.connect_timeout' must be a number of "
                                          r"seconds above 0, got 'abc' \(str\)"),
    ("config_kwargs.read_timeout=-1", r"'config_kwargs.read_timeout' must be a number of seconds above 0, got -1"),
]


@pytest.mark.parametrize("command", ["info", "verify", "build-into", "build-from"])
@pytest.mark.parametrize("option, says", BAD_OPTIONS, ids=[o.split("=")[0] for o, _ in BAD_OPTIONS])
def test_a_storage_option_the_filesystem_does_not_take_is_one_line(tmp_path, command, option, says):
    (tmp_path / "images" / "a").mkdir(parents=True)
    Image.new("RGB", (24, 24), (200, 30, 30)).save(tmp_path / "images" / "a" / "one.jpg")
    argv = {"info": ["info", "s3://bucket/cache"], "verify": ["verify", "s3://bucket/cache"],
            "build-into": ["build", str(tmp_path / "images"), "s3://bucket/cache", "--scheduler", "sync"],
            "build-from": ["build", "s3://bucket/images", str(tmp_path / "out"), "--scheduler", "sync"]}[command]
    proc = cli(*argv, "--storage-option", option, env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert re.search(says, lines[0]) and lines[0].startswith(f"datapipe {argv[0]}: error: s3://bucket/"), lines[0]


def test_credentials_given_as_digits_reach_the_store(s3, source):
    url = s3.bucket() + "/cache"
    build(source[0], url, storage_options=s3.storage_options)
    proc = cli("info", url, "--storage-option", f"endpoint_url={s3.storage_options['endpoint_url']}",
               "--storage-option", "key=12345678", "--storage-option", "secret=12345678", env={})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # moto takes any credentials
    assert f"cache      {url}" in proc.stdout


def test_a_full_staging_disk_is_named_as_local_not_blamed_on_the_store(s3, source, monkeypatch):
    import errno
    import tempfile

    from datapipe import builder
    from datapipe.errors import OutputWriteError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(builder, "_staging_folder", full)
    url = s3.bucket() + "/cache"
    with pytest.raises(OutputWriteError) as caught:
        build(source[0], url, storage_options=s3.storage_options)
    message = str(caught.value)
    assert message.startswith(f"{url}: cannot write the cache: No space left on device on a local disk, not the store"), message
    assert os.path.join(tempfile.gettempdir(), "datapipe-shard-*") in message and "TMPDIR" in message, message
    assert "credentials" not in message, message


def test_a_file_size_limit_on_the_staging_disk_is_named_as_local_not_blamed_on_the_store(s3, source):
    """A real RLIMIT_FSIZE (`ulimit -f`): the staged shard cannot be written (EFBIG); the one line says so, names
    the limit, and neither blames the store nor asks about credentials."""
    import resource

    url = s3.bucket() + "/cache"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))

    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source[0]), url, "--size", "64",
                           "--scheduler", "sync", "--quiet", "--storage-option", f"endpoint_url={s3.endpoint_url}"],
                          capture_output=True, text=True, env={**os.environ, **s3.env}, timeout=240, preexec_fn=limit)
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"datapipe build: error: {url}: cannot write the cache: File too large on a local disk, "
                           "not the store"), line
    assert "`ulimit -f`" in line and "credentials" not in line and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("error", "local"), [
    (OSError(28, "No space left on device"), True),
    (OSError(122, "Disk quota exceeded"), True),
    (OSError(30, "Read-only file system", "/tmp/x/datapipe-shard-1/a"), True),
    (OSError(27, "File too large"), True),
    (PermissionError(13, "Permission denied", "/tmp/x/datapipe-shard-1/a"), True),
    (PermissionError("Access Denied", "bucket/key"), False),  # s3fs's for the store's AccessDenied
    (OSError(5, "Internal error", "bucket/key"), False),  # s3fs's for any other store error
])
def test_a_local_os_error_is_never_blamed_on_the_store(error, local):
    from datapipe.errors import OutputWriteError

    loc = remote.Location("s3://bucket/cache", fs=None, root="bucket/cache", storage_options={})
    with pytest.raises(OutputWriteError) as caught, remote.store_errors(loc, "write the cache", OutputWriteError):
        raise error
    message = str(caught.value)
    assert ("check the URL, the credentials" not in message) == local, message
    assert ("not the store" in message or "(a local path)" in message) == local, message


def test_readers_of_a_node_cache_across_an_in_place_rebuild(s3, source, tmp_path, imaging):
    """A rerun with changed inputs rewrites a shard under the same build id, so a node's local_cache holds one
    copy of it for readers of both states. A reader opened before the rebuild that meets the new copy waited
    for a lock twice its timeout and blamed the lock: it says at once that the cache changed since it was
    opened. One opened after it, meeting the old copy that an older reader still holds, says so at its timeout."""
    from datapipe.errors import CorruptShardError, RemoteStoreError

    src = tmp_path / "src"
    shutil.copytree(source[0], src)
    url = s3.bucket() + "/cache"
    build(src, url, storage_options=s3.storage_options)
    node = tmp_path / "node"

    def reader(timeout: float = 30) -> datapipe.StreamingDataset:
        return datapipe.StreamingDataset(url, local_cache=node, storage_options=s3.storage_options, batch_size=4,
                                         timeout=timeout)

    old = reader()
    held_old = old.cache.remote.hold(0)  # the first shard's old copy, held open as a reader does
    first = sorted(p for p in src.rglob("*.jpg"))[0]
    first.write_bytes(imaging.jpeg(imaging.gradient(40, 52, seed=7)))
    assert build(src, url, storage_options=s3.storage_options).shards_built == 1  # the same build id, shard 0 anew
    new = reader()  # opened under the default timeout: a loaded store may take over a second to answer
    new.cache.remote.timeout = 1.0  # the wait for the old copy's lock ends after 1 s
    started = time.monotonic()
    with pytest.raises(RemoteStoreError, match="this node's copy is of the cache before it was rebuilt in place, and "
                                               "another process still reads it"):
        new.cache.remote.hold(0)
    assert time.monotonic() - started < 10
    held_old.release()
    new.cache.remote.timeout = 30.0  # the download of the new copy under a loaded store's deadline
    held_new = new.cache.remote.hold(0)  # the old copy free: replaced by the new one
    started = time.monotonic()
    with pytest.raises(CorruptShardError, match=r"shard 000000\.zarr: the cache changed since it was opened"):
        old.cache.remote.hold(0)
    assert time.monotonic() - started < 5  # at once, not after waiting for the lock
    held_new.release()


def test_a_closed_reader_lets_a_rebuilt_shard_replace_its_copy_at_once(s3, source, tmp_path, imaging):
    """A reader that read its epoch holds the node's copies of its shards; after close() (or its with block)
    it holds none, so a reader of the cache rebuilt in place downloads the new copy at once instead of
    waiting for the older reader until its timeout."""
    src = tmp_path / "src"
    shutil.copytree(source[0], src)
    url = s3.bucket() + "/cache"
    build(src, url, storage_options=s3.storage_options)
    node = tmp_path / "node"

    def reader() -> datapipe.StreamingDataset:
        return datapipe.StreamingDataset(url, local_cache=node, storage_options=s3.storage_options, batch_size=4,
                                         shuffle=False)

    with reader() as old:
        before = [labels for _, labels in old]
        assert old.cache.remote.open_shards()  # the copies it read stay held while it is open
    assert not old.cache.remote.open_shards()
    first = sorted(p for p in src.rglob("*.jpg"))[0]
    first.write_bytes(imaging.jpeg(imaging.gradient(40, 52, seed=7)))
    assert build(src, url, storage_options=s3.storage_options).shards_built == 1  # the same build id, shard 0 anew
    new = reader()
    new.cache.remote.timeout = 5.0  # a wait for a holder would end in an error after 5 s
    started = time.monotonic()
    try:
        after = [labels for _, labels in new]
    finally:
        new.close()
    assert time.monotonic() - started < 5
    assert torch.equal(torch.cat(before), torch.cat(after))  # the labels stay; shard 0's first image is new


def test_removing_a_lock_whose_object_became_garbage_leaves_it_without_an_error(s3, monkeypatch):
    """A lock object written over with garbage after its build stopped refreshing it is nobody's: the build's
    removal at its end raised a CacheError about the lock (its own work was done), where every other reader of
    the lock takes such an object for no holder. It is left as it is, and no error is raised."""
    _, fs, key, lock = _held_lock(s3, monkeypatch)
    lock.stop()
    fs.pipe_file(key, b"{not json")
    lock.remove()
    assert fs.cat_file(key) == b"{not json"


def _small_source(root: Path, names: tuple[str, ...]) -> Path:
    for k, name in enumerate(names):
        (root / name).mkdir(parents=True)
        for i in range(5):
            pixels = np.random.default_rng(10 * k + i).integers(0, 255, (40, 44, 3), np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


def test_verify_in_a_store_finds_impossible_index_rows_whose_checksums_agree(s3, tmp_path):
    """remote.verify and `build --verify` into a store compared the sample index's checksum only: a row of no height
    with its checksums made to agree was kept (readers refuse it and say to run --verify)."""
    src = _small_source(tmp_path / "src", ("a", "b"))
    url = s3.bucket() + "/cache"
    build(src, url, storage_options=s3.storage_options, fit="short", shard_size=4)
    fs, base = s3.filesystem(), url.removeprefix("s3://")
    key = base + "/shards/000000.zarr/index/c/0/0"
    rows = np.frombuffer(fs.cat_file(key), "<i8").reshape(-1, 4).copy()
    rows[1, 2] = 0
    raw = rows.astype("<i8").tobytes()
    fs.pipe_file(key, raw)
    checksum = f"{datapipe.files.crc32c(raw):08x}"
    for doc_key, edit in ((base + "/shards/000000.zarr/zarr.json", lambda d: d["attributes"]["datapipe"]),
                          (base + "/manifest.json", lambda d: d["shards"][0])):
        doc = json.loads(fs.cat_file(doc_key))
        edit(doc)["index_crc32c"] = checksum
        fs.pipe_file(doc_key, json.dumps(doc).encode())
    problems = remote.verify(remote.open_location(url, s3.storage_options))
    assert len(problems) == 1 and "gives sample 1 the shape 0x" in problems[0] and "--verify` rewrites it" in problems[0]
    assert build(src, url, storage_options=s3.storage_options, fit="short", shard_size=4, verify=True).shards_built == 1
    assert remote.verify(remote.open_location(url, s3.storage_options)) == []


def test_class_prefixes_in_a_store_named_in_two_unicode_forms_are_refused(s3, tmp_path):
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    src = _small_source(tmp_path / "src", (nfc, nfd))
    fs, bucket = s3.filesystem(), s3.bucket()
    for path in sorted(src.rglob("*.png")):
        fs.put_file(str(path), bucket.removeprefix("s3://") + "/src/" + path.relative_to(src).as_posix())
    with pytest.raises(datapipe.errors.SourceError, match=r"the class folders 'cafe\\u0301' and 'caf\\xe9' are one name "
                                                          r"written two ways"):
        build(bucket + "/src", tmp_path / "out", storage_options=s3.storage_options)
