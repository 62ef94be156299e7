"""The package's layout: no import cycle, layers import only downward, a light core.

Imports are read from the source with ``ast`` — function-level imports included, ``if
TYPE_CHECKING:`` blocks left out (they never run) — so a cycle hidden inside a function is found
as well as one at module level.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "datapipe"

# The benchmark harness's dependencies (the bench and peers extras): never imported by the core.
HEAVY = ("matplotlib", "skimage", "psutil", "webdataset", "litdata", "streaming")

# Lower layers first; a module may import its own layer or any layer before it, never a later one.
LAYERS = [
    {"errors", "text", "_threads", "world", "stats", "native", "files"},
    {"records"},  # the format's documents, parsed and checked
    {"sources", "codecs", "bounded", "probe"},
    {"shards", "manifest"},  # the shard layout and the manifest: names, paths, documents
    {"writer", "output", "remote"},  # writing a shard; owning an output folder; objects in a store (fsspec URLs)
    {"builder", "dask_plugins"},
    {"cache", "fetch"},  # fetch: a remote cache's node-local shard cache, under a Cache
    {"dataset", "partition"},
    {"gpu_decode"},  # JPEG samples decoded on the GPU for the CUDA loader
    {"augment", "device"},
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST):
    """Every node below ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _walk(other)
            continue
        yield child
        yield from _walk(child)


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in its code."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join([*base, node.module] if node.module else base)
            else:
                stem = node.module or ""
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module.
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # datapipe.x.y where only datapipe.x is a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_graph_sees_function_level_imports():
    edges = graph()
    assert "datapipe.bench.harness" in edges["datapipe.cli"]  # `datapipe bench` imports it inside _bench
    assert "datapipe.bench.sample" in edges["datapipe.bench.demo"]


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_layers_import_only_downward():
    rank = {f"datapipe.{m}": i for i, layer in enumerate(LAYERS) for m in layer}
    edges = graph()
    assert set(rank) <= set(edges), sorted(set(rank) - set(edges))
    upward = [f"{m} (layer {rank[m]}) imports {t} (layer {rank[t]})"
              for m, targets in edges.items() if m in rank for t in sorted(targets) if rank.get(t, -1) > rank[m]]
    assert not upward, upward


def test_the_core_never_imports_the_benchmark_harness():
    edges = graph()
    core = [m for m in edges if not m.startswith("datapipe.bench") and m not in ("datapipe.cli", "datapipe")]
    reached = [(m, t) for m in core for t in edges[m] if t.startswith("datapipe.bench")]
    assert not reached, reached


def test_core_modules_import_no_heavy_dependency():
    for name, path in modules().items():
        if name.startswith("datapipe.bench"):
            continue
        for node in _walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad = [n for n in names if n.split(".")[0] in HEAVY]
                assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("code", [
    "import datapipe; datapipe.StreamingDataset; datapipe.DeviceLoader",
    "import datapipe; datapipe.build; datapipe.open; datapipe.augment.train",
    "import datapipe.cli",
])
def test_the_core_leaves_the_heavy_dependencies_unimported(code):
    check = f"{code}\nimport sys\nbad = [m for m in {HEAVY!r} if m in sys.modules]\nassert not bad, bad\n"
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_make_sample_dataset_stays_a_lazy_attribute():
    proc = subprocess.run([sys.executable, "-c", "import sys, datapipe; datapipe.make_sample_dataset; "
                           "assert 'skimage' not in sys.modules and 'psutil' not in sys.modules"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_core_install_pulls_none_of_the_harness_dependencies():
    import re
    import tomllib

    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in requirements}

    extras = project["optional-dependencies"]

    def closure(extra: str) -> set[str]:  # an extra's names, following datapipe[...] references
        found = set()
        for req in extras[extra]:
            inner = re.fullmatch(r"datapipe\[(\w+)\]", req)
            found |= closure(inner.group(1)) if inner else names([req])
        return found

    harness = {"psutil", "scikit-image", "matplotlib", "webdataset", "litdata", "mosaicml-streaming"}
    assert not names(project["dependencies"]) & harness
    assert {"psutil", "scikit-image", "matplotlib", "webdataset"} <= closure("bench")  # what `datapipe demo` runs
    assert {"litdata", "mosaicml-streaming"} <= closure("peers")
    assert closure("bench") <= closure("test")  # the tests run the harness
