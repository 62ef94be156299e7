"""Files and folders that are there but may not be read: real permissions, as an ordinary user has them.

Every command says so in one line naming the path, and never takes such a file for a missing, damaged or
foreign one (which would advise rebuilding, or moving away, a file that only needs its permissions fixed).
As root, the commands run without the capabilities that let root read anything (``setpriv``), so that the
modes apply; the tests are skipped only where neither an ordinary user nor setpriv is at hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import datapipe

SIZE = "16"
SAME = ("--size", SIZE, "--shard-size", "4", "--scheduler", "sync", "--quiet")  # the configuration of `built`
NO_OVERRIDE = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner",
               "--inh-caps", "-dac_override,-dac_read_search,-fowner"]


def _unprivileged() -> list[str]:
    """The prefix that runs a command under file permissions: none for an ordinary user; setpriv for root."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: file modes do not apply to this user")
    probe = subprocess.run([*NO_OVERRIDE, "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv cannot drop the capabilities here: {probe.stderr.decode(errors='replace').strip()}")
    return NO_OVERRIDE


def datapipe_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_unprivileged(), sys.executable, "-m", "datapipe.cli", *args], capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a failed command."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    from conftest import write_source

    root = tmp_path_factory.mktemp("perm")
    src = root / "src"
    write_source(src, {"a": 3, "b": 3}, variety=False)
    cache = root / "cache"
    datapipe.build(src, cache, size=int(SIZE), shard_size=4, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    return src, cache


@pytest.fixture
def cache(built, tmp_path) -> Path:
    """A copy of the built cache, free to damage."""
    copy = tmp_path / "cache"
    shutil.copytree(built[1], copy)
    yield copy
    for folder, dirs, _ in os.walk(copy):  # give back every mode, so that the folder can be removed
        os.chmod(folder, 0o755)
        for d in dirs:
            os.chmod(os.path.join(folder, d), 0o755)


FORBIDDEN = ("missing", "truncated", "was not written by", "in the way", "no build.json", "move it away",
             "not a datapipe cache")


def _is_permission_line(line: str, path: Path) -> None:
    assert f"{path} cannot be read (Permission denied)" in line, line
    assert "permissions" in line, line
    assert not any(word in line for word in FORBIDDEN), line


@pytest.mark.parametrize("command", ["info", "verify"])
def test_a_cache_folder_that_cannot_be_read(cache, command):
    os.chmod(cache, 0)
    _is_permission_line(one_line(datapipe_cli(command, str(cache))), cache)


def test_a_build_into_an_output_folder_that_cannot_be_read(built, cache):
    os.chmod(cache, 0)
    _is_permission_line(one_line(datapipe_cli("build", str(built[0]), str(cache), *SAME)), cache)


def test_a_build_under_a_folder_that_cannot_be_entered(built, tmp_path):
    parent = tmp_path / "parent"
    parent.mkdir()
    os.chmod(parent, 0)
    try:
        line = one_line(datapipe_cli("build", str(built[0]), str(parent / "out"), *SAME))
    finally:
        os.chmod(parent, 0o755)
    _is_permission_line(line, parent / "out")


def test_classes_from_a_cache_that_cannot_be_read(built, cache, tmp_path):
    os.chmod(cache, 0)
    line = one_line(datapipe_cli("build", str(built[0]), str(tmp_path / "out"), *SAME, "--classes-from", str(cache)))
    _is_permission_line(line, cache)


@pytest.mark.parametrize("command", ["build", "verify"])
def test_a_shards_folder_that_cannot_be_read(built, cache, command):
    os.chmod(cache / "shards", 0)
    args = ("build", str(built[0]), str(cache), *SAME) \
        if command == "build" else ("verify", str(cache))
    line = one_line(datapipe_cli(*args))
    assert "cannot be read (Permission denied)" in line and str(cache / "shards") in line, line
    assert not any(word in line for word in FORBIDDEN), line


@pytest.mark.parametrize("name", ["manifest.json", "build.json", "report.json", "shards/000000.zarr/zarr.json"])
def test_a_file_of_the_cache_that_cannot_be_read_is_not_taken_for_a_foreign_one(built, cache, name):
    """The build used to call such a file "not written by this build" and advise moving it away."""
    os.chmod(cache / name, 0)
    line = one_line(datapipe_cli("build", str(built[0]), str(cache), *SAME, "--force"))
    _is_permission_line(line, cache / name)
    os.chmod(cache / name, 0o644)
    assert datapipe_cli("verify", str(cache)).returncode == 0  # nothing was touched


def test_a_source_folder_that_can_be_listed_but_not_entered(built, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(built[0], src)
    sub = src / "a" / "sub"
    (sub / "deeper").mkdir(parents=True)
    shutil.copy(next((src / "a").glob("*.jpg")), sub / "x.jpg")
    shutil.copy(next((src / "a").glob("*.jpg")), sub / "deeper" / "y.jpg")
    os.chmod(sub, 0o644)  # read, no execute: its names can be listed, nothing in it looked up
    try:
        line = one_line(datapipe_cli("build", str(src), str(tmp_path / "out"), *SAME, "--max-bad-fraction", "1"))
    finally:
        os.chmod(sub, 0o755)
    assert f"folder {sub} of the source cannot be read (Permission denied)" in line, line


INSIDE = ["labels.npy", "paths.json", "shards/000000.zarr/images/c/0/0/0/0", "shards/000000.zarr/labels/c/0"]


@pytest.mark.parametrize("name", INSIDE)
def test_verify_says_which_file_cannot_be_read_and_not_to_rebuild(cache, name):
    os.chmod(cache / name, 0)
    proc = datapipe_cli("verify", str(cache))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    problem = next(line for line in lines if str(cache / name) in line)
    assert "cannot be read (Permission denied)" in problem and "permissions" in problem, problem
    assert not any(word in problem for word in ("rewrite", "rerun the same", "damaged")), problem
    assert lines[-1].endswith("fix the permissions of the files named"), lines[-1]


_READ = """
import sys
import datapipe
from datapipe.errors import UnreadableFileError
try:
    for _ in datapipe.StreamingDataset(sys.argv[1], batch_size=4, shuffle=False):
        pass
    datapipe.open(sys.argv[1]).path(0)
except UnreadableFileError as exc:
    print("UnreadableFileError:", exc)
"""


@pytest.mark.parametrize("name", INSIDE[:3])
def test_the_loader_says_which_file_cannot_be_read(cache, name):
    os.chmod(cache / name, 0)
    proc = subprocess.run([*_unprivileged(), sys.executable, "-c", _READ, str(cache)], capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert proc.stdout.startswith("UnreadableFileError: "), proc.stdout + proc.stderr
    assert str(cache / name) in proc.stdout and "cannot be read (Permission denied)" in proc.stdout, proc.stdout
    assert "rewrite" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("damage", ["shards folder listed, not entered", "a shard's zarr.json"])
def test_a_forced_rebuild_that_cannot_read_a_shard_removes_nothing(built, cache, damage):
    """--force with another configuration removed the manifest, labels, paths and report first, then met the shard
    it could not read: the working cache was gone before the build found it could not go on, and the line named
    the output folder, not the file."""
    path = cache / "shards" if damage.startswith("shards") else cache / "shards" / "000000.zarr" / "zarr.json"
    before = sorted(p.name for p in cache.iterdir())
    os.chmod(path, 0o644 if damage.startswith("shards") else 0)
    line = one_line(datapipe_cli("build", str(built[0]), str(cache), "--size", "24", "--scheduler", "sync", "--force",
                                 "--quiet"))
    unreadable = cache / "shards" if damage.startswith("shards") else path
    assert str(unreadable) in line and "(Permission denied)" in line and "permissions" in line, line
    os.chmod(path, 0o755 if damage.startswith("shards") else 0o644)
    assert sorted(p.name for p in cache.iterdir()) == before
    assert datapipe_cli("verify", str(cache)).returncode == 0  # the cache as it was
