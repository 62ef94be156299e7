"""The versioned manifest: the only contract between the build and the loader.

``manifest.json`` is written last and atomically; a folder without one is not a finished cache.
A reader checks the format name and version first and refuses what it does not understand.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .errors import CacheError
from .storage import atomic_write_text

FORMAT = "datapipe-cache"
VERSION = 1
MANIFEST = "manifest.json"
REPORT = "report.json"
BUILD_LOCK = "build.json"
LABELS = "labels.npy"
PATHS = "paths.json"


def config_hash(config: dict) -> str:
    """A stable hash of the build configuration (what determines the bytes of every shard)."""
    blob = json.dumps({"format": FORMAT, "version": VERSION, **config}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def write_manifest(output: Path, manifest: dict) -> None:
    atomic_write_text(output / MANIFEST, json.dumps(manifest, indent=1, ensure_ascii=False))


def read_manifest(cache: str | Path) -> dict:
    """Read and check a cache's manifest.

    Raises:
        CacheError: the folder is missing, holds no finished build, or was written by a format
            version this datapipe does not understand.
    """
    cache = Path(cache).expanduser()
    if not cache.exists():
        raise CacheError(f"cache {cache} does not exist; build it with `datapipe build SOURCE {cache}`")
    path = cache / MANIFEST
    if not path.exists():
        hint = (" — a build was started here but did not finish; run the same `datapipe build` "
                "again to resume it" if (cache / BUILD_LOCK).exists() else "")
        raise CacheError(f"{cache} is not a finished datapipe cache (no {MANIFEST}){hint}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CacheError(f"{path} cannot be read as JSON ({exc}); rebuild the cache") from None
    if manifest.get("format") != FORMAT:
        raise CacheError(f"{path} is not a datapipe manifest (format={manifest.get('format')!r})")
    version = manifest.get("version")
    if version != VERSION:
        raise CacheError(
            f"{path} was written by cache format version {version!r}; this datapipe reads version "
            f"{VERSION}. Install a datapipe that matches, or rebuild the cache with this one.")
    return manifest
