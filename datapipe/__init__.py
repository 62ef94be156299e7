"""datapipe: decode images once on a Dask cluster, then stream them to the GPU at memory speed.

``import datapipe`` imports nothing heavy: torch, dask and zarr load when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "build": ("datapipe.builder", "build"),
    "BuildReport": ("datapipe.builder", "BuildReport"),
    "BuildSpec": ("datapipe.builder", "BuildSpec"),
    "Cluster": ("datapipe.builder", "Cluster"),
    "open": ("datapipe.fetch", "open_cache"),
    "Cache": ("datapipe.cache", "Cache"),
    "StreamingDataset": ("datapipe.dataset", "StreamingDataset"),
    "DeviceLoader": ("datapipe.device", "DeviceLoader"),
    "augment": ("datapipe.augment", None),
    "bench": ("datapipe.bench", None),
    "make_sample_dataset": ("datapipe.bench.sample", "make_sample_dataset"),
    "DatapipeError": ("datapipe.errors", "DatapipeError"),
    "errors": ("datapipe.errors", None),  # datapipe.errors.RankMismatchError ... right after `import datapipe`
}

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover
    from . import augment, bench, errors
    from .bench.sample import make_sample_dataset
    from .builder import BuildReport, BuildSpec, Cluster, build
    from .cache import Cache
    from .dataset import StreamingDataset
    from .device import DeviceLoader
    from .errors import DatapipeError
    from .fetch import open_cache as open


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'datapipe' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    return mod if attr is None else getattr(mod, attr)
