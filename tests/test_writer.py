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
