"""Scan a source (class folders or a CSV list) into sorted, labelled records and shard plans.

Order and labels are deterministic: records are sorted by their path relative to the source root,
and the class index is the position of the class name in the sorted list of class names: for class
folders sorted as strings, as torchvision's ImageFolder numbers them ("10" before "2"); for a CSV's
labels, numbers in numeric order, then names (so that numeric labels keep their order). A folder
whose class names are numbers out of numeric order says so in the log (a CSV of the same names
numbers them otherwise: ``--classes-from`` gives two caches one list). Only
paths, labels, sizes and modification times are gathered here — never image bytes.

Nothing is lost silently: every file with an image extension (every row of a CSV) ends up either as
a record or in ``dropped`` with a quarantine class and a reason, or, for an image file at the top of
a folder source (it has no class folder), in ``outside_classes``; other files and the directory links
that are not followed are listed in ``ignored``. A folder that cannot be read ends the scan with a
SourceError naming it: it would drop every image in it, a whole class perhaps, not one file. The
build's own output folder, when it lies inside the source, is never scanned.

Folder scans follow file symlinks and follow a directory symlink only when it leads outside the
source root into a directory not visited yet (tracked by device and inode), so a scan always ends
and each real directory is read at most once.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import hashlib
import io
import json
import logging
import os
import posixpath
import re
import stat
import sys
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SourceError, refused
from .files import FileTooLarge, NotRegularFile, describe_mode, read_regular
from .text import message_text, printable, show

log = logging.getLogger("datapipe.build")

IMAGE_EXTENSIONS = frozenset(
    [".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".gif", ".bmp", ".dib", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm",
     ".pnm"]
)
# Pictures of formats datapipe does not decode (HEIF/HEIC, AVIF, JPEG 2000, JPEG XL): listed with the images, so
# that each is quarantined as `unsupported`, saying to convert it, not left out as a note beside them would be.
UNDECODED_EXTENSIONS = frozenset([".heic", ".heif", ".hif", ".avif", ".jp2", ".j2k", ".j2c", ".jpx", ".jpf", ".jxl"])
LISTED_EXTENSIONS = IMAGE_EXTENSIONS | UNDECODED_EXTENSIONS  # what a folder source's scan takes for an image file
# A CSV's first row is a header when its first cell (stripped, case-folded) is one of these names
# and no file of that name exists beside the CSV.
HEADER_NAMES = frozenset(
    ["path", "paths", "file", "files", "filename", "file_name", "filepath", "file_path", "image", "images", "image_path",
     "image_name", "img", "relpath", "rel_path", "relative_path", "name", "fname", "id", "image_id", "imageid", "img_id",
     "img_name", "image_file"]
)
# A label of four or more numbers after its name (Pascal/ImageNet boxes: "n01440764 102 107 200 180") is a row of
# targets, not a class name: a cache holds one class label per image.
_BOX_LABEL = re.compile(r"\S+(\s+[-+]?\d+(\.\d+)?){4,}(\s.*)?", re.DOTALL)
MAX_CSV_BYTES = 1 << 30  # a listing of ~10 M rows; anything larger is not a path,label list

# Byte-order marks of encodings a CSV of path,label rows is refused in (checked longest first).
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian)"), (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)"),
               (b"\xff\xfe", "UTF-16 (little-endian)"), (b"\xfe\xff", "UTF-16 (big-endian)"))


@dataclass
class Listing:
    """Everything a build needs to know about its source, in a stable order."""

    root: Path
    kind: str  # "folder" or "csv"
    classes: list[str]
    paths: list[str]  # relative to root, '/'-separated, sorted
    labels: list[int]
    stats: list[tuple[int, int]]  # (size, mtime_ns) per path; (-1, -1) when it cannot be read
    ignored: list[str] = field(default_factory=list)  # files skipped for their extension, links not followed
    outside_classes: list[str] = field(default_factory=list)  # image files at the top of a folder source: no class
    dropped: list[dict] = field(default_factory=list)  # entries quarantined at scan time (path, error, reason)
    source: Path | None = None  # the resolved folder or CSV file: the build's identity
    url: str | None = None  # a source in object storage: its URL (``root`` is then the path inside its filesystem)
    listed_from: str | None = None  # a CSV object's URL (the build's identity; ``url`` is the folder its paths are under)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def identity(self) -> dict[str, str]:
        """What the build was made from: the resolved source path (or URL) and its kind."""
        return {"path": self.listed_from or self.url or str(self.source or self.root.resolve()), "kind": self.kind}

    @property
    def location(self) -> str:
        """Where the workers read the files: the source's URL or its absolute folder."""
        return self.url or str(self.root.absolute())


def scan(source: str | os.PathLike, *, exclude: str | os.PathLike | None = None) -> Listing:
    """List a class-per-folder tree or a CSV of ``path,label`` rows.

    Args:
        source: the folder or CSV file.
        exclude: a folder never scanned, whatever it holds: the build's output, which may lie inside
            the source (an empty one made in advance is otherwise a class of the first build only).

    Raises:
        SourceError: the source does not exist, cannot be read, holds a folder that cannot be read,
            or holds no image files.
    """
    src = Path(source).expanduser()
    if not src.exists():
        raise SourceError(f"source {shown(str(src))} does not exist; pass a folder of class folders or a CSV of path,label")
    if src.is_file():
        listing = _scan_csv(src)
    elif src.is_dir():
        if exclude is not None and _identity(src) == _identity(exclude):
            raise SourceError(f"source {src} is the output folder itself; write the cache to another folder "
                              "(a folder inside the source is fine: it is never scanned)")
        listing = _scan_folder(src, exclude)
    else:
        raise SourceError(f"source {src} is neither a folder nor a CSV file")
    listing.source = src.resolve() if listing.kind == "folder" else _csv_identity(src)
    if fs_encoding() != "utf-8":  # names as the locale decoded them (a dropped one is as shown: shown())
        for name, text in (*((p, listing.kind == "csv") for p in listing.paths), *((e["path"], True) for e in listing.dropped)):
            if (wrong := locale_error(name, text=text)) is not None:
                raise SourceError(f"source file {wrong}")
    if not listing.paths and not listing.dropped:
        hint = (f" ({len(listing.ignored)} entries skipped (not an image extension, hidden), e.g. {listing.ignored[:3]})"
                if listing.ignored else "")
        if listing.outside_classes:
            hint = (f" in class folders ({len(listing.outside_classes)} at its top, e.g. "
                    f"{listing.outside_classes[:3]}: a folder source takes each image's class from its folder)")
        raise SourceError(f"source {src} holds no image files{hint}; expected "
                          "SOURCE/<class>/<image> or a CSV of path,label")
    return listing


def _is_cache(folder: Path) -> bool:
    """A datapipe output (finished or not) is never a class, even when written inside the source.

    Recognised only by its datapipe marker: a class folder holding a file of its own named
    ``manifest.json`` or ``build.json`` stays a class.
    """
    from .records import is_datapipe_output

    return is_datapipe_output(folder)


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
        return st.st_size, st.st_mtime_ns
    except OSError:
        return -1, -1


def shown(name: str) -> str:
    """A path as text that JSON and a one-line message can carry: bytes that are not UTF-8 as ``\\xNN``, control
    characters escaped (:func:`datapipe.text.printable`). (A name this process's locale cannot encode, one it was
    handed as text, is shown as it is.)"""
    try:
        raw = os.fsencode(name)
    except UnicodeEncodeError:
        return message_text(name)
    return printable(raw.decode("utf-8", "backslashreplace"))


def fs_encoding() -> str:
    """The encoding Python decodes file names by (the locale's, or UTF-8 in its UTF-8 mode), by its codec's name."""
    return codecs.lookup(sys.getfilesystemencoding()).name


def locale_error(name: str, *, text: bool = False) -> str | None:
    """Why ``name`` (from the file system; with ``text``, read as text: a CSV's row or a name as shown) cannot
    be recorded under this process's locale, or None. Where Python decodes file names by a locale that is not
    UTF-8 (LC_ALL=en_US.ISO-8859-1; LC_ALL=C with PYTHONUTF8=0), a name that is not ASCII would be recorded as
    other text than under a UTF-8 locale (Zürich as ZÃ¼rich) or taken for one that is not UTF-8: the same files
    would give another cache, its classes renamed."""
    if name.isascii() or (encoding := fs_encoding()) == "utf-8":
        return None
    why = f"this Python reads file names as {encoding} (the locale's), not UTF-8"
    if not text and not valid_utf8(os.fsencode(name).decode("utf-8", "surrogateescape")):
        origin = "latin1" if encoding == "ascii" else encoding  # the names' own encoding, when the locale's says none
        return (f"{shown(name)}: the name is not UTF-8 ({why}): rename it to UTF-8 (e.g. `convmv -f {origin} -t "
                "utf8 -r --notest FOLDER`) and rerun under a UTF-8 locale")
    return (f"{printable(name) if text else shown(name)}: {why}, so a name that is not ASCII would be read as "
            "other text than under a UTF-8 locale; run it with PYTHONUTF8=1 (or a UTF-8 locale: LC_ALL=C.UTF-8) "
            "and rerun")


def valid_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def not_regular(mode: int) -> dict[str, str]:
    """The quarantine entry of a path that is not a regular file (never opened: it could block)."""
    return {"error": "unreadable", "reason": f"not a regular file: {describe_mode(mode)}"}


def bad_name(rel: str) -> dict[str, str]:
    """The quarantine entry of a name that is not UTF-8: shown with its bytes escaped (``\\xff``), which another
    file's real name may read as, so its bytes in hex too (``path_bytes``: ``bytes.fromhex``)."""
    return {"path": shown(rel), "path_bytes": os.fsencode(rel).hex(), "error": "unreadable",
            "reason": f"the path is not valid UTF-8 ({shown(rel)}); rename the file (or its folder) to build it"}


class _Walker:
    """One scan of a folder source; ``visited`` holds (st_dev, st_ino) of every directory read."""

    def __init__(self, root: Path, exclude: str | os.PathLike | None = None) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        st = os.stat(root)
        self.visited: set[tuple[int, int]] = {(st.st_dev, st.st_ino)}
        self.excluded = _identity(exclude) if exclude is not None else None  # (dev, inode) of the output
        self.records: list[tuple[str, int]] = []
        self.ignored: list[str] = []
        self.outside: list[str] = []  # image files at the top of the source: no class folder
        self.dropped: list[dict] = []

    def enter(self, path: str, rel: str, *, is_link: bool) -> bool:
        """Whether to read the directory at ``path``: once per real directory; a link only if it leads
        outside the source root (everything inside the root is read through its real path). A folder that
        cannot be looked up ends the scan (:func:`unreadable_folder`)."""
        try:
            st = os.stat(path)
        except OSError as exc:
            raise unreadable_folder(self.root, rel, exc) from None
        key = st.st_dev, st.st_ino
        if key == self.excluded:
            self.ignored.append(shown(rel) + "/ (the build's output folder)")
            return False
        inside = is_link and (os.path.realpath(path) + os.sep).startswith(self.real_root + os.sep)
        if key in self.visited or inside:
            self.ignored.append(shown(rel) + "/ (directory link not followed: it leads into a folder already scanned)")
            return False
        self.visited.add(key)
        return True

    def walk(self, top: str, rel_top: str, label: int) -> None:
        stack = [(top, rel_top)]
        while stack:
            folder, rel_folder = stack.pop()
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name, reverse=True)
            except OSError as exc:
                raise unreadable_folder(self.root, rel_folder, exc) from None
            for entry in entries:
                rel = f"{rel_folder}/{entry.name}"
                if entry.name.startswith("."):
                    self.ignored.append(hidden(entry, rel))
                    continue
                self.visit(entry, rel, label, stack)

    def visit(self, entry: os.DirEntry, rel: str, label: int, stack: list) -> None:
        is_link = False
        try:
            is_link = entry.is_symlink()
            mode = os.stat(entry.path).st_mode
        except OSError as exc:  # a dangling link, or a file gone since the listing: read time reports it
            mode = None
            if not is_link and refused(exc):
                # listed but not looked up: its folder can be read but not entered (no execute permission)
                raise unreadable_folder(self.root, posixpath.dirname(rel), exc) from None
            if not is_link and _listed_as_folder(entry):  # a path too long, an I/O error: all its images lost
                raise unreadable_folder(self.root, rel, exc) from None
        if mode is not None and stat.S_ISDIR(mode):
            if self.enter(entry.path, rel, is_link=is_link):
                stack.append((entry.path, rel))
            return
        if os.path.splitext(entry.name)[1].lower() not in LISTED_EXTENSIONS:
            self.ignored.append(shown(rel))
        elif not valid_utf8(rel):
            self.dropped.append(bad_name(rel))
        elif mode is not None and not stat.S_ISREG(mode):
            self.dropped.append({"path": rel, **not_regular(mode)})
        else:
            self.records.append((rel, label))


def _listed_as_folder(entry: os.DirEntry) -> bool:
    """Whether the listing says ``entry`` is a folder (its type as the listing gave it, nothing followed)."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def hidden(entry: os.DirEntry, rel: str) -> str:
    """The ignored-list entry of a hidden file or folder (a name starting with a dot: .DS_Store, ._photo.jpg,
    .ipynb_checkpoints/): skipped, as file browsers hide them (macOS's ._ files are not images of their class)."""
    try:
        folder = entry.is_dir()
    except OSError:
        folder = False
    return shown(rel) + ("/" if folder else "") + " (hidden)"


def unreadable_folder(root: Path | str, rel: str, exc: OSError) -> SourceError:
    """A folder of the source that cannot be read ends the scan: all its images, a whole class
    perhaps, would be missing from the cache, which one bad file in the report would not say."""
    where = os.path.join(root, rel)
    return SourceError(f"folder {shown(where)} of the source cannot be read ({exc.strerror or exc}); every image in "
                       "it would be missing: fix its permissions or move it out of the source, and rerun")


def _identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the directory (or file) at ``path``, links followed; None where it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # gone, unreadable, or (the output) not there yet
    return st.st_dev, st.st_ino


def _scan_folder(root: Path, exclude: str | os.PathLike | None = None) -> Listing:
    walker = _Walker(root, exclude)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise SourceError(f"source {root} cannot be read: {exc.strerror or exc}") from None
    class_dirs: list[os.DirEntry] = []
    for entry in entries:
        if entry.name.startswith("."):
            walker.ignored.append(hidden(entry, entry.name))
            continue
        try:
            is_dir = entry.is_dir()
        except OSError:
            is_dir = False
        if not is_dir:
            image = os.path.splitext(entry.name)[1].lower() in LISTED_EXTENSIONS
            (walker.outside if image else walker.ignored).append(shown(entry.name))
        elif walker.excluded is not None and _identity(entry.path) == walker.excluded:
            walker.ignored.append(shown(entry.name) + "/ (the build's output folder)")
        elif not _is_cache(Path(entry.path)):
            class_dirs.append(entry)
    for entry in class_dirs:
        if (wrong := locale_error(entry.name)) is not None:
            raise SourceError(f"class folder {wrong}")
    unnamed = [e.name for e in class_dirs if not valid_utf8(e.name)]
    if unnamed:
        raise SourceError(
            f"class folder {shown(str(root / unnamed[0]))} has a name that is not valid UTF-8"
            f"{f' (and {len(unnamed) - 1} more)' if len(unnamed) > 1 else ''}: the cache records class names as "
            "text, and leaving the class out would renumber every class after it; rename the folder (e.g. "
            "`convmv -f latin1 -t utf8 -r --notest FOLDER`) and rerun")
    classes = [e.name for e in class_dirs]
    check_class_folders(classes, shown(str(root)))
    index = {name: i for i, name in enumerate(classes)}
    # Real class folders are read before linked ones, so a class linked to another is the one left empty.
    for entry in sorted(class_dirs, key=lambda e: (e.is_symlink(), e.name)):
        label = index[entry.name]
        if walker.enter(entry.path, entry.name, is_link=False):
            walker.walk(entry.path, entry.name, label)
    records = sorted(walker.records)
    paths = [p for p, _ in records]
    return Listing(
        root=root, kind="folder", classes=classes, paths=paths, labels=[lab for _, lab in records],
        stats=[_stat(root / p) for p in paths], ignored=sorted(walker.ignored),
        dropped=sorted(walker.dropped, key=lambda q: q["path"]), outside_classes=sorted(walker.outside),
    )


# ----------------------------------------------------------------------------- CSV lists


def _csv_text(csv_path: Path) -> str:
    """The CSV's text: UTF-8 with or without a byte-order mark; other encodings refused by name."""
    try:
        data = read_regular(csv_path, MAX_CSV_BYTES)
    except NotRegularFile as exc:
        raise SourceError(f"source {csv_path} is {exc.what}, not a CSV file") from None
    except FileTooLarge as exc:
        raise SourceError(f"source {csv_path} is {exc.size:,} bytes, over the {MAX_CSV_BYTES:,} a CSV of "
                          "path,label rows may hold; is it the right file?") from None
    except OSError as exc:
        raise SourceError(f"source {csv_path} cannot be read: {exc.strerror or exc}") from None
    return csv_text(data, str(csv_path))


def csv_text(data: bytes, name: str) -> str:
    """The text of a CSV's bytes (``name``: the file or object, for messages): UTF-8 with or without a
    byte-order mark; other encodings refused by name."""
    for bom, encoding in _OTHER_BOMS:
        if data.startswith(bom):
            raise SourceError(f"{name} is {encoding} text; save it as UTF-8 (in Excel: 'CSV UTF-8') and rerun")
    try:
        return data.decode("utf-8-sig")  # Excel's "CSV UTF-8" starts with a byte-order mark
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise SourceError(f"{name}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          "save the CSV as UTF-8 and rerun") from None


def _is_header(row: list[str], exists: Callable[[str], bool]) -> bool:
    """The documented header rule: the first row's first cell names a column (see HEADER_NAMES),
    not a file that exists beside the CSV."""
    cell = row[0].strip().lstrip("\ufeff").strip()
    return cell.casefold() in HEADER_NAMES and not exists(cell)


def _is_comment(row: list[str], exists: Callable[[str], bool]) -> bool:
    """The documented comment rule: a row whose first cell starts with '#' is a comment, unless that cell names a
    file beside the CSV (an image named '#1.jpg' is data)."""
    cell = row[0].strip()
    return cell.startswith("#") and not exists(cell) and not exists(row[0])  # (a name may begin with spaces)


def _csv_identity(csv_path: Path) -> Path:
    """A CSV source's identity: the file it resolves to, when that lies in the folder its rows are read under (the
    link's own, resolved); else the CSV as named in that folder: a link from another folder reads other files
    than its target, and is another source."""
    folder, target = csv_path.absolute().parent.resolve(), csv_path.resolve()
    return target if target.parent == folder else folder / csv_path.name


def _relative(cell: str, csv_path: Path, lineno: int) -> str:
    """A CSV path cell as a normalised '/'-separated path inside the CSV's folder, or SourceError. Spaces
    around the cell are dropped (``a.jpg , cat``), unless the file's own name has them."""
    path = cell.strip()
    if path != cell and not os.path.lexists(csv_path.parent / path) and os.path.lexists(csv_path.parent / cell):
        path = cell  # a name that does begin or end with spaces
    if not path:
        raise SourceError(f"{csv_path}:{lineno}: empty path; every row must be 'path,label'")
    if "\x00" in path:
        raise SourceError(f"{csv_path}:{lineno}: the path holds a NUL character; write plain 'path,label' rows")
    if os.path.isabs(path) or path.startswith("~"):
        raise SourceError(f"{csv_path}:{lineno}: absolute path {path!r}; paths must be relative to the CSV's "
                          f"folder {csv_path.parent} (move the CSV or rewrite its paths)")
    rel = posixpath.normpath(path.replace(os.sep, "/"))
    if rel == ".." or rel.startswith("../") or rel == ".":
        raise SourceError(f"{csv_path}:{lineno}: path {path!r} leads outside the CSV's folder {csv_path.parent}; "
                          "put the CSV at the top of the image tree")
    parts = path.replace(os.sep, "/").split("/")
    if ".." in parts:  # the text drops "link/.." where the system goes up from the link's target: another file
        for i, part in enumerate(parts[:-1]):
            if parts[i + 1] == ".." and part not in ("", ".", "..") and \
                    os.path.islink(csv_path.parent / "/".join(parts[:i + 1])):
                raise SourceError(f"{csv_path}:{lineno}: path {path!r} goes up ('..') from the symlink "
                                  f"{'/'.join(parts[:i + 1])!r}, which the system does from the link's target, "
                                  "reading another file than the text names; write the path without '..'")
    return rel


def _csv_rows(csv_path: Path) -> list[tuple[str, str, int]]:
    """(relative path, label, line number) of every data row."""
    def names_file(cell: str) -> bool:  # a folder is never a sample: a header cell named like one is a header
        path = csv_path.parent / cell
        return os.path.lexists(path) and not path.is_dir()

    return csv_rows(_csv_text(csv_path), str(csv_path), names_file, lambda cell, lineno: _relative(cell, csv_path, lineno))


def csv_rows(text: str, csv_path: str, exists: Callable[[str], bool],
             relative: Callable[[str, int], str]) -> list[tuple[str, str, int]]:
    """(path, label, line number) of every data row of a CSV's ``text``: ``exists(cell)`` says whether a
    first cell that looks like a header names a file beside the CSV, ``relative(cell, lineno)`` makes
    a path cell the path the listing records (or raises SourceError naming the line)."""
    rows: list[tuple[str, str, int]] = []
    reader = csv.reader(io.StringIO(text, newline=""))
    first_row = True
    first_line: dict[str, int] = {}  # each label's first row
    physical: list[str] | None = None  # the text's lines as the reader counts them, split once it is needed
    first_cells: list[list[str]] = []  # the first two data rows' cells
    try:
        start = 1  # the line the row begins on (a quoted cell may span lines): every message names it
        for row in reader:
            lineno, start, begins = reader.line_num, reader.line_num + 1, start
            if not row or not "".join(row).strip():
                continue
            # A stray quote makes the lines after it one cell, until the next quote: those rows would vanish into
            # it (a header's or a comment's too). Only a path naming a file may hold a line break.
            if any(_breaks_line(cell) for cell in row[1:]) or (_breaks_line(row[0]) and not exists(row[0])):
                physical = physical if physical is not None else io.StringIO(text, newline="").readlines()
                if _quote_left_open("".join(physical[begins - 1:lineno])):  # the reader took the rest of the text
                    raise SourceError(f"{csv_path}:{begins}: a quote opened on this line is never closed; "
                                      "close it (a quote inside a cell is written twice: \"\")")
                raise SourceError(f"{csv_path}:{begins}: a quote opened on this line is closed only on line {lineno}, "
                                  f"which makes the lines between one cell ({_clip(row)}); close it where its cell "
                                  "ends (a quote inside a cell is written twice: \"\")")
            if _is_comment(row, exists):
                continue
            if len(row) < 2:
                raise SourceError(f"{csv_path}:{begins}: expected 'path,label', got {_clip(row)}")
            if any(cell.strip() for cell in row[2:]):  # refused, not silently dropped
                raise SourceError(
                    f"{csv_path}:{begins}: {len(row)} columns, expected 'path,label'. A datapipe cache holds "
                    "one class label per image, so boxes, masks or other targets in further columns "
                    "would be lost: keep them in a file of your own, keyed by path (datapipe.open(cache).path(i)), or "
                    "write the CSV with two columns")
            if first_row and _is_header(row, exists):
                first_row = False
                continue
            first_row = False
            label = row[1].strip()
            if not label:
                raise SourceError(f"{csv_path}:{begins}: empty label for {row[0].strip()!r}; every row must be 'path,label'")
            if "\x00" in label:
                raise SourceError(f"{csv_path}:{begins}: the label holds a NUL character; write plain 'path,label' rows")
            if _BOX_LABEL.fullmatch(label):
                raise SourceError(f"{csv_path}:{begins}: the label {_clip([label])} holds numbers after a name: boxes or "
                                  "other targets (ImageNet's LOC_val_solution.csv), which would make a class of every "
                                  "row; a datapipe cache holds one class label per image: write 'path,label' rows "
                                  "with the class name alone (keep the boxes in a file of your own, keyed by path)")
            if len(rows) < 2:
                first_cells.append(row)
            first_line.setdefault(label, begins)
            rows.append((relative(row[0], begins), label, begins))
    except csv.Error as exc:
        if "field larger than field limit" in str(exc):  # a quote left open: the rest of the file taken as one cell
            raise SourceError(f"{csv_path}:{start}: a quote opened on this line is not closed within "
                              f"{csv.field_size_limit():,} characters, which makes the lines after it one cell; close it "
                              "(a quote inside a cell is written twice: \"\")") from None
        raise SourceError(f"{csv_path}:{reader.line_num}: not a CSV row ({exc}); write plain 'path,label' rows") from None
    if (twins := unicode_twins(first_line)) is not None:
        one, other = twins
        raise SourceError(f"{csv_path}:{first_line[other]}: label {ascii(other)} is the label {ascii(one)} of line "
                          f"{first_line[one]} written another way ({_UNICODE_FORMS}), which would make two classes "
                          "that print alike; write the labels alike")
    if len(rows) > 2 and sum(1 for _, label, _ in rows if label == rows[0][1]) == 1 and not _names_file(
            first_cells[0][0], exists) and _names_file(first_cells[1][0], exists) \
            and os.path.splitext(first_cells[0][0].strip())[1].lower() not in LISTED_EXTENSIONS:
        # a header of a name not in HEADER_NAMES (`Photo,PredictionString`: no image's name): its label would be a
        # class of no sample, numbered among the others, and every class after it another label than another cache's
        raise SourceError(f"{csv_path}:{rows[0][2]}: the first row ({_clip(first_cells[0])}) looks like a header: its path "
                          f"names no file, the next row's does, and no other row has its label {rows[0][1]!r}, which "
                          "would be a class of no sample and renumber every class after it. If it is a header, name "
                          "its first cell 'path' (a header's first cell is one of: path, file, filename, image, id, "
                          "name, ...); if it is data, put its file in place or remove the row")
    note_number_twins(first_line, csv_path)
    note_compatibility_twins(first_line, csv_path)
    return rows


def _names_file(cell: str, exists: Callable[[str], bool]) -> bool:
    """Whether a path cell names a file beside the CSV, as written or without the spaces around it."""
    return exists(cell.strip()) or exists(cell)


def _breaks_line(cell: str) -> bool:
    return "\n" in cell or "\r" in cell


def _quote_left_open(text: str) -> bool:
    """Whether a quoted cell is still open at the end of ``text`` (rows of a CSV), read as :mod:`csv`'s default
    dialect reads it: a quote opens a cell only at its start, two in one stand for one, and what follows the
    closing quote up to the next comma joins the cell."""
    start, quoted, closing = True, False, False  # at a cell's start; in a quoted cell; just after a quote in it
    for char in text:
        if quoted:
            if closing:
                closing = False
                if char == '"':  # a quote written twice
                    continue
                quoted, start = False, char in ",\r\n"
            elif char == '"':
                closing = True
            continue
        if start and char == '"':
            quoted, start = True, False
        else:
            start = char in ",\r\n"
    return quoted and not closing


_UNICODE_FORMS = ("in another Unicode form: NFD and NFC write the same letters with other code points; or with an "
                  "invisible character, such as a zero-width space, a soft hyphen or a direction mark")
# Characters that show nothing in a name: Unicode's default-ignorable code points, but for the zero-width joiner and
# non-joiner (which change how an emoji or a Persian word prints) and the tag characters (which tell flags apart)
_INVISIBLE = dict.fromkeys(
    c for first, last in ((0x00AD, 0x00AD), (0x034F, 0x034F), (0x061C, 0x061C), (0x115F, 0x1160), (0x17B4, 0x17B5),
                          (0x180B, 0x180F), (0x200B, 0x200B), (0x200E, 0x200F), (0x202A, 0x202E), (0x2060, 0x206F),
                          (0x3164, 0x3164), (0xFE00, 0xFE0F), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0x1BCA0, 0x1BCA3),
                          (0x1D173, 0x1D17A), (0xE0100, 0xE01EF))
    for c in range(first, last + 1))


def spelling(name: str) -> str:
    """What ``name`` prints as: without the characters that show nothing (:data:`_INVISIBLE`), in its NFC form
    (NFC and NFD alike; taken last, for an invisible character between a letter and its accent keeps them apart)."""
    return unicodedata.normalize("NFC", name.translate(_INVISIBLE))


def _twins(names: Iterable[str], key: Callable[[str], object]) -> tuple[str, str] | None:
    """The first two ``names`` of one ``key`` (None: a name left out), in their order; None if none are."""
    seen: dict[object, str] = {}
    for name in names:
        if (k := key(name)) is not None and (one := seen.setdefault(k, name)) != name:
            return one, name
    return None


def unicode_twins(names: Iterable[str]) -> tuple[str, str] | None:
    """The first two ``names`` that print alike, being one name written two ways (see :func:`spelling`), in their
    order; None if none are. (Names alike only under NFKC, such as ``m2`` and ``m²``, print otherwise: see
    :func:`note_compatibility_twins`.)"""
    return _twins(names, spelling)


def note_compatibility_twins(names: Iterable[str], where: object) -> None:
    """Log when two class names are one name under Unicode's compatibility forms (NFKC: ``ﬁsh`` and ``fish``,
    ``１`` and ``1``, ``m²`` and ``m2``): two classes, which they may well be, but seldom where a file was written
    by two tools."""
    if (twins := _twins(names, lambda name: unicodedata.normalize("NFKC", spelling(name)))) is not None:
        log.warning("datapipe build: %s: the labels %s and %s are one name in Unicode's compatibility forms (NFKC), "
                    "and so two classes; if they are one class, write them alike", where, *map(show, twins))


def check_class_folders(classes: list[str], where: str) -> None:
    """Refuse class folders (of a local or remote folder source ``where``) that are one name in two Unicode forms;
    log numbers written two ways and numbers out of numeric order (:func:`note_string_order`).

    Raises:
        SourceError: naming both folders.
    """
    if (twins := unicode_twins(classes)) is not None:
        raise SourceError(f"source {where}: the class folders {ascii(twins[0])} and {ascii(twins[1])} are one name "
                          f"written two ways ({_UNICODE_FORMS}), which would make two classes that print alike; move "
                          "the images of one into the other (or rename one) and rerun")
    note_number_twins(classes, where)
    note_compatibility_twins(classes, where)
    note_string_order(classes)


def note_number_twins(names: Iterable[str], where: object) -> None:
    """Log when two class names are one whole number written two ways (``1`` and ``01``): two classes, as
    torchvision's ImageFolder makes them, which is seldom what was meant."""
    if (twins := _twins(names, lambda name: _numeric(name) if _is_number(name) else None)) is not None:
        log.warning("datapipe build: %s: the labels %s and %s are one number written two ways, and so two classes; "
                    "if they are one class, write them alike", where, *map(show, twins))


def _clip(row: list[str]) -> str:
    text = repr(row)
    return text if len(text) <= 80 else text[:79] + "…"


def _scan_csv(csv_path: Path) -> Listing:
    root = csv_path.parent

    def refused(rel: str) -> dict | None:
        if (wrong := locale_error(rel, text=True)) is not None:
            raise SourceError(f"{csv_path}: path {wrong}")
        try:
            mode = os.stat(root / rel).st_mode
        except OSError:  # missing or unreadable: read time reports it
            return None
        return None if stat.S_ISREG(mode) else not_regular(mode)

    seen, dropped, named = csv_first_rows(((rel, label) for rel, label, _ in _csv_rows(csv_path)), refused)
    names, paths, labels = csv_labels(seen, named)
    stats = [_stat(root / p) for p in paths]
    _note_missing(csv_path, [p for p, st in zip(paths, stats, strict=True) if st == (-1, -1)], len(paths))
    return Listing(root=root, kind="csv", classes=names, paths=paths, labels=labels, stats=stats, dropped=dropped)


def _note_missing(csv_path: Path, missing: list[str], total: int) -> None:
    """Log, when rows of a CSV name no file, where the first was looked for and, when a file a common slip would
    have named exists (Windows' backslashes, no extension, a path from the CSV's parent folder), that file: each
    row is quarantined as unreadable, whose reason names neither."""
    if not missing:
        return
    root = csv_path.parent
    hint = ""
    for rel in missing[:20]:
        tries = [(rel.replace("\\", "/"), "write paths with '/'")] if "\\" in rel else []
        if not os.path.splitext(rel)[1]:
            tries += [(rel + ext, "write each file's extension") for ext in (".jpg", ".JPEG", ".jpeg", ".png", ".JPG")]
        for form in ("NFC", "NFD"):  # the same text composed otherwise (a CSV written on macOS, files copied from it)
            if (alt := unicodedata.normalize(form, rel)) != rel:
                tries.append((alt, f"the file's name is the same text in Unicode {form}: write the CSV's paths as the "
                                   f"files are named (unicodedata.normalize({form!r}, path))"))
        first, _, rest = rel.partition("/")
        if first == root.name and rest:
            tries.append((rest, f"write paths from the CSV's folder {shown(str(root))}, not from its parent"))
        found = next(((alt, why) for alt, why in tries if (root / alt).is_file()), None)
        if found is not None:
            hint = f"; {found[0]!r} exists, for the row of {rel!r}: {found[1]}"
            break
    log.warning(f"datapipe build: {len(missing):,} of the {total:,} paths of {shown(str(csv_path))} name no file (first: "
                f"{missing[0]!r}, looked for as {shown(str(root / missing[0]))}: paths are read from the CSV's folder)"
                f"{hint}; each is quarantined as unreadable")


# The reason of a row that repeats an earlier one (same path, same label): its file is used, with that label.
REPEATED_ROW = "duplicate path in list source (kept the first row)"


def repeats_a_row(entry: dict) -> bool:
    """Whether a quarantine ``entry`` is a list source's row repeating an earlier one exactly: nothing is lost."""
    return entry.get("error") == "duplicate" and entry.get("reason") == REPEATED_ROW


def csv_first_rows(rows: Iterable[tuple[str, str]], refused: Callable[[str], dict | None] | None = None,
                   ) -> tuple[dict[str, str], list[dict], set[str]]:
    """A CSV's (path, label) rows in file order as ``path -> label`` (the first row of a duplicated path
    wins), the rows dropped (duplicates, and paths ``refused`` returns a quarantine record for) and every
    label the rows name, the dropped rows' too: the classes are the CSV's, whatever the files are."""
    seen: dict[str, str] = {}
    dropped: list[dict] = []
    named: set[str] = set()
    for rel, label in rows:
        named.add(label)
        if rel in seen:
            other = "" if label == seen[rel] else f" with another label ({label!r}; the first row's {seen[rel]!r} is kept)"
            dropped.append({"path": rel, "error": "duplicate", "reason": f"duplicate path in list source{other}"
                            if other else REPEATED_ROW})
            continue
        bad = refused(rel) if refused is not None else None
        if bad is not None:
            dropped.append({"path": rel, **bad})
            continue
        seen[rel] = label
    return seen, dropped, named


def _is_number(name: str) -> bool:
    """A class name that is a whole number in ASCII digits (``"²"`` and ``"٣"`` are names)."""
    return name.isascii() and name.isdigit()


def _numeric(name: str) -> tuple[int, str]:
    """The sort key of a whole number in ASCII digits, in numeric order without converting it (``int()`` refuses
    more than 4,300 digits): fewer significant digits first, then the digits."""
    digits = name.lstrip("0")
    return len(digits), digits


def note_string_order(classes: list[str]) -> None:
    """Log the class folders' numbering when their names are numbers out of numeric order: the folders take
    ImageFolder's string order, a CSV of the same names their numeric order, so two caches of one dataset
    built from the two kinds of source would disagree on labels but for --classes-from."""
    numbers = [c for c in classes if _is_number(c)]
    if numbers and numbers != sorted(numbers, key=_numeric):
        first = next(a for a, b in zip(numbers, sorted(numbers, key=_numeric), strict=True) if a != b)
        log.info("datapipe build: class folders are numbered in torchvision ImageFolder's (string) order, so %r "
                 "is label %d; a CSV source numbers numeric labels in numeric order (a cache built from one "
                 "shares its labels with a cache from the other through --classes-from)", first, classes.index(first))


def csv_labels(seen: dict[str, str], named: Iterable[str] = ()) -> tuple[list[str], list[str], list[int]]:
    """The classes (numbers in numeric order, then names), the sorted paths and their label indices of a
    CSV's path -> label rows; the classes are every label in ``seen`` or ``named`` (the labels of rows that
    were dropped name classes too: a file missing from a class never renumbers the classes after it)."""
    names = sorted(set(seen.values()) | set(named), key=lambda s: (0, *_numeric(s), s) if _is_number(s) else (1, 0, "", s))
    index = {name: i for i, name in enumerate(names)}
    records = sorted((rel, index[label]) for rel, label in seen.items())
    return names, [p for p, _ in records], [lab for _, lab in records]


_DECIMAL = re.compile(r"[0-9]+\.[0-9]+")  # a number with a decimal point: "2.0", "10.5"


def note_numeric_labels(listing: Listing) -> None:
    """Log when a CSV's numeric label is not the class index the cache stores (labels 1..N, or with gaps), with
    the class list the build labels by (the source's, or the one given)."""
    if listing.kind != "csv":
        return
    renumbered = next(((name, i) for i, name in enumerate(listing.classes)
                       if _is_number(name) and _numeric(name) != _numeric(str(i))), None)
    if renumbered is not None:
        log.info("datapipe build: the CSV's numeric labels are numbered in the class list's order from 0, so label "
                 "%s is class %d (the cache holds class indices; cache.classes gives each one's label as written)",
                 show(renumbered[0]), renumbered[1])
    decimals = [name for name in listing.classes if _DECIMAL.fullmatch(name) and not _is_number(name)]
    if len(decimals) > 1 and decimals != sorted(decimals, key=float):
        first = next(i for i, (a, b) in enumerate(zip(decimals, sorted(decimals, key=float), strict=True)) if a != b)
        log.warning("datapipe build: the CSV's labels %s and the like are numbers written with a decimal point (as "
                    "pandas writes integer labels it read as floats), which are class names in text order: %s is "
                    "class %d; write them as whole numbers (numeric order), or give the class list (--classes-from)",
                    show(decimals[0]), show(decimals[first]), listing.classes.index(decimals[first]))


def with_classes(listing: Listing, classes: Sequence[str]) -> Listing:
    """``listing`` labelled by ``classes`` (another cache's class list, so that both caches give every class
    the same label): each class of the source must be among them; those it lacks simply have no sample.

    Raises:
        SourceError: a class of the source is not in ``classes``.
    """
    index = {name: i for i, name in enumerate(classes)}
    missing = [name for name in listing.classes if name not in index]
    if missing:
        names = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
        given = {spelling(name): name for name in classes}
        twins = [(m, given[spelling(m)]) for m in missing if spelling(m) in given]
        alike = (f"; {ascii(twins[0][0])} differs from the given {ascii(twins[0][1])} only in how it is written "
                 f"({_UNICODE_FORMS}): "
                 f"{'write the labels in the CSV' if listing.kind == 'csv' else 'rename the folders'} alike" if twins else "")
        shown_given = ", ".join(repr(c) for c in list(classes)[:3]) + (" ..." if len(classes) > 3 else "")
        raise SourceError(f"{shown(listing.url or str(listing.source or listing.root))}: "
                          f"{len(missing)} of its {len(listing.classes)} classes are not among the {len(classes)} "
                          f"given ({names}; the given are {shown_given}){alike}; give a class list that holds every "
                          "class of the source, one name a line (for a validation set: the training cache's, with "
                          "--classes-from TRAIN_CACHE)")
    remap = [index[name] for name in listing.classes]
    labels = [remap[label] if label >= 0 else label for label in listing.labels]
    return dataclasses.replace(listing, classes=list(classes), labels=labels)


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
            "stats": [list(listing.stats[i]) for i in range(start, stop)],  # what each read must find (builder._load)
            # the paths the scan found no file at (a dangling link, a missing CSV row): see builder.read_again
            "absent": [listing.paths[i] for i in range(start, stop) if listing.stats[i][0] < 0],
        })
    return plans
