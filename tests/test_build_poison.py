"""A file that takes its Dask worker down with it ends the build with one clear error naming the shard's
files, keeping the finished shards — not with a KilledWorker traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import datapipe
from datapipe.errors import BuildError

pytestmark = pytest.mark.distributed


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_file_that_kills_its_worker_gives_a_clear_error(tmp_path, imaging):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 6, "b": 6}, variety=False)
    os.mkfifo(src / "b" / "zz-blocks.jpg")  # reading it blocks the worker until we kill it
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
    sched_file = tmp_path / "scheduler.json"
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                       "--port", "0", "--no-dashboard", "--scheduler-file", str(sched_file)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait(lambda: sched_file.exists() and sched_file.stat().st_size > 0, 60, "the scheduler")
        address = json.loads(sched_file.read_text())["address"]
        worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                                   "--no-nanny", "--memory-limit", "0", "--local-directory", str(tmp_path / "w")],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(worker)
        out = tmp_path / "cache"
        result: dict[str, object] = {}

        def run() -> None:
            try:
                datapipe.build(src, out, size=32, shard_size=6, scheduler=address, progress=False,
                               log=lambda line: None)
            except Exception as exc:  # noqa: BLE001 - checked below
                result["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        _wait(lambda: (out / "shards").is_dir() and any((out / "shards").glob("*.zarr")), 60, "the first shard")
        time.sleep(0.5)  # the worker is now stuck reading the second shard's last file
        os.kill(worker.pid, signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive()
        err = result.get("error")
        assert isinstance(err, BuildError), repr(err)
        assert "shard 2" in str(err) and "b/zz-blocks.jpg" in str(err) and "rerun" in str(err)  # 13 files, 6 a shard
        assert (out / "shards" / "000000.zarr").is_dir() and not (out / "manifest.json").exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(15)
