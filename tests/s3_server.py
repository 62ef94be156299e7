"""A real S3-API server for the tests: moto's standalone server on loopback, in its own process.

Use the fixture ``s3`` (the session's server, running; registered in conftest.py); ``requires_s3`` marks tests
that need moto and s3fs without the server:

    def test_x(s3):
        url = s3.bucket()                 # "s3://<fresh bucket>"
        fs = s3fs.S3FileSystem(**s3.storage_options)

``storage_options`` are what s3fs (and datapipe's ``storage_options=``) take; ``env`` holds the same
credentials and endpoint as environment variables for subprocesses (the CLI, Dask workers).
Faults: ``pause()``/``resume()`` freeze and thaw the server (SIGSTOP/SIGCONT: connections hang, the
objects are kept); ``stop()``/``start()`` end it and start a fresh one on the same port (moto keeps its
objects in memory, so a restarted server is empty).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

MISSING = [name for name in ("moto", "s3fs", "flask") if importlib.util.find_spec(name) is None]
REASON = f"needs {', '.join(MISSING)} (pip install -e '.[test]' installs moto[server] and s3fs)"
requires_s3 = pytest.mark.skipif(bool(MISSING), reason=REASON)

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
_names = itertools.count()


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    """moto's server process on one fixed port, with the options and environment that reach it."""

    def __init__(self, port: int | None = None, *, log_dir: str | None = None) -> None:
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.storage_options: dict[str, Any] = {
            "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "endpoint_url": self.endpoint_url,
        }
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ENDPOINT_URL_S3": self.endpoint_url}
        self._log_dir = log_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._client: Any = None

    # ------------------------------------------------------------------ process

    def start(self, timeout: float = 60.0) -> None:
        """Start the server (empty) on this port and wait until it answers."""
        if self._proc is not None and self._proc.poll() is None:
            return
        log = subprocess.DEVNULL
        if self._log_dir:
            log = open(os.path.join(self._log_dir, f"moto-{self.port}.log"), "ab")  # noqa: SIM115 - the child keeps it
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS}, start_new_session=True,
        )
        if log is not subprocess.DEVNULL:
            log.close()  # type: ignore[union-attr]
        self._paused = False
        self._wait(timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server on port {self.port} exited with {self._proc.returncode}")
            try:
                with urllib.request.urlopen(self.endpoint_url + "/", timeout=2) as response:
                    response.read()
                return
            except urllib.error.HTTPError:
                return  # it answered, if only with an error status
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server on port {self.port} did not answer in {timeout:.0f} s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        """End the server (its objects are gone); the port stays this server's for start()."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            if self._paused:
                os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        self._paused = False

    def pause(self) -> None:
        """Freeze the server: it accepts connections but answers nothing until resume(); objects are kept."""
        assert self._proc is not None
        os.killpg(self._proc.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        assert self._proc is not None
        os.killpg(self._proc.pid, signal.SIGCONT)
        self._paused = False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------------ store

    def client(self) -> Any:
        """A boto3 S3 client for this server (for checks below s3fs: ETags, LastModified, raw puts), made once:
        making one takes a few hundred milliseconds of CPU, which a test polling the store would spend per look."""
        if self._client is None:
            import boto3

            self._client = boto3.client("s3", endpoint_url=self.endpoint_url,
                                        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                                        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"])
        return self._client

    def bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh unique name unless given) and return its URL, ``s3://name``."""
        name = name or f"test-{os.getpid()}-{next(_names)}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def objects(self, url: str) -> dict[str, dict[str, Any]]:
        """Every object under an ``s3://bucket/prefix`` URL: key -> {Size, ETag, LastModified}."""
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        found: dict[str, dict[str, Any]] = {}
        paginator = self.client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                found[obj["Key"]] = {"Size": obj["Size"], "ETag": obj["ETag"], "LastModified": obj["LastModified"]}
        return found

    def filesystem(self) -> Any:
        """A fresh (uncached) s3fs filesystem for this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)


@contextlib.contextmanager
def running_server(log_dir: str | None = None) -> Iterator[S3Server]:
    """A started server, killed on exit (for scripts and benchmarks outside pytest)."""
    server = S3Server(log_dir=log_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto server for the test session; skipped with the reason when moto or s3fs is not installed."""
    if MISSING:
        pytest.skip(REASON)
    with running_server() as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server) -> S3Server:
    """The session's server, running and answering (resumed or restarted if an earlier test left it paused or stopped)."""
    if s3_server._paused:
        s3_server.resume()
    if not s3_server.running:
        s3_server.start()
    return s3_server
