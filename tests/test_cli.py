"""The ``datapipe`` command's surface: help for every argument, --version, wording, errors that name the flag."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import pytest

import datapipe
from datapipe import cli
from datapipe.errors import ArgumentError, DatapipeError, OutputWriteError
from datapipe.text import plural


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli._parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_argument_of_every_command_has_help():
    parser = cli._parser()
    missing = [f"datapipe {a.dest}" for a in parser._actions if not (a.help or "").strip()]
    for name, sub in subcommands().items():
        missing += [f"datapipe {name} {a.option_strings or a.dest}" for a in sub._actions if not (a.help or "").strip()]
    assert not missing, missing
    assert set(subcommands()) == {"build", "info", "verify", "sample", "demo", "bench"}


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"datapipe {datapipe.__version__}"
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"datapipe {datapipe.__version__}"


@pytest.mark.parametrize(("count", "noun", "plural_form", "text"), [
    (0, "shard", None, "0 shards"), (1, "shard", None, "1 shard"), (2, "shard", None, "2 shards"),
    (1, "class", "classes", "1 class"), (3, "class", "classes", "3 classes"), (1000, "sample", None, "1,000 samples"),
])
def test_plural(count, noun, plural_form, text):
    assert plural(count, noun, plural_form) == text


def test_build_summary_and_cache_lines_say_one_shard(tmp_path, capsys):
    from datapipe.bench.sample import make_sample_dataset

    source = make_sample_dataset(tmp_path / "src", images=3, classes=1)
    out = tmp_path / "cache"
    code = cli.main(["build", str(source), str(out), "--size", "32", "--shard-size", "10", "--scheduler", "sync",
                     "--quiet"])
    assert code == 0
    err = capsys.readouterr().err
    assert "1 shard " in err and "1 shards" not in err and "1 class " in err, err
    assert cli.main(["verify", str(out)]) == 0
    verify = capsys.readouterr().out
    assert "1 shard, 3 samples: OK" in verify, verify
    assert cli.main(["info", str(out)]) == 0
    info = capsys.readouterr().out
    assert "in 1 shard\n" in info and "1 shards" not in info, info


@pytest.mark.parametrize(("option", "flag"), [
    (["--max-bad-fraction", "2"], "--max-bad-fraction"),
    (["--max-bad-fraction", "-0.5"], "--max-bad-fraction"),
    (["--size", "4"], "--size"),
    (["--size", "9000"], "--size"),
])
def test_a_bad_build_value_is_one_line_naming_the_flag(tmp_path, capsys, option, flag):
    (tmp_path / "src" / "a").mkdir(parents=True)
    code = cli.main(["build", str(tmp_path / "src"), str(tmp_path / "o"), "--scheduler", "sync", "--quiet", *option])
    assert code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("datapipe build: error: ") and flag in line
    assert "max_bad_fraction" not in line and not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["build", "demo"])
@pytest.mark.parametrize("workers", ["over the cores", "1000", "1000000000"])
def test_more_workers_than_the_machine_can_run_is_refused_before_anything_starts(tmp_path, capsys, command, workers):
    """A LocalCluster of a thousand workers ran the machine out of memory for minutes and ended in the OOM
    killer: any count over 4 a core (or the available memory at 256 MiB a worker) is one line, nothing made."""
    from dask.system import CPU_COUNT

    count = str(4 * CPU_COUNT + 1) if workers == "over the cores" else workers
    (tmp_path / "src" / "a").mkdir(parents=True)
    args = ["build", str(tmp_path / "src"), str(tmp_path / "o")] if command == "build" else ["demo", "--dir", str(tmp_path / "o")]
    assert cli.main([*args, "--workers", count, "--quiet"] if command == "build" else [*args, "--workers", count]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"datapipe {command}: error: --workers {count} is more than this machine can run: "), line
    assert f"at most {4 * CPU_COUNT} LocalCluster workers" in line or "GiB of memory" in line
    assert not (tmp_path / "o").exists()


def test_the_memory_a_worker_needs_bounds_the_workers_too(monkeypatch):
    import datapipe.builder as builder

    monkeypatch.setattr(builder, "WORKER_MEMORY", int(builder.available_memory() / 1.5))  # room for one
    with pytest.raises(ArgumentError, match=r"--workers 2 is more than .* allow at most 1 LocalCluster workers"):
        builder.local_workers(2)
    assert builder.local_workers(1) == 1
    with pytest.raises(ArgumentError, match="--workers 2"):
        datapipe.build("nowhere", "nothing", cluster=datapipe.Cluster(workers=2))


def test_the_default_is_one_worker_per_core_this_process_may_use():
    from dask.system import CPU_COUNT

    import datapipe.builder as builder

    assert builder.local_workers(None) == CPU_COUNT <= len(os.sched_getaffinity(0))  # a CPU quota may lower it


@pytest.mark.parametrize(("command", "option", "flag"), [
    ("build", ["--shard-size", "0"], "--shard-size"), ("build", ["--shard-size", "x"], "--shard-size"),
    ("build", ["--workers", "-1"], "--workers"), ("build", ["--size", "32.5"], "--size"),
    ("sample", ["--images", "ten"], "--images"), ("sample", ["--seed", "-1"], "--seed"), ("sample", ["--seed", "1e3"], "--seed"),
])
def test_a_malformed_number_is_refused_by_the_parser_naming_the_flag(tmp_path, capsys, command, option, flag):
    """The flag and what it takes, with the text given; never the parser's name of a function."""
    args = [str(tmp_path), str(tmp_path / "o")] if command == "build" else [str(tmp_path / "s")]
    with pytest.raises(SystemExit) as stop:
        cli.main([command, *args, *option])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a " in err and repr(option[1]) in err and "_int" not in err


def test_the_storage_option_help_lists_the_words_that_keep_a_value_text(capsys):
    from datapipe.remote import TEXT_WORDS, text_option

    with pytest.raises(SystemExit):
        cli.main(["build", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert all(f" {word}," in out or f" {word} (" in out for word in TEXT_WORDS), out
    assert text_option("region_name") and text_option("aws_access_key_id") and not text_option("hostname")


def test_an_unknown_peer_names_the_flag(tmp_path, capsys):
    from datapipe.bench.peers import get_peer

    with pytest.raises(DatapipeError, match="--against"):
        get_peer("nope")


def test_the_cli_reports_a_bug_as_a_bug(monkeypatch):
    """Only DatapipeError is a user-facing error: anything else keeps its traceback."""
    def broken(args):
        raise ValueError("a bug")

    monkeypatch.setitem(cli._COMMANDS, "verify", broken)
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["verify", "x"])


def test_a_write_error_exits_with_1(monkeypatch, capsys):
    def full(args):
        raise OutputWriteError("No space left on device: /x/.tmp-000002; finished shards are kept")

    monkeypatch.setitem(cli._COMMANDS, "verify", full)
    assert cli.main(["verify", "x"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "datapipe verify: error: No space left on device: /x/.tmp-000002; finished shards are kept"


def test_library_messages_reach_stderr_only_while_a_command_runs(monkeypatch, capsys):
    def talk(args):
        logging.getLogger("datapipe.build").info("a progress line")
        return 0

    monkeypatch.setitem(cli._COMMANDS, "verify", talk)
    assert cli.main(["verify", "x"]) == 0
    assert capsys.readouterr().err == "a progress line\n"
    logger = logging.getLogger("datapipe")
    assert not [h for h in logger.handlers if isinstance(h, cli._Stderr)]
    logging.getLogger("datapipe.build").info("after the command")
    assert "after the command" not in capsys.readouterr().err


def test_build_lines_go_to_the_build_logger(tmp_path, caplog):
    from datapipe.bench.sample import make_sample_dataset

    source = make_sample_dataset(tmp_path / "src", images=2, classes=1)
    with caplog.at_level(logging.INFO, logger="datapipe.build"):
        datapipe.build(source, tmp_path / "cache", size=16, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "datapipe.build"]
    assert any("1 shard " in line for line in lines), lines


def test_sample_that_cannot_be_written_is_one_line_exit_1(tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where a folder should be")
    assert cli.main(["sample", str(blocker / "out"), "--images", "2", "--classes", "1"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("datapipe sample: error: cannot write the sample: ") and str(blocker) in line


def test_bench_output_file_that_cannot_be_written_names_the_flag(tmp_path):
    from datapipe.cli import _writing
    from datapipe.errors import OutputError

    target = tmp_path / "blocker" / "result.json"
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(OutputError, match="--json .*result.json"), _writing("--json", target):
        target.write_text("{}")


def test_build_lines_of_builds_in_two_threads_stay_apart(tmp_path, caplog):
    import threading

    from datapipe.bench.sample import make_sample_dataset

    source = make_sample_dataset(tmp_path / "src", images=2, classes=1)
    gate = threading.Barrier(2)

    def run(name: str) -> None:
        gate.wait()
        datapipe.build(source, tmp_path / name, size=16, cluster=datapipe.Cluster(scheduler="sync"), progress=False)

    threads = [threading.Thread(target=run, args=(name,), name=f"build-{name}") for name in ("one", "two")]
    with caplog.at_level(logging.INFO, logger="datapipe.build"):
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    lines = {name: [r.getMessage() for r in caplog.records if r.threadName == f"build-{name}"] for name in ("one", "two")}
    for name, other in (("one", "two"), ("two", "one")):
        assert any(str(tmp_path / name) in line for line in lines[name]), lines
        assert not any(str(tmp_path / other) in line for line in lines[name]), lines
    assert logging.getLogger("datapipe.build").level == logging.NOTSET


@pytest.mark.parametrize(("argv", "module", "extra"), [
    (["sample", "out"], "skimage", "sample"),
    (["demo"], "psutil", "bench"),
    (["bench", "cache"], "psutil", "bench"),
    (["bench", "cache", "--plot", "p.png"], "matplotlib", "bench"),
])
def test_a_command_without_its_extra_names_the_extra(tmp_path, monkeypatch, capsys, argv, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert module in line and f"pip install 'datapipe[{extra}]'" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CPU", ""])
def test_a_bad_bench_device_names_the_flag(tmp_path, capsys, device):
    assert cli.main(["bench", str(tmp_path / "cache"), "--device", device]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("datapipe bench: error: --device must be") and repr(device) in line


@pytest.mark.parametrize("argv", [["--seed", "-1"], ["--seed", "1.5"], ["--images", "0"], ["--classes", "-2"]])
def test_a_bad_sample_number_is_refused_before_anything_is_written(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        cli.main(["sample", str(tmp_path / "out"), "--images", "4", "--classes", "2", *argv])
    assert exc.value.code == 2 and argv[0] in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_sample_library_checks_its_numbers_before_writing(tmp_path):
    from datapipe.bench.sample import make_sample_dataset
    from datapipe.errors import ArgumentError

    for bad in ({"seed": -1}, {"seed": 1.5}, {"images": 1}, {"workers": 0}):
        with pytest.raises(ArgumentError):
            make_sample_dataset(tmp_path / "out", **{"images": 4, "classes": 2, **bad})
        assert not (tmp_path / "out").exists()  # no folder, no marker: a rerun with good values works


def test_demo_with_too_few_images_names_only_its_own_flags(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--dir", str(tmp_path / "demo"), "--images", "5"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--images" in line and "--classes" not in line
    assert not (tmp_path / "demo").exists()


def test_demo_names_the_batches_it_read():
    from datapipe.bench.demo import _shapes

    assert _shapes([(200, 3, 224, 224)]) == "[200, 3, 224, 224]"
    assert _shapes([(256, 3, 224, 224), (256, 3, 224, 224), (8, 3, 224, 224)]) == "[256|8, 3, 224, 224]"


@pytest.mark.parametrize("encoding", ["latin-1", "ascii", "C locale"])
def test_commands_print_on_an_output_that_is_not_utf8(tmp_path, encoding):
    """In a Latin-1 or ASCII locale (or PYTHONIOENCODING), `datapipe info` of a cache with more than 8 classes or
    a class named in another script, and `datapipe bench` (its table's dashes), died with a UnicodeEncodeError
    traceback, bench after measuring and before writing its --json file. The characters the output lacks are
    written as ASCII ("...", "-") or escaped; the figures are kept."""
    source = datapipe.make_sample_dataset(tmp_path / "src", images=30, classes=10)
    (source / "class_009").rename(source / "日本")
    datapipe.build(source, tmp_path / "cache", size=32, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "PYTHONUTF8", "LANG", "LC_ALL")}
    if encoding == "C locale":  # ASCII, whose errors are escaped as surrogates ("surrogateescape")
        env.update(LC_ALL="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    else:
        env["PYTHONIOENCODING"] = encoding

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "datapipe.cli", *args], capture_output=True, timeout=600, env=env)

    info = run("info", str(tmp_path / "cache"))
    assert info.returncode == 0 and b"Traceback" not in info.stderr, info.stderr.decode(errors="replace")
    assert b"class_007 ..." in info.stdout  # the list cut after 8 classes, with an ASCII ellipsis
    bench = run("bench", str(tmp_path / "cache"), "--batch-size", "8", "--workers", "1", "--repeats", "1", "--batches",
                "2", "--crop", "16", "--quiet", "--json", str(tmp_path / "bench.json"))
    assert bench.returncode == 0 and b"Traceback" not in bench.stderr, bench.stderr.decode(errors="replace")
    assert json.loads((tmp_path / "bench.json").read_text())["systems"]["datapipe"]["status"] == "ok"
    assert b"images/s" in bench.stdout
    for args in (["build", "--help"], ["bench", "--help"]):
        shown = run(*args)
        assert shown.returncode == 0 and b"Traceback" not in shown.stderr, shown.stderr.decode(errors="replace")
    missing = run("info", str(tmp_path / "日本"))  # a message naming a path the output cannot encode
    # the path as given: its bytes (the C locale read the argument's bytes as escapes), or escaped characters
    name = "日本".encode() if encoding == "C locale" else b"\\u65e5\\u672c"
    assert missing.returncode == 2 and b"Traceback" not in missing.stderr and name in missing.stderr


def test_main_gives_a_programs_own_stream_back_as_it_was(tmp_path, monkeypatch):
    """cli.main() called from a program left its error handler on the program's stdout: the program's own later
    writes of characters the stream lacks were rewritten instead of raising as the program had asked."""
    import io

    from datapipe.testing import build_index_cache

    cache = build_index_cache(tmp_path, 7)
    mine = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", mine)
    assert cli.main(["info", str(cache)]) == 0
    assert mine.errors == "strict"
    with pytest.raises(UnicodeEncodeError):
        mine.write("café")
        mine.flush()
