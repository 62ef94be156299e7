"""`datapipe bench` compares like with like: every baseline reads exactly the cache's samples.

The source here holds files the build quarantined (a text file and an empty file named .jpg):
the baselines must never read them (a plain ImageFolder scan would, and crash). Another dataset as
--source is refused instead of measured, and a baseline that fails is reported as failed — the
others still run, and the exit code says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import datapipe
from datapipe.bench import harness as bench
from datapipe.bench import peers
from datapipe.bench.harness import BenchSpec
from datapipe.errors import DatapipeError, SourceError

IMAGES = 24
BAD = {"class_001/not-an-image.jpg": b"this is no image, whatever its name says\n" * 4, "class_002/empty.jpg": b""}
FAST = ["--batch-size", "8", "--workers", "1", "--repeats", "1", "--batches", "2", "--crop", "48", "--quiet"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A source of 24 photographs and 2 bad files, and its cache (the 2 quarantined)."""
    root = tmp_path_factory.mktemp("trust-bench")
    source = datapipe.make_sample_dataset(root / "src", images=IMAGES, classes=3)
    for rel, data in BAD.items():
        (source / rel).write_bytes(data)
    datapipe.build(source, root / "cache", size=64, shard_size=10, cluster=datapipe.Cluster(scheduler="sync"),
                   max_bad_fraction=0.2, progress=False)
    cache = datapipe.open(root / "cache")
    report = json.loads((root / "cache" / "report.json").read_text())
    assert sorted(q["path"] for q in report["quarantined"]) == sorted(BAD) and len(cache) == IMAGES
    return root


def cache_files(root: Path) -> set[str]:
    cache = datapipe.open(root / "cache")
    return {str(root / "src" / cache.path(i)) for i in range(len(cache))}


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datapipe.cli", "bench", *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_the_baselines_read_exactly_the_caches_samples(built, tmp_path):
    out = tmp_path / "r.json"
    proc = cli(str(built / "cache"), "--source", str(built / "src"), "--against", "dataloader,webdataset",
               "--work-dir", str(tmp_path / "work"), "--json", str(out), *FAST)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["config"]["samples"] == IMAGES
    for name in ("datapipe", "dataloader", "webdataset"):
        s = result["systems"][name]
        assert s["status"] == "ok" and s["samples"] == IMAGES and s["median"] > 0, (name, s)
    assert f"the cache's {IMAGES}" in proc.stdout
    # webdataset's shards hold the cache's files, byte for byte, and nothing else
    stored = {}
    for tar in sorted((tmp_path / "work" / "webdataset").glob("shard-*.tar")):
        with tarfile.open(tar) as t:
            for member in t.getmembers():
                if member.name.endswith(".jpg"):
                    stored[member.name] = t.extractfile(member).read()
    expected = sorted(Path(p).read_bytes() for p in cache_files(built))
    assert sorted(stored.values()) == expected


def test_every_file_a_baseline_decodes_is_one_of_the_caches(built, tmp_path, monkeypatch):
    """In one process (workers=0), every file the plain DataLoader baseline opens is watched."""
    opened: list[str] = []
    load = peers.ImageFolderTransform.load

    def watched(src):
        opened.append(str(src))
        return load(src)

    monkeypatch.setattr(peers.ImageFolderTransform, "load", staticmethod(watched))
    result = bench.run(built / "cache", BenchSpec(batch_size=8, workers=0, repeats=1, batches=3, crop=48),
                       source=built / "src", against=["dataloader"], work_dir=tmp_path / "work", progress=False)
    assert result.systems["dataloader"].status == "ok"
    assert len(opened) == 2 * 3 * 8  # warm-up and one round of 3 batches
    assert set(opened) <= cache_files(built)
    assert not any(rel in name for name in opened for rel in BAD)


def test_another_dataset_as_source_is_refused(built, tmp_path):
    other = datapipe.make_sample_dataset(tmp_path / "other", images=IMAGES, classes=3, seed=7)  # the same names
    proc = cli(str(built / "cache"), "--source", str(other), "--against", "dataloader", *FAST)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "is not the file sample" in line and str(built / "src") in line
    cache = datapipe.open(built / "cache")
    with pytest.raises(SourceError, match="pixels differ"):
        peers.cache_samples(cache, other)


@pytest.mark.parametrize("options", [{"encoding": "jpeg"}, {"encoding": "jpeg", "quality": 50},
                                     {"fit": "short", "max_aspect": 1.1}, {"fit": "pad"}])
def test_the_source_of_a_cache_built_any_way_is_its_source_and_another_is_refused(built, tmp_path, options):
    """The spot check decodes source files with every field of the build's decoding configuration (max_aspect
    included) and accepts a JPEG cache's samples within the encoding's loss; another dataset with the same file
    names is refused all the same."""
    out = tmp_path / "cache"
    datapipe.build(built / "src", out, size=64, shard_size=10, cluster=datapipe.Cluster(scheduler="sync"),
                   max_bad_fraction=0.2, progress=False, **options)
    cache = datapipe.open(out)
    listing = peers.cache_samples(cache, built / "src")
    assert len(listing) == IMAGES
    other = datapipe.make_sample_dataset(tmp_path / "other", images=IMAGES, classes=3, seed=7)  # the same names
    with pytest.raises(SourceError, match="pixels differ"):
        peers.cache_samples(cache, other)


def test_a_cache_without_samples_is_one_line_not_a_measurement_of_nothing(tmp_path, imaging):
    source = tmp_path / "src"
    for rel, data in BAD.items():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        (source / rel).write_bytes(data)
    datapipe.build(source, tmp_path / "cache", size=64, cluster=datapipe.Cluster(scheduler="sync"),
                   max_bad_fraction=1.0, progress=False)
    assert len(datapipe.open(tmp_path / "cache")) == 0
    proc = cli(str(tmp_path / "cache"), *FAST)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("datapipe bench: error: ") and "holds no samples" in line and "nothing to measure" in line


def test_a_source_without_the_caches_files_is_refused(built, tmp_path):
    partial = shutil.copytree(built / "src", tmp_path / "partial")
    cache = datapipe.open(built / "cache")
    (partial / cache.path(5)).unlink()
    (partial / cache.path(17)).unlink()
    with pytest.raises(SourceError, match=rf"2 of {IMAGES} files are missing \(first: {cache.path(5)}\)"):
        peers.cache_samples(cache, partial)
    with pytest.raises(SourceError, match="not a folder"):
        peers.cache_samples(cache, tmp_path / "missing")
    proc = cli(str(built / "cache"), "--source", str(tmp_path / "nowhere"), "--against", "dataloader", *FAST)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_a_moved_copy_of_the_source_is_the_same_data(built, tmp_path):
    moved = shutil.copytree(built / "src", tmp_path / "moved")  # new modification times, same files
    cache = datapipe.open(built / "cache")
    listing = peers.cache_samples(cache, moved)
    assert len(listing) == IMAGES and listing.root == moved
    assert [(p.relative_to(moved).as_posix(), lab) for p, lab in listing.samples] == [
        (cache.path(i), int(cache.labels[i])) for i in range(IMAGES)]


def test_a_baseline_that_cannot_import_is_one_failed_line_and_a_nonzero_exit(built, tmp_path):
    sabotage = tmp_path / "sabotage" / "webdataset"
    sabotage.mkdir(parents=True)
    (sabotage / "__init__.py").write_text("raise ImportError('webdataset is sabotaged for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(sabotage.parent), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "r.json"
    proc = cli(str(built / "cache"), "--source", str(built / "src"), "--against", "dataloader,webdataset",
               "--work-dir", str(tmp_path / "work"), "--json", str(out), *FAST, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"(datapipe( \([a-z]+, [a-z]+\))?|dataloader|webdataset)\s{2}", line)]
    assert len(rows) == 3
    [failed] = [line for line in rows if "FAILED" in line]
    assert failed.startswith("webdataset") and "sabotaged" in failed and "pip install webdataset" in failed
    assert "×" in next(line for line in rows if line.startswith("dataloader"))  # the others still report
    systems = json.loads(out.read_text())["systems"]
    assert systems["webdataset"]["status"] == "failed" and systems["dataloader"]["status"] == "ok"
    assert "webdataset" in proc.stderr.strip().splitlines()[-1]


def test_a_baseline_that_fails_mid_run_is_reported_and_the_others_run(built, tmp_path, monkeypatch):
    def broken_loader(self, source, workdir, **kwargs):
        def batches():
            raise OSError("the disk went away\nwith a second line")
            yield  # pragma: no cover

        class Loader:
            def __iter__(self):
                return batches()
        return Loader()

    monkeypatch.setattr(peers.WebDatasetPeer, "loader", broken_loader)
    result = bench.run(built / "cache", BenchSpec(batch_size=8, workers=0, repeats=1, batches=2, crop=48),
                       source=built / "src", against=["webdataset", "dataloader"], work_dir=tmp_path / "work",
                       progress=False)
    web, plain = result.systems["webdataset"], result.systems["dataloader"]
    assert web.status == "failed" and web.reason == "OSError: the disk went away" and not web.images_per_s
    assert plain.status == "ok" and plain.ratio and result.systems["datapipe"].median > 0
    table = bench.format_table(result)
    assert re.search(r"^webdataset\s+FAILED: OSError: the disk went away$", table, re.MULTILINE), table


def test_all_skips_peers_that_are_not_installed_without_failing(built, tmp_path, monkeypatch):
    monkeypatch.setattr(peers.LitDataPeer, "unavailable", lambda self: "ModuleNotFoundError: No module named 'litdata'")
    monkeypatch.setattr(peers.StreamingPeer, "unavailable", lambda self: "ModuleNotFoundError: No module named 'x'")
    monkeypatch.setattr(peers.WebDatasetPeer, "unavailable", lambda self: "ModuleNotFoundError: No module named 'y'")
    result = bench.run(built / "cache", BenchSpec(batch_size=8, workers=0, repeats=1, batches=1, crop=48),
                       source=built / "src", against=["all"], work_dir=tmp_path / "work", progress=False)
    assert {n: s.status for n, s in result.systems.items()} == {
        "datapipe": "ok", "dataloader": "ok", "webdataset": "skipped", "litdata": "skipped", "streaming": "skipped"}


def test_source_errors_are_datapipe_errors():
    assert issubclass(SourceError, DatapipeError)


def test_a_work_folder_datapipe_did_not_write_is_refused_before_anything_runs(built, tmp_path):
    """The rule of ownership: a peer's folder without datapipe's marker is the user's, never deleted."""
    mine = tmp_path / "work" / "webdataset"
    mine.mkdir(parents=True)
    (mine / "IMPORTANT.txt").write_text("my notes, not datapipe's")
    proc = cli(str(built / "cache"), "--source", str(built / "src"), "--against", "webdataset",
               "--work-dir", str(tmp_path / "work"), *FAST)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert str(mine) in line and "not datapipe's" in line
    assert (mine / "IMPORTANT.txt").read_text() == "my notes, not datapipe's"
    assert sorted(p.name for p in mine.iterdir()) == ["IMPORTANT.txt"]


@pytest.mark.parametrize("inside", ["cache", "src"])
def test_a_work_dir_inside_the_cache_or_the_source_is_refused(built, inside):
    before = sorted(p.name for p in (built / inside).iterdir())
    proc = cli(str(built / "cache"), "--source", str(built / "src"), "--against", "dataloader,webdataset",
               "--work-dir", str(built / inside / "work"), *FAST)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "--work-dir" in line and f"inside the {'cache' if inside == 'cache' else 'source'} folder" in line
    assert sorted(p.name for p in (built / inside).iterdir()) == before


def test_sigterm_to_the_process_group_is_one_line_and_143(built, tmp_path):
    """systemd, scancel and `kill -TERM -PGID` signal every process of the group: the DataLoader
    workers die with the command, which must still say one line and exit 143 (not torch's report
    of a killed worker)."""
    import signal
    import time

    args = [sys.executable, "-m", "datapipe.cli", "bench", str(built / "cache"), "--source", str(built / "src"),
            "--against", "dataloader", "--work-dir", str(tmp_path / "work"), "--batch-size", "4", "--workers", "2",
            "--repeats", "200", "--crop", "48", "--quiet"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until the peer's workers run
            line = proc.stderr.readline()
            lines.append(line)
            if "preparing dataloader" in line or not line:
                break
        time.sleep(3)  # into the measured rounds
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    after = [line for line in err.strip().splitlines() if line.strip()]
    assert proc.returncode == 143, "".join(lines) + err
    assert after == ["datapipe bench: terminated"], err


@pytest.mark.parametrize(("name", "expected"), [("Terminated", "Terminated"), ("Interrupt", "KeyboardInterrupt")])
def test_torchs_report_of_a_worker_the_same_signal_killed_is_the_commands_stop(name, expected):
    """Python runs signal handlers between bytecodes, so torch's SIGCHLD handler could run inside the command's own
    SIGTERM handler, before that had replaced it, and its RuntimeError ended the command with a traceback and exit 1
    (seen beside a busy core). Raised inside the block, it is the same stop as the signal itself."""
    import signal

    from datapipe import cli

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)}
    try:
        with pytest.raises(BaseException) as info, cli._loaders_stop_quietly():
            raise RuntimeError(f"DataLoader worker (pid 4242) is killed by signal: {name}. ")
        assert type(info.value).__name__ == expected
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # a second signal cannot cut the shutdown short
        with pytest.raises(RuntimeError, match="exited unexpectedly"), cli._loaders_stop_quietly():
            raise RuntimeError("DataLoader worker (pid 4242) exited unexpectedly")  # not a signal: torch's report stands
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
