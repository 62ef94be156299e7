"""A cache's files are trusted only after they are checked, and no reader dies of a signal.

Malformed or inconsistent manifest.json, build.json and report.json end ``datapipe.open``,
``datapipe info`` and ``datapipe verify`` with one CacheError line naming the file and the field;
shard names never lead outside the cache; indices out of range are refused; a shard truncated or
replaced under a running loader (threads or DataLoader worker processes) is an error naming the
shard, never SIGBUS, and never pairs one build's images with another's labels.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import datapipe
from datapipe import cli, native
from datapipe.errors import CacheError, CorruptShardError, DatapipeError
from datapipe.records import config_hash, is_datapipe_output, read_build_record
from datapipe.shards import images_path, shard_labels_path
from datapipe.testing import build_index_cache, index_map, index_of

N, SHARD = 40, 7  # 6 shards: 5 of 7 samples and one of 5


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_index_cache(tmp_path_factory.mktemp("trust"), N, shard_size=SHARD)


@pytest.fixture(scope="module")
def ids(built) -> np.ndarray:
    return index_map(built)


@pytest.fixture
def cache_dir(built, tmp_path) -> Path:
    """A private copy of the built cache, free to damage."""
    return Path(shutil.copytree(built, tmp_path / "cache"))


def edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    result = change(doc)
    if isinstance(result, tuple) and result[:1] == ("whole",):  # the document replaced as a whole
        doc = result[1]
    path.write_text(json.dumps(doc), encoding="utf-8")


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the CLI in-process: exit code 2 and exactly one line on stderr, no traceback."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def _set(path: list, value):
    def change(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _delete(path: list):
    def change(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return change


# (description, change to the manifest document, the field the message must name)
MANIFEST_CASES = [
    ("a list", lambda doc: ("whole", [doc]), "JSON object"),
    ("null", lambda doc: ("whole", None), "JSON object"),
    ("shards null", _set(["shards"], None), "shards"),
    ("shards an object", _set(["shards"], {"0": 1}), "shards"),
    ("a shard null", _set(["shards", 2], None), "shards[2]"),
    ("offsets restart", _set(["shards", 1, "first"], 0), "shards[1].first"),
    ("offsets skip", _set(["shards", 3, "first"], 22), "shards[3].first"),
    ("negative count", _set(["shards", 0, "count"], -7), "shards[0].count"),
    ("bool count", _set(["shards", 0, "count"], True), "shards[0].count"),
    ("float count", _set(["shards", 0, "count"], 7.0), "shards[0].count"),
    ("string count", _set(["shards", 0, "count"], "7"), "shards[0].count"),
    ("count without nbytes", _set(["shards", 5, "count"], 6), "shards[5].nbytes"),
    ("nbytes off by one", lambda doc: doc["shards"][4].update(nbytes=doc["shards"][4]["nbytes"] + 1), "shards[4].nbytes"),
    ("num_samples disagrees", _set(["num_samples"], N + 1), "num_samples"),
    ("num_samples negative", _set(["num_samples"], -1), "num_samples"),
    ("num_samples missing", _delete(["num_samples"]), "num_samples"),
    ("crc32c short", _set(["shards", 0, "crc32c"], "abc"), "shards[0].crc32c"),
    ("crc32c not hex", _set(["shards", 0, "crc32c"], "zzzzzzzz"), "shards[0].crc32c"),
    ("crc32c a number", _set(["shards", 0, "crc32c"], 12345678), "shards[0].crc32c"),
    ("size zero", _set(["config", "size"], 0), "config.size"),
    ("size huge", _set(["config", "size"], 10**9), "config.size"),
    ("size bool", _set(["config", "size"], True), "config.size"),
    ("size null", _set(["config", "size"], None), "config.size"),
    ("config a list", _set(["config"], [32]), "config"),
    ("config altered", _set(["config", "fit"], "pad"), "config_hash"),
    ("config_hash missing", _delete(["config_hash"]), "config_hash"),
    ("sample shape", _set(["sample", "shape"], [32, 32, 4]), "sample.shape"),
    ("sample dtype", _set(["sample", "dtype"], "float32"), "sample.dtype"),
    ("classes repeated", _set(["classes"], ["a", "a", "b"]), "classes[1]"),
    ("classes not strings", _set(["classes"], [0, 1, 2]), "classes[0]"),
    ("classes a string", _set(["classes"], "abc"), "classes"),
    ("source null", _set(["source"], None), "source"),
    ("files without labels", _delete(["files", "labels"]), "files.labels"),
    ("labels file outside", _set(["files", "labels", "name"], "../labels.npy"), "files.labels.name"),
    ("paths file absolute", _set(["files", "paths", "name"], "/etc/passwd"), "files.paths.name"),
    ("shard name climbs out", _set(["shards", 0, "name"], "../../x"), "shards[0].name"),
    ("shard name absolute", _set(["shards", 0, "name"], "/tmp/000000.zarr"), "shards[0].name"),
    ("shard name nested", _set(["shards", 1, "name"], "000000.zarr/../000001.zarr"), "shards[1].name"),
    ("shard name repeated", _set(["shards", 1, "name"], "000000.zarr"), "shards[1].name"),
    ("build_id malformed", _set(["build_id"], "not-an-id"), "build_id"),
    ("format missing", _delete(["format"]), "format"),
]


@pytest.mark.parametrize("what, change, field", MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_malformed_manifest_is_one_error_line_naming_the_field(cache_dir, capsys, what, change, field):
    manifest = cache_dir / "manifest.json"
    edit_json(manifest, change)
    with pytest.raises(CacheError) as err:
        datapipe.open(cache_dir)
    message = str(err.value)
    assert "\n" not in message and str(manifest) in message and field in message, message
    assert "datapipe build" in message or "datapipe" in message  # says what to do
    for command in ("info", "verify"):
        line = one_line_error(capsys, [command, str(cache_dir)])
        assert str(manifest) in line and field in line


@pytest.mark.parametrize("text", ["", "{", "NaN", '{"format": NaN}', "[" * 100_000, '{"num_samples": Infinity}',
                                  "\xff\xfe", '{"format": "datapipe-cache", "version": 1, "num_samples": 1e400}'])
def test_manifest_that_is_not_strict_json(cache_dir, capsys, text):
    (cache_dir / "manifest.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(CacheError, match="manifest.json"):
        datapipe.open(cache_dir)
    assert "manifest.json" in one_line_error(capsys, ["info", str(cache_dir)])


def test_other_version_and_format_are_named(cache_dir):
    edit_json(cache_dir / "manifest.json", _set(["version"], 3))
    with pytest.raises(CacheError, match="version 3"):
        datapipe.open(cache_dir)
    edit_json(cache_dir / "manifest.json", _set(["version"], 2))  # a version this datapipe reads, not this layout's
    with pytest.raises(CacheError, match="'version' is 2, expected 1 for a cache of the fixed layout"):
        datapipe.open(cache_dir)
    edit_json(cache_dir / "manifest.json", _set(["format"], "something-else"))
    with pytest.raises(CacheError, match="not a datapipe manifest.json"):
        datapipe.open(cache_dir)


@pytest.mark.parametrize("version", ["1", True, None, 0, -1, 1.0, [1]])
def test_a_version_that_is_no_format_version_is_damage_not_another_datapipe(cache_dir, version, capsys):
    """A hand-edited version ("1", true, null, 0, -1) was said to be written by cache format version "1" and the
    advice was to install a datapipe that matches; 1.0 was read as 1, where every other whole-number field
    refuses a float. Each is damage to the manifest, said so, with the rebuild advice."""
    edit_json(cache_dir / "manifest.json", _set(["version"], version))
    with pytest.raises(CacheError, match=r"field 'version' is .*not a format version \(a whole number from 1\)") as exc:
        datapipe.open(cache_dir)
    assert "Install a datapipe" not in str(exc.value) and "\n" not in str(exc.value)


def test_manifest_that_is_a_fifo_is_refused_without_waiting(cache_dir):
    (cache_dir / "manifest.json").unlink()
    os.mkfifo(cache_dir / "manifest.json")
    with pytest.raises(CacheError, match="not a regular file"):
        datapipe.open(cache_dir)


@pytest.mark.lifecycle
def test_cli_in_a_real_process_prints_one_line(cache_dir):
    edit_json(cache_dir / "manifest.json", _set(["shards", 1, "first"], 0))
    for command in ("info", "verify"):
        done = subprocess.run([sys.executable, "-m", "datapipe.cli", command, str(cache_dir)], capture_output=True,
                              text=True, timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and "shards[1].first" in lines[0], done.stderr


def test_shard_name_traversal_reads_nothing_outside(cache_dir, tmp_path, monkeypatch):
    """A manifest naming a shard outside the cache is refused before any file is opened there, even
    when a file of exactly the right size waits at that path."""
    outside = tmp_path / "outside.zarr"
    shutil.copytree(cache_dir / "shards" / "000000.zarr", outside)
    edit_json(cache_dir / "manifest.json", _set(["shards", 0, "name"], "../../outside.zarr"))
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(os.fspath(path)) or real_open(path, *a, **k))
    with pytest.raises(CacheError, match=r"shards\[0\].name"):
        datapipe.open(cache_dir)
    assert all(Path(p).resolve().is_relative_to(cache_dir.resolve()) for p in opened), opened


def test_typed_manifest_round_trips(built):
    cache = datapipe.open(built)
    m = cache.manifest
    assert m.to_json() == json.loads((built / "manifest.json").read_text(encoding="utf-8"))
    assert [s.first for s in m.shards] == [0, 7, 14, 21, 28, 35] and m.num_samples == N
    assert len(cache.build_id) in (0, 32) and cache.build_id == m.build_id


# ----------------------------------------------------------------------------- build.json, report.json


def _build_doc(**extra) -> dict:
    config = {"size": 32, "fit": "crop"}
    return {"format": "datapipe-cache", "version": 1, "config": config, "config_hash": config_hash(config), **extra}


@pytest.mark.parametrize("doc", [
    {"format": "my-project", "version": 1}, {"name": "my dataset"}, [], None, "datapipe-cache", 3,
    {"format": "datapipe-cache"}, {"format": "datapipe-cache", "version": "1"}, {"format": "datapipe-cache", "version": True},
    {"format": "datapipe-cache", "version": 1, "build_id": "xyz"},
], ids=repr)
def test_a_users_own_build_or_manifest_json_is_not_a_datapipe_output(tmp_path, doc):
    for name in ("build.json", "manifest.json"):
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        (folder / name).write_text(json.dumps(doc))
        assert not is_datapipe_output(folder)
        assert read_build_record(folder) is None


def test_user_files_that_are_not_json_are_not_datapipe_outputs(tmp_path):
    (tmp_path / "build.json").write_bytes(b"\x00\x01 not json")
    os.mkfifo(tmp_path / "manifest.json")
    assert not is_datapipe_output(tmp_path) and read_build_record(tmp_path) is None
    assert not is_datapipe_output(tmp_path / "missing")


def test_build_records_are_recognised_and_checked(tmp_path, built):
    assert is_datapipe_output(built)
    (tmp_path / "build.json").write_text(json.dumps(_build_doc()))
    assert is_datapipe_output(tmp_path) and read_build_record(tmp_path).build_id == ""
    build_id = "0123456789abcdef0123456789abcdef"
    (tmp_path / "build.json").write_text(json.dumps(_build_doc(build_id=build_id, source={"root": "/data", "kind": "folder"})))
    record = read_build_record(tmp_path)
    assert record.build_id == build_id and record.source["kind"] == "folder" and record.config["size"] == 32
    for damage, field in ((dict(config=None), "config"), (dict(config_hash="0" * 16), "config_hash"),
                          (dict(config={"size": -1, "fit": "crop"}), "config.size"), (dict(version=9), "version 9"),
                          (dict(source=[1]), "source")):
        (tmp_path / "build.json").write_text(json.dumps({**_build_doc(), **damage}))
        assert is_datapipe_output(tmp_path)  # still ours: the build may replace it
        with pytest.raises(CacheError) as err:
            read_build_record(tmp_path)
        assert "build.json" in str(err.value) and field in str(err.value) and "\n" not in str(err.value)


def test_build_into_an_output_with_a_damaged_build_record(cache_dir, capsys):
    edit_json(cache_dir / "build.json", _set(["config"], None))
    source = cache_dir.parent / "source"
    shutil.copytree(Path(datapipe.open(cache_dir).manifest.source.root), source)
    done = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source), str(cache_dir), "--size", "32",
                           "--shard-size", str(SHARD), "--scheduler", "sync", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr and done.returncode in (0, 2), done.stderr
    if done.returncode == 2:
        assert "build.json" in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("damage", ["cut", "not json", "field"])
def test_the_advice_for_a_damaged_manifest_repairs_the_cache(cache_dir, capsys, damage):
    """What the error for a damaged manifest.json says to do works: the build cannot tell a manifest damaged
    past reading from a user's file and never overwrites it, so the advice is to move it away, then rerun
    the build, which keeps the finished shards and writes the manifest again (one still marked as the
    build's own is rewritten by the rerun alone)."""
    manifest = cache_dir / "manifest.json"
    good = manifest.read_bytes()
    if damage == "cut":
        manifest.write_bytes(good[:100])
    elif damage == "not json":
        manifest.write_bytes(b"\x00" * 64)
    else:
        edit_json(manifest, _set(["num_samples"], -1))
    line = one_line_error(capsys, ["info", str(cache_dir)])
    assert "move it away and rerun the same `datapipe build`" in line, line
    source = json.loads(good)["source"]["root"]  # the same build: its source, read only
    args = [sys.executable, "-m", "datapipe.cli", "build", source, str(cache_dir), "--size", "32",
            "--shard-size", str(SHARD), "--scheduler", "sync", "--quiet"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)  # a manifest still marked as its own
    if done.returncode != 0:  # one the build cannot tell from a user's file: refused, as the advice foresees
        assert done.returncode == 2 and "move it away" in done.stderr, done.stderr
        manifest.rename(cache_dir.parent / "manifest.json.damaged")
        done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(datapipe.open(cache_dir)) == json.loads(good)["num_samples"] and datapipe.open(cache_dir).verify() == []


@pytest.mark.parametrize("change, field", [
    (lambda doc: ("whole", [doc]), "JSON object"),
    (_set(["status"], None), "status"),
    (_set(["quarantined"], None), "quarantined"),
    (_set(["quarantined"], [{"path": 1, "reason": "x"}]), "quarantined[0].path"),
    (_set(["quarantined"], ["bad.jpg"]), "quarantined[0]"),
    (_set(["images_per_second"], "fast"), "images_per_second"),
    (_set(["images_per_second"], -1), "images_per_second"),
    (_set(["workers"], 1.5), "workers"),
    (_set(["workers"], False), "workers"),
    (_delete(["workers"]), "workers"),
    (_set(["status"], "ok\x1b[2J\nforged"), "status"),  # a terminal escape, a forged line: no status of ours
    (_set(["quarantined"], [{"path": "x.jpg", "error": "corrupt\x1b]0;title\x07", "reason": "r"}]), "quarantined[0].error"),
])
def test_malformed_report_is_one_line_from_info(cache_dir, capsys, change, field):
    edit_json(cache_dir / "report.json", change)
    line = one_line_error(capsys, ["info", str(cache_dir)])
    assert "report.json" in line and field in line
    assert capsys.readouterr().out == ""  # nothing half-printed before the error
    datapipe.open(cache_dir)  # the cache itself is still readable


def test_info_prints_no_control_character_a_cache_file_holds(cache_dir, capsys):
    """A cache from someone else drove the terminal through info: raw escapes in the source's kind, and C1 controls
    and bidirectional overrides (which JSON leaves as they are) in the configuration."""
    def tamper(doc: dict) -> dict:
        doc["config"]["note"] = "\u202e\x9b31m\u2028"
        doc["config_hash"] = config_hash(doc["config"])
        return doc

    edit_json(cache_dir / "manifest.json", tamper)
    assert cli.main(["info", str(cache_dir)]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\u202e\x9b\u2028\x1b") and "\\u202e\\x9b" in out
    edit_json(cache_dir / "manifest.json", _set(["source", "kind"], "folder\x1b]0;pwned\x07"))
    line = one_line_error(capsys, ["info", str(cache_dir)])
    assert "field 'source.kind' is 'folder\\x1b]0;pwned\\x07', expected 'folder' or 'csv'" in line, line


def _rewrite_index_file(cache_dir: Path, key: str, data: bytes) -> None:
    """Replace labels.npy or paths.json with ``data``, its checksum and size in the manifest made to agree."""
    from datapipe.files import crc32c

    (cache_dir / ("paths.json" if key == "paths" else "labels.npy")).write_bytes(data)
    edit_json(cache_dir / "manifest.json", lambda doc: doc["files"][key].update(
        crc32c=f"{crc32c(data):08x}", **({"nbytes": len(data)} if "nbytes" in doc["files"][key] else {})))


@pytest.mark.parametrize("name", ["../outside.jpg", "/etc/hostname", "a/../../x.jpg", ""])
def test_a_sample_path_that_leaves_any_source_is_refused_by_every_reader(cache_dir, tmp_path, name):
    """paths.json naming an absolute path or going up ('..') had the bench open that file outside --source (and
    copy it into a peer's tar); no build writes one."""
    paths = json.loads((cache_dir / "paths.json").read_text())
    paths[1] = name
    _rewrite_index_file(cache_dir, "paths", json.dumps(paths).encode())
    with pytest.raises(CorruptShardError, match=r"paths.json: sample 1's path .* is no path inside a source"):
        datapipe.open(cache_dir).path(0)
    assert any("is no path inside a source" in p for p in datapipe.open(cache_dir).verify())


def test_verify_finds_class_names_swapped_in_the_manifest_of_a_folder_source(cache_dir):
    """Two names of the class list swapped: every sample of those classes read under the other's name, verify OK."""
    cache = datapipe.open(cache_dir)
    truth = {cache.path(i): cache.classes[cache[i][1]] for i in range(len(cache))}
    assert all(path.split("/")[0] == name for path, name in truth.items())
    edit_json(cache_dir / "manifest.json", lambda doc: doc["classes"].reverse())
    problems = datapipe.open(cache_dir).verify()
    assert len(problems) == 1 and "class folder is not their class's name" in problems[0], problems
    assert re.search(r": \d+ samples' class folder", problems[0]) and "rerun the same `datapipe build`" in problems[0]


def test_a_manifest_declaring_more_samples_than_memory_holds_is_one_line(cache_dir, capsys):
    """5e10 samples declared by a 48 KiB cache: numpy's MemoryError traceback from info and the loader (or, for a
    count the allocator grants, the memory filled first)."""
    n = 50_000_000_000

    def declare(doc: dict) -> None:
        first = doc["shards"][0]
        doc["shards"] = [dict(first, count=n, first=0, nbytes=n * (32 * 32 * 3 + 16) + 4)]  # samples, shard index
        doc["num_samples"] = n

    edit_json(cache_dir / "manifest.json", declare)
    line = one_line_error(capsys, ["info", str(cache_dir)])
    assert f"the manifest declares {n:,} samples, whose labels and order alone take 745.1 GiB, more than" in line, line
    with pytest.raises(CacheError, match="whose labels and order alone take"):
        datapipe.StreamingDataset(cache_dir, batch_size=8)


def test_info_reads_a_valid_report(built, capsys):
    assert cli.main(["info", str(built)]) == 0
    out = capsys.readouterr().out
    assert "last build ok: 0 quarantined" in out and f"{N:,} of shape" in out


# ----------------------------------------------------------------------------- verify


def test_verify_checks_index_files_and_each_shards_own_records(cache_dir):
    assert datapipe.open(cache_dir).verify() == []
    # a shard's zarr.json record disagreeing with the manifest
    meta = cache_dir / "shards" / "000002.zarr" / "zarr.json"
    edit_json(meta, lambda doc: doc["attributes"]["datapipe"].update(crc32c="00000000"))
    problems = datapipe.open(cache_dir).verify()
    assert len(problems) == 1 and "000002.zarr" in problems[0] and "crc32c" in problems[0]
    # a shard's own labels chunk disagreeing with labels.npy
    chunk = shard_labels_path(cache_dir / "shards" / "000003.zarr")
    labels = np.frombuffer(chunk.read_bytes(), "<i8").copy()
    labels[0] += 1
    chunk.write_bytes(labels.tobytes())
    problems = datapipe.open(cache_dir).verify()
    assert len(problems) == 2 and "000003.zarr" in problems[1] and "labels chunk" in problems[1]
    # a zarr.json that is no JSON
    (cache_dir / "shards" / "000004.zarr" / "zarr.json").write_text("[")
    assert any("000004.zarr" in p and "zarr.json" in p for p in datapipe.open(cache_dir).verify())


def test_verify_reports_paths_json_that_is_not_a_list_of_paths(cache_dir):
    from datapipe.files import file_crc32c

    (cache_dir / "paths.json").write_text(json.dumps({"a": 1}))
    edit_json(cache_dir / "manifest.json", _set(["files", "paths", "crc32c"], file_crc32c(cache_dir / "paths.json")))
    cache = datapipe.open(cache_dir)
    problems = cache.verify()
    assert len(problems) == 1 and "paths.json" in problems[0] and "list of" in problems[0]
    with pytest.raises(CacheError, match="paths.json"):
        cache.path(0)


def test_verify_names_every_damaged_shard_not_only_the_first_of_a_wrong_size(cache_dir, capsys):
    """Opening a cache stops at its first shard of the wrong size; verify lists each damaged shard, whatever the
    damage: cut short, grown, gone, something else in the file's place, or altered at the same size."""
    layout = datapipe.open(cache_dir).layout
    data = [images_path(cache_dir / "shards" / f"{s:06d}.zarr", layout) for s in range(6)]
    with open(data[0], "r+b") as f:
        f.truncate(data[0].stat().st_size - 10)
    with open(data[2], "ab") as f:
        f.write(b"\0" * 7)
    data[3].unlink()
    data[4].unlink()
    os.mkfifo(data[4])  # never waited on
    raw = bytearray(data[5].read_bytes())
    raw[5] ^= 0xFF
    data[5].write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match=r"shard 000000\.zarr .* bytes, expected"):
        datapipe.open(cache_dir)
    problems = datapipe.Cache(cache_dir, check_sizes=False).verify()
    named = {p[:12]: p for p in problems}
    assert list(named) == ["shard 000000", "shard 000002", "shard 000003", "shard 000004", "shard 000005"], problems
    assert "bytes, expected" in named["shard 000000"] and "bytes, expected" in named["shard 000002"]
    assert "is missing" in named["shard 000003"] and "checksum" in named["shard 000005"]
    assert any("not a regular file" in p for p in problems if p.startswith("shard 000004"))
    assert cli.main(["verify", str(cache_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[:-1] == problems and f"{len(problems)} problems" in out[-1], out


def test_labels_out_of_the_class_range_are_refused(cache_dir):
    from datapipe.files import file_crc32c

    labels = np.load(cache_dir / "labels.npy")
    labels[5] = 3  # 3 classes
    np.save(cache_dir / "labels.npy", labels)
    edit_json(cache_dir / "manifest.json", _set(["files", "labels", "crc32c"], file_crc32c(cache_dir / "labels.npy")))
    with pytest.raises(CorruptShardError, match="label 3"):
        _ = datapipe.open(cache_dir).labels


# ----------------------------------------------------------------------------- indices


@pytest.mark.parametrize("bad", [[N], [0, N], [-1], [0, -N - 1], [2**40], [-(2**40)]])
def test_out_of_range_indices_are_refused_not_clipped(built, bad):
    cache = datapipe.open(built)
    out, labels = np.zeros((len(bad), 32, 32, 3), np.uint8), np.zeros(len(bad), np.int64)
    with pytest.raises(IndexError, match="out of range"):
        cache.read_batch(np.array(bad), out, labels)
    with pytest.raises(IndexError, match="out of range"):
        cache.sample_views(np.array(bad), labels)
    assert not out.any()


@pytest.mark.parametrize("bad", [1.9, 2.0, "3", True, np.bool_(False), None, slice(0, 2), np.float64(1)])
def test_indices_that_are_no_integers_are_refused_not_converted(built, bad):
    """cache[1.9] was sample 1, cache["3"] sample 3 and cache[True] sample 1: an index is an integer or refused."""
    cache = datapipe.open(built)
    with pytest.raises(TypeError, match="sample index must be an integer") as excinfo:
        cache[bad]
    assert "\n" not in str(excinfo.value)
    with pytest.raises(TypeError, match="sample index must be an integer"):
        cache.path(bad)


def test_integer_indices_of_any_integer_type_are_taken(built, ids):
    import torch

    cache = datapipe.open(built)
    for i in (3, np.int64(3), np.int32(3), torch.tensor(3), 3 - N):
        assert np.array_equal(cache[i][0], cache[3][0]) and cache.path(i) == cache.path(3)


def test_batches_pair_every_image_with_its_label(built, ids):
    cache = datapipe.open(built)
    order = np.random.default_rng(0).permutation(N)
    out, labels, index = np.empty((N, 32, 32, 3), np.uint8), np.empty(N, np.int64), np.empty(N, np.int64)
    assert cache.read_batch(order, out, labels, index) == N
    assert np.array_equal(index, np.arange(N)) and np.array_equal(index_of(out), ids) and np.array_equal(labels, ids % 3)
    views = cache.sample_views(order[:9], labels)
    assert np.array_equal(index_of(np.stack([v.numpy() for v in views])), ids[np.sort(order[:9])])


# ----------------------------------------------------------------------------- files changing under a reader


def test_labels_truncated_after_open_are_an_error_not_label_zero(cache_dir):
    cache = datapipe.open(cache_dir)
    os.truncate(cache_dir / "labels.npy", 128 + 8 * 10)
    out, labels = np.empty((4, 32, 32, 3), np.uint8), np.full(4, -1, np.int64)
    with pytest.raises(CorruptShardError, match="labels.npy"):
        cache.read_batch(np.array([30, 31, 32, 33]), out, labels)
    with pytest.raises(CorruptShardError, match="labels.npy"):
        _ = datapipe.open(cache_dir).labels  # the property reads and checks the file


def test_labels_rewritten_after_open_are_an_error(cache_dir):
    cache = datapipe.open(cache_dir)
    labels = np.load(cache_dir / "labels.npy")
    np.save(cache_dir / "labels.npy", (labels + 1) % 3)  # same size, other content
    with pytest.raises(CorruptShardError, match="changed since it was opened"):
        _ = cache.labels


@pytest.mark.parametrize("name", ["labels.npy", "paths.json"])
def test_an_index_file_removed_after_open_says_the_cache_changed(cache_dir, name):
    """A rebuild in place (`--force`) removes the old build's files: a reader opened before it was told its
    labels.npy "cannot be opened (No such file or directory); rerun the same datapipe build to rewrite it", as
    if the cache were damaged. A file missing since the open is a changed cache; one missing at open is damage."""
    copy = cache_dir
    cache = datapipe.open(copy)
    (copy / name).unlink()
    with pytest.raises(CorruptShardError) as err:
        _ = cache.labels if name == "labels.npy" else cache.path(0)
    assert str(err.value) == (f"{name.split('.')[0]} file ({copy / name}) is gone: the cache changed since it was "
                              "opened (rebuilt or altered); reopen it (a new datapipe.open / dataset), or rerun the "
                              "same `datapipe build` if it is damaged")
    with pytest.raises(CacheError, match=rf"{name}.* is missing; rerun the same `datapipe build` to rewrite it"):
        reopened = datapipe.open(copy)
        _ = reopened.labels if name == "labels.npy" else reopened.path(0)


@pytest.mark.parametrize("size", [0, 100, "half"])
def test_shard_truncated_after_open_is_an_error_naming_it(cache_dir, size):
    cache = datapipe.open(cache_dir)
    data = images_path(cache_dir / "shards" / "000001.zarr")
    os.truncate(data, data.stat().st_size // 2 if size == "half" else size)
    out, labels = np.empty((2, 32, 32, 3), np.uint8), np.empty(2, np.int64)
    with pytest.raises(CorruptShardError, match="000001.zarr") as err:
        cache.read_batch(np.array([7, 13]), out, labels)
    assert "changed since it was opened" in str(err.value) and "\n" not in str(err.value)
    cache.read_batch(np.array([0, 14]), out, labels)  # other shards still read


def test_shard_truncated_after_its_file_was_opened(cache_dir):
    """The open descriptor sees the shrink: one fstat per shard per batch, and a short read."""
    cache = datapipe.open(cache_dir)
    out, labels = np.empty((2, 32, 32, 3), np.uint8), np.empty(2, np.int64)
    cache.read_batch(np.array([7, 13]), out, labels)
    os.truncate(images_path(cache_dir / "shards" / "000001.zarr"), 3072 * 3)
    with pytest.raises(CorruptShardError, match="000001.zarr"):
        cache.read_batch(np.array([7, 13]), out, labels)


def _build_other(tmp: Path) -> Path:
    """A build of the same number of samples and shard sizes whose samples sit in other places."""
    return build_index_cache(tmp, N, classes=5, shard_size=SHARD)


def test_shard_replaced_by_a_rebuild_never_pairs_new_images_with_old_labels(cache_dir, tmp_path, ids):
    other = _build_other(tmp_path / "other")
    cache = datapipe.open(cache_dir)
    out, labels, index = np.empty((N, 32, 32, 3), np.uint8), np.empty(N, np.int64), np.empty(N, np.int64)
    cache.read_batch(np.arange(0, 7), out, labels, index)  # shard 0's file is open from here on
    for name in ("000000.zarr", "000001.zarr"):  # a rebuild: new folders renamed into place
        staged = cache_dir / "shards" / f".tmp-{name}"
        shutil.copytree(other / "shards" / name, staged)
        shutil.rmtree(cache_dir / "shards" / name)
        os.rename(staged, cache_dir / "shards" / name)
    shutil.copy(other / "labels.npy", cache_dir / ".tmp-labels.npy")
    os.replace(cache_dir / ".tmp-labels.npy", cache_dir / "labels.npy")
    n = cache.read_batch(np.arange(0, 7), out, labels, index)  # the open file: the build it opened
    assert np.array_equal(index_of(out[:n]), ids[:7]) and np.array_equal(labels[:n], ids[:7] % 3)
    with pytest.raises(CorruptShardError, match="000001.zarr.*changed since it was opened"):
        cache.read_batch(np.arange(7, 14), out, labels)
    cache._files.limit = 0  # descriptors closed as soon as they are idle: shard 0 must be reopened
    cache.read_batch(np.arange(14, 21), out, labels)
    with pytest.raises(CorruptShardError, match="000000.zarr"):
        cache.read_batch(np.arange(0, 7), out, labels)


@pytest.mark.parametrize("before, after", [({"encoding": "raw"}, {"encoding": "jpeg"}),
                                           ({"encoding": "jpeg"}, {"encoding": "raw"}),
                                           ({"fit": "short"}, {"fit": "crop"})],
                         ids=["raw-to-jpeg", "jpeg-to-raw", "short-to-crop"])
def test_a_reader_of_a_cache_rebuilt_into_another_layout_is_told_it_changed(tmp_path, imaging, before, after):
    """Rebuilt with --force into another shard layout, a shard's files are at other paths (a file where a
    folder was, no sample index): the reader must say the cache changed, not advise rebuilding it (which
    would undo the new build) or checking the storage."""
    src, out = tmp_path / "src", tmp_path / "out"
    imaging.write_source(src, {"a": 6, "b": 6}, variety=False)
    options = {"size": 32, "shard_size": 4, "cluster": datapipe.Cluster(scheduler="sync"), "progress": False}
    datapipe.build(src, out, **options, **before)
    cache = datapipe.open(out)
    labels = np.empty(1, np.int64)
    cache.read_samples(np.array([0]), labels)  # shard 0 in use
    datapipe.build(src, out, force=True, **options, **after)
    with pytest.raises(CorruptShardError, match="000002.zarr.*the cache changed since it was opened"):
        cache.read_samples(np.array([11]), labels)


def test_a_cache_a_build_is_writing_says_so_rather_than_unfinished(cache_dir, capsys):
    """Opened (info, verify, open) while a build holds its lock, without a manifest: that build is named;
    the advice for an unfinished build, to run it again, would only meet that build's lock."""
    import fcntl
    import socket

    (cache_dir / "manifest.json").unlink()  # as a rebuild that changes a shard does first
    fd = os.open(cache_dir / ".datapipe.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "now"}).encode())
        running = rf"a datapipe build is writing it now \(pid {os.getpid()} on host"
        with pytest.raises(CacheError, match=running):
            datapipe.open(cache_dir)
        for command in ("info", "verify"):
            assert "writing it now" in one_line_error(capsys, [command, str(cache_dir)])
    finally:
        os.close(fd)
    with pytest.raises(CacheError, match="did not finish"):  # its lock released: a build that did not finish
        datapipe.open(cache_dir)


def test_many_shards_hold_a_bounded_number_of_descriptors(tmp_path, ids):
    cache_dir = build_index_cache(tmp_path, 60, shard_size=1)  # 60 shards
    cache = datapipe.open(cache_dir)
    cache._files.limit = 8
    before = len(os.listdir("/proc/self/fd"))
    out, labels = np.empty((60, 32, 32, 3), np.uint8), np.empty(60, np.int64)
    for _ in range(3):
        cache.read_batch(np.random.default_rng(1).permutation(60), out, labels)
    assert len(cache._files) <= 8 and len(os.listdir("/proc/self/fd")) <= before + 8
    assert np.array_equal(index_of(out), index_map(cache_dir))


READER = textwrap.dedent("""
    import sys, numpy as np, torch, datapipe
    from datapipe.errors import DatapipeError
    from datapipe.testing import index_map, index_of
    cache, mode = sys.argv[1], sys.argv[2]
    ids = index_map(cache)
    ds = datapipe.StreamingDataset(cache, batch_size=4, seed=1, return_index=True)
    if mode == "device":
        loader = datapipe.DeviceLoader(ds, device="cpu", output="uint8", num_workers=2, prefetch=1)
    else:
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, prefetch_factor=1)
    told = False
    try:
        for epoch in range(6):
            ds.set_epoch(epoch) if mode != "device" else loader.set_epoch(epoch)
            for images, labels, index in loader:
                i = index.numpy()
                # every batch pairs the images and labels of one build
                assert np.array_equal(index_of(images.numpy()), ids[i]) and np.array_equal(labels.numpy(), ids[i] % 3)
                if not told:
                    print("ready", flush=True)
                    sys.stdin.readline()  # the test damages the cache now
                    told = True
    except DatapipeError as exc:
        print("ERROR", type(exc).__name__, str(exc).splitlines()[0] if mode == "device" else str(exc), flush=True)
        sys.exit(3)
    print("DONE", flush=True)
""")


def _run_reader(cache_dir: Path, mode: str, damage) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-c", READER, str(cache_dir), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        damage()
        out, err = proc.communicate("go\n", timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("mode", ["device", "dataloader"])
def test_shard_truncated_under_a_running_loader_is_an_error_not_sigbus(cache_dir, mode):
    data = images_path(cache_dir / "shards" / "000003.zarr")
    done = _run_reader(cache_dir, mode, lambda: os.truncate(data, data.stat().st_size // 3))
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr[-2000:])  # not -7 (SIGBUS) or 135
    assert "CorruptShardError" in done.stdout and "000003.zarr" in done.stdout


@pytest.mark.parametrize("mode", ["device", "dataloader"])
def test_cache_rebuilt_under_a_running_loader_never_mixes_builds(cache_dir, tmp_path, mode):
    other = _build_other(tmp_path / "other")

    def rebuild():
        for name in sorted(os.listdir(cache_dir / "shards")):
            staged = cache_dir / "shards" / f".tmp-{name}"
            shutil.copytree(other / "shards" / name, staged)
            shutil.rmtree(cache_dir / "shards" / name)
            os.rename(staged, cache_dir / "shards" / name)
        for name in ("labels.npy", "paths.json", "manifest.json"):
            shutil.copy(other / name, cache_dir / f".tmp-{name}")
            os.replace(cache_dir / f".tmp-{name}", cache_dir / name)

    done = _run_reader(cache_dir, mode, rebuild)
    # The reader's own check (index_of(images) == ids, labels == ids % 3 of the build it opened)
    # would end it with an AssertionError (rc 1); it ends with the old data or the clear error.
    assert done.returncode in (0, 3), (done.returncode, done.stdout, done.stderr[-2000:])
    if done.returncode == 3:
        assert "changed since it was opened" in done.stdout


def test_a_pickled_cache_checks_the_files_it_was_opened_with(cache_dir):
    import pickle

    cache = datapipe.open(cache_dir)
    copy = pickle.loads(pickle.dumps(cache))
    data = images_path(cache_dir / "shards" / "000002.zarr")
    os.truncate(data, 10)
    out, labels = np.empty((1, 32, 32, 3), np.uint8), np.empty(1, np.int64)
    with pytest.raises(CorruptShardError, match="000002.zarr"):
        copy.read_batch(np.array([15]), out, labels)
    assert isinstance(CorruptShardError("x"), DatapipeError)


# ----------------------------------------------------------------------------- the process's descriptors


def test_caches_open_in_one_process_share_one_budget_of_open_shard_files(built, tmp_path, ids, monkeypatch):
    """Each cache kept up to a quarter of the descriptor limit open: train, validation and test sets of many
    shards read in one process (ulimit -n 1024) ran out of descriptors at the fourth. All caches together
    now stay within one budget, and every read is still right."""
    from datapipe.cache import _ShardFiles

    monkeypatch.setattr(_ShardFiles, "budget", 4)
    caches = [datapipe.open(shutil.copytree(built, tmp_path / f"c{k}")) for k in range(3)]
    base = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        for cache in caches:
            for i in range(0, N, 3):  # every shard of each, in turn
                image, label = cache[i]
                assert index_of(image[None])[0] == ids[i]
                assert sum(len(c._files) for c in caches) <= 4
                assert len(os.listdir("/proc/self/fd")) <= base + 4
    assert sum(len(c._files) for c in caches) == 4


def test_the_least_recently_used_idle_shard_files_are_closed_first_across_caches(built, tmp_path, monkeypatch):
    """Eviction finds the least recently used files from the front of each cache's order (a walk over every open
    file per shard opened made a shuffled epoch over thousands of shards 4 times slower): the order it closes in
    is still the least recently used first, within a cache and across the caches sharing the budget."""
    from datapipe.cache import _ShardFiles

    monkeypatch.setattr(_ShardFiles, "budget", 4)
    a, b = (datapipe.open(shutil.copytree(built, tmp_path / name)) for name in "ab")

    def read(cache, shard):
        cache[shard * SHARD]

    def open_shards():
        return sorted(a._files._open), sorted(b._files._open)

    for cache, shard in [(a, 0), (a, 1), (a, 2), (b, 0)]:
        read(cache, shard)
    assert open_shards() == ([0, 1, 2], [0])
    read(a, 0)  # used again: now the most recent of a's
    read(b, 1)  # one over the budget: a's shard 1 is the least recently used of all
    assert open_shards() == ([0, 2], [0, 1])
    a._files.limit = 2  # a's own limit: its least recently used goes first (2, read before 0 was read again)
    read(a, 3)
    assert open_shards() == ([0, 3], [0, 1])
    read(b, 0)
    read(b, 2)  # a's 0 is the least recent of all now (read before b's 1 and a's 3)
    assert open_shards() == ([3], [0, 1, 2])


@pytest.mark.skipif(not native.guard_available(), reason="memory maps are used under the SIGBUS guard only")
def test_a_fault_in_any_open_shards_map_is_named_by_that_shard_after_maps_came_and_went(built, monkeypatch):
    """The shard a faulting address belongs to is looked up among the maps' ranges kept in address order (a walk
    over every range per shard opened was one of the costs of a shuffled epoch over thousands of shards): after
    many maps made and unmapped (addresses reused), each open shard's first, middle and last byte name it, and an
    address in no map names none."""
    from datapipe.cache import _ShardFiles
    from datapipe.errors import MappedReadError

    monkeypatch.setattr(_ShardFiles, "budget", 3)
    cache = datapipe.open(built)
    for k in np.random.default_rng(0).integers(0, N, 200).tolist():
        cache[k]
        for shard, entry in list(cache._files._open.items()):
            m = entry.mapping
            for address in (m.address, m.address + m.length // 2, m.address + m.length - 1):
                named = cache.shard_error(MappedReadError("fault", address))
                assert f"shard {shard:06d}.zarr" in str(named), (shard, str(named))
    assert sorted(cache._map_ranges) == cache._map_starts and len(cache._map_starts) <= 64  # swept
    lone = MappedReadError("fault", 8)
    assert cache.shard_error(lone) is lone


@pytest.mark.skipif(not native.guard_available(), reason="memory maps are used under the SIGBUS guard only")
def test_a_fault_in_an_earlier_map_of_a_reopened_shard_names_that_shard(cache_dir):
    """A reader thread holds views of a shard's map, released to the cache, while another closes the shard and
    opens it again (a cache with more shards than stay open): the shard then has two maps. A fault in the earlier
    one, the shard truncated, was a bare "a memory-mapped file shrank" naming no shard: only the newest map's
    range was kept."""
    import torch

    cache = datapipe.Cache(cache_dir)
    cache._files.limit = 1  # one shard file open at a time
    labels = np.empty(8, np.int64)
    views = cache.sample_views(np.arange(3), labels, mapped=True)  # shard 0's map, its file released
    cache.read_batch(np.array([SHARD]), np.empty((1, 32, 32, 3), np.uint8), labels)  # shard 1 opened: 0 closed
    cache.read_batch(np.array([0]), np.empty((1, 32, 32, 3), np.uint8), labels)  # shard 0 opened again: a new map
    os.truncate(images_path(cache.root / "shards" / "000000.zarr", cache.layout), 0)
    reading = cache.mapped_reads(np.arange(3))
    with pytest.raises(CorruptShardError, match=r"shard 000000\.zarr .* ends early") as caught, reading:
        native.resize(views[0], torch.empty((16, 16, 3), dtype=torch.uint8))
    assert type(caught.value) is CorruptShardError


EMFILE_SCRIPT = r"""
import os, resource, sys
import datapipe
from datapipe.errors import DatapipeError

cache_dir, when = sys.argv[1], sys.argv[2]
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
cache = datapipe.open(cache_dir)  # (also imports what opening needs: an import needs descriptors too)
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    if when == "open":
        datapipe.open(cache_dir)
    elif when == "labels":
        cache.labels
    else:
        cache[int(when)]
except DatapipeError as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.parametrize("when", ["open", "labels", "0", "39"])
def test_running_out_of_descriptors_is_said_so_never_blamed_on_the_cache(built, tmp_path, when):
    """EMFILE was a CorruptShardError or CacheError with the advice to rebuild the cache or move its manifest
    away (which makes a whole cache unfinished): it names the limit, and says the file is fine."""
    script = tmp_path / "emfile.py"
    script.write_text(EMFILE_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(built), when], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout.strip()
    assert out.startswith("TooManyOpenFilesError ") and "reached its limit of open files (64, `ulimit -n`)" in out, out
    assert "nothing is wrong with the file" in out and "rerun" not in out and "move it away" not in out, out


def test_the_advice_for_a_shard_altered_after_the_build_repairs_it(built, tmp_path):
    """A sample index altered in place (same size): the reader's advice was a plain rerun of the build, which
    checks sizes only and said "nothing to do"; the advice is --verify, and following it repairs the cache."""
    from datapipe.shards import index_path

    source, out = built.parent / "source", tmp_path / "jpeg"
    kwargs = {"size": 32, "shard_size": SHARD, "encoding": "jpeg", "progress": False,
              "cluster": datapipe.Cluster(scheduler="sync")}
    datapipe.build(source, out, **kwargs)
    index = index_path(out / "shards" / "000001.zarr")
    data = bytearray(index.read_bytes())
    data[8] ^= 1  # the first sample's byte count, one off
    index.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="altered after the build.*rerun the same `datapipe build` with --verify"):
        datapipe.open(out)[SHARD]
    assert datapipe.build(source, out, **kwargs).shards_built == 0  # a plain rerun: sizes match, nothing to do
    with pytest.raises(CorruptShardError):
        datapipe.open(out)[SHARD]
    assert datapipe.build(source, out, verify=True, **kwargs).shards_built == 1  # as the message says
    cache = datapipe.open(out)
    assert cache[SHARD][0].shape == (32, 32, 3) and cache.verify() == []


def _put_shard_in_place(out: Path, case: str, tmp_path: Path) -> None:
    """Shard 1 of ``out`` replaced by a folder of the same size that is not the manifest's shard 1."""
    target = out / "shards" / "000001.zarr"
    if case == "another cache's":  # another cache of the same shape and configuration (other images)
        other = build_index_cache(tmp_path / "other", N, shard_size=SHARD, seed=1)
        donor = other / "shards" / "000001.zarr"
    elif case == "another shard of this cache":  # shard 2 copied over shard 1 (the same sample count)
        donor = out / "shards" / "000002.zarr"
    else:  # "an older copy of itself": kept before one of its images changed and the cache was rebuilt in place
        donor = tmp_path / "older"
        shutil.copytree(target, donor)
        source = out.parent / "source"
        images = sorted(p for p in source.rglob("*") if p.is_file())
        shutil.copyfile(images[SHARD], images[SHARD + 1])  # the first two samples of shard 1 alike
        datapipe.build(source, out, size=32, shard_size=SHARD, cluster=datapipe.Cluster(scheduler="sync"),
                       progress=False)
    shutil.rmtree(target)
    shutil.copytree(donor, target)


@pytest.mark.parametrize("case", ["another cache's", "another shard of this cache", "an older copy of itself"])
def test_a_shard_put_in_place_of_one_of_the_cache_is_refused_and_the_advice_repairs_it(tmp_path, case, capsys):
    """A shard folder copied in from another cache of the same shape (or another shard of the same size, or an
    older copy) was read silently: its pixels with this cache's labels. Its zarr.json is checked the first time
    a reader opens it (build, position, count, checksum); verify names it; its advice (move it away, rebuild)
    repairs the cache: another build's shard is moved away first (the build never deletes what it did not write:
    the advice to rerun it met that refusal), one of this build's is rewritten by a rerun with --verify."""
    foreign = case == "another cache's"
    advice = (r"move the shard's folder away and rerun the same `datapipe build`" if foreign else
              r"rerun the same `datapipe build` with --verify")
    cache = build_index_cache(tmp_path / "mine", N, shard_size=SHARD)
    source = cache.parent / "source"
    _put_shard_in_place(cache, case, tmp_path)
    opened = datapipe.open(cache)  # sizes match: opening says nothing
    assert opened[0][0].shape == (32, 32, 3)  # the other shards read on
    with pytest.raises(CorruptShardError, match=r"shard 000001\.zarr .* is not the one this cache's manifest lists: "
                       r"its zarr.json says (build_id|shard|crc32c) .*" + advice):
        opened[SHARD]
    ds = datapipe.StreamingDataset(cache, batch_size=8, shuffle=False)
    with pytest.raises(CorruptShardError, match="000001.zarr"):
        list(ds)
    assert cli.main(["verify", str(cache)]) == 1
    out = capsys.readouterr().out
    if foreign:
        assert "move the shard's folder away" in out and "move the shard folders named away; then `datapipe build" in out
        shutil.move(cache / "shards" / "000001.zarr", tmp_path / "moved-away")
    else:
        assert "`datapipe build SOURCE OUTPUT --verify` rewrites it" in out and "move" not in out
    report = datapipe.build(source, cache, size=32, shard_size=SHARD, cluster=datapipe.Cluster(scheduler="sync"),
                            progress=False, verify=not foreign)
    assert report.shards_built == 1
    repaired = datapipe.open(cache)
    assert repaired.verify() == []
    fresh = datapipe.build(source, tmp_path / "fresh", size=32, shard_size=SHARD,
                           cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    expected = datapipe.open(fresh.output)
    for i in range(N):  # every sample and label as a build of the source into a new folder has them
        assert np.array_equal(repaired[i][0], expected[i][0]) and repaired[i][1] == expected[i][1], i


@pytest.mark.parametrize("fit", ["short", "crop"])
def test_a_shard_of_another_cache_in_a_cache_with_sample_indexes_is_named_so(tmp_path, fit):
    """A JPEG or --fit short cache reads a shard's sample index before its data: for a shard copied in from
    another cache, the index's checksum error came first and advised --verify, which the build then refused (a
    folder not its own). The record is checked before the index; following its advice repairs the cache."""
    kwargs = dict(size=32, shard_size=SHARD, fit=fit, encoding="jpeg", cluster=datapipe.Cluster(scheduler="sync"),
                  progress=False)
    sources = [build_index_cache(tmp_path / name, 21, shard_size=SHARD, seed=seed).parent / "source"
               for name, seed in (("a", 0), ("b", 1))]
    mine, other = tmp_path / "mine", tmp_path / "other"
    datapipe.build(sources[0], mine, **kwargs)
    datapipe.build(sources[1], other, **kwargs)
    shutil.rmtree(mine / "shards" / "000001.zarr")
    shutil.copytree(other / "shards" / "000001.zarr", mine / "shards" / "000001.zarr")
    with pytest.raises(CorruptShardError, match=r"zarr.json says build_id .*move the shard's folder away"):
        datapipe.open(mine)[SHARD]
    shutil.move(mine / "shards" / "000001.zarr", tmp_path / "moved-away")
    assert datapipe.build(sources[0], mine, **kwargs).shards_built == 1
    assert datapipe.open(mine).verify() == []


def test_a_shard_folder_moved_away_by_a_running_rebuild_is_a_change_not_damage(cache_dir, monkeypatch):
    """A rebuild renames a shard's folder away before it writes it again. A reader that had just opened the shard's
    data file found no zarr.json and advised moving the folder away, while a build was writing it; it says the
    cache is being rewritten."""
    import datapipe.cache as cache_module
    from datapipe.output import BuildLock

    cache = datapipe.open(cache_dir)
    lock = BuildLock(cache_dir)
    lock.acquire()  # a build of this output runs
    real = cache_module.open_for_reading
    folder = cache_dir / "shards" / "000001.zarr"

    def open_then_moved(path, *args, **kwargs):
        fd = real(path, *args, **kwargs)
        if str(path).startswith(str(folder)) and folder.exists():
            os.rename(folder, folder.with_name(".tmp-stale-000001.zarr-1"))  # the rebuild's step, at that moment
        return fd

    monkeypatch.setattr(cache_module, "open_for_reading", open_then_moved)
    try:
        with pytest.raises(CorruptShardError, match=r"is being rewritten by a datapipe build \(pid \d+.*the cache "
                                                     r"changed since it was opened") as excinfo:
            cache[SHARD]
        assert "move the shard's folder away" not in str(excinfo.value)
    finally:
        lock.release()


@pytest.mark.parametrize("damage", ["missing", "not JSON"])
def test_the_advice_for_a_shard_without_its_record_repairs_it(cache_dir, built, damage, capsys):
    """A shard whose zarr.json is missing or damaged: verify said to rerun the build, which refused it as a folder
    no build can tell to be its own. The advice is to move the folder away first; following it repairs the cache."""
    meta = cache_dir / "shards" / "000001.zarr" / "zarr.json"
    meta.unlink() if damage == "missing" else meta.write_text("{not json")
    with pytest.raises(CorruptShardError, match="move the shard's folder away"):
        datapipe.open(cache_dir)[SHARD]
    assert cli.main(["verify", str(cache_dir)]) == 1
    assert "move the shard's folder away" in capsys.readouterr().out
    shutil.move(cache_dir / "shards" / "000001.zarr", cache_dir.parent / "moved-away")
    datapipe.build(built.parent / "source", cache_dir, size=32, shard_size=SHARD, cluster=datapipe.Cluster(scheduler="sync"),
                   progress=False)
    assert datapipe.open(cache_dir).verify() == []


# ----------------------------------------------------------------------------- closing


def open_shard_files(root: Path) -> list[str]:
    """The files under ``root`` this process holds open (its descriptors' targets)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(root.resolve()) + os.sep):
                found.append(target)
    return found


def read_all(cache) -> np.ndarray:
    return np.stack([cache[i][0] for i in range(len(cache))])


@pytest.mark.parametrize("how", ["cache", "dataset", "with-cache", "with-dataset"])
def test_close_closes_the_shard_files_and_the_cache_stays_usable(cache_dir, how):
    """close() (or the end of a with block) closes every shard file the cache opened; reading afterwards
    opens them again and reads the same samples."""
    if how.endswith("dataset"):
        ds = datapipe.StreamingDataset(cache_dir, batch_size=8, shuffle=False)
        cache = ds.cache
        first = torch.cat([images for images, _ in ds])
    else:
        cache = ds = datapipe.open(cache_dir)
        first = torch.from_numpy(read_all(cache))
    assert len(open_shard_files(cache_dir)) == len(cache.counts)  # every shard read, every one open
    if how.startswith("with"):
        with ds as entered:
            assert entered is ds
    else:
        ds.close()
    assert open_shard_files(cache_dir) == []
    again = torch.cat([images for images, _ in ds]) if how.endswith("dataset") else torch.from_numpy(read_all(cache))
    assert len(open_shard_files(cache_dir)) == len(cache.counts)
    assert len(first) == N and torch.equal(first, again)
    ds.close()


def test_a_file_in_use_is_closed_when_its_reader_releases_it(cache_dir):
    """close() never closes a descriptor under a reader thread (its number could be reused by another open and
    read the wrong file): a shard in use is closed when it is released, and one read again stays open."""
    cache = datapipe.open(cache_dir)
    read_all(cache)
    files = cache._files
    entry = files.acquire(0, lambda: pytest.fail("shard 0 is open already"))
    cache.close()
    assert len(open_shard_files(cache_dir)) == 1 and os.fstat(entry.fd)  # the one in use
    files.release(0)
    assert open_shard_files(cache_dir) == []
    files.acquire(0, lambda: cache._open_shard(0))
    cache.close()
    files.acquire(0, lambda: pytest.fail("shard 0 is open still"))  # read again while the close waited
    files.release(0)
    files.release(0)
    assert len(open_shard_files(cache_dir)) == 1  # in use again after the close: kept open, as any read leaves it


@pytest.mark.parametrize("indices", [[1.7, 2.9], np.array([1.0, 2.0]), np.array([True, False, True]), ["5", "6"],
                                     [[1, 2], [3.5, 4]]], ids=["floats", "whole floats", "mask", "strings", "nested"])
def test_batch_reads_take_integer_indices_only(built, indices):
    """read_batch and read_samples refuse what cache[i] refuses: a mask read as indices read samples 0, 1, 1 (one
    twice, one never) and floats were truncated, with no error."""
    cache = datapipe.open(built)
    out, labels = np.empty((4, *cache.shape), np.uint8), np.empty(4, np.int64)
    with pytest.raises(TypeError, match=r"sample indices must be integers \(read_batch, read_samples\), got "):
        cache.read_batch(indices, out, labels)
    with pytest.raises(TypeError, match="sample indices must be integers"):
        cache.read_samples(indices, labels)


@pytest.mark.parametrize("indices", [np.array([3, 1], np.int32), np.array([3, 1], np.uint8), [3, 1], torch.tensor([3, 1]),
                                     (np.int64(3), 1)])
def test_batch_reads_take_integers_of_any_kind(built, indices):
    cache = datapipe.open(built)
    out, labels, index = np.empty((2, *cache.shape), np.uint8), np.empty(2, np.int64), np.empty(2, np.int64)
    assert cache.read_batch(indices, out, labels, index) == 2
    assert index.tolist() == [1, 3] and np.array_equal(out[0], cache[1][0]) and labels.tolist() == [cache[1][1], cache[3][1]]


def test_a_huge_unsigned_index_is_named_as_given(built):
    cache = datapipe.open(built)
    with pytest.raises(IndexError, match=f"sample index {2**63 + 5} out of range"):
        cache.read_batch(np.array([2**63 + 5], np.uint64), np.empty((1, *cache.shape), np.uint8), np.empty(1, np.int64))
