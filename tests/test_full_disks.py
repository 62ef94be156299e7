"""Running out of room: a full output disk, its file entries (inodes) used up, a file size limit, a Dask scratch
folder on a full or read-only disk, a bench chart written into a full disk, a demo that cannot fit.

Full disks are real: a small tmpfs mounted in a user and mount namespace of the test's own (`unshare -rm`), where
an ordinary user may mount one. File size limits are real too (RLIMIT_FSIZE, as `ulimit -f` sets it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import file_size_limit, needs_mounts

import datapipe
from datapipe.testing import index_map, make_index_dataset

N, SIZE, SHARD = 60, 64, 10  # 6 shards of 10 samples, 123 KB each


def in_namespace(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the shell ``script`` (its arguments ``$1``...) in a user and mount namespace of its own, where it may
    mount a tmpfs; ``$PY`` is this Python."""
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PY": sys.executable}, stdin=subprocess.DEVNULL)


def build_on_a_small_disk(script: str, source: Path, tmp_path: Path) -> Path:
    """Run ``script`` in a namespace of its own with ``$1`` the source, ``$2`` an empty folder to mount a tmpfs on
    and ``$3`` a folder outside it for what the script keeps (returned)."""
    mnt, kept = tmp_path / "mnt", tmp_path / "kept"
    mnt.mkdir()
    kept.mkdir()
    done = in_namespace(script, str(source), str(mnt), str(kept))
    assert done.returncode == 0, done.stderr[-2000:]
    return kept


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_index_dataset(tmp_path_factory.mktemp("full") / "source", N, size=SIZE)


@pytest.fixture(scope="module")
def clean(source) -> Path:
    """The same source built where nothing runs out."""
    out = source.parent / "clean"
    datapipe.build(source, out, size=SIZE, shard_size=SHARD, cluster=datapipe.Cluster(scheduler="sync"),
                   progress=False)
    return out


BUILD = '"$PY" -m datapipe.cli build "$1" "$2/out" --size 64 --shard-size 10 --scheduler sync'


@needs_mounts
def test_a_build_that_fills_its_disk_leaves_no_half_written_file_and_a_rerun_resumes_to_the_same_cache(
        source, clean, tmp_path):
    """The disk filled mid-build: the shard being written was left behind under its temporary name (its file's
    close flushed into the full disk again and raised before the folder was removed), on the disk the user is
    told to free. Now nothing half-written is left, the line says how much is free, and once there is room the
    rerun builds only the missing shards into the cache a clean build writes."""
    script = f"""
        mount -t tmpfs -o size=400k tmpfs "$2" || exit 90
        {BUILD} > "$3/first.log" 2>&1; echo $? > "$3/first.rc"
        find "$2" -name '.tmp-*' > "$3/leftovers"
        ls "$2/out/shards" > "$3/finished"
        mount -o remount,size=4m "$2" || exit 91
        {BUILD} > "$3/second.log" 2>&1; echo $? > "$3/second.rc"
        cp -a "$2/out" "$3/out"
    """
    kept = build_on_a_small_disk(script, source, tmp_path)
    first = (kept / "first.log").read_text()
    line = last_line(first)
    assert (kept / "first.rc").read_text().strip() == "1", first[-2000:]
    assert line.startswith("datapipe build: error: No space left on device") and "MiB free on its disk" in line, line
    finished = (kept / "finished").read_text().split()
    assert finished and len(finished) < N // SHARD, finished  # the disk held some of the shards
    assert "finished shards are kept: free space there and rerun to resume" in line, line
    assert (kept / "leftovers").read_text() == "", (kept / "leftovers").read_text()  # nothing half-written
    second = (kept / "second.log").read_text()
    assert (kept / "second.rc").read_text().strip() == "0", second[-2000:]
    assert f"({N // SHARD - len(finished)} built, {len(finished)} already done)" in second, second[-2000:]
    resumed, reference = datapipe.open(kept / "out"), datapipe.open(clean)
    assert resumed.verify() == []
    assert np.array_equal(resumed.labels, reference.labels)
    assert np.array_equal(index_map(kept / "out"), index_map(clean))  # every sample's pixels where they belong
    for s in range(N // SHARD):
        name = f"{s:06d}.zarr"
        assert resumed._shard_path(s).read_bytes() == reference._shard_path(s).read_bytes(), name


@needs_mounts
def test_a_build_whose_disk_has_no_file_entries_left_says_so(source, tmp_path):
    """Out of inodes, `df -h` shows free space: the line says that the file entries ran out."""
    script = f"""
        mount -t tmpfs -o size=4m,nr_inodes=24 tmpfs "$2" || exit 90
        {BUILD} > "$3/log" 2>&1; echo $? > "$3/rc"
        find "$2" -name '.tmp-*' > "$3/leftovers"
    """
    kept = build_on_a_small_disk(script, source, tmp_path)
    log = (kept / "log").read_text()
    line = last_line(log)
    assert (kept / "rc").read_text().strip() == "1", log[-2000:]
    assert "No space left on device" in line and "file entries (inodes) free on its disk" in line, line
    assert (kept / "leftovers").read_text() == ""


def test_a_build_past_the_file_size_limit_names_the_limit_and_claims_no_shard_it_did_not_finish(source, tmp_path):
    """`ulimit -f` below a shard's size: the line said "fix it", and that finished shards were kept where none
    was. It now names the limit, and says that no shard was finished."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source), str(out), "--size", str(SIZE),
                           "--shard-size", str(SHARD), "--scheduler", "sync"], capture_output=True, text=True,
                          timeout=300, preexec_fn=file_size_limit(50_000))
    line = last_line(proc.stderr)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert line.startswith("datapipe build: error: File too large") and "`ulimit -f`" in line, line
    assert "no shard was finished yet" in line and "finished shards are kept" not in line, line
    leftovers = [p for p in out.rglob(".tmp-*")] if out.exists() else []
    assert leftovers == []


def test_a_local_cluster_whose_scratch_folder_is_full_or_read_only_is_told_where_not_ulimit(tmp_path, monkeypatch):
    """distributed keeps the cause of "Cluster failed to start" as text alone ("[Errno 28] No space left on device:
    '.../dask-scratch-space'"): the line blamed open files and memory, and advised ulimit."""
    import errno

    import dask

    from datapipe.builder import _cluster_failed

    monkeypatch.setitem(dask.config.config, "temporary-directory", str(tmp_path))
    for code, fix in ((errno.ENOSPC, "free space there"), (errno.EROFS, "which is read-only"),
                      (errno.EDQUOT, "free space there")):
        text = RuntimeError(f"Cluster failed to start: [Errno {code}] {os.strerror(code)}: '{tmp_path}/dask-scratch-space'")
        chained = RuntimeError("Cluster failed to start")
        chained.__cause__ = OSError(code, os.strerror(code))
        for exc in (text, chained):
            line = _cluster_failed(2, exc)
            assert f"scratch space in {tmp_path}" in line and fix in line and "DASK_TEMPORARY_DIRECTORY" in line, line
            assert "ulimit" not in line, line
    other = _cluster_failed(2, RuntimeError("Cluster failed to start: [Errno 24] Too many open files"))
    assert "ulimit -n" in other and "DASK_TEMPORARY_DIRECTORY" not in other, other


@needs_mounts
def test_a_local_cluster_on_a_read_only_scratch_folder_is_one_line_naming_it(source, tmp_path):
    script = """
        mount -t tmpfs -o ro,size=1m tmpfs "$2" || exit 90
        DASK_TEMPORARY_DIRECTORY="$2" "$PY" -m datapipe.cli build "$1" "$3" --size 64 --workers 1
    """
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    done = in_namespace(script, str(source), str(scratch), str(tmp_path / "out"))
    line = last_line(done.stderr)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"scratch space in {scratch}, which is read-only" in line and "ulimit" not in line, line


def test_a_bench_chart_that_cannot_be_written_leaves_the_chart_there_and_names_both_files(source, clean, tmp_path):
    """--plot wrote in place: a full disk left an empty or truncated PNG, over the chart that was there. And when
    --json failed too, only the chart's error was shown. Now the chart is written whole or not at all, and the one
    line names both files."""
    chart, figures = tmp_path / "chart.png", tmp_path / "figures.json"
    chart.write_bytes(b"the chart of an earlier run")
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "bench", str(clean), "--json", str(figures),
                           "--plot", str(chart), "--batches", "2", "--repeats", "1", "--batch-size", "4", "--crop",
                           "16", "--against", "", "--quiet"], capture_output=True, text=True, timeout=300,
                          preexec_fn=file_size_limit(64))
    line = last_line(proc.stderr)
    assert proc.returncode == 1 and "end to end" in proc.stdout, proc.stderr[-3000:]
    assert f"--json {figures}: File too large" in line and f"--plot {chart}: File too large" in line, line
    assert chart.read_bytes() == b"the chart of an earlier run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png"]  # no half-written file beside it


def test_the_demo_checks_room_for_its_cache_too_before_writing_anything(tmp_path, monkeypatch):
    """The check counted the sample's images alone (5.9 MiB for 60), then the build of its 256² cache filled the
    disk (17 MiB in all)."""
    import types

    from datapipe.bench import demo, sample
    from datapipe.errors import ArgumentError

    free = 8 * 2**20  # room for the images, not for the cache
    monkeypatch.setattr(sample.os, "statvfs", lambda _: types.SimpleNamespace(f_bavail=free // 4096, f_frsize=4096))
    with pytest.raises(ArgumentError, match=r"^--images 60 needs about 1\d\.\d MiB \(the sample and its cache\), and "
                                            r"the disk of .* has 8\.0 MiB free"):
        demo.run_demo(tmp_path / "demo", images=60, bench=False)
    assert not (tmp_path / "demo").exists()


def test_the_index_files_are_written_whole_or_not_at_all(source, tmp_path):
    """labels.npy was written to a fixed temporary name without the checks of the other index files: a full disk
    left an empty `.tmp-labels.npy`. A file size limit between paths.json's size and labels.npy's hits the same
    write."""
    out = tmp_path / "out"
    datapipe.build(source, out, size=SIZE, shard_size=SHARD, cluster=datapipe.Cluster(scheduler="sync"),
                   progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").unlink()  # the build's last step, to do again
    (out / "labels.npy").unlink()
    limit = (out / "build.json").stat().st_size + 16  # under labels.npy's (8 bytes a sample and a header)
    assert limit < N * 8
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source), str(out), "--size", str(SIZE),
                           "--shard-size", str(SHARD), "--scheduler", "sync"], capture_output=True, text=True,
                          timeout=300, preexec_fn=file_size_limit(limit))
    assert proc.returncode == 1 and "File too large" in last_line(proc.stderr), proc.stderr[-2000:]
    assert [p.name for p in out.iterdir() if p.name.startswith(".tmp-")] == []
    rerun = datapipe.build(source, out, size=SIZE, shard_size=SHARD, cluster=datapipe.Cluster(scheduler="sync"),
                           progress=False)
    assert rerun.shards_built == 0 and json.loads((out / "manifest.json").read_text())["shards"] == manifest["shards"]


def test_file_entries_are_blamed_only_when_scarcer_than_bytes():
    """XFS makes inodes as they are needed and reports as free those its free bytes could hold: a disk out of
    bytes shows few free inodes too, and was said to be out of file entries, "whatever its free bytes"."""
    import os

    from datapipe.files import few_entries

    def disk(blocks, free_blocks, files, free_files):
        return os.statvfs_result((4096, 4096, blocks, free_blocks, free_blocks, files, free_files, free_files, 0, 255))

    xfs_out_of_bytes = disk(10**8, 1024, 2_000_000 + 8192, 100 + 8192)  # 4 MiB free, 8 inodes a free block
    assert not few_entries(xfs_out_of_bytes)
    assert few_entries(disk(10**8, 10**7, 2_000_000, 100))  # ext4 out of inodes, 40 GB free
    assert not few_entries(disk(10**8, 10**7, 2_000_000, 500_000))  # plenty of both
    assert not few_entries(disk(10**8, 0, 0, 0))  # a file system that counts no inodes
