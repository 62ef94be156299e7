"""Names in text: whatever a path holds (a byte that is not UTF-8, ESC, a newline, a bidirectional control), an
error's text and the command's output lines carry it as one printable line; a Dask worker or a bench whose locale
reads file names otherwise than UTF-8 says so instead of losing files; report.json gives a name that is not UTF-8 by
its bytes; a CSV path in another Unicode form than its file gets a hint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest
from build_fixtures import build, build_log

import datapipe
from datapipe import cli, errors

# A name holding everything an output must not pass on raw: a byte that is not UTF-8 (a lone surrogate once
# decoded), ESC and a colour sequence, a newline, the right-to-left override.
NOT_UTF8 = os.fsdecode(b"x\xff")
CONTROLS = "c\x1b[31m\nq\u202e"
WEIRD = NOT_UTF8 + CONTROLS
# CONTROLS as the escaped text every line shows instead
CONTROLS_SHOWN = "c\\x1b[31m\\nq\\u202e"


def raw_characters(text: str) -> list[str]:
    """The characters of ``text`` that no one-line message may hold: C0/C1 controls (the newline too), DEL, line
    and paragraph separators, bidirectional controls and lone surrogates."""
    bidi = {0x200E, 0x200F, 0x061C, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}
    return [c for c in text if ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or ord(c) in bidi or 0xD800 <= ord(c) <= 0xDFFF]


def assert_one_printable_line(text: str) -> None:
    assert raw_characters(text) == [], repr(text)
    text.encode("utf-8")  # no lone surrogate: any UTF-8 output writes it


def output_lines_are_clean(text: str) -> None:
    """Output of several lines: nothing raw but the newlines that end them (and a progress bar's carriage returns: the
    names here hold none), and no line begun by a name's newline."""
    assert raw_characters(text.replace("\n", "").replace("\r", "")) == [], repr(text)
    assert not [line for line in text.splitlines() if line.startswith("q\u202e") or line.startswith("q\\u202e")], text


# ----------------------------------------------------------------------------- 1. the text of errors


@pytest.mark.parametrize("opener", [datapipe.open, datapipe.StreamingDataset], ids=["open", "StreamingDataset"])
def test_the_error_of_a_missing_cache_whose_name_holds_anything_is_one_printable_line(tmp_path, opener):
    path = os.path.join(str(tmp_path), WEIRD)
    with pytest.raises(errors.DatapipeError) as caught:
        opener(path)
    text = str(caught.value)
    assert_one_printable_line(text)
    assert "x\\xff" in text and "\\x1b[31m" in text and "\\n" in text and "\\u202e" in text, text
    assert f"{tmp_path}/x\\xff{CONTROLS_SHOWN}" in text, text


def _plain_error_classes() -> list[type]:
    """Every DatapipeError made from a message alone (no __init__ of its own)."""
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.DatapipeError)
            and not any("__init__" in vars(k) for k in c.__mro__ if issubclass(k, errors.DatapipeError))]


@pytest.mark.parametrize("cls", _plain_error_classes(), ids=lambda c: c.__name__)
def test_every_datapipe_error_naming_any_path_is_one_printable_line(cls):
    exc = cls(f"cannot read /data/{WEIRD}/img.jpg; rename it")
    text = str(exc)
    assert_one_printable_line(text)
    assert text == f"cannot read /data/x\\xff{CONTROLS_SHOWN}/img.jpg; rename it"


PRINT_IT = """
import sys
import datapipe

try:
    datapipe.open(sys.argv[1])
except datapipe.errors.DatapipeError as exc:
    print(exc)
    print("printed")
"""


def test_print_of_the_error_succeeds_on_a_utf8_stdout(tmp_path):
    """print(exc) of a CacheError naming a path that is not UTF-8 died on its lone surrogate."""
    path = os.path.join(str(tmp_path), WEIRD)
    done = subprocess.run([sys.executable, "-c", PRINT_IT, path], capture_output=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8", "PYTHONUTF8": "1"})
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode(errors="replace")
    lines = done.stdout.decode("utf-8").splitlines()
    assert lines[-1] == "printed" and len(lines) == 2, lines
    assert_one_printable_line(lines[0])
    assert f"x\\xff{CONTROLS_SHOWN}" in lines[0], lines[0]


@pytest.mark.parametrize("command", ["info", "verify", "bench"])
def test_the_commands_error_line_of_a_missing_cache_escapes_its_name(tmp_path, command):
    path = os.path.join(str(tmp_path), WEIRD)
    done = subprocess.run([sys.executable, "-m", "datapipe.cli", command, path], capture_output=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, "PYTHONUTF8": "1"})
    assert done.returncode == 2 and done.stdout == b""
    assert not [b for b in (b"\x1b", b"\n" + b"q", "\u202e".encode()) if b in done.stderr], done.stderr
    # the command line's own line writes a name's bytes back as they are (the user's terminal shows the name as
    # it shows the folder's listing), its control characters escaped
    assert b"x\xff" + CONTROLS_SHOWN.encode() in done.stderr, done.stderr
    err = done.stderr.decode("utf-8", "surrogateescape")
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert_one_printable_line(err[:-1].replace("\udcff", ""))
    assert err.startswith(f"datapipe {command}: error: "), err


def test_the_os_error_line_escapes_the_file_it_names(tmp_path):
    """`datapipe sample` into a path under a file: the OSError's file name, escaped."""
    (tmp_path / "afile").write_text("")
    done = subprocess.run([sys.executable, "-m", "datapipe.cli", "sample", str(tmp_path / "afile" / CONTROLS),
                           "--images", "2", "--classes", "1"], capture_output=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONUTF8": "1"})
    assert done.returncode != 0
    err = done.stderr.decode("utf-8")
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert_one_printable_line(err[:-1])
    assert f"afile/{CONTROLS_SHOWN}" in err, err


# ----------------------------------------------------------------------------- 2. a Dask worker in another locale


def _c_locale_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "PYTHONUTF8", "LANG", "LC_CTYPE")}
    env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    return env


def _utf8_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LC_ALL", "LC_CTYPE")}
    env.update(PYTHONUTF8="1")
    return env


def _dask_cli(kind: str) -> list[str]:
    exe = shutil.which("dask", path=os.path.dirname(sys.executable))
    return [exe, kind] if exe else [sys.executable, "-m", f"distributed.cli.dask_{kind}"]


def _small_source(root: Path, imaging, names: dict[str, list[str]]) -> Path:
    for k, (folder, files) in enumerate(names.items()):
        (root / folder).mkdir(parents=True, exist_ok=True)
        for j, name in enumerate(files):
            (root / folder / name).write_bytes(imaging.jpeg(imaging.gradient(20, 24, seed=10 * k + j)))
    return root


@contextlib.contextmanager
def _one_worker_cluster(folder: Path, worker_env: dict[str, str]):
    """A scheduler and one single-threaded worker (no nanny) started with ``worker_env``: yields (the scheduler's
    address, the worker's address); both are killed at the end."""
    from distributed import Client

    procs: list[subprocess.Popen] = []
    file = folder / "scheduler.json"
    try:
        procs.append(subprocess.Popen([*_dask_cli("scheduler"), "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                                       "--idle-timeout", "300", "--scheduler-file", str(file)], cwd=folder,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 60
        while not (file.exists() and file.stat().st_size > 0):
            assert time.monotonic() < deadline and procs[0].poll() is None, "the scheduler did not start"
            time.sleep(0.05)
        address = json.loads(file.read_text())["address"]
        procs.append(subprocess.Popen([*_dask_cli("worker"), address, "--nthreads", "1", "--no-nanny",
                                       "--memory-limit", "0", "--death-timeout", "60", "--name", "c-locale",
                                       "--local-directory", str(folder / "w")], cwd=folder, env=worker_env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        with Client(address, timeout="30s") as client:
            client.wait_for_workers(1, timeout=60)
            encodings = client.run(lambda: sys.getfilesystemencoding())
        assert list(encodings.values()) == ["ascii"], encodings  # the worker does read names otherwise than UTF-8
        yield address, next(iter(encodings))
    finally:
        for proc in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _cli_build(source: Path, out: Path, address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source), str(out), "--scheduler", address,
                           "--size", "16", "--shard-size", "4", "--max-bad-fraction", "0.5", "--quiet"],
                          capture_output=True, text=True, timeout=120, cwd=out.parent, env=_utf8_env())


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_worker_that_reads_names_otherwise_than_utf8_is_refused_by_name(tmp_path, imaging):
    """A worker under LC_ALL=C (PYTHONUTF8=0) could not open `été.jpg`, and the build quarantined it for good as a
    decoder error; now the build ends in one line naming the worker and PYTHONUTF8=1. A source whose names are all
    ASCII still builds on it, and so does an output whose name is ASCII; a non-ASCII output folder is refused too."""
    ascii_src = _small_source(tmp_path / "ascii", imaging, {"a": ["x1.jpg", "x2.jpg"], "b": ["y1.jpg"]})
    named_src = _small_source(tmp_path / "named", imaging, {"a": ["x1.jpg", "été.jpg"], "b": ["y1.jpg"]})
    with _one_worker_cluster(tmp_path, _c_locale_env()) as (address, worker):
        fine = _cli_build(ascii_src, tmp_path / "ascii-out", address)
        refused = _cli_build(named_src, tmp_path / "named-out", address)
        elsewhere = _cli_build(ascii_src, tmp_path / "sortie-é", address)
    # no false refusal: ASCII names build on that worker
    assert fine.returncode == 0, fine.stderr
    assert len(datapipe.open(tmp_path / "ascii-out")) == 3

    for done, name in ((refused, "été.jpg"), (elsewhere, "sortie-é")):
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith("datapipe build: error: ") and worker in line, line
        assert "PYTHONUTF8=1" in line and name in line and "ascii" in line, line
    report = tmp_path / "named-out" / "report.json"
    if report.exists():  # never quarantined (for good) as a file the decoder failed on
        quarantined = json.loads(report.read_text())["quarantined"]
        assert not [q for q in quarantined if q["error"] == "decoder-error" or "été" in q["path"]], quarantined
    with contextlib.suppress(datapipe.errors.DatapipeError):
        cache = datapipe.open(tmp_path / "named-out")
        pytest.fail(f"a cache of {len(cache)} samples was built without été.jpg")


# ----------------------------------------------------------------------------- 3. bench --source in another locale


@pytest.mark.parametrize("names", [{"a": ["x1.jpg", "été.jpg"], "b": ["y1.jpg"]},
                                   {"café": ["x1.jpg", "x2.jpg"], "b": ["y1.jpg"]}], ids=["file", "class-folder"])
def test_bench_source_under_a_locale_that_is_not_utf8_names_the_locale_not_missing_files(tmp_path, imaging, names):
    src = _small_source(tmp_path / "src", imaging, names)
    build(src, tmp_path / "cache", size=16, shard_size=4)
    done = subprocess.run([sys.executable, "-m", "datapipe.cli", "bench", str(tmp_path / "cache"), "--source", str(src),
                           "--against", "dataloader", "--batch-size", "2", "--workers", "1", "--repeats", "1",
                           "--batches", "1", "--crop", "8", "--quiet", "--work-dir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_c_locale_env())
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("datapipe bench: error: --source "), line
    assert "PYTHONUTF8=1" in line and "ascii" in line, line
    assert "missing" not in line and "does not hold" not in line, line


# ----------------------------------------------------------------------------- 4. report.json: names by their bytes


def test_a_quarantined_name_that_is_not_utf8_is_in_the_report_by_its_bytes(tmp_path, imaging):
    """`a/img\\xff.jpg` (the byte 0xff) shows as the text of the file literally named `img\\xff.jpg` (a backslash,
    an x, two f's), which is built as a sample: only path_bytes tells them apart."""
    src = _small_source(tmp_path / "src", imaging, {"a": ["x1.jpg", "x2.jpg", "img\\xff.jpg"], "b": ["y1.jpg", "y2.jpg"]})
    good = imaging.jpeg(imaging.gradient(20, 24, seed=99))
    (src / "a" / os.fsdecode(b"img\xff.jpg")).write_bytes(good)
    (src / "b" / os.fsdecode(b"sub\xfe")).mkdir()
    (src / "b" / os.fsdecode(b"sub\xfe") / "in.jpg").write_bytes(good)
    out = tmp_path / "out"
    build(src, out, size=16, shard_size=4, max_bad_fraction=0.5)

    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    by_bytes = {bytes.fromhex(q["path_bytes"]): q for q in report["quarantined"] if "path_bytes" in q}
    assert set(by_bytes) == {b"a/img\xff.jpg", b"b/sub\xfe/in.jpg"}, report["quarantined"]
    assert by_bytes[b"a/img\xff.jpg"]["path"] == "a/img\\xff.jpg"  # the literal file's name as text
    for raw in by_bytes:  # the bytes name the very file
        assert (src / os.fsdecode(raw)).read_bytes() == good
    cache = datapipe.open(out)
    paths = [cache.path(i) for i in range(len(cache))]
    assert "a/img\\xff.jpg" in paths and len(paths) == 5, paths
    literal = [q for q in report["quarantined"] if q["path"] == "a/img\\xff.jpg"]
    assert len(literal) == 1 and literal[0]["path_bytes"] == b"a/img\xff.jpg".hex()


# ----------------------------------------------------------------------------- 5. the CSV's Unicode form


@pytest.mark.parametrize(("csv_form", "file_form"), [("NFD", "NFC"), ("NFC", "NFD")])
def test_a_csv_path_in_another_unicode_form_than_its_file_gets_a_hint(tmp_path, imaging, csv_form, file_form):
    name = "café/été.jpg"
    on_disk, in_csv = unicodedata.normalize(file_form, name), unicodedata.normalize(csv_form, name)
    assert on_disk != in_csv
    src = _small_source(tmp_path / "src", imaging, {"dog": ["d1.jpg", "d2.jpg", "d3.jpg"]})
    (src / on_disk).parent.mkdir()
    (src / on_disk).write_bytes(imaging.jpeg(imaging.gradient(20, 24, seed=5)))
    rows = [f"dog/d{k}.jpg,dog" for k in (1, 2, 3)] + [f"{in_csv},cat"]
    (src / "list.csv").write_text("path,label\n" + "\n".join(rows) + "\n", encoding="utf-8")
    lines: list[str] = []
    with build_log(lambda record: lines.append(record.getMessage())):
        build(src / "list.csv", tmp_path / "out", size=16, shard_size=4, max_bad_fraction=0.5)
    [warning] = [line for line in lines if "name no file" in line]
    assert f"{on_disk!r} exists" in warning, warning
    assert f"Unicode {file_form}" in warning and f"unicodedata.normalize('{file_form}'" in warning, warning


# ----------------------------------------------------------------------------- 6. the command's output lines


@pytest.fixture
def weird_build(tmp_path, imaging, capsys) -> tuple[Path, Path, str]:
    """A source and a cache in folders whose names hold ESC, a newline and U+202E, built by the command:
    (source, cache, what the build wrote to standard error)."""
    src = _small_source(tmp_path / f"src-{CONTROLS}", imaging, {"a": ["x1.jpg", "x2.jpg"], "b": ["y1.jpg"]})
    out = tmp_path / f"cache-{CONTROLS}"
    capsys.readouterr()
    code = cli.main(["build", str(src), str(out), "--size", "16", "--shard-size", "4", "--scheduler", "sync", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return src, out, captured.out + captured.err


def test_the_builds_plan_and_ok_lines_escape_the_paths(weird_build, tmp_path):
    src, out, printed = weird_build
    output_lines_are_clean(printed)
    lines = printed.splitlines()
    plan = [line for line in lines if line.startswith("datapipe build: 3 files in 2 classes from ")]
    ok = [line for line in lines if line.startswith("datapipe build: ok: ")]
    assert len(plan) == 1 and f"from {tmp_path}/src-{CONTROLS_SHOWN} -> " in plan[0], printed
    assert len(ok) == 1 and ok[0].endswith(f"-> {tmp_path}/cache-{CONTROLS_SHOWN}"), printed


def test_info_and_verify_of_a_cache_whose_path_holds_controls_print_no_raw_control(weird_build, tmp_path, capsys):
    _, out, _ = weird_build
    assert cli.main(["info", str(out)]) == 0
    info = capsys.readouterr()
    output_lines_are_clean(info.out + info.err)
    assert info.out.startswith(f"cache      {tmp_path}/cache-{CONTROLS_SHOWN}\n"), info.out
    assert f"source     {tmp_path}/src-{CONTROLS_SHOWN} (folder)" in info.out, info.out
    assert f"(every file and reason: {tmp_path}/cache-{CONTROLS_SHOWN}/report.json)" in info.out, info.out

    assert cli.main(["verify", str(out)]) == 0
    verify = capsys.readouterr()
    output_lines_are_clean(verify.out + verify.err)
    assert f"{tmp_path}/cache-{CONTROLS_SHOWN}: 1 shard, 3 samples: OK" in verify.out, verify.out


def test_verify_lines_of_a_damaged_cache_whose_path_holds_controls_are_escaped(weird_build, tmp_path, capsys):
    _, out, _ = weird_build
    shard = next(p for p in sorted((out / "shards").rglob("*")) if p.is_file() and p.stat().st_size > 64)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x5A
    shard.write_bytes(bytes(data))
    assert cli.main(["verify", str(out)]) == 1
    verify = capsys.readouterr()
    output_lines_are_clean(verify.out + verify.err)
    assert f"{tmp_path}/cache-{CONTROLS_SHOWN}: 1 shard, 3 samples: 1 problem" in verify.out, verify.out


def test_the_sample_commands_line_escapes_its_folder(tmp_path, capsys):
    out = tmp_path / f"sample-{CONTROLS}"
    for _ in range(2):  # written, then already there
        assert cli.main(["sample", str(out), "--images", "2", "--classes", "1"]) == 0
        printed = capsys.readouterr()
        output_lines_are_clean(printed.out + printed.err)
        assert f"{tmp_path}/sample-{CONTROLS_SHOWN}" in printed.out, printed.out


@pytest.mark.parametrize("csv_name", ["list.csv", f"li{CONTROLS}st.csv"], ids=["plain", "controls"])
def test_the_plan_line_of_a_csv_source_names_the_csv_file(tmp_path, imaging, capsys, csv_name):
    src = _small_source(tmp_path / "src", imaging, {"a": ["x1.jpg", "x2.jpg"], "b": ["y1.jpg"]})
    csv_file = src / csv_name
    csv_file.write_text("path,label\na/x1.jpg,a\na/x2.jpg,a\nb/y1.jpg,b\n", encoding="utf-8")
    capsys.readouterr()
    code = cli.main(["build", str(csv_file), str(tmp_path / "out"), "--size", "16", "--shard-size", "4",
                     "--scheduler", "sync", "--quiet"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    output_lines_are_clean(printed.out + printed.err)
    [plan] = [line for line in printed.err.splitlines() if line.startswith("datapipe build: 3 files in ")]
    shown = csv_name.replace(CONTROLS, CONTROLS_SHOWN)
    assert f" from {src}/{shown} -> " in plan, plan
