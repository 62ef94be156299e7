"""Index caches shared by the loader tests: each test module wraps these in its own fixture.

The caches hold :mod:`datapipe.testing` images, whose pixels encode their own index, so every
batch a loader yields can be checked exactly.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

from datapipe.testing import build_index_cache, index_map

N = 101  # prime: divisible by no batch size or world size used in the tests
SIZE = 32
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
