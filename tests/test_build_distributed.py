"""Builds on real Dask clusters: parallel equals serial byte for byte, a SIGKILLed build resumes to
the same bytes, an external multi-process cluster works, and losing a worker mid-build loses nothing.

Every test starts real processes; the whole file takes well under two minutes on two cores.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from build_fixtures import build_log

import datapipe
from datapipe import native
from datapipe.errors import CacheError

pytestmark = pytest.mark.distributed

SIZE = 64
SHARD = 8
CLASSES = ("bird", "café", "dog")
PER_CLASS = 40
MAX_BAD = 0.1


def quiet(**kwargs) -> dict:
    """build()'s keywords for the shared source; ``workers`` and ``scheduler`` make its Cluster."""
    cluster = datapipe.Cluster(workers=kwargs.pop("workers", None), scheduler=kwargs.pop("scheduler", None))
    return {"size": SIZE, "shard_size": SHARD, "progress": False, "max_bad_fraction": MAX_BAD, "cluster": cluster, **kwargs}


def without_temps(tree: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in tree.items() if "/.tmp-" not in f"/{k}"}


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "shards").iterdir() if p.name.startswith(".tmp-"))


def wait_for(predicate, timeout: float, what: str, poll: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


@pytest.fixture(scope="module")
def dist_source(tmp_path_factory, imaging) -> Path:
    """120 PNGs big enough that a shard takes a noticeable time to decode, plus every bad kind.

    Six distinct pictures are reused under different names, so generating them is cheap.
    """
    root = tmp_path_factory.mktemp("dist") / "src"
    blobs = [imaging.encode(imaging.gradient(600, 800, seed=s), "PNG") for s in range(6)]
    for c, name in enumerate(CLASSES):
        (root / name).mkdir(parents=True)
        for j in range(PER_CLASS):
            fname = "ß-ü.png" if (c, j) == (1, 7) else f"{j:03d}.png"
            (root / name / fname).write_bytes(blobs[(c * PER_CLASS + j) % len(blobs)])
    imaging.write_bad_files(root / "café")  # spread over two shards, none of them all bad
    return root


@pytest.fixture(scope="module")
def serial(dist_source, tmp_path_factory, imaging) -> tuple[Path, dict[str, bytes]]:
    out = tmp_path_factory.mktemp("serial") / "cache"
    report = datapipe.build(dist_source, out, **quiet(scheduler="sync"))
    assert report.num_samples == len(CLASSES) * PER_CLASS and len(report.quarantined) == 6
    return out, imaging.tree_bytes(out)


def assert_same_cache(out: Path, reference: dict[str, bytes], imaging, *, allow_temps: bool = False) -> None:
    tree = imaging.tree_bytes(out)
    if allow_temps:
        tree = without_temps(tree)
    assert sorted(tree) == sorted(reference)
    different = [name for name in reference if tree[name] != reference[name]]
    assert not different, f"files differ from the serial build: {different}"
    cache = datapipe.open(out)
    paths = [cache.path(i) for i in range(len(cache))]
    assert len(paths) == len(set(paths)) == len(CLASSES) * PER_CLASS  # every sample exactly once
    assert cache.verify() == []


# ----------------------------------------------------------------------------- (a) LocalCluster


@pytest.mark.timeout(180)
def test_local_cluster_equals_serial(dist_source, serial, tmp_path, imaging):
    """...and the dashboard URL the build prints answers while the build runs."""
    import re
    import urllib.request

    pages: dict[str, int] = {}

    def log(record: logging.LogRecord) -> None:
        url = re.search(r"dashboard: (http://\S+)", record.getMessage())
        if url:
            with urllib.request.urlopen(url.group(1), timeout=30) as page:
                pages[url.group(1)] = page.status

    out = tmp_path / "parallel"
    import dask
    import distributed  # noqa: F401 - its config defaults loaded first: leaving the set() below must not drop them

    # the source's files total ~100 MB: a graph that carried them would pass a 1 MB threshold
    with warnings.catch_warnings(record=True) as caught, \
            dask.config.set({"distributed.admin.large-graph-warning-threshold": "1MB"}), build_log(log):
        warnings.simplefilter("always")
        report = datapipe.build(dist_source, out, **quiet(workers=2))
    assert report.status == "ok" and report.workers == 2
    assert report.dashboard and pages == {report.dashboard: 200}
    # tasks carry paths, never pixels ("Sending large graph" is Dask's warning)
    assert not [w for w in caught if "large graph" in str(w.message).lower()]
    assert report.shards_built == report.shards_total == len(json.loads(serial[1]["manifest.json"])["shards"])
    assert {q["path"] for q in report.quarantined} == {
        f"café/{n}" for n in ("zero.jpg", "text.jpg", "truncated.jpg", "corrupt.jpg", "bomb.png", "x.jpg")}
    assert_same_cache(out, serial[1], imaging)
    assert temps(out) == []


@pytest.mark.timeout(180)
def test_a_graph_of_many_paths_is_not_warned_of_as_a_large_graph(tmp_path, imaging):
    """A million files' paths made a 19 MB graph, and distributed's "Sending large graph ... Consider loading the
    data with Dask directly" on every large build. The threshold grows with the files (256 bytes each): here
    1,200 files against a threshold of 4 KB, which their paths alone pass."""
    import dask
    import distributed  # noqa: F401 - its config defaults loaded first: leaving the set() below must not drop them

    first = tmp_path / "one.png"
    first.write_bytes(imaging.encode(imaging.gradient(12, 10), "PNG"))
    for k in range(1200):
        (tmp_path / "src" / f"class_{k % 3}").mkdir(parents=True, exist_ok=True)
        os.link(first, tmp_path / "src" / f"class_{k % 3}" / f"an_image_with_a_long_name_{k:05d}.png")
    with warnings.catch_warnings(record=True) as caught, \
            dask.config.set({"distributed.admin.large-graph-warning-threshold": "4kB"}):
        warnings.simplefilter("always")
        report = datapipe.build(tmp_path / "src", tmp_path / "out", **quiet(workers=1, size=8, shard_size=400))
    assert report.status == "ok" and report.num_samples == 1200 and report.workers == 1
    assert not [w for w in caught if "large graph" in str(w.message).lower()], [str(w.message) for w in caught]


@pytest.mark.timeout(180)
def test_local_cluster_workers_keep_their_buffers(tmp_path, imaging):
    """The allocator settings reach the worker processes before they start: a worker reuses its
    per-image buffers instead of faulting fresh pages in for every image (Dask's default
    MALLOC_TRIM_THRESHOLD_ alone costs over 100 page faults per 480x360 image here)."""
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 40, "b": 40}, shape=(360, 480), variety=False)
    report = datapipe.build(src, tmp_path / "out", **quiet(workers=1, shard_size=80, size=256))
    assert report.status == "ok" and report.num_samples == 80 and report.workers == 1
    assert 0 < report.page_faults_per_image < 40, report.page_faults_per_image


# ----------------------------------------------------------------------------- (b) SIGKILL and resume


@pytest.mark.timeout(180)
def test_sigkill_and_resume_is_byte_identical(tmp_path, imaging):
    """Kill `datapipe build` with SIGKILL while a shard is being written; the rerun finishes the
    same bytes as an uninterrupted build.

    To kill at a known point, the build runs with one test hook: reading one source file first
    waits on a named pipe the test holds (a FIFO in the source itself is quarantined at scan, and
    never opened), in the middle of the shard that holds it (four of its samples already written),
    with the earlier shards finished and no manifest written.
    """
    from datapipe.shards import images_path

    src = tmp_path / "src"
    imaging.write_source(src, {"a": 50, "b": 50, "c": 50, "d": 50}, variety=False, shape=(40, 52))
    blocker = src / "b" / "img004-blocker.jpg"  # sorts before img004.jpg: sample 54, the fifth of shard 5
    blocker.write_bytes(imaging.jpeg(imaging.gradient(40, 52, seed=4242)))
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    hook = ("import os, sys\nimport datapipe.builder as b\nreal = b.read_file\n"
            "def gated(path, limit, *scanned):\n"
            "    if path.endswith('img004-blocker.jpg'):\n"
            "        open(os.environ['GATE'], 'rb').read()\n"
            "    return real(path, limit, *scanned)\n"
            "b.read_file = gated\nfrom datapipe.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "out"
    cmd = [sys.executable, "-c", hook, "build", str(src), str(out), "--size", "32",
           "--shard-size", "10", "--scheduler", "sync", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "GATE": str(gate)})
    try:
        def shard_5_half_written() -> bool:
            files = [images_path(out / "shards" / t) for t in temps(out)]
            return any(f.exists() and f.stat().st_size > 0 for f in files)

        wait_for(lambda: (out / "shards" / "000004.zarr").exists() and shard_5_half_written() or proc.poll() is not None,
                 120, "shard 4 to finish and shard 5 to be half-written")
        assert proc.poll() is None, proc.stderr.read().decode()
        assert not (out / "manifest.json").exists()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    assert not (out / "manifest.json").exists()
    assert len(temps(out)) == 1  # the shard that was being written is left as a temporary folder,
    partial = images_path(out / "shards" / temps(out)[0])
    assert 0 < partial.stat().st_size < 10 * 32 * 32 * 3  # half-written: some samples, not all
    assert sorted(p.name for p in (out / "shards").glob("*.zarr")) == [f"{i:06d}.zarr" for i in range(5)]
    with pytest.raises(CacheError, match="did not finish"):
        datapipe.open(out)

    report = datapipe.build(src, out, size=32, shard_size=10, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    assert report.status == "ok" and report.num_samples == 201
    assert report.shards_skipped == 5 and report.shards_built == report.shards_total - 5 == 16
    assert temps(out) == []

    ref = tmp_path / "ref"
    datapipe.build(src, ref, size=32, shard_size=10, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    resumed, uninterrupted = imaging.tree_bytes(out), imaging.tree_bytes(ref)
    assert sorted(resumed) == sorted(uninterrupted)
    for name in ("manifest.json", "labels.npy", "paths.json", "build.json", "shards/000005.zarr/zarr.json"):
        assert name in resumed
    assert [k for k in uninterrupted if resumed[k] != uninterrupted[k]] == []


# ----------------------------------------------------------------------------- (c, d) external cluster


def _dask_cli(kind: str) -> list[str]:
    exe = shutil.which("dask", path=os.path.dirname(sys.executable))
    if exe:
        return [exe, kind]
    return [sys.executable, "-m", f"distributed.cli.dask_{kind}"]


@pytest.fixture(scope="module")
def external_cluster(tmp_path_factory):
    """A scheduler and two single-threaded worker processes without nannies (so a killed worker
    stays dead), named worker0 and worker1. Yields (address, worker processes, in that order);
    every process is stopped at teardown."""
    from distributed import Client

    folder = tmp_path_factory.mktemp("cluster")
    scheduler_file = folder / "scheduler.json"
    procs: list[subprocess.Popen] = []
    logs = []

    def start(args, name):
        log = open(folder / f"{name}.log", "wb")  # noqa: SIM115 - closed at teardown
        logs.append(log)
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        start([*_dask_cli("scheduler"), "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
               "--idle-timeout", "600",  # a safety net should this process ever be killed
               "--scheduler-file", str(scheduler_file)], "scheduler")
        wait_for(lambda: scheduler_file.exists() and scheduler_file.stat().st_size > 0, 60, "the scheduler",
                 poll=0.05)
        address = json.loads(scheduler_file.read_text())["address"]
        workers = [start([*_dask_cli("worker"), address, "--nthreads", "1", "--nworkers", "1", "--no-nanny",
                          "--memory-limit", "0", "--death-timeout", "60", "--name", f"worker{i}",
                          "--local-directory", str(folder / f"w{i}")], f"worker{i}") for i in range(2)]
        with Client(address, timeout="30s") as client:
            client.wait_for_workers(2, timeout=60)
        yield address, workers
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(15)
        for log in logs:
            log.close()


@pytest.mark.timeout(180)
def test_external_cluster_equals_serial(dist_source, serial, external_cluster, tmp_path, imaging):
    address, workers = external_cluster
    assert all(w.poll() is None for w in workers)
    out = tmp_path / "external"
    report = datapipe.build(dist_source, out, **quiet(scheduler=address))
    assert report.status == "ok" and report.workers == 2
    assert report.shards_built == report.shards_total
    assert_same_cache(out, serial[1], imaging)
    assert temps(out) == []
    # Where the compiled resize kernel is built, the workers decoded and resized without importing torch
    # (its import takes seconds and ~200 MB in every worker); torch's kernel is only the fallback.
    from distributed import Client

    with Client(address, timeout="30s") as client:
        imported = client.run(lambda: "torch" in sys.modules)
    assert set(imported.values()) == {not native.available()}, imported
    # and a rerun through the cluster is a no-op
    again = datapipe.build(dist_source, out, **quiet(scheduler=address))
    assert again.shards_built == 0 and again.shards_skipped == again.shards_total
    assert_same_cache(out, serial[1], imaging)


@pytest.mark.timeout(180)
def test_two_outputs_from_one_source_at_once(dist_source, serial, external_cluster, tmp_path, imaging):
    """Two builds of the same source and configuration into different folders, on one cluster and
    at the same time, each write their own complete cache."""
    address, _ = external_cluster
    results: dict[str, object] = {}
    times: dict[str, float] = {}

    def log(record: logging.LogRecord) -> None:
        if " Dask workers at " in record.getMessage():
            times[f"{record.threadName}-submit"] = time.monotonic()  # logged just before the tasks go out

    def run(name: str) -> None:
        try:
            results[name] = datapipe.build(dist_source, tmp_path / name, **quiet(scheduler=address))
        except Exception as exc:  # noqa: BLE001 - reported below
            results[name] = exc
        times[f"{name}-done"] = time.monotonic()

    first = threading.Thread(target=run, args=("one",), name="one")
    second = threading.Thread(target=run, args=("two",), name="two")
    with build_log(log):
        first.start()
        wait_for(lambda: (tmp_path / "one" / "shards" / "000000.zarr").exists() or not first.is_alive(), 120,
                 "the first build's first shard")
        second.start()
        first.join(150)
        second.join(150)
    assert not first.is_alive() and not second.is_alive()
    for name in ("one", "two"):  # either build failing fails the test, whenever it failed
        assert isinstance(results.get(name), datapipe.BuildReport), f"build {name} failed: {results.get(name)!r}"
        assert_same_cache(tmp_path / name, serial[1], imaging)
    assert {"one-submit", "two-submit", "one-done"} <= set(times), times  # both submitted to the cluster
    if times["one-done"] < times["two-submit"]:
        pytest.skip("both builds are whole, but the first finished before the second submitted its tasks: "
                    "nothing overlapped")


@pytest.mark.timeout(180)
def test_worker_lost_mid_build(dist_source, serial, external_cluster, tmp_path, imaging):
    """SIGKILL one of the two workers once the first shard exists: the build still completes with
    every sample exactly once, byte-identical to the serial build. (Runs last: the worker stays dead.)"""
    from distributed import Client

    address, workers = external_cluster
    assert all(w.poll() is None for w in workers)
    out = tmp_path / "lost"
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["report"] = datapipe.build(dist_source, out, **quiet(scheduler=address))
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: any((out / "shards").glob("*.zarr")) if (out / "shards").is_dir() else False,
                 120, "the first shard")
        with Client(address, timeout=30) as client:  # the worker to kill must hold shard tasks

            def victim_busy() -> bool:
                info = client.scheduler_info(n_workers=-1)["workers"]
                addr = next((a for a, w in info.items() if w.get("name") == "worker0"), None)
                return addr is not None and bool(client.processing(workers=[addr]).get(addr))

            wait_for(victim_busy, 60, "the worker to be running a shard task", poll=0.05)
        assert thread.is_alive() and not (out / "manifest.json").exists(), "the build ended before the kill"
        os.kill(workers[0].pid, signal.SIGKILL)
        assert workers[0].wait(30) == -signal.SIGKILL
    finally:
        thread.join(150)
    assert not thread.is_alive(), "the build hung after losing a worker"
    assert "error" not in result, f"the build failed after losing a worker: {result.get('error')!r}"
    report = result["report"]
    assert report.status == "ok" and report.num_samples == len(CLASSES) * PER_CLASS
    assert report.shards_total == report.shards_built + report.shards_skipped
    assert_same_cache(out, serial[1], imaging, allow_temps=True)
    assert not temps(out), "the temporary folder of the lost worker's shard is removed when the build ends"


def test_a_busy_dashboard_port_is_taken_in_silence(tmp_path, imaging):
    """Another cluster's dashboard on 8787 (a second build, a notebook): the build's LocalCluster takes a free
    port, named in the build's own dashboard line, without distributed's multi-line warning about it."""
    import socket

    imaging.write_source(tmp_path / "src", {"a": 2, "b": 2}, variety=False)
    holder = socket.socket()
    try:
        for _ in range(60):  # held here for the whole build: another test's cluster may hold it only a while
            try:
                holder.bind(("", 8787))
                holder.listen()
                break
            except OSError:
                time.sleep(0.5)  # busy: taken as soon as it is free (held by another for all of it: the same case)
        done = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(tmp_path / "src"), str(tmp_path / "out"),
                               "--size", "16", "--workers", "1"], capture_output=True, text=True, timeout=300)
    finally:
        holder.close()
    assert done.returncode == 0, done.stderr
    assert "already in use" not in done.stderr and "warnings.warn" not in done.stderr, done.stderr
    line = next(x for x in done.stderr.splitlines() if "dashboard:" in x)
    assert ":8787" not in line, line


def _private_mounts() -> bool:
    """Whether this process may start one in a mount namespace of its own (unshare -m: root, or a user namespace)."""
    unshare = shutil.which("unshare")
    return bool(unshare) and subprocess.run([unshare, "-m", "--propagation", "private", "true"],
                                            capture_output=True).returncode == 0


@pytest.mark.timeout(240)
@pytest.mark.skipif(not _private_mounts(), reason="needs `unshare -m` (a worker that sees another folder at the same path)")
def test_a_worker_that_sees_another_output_folder_fails_the_build_not_the_cache(dist_source, tmp_path):
    """The output is a path local to each machine: the worker writes its shards into its own folder of that name.
    The build said "ok" and wrote a manifest of shards that are not there; it fails naming one, and the cache
    is not called finished."""
    from distributed import Client

    hidden = tmp_path / "hidden"  # the worker sees an empty tmpfs here; this process, the real folder
    hidden.mkdir()
    scheduler_file = tmp_path / "scheduler.json"
    procs = []
    try:
        procs.append(subprocess.Popen([*_dask_cli("scheduler"), "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                       "--scheduler-file", str(scheduler_file)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        wait_for(lambda: scheduler_file.exists() and scheduler_file.stat().st_size > 0, 60, "the scheduler", poll=0.05)
        address = json.loads(scheduler_file.read_text())["address"]
        worker = " ".join([*_dask_cli("worker"), address, "--nthreads", "1", "--no-nanny", "--memory-limit", "0",
                           "--local-directory", str(tmp_path / "w")])
        procs.append(subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                       f"mount -t tmpfs tmpfs {hidden} && exec {worker}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        with Client(address, timeout="30s") as client:
            client.wait_for_workers(1, timeout=60)
        out = hidden / "out"
        # the worker finds no build lock in its folder (or, had it one, the client finds no shard in its own)
        with pytest.raises(datapipe.errors.BuildError, match=r"(as this machine sees it|as this worker sees it).*every "
                                                             r"worker must see the output folder at the same path"):
            datapipe.build(dist_source, out, **quiet(scheduler=address))
        assert not (out / "manifest.json").exists()
        with pytest.raises(datapipe.errors.CacheError, match="not a finished datapipe cache|does not exist"):
            datapipe.open(out)
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_client_leaves_nothing_written_by_its_cluster_and_the_rerun_resumes(dist_source, serial, external_cluster,
                                                                                      tmp_path, imaging, signum):
    """An existing cluster runs a build's tasks on after its client is stopped: they wrote their shards into the
    output after the lock was released (and into a folder the client had removed, made again, which the rerun then
    refused as not a cache). A task writes nothing once no build holds the output's lock."""
    address, workers = external_cluster
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "datapipe.cli", "build", str(dist_source), str(out), "--scheduler",
                             address, "--shard-size", "200", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: (out / "shards").is_dir() and bool(temps(out)), 120, "a shard being written")
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signum, err
    time.sleep(0.5)
    from distributed import Client

    with Client(address, timeout="30s") as client:  # the tasks the client left behind have ended
        wait_for(lambda: not any(client.processing().values()), 120, "the cluster's tasks to end", poll=0.1)
    assert not out.exists() or not (out / "shards").exists() or (not temps(out) and not list((out / "shards").glob("*.zarr")))
    report = datapipe.build(dist_source, out, **quiet(scheduler=address))
    assert report.status == "ok"
    assert_same_cache(out, serial[1], imaging)


@pytest.mark.parametrize("scheme,need", [
    ("tls", "a tls:// scheduler needs the cluster's TLS settings in Dask's configuration (distributed.comm.tls.*)"),
    ("ucx", "a ucx:// scheduler needs distributed's support for ucx:// installed here (ucx: pip install "
            "distributed-ucxx)"),  # it was told it needed TLS settings
])
def test_a_scheme_without_its_settings_or_package_is_one_line_naming_what_it_needs(tmp_path, imaging, scheme, need):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 2}, variety=False)
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(src), str(tmp_path / "out"), "--scheduler",
                           f"{scheme}://127.0.0.1:9", "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"datapipe build: error: --scheduler {scheme}://127.0.0.1:9: ") and line.endswith(need), line
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(240)
def test_a_scheduler_killed_mid_build_is_one_line_and_the_rerun_resumes(dist_source, serial, tmp_path, imaging):
    scheduler_file = tmp_path / "scheduler.json"
    procs: list[subprocess.Popen] = []

    def cluster() -> str:
        scheduler_file.unlink(missing_ok=True)
        procs.append(subprocess.Popen([*_dask_cli("scheduler"), "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                       "--scheduler-file", str(scheduler_file)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True))
        wait_for(lambda: scheduler_file.exists() and scheduler_file.stat().st_size > 0, 60, "the scheduler", poll=0.05)
        address = json.loads(scheduler_file.read_text())["address"]
        procs.append(subprocess.Popen([*_dask_cli("worker"), address, "--nthreads", "1", "--no-nanny", "--memory-limit",
                                       "0", "--death-timeout", "30", "--local-directory", str(tmp_path / "w")],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        return address

    out = tmp_path / "out"
    try:
        address = cluster()
        proc = subprocess.Popen([sys.executable, "-m", "datapipe.cli", "build", str(dist_source), str(out), "--scheduler",
                                 address, "--shard-size", "20", "--size", str(SIZE), "--max-bad-fraction", str(MAX_BAD),
                                 "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        wait_for(lambda: (out / "shards").is_dir() and len(list((out / "shards").glob("*.zarr"))) >= 1, 120, "a shard")
        procs[0].kill()  # the scheduler
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0 and "Traceback" not in err, err
        line = err.strip().splitlines()[-1]
        assert line.startswith("datapipe build: error: the build lost its Dask scheduler") and "are kept" in line, err
        for p in procs:
            p.kill()
            p.wait(30)
        procs.clear()
        address = cluster()
        report = datapipe.build(dist_source, out, **quiet(scheduler=address, shard_size=20))
        assert report.status == "ok" and report.shards_skipped >= 1
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


@pytest.mark.timeout(120)
def test_an_address_where_no_scheduler_answers_is_one_line_not_a_hang(tmp_path, imaging):
    """Something listens there and never answers (a web server, a stuck process): distributed's handshake has no
    deadline of its own; the build ends with one line after DATAPIPE_SCHEDULER_TIMEOUT (+10 s), nothing left."""
    import socket

    src = tmp_path / "src"
    imaging.write_source(src, {"a": 2}, variety=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(src), str(tmp_path / "out"),
                               "--scheduler", f"tcp://127.0.0.1:{port}", "--quiet"], capture_output=True, text=True,
                              timeout=100, env={**os.environ, "DATAPIPE_SCHEDULER_TIMEOUT": "2"})
        took = time.monotonic() - started
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"datapipe build: error: the Dask scheduler at tcp://127.0.0.1:{port} did not answer within "
                           "12 s (DATAPIPE_SCHEDULER_TIMEOUT + 10)"), line
    assert took < 60 and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- a cluster that cannot build


class _Cluster:
    """A scheduler and workers of our own on loopback (each in a session of its own), stopped (continued first,
    if stopped) at the end of the with block."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.procs = folder, []

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.wait(30)

    def scheduler(self) -> str:
        file = self.folder / "scheduler.json"
        self.procs.append(subprocess.Popen([*_dask_cli("scheduler"), "--host", "127.0.0.1", "--port", "0",
                                            "--no-dashboard", "--scheduler-file", str(file)], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL, start_new_session=True))
        wait_for(lambda: file.exists() and file.stat().st_size > 0, 60, "the scheduler", poll=0.05)
        return json.loads(file.read_text())["address"]

    def worker(self, address: str, *args: str, env: dict | None = None) -> subprocess.Popen:
        proc = subprocess.Popen([*_dask_cli("worker"), address, "--nthreads", "1", "--no-nanny", "--death-timeout",
                                 "60", "--local-directory", str(self.folder / f"w{len(self.procs)}"), *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {})})
        self.procs.append(proc)
        return proc


def _build_cli(source: Path, out: Path, address: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "datapipe.cli", "build", str(source), str(out), "--scheduler", address,
                             "--shard-size", "4", "--size", str(SIZE), "--max-bad-fraction", str(MAX_BAD), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **env})


def _ended_with(proc: subprocess.Popen, within: float) -> str:
    """The one line a build ended with (within ``within`` seconds, not killed)."""
    try:
        _, err = proc.communicate(timeout=within)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.timeout(120)
def test_a_cluster_that_runs_none_of_the_pending_shards_is_named_after_the_worker_timeout(monkeypatch):
    """A scheduler with a live, unpaused worker that runs none of the build's shards while some are left (their
    tasks lost between worker and scheduler): the build's watch names it after DATAPIPE_WORKER_TIMEOUT, and a
    shard built meanwhile starts the wait again."""
    from distributed import Client, LocalCluster

    from datapipe.builder import _Watch
    from datapipe.errors import BuildError

    monkeypatch.setenv("DATAPIPE_WORKER_TIMEOUT", "2")
    monkeypatch.setattr(_Watch, "EVERY", 0.2)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        watch = _Watch(client, cluster.scheduler_address)
        started = time.monotonic()
        for built in (0, 1):  # 0 -> 1: a shard was built, which starts the wait again
            while time.monotonic() - started < 1.5 * (built + 1):
                watch.check(built, 3)
                time.sleep(0.05)
        with pytest.raises(BuildError) as raised:
            while time.monotonic() - started < 30:
                watch.check(1, 3)
                time.sleep(0.05)
        took = time.monotonic() - started
    message = str(raised.value)
    assert "has had no worker running any of the build's shards for " in message, message
    assert "2 are left, and the scheduler gives them to none" in message and "(1 of 3 reported)" in message, message
    assert 3.5 < took < 20, took


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["no-worker", "paused-worker"])
def test_a_cluster_without_a_worker_that_can_build_ends_the_build_with_one_line(dist_source, tmp_path, case):
    """A scheduler with no worker, or with only a worker paused over its memory limit: the build printed
    "0 Dask workers" (or nothing) and waited for ever. Now it ends after DATAPIPE_WORKER_TIMEOUT with one line."""
    out = tmp_path / "out"
    with _Cluster(tmp_path) as cluster:
        address = cluster.scheduler()
        if case == "paused-worker":
            cluster.worker(address, "--memory-limit", "60MB")  # pauses at 80%: its own interpreter is more
        started = time.monotonic()
        line = _ended_with(_build_cli(dist_source, out, address, {"DATAPIPE_WORKER_TIMEOUT": "3"}), 120)
        took = time.monotonic() - started
    assert line.startswith(f"datapipe build: error: the Dask scheduler at {address} has had "), line
    if case == "no-worker":
        assert "has had no workers for " in line and "(DATAPIPE_WORKER_TIMEOUT: 3 s)" in line, line
    else:
        assert "only paused workers" in line and "(memory limit 57 MiB)" in line and "--memory-limit" in line, line
    assert re.search(r"; the shards finished so far are kept \(\d+ of \d+ reported\): rerun once the cluster is up "
                     r"to resume$", line), line
    assert took < 90


@pytest.mark.timeout(240)
@pytest.mark.parametrize("frozen", ["worker", "scheduler"])
def test_a_frozen_worker_or_scheduler_ends_the_build_with_one_line_and_the_rerun_resumes(dist_source, serial, tmp_path,
                                                                                         imaging, frozen):
    """A worker or scheduler stopped (SIGSTOP) mid-build keeps its connections open, so no error ever reached the
    build: it waited for ever. The scheduler's silence ends it after DATAPIPE_SCHEDULER_TIMEOUT, the silence of
    the worker building a shard after DATAPIPE_WORKER_TIMEOUT; finished shards are kept."""
    out = tmp_path / "out"
    with _Cluster(tmp_path) as cluster:
        address = cluster.scheduler()
        worker = cluster.worker(address)
        proc = _build_cli(dist_source, out, address, {"DATAPIPE_WORKER_TIMEOUT": "4", "DATAPIPE_SCHEDULER_TIMEOUT": "4"})
        wait_for(lambda: len(list((out / "shards").glob("*.zarr"))) >= 2 or proc.poll() is not None, 120, "a shard")
        assert proc.poll() is None, "the build ended before it could be stopped"
        os.kill((worker if frozen == "worker" else cluster.procs[0]).pid, signal.SIGSTOP)
        line = _ended_with(proc, 90)
    if frozen == "worker":  # found building a shard, or holding the record of one it built
        assert re.match(r"datapipe build: error: (Dask worker tcp://127\.0\.0\.1:\d+ of tcp://\S+ has not been heard "
                        r"from for \d+ s \(DATAPIPE_WORKER_TIMEOUT: 4 s\) while building a shard|the record of a "
                        r"finished shard did not arrive from Dask worker tcp://127\.0\.0\.1:\d+ of tcp://\S+, not heard "
                        r"from for \d+ s \(DATAPIPE_WORKER_TIMEOUT: 4 s\)): it may be stopped or frozen; ", line), line
    else:
        assert line.startswith(f"datapipe build: error: the Dask scheduler at {address} stopped answering (nothing "
                               "within 4 s, DATAPIPE_SCHEDULER_TIMEOUT)"), line
    assert "the shards finished so far are kept (" in line and "rerun once the cluster is up to resume" in line
    report = datapipe.build(dist_source, out, **quiet(shard_size=4))
    assert report.status == "ok" and report.shards_skipped >= 2


@pytest.mark.timeout(180)
@pytest.mark.parametrize("joins", ["before the build", "mid-build"])
@pytest.mark.parametrize("change", ["version", "decode rules", "older"])
def test_a_worker_running_another_datapipe_is_refused_before_any_shard(dist_source, tmp_path, joins, change):
    """A worker with another datapipe installed built shards silently: another version may write another format
    into the same cache, and another commit of the same version decode files otherwise (the version string never
    changed: a worker of earlier decode rules wrote a cache of mixed rules, "ok"). What runs is compared when the
    workers warm up, and by each shard's task (a worker that joins later); the build ends naming the worker."""
    other = tmp_path / "other"
    shutil.copytree(Path(datapipe.__file__).parent, other / "datapipe", ignore=shutil.ignore_patterns("__pycache__"))
    if change == "version":
        edited, old, new = other / "datapipe" / "__init__.py", f'__version__ = "{datapipe.__version__}"', '__version__ = "9.9.9"'
    elif change == "older":  # a datapipe from before the warm-up's report: it cannot even be asked
        edited, old, new = other / "datapipe" / "builder.py", "def _warm_up_report(", "def _warm_up_report_to_come("
    else:
        rules = datapipe.codecs.DECODE_RULES
        edited, old, new = other / "datapipe" / "codecs.py", f"DECODE_RULES = {rules}\n", f"DECODE_RULES = {rules - 1}\n"
    assert old in edited.read_text()
    edited.write_text(edited.read_text().replace(old, new))
    out = tmp_path / "out"
    with _Cluster(tmp_path) as cluster:
        address = cluster.scheduler()
        if joins == "before the build":
            cluster.worker(address, env={"PYTHONPATH": str(other)})
            from distributed import Client

            with Client(address, timeout="30s") as client:
                client.wait_for_workers(1, timeout=60)
        proc = _build_cli(dist_source, out, address, {})
        if joins == "mid-build":  # the build found no worker to check: the worker's first task refuses
            wait_for(lambda: (out / "shards").is_dir() or proc.poll() is not None, 60, "the build to start")
            cluster.worker(address, env={"PYTHONPATH": str(other)})
        line = _ended_with(proc, 120)
    theirs = (r"datapipe 9\.9\.9, decode rules \d+, code [0-9a-f]{8}" if change == "version" else
              rf"datapipe {re.escape(datapipe.__version__)}, decode rules {datapipe.codecs.DECODE_RULES - 1}, code "
              r"[0-9a-f]{8}" if change == "decode rules" else "an older datapipe" if joins == "before the build" else
              rf"datapipe {re.escape(datapipe.__version__)}, decode rules \d+, code [0-9a-f]{{8}}")  # (its task's check)
    worker = (rf"\(one of {address}\)" if change == "older" and joins == "before the build" else
              rf"tcp://127\.0\.0\.1:\d+( of {address})?")
    assert re.fullmatch(rf"datapipe build: error: Dask worker {worker} runs "
                        rf"{theirs}, this process datapipe {re.escape(datapipe.__version__)}, decode "
                        rf"rules {datapipe.codecs.DECODE_RULES}, code [0-9a-f]{{8}}: every worker must run this "
                        r"process's datapipe, which decides what the cache holds \(its format, how each file decodes\); "
                        r"install it on the workers \(or this one's on this machine\) and rerun", line), line
    assert not any(out.glob("shards/*.zarr"))  # refused before any shard


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["a worker", "this process"])
def test_a_decoding_library_older_than_datapipe_needs_is_named_before_any_shard(dist_source, tmp_path, where):
    """A worker with Pillow 9.5 (below the version datapipe requires: pip never checked that image) wrote unrotated
    TIFFs into some shards, "ok"; one with zarr 3.0 ended the build with a raw TypeError. The libraries are checked
    when a process warms up, and the worker or the process named."""
    other = tmp_path / "other"
    shutil.copytree(Path(datapipe.__file__).parent, other / "datapipe", ignore=shutil.ignore_patterns("__pycache__"))
    builder_py = other / "datapipe" / "builder.py"
    text = builder_py.read_text()
    assert '"Pillow": "11.2.1"' in text
    builder_py.write_text(text.replace('"Pillow": "11.2.1"', '"Pillow": "999"'))  # as if the Pillow here were older
    from PIL import __version__ as pillow

    out = tmp_path / "out"
    if where == "this process":
        done = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(dist_source), str(out), "--scheduler",
                               "sync", "--quiet"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(other)})
        line = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and line == (f"datapipe build: error: this process has Pillow {pillow} (datapipe "
                                                 "needs 999 or later): install the versions datapipe needs (pip install "
                                                 "-U 'PACKAGE>=VERSION') and rerun"), done.stderr
    else:
        with _Cluster(tmp_path) as cluster:
            address = cluster.scheduler()
            cluster.worker(address, env={"PYTHONPATH": str(other)})
            from distributed import Client

            with Client(address, timeout="30s") as client:
                client.wait_for_workers(1, timeout=60)
            line = _ended_with(_build_cli(dist_source, out, address, {}), 120)
        assert re.fullmatch(rf"datapipe build: error: Dask worker tcp://127\.0\.0\.1:\d+ of {address} has Pillow "
                            rf"{re.escape(pillow)} \(datapipe needs 999 or later\): install the versions datapipe needs "
                            r".* and rerun", line), line
    assert not any(out.glob("shards/*.zarr"))


def test_the_least_versions_checked_are_pyproject_tomls():
    """The table the workers are checked against is the requirements' (one changed without the other would let an
    older library through, or refuse a good one)."""
    import tomllib

    from datapipe import builder

    required = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    least = {}
    for line in required:
        name, _, rest = line.partition(">=")
        least[name.split("[")[0].strip()] = rest.split(",")[0].strip()
    assert {name: least[name] for name in builder._NEEDS} == builder._NEEDS


HOLD_PRELOAD = '''
import ctypes
import datapipe.builder as builder

if not hasattr(builder, "_held_load"):  # a preload may be imported twice
    builder._held_load = real = builder._load

    def _load(file, *args, **kwargs):
        if str(file).endswith("000_hold.jpg"):
            ctypes.PyDLL(None).sleep(6)  # a call that keeps the interpreter (the GIL) for 6 s: no heartbeat meanwhile
        return real(file, *args, **kwargs)

    builder._load = _load
'''


def _source_with_a_marked_file(tmp_path: Path, imaging, mark: str, preload_text: str) -> tuple[Path, Path]:
    """A source of two classes of 4 whose shard 1 begins with ``000_<mark>.jpg`` (shards of 4), and a worker
    preload (``preload_text``) that acts on that file: (the source, the preload)."""
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 4, "b": 4}, variety=False)
    shutil.copy(next(iter(sorted((src / "b").iterdir()))), src / "b" / f"000_{mark}.jpg")  # the first of shard 1
    preload = tmp_path / f"{mark}_preload.py"
    preload.write_text(preload_text)
    return src, preload


@pytest.mark.timeout(180)
def test_a_worker_that_holds_its_interpreter_in_a_long_decode_is_not_taken_for_frozen(tmp_path, imaging):
    """A decode that holds a worker's interpreter (a library call that keeps the GIL) stops its heartbeats and its
    answers, also for the record of the shard it finished just before: the build ended after
    DATAPIPE_SCHEDULER_TIMEOUT saying the worker may be frozen. Only DATAPIPE_WORKER_TIMEOUT of silence ends it."""
    src, preload = _source_with_a_marked_file(tmp_path, imaging, "hold", HOLD_PRELOAD)
    out = tmp_path / "out"
    with _Cluster(tmp_path) as cluster:
        address = cluster.scheduler()
        cluster.worker(address, "--preload", str(preload))
        from distributed import Client

        with Client(address, timeout="30s") as client:
            client.wait_for_workers(1, timeout=60)
        proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(src), str(out), "--scheduler", address,
                               "--shard-size", "4", "--size", str(SIZE), "--quiet"], capture_output=True, text=True,
                              timeout=150, env={**os.environ, "DATAPIPE_SCHEDULER_TIMEOUT": "2",
                                                "DATAPIPE_WORKER_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stderr
    assert len(datapipe.open(out)) == 9


PAUSE_PRELOAD = '''
import time
import datapipe.builder as builder

if not hasattr(builder, "_paused_load"):  # a preload may be imported twice
    builder._paused_load = real = builder._load

    def _load(file, *args, **kwargs):
        if str(file).endswith("000_pause.jpg"):
            ballast = bytearray(400 * 2**20)  # past the worker's memory limit: it pauses while it executes this shard
            ballast[::4096] = b"x" * len(ballast[::4096])
            time.sleep(12)  # the interpreter is free: the worker's heartbeats go on, saying it is paused
            del ballast
        return real(file, *args, **kwargs)

    builder._load = _load
'''


@pytest.mark.timeout(180)
def test_a_worker_paused_while_it_builds_a_shard_is_waited_for(tmp_path, imaging):
    """A worker over its memory limit pauses: it starts no new task, yet finishes the one it executes. The watch
    counted a paused worker as one that cannot build, and ended a build whose only worker was paused in the
    middle of a shard it then finished; only a paused worker executing no shard counts as one that cannot build."""
    src, preload = _source_with_a_marked_file(tmp_path, imaging, "pause", PAUSE_PRELOAD)
    out = tmp_path / "out"
    with _Cluster(tmp_path) as cluster:
        address = cluster.scheduler()
        cluster.worker(address, "--preload", str(preload), "--memory-limit", "500MB")
        from distributed import Client

        with Client(address, timeout="30s") as client:
            client.wait_for_workers(1, timeout=60)
            proc = subprocess.Popen([sys.executable, "-m", "datapipe.cli", "build", str(src), str(out), "--scheduler",
                                     address, "--shard-size", "4", "--size", str(SIZE), "--quiet"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**os.environ, "DATAPIPE_WORKER_TIMEOUT": "3"})
            # the worker did pause (else this test shows nothing)
            wait_for(lambda: proc.poll() is not None or any(
                w.get("status") == "paused" for w in client.scheduler_info()["workers"].values()), 120, "a pause")
            assert proc.poll() is None, proc.communicate()
            _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert len(datapipe.open(out)) == 9


FAILED_CONNECTIONS = '''
import sys
import datapipe

if __name__ == "__main__":
    for scheduler in ("bogus", "tcp://127.0.0.1:1", "SYNC"):
        try:
            datapipe.build(sys.argv[1], sys.argv[2], size=16, progress=False, cluster=datapipe.Cluster(scheduler=scheduler))
        except datapipe.errors.OutputError as exc:
            print("refused:", exc, flush=True)
'''


@pytest.mark.timeout(120)
def test_a_program_whose_builds_could_not_reach_a_scheduler_exits_at_once(tmp_path, imaging):
    """A program that called build() with schedulers it could not reach got each refusal, then waited 40 s at its
    exit and printed a traceback from distributed: the Client whose constructor failed lingered in a reference
    cycle, to be closed only when the interpreter ended. It is collected when the connection fails."""
    imaging.write_source(tmp_path / "src", {"a": 2}, variety=False)
    script = tmp_path / "connect.py"
    script.write_text(FAILED_CONNECTIONS)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "src"), str(tmp_path / "out")], capture_output=True,
                          text=True, timeout=110, env={**os.environ, "DATAPIPE_SCHEDULER_TIMEOUT": "2"})
    took = time.monotonic() - started
    assert done.returncode == 0 and done.stdout.count("refused:") == 3, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert took < 30, took
