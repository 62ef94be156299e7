"""The package surface: light import, the README's commands, the environment report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_is_light_and_changes_nothing():
    code = ("import sys, datapipe; heavy = [m for m in ('torch', 'dask', 'distributed', 'zarr', 'kornia', 'PIL') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_lazy_attributes_resolve():
    import datapipe

    assert callable(datapipe.build) and callable(datapipe.open)
    assert datapipe.StreamingDataset.__name__ == "StreamingDataset"
    assert hasattr(datapipe.augment, "train") and hasattr(datapipe.bench, "run")


def _commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", setup, flags=re.S)]


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one():
    commands = _commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    assert "datapipe demo" in demo and "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci.splitlines(), "the CI script must run the README's test command verbatim"


def test_environment_report_names_the_jpeg_decoder():
    from datapipe.cli import environment

    env = environment()
    assert "libjpeg-turbo" in env["decoders"]["jpeg"]
    assert env["torch"] and env["zarr"].startswith("3")
