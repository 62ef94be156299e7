"""A file whose decoding takes its Dask worker down (a crash, or a read or decode that never ends) is
isolated and quarantined: the shard is rebuilt with every file decoded in a separate process first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import datapipe

pytestmark = pytest.mark.distributed


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


HANG_HOOK = """
import threading
import datapipe.bounded as bounded
_real = bounded.read_file
def _read_file(path, limit, *scanned):
    if path.endswith("zz-blocks.jpg"):
        threading.Event().wait()  # a read that never returns
    return _real(path, limit, *scanned)
bounded.read_file = _read_file
try:
    import datapipe.builder as builder
    builder.read_file = _read_file
except ImportError:
    pass
"""


@pytest.mark.timeout(150)
def test_a_file_that_kills_its_worker_is_isolated_and_quarantined(tmp_path, imaging):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 6, "b": 6}, variety=False)
    # Reading this file never returns, in every process (a test hook loaded at interpreter start: a
    # FIFO in the source is no longer opened at all): the worker's watchdog ends the worker after
    # DATAPIPE_FILE_TIMEOUT, and the isolated probe of the file, under the same limit, reports a timeout.
    (src / "b" / "zz-blocks.jpg").write_bytes(imaging.jpeg(imaging.gradient(40, 52)))
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(HANG_HOOK)
    # Kill on the first death (no retries).
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0", "DATAPIPE_PROBE_TIMEOUT": "60",
           "DATAPIPE_FILE_TIMEOUT": "2", "PYTHONPATH": os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")])}
    sched_file = tmp_path / "scheduler.json"
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                       "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(lambda: sched_file.exists() and sched_file.stat().st_size > 0, 60, "the scheduler")
        address = json.loads(sched_file.read_text())["address"]
        workers = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                                     "--no-nanny", "--memory-limit", "0", "--local-directory", str(tmp_path / f"w{i}")],
                                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(2)]
        procs.extend(workers)
        out = tmp_path / "cache"
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["report"] = datapipe.build(src, out, size=32, shard_size=6, cluster=datapipe.Cluster(scheduler=address),
                                                  progress=False, max_bad_fraction=0.2)
            except Exception as exc:  # noqa: BLE001 - checked below
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        _wait(lambda: any(w.poll() is not None for w in workers), 90, "the watchdog to end the stuck worker")
        assert [w.poll() for w in workers].count(70) == 1  # the watchdog's exit code
        thread.join(90)
        assert not thread.is_alive()
        assert "error" not in result, repr(result.get("error"))
        report = result["report"]
        assert report.status == "ok" and report.num_samples == 12
        assert [q["path"] for q in report.quarantined] == ["b/zz-blocks.jpg"]
        assert "did not finish" in report.quarantined[0]["reason"]
        assert report.quarantined[0]["error"] == "timeout"
        cache = datapipe.open(out)
        assert len(cache) == 12 and cache.verify() == []
        assert not any(p.name.startswith(".tmp-") for p in (out / "shards").iterdir())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(15)
