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


def _declared(extras: bool = True) -> set[str]:
    """Every distribution pyproject.toml names: the dependencies and (``extras``) each extra's, normalised."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"]]
    if extras:
        wanted += [r for extra in project["optional-dependencies"].values() for r in extra]
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in wanted}


def test_every_package_the_code_imports_is_declared():
    """The shards' checksums imported google_crc32c, which zarr brings only from 3.1.4: an install that met every
    declared bound (zarr 3.1.3) failed build, verify and the loader with ModuleNotFoundError."""
    import ast
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    declared = _declared()
    undeclared = {}
    for path in sorted((ROOT / "datapipe").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "datapipe" or top not in owners:
                    continue  # the standard library, the package, or a module not installed here (an optional one)
                dists = {d.lower().replace("_", "-") for d in owners[top]}
                if not dists & declared:
                    undeclared[f"{path.relative_to(ROOT)}: {top}"] = sorted(dists)
    assert undeclared == {}, undeclared


def test_the_sdist_carries_the_licences_and_types_and_no_half_test_suite(tmp_path):
    """The sdist held every tests/test_*.py but not their fixtures (collecting them failed), no LICENSE for the
    declared Apache-2.0, and no py.typed: mypy took the annotated package as untyped."""
    import shutil
    import tarfile

    tree = tmp_path / "tree"  # the tracked files: the build writes its egg-info beside them, never into the checkout
    for name in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n"):
        if name and (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    sdist = tmp_path / subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"],
        cwd=tree, capture_output=True, text=True, check=True).stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"LICENSE", "datapipe/py.typed", "datapipe/_native.c", "datapipe/_jpegcrop.c",
            "datapipe/_vendor/libjpeg/LICENSE.md", "datapipe/__main__.py"} <= names
    assert not [n for n in names if n.startswith("tests/")]
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_a_missing_dependency_is_one_line_naming_it(tmp_path, imaging):
    """Without torch (installed with --no-deps, or removed), a build without the compiled kernel, `datapipe bench`
    and `datapipe demo` ended in a ModuleNotFoundError traceback; a missing extra's package was one line."""
    import os

    imaging.write_source(tmp_path / "src", {"a": 2, "b": 2}, variety=False)
    build = ["build", str(tmp_path / "src"), str(tmp_path / "out"), "--size", "16", "--scheduler", "sync", "--quiet"]
    without_torch = ("import sys; sys.modules['torch'] = None; from datapipe.cli import main; "
                     "raise SystemExit(main(sys.argv[1:]))")
    env = {**os.environ, "DATAPIPE_NATIVE": "0"}
    for args in (build, ["bench", str(tmp_path / "out"), "--repeats", "1"]):
        done = subprocess.run([sys.executable, "-c", without_torch, *args], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert f"datapipe {args[0]}: error: it needs torch, one of datapipe's dependencies" in done.stderr, done.stderr
        if args is build:  # a cache to bench, built with torch
            subprocess.run([sys.executable, "-m", "datapipe", *build], check=True, timeout=120)
    # numpy is imported by the command line's parser already
    done = subprocess.run([sys.executable, "-c", without_torch.replace("torch", "numpy"), *build], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "datapipe: error: it needs numpy, one of datapipe's dependencies" in done.stderr, done.stderr
    from datapipe.cli import _REQUIRED

    assert {d.lower() for d in _REQUIRED.values()} == _declared(extras=False)  # the same list as pyproject.toml's


def test_python_m_datapipe_builds_on_a_local_cluster(tmp_path, imaging):
    """`python -m datapipe build` ran the command line at the import of datapipe/__main__.py, outside a main guard:
    every build on a LocalCluster (the default) was refused as an unguarded script."""
    imaging.write_source(tmp_path / "src", {"a": 2, "b": 2}, variety=False)
    done = subprocess.run([sys.executable, "-m", "datapipe", "build", str(tmp_path / "src"), str(tmp_path / "out"),
                           "--size", "16", "--workers", "1", "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert subprocess.run([sys.executable, "-m", "datapipe", "verify", str(tmp_path / "out")], capture_output=True,
                          timeout=120).returncode == 0
