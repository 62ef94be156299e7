"""The build's output and configuration: another configuration refused, then forced; the default shard
size; outputs that cannot be written or hold someone else's files; invalid arguments.
"""

from __future__ import annotations

import pytest
from build_fixtures import (
    build,
    check_cache_matches_source,
)

import datapipe
from datapipe.codecs import DecodeSpec
from datapipe.errors import (
    ConfigMismatchError,
    OutputError,
)

# ----------------------------------------------------------------------------- configuration and output


def test_other_config_refused_then_forced(built_copy, source):
    before = (built_copy / "manifest.json").read_bytes()
    with pytest.raises(ConfigMismatchError, match=r"size: 32 -> 40"):
        build(source[0], built_copy, size=40)
    assert (built_copy / "manifest.json").read_bytes() == before  # nothing touched
    assert len(datapipe.open(built_copy)) == len(source[1])
    with pytest.raises(ConfigMismatchError, match="fit"):
        build(source[0], built_copy, fit="pad")
    report = build(source[0], built_copy, size=40, force=True)
    assert report.status == "ok" and report.shards_built == report.shards_total
    cache = datapipe.open(built_copy)
    assert cache.manifest.size == 40
    assert cache[0][0].shape == (40, 40, 3)
    check_cache_matches_source(built_copy, source[0], source[1], DecodeSpec(size=40))
    assert cache.verify() == []


def test_default_shard_size_makes_shards_of_about_100_mb(tmp_path, imaging):
    from datapipe.builder import default_shard_size

    for size in (64, 224, 256, 512):
        assert 50e6 <= default_shard_size(size) * size * size * 3 <= 200e6, size
    root = tmp_path / "src"
    imaging.write_source(root, {"a": 3, "b": 3}, variety=False)
    report = datapipe.build(root, tmp_path / "out", size=256, cluster=datapipe.Cluster(scheduler="sync"), progress=False)
    assert report.config["shard_size"] == default_shard_size(256) and report.shards_total == 1


def test_output_under_a_regular_file(source, tmp_path):
    blocker = tmp_path / "file.txt"
    blocker.write_text("keep me")
    with pytest.raises(OutputError, match="cannot create output folder"):
        build(source[0], blocker / "cache")
    with pytest.raises(OutputError):
        build(source[0], blocker)
    assert blocker.read_text() == "keep me"


def test_non_empty_foreign_output_refused(source, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    (out / "shards").mkdir()
    (out / "shards" / "000000.zarr").mkdir()
    with pytest.raises(OutputError, match="not empty and is not a datapipe cache"):
        build(source[0], out)
    with pytest.raises(OutputError, match="not empty and is not a datapipe cache"):
        build(source[0], out, force=True)  # force never deletes what datapipe did not write
    assert (out / "thesis.tex").read_text() == "precious"
    assert sorted(p.name for p in out.rglob("*")) == ["000000.zarr", "shards", "thesis.tex"]


def test_output_inside_the_source(tmp_path, imaging):
    root = tmp_path / "src"
    imaging.write_source(root, {"b": 2, "d": 2}, variety=False)
    first = build(root, root / "c-cache")  # sorts between the two classes
    assert datapipe.open(root / "c-cache").classes == ["b", "d"]
    manifest = (root / "c-cache" / "manifest.json").read_bytes()
    again = build(root, root / "c-cache")
    assert again.shards_built == 0 and first.num_samples == again.num_samples == 4
    assert (root / "c-cache" / "manifest.json").read_bytes() == manifest


def test_invalid_arguments(source, tmp_path):
    with pytest.raises(ValueError, match="--fit"):
        build(source[0], tmp_path / "a", fit="zoom")
    with pytest.raises(ValueError, match="--size"):
        build(source[0], tmp_path / "b", size=2)
    with pytest.raises(ValueError, match="--shard-size"):
        build(source[0], tmp_path / "c", shard_size=-1)


def test_a_killed_runs_temporary_files_are_removed_and_a_users_look_alikes_kept(built_copy, source):
    """A run killed mid-write leaves files and folders under datapipe's temporary names (the manifest or
    report being written, the labels, a shard's folder); the next build removes exactly those, and keeps
    a user's entries that only start the same way."""
    import shutil

    shards = built_copy / "shards"
    ours = [built_copy / ".tmp-manifest.json.1a2b3c4d", built_copy / ".tmp-report.json.0f0f0f0f",
            built_copy / ".tmp-labels.npy", built_copy / ".tmp-labels.npy.5e5e5e5e", shards / ".tmp-000001-deadbeef",
            shards / ".tmp-stale-000001.zarr-4242"]
    theirs = [built_copy / ".tmp-notes.txt", built_copy / ".tmp-manifest.json.backup", shards / ".tmp-mine",
              shards / ".tmp-000001-not-hex"]
    name = sorted(p.name for p in shards.iterdir() if p.name.endswith(".zarr"))[0]
    for path in ours + theirs:
        if path.parent == shards:
            shutil.copytree(shards / name, path)  # a whole shard's folder
        else:
            path.write_bytes(b"" if "manifest" in path.name else b"x" * 100)
    report = build(source[0], built_copy)
    assert report.status == "ok" and report.shards_built == 0
    assert [p for p in ours if p.exists()] == []
    assert all(p.exists() for p in theirs)
    assert (shards / ".tmp-mine" / "zarr.json").is_file()


def test_an_output_error_is_not_wrapped_in_another(tmp_path, source, monkeypatch):
    """An error prepare() raises itself (an OutputError names its cause) reaches the caller as it is, not as
    'cannot write to output folder ...: <that error>'."""
    from datapipe import output

    def refuse(*args, **kwargs):
        raise OutputError(f"{tmp_path / 'out' / 'manifest.json'} was not written by the build; move it away and rerun")

    monkeypatch.setattr(output, "_claim", refuse)
    with pytest.raises(OutputError) as err:
        build(source[0], tmp_path / "out")
    assert str(err.value).startswith(str(tmp_path / "out" / "manifest.json")), err.value
    assert "cannot write to output folder" not in str(err.value)
