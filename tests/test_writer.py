"""The shard writer (datapipe.writer): metadata exactly as zarr writes it, flushes synced in the
background while decoding goes on, a failed sync keeps nothing half done.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

# ----------------------------------------------------------------------------- the shard writer


def _write_shard(final: Path, n: int, size: int = 8) -> tuple[dict, list[np.ndarray]]:
    from datapipe.writer import ShardWriter

    rng = np.random.default_rng(n)
    images = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]
    with ShardWriter(final, size=size) as writer:
        for i, img in enumerate(images):
            writer.add(img, i % 4, f"f{i}.jpg")
        record = writer.commit({"shard": 0})
    return record, images


@pytest.mark.parametrize("n", [0, 1, 5])
def test_shard_metadata_is_what_zarr_itself_writes(tmp_path, n):
    import zarr
    from zarr.storage import LocalStore

    final = tmp_path / "shards" / "000000.zarr"
    final.parent.mkdir()
    _write_shard(final, n)
    ref = tmp_path / "reference"
    group = zarr.create_group(store=LocalStore(str(ref)), zarr_format=3)
    group.create_array("images", shape=(n, 8, 8, 3), dtype="uint8", chunks=(1, 8, 8, 3),
                       shards=(max(n, 1), 8, 8, 3), compressors=None, fill_value=0, write_data=False)
    labels = group.create_array("labels", shape=(n,), dtype="int64", chunks=(max(n, 1),), compressors=None,
                                fill_value=-1)
    if n:
        labels[:] = np.arange(n) % 4
    for key in ("images/zarr.json", "labels/zarr.json", "labels/c/0"):
        assert (final / key).exists() == (ref / key).exists(), key
        if (ref / key).exists():
            assert (final / key).read_bytes() == (ref / key).read_bytes(), key
    ours = json.loads((final / "zarr.json").read_text())
    assert ours.pop("attributes")["datapipe"]["count"] == n
    assert ours == {k: v for k, v in json.loads((ref / "zarr.json").read_text()).items() if k != "attributes"}


def test_large_shard_is_synced_in_background_steps(tmp_path, monkeypatch):
    import datapipe.writer as writer

    started: list[int] = []  # bytes written when a background sync was started
    synced: list[int] = []
    real, start = os.fdatasync, writer.ShardWriter._sync_in_background
    monkeypatch.setattr(writer, "SYNC_EVERY_BYTES", 3 * 8 * 8 * 3)
    monkeypatch.setattr(writer.ShardWriter, "_sync_in_background", lambda w: (started.append(w._file.tell()), start(w)))
    monkeypatch.setattr(writer.os, "fdatasync", lambda fd: (synced.append(fd), real(fd)))
    final = tmp_path / "000000.zarr"
    record, images = _write_shard(final, 10)
    # Started after whole samples, mid-shard; the sync itself runs whenever its thread gets the CPU.
    assert started and all(size % (8 * 8 * 3) == 0 for size in started), started
    assert min(started) < 10 * 8 * 8 * 3 and synced
    data = (final / "images" / "c" / "0" / "0" / "0" / "0").read_bytes()
    assert data[: 10 * 192] == b"".join(img.tobytes() for img in images) and record["count"] == 10


def test_failed_background_sync_fails_the_shard_and_keeps_nothing_half_done(tmp_path, monkeypatch):
    import datapipe.writer as writer

    def broken(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(writer, "SYNC_EVERY_BYTES", 192)
    monkeypatch.setattr(writer.os, "fdatasync", broken)
    final = tmp_path / "000000.zarr"
    with pytest.raises(OSError, match="Input/output error"):
        _write_shard(final, 4)
    assert not final.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("layout,encoding", [("fixed", "raw"), ("indexed", "raw"), ("indexed", "jpeg")])
def test_a_shard_staged_for_a_store_is_never_flushed_to_disk_and_holds_the_same_bytes(tmp_path, monkeypatch, layout,
                                                                                      encoding, synced_paths):
    """durable=False (a shard staged on its way to an object store, whose copy is the durable one): no fsync or
    fdatasync of its files or folders, not even in background steps; the files are those a durable writer
    writes, which syncs its data, its zarr.json and its folders."""
    import datapipe.writer as writer
    from datapipe.shards import images_path

    monkeypatch.setattr(writer, "SYNC_EVERY_BYTES", 3 * 8 * 8 * 3)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(12)]
    synced = synced_paths
    trees = {}
    for durable in (True, False):
        final = tmp_path / str(durable) / "000000.zarr"
        final.parent.mkdir()
        synced.clear()
        with writer.ShardWriter(final, size=8, layout=layout, encoding=encoding, durable=durable) as w:
            for i, img in enumerate(images):
                w.add(img, i % 4, f"f{i}.jpg")
            w.commit({"shard": 0})
        trees[durable] = {p.relative_to(final).as_posix(): p.read_bytes() for p in sorted(final.rglob("*")) if p.is_file()}
        if durable:  # the data file (in background steps, then whole), zarr.json, the shard's folder and its parent
            data = images_path(Path("x"), layout).relative_to("x").as_posix()
            assert sum(p.endswith(data) for p in synced) >= 2, synced
            assert any("zarr.json" in Path(p).name for p in synced) and str(final.parent) in synced, synced
        else:
            assert synced == []
    assert trees[True] == trees[False] and len(trees[True]) >= 4


# ----------------------------------------------------------------------------- the indexed layout


@pytest.mark.parametrize("n", [0, 1, 5])
@pytest.mark.parametrize("encoding", ["raw", "jpeg"])
def test_indexed_shard_is_what_zarr_itself_writes(tmp_path, n, encoding):
    """An indexed shard's documents, data file and sample index are the bytes zarr-python writes for
    the same arrays: images uint8 [total] (64 KiB inner chunks, one shard), index int64 [n, 4]."""
    import zarr
    from zarr.storage import LocalStore

    from datapipe import samples
    from datapipe.files import crc32c
    from datapipe.records import indexed_file_size
    from datapipe.writer import ShardWriter

    rng = np.random.default_rng(n)
    images = [rng.integers(1, 256, (int(rng.integers(20, 90)), int(rng.integers(20, 90)), 3), dtype=np.uint8)
              for _ in range(n)]
    final = tmp_path / "000000.zarr"
    with ShardWriter(final, size=90, layout="indexed", encoding=encoding, quality=80) as writer:
        for i, img in enumerate(images):
            writer.add(img, i % 4, f"f{i}.jpg")
        record = writer.commit({"shard": 0})
    stored = [img.tobytes() if encoding == "raw" else bytes(samples.encode(img, "jpeg", 80)) for img in images]
    blob = b"".join(stored)
    rows = np.array([[sum(map(len, stored[:i])), len(stored[i]), *images[i].shape[:2]] for i in range(n)],
                    np.int64).reshape(n, 4)
    ref = tmp_path / "reference"
    group = zarr.create_group(store=LocalStore(str(ref)), zarr_format=3)
    padded = max(-(-len(blob) // 65536), 1) * 65536
    data = group.create_array("images", shape=(len(blob),), dtype="uint8", chunks=(65536,), shards=(padded,),
                              compressors=None, fill_value=0)
    index = group.create_array("index", shape=(n, 4), dtype="int64", chunks=(max(n, 1), 4), compressors=None,
                               fill_value=0)
    labels = group.create_array("labels", shape=(n,), dtype="int64", chunks=(max(n, 1),), compressors=None,
                                fill_value=-1)
    if n:
        data[:] = np.frombuffer(blob, np.uint8)
        index[:] = rows
        labels[:] = np.arange(n) % 4
    for key in ("images/zarr.json", "images/c/0", "index/zarr.json", "index/c/0/0", "labels/zarr.json", "labels/c/0"):
        assert (final / key).exists() == (ref / key).exists(), key
        if (ref / key).exists():
            assert (final / key).read_bytes() == (ref / key).read_bytes(), key
    assert record["nbytes"] == indexed_file_size(len(blob)) == ((final / "images/c/0").stat().st_size if n else 0)
    assert record["index_crc32c"] == f"{crc32c(rows.astype('<i8').tobytes()):08x}"
    back = zarr.open_group(str(final), mode="r")
    for i in range(n):
        off, nbytes = int(rows[i, 0]), int(rows[i, 1])
        assert back["images"][off:off + nbytes].tobytes() == stored[i]


def test_indexed_writer_refuses_what_its_layout_cannot_hold(tmp_path):
    from datapipe.writer import ShardWriter

    with pytest.raises(ValueError, match="no shard layout"):
        ShardWriter(tmp_path / "a.zarr", size=8, layout="fixed", encoding="jpeg")
    with ShardWriter(tmp_path / "b.zarr", size=8, layout="indexed") as writer:
        with pytest.raises(ValueError, match="sides from 1 to 8"):
            writer.add(np.zeros((4, 9, 3), np.uint8), 0, "wide.png")
        with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
            writer.add(np.zeros((4, 4), np.uint8), 0, "gray.png")
    assert not (tmp_path / "b.zarr").exists()
