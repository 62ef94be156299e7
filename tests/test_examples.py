"""The examples run the way a user runs them: build a small cache, train on it on the CPU, resume a
stopped run, and train under torch.distributed.run with two gloo ranks. Every run is a subprocess
with a time limit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import datapipe

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
IMAGES, CLASSES, SIZE = 48, 4, 48
EPOCH_LINE = re.compile(r"^\[rank (\d+)/(\d+)\] epoch (\d+): (\d+) batches", re.MULTILINE)
# Set by torchrun for its workers; a run of the single-process example must not inherit them.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                 "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def run(args: list[str], *, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    """Run a command to completion; on timeout kill its whole process group (torchrun's ranks too)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([str(a) for a in args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, args))} did not finish within {timeout} s\n{out}\n{err}")
    assert proc.returncode == 0, f"{' '.join(map(str, args))} exited with {proc.returncode}\n{out}\n{err}"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def epochs(stdout: str) -> dict[tuple[int, int], int]:
    """{(rank, epoch): batches} from the example's per-epoch lines."""
    return {(int(r), int(e)): int(n) for r, _, e, n in EPOCH_LINE.findall(stdout)}


def train_args(cache: Path, checkpoint: Path, *more) -> list:
    return [EXAMPLES / "train.py", "--cache", cache, "--crop", 32, "--device", "cpu", "--workers", 1,
            "--checkpoint", checkpoint, *more]


@pytest.fixture(scope="module")
def example_cache(tmp_path_factory) -> Path:
    """examples/build_dataset.py on a generated sample: a one-worker LocalCluster, 48 images of 48x48."""
    work = tmp_path_factory.mktemp("examples")
    proc = run([sys.executable, EXAMPLES / "build_dataset.py", "--output", work / "cache", "--images", IMAGES,
                "--classes", CLASSES, "--size", SIZE, "--shard-size", 16, "--workers", 1, "--quiet"],
               timeout=180, cwd=work)
    assert "LocalCluster: 1 workers" in proc.stdout
    return work / "cache"


def test_build_dataset_example(example_cache):
    cache = datapipe.open(example_cache)
    assert len(cache) == IMAGES and cache.shape == (SIZE, SIZE, 3) and len(cache.classes) == CLASSES
    assert len(list((example_cache.parent / "images").glob("*/*.jpg"))) == IMAGES

    # A rerun keeps the generated images (untouched) and finds every shard done.
    proc = run([sys.executable, EXAMPLES / "build_dataset.py", "--output", example_cache, "--images", IMAGES,
                "--classes", CLASSES, "--size", SIZE, "--shard-size", 16, "--scheduler", "sync", "--quiet"],
               timeout=120, cwd=example_cache.parent)
    assert f"{IMAGES} images already in" in proc.stdout
    assert "(0 built, 3 already done)" in proc.stderr


@pytest.fixture(scope="module")
def stopped_run(example_cache) -> tuple[subprocess.CompletedProcess, Path]:
    """One epoch of train.py stopped by --max-steps 2 (batches of 8: 6 per epoch)."""
    checkpoint = example_cache.parent / "stopped.pt"
    proc = run([sys.executable, *train_args(example_cache, checkpoint, "--epochs", 1, "--batch-size", 8,
                                            "--max-steps", 2)], timeout=180, cwd=example_cache.parent)
    return proc, checkpoint


def test_train_example_single_process(stopped_run):
    proc, checkpoint = stopped_run
    assert epochs(proc.stdout) == {(0, 0): 2}
    assert "[rank 0/1]" in proc.stdout and "img/s" in proc.stdout  # the loader's stats, per epoch
    ckpt = torch.load(checkpoint, map_location="cpu")
    assert ckpt["step"] == 2 and ckpt["epoch"] == 0 and not ckpt["epoch_done"]
    assert ckpt["loader"]["epoch"] == 0 and ckpt["loader"]["position"] == 2 * 8  # trained batches, not prefetched


def test_train_example_resumes_mid_epoch(stopped_run, example_cache):
    _, checkpoint = stopped_run
    final = example_cache.parent / "resumed.pt"
    proc = run([sys.executable, *train_args(example_cache, final, "--epochs", 2, "--batch-size", 8,
                                            "--resume", checkpoint)], timeout=180, cwd=example_cache.parent)
    assert "resumed from" in proc.stdout
    # The rest of epoch 0 (6 - 2 batches), then a whole epoch 1.
    assert epochs(proc.stdout) == {(0, 0): 4, (0, 1): 6}
    ckpt = torch.load(final, map_location="cpu")
    assert ckpt["step"] == 2 + 4 + 6 and ckpt["epoch"] == 1 and ckpt["epoch_done"]


def test_train_stopped_at_an_epochs_last_batch_resumes_at_the_next_epoch(example_cache, tmp_path):
    """--max-steps at exactly an epoch's end (batches of 8: 6 per epoch): the checkpoint says the epoch is
    done; the resume trains the next epoch whole (no empty rest of the finished one) and ends with the
    weights of an uninterrupted run."""
    run([sys.executable, *train_args(example_cache, tmp_path / "s.pt", "--epochs", 3, "--batch-size", 8,
                                     "--max-steps", 6)], timeout=180, cwd=tmp_path)
    ckpt = torch.load(tmp_path / "s.pt", map_location="cpu")
    assert (ckpt["epoch"], ckpt["epoch_done"], ckpt["step"], ckpt["loader"]["position"]) == (0, True, 6, IMAGES)
    proc = run([sys.executable, *train_args(example_cache, tmp_path / "r.pt", "--epochs", 2, "--batch-size", 8,
                                            "--resume", tmp_path / "s.pt")], timeout=180, cwd=tmp_path)
    assert epochs(proc.stdout) == {(0, 1): 6}
    run([sys.executable, *train_args(example_cache, tmp_path / "w.pt", "--epochs", 2, "--batch-size", 8)],
        timeout=180, cwd=tmp_path)
    resumed, whole = (torch.load(tmp_path / f"{n}.pt", map_location="cpu") for n in ("r", "w"))
    assert resumed["step"] == whole["step"] == 12
    for key, value in whole["model"].items():
        assert torch.equal(resumed["model"][key], value), key


@pytest.mark.distributed
def test_train_example_under_torchrun(example_cache):
    """Two gloo ranks with batches of 4 (a global step of 8: 6 steps per epoch), stopped and resumed."""
    work = example_cache.parent
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    checkpoint = work / "ddp.pt"
    proc = run([*launch, *train_args(example_cache, checkpoint, "--epochs", 1, "--batch-size", 4,
                                     "--max-steps", 2)], timeout=240, cwd=work)
    assert epochs(proc.stdout) == {(0, 0): 2, (1, 0): 2}, proc.stdout
    assert torch.load(checkpoint, map_location="cpu")["loader"]["position"] == 2 * 4 * 2

    proc = run([*launch, *train_args(example_cache, work / "ddp-resumed.pt", "--epochs", 1, "--batch-size", 4,
                                     "--resume", checkpoint)], timeout=240, cwd=work)
    seen = epochs(proc.stdout)
    assert seen == {(0, 0): 4, (1, 0): 4}, proc.stdout  # both ranks: the same, remaining 6 - 2 batches


def run_failing(args: list, *, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("more, message", [(["--images", IMAGES + 8], "holds another sample"),
                                           (["--images", 2], "--images (2) must be at least --classes")])
def test_build_dataset_mistakes_are_one_line(example_cache, more, message):
    proc = run_failing([sys.executable, EXAMPLES / "build_dataset.py", "--output", example_cache,
                        "--classes", CLASSES, "--size", SIZE, "--scheduler", "sync", "--quiet", *more],
                       timeout=120, cwd=example_cache.parent)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("build_dataset.py: error: ") and message in line


@pytest.mark.parametrize("more, message", [(["--resume", "missing.pt"], "--resume missing.pt: no such checkpoint"),
                                           (["--batch-size", IMAGES + 1], "no full batch to train on")])
def test_train_mistakes_are_one_line(example_cache, tmp_path, more, message):
    proc = run_failing([sys.executable, *train_args(example_cache, tmp_path / "c.pt", "--epochs", 1, *more)],
                       timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("train.py: error: ") and message in proc.stderr
    assert not (tmp_path / "c.pt").exists()


@pytest.mark.parametrize("more, message", [(["--batch-size", 5], "it is not a multiple of 5"),
                                           (["--batch-size", 8, "--seed", 5], "the saved state is for seed=0")])
def test_a_resume_with_other_options_than_the_checkpoints_is_one_line(stopped_run, example_cache, tmp_path, more,
                                                                       message):
    """A checkpoint saved at sample 16 resumed with a batch size that does not divide it, or another seed: the
    loader's StateError was a traceback (on every rank under torchrun)."""
    _, checkpoint = stopped_run
    proc = run_failing([sys.executable, *train_args(example_cache, tmp_path / "c.pt", "--epochs", 1,
                                                    "--resume", checkpoint, *more)], timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"train.py: error: --resume {checkpoint}: ") and message in line, proc.stderr
    assert not (tmp_path / "c.pt").exists()


def test_a_resume_on_another_cache_with_other_classes_is_the_loaders_one_line(stopped_run, tmp_path):
    """A checkpoint resumed on another cache of another class count failed on the model's weights first: a torch
    "size mismatch" error over three lines that never named the cache. The loader's state is loaded first."""
    _, checkpoint = stopped_run
    source = datapipe.make_sample_dataset(tmp_path / "src", images=IMAGES, classes=CLASSES + 1)
    other = tmp_path / "other"
    datapipe.build(source, other, size=SIZE, shard_size=16, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    proc = run_failing([sys.executable, *train_args(other, tmp_path / "c.pt", "--epochs", 1, "--batch-size", 8,
                                                    "--resume", checkpoint)],
                       timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"train.py: error: --resume {checkpoint}: the saved state is for build_id="), lines
    assert "size mismatch" not in proc.stderr


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_train_saves_a_checkpoint_when_stopped_and_resumes_exactly(example_cache, tmp_path, sig, code):
    """SIGTERM (a preempted job) or Ctrl-C mid-epoch: the step in progress ends, a checkpoint counts
    the batches trained on, one line, exit 143 / 130; resumed, the run ends with the very weights of
    an uninterrupted one (every later batch the same)."""
    import time

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    args = [str(a) for a in [sys.executable, *train_args(example_cache, tmp_path / "stopped.pt", "--epochs", 400,
                                                         "--batch-size", 2)]]
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        while "epoch 0:" not in (proc.stdout.readline() or "epoch 0:"):
            pass
        time.sleep(0.3)
        os.killpg(proc.pid, sig)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("train.py: stopped by ")
    ckpt = torch.load(tmp_path / "stopped.pt", map_location="cpu")
    # Stopped mid-epoch: the position counts the epoch's trained batches. A stop during an epoch's last
    # step finished that epoch: saved as done, at its end.
    in_epoch = ckpt["step"] - ckpt["epoch"] * (IMAGES // 2)
    assert 0 < in_epoch <= IMAGES // 2 and ckpt["loader"]["position"] == 2 * in_epoch
    assert ckpt["epoch_done"] == (in_epoch == IMAGES // 2)
    last = ckpt["epoch"] + 1  # the stopped epoch and one more
    ends = {}
    for name, more in (("resumed", ["--resume", tmp_path / "stopped.pt"]), ("whole", [])):
        run([sys.executable, *train_args(example_cache, tmp_path / f"{name}.pt", "--epochs", last + 1,
                                         "--batch-size", 2, *more)], timeout=300, cwd=tmp_path)
        ends[name] = torch.load(tmp_path / f"{name}.pt", map_location="cpu")
    assert ends["resumed"]["step"] == ends["whole"]["step"] == (last + 1) * (IMAGES // 2)
    for key, value in ends["whole"]["model"].items():
        assert torch.allclose(ends["resumed"]["model"][key].float(), value.float(), atol=1e-5), key
