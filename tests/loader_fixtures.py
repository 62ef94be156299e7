"""Index caches shared by the loader tests (each test module wraps these in its own fixture), and the helpers
that read them through a StreamingDataset and check every batch against the cache.

The caches hold :mod:`datapipe.testing` images, whose pixels encode their own index, so every
batch a loader yields can be checked exactly.
"""

from __future__ import annotations

import itertools
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import datapipe
from datapipe.testing import build_index_cache, index_map, index_of

N = 101  # prime: divisible by no batch size or world size used in the tests
SIZE = 32
B = 8  # the loader tests' batch size
_built: dict[tuple, types.SimpleNamespace] = {}


def index_cache_info(factory: pytest.TempPathFactory, n: int = N, *, shard_size: int = 7,
                     size: int = SIZE) -> types.SimpleNamespace:
    """Build (once per session, whichever module asks first) an index cache.

    Returns:
        A namespace with ``path``, ``n``, ``size``, ``shard_size`` and ``ids`` (int64 [n]: the
        pixel-encoded id of each global sample index).
    """
    key = (n, shard_size, size)
    if key not in _built:
        path = build_index_cache(factory.mktemp(f"index-{n}-{shard_size}"), n, shard_size=shard_size, size=size)
        _built[key] = types.SimpleNamespace(path=Path(path), n=n, size=size, shard_size=shard_size,
                                            ids=index_map(path))
    return _built[key]


def concat(batches, column: int) -> np.ndarray:
    """Concatenate one column (0 images, 1 labels, 2 indices) of a list of batches as numpy."""
    parts = [np.asarray(b[column]) for b in batches]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def dataset(info, **kwargs) -> datapipe.StreamingDataset:
    kwargs.setdefault("batch_size", B)
    kwargs.setdefault("seed", 3)
    kwargs.setdefault("return_index", True)
    return datapipe.StreamingDataset(info.path, **kwargs)


def take(ds, num_workers: int, k: int | None = None) -> list:
    """The first ``k`` (default: all) batches of a DataLoader over ``ds``; the iterator is then dropped."""
    it = iter(DataLoader(ds, batch_size=None, num_workers=num_workers))
    try:
        return list(itertools.islice(it, k))  # never asks for batch k + 1
    finally:
        del it


def check_batches(info, batches) -> np.ndarray:
    """Every batch's pixels, labels and indices agree with the cache; returns all indices."""
    cache = datapipe.open(info.path)
    for images, labels, idx in batches:
        assert images.dtype == torch.uint8 and images.shape[1:] == (info.size, info.size, 3)
        assert labels.dtype == torch.int64 and idx.dtype == torch.int64
        idx = idx.numpy()
        assert np.array_equal(index_of(images.numpy()), info.ids[idx])
        assert np.array_equal(labels.numpy(), info.ids[idx] % 3)
        expected = [cache[int(i)] for i in idx]
        assert np.array_equal(images.numpy(), np.stack([img for img, _ in expected]))
        assert labels.tolist() == [lab for _, lab in expected]
    return concat(batches, 2)


def same_stream(a, b) -> bool:
    return len(a) == len(b) and all(all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True))
