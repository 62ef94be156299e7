"""`datapipe bench` on a tiny generated dataset: well-formed results, a chart, peers run or skipped."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import datapipe
from datapipe import cli, native
from datapipe.bench import harness as bench
from datapipe.bench.harness import BenchSpec
from datapipe.errors import ArgumentError, CacheError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    source = datapipe.make_sample_dataset(root / "src", images=24, classes=3)
    datapipe.build(source, root / "cache", size=64, shard_size=10, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    return root


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None and __import__(name) is not None
    except Exception:  # noqa: BLE001 - a broken install counts as missing
        return False


def test_bench_json_chart_and_peers(tiny, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = cli.main([
        "bench", str(tiny / "cache"), "--source", str(tiny / "src"), "--against", "all",
        "--batch-size", "8", "--workers", "1", "--repeats", "2", "--batches", "2", "--crop", "48",
        "--step-ms", "5", "--work-dir", str(tmp_path / "work"), "--json", str(out_json), "--plot", str(out_png),
        "--quiet"])
    assert code == 0
    result = json.loads(out_json.read_text())
    assert set(result) == {"machine", "config", "stages", "systems", "attribution"}
    assert result["machine"]["cores"] >= 1 and result["machine"]["versions"]["torch"]
    assert result["machine"]["cpu_kernel"] == native.describe()  # which float conversion the loader ran
    for stage in ("read", "assemble", "decode", "h2d", "augment"):
        assert stage in result["stages"]
    assert result["stages"]["assemble"]["images_per_s"] > 0
    assert result["stages"]["bytes_on_disk_per_image"] == pytest.approx(64 * 64 * 3 + 16 + 4 / 10, rel=0.01)
    systems = result["systems"]
    assert set(systems) == {"datapipe", "dataloader", "webdataset", "litdata", "streaming"}
    dp = systems["datapipe"]
    assert dp["status"] == "ok" and len(dp["images_per_s"]) == 2 and dp["median"] > 0
    assert dp["spread"][0] <= dp["median"] <= dp["spread"][1]
    for name, module in (("dataloader", "torch"), ("webdataset", "webdataset"), ("litdata", "litdata"),
                         ("streaming", "streaming")):
        s = systems[name]
        if _importable(module) and (name in ("dataloader", "webdataset") or _importable("torchvision")):
            assert s["status"] == "ok", (name, s["reason"])
            assert s["ratio"] and s["ratio"] > 0 and len(s["images_per_s"]) == 2
            assert s["prepare_s"] is not None
        else:
            assert s["status"] == "skipped" and s["reason"] and "pip install" in s["install"]
    a = result["attribution"]
    assert a["end_to_end_s_per_image"] > 0 and a["sum_of_stages_s_per_image"] > 0
    # Without a GPU the loader crops straight from the memory maps: no gathered batch to count.
    assert result["stages"]["assemble"]["on_this_path"] is False
    assert set(a["stage_seconds_per_image"]) == {"augment"}
    # Stages and end to end are timed alternately: one ratio per round, the median reported.
    assert a["sum_of_stages_s_per_image"] == pytest.approx(sum(a["stage_seconds_per_image"].values()))
    assert len(a["rounds"]) == 3 and a["sum_over_end_to_end"] == pytest.approx(sorted(a["rounds"])[1])
    assert all(r > 0 for r in a["rounds"])
    read = result["stages"]["read"]
    assert read["MB_per_s"] > 0 and read["MB_per_s_cached"] > 0
    assert 0.0 <= a["model_step"]["wait_share"] <= 1.0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_table_mentions_every_system(tiny):
    result = bench.run(tiny / "cache", BenchSpec(batch_size=8, workers=1, repeats=1, batches=1, crop=48), progress=False)
    table = bench.format_table(result)
    assert "datapipe" in table and "img/s" in table
    assert result.systems["datapipe"].median > 0


def test_bench_bad_paths_give_one_clear_line(tmp_path):
    with pytest.raises(CacheError, match="does not exist"):
        bench.run(tmp_path / "nope", progress=False)
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "bench", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_needs_source_for_peers(tiny):
    with pytest.raises(Exception, match="--source"):
        bench.run(tiny / "cache", against=["dataloader"], progress=False)
    with pytest.raises(ValueError, match="dataloader"):
        bench.run(tiny / "cache", source=tiny / "src", against=["nope"], progress=False)


@pytest.mark.load_sensitive  # the ratio moves with the machine's load (0.60 in a full run, 1.99 beside a busy core)
def test_the_stage_breakdown_adds_up_to_the_end_to_end_time(tmp_path):
    """On the CPU path (crops straight from the maps), the stages measured one by one account for
    the end-to-end time of one reader: the bench's goal is within 15%; this bound catches a stage
    left out or counted twice (a ratio near 0.5 or 2) on a noisy machine."""
    import torch

    from datapipe.testing import build_index_cache

    cache = datapipe.open(build_index_cache(tmp_path, 512, shard_size=128, size=128))
    timers: dict = {}
    bench.measure_stages(cache, batch_size=64, crop=112, device=torch.device("cpu"), timers=timers)
    a = bench._attribution(cache, timers, BenchSpec(batch_size=64, crop=112), torch.device("cpu"), batches=8)
    assert set(timers) == {"augment"}
    assert 0.65 <= a["sum_over_end_to_end"] <= 1.5, a


@pytest.mark.parametrize("field,flag,bad", [
    ("batch_size", "--batch-size", 0), ("batch_size", "--batch-size", -3), ("batch_size", "--batch-size", 8.0),
    ("batch_size", "--batch-size", True), ("batch_size", "--batch-size", "8"),
    ("workers", "--workers", -1), ("workers", "--workers", 1.5), ("workers", "--workers", None),
    ("crop", "--crop", 0), ("crop", "--crop", False),
    ("batches", "--batches", 0), ("batches", "--batches", 2.0),
    ("repeats", "--repeats", 0), ("repeats", "--repeats", "3"),
    ("step_ms", "--step-ms", -1.0), ("step_ms", "--step-ms", float("nan")), ("step_ms", "--step-ms", float("inf")),
    ("step_ms", "--step-ms", True), ("step_ms", "--step-ms", "5"), ("step_ms", "--step-ms", 1e13),
    ("device", "--device", "gpu"), ("device", "--device", "cuda:x"), ("device", "--device", "CPU"),
    ("device", "--device", ""), ("device", "--device", None),
])
def test_a_bad_spec_is_one_error_naming_the_flag(field, flag, bad):
    with pytest.raises(ArgumentError) as err:
        BenchSpec(**{field: bad})
    message = str(err.value)
    assert message.startswith(f"{flag} must be") and "\n" not in message


def test_batches_larger_than_the_machine_are_refused_before_anything_runs():
    """--crop 60000 --batch-size 2 (80 GiB float batches) was a traceback from torch's allocator mid-run."""
    with pytest.raises(ArgumentError, match=r"^--crop 60000 with --batch-size 2 makes float batches of 80\.5 GiB"):
        BenchSpec(crop=60000, batch_size=2)
    assert BenchSpec(crop=512, batch_size=8).crop == 512  # 24 MiB a batch: taken


def test_the_spec_keeps_good_values_and_is_frozen():
    spec = BenchSpec(batch_size=1, workers=0, crop=1, batches=None, device="cuda:1", repeats=1, step_ms=0)
    assert (spec.batch_size, spec.workers, spec.batches, spec.device, spec.step_ms) == (1, 0, None, "cuda:1", 0)
    assert BenchSpec() == BenchSpec(batch_size=256, workers=2, crop=224, batches=None, device="auto", repeats=3,
                                    step_ms=0.0)
    with pytest.raises(AttributeError):
        spec.batch_size = 2  # type: ignore[misc]
    # batches per pass: the spec's, else one epoch of the cache capped at 40
    assert BenchSpec(batch_size=8).batches_per_pass(24) == 3
    assert BenchSpec(batch_size=8).batches_per_pass(25) == 4
    assert BenchSpec(batch_size=8).batches_per_pass(8 * 100) == 40
    assert BenchSpec(batch_size=8, batches=100).batches_per_pass(24) == 100


def test_run_takes_a_spec_only(tiny):
    with pytest.raises(ArgumentError, match="BenchSpec"):
        bench.run(tiny / "cache", {"batch_size": 8}, progress=False)  # type: ignore[arg-type]


def test_the_bench_command_checks_its_flags_through_the_spec(tmp_path, capsys):
    """A negative model step is refused before the cache is opened (argparse's types let it through)."""
    assert cli.main(["bench", str(tmp_path / "no-cache"), "--step-ms", "-5"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "datapipe bench: error: --step-ms must be a number of milliseconds from 0 to 86,400,000 (a day), got -5.0"


@pytest.mark.parametrize("flags, words", [
    (["--json", ""], "--json is empty; name a file"),  # `--json "$OUT"` with OUT unset: it was taken as no --json
    (["--plot", ""], "--plot is empty; name a file"),
    (["--json", "{tmp}/r.png", "--plot", "{tmp}/r.png"], "--json and --plot name the same file"),  # the chart overwrote it
    (["--json", "{tmp}/afile/x.json"], "afile is a file, not a folder"),  # was: "the folder ... does not exist"
])
def test_result_paths_that_would_lose_the_results_are_refused_before_anything_runs(tiny, tmp_path, capsys, flags,
                                                                                    words):
    (tmp_path / "afile").write_text("mine")
    args = [f.format(tmp=tmp_path) for f in flags]
    assert cli.main(["bench", str(tiny / "cache"), "--repeats", "1", *args]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("datapipe bench: error: ") and words in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


# ----------------------------------------------------------------------------- caches side by side


@pytest.fixture(scope="module")
def formats(tiny):
    """The tiny source built three more ways: JPEG square, raw aspect-kept, JPEG aspect-kept."""
    caches = {"raw-crop": tiny / "cache"}
    for encoding, fit in (("jpeg", "crop"), ("raw", "short"), ("jpeg", "short")):
        caches[f"{encoding}-{fit}"] = tiny / f"cache-{encoding}-{fit}"
        datapipe.build(tiny / "src", caches[f"{encoding}-{fit}"], size=64, fit=fit, encoding=encoding, shard_size=10,
                       cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    return caches


def test_bench_reports_a_raw_and_a_jpeg_cache_side_by_side(tiny, formats, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    code = cli.main(["bench", str(formats["raw-crop"]), "--also", str(formats["jpeg-crop"]), "--source", str(tiny / "src"),
                     "--against", "dataloader", "--batch-size", "8", "--workers", "1", "--repeats", "2", "--batches", "2",
                     "--crop", "48", "--work-dir", str(tmp_path / "work"), "--json", str(out_json), "--quiet"])
    assert code == 0
    table = capsys.readouterr().out
    result = json.loads(out_json.read_text())
    systems = result["systems"]
    assert list(systems) == ["datapipe", "datapipe-jpeg-crop", "dataloader"]
    raw, jpeg, peer = systems["datapipe"], systems["datapipe-jpeg-crop"], systems["dataloader"]
    for s in (raw, jpeg, peer):
        assert {"bytes_per_sample", "cpu_s_per_image", "median", "images_per_s", "encoding", "fit", "cache"} <= set(s)
        assert s["status"] == "ok" and s["median"] > 0 and len(s["images_per_s"]) == 2 and s["cpu_s_per_image"] > 0
    assert (raw["encoding"], raw["fit"], raw["cache"]) == ("raw", "crop", str(formats["raw-crop"]))
    assert (jpeg["encoding"], jpeg["fit"], jpeg["cache"]) == ("jpeg", "crop", str(formats["jpeg-crop"]))
    assert peer["encoding"] is None and peer["fit"] is None
    # stored bytes per sample: the raw square's pixels, the JPEG's compressed sizes (smaller), the peer's source files
    assert raw["bytes_per_sample"] == 64 * 64 * 3
    assert jpeg["bytes_per_sample"] == pytest.approx(float(datapipe.open(formats["jpeg-crop"]).sample_nbytes.mean()))
    assert 0 < jpeg["bytes_per_sample"] < raw["bytes_per_sample"] / 2
    sources = [p for p in (tiny / "src").rglob("*") if p.is_file() and p.suffix.lower() in (".jpg", ".jpeg", ".png")]
    assert peer["bytes_per_sample"] == pytest.approx(sum(p.stat().st_size for p in sources) / len(sources))
    assert jpeg["ratio"] and jpeg["ratio"] > 0 and peer["ratio"] and peer["ratio"] > 0
    assert result["config"]["also"] == [str(formats["jpeg-crop"])]
    # the table: one row per system, datapipe labelled with its encoding and fit, a bytes column
    rows = {line.split()[0]: line for line in table.splitlines()
            if line.startswith(("datapipe", "dataloader")) and "stages" not in line}
    assert set(rows) == {"datapipe", "datapipe-jpeg-crop", "dataloader"}
    assert "datapipe (raw, crop)" in rows["datapipe"] and "KiB/sample" in table
    assert rows["datapipe"].split()[-1] == "12.0" and float(rows["datapipe-jpeg-crop"].split()[-1]) < 6.0
    assert "datapipe stages (one thread each) on the raw cache, fit crop" in table


@pytest.mark.parametrize("first", ["jpeg-crop", "raw-short", "jpeg-short"])
def test_every_encoding_and_fit_is_benched_stage_by_stage(formats, first):
    """The stage breakdown is measured on any cache: samples of varying shapes read one by one, a
    JPEG cache's decode timed, its augment stage decoding each sample for its crop as the loader does."""
    others = [formats[k] for k in formats if k != first]
    result = bench.run(formats[first], BenchSpec(batch_size=8, workers=0, repeats=1, batches=1, crop=48), also=others,
                       progress=False)
    encoding, fit = first.split("-")
    assert (result.systems["datapipe"].encoding, result.systems["datapipe"].fit) == (encoding, fit)
    assert len(result.systems) == 4 and all(s.status == "ok" and s.median > 0 for s in result.systems.values())
    assert {(s.encoding, s.fit) for s in result.systems.values()} == {(e, f) for e in ("raw", "jpeg") for f in ("crop", "short")}
    for s in result.systems.values():
        cache = datapipe.open(s.cache)
        assert s.bytes_per_sample == pytest.approx(float(cache.sample_nbytes.mean()))
        assert s.samples == len(cache)
    stages = result.stages
    assert stages["assemble"]["images_per_s"] > 0 and stages["augment"]["images_per_s"] > 0
    assert (stages["decode"]["images_per_s"] is not None) == (encoding == "jpeg")
    assert ("decoded for its crop" in stages["augment"]["what"]) == (encoding == "jpeg")
    assert result.attribution["end_to_end_s_per_image"] > 0


def test_caches_built_alike_get_numbered_names(formats):
    caches = [datapipe.open(formats[k]) for k in ("raw-crop", "jpeg-crop", "jpeg-crop", "raw-crop")]
    assert bench._system_names(caches) == ["datapipe", "datapipe-jpeg-crop", "datapipe-jpeg-crop-2", "datapipe-raw-crop"]


def test_a_missing_also_cache_is_one_line_before_anything_runs(formats, tmp_path, capsys):
    with pytest.raises(CacheError, match="does not exist"):
        bench.run(formats["raw-crop"], also=[tmp_path / "nope"], progress=False)
    assert cli.main(["bench", str(formats["raw-crop"]), "--also", str(tmp_path / "nope"), "--quiet"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "nope" in line and "does not exist" in line


OWN_PASS = """
import os, time
from datapipe.bench.timing import cpu_seconds
assert len(os.listdir("/proc/self/task")) == 1, "another thread would share the process's CPU clock"
before = cpu_seconds()  # the first reading imports psutil
start = time.process_time()
while time.process_time() - start < 0.002:
    pass
for _ in range(20):
    cpu_seconds()
print(cpu_seconds() - before)
"""


def test_cpu_seconds_counts_a_pass_shorter_than_a_clock_tick():
    """A fast loader's short pass takes a few ms of CPU: counted in /proc's ticks of 10 ms it read 0.0
    (or 0.01), and cpu_s_per_image with it. Measuring is not charged to the pass: finding the live
    children walks all of /proc (and imports psutil the first time), milliseconds a walk, more on a host
    of many processes; the first reading's import and twenty extra readings inside the pass would add
    tens of ms if it were. A fresh interpreter of one thread (numpy's BLAS threads spin a while after
    import, on the same clock) and no children measures its own pass."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", OWN_PASS], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    used = float(done.stdout)
    assert 0.002 <= used < 0.009, used


CHILD_SPIN = """
import sys, time
start = time.process_time()
while time.process_time() - start < 0.3:
    pass
print("spun", flush=True)
sys.stdin.read()
"""


def test_cpu_seconds_counts_live_and_reaped_children():
    """A worker process's CPU counts while it lives (from /proc) and after it is reaped (from the
    kernel's tally of waited-for children), once either way."""
    from datapipe.bench.timing import cpu_seconds

    before = cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", CHILD_SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        live = cpu_seconds() - before  # the child spun 0.3 s of CPU and waits, alive
    finally:
        child.communicate(timeout=60)
    reaped = cpu_seconds() - before
    # /proc's ticks round down by at most 10 ms; the child's start-up (an interpreter) adds a little.
    assert 0.29 <= live < 1.5, live
    assert 0.29 <= reaped < 1.5, reaped
    assert abs(reaped - live) < 0.2, (live, reaped)  # not counted twice once reaped


# ----------------------------------------------------------------------------- result files, checked first


def _no_run(*args, **kwargs):
    raise AssertionError("the bench ran before its output paths were checked")


@pytest.mark.parametrize("flag, name, message", [
    ("--plot", "chart.txt", ".txt is not a chart format"),
    ("--plot", "a-folder", "is a folder"),
    ("--json", "a-folder", "is a folder"),
    ("--json", "missing/r.json", "does not exist"),
    ("--plot", "missing/chart.png", "does not exist"),
])
def test_a_result_path_that_cannot_be_written_is_refused_before_anything_runs(tiny, tmp_path, capsys, monkeypatch,
                                                                               flag, name, message):
    (tmp_path / "a-folder").mkdir()
    monkeypatch.setattr(bench, "run", _no_run)
    assert cli.main(["bench", str(tiny / "cache"), flag, str(tmp_path / name), "--quiet"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"datapipe bench: error: {flag} ") and message in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder"]  # nothing written, next to it either


def test_the_chart_message_names_the_file_written(tiny, tmp_path, capsys):
    assert cli.main(["bench", str(tiny / "cache"), "--batch-size", "8", "--workers", "1", "--repeats", "1",
                     "--batches", "1", "--crop", "48", "--plot", str(tmp_path / "chart"), "--quiet"]) == 0
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "chart").exists()
    assert f"wrote {tmp_path / 'chart.png'}" in capsys.readouterr().out.splitlines()


# ----------------------------------------------------------------------------- what the figures count


class _Clock:
    """A fake perf_counter: the test moves time by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("come_back", [False, True])
def test_the_stall_meter_counts_every_step(monkeypatch, come_back):
    """N batches of 32 with a 50 ms step each and no wait: N steps of work, 32 / 0.050 = 640 img/s
    (counting only N - 1 steps read 960 img/s for N = 3)."""
    from datapipe import stats

    clock = _Clock()
    monkeypatch.setattr(stats.time, "perf_counter", clock)
    meter = stats.StallMeter()
    batches, step, size = 3, 0.050, 32
    for _ in range(batches):
        started = meter.begin()
        meter.record(started, 0.0, size)
        clock.now += step  # the model's step on this batch
    if come_back:  # the loop asks once more (the end of the epoch)
        meter.begin()
    s = meter.stats()
    assert s["seconds"] == pytest.approx(batches * step)
    assert s["images_per_s"] == pytest.approx(size / step)
    clock.now += 10  # asked again later: the same figures, not the time since
    assert meter.stats()["images_per_s"] == pytest.approx(size / step)


def test_the_stall_meter_counts_waits_and_steps(monkeypatch):
    from datapipe import stats

    clock = _Clock()
    monkeypatch.setattr(stats.time, "perf_counter", clock)
    meter = stats.StallMeter()
    for _ in range(4):  # each batch: 10 ms waiting for data, then a 30 ms step
        started = meter.begin()
        clock.now += 0.010
        meter.record(started, 0.010, 8)
        clock.now += 0.030
    s = meter.stats()
    assert s["images_per_s"] == pytest.approx(8 / 0.040) and s["wait_share"] == pytest.approx(0.25)


def test_the_stall_meter_is_only_read_by_stats_and_its_window_counts_the_latest_step(monkeypatch):
    """stats() in the loop's body (a live meter) froze the end of the last step at that call: 7 batches of a 200 ms
    step read 74.9 img/s where 7 steps allow 71.4. The window's figures left out its latest batch's step; a wait
    outside a delivered batch (an iteration begun, a timeout caught) counted as the model's time."""
    from datapipe import stats

    clock = _Clock()
    monkeypatch.setattr(stats.time, "perf_counter", clock)
    meter = stats.StallMeter()
    meter.begin()
    meter.add_wait(0.5)  # beginning the iteration: the readers finished the one it replaced
    clock.now += 0.5
    for _ in range(4):  # each batch: 10 ms waiting, then a 30 ms step, with a peek half-way through the step
        started = meter.begin()
        clock.now += 0.010
        meter.record(started, 0.010, 8)
        clock.now += 0.015
        meter.stats()
        clock.now += 0.015
    meter.finish()  # the loop asked once more: the epoch is over
    clock.now += 5
    s = meter.stats()
    assert s["seconds"] == pytest.approx(0.5 + 4 * 0.040) and s["wait_s"] == pytest.approx(0.5 + 4 * 0.010)
    assert s["recent"]["images_per_s"] == pytest.approx(s["images_per_s"])  # the window holds every batch
    assert s["recent"]["wait_share"] == pytest.approx(s["wait_share"])


def test_the_stall_meter_may_be_read_from_another_thread():
    """stats() from a monitoring thread raised "deque mutated during iteration" while the loop recorded."""
    import threading

    from datapipe import stats

    meter = stats.StallMeter(window=8)
    errors: list[BaseException] = []
    stop = threading.Event()

    def monitor() -> None:
        while not stop.is_set():
            try:
                meter.stats()
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)

    thread = threading.Thread(target=monitor)
    thread.start()
    for _ in range(20_000):
        meter.record(meter.begin(), 0.0, 1)
    stop.set()
    thread.join()
    assert errors == [] and meter.stats()["batches"] == 20_000


def test_the_model_step_figure_counts_every_step(tiny):
    """--step-ms 50 with batches of 8: the loop cannot go faster than 8 / 0.050 = 160 img/s."""
    result = bench.run(tiny / "cache", BenchSpec(batch_size=8, workers=1, repeats=1, batches=3, crop=48, step_ms=50),
                       progress=False)
    step = result.attribution["model_step"]
    bound = 8 / 0.050
    assert 0.5 * bound < step["images_per_s"] <= bound
    assert 0.0 <= step["wait_share"] < 0.5


def test_a_pass_of_more_batches_than_an_epoch_runs_over_epochs():
    """--batches beyond one epoch: the pass runs that many batches (the next epochs), as reported."""
    import torch

    from datapipe.bench.timing import timed_pass

    epoch = [(torch.zeros(4, 1), torch.zeros(4)), (torch.zeros(4, 1), torch.zeros(4)), (torch.zeros(2, 1), torch.zeros(2))]
    assert timed_pass(epoch, 7).images == 4 + 4 + 2 + 4 + 4 + 2 + 4
    assert timed_pass(epoch).images == 10  # without a count: one epoch
    assert timed_pass([], 5).images == 0  # a loader without batches ends the pass


def test_a_pass_reads_as_many_images_for_a_loader_whose_workers_end_with_partial_batches(tiny, tmp_path):
    """webdataset's workers each batch their own shards, so each ends an epoch with a partial batch: 300 samples
    at batch 64 came in 6 batches, and a pass of ceil(300 / 64) = 5 read 280 of them while the other systems read
    300. A pass takes batches until it has the images every system reads."""
    import torch

    from datapipe.bench import harness, peers
    from datapipe.bench.timing import timed_pass

    assert timed_pass([(torch.zeros(0, 1), torch.zeros(0))] * 3, 2, images=10).images == 0  # no images: it ends
    worker_ends = [(torch.zeros(n, 1), torch.zeros(n)) for n in (4, 4, 2, 1)]  # two workers' last batches partial
    assert timed_pass(worker_ends, 3, images=11).images == 11 and timed_pass(worker_ends, 3).images == 10
    cache = datapipe.open(tiny / "cache")
    listing = peers.cache_samples(cache, tiny / "src")
    wds = peers.get_peer("webdataset")
    assert wds.unavailable() is None  # the bench extra installs it
    wds.prepare(listing, tmp_path)
    loader = wds.loader(listing, tmp_path, batch_size=8, workers=2)
    try:
        batches = harness.BenchSpec(batch_size=8).batches_per_pass(len(cache))
        assert sum(1 for _ in loader) > batches  # the partial batches: the case itself
        assert timed_pass(loader, batches, images=len(cache)).images == len(cache)
    finally:
        harness.close_loader(loader)


def test_the_bench_runs_the_batches_it_reports(tiny):
    result = bench.run(tiny / "cache", BenchSpec(batch_size=8, workers=1, repeats=1, batches=7, crop=48), progress=False)
    assert result.config["batches_per_pass"] == 7  # 24 samples: 3 batches an epoch
    passes = result.systems["datapipe"].images_per_s
    assert len(passes) == 1 and passes[0] > 0


def test_an_also_cache_of_other_samples_is_refused(formats, tmp_path, capsys):
    other = datapipe.make_sample_dataset(tmp_path / "other-src", images=12, classes=3, seed=5)
    datapipe.build(other, tmp_path / "other", size=64, shard_size=10, cluster=datapipe.Cluster(scheduler="sync"),
                   progress=False)
    with pytest.raises(ArgumentError, match="--also .*another source"):
        bench.run(formats["raw-crop"], also=[tmp_path / "other"], progress=False)
    assert cli.main(["bench", str(formats["raw-crop"]), "--also", str(tmp_path / "other"), "--quiet"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--also" in line and "the same samples" in line and "24 samples" in line and "12 samples" in line


def test_the_work_dir_help_says_where_it_goes():
    parser = cli._parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["bench"]
    [work] = [a for a in sub._actions if a.dest == "work_dir"]
    assert "CACHE-bench-work beside the cache" in work.help and "../" not in work.help
