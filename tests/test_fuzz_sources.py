"""Generated CSV listings and build.json documents: only one-line DatapipeErrors, never a listing that
reaches outside the source root.

A CSV of random bytes, rows, encodings, byte-order marks, quotes, NULs, absolute paths and paths with
'..' is either refused with a one-line :class:`~datapipe.errors.SourceError` or scanned into a
listing whose every path is a normalised relative path inside the CSV's folder. A build.json of any
JSON shape gives a one-line error from the build (or none, for a document that is not datapipe's),
never another exception.
"""

from __future__ import annotations

import json
import os
import posixpath
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datapipe.errors import DatapipeError
from datapipe.output import prepare
from datapipe.sources import scan

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

segment = st.sampled_from(["a", "b.jpg", "..", ".", "", "c d", "é.png", "x\x00y", "/", "~", "\\", '"q"', "\r", "\n"])
path_cell = st.one_of(st.lists(segment, min_size=1, max_size=5).map("/".join),
                      st.sampled_from(["/etc/passwd", "../../x.jpg", "a/../../b.jpg", "a/./b.jpg", "~/x.jpg"]),
                      st.text(max_size=12))
label_cell = st.one_of(st.sampled_from(["cat", "dog", "1", "10", "", " ", "label", '"x,y"']), st.text(max_size=6))
row = st.lists(st.one_of(path_cell, label_cell), min_size=0, max_size=4)
encoding = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32", "latin-1"])


def one_line(exc: BaseException) -> None:
    assert isinstance(exc, DatapipeError), repr(exc)
    assert "\n" not in str(exc) and str(exc), repr(str(exc))


def check_listing(csv_path: Path) -> None:
    try:
        listing = scan(csv_path)
    except DatapipeError as exc:
        one_line(exc)
        return
    root = os.path.realpath(csv_path.parent)
    for path in listing.paths + [q["path"] for q in listing.dropped]:
        assert not os.path.isabs(path) and "\x00" not in path
        assert posixpath.normpath(path) == path and not path.startswith("..")
        assert os.path.realpath(os.path.join(root, path)).startswith(root + os.sep)
    assert len(listing.labels) == len(listing.paths) == len(listing.stats)
    assert all(0 <= label < len(listing.classes) for label in listing.labels)


@SETTINGS
@given(rows=st.lists(row, max_size=8), enc=encoding, crlf=st.booleans())
def test_generated_csv_rows(tmp_path_factory, rows, enc, crlf):
    folder = tmp_path_factory.mktemp("csv")
    (folder / "b.jpg").write_bytes(b"not really an image")
    end = "\r\n" if crlf else "\n"
    text = end.join(",".join(cells) for cells in rows) + end
    try:
        data = text.encode(enc)
    except UnicodeEncodeError:
        data = text.encode("utf-8", "surrogatepass")
    (folder / "list.csv").write_bytes(data)
    check_listing(folder / "list.csv")


@SETTINGS
@given(data=st.binary(max_size=300))
def test_random_bytes_as_csv(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("bytes")
    (folder / "list.csv").write_bytes(data)
    check_listing(folder / "list.csv")


json_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.floats(allow_nan=False), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)
build_doc = st.one_of(
    json_value,
    st.fixed_dictionaries({"format": st.sampled_from(["datapipe-cache", "other", 1]),
                           "version": st.sampled_from([1, "1", 2, None, True])},
                          optional={"config": json_value, "config_hash": json_value, "build_id": json_value,
                                    "source": json_value}),
)


@SETTINGS
@given(doc=build_doc)
def test_generated_build_json(tmp_path_factory, doc):
    out = tmp_path_factory.mktemp("out")
    (out / "build.json").write_text(json.dumps(doc))
    before = (out / "build.json").read_bytes()
    config = {"size": 32, "fit": "crop", "max_pixels": 100, "shard_size": 4, "source_kind": "folder"}
    from datapipe.records import config_hash

    try:
        target = prepare(out, config, config_hash(config), {"path": "/src", "kind": "folder"}, force=True)
    except DatapipeError as exc:
        one_line(exc)
        assert (out / "build.json").read_bytes() == before  # refused: nothing touched
        return
    target.lock.release()  # accepted only as datapipe's own (marker, build id): a resume or a forced rebuild
    assert json.loads((out / "build.json").read_text())["build_id"]


@pytest.mark.parametrize("text", ["path,label\n/etc/passwd,cat\n", "../x.jpg,cat\n", "a/../../x.jpg,c\n"])
def test_escaping_rows_are_refused(tmp_path, text):
    (tmp_path / "list.csv").write_text(text)
    with pytest.raises(DatapipeError, match="outside|absolute"):
        scan(tmp_path / "list.csv")
