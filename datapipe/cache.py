"""Random access to a finished cache: ``datapipe.open(path)`` and the batch reader under the loader.

Opening reads the manifest and checks every shard file's size (O(number of shards), no sample is
touched). Samples are read from memory-mapped shard files: a batch is one sorted gather per shard
it touches, straight into the caller's buffer.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from . import manifest as mf
from .errors import CacheError, CorruptShardError
from .storage import SHARDS_DIR, expected_file_size, file_crc32c, images_path, open_images


_OPEN_LOCK = threading.Lock()


class Cache:
    """A finished cache, opened read-only.

    ``len(cache)`` samples; ``cache[i]`` is ``(image, label)`` with image a uint8 H×W×3 RGB array;
    ``cache.path(i)`` the source file of sample i relative to the source root; ``cache.classes``
    the class names. The object pickles small (path and manifest only; memory maps are reopened).
    """

    def __init__(self, path: str | Path, *, check_sizes: bool = True) -> None:
        self.root = Path(path).expanduser().absolute()
        self.manifest = mf.read_manifest(self.root)
        shards = self.manifest["shards"]
        self.size = int(self.manifest["config"]["size"])
        self.shape = tuple(self.manifest["sample"]["shape"])
        self.classes: list[str] = list(self.manifest["classes"])
        self.shard_names = [s["name"] for s in shards]
        self.counts = np.array([s["count"] for s in shards], np.int64)
        self.starts = np.array([s["first"] for s in shards], np.int64)
        self.num_samples = int(self.manifest["num_samples"])
        if int(self.counts.sum()) != self.num_samples:
            raise CacheError(f"{self.root / mf.MANIFEST}: shard counts add up to {int(self.counts.sum())}, "
                             f"num_samples says {self.num_samples}; rebuild the cache")
        if check_sizes:
            self.check_sizes()
        self._maps: dict[int, np.ndarray] = {}
        self._views: dict[int, object] = {}  # shard -> torch uint8 [count, H, W, 3] over the same file
        self._labels: np.ndarray | None = None
        self._paths: list[str] | None = None

    # -- pickling: only the small description travels to DataLoader workers
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_maps={}, _views={}, _labels=None, _paths=None)
        return state

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"Cache({str(self.root)!r}, samples={self.num_samples:,}, shards={len(self.counts)}, "
                f"shape={self.shape}, classes={len(self.classes)})")

    @property
    def labels(self) -> np.ndarray:
        """All labels, int64 [num_samples] (memory-mapped)."""
        if self._labels is None:
            with _OPEN_LOCK:  # np.load parses the header with ast, which is not thread-safe on 3.11
                labels = self._labels if self._labels is not None else np.load(self.root / mf.LABELS, mmap_mode="r")
            if labels.shape != (self.num_samples,):
                raise CorruptShardError(f"{self.root / mf.LABELS} holds {labels.shape} labels, the manifest "
                                        f"says {self.num_samples}; rebuild the cache")
            self._labels = labels
        return self._labels

    def path(self, index: int) -> str:
        """The source file of sample ``index``, relative to the source root."""
        if self._paths is None:
            self._paths = json.loads((self.root / mf.PATHS).read_text(encoding="utf-8"))
        return self._paths[self._check_index(index)]

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        index = self._check_index(index)
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        return np.array(self.images(shard)[index - self.starts[shard]]), int(self.labels[index])

    def _check_index(self, index: int) -> int:
        i = int(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample index {index} out of range for a cache of {self.num_samples} samples")
        return i

    def images(self, shard: int) -> np.ndarray:
        """Shard ``shard``'s samples as a read-only memory map, uint8 [count, H, W, 3]."""
        mm = self._maps.get(shard)
        if mm is None:
            mm = open_images(self.root / SHARDS_DIR / self.shard_names[shard], int(self.counts[shard]),
                             self.size, name=self.shard_names[shard])
            self._maps[shard] = mm
        return mm

    def read_batch(self, indices: np.ndarray, out: np.ndarray, labels_out: np.ndarray,
                   index_out: np.ndarray | None = None) -> int:
        """Gather samples ``indices`` into ``out`` [>=n, H, W, 3], sorted by index; returns n.

        ``mode="clip"`` is safe (indices come from the partition) and keeps numpy from buffering
        ``out`` through a temporary, which would double the copy.

        One ``np.take`` per shard touched, each reading its rows in file order. ``labels_out`` (and
        ``index_out``) receive the labels (and global indices) in the same order.
        """
        idx, shard_of = self._locate(indices, labels_out, index_out)
        n = idx.shape[0]
        if n == 0:
            return 0
        cuts = np.flatnonzero(np.diff(shard_of)) + 1  # boundaries between shards
        for a, b in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [n]])):
            s = int(shard_of[a])
            np.take(self.images(s), idx[a:b] - self.starts[s], axis=0, out=out[a:b], mode="clip")
        return n

    def _locate(self, indices, labels_out: np.ndarray, index_out: np.ndarray | None):
        """Sorted indices [n] and the shard of each; their labels (and the indices) written out."""
        idx = np.sort(np.asarray(indices, np.int64))  # [n]
        np.take(self.labels, idx, out=labels_out[: idx.shape[0]], mode="clip")
        if index_out is not None:
            index_out[: idx.shape[0]] = idx
        return idx, np.searchsorted(self.starts, idx, side="right") - 1

    def sample_views(self, indices: np.ndarray, labels_out: np.ndarray,
                     index_out: np.ndarray | None = None) -> list:
        """Samples ``indices`` as uint8 [H, W, 3] torch views into the shard files, sorted by index.

        Nothing is copied: a consumer that reads only part of each sample (a random crop) reads
        straight from the page cache, which is what the CPU loader does instead of gathering the
        whole batch first. Labels (and indices) land in ``labels_out`` in the same order, as with
        :meth:`read_batch`. The views are for reading: the maps are private, so even a write would
        never reach the file.
        """
        idx, shard_of = self._locate(indices, labels_out, index_out)
        views = []
        for s, i in zip(shard_of.tolist(), (idx - self.starts[shard_of]).tolist()):
            t = self._views.get(s)
            if t is None:
                t = self._open_view(s)
            views.append(t[i])
        return views

    def _open_view(self, shard: int):
        import torch

        mm = self.images(shard)  # checks the file's size against the manifest
        if mm.shape[0] == 0:
            t = torch.from_numpy(np.empty(mm.shape, np.uint8))
        else:  # copy-on-write map: writable for torch, never written back
            t = torch.from_numpy(np.memmap(mm.filename, dtype=np.uint8, mode="c", shape=mm.shape))
        self._views[shard] = t
        return t

    def check_sizes(self) -> None:
        """Raise CorruptShardError naming the first shard whose file size differs from the manifest."""
        for name, count, rec in zip(self.shard_names, self.counts, self.manifest["shards"]):
            path = images_path(self.root / SHARDS_DIR / name)
            expected = expected_file_size(int(count), self.size)
            if count == 0 and rec["nbytes"] == 0:
                continue  # every file of this shard was quarantined: there is no data file
            actual = path.stat().st_size if path.exists() else -1
            if actual != expected or rec["nbytes"] != expected:
                what = "missing" if actual < 0 else f"{actual:,} bytes, expected {expected:,}"
                raise CorruptShardError(
                    f"shard {name} ({path}) is {what}: truncated or altered after the build. "
                    "Rerun the same `datapipe build` to rewrite damaged shards, or `datapipe verify` "
                    "to check every checksum.")

    def verify(self, *, progress: bool = False) -> list[str]:
        """Check every shard's and index file's crc32c against the manifest; return the problems."""
        from tqdm import tqdm

        problems = []
        for rec in tqdm(self.manifest["shards"], desc="verify", unit="shard", disable=not progress):
            path = images_path(self.root / SHARDS_DIR / rec["name"])
            if rec["count"] == 0:
                continue
            if not path.exists():
                problems.append(f"shard {rec['name']}: {path} is missing")
                continue
            crc = file_crc32c(path)
            if crc != rec["crc32c"]:
                problems.append(f"shard {rec['name']}: checksum {crc} != manifest {rec['crc32c']} ({path}); "
                                "`datapipe build SOURCE OUTPUT --verify` rewrites it")
        for key, info in self.manifest["files"].items():
            path = self.root / info["name"]
            if not path.exists() or file_crc32c(path) != info["crc32c"]:
                problems.append(f"{key} file {path} is missing or its checksum differs from the manifest")
        return problems


def open(path: str | Path) -> Cache:  # noqa: A001 - the public name is datapipe.open
    """Open a finished cache for random access (see :class:`Cache`)."""
    return Cache(path)
