"""Scan a source (class folders or a CSV list) into sorted, labelled records and shard plans.

Order and labels are deterministic: records are sorted by their path relative to the source root,
and the class index is the position of the class name in the sorted list of class names. Only
paths, labels, sizes and modification times are gathered here — never image bytes.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SourceError

IMAGE_EXTENSIONS = frozenset(
    ".jpg .jpeg .jpe .jfif .png .gif .bmp .dib .tif .tiff .webp".split()
)


@dataclass
class Listing:
    """Everything a build needs to know about its source, in a stable order."""

    root: Path
    kind: str  # "folder" or "csv"
    classes: list[str]
    paths: list[str]  # relative to root, '/'-separated, sorted
    labels: list[int]
    stats: list[tuple[int, int]]  # (size, mtime_ns) per path; (-1, -1) when it cannot be read
    ignored: list[str] = field(default_factory=list)  # files skipped for their extension
    dropped: list[dict] = field(default_factory=list)  # list entries rejected at scan time

    def __len__(self) -> int:
        return len(self.paths)


def scan(source: str | os.PathLike) -> Listing:
    """List a class-per-folder tree or a CSV of ``path,label`` rows.

    Raises:
        SourceError: the source does not exist, cannot be read, or holds no image files.
    """
    src = Path(source).expanduser()
    if not src.exists():
        raise SourceError(f"source {src} does not exist; pass a folder of class folders or a CSV of path,label")
    if src.is_file():
        listing = _scan_csv(src)
    elif src.is_dir():
        listing = _scan_folder(src)
    else:
        raise SourceError(f"source {src} is neither a folder nor a CSV file")
    if not listing.paths:
        hint = (f" ({len(listing.ignored)} files skipped for their extension, e.g. {listing.ignored[:3]})"
                if listing.ignored else "")
        raise SourceError(f"source {src} holds no image files{hint}; expected "
                          "SOURCE/<class>/<image> or a CSV of path,label")
    return listing


def _is_cache(folder: Path) -> bool:
    """A datapipe output (finished or not) is never a class, even when written inside the source."""
    return (folder / "build.json").exists() or (folder / "manifest.json").exists()


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return -1, -1


def _scan_folder(root: Path) -> Listing:
    try:
        class_dirs = sorted(e.name for e in os.scandir(root)
                            if e.is_dir() and not e.name.startswith(".") and not _is_cache(Path(e.path)))
    except PermissionError as exc:
        raise SourceError(f"source {root} cannot be read: {exc}") from None
    records: list[tuple[str, int]] = []
    ignored: list[str] = []
    for label, name in enumerate(class_dirs):
        for dirpath, dirnames, filenames in os.walk(root / name, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel_dir = Path(dirpath).relative_to(root).as_posix()
            for fname in filenames:
                if fname.startswith("."):
                    continue
                rel = f"{rel_dir}/{fname}"
                if os.path.splitext(fname)[1].lower() in IMAGE_EXTENSIONS:
                    records.append((rel, label))
                else:
                    ignored.append(rel)
    for entry in os.scandir(root):
        if entry.is_file() and not entry.name.startswith("."):
            ignored.append(entry.name)
    records.sort()
    paths = [p for p, _ in records]
    return Listing(
        root=root, kind="folder", classes=class_dirs, paths=paths, labels=[lab for _, lab in records],
        stats=[_stat(root / p) for p in paths], ignored=sorted(ignored),
    )


def _scan_csv(csv_path: Path) -> Listing:
    root = csv_path.parent
    rows: list[tuple[str, str]] = []
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            for lineno, row in enumerate(csv.reader(f), start=1):
                if not row or not "".join(row).strip() or row[0].startswith("#"):
                    continue
                if len(row) < 2:
                    raise SourceError(f"{csv_path}:{lineno}: expected 'path,label', got {row!r}")
                if any(cell.strip() for cell in row[2:]):  # refused, not silently dropped
                    raise SourceError(
                        f"{csv_path}:{lineno}: {len(row)} columns, expected 'path,label'. A datapipe cache holds "
                        "one class label per image, so boxes, masks or other targets in further columns "
                        "would be lost: keep them in a file of your own, keyed by path (ds.path(i)), or "
                        "write the CSV with two columns")
                if lineno == 1 and row[0].strip().lower() == "path":
                    continue  # header
                rows.append((row[0].strip(), row[1].strip()))
    except UnicodeDecodeError as exc:
        raise SourceError(f"{csv_path} is not a UTF-8 CSV of path,label: {exc}") from None
    seen: dict[str, str] = {}
    dropped: list[dict] = []
    for path, label in rows:  # file order: the first row of a duplicated path wins
        rel = Path(path).as_posix() if not os.path.isabs(path) else path
        if rel in seen:
            dropped.append({"path": rel, "error": "duplicate", "reason": "duplicate path in list source (kept the first row)"})
            continue
        seen[rel] = label
    names = sorted(set(seen.values()), key=lambda s: (0, int(s), s) if s.isdigit() else (1, 0, s))
    index = {name: i for i, name in enumerate(names)}
    records = sorted((rel, index[label]) for rel, label in seen.items())
    paths = [p for p, _ in records]
    return Listing(
        root=root, kind="csv", classes=names, paths=paths, labels=[lab for _, lab in records],
        stats=[_stat(root / p) for p in paths], dropped=dropped,
    )


def plan_shards(listing: Listing, shard_size: int) -> list[dict]:
    """Split the records into consecutive shard plans: paths, labels and a hash of the inputs.

    The hash covers each file's path, label, size and modification time, so a shard is rebuilt
    exactly when one of its inputs changed.
    """
    plans = []
    for shard, start in enumerate(range(0, len(listing), shard_size)):
        stop = min(start + shard_size, len(listing))
        items = [[listing.paths[i], listing.labels[i], *listing.stats[i]] for i in range(start, stop)]
        digest = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]
        plans.append({
            "shard": shard,
            "paths": listing.paths[start:stop],
            "labels": listing.labels[start:stop],
            "inputs_hash": digest,
        })
    return plans
