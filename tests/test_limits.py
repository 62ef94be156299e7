"""The machine's limits reached: too few open files for a LocalCluster, no thread to be had (``ulimit -v``).
One line naming the limit and what to do, never a hang or a traceback."""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import pytest
from conftest import file_size_limit

import datapipe
from datapipe.errors import OutOfThreadsError


@pytest.mark.parametrize("hard", ["20", "unchanged"])
def test_a_local_cluster_gets_the_open_files_it_needs_or_is_refused_before_it_starts(source, tmp_path, hard):
    """With about 20 descriptors the cluster's scheduler retried accept() for ever and the build hung, deaf to
    Ctrl-C and SIGTERM (signals wait while a cluster starts); with some more it failed, blaming no limit. The
    soft limit is raised to what the cluster needs where the hard limit allows (as Dask's scheduler does);
    where it does not, one line says how many."""
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1] if hard == "unchanged" else 20

    def few_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (20, limit))

    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source[0]), str(tmp_path / "out"),
                           "--workers", "2", "--size", "16", "--quiet"], capture_output=True, text=True, timeout=120,
                          preexec_fn=few_files)
    if hard == "unchanged":
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(datapipe.open(tmp_path / "out")) == len(source[1])
        return
    lines = proc.stderr.strip().splitlines()  # the plan's line, then the error's
    assert proc.returncode == 2 and len(lines) == 2, proc.stderr[-3000:]
    assert lines[1] == ("datapipe build: error: this process may open 20 files (ulimit -n), and a LocalCluster of 2 "
                        "workers needs about 64: raise the limit (ulimit -n 64), build with fewer --workers, or with "
                        "--scheduler sync (no Dask processes)")
    assert not (tmp_path / "out").exists()


NO_THREADS = """
import sys, threading
real = threading.Thread.start
def start(self):
    if self.name == sys.argv[1]:
        raise RuntimeError("can't start new thread")
    return real(self)
threading.Thread.start = start
from datapipe.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("thread", ["zarr_io", "datapipe-fetch-record"])
def test_a_build_that_cannot_start_a_thread_ends_in_one_line_and_resumes(source, tmp_path, thread):
    """Under a low ``ulimit -v`` a thread's stack cannot be had: zarr's I/O thread (the first shard's), or the
    build's own. That was a traceback (and zarr, keeping the loop of a thread that never ran, waited on it for
    ever at its next call, and failed again at exit)."""
    out = tmp_path / "out"
    scheduler = ["--scheduler", "sync"] if thread == "zarr_io" else ["--workers", "1"]
    proc = subprocess.run([sys.executable, "-c", NO_THREADS, thread, "build", str(source[0]), str(out), "--size", "16",
                           "--quiet", *scheduler], capture_output=True, text=True, timeout=240)
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("datapipe build: error: no thread could be started") and \
        "(can't start new thread): this process is short of memory or threads" in lines[-1], lines[-1]
    assert "ulimit -v" in lines[-1] and all(line.startswith("datapipe build: ") for line in lines), lines
    again = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source[0]), str(out), "--size", "16",
                            "--quiet", *scheduler], capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(datapipe.open(out)) == len(source[1])


def test_zarr_goes_on_after_its_io_thread_failed_to_start(tmp_path):
    """The next zarr call in the same process (the worker's next shard) starts zarr's thread anew, where it
    would have waited for ever on the loop of the one that never ran."""
    script = textwrap.dedent("""
        import threading
        from datapipe import shards
        from datapipe.errors import OutOfThreadsError
        real = threading.Thread.start
        def start(self):
            if self.name == "zarr_io":
                raise RuntimeError("can't start new thread")
            return real(self)
        threading.Thread.start = start
        try:
            shards._zarr_documents("fixed", 4, 8)
        except OutOfThreadsError as exc:
            print("refused:", exc)
        threading.Thread.start = real
        print(sorted(shards._zarr_documents("fixed", 4, 8)))
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    first, second = proc.stdout.splitlines()
    assert first.startswith("refused: no thread could be started for zarr's I/O")
    assert second == "['images/zarr.json', 'labels/zarr.json', 'zarr.json']"


def test_a_device_loader_that_cannot_start_its_readers_says_so(source, tmp_path, monkeypatch):
    import threading

    out = tmp_path / "out"
    datapipe.build(source[0], out, size=16, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    real = threading.Thread.start

    def start(self):
        if self.name.startswith("datapipe-reader"):
            raise RuntimeError("can't start new thread")
        return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    loader = datapipe.DeviceLoader(datapipe.StreamingDataset(out, batch_size=4), num_workers=2)
    with pytest.raises(OutOfThreadsError, match=r"^no thread could be started for the DeviceLoader's reader threads "):
        next(iter(loader))
    monkeypatch.setattr(threading.Thread, "start", real)
    assert sum(len(labels) for _, labels in loader) == len(source[1])  # nothing left half started


@pytest.mark.parametrize("output", ["new", "an empty folder of the user's"])
def test_a_lock_file_that_cannot_be_written_is_named_and_nothing_is_left(source, tmp_path, output):
    """The build's first write (its lock's holder line) failed with an OSError that named no file (the catch-all
    line of the command), and left the folder it made, and the lock, in it or in the user's folder."""
    out = tmp_path / "out"
    if output != "new":
        out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source[0]), str(out), "--size", "16",
                           "--scheduler", "sync"], capture_output=True, text=True, timeout=120,
                          preexec_fn=file_size_limit(0))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and lines[-1] == (
        f"datapipe build: error: cannot write the lock file {out}/.datapipe.lock: File too large; nothing was built: "
        "free space on its disk (or raise the file size limit, ulimit -f) and rerun"), proc.stderr[-3000:]
    assert (list(out.iterdir()) == []) if output != "new" else not out.exists()


def test_bench_shows_its_figures_when_its_json_cannot_be_written(source, tmp_path):
    """--json is written before the table (so that the figures outlive a closed pipe); a write that failed (a full
    disk) ended the command there, the table unshown and half a file left. Now: the table, then one line."""
    out = tmp_path / "cache"
    datapipe.build(source[0], out, size=16, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    json_out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "bench", str(out), "--json", str(json_out),
                           "--batches", "2", "--repeats", "1", "--batch-size", "4", "--crop", "16", "--against", "",
                           "--quiet"], capture_output=True, text=True, timeout=300, preexec_fn=file_size_limit(64))
    assert proc.returncode == 1, proc.stderr[-3000:]  # the machine's, not the call's
    assert "end to end" in proc.stdout, proc.stdout  # the table
    assert proc.stderr.strip().splitlines()[-1] == (
        f"datapipe bench: error: --json {json_out}: File too large; raise the file size limit (ulimit -f) or choose "
        "another path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no half-written file


def test_a_sample_that_does_not_fit_a_nearly_full_disk_says_how_much_in_a_unit_that_shows_it(tmp_path, monkeypatch):
    """A disk with a few MiB free was "0.0 GiB free" for a sample of "0.0 GiB"."""
    import os
    import types

    from datapipe.bench import sample
    from datapipe.errors import ArgumentError

    monkeypatch.setattr(sample.os, "statvfs", lambda _: types.SimpleNamespace(f_bavail=1024, f_frsize=4096))
    with pytest.raises(ArgumentError, match=r"^--images 60 needs about 5\.9 MiB, and the disk of .* has 4\.0 MiB free"):
        sample._check_room(tmp_path / "s", 60)
    assert os.path.exists(tmp_path)


def test_a_local_cluster_without_a_temporary_folder_is_told_to_set_tmpdir():
    """Advice on open files and memory does not help a cluster whose processes found no writable temporary folder."""
    from datapipe.builder import _cluster_failed

    line = _cluster_failed(2, FileNotFoundError("No usable temporary directory found in ['/tmp', '/var/tmp']"))
    assert "set TMPDIR to one" in line and "ulimit" not in line, line


@pytest.mark.parametrize(("code", "advice"), [(28, "free space, or pass --work-dir"), (30, "pass --work-dir a writable"),
                                              (24, "ulimit -n"), (2, None)])
def test_a_peer_failed_by_the_machine_says_what_to_do(code, advice):
    """A peer's own code raises OSErrors without a path ("[Errno 28] No space left on device"): the bench's line
    says which folder and what to do about the machine's part."""
    import os

    from datapipe.bench.harness import Measurement, _failed

    m = Measurement(name="webdataset")
    _failed(m, OSError(code, os.strerror(code)))
    assert m.status == "failed" and f"Error: [Errno {code}] {os.strerror(code)}" in m.reason, m.reason
    assert (advice in m.reason) if advice else m.reason.endswith(os.strerror(code)), m.reason


def test_an_up_to_date_cache_on_a_full_disk_is_still_a_no_op(source, tmp_path):
    """A rerun that has nothing to write (every rank of a job calls build() at its start) needs no lock file
    written: on a full disk it says the cache is up to date, as for a folder it may not write."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "datapipe.cli", "build", str(source[0]), str(out), "--size", "16", "--scheduler",
            "sync"]
    assert subprocess.run(args, capture_output=True, timeout=120).returncode == 0
    before = sorted(p.name for p in out.iterdir())
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, preexec_fn=file_size_limit(0))
    assert proc.returncode == 0 and "up to date" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == before
