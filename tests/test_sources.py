"""Build sources: CSV listings (header rule, numeric labels, duplicates, decoding by content, boxes
refused, bad rows), missing and empty sources.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from build_fixtures import (
    SIZE,
    build,
)

import datapipe
from datapipe.codecs import DecodeSpec, decode_sample
from datapipe.errors import (
    SourceError,
)

# ----------------------------------------------------------------------------- CSV sources


def test_csv_source(tmp_path, imaging):
    root = tmp_path / "data"
    good = imaging.write_source(root / "pics", {"x": 4, "y": 4}, variety=True)
    (root / "pics" / "ünï").mkdir()
    (root / "pics" / "ünï" / "café.png").write_bytes(imaging.encode(imaging.gradient(40, 40), "PNG"))
    rows = [("path", "label")]
    labels = {}
    for i, rel in enumerate(sorted(good)):
        name = "cat" if i % 2 else "bird"
        rows.append((f"pics/{rel}", name))
        labels[f"pics/{rel}"] = name
    rows.append(("pics/ünï/café.png", "ant"))
    labels["pics/ünï/café.png"] = "ant"
    rows.append(("pics/missing.jpg", "cat"))  # names a file that does not exist
    twice = f"pics/{min(good)}"
    rows.append((twice, labels[twice]))  # duplicate row
    csv_path = root / "list.csv"
    csv_path.write_text("\n".join(",".join(r) for r in rows) + "\n", encoding="utf-8")
    report = build(csv_path, tmp_path / "out", max_bad_fraction=0.5)
    assert report.status == "ok"
    reasons = {q["path"]: q["reason"] for q in report.quarantined}
    assert set(reasons) == {"pics/missing.jpg", twice}
    assert re.search(r"unreadable.*(FileNotFound|No such file)", reasons["pics/missing.jpg"])
    assert "duplicate" in reasons[twice]
    kinds = {q["path"]: q["error"] for q in report.quarantined}
    assert kinds == {"pics/missing.jpg": "unreadable", twice: "duplicate"}
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["ant", "bird", "cat"]
    assert cache.manifest.config["source_kind"] == "csv"
    assert len(cache) == len(labels)
    assert [cache.path(i) for i in range(len(cache))] == sorted(labels)
    for i in range(len(cache)):
        image, label = cache[i]
        assert cache.classes[label] == labels[cache.path(i)]
        np.testing.assert_array_equal(image, decode_sample((root / cache.path(i)).read_bytes(), DecodeSpec(SIZE)))
    report_json = json.loads((tmp_path / "out" / "report.json").read_text(encoding="utf-8"))
    assert {q["path"] for q in report_json["quarantined"]} == set(reasons)


def test_csv_without_header_numeric_labels(tmp_path, imaging):
    root = tmp_path / "data"
    files = imaging.write_source(root, {"a": 3}, variety=False)
    paths = sorted(files)
    lines = [f"{paths[0]},10", f"{paths[1]},2", f" {paths[2]} , 2 ", "", "# a comment"]
    (root / "list.csv").write_text("\n".join(lines) + "\n")
    build(root / "list.csv", tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["2", "10"]  # numeric labels sort as numbers
    assert [cache.path(i) for i in range(3)] == paths
    assert [cache[i][1] for i in range(3)] == [1, 0, 0]


def test_csv_duplicate_keeps_the_first_row(tmp_path, imaging):
    files = sorted(imaging.write_source(tmp_path, {"a": 2}, variety=False))
    (tmp_path / "list.csv").write_text(f"{files[0]},zebra\n{files[0]},ant\n{files[1]},zebra\n")
    report = build(tmp_path / "list.csv", tmp_path / "out", max_bad_fraction=0.5)
    assert [q["path"] for q in report.quarantined] == [files[0]]
    assert "first row" in report.quarantined[0]["reason"]
    cache = datapipe.open(tmp_path / "out")
    assert [cache.classes[cache[i][1]] for i in range(2)] == ["zebra", "zebra"]


def test_csv_rows_are_decoded_by_content_whatever_their_names(tmp_path, imaging):
    root = tmp_path / "src"
    root.mkdir()
    arr = imaging.gradient(40, 52, seed=1)
    (root / "photo.dat").write_bytes(imaging.jpeg(arr))  # a JPEG without an image extension
    (root / "scan").write_bytes(imaging.encode(arr, "PNG"))  # a PNG without any extension
    (root / "list.csv").write_text("photo.dat,a\nscan,b\n", encoding="utf-8")
    report = build(root / "list.csv", tmp_path / "out")
    assert report.status == "ok" and report.num_samples == 2 and report.quarantined == []
    cache = datapipe.open(tmp_path / "out")
    for i, name in enumerate(["photo.dat", "scan"]):
        assert cache.path(i) == name
        np.testing.assert_array_equal(cache[i][0], decode_sample((root / name).read_bytes(), DecodeSpec(size=SIZE)))


def test_csv_with_boxes_is_refused_not_dropped(tmp_path, imaging):
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.jpg").write_bytes(imaging.jpeg(imaging.gradient(40, 52, seed=1)))
    (root / "list.csv").write_text("path,label,xmin,ymin,xmax,ymax\na.jpg,cat,1,2,30,40\n", encoding="utf-8")
    with pytest.raises(SourceError, match=r"list.csv:1: 6 columns.*boxes, masks"):
        build(root / "list.csv", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (root / "list.csv").write_text("path,label,\na.jpg,cat,\n", encoding="utf-8")  # a trailing comma is fine
    assert build(root / "list.csv", tmp_path / "out").num_samples == 1


def test_csv_with_bad_row(tmp_path):
    (tmp_path / "list.csv").write_text("path,label\njust-a-path\n")
    with pytest.raises(SourceError, match="list.csv:2"):
        build(tmp_path / "list.csv", tmp_path / "out")


# ----------------------------------------------------------------------------- configuration and output


def test_missing_source(tmp_path):
    with pytest.raises(SourceError, match="does not exist") as info:
        build(tmp_path / "nope", tmp_path / "out")
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "out").exists()


def test_empty_source(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(SourceError, match="no image files"):
        build(tmp_path / "src", tmp_path / "out")
    (tmp_path / "src" / "cls").mkdir()
    (tmp_path / "src" / "cls" / "readme.txt").write_text("x")
    with pytest.raises(SourceError, match="no image files.*readme.txt"):
        build(tmp_path / "src", tmp_path / "out")
    (tmp_path / "empty.csv").write_text("path,label\n")
    with pytest.raises(SourceError, match="no image files"):
        build(tmp_path / "empty.csv", tmp_path / "out")
