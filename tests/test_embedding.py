"""`datapipe.build` called from a program, not the command line: where it may run (a spawned process, an
interactive session, a script read from standard input, a process without standard error) and what it gives
back (the program's loggers, environment and logging switch as they were)."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import textwrap

import pytest
from build_fixtures import build

import datapipe
from datapipe import builder, cli

DASK_LOGGERS = ("distributed", "tornado", "asyncio", "bokeh", "distributed.client")


def test_builds_running_at_once_give_each_logger_and_variable_back():
    """Two builds in one process (threads) silence the same loggers for a while, and their clusters set the same
    variables; whatever the order they end in, each gets the level or value it had before the first."""
    logger = logging.getLogger("distributed.client")
    before = logger.level
    try:
        logger.setLevel(logging.WARNING)
        with contextlib.ExitStack() as first, contextlib.ExitStack() as second:
            first.enter_context(builder._loggers_quiet("distributed.client"))
            second.enter_context(builder._loggers_quiet("distributed.client"))
            assert logger.level > logging.CRITICAL
            first.close()  # the first build ends while the second still runs
            assert logger.level > logging.CRITICAL
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(before)
    saved = os.environ.pop("OMP_NUM_THREADS", None)
    try:  # the environment the nannies of two LocalClusters set, the same way
        builder._Environ.hold(["OMP_NUM_THREADS"])
        os.environ["OMP_NUM_THREADS"] = "1"  # the first build's nanny
        builder._Environ.hold(["OMP_NUM_THREADS"])
        builder._Environ.release(["OMP_NUM_THREADS"])  # the first build ends
        assert os.environ["OMP_NUM_THREADS"] == "1"
        builder._Environ.release(["OMP_NUM_THREADS"])
        assert "OMP_NUM_THREADS" not in os.environ
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved


def test_a_build_that_failed_on_a_local_cluster_leaves_the_programs_loggers_and_environment_as_they_were():
    """Stopping early silences Dask's loggers (closing the cluster logs the cancelled tasks' tracebacks) only
    until the cluster is closed; the environment distributed's nannies set in this process for their workers
    (one BLAS thread, glibc's malloc settings) is the program's again afterwards."""
    names = [*builder._pre_spawn_environ(), "PYTHONHASHSEED"]
    assert "OMP_NUM_THREADS" in names and "MALLOC_MMAP_THRESHOLD_" in names
    levels = {name: logging.getLogger(name).level for name in DASK_LOGGERS}
    environ = {name: os.environ.get(name) for name in names}
    try:
        for name in DASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)
        os.environ.pop("OMP_NUM_THREADS", None)
        os.environ.pop("PYTHONHASHSEED", None)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "12345"
        with pytest.raises(RuntimeError, match="the program's own"), \
                builder._dask_client(datapipe.Cluster(workers=1)) as client:
            assert client.run(lambda: os.environ.get("OMP_NUM_THREADS")) != {}  # the workers started
            assert os.environ.get("OMP_NUM_THREADS") == "1"  # set here, by the nanny
            raise RuntimeError("the program's own")
        assert {name: logging.getLogger(name).level for name in DASK_LOGGERS} == dict.fromkeys(DASK_LOGGERS, logging.INFO)
        assert "OMP_NUM_THREADS" not in os.environ and "PYTHONHASHSEED" not in os.environ
        assert os.environ["MALLOC_MMAP_THRESHOLD_"] == "12345"
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for name, value in environ.items():
            os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


def test_a_build_in_a_process_without_standard_error_goes_on_without_its_bar(source, tmp_path, monkeypatch):
    """A process started with descriptor 2 closed has ``sys.stderr = None``: the progress bar is silent."""
    monkeypatch.setattr(sys, "stderr", None)
    report = build(source[0], tmp_path / "out", progress=True)
    assert report.num_samples == len(source[1]) and len(datapipe.open(tmp_path / "out")) == len(source[1])


def test_a_command_called_from_a_program_and_interrupted_gives_logging_back(source, tmp_path, monkeypatch):
    """An interrupted command says so in one line and silences all logging for the rest of the process, which
    then ends; called from a program, which goes on, logging is switched back on."""

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(builder, "scan", interrupted)
    assert logging.root.manager.disable == logging.NOTSET
    assert cli.main(["build", str(source[0]), str(tmp_path / "out"), "--scheduler", "sync"]) == 130
    assert logging.root.manager.disable == logging.NOTSET


SPAWNED = """
import multiprocessing, sys
import datapipe

def rank(source, output):  # as torch.multiprocessing.spawn runs each rank: a function of the main script
    datapipe.build(source, output, size=16, cluster=datapipe.Cluster(scheduler="sync"), progress=False)

if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=rank, args=sys.argv[1:])
    process.start()
    process.join(120)
    print(process.exitcode, len(datapipe.open(sys.argv[2])))
"""


def test_a_function_of_the_main_script_that_a_spawned_process_runs_may_build(source, tmp_path):
    """A spawned process imports the main script as __mp_main__, then runs its target: a build there is no
    script's top-level code run again (which is refused), and goes on."""
    (tmp_path / "ranks.py").write_text(SPAWNED)
    proc = subprocess.run([sys.executable, str(tmp_path / "ranks.py"), str(source[0]), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", str(len(source[1]))], proc.stderr[-3000:]


def test_a_script_read_from_standard_input_is_told_that_a_local_cluster_cannot_start_from_it(source, tmp_path):
    """``python - < build.py``: a LocalCluster's spawned workers would run the main script again from a path that
    is no file; one line says so before anything starts, instead of blaming the machine's limits."""
    script = (f"import datapipe\nif __name__ == '__main__':\n    datapipe.build({str(source[0])!r}, "
              f"{str(tmp_path / 'out')!r}, size=16, cluster=datapipe.Cluster(workers=1), progress=False)\n")
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("datapipe.errors.ArgumentError: the main script <stdin> is no "
                                                    "file"), proc.stderr[-3000:]
    assert "--scheduler sync" in last and "Nanny" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_local_cluster_build_in_pythons_asyncio_console_runs_and_leaves_nothing_set(source, tmp_path):
    """``python -m asyncio`` runs what it is given as an interactive session whose namespace names asyncio's own
    __main__.py as its file: nothing is imported again there, so the build is not refused as an unguarded
    script's, and afterwards the session's environment is as it was."""
    lines = textwrap.dedent(f"""\
        import os, datapipe
        report = datapipe.build({str(source[0])!r}, {str(tmp_path / 'out')!r}, size=16, cluster=datapipe.Cluster(workers=1), progress=False)
        print("built", report.num_samples, os.environ.get("OMP_NUM_THREADS"))
        """)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run([sys.executable, "-m", "asyncio"], input=lines, capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)
    assert f"built {len(source[1])} None" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


POOLED = """
import multiprocessing, sys
import datapipe

def task(source, output):  # a pool's worker is daemonic: it may start no processes
    try:
        datapipe.build(source, output, size=16, cluster=datapipe.Cluster(workers=1), progress=False)
    except datapipe.errors.DatapipeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "built"

if __name__ == "__main__":
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        print(pool.apply(task, sys.argv[1:]))
"""


def test_a_local_cluster_build_in_a_pools_worker_is_refused_in_one_line(source, tmp_path):
    """A daemonic process may not have children: the cluster failed to start, blamed on open files and memory."""
    (tmp_path / "pooled.py").write_text(POOLED)
    proc = subprocess.run([sys.executable, str(tmp_path / "pooled.py"), str(source[0]), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("BuildError: this process (SpawnPoolWorker-1) is daemonic, as a "
                                  "multiprocessing.Pool's workers are"), proc.stdout
    assert "--scheduler sync" in proc.stdout and not (tmp_path / "out").exists()
