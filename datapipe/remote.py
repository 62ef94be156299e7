"""Sources and caches in object storage: fsspec URLs (``s3://bucket/prefix``, ``gs://``, ``az://``, ``file://``).

A location is a URL plus the storage options of its filesystem; credentials and the endpoint come the
way the ecosystem gives them (fsspec's configuration, AWS_ACCESS_KEY_ID / AWS_ENDPOINT_URL ... in the
environment, ``--storage-option key=value``). Object stores have no rename and no flock, so a cache is
written as objects each of which is whole once it exists (one PUT per file), in an order that makes the
last one the proof: a shard's ``zarr.json`` after its data, the manifest after every shard.

What datapipe deletes in object storage: only objects whose names are the shard layout's, under a shard
of its own build id, and the documents carrying that build id; any other object under the prefix stays.
fsspec and s3fs are imported only when a URL is used (``pip install 'datapipe[remote]'``).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import json
import os
import posixpath
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import (
    FULL_DISK,
    TOO_LARGE_ADVICE,
    ArgumentError,
    CacheError,
    ConfigMismatchError,
    DatapipeError,
    MissingExtraError,
    OutputBusyError,
    OutputError,
    RemoteStoreError,
    SourceError,
    env_seconds,
    local_os_error,
    one_line,
)
from .files import crc32c, free_mib
from .records import (
    BUILD_LOCK,
    FORMAT,
    INDEX_ROW_BYTES,
    LABELS,
    MANIFEST,
    PATHS,
    REPORT,
    BuildRecord,
    Manifest,
    parse_build_record,
    parse_json,
    parse_manifest,
)
from .shards import (
    GROUP_META,
    IMAGES_FILE,
    INDEX_FILE,
    INDEXED_IMAGES_FILE,
    LABELS_FILE,
    SHARD_FILES,
    SHARDS_DIR,
    shard_attributes,
    shard_layout,
)
from .text import show

URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
INSTALL = "pip install 'datapipe[remote]'"
LOCK_OBJECT = ".datapipe.lock"
LOCK_SETTLE = 1.0  # seconds between writing the lock object and reading it back (DATAPIPE_REMOTE_LOCK_SETTLE)
LOCK_TTL = 120.0  # seconds: a lock object not refreshed for this long is a dead build's (DATAPIPE_REMOTE_LOCK_TTL)
MAX_DOC_BYTES = 256 << 20
PART_BYTES = 8 << 20  # a shard's data object is uploaded in parts of this size while the shard is written
MIN_PART_BYTES = 5 << 20  # S3's smallest part (all but the last)
LIST_PAGE = 1000  # keys per page of a listing (S3's most)
GATHER = 128  # documents counted as one request in the deadline of a concurrent read of many (fsspec's cat)
STORE_TIMEOUT = 60.0  # seconds the store may take per request, per 8 MiB a write sends (DATAPIPE_STORE_TIMEOUT)
CONNECT_SECONDS = 60.0  # the least time given to making an S3 client (see connect), apart from any request's deadline
# The object names of a shard (relative to its folder) that datapipe writes, and so may replace or delete.
SHARD_OBJECTS = SHARD_FILES  # the objects of a shard, named as its files
SHARD_NAME = re.compile(r"\d{6}\.zarr")


def is_url(location: object) -> bool:
    """Whether ``location`` is an fsspec URL (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and bool(URL.match(location))


def local_path(location: Any) -> Any:
    """The local path a ``file://`` URL names (``file:///data/cache`` -> ``/data/cache``, percent-escapes
    decoded), so that it is built and read as the folder it is; anything else is returned as it is.

    Raises:
        ArgumentError: a ``file://`` URL that names another host, or no absolute path.
    """
    if not (isinstance(location, str) and location[:7].lower() == "file://"):
        return location
    from urllib.parse import unquote, urlsplit

    parts = urlsplit(location)
    if parts.netloc not in ("", "localhost") or not parts.path.startswith("/") or parts.query or parts.fragment:
        raise ArgumentError(f"{location} is not a file:// URL of a local folder (file:///absolute/path); "
                            "pass the folder's path")
    return unquote(parts.path)


# ----------------------------------------------------------------------------- storage options


# The words of an option's name (its last dotted part, split at "_", "-" and capitals) that make its value a
# credential, a name or a URL: such a value is always the text given (an all-digit access key stays a string).
TEXT_WORDS = frozenset({"key", "secret", "token", "password", "user", "username", "profile", "name", "url", "uri",
                        "endpoint", "region", "bucket", "account", "id", "arn", "project", "tenant", "sas", "string"})


def text_option(key: str) -> bool:
    """Whether the storage option ``key`` (dotted) holds a credential, a name or a URL (see ``TEXT_WORDS``)."""
    leaf = key.rsplit(".", 1)[-1]
    words = re.findall(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+", leaf)
    return any(w.lower() in TEXT_WORDS for w in words)


def parse_storage_options(items: Iterable[str], flag: str = "--storage-option") -> dict[str, Any]:
    """``key=value`` items as fsspec storage options, dotted keys nested (``client_kwargs.region_name=eu-west-1``).

    A value is the text given when its key names a credential, a name or a URL (a word of the key's last
    part is one of ``TEXT_WORDS``: ``key``, ``secret``, ``token``, ``endpoint_url``, ``region_name``,
    ``aws_access_key_id`` ...): ``key=12345678`` is the string "12345678". Any other value is read as JSON
    when it is JSON (a number, true/false, null, an object or an array) and is the text otherwise."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise ArgumentError(f"{flag} expects key=value (e.g. {flag} endpoint_url=http://127.0.0.1:9000), got {item!r}")
        value: Any = text
        if not text_option(key):
            with contextlib.suppress(ValueError):
                value = json.loads(text)
        node = options
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ArgumentError(f"{flag} {item!r}: {part!r} was given a value already and cannot also hold keys")
            node = child
        if isinstance(node.get(leaf), dict):
            raise ArgumentError(f"{flag} {item!r}: {key!r} holds nested keys already")
        node[leaf] = value
    return options


# The s3:// filesystem's options beyond its constructor's own parameters: fsspec's listings cache and
# instance cache (the rest of its keyword arguments go to aiobotocore's AioSession, whose parameters count too).
S3_FSSPEC_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"})
S3_TEXT = frozenset({"endpoint_url", "key", "secret", "token", "username", "password", "profile", "default_cache_type"})
S3_DICTS = frozenset({"client_kwargs", "config_kwargs", "s3_additional_kwargs", "session_vars"})
S3_BOOLS = frozenset({"anon", "use_ssl", "requester_pays", "default_fill_cache", "version_aware", "cache_regions",
                      "fixed_upload_size", "local_expiry_check", "use_listings_cache", "skip_instance_cache"})
S3_COUNTS = frozenset({"max_concurrency", "default_block_size", "max_paths"})
S3_CLIENT_TEXT = frozenset({"region_name", "api_version", "endpoint_url", "aws_access_key_id", "aws_secret_access_key",
                            "aws_session_token", "aws_account_id"})
CHECK_OPTIONS = "check its spelling against the filesystem's documentation (--storage-option, storage_options=)"


def check_storage_options(url: str, fs_class: type, options: dict[str, Any]) -> None:
    """Refuse, before anything is sent, storage options that ``fs_class`` (the filesystem of ``url``) does not
    take or whose values are of the wrong kind: s3fs takes any keyword and fails only at its first request
    (an unknown one is handed to aiobotocore's session), or with an AttributeError deep inside it.
    Filesystems other than s3fs are left to refuse their options themselves (see :func:`open_location`).

    Raises:
        ArgumentError: naming the option and what to check.
    """
    if not (fs_class.__name__ == "S3FileSystem" and fs_class.__module__.split(".")[0] == "s3fs"):
        return
    known, client_known = _s3_parameters(fs_class)
    where = f"{url}: storage option"
    for name, value in options.items():
        if name not in known:
            raise ArgumentError(f"{where} {name!r} is not an option of the s3:// filesystem (s3fs){_did_you_mean(name, known)}; "
                                f"{CHECK_OPTIONS}")
        _check_kind(where, name, value, text=name in S3_TEXT, mapping=name in S3_DICTS, flag=name in S3_BOOLS,
                    count=name in S3_COUNTS)
    if options.get("key") and options.get("username") or options.get("secret") and options.get("password"):
        raise ArgumentError(f"{url}: storage options key/secret and username/password are two names for the same "
                            "credentials; give one of them")
    client = options.get("client_kwargs") or {}
    for name, value in client.items():
        if name not in client_known:
            raise ArgumentError(f"{where} 'client_kwargs.{name}' is not an argument of the S3 client"
                                f"{_did_you_mean(name, client_known)}; {CHECK_OPTIONS}")
        _check_kind(where, f"client_kwargs.{name}", value, text=name in S3_CLIENT_TEXT)
    if options.get("config_kwargs"):
        from aiobotocore.config import AioConfig  # type: ignore[import-untyped]

        try:
            AioConfig(**options["config_kwargs"])
        except (TypeError, ValueError) as exc:
            raise ArgumentError(f"{where} 'config_kwargs' is refused by botocore's Config ({one_line(exc)}); "
                                f"{CHECK_OPTIONS}") from None
        # botocore's Config takes any value for these, which fail only at the first request (blamed on the store)
        for name, value in options["config_kwargs"].items():
            if name in ("connect_timeout", "read_timeout", "max_pool_connections") and (
                    isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
                    or (name == "max_pool_connections" and not isinstance(value, int))):
                what = "a whole number above 0" if name == "max_pool_connections" else "a number of seconds above 0"
                raise ArgumentError(f"{where} 'config_kwargs.{name}' must be {what}, got {value!r} "
                                    f"({type(value).__name__}); {CHECK_OPTIONS}")


@functools.lru_cache(maxsize=4)
def _s3_parameters(fs_class: type) -> tuple[frozenset[str], frozenset[str]]:
    """The options s3fs's filesystem takes, and the arguments of the S3 client (``client_kwargs``)."""
    import inspect

    from aiobotocore.session import AioSession  # type: ignore[import-untyped]
    from botocore.session import Session  # type: ignore[import-untyped]

    def params(fn: Any) -> set[str]:
        return {p.name for p in inspect.signature(fn).parameters.values()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}

    init = fs_class.__init__  # type: ignore[misc]  # the class's own: its metaclass's __call__ takes anything
    return (frozenset(params(init) | params(AioSession) | S3_FSSPEC_OPTIONS),
            frozenset(params(Session.create_client) - {"service_name"}))


def _check_kind(where: str, name: str, value: Any, *, text: bool = False, mapping: bool = False, flag: bool = False,
                count: bool = False) -> None:
    if value is None:
        return
    kind = ("a string" if text and not isinstance(value, str) else
            "a mapping of keys to values" if mapping and not isinstance(value, dict) else
            "true or false" if flag and not isinstance(value, bool) else
            "a whole number" if count and (isinstance(value, bool) or not isinstance(value, int)) else None)
    if kind is not None:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ArgumentError(f"{where} {name!r} must be {kind}, got {shown} ({type(value).__name__}); check its value "
                            "(--storage-option name.key=value sets one key of a mapping)")


def _did_you_mean(name: str, known: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    if not close and name == "endpoint":
        close = ["endpoint_url"]
    return f" (did you mean {close[0]!r}?)" if close else ""


# ----------------------------------------------------------------------------- locations


@dataclass(frozen=True)
class Location:
    """A place in object storage: its URL, the fsspec filesystem and the root path inside it."""

    url: str
    fs: Any
    root: str
    storage_options: dict[str, Any]
    timeout: float = STORE_TIMEOUT  # each request's deadline, per PART_BYTES a write sends (see call)

    def path(self, *keys: str) -> str:
        """The filesystem path of a key under the root (``keys`` joined with '/')."""
        return "/".join([self.root, *[k.strip("/") for k in keys if k]])

    def url_of(self, *keys: str) -> str:
        return "/".join([self.url.rstrip("/"), *[k.strip("/") for k in keys if k]])

    def key_of(self, path: str) -> str:
        """The key of a filesystem path under the root: what follows the root and its one separating slash (a
        key is literal: ``root//x`` is the key ``/x``, another object than ``root/x``)."""
        rel = path[len(self.root):]
        return rel[1:] if rel.startswith("/") else rel

    def under(self, root: str) -> Location:
        """The same store and options at another root path."""
        return Location(self.url, self.fs, root, self.storage_options, self.timeout)

    def call(self, method: str | Callable[..., Any], *args: Any, nbytes: int = 0, what: str = "",
             deadline: float | None = None, read: bool = False, **kwargs: Any) -> Any:
        """Call the filesystem's ``method`` (``pipe_file``, ``cat_file``, ``rm``, s3fs's ``call_s3`` ..., or a
        coroutine function on an async filesystem's loop) under a deadline (default: ``timeout`` seconds per
        PART_BYTES of the ``nbytes`` it sends, at least ``timeout``).

        An S3 client has timeouts for connecting and for reading an answer, none for sending: a store
        that stops reading in the middle of a request body (it keeps the connection open, its receive
        window at zero) would hold the request without end; and a request the store never answers is
        retried by botocore and again by s3fs, for about seven minutes. On an async filesystem (s3fs,
        gcsfs, adlfs) the call runs on the filesystem's event loop and is cancelled at the deadline, which
        closes its connection; a blocking filesystem (``file://``) is called as it is.

        Raises:
            RemoteStoreError: the deadline passed (the message names ``what``, or the URL).
        """
        fs = self.fs
        if not (getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None):
            assert isinstance(method, str), "a coroutine function runs on an async filesystem's loop"
            return getattr(fs, method)(*args, **kwargs)
        from fsspec.asyn import sync

        connect(fs, self.timeout, what or self.url)  # s3fs's client, made outside the request's deadline
        if deadline is None:
            deadline = self.timeout * max(1.0, nbytes / PART_BYTES)
        try:
            func = method if callable(method) else getattr(fs, f"_{method}")
            return sync(fs.loop, func, *args, timeout=deadline, **kwargs)
        except TimeoutError:  # fsspec's FSTimeoutError, or the client's own timeout surfacing as one
            did = "answer" if read else f"take a write of {nbytes:,} bytes"
            raise RemoteStoreError(f"{what or self.url}: the store did not {did} within {deadline:g} s "
                                   f"(DATAPIPE_STORE_TIMEOUT: {self.timeout:g} s per request, per 8 MiB sent); check "
                                   "that it is up and run the command again (a build resumes: finished shards are "
                                   "kept)") from None

    @property
    def cleanup_seconds(self) -> float:
        """The most a best-effort clean-up after a failure may take: one request's deadline, CLEANUP_SECONDS at most."""
        return min(CLEANUP_SECONDS, self.timeout)

    def read(self, method: str | Callable[..., Any], *args: Any, what: str = "", requests: int = 1, **kwargs: Any) -> Any:
        """:meth:`call` for a read of ``requests`` requests (``timeout`` seconds each)."""
        return self.call(method, *args, what=what, deadline=self.timeout * max(1, requests), read=True, **kwargs)


CLEANUP_SECONDS = 10.0  # the most a best-effort cleanup after a failure may take (Location.cleanup_seconds)


def briefly(cleanup: Any, seconds: float) -> None:
    """Run a best-effort ``cleanup`` of the store for at most ``seconds``, its errors ignored: it runs in a daemon
    thread, so a store that stopped answering does not hold the exit."""

    def run() -> None:
        with contextlib.suppress(Exception):
            cleanup()

    thread = threading.Thread(target=run, daemon=True, name="datapipe-store-cleanup")
    thread.start()
    thread.join(seconds)


def store_timeout() -> float:
    """Seconds the store may take per request, per 8 MiB a write sends: ``DATAPIPE_STORE_TIMEOUT`` (default 60)."""
    return env_seconds("DATAPIPE_STORE_TIMEOUT", STORE_TIMEOUT)


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError:
        raise MissingExtraError(f"URLs need fsspec, which is not installed: {INSTALL}") from None
    return fsspec


def open_location(url: str, storage_options: dict[str, Any] | None = None, timeout: float = STORE_TIMEOUT) -> Location:
    """Open the filesystem of ``url`` (fsspec's own configuration and environment apply, then ``storage_options``);
    ``timeout``: each request's deadline, per 8 MiB a write sends (the commands pass :func:`store_timeout`).

    Raises:
        MissingExtraError: fsspec, or the filesystem's package (s3fs, gcsfs, adlfs), is not installed.
        ArgumentError: the URL's scheme is unknown or the storage options are refused by the filesystem.
    """
    fsspec = _fsspec()
    options = dict(storage_options or {})
    scheme = url.split("://", 1)[0].lower()
    chained = "::" in scheme  # simplecache::s3://... is left to fsspec
    if not chained:
        url = scheme + url[len(scheme):]  # S3://bucket is s3://bucket
        try:
            fs_class = fsspec.get_filesystem_class(scheme)
        except ImportError as exc:
            raise MissingExtraError(f"{url}: the {scheme}:// filesystem needs a package that is not installed ({exc}); "
                                    f"{INSTALL} (s3fs), or gcsfs / adlfs for gs:// and az://") from None
        except ValueError as exc:
            raise ArgumentError(f"{url}: {exc}; check the URL's scheme (s3://, gs://, az://, file://)") from None
        check_storage_options(url, fs_class, options)
    try:
        if chained or "::" not in url:
            fs, root = fsspec.core.url_to_fs(url, **options)
        else:  # "::" in a key is part of the key, never the chaining fsspec.core.url_to_fs would take it for
            fs = fsspec.filesystem(scheme, **{**fs_class._get_kwargs_from_urls(url), **options})
            root = fs_class._strip_protocol(url)
    except ImportError as exc:
        raise MissingExtraError(f"{url}: the {scheme}:// filesystem needs a package that is not installed ({exc}); "
                                f"{INSTALL} (s3fs), or gcsfs / adlfs for gs:// and az://") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ArgumentError(f"{url}: the {scheme}:// filesystem refuses the storage options ({one_line(exc)}); "
                            "check --storage-option (storage_options=): each name and value") from None
    return Location(url=url.rstrip("/"), fs=fs, root=str(root).rstrip("/"), storage_options=options,
                    timeout=float(timeout))


# The packages of object-store clients, whose own exceptions derive from none of OSError, ValueError or
# RuntimeError (botocore's EndpointConnectionError and NoCredentialsError, aiohttp's, google-auth's, azure's).
CLIENT_PACKAGES = frozenset({"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "gcsfs", "google", "adlfs",
                             "azure", "urllib3", "requests"})


def store_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the object store's (or its client's) failure, not datapipe's own error or defect."""
    if isinstance(exc, DatapipeError):  # says what to do already
        return False
    if isinstance(exc, OSError | ValueError | RuntimeError):  # what fsspec filesystems raise
        return True
    return any(c.__module__.split(".")[0] in CLIENT_PACKAGES for c in type(exc).__mro__)


@contextlib.contextmanager
def store_errors(loc: Location, what: str, error: type[Exception] = OutputError) -> Iterator[None]:
    """Errors of the object store (no such bucket, no permission, no connection) as one line naming the URL."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, OSError) and local_os_error(exc):
            raise error(local_disk_message(exc, f"{loc.url}: cannot {what}")) from None
        if not store_failure(exc):
            raise
        raise error(f"{loc.url}: cannot {what} ({type(exc).__name__}: {one_line(exc)}); check the URL, the credentials "
                    "and the endpoint (--storage-option, AWS_* variables)") from None


STAGING = "datapipe-shard-*"  # the folders a build stages its shards in before they are uploaded (builder.STAGING_PREFIX)


def local_disk_message(exc: OSError, head: str) -> str:
    """What to say of a local OSError (see :func:`datapipe.errors.local_os_error`) met on the way to or from a
    store: it names the local file or, without one, the folder where a build stages its shards (on the
    machine that raised it: a Dask worker's ``$TMPDIR``), and says it is no fault of the store."""
    import tempfile

    reason = exc.strerror or one_line(exc)
    if exc.filename:
        place = f"{os.fspath(exc.filename)} (a local path)"
        folder = os.path.dirname(os.fspath(exc.filename))
    else:
        folder = tempfile.gettempdir()
        place = (f"a local disk, not the store: while a build writes into a store, each shard is staged first in "
                 f"{os.path.join(folder, STAGING)} on the machine that builds it (its TMPDIR)")
    if exc.errno == errno.EFBIG:
        return f"{head}: {reason} on {place}: {TOO_LARGE_ADVICE} or point TMPDIR at another file system " \
            "(on every Dask worker), and run the command again (a build resumes: finished shards are kept)"
    if exc.errno in FULL_DISK:
        free = f", {mib} free there now" if (mib := free_mib(folder)) else ""
        todo = ("free space there, or point TMPDIR at a folder on a larger disk (on every Dask worker), and run the "
                "command again (a build resumes: finished shards are kept)")
        return f"{head}: {reason} on {place}{free}; {todo}"
    return f"{head}: {reason} on {place}; make it writable, or point TMPDIR at a writable folder (on every Dask " \
        "worker), and run the command again"


# ----------------------------------------------------------------------------- objects


def listing(loc: Location, prefix: str = "", *, markers: bool = False) -> dict[str, int]:
    """Every object under ``prefix`` (a key under the root): key -> size in bytes. One listing request (paged;
    on S3 each page under the location's deadline). ``markers``: also the folders, as ``key/`` (on S3 the
    zero-byte objects a console's "Create folder" makes; elsewhere the directories)."""
    if is_s3fs(loc.fs):
        return _s3_listing(loc, prefix, markers=markers)
    loc.fs.invalidate_cache(loc.path(prefix))  # the store, not the filesystem's memory of an earlier listing
    try:
        found = loc.fs.find(loc.path(prefix), detail=True)
    except FileNotFoundError:
        return {}
    out: dict[str, int] = {}
    for path, info in found.items():
        if info.get("type", "file") == "file":
            out[loc.key_of(path)] = int(info.get("size") or 0)
        elif markers and info.get("type") == "directory" and loc.key_of(path):
            out[loc.key_of(path).rstrip("/") + "/"] = 0
    return out


def _s3_listing(loc: Location, prefix: str, *, markers: bool = False) -> dict[str, int]:
    """listing() on S3: ListObjectsV2 page by page (1,000 keys each), s3fs's own requests, each under the
    deadline (a listing of millions of objects is thousands of pages: no deadline can cover it whole)."""
    bucket, key, _ = loc.fs.split_path(loc.path(prefix))
    folder = f"{key.rstrip('/')}/" if key else ""
    out: dict[str, int] = {}
    token: str | None = None
    while True:
        request: dict[str, Any] = {"Bucket": bucket, "Prefix": folder, "MaxKeys": LIST_PAGE}
        if token:
            request["ContinuationToken"] = token
        page = loc.read("call_s3", "list_objects_v2", what=loc.url_of(prefix) + "/ (list)", **request)
        for obj in page.get("Contents", []):
            if not obj["Key"].endswith("/"):  # a folder marker is no object of a cache
                out[loc.key_of(f"{bucket}/{obj['Key']}")] = int(obj.get("Size") or 0)
            elif markers and obj["Key"] != folder:
                out[loc.key_of(f"{bucket}/{obj['Key'].rstrip('/')}") + "/"] = 0
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            return out


def read_bytes(loc: Location, key: str, limit: int = MAX_DOC_BYTES) -> bytes | None:
    """The object at ``key`` (None when there is none); CacheError when it holds more than ``limit`` bytes."""
    try:
        data = b"".join(_ranges(loc, key, limit + 1))
    except FileNotFoundError:
        return None
    if len(data) > limit:
        raise CacheError(f"{loc.url_of(key)} holds more than the {limit:,} bytes this object may hold")
    return data


def _ranges(loc: Location, key: str, most: float = float("inf"), chunk: int = PART_BYTES) -> Iterator[bytes]:
    """An object's bytes (the first ``most`` of them) by ranged GETs of ``chunk``, each under the deadline
    (opening the file would first ask for its size, and list its prefix when it is missing)."""
    size = 0
    while size < most:
        want = int(min(chunk, most - size))
        data = _read_range(loc, key, size, size + want)
        yield data
        size += len(data)
        if len(data) < want:
            return


def _read_range(loc: Location, key: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an object by one ranged GET under the deadline (fewer at its end; none at or
    past it, where S3 answers 416 InvalidRange, which an empty object also gives for any range)."""
    try:
        return bytes(loc.read("cat_file", loc.path(key), start=start, end=end, what=loc.url_of(key)))
    except FileNotFoundError:
        raise
    except OSError as exc:
        if past_the_end(exc):
            return b""
        raise


def past_the_end(exc: OSError) -> bool:
    """Whether ``exc`` is a store's answer to a range at or past an object's end (S3's 416 InvalidRange, which an
    empty object gives for any range): no byte, rather than a failure."""
    return "not satisfiable" in str(exc) or "InvalidRange" in str(exc)


def read_doc(loc: Location, key: str) -> Any | None:
    """The JSON document at ``key`` (None when there is none); CacheError naming the URL when it is not JSON."""
    data = read_bytes(loc, key)
    return None if data is None else parse_json(data, loc.url_of(key))  # a URL, never a Path (s3:// -> s3:/)


def read_lock(loc: Location) -> Any | None:
    """The lock object's document (see :class:`RemoteLock`); None when there is none, or it is damaged (a damaged
    lock object holds nobody)."""
    try:
        return read_doc(loc, LOCK_OBJECT)
    except CacheError:
        return None


def read_docs(loc: Location, keys: list[str]) -> dict[str, bytes]:
    """Several small objects at once (the filesystem fetches them concurrently); missing ones left out."""
    if not keys:
        return {}
    got = loc.read("cat", [loc.path(k) for k in keys], on_error="omit", what=f"{loc.url}: {len(keys)} documents",
                   requests=-(-len(keys) // GATHER))
    return {loc.key_of(path): bytes(data) for path, data in got.items() if isinstance(data, bytes | bytearray)}


def write_bytes(loc: Location, key: str, data: bytes) -> None:
    """One object, written whole by a single PUT: a reader sees the old object or the new one."""
    loc.call("pipe_file", loc.path(key), data, nbytes=len(data), what=loc.url_of(key))


def _named(loc: Location, keys: list[str]) -> str:
    """The objects of a request of several, for its error: the first one's URL and how many more."""
    return loc.url_of(keys[0]) + (f" (and {len(keys) - 1} more)" if len(keys) > 1 else "")


def write_objects(loc: Location, objects: dict[str, bytes]) -> None:
    """Several objects (key -> bytes) at once, each written whole (the filesystem sends them concurrently)."""
    if objects:
        loc.call("pipe", {loc.path(k): v for k, v in objects.items()}, nbytes=sum(map(len, objects.values())),
                 what=_named(loc, sorted(objects)))


def put_file(loc: Location, local: str | os.PathLike[str], key: str) -> None:
    """A local file as the object ``key``, written whole."""
    loc.call("put_file", os.fspath(local), loc.path(key), nbytes=os.stat(local).st_size, what=loc.url_of(key))


def write_doc(loc: Location, key: str, doc: Any) -> None:
    write_bytes(loc, key, json.dumps(doc, indent=1, ensure_ascii=False).encode())


def delete(loc: Location, keys: Iterable[str]) -> None:
    """Delete exactly these keys (never a prefix)."""
    keys = list(keys)
    paths = [loc.path(k) for k in keys]
    if paths:
        with contextlib.suppress(FileNotFoundError):
            loc.read("rm", paths, what=_named(loc, keys), requests=-(-len(paths) // 1000))


POLL_SECONDS = 0.02  # how often the uploader looks for newly written bytes


class ShardUpload:
    """Upload one shard while its task is still writing it, its zarr.json last.

    A thread of the task follows the shard's local data file as it grows and streams it into the store
    (``fs.open(path, "wb")``: parts of ``part_bytes`` leave as soon as they are written; the object
    appears only when the upload is completed, after the shard's last byte), so the upload overlaps the
    decoding of the shard's images instead of following it. ``before`` (the claim of the shard's folder,
    see :func:`datapipe.builder._claim_remote_shard`) runs first in that thread: nothing is written if it
    fails. :meth:`finish` then uploads the rest and the group's zarr.json last, the proof that the shard is
    whole; :meth:`abort` abandons an unfinished upload (an S3 multipart upload is aborted: it never becomes
    an object). A process killed mid-upload leaves its claim and at most an unfinished multipart upload,
    which no reader sees (a bucket lifecycle rule ``AbortIncompleteMultipartUpload`` reclaims its parts).
    Filesystems without buffered writes (``file://``) get the data object whole at the end, as put_file
    writes it.
    """

    def __init__(self, loc: Location, key: str, *, before: Any = None, part_bytes: int | None = None) -> None:
        self.loc = loc
        self.key = key
        self.part = max(MIN_PART_BYTES, part_bytes or PART_BYTES)
        self.stream = bool(getattr(loc.fs, "async_impl", False))  # s3fs, gcsfs, adlfs: buffered, atomic at close
        self._before = before
        self._source: tuple[Any, str] | None = None  # the data file open for reading, its name in the shard
        self._opened = threading.Event()
        self._written = threading.Event()
        self._cancel = threading.Event()
        self._before_done = threading.Event()  # ``before`` ran (or failed: see _error)
        self._error: BaseException | None = None
        self.sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="datapipe-shard-upload")
        self._thread.start()

    def follow(self, data: Path, rel: str) -> None:
        """The task's writer opened the shard's data file ``data`` (``rel``: its name inside the shard); it is
        opened here, in the task's thread, before the writer may rename its folder."""
        self._source = (open(data, "rb"), rel)  # noqa: SIM115 - closed by the upload thread
        self._opened.set()

    def _run(self) -> None:
        sink: _S3Parts | _BufferedObject | None = None
        try:
            try:
                if self._before is not None:
                    self._before()
            finally:
                self._before_done.set()
            while not (self._opened.wait(POLL_SECONDS) or self._written.is_set() or self._cancel.is_set()):
                pass
            if self._source is None:
                return
            if self._cancel.is_set():
                self._source[0].close()
                return
            local, rel = self._source
            with local:
                if not self.stream:
                    self._written.wait()
                    if not self._cancel.is_set() and os.fstat(local.fileno()).st_size:
                        write_bytes(self.loc, f"{self.key}/{rel}", local.read())
                        self.sent = os.fstat(local.fileno()).st_size
                    return
                sink = _S3Parts(self.loc, f"{self.key}/{rel}") if is_s3fs(self.loc.fs) else \
                    _BufferedObject(self.loc, f"{self.key}/{rel}", self.part)
                while True:
                    done = self._written.is_set()
                    size = os.fstat(local.fileno()).st_size
                    while size - self.sent >= self.part or (done and size > self.sent):
                        chunk = os.pread(local.fileno(), min(self.part, size - self.sent), self.sent)
                        sink.send(chunk, last=done and self.sent + len(chunk) == size)
                        self.sent += len(chunk)
                        if self._cancel.is_set():
                            return
                    if done:
                        break
                    if self._cancel.wait(POLL_SECONDS):
                        return
            sink.complete()  # the object appears now, whole
            sink = None
        except BaseException as exc:  # noqa: BLE001 - handed to the task by finish()
            self._error = exc
        finally:
            if sink is not None:
                sink.abort()  # an S3 multipart upload is aborted: no object appears

    def finish(self, folder: Path) -> list[str]:
        """The shard is written (renamed to ``folder``): upload the rest of its data and, meanwhile, its other
        files, then its zarr.json; returns the keys written. Raises what the upload raised."""
        self._written.set()  # the upload thread sends the data's last part
        self._before_done.wait()
        if self._error is not None:  # nothing more is written where ``before`` refused to write
            self._thread.join()
            raise self._error
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        data = self._source[1] if self._source is not None else None
        rest = {f"{self.key}/{p.relative_to(folder).as_posix()}": p.read_bytes() for p in files
                if p.relative_to(folder).as_posix() not in (data, GROUP_META)}
        try:
            write_objects(self.loc, rest)
        finally:
            self._thread.join()
        if self._error is not None:
            raise self._error
        if data is not None and (folder / data).is_file() and self.sent != (folder / data).stat().st_size:
            raise OSError(f"{self.loc.url_of(self.key, data)}: {self.sent:,} bytes uploaded of "
                          f"{(folder / data).stat().st_size:,}")
        keys = [*rest, *([f"{self.key}/{data}"] if self.sent else [])]
        if (folder / GROUP_META).is_file():
            write_bytes(self.loc, f"{self.key}/{GROUP_META}", (folder / GROUP_META).read_bytes())
            keys.append(f"{self.key}/{GROUP_META}")
        return keys

    def abort(self) -> None:
        """The task failed: stop the upload and abandon what it sent (no object appears)."""
        self._cancel.set()
        self._written.set()
        self._thread.join()


def is_s3fs(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's, whose requests datapipe sends itself: a shard's multipart upload part by part
    under deadlines, listings page by page, the node cache's downloads checksummed as they arrive."""
    return callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))


def connect(fs: Any, timeout: float, what: str) -> None:
    """Make an s3fs filesystem's client, when it has none (or its connections were closed), under a deadline of
    its own: ``timeout`` or CONNECT_SECONDS, the longer. s3fs would make it inside the first request, whose
    deadline would then also cover the lookup of the credentials (a ``credential_process``, SSO, the instance
    metadata service: seconds) and the loading of the service's model (0.2 s of CPU, over 1.5 s on a busy
    host), and a short ``timeout`` would fail a store that answers at once. Other filesystems: nothing to do.

    Raises:
        RemoteStoreError: the client was not made within the deadline, or its configuration was refused (the
            message names ``what`` and the client's reason).
    """
    if not is_s3fs(fs) or getattr(fs, "loop", None) is None or not callable(getattr(fs, "set_session", None)):
        return
    from fsspec.asyn import sync

    seconds = max(timeout, CONNECT_SECONDS)
    try:
        sync(fs.loop, fs.set_session, timeout=seconds)
    except TimeoutError:
        raise RemoteStoreError(f"{what}: the S3 client was not made within {seconds:g} s (making it looks up the "
                               "credentials: a credential_process, SSO or the instance metadata service did not "
                               "answer); check the AWS configuration (AWS_PROFILE, ~/.aws/config) or pass the "
                               "credentials in storage_options") from None
    except Exception as exc:
        if not store_failure(exc):
            raise
        raise RemoteStoreError(f"{what}: the S3 client cannot be made: {one_line(exc)}; check the AWS "
                               "configuration (AWS_PROFILE, ~/.aws/config) or the storage options") from None


class _S3Parts:
    """One object sent as an S3 multipart upload, a part per :meth:`send`, each request under the location's
    deadline (see :meth:`Location.call`); an object that is one part is sent by a single PUT. The requests
    are s3fs's own (its extra request arguments apply), so the object is what ``fs.open(path, "wb")`` writes."""

    def __init__(self, loc: Location, key: str) -> None:
        self.loc = loc
        self.key = key
        self.url = loc.url_of(key)
        self.bucket, self.object_key, _ = loc.fs.split_path(loc.path(key))
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.crc32c = False  # each part sent with its CRC32C (decided when the upload starts)

    def _call(self, method: str, nbytes: int = 0, **kwargs: Any) -> Any:
        return self.loc.call("call_s3", method, nbytes=nbytes, what=f"{self.url} ({method})", Bucket=self.bucket,
                             Key=self.object_key, **kwargs)

    def _crc32c_parts(self) -> bool:
        """Whether each part carries its CRC32C, which the store checks on receipt: where the client would
        otherwise checksum every request it can (botocore's default, ``request_checksum_calculation`` =
        ``when_supported``: a CRC32 in Python on the event loop, about 0.9 ms per MB here, against
        0.08 ms for a CRC32C). A client configured ``when_required`` (for stores that refuse checksums)
        gets none, as before."""
        connect(self.loc.fs, self.loc.timeout, self.url)
        # botocore before 1.36 has no such setting (and computes no checksum by default)
        return getattr(self.loc.fs._s3.meta.config, "request_checksum_calculation", None) == "when_supported"

    def send(self, chunk: bytes, *, last: bool) -> None:
        if self.upload_id is None and last:
            write_bytes(self.loc, self.key, chunk)
            return
        if self.upload_id is None:
            self.crc32c = self._crc32c_parts()
            algorithm: dict[str, Any] = {"ChecksumAlgorithm": "CRC32C"} if self.crc32c else {}
            self.upload_id = self._call("create_multipart_upload", **algorithm)["UploadId"]
        number = len(self.parts) + 1
        checksum = {"ChecksumCRC32C": _b64_crc32c(chunk)} if self.crc32c else {}
        out = self._call("upload_part", nbytes=len(chunk), PartNumber=number, UploadId=self.upload_id, Body=chunk,
                         **checksum)
        part = {"PartNumber": number, "ETag": out["ETag"], **checksum}
        if "ChecksumSHA256" in out:
            part["ChecksumSHA256"] = out["ChecksumSHA256"]
        self.parts.append(part)

    def complete(self) -> None:
        if self.upload_id is not None:
            self._call("complete_multipart_upload", UploadId=self.upload_id, MultipartUpload={"Parts": self.parts})
            self.upload_id = None

    def abort(self) -> None:
        """Abandon the upload (best effort, briefly: a store that stopped answering does not hold the task)."""
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is not None:
            with contextlib.suppress(Exception):
                self.loc.call("call_s3", "abort_multipart_upload", what=self.url, Bucket=self.bucket,
                              Key=self.object_key, UploadId=upload_id, deadline=self.loc.cleanup_seconds)


def _b64_crc32c(data: bytes) -> str:
    """``data``'s CRC32C as S3's checksum headers carry it (base64 of its four big-endian bytes)."""
    return base64.b64encode(crc32c(data).to_bytes(4, "big")).decode("ascii")


class _BufferedObject:
    """One object sent through the filesystem's buffered file (gcsfs, adlfs: parts leave as they fill, the
    object appears when the file is closed). These requests have the filesystem's own timeouts only."""

    def __init__(self, loc: Location, key: str, part: int) -> None:
        self.path = loc.path(key)
        self.loc = loc
        self.part = part
        self.file: Any = None

    def send(self, chunk: bytes, *, last: bool) -> None:
        if self.file is None:
            self.file = self.loc.fs.open(self.path, "wb", block_size=self.part)
        self.file.write(chunk)

    def complete(self) -> None:
        if self.file is not None:
            self.file.close()

    def abort(self) -> None:
        if self.file is not None:
            with contextlib.suppress(Exception):
                self.file.discard()  # an unfinished upload is abandoned: no object appears
            self.file.closed = True  # never completed by close() when it is collected


def stream_crc32c(loc: Location, key: str) -> tuple[int, str]:
    """The size and crc32c (8 hex digits) of an object, read in ranges (never held whole)."""
    value, size = 0, 0
    for data in _ranges(loc, key):
        value = crc32c(data, value)
        size += len(data)
    return size, f"{value:08x}"


def read_object(url: str, limit: int, storage_options: dict[str, Any] | None, timeout: float | None = None) -> bytes:
    """A source object's bytes for decoding (a worker reads it directly); at most ``limit`` bytes, as
    :func:`datapipe.bounded.read_file` reads a local file, in ranged GETs of 8 MiB, each under ``timeout``.

    Raises:
        DecodeError: the object holds more than ``limit`` bytes (quarantined as ``too-large``).
        FileNotFoundError, PermissionError: this object is gone or may not be read (it is quarantined).
        RemoteStoreError: the store failed, not the object (no connection, no answer within the deadline,
            an error status past the client's retries): the shard's task ends and the rerun resumes.
    """
    from .errors import DecodeError

    loc = open_location(url, storage_options, timeout=timeout or STORE_TIMEOUT)
    try:
        data = b"".join(_ranges(loc, "", limit + 1))
    except (FileNotFoundError, PermissionError, IsADirectoryError, DatapipeError):
        raise
    except Exception as exc:
        if not store_failure(exc):
            raise
        raise RemoteStoreError(f"{url}: the store failed while the image was read ({type(exc).__name__}: "
                               f"{one_line(exc)}); this is no fault of the image: check that the store is up and "
                               "run the build again (finished shards are kept)") from None
    if len(data) > limit:
        raise DecodeError(f"object of more than {limit:,} bytes, over the limit for its max_pixels "
                          "(raise --max-pixels to build it)", kind="too-large")
    return data


# ----------------------------------------------------------------------------- shards in the store


def shard_objects(objects: dict[str, int], name: str) -> dict[str, int]:
    """The objects of shard ``name`` that carry layout names (relative name -> size)."""
    prefix = f"{SHARDS_DIR}/{name}/"
    return {k[len(prefix):]: v for k, v in objects.items() if k.startswith(prefix) and k[len(prefix):] in SHARD_OBJECTS}


def shard_record(doc: Any) -> dict[str, Any] | None:
    """The datapipe record in a shard group's zarr.json document, or None when it carries none."""
    record = shard_attributes(doc)
    if record is None:
        return None
    for key, kind in (("count", int), ("nbytes", int), ("crc32c", str)):
        if isinstance(record.get(key), bool) or not isinstance(record.get(key), kind):
            return None
    return record


def whole(record: dict[str, Any], objects: dict[str, int]) -> bool:
    """Whether a shard's objects (relative name -> size) are of the sizes its record gives."""
    if record["count"] == 0:
        return True
    layout = shard_layout(record)
    data = "/".join(INDEXED_IMAGES_FILE if layout == "indexed" else IMAGES_FILE)
    if objects.get(data) != record["nbytes"]:
        return False
    return layout == "fixed" or objects.get("/".join(INDEX_FILE)) == record["count"] * INDEX_ROW_BYTES


def shard_records(loc: Location, objects: dict[str, int], names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The records of the named shards whose zarr.json exists (fetched concurrently): name -> record."""
    keys = [f"{SHARDS_DIR}/{n}/{GROUP_META}" for n in names if f"{SHARDS_DIR}/{n}/{GROUP_META}" in objects]
    out: dict[str, dict[str, Any]] = {}
    for key, data in read_docs(loc, keys).items():
        try:
            record = shard_record(json.loads(data))
        except ValueError:
            record = None
        if record is not None:
            out[key.split("/")[1]] = record
    return out


def shard_owner(doc: Any) -> str | None:
    """The build id a shard group's zarr.json carries (a whole shard's record, or the mark a shard's upload
    begins with: see :func:`uploading_document`); None when it carries none."""
    owner = (shard_attributes(doc) or {}).get("build_id")
    return owner if isinstance(owner, str) else None


def uploading_document(build_id: str, shard: int) -> bytes:
    """The zarr.json a shard's upload writes first, in place of any earlier one (one PUT, so the shard never
    looks whole meanwhile): it marks every object the upload then writes as this build's (a build killed
    mid-upload leaves them marked, so its rerun replaces them), and carries no record (not whole)."""
    return json.dumps({"zarr_format": 3, "node_type": "group",
                       "attributes": {"datapipe": {"build_id": build_id, "shard": shard, "uploading": True}}}).encode()


def remove_shards(loc: Location, objects: dict[str, int], build_id: str, keep: Iterable[str] = ()) -> int:
    """Delete the layout objects of every shard whose zarr.json carries ``build_id`` (whole, or marked by an
    unfinished upload) and whose name is not in ``keep``; the group's zarr.json first, so that a shard is
    never whole-looking while half deleted."""
    keep = set(keep)
    names = sorted({k.split("/")[1] for k in objects if k.startswith(f"{SHARDS_DIR}/") and k.count("/") >= 2} - keep)
    keys = [f"{SHARDS_DIR}/{n}/{GROUP_META}" for n in names if SHARD_NAME.fullmatch(n)
            and f"{SHARDS_DIR}/{n}/{GROUP_META}" in objects]
    owners = {}
    for key, data in read_docs(loc, keys).items():
        try:
            owners[key.split("/")[1]] = shard_owner(json.loads(data))
        except ValueError:
            continue
    removed = 0
    for name, owner in owners.items():
        if owner != build_id:
            continue
        delete(loc, [f"{SHARDS_DIR}/{name}/{GROUP_META}"])
        delete(loc, [f"{SHARDS_DIR}/{name}/{rel}" for rel in shard_objects(objects, name) if rel != GROUP_META])
        removed += 1
    return removed


# ----------------------------------------------------------------------------- the lock


class _Lost(Exception):
    """A conditional write of the lock object failed its condition: another build wrote (or removed) it."""


class _Unconditional(Exception):
    """The store refused a conditional request as such (it supports none)."""


class RemoteLock:
    """A lock object (an object store has no flock): host, pid, a token and a heartbeat the holder refreshes.
    A second build refuses a lock refreshed within LOCK_TTL seconds, unless it was left by a process of this
    host that is gone (a SIGKILLed build).

    On S3 (s3fs) the lock is written with conditional requests: created only where no lock object is
    (``If-None-Match: *``), taken over from a dead build and refreshed only while it is still the object that
    was read or last written (``If-Match`` its ETag). Of builds that find it free or dead at the same time
    (the ranks of a job each calling build()), the store lets one write it; the others are refused as busy.
    Elsewhere, and on a store that refuses conditional requests, the builds all write it, each reads it back
    LOCK_SETTLE seconds later, and only the one whose token it then holds goes on (the last writer); stores
    are read-after-write consistent (S3 since 2020, GCS, Azure), so this fails only where a build takes longer
    than that between reading the lock and writing it. The read-back is kept on S3 too, for a store that takes
    the conditions without honouring them."""

    def __init__(self, loc: Location) -> None:
        self.loc = loc
        self.token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._etag: str | None = None  # the lock object's ETag as this build last wrote it (S3's conditional writes)
        self.lost = False  # another build took the lock over while this one ran
        self.ttl = env_seconds("DATAPIPE_REMOTE_LOCK_TTL", LOCK_TTL)

    def _doc(self) -> dict[str, Any]:
        return {"host": socket.gethostname(), "pid": os.getpid(), "token": self.token, "refreshed": time.time(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}

    def _busy(self, held: Any, how: str = "") -> OutputBusyError:
        holder = f"pid {held.get('pid')} on host {held.get('host')}" if isinstance(held, dict) else "holder unknown"
        if how:
            return OutputBusyError(f"output {self.loc.url} is being written by another datapipe build ({holder}), which "
                                   f"took its lock {how}; wait for it to finish, or build into another prefix")
        try:
            age = time.time() - float(held.get("refreshed", 0)) if isinstance(held, dict) else None
        except (TypeError, ValueError):
            age = None
        when = ("" if age is None else f", refreshed {max(0.0, age):.0f} s ago" if -self.ttl / 4 <= age <= self.ttl else
                ", refreshing it while watched (its host's clock differs from this one's)")
        return OutputBusyError(
            f"output {self.loc.url} is being written by another datapipe build ({holder}{when}); wait for it to finish "
            f"or stop it, or build into another prefix (a lock not refreshed for {self.ttl:g} s is taken over)")

    def _held(self) -> Any:
        return read_lock(self.loc)

    def _taken_over(self, held: Any, stale: bool = False) -> bool:
        """Whether the lock object ``held`` says another build holds the lock, or, ``stale`` (this build did not
        refresh it for the TTL), that none does: another may have taken it over and removed it since."""
        return (held.get("token") != self.token) if isinstance(held, dict) else stale

    def acquire(self) -> None:
        if not self._acquire_conditionally():
            held = self._held()
            if isinstance(held, dict) and self.alive(held):
                raise self._busy(self._holder(held))
            write_doc(self.loc, LOCK_OBJECT, self._doc())
        time.sleep(env_seconds("DATAPIPE_REMOTE_LOCK_SETTLE", LOCK_SETTLE))
        now = self._held()
        if not (isinstance(now, dict) and now.get("token") == self.token):
            raise self._busy(now, "as this build did")
        self._thread = threading.Thread(target=self._beat, daemon=True, name="datapipe-remote-lock")
        self._thread.start()

    def _acquire_conditionally(self) -> bool:
        """Take the lock with conditional writes (S3): True when this build wrote it, False where the store
        takes no conditions (the caller writes it as elsewhere).

        Raises:
            OutputBusyError: a living build holds it, or another build wrote it first.
        """
        if not is_s3fs(self.loc.fs):
            return False
        try:
            self._etag = self._put(if_none_match=True)
            return True
        except _Unconditional:
            return False
        except _Lost:
            pass
        try:
            held, etag = self._get()
        except FileNotFoundError:  # removed since (its build ended): the next build to write it holds it
            held, etag = None, None
        if isinstance(held, dict) and held.get("token") == self.token:
            self._etag = etag  # this build's own write, whose answer was lost (and the client's retry refused)
            return True
        if isinstance(held, dict) and self.alive(held):
            raise self._busy(self._holder(held))
        for _ in range(2):  # a lock object removed while it was watched (its build ended): written anew, once
            try:
                self._etag = self._put(if_match=etag) if etag else self._put(if_none_match=True)
                return True
            except _Unconditional:
                return False
            except _Lost:
                if not etag:
                    break
                try:
                    _, etag = self._get()
                except FileNotFoundError:
                    etag = None  # gone: the next build to write it holds it
                    continue
                break
        raise self._busy(self._held(), "first") from None

    def _get(self) -> tuple[Any, str]:
        """The lock object's document (None when damaged) and its ETag, in one GET."""
        fs, loc = self.loc.fs, self.loc
        bucket, key, _ = fs.split_path(loc.path(LOCK_OBJECT))

        async def get() -> tuple[bytes, str]:
            answer = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            body = answer["Body"]
            try:
                return await body.read(), str(answer["ETag"])
            finally:
                body.close()

        data, etag = loc.read(get, what=loc.url_of(LOCK_OBJECT))
        try:
            return parse_json(data, loc.url_of(LOCK_OBJECT)), etag
        except CacheError:
            return None, etag

    def _put(self, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write this build's lock document under a condition; its ETag.

        Raises:
            _Lost: the condition failed (another build wrote or removed the lock).
            _Unconditional: the store refused the conditional request as such.
        """
        fs, loc = self.loc.fs, self.loc
        bucket, key, _ = fs.split_path(loc.path(LOCK_OBJECT))
        body = json.dumps(self._doc(), indent=1).encode()
        condition = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match}
        try:
            answer = loc.call("call_s3", "put_object", Bucket=bucket, Key=key, Body=body, nbytes=len(body),
                              what=loc.url_of(LOCK_OBJECT), **condition)
        except (FileExistsError, FileNotFoundError):
            raise _Lost from None
        except OSError as exc:
            text = f"{exc} {exc.__cause__!r}"
            if any(word in text for word in ("PreconditionFailed", "pre-condition", "ConditionalRequestConflict",
                                             "precondition")):
                raise _Lost from None
            if any(word in text for word in ("NotImplemented", "not implemented", "InvalidArgument")):
                raise _Unconditional from None
            raise
        etag = answer.get("ETag") if isinstance(answer, dict) else None
        if not etag:
            raise _Unconditional
        return str(etag)

    def held_now(self) -> bool:
        """Whether the lock object is this build's now (read from the store, not the heartbeat's last word: a build
        paused past the TTL, SIGSTOP or a frozen VM, runs on at once while its heartbeat has not looked yet);
        ``lost`` when it is not."""
        if self._taken_over(self._held(), stale=True):
            self.lost = True
        return not self.lost

    def _holder(self, held: dict[str, Any]) -> dict[str, Any]:
        """The lock object as it is now, for a message naming its holder (``held`` if it cannot be read): after a
        watch, another build may have taken it over from the one read first."""
        now = self._held()
        return now if isinstance(now, dict) else held

    def alive(self, held: dict[str, Any], *, watch: bool = True) -> bool:
        """Whether the lock object ``held`` is a living build's. On this host (one clock): refreshed within the TTL
        and its process still there. Another host's ``refreshed`` is its own clock's, which may differ from this
        one's by any amount: a lock it refreshed within the TTL by this clock is alive; any other (older, or in
        this clock's future) is judged by whether it is refreshed while ``watch``-ed for one and a half refresh
        intervals (a living build refreshes it every TTL / 4), never by the two clocks alone."""
        try:
            age = time.time() - float(held.get("refreshed", 0))
        except (TypeError, ValueError):
            return False
        if held.get("host") == socket.gethostname():
            if age > self.ttl:
                return False
            if isinstance(held.get("pid"), int):
                try:
                    os.kill(held["pid"], 0)
                except ProcessLookupError:
                    return False
                except PermissionError:
                    return True
            return True
        if -self.ttl / 4 <= age <= self.ttl:  # a clock a little ahead: as fresh as one in step
            return True
        return watch and self._refreshed_within(held, self.ttl * 3 / 8)

    def _refreshed_within(self, held: dict[str, Any], seconds: float) -> bool:
        """Whether the lock object changes from ``held`` (refreshed, or taken by another build) within ``seconds``
        of this process's monotonic clock."""
        deadline = time.monotonic() + seconds
        while True:
            time.sleep(min(max(0.0, deadline - time.monotonic()), seconds / 6))
            now = self._held()
            if not isinstance(now, dict) or (now.get("token"), now.get("refreshed")) != \
                    (held.get("token"), held.get("refreshed")):
                return isinstance(now, dict)  # gone: its build ended (no holder); rewritten: someone holds it
            if time.monotonic() >= deadline:
                return False

    def _beat(self) -> None:
        refreshed = time.monotonic()  # this build's last refresh (or its taking of the lock), by this process's clock
        while not self._stop.wait(self.ttl / 4):
            with contextlib.suppress(Exception):
                # Not refreshed for the TTL (the process paused: SIGSTOP, a frozen VM): another build was entitled to
                # take the lock over, and may have finished and removed it since. A lock object gone or another's is
                # then lost for good, never put back.
                stale = time.monotonic() - refreshed > self.ttl
                if self._etag is not None:
                    try:
                        if stale:
                            raise _Lost
                        self._etag = self._put(if_match=self._etag)
                        refreshed = time.monotonic()
                        continue
                    except _Unconditional:
                        self._etag = None  # refreshed as elsewhere from now on
                    except _Lost:  # another build's write, this build's own whose answer was lost, or none left
                        try:
                            held, etag = self._get()
                        except FileNotFoundError:
                            held, etag = None, None
                        if self._taken_over(held, stale):
                            self.lost = True  # another build took the lock over (this one's refreshes failed for
                            return  # LOCK_TTL), never undone: the build ends before its manifest
                        if isinstance(held, dict):
                            self._etag = etag
                            if stale:  # still this build's after all: refreshed now
                                self._etag = self._put(if_match=etag)
                                refreshed = time.monotonic()
                            continue
                        with contextlib.suppress(_Lost):  # removed or damaged: put back (unless written meanwhile)
                            self._etag = self._put(if_match=etag) if etag else self._put(if_none_match=True)
                            refreshed = time.monotonic()
                        continue
                held = self._held()
                if self._taken_over(held, stale):
                    self.lost = True  # another build took the lock over (this one's refreshes failed for LOCK_TTL)
                    return
                write_doc(self.loc, LOCK_OBJECT, self._doc())
                refreshed = time.monotonic()

    def release(self) -> None:
        """Stop refreshing the lock and remove its object if it is still this build's (for at most
        ``cleanup_seconds``: a store that stopped answering leaves it, to be taken over once it is LOCK_TTL old)."""
        self.stop()
        briefly(self.remove, self.loc.cleanup_seconds)

    def stop(self) -> None:
        """Stop refreshing the lock (a write already under way ends with its deadline)."""
        self._stop.set()

    def remove(self) -> None:
        """Stop refreshing the lock, wait for the refreshing thread, then remove the lock object if it is this build's."""
        self.stop()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
            held = self._held()  # a damaged lock object is nobody's: left as it is
            if isinstance(held, dict) and held.get("token") == self.token:
                delete(self.loc, [LOCK_OBJECT])


# ----------------------------------------------------------------------------- owning a prefix


@dataclass
class RemoteOutput:
    """A prepared output in object storage: its build id, the lock, and the listing read when it was prepared."""

    loc: Location
    build_id: str
    lock: RemoteLock
    objects: dict[str, int]
    created_marker: bool = False
    read_only: OutputError | None = None  # another build holds the prefix: this one may only check it is up to date

    def why_read_only(self) -> str:
        """Why a read-only output was not written, for the build's last line."""
        return "another build holds the prefix"

    def cannot_write(self) -> OutputError:
        """The error of a build with something to write into a prefix another build holds."""
        assert self.read_only is not None
        return self.read_only

    def holds(self, key: str, data: bytes) -> bool:
        """Whether the object at ``key`` holds ``data`` (its listed size first: no GET when that differs)."""
        return self.objects.get(key) == len(data) and read_bytes(self.loc, key, len(data)) == data

    def end(self, *, failed: bool) -> None:
        """The build ended: after a failure before any shard was written, remove the build.json this run wrote;
        then remove the lock. Best effort, for at most ``cleanup_seconds`` together (see :func:`briefly`)."""

        def steps() -> None:
            if failed and self.created_marker:
                with contextlib.suppress(Exception):
                    if not any(k.startswith(f"{SHARDS_DIR}/") for k in listing(self.loc, SHARDS_DIR)):
                        delete(self.loc, [BUILD_LOCK])
            self.lock.remove()

        self.lock.stop()
        briefly(steps, self.loc.cleanup_seconds)


def _marker_doc(loc: Location, key: str) -> dict[str, Any] | None:
    doc = _any_doc(loc, key)
    return doc if doc is not None and doc.get("format") == FORMAT else None


def _any_doc(loc: Location, key: str) -> dict[str, Any] | None:
    """The JSON object at ``key``; None when there is none or it is not a JSON object."""
    try:
        doc = read_doc(loc, key)
    except CacheError:
        return None
    return doc if isinstance(doc, dict) else None


def _prefix_state(loc: Location) -> tuple[dict[str, int], list[str], dict[str, Any] | None]:
    """What an output prefix holds: its objects, those other than the lock, and its build.json when it is a datapipe
    one. Raises OutputError when it holds objects and is no datapipe cache."""
    with store_errors(loc, "list the output"):
        objects = listing(loc)
    others = [k for k in objects if k != LOCK_OBJECT]
    marker = _marker_doc(loc, BUILD_LOCK) if BUILD_LOCK in objects else None
    if others and marker is None and _marker_doc(loc, MANIFEST) is None:
        raise OutputError(f"output {loc.url} holds {len(others)} objects (e.g. {others[0]}) and is not a datapipe cache; "
                          "choose an empty or new prefix (datapipe never deletes objects it did not write)")
    return objects, others, marker


def prepare(loc: Location, config: dict, chash: str, source: dict[str, str], force: bool) -> RemoteOutput:
    """Claim the prefix of ``loc`` for a build of ``config`` (the object-store twin of output.prepare).

    Raises:
        OutputError: the prefix holds objects and no datapipe build.json, or cannot be listed or written.
        OutputBusyError: another build's lock object is fresh.
        ConfigMismatchError: it holds a build of another configuration or source (``force`` rebuilds).
    """
    from .output import new_build_id

    objects, others, marker = _prefix_state(loc)
    lock = RemoteLock(loc)
    try:
        with store_errors(loc, "write the lock object"):
            lock.acquire()
    except OutputBusyError as busy:
        if marker is None:
            raise
        # The ranks of a job each calling build() on the same cache: it may hold this very build, up to date,
        # checked without the lock (see output._read_only).
        return _read_only(loc, objects, marker, config, chash, source, force, busy)
    try:
        # What the prefix holds now, under the lock: another build may have written it since the listing above
        # (one that held the lock then, and finished).
        objects, others, marker = _prefix_state(loc)
        build_id = new_build_id()
        created = marker is None
        if marker is not None:
            build_id = _claim(loc, objects, parse_build_record(marker, loc.url_of(BUILD_LOCK)), config, chash,
                              source, force)
            if force and build_id != marker.get("build_id"):
                objects = listing(loc)
        elif others:
            raise OutputError(f"{loc.url} holds a datapipe manifest but no build.json of datapipe's, so its objects "
                              "cannot be told from yours; build into a new prefix")
        record = BuildRecord(config=config, config_hash=chash, build_id=build_id, source=source).to_json()
        if not _same_doc(marker, record):  # an unchanged one is left as it is: a rerun with nothing to do writes nothing
            with store_errors(loc, "write build.json"):
                write_doc(loc, BUILD_LOCK, record)
    except BaseException:
        lock.release()
        raise
    return RemoteOutput(loc, build_id, lock, objects, created_marker=created)


def _same_doc(doc: dict[str, Any] | None, record: dict[str, Any]) -> bool:
    return doc is not None and doc == json.loads(json.dumps(record))


def _read_only(loc: Location, objects: dict[str, int], marker: dict[str, Any], config: dict, chash: str,
               source: dict[str, str], force: bool, busy: OutputBusyError) -> RemoteOutput:
    """The output of a build into a prefix another build holds: only when it holds this very build, whose
    build.json needs no change, as a RemoteOutput the builder may only check (``read_only``); else ``busy``."""
    from .output import resumes

    previous = parse_build_record(marker, loc.url_of(BUILD_LOCK))
    try:
        same = bool(previous.build_id) and resumes(previous, config, chash, source, force=force, where=loc.url,
                                                   place="prefix")
    except ConfigMismatchError:
        raise busy from None  # another build at work: the first thing to know, whatever it builds
    record = BuildRecord(config=config, config_hash=chash, build_id=previous.build_id, source=source).to_json()
    if not same or not _same_doc(marker, record):
        raise busy
    return RemoteOutput(loc, previous.build_id, RemoteLock(loc), objects, read_only=busy)


def _claim(loc: Location, objects: dict[str, int], previous: BuildRecord, config: dict, chash: str,
           source: dict[str, str], force: bool) -> str:
    from .output import new_build_id, resumes

    if not previous.build_id:
        raise OutputError(f"{loc.url} was written by an earlier datapipe whose build.json has no build id; build into a new prefix")
    for key in (MANIFEST, REPORT):
        if key in objects:
            doc = _any_doc(loc, key)
            if doc is None or doc.get("build_id") != previous.build_id:
                raise OutputError(f"{loc.url_of(key)} was not written by the build recorded in {loc.url_of(BUILD_LOCK)}, "
                                  "and datapipe does not overwrite objects it did not write; move it away and rerun")
    if resumes(previous, config, chash, source, force=force, where=loc.url, place="prefix"):
        return previous.build_id
    remove_build(loc, objects, previous.build_id)
    return new_build_id()


def remove_build(loc: Location, objects: dict[str, int], build_id: str) -> None:
    """Delete what the build ``build_id`` wrote under ``loc`` (its documents, index objects, shards), nothing else."""
    manifest = _marker_doc(loc, MANIFEST) if MANIFEST in objects else None
    ours = [k for k in (MANIFEST, REPORT) if k in objects and (_any_doc(loc, k) or {}).get("build_id") == build_id]
    delete(loc, ours)
    if manifest is None or manifest.get("build_id") == build_id:
        delete(loc, [k for k in (LABELS, PATHS) if k in objects])
    remove_shards(loc, objects, build_id)


# ----------------------------------------------------------------------------- reading a cache


def read_manifest(loc: Location) -> Manifest:
    """A remote cache's manifest, checked as a local one is (CacheError naming the URL)."""
    with store_errors(loc, "read the manifest", CacheError):
        doc = read_doc(loc, MANIFEST)
    if doc is None:
        raise no_manifest(loc)
    return parse_manifest(doc, loc.url_of(MANIFEST))


def no_manifest(loc: Location) -> CacheError:
    """The error for a cache URL without a manifest: a bucket that does not exist is said so, in the build's
    words (raised here, from one listing request); a build started and not finished, or nothing at all, is
    not a finished cache."""
    with store_errors(loc, "read the manifest", CacheError):
        if is_s3fs(loc.fs):  # reading a missing object does not tell a missing bucket from a missing key
            bucket, key, _ = loc.fs.split_path(loc.path())
            loc.read("call_s3", "list_objects_v2", what=f"{loc.url}/ (list)", Bucket=bucket,
                     Prefix=f"{key.rstrip('/')}/" if key else "", MaxKeys=1)
        started = read_bytes(loc, BUILD_LOCK, 1 << 20) is not None
        held = read_lock(loc) if started else None
    if isinstance(held, dict) and RemoteLock(loc).alive(held, watch=False):
        return CacheError(f"{loc.url} is not a finished datapipe cache yet: a datapipe build is writing it now (pid "
                          f"{held.get('pid')} on host {held.get('host')}); open it once that build has finished")
    hint = (" — a build was started here but did not finish; run the same `datapipe build` again" if started else
            f"; build it with `datapipe build SOURCE {loc.url}`")
    if isinstance(held, dict) and held.get("host") != socket.gethostname():  # its refreshes tell, not the clocks
        hint = (f" — a build was started here and did not finish, unless the one on host {show(held.get('host'))} (pid "
                f"{show(held.get('pid'))}) that holds its lock is writing it now by a clock other than this one's; "
                "open it once no build runs, or run the same `datapipe build` again (it watches the lock to tell: it "
                "resumes a build that ended, and refuses one still running)")
    return CacheError(f"{loc.url} is not a finished datapipe cache (no {MANIFEST}){hint}")


def verify(loc: Location, manifest: Manifest | None = None) -> list[str]:
    """Check every object of a remote cache against its manifest by streaming it: the index objects'
    and each shard's data (and sample index) size and crc32c, and each shard's record. Problems, one line each."""
    manifest = manifest or read_manifest(loc)
    problems: list[str] = []
    with store_errors(loc, "list the cache", CacheError):
        objects = listing(loc)
    with store_errors(loc, "read the index files", CacheError):
        labels, paths = _index_files(loc, manifest)
    for rec in manifest.files.values():
        problems += _check_object(loc, objects, rec.name, None, rec.crc32c)
    with store_errors(loc, "read the shards' records", CacheError):
        records = shard_records(loc, objects, [s.name for s in manifest.shards])
    for shard in manifest.shards:
        base = f"{SHARDS_DIR}/{shard.name}"
        record = records.get(shard.name)
        if record is None:
            problems.append(f"shard {shard.name}: {loc.url_of(base, GROUP_META)} is missing or holds no shard record")
            continue
        for key, want in (("count", shard.count), ("nbytes", shard.nbytes), ("crc32c", shard.crc32c)):
            if record.get(key) != want:
                problems.append(f"shard {shard.name}: {loc.url_of(base, GROUP_META)} says {key} {record.get(key)!r}, "
                                f"the manifest {want!r}")
        if shard.count == 0:
            continue
        indexed = "index_crc32c" in record
        data = "/".join(INDEXED_IMAGES_FILE if indexed else IMAGES_FILE)
        problems += _check_object(loc, objects, f"{base}/{data}", shard.nbytes, shard.crc32c, f"shard {shard.name}: ")
        if indexed:
            problems += _check_object(loc, objects, f"{base}/{'/'.join(INDEX_FILE)}", shard.count * INDEX_ROW_BYTES,
                                      shard.index_crc32c, f"shard {shard.name}: ")
        if labels is not None and paths is not None:
            fix = f"`datapipe build SOURCE {loc.url} --verify` rewrites it"
            problems += [f"shard {shard.name}: {p}; {fix}" for p in shard_content_problems(
                loc, shard.name, record, labels[shard.first : shard.first + shard.count],
                paths[shard.first : shard.first + shard.count], manifest.max_side, manifest.encoding)]
    return problems


def _index_files(loc: Location, manifest: Manifest) -> tuple[Any, list[str] | None]:
    """labels.npy and paths.json of a remote cache, or None for one that cannot be read as such (whose
    checksum check names it)."""
    import io

    import numpy as np

    labels: Any = None
    paths: list[str] | None = None
    with contextlib.suppress(ValueError, TypeError, OSError, EOFError, CacheError):
        data = read_bytes(loc, manifest.files["labels"].name, limit=16 * manifest.num_samples + 65536)
        array = np.load(io.BytesIO(data or b""), allow_pickle=False)
        if array.shape == (manifest.num_samples,) and array.dtype.kind == "i":
            labels = array.astype(np.int64)
    with contextlib.suppress(ValueError, TypeError, OSError, CacheError):
        doc = json.loads(read_bytes(loc, manifest.files["paths"].name) or b"")
        if isinstance(doc, list) and len(doc) == manifest.num_samples:
            paths = doc
    return labels, paths


def shard_content_problems(loc: Location, name: str, record: dict[str, Any], labels: Any, paths: list[str],
                           side: int, encoding: str) -> list[str]:
    """What a remote shard holds beyond its data's and sample index's checksums, against what its build wrote: the
    paths in its record against ``paths``, its labels chunk against ``labels``, its sample index's rows (possible
    ones, as a reader checks them), its Zarr documents against those the build writes (``side``: a fixed-layout
    sample's side, the longest side of an indexed one's). One problem a line, naming the URL."""
    import numpy as np

    from .errors import CorruptShardError
    from .samples import SampleIndex
    from .shards import documents_differ

    base = f"{SHARDS_DIR}/{name}"
    count = record["count"]
    problems = []
    if record.get("paths") != list(paths):
        problems.append(f"the paths in {loc.url_of(base, GROUP_META)} differ from the cache's paths.json")
    indexed = shard_layout(record) == "indexed"
    labels_key, index_key = "/".join(LABELS_FILE), "/".join(INDEX_FILE)
    keys = sorted(k for k in SHARD_FILES if k.endswith(GROUP_META)) + ([labels_key] if count else []) + \
        ([index_key] if count and indexed else [])
    got = {k[len(base) + 1:]: v for k, v in read_docs(loc, [f"{base}/{k}" for k in keys]).items()}
    if count and got.get(labels_key) != np.asarray(labels, "<i8").tobytes():
        problems.append(f"labels chunk {loc.url_of(base, labels_key)} differs from the cache's labels.npy")
    size: int | None = side if not indexed else 0
    if indexed and count:
        raw, size = got.get(index_key), None
        if raw and len(raw) == count * INDEX_ROW_BYTES:  # else the sample index's own check names it
            try:
                size = SampleIndex.parse(raw, count=count, encoding=encoding, max_side=side,
                                         where=loc.url_of(base, index_key)).data_size
            except CorruptShardError as exc:
                problems.append(str(exc).split("; ")[0])
    if size is not None:  # else the sample index's own check names it
        problems += documents_differ(got.get, count, size, indexed=indexed, name=lambda key: loc.url_of(base, key))
    return problems


def _check_object(loc: Location, objects: dict[str, int], key: str, size: int | None, crc: str, what: str = "") -> list[str]:
    url = loc.url_of(key)
    if key not in objects:
        return [f"{what}{url} is missing"]
    if size is not None and objects[key] != size:
        return [f"{what}{url} is {objects[key]:,} bytes, the manifest says {size:,}"]
    try:
        _, got = stream_crc32c(loc, key)
    except Exception as exc:
        if not store_failure(exc):
            raise
        return [f"{what}{url} cannot be read: {one_line(exc)}"]
    return [] if got == crc else [f"{what}{url}: checksum {got} differs from the manifest's {crc}"]


# ----------------------------------------------------------------------------- a source in object storage


def scan(url: str, storage_options: dict[str, Any] | None = None, timeout: float = STORE_TIMEOUT, *,
         exclude: str | None = None) -> Any:
    """List a source in object storage: a prefix of class folders (one listing), or a CSV object of
    ``path,label`` rows (a URL ending in .csv: read once, and its folder listed once). A
    :class:`datapipe.sources.Listing` whose ``root`` is the path of the folder its paths are relative
    to and ``url`` that folder's URL; workers read each object directly. ``timeout``: each request's deadline.
    ``exclude``: the build's output URL, never listed as part of the source (as a local build's output)."""
    from .sources import LISTED_EXTENSIONS, Listing, check_class_folders

    loc = open_location(url, storage_options, timeout=timeout)
    if loc.root.lower().endswith(".csv"):
        with store_errors(loc, "read the source", SourceError):
            return _scan_csv(loc)
    output = _inside(loc, exclude)
    if output == "":
        raise SourceError(f"source {url} is the output itself; write the cache to another prefix "
                          "(one inside the source is fine: it is never listed)")
    with store_errors(loc, "list the source", SourceError):
        objects = listing(loc, markers=True)
        caches = {key.split("/", 1)[0] for key in objects if key.count("/") == 1 and key.split("/")[1] in
                  (BUILD_LOCK, MANIFEST) and _marker_doc(loc, key) is not None}  # other datapipe caches: never classes
    if not objects:
        raise SourceError(f"source {url} holds no objects; pass a prefix of class folders (PREFIX/<class>/<image>)")
    # As a local folder source: a class for each top-level folder (a folder marker alone, as a console's
    # "Create folder" makes, is an empty class), images at the top level named as outside any class.
    records: list[tuple[str, str]] = []
    ignored: list[str] = [f"{name}/ (a datapipe cache)" for name in sorted(caches)]
    outside: list[str] = []
    folders: set[str] = set()
    dropped: list[dict[str, str]] = []
    for key in sorted(objects):
        parts = PurePosixPath(key).parts
        if not parts or parts[0] in caches or (output is not None and f"{key}/".startswith(f"{output}/")):
            continue
        if key.startswith("/") or "//" in key.rstrip("/"):  # a path of folders would name another object
            if os.path.splitext(key)[1].lower() in LISTED_EXTENSIONS:
                dropped.append({"path": key, "error": "unreadable", "reason": "its key has an empty folder name "
                                "('//'), which a path of class folders cannot name; rename the object"})
            elif not key.endswith("/"):
                ignored.append(f"{key} (an empty folder name in its key)")
            continue
        if (len(parts) > 1 or key.endswith("/")) and not parts[0].startswith("."):
            # a class, also with no image in it, or only hidden files (.DS_Store), as a local folder is: dropping it
            # would renumber every class after it
            folders.add(parts[0])
        if any(p.startswith(".") for p in parts):
            ignored.append(f"{key} (hidden)")
            continue
        if key.endswith("/"):
            continue
        image = os.path.splitext(key)[1].lower() in LISTED_EXTENSIONS
        if len(parts) < 2 or not image:
            (outside if image else ignored).append(key)
            continue
        records.append((key, parts[0]))
    if not records:
        raise SourceError(f"source {url} holds no image objects under class folders ({len(ignored) + len(outside)} "
                          f"other objects, e.g. {(outside + ignored)[:3]}); expected PREFIX/<class>/<image>")
    classes = sorted({c for _, c in records} | folders)
    check_class_folders(classes, url)
    index = {c: i for i, c in enumerate(classes)}
    listing_ = Listing(root=Path(loc.root), kind="folder", classes=classes, paths=[k for k, _ in records],
                       labels=[index[c] for _, c in records], stats=[(objects[k], 0) for k, _ in records],
                       ignored=ignored, outside_classes=outside, dropped=dropped)
    listing_.url = loc.url
    return listing_


def _inside(loc: Location, url: str | None) -> str | None:
    """The key of ``url``'s prefix under ``loc`` ('' for the same prefix), or None when it is elsewhere (or None)."""
    if url is None or not is_url(url) or url.split("://", 1)[0].lower() != loc.url.split("://", 1)[0].lower():
        return None
    root, other = loc.root.strip("/"), str(loc.fs._strip_protocol(url)).strip("/")
    if other == root:
        return ""
    return other[len(root) + 1:] if other.startswith(f"{root}/") else None


def _scan_csv(loc: Location) -> Any:
    """The Listing of a CSV object of ``path,label`` rows: paths relative to the CSV's folder, or URLs of the
    same bucket; the listing's root is the deepest folder holding them all (the CSV's, unless a URL leads
    elsewhere), listed once for the objects' sizes (a missing object is quarantined when it is read)."""
    from .sources import MAX_CSV_BYTES, Listing, csv_first_rows, csv_labels, csv_rows, csv_text

    data = read_bytes(loc, "", MAX_CSV_BYTES)
    if data is None:
        raise SourceError(f"source {loc.url} does not exist; pass a prefix of class folders or a CSV object of path,label")
    folder = posixpath.dirname(loc.root)
    bucket = loc.root.split("/", 1)[0]
    scheme = loc.url.split("://", 1)[0]
    beside = listing(loc.under(folder))

    def full(cell: str, lineno: int) -> str:
        path = cell.strip()
        where = f"{loc.url}:{lineno}"
        if not path or "\x00" in path:
            raise SourceError(f"{where}: {'empty path' if not path else 'the path holds a NUL character'}; "
                              "every row must be 'path,label'")
        if is_url(path):
            if not path.lower().startswith(f"{scheme.lower()}://"):
                raise SourceError(f"{where}: {path!r} is in another kind of store; a CSV object's rows name objects of "
                                  f"its own store ({scheme}://{bucket}/...) or paths relative to its folder")
            key = posixpath.normpath(str(loc.fs._strip_protocol(path)))
            if key.split("/", 1)[0] != bucket:
                raise SourceError(f"{where}: {path!r} is in another bucket; a CSV object's rows name objects of "
                                  f"its own bucket {scheme}://{bucket} (the workers read them with its options)")
            return key
        if path.startswith("/") or path.startswith("~"):
            raise SourceError(f"{where}: absolute path {path!r}; write a path relative to the CSV's folder "
                              f"{scheme}://{folder} or a full {scheme}:// URL")
        rel = posixpath.normpath(path)
        if rel == "." or rel == ".." or rel.startswith("../"):
            raise SourceError(f"{where}: path {path!r} leads outside the CSV's folder {scheme}://{folder}; "
                              "write a full URL instead")
        return f"{folder}/{rel}"

    rows = csv_rows(csv_text(data, loc.url), loc.url, lambda cell: posixpath.normpath(cell.strip()) in beside, full)
    keys = [key for key, _, _ in rows]
    root = posixpath.commonpath([folder, *(posixpath.dirname(k) for k in keys)]) if keys else folder
    objects = beside if root == folder else listing(loc.under(root))
    seen, dropped, named = csv_first_rows((key[len(root):].lstrip("/"), label) for key, label, _ in rows)
    names, paths, labels = csv_labels(seen, named)
    if not paths:
        raise SourceError(f"source {loc.url} lists no images; write one 'path,label' row per image")
    out = Listing(root=Path(root), kind="csv", classes=names, paths=paths, labels=labels,
                  stats=[(objects[p], 0) if p in objects else (-1, -1) for p in paths], dropped=dropped)
    out.url = f"{scheme}://{root}"
    out.listed_from = loc.url
    return out
