"""docker/ stays runnable: the Compose services, the commands they run (checked against the real
datapipe, dask and examples/train.py command lines, so renaming an option breaks this test), the
object store they share (its endpoint, credentials and bucket), the Dockerfile's sources and the
commands in docker/README.md. No Docker engine is needed."""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILE = DOCKER / "Dockerfile"
README = DOCKER / "README.md"
SHELL_OPERATORS = {"&&", "||", ";", "|", "(", ")", "&"}
STORE_IMAGES = {"store": "minio/minio", "bucket": "minio/mc"}  # the object store and its one-shot bucket job
BUCKET = "datapipe"


# ----------------------------------------------------------------------------- helpers


@cache
def compose() -> dict:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict), f"{COMPOSE} is not a mapping"
    return data


def services() -> dict:
    return compose()["services"]


def argv_of(command) -> list[str]:
    """A Compose ``command``/``entrypoint`` (string or list) as an argv list."""
    return shlex.split(command) if isinstance(command, str) else [str(a) for a in command]


def simple_commands(argv: list[str]) -> list[list[str]]:
    """The simple commands of an argv: itself, each one inside an ``sh -c SCRIPT``, or the argv lists
    (``["datapipe", ...]``) that a ``python -c CODE`` runs."""
    if len(argv) >= 3 and Path(argv[0]).name in ("sh", "bash") and argv[1] == "-c":
        return shell_commands(argv[2])
    if len(argv) >= 3 and Path(argv[0]).name.startswith("python") and argv[1] == "-c":
        return python_commands(argv[2])
    return [argv]


def python_commands(code: str) -> list[list[str]]:
    """The list literals of strings in Python code (the argvs it hands to subprocess)."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.List) and node.elts and all(isinstance(e, ast.Constant) and isinstance(e.value, str)
                                                            for e in node.elts):
            found.append([e.value for e in node.elts])  # type: ignore[attr-defined]
    return found


def shell_commands(script: str) -> list[list[str]]:
    """Split a shell line on ``&&``, ``||``, ``;``, ``|`` and parentheses; drop a leading ``exec``."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], []
    for token in lexer:
        if token in SHELL_OPERATORS:
            commands.append(current)
            current = []
        else:
            current.append(token)
    commands.append(current)
    return [c[1:] if c[:1] == ["exec"] else c for c in commands if c]


def tool_commands(argvs, tool: str) -> list[list[str]]:
    """Every ``tool ...`` command (``datapipe`` or ``dask``) in the given argvs.

    A command is a simple command that starts with the tool, or the command a ``docker run`` /
    ``docker compose run`` line hands to a container (``docker compose run build datapipe info ...``).
    """
    found = []
    for argv in argvs:
        for cmd in simple_commands(argv):
            start = 0 if cmd[:1] == [tool] else None
            if cmd[:1] == ["docker"] and tool in cmd:
                start = cmd.index(tool)
            if start is not None:
                found.append(cmd[start:])
    return found


def compose_argvs() -> list[list[str]]:
    return [argv_of(s[key]) for s in services().values() for key in ("entrypoint", "command") if key in s]


def option_value(argv: list[str], option: str) -> str | None:
    for i, word in enumerate(argv):
        if word == option and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


def volume_mounts(service: dict) -> set[tuple[str, str]]:
    """(source, target) of each volume, in the short (``data:/data[:ro]``) or the long syntax."""
    mounts = set()
    for v in service.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            mounts.add((parts[0], parts[1]) if len(parts) > 1 else ("", parts[0]))
        else:
            mounts.add((v.get("source", ""), v["target"]))
    return mounts


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return out


def exec_form(arguments: str) -> list[str]:
    """CMD/ENTRYPOINT arguments: the JSON exec form, or the shell form run by ``sh -c``."""
    if arguments.startswith("["):
        return json.loads(arguments)
    return ["sh", "-c", arguments]


def build_context() -> Path:
    build = services()["scheduler"]["build"]
    return (COMPOSE.parent / (build if isinstance(build, str) else build.get("context", "."))).resolve()


def readme_argvs() -> list[list[str]]:
    """Shell commands and Compose ``command`` lists in the fenced code blocks of docker/README.md."""
    argvs = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", README.read_text(), flags=re.DOTALL):
        if lang in ("bash", "sh", "shell", "console"):
            for line in body.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    argvs.extend(shell_commands(line))
        elif lang in ("yaml", "yml"):
            doc = yaml.safe_load(body)
            for service in (doc or {}).get("services", {}).values():
                for key in ("entrypoint", "command"):
                    if isinstance(service, dict) and key in service:
                        argvs.append(argv_of(service[key]))
    return argvs


def check_datapipe(argv: list[str]) -> None:
    """The real ``datapipe`` parser accepts the command (argparse exits on an unknown option)."""
    from datapipe.cli import _parser

    assert argv[0] == "datapipe"
    parser = _parser()
    try:
        parser.parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"`datapipe` rejects {shlex.join(argv)!r} (exit {exc.code}); see the usage above")
    # argparse also accepts unambiguous prefixes (--image for --images): require the full names.
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    known = {o for action in subparsers.choices[argv[1]]._actions for o in action.option_strings}
    for word in argv[2:]:
        if word.startswith("--"):
            assert word.split("=", 1)[0] in known, f"`datapipe {argv[1]}` has no option {word}"


def dask_module(subcommand: str) -> str:
    """The module behind ``dask SUBCOMMAND``, from the ``dask_cli`` entry points that ``dask`` loads."""
    points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="dask_cli")}
    assert subcommand in points, f"`dask {subcommand}` is not a dask command; dask has {sorted(points)}"
    return points[subcommand].split(":")[0]


@cache
def dask_help(module: str) -> str:
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, f"python -m {module} --help failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def check_dask(argv: list[str]) -> None:
    """``dask SUB`` is a real entry point, its --help lists every option used, and it parses the line."""
    import click

    assert argv[0] == "dask" and len(argv) > 1, f"incomplete dask command {argv}"
    module = dask_module(argv[1])
    help_text = dask_help(module)
    for word in argv[2:]:
        if word.startswith("--"):
            option = word.split("=", 1)[0]
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text), (
                f"`dask {argv[1]}` has no option {option} (python -m {module} --help)")
    command = importlib.import_module(module).main
    try:
        command.make_context(f"dask {argv[1]}", list(argv[2:]))  # parses and converts; runs nothing
    except click.ClickException as exc:
        pytest.fail(f"`dask {argv[1]}` rejects {shlex.join(argv)!r}: {exc.format_message()}")



# ----------------------------------------------------------------------------- compose


def test_compose_file_parses_with_the_expected_services():
    names = set(services())
    assert {"store", "bucket", "scheduler", "worker-1", "worker-2", "sample", "build", "train"} <= names
    assert argv_of(services()["scheduler"]["command"])[:2] == ["dask", "scheduler"]
    for worker in ("worker-1", "worker-2"):
        assert argv_of(services()[worker]["command"])[:2] == ["dask", "worker"]
    assert [c[:2] for c in tool_commands([argv_of(services()["build"]["command"])], "datapipe")] == [
        ["datapipe", "build"]]
    assert [c[:2] for c in tool_commands([argv_of(services()["sample"]["command"])], "datapipe")] == [
        ["datapipe", "sample"]]


def test_every_service_runs_the_image_that_compose_builds():
    image = services()["scheduler"]["image"]
    context = build_context()
    build = services()["scheduler"]["build"]
    dockerfile = context / (build.get("dockerfile", "Dockerfile") if isinstance(build, dict) else "Dockerfile")
    assert dockerfile.resolve() == DOCKERFILE.resolve()
    assert context == ROOT, "the build context must be the repository root (the Dockerfile copies from it)"
    for name, service in services().items():
        want = STORE_IMAGES.get(name, image)
        assert service.get("image", "").split(":")[0] == want.split(":")[0] if name in STORE_IMAGES else (
            service.get("image") == want), f"service {name} runs {service.get('image')!r}, not {want!r}"


def datapipe_services() -> list[str]:
    return [name for name in services() if name not in STORE_IMAGES]


def environment(name: str) -> dict[str, str]:
    env = services()[name].get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def build_args() -> argparse.Namespace:
    from datapipe.cli import _parser

    return _parser().parse_args(tool_commands([argv_of(services()["build"]["command"])], "datapipe")[0][1:])


def train_args() -> argparse.Namespace:
    argv = argv_of(services()["train"]["command"])
    assert argv[0] == "python" and argv[1].endswith("examples/train.py"), argv
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        train = importlib.import_module("train")
    finally:
        sys.path.remove(str(ROOT / "examples"))
    try:
        return train.parse_args(argv[2:])
    except SystemExit as exc:
        pytest.fail(f"examples/train.py rejects {shlex.join(argv)!r} (exit {exc.code})")


def test_the_build_reads_and_writes_the_bucket_and_no_volume_is_shared():
    args = build_args()
    assert args.source == f"s3://{BUCKET}/source" and args.output == f"s3://{BUCKET}/cache"
    bucket_job = " ".join(argv_of(services()["bucket"]["entrypoint"]))
    assert f"mc mb --ignore-existing store/{BUCKET}" in bucket_job
    sample = " ".join(argv_of(services()["sample"]["command"]))
    assert f'"{BUCKET}/source/' in sample, "the sample job must upload where the build job reads"
    # the workers need no shared volume: they read the source objects and upload their shards themselves
    declared = set(compose().get("volumes") or {})
    users: dict[str, list[str]] = {}
    for name, service in services().items():
        for source, _ in volume_mounts(service):
            if source in declared:
                users.setdefault(source, []).append(name)
    assert all(len(names) == 1 for names in users.values()), f"a volume shared by services: {users}"


def test_every_datapipe_service_reaches_the_store_with_its_credentials():
    store = services()["store"]
    port = option_value(argv_of(store["command"]), "--address").rsplit(":", 1)[-1]
    minio = environment("store")
    for name in datapipe_services():
        env = environment(name)
        assert env.get("AWS_ENDPOINT_URL_S3") == f"http://store:{port}", name
        assert env.get("AWS_ACCESS_KEY_ID") == minio["MINIO_ROOT_USER"], name
        assert env.get("AWS_SECRET_ACCESS_KEY") == minio["MINIO_ROOT_PASSWORD"], name
    assert environment("bucket")["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"]
    assert f"http://store:{port}" in " ".join(argv_of(services()["bucket"]["entrypoint"]))
    assert "mc ready local" in " ".join(argv_of(store["healthcheck"]["test"]))


def test_botocore_takes_the_endpoint_from_aws_endpoint_url_s3():
    """The compose file gives the endpoint only as AWS_ENDPOINT_URL_S3: s3fs (through botocore) must read it."""
    pytest.importorskip("s3fs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"AWS_ENDPOINT_URL_S3": "http://store:9000", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                "AWS_DEFAULT_REGION": "us-east-1"})
    code = ("import s3fs; fs = s3fs.S3FileSystem(); fs.connect(); print(fs.s3.meta.endpoint_url)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "http://store:9000"


def test_train_streams_the_built_cache_into_a_volume_of_its_own():
    args = train_args()
    assert args.cache == build_args().output
    assert args.local_cache, "train must stream through a node-local cache"
    mounts = volume_mounts(services()["train"])
    assert any(Path(args.local_cache).is_relative_to(target) for source, target in mounts
               if source in (compose().get("volumes") or {}))
    assert Path(args.checkpoint).is_relative_to(Path(args.local_cache).parent)
    depends = services()["train"]["depends_on"]
    assert depends["build"].get("condition") == "service_completed_successfully"
    assert any(keyword == "COPY" and rest.split()[0] == "examples" for keyword, rest in dockerfile_instructions())


def test_jobs_wait_for_the_store_the_cluster_and_each_other():
    depends = services()["build"]["depends_on"]
    depends = depends if isinstance(depends, dict) else {name: {} for name in depends}
    assert {"scheduler", "worker-1", "worker-2", "sample"} <= set(depends)
    assert depends["sample"].get("condition") == "service_completed_successfully"
    for worker in ("worker-1", "worker-2"):
        assert "scheduler" in services()[worker]["depends_on"]
    assert services()["sample"]["depends_on"]["bucket"]["condition"] == "service_completed_successfully"
    assert services()["bucket"]["depends_on"]["store"]["condition"] == "service_healthy"


def test_workers_and_build_point_at_the_scheduler_service():
    scheduler = argv_of(services()["scheduler"]["command"])
    port = option_value(scheduler, "--port")
    dashboard = option_value(scheduler, "--dashboard-address")
    assert port and dashboard
    address = f"tcp://scheduler:{port}"
    for worker in ("worker-1", "worker-2"):
        assert argv_of(services()[worker]["command"])[2] == address
    build = tool_commands([argv_of(services()["build"]["command"])], "datapipe")[0]
    assert option_value(build, "--scheduler") == address
    published = {str(p).split(":")[-1] for p in services()["scheduler"]["ports"]}
    assert {port, dashboard.rsplit(":", 1)[-1]} <= published
    health = " ".join(argv_of(services()["scheduler"]["healthcheck"]["test"]))
    assert f":{dashboard.rsplit(':', 1)[-1]}/health" in health


def test_compose_datapipe_commands_parse_with_the_cli():
    commands = tool_commands(compose_argvs(), "datapipe")
    assert len(commands) >= 2
    for argv in commands:
        check_datapipe(argv)


def test_compose_dask_commands_are_real_entry_points_with_real_options():
    commands = tool_commands(compose_argvs(), "dask")
    assert {c[1] for c in commands} == {"scheduler", "worker"}
    for argv in commands:
        check_dask(argv)


def test_worker_memory_limit_is_a_size_dask_understands():
    from dask.utils import parse_bytes

    for worker in ("worker-1", "worker-2"):
        limit = option_value(argv_of(services()[worker]["command"]), "--memory-limit")
        assert parse_bytes(limit) >= 2**30


def test_docker_compose_config_accepts_the_file():
    """Only where the docker client has the compose plugin (validating needs no engine)."""
    try:
        version = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60,
                                 check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pytest.skip("no docker client")
    if version.returncode != 0:
        pytest.skip("the docker client has no compose plugin")
    proc = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- Dockerfile


def test_dockerfile_copies_sources_that_exist_and_installs_the_project():
    context = build_context()
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    workdir, copied, installed = "/", {}, False
    instructions = dockerfile_instructions()
    assert instructions[0][0] == "FROM" and instructions[0][1].startswith("python:3.11")
    for keyword, args in instructions:
        if keyword == "WORKDIR":
            workdir = args if args.startswith("/") else f"{workdir.rstrip('/')}/{args}"
        elif keyword in ("COPY", "ADD"):
            words = [w for w in (json.loads(args) if args.startswith("[") else shlex.split(args))
                     if not w.startswith("--")]
            assert not any(w.startswith("--from") for w in shlex.split(args)), "multi-stage COPY: extend this test"
            *sources, dest = words
            for src in sources:
                assert (context / src).exists(), f"{keyword} {src}: no such file in the build context {context}"
                assert not any(fnmatch.fnmatch(src, pattern.lstrip("/")) for pattern in ignored), (
                    f"{keyword} {src}: excluded by .dockerignore")
                target = dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"
                if dest.endswith("/") or dest in (".", "./") or len(sources) > 1:
                    target = f"{target.rstrip('/').removesuffix('/.')}/{Path(src).name}"
                copied[target.replace("/./", "/")] = src
        elif keyword == "RUN":
            words = shlex.split(args)
            if "pip" in words and "install" in words and any(w == "." or w.startswith(".[") for w in words):
                for needed in ("pyproject.toml", "datapipe"):
                    assert f"{workdir.rstrip('/')}/{needed}" in copied, (
                        f"`pip install .` in {workdir} but {needed} was not copied there: {copied}")
                installed = True
            assert "torch==" not in args or '"torch==2.13.0"' in args
    assert installed, "the Dockerfile does not install the project (pip install ... .)"


def test_dockerfile_commands_parse():
    instructions = dockerfile_instructions()
    argvs = [exec_form(args) for keyword, args in instructions if keyword in ("CMD", "ENTRYPOINT")]
    argvs += [["sh", "-c", args] for keyword, args in instructions if keyword == "RUN"]
    datapipe_commands = tool_commands(argvs, "datapipe")
    assert datapipe_commands, "the Dockerfile runs no datapipe command (CMD or a RUN check)"
    for argv in datapipe_commands:
        check_datapipe(argv)
    for argv in tool_commands(argvs, "dask"):
        check_dask(argv)
    exposed = {w for keyword, args in instructions if keyword == "EXPOSE" for w in args.split()}
    assert {"8786", "8787"} <= exposed


# ----------------------------------------------------------------------------- README


def test_readme_commands_parse():
    text = README.read_text()
    assert "docker compose -f docker/compose.yaml up --build" in text
    assert "http://localhost:8787" in text
    argvs = readme_argvs()
    datapipe_commands = tool_commands(argvs, "datapipe")
    assert any(c[:2] == ["datapipe", "build"] and option_value(c, "--scheduler") for c in datapipe_commands)
    for argv in datapipe_commands:
        check_datapipe(argv)
    for argv in tool_commands(argvs, "dask"):
        check_dask(argv)
    for argv in argvs:  # the compose files the README passes with -f (before the subcommand) exist
        i = 2
        while argv[:2] == ["docker", "compose"] and i + 1 < len(argv) and argv[i] == "-f":
            if "override" not in argv[i + 1]:  # the README's own example of an override file
                assert (ROOT / argv[i + 1]).is_file(), argv[i + 1]
            i += 2
