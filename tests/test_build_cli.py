"""The `datapipe` build, info and verify commands: one-line errors in process and in a subprocess; the
isolated probe's report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from build_fixtures import (
    SHARD,
    SIZE,
    check_cache_matches_source,
    flip_byte,
    images_file,
)

import datapipe
from datapipe.cli import main as cli_main
from datapipe.codecs import DecodeSpec, decode_sample

# ----------------------------------------------------------------------------- CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datapipe.cli", *args], check=False, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def the_error_line(stderr: str) -> str:
    """The one error line of a build that logged progress before failing."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("datapipe build: error: "), stderr
    return errors[0]


def assert_one_line_error(stderr: str, command: str = "build") -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith(f"datapipe {command}: error: "), stderr
    return lines[0]


def test_cli_build_info_verify(source, tmp_path, capsys):
    out = tmp_path / "cache"
    args = ["build", str(source[0]), str(out), "--size", str(SIZE), "--shard-size", str(SHARD),
            "--scheduler", "sync", "--quiet"]
    assert cli_main(args) == 0
    assert len(datapipe.open(out)) == len(source[1])
    capsys.readouterr()
    assert cli_main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"{len(source[1])} of shape ({SIZE}, {SIZE}, 3)" in text and "café" in text
    assert cli_main(["verify", str(out)]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli_main(args) == 0  # a rerun is a no-op and still succeeds
    flip_byte(images_file(out, 0), 7)
    assert cli_main(["verify", str(out)]) == 1
    assert "000000.zarr" in capsys.readouterr().out


def test_cli_info_env(capsys):
    assert cli_main(["info", "--env"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert "jpeg" in env["decoders"] and env["zarr"].startswith("3")


def test_cli_errors_in_process(source, built_copy, tmp_path, capsys):
    assert cli_main(["build", str(tmp_path / "missing"), str(tmp_path / "o"), "--scheduler", "sync"]) == 2
    line = assert_one_line_error(capsys.readouterr().err)
    assert "does not exist" in line
    args = ["build", str(source[0]), str(built_copy), "--size", "48", "--shard-size", str(SHARD),
            "--scheduler", "sync", "--quiet"]
    assert cli_main(args) == 2
    line = assert_one_line_error(capsys.readouterr().err)
    assert "another configuration" in line and "--force" in line
    m = json.loads((built_copy / "manifest.json").read_text(encoding="utf-8"))
    m["version"] = 999
    (built_copy / "manifest.json").write_text(json.dumps(m))
    assert cli_main(["info", str(built_copy)]) == 2
    assert "999" in assert_one_line_error(capsys.readouterr().err, "info")
    assert cli_main(["verify", str(built_copy)]) == 2
    assert "999" in assert_one_line_error(capsys.readouterr().err, "verify")


def test_cli_too_many_bad_files(bad_source, tmp_path, capsys):
    args = ["build", str(bad_source[0]), str(tmp_path / "o"), "--size", str(SIZE), "--scheduler", "sync",
            "--quiet", "--max-bad-fraction", "0.01"]
    assert cli_main(args) == 2
    assert "dog/" in the_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("option", [["--size", "4"], ["--max-bad-fraction", "2"]], ids=["size", "fraction"])
def test_cli_invalid_values_are_one_line_errors(source, tmp_path, capsys, option):
    code = cli_main(["build", str(source[0]), str(tmp_path / "o"), "--scheduler", "sync", "--quiet", *option])
    assert code == 2
    assert_one_line_error(capsys.readouterr().err)


@pytest.mark.parametrize("fit", ["pad", "stretch"])
def test_cli_fit_pad_and_stretch(tmp_path, imaging, fit):
    """--fit reaches every sample: pad letterboxes on white, stretch fills the square."""
    root = tmp_path / "src"
    files = imaging.write_source(root, {"a": 4, "b": 3})  # landscape and portrait, JPEG and PNG
    out = tmp_path / "out"
    assert cli_main(["build", str(root), str(out), "--size", str(SIZE), "--fit", fit, "--shard-size", "4",
                     "--scheduler", "sync", "--quiet"]) == 0
    spec = DecodeSpec(size=SIZE, fit=fit)
    check_cache_matches_source(out, root, files, spec)
    cache = datapipe.open(out)
    assert cache.manifest.config["fit"] == fit
    corners = np.stack([cache[i][0][0, 0] for i in range(len(cache))])
    assert (corners == 255).all(axis=1).any() == (fit == "pad")  # white borders only when padded
    crop = decode_sample((root / cache.path(0)).read_bytes(), DecodeSpec(size=SIZE))
    assert not np.array_equal(cache[0][0], crop)  # not the default center crop


def test_cli_empty_source_max_pixels_and_force(tmp_path, source, capsys):
    (tmp_path / "empty").mkdir()
    assert cli_main(["build", str(tmp_path / "empty"), str(tmp_path / "o"), "--scheduler", "sync", "--quiet"]) == 2
    assert "no image files" in assert_one_line_error(capsys.readouterr().err)
    out = tmp_path / "cache"
    base = ["build", str(source[0]), str(out), "--size", str(SIZE), "--shard-size", str(SHARD), "--scheduler",
            "sync", "--quiet"]
    assert cli_main([*base, "--max-pixels", "1000", "--max-bad-fraction", "1"]) == 0  # every image is too large
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    assert report["num_samples"] == 0 and {q["error"] for q in report["quarantined"]} == {"too-large"}
    assert "max_pixels=1,000" in report["quarantined"][0]["reason"]
    capsys.readouterr()
    assert cli_main(["info", str(out)]) == 0
    n = len(source[1])
    assert f"last build ok: {n} quarantined ({n} too-large)" in capsys.readouterr().out
    assert cli_main(base) == 2  # another configuration: refused ...
    assert "--force" in assert_one_line_error(capsys.readouterr().err)
    assert cli_main([*base, "--force"]) == 0  # ... unless forced
    assert len(datapipe.open(out)) == len(source[1])


@pytest.mark.parametrize("named", [True, False], ids=["file-named", "no-file-named"])
def test_cli_os_error_mid_build_is_one_line_and_keeps_finished_shards(tmp_path, source, capsys, monkeypatch, named):
    """The disk filling up in the third shard: one line naming the file (the output folder when the
    error names none, as a full disk's write() does), exit 1, two shards kept."""
    import errno

    from datapipe import shards, writer

    add, calls = writer.ShardWriter.add, []

    def add_until_full(self, image, label, path):
        calls.append(path)
        if len(calls) > 2 * SHARD:
            where = (str(shards.images_path(self.tmp_dir)),) if named else ()
            raise OSError(errno.ENOSPC, "No space left on device", *where)
        add(self, image, label, path)

    monkeypatch.setattr(writer.ShardWriter, "add", add_until_full)
    out = tmp_path / "out"
    args = ["build", str(source[0]), str(out), "--size", str(SIZE), "--shard-size", str(SHARD), "--scheduler",
            "sync", "--quiet"]
    assert cli_main(args) == 1
    line = the_error_line(capsys.readouterr().err)  # after the build's progress lines
    assert "No space left on device" in line and "rerun to resume" in line
    assert ".tmp-000002" in line if named else f"while writing {out}" in line
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["000000.zarr", "000001.zarr"]
    monkeypatch.setattr(writer.ShardWriter, "add", add)
    assert cli_main(args) == 0  # the rerun builds only what is missing
    assert json.loads((out / "report.json").read_text(encoding="utf-8"))["shards_skipped"] == 2


def test_probe_reports_the_class_and_reason(tmp_path):
    """The isolated decoder (used after a shard killed its worker) reports like the build does."""
    from dataclasses import asdict

    spec = json.dumps(asdict(DecodeSpec(size=SIZE)))
    (tmp_path / "text.jpg").write_text("no image here")
    for name, error, reason in [("missing.jpg", "unreadable", "FileNotFoundError"),
                                ("text.jpg", "not-an-image", "not an image")]:
        proc = subprocess.run([sys.executable, "-m", "datapipe.probe", str(tmp_path / name), spec],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 3, proc.stderr
        entry = json.loads(proc.stdout)
        assert entry["error"] == error and reason in entry["reason"], entry


def test_cli_subprocess_errors(tmp_path, source):
    proc = run_cli("build", str(tmp_path / "missing"), str(tmp_path / "out"), "--scheduler", "sync")
    assert proc.returncode == 2
    assert "does not exist" in assert_one_line_error(proc.stderr)
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    proc = run_cli("build", str(source[0]), str(blocker / "out"), "--scheduler", "sync", "--quiet")
    assert proc.returncode == 2
    assert "cannot create output folder" in assert_one_line_error(proc.stderr)
    proc = run_cli("build", str(source[0]), str(tmp_path / "x"), "--fit", "zoom")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "zoom" in proc.stderr


# ----------------------------------------------------------------------------- file:// URLs and pipes


def test_file_urls_are_the_folders_they_name_for_build_info_verify_and_the_loader(source, built, tmp_path):
    """A file:// URL (percent-escapes too) is built, opened and read as the local folder it names, into a new
    or an existing empty folder; with local_cache the loader streams it through the node cache instead."""
    from urllib.parse import quote

    for name in ("new folder", "empty"):
        out = tmp_path / name
        if name == "empty":
            out.mkdir()
        url = "file://" + quote(str(out))
        done = run_cli("build", "file://" + quote(str(source[0])), url, "--size", str(SIZE), "--shard-size",
                       str(SHARD), "--scheduler", "sync", "--quiet")
        assert done.returncode == 0, done.stderr
        assert (out / "manifest.json").is_file()
        assert images_file(out, 0).read_bytes() == images_file(built[0], 0).read_bytes()
        for command in ("info", "verify"):
            shown = run_cli(command, url)
            assert shown.returncode == 0 and str(out) in shown.stdout, shown.stderr
        assert len(datapipe.open(url)) == len(datapipe.open(out))
    url = "file://" + quote(str(tmp_path / "empty"))
    in_place = [x for x, _ in datapipe.StreamingDataset(url, batch_size=5, shuffle=False)]
    streamed = [x for x, _ in datapipe.StreamingDataset(url, batch_size=5, shuffle=False, local_cache=tmp_path / "node")]
    assert len(in_place) == len(streamed) > 1 and all(torch_equal(a, b) for a, b in zip(in_place, streamed, strict=True))
    assert any((tmp_path / "node").rglob("*.json"))  # streamed through the node cache


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


@pytest.mark.parametrize("url", ["file://otherhost/data/cache", "file://relative/path", "file:///data?x=1"])
def test_a_file_url_that_names_no_local_folder_is_one_line(url):
    done = run_cli("info", url)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "file:///absolute/path" in done.stderr, done.stderr


@pytest.mark.parametrize("args", [["info", "CACHE"], ["info", "--env"], ["verify", "CACHE"]])
def test_a_command_whose_reader_went_away_stops_quietly(built, args):
    """`datapipe info CACHE | head -1`: the output's reader goes away; the command stops as a pipe's writer does
    (exit 141), without a traceback or a message about an exception at exit."""
    args = [str(built[0]) if a == "CACHE" else a for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "datapipe.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(60) == 141 and "Traceback" not in err and "Exception ignored" not in err, err


@pytest.mark.parametrize("command", ["build", "verify"])
def test_a_progress_bar_whose_reader_went_away_never_ends_the_work(source, tmp_path, command):
    """`datapipe build SRC OUT 2>&1 | head -1`: the progress bar's write to a pipe with no reader raised
    BrokenPipeError, which the build took for a failure to write the cache ("Broken pipe while writing OUT"),
    removing the new output. The bar goes silent instead; the work finishes (the summary has nowhere to go)."""
    out = tmp_path / "out"
    if command == "verify":
        assert run_cli("build", str(source[0]), str(out), "--scheduler", "sync", "--quiet").returncode == 0
    args = ["build", str(source[0]), str(out), "--scheduler", "sync"] if command == "build" else ["verify", str(out)]
    read, write = os.pipe()
    os.close(read)  # standard error's reader is gone before the first line
    try:
        done = subprocess.run([sys.executable, "-m", "datapipe.cli", *args], stdout=subprocess.DEVNULL, stderr=write,
                              timeout=300)
    finally:
        os.close(write)
    assert done.returncode in (0, 141)
    assert datapipe.open(out).verify() == []


def test_a_signal_after_the_command_finished_neither_kills_it_nor_says_it_was_terminated(source, tmp_path):
    """SIGTERM in the moment between a finished build's "ok" line and the end of the interpreter (Dask's clean-up,
    ~0.3 s) killed the process by the signal (exit status -15, no line): the work is done and said, so the exit
    ignores it."""
    code = ("import atexit, os, signal, sys, time; from datapipe.cli import main\n"
            "def late():  # at exit, after datapipe's own handler (registered later, so run first)\n"
            "    os.kill(os.getpid(), signal.SIGTERM); os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
            "atexit.register(late)\n"
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "build", str(source[0]), str(tmp_path / "out"), "--scheduler",
                           "sync", "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("datapipe build: ok: "), done.stderr


def test_info_quotes_class_names_that_would_blur_the_list(tmp_path, imaging, capsys):
    """Classes "a, b" and "c" were listed as "a, b, c": three classes to the eye. Such names are quoted."""
    imaging.write_source(tmp_path / "src", {"a, b": 1, " c": 1, "d": 1}, variety=False)
    assert cli_main(["build", str(tmp_path / "src"), str(tmp_path / "out"), "--size", "16", "--scheduler", "sync",
                     "--quiet"]) == 0
    capsys.readouterr()
    assert cli_main(["info", str(tmp_path / "out")]) == 0
    assert 'classes    3: " c", "a, b", "d"\n' in capsys.readouterr().out
    imaging.write_source(tmp_path / "plain", {"ant": 1, "bee": 1}, variety=False)
    assert cli_main(["build", str(tmp_path / "plain"), str(tmp_path / "p"), "--size", "16", "--scheduler", "sync",
                     "--quiet"]) == 0
    capsys.readouterr()
    assert cli_main(["info", str(tmp_path / "p")]) == 0
    assert "classes    2: ant, bee\n" in capsys.readouterr().out
