"""Build sources: CSV listings (header rule, numeric labels, duplicates, decoding by content, boxes
refused, bad rows), missing and empty sources, a class list given to the build (another cache's).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from build_fixtures import (
    SIZE,
    build,
)

import datapipe
from datapipe.codecs import DecodeSpec, decode_rgb, decode_sample
from datapipe.errors import (
    ArgumentError,
    ConfigMismatchError,
    DecodeError,
    SourceError,
)
from datapipe.sources import Listing, with_classes

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


def test_numeric_class_folders_are_numbered_as_imagefolder_does_and_the_log_says_so(tmp_path, imaging, caplog):
    """Class folders 1, 2, 10 are numbered in torchvision ImageFolder's string order ('10' is label 1), a CSV of the
    same names in numeric order: the build's log says so, and --classes-from gives both caches one list."""
    root = tmp_path / "data"
    files = imaging.write_source(root, {"1": 1, "2": 1, "10": 1}, variety=False)
    with caplog.at_level("INFO", logger="datapipe.build"):
        build(root, tmp_path / "folder")
    assert datapipe.open(tmp_path / "folder").classes == ["1", "10", "2"]
    assert "ImageFolder's (string) order, so '10' is label 1" in caplog.text
    caplog.clear()
    (tmp_path / "list.csv").write_text("".join(f"data/{p},{p.split('/')[0]}\n" for p in sorted(files)))
    with caplog.at_level("INFO", logger="datapipe.build"):
        build(tmp_path / "list.csv", tmp_path / "csv")
    assert datapipe.open(tmp_path / "csv").classes == ["1", "2", "10"] and "ImageFolder" not in caplog.text
    build(tmp_path / "list.csv", tmp_path / "csv-shared", classes=datapipe.open(tmp_path / "folder").classes)
    shared = datapipe.open(tmp_path / "csv-shared")
    assert shared.classes == ["1", "10", "2"]
    assert {shared.path(i).split("/")[-2]: shared[i][1] for i in range(3)} == {"1": 0, "10": 1, "2": 2}


def test_csv_numeric_labels_of_any_length_are_numbered_and_the_log_says_when_they_are_renumbered(tmp_path, imaging,
                                                                                                 caplog):
    """A numeric label of more than 4,300 digits ended the build with a traceback (int() refuses it); labels 1..N
    (or with gaps) become classes 0..N-1 without a word, so the cache's label differed from the CSV's number.
    Any length sorts in numeric order, and the log says when a number is not its class index."""
    root = tmp_path / "data"
    files = sorted(imaging.write_source(root, {"a": 3}, variety=False))
    huge = "9" * 5000
    (root / "list.csv").write_text("".join(f"{p},{label}\n" for p, label in zip(files, [huge, "1", "0"], strict=True)))
    with caplog.at_level("INFO", logger="datapipe.build"):
        build(root / "list.csv", tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["0", "1", huge] and [cache[i][1] for i in range(3)] == [2, 1, 0]
    assert "numbered in the class list's order from 0, so label '999" in caplog.text and "is class 2" in caplog.text
    caplog.clear()
    (root / "list.csv").write_text("".join(f"{p},{label}\n" for p, label in zip(files, ["2", "1", "0"], strict=True)))
    with caplog.at_level("INFO", logger="datapipe.build"):
        build(root / "list.csv", tmp_path / "identity")
    assert "numbered in the class list's order" not in caplog.text  # 0..N-1: each number is its class index
    caplog.clear()
    with caplog.at_level("INFO", logger="datapipe.build"):  # labels 1, 2 by the list 0, 1, 2: each its own index
        build(root / "list.csv", tmp_path / "given", classes=["0", "1", "2"])
    assert "numbered in the class list's order" not in caplog.text


def test_csv_labels_that_look_like_digits_but_are_no_ascii_numbers_are_names(tmp_path, imaging):
    """'²' or '①' pass str.isdigit() but are no numbers for int(): names, sorted after the numbers (they crashed
    the build with a traceback)."""
    root = tmp_path / "data"
    files = sorted(imaging.write_source(root, {"a": 4}, variety=False))
    labels = ["²", "cat", "①", "3"]
    (root / "list.csv").write_text("".join(f"{p},{label}\n" for p, label in zip(files, labels, strict=True)))
    build(root / "list.csv", tmp_path / "out")
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["3", "cat", "²", "①"]
    assert [cache.classes[cache[i][1]] for i in range(4)] == labels


def test_csv_paths_whose_names_begin_or_end_with_spaces(tmp_path, imaging):
    """Spaces around a path cell are dropped, except where the file's own name has them (a quoted cell)."""
    root = tmp_path / "data"
    files = sorted(imaging.write_source(root, {"a": 3}, variety=False))
    spaced = [" lead.jpg", "trail.jpg "]
    for name, src in zip(spaced, files, strict=False):
        os.replace(root / src, root / "a" / name)
    rows = [f'"a/{spaced[0]}",x', f'"a/{spaced[1]}",x', f"  {files[2]}  ,y"]
    (root / "list.csv").write_text("\n".join(rows) + "\n")
    report = build(root / "list.csv", tmp_path / "out")
    assert report.quarantined == []
    cache = datapipe.open(tmp_path / "out")
    assert sorted(cache.path(i) for i in range(3)) == sorted([f"a/{spaced[0]}", f"a/{spaced[1]}", files[2]])


def test_csv_duplicate_keeps_the_first_row(tmp_path, imaging):
    files = sorted(imaging.write_source(tmp_path, {"a": 2}, variety=False))
    (tmp_path / "list.csv").write_text(f"{files[0]},zebra\n{files[0]},ant\n{files[1]},zebra\n")
    report = build(tmp_path / "list.csv", tmp_path / "out", max_bad_fraction=0.5)
    assert [q["path"] for q in report.quarantined] == [files[0]]
    assert "first row" in report.quarantined[0]["reason"]
    cache = datapipe.open(tmp_path / "out")
    assert [cache.classes[cache[i][1]] for i in range(2)] == ["zebra", "zebra"]


@pytest.mark.parametrize("b_is", ["missing", "a folder", "a fifo", "a duplicate row"])
def test_a_csv_rows_class_stays_when_its_only_file_is_dropped(tmp_path, imaging, b_is):
    """The classes are the CSV's labels, whatever becomes of the files: a class whose only row is refused at
    scan (a folder or FIFO at its path, a path listed twice) is named as empty, and the classes after it keep
    their labels; it used to vanish, and every later class took the label before it."""
    import os

    a, c = sorted(imaging.write_source(tmp_path, {"x": 2}, variety=False))
    rows = [f"{a},cat", "b.jpg,dog", f"{c},zebra"]
    if b_is == "a folder":
        (tmp_path / "b.jpg").mkdir()
    elif b_is == "a fifo":
        os.mkfifo(tmp_path / "b.jpg")
    elif b_is == "a duplicate row":
        rows[1] = f"{a},dog"
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    report = build(tmp_path / "list.csv", tmp_path / "out", max_bad_fraction=0.5)
    cache = datapipe.open(tmp_path / "out")
    assert cache.classes == ["cat", "dog", "zebra"]
    assert {cache.path(i): cache.classes[cache[i][1]] for i in range(len(cache))} == {a: "cat", c: "zebra"}
    assert report.empty_classes == ["dog"]
    assert len(report.quarantined) == 1


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


# ----------------------------------------------------------------------------- folders that cannot be read, classes left empty


@pytest.mark.parametrize("folder", ["b", "b/deeper"])
def test_an_unreadable_folder_ends_the_build_naming_it(tmp_path, imaging, monkeypatch, folder):
    """A class folder (or a folder inside one) that cannot be read would take all its images out of
    the cache; it is not one quarantined file within the budget but one line naming the folder."""
    import os

    src = tmp_path / "src"
    imaging.write_source(src, {"a": 3, "b": 3, "c": 3}, variety=False)
    (src / "b" / "deeper").mkdir()
    (src / "b" / "deeper" / "x.jpg").write_bytes(imaging.jpeg(imaging.gradient(20, 20)))
    blocked = str(src / folder)
    real = os.scandir

    def scandir(path=".", *args):
        if os.fspath(path) == blocked:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, *args)

    monkeypatch.setattr(os, "scandir", scandir)
    with pytest.raises(SourceError, match=f"folder {re.escape(blocked)} of the source cannot be read "
                                          r"\(Permission denied\)") as info:
        build(src, tmp_path / "out", max_bad_fraction=0.5)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("fails", "code", "named"), [
    ("b/sub/*", "EACCES", "b/sub"),  # listed, not entered: every entry's lookup is refused
    ("b/sub/deeper", "ENAMETOOLONG", "b/sub/deeper"),  # a folder whose path is over PATH_MAX
    ("b/sub/deeper", "EIO", "b/sub/deeper"),
    ("b", "EACCES", "b"),  # a class folder
])
def test_a_folder_that_cannot_be_looked_up_ends_the_build_naming_it(tmp_path, imaging, monkeypatch, fails, code, named):
    """A folder the scan lists but cannot look into (no execute permission) or look up (a path too long, an
    I/O error) ends the build naming it; its sub-folders and their images used to be left out without a word."""
    import errno
    import os

    src = tmp_path / "src"
    imaging.write_source(src, {"a": 3, "b": 3}, variety=False)
    (src / "b" / "sub" / "deeper").mkdir(parents=True)
    (src / "b" / "sub" / "x.jpg").write_bytes(imaging.jpeg(imaging.gradient(20, 20)))
    (src / "b" / "sub" / "deeper" / "y.jpg").write_bytes(imaging.jpeg(imaging.gradient(20, 20)))
    real = os.stat

    def refused(path) -> bool:
        path = os.fspath(path)
        if fails.endswith("/*"):
            return os.path.dirname(path) == str(src / fails[:-2])
        return path == str(src / fails)

    def stat(path, *args, **kwargs):
        if not isinstance(path, int) and refused(path):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(SourceError, match=f"folder {re.escape(str(src / named))} of the source cannot be read "
                                          rf"\({re.escape(os.strerror(getattr(errno, code)))}\)") as info:
        build(src, tmp_path / "out", max_bad_fraction=1.0)
    assert "\n" not in str(info.value)


def test_a_folder_without_read_permission_ends_the_build(tmp_path, imaging):
    import os

    src = tmp_path / "src"
    imaging.write_source(src, {"a": 3, "b": 3}, variety=False)
    os.chmod(src / "b", 0)
    try:
        if os.access(src / "b", os.R_OK):
            pytest.skip("this user reads folders whatever their mode (root with CAP_DAC_OVERRIDE)")
        with pytest.raises(SourceError, match=r"folder .*/b of the source cannot be read"):
            build(src, tmp_path / "out", max_bad_fraction=1.0)
    finally:
        os.chmod(src / "b", 0o755)


def test_a_class_without_samples_is_reported(tmp_path, imaging, caplog):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 3, "b": 3}, variety=False)
    (src / "empty").mkdir()
    (src / "only-bad").mkdir()
    (src / "only-bad" / "zero.jpg").write_bytes(b"")
    with caplog.at_level("INFO", logger="datapipe.build"):
        report = build(src, tmp_path / "out", max_bad_fraction=1.0)
    assert report.empty_classes == ["empty", "only-bad"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["empty_classes"] == ["empty", "only-bad"]
    assert "2 classes without any sample (empty, only-bad)" in report.summary()
    assert report.summary() in caplog.text


# ----------------------------------------------------------------------------- images outside class folders


def test_images_at_the_top_of_a_folder_source_are_named_not_dropped_silently(tmp_path, imaging):
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 3, "b": 3}, variety=False)
    for name in ("cover.jpg", "z.PNG"):
        (src / name).write_bytes(imaging.jpeg(imaging.gradient(20, 20)))
    (src / "notes.txt").write_text("x")
    report = build(src, tmp_path / "out")
    assert report.outside_classes == ["cover.jpg", "z.PNG"]
    assert report.ignored == 1  # notes.txt: not an image
    on_disk = json.loads((tmp_path / "out" / "report.json").read_text())
    assert on_disk["outside_classes"] == ["cover.jpg", "z.PNG"]
    assert "2 image files at the source's top level not used (no class folder" in report.summary()
    assert report.num_samples == 6 and report.scanned == 6


_UNDECODED = {"heic": b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic", "avif": b"\x00\x00\x00\x1cftypavif" + bytes(16),
              "jp2": b"\x00\x00\x00\x0cjP  \r\n\x87\n" + bytes(16), "jxl": b"\xff\x0a" + bytes(16)}


def test_pictures_of_formats_not_decoded_are_quarantined_saying_so_not_left_out_as_notes(tmp_path, imaging):
    """An iPhone's .HEIC photos (and AVIF, JPEG 2000, JPEG XL ones) were counted with the notes beside the images
    ('ignored'): the build said "ok" with none of them, and nothing said to convert them."""
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 3, "b": 3}, variety=False)
    for kind, head in _UNDECODED.items():
        (src / "a" / f"photo.{kind.upper()}").write_bytes(head)
    (src / "b" / "avif-named.jpg").write_bytes(_UNDECODED["avif"])  # the content decides, not the name
    (src / "b" / "notes.txt").write_text("x")
    report = build(src, tmp_path / "out", max_bad_fraction=1.0)
    assert report.ignored == 1 and report.num_samples == 6
    reasons = {q["path"]: (q["error"], q["reason"]) for q in report.quarantined}
    names = {"heic": "a HEIC", "avif": "an AVIF", "jp2": "a JPEG 2000", "jxl": "a JPEG XL"}
    for kind, named in names.items():
        error, reason = reasons[f"a/photo.{kind.upper()}"]
        assert error == "unsupported" and reason.startswith(f"unsupported: {named} picture, a format datapipe does "
                                                            "not decode; convert it to JPEG or PNG"), reason
    assert reasons["b/avif-named.jpg"][0] == "unsupported"
    mp4 = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"  # ISO-BMFF of no picture brand: no picture
    with pytest.raises(DecodeError) as info:
        decode_rgb(mp4)
    assert info.value.kind == "not-an-image"


def test_netpbm_pictures_of_a_folder_source_are_samples(tmp_path, imaging):
    """GTSRB's .ppm pictures were counted with the notes beside the images: its folders were refused as holding
    no image, a mixed class kept only its JPEGs, the build saying "ok"."""
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 2, "b": 2}, variety=False)
    pixels = np.random.default_rng(0).integers(0, 256, (20, 24, 3), dtype=np.uint8)
    for name in ("a/x.ppm", "b/y.PGM"):
        data = b"P6\n24 20\n255\n" + pixels.tobytes() if name.endswith("ppm") else \
            b"P5\n24 20\n255\n" + pixels[..., 0].tobytes()
        (src / name).write_bytes(data)
    report = build(src, tmp_path / "out")
    assert report.num_samples == 6 and report.quarantined == [] and report.ignored == 0


def test_labels_that_are_numbers_with_a_decimal_point_are_named_in_the_log(tmp_path, imaging, caplog):
    """pandas writes integer labels it read as floats as '0.0' .. '11.0': they are names in text order ('10.0' is
    class 2), which was said nowhere."""
    names = [f"{i:02d}.jpg" for i in range(12)]
    _images(tmp_path, names, imaging)
    (tmp_path / "list.csv").write_text("".join(f"{n},{float(i)}\n" for i, n in enumerate(names)))
    with caplog.at_level("WARNING", logger="datapipe"):
        datapipe.build(tmp_path / "list.csv", tmp_path / "out", size=16, cluster=datapipe.Cluster(scheduler="sync"),
                       progress=False)
    warned = [r.getMessage() for r in caplog.records if "decimal point" in r.getMessage()]
    assert len(warned) == 1 and "'10.0' is class 2" in warned[0], warned


@pytest.mark.parametrize(("cell", "advice"), [("imgs\\cat\\0.jpg", "write paths with '/'"),
                                             ("imgs/cat/0", "write each file's extension"),
                                             ("data/imgs/cat/0.jpg", "write paths from the CSV's folder")],
                         ids=["backslashes", "no-extension", "from-the-parent"])
def test_rows_naming_no_file_are_told_where_they_were_looked_for_and_the_file_a_slip_missed(tmp_path, imaging, caplog,
                                                                                              cell, advice):
    """Windows paths, Kaggle ids without their extension and paths from the project's root each gave N quarantined
    rows of 'FileNotFoundError: No such file or directory', naming neither the path looked for nor the file meant."""
    data = tmp_path / "data"
    _images(data, ["imgs/cat/0.jpg", "imgs/cat/1.jpg", "imgs/dog/2.jpg"], imaging)
    (data / "list.csv").write_text(f"{cell},cat\nimgs/cat/1.jpg,cat\nimgs/dog/2.jpg,dog\n")
    with caplog.at_level("WARNING", logger="datapipe"):
        datapipe.sources.scan(data / "list.csv")
    warned = [r.getMessage() for r in caplog.records if "name no file" in r.getMessage()]
    assert len(warned) == 1 and f"1 of the 3 paths of {data / 'list.csv'} name no file (first: {cell!r}, looked for " \
        f"as {data / cell}" in warned[0] and "'imgs/cat/0.jpg' exists" in warned[0] and advice in warned[0], warned


def test_a_source_of_only_top_level_images_says_why_nothing_is_used(tmp_path, imaging):
    src = tmp_path / "src"
    src.mkdir()
    (src / "cover.jpg").write_bytes(imaging.jpeg(imaging.gradient(20, 20)))
    with pytest.raises(SourceError, match=r"no image files in class folders \(1 at its top, e.g. \['cover.jpg'\]"):
        build(src, tmp_path / "out")


# ----------------------------------------------------------------------------- the output inside the source


@pytest.mark.parametrize("where", ["cache", "a/cache"])
def test_an_output_folder_inside_the_source_is_never_scanned(tmp_path, imaging, where):
    """An empty output folder made in advance inside the source is no class of the first build, and
    the rerun (the folder is a cache by then) keeps the same classes and labels."""
    src = tmp_path / "src"
    imaging.write_source(src, {"a": 3, "b": 3}, variety=False)
    out = src / where
    out.mkdir()
    first = build(src, out)
    cache = datapipe.open(out)
    classes, labels = list(cache.classes), [int(cache[i][1]) for i in range(len(cache))]
    paths = [cache.path(i) for i in range(len(cache))]
    assert classes == ["a", "b"] and first.num_samples == 6
    assert not any(p.startswith(where) for p in paths)
    second = build(src, out)
    again = datapipe.open(out)
    assert list(again.classes) == classes and second.shards_built == 0
    assert [int(again[i][1]) for i in range(len(again))] == labels
    assert [again.path(i) for i in range(len(again))] == paths


# ----------------------------------------------------------------------------- a class list given to the build


def test_a_validation_cache_labelled_by_the_training_caches_classes(tmp_path, imaging):
    """A validation source that lacks a class (or holds them in another order) labelled by the training cache's
    class list: every class keeps the training cache's label. Without the list, labels would shift."""
    train_src, val_src = tmp_path / "train", tmp_path / "val"
    imaging.write_source(train_src, {"ant": 2, "bee": 2, "cat": 2, "dog": 2}, variety=False)
    imaging.write_source(val_src, {"bee": 2, "dog": 2}, variety=False)
    build(train_src, tmp_path / "train-cache")
    train = datapipe.open(tmp_path / "train-cache")
    report = build(val_src, tmp_path / "val-cache", classes=train.classes)
    val = datapipe.open(tmp_path / "val-cache")
    assert list(val.classes) == list(train.classes) == ["ant", "bee", "cat", "dog"]
    for i in range(len(val)):
        assert val.classes[val[i][1]] == val.path(i).split("/")[0]  # bee -> 1, dog -> 3, as in training
    assert sorted({int(val[i][1]) for i in range(len(val))}) == [1, 3]
    assert report.empty_classes == ["ant", "cat"]
    assert build(val_src, tmp_path / "val-cache", classes=train.classes).shards_built == 0  # a rerun: nothing to do
    with pytest.raises(ConfigMismatchError, match="classes"):
        build(val_src, tmp_path / "val-cache")  # another labelling is another cache
    plain = build(val_src, tmp_path / "plain")
    assert plain.status == "ok" and list(datapipe.open(tmp_path / "plain").classes) == ["bee", "dog"]


def test_a_class_of_the_source_missing_from_the_list_is_refused(tmp_path, imaging):
    imaging.write_source(tmp_path / "src", {"bee": 1, "emu": 1, "fox": 1}, variety=False)
    with pytest.raises(SourceError, match=r"2 of its 3 classes are not among the 2 given \('emu', 'fox'; the given "
                                          r"are 'ant', 'bee'\)"):
        build(tmp_path / "src", tmp_path / "out", classes=["ant", "bee"])
    assert not (tmp_path / "out" / "manifest.json").exists()
    lines = ["bee the honey bee", "emu the large bird", "fox the red fox"]  # a synset mapping: more than a name
    with pytest.raises(SourceError, match=r"3 of its 3 classes are not among the 3 given \('bee', 'emu', 'fox'; the "
                                          r"given are 'bee the honey bee', 'emu the large bird', 'fox the red fox'\)"):
        build(tmp_path / "src", tmp_path / "out", classes=lines)


@pytest.mark.parametrize(("classes", "message"), [("ab", "list of class names"), ([], "list of class names"),
                                                    (["a", ""], "list of class names"), (["a", 1], "list of class names"),
                                                    (["a", "b", "a"], "'a' more than once")])
def test_a_class_list_that_is_not_one_is_an_argument_error(tmp_path, classes, message):
    with pytest.raises(ArgumentError, match=message):
        datapipe.BuildSpec(classes=classes)


def test_classes_from_a_cache_or_a_text_file_on_the_command_line(tmp_path, imaging):
    """`--classes-from` takes a cache folder (its manifest's list) or a text file of one name per line; with
    CSV sources of numeric labels too, where a missing class would otherwise renumber the rest."""
    root = tmp_path / "data"
    files = sorted(imaging.write_source(root, {"a": 4}, variety=False))
    (root / "train.csv").write_text("".join(f"{f},{label}\n" for f, label in zip(files, ["0", "2", "5", "7"], strict=True)))
    (root / "val.csv").write_text(f"{files[0]},0\n{files[3]},7\n")
    (tmp_path / "names.txt").write_text("0\n2\n5\n7\n\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "datapipe.cli", "build", *args, "--size", "16",  # noqa: E731
                                        "--scheduler", "sync", "--quiet"], capture_output=True, text=True, timeout=120)
    assert run(str(root / "train.csv"), str(tmp_path / "train")).returncode == 0
    for given in (tmp_path / "train", tmp_path / "names.txt"):
        out = tmp_path / f"val-{given.name}"
        done = run(str(root / "val.csv"), str(out), "--classes-from", str(given))
        assert done.returncode == 0, done.stderr
        val = datapipe.open(out)
        assert list(val.classes) == ["0", "2", "5", "7"] and [int(val[i][1]) for i in range(2)] == [0, 3]
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "twice.txt").write_text("0\n2\n5\n2\n7\n")
    for bad, message in ((tmp_path / "empty.txt", "holds no class name"), (tmp_path / "missing", "cannot be read"),
                         (tmp_path / "twice.txt", f"--classes-from {tmp_path / 'twice.txt'}: names class '2' more than "
                                                  "once (again as name 4)")):
        done = run(str(root / "val.csv"), str(tmp_path / "bad"), "--classes-from", str(bad))
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_class_list_file_with_a_comment_a_header_or_of_another_kind(tmp_path, imaging):
    """--classes-from a class list whose first line was a comment ('# classes') or a header ('class', a pandas
    export) took it for class 0: every label one too high, "ok". A comment line is skipped (as in a CSV source);
    a header word is warned of; a JSON file, a source folder and a shifted Unicode form are named for what they
    are; a changed class list of 1,000 names is told in one short line."""
    root = tmp_path / "data"
    imaging.write_source(root / "val", {"bee": 1, "cat": 1}, variety=False)
    run = lambda *args: subprocess.run([sys.executable, "-m", "datapipe.cli", "build", *map(str, args), "--size", "16",  # noqa: E731
                                        "--scheduler", "sync", "--quiet"], capture_output=True, text=True, timeout=120)
    (tmp_path / "commented.txt").write_text("# class names, one per line\nant\nbee\ncat\n#\n")
    done = run(root / "val", tmp_path / "commented", "--classes-from", tmp_path / "commented.txt")
    assert done.returncode == 0, done.stderr
    val = datapipe.open(tmp_path / "commented")
    assert val.classes == ["ant", "bee", "cat"] and sorted(int(val[i][1]) for i in range(2)) == [1, 2]
    (tmp_path / "header.txt").write_text("class\nant\nbee\ncat\n")
    done = run(root / "val", tmp_path / "header", "--classes-from", tmp_path / "header.txt")
    assert done.returncode == 0 and "the first class of --classes-from" in done.stderr and "looks like a header" in done.stderr
    (tmp_path / "names.txt").write_text("#1\n[unlabelled]\nbee\ncat\n")  # a name may begin with # or [
    done = run(root / "val", tmp_path / "names", "--classes-from", tmp_path / "names.txt")
    assert done.returncode == 0 and datapipe.open(tmp_path / "names").classes == ["#1", "[unlabelled]", "bee", "cat"]
    (tmp_path / "manifest.json").write_text('{"classes": ["ant"]}')
    imaging.write_source(root / "train", {"ant": 1}, variety=False)
    for given, words in ((tmp_path / "manifest.json", "a JSON document, not a class list"),
                         (root / "train",
                          "no manifest.json) — pass the folder `datapipe build` wrote (--classes-from takes the training cache")):
        done = run(root / "val", tmp_path / "bad", "--classes-from", given)
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
    imaging.write_source(root / "nfd", {"cafe\u0301": 1}, variety=False)
    (tmp_path / "nfc.txt").write_text("caf\u00e9\n")
    done = run(root / "nfd", tmp_path / "bad", "--classes-from", tmp_path / "nfc.txt")
    assert done.returncode == 2 and "only in how it is written (in another Unicode form" in done.stderr and "'cafe\\u0301'" in done.stderr
    (tmp_path / "c1.txt").write_text("".join(f"n{i:08d}\n" for i in range(1000)) + "bee\ncat\n")
    (tmp_path / "c2.txt").write_text("".join(f"n{i:08d}\n" for i in range(1001)) + "bee\ncat\n")
    assert run(root / "val", tmp_path / "big", "--classes-from", tmp_path / "c1.txt").returncode == 0
    done = run(root / "val", tmp_path / "big", "--classes-from", tmp_path / "c2.txt")
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "classes: a list of 1,002 -> 1,003 (the first difference at [1,000]" in line
    assert len(line) < 400, len(line)


@pytest.mark.parametrize("kind, advice", [("folder", "rename the folders alike"), ("csv", "write the labels in the CSV alike")])
def test_a_class_in_another_unicode_form_is_told_how_its_source_names_it(tmp_path, kind, advice):
    """A CSV's label written in NFD against a class list in NFC was told to rename its folders: a CSV has none."""
    listing = Listing(root=tmp_path, kind=kind, classes=["cafe\u0301"], paths=["a.jpg"], labels=[0], stats=[(1, 1)])
    with pytest.raises(SourceError, match=f"only in how it is written .*: {advice};"):
        with_classes(listing, ["caf\u00e9"])


def test_datasets_of_one_process_that_label_their_classes_otherwise_are_warned_of(tmp_path, imaging):
    """A validation set built without --classes-from that lacks a class: every later label shifts, and a model
    trained on the training set was scored against the wrong labels in silence. Opened in one process, the two
    datasets are compared: a class list within the other's at other labels is a ClassListWarning naming a class
    and both labels; the list --classes-from gives, disjoint lists and a class added last are not."""
    import warnings as _warnings

    from datapipe.errors import ClassListWarning

    imaging.write_source(tmp_path / "train", {"ant": 1, "bee": 1, "cat": 1, "dog": 1}, variety=False)
    imaging.write_source(tmp_path / "val", {"ant": 1, "cat": 1, "dog": 1}, variety=False)  # no bee
    imaging.write_source(tmp_path / "other", {"elk": 1, "fox": 1}, variety=False)
    imaging.write_source(tmp_path / "first", {"ant": 1, "bee": 1, "cat": 1}, variety=False)  # dog added last since
    for name in ("train", "val", "other", "first"):
        build(tmp_path / name, tmp_path / f"{name}-cache")
    build(tmp_path / "val", tmp_path / "val-given", classes=datapipe.open(tmp_path / "train-cache").classes)

    def opened(*names: str) -> list[str]:
        """The ClassListWarnings of opening these caches, each dataset kept alive as a training script keeps it."""
        with _warnings.catch_warnings(record=True) as seen:
            _warnings.simplefilter("always")
            alive = [datapipe.StreamingDataset(tmp_path / name, batch_size=2) for name in names]
        assert len(alive) == len(names)
        return [str(w.message) for w in seen if issubclass(w.category, ClassListWarning)]

    [message] = opened("train-cache", "val-cache")
    assert "class 'cat' is label 1 in the first and 2 in the second (2 of its 3 classes differ)" in message, message
    assert f"--classes-from {tmp_path / 'train-cache'}" in message and str(tmp_path / "val-cache") in message
    assert opened("val-given", "other-cache", "first-cache", "train-cache") == []  # the others are dropped by now


@pytest.mark.parametrize("kind", ["class folder", "file", "csv row", "output"])
def test_names_that_are_not_ascii_under_a_locale_that_is_not_utf8_are_one_line_not_another_cache(tmp_path, imaging,
                                                                                                    kind):
    """Python decodes file names by the locale (LC_ALL=C with PYTHONUTF8=0: ASCII; a Latin-1 locale: Latin-1).
    Under a Latin-1 locale, Zürich was recorded as ZÃ¼rich (the same files gave another cache, and a rerun renamed
    the classes of one built under UTF-8); under C, valid UTF-8 names were called invalid, with advice to convert
    them that would have double-encoded them. Such a name is now refused, naming the variable that helps."""
    src = tmp_path / "src"
    names = {"class folder": ("Zürich", "a.jpg"), "file": ("cat", "é.jpg"), "csv row": ("cat", "ü.jpg"),
             "output": ("cat", "a.jpg")}[kind]
    (src / names[0]).mkdir(parents=True)
    (src / names[0] / names[1]).write_bytes(imaging.jpeg(imaging.gradient(20, 24)))
    (src / "dog").mkdir()
    (src / "dog" / "b.jpg").write_bytes(imaging.jpeg(imaging.gradient(20, 24, seed=1)))
    source = src
    if kind == "csv row":
        (tmp_path / "list.csv").write_text(f"path,label\nsrc/{names[0]}/{names[1]},cat\nsrc/dog/b.jpg,dog\n",
                                           encoding="utf-8")
        source = tmp_path / "list.csv"
    out = tmp_path / ("dépôt" if kind == "output" else "out")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", os.fsencode(source), os.fsencode(out),
                           "--scheduler", "sync", "--size", "16"], capture_output=True, env=env, timeout=120)
    lines = proc.stderr.decode("ascii", "replace").strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "this Python reads file names as ascii (the locale's), not UTF-8" in lines[0], lines[0]
    assert "PYTHONUTF8=1" in lines[0] and "LC_ALL=C.UTF-8" in lines[0] and "convmv" not in lines[0], lines[0]
    assert not out.exists()
    utf8 = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(source), str(out), "--scheduler", "sync",
                           "--size", "16"], capture_output=True, text=True, env={**env, "PYTHONUTF8": "1"}, timeout=120)
    assert utf8.returncode == 0, utf8.stderr
    cache = datapipe.open(out)
    assert len(cache) == 2 and (names[0] in cache.classes or kind == "csv row")
    assert f"{names[0]}/{names[1]}" in [cache.path(i).removeprefix("src/") for i in range(len(cache))]


def test_a_name_whose_bytes_are_not_utf8_under_such_a_locale_is_told_to_be_renamed(tmp_path, imaging):
    """Under a locale that is not UTF-8 a Latin-1 name reads as text; PYTHONUTF8=1 would not help it (it is then
    refused as not UTF-8): the line says to rename it."""
    src = tmp_path / "src"
    os.makedirs(os.fsencode(src / "cat"))
    os.mkdir(os.fsencode(src) + b"/Z\xfcrich")
    for folder in (os.fsencode(src / "cat"), os.fsencode(src) + b"/Z\xfcrich"):
        with open(folder + b"/a.jpg", "wb") as f:
            f.write(imaging.jpeg(imaging.gradient(20, 24)))
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    proc = subprocess.run([sys.executable, "-m", "datapipe.cli", "build", str(src), str(tmp_path / "out"),
                           "--scheduler", "sync", "--size", "16"], capture_output=True, text=True, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("datapipe build: error: class folder ") and "the name is not UTF-8" in lines[0], lines[0]
    assert "rename it to UTF-8" in lines[0] and "convmv -f latin1" in lines[0] and "PYTHONUTF8" not in lines[0], lines[0]


def test_a_csv_path_that_goes_up_from_a_symlink_is_refused_not_read_as_another_file(tmp_path, imaging):
    """`sub/link/../x.jpg` with sub/link -> ../other/deep is other/x.jpg to the system; the text, normalised,
    named sub/x.jpg, which was cached under the row's label, silently. A `..` after a plain folder stays."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "other" / "deep").mkdir(parents=True)
    (src / "sub" / "x.jpg").write_bytes(imaging.jpeg(imaging.gradient(20, 24, seed=1)))
    (src / "other" / "x.jpg").write_bytes(imaging.jpeg(imaging.gradient(20, 24, seed=2)))
    (src / "sub" / "link").symlink_to("../other/deep")
    (src / "list.csv").write_text("sub/link/../x.jpg,cat\nother/x.jpg,dog\n")
    with pytest.raises(SourceError, match=r"list.csv:1: path 'sub/link/\.\./x\.jpg' goes up \('\.\.'\) from the "
                                          r"symlink 'sub/link'"):
        datapipe.build(src / "list.csv", tmp_path / "out", size=16, cluster=datapipe.Cluster(scheduler="sync"),
                       progress=False)
    assert not (tmp_path / "out").exists()
    (src / "list.csv").write_text("sub/../sub/x.jpg,cat\nother/x.jpg,dog\n")  # up from a folder: the same file
    datapipe.build(src / "list.csv", tmp_path / "out", size=16, cluster=datapipe.Cluster(scheduler="sync"),
                   progress=False)
    assert [datapipe.open(tmp_path / "out").path(i) for i in range(2)] == ["other/x.jpg", "sub/x.jpg"]


# ----------------------------------------------------------------------------- stray quotes, label spellings


def _images(root, names, imaging):
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(imaging.jpeg(imaging.gradient(16, 20, seed=len(name))))


@pytest.mark.parametrize(("rows", "line", "to"), [
    (['a.jpg,cat', 'b.jpg,"cat', 'c.jpg,dog', 'd.jpg,dog'], 2, None),  # open to the end of the file
    (['a.jpg,cat', 'b.jpg,"cat', 'c.jpg,dog'], 2, None),  # the same, with no line break at the end (see below)
    (['path,"label', 'a.jpg,cat', 'b.jpg,"dog', 'c.jpg,dog'], 1, 3),  # in the header: its rows were dropped with it
    (['#note,"see below', 'a.jpg,cat', 'b.jpg,"dog', 'c.jpg,dog'], 1, 3),  # in a comment, likewise
    (['a.jpg,"cat', 'b.jpg",dog', 'c.jpg,dog'], 1, 2),  # closed in the next row's path: not "3 columns"
    (['a.jpg,cat', 'b.jpg,"dog', 'c.jpg,dog"'], 2, 3),  # closed on the last line, which has no line break
    (['a.jpg,cat', 'b.jpg,"dog', 'c.jpg,dog', 'd.jpg,"eel'], 2, 4),  # closed by the next stray one
    (['a.jpg,"cat', 'b.jpg,cat', 'c.jpg,dog"', 'd.jpg,dog'], 1, 3),  # closed by a stray quote further down
    (['a.jpg,cat', '"b.jpg,cat', 'c.jpg,dog', 'd.jpg",dog', 'e.jpg,eel'], 2, 4),  # in the path cell
    (['a.jpg,cat', '"b.jpg,cat', 'c.jpg,dog"', 'd.jpg,dog'], 2, 3),  # one cell in all, closed on the next line
    (['a.jpg,cat', '"b.jpg,cat', 'c.jpg,dog"'], 2, 3),  # the same on the last line, which has no line break
    (['a.jpg,cat', 'b.jpg,"cat', 'c.jpg,dog', '"d.jpg",dog'], 2, 4),  # closed on the last line, a quoted path after
    (['a.jpg,cat', '"b.jpg,cat', 'c.jpg,dog'], 2, None),  # a path's never closed
    (['a.jpg,cat', 'b.jpg,"cat""s', 'c.jpg,dog'], 2, None),  # a quote written twice does not close it
], ids=["label-to-the-end", "to-the-end-no-last-line-break", "header", "comment", "into-a-path",
        "closed-on-the-last-line", "closed-then-another", "two-in-labels", "two-in-paths", "path-one-cell",
        "path-one-cell-closed-on-the-last-line", "closed-on-the-last-line-by-a-quoted-path", "path-to-the-end",
        "doubled-quote-inside"])
def test_a_stray_quote_that_joins_rows_into_one_cell_is_refused_naming_where_it_opens(tmp_path, imaging, rows, line, to,
                                                                                     request):
    """csv read the rows after a stray quote into its cell: they vanished (30 rows gave 4 samples, a class named by
    the rest of the file) and the build said "ok"."""
    _images(tmp_path, "abcde", imaging)
    (tmp_path / "list.csv").write_text("\n".join(rows) + ("\n" if "last-line" not in request.node.name else ""))
    closed = "is never closed" if to is None else f"is closed only on line {to}"
    with pytest.raises(SourceError, match=rf"list.csv:{line}: a quote opened on this line {closed}"):
        datapipe.sources.scan(tmp_path / "list.csv")


def test_a_quote_left_open_past_the_field_limit_is_named_by_its_line(tmp_path, imaging):
    """csv's own error named the line where the cell passed 128 KiB ('not a CSV row (field larger than field limit)'),
    thousands of lines after the stray quote."""
    _images(tmp_path, "ab", imaging)
    rows = ["a.jpg,cat", 'b.jpg,"dog'] + [f"x{i:05d}.jpg,eel" for i in range(20000)]
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(SourceError, match=r"list.csv:2: a quote opened on this line is not closed within 131,072 "
                                          r"characters"):
        datapipe.sources.scan(tmp_path / "list.csv")


def test_a_quoted_cell_of_a_file_whose_name_holds_a_line_break_is_a_path(tmp_path, imaging):
    _images(tmp_path, ["a\nb.jpg", "c.jpg"], imaging)
    (tmp_path / "list.csv").write_text('"a\nb.jpg",cat\nc.jpg,dog\n')
    listing = datapipe.sources.scan(tmp_path / "list.csv")
    assert listing.paths == ["a\nb.jpg", "c.jpg"] and listing.classes == ["cat", "dog"]


@pytest.mark.parametrize(("text", "words"), [
    ('"a\nb.jpg",\n', "2: empty label"),  # a cell over lines 2-3: the line it begins on
    ('"{tmp}/x\ny.jpg",cat\n', "2: absolute path"),  # a file that exists, named by its absolute path
    ('"a.jpg",ca\x00t\n', "2: the label holds a NUL character"),
])
def test_a_bad_row_is_named_by_the_line_it_begins_on(tmp_path, text, words):
    (tmp_path / "x\ny.jpg").write_bytes(b"")
    (tmp_path / "a\nb.jpg").write_bytes(b"")
    (tmp_path / "list.csv").write_text("path,label\n" + text.replace("{tmp}", str(tmp_path)))
    with pytest.raises(SourceError, match=f"list.csv:{words}"):
        datapipe.sources.scan(tmp_path / "list.csv")


@pytest.mark.parametrize(("one", "other"), [("cat", "cat\u200b"), ("cat", "\u2060cat"), ("cat", "\ufeffcat"),
                                            ("cat", "c\u00adat"), ("cat", "cat\u200e"), ("cat", "ca\u034ft"),
                                            ("cat", "cat\ufe0f"), ("cat", "\u3164cat"),
                                            ("cafe\u0301", "cafe\u034f\u0301"), ("cafe\u0301", "cafe\u200b\u0301"),
                                            ("caf\u00e9", "cafe\u00ad\u0301")],
                         ids=["zero-width-space", "word-joiner", "byte-order-mark", "soft-hyphen", "direction-mark",
                              "grapheme-joiner", "variation-selector", "hangul-filler", "between-letter-and-accent",
                              "zero-width-space-before-accent", "soft-hyphen-before-accent-nfc-twin"])
def test_labels_that_print_alike_are_refused_whatever_makes_them_differ(tmp_path, imaging, one, other):
    _images(tmp_path, "ab", imaging)
    (tmp_path / "list.csv").write_text(f"a.jpg,{one}\nb.jpg,{other}\n")
    with pytest.raises(SourceError, match=r"list.csv:2: label .* is the label .* of line 1 written another way"):
        datapipe.sources.scan(tmp_path / "list.csv")
    folders = tmp_path / "folders"
    _images(folders, [f"{one}/a.jpg", f"{other}/b.jpg"], imaging)
    with pytest.raises(SourceError, match=r"are one name written two ways"):
        datapipe.sources.scan(folders)


@pytest.mark.parametrize(("one", "other"), [("fish", "\ufb01sh"), ("m2", "m\u00b2"), ("1", "\uff11"),
                                            ("\U0001f469\u200d\U0001f4bb", "\U0001f469\U0001f4bb"),
                                            ("\U0001f3f4\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f",
                                             "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f")],
                         ids=["ligature", "superscript", "full-width", "emoji-joined-or-not", "england-or-scotland"])
def test_labels_that_print_otherwise_are_two_classes_and_the_log_says_when_nfkc_makes_them_one(tmp_path, imaging,
                                                                                             caplog, one, other):
    """Names alike only under NFKC (m2 and m², H2O and H₂O) may well be two classes: they are, and the log says so;
    a zero-width joiner changes how an emoji prints: not a twin at all."""
    _images(tmp_path, "ab", imaging)
    (tmp_path / "list.csv").write_text(f"a.jpg,{one}\nb.jpg,{other}\n")
    with caplog.at_level("WARNING", logger="datapipe"):
        assert len(datapipe.sources.scan(tmp_path / "list.csv").classes) == 2
    warned = [r.getMessage() for r in caplog.records if "compatibility forms" in r.getMessage()]
    assert len(warned) == (0 if "\u200d" in one or "\U0001f3f4" in one else 1), warned


def test_one_label_in_two_unicode_forms_is_refused_not_split_into_two_classes(tmp_path, imaging):
    """'café' as NFC and as NFD print alike and were two classes, the images of one class alternating labels."""
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    _images(tmp_path, "abc", imaging)
    (tmp_path / "list.csv").write_text(f"a.jpg,{nfc}\nb.jpg,dog\nc.jpg,{nfd}\n")
    with pytest.raises(SourceError, match=r"list.csv:3: label 'cafe\\u0301' is the label 'caf\\xe9' of line 1 "
                                          r"written another way \(in another Unicode form"):
        datapipe.sources.scan(tmp_path / "list.csv")
    folders = tmp_path / "folders"
    _images(folders, [f"{nfc}/a.jpg", f"{nfd}/b.jpg"], imaging)
    with pytest.raises(SourceError, match=r"the class folders 'cafe\\u0301' and 'caf\\xe9' are one name written two "
                                          r"ways"):
        datapipe.sources.scan(folders)


@pytest.mark.parametrize("header", ["Photo,PredictionString", "sample,breed", "picture,label"])
def test_a_header_of_another_name_is_refused_not_made_a_class_that_renumbers_the_rest(tmp_path, imaging, header):
    """`ImageId,label` was data: 'label' became a class of no sample (its path quarantined as missing, within the
    budget), and every class after it was numbered one more than the train cache's, the build saying "ok"."""
    _images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"], imaging)
    (tmp_path / "list.csv").write_text(f"{header}\na.jpg,n01\nb.jpg,n02\nc.jpg,n01\n")
    with pytest.raises(SourceError, match=rf"list.csv:1: the first row \({re.escape(repr(header.split(',')))}\) looks like "
                                          r"a header: its path names no file, the next row's does, and no other row has "
                                          r"its label .* name its first cell 'path'"):
        datapipe.sources.scan(tmp_path / "list.csv")
    (tmp_path / "list.csv").write_text("path," + header.split(",")[1] + "\na.jpg,n01\nb.jpg,n02\nc.jpg,n01\n")
    assert datapipe.sources.scan(tmp_path / "list.csv").classes == ["n01", "n02"]


@pytest.mark.parametrize("header", ["id,label", "image_id,label", "ImageId,label", "img_id,class", "image_file,label"])
def test_more_header_names_are_headers(tmp_path, imaging, header):
    _images(tmp_path, ["a.jpg", "b.jpg"], imaging)
    (tmp_path / "list.csv").write_text(f"{header}\na.jpg,cat\nb.jpg,dog\n")
    assert datapipe.sources.scan(tmp_path / "list.csv").classes == ["cat", "dog"]


@pytest.mark.parametrize("first", ["a.jpg,cat", "gone/a.jpg,aardvark", "gone/a.PNG,aardvark"],
                         ids=["label-recurs", "an-image-name", "an-image-name-in-capitals"])
def test_a_first_row_whose_file_is_missing_is_data_when_it_is_no_header(tmp_path, imaging, first):
    """A row naming an image (its label recurring, or its cell an image's name) is data: its file is quarantined by
    the build, which went on ("looks like a header" stopped it)."""
    _images(tmp_path, ["b.jpg", "c.jpg"], imaging)
    (tmp_path / "list.csv").write_text(f"{first}\nb.jpg,cat\nc.jpg,dog\n")
    assert set(datapipe.sources.scan(tmp_path / "list.csv").classes) == {first.split(",")[1], "cat", "dog"}


@pytest.mark.parametrize("label", ["n01440764 102 107 200 180", "n01440764 3 4 90 99 n01440764 1 2 3 4",
                                   "dog 0.1 0.2 0.5 0.5"])
def test_a_label_of_boxes_is_refused_not_made_a_class_per_row(tmp_path, imaging, label):
    """ImageNet's LOC_val_solution.csv ('synset x y x y ...') built "ok" with a class per row."""
    _images(tmp_path, ["a.jpg", "b.jpg"], imaging)
    (tmp_path / "list.csv").write_text(f"a.jpg,{label}\nb.jpg,cat\n")
    with pytest.raises(SourceError, match=r"list.csv:1: the label .* holds numbers after a name: boxes or other targets"):
        datapipe.sources.scan(tmp_path / "list.csv")


def test_labels_with_spaces_and_a_number_stay_names(tmp_path, imaging):
    _images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"], imaging)
    (tmp_path / "list.csv").write_text("a.jpg,golden retriever\nb.jpg,route 66\nc.jpg,type 2 diabetes\n")
    assert datapipe.sources.scan(tmp_path / "list.csv").classes == ["golden retriever", "route 66", "type 2 diabetes"]


@pytest.mark.parametrize("kind", ["csv", "folder"])
def test_one_number_written_two_ways_is_two_classes_and_the_log_says_so(tmp_path, imaging, caplog, kind):
    if kind == "csv":
        _images(tmp_path, ["a.jpg", "b.jpg", "c.jpg"], imaging)
        (tmp_path / "list.csv").write_text("a.jpg,1\nb.jpg,01\nc.jpg,2\n")
        source = tmp_path / "list.csv"
    else:
        _images(tmp_path, ["1/a.jpg", "01/b.jpg", "2/c.jpg"], imaging)
        source = tmp_path
    with caplog.at_level("WARNING", logger="datapipe"):
        listing = datapipe.sources.scan(source)
    assert len(listing.classes) == 3
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "one number written two ways, and so two classes" in warned[0], warned


def test_a_csv_reached_through_a_link_in_another_folder_is_another_source(tmp_path, imaging):
    """Its rows are read beside the link, so it names other files than the CSV it links to: a build of it into
    a cache of that CSV was taken for the same source (and rebuilt the cache from the other files)."""
    a, b = tmp_path / "A", tmp_path / "B"
    _images(a, ["x/1.jpg", "x/2.jpg", "y/3.jpg"], imaging)
    _images(b, ["x/1.jpg"], imaging)
    (a / "list.csv").write_text("x/1.jpg,cat\nx/2.jpg,cat\ny/3.jpg,dog\n")
    (b / "list.csv").symlink_to(a / "list.csv")
    out = tmp_path / "out"
    build(a / "list.csv", out)
    with pytest.raises(ConfigMismatchError, match="another source"):
        build(b / "list.csv", out)
    assert datapipe.open(out).num_samples == 3
    build(a / "list.csv", out)  # the CSV itself, and through a linked folder, is the same source
    (tmp_path / "linked").symlink_to(a)
    build(tmp_path / "linked" / "list.csv", out)
    (a / "current.csv").symlink_to("list.csv")  # a link beside its target reads the same files: the same source
    build(a / "current.csv", out)
