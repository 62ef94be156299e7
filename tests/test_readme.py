"""The README's commands, run as a user would type them.

The two set-up commands are held by tests/test_package.py (exactly two; CI runs the test one
verbatim) and by CI itself; here every other fenced command of the README runs verbatim, with HOME
pointed at a temporary folder that holds a small dataset at ``~/data/train``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from datapipe.testing import make_index_dataset

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _blocks(lang: str, section: str | None = None) -> list[str]:
    text = README if section is None else README.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [body for body in re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)]


def _env(home: Path) -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    return {**os.environ, "HOME": str(home), "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("home")
    make_index_dataset(home / "data" / "train", 48, classes=3, size=40)
    make_index_dataset(home / "data" / "val", 8, classes=2, size=40)  # fewer classes than the training set
    return home


def test_the_readme_is_short_and_every_fenced_block_is_accounted_for():
    assert len(README.splitlines()) <= 150
    fenced = re.findall(r"```(\w*)\n.*?```", README, flags=re.S)
    setup, quick_bash, quick_py = _blocks("bash", "Set up"), _blocks("bash", "Quickstart"), _blocks("python", "Quickstart")
    assert len(setup) == 2 and len(quick_bash) == 1 and len(quick_py) == 1
    assert len(fenced) == 4, "a new fenced block in the README needs a test that runs it"


def test_the_setup_commands_use_two_environments_and_extras_that_exist():
    demo, tests = (c.strip() for c in _blocks("bash", "Set up"))
    venvs = [re.search(r"python3 -m venv (\S+)", c).group(1) for c in (demo, tests)]
    assert venvs[0] != venvs[1], "the two set-up commands must not share one virtual environment"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for command in (demo, tests):
        for group in re.findall(r'"\.\[([\w,-]+)\]"', command):
            assert set(group.split(",")) <= set(extras), group
    assert "torch==" in demo and "torch==" in tests


def test_the_quickstart_commands_run_verbatim(home):
    (commands,) = _blocks("bash", "Quickstart")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], env=_env(home), capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (home / "cache" / "train" / "manifest.json").is_file()
    assert "48 samples" in proc.stdout.replace(",", "") or "48" in proc.stdout, proc.stdout
    assert "OK" in proc.stdout, proc.stdout
    import datapipe

    train, val = datapipe.open(home / "cache" / "train"), datapipe.open(home / "cache" / "val")
    assert list(val.classes) == list(train.classes) and len(set(val.classes)) == 3  # the training cache's labels


def test_the_quickstart_script_runs_verbatim(home, tmp_path):
    if not (home / "cache" / "train" / "manifest.json").exists():  # run alone: build it as the bash block does
        subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(home / "data" / "train"),
                        str(home / "cache" / "train"), "--size", "256", "--scheduler", "sync", "--quiet"],
                       check=True, env=_env(home), capture_output=True, timeout=600)
    (script,) = _blocks("python", "Quickstart")
    path = tmp_path / "train_quickstart.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=_env(home), capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wait_share" in proc.stdout or "images_per_second" in proc.stdout, proc.stdout


def test_docs_links_in_the_readme_exist():
    for target in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / target).is_file(), target
    assert shutil.which("bash")
