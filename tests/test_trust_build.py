"""What a user may trust of `datapipe build` and `datapipe sample`, checked against real things.

Real FIFOs, real symlink loops, real non-UTF-8 file names, two real build processes into one output,
a real SIGKILL of a build holding the lock, real signals mid-build, a port nobody listens on, and a
user's own folder that must survive ``--force`` byte for byte. Builds use ``scheduler="sync"`` except
where the claim is about Dask.

To stop a build at a known point, a few tests run the real CLI with one test hook: reading one named
source file first waits on a FIFO the test holds (``GATED``). Everything else is the shipped code.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from build_fixtures import build_log
from conftest import needs_mounts

import datapipe
import datapipe.builder as builder
import datapipe.writer as writer
from datapipe.bounded import read_file
from datapipe.cli import main as cli_main
from datapipe.errors import (
    BuildError,
    CacheError,
    ConfigMismatchError,
    CorruptShardError,
    DecodeError,
    OutputBusyError,
    OutputError,
    OutputWriteError,
    SourceError,
    TooManyBadFilesError,
)
from datapipe.files import crc32c
from datapipe.shards import images_path

SIZE = 32

GATED = """
import os, sys
import datapipe.builder as builder
real = builder.read_file
def gated(path, limit, *scanned):
    if path.endswith(os.environ["GATE_FILE"]):
        with open(os.environ["GATE"], "rb") as gate:
            gate.read()
    return real(path, limit, *scanned)
builder.read_file = gated
from datapipe.cli import main
sys.exit(main(sys.argv[1:]))
"""


def build(source, output, **kwargs) -> datapipe.BuildReport:
    kwargs = {"size": SIZE, "shard_size": 4, "cluster": datapipe.Cluster(scheduler="sync"), "progress": False, **kwargs}
    return datapipe.build(source, output, **kwargs)


def cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datapipe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


def one_line(stderr: str, command: str = "build") -> str:
    """The single line a failed command prints (after any progress output)."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert lines and lines[-1].startswith(f"datapipe {command}: error: "), stderr
    assert not any("error" in line.lower() for line in lines[:-1]), stderr
    return lines[-1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def blocked_on_fifo(pid: int) -> bool:
    try:
        return any((t / "wchan").read_text() == "wait_for_partner" for t in Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False


def gated_build(src: Path, out: Path, gate: Path, gate_file: str, *extra: str) -> subprocess.Popen:
    if not gate.exists():
        os.mkfifo(gate)
    env = {**os.environ, "GATE": str(gate), "GATE_FILE": gate_file}
    return subprocess.Popen([sys.executable, "-c", GATED, "build", str(src), str(out), "--size", str(SIZE),
                             "--shard-size", "4", "--scheduler", "sync", "--quiet", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


@pytest.fixture
def small(tmp_path, imaging) -> Path:
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 5, "b": 5}, variety=False)
    return src


# ----------------------------------------------------------------------------- silent wrong labels


@pytest.mark.parametrize("text,encoding", [
    ("path,label\n{a},cat\n{b},dog\n", "utf-8-sig"),                 # Excel's "CSV UTF-8"
    ("\ufeffFilename,Class\r\n{a},cat\r\n{b},dog\r\n", "utf-8"),      # BOM as text, CRLF, other names
    ('"path","label"\n"{a}","cat"\n"{b}","dog"\n', "utf-8-sig"),     # quoted header and cells
    ("  Image , Label \n {a} , cat \n{b},dog\n", "utf-8"),            # whitespace
    ("# listing\n\nfile,label\n{a},cat\n{b},dog\n", "utf-8-sig"),    # comment and blank line first
    ("{a},cat\n{b},dog\n", "utf-8-sig"),                             # no header, BOM
], ids=["bom", "crlf-filename-class", "quoted", "spaces", "comment-first", "no-header"])
def test_csv_header_and_bom_never_become_a_class(tmp_path, imaging, text, encoding):
    files = sorted(imaging.write_source(tmp_path / "pics", {"x": 2}, variety=False))
    rows = text.format(a=f"pics/{files[0]}", b=f"pics/{files[1]}")
    (tmp_path / "list.csv").write_bytes(rows.encode(encoding))
    report = build(tmp_path / "list.csv", tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["cat", "dog"] and report.num_samples == 2 and report.quarantined == []
    assert [cache.classes[cache[i][1]] for i in range(2)] == ["cat", "dog"]


def test_a_header_like_first_row_naming_a_real_file_is_data(tmp_path, imaging):
    arr = imaging.gradient(40, 52)
    (tmp_path / "image").write_bytes(imaging.jpeg(arr))  # a file really named "image"
    (tmp_path / "b.jpg").write_bytes(imaging.jpeg(arr))
    (tmp_path / "list.csv").write_text("image,cat\nb.jpg,dog\n")
    build(tmp_path / "list.csv", tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert [cache.path(i) for i in range(len(cache))] == ["b.jpg", "image"]


@pytest.mark.parametrize("header", ["img,label", "path,class", "Image,Label"])
def test_a_header_naming_a_folder_beside_the_csv_is_a_header(tmp_path, imaging, header):
    """The images in a folder named like the header's first cell (`img/`, `path/`): the header was read as data,
    its label became a class ('label' between 'dog' and 'zebra', renumbering zebra) and its row a quarantined
    'directory' within the budget. A folder is never a sample, so the row is the header."""
    folder = header.split(",")[0]
    files = sorted(imaging.write_source(tmp_path / folder, {"x": 3}, variety=False))
    rows = [f"{folder}/{name},{label}" for name, label in zip(files, ["cat", "dog", "zebra"], strict=True)]
    (tmp_path / "list.csv").write_text("\n".join([header, *rows]) + "\n")
    report = build(tmp_path / "list.csv", tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["cat", "dog", "zebra"] and report.quarantined == [] and report.num_samples == 3
    assert [cache.classes[cache[i][1]] for i in range(3)] == ["cat", "dog", "zebra"]


def test_a_path_listed_twice_with_two_labels_names_both(tmp_path, imaging):
    files = sorted(imaging.write_source(tmp_path / "pics", {"x": 2}, variety=False))
    (tmp_path / "list.csv").write_text(f"pics/{files[0]},cat\npics/{files[1]},cat\npics/{files[0]},dog\n"
                                       f"pics/{files[1]},cat\n")
    report = build(tmp_path / "list.csv", tmp_path / "out", max_bad_fraction=1.0)
    reasons = {(q["path"], q["reason"]) for q in report.quarantined}
    assert reasons == {(f"pics/{files[0]}", "duplicate path in list source with another label ('dog'; the first "
                                            "row's 'cat' is kept)"),
                       (f"pics/{files[1]}", "duplicate path in list source (kept the first row)")}
    assert datapipe.open(tmp_path / "out").classes == ["cat", "dog"]


def test_rows_repeated_exactly_lose_no_file_and_are_not_counted_against_the_budget(tmp_path, imaging):
    """A CSV with two rows repeated (same path, same label) failed: "2 of 8 files (25.0%) could not be used",
    though every file was used. A repeat with another label loses that label: it counts."""
    files = sorted(imaging.write_source(tmp_path / "pics", {"x": 6}, variety=False))
    rows = [f"pics/{name},{'cat' if i % 2 else 'dog'}" for i, name in enumerate(files)]
    (tmp_path / "list.csv").write_text("\n".join([*rows, rows[0], rows[1]]) + "\n")
    report = build(tmp_path / "list.csv", tmp_path / "out", max_bad_fraction=0.1)
    assert report.num_samples == 6 and len(report.quarantined) == 2 and report.status == "ok"
    other = rows[2].replace(",dog", ",cat") if rows[2].endswith("dog") else rows[2].replace(",cat", ",dog")
    (tmp_path / "list.csv").write_text("\n".join([*rows, rows[0], other]) + "\n")
    with pytest.raises(datapipe.errors.TooManyBadFilesError, match=r"^1 of 7 files \(14\.3%\) could not be used"):
        build(tmp_path / "list.csv", tmp_path / "out2", max_bad_fraction=0.1)


@pytest.mark.parametrize("codec,name", [("utf-16", "UTF-16"), ("utf-16-be", None), ("utf-32", "UTF-32")])
def test_csv_in_another_encoding_is_refused_by_name(tmp_path, codec, name):
    data = "path,label\na.jpg,cat\n".encode(codec)
    if name is None:  # a UTF-16 file with its byte-order mark written big-endian
        data, name = b"\xfe\xff" + data, "UTF-16"
    (tmp_path / "list.csv").write_bytes(data)
    with pytest.raises(SourceError, match=name):
        build(tmp_path / "list.csv", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("row", ["/etc/hostname,cat", "../outside.jpg,cat", "a/../../outside.jpg,cat", "~/x.jpg,cat"])
def test_csv_rows_outside_the_csv_folder_are_refused(tmp_path, imaging, row):
    (tmp_path / "outside.jpg").write_bytes(imaging.jpeg(imaging.gradient(40, 52)))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "list.csv").write_text(f"path,label\n{row}\n")
    with pytest.raises(SourceError, match=r"list.csv:2: .*(outside|absolute)"):
        build(tmp_path / "data" / "list.csv", tmp_path / "out")


@pytest.mark.parametrize("name", ["manifest.json", "build.json"])
def test_a_class_folder_holding_a_json_file_of_that_name_stays_a_class(small, tmp_path, name):
    (small / "a" / name).write_text('{"format": "mine"}')
    report = build(small, tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["a", "b"] and report.num_samples == 10
    assert sum(1 for i in range(10) if cache[i][1] == 1) == 5  # b keeps its index


def test_symlink_loops_end_and_each_real_file_enters_once(tmp_path, imaging):
    src = tmp_path / "src"
    files = imaging.write_source(src, {"a": 2, "b": 2, "c": 1}, variety=False)
    os.symlink(".", src / "a" / "self")
    os.symlink("..", src / "a" / "parent")
    os.symlink(str(tmp_path), src / "b" / "ancestor")  # outside the source, but leads back into it
    os.symlink("../c", src / "b" / "to-c")  # into a sibling class
    os.symlink("../b", src / "c" / "to-b")  # ... and back: two links into each other
    (src / "c" / "sub").mkdir()
    os.symlink("../../c", src / "c" / "sub" / "up-two")
    proc = subprocess.run([sys.executable, "-c", "import sys, datapipe.sources as s; l = s.scan(sys.argv[1]); "
                           "print(len(l.paths), len(l.ignored))", str(src)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr  # the scan ends
    report = build(src, tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert sorted(cache.path(i) for i in range(len(cache))) == sorted(files)  # each file once, by its real path
    assert report.num_samples == 5 and report.ignored == 6  # every link not followed is counted


def test_a_link_outside_the_source_is_followed_once(tmp_path, imaging):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 1, "b": 1}, variety=False)
    extra = tmp_path / "elsewhere"
    imaging.write_source(extra, {"more": 2}, variety=False)
    os.symlink(str(extra / "more"), src / "a" / "more")
    os.symlink(str(extra / "more"), src / "b" / "same-again")
    report = build(src, tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    paths = [cache.path(i) for i in range(len(cache))]
    assert report.num_samples == 4 and sum(p.startswith("a/more/") for p in paths) == 2
    assert report.ignored == 1


def test_fifo_socket_and_unreadable_names_are_quarantined_not_waited_on(tmp_path, imaging):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 4, "b": 4}, variety=False)
    os.mkfifo(src / "a" / "pipe.jpg")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "b" / "sock.png"))
    fd = os.open(os.fsencode(src / "b") + b"/caf\xe9-\xff.jpg", os.O_CREAT | os.O_WRONLY)
    os.write(fd, imaging.jpeg(imaging.gradient(40, 52)))
    os.close(fd)
    (src / "b" / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    proc = cli("build", str(src), str(out), "--size", str(SIZE), "--scheduler", "sync", "--quiet",
               "--max-bad-fraction", "0.5", timeout=90)
    sock.close()
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    reasons = {q["path"]: (q["error"], q["reason"]) for q in report["quarantined"]}
    assert reasons["a/pipe.jpg"] == ("unreadable", "not a regular file: a named pipe (FIFO)")
    assert reasons["b/sock.png"] == ("unreadable", "not a regular file: a socket")
    assert reasons["b/caf\\xe9-\\xff.jpg"][0] == "unreadable" and "UTF-8" in reasons["b/caf\\xe9-\\xff.jpg"][1]
    # nothing lost: every image file is a sample or quarantined, the rest counted as ignored
    assert report["scanned"] == report["num_samples"] + len(report["quarantined"]) == 11
    assert report["num_samples"] == 8 and report["ignored"] == 1


def test_a_file_swapped_for_a_fifo_after_the_scan_is_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "late.jpg")
    with pytest.raises(DecodeError, match="named pipe") as info:
        read_file(str(tmp_path / "late.jpg"), 1 << 20)
    assert info.value.kind == "unreadable"
    (tmp_path / "big.jpg").write_bytes(b"\xff" * 5000)
    with pytest.raises(DecodeError, match="5,000 bytes") as info:
        read_file(str(tmp_path / "big.jpg"), 4096)
    assert info.value.kind == "too-large"
    assert read_file(str(tmp_path / "big.jpg"), 5000) == b"\xff" * 5000


def test_a_file_that_takes_too_long_ends_a_serial_build_with_one_line(tmp_path, imaging, monkeypatch):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 4}, variety=False)  # shard 0, finished before the slow file
    (src / "b").mkdir()
    (src / "b" / "slow.png").write_bytes(imaging.encode(imaging.gradient(40, 52), "PNG"))
    out = tmp_path / "out"
    # Reading b/slow.png waits on a FIFO nobody ever writes: it never finishes, however fast the machine.
    monkeypatch.setenv("DATAPIPE_FILE_TIMEOUT", "1")  # the good files too: room for a loaded machine
    proc = gated_build(src, out, tmp_path / "gate", "b/slow.png")
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(15)
    assert proc.returncode == 2
    line = one_line(stderr)
    assert "b/slow.png" in line and "did not finish within 1 s" in line and "DATAPIPE_FILE_TIMEOUT" in line
    assert not (out / "manifest.json").exists()  # the build ended there
    assert (out / "shards" / "000000.zarr").is_dir()  # and kept the shard it had finished
    # Once the file reads again, the rerun resumes and finishes.
    rerun = cli("build", str(src), str(out), "--size", str(SIZE), "--shard-size", "4", "--scheduler", "sync", "--quiet")
    assert rerun.returncode == 0, rerun.stderr
    assert len(datapipe.open(out)) == 5


# ----------------------------------------------------------------------------- user files never deleted


def test_a_users_folder_with_datapipe_names_survives_force(small, tmp_path, imaging):
    mine = tmp_path / "mine"
    (mine / "shards" / "000000.zarr").mkdir(parents=True)
    (mine / "shards" / "000000.zarr" / "zarr.json").write_text('{"my": "data"}')
    for name, text in {"build.json": '{"project": "mine", "steps": [1, 2]}', "manifest.json": "[1, 2, 3]",
                       "report.json": "my report", "paths.json": "[]", "labels.npy": "x"}.items():
        (mine / name).write_text(text)
    before = imaging.tree_bytes(mine, skip=())
    for force in (False, True):
        with pytest.raises(OutputError, match="not a datapipe cache"):
            build(small, mine, force=force)
    assert imaging.tree_bytes(mine, skip=()) == before
    assert not (mine / ".datapipe.lock").exists()


def test_force_removes_only_the_files_of_the_earlier_build(small, tmp_path):
    out = tmp_path / "out"
    first = build(small, out)
    (out / "shards" / "notes.txt").write_text("mine")
    (out / "shards" / "999999.zarr").mkdir()  # a shard-like folder without this build's id
    (out / "shards" / "999999.zarr" / "zarr.json").write_text('{"attributes": {"datapipe": {"build_id": "0"}}}')
    (out / "mine.txt").write_text("keep")
    with pytest.raises(ConfigMismatchError, match="size: 32 -> 40"):
        build(small, out, size=40)
    second = build(small, out, size=40, force=True)
    assert second.build_id != first.build_id and len(datapipe.open(out)) == 10
    assert (out / "shards" / "notes.txt").read_text() == "mine" and (out / "mine.txt").read_text() == "keep"
    assert (out / "shards" / "999999.zarr" / "zarr.json").exists()
    for shard in (out / "shards").glob("00000*.zarr"):
        assert json.loads((shard / "zarr.json").read_text())["attributes"]["datapipe"]["build_id"] == second.build_id


# Where in a shard folder a user's own file may lie: beside the shard's files, inside its layout's folders,
# in a folder of its own, or a link.
USER_FILES = {
    "beside": lambda shard: (shard / "NOTES.txt").write_text("mine"),
    "inside": lambda shard: (shard / "labels" / "c" / "notes.txt").write_text("mine"),
    "folder": lambda shard: ((shard / "mine").mkdir(), (shard / "mine" / "a.txt").write_text("mine")),
    "link": lambda shard: (shard / "link").symlink_to(shard.parent.parent / "labels.npy"),
}


@pytest.mark.parametrize("where", sorted(USER_FILES))
@pytest.mark.parametrize("how", ["force", "changed input", "fewer shards"])
def test_a_users_file_inside_a_shard_folder_survives_every_rebuild(small, tmp_path, imaging, where, how):
    """A shard folder rewritten (--force, an input changed) or removed (the source shrank) with a file in it
    that no build wrote: the build deletes only its own files; a rewrite stops at once naming the file (the
    shards finished are kept) and, once the file is moved out, the rerun finishes."""
    out = tmp_path / "out"
    build(small, out)
    shard = out / "shards" / "000001.zarr"
    USER_FILES[where](shard)
    before = {p: (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink() else None)
              for p in shard.rglob("*") if "mine" in p.parts or p.name in ("NOTES.txt", "notes.txt", "link")}
    options = {}
    if how == "force":
        options = {"size": SIZE + 8, "force": True}
    elif how == "changed input":
        victim = sorted(small.rglob("*.*"))[5]  # the shard's second sample
        os.utime(victim, (1_000_000_000, 1_000_000_000))
    else:
        for victim in sorted(small.rglob("*.*"))[3:]:
            victim.unlink()
    if how == "fewer shards":  # shard 1 is no longer planned: its own files go, the user's stay
        report = build(small, out, **options)
        assert report.shards_total == 1 and datapipe.open(out).verify() == []
    else:
        with pytest.raises(datapipe.errors.BuildError, match=r"is in shard folder .*000001\.zarr, which this build "
                           r"(writes|replaces), and no datapipe build wrote it; .* move it out and rerun") as excinfo:
            build(small, out, **options)
        assert str(excinfo.value).startswith(str(shard / next(iter(before)).relative_to(shard).parts[0]))
    after = {p: (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink() else None)
             for p in before}
    assert after == before
    if how != "fewer shards":
        holding = tmp_path / "moved"
        holding.mkdir()
        for path in sorted(before, key=lambda p: len(p.parts)):
            if path.exists() or path.is_symlink():
                path.rename(holding / path.name)
        build(small, out, **options)
        assert datapipe.open(out).verify() == [] and len(datapipe.open(out)) == 10


@pytest.mark.parametrize("what", ["linked shard", "shard of no record", "another build's shard", "a file"])
def test_force_refuses_a_shard_it_could_not_replace_before_it_removes_anything(small, tmp_path, imaging, what):
    """--force removed the manifest, the index files and every shard of its own, then refused the one in its way (a
    linked shard, a folder whose zarr.json a removal cut short had taken): the cache was gone, nothing built."""
    out = tmp_path / "out"
    build(small, out)
    shard = out / "shards" / "000000.zarr"
    if what == "linked shard":  # deduplicated against a copy of the cache
        copy = tmp_path / "copy"
        shutil.copytree(shard, copy)
        shutil.rmtree(shard)
        shard.symlink_to(copy)
    elif what == "shard of no record":
        (shard / "zarr.json").unlink()
    elif what == "another build's shard":
        other = tmp_path / "other"
        build(small, other)
        shutil.rmtree(shard)
        shutil.copytree(other / "shards" / "000000.zarr", shard)
    else:
        shutil.rmtree(shard)
        shard.write_text("mine")
    before = imaging.tree_bytes(out, skip=())
    with pytest.raises(datapipe.errors.OutputError, match=r"000000\.zarr in .*shards is no shard of the build this one "
                                                        r"replaces .* move it away and rerun. Nothing was removed"):
        build(small, out, size=SIZE + 8, force=True)
    assert imaging.tree_bytes(out, skip=()) == before
    moved = tmp_path / "moved"
    shard.rename(moved)  # as told
    assert build(small, out, size=SIZE + 8, force=True).shards_built == 3 and datapipe.open(out).verify() == []


@needs_mounts
@pytest.mark.parametrize("mounted", ["images folder", "shard folder"])
def test_force_never_deletes_through_a_folder_bind_mounted_into_a_shard(small, tmp_path, imaging, mounted):
    """A shard's images/ (or the shard folder itself) moved to another disk and bind-mounted back: --force walked
    into the mount point (a plain folder to a symlink check) and deleted the files on the other disk, then failed
    on the emptied folder ("Device or resource busy")."""
    out = tmp_path / "out"
    build(small, out)
    shard = out / "shards" / "000001.zarr"
    target = shard / "images" if mounted == "images folder" else shard
    elsewhere = tmp_path / "elsewhere"
    target.rename(elsewhere)
    target.mkdir()
    outside = imaging.tree_bytes(elsewhere, skip=())
    code = (f"import datapipe; datapipe.build({str(small)!r}, {str(out)!r}, size={SIZE + 8}, force=True, progress=False, "
            "cluster=datapipe.Cluster(scheduler='sync'))")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount --bind "$1" "$2" && exec "$3" -c "$4"', "sh",
                           str(elsewhere), str(target), sys.executable, code], capture_output=True, text=True,
                          timeout=300)
    if mounted == "images folder":  # the shard is the earlier build's: refused before anything goes
        assert done.returncode == 1 and "000001.zarr/images is in shard folder" in done.stderr, done.stderr[-2000:]
        assert "nothing was removed" in done.stderr
    else:  # a mount point is no shard of the earlier build: left as it is (the new build's one shard is 000000)
        assert done.returncode == 0, done.stderr[-2000:]
    assert imaging.tree_bytes(elsewhere, skip=()) == outside
    assert (out / "manifest.json").exists()


@pytest.mark.parametrize("how", ["force", "changed input", "fewer shards"])
def test_files_behind_a_linked_folder_of_a_shard_survive_every_rebuild(small, tmp_path, imaging, how):
    """A shard's images/ and labels/ moved elsewhere and linked back in (the cache still verifies): --force deleted
    every file behind the links, outside the output, and then refused the links as no build's."""
    out = tmp_path / "out"
    build(small, out)
    shard = out / "shards" / "000001.zarr"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("images", "labels"):
        (shard / name).rename(elsewhere / name)
        (shard / name).symlink_to(elsewhere / name)
    assert datapipe.open(out).verify() == []
    outside = imaging.tree_bytes(elsewhere, skip=())
    manifest = (out / "manifest.json").read_bytes()
    if how == "changed input":
        os.utime(sorted(small.rglob("*.*"))[5], (1_000_000_000, 1_000_000_000))
    elif how == "fewer shards":
        for victim in sorted(small.rglob("*.*"))[3:]:
            victim.unlink()
    options = {"size": SIZE + 8, "force": True} if how == "force" else {}
    if how == "fewer shards":
        build(small, out)
        assert (shard / "images").is_symlink() and (shard / "labels").is_symlink()
    else:
        with pytest.raises(datapipe.errors.BuildError, match=r"000001\.zarr/(images|labels) \(and 1 more\) is in shard "
                                                             r"folder .*000001\.zarr, which this build (writes|replaces)"):
            build(small, out, **options)
    assert imaging.tree_bytes(elsewhere, skip=()) == outside
    if how == "force":  # refused before anything went: the cache is whole
        assert (out / "manifest.json").read_bytes() == manifest and datapipe.open(out).verify() == []


def test_another_source_into_a_cache_is_refused_naming_both(small, tmp_path, imaging):
    other = tmp_path / "other"
    imaging.write_source(other, {"a": 5, "b": 5}, variety=False, seed=9)
    out = tmp_path / "out"
    build(small, out)
    manifest = (out / "manifest.json").read_bytes()
    with pytest.raises(ConfigMismatchError, match=rf"another source.*{small}.*{other}.*--force"):
        build(other, out)
    assert (out / "manifest.json").read_bytes() == manifest
    assert build(other, out, force=True).shards_built == 3
    assert datapipe.open(out).manifest.source.root == str(other)


@pytest.mark.parametrize("doc", ["[]", "null", '{"format": "datapipe-cache", "version": 1, "config": []}',
                                 '{"format": "datapipe-cache", "version": 1, "config": {"size": "32"}, "config_hash": 5}',
                                 '{"format": "datapipe-cache", "version": "1"}'])
def test_malformed_build_json_is_one_line(small, tmp_path, capsys, doc):
    out = tmp_path / "out"
    build(small, out)
    (out / "build.json").write_text(doc)
    code = cli_main(["build", str(small), str(out), "--size", str(SIZE), "--shard-size", "4", "--scheduler", "sync",
                     "--quiet"])
    assert code == 2
    line = one_line(capsys.readouterr().err)
    assert "build.json" in line or "not a datapipe cache" in line


def test_sample_refuses_a_folder_it_did_not_write(tmp_path, imaging):
    mine = tmp_path / "mine"
    imaging.write_source(mine, {"class_000": 1}, variety=False)
    before = imaging.tree_bytes(mine, skip=())
    proc = cli("sample", str(mine), "--images", "3", "--classes", "2")
    assert proc.returncode == 2 and "not empty" in one_line(proc.stderr, "sample")
    assert imaging.tree_bytes(mine, skip=()) == before
    fresh = tmp_path / "fresh"
    assert cli("sample", str(fresh), "--images", "3", "--classes", "2").returncode == 0
    written = imaging.tree_bytes(fresh, skip=())
    again = cli("sample", str(fresh), "--images", "3", "--classes", "2")  # the same sample: a no-op
    assert again.returncode == 0 and "nothing to do" in again.stdout
    other = cli("sample", str(fresh), "--images", "4", "--classes", "2")
    assert other.returncode == 2 and "another sample" in one_line(other.stderr, "sample")
    assert imaging.tree_bytes(fresh, skip=()) == written


# ----------------------------------------------------------------------------- one writer, resume


def test_two_builds_into_one_output_then_sigkill_and_resume(small, tmp_path, imaging):
    """A second build fails at once naming the holder; the holder killed with SIGKILL leaves its lock
    file, whose lock the kernel released: a rerun takes it and ends as an uninterrupted build."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    first = gated_build(small, out, gate, "b/img001.jpg")  # shard 0 finished, shard 1 half-written
    try:
        wait_for(lambda: blocked_on_fifo(first.pid) or first.poll() is not None, 60, "the first build to hold the lock")
        assert first.poll() is None
        second = cli("build", str(small), str(out), "--size", str(SIZE), "--shard-size", "4", "--scheduler", "sync",
                     "--quiet")
        assert second.returncode == 2
        line = one_line(second.stderr)
        assert f"pid {first.pid} on host {socket.gethostname()}" in line and "another datapipe build" in line
        os.kill(first.pid, signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(30)
        first.stderr.close()
    assert (out / ".datapipe.lock").exists() and not (out / "manifest.json").exists()
    assert (out / "shards" / "000000.zarr").exists()
    report = build(small, out)
    assert report.shards_skipped == 1 and report.num_samples == 10
    ref = tmp_path / "ref"
    build(small, ref)
    assert imaging.tree_bytes(out) == imaging.tree_bytes(ref)
    assert not (out / ".datapipe.lock").exists()


def test_sigterm_mid_build_is_one_line_and_resumable(small, tmp_path):
    out, gate = tmp_path / "out", tmp_path / "gate"
    proc = gated_build(small, out, gate, "b/img001.jpg")
    try:
        wait_for(lambda: blocked_on_fifo(proc.pid) or proc.poll() is not None, 60, "the build to block")
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGTERM)  # interrupts the wait on the gate (PEP 475: the handler runs)
        assert proc.wait(30) == 143
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        proc.stderr.close()
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "datapipe build: terminated; finished shards are kept, rerun to resume"
    assert not (out / ".datapipe.lock").exists() and (out / "shards" / "000000.zarr").exists()
    report = build(small, out)
    assert report.shards_skipped == 1 and report.shards_built == 2 and report.num_samples == 10


def test_verify_of_a_cache_a_rebuild_in_place_is_rewriting_names_the_build_not_damage(small, tmp_path):
    """verify opened the cache, then `build --force` removed the old build's files under its lock: verify listed
    every file as missing ("rerun the same datapipe build to rewrite the shard", "N problems; --verify rewrites
    damaged shards"), exit 1. Now it names the build writing the cache, and says so once it has finished."""
    out, gate = tmp_path / "out", tmp_path / "gate"
    build(small, out)
    cache = datapipe.open(out)  # verify has opened the cache ...
    proc = gated_build(small, out, gate, "a/img002.jpg", "--size", str(SIZE + 8), "--force")
    try:
        wait_for(lambda: blocked_on_fifo(proc.pid) or proc.poll() is not None, 60, "the rebuild to block")
        assert proc.poll() is None and not (out / "manifest.json").exists()  # ... and the rebuild removed its files
        with pytest.raises(CacheError, match=rf"^{out}: a datapipe build is writing it now \(pid {proc.pid} on host "):
            cache.verify()
    finally:
        with open(gate, "wb"):
            pass
        assert proc.wait(60) == 0, proc.stderr.read()
        proc.stderr.close()
    with pytest.raises(CacheError, match=rf"^{out}: it was rebuilt while it was being verified, so what verify found "):
        cache.verify()
    assert datapipe.open(out).verify() == []


@pytest.mark.parametrize("added", ["a/img001b.jpg", "b/zzz.jpg"], ids=["inside-a-shard", "past-the-last-shard"])
def test_verify_of_a_cache_an_incremental_rebuild_changed_meanwhile_says_so(small, tmp_path, imaging, added,
                                                                             monkeypatch):
    """An incremental rebuild keeps the build id and configuration: verify, which compared only those, listed the
    rewritten shards as damaged ("--verify rewrites damaged shards"), or (a shard added after the last) said OK
    for a cache it had checked only a part of."""
    out = tmp_path / "out"
    if added.startswith("b/"):  # 12 files: 3 full shards, and the one added makes a fourth
        for name in ("b/zzx.jpg", "b/zzy.jpg"):
            (small / name).write_bytes(imaging.jpeg(imaging.gradient(40, 44, seed=8)))
    first = build(small, out)
    cache = datapipe.open(out)  # verify has opened the cache ...
    reports = []

    def rebuild() -> None:  # ... and a rerun finishes meanwhile: before verify, or once it checked the index files
        (small / added).write_bytes(imaging.jpeg(imaging.gradient(40, 44, seed=7)))
        reports.append(build(small, out))

    if added.startswith("a/"):
        rebuild()
    else:
        real = cache._verify_shard
        monkeypatch.setattr(cache, "_verify_shard", lambda *a: (reports or rebuild(), real(*a))[1])
    found = "what verify found missing or changed" if added.startswith("a/") else "verify checked the cache as it was"
    with pytest.raises(CacheError, match=rf"^{out}: it was rebuilt while it was being verified, so {found}"):
        cache.verify()
    assert reports[0].build_id == first.build_id
    assert reports[0].shards_built == (1 if added.startswith("b/") else 3)
    assert reports[0].shards_total == first.shards_total + added.startswith("b/")
    assert datapipe.open(out).verify() == []


def hold_build_lock(out: Path) -> int:
    """Hold ``out``'s build lock as a running build does (flock on a descriptor of our own, holder written);
    returns the descriptor: closing it releases the lock."""
    fd = os.open(out / ".datapipe.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now"}).encode())
    return fd


def test_a_build_meeting_another_that_has_not_written_its_marker_yet_says_it_is_busy(small, tmp_path):
    """Between its mkdir and the rename of its build.json a starting build's folder holds shards/ (and a
    temporary build.json) but no marker: a second build must name the first, not call the folder foreign."""
    out = tmp_path / "out"
    (out / "shards").mkdir(parents=True)
    (out / ".tmp-build.json.1a2b3c4d").write_text("{")
    fd = hold_build_lock(out)
    try:
        with pytest.raises(OutputBusyError, match=rf"another datapipe build \(pid {os.getpid()} on host"):
            build(small, out)
    finally:
        os.close(fd)
    assert sorted(os.listdir(out)) == [".datapipe.lock", ".tmp-build.json.1a2b3c4d", "shards"]


def files_of(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``folder``: (inode, mtime, bytes) by relative path."""
    return {path.relative_to(folder).as_posix(): (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes())
            for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("again", [{}, {"force": True}, {"verify": True}], ids=["plain", "force", "verify"])
def test_a_rerun_with_nothing_to_do_touches_no_file_and_open_readers_read_on(small, tmp_path, again):
    out = tmp_path / "out"
    build(small, out)
    before = files_of(out)
    cache = datapipe.open(out)  # a reader that has the cache open (DataLoader workers get pickled copies)
    report = build(small, out, **again)
    assert report.status == "ok" and report.shards_built == 0 and report.num_samples == 10
    assert files_of(out) == before  # the same files: same inodes, same bytes
    assert [cache.path(i) for i in range(10)] == sorted(cache.path(i) for i in range(10))
    assert len(pickle.loads(pickle.dumps(cache)).labels) == 10


@pytest.mark.parametrize("again", [{}, {"verify": True}], ids=["plain", "verify"])
@pytest.mark.parametrize("shard", ["2", "true", '"1"', "-1"])
def test_a_shard_record_naming_another_shard_is_rebuilt_not_filed_under_it(small, tmp_path, again, shard):
    """Shard 1's zarr.json edited to say shard 2 (nothing else): `build --verify`, the remedy verify advises, died
    with KeyError, and every later rerun blamed manifest.json (two shards named 000002.zarr). A record of another
    shard (or of none: true, "1") is not this shard's: it is built again, and the cache is the original one."""
    out = tmp_path / "out"
    build(small, out)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    record = out / "shards" / "000001.zarr" / "zarr.json"
    record.write_text(record.read_text().replace('"shard": 1,', f'"shard": {shard},', 1))
    assert any("000001.zarr" in line for line in datapipe.open(out).verify())
    report = build(small, out, **again)
    assert report.status == "ok" and report.shards_built == 1
    assert datapipe.open(out).verify() == []
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    changed = {str(k) for k in before if before[k] != after.get(k)} - {"report.json"}
    assert changed == set(), changed


def run_without_write_permission(*args: str) -> subprocess.CompletedProcess:
    """The CLI as a user who may not write where file permissions say so: root gives up its override."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
        if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"], capture_output=True).returncode:
            pytest.skip("running as root, and setpriv cannot drop the permission override")
    return subprocess.run([*prefix, sys.executable, "-m", "datapipe.cli", *args], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def set_writable(folder: Path, writable: bool) -> None:
    for path in [folder, *folder.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | 0o200 if writable else mode & ~0o222)


def test_a_finished_cache_in_a_read_only_folder_is_up_to_date_and_only_then(small, tmp_path, imaging):
    """A shared cache the user may not write: the rerun that has nothing to do says so (exit 0, one line),
    without the lock it cannot take; a rerun that has something to do still fails with the clear line."""
    out = tmp_path / "out"
    build(small, out)
    before = files_of(out)
    args = ["build", str(small), str(out), "--size", str(SIZE), "--shard-size", "4", "--scheduler", "sync", "--quiet"]
    set_writable(out, False)
    try:
        for extra in ([], ["--force"], ["--verify"]):
            proc = run_without_write_permission(*args, *extra)
            assert proc.returncode == 0, proc.stderr
            assert "up to date" in proc.stderr.strip().splitlines()[-1] and "error" not in proc.stderr
        (small / "b" / "img001.jpg").write_bytes(imaging.jpeg(imaging.gradient(40, 52, seed=99)))  # a changed input
        proc = run_without_write_permission(*args)
        assert proc.returncode == 2 and "cannot write to output folder" in one_line(proc.stderr)
    finally:
        set_writable(out, True)
    assert files_of(out) == before
    shard = images_path(out / "shards" / "000000.zarr", "fixed")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # damage that keeps the size: only --verify sees it
    shard.write_bytes(bytes(data))
    set_writable(out, False)
    try:
        proc = run_without_write_permission(*args, "--verify")
        assert proc.returncode == 2 and "cannot write to output folder" in one_line(proc.stderr)
    finally:
        set_writable(out, True)


def test_a_build_of_a_cache_another_build_holds_is_up_to_date_without_waiting_and_only_then(small, tmp_path, imaging,
                                                                                          caplog):
    """Every rank of a job calling build() on the same finished cache (the README's pattern under torchrun): the
    one that finds the lock held checks, without it, that the cache is up to date, and goes on; with
    something to do it is refused naming the holder, and nothing is written either way."""
    from datapipe.errors import OutputBusyError
    from datapipe.output import BuildLock

    out = tmp_path / "out"
    first = build(small, out)
    before = files_of(out)
    holder = BuildLock(out)  # another build of it (another rank), as far as the flock tells
    holder.acquire()
    try:
        for kwargs in ({}, {"verify": True}):
            with caplog.at_level("INFO", logger="datapipe"):
                report = build(small, out, **kwargs)
            assert report.status == "ok" and report.num_samples == first.num_samples and report.shards_built == 0
            assert "up to date; nothing written: another build holds the folder" in caplog.text
            caplog.clear()
        (small / "b" / "img001.jpg").write_bytes(imaging.jpeg(imaging.gradient(40, 52, seed=99)))  # a changed input
        with pytest.raises(OutputBusyError, match=f"being written by another datapipe build \\(pid {os.getpid()}"):
            build(small, out)
        for force in (False, True):  # another configuration: the holder is still the first thing to know
            with pytest.raises(OutputBusyError, match=f"being written by another datapipe build \\(pid {os.getpid()}"):
                build(small, out, size=SIZE + 8, force=force)
    finally:
        holder.release()
    assert files_of(out) == before
    build(small, out)  # the lock free again: the change is built
    assert files_of(out) != before


VICTIM = "b/img001.jpg"  # in shard 1 of ``small`` (4 files a shard)


def fail_reads(monkeypatch, kind: str) -> list[bool]:
    """While the returned list holds True, the build quarantines VICTIM as ``kind`` without its size or mtime
    changing: a read refused (``unreadable``: permissions, an I/O error), or, as the isolated decode of a
    shard that killed its worker reports it, a ``timeout`` or a ``decoder-crash`` (memory pressure)."""
    failing = [True]
    real_read, real_load = builder.read_file, builder._load

    def read(path, limit, *scanned):
        if failing and path.endswith(VICTIM):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_read(path, limit, *scanned)

    def load(file, spec, path, quarantined, *args, **kwargs):
        if failing and path == VICTIM:
            quarantined.append({"path": path, "error": kind, "reason": f"{kind} (isolated after its shard killed a worker)"})
            return None
        return real_load(file, spec, path, quarantined, *args, **kwargs)

    if kind == "unreadable":
        monkeypatch.setattr(builder, "read_file", read)
    else:
        monkeypatch.setattr(builder, "_load", load)
    return failing


@pytest.mark.parametrize("kind", ["unreadable", "timeout", "decoder-crash"])
def test_a_file_that_failed_for_no_fault_of_its_bytes_is_read_again(small, tmp_path, monkeypatch, kind):
    """Fixed (chmod, an I/O error that cleared, memory freed) with its size and mtime unchanged, it is read
    again by the rerun the error line advises: only its shard is built again, and then nothing."""
    out = tmp_path / "out"
    failing = fail_reads(monkeypatch, kind)
    with pytest.raises(TooManyBadFilesError, match="reads again"):
        build(small, out, max_bad_fraction=0)
    failing.clear()
    report = build(small, out, max_bad_fraction=0)
    assert report.quarantined == [] and report.num_samples == 10 and report.shards_built == 1
    cache = datapipe.open(out)
    assert VICTIM in [cache.path(i) for i in range(len(cache))]
    assert build(small, out, max_bad_fraction=0).shards_built == 0


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_file_gone_while_the_build_ran_is_read_again_once_it_is_back(small, tmp_path, what):
    """A file (or its folder) moved away after the scan and back before the rerun, with its size and mtime (mv,
    rsync -a): the scan's record of it is unchanged, so the rerun must read it again for its reason, as for any
    read that failed for no fault of the bytes. It stayed quarantined for ever, a whole class with the folder."""
    out = tmp_path / "out"
    moved = small / VICTIM if what == "file" else small / "b"
    away = tmp_path / "away"

    def move_away(record) -> None:
        if "building serially" in record.getMessage():
            os.rename(moved, away)

    with build_log(move_away), pytest.raises(TooManyBadFilesError, match="a rerun reads again"):
        build(small, out, max_bad_fraction=0)
    gone = json.loads((out / "report.json").read_text())["quarantined"]
    assert gone and all(q["path"].startswith("b/") and q["error"] == "unreadable"
                        and q["reason"].startswith("unreadable: gone since the scan") for q in gone), gone
    os.rename(away, moved)
    again = build(small, out, max_bad_fraction=0)  # as the error line advises
    assert again.quarantined == [] and again.num_samples == 10 and again.empty_classes == []
    assert build(small, out, max_bad_fraction=0).shards_built == 0


def build_with_victim_gone_and_back(small: Path, out: Path, away: Path) -> list[dict]:
    """A build within a budget of half the files, VICTIM moved away as its shards are read, then put back as the
    scan saw it: the build's quarantine."""

    def move_away(record) -> None:
        if "building serially" in record.getMessage():
            os.rename(small / VICTIM, away)

    with build_log(move_away):
        quarantined = build(small, out, max_bad_fraction=0.5).quarantined
    os.rename(away, small / VICTIM)
    return quarantined


def test_a_finished_cache_takes_a_file_back_that_was_gone_while_it_was_built_when_asked(small, tmp_path):
    """Within its budget the build finishes; a plain rerun is then a no-op (the training script that calls build()
    on every rank must not write), and --verify reads the file again, as its reason says."""
    out = tmp_path / "out"
    quarantined = build_with_victim_gone_and_back(small, out, tmp_path / "away.jpg")
    assert [q["path"] for q in quarantined] == [VICTIM] and "with --verify once it is back" in quarantined[0]["reason"]
    assert build(small, out, max_bad_fraction=0.5).shards_built == 0
    again = build(small, out, max_bad_fraction=0.5, verify=True)
    assert again.quarantined == [] and again.shards_built == 1 and len(datapipe.open(out)) == 10


def test_a_rerun_over_its_budget_did_not_finish_and_the_next_reads_the_file_again(small, tmp_path):
    """A finished cache (its manifest kept) rerun with a smaller budget fails over it: that build did not finish,
    so the next reads again the file its error line says a rerun reads. It looked finished by its manifest, and
    every rerun failed the same way for ever."""
    out = tmp_path / "out"
    assert len(build_with_victim_gone_and_back(small, out, tmp_path / "away.jpg")) == 1
    with pytest.raises(TooManyBadFilesError, match="a rerun reads again every file that changed or could not be read"):
        build(small, out, max_bad_fraction=0)
    again = build(small, out, max_bad_fraction=0)
    assert again.quarantined == [] and again.shards_built == 1 and len(datapipe.open(out)) == 10
    assert build(small, out, max_bad_fraction=0).shards_built == 0


@pytest.mark.parametrize("change", ["another image", "same size", "same size, 1 ns later"])
@pytest.mark.parametrize("then", ["left", "put back"])
def test_a_file_written_between_the_scan_and_its_read_is_never_cached_under_the_scans_record(
        small, tmp_path, imaging, change, then):
    """The shard's record (which decides whether a rerun builds it again) holds each file's size and mtime as the
    scan saw them. A file replaced after the scan (by another image, by another of the same size, or so and with
    an mtime a nanosecond on) was cached as it was read, under that record: left so, no rerun noticed; put back
    as it was, the cache kept the other picture for ever. Now it is quarantined as changed, and a plain rerun
    caches what the file then holds, as a fresh build does."""
    out = tmp_path / "out"
    victim = small / VICTIM
    scanned = victim.stat()
    original = victim.read_bytes()
    other = imaging.jpeg(imaging.gradient(40, 30, seed=9))  # another picture; a JPEG ends at its EOI marker
    if change == "another image":
        assert len(other) != len(original)
    else:
        assert len(other) < len(original)
        other = other.ljust(len(original), b"\0")

    def replace(record) -> None:
        if "building serially" in record.getMessage():
            victim.write_bytes(other)
            if change == "same size, 1 ns later":
                os.utime(victim, ns=(scanned.st_atime_ns, scanned.st_mtime_ns + 1))

    with build_log(replace):
        report = build(small, out, max_bad_fraction=0.5)
    assert [(q["path"], q["error"]) for q in report.quarantined] == [(VICTIM, "unreadable")], report.quarantined
    reason = report.quarantined[0]["reason"]
    assert reason.startswith("changed since the scan (") and "when read: written while the build ran" in reason and \
        "with --verify once it is back as the scan saw it" in reason, reason
    if then == "put back":  # as the scan saw it: bytes, size and mtime; the plain rerun of a finished cache writes
        victim.write_bytes(original)  # nothing, as its reason says
        os.utime(victim, ns=(scanned.st_atime_ns, scanned.st_mtime_ns))
        assert build(small, out, max_bad_fraction=0.5).shards_built == 0
    again = build(small, out, max_bad_fraction=0.5, verify=then == "put back")
    assert again.shards_built == 1 and again.quarantined == [], again.quarantined
    build(small, tmp_path / "fresh")
    cache, fresh = datapipe.open(out), datapipe.open(tmp_path / "fresh")
    assert [cache.path(i) for i in range(len(cache))] == [fresh.path(i) for i in range(len(fresh))]
    i = [cache.path(k) for k in range(len(cache))].index(VICTIM)
    assert np.array_equal(cache[i][0], fresh[i][0]) and cache[i][1] == fresh[i][1]
    assert build(small, out, max_bad_fraction=0.5).shards_built == 0


def test_a_file_that_became_a_fifo_after_the_scan_has_the_scans_reason(small, tmp_path):
    """Read time says what the scan says of a FIFO under an image's name, and never opens it to wait."""
    victim = small / VICTIM

    def swap(record) -> None:
        if "building serially" in record.getMessage():
            victim.unlink()
            os.mkfifo(victim)

    with build_log(swap):
        report = build(small, tmp_path / "out", max_bad_fraction=0.5)
    assert [(q["path"], q["error"], q["reason"]) for q in report.quarantined] == [
        (VICTIM, "unreadable", "not a regular file: a named pipe (FIFO)")]


def test_a_shard_data_file_that_is_a_fifo_is_named_with_what_to_do(small, tmp_path):
    """Builds never delete what they did not write: the message says to move it away first, and then the rerun
    rewrites the shard (it used to advise the rerun alone, which refused the FIFO)."""
    out = tmp_path / "out"
    build(small, out)
    data = images_path(out / "shards" / "000001.zarr", "fixed")
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(CorruptShardError, match=r"is not a regular file but a named pipe \(FIFO\); move it away"):
        datapipe.open(out)
    with pytest.raises(BuildError, match="no datapipe build wrote it"):
        build(small, out)
    data.rename(tmp_path / "fifo")
    assert build(small, out).shards_built == 1 and datapipe.open(out).verify() == []


@pytest.mark.parametrize("name", ["DATAPIPE_FILE_TIMEOUT", "DATAPIPE_PROBE_TIMEOUT", "DATAPIPE_SCHEDULER_TIMEOUT",
                                  "DATAPIPE_REMOTE_LOCK_TTL"])
@pytest.mark.parametrize("value", ["abc", "-5", "0", "inf", "nan", "1e10"])
def test_a_bad_timeout_variable_is_one_line_before_anything_starts(small, tmp_path, name, value):
    """Each was read its own way: a traceback, a silent fallback to the default, or (a worker's) a failed shard."""
    out = tmp_path / "out"
    proc = cli("build", str(small), str(out), "--size", str(SIZE), "--scheduler", "sync", "--quiet", env={name: value})
    assert proc.returncode == 2
    default = {"DATAPIPE_FILE_TIMEOUT": 300, "DATAPIPE_PROBE_TIMEOUT": 120, "DATAPIPE_SCHEDULER_TIMEOUT": 20,
               "DATAPIPE_REMOTE_LOCK_TTL": 120}[name]
    assert one_line(proc.stderr) == (f"datapipe build: error: {name} must be a positive number of seconds, at most "
                                     f"{threading.TIMEOUT_MAX:,.0f}, got {value!r}; unset it for the default ({default} s)")
    assert not out.exists()


def test_a_file_missing_at_the_scan_does_not_make_every_rerun_build_again(small, tmp_path):
    """A path the scan finds no file at (a dangling link) is quarantined once; reruns stay no-ops."""
    (small / "b" / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    out = tmp_path / "out"
    first = build(small, out, max_bad_fraction=1.0)
    assert [q["path"] for q in first.quarantined] == ["b/dangling.jpg"]
    assert build(small, out, max_bad_fraction=1.0).shards_built == 0


def test_a_finished_cache_reads_such_files_again_when_asked_and_only_then(small, tmp_path, monkeypatch):
    """A finished cache (within its budget) that quarantined a file it could not read: a plain rerun is the no-op
    that writes nothing (the training script that calls build() on every start); --force or --verify reads
    the file again, quarantines it again while it still fails, and takes it once it is fixed."""
    out = tmp_path / "out"
    failing = fail_reads(monkeypatch, "unreadable")
    first = build(small, out, max_bad_fraction=0.5)
    assert [(q["path"], q["error"]) for q in first.quarantined] == [(VICTIM, "unreadable")]
    failing.clear()
    before = files_of(out)
    plain = build(small, out, max_bad_fraction=0.5)
    assert plain.shards_built == 0 and files_of(out) == before
    failing.append(True)
    again = build(small, out, max_bad_fraction=0.5, force=True)
    assert again.shards_built == 1 and [q["path"] for q in again.quarantined] == [VICTIM]
    failing.clear()
    fixed = build(small, out, max_bad_fraction=0.5, verify=True)
    assert fixed.quarantined == [] and len(datapipe.open(out)) == 10


def test_a_rerun_that_reads_a_file_again_drops_the_manifest_first(small, tmp_path, monkeypatch):
    """The file now read may add a sample: stopped while it rebuilds that shard, the rerun must leave an
    unfinished cache, never the old manifest describing a shard that is being replaced."""
    out = tmp_path / "out"
    failing = fail_reads(monkeypatch, "unreadable")
    build(small, out, max_bad_fraction=0.5)
    failing.clear()

    def disk_full(self, image, label, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.tmp_dir))

    monkeypatch.setattr(writer.ShardWriter, "add", disk_full)
    with pytest.raises(OutputWriteError, match="No space left"):
        build(small, out, max_bad_fraction=0.5, force=True)
    with pytest.raises(CacheError, match="did not finish"):
        datapipe.open(out)
    monkeypatch.undo()
    assert build(small, out, max_bad_fraction=0.5).quarantined == [] and len(datapipe.open(out)) == 10


# ----------------------------------------------------------------------------- hangs and crashes


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_scheduler_leaves_nothing_behind(small, tmp_path):
    out = tmp_path / "new" / "out"
    proc = cli("build", str(small), str(out), "--scheduler", f"tcp://127.0.0.1:{closed_port()}", "--quiet",
               env={"DATAPIPE_SCHEDULER_TIMEOUT": "1"})
    assert proc.returncode == 2
    assert "cannot reach the Dask scheduler" in one_line(proc.stderr)
    assert list((tmp_path / "new").iterdir()) == []  # no output folder, no shards/, no lock file


@pytest.mark.parametrize("address", ["foo", "tcp://head"])
def test_a_malformed_scheduler_address_is_named_as_such_at_once(small, tmp_path, address):
    """An address Dask cannot parse fails before any wait, saying so (it said 'cannot reach ... within 20 s')."""
    proc = cli("build", str(small), str(tmp_path / "out"), "--scheduler", address, "--quiet")
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert f"--scheduler {address} is not a Dask scheduler address" in line and "within" not in line, line
    assert not (tmp_path / "out").exists()


def test_a_local_cluster_that_cannot_start_is_one_line_naming_the_limit(small, tmp_path):
    """Under a low descriptor limit the LocalCluster's start failed with distributed's tracebacks ("RuntimeError:
    Nanny failed to start", asyncio's "Too many open files" callbacks) instead of one line saying what to do."""
    import resource

    def lower() -> None:  # the hard limit too: the soft one is raised to what the cluster needs where it allows
        resource.setrlimit(resource.RLIMIT_NOFILE, (24, 24))

    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(small), str(out), "--size", str(SIZE),
                           "--workers", "1", "--quiet"], capture_output=True, text=True, timeout=180,
                          preexec_fn=lower, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 2, proc.stderr  # the plan's line, then the error's
    assert line.startswith("datapipe build: error: this process may open 24 files (ulimit -n), and a LocalCluster "
                           "of 1 worker needs about 56: raise the limit (ulimit -n 56)"), line
    assert "--scheduler sync" in line, line
    rerun = cli("build", str(small), str(out), "--size", str(SIZE), "--workers", "1", "--quiet")
    assert rerun.returncode == 0, rerun.stderr


def test_an_unchanged_rerun_starts_no_cluster(small, tmp_path):
    out = tmp_path / "out"
    build(small, out)
    code = ("import json, sys, datapipe; r = datapipe.build(sys.argv[1], sys.argv[2], size=32, shard_size=4, "
            "progress=False); "
            "print(json.dumps([r.shards_built, r.shards_skipped, r.workers, 'distributed' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code, str(small), str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [0, 3, 0, False]


@pytest.mark.distributed
def test_ctrl_c_mid_build_prints_one_line_and_leaves_no_process(tmp_path, imaging):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 40, "b": 40}, variety=False, shape=(300, 400))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "datapipe.cli", "build", str(src), str(out), "--size", str(SIZE),
                             "--shard-size", "2", "--workers", "1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: any((out / "shards").glob("*.zarr")) or proc.poll() is not None, 120, "the first shard")
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the whole process group
        stderr = proc.stderr.read()
        assert proc.wait(60) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        proc.stderr.close()
    assert "Traceback" not in stderr, stderr
    after = stderr.split("shard/s]")[-1].strip().splitlines()  # what follows the progress bar
    assert after == ["datapipe build: interrupted; finished shards are kept, rerun to resume"], stderr
    assert any((out / "shards").glob("*.zarr"))
    wait_for(lambda: subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1, 30,
             "every process of the build to end")
    with pytest.raises(CacheError, match="did not finish"):
        datapipe.open(out)


STARTUP_SIGNAL = """
import os, signal, sys, time
import dask.distributed as dd

phase, signum = os.environ["PHASE"], getattr(signal, os.environ["SIGNAL"])

def hit(where):
    if phase == where:
        os.kill(os.getpid(), signum)
        time.sleep(0.3)  # the handler runs here, in the middle of the cluster's start

class Cluster(dd.LocalCluster):
    def __init__(self, *args, **kwargs):
        hit("cluster-before")
        super().__init__(*args, **kwargs)
        hit("cluster-after")

class Client(dd.Client):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        hit("client")

real_start = dd.Nanny.start_unsafe

async def nanny_start(self):
    if phase == "workers-starting":  # sent from the cluster's event loop while the main thread waits on it
        os.kill(os.getpid(), signum)
    return await real_start(self)

dd.LocalCluster, dd.Client, dd.Nanny.start_unsafe = Cluster, Client, nanny_start
from datapipe.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
@pytest.mark.parametrize("phase,signame", [("cluster-before", "SIGTERM"), ("workers-starting", "SIGTERM"),
                                           ("workers-starting", "SIGINT"), ("cluster-after", "SIGTERM"),
                                           ("client", "SIGINT")])
def test_a_signal_while_the_cluster_starts_is_one_line_and_leaves_no_process(small, tmp_path, phase, signame):
    """SIGTERM or Ctrl-C in any phase of the LocalCluster's start: the build's one line, its exit code,
    no traceback (distributed's exit handler once failed on the half-made cluster), no worker left."""
    interrupted_build(["-c", STARTUP_SIGNAL, "build", str(small), str(tmp_path / "out")], signame,
                      {**os.environ, "PHASE": phase, "SIGNAL": signame})


def interrupted_build(args: list[str], signame: str, env: dict[str, str]) -> None:
    """Run ``python ARGS --size SIZE --workers 1 --quiet`` in a session of its own, which a signal interrupts:
    the build's one line and exit code, no traceback, and no process of it left."""
    proc = subprocess.Popen([sys.executable, *args, "--size", str(SIZE), "--workers", "1", "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        stderr = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    assert proc.returncode == (143 if signame == "SIGTERM" else 130), stderr
    assert "Traceback" not in stderr and "Error" not in stderr, stderr
    what = "terminated" if signame == "SIGTERM" else "interrupted"
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1] == f"datapipe build: {what}; finished shards are kept, rerun to resume", stderr
    assert len(lines) <= 3, stderr  # the plan, the workers' line at most, and the one line
    wait_for(lambda: subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True).returncode == 1, 30,
             "every process of the build to end")


GROUP_SIGNAL = """
import os, signal

def dask_setup(worker):  # as Ctrl-C in a terminal does: the signal reaches every process of the group
    os.killpg(os.getpgrp(), getattr(signal, os.environ["SIGNAL"]))
"""


@pytest.mark.distributed
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_whole_group_while_a_worker_starts_is_one_line(small, tmp_path, signame):
    """The signal reaches the build and its worker still starting (a worker preload sends it, so the
    moment is always the same): the worker's death makes the cluster's start fail ("Nanny failed to
    start"), which must be reported as the interruption, not as distributed's traceback."""
    preload = tmp_path / "preload.py"
    preload.write_text(GROUP_SIGNAL)
    env = {**os.environ, "SIGNAL": signame, "DASK_DISTRIBUTED__WORKER__PRELOAD": json.dumps([str(preload)])}
    interrupted_build(["-m", "datapipe.cli", "build", str(small), str(tmp_path / "out")], signame, env)


# ----------------------------------------------------------------------------- names and places a build records


@pytest.mark.parametrize("which", ["source", "output"])
def test_a_source_or_output_path_that_is_not_utf8_is_one_line_and_writes_nothing(small, tmp_path, which):
    """build.json, the manifest and the report are UTF-8 text: a folder named in another encoding (a
    name from an old archive) ended in a UnicodeEncodeError after a shard, and every rerun repeated it."""
    odd = tmp_path / os.fsdecode(b"folder\xff")
    if which == "source":
        shutil.copytree(small, odd)
        source, out = odd, tmp_path / "out"
    else:
        source, out = small, odd
    result = cli("build", str(source), str(out), "--size", str(SIZE), "--scheduler", "sync")
    assert result.returncode == 2
    assert one_line(result.stderr) == (f"datapipe build: error: {which} {tmp_path}/folder\\xff: the path is not valid "
                                       "UTF-8; rename it (or link to it from a path that is) and rerun")
    assert not out.exists()
    with pytest.raises(SourceError if which == "source" else OutputError, match="not valid UTF-8"):
        build(source, out)


def test_a_class_folder_whose_name_is_not_utf8_ends_the_build_naming_it(small, tmp_path):
    """Its files were quarantined as badly named files and the class left out of the list without a word, so
    every class after it took another label than ImageFolder gives it."""
    odd = os.fsencode(small) + b"/b\xe9b\xe9"
    os.rename(small / "b", odd)
    os.makedirs(small / "c")
    shutil.copy(next(iter(sorted((small / "a").iterdir()))), small / "c" / "x.jpg")
    out = tmp_path / "out"
    result = cli("build", str(small), str(out), "--size", str(SIZE), "--scheduler", "sync")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        f"datapipe build: error: class folder {small}/b\\xe9b\\xe9 has a name that is not valid UTF-8: the cache "
        "records class names as text, and leaving the class out would renumber every class after it; rename the "
        "folder (e.g. `convmv -f latin1 -t utf8 -r --notest FOLDER`) and rerun")
    assert not out.exists()
    nested = small / "a" / os.fsdecode(b"sub\xff")  # inside a class, only its files are quarantined
    nested.mkdir()
    shutil.copy(next(iter(sorted((small / "a").glob("*.jpg")))), nested / "y.jpg")
    os.rename(odd, small / "b")
    report = build(small, out, max_bad_fraction=0.5)
    assert datapipe.open(out).classes == ["a", "b", "c"]
    assert [(q["path"], q["error"]) for q in report.quarantined] == [("a/sub\\xff/y.jpg", "unreadable")]
    assert "rename the file (or its folder)" in report.quarantined[0]["reason"]


def test_names_with_control_characters_are_escaped_in_every_message(tmp_path, imaging):
    """A newline or a terminal escape in a file or class name was printed raw: the over-budget error ran over
    three lines with ESC sequences in them, the summary cleared the screen, and info's classes line was broken."""
    src = tmp_path / "src"
    imaging.write_source(src, {"ok": 3, "cl\nass": 3}, variety=False)
    (src / "cl\nass" / "bad\n\x1b[31mRED\u202e.jpg").write_bytes(b"garbage")
    (src / "empty\n\x1b[2Jcls").mkdir()
    out = tmp_path / "out"
    failed = cli("build", str(src), str(out), "--size", str(SIZE), "--scheduler", "sync", "--quiet")
    assert failed.returncode == 2
    line = one_line(failed.stderr)
    assert "First: cl\\nass/bad\\n\\x1b[31mRED\\u202e.jpg (not-an-image)" in line, line
    assert not any(c in failed.stderr for c in "\x1b\u202e")
    done = cli("build", str(src), str(out), "--size", str(SIZE), "--scheduler", "sync", "--quiet",
               "--max-bad-fraction", "0.5")
    assert done.returncode == 0, done.stderr
    summary = done.stderr.strip().splitlines()[-1]
    assert "1 class without any sample (empty\\n\\x1b[2Jcls)" in summary and "\x1b" not in done.stderr, summary
    info = cli("info", str(out))
    classes = [line for line in info.stdout.splitlines() if line.startswith("classes")]
    assert classes == ["classes    3: cl\\nass, empty\\n\\x1b[2Jcls, ok"], info.stdout
    assert "\x1b" not in info.stdout
    assert datapipe.open(out).classes == ["cl\nass", "empty\n\x1b[2Jcls", "ok"]  # the names as they are


@pytest.mark.parametrize("spelling", ["same", "trailing-slash", "link"])
def test_a_cache_is_never_its_own_source(small, tmp_path, spelling):
    """A cache holding the user's images (copied into it later), built from itself with --force: its own
    shards/ folder was scanned as an empty class and every image got label 0 of the wrong list."""
    cache = tmp_path / "cache"
    build(small, cache)
    shutil.copytree(small, cache / "imgs")
    before = files_of(cache)
    output = {"same": str(cache), "trailing-slash": f"{cache}/", "link": str(tmp_path / "link")}[spelling]
    if spelling == "link":
        (tmp_path / "link").symlink_to(cache)
    for force in (False, True):
        with pytest.raises(SourceError, match=f"source {cache} is the output folder itself; write the cache to another"):
            build(cache, output, force=force)
    assert files_of(cache) == before
    inside = build(cache / "imgs", tmp_path / "elsewhere")  # the images themselves build
    assert inside.num_samples == 10


def test_a_csv_row_starting_with_a_hash_is_a_comment_only_when_no_such_file_exists(tmp_path, imaging):
    """A file really named '#1.jpg' was read as a comment: its row vanished, with its class, from the cache and
    the report, and every later class moved down one label."""
    arr = imaging.gradient(40, 52)
    for name in ("a.jpg", "#1.jpg", " #2.jpg"):
        (tmp_path / name).write_bytes(imaging.jpeg(arr))
    (tmp_path / "list.csv").write_text("# a comment, kept out\na.jpg,cat\n#1.jpg,dog\n #2.jpg,eel\n#gone.jpg,fox\n")
    report = build(tmp_path / "list.csv", tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["cat", "dog", "eel"] and report.num_samples == 3 and report.quarantined == []
    assert {cache.path(i): cache.classes[cache[i][1]] for i in range(3)} == {"a.jpg": "cat", "#1.jpg": "dog",
                                                                           " #2.jpg": "eel"}


@pytest.mark.parametrize("text,line", [('a.jpg,cat\n"b.jpg,dog\nc.jpg,eel\n', 2), ('"a.jpg,cat\n', 1)])
def test_an_unclosed_quote_in_a_csv_names_the_line_it_opens_on(tmp_path, text, line):
    (tmp_path / "list.csv").write_text(text)
    with pytest.raises(SourceError, match=rf"list.csv:{line}: a quote opened on this line is never closed"):
        build(tmp_path / "list.csv", tmp_path / "out")


def test_hidden_files_and_folders_are_counted_as_ignored(small, tmp_path, imaging):
    """The guarantee: every source file is a sample, in the report, or counted as ignored; hidden ones
    (.DS_Store, macOS's ._ copies, notebook checkpoints) were skipped without a count."""
    plain = build(small, tmp_path / "plain")
    jpeg = imaging.jpeg(imaging.gradient(40, 52))
    (small / ".DS_Store").write_bytes(b"\0")
    (small / "a" / "._img000.jpg").write_bytes(b"\0\5\26\7")
    (small / "a" / ".ipynb_checkpoints").mkdir()
    (small / "a" / ".ipynb_checkpoints" / "img-checkpoint.jpg").write_bytes(jpeg)
    (small / ".trash").mkdir()
    (small / ".trash" / "x.jpg").write_bytes(jpeg)
    report = build(small, tmp_path / "out")
    assert report.num_samples == plain.num_samples
    assert report.ignored == plain.ignored + 4
    assert json.loads((tmp_path / "out" / "report.json").read_text())["ignored"] == plain.ignored + 4


def test_a_class_list_file_with_a_byte_order_mark(small, tmp_path):
    """A class list saved by Notepad or Excel starts with a byte-order mark, which stuck to the first name."""
    (tmp_path / "classes.txt").write_bytes("\ufeffa\nb\n".encode())
    assert cli_main(["build", str(small), str(tmp_path / "out"), "--size", str(SIZE), "--scheduler", "sync",
                     "--classes-from", str(tmp_path / "classes.txt"), "--quiet"]) == 0
    assert datapipe.open(tmp_path / "out").classes == ["a", "b"]


@pytest.mark.parametrize("name", ["report.json", "manifest.json", "build.json", "labels.npy", "paths.json",
                                  "shards/bench.json", "shards/000000.zarr/zarr.json"])
def test_bench_never_writes_over_a_file_of_a_cache(small, tmp_path, capsys, name):
    """`datapipe bench CACHE --json CACHE/report.json` wrote over the build's report; the rerun the reader was
    then told to make refused to replace a file it had not written."""
    cache = tmp_path / "cache"
    build(small, cache)
    before = files_of(cache)
    assert cli_main(["bench", str(cache), "--json", str(cache / name), "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert f"--json {cache / name}: is one of the datapipe cache {cache}'s own files" in err
    assert files_of(cache) == before


def test_a_report_written_over_is_refused_by_the_build_and_the_advice_works(small, tmp_path, capsys):
    cache = tmp_path / "cache"
    build(small, cache)
    (cache / "report.json").write_text('{"x": 1}')
    assert cli_main(["info", str(cache)]) == 2
    err = capsys.readouterr().err
    assert "field 'status' is missing; move it away and rerun the same `datapipe build`" in err
    with pytest.raises(OutputError, match="report.json was not written by the build"):
        build(small, cache)
    (cache / "report.json").rename(tmp_path / "report.json")  # as the message says
    assert build(small, cache).shards_built == 0
    assert cli_main(["info", str(cache)]) == 0


def test_a_rerun_that_only_updates_the_index_says_so(tmp_path, capsys):
    """An empty class folder added last changes the class list only: no shard to build, the manifest rewritten.
    The summary said "nothing to do" and `datapipe info` "0 img/s on 0 workers"; it says the index was updated,
    and info that no shard was built. A rerun after it has nothing to do, and says so."""
    source = datapipe.make_sample_dataset(tmp_path / "src", images=12, classes=3)
    out = tmp_path / "cache"
    argv = ["build", str(source), str(out), "--scheduler", "sync", "--quiet", "--size", "32"]
    assert cli_main(argv) == 0
    (source / "zzz").mkdir()
    capsys.readouterr()
    assert cli_main(argv) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "(0 built, 1 already done)" in line and "no shard to build, index updated" in line, line
    assert datapipe.open(out).classes[-1] == "zzz"
    assert cli_main(["info", str(out)]) == 0
    assert "last build ok: 0 quarantined, no shard built (every file" in capsys.readouterr().out
    assert cli_main(argv) == 0
    assert "nothing to do" in capsys.readouterr().err


def test_the_report_is_written_before_the_manifest(tmp_path, monkeypatch):
    """The manifest is written last (docs/format.md): a build stopped between the two left a finished cache with
    the report of the build before it ("last build failed" for a cache that built). When the report is written,
    the manifest is not yet this build's."""
    source = datapipe.make_sample_dataset(tmp_path / "src", images=12, classes=3)
    out = tmp_path / "cache"
    kwargs = dict(size=32, shard_size=4, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    datapipe.build(source, out, **kwargs)
    first = (out / "manifest.json").read_bytes()
    shutil.copy(next((source / "class_001").iterdir()), source / "class_001" / "zz_added.jpg")  # the last shard changes
    seen = []
    real = builder._write_report

    def write_report(where, report):
        seen.append((out / "manifest.json").read_bytes() if (out / "manifest.json").exists() else None)
        real(where, report)

    monkeypatch.setattr(builder, "_write_report", write_report)
    report = datapipe.build(source, out, **kwargs)
    final = (out / "manifest.json").read_bytes()
    assert report.shards_built >= 1 and final != first
    assert len(seen) == 1 and seen[0] in (None, first)  # the earlier build's manifest, or none (retired), never this one's


# ----------------------------------------------------------------------------- a shard's record taken as it is


def _edit_record(shard: Path, edit: Callable[[dict], None]) -> None:
    doc = json.loads((shard / "zarr.json").read_text())
    edit(doc["attributes"]["datapipe"])
    (shard / "zarr.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("edit", ["a file the source lacks", "an unknown kind", "listed twice", "a count off by one"])
def test_a_shard_whose_record_does_not_account_for_its_files_is_built_again(small, tmp_path, edit):
    """A shard's zarr.json listing a quarantined file the source never had was kept, its entry copied into the
    report (60 scanned, 60 samples, 1 quarantined): within the budget the build failed over a file that never
    failed, and the entry's kind reached the terminal raw. Each plan file must be a sample or quarantined once."""
    out = tmp_path / "out"
    first = build(small, out)
    ghost = {"path": "a/ghost.jpg", "error": "corrupt", "reason": "corrupt: never in the source"}
    edits = {
        "a file the source lacks": lambda rec: rec["quarantined"].append(ghost),
        "an unknown kind": lambda rec: (rec["quarantined"].append({**ghost, "path": rec["paths"][0],
                                                                  "error": "corrupt\x1b[2J"}),
                                        rec.update(count=rec["count"] - 1, paths=rec["paths"][1:])),
        "listed twice": lambda rec: rec["quarantined"].extend([{**ghost, "path": rec["paths"][0]}] * 2),
        "a count off by one": lambda rec: rec.update(count=rec["count"] + 1),
    }
    _edit_record(out / "shards" / "000000.zarr", edits[edit])
    report = build(small, out)
    assert report.shards_built == 1 and report.quarantined == [] and report.num_samples == first.num_samples == 10
    assert report.scanned == report.num_samples + len(report.quarantined)
    assert datapipe.open(out).verify() == []


@pytest.mark.parametrize("damage", ["a row of no height", "offsets past int64"])
def test_build_verify_rewrites_a_shard_whose_index_rows_are_impossible_though_its_checksums_agree(small, tmp_path, damage):
    """Readers refuse such an index ("rerun ... to rewrite it"), but --verify compared only its checksum with the
    shard's own record: kept (the advice could not be followed), or, with overflowing offsets, a raw zarr
    ValueError from sizes computed from the unchecked rows."""
    out = tmp_path / "out"
    build(small, out, fit="short")
    index = out / "shards" / "000000.zarr" / "index" / "c" / "0" / "0"
    rows = np.frombuffer(index.read_bytes(), "<i8").reshape(-1, 4).copy()
    if damage == "a row of no height":
        rows[1, 2] = 0
    else:
        rows[-2, 1] = 2**62
        rows[-1, 0], rows[-1, 1] = rows[-2, 0] + 2**62, 2**62
    raw = rows.astype("<i8").tobytes()
    index.write_bytes(raw)
    checksum = f"{crc32c(raw):08x}"
    _edit_record(out / "shards" / "000000.zarr", lambda rec: rec.update(index_crc32c=checksum))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"][0]["index_crc32c"] = checksum
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptShardError, match=r"the sample index .*; rerun the same `datapipe build` with --verify"):
        datapipe.open(out)[0]
    report = build(small, out, fit="short", verify=True)
    assert report.shards_built == 1 and datapipe.open(out).verify() == []
    assert datapipe.open(out)[0][0].shape[2] == 3


@pytest.mark.parametrize("what", ["link", "folder"])
def test_something_else_at_the_lock_files_name_is_named_and_left_alone(small, tmp_path, what):
    """A link there (never followed) gave 'cannot write to output folder: Too many levels of symbolic links', a
    folder 'Is a directory': neither named the lock file nor what to do."""
    out, target = tmp_path / "out", tmp_path / "elsewhere.txt"
    build(small, out)
    target.write_text("mine")
    if what == "link":
        (out / ".datapipe.lock").symlink_to(target)
    else:
        (out / ".datapipe.lock").mkdir()
    kind = "a symbolic link" if what == "link" else "a folder"
    with pytest.raises(OutputError, match=rf"\.datapipe\.lock is {kind}, where a build keeps its lock file .* move it "
                                          "away and rerun"):
        build(small, out, size=SIZE + 8, force=True)
    assert target.read_text() == "mine" and os.path.lexists(out / ".datapipe.lock")
    assert datapipe.open(out).verify() == []


def test_opening_a_folder_that_holds_no_cache_says_what_to_pass(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CacheError, match=r"empty is not a finished datapipe cache \(no manifest.json\) — pass the folder "
                                         r"`datapipe build` wrote$"):
        datapipe.StreamingDataset(tmp_path / "empty", batch_size=4)


@pytest.mark.parametrize("how", ["force", "fewer shards", "no change"])
def test_a_build_never_writes_or_removes_behind_a_linked_shards_folder(small, tmp_path, imaging, how):
    """B's shards/ linked to cache A's: `--force` into B rewrote every shard of A, a rerun with fewer shards
    removed one of A's."""
    a, b = tmp_path / "a", tmp_path / "b"
    build(small, a)
    b.mkdir()
    for name in ("build.json", "manifest.json", "report.json", "labels.npy", "paths.json"):
        shutil.copy(a / name, b / name)
    (b / "shards").symlink_to(a / "shards")
    before = imaging.tree_bytes(a / "shards", skip=())
    if how == "fewer shards":
        for victim in sorted(small.rglob("*.*"))[3:]:
            victim.unlink()
    if how == "no change":  # a rerun that finds nothing to do goes through the link, as readers do
        assert build(small, b).shards_built == 0 and datapipe.open(b).verify() == []
    else:
        with pytest.raises(OutputError, match=r"b/shards is a symbolic link \(to .*a/shards\), and this build would "
                                              r"write or remove shards there; .* Nothing was changed"):
            build(small, b, **({"size": SIZE + 8, "force": True} if how == "force" else {}))
    assert imaging.tree_bytes(a / "shards", skip=()) == before and datapipe.open(a).verify() == []
    if how == "fewer shards":  # refused before the manifest went: B still opens as it was
        assert len(datapipe.open(b)) == 10


@pytest.mark.parametrize("verify", [False, True], ids=["rerun", "verify"])
def test_a_rerun_says_how_many_shards_it_keeps_were_decoded_by_an_earlier_datapipes_rules(small, tmp_path, caplog,
                                                                                          verify):
    """A rule of the decode changed (a --fit short sample one pixel longer) and an upgraded rerun said 'nothing to
    do', then wrote new shards by the new rule beside the old: one picture at two shapes in one cache, unsaid (with
    --verify, whose tasks find the shards whole, it still said nothing)."""
    out = tmp_path / "out"
    build(small, out)
    assert all(json.loads(p.read_text())["attributes"]["datapipe"]["decode_rules"] == builder.DECODE_RULES
               for p in (out / "shards").glob("*/zarr.json"))
    _edit_record(out / "shards" / "000001.zarr", lambda rec: rec.pop("decode_rules"))  # as an earlier datapipe wrote it
    with caplog.at_level("WARNING", logger="datapipe"):
        report = build(small, out, verify=verify)
    assert report.shards_built == 0
    warned = [r.getMessage() for r in caplog.records if "another datapipe's rules" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("datapipe build: 1 of the 3 shards kept were decoded by another "
                                                     f"datapipe's rules (decode rules 1; this one's: {builder.DECODE_RULES}")
    for odd in ([1], {"a": 1}, "2", True, None):  # an edited record: named, never a traceback, the shard kept
        _edit_record(out / "shards" / "000001.zarr", lambda rec, odd=odd: rec.update(decode_rules=odd))
        caplog.clear()
        with caplog.at_level("WARNING", logger="datapipe"):
            assert build(small, out, verify=verify).shards_built == 0
        assert any("(decode rules unknown;" in r.getMessage() for r in caplog.records), odd
    caplog.clear()
    with caplog.at_level("WARNING", logger="datapipe"):
        build(small, tmp_path / "fresh")
    assert not [r for r in caplog.records if "another datapipe's rules" in r.getMessage()]


def test_a_folder_an_earlier_datapipe_began_is_named_as_such(small, tmp_path):
    """Opening one said "run the same datapipe build again to resume it", which the build refuses (no build id), and
    the build's refusal named a setting the user never gave ("restart_interval: None -> 1")."""
    out = tmp_path / "out"
    build(small, out)
    (out / "manifest.json").unlink()
    doc = json.loads((out / "build.json").read_text())
    without_id = {k: v for k, v in doc.items() if k != "build_id"}
    (out / "build.json").write_text(json.dumps(without_id))
    with pytest.raises(CacheError, match=r"a build of an earlier datapipe was started here but did not finish, and this "
                                         r"one cannot resume it \(its build.json has no build id\): build into a new folder"):
        datapipe.open(out)
    config = {k: v for k, v in doc["config"].items() if k != "max_pixels"}
    older = dict(doc, config=config, config_hash=datapipe.records.config_hash(config))
    (out / "build.json").write_text(json.dumps(older))
    with pytest.raises(ConfigMismatchError, match=r"the earlier build's datapipe did not record max_pixels: an earlier "
                                                  r"datapipe wrote it"):
        build(small, out)


def test_an_output_named_by_a_dangling_link_says_so(small, tmp_path):
    """mkdir said "cannot create output folder …: File exists" of a name that shows no file."""
    (tmp_path / "out").symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputError, match=r"out is a symbolic link to .*nowhere, which does not exist: create the folder"):
        build(small, tmp_path / "out")
    (tmp_path / "nowhere").mkdir()
    assert build(small, tmp_path / "out").num_samples == 10
    (tmp_path / "way").symlink_to(tmp_path / "gone")  # a dangling link on the way to the output
    with pytest.raises(OutputError, match=r"output .*way/sub/out: the folder on its way .*way is a symbolic link to "
                                          r".*gone, which does not exist"):
        build(small, tmp_path / "way" / "sub" / "out")
