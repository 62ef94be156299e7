"""The versioned manifest: the only contract between the build and the loader.

``manifest.json`` is written last and atomically; a folder without one is not a finished cache.
A reader checks the format name and version first (1: the fixed layout of square raw samples, 2:
the indexed layout, see docs/format.md) and refuses what it does not understand; every field is
then checked by :func:`datapipe.records.parse_manifest` into a typed :class:`Manifest`.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import PERMISSION_ADVICE, CacheError, UnreadableFileError
from .files import atomic_write_text
from .records import (
    BUILD_LOCK,
    FORMAT,
    LABELS,
    MANIFEST,
    PATHS,
    REPORT,
    VERSION,
    VERSIONS,
    Manifest,
    config_hash,
    parse_manifest,
    read_build_record,
    version_of,
)
from .records import read_manifest as _read_manifest

__all__ = ["BUILD_LOCK", "FORMAT", "LABELS", "MANIFEST", "PATHS", "REPORT", "VERSION", "VERSIONS", "Manifest", "config_hash",
           "read_manifest", "version_of", "write_manifest"]


def write_manifest(output: Path, manifest: Manifest) -> None:
    """Write ``manifest`` atomically, after checking that the reader will accept what is written."""
    doc = manifest.to_json()
    parse_manifest(doc, output / MANIFEST)  # the writer never writes what the reader refuses
    atomic_write_text(output / MANIFEST, json.dumps(doc, indent=1, ensure_ascii=False))


def _stat(path: Path, cache: Path) -> os.stat_result | None:
    """``path``'s status (links followed); None when there is nothing there. Raises UnreadableFileError when it
    is there but cannot be looked into (no permission, an I/O error): that is never called missing."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise UnreadableFileError(f"cache {cache} cannot be read ({exc.strerror or exc}); {PERMISSION_ADVICE}") from None


def _unfinished_hint(cache: Path) -> str:
    """What to do with a folder a build began and did not finish: run it again, unless an earlier datapipe wrote
    it, whose build a rerun cannot resume (its build.json has no build id)."""
    try:
        record = read_build_record(cache)
    except CacheError:
        record = None
    if record is not None and not record.build_id:
        return ("a build of an earlier datapipe was started here but did not finish, and this one cannot resume it "
                "(its build.json has no build id): build into a new folder, or remove this one yourself")
    return "a build was started here but did not finish; run the same `datapipe build` again to resume it"


def read_manifest(cache: str | Path) -> Manifest:
    """Read and check a cache's manifest.

    Raises:
        CacheError: the folder is missing, holds no finished build, was written by a format version
            this datapipe does not understand, or any field is malformed or inconsistent.
    """
    cache = Path(cache).expanduser()
    found = _stat(cache, cache)
    if found is None:
        raise CacheError(f"cache {cache} does not exist; build it with `datapipe build SOURCE {cache}`")
    if not stat.S_ISDIR(found.st_mode):
        raise CacheError(f"cache {cache} is not a folder; pass the folder `datapipe build` wrote")
    if _stat(cache / MANIFEST, cache) is None:
        hint = (_unfinished_hint(cache) if (cache / BUILD_LOCK).exists() else "pass the folder `datapipe build` wrote")
        raise CacheError(f"{cache} is not a finished datapipe cache (no {MANIFEST}) — {hint}")
    return _read_manifest(cache)
