"""The shard layout (datapipe.shards): the shard index is the one zarr writes, and a shard's record is
read back checked — a damaged or partial shard is a CacheError or "not whole", never another exception.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from datapipe.errors import CacheError
from datapipe.shards import GROUP_META, images_path, read_shard_metadata, read_shard_record, shard_index, shard_name
from datapipe.writer import ShardWriter


def _shard(tmp_path: Path, n: int = 3, size: int = 4) -> Path:
    final = tmp_path / shard_name(0)
    with ShardWriter(final, size=size) as writer:
        for i in range(n):
            writer.add(np.full((size, size, 3), i, np.uint8), i, f"f{i}.png")
        writer.commit({"shard": 0})
    return final


@pytest.mark.parametrize("n", [1, 3])
def test_shard_index_is_the_tail_zarr_writes(tmp_path, n):
    import zarr
    from zarr.storage import LocalStore

    size = 4
    group = zarr.create_group(store=LocalStore(str(tmp_path / "ref")), zarr_format=3)
    images = group.create_array("images", shape=(n, size, size, 3), dtype="uint8", chunks=(1, size, size, 3),
                                shards=(n, size, size, 3), compressors=None, fill_value=0)
    images[:] = np.arange(1, n + 1, dtype=np.uint8)[:, None, None, None]  # no sample all fill value
    data = images_path(tmp_path / "ref").read_bytes()
    assert data[n * size * size * 3:] == shard_index(n, size)
    assert shard_index(0, size) == b""


def test_a_whole_shard_reads_back_its_record(tmp_path):
    final = _shard(tmp_path)
    record = read_shard_metadata(final)
    assert record["count"] == 3 and record["paths"] == ["f0.png", "f1.png", "f2.png"]
    assert read_shard_record(final) == record


@pytest.mark.parametrize("damage", ["missing", "not json", "no record", "count is a bool", "nbytes a string",
                                    "crc32c a number", "a list"])
def test_a_damaged_group_document_is_a_cache_error(tmp_path, damage):
    final = _shard(tmp_path)
    meta_path = final / GROUP_META
    meta = json.loads(meta_path.read_text())
    record = meta["attributes"]["datapipe"]
    if damage == "missing":
        meta_path.unlink()
    elif damage == "not json":
        meta_path.write_text("{not json")
    else:
        if damage == "no record":
            meta["attributes"] = {}
        elif damage == "count is a bool":
            record["count"] = True
        elif damage == "nbytes a string":
            record["nbytes"] = "12"
        elif damage == "crc32c a number":
            record["crc32c"] = 5
        elif damage == "a list":
            meta = [meta]
        meta_path.write_text(json.dumps(meta))
    with pytest.raises(CacheError, match=str(meta_path)) as info:
        read_shard_metadata(final)
    assert "\n" not in str(info.value) and "datapipe build" in str(info.value)
    assert read_shard_record(final) is None


@pytest.mark.parametrize("damage", ["truncated", "grown", "removed", "a folder"])
def test_a_data_file_of_the_wrong_size_or_kind_is_not_whole(tmp_path, damage):
    final = _shard(tmp_path)
    data = images_path(final)
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:-1])
    elif damage == "grown":
        data.write_bytes(data.read_bytes() + b"\0")
    elif damage == "removed":
        data.unlink()
    else:
        data.unlink()
        data.mkdir()
    assert read_shard_metadata(final)["count"] == 3  # the record itself is fine
    assert read_shard_record(final) is None


def _indexed_shard(tmp_path: Path, n: int = 3) -> Path:
    final = tmp_path / shard_name(1)
    with ShardWriter(final, size=16, layout="indexed", encoding="jpeg") as writer:
        for i in range(n):
            writer.add(np.full((8 + i, 16 - i, 3), 40 * i, np.uint8), i, f"f{i}.png")
        writer.commit({"shard": 1})
    return final


@pytest.mark.parametrize("damage", ["none", "index missing", "index short", "index long", "data short"])
def test_an_indexed_shard_is_whole_only_with_its_index(tmp_path, damage):
    from datapipe.shards import images_path, index_path, shard_layout

    final = _indexed_shard(tmp_path)
    record = read_shard_metadata(final)
    assert shard_layout(record) == "indexed" and re.fullmatch(r"[0-9a-f]{8}", record["index_crc32c"])
    index = index_path(final)
    assert index.stat().st_size == 3 * 32
    if damage == "index missing":
        index.unlink()
    elif damage == "index short":
        index.write_bytes(index.read_bytes()[:-1])
    elif damage == "index long":
        index.write_bytes(index.read_bytes() + b"\0")
    elif damage == "data short":
        data = images_path(final, "indexed")
        data.write_bytes(data.read_bytes()[:-1])
    assert (read_shard_record(final) == record) == (damage == "none")


def test_an_index_crc_of_the_wrong_type_is_a_cache_error(tmp_path):
    final = _indexed_shard(tmp_path)
    meta = json.loads((final / GROUP_META).read_text())
    meta["attributes"]["datapipe"]["index_crc32c"] = 5
    (final / GROUP_META).write_text(json.dumps(meta))
    with pytest.raises(CacheError, match="index_crc32c"):
        read_shard_metadata(final)
