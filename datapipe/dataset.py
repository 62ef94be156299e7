"""The streaming dataset: whole uint8 batches from memory-mapped shards, exactly once per epoch.

``StreamingDataset`` is a ``torch.utils.data.IterableDataset`` that yields whole batches
(``batch_size=None`` in a DataLoader). Its order is a pure function of (seed, epoch, position)
— see :mod:`datapipe.partition` — split over ranks × workers together, so every rank yields the
same number of batches and the stream is identical for any number of DataLoader workers.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from os import PathLike  # not os.PathLike: tests replace this module's os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import numpy as np
import torch
from torch.utils.data import IterableDataset

from . import partition as part
from .cache import Cache
from .errors import (
    ArgumentError,
    ClassListWarning,
    DatapipeError,
    RankMismatchError,
    RepeatedEpochWarning,
    ResumeWarning,
    StateError,
    check_bool,
    env_seconds,
)
from .fetch import is_url, open_cache
from .remote import local_path
from .text import printable, show
from .world import (
    MAX_WORLD_SIZE,
    World,
    all_announced,
    announce,
    detect_ranks,
    detect_worker,
    distributed_ranks,
    first_published,
    forget,
)

if TYPE_CHECKING:  # pragma: no cover
    from torch.utils.data._utils.worker import WorkerInfo

# Version 2 names the build of the cache a state belongs to (build_id); version 1 did not. Version 3 adds a digest
# of what that build holds (contents): a cache rebuilt in place from changed inputs keeps its build id.
STATE_VERSION = 3
STATE_KEYS = ("version", "epoch", "position", "seed", "shuffle", "num_samples", "config_hash", "build_id", "contents")
# A state of order="shards" also holds these (a state without them is of the global order).
SHARD_STATE_KEYS = ("order", "window", "nodes")
# The state a DataLoader worker saves (torchdata's StatefulDataLoader asks each worker for its own) also holds
# "worker": {these}: which worker of how many, the batches of its share it has yielded since the iteration
# began at "position", and the batch layout those batches count in.
WORKER_STATE_KEYS = ("id", "num_workers", "batches", "batch_size", "world_size", "drop_last")
# partition.epoch_order (and the augmentation seeds) keep the low 32 bits of the seed and the epoch:
# seeds or epochs 2**32 apart give the same order, so only [0, 2**32) is accepted.
ORDER_LIMIT = 2**32
MAX_BATCH_SIZE = 2**42  # a batch per rank (more than any cache holds); × MAX_WORLD_SIZE, a step within int64
# Each process numbers the datasets it splits over ranks in the order it creates them: the n-th on every rank
# is one dataset, whose cache, settings and positions the ranks compare (see StreamingDataset._agree). Every
# rank must create the same split datasets in the same order (one made on some ranks only, an evaluation of
# rank 0's own, is read whole with rank=0, world_size=1, and not split).
_SPLIT_DATASETS = itertools.count(1)
# Position keys a dataset keeps in the process group's store; older ones are removed (two per epoch).
_KEPT_KEYS = 8
# The epochs whose "this rank began reading it" key a rank keeps in the store: a rank that ends an epoch looks for
# every rank's key of that epoch (see StreamingDataset._check_every_rank_began), and one far ahead keeps it for it.
_KEPT_BEGUN = 32
# How long a rank that read a whole epoch of a split dataset waits for every other rank to have begun it (seconds).
RANK_TIMEOUT = 60.0


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """A real integer: Python's or numpy's, never a bool, a float or a string."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_int(value: object, what: str, lo: int, hi: int | None = None, *, error: type[DatapipeError] = ArgumentError) -> int:
    """``value`` as an int in ``[lo, hi]`` (``hi`` inclusive, None: no upper bound), else ``error`` naming ``what``."""
    if not is_int(value):
        raise error(f"{what} must be an integer, got {show(value)} ({type(value).__name__})")
    v = int(value)
    if v < lo or (hi is not None and v > hi):
        bound = f"{lo} <= {what.split()[-1]} <= {hi}" if hi is not None else f">= {lo}"
        raise error(f"{what} must be {bound}, got {v if abs(v) < 10**30 else show(v)}")
    return v


def cache_identity(cache: Cache) -> tuple[str, str]:
    """(build_id, config_hash): which build of which configuration a cache holds.

    A saved loader state carries both, so that it resumes only the build it was saved from: two
    caches of the same size and configuration (another source, a rebuild) differ in their build
    id. A cache written before build ids gets a digest of its checksums instead.
    """
    m = cache.manifest
    build_id = cache.build_id
    if not build_id:
        blob = json.dumps([[s.crc32c for s in m.shards], {k: f.crc32c for k, f in sorted(m.files.items())}])
        build_id = "crc32c-" + hashlib.sha256(blob.encode()).hexdigest()[:16]
    return build_id, m.config_hash


def cache_contents(cache: Cache) -> str:
    """A digest of what a cache holds: its classes, the checksum of its labels file and each shard's name, sample
    count and checksum (of its data file, which changes with the shard's sample index). A cache rebuilt in place
    keeps its build id (the build id says which output a shard belongs to) but holds other samples or labels
    when its inputs changed: this digest changes with them. Byte-identical rebuilds keep it; the source paths
    (paths.json) are left out, so that a source moved and built again into the same samples is the same cache."""
    m = cache.manifest
    blob = json.dumps([list(m.classes), {k: f.crc32c for k, f in sorted(m.files.items()) if k != "paths"},
                       [[s.name, s.count, s.crc32c] for s in m.shards]])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _check_shm(batch_bytes: int, worker_info: WorkerInfo | None, path: str = "/dev/shm") -> None:
    """Fail fast, with the fix named, when shared memory cannot hold the batches in flight.

    Worker processes hand batches over through /dev/shm; Docker's default of 64 MB holds less than
    two 256×256 batches of 256, and running out surfaces as a bus error deep in the DataLoader.
    """
    try:
        st = os.statvfs(path)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    # each worker's prefetched batches (the DataLoader's default prefetch_factor, 2), and the two the loop holds
    in_flight = batch_bytes * (2 * (worker_info.num_workers if worker_info else 1) + 2)
    if free < in_flight:
        raise _shm_error(f"{path} has {_mb(free)} free, but DataLoader workers need about {_mb(in_flight)} of "
                         f"shared memory for the batches in flight ({_mb(batch_bytes)} each)")


def _mb(nbytes: float) -> str:
    """A size for a message, to three significant figures at least (2.40 MB, 310 KB, 1,234 MB)."""
    value, unit = (nbytes / 2**10, "KB") if nbytes < 2**20 else (nbytes / 2**20, "MB")
    decimals = 2 if value < 10 else 1 if value < 100 else 0
    return f"{value:,.{decimals}f} {unit}"


def _shm_error(what: str) -> DatapipeError:
    return DatapipeError(
        f"{what}. Start the container with a larger --shm-size (e.g. docker run --shm-size=8g), use "
        "datapipe.DeviceLoader (threads, no shared memory), or use fewer workers, a smaller prefetch_factor or a "
        "smaller batch.")


def _share(tensors: Iterable[torch.Tensor], batch_bytes: int, path: str = "/dev/shm") -> None:
    """Move a worker's batch into shared memory (the DataLoader then sends handles, not copies); running out
    there (more batches in flight than the check at the start foresaw: a larger prefetch_factor, other
    processes' use) is the --shm-size error, not torch's."""
    try:
        for t in tensors:
            t.share_memory_()
    except RuntimeError as exc:
        if "shared memory" not in str(exc) and "No space left" not in str(exc):
            raise
        raise _shm_error(f"{path} ran out of shared memory for the batches in flight ({_mb(batch_bytes)} each): "
                         f"{exc}") from None


def _launched_world(given: int | None, world_size: int) -> bool:
    """Whether torchrun's LOCAL_WORLD_SIZE describes ``world_size``: unless it was given explicitly and differs
    from the world the job was launched with (torch.distributed's, or WORLD_SIZE): an evaluation dataset on
    rank 0 alone (``world_size=1``) is one node."""
    ranks = distributed_ranks()
    launched = ranks[1] if ranks is not None else os.environ.get("WORLD_SIZE", "").strip()
    return given is None or launched in ("", world_size, str(world_size))


# The caches of this process's live datasets (a dataset dropped is forgotten): their class lists are compared
_LIVE_CACHES: weakref.WeakSet[Cache] = weakref.WeakSet()
_WARNED_PAIRS: set[tuple[str, str]] = set()


def _check_class_lists(cache: Cache) -> None:
    """Warn (ClassListWarning, once per pair) when this cache's class list lies within the class list of a
    cache another live dataset of this process reads, or holds it, at other labels: a validation set built
    without --classes-from that lacks a class shifts every label after it, silently (the model trained on
    the other set is then scored against wrong labels). Disjoint or equal lists are fine."""
    root, mine = str(cache.root), tuple(cache.classes)
    for other_cache in list(_LIVE_CACHES):
        other, theirs = str(other_cache.root), tuple(other_cache.classes)
        if other == root or theirs == mine or (root, other) in _WARNED_PAIRS:
            continue
        (small, small_root), (big, big_root) = sorted(((mine, root), (theirs, other)), key=lambda x: len(x[0]))
        label = {name: i for i, name in enumerate(big)}
        if not small or any(name not in label for name in small):
            continue  # not one class list within the other: unrelated datasets
        moved = [(name, i, label[name]) for i, name in enumerate(small) if label[name] != i]
        if not moved:
            continue  # the same labels, the larger list's classes added after them
        _WARNED_PAIRS.update({(root, other), (other, root)})
        name, i, j = moved[0]
        warnings.warn(ClassListWarning(
            f"datapipe: the caches '{printable(small_root)}' and '{printable(big_root)}' label their classes otherwise: class "
            f"{show(name)} is label {i} in the first and {j} in the second ({len(moved)} of its {len(small)} classes "
            f"differ); if one is the other's validation set, its labels are wrong for a model trained on the other: "
            f"build it with --classes-from {printable(big_root)}"), stacklevel=3)
    _LIVE_CACHES.add(cache)


def check_order(order: str | None, window: object, nodes: object, world_size: int, *,
                ranks_per_node: bool = True) -> tuple[str, int, int]:
    """(order, window, nodes), checked; order None is the local-cache default, nodes None is detected.

    Nodes come from torchrun's LOCAL_WORLD_SIZE (ranks per node) when ``ranks_per_node`` (the world size is the
    launched one); they matter to "shards" only, so a global order ignores the environment.
    """
    order = part.default_order(is_remote=False) if order is None else order
    if order not in part.ORDERS:
        raise ArgumentError(f"order must be one of {', '.join(map(repr, part.ORDERS))}, got {show(order)}")
    window = check_int(window, "window", 1)
    if nodes is not None:
        nodes = check_int(nodes, "nodes", 1)
    elif order == "shards" and ranks_per_node and os.environ.get("LOCAL_WORLD_SIZE"):
        local = os.environ["LOCAL_WORLD_SIZE"]
        if not local.strip().isdigit() or int(local) < 1:
            raise ArgumentError(f"LOCAL_WORLD_SIZE must be a positive integer, got {show(local)}; unset it or pass nodes=")
        if world_size % int(local):
            raise ArgumentError(f"world_size={world_size} is not a multiple of LOCAL_WORLD_SIZE={int(local)} (the ranks "
                                "per node); pass nodes= or fix LOCAL_WORLD_SIZE")
        nodes = world_size // int(local)
    else:
        nodes = 1
    if world_size % nodes:
        raise ArgumentError(f"world_size={world_size} is not a multiple of nodes={nodes} (ranks per node must be equal); "
                            "pass nodes= or fix LOCAL_WORLD_SIZE")
    return order, window, nodes


# Every dataset of this process: one that it received takes a state of its own before the process forks (its
# forked DataLoader workers must share that one, not the state of the process it came from; see _shared).
_DATASETS: weakref.WeakSet[StreamingDataset] = weakref.WeakSet()


def _own_states() -> None:
    for dataset in list(_DATASETS):
        _ = dataset._shared


os.register_at_fork(before=_own_states)


class StreamingDataset(IterableDataset):
    """Stream a cache as batches ``(images, labels[, indices])``.

    Args:
        cache: a cache folder (written by ``datapipe build``) or an opened :class:`~datapipe.Cache`.
        batch_size: samples per batch on each rank.
        shuffle: a global shuffle of all samples each epoch (samples inside one batch come in
            index order: one sequential pass per shard they live in).
        seed: the order is a pure function of (seed, epoch, position). The same on every rank: the ranks
            split one order between them (a seed per rank would read some samples twice and others never).
        drop_last: drop the epoch's last partial global step (so every batch is full); otherwise
            every sample comes exactly once and the last batch of each rank may be smaller.
        rank: this process's rank; default: what torch.distributed or RANK say when the dataset is
            created (create it after ``init_process_group``, or under torchrun, which sets RANK).
        world_size: the number of ranks; default: what torch.distributed or WORLD_SIZE say.
        return_index: also yield the global sample indices (as ``datapipe.open(cache)[i]`` numbers them).
        order: ``"global"`` (one permutation of all samples; the default for a local cache) or
            ``"shards"`` (shard order permuted, samples shuffled within windows of ``window``
            shards, each node reading its own part; the default for a remote cache). See
            :mod:`datapipe.partition` and docs/loader.md.
        window: shards per window of the ``"shards"`` order.
        nodes: machines the ranks run on (ranks numbered node-major); default: WORLD_SIZE //
            LOCAL_WORLD_SIZE (torchrun's environment), 1 when unset. Used by ``"shards"`` only.
        local_cache: for a cache in object storage (``cache`` an fsspec URL such as
            ``s3://bucket/cache``): the node-local folder its shards are downloaded into, shared by
            every rank and worker on the node (see :mod:`datapipe.fetch`).
        cache_limit: bytes (or a size such as ``"200GB"``) ``local_cache`` may hold; least recently
            used shards are evicted beyond it. None: no limit.
        storage_options: for the URL's filesystem (fsspec: credentials, ``endpoint_url``...).
        prefetch: shards downloaded ahead of the reader (an int), or bytes ahead (``"2GB"``); default 2.
        timeout: seconds without a byte arriving before a download raises RemoteStoreError; default 60.

    Iterating yields ``images`` uint8 [B, H, W, 3] and ``labels`` int64 [B] (and ``indices``
    int64 [B]); for a cache whose samples vary in shape (``--fit short``), ``images`` is a list of B uint8
    [H, W, 3] tensors, each at its own shape (a DeviceLoader's train or eval preset crops them to one size).

    Under torch.distributed the ranks check, in this process (never in DataLoader workers), without
    waiting for each other, that they read alike: ``set_epoch``, ``len()`` and an iteration begun
    here (a DeviceLoader, or a DataLoader with ``num_workers=0``) raise
    :class:`~datapipe.errors.RankMismatchError` when another rank has this dataset with another
    cache, seed, shuffle, order, batch size, drop_last or world size, or starts the epoch at another
    position (a state loaded on one rank only), or when torch.distributed contradicts the rank and
    world size detected when the dataset was created. The n-th dataset of a cache split over ranks
    that each process creates is compared with the n-th of that cache on the others.
    """

    def __init__(self, cache: str | Path | Cache, /, *, batch_size: int = 256, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, return_index: bool = False, order: str | None = None,
                 window: int = part.DEFAULT_WINDOW, nodes: int | None = None,
                 local_cache: str | PathLike | None = None, cache_limit: int | str | None = None,
                 storage_options: dict | None = None, prefetch: int | str | None = None,
                 timeout: float | None = None) -> None:
        super().__init__()
        if not isinstance(cache, (str, PathLike, Cache)):
            raise ArgumentError(f"cache must be a cache folder or a datapipe.Cache, got {type(cache).__name__}")
        self.batch_size = check_int(batch_size, "batch_size", 1, MAX_BATCH_SIZE)
        self.shuffle = check_bool(shuffle, "shuffle")
        self.seed = check_int(seed, "seed", 0, ORDER_LIMIT - 1)
        self.drop_last = check_bool(drop_last, "drop_last")
        self.return_index = check_bool(return_index, "return_index")
        for name, value, least in (("rank", rank, 0), ("world_size", world_size, 1)):
            if value is not None:
                check_int(value, name, least, MAX_WORLD_SIZE - (name == "rank"))
        self._detected = (rank is None, world_size is None)  # checked against torch.distributed when used
        try:
            self.rank, self.world_size = detect_ranks(rank, world_size)
            World(self.rank, self.world_size)  # validates
        except ValueError as exc:  # RANK/WORLD_SIZE that are no numbers, or a rank out of range
            raise ArgumentError(f"{exc} (from the arguments, torch.distributed or RANK/WORLD_SIZE)") from None
        if local_cache is None:  # a file:// URL is the folder it names, read in place (with local_cache: streamed)
            cache = local_path(cache)
        if order is None and is_url(cache):
            order = part.default_order(is_remote=True)
        self.order, self.window, self.nodes = check_order(order, window, nodes, self.world_size,
                                                          ranks_per_node=_launched_world(world_size, self.world_size))
        # object-storage arguments are passed on as given (ShardFetcher's defaults for those left out)
        streaming: dict[str, Any] = {"local_cache": local_cache, "cache_limit": cache_limit,
                                     "storage_options": storage_options, "prefetch": prefetch, "timeout": timeout}
        if not isinstance(cache, Cache):
            self.cache = open_cache(cache, **streaming)
        elif any(value is not None for value in streaming.values()):
            raise ArgumentError(f"{', '.join(k for k, v in streaming.items() if v is not None)}: for a cache in object "
                                "storage given by its URL only; a datapipe.Cache is already open, so leave them out")
        else:
            self.cache = cache
        self._identity = cache_identity(self.cache)
        self._contents = cache_contents(self.cache)
        _check_class_lists(self.cache)
        # [epoch, start, read by workers, set_epoch/load_state_dict calls, epoch + 1 read to its end, the
        # calls then, warned]: shared with DataLoader workers (also persistent ones) through shared memory.
        # The third is set by a worker that reads this epoch: then only the caller knows how many batches
        # the loop received (state_dict(batches_consumed=k)). The next three tell an epoch read whole and
        # begun again without set_epoch (the same shuffled order again: warned once, see _check_repeat).
        self._state = torch.zeros(7, dtype=torch.int64).share_memory_()
        self._owner = os.getpid()  # the process whose dataset this is (see _shared)
        _DATASETS.add(self)
        self._consumed = 0  # batches the loop received of the current iteration (main process)
        self._iter_base = 0  # where the current iteration began in the epoch's order
        # Bumped by every iteration begun in this process and by every change of epoch or position:
        # only the iteration holding the current number moves the state (see note_received).
        self._iteration = 0
        self._overlapped = False  # an earlier iteration yielded after the current one began
        self._running = False  # the current iteration (main process) has begun and not ended
        # Agreement between ranks (_agree): this dataset's number among those this process splits over
        # ranks (0: not split), whether its settings were compared, and the position keys published.
        self._split = next(_SPLIT_DATASETS) if self.world_size > 1 else 0
        self._agreed = False
        self._published: dict[tuple[int, str] | str, int] = {}  # (epoch, "iteration"), (passes, "pass") or "set_epoch"
        self._passes = 0  # iterations this process read to their end (the loop received the last batch)
        self._keys: deque[str] = deque()
        self._begun: deque[str] = deque()  # this rank's "began epoch e" keys in the store (see _agree)
        self._read_epoch: int | None = None  # the epoch this rank last read its part of to the end, if not checked
        self._reading: str | None = None  # the "began" key of the current iteration, announced at its first batch
        # In a DataLoader worker: a worker state loaded (epoch, position, batches of its share yielded), for
        # its next iteration; and the current iteration's (epoch, position, batches yielded), for state_dict.
        self._worker_loaded: tuple[int, int, int] | None = None
        self._worker_progress: tuple[int, int, int] | None = None

    @property
    def _shared(self) -> torch.Tensor:
        """The state shared with this dataset's DataLoader workers (forked, or handed the same shared memory by
        torch's pickler). Any other process that uses a copy (one the dataset was passed to through
        multiprocessing, a fork that is no DataLoader worker) takes a private copy of it at its first use: its
        set_epoch or load_state_dict must not move the original's epoch, nor its iterations use up the
        original's resumed position."""
        if self._owner != os.getpid() and torch.utils.data.get_worker_info() is None:
            self._own_state()
        return self._state

    def _own_state(self) -> None:
        """This process's state from now on: a copy of the one it had, in shared memory for its own workers."""
        self._state = self._state.clone().share_memory_()
        self._owner = os.getpid()

    def __getstate__(self) -> dict:
        """A process that received this dataset takes a state of its own before it hands the dataset on (to its
        own spawned DataLoader workers, which must share that one). The pickling process is noted: unpickled
        in it, the dataset is a copy (``copy.copy`` and ``deepcopy`` pickle and unpickle in one process)."""
        _ = self._shared
        return {**self.__dict__, "_pickled_by": os.getpid()}

    def __setstate__(self, state: dict) -> None:
        """A copy (``copy.copy``, ``copy.deepcopy``, ``pickle``; Ray, submitit, cloudpickle; in a DataLoader
        worker too) has a state of its own, in shared memory as the original's is, so that its own DataLoader
        workers see its set_epoch and load_state_dict; it is compared across ranks as a dataset of its own; and
        copied in the middle of an iteration it begins where the loop was (as its state_dict says). What
        torch's pickler hands a spawned DataLoader worker of another process is that process's shared
        memory: it stays."""
        state = dict(state)
        pickled_by = state.pop("_pickled_by", None)
        self.__dict__.update(state)
        _DATASETS.add(self)
        if pickled_by != os.getpid() and self._state.is_shared():
            return
        self._own_state()
        self._split = next(_SPLIT_DATASETS) if self.world_size > 1 else 0
        self._agreed = False
        self._published = {}
        self._keys = deque()
        self._begun = deque()
        self._read_epoch = None  # a copy's keys are its own: it checks the epochs it reads
        self._reading = None
        if self._running or self._consumed:
            try:
                position = int(self.state_dict()["position"])
            except StateError:  # read by workers, or by two iterators: it cannot tell, nor can its state_dict
                return
            self._shared[1] = position
            self._running = False
            self._restart(position)

    # ----------------------------------------------------------------- epoch, length, plan
    @property
    def epoch(self) -> int:
        return int(self._shared[0])

    @property
    def start(self) -> int:
        """Position in the epoch's order where the next iteration begins (0 unless resumed)."""
        return int(self._shared[1])

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (call before each epoch). A new epoch starts from its beginning.

        A resumed position (``load_state_dict``) holds until the epoch changes. In the main
        process (``num_workers=0``, DeviceLoader) it is also used only once; DataLoader worker
        processes cannot tell the main process that they used it, so there a second pass over the
        resumed epoch without ``set_epoch`` starts at the resumed position again.

        Raises:
            RankMismatchError: under torch.distributed, another rank reads this dataset with other
                settings or starts this epoch elsewhere, or the detected rank is not torch.distributed's.
        """
        epoch = check_int(epoch, "epoch", 0, ORDER_LIMIT - 1)
        self._check_ranks()
        self._shared[3] += 1
        if int(self._shared[2]) and self._split and distributed_ranks() is not None:
            # DataLoader workers read the epoch: noted for them (see _check_every_rank_began), as a rank that reads
            # in this process notes it at its first batch; a worker has no process group to note it in
            self._announce_began(self._began_key(self.epoch, self.rank))
        if epoch != self.epoch:
            self._shared[1] = 0
            self._shared[2] = 0
            self._restart(0)
        self._shared[0] = epoch
        self._agree("epoch")

    def _restart(self, base: int) -> None:
        """Nothing of the current epoch received yet, from ``base`` on: a new epoch, a loaded state or a
        new iteration. An iteration begun before no longer counts (its batches are not the loop's)."""
        self._iter_base = base
        self._consumed = 0
        self._iteration += 1
        self._overlapped = False
        self._running = False

    def end_iteration(self, iteration: int) -> None:
        """Iteration ``iteration`` of this process ended (read to its end, or dropped): what it yields
        (``_len``) is the next one's again."""
        if iteration == self._iteration:
            self._running = False

    @property
    def iteration(self) -> int:
        """The number of the current iteration in this process (see :meth:`note_received`)."""
        return self._iteration

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch the training loop has received, counted from the epoch's start
        (after a resume: those before the resumed position too), as this process counted them: what
        ``state_dict()`` saves when not told. DataLoader workers' batches are not counted here."""
        return self._batches_before() + self._consumed

    def _epoch_batches(self, start: int = 0) -> int:
        """Batches each rank yields for the current epoch's order from ``start`` on."""
        return part.num_batches(len(self.cache), batch_size=self.batch_size, world_size=self.world_size,
                                drop_last=self.drop_last, start=start)

    def _batches_before(self) -> int:
        """The epoch's batches ahead of where the current iteration began (in this batch layout)."""
        return self._epoch_batches() - self._epoch_batches(self._iter_base)

    def receipt(self) -> tuple:
        """What :meth:`note_received` changes, as it is now: handed to :meth:`take_back` when the batch noted never
        reached the loop."""
        return (self._iteration, self._consumed, self._passes, self._read_epoch, int(self._shared[4]),
                int(self._shared[5]))

    def take_back(self, receipt: tuple) -> None:
        """The batch noted as received after ``receipt`` (:meth:`receipt`) never reached the loop: an exception (a
        Ctrl-C, a handler of SIGTERM) was raised after it was counted, before it was handed over. Left counted, a
        state saved then would be one batch ahead of the loop, and a resume from it would skip that batch."""
        iteration, consumed, passes, read_epoch, shared4, shared5 = receipt
        if iteration == self._iteration:  # (no newer iteration can begin between the two, in one step of the loop)
            self._consumed, self._passes, self._read_epoch = consumed, passes, read_epoch
            self._shared[4], self._shared[5] = shared4, shared5

    def note_received(self, iteration: int, batches: int) -> None:
        """Record that the loop has received the first ``batches`` batches of iteration ``iteration``.

        Only the current iteration moves the state: a batch of an earlier one (an iterator kept
        after a newer one began, or after set_epoch/load_state_dict) is not counted, and makes
        ``state_dict()`` refuse to guess which of them the training loop follows. A caller counts a batch right
        before it hands it over, and takes the count back (:meth:`take_back`) when that fails (a plain DataLoader
        in the main process takes the batch, then collates and pins it: a failure there is not seen here).
        """
        if iteration == self._iteration:
            self._consumed = batches
            if self._reading is not None:  # its first batch: this rank reads the epoch (see _agree)
                self._announce_began(self._reading)
            if batches == self._len():
                self._read_whole()
                self._passes += 1
                self._read_epoch = self.epoch  # every rank must have begun it: see _check_every_rank_began
        else:
            self._overlapped = True

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank (the same on every rank), also while a resumed epoch is read:
        its iteration yields those after the loaded position, ``len() - batches_consumed`` right after
        ``load_state_dict``. Training frameworks that resume (Lightning, torchdata's StatefulDataLoader) count
        so: the epoch's batches, those before the saved position taken as read; one given the rest would end
        the resumed epoch early by as many batches, and every later epoch with it."""
        self._check_ranks()
        self._agree()
        return self._epoch_batches()

    def _len(self) -> int:
        """Batches the current iteration yields (between iterations, the next one): from its position on."""
        return self._epoch_batches(self._iter_base if self._running else self.start)

    def plan(self, start: int | None = None, epoch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The current epoch's (or ``epoch``'s) global order [N] and this rank's batch bounds [n, 2] from ``start``."""
        order = self.epoch_order(epoch)
        bounds = part.batch_bounds(len(self.cache), batch_size=self.batch_size, world_size=self.world_size,
                                   rank=self.rank, drop_last=self.drop_last,
                                   start=self.start if start is None else start)
        return order, bounds

    def epoch_order(self, epoch: int | None = None) -> np.ndarray:
        """The current epoch's (or ``epoch``'s) order of all samples, int64 [N] (rank slicing: :meth:`plan`)."""
        epoch = self.epoch if epoch is None else epoch
        if self.order == "shards":
            return part.shard_order(self.cache.counts, seed=self.seed, epoch=epoch, nodes=self.nodes,
                                    window=self.window, batch_size=self.batch_size,
                                    local_world=self.world_size // self.nodes, shuffle=self.shuffle)
        return part.epoch_order(len(self.cache), seed=self.seed, epoch=epoch, shuffle=self.shuffle)

    @property
    def classes(self) -> list[str]:
        """The cache's class names: label ``i`` is ``classes[i]`` (torchvision ImageFolder's ``classes``), to check
        a validation set's labels against its training set's, or to name a prediction."""
        return self.cache.classes

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        return self.cache.shape

    # ----------------------------------------------------------------- iteration
    def begin_iteration(self) -> tuple[np.ndarray, np.ndarray]:
        """Start an iteration of the current epoch in this process: its order and batch bounds.

        A resumed position is used once; the next iteration of the same epoch is whole again.

        Raises:
            RankMismatchError: another rank reads this dataset with other settings or from another
                position, or torch.distributed contradicts the detected rank (see the class).
        """
        self._check_ranks()
        self._agree("iteration")
        self._check_repeat(stacklevel=4)
        order, bounds = self.plan()
        start = self.start
        self._restart(start)
        self._running = True
        self._shared[1] = 0  # the resumed position serves this iteration only
        self._shared[2] = 0
        self._follow(order, bounds, np.arange(len(bounds)), start)
        return order, bounds

    def _follow(self, order: np.ndarray, bounds: np.ndarray, batches: np.ndarray, start: int) -> None:
        """A remote cache prefetches shards in the order these batches first read them (each batch's
        samples are read sorted, so its shards in ascending order). The node's ranks share one local
        cache and read the same window's shards in the same steps: what a step reads is what every rank
        of this node reads in it, so a shard is neither evicted nor stamped finished while another rank
        of the node still has samples in it. ``start``: the position the iteration begins at (every rank's)."""
        remote = self.cache.remote
        if remote is None:
            return
        batches = np.asarray(batches, np.int64)
        steps, positions = self._node_reads(bounds, batches, start)
        if not len(positions):
            remote.follow([])
            return
        shards = np.searchsorted(self.cache.starts, order[positions], side="right") - 1
        s = len(self.cache.counts)
        reads = np.unique(steps * s + shards)  # (batch, shard), sorted
        at, shard = reads // s, reads % s
        _, first = np.unique(shard, return_index=True)  # [u] by shard number
        _, from_end = np.unique(shard[::-1], return_index=True)
        last = at[len(reads) - 1 - from_end]
        by_first = np.argsort(first, kind="stable")
        begin, end = bounds[batches[0]] if len(batches) else (0, 0)
        # the shard this process opens first: its first batch's samples are read sorted, shards ascending
        own = int(np.searchsorted(self.cache.starts, order[begin:end].min(), side="right") - 1) if end > begin else None
        remote.follow(shard[first[by_first]], at[first[by_first]], last[by_first], reader_first=own)

    def _node_reads(self, bounds: np.ndarray, batches: np.ndarray, start: int) -> tuple[np.ndarray, np.ndarray]:
        """(k, position in the order) of every sample that a rank of this node reads in the step of this
        process's k-th batch (this rank's own ``bounds`` included)."""
        local = max(1, self.world_size // self.nodes) if self.order == "shards" else 1
        node = self.rank // local
        steps, positions = [], []
        for rank in range(node * local, min(node * local + local, self.world_size)):
            b = bounds if rank == self.rank else part.batch_bounds(
                len(self.cache), batch_size=self.batch_size, world_size=self.world_size, rank=rank,
                drop_last=self.drop_last, start=start)
            b = b[batches]
            sizes = b[:, 1] - b[:, 0]
            total = int(sizes.sum())
            if not total:
                continue
            before = np.concatenate(([0], np.cumsum(sizes)[:-1]))
            steps.append(np.repeat(np.arange(len(batches), dtype=np.int64), sizes))
            positions.append(np.repeat(b[:, 0] - before, sizes) + np.arange(total))
        if not steps:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(steps), np.concatenate(positions)

    def __iter__(self) -> Iterator[tuple[torch.Tensor | list[torch.Tensor], ...]]:
        """In the main process the iteration begins here, not at its first batch: from ``iter()`` on,
        the state says nothing of it has been received (an iterator kept from before stops counting)."""
        if torch.utils.data.get_worker_info() is not None:
            self._worker_progress = None  # a new iteration of this worker: its state is where it will begin
            return self._stream(None)
        order, bounds = self.begin_iteration()
        return self._stream((order, bounds, self._iteration))

    def _stream(self, begun: tuple[np.ndarray, np.ndarray, int] | None) -> Iterator[tuple[torch.Tensor | list[torch.Tensor], ...]]:
        """The batches of an iteration: begun in the main process (its order, bounds and number), or
        None in a DataLoader worker (which plans its share when its first batch is asked for)."""
        worker, num_workers = detect_worker()
        in_worker = begun is None
        epoch, start, skip = self._worker_begin() if in_worker else (self.epoch, self.start, 0)
        order, bounds, iteration = (*self.plan(start, epoch), 0) if begun is None else begun
        # a worker resumed from its own state (StatefulDataLoader) goes on after the batches of its share it yielded
        mine = part.worker_batches(len(bounds), worker=worker, num_workers=num_workers)[skip:]
        # the dataset's epoch as set (not one a worker's loaded state names: see _load_worker_state)
        current = epoch == self.epoch
        if in_worker:  # batches go back through shared memory: is there room for them?
            self._shared[2] = 1
            if worker == 0 and current and not skip and start == self.start:  # (a resumed share is no repeat)
                self._check_repeat(stacklevel=3)
            self._follow(order, bounds, mine, start)
            # the largest batch this worker yields (batch_size may exceed the samples: an evaluation set in one batch)
            rows = max((int(bounds[j][1] - bounds[j][0]) for j in mine), default=0)
            _check_shm(rows * self._sample_bytes(), torch.utils.data.get_worker_info())
        remote = self.cache.remote
        try:
            for k, j in enumerate(mine):
                if remote is not None:
                    remote.advance(k)  # the plan's position (_follow): what is finished, how far to prefetch
                begin, end = bounds[j]
                batch = self._read(order[begin:end], shared=in_worker)
                if remote is not None:
                    remote.read(k)
                if in_worker:  # yielded, as a worker's state_dict (asked for after the batches it yields) says
                    self._worker_progress = (epoch, start, skip + k + 1)
                    yield batch
                    continue
                receipt = None
                try:  # counted as the loop's when handed over, and only then (see take_back)
                    receipt = self.receipt()
                    self.note_received(iteration, int(j) + 1)
                    yield batch
                except GeneratorExit:  # closed at the yield (a break): the loop had the batch
                    raise
                except BaseException:
                    if receipt is not None:
                        self.take_back(receipt)
                    raise
            if in_worker and worker == 0 and current:  # its share read to the end: the loop has (about) the whole epoch
                self._read_whole()
        finally:
            if not in_worker:
                self.end_iteration(iteration)

    def _worker_begin(self) -> tuple[int, int, int]:
        """A DataLoader worker's iteration begins: (epoch, position, batches of its share to skip): those of the
        worker state loaded into it (used once), or the dataset's epoch and start."""
        loaded, self._worker_loaded = self._worker_loaded, None
        begun = loaded if loaded is not None else (self.epoch, self.start, 0)
        self._worker_progress = begun
        return begun

    def _read_whole(self) -> None:
        """The current epoch was read to its end (the loop received its last batch, or DataLoader worker 0
        read its share), with no set_epoch or load_state_dict since."""
        self._shared[4] = self.epoch + 1
        self._shared[5] = self._shared[3]

    def _check_repeat(self, stacklevel: int) -> None:
        """A shuffled epoch read to its end and begun again without set_epoch repeats its order: a loop
        that never calls set_epoch trains on epoch 0's order every time. Warned once per dataset (its
        DataLoader workers included); set_epoch(e), even to the same epoch, says the repeat is meant."""
        shared = self._shared
        if (not self.shuffle or int(shared[6]) or int(shared[4]) != self.epoch + 1
                or int(shared[5]) != int(shared[3])):
            return
        shared[6] = 1
        warnings.warn(RepeatedEpochWarning(
            f"datapipe: epoch {self.epoch} was read to its end and begins again in the same shuffled order; "
            "call set_epoch(epoch) at the start of each epoch for a new order (a loop that never calls it "
            "reads epoch 0's order every time)"), stacklevel=stacklevel)

    def _sample_bytes(self) -> int:
        """Decoded bytes of the largest sample (all of them when they share one shape)."""
        h, w = self.cache.shape_range[1]
        return h * w * 3

    def _read(self, indices: np.ndarray, *, shared: bool) -> tuple[torch.Tensor | list[torch.Tensor], ...]:
        n = len(indices)
        if self.cache.fixed_shape is None:  # samples of varying shapes: a list of uint8 [h, w, 3] tensors
            labels = torch.empty(n, dtype=torch.int64)
            index = torch.empty(n, dtype=torch.int64)
            samples = [torch.from_numpy(x) for x in self.cache.read_samples(indices, labels.numpy(), index.numpy())]
            if shared:
                _share([*samples, labels, index], sum(x.numel() for x in samples))
            return (samples, labels, index) if self.return_index else (samples, labels)
        images = torch.empty((n, *self.cache.shape), dtype=torch.uint8)
        labels = torch.empty(n, dtype=torch.int64)
        index = torch.empty(n, dtype=torch.int64)
        if shared and n:
            _share([images, labels, index], images.numel())  # filled in place: the DataLoader sends handles, not copies
        self.cache.read_batch(indices, images.numpy(), labels.numpy(), index.numpy())
        return (images, labels, index) if self.return_index else (images, labels)

    # ----------------------------------------------------------------- ranks
    def _check_ranks(self) -> None:
        """The rank and world size detected when the dataset was created are torch.distributed's now.

        Not re-detected: a loaded state, the order's nodes and ``len()`` already given out were for the
        detected world. Checked in the main process only (a DataLoader worker has no process group).
        """
        if not any(self._detected) or torch.utils.data.get_worker_info() is not None:
            return
        ranks = distributed_ranks()
        if ranks is None:
            return
        rank, world_size = ranks
        if (self._detected[0] and rank != self.rank) or (self._detected[1] and world_size != self.world_size):
            raise RankMismatchError(
                f"this StreamingDataset detected rank {self.rank} of world_size {self.world_size} when it was "
                f"created, but torch.distributed is now initialised as rank {rank} of {world_size}: create the "
                "dataset after init_process_group, or pass rank= and world_size=")

    def _settings(self) -> dict[str, object]:
        """What every rank must read this dataset with."""
        build_id, _ = self._identity
        order = {"order": self.order} | ({"window": self.window, "nodes": self.nodes} if self.order == "shards" else {})
        return {"build_id": build_id, "contents": self._contents, "num_samples": len(self.cache), "seed": self.seed,
                "shuffle": self.shuffle,
                **order, "batch_size": self.batch_size, "drop_last": self.drop_last, "world_size": self.world_size}

    def _agree(self, kind: str | None = None) -> None:
        """Under torch.distributed, compare this dataset's cache and settings (once) and, for ``kind``, the
        epoch and position it is read from, with the first rank that published them. Never waits, no
        collective.

        The epoch and position are published for the n-th ``set_epoch`` call ("epoch"), for the n-th
        iteration of an epoch begun here and the n-th begun after as many iterations read to their end
        ("iteration"), and for the dataset's first iteration. Ranks running
        the same code publish the same keys whatever their timing; a rank that loaded a state the others did
        not, or an older one, or that selects another epoch, differs in its epoch or start.
        """
        if not self._split or torch.utils.data.get_worker_info() is not None or distributed_ranks() is None:
            return
        prefix = f"datapipe/dataset-{self._split}"
        if not self._agreed:
            self._compare(f"{prefix}/settings", self._settings(), "settings")
            self._agreed = True
        if kind is None:
            return
        epoch = self.epoch
        keys = []
        if kind == "epoch":
            n = self._published.get("set_epoch", 0)
            self._published["set_epoch"] = n + 1
            keys.append((f"{prefix}/set_epoch-{n}", f"set_epoch call #{n + 1}"))
        else:
            n = self._published.get((epoch, kind), 0)
            self._published[(epoch, kind)] = n + 1
            if not self._published.get("iteration"):
                self._published["iteration"] = 1
                keys.append((f"{prefix}/first-iteration", "first iteration"))
            keys.append((f"{prefix}/epoch-{epoch}/iteration-{n}", f"iteration #{n + 1} of epoch {epoch}"))
            # and by the passes read whole before it: a rank that never calls set_epoch reads epoch 0 again where the
            # others read epoch 1, which the epoch's own key never compares (no other rank publishes it)
            passes = self._passes
            k = self._published.get((passes, "pass"), 0)
            self._published[(passes, "pass")] = k + 1
            keys.append((f"{prefix}/pass-{passes}/iteration-{k}",
                         f"iteration #{k + 1} after {passes} iteration{'s' if passes != 1 else ''} read to the end"))
        for key, what in keys:
            self._compare(key, {"epoch": epoch, "start": self.start}, what)
            self._keys.append(key)
        while len(self._keys) > _KEPT_KEYS:  # every rank removes the same old keys: a few per dataset at most
            forget(self._keys.popleft())
        if kind == "iteration":
            # This rank reads the epoch once it receives a batch, not at iter(): Accelerate's dispatcher makes the
            # iterator on every rank and reads it on rank 0 only. An iteration with nothing to read has begun.
            began = self._began_key(epoch, self.rank)
            if self._epoch_batches(self.start) == 0:
                self._announce_began(began)
            else:
                self._reading = began
            if self._read_epoch is not None:
                read, self._read_epoch = self._read_epoch, None
                self._check_every_rank_began(read)

    def _announce_began(self, began: str) -> None:
        """Note ``began`` (this rank reads an epoch: :meth:`_began_key`) in the store; nothing is pending after it."""
        self._reading = None
        announce(began)  # every time: a process group made anew has a store of its own
        if began not in self._begun:
            self._begun.append(began)
            while len(self._begun) > _KEPT_BEGUN:
                forget(self._begun.popleft())

    def _began_key(self, epoch: int, rank: int) -> str:
        return f"datapipe/dataset-{self._split}/epoch-{epoch}/began-{rank}"

    def _refused_key(self) -> str:
        """Set by a rank that raised a RankMismatchError for this dataset: the other ranks name it no more."""
        return f"datapipe/dataset-{self._split}/refused"

    def _check_every_rank_began(self, epoch: int) -> None:
        """This rank read its whole part of ``epoch`` and begins to read again: every other rank must have begun
        ``epoch`` by now, or its part was never read. A framework that reads the loader on one rank and sends its
        batches to the others (Hugging Face Accelerate's ``dispatch_batches``, its default for an iterable
        dataset) reads only that rank's part of a dataset split over ranks. Checked when the next iteration
        begins, not at the epoch's end: ranks may take turns (one reads while the others wait at a barrier) or
        lag without a collective (an evaluation after rank 0 saved a checkpoint), and by its next iteration a
        rank that reads at all has begun the epoch before. Waits up to DATAPIPE_RANK_TIMEOUT seconds (60) for
        one that has not, never otherwise.

        Raises:
            RankMismatchError: a rank had not begun the epoch when the wait ended, named with what to do.
        """
        keys = [self._began_key(epoch, rank) for rank in range(self.world_size)]
        refused = [self._refused_key()]  # a rank that disagreed raised already: said once
        timeout = env_seconds("DATAPIPE_RANK_TIMEOUT", RANK_TIMEOUT)
        deadline = time.monotonic() + timeout
        while True:  # one request per look, whatever the number of ranks
            if all_announced(keys) in (None, True) or all_announced(refused):
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        missing = [rank for rank, key in enumerate(keys) if all_announced([key]) is False]
        if not missing:  # begun in the meantime
            return
        ranks = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8:,} more" if len(missing) > 8 else "")
        which, theirs = (f"ranks {ranks} had", "their parts") if len(missing) > 1 else (f"rank {ranks} had", "its part")
        raise RankMismatchError(
            f"{self._which()} is split over {self.world_size} ranks: this rank ({self.rank}) read its part of epoch "
            f"{epoch} to the end and begins to read again, but {which} not begun reading {theirs} (waited "
            f"{timeout:g} s), so those samples were not read, unless that rank failed or stopped. A framework that "
            "reads the loader on one rank and sends its batches to the others (Hugging Face Accelerate's "
            "dispatch_batches, its default for an iterable dataset) reads only that rank's part: give it a "
            "datapipe.DeviceLoader (which Accelerate leaves as it is, each rank reading its part), or a dataset not "
            "split over ranks (rank=0, world_size=1). A rank that only lags this far behind: raise "
            f"DATAPIPE_RANK_TIMEOUT (seconds, {RANK_TIMEOUT:g} by default)")

    def _which(self) -> str:
        return f"StreamingDataset #{self._split} of {show(str(self.cache.root))}"

    def _compare(self, key: str, mine: dict[str, object], what: str) -> None:
        """Raise when the first rank to publish ``key`` published other values than ``mine``."""
        first = first_published(key, {**mine, "rank": self.rank})
        if first is None:
            return
        other = first.pop("rank", "?")
        # window and nodes belong to the "shards" order: where the orders differ, they are not compared
        differ = [name for name in mine if first.get(name) != mine[name]
                  and not (name in ("window", "nodes") and first.get("order") != mine.get("order"))]
        if not differ:
            return
        announce(self._refused_key())  # the ranks no longer read alike: see _check_every_rank_began
        if "start" in mine:
            raise RankMismatchError(
                f"the ranks disagree on {self._which()}: its {what} reads epoch {mine['epoch']} from sample "
                f"{mine['start']} here (rank {self.rank}) but epoch {show(first.get('epoch'))} from sample "
                f"{show(first.get('start'))} on rank {other}; load the same state on every rank (load_state_dict on "
                "each rank, not only on one) and call set_epoch alike, with the same epochs")
        if "build_id" in differ:
            raise RankMismatchError(
                f"the ranks disagree on {self._which()}: it reads the cache of build {show(mine['build_id'])} here "
                f"(rank {self.rank}) but that of build {show(first.get('build_id'))} on rank {other}; every rank must "
                "read the same cache and create the same StreamingDatasets in the same order")
        if "contents" in differ:
            raise RankMismatchError(
                f"the ranks disagree on {self._which()}: it holds other samples or labels here (rank {self.rank}, "
                f"contents {show(mine['contents'])}) than on rank {other} (contents {show(first.get('contents'))}): "
                "the cache was rebuilt in place between the ranks' opening it; restart every rank once the build "
                "has finished")
        values = "; ".join(f"{name}={show(mine[name])} here (rank {self.rank}) but {name}={show(first.get(name))} "
                           f"on rank {other}" for name in differ)
        why = " (the ranks split one order: a seed per rank reads some samples twice and others never)" \
            if "seed" in differ else ""
        raise RankMismatchError(f"the ranks disagree on the {what} of {self._which()}: {values}; create "
                                f"it with the same settings on every rank{why}")

    # ----------------------------------------------------------------- resume
    def state_dict(self, batches_consumed: int | None = None) -> dict:
        """A small, versioned state: load it into a fresh dataset to continue the same stream.

        The state names the cache it belongs to (``build_id``, ``config_hash``, ``num_samples``), so
        that it is never applied to another cache of the same size.

        Args:
            batches_consumed: batches of the current epoch the training loop has received, counted
                from the epoch's start in this dataset's batch layout: after a resume, the batches
                before the resumed position (``ds.batches_consumed`` right after ``load_state_dict``:
                ``ceil(state["position"] / (batch_size * world_size))``, an epoch's last batch being short
                without ``drop_last``) plus those received since. Default: what this dataset counted while iterated in the main
                process (``num_workers=0``); required when the epoch was read through your own
                multi-worker DataLoader (its workers cannot report it): without it that raises
                StateError.

        Raises:
            StateError: ``batches_consumed`` is needed and missing, is no integer, is beyond the
                epoch's batches, or counts fewer batches than lie before the resumed position.
        """
        info = torch.utils.data.get_worker_info()
        if info is not None:
            return self._worker_state(info, batches_consumed)
        before = self._batches_before()
        count = (f"k = the batches of epoch {self.epoch} the loop has received, counted from the epoch's start"
                 + (f", the {before} before the resumed position included" if before else ""))
        if batches_consumed is None and int(self._shared[2]):
            raise StateError(
                "this epoch was read by DataLoader worker processes, which cannot tell this process how "
                f"many batches your loop received: pass state_dict(batches_consumed=k), {count} "
                "(or use datapipe.DeviceLoader, which counts them)")
        if batches_consumed is None and self._overlapped:
            raise StateError(
                "an earlier iterator of this dataset went on yielding after a newer iteration began (or after "
                "set_epoch/load_state_dict), so this process cannot tell which one your loop follows: pass "
                f"state_dict(batches_consumed=k), {count}")
        total = self._epoch_batches()
        if batches_consumed is None:
            k = before + self._consumed
        else:
            k = check_int(batches_consumed, "batches_consumed", 0, total, error=StateError)
            if k < before:
                raise StateError(
                    f"batches_consumed={k} is before the position this epoch resumed at (sample {self._iter_base}, "
                    f"after {before} batches): it counts the batches of epoch {self.epoch} from the epoch's start, "
                    f"so pass {before} + the batches the loop has received since the resume")
        # The last batch received: the epoch is done, whatever drop_last skipped after it. Saved as
        # the end of the order, it resumes to no batch under any batch layout (a position short of
        # the end would hand a smaller layout the dropped samples, and a larger one could refuse it).
        if k == before:  # nothing received since this iteration began (at a step boundary, or the end)
            position = self._iter_base
        elif k == total:
            position = len(self.cache)
        else:
            position = k * self.batch_size * self.world_size
        return self._state_of(self.epoch, position)

    def _state_of(self, epoch: int, position: int) -> dict:
        build_id, config_hash = self._identity
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.cache),
            "config_hash": config_hash,
            "build_id": build_id,
            "contents": self._contents,
        } | ({"order": self.order, "window": self.window, "nodes": self.nodes} if self.order == "shards" else {})

    def _worker_state(self, info: WorkerInfo, batches_consumed: int | None) -> dict:
        """The state of this DataLoader worker's share (torchdata's StatefulDataLoader asks each worker for one
        after the batches it yields and keeps, per worker, the one of the last batch the loop received): the
        epoch and position its iteration began at and how many batches of its share it has yielded. Loaded
        into the same worker of a loader with as many workers (:meth:`load_state_dict`), it goes on after them."""
        if batches_consumed is not None:
            raise StateError(
                "state_dict(batches_consumed=k) was called in a DataLoader worker process: a worker yields only its "
                "share of each epoch, and k counts the batches of the whole loop; call it on the dataset in the "
                "training loop's process (a worker's own state_dict(), without k, is what torchdata's "
                "StatefulDataLoader saves)")
        if self._worker_progress is not None:  # an iteration of this worker has begun
            epoch, position, batches = self._worker_progress
        elif self._worker_loaded is not None:  # the state loaded for the next one
            epoch, position, batches = self._worker_loaded
        else:
            epoch, position, batches = self.epoch, self.start, 0
        return self._state_of(epoch, position) | {"worker": {
            "id": info.id, "num_workers": info.num_workers, "batches": batches, "batch_size": self.batch_size,
            "world_size": self.world_size, "drop_last": self.drop_last}}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state (seeks: skipped samples are never read).

        Every field is checked before anything changes: its type, its range, and that the state
        belongs to this cache (build, configuration, size), seed and shuffle. The world size and
        batch size may differ from the saved run as long as the saved position falls on a global
        step boundary of the new configuration. Load it on every rank: under torch.distributed a rank
        that starts the epoch elsewhere than the others is refused (see the class). ``len()`` stays the
        whole epoch's batches; the resumed iteration yields those from the position on.

        Raises:
            StateError: the state is malformed, from another datapipe version, or for another
                cache, seed or shuffle, or its position cannot be resumed with this batch layout.
            RankMismatchError: torch.distributed contradicts the rank detected at creation.
        """
        info = torch.utils.data.get_worker_info()
        if isinstance(state, Mapping) and "worker" in state:
            self._load_worker_state(state, info)
            return
        if info is not None:
            raise StateError(
                "load_state_dict() was called in a DataLoader worker process with the state of a training loop: "
                "a worker reads only its share of each epoch; load it into the dataset in the loop's process "
                "before iterating (its workers then begin where it says)")
        self._check_ranks()
        epoch, position = self.check_state(state)
        self._shared[3] += 1
        self._shared[0] = epoch
        self._shared[1] = position
        self._shared[2] = 0
        self._restart(position)

    def _load_worker_state(self, state: Mapping, info: WorkerInfo | None) -> None:
        """A DataLoader worker's own state (see :meth:`_worker_state`), loaded into the same worker of a loader
        with as many workers and the same batch layout: its next iteration reads that epoch from that position,
        after the batches of its share it had yielded. Nothing changes for the other workers or the loop's
        process (their states are their own)."""
        worker = state["worker"]
        if info is None:
            saved = (f" {show(worker.get('id'))} of {show(worker.get('num_workers'))}"
                     if isinstance(worker, Mapping) else "")
            raise StateError(
                f"this is the state of DataLoader worker{saved} (torchdata's StatefulDataLoader saves one per "
                "worker), which says how far that worker read its share of an epoch, not where the loop is: load "
                "the StatefulDataLoader's own state with its load_state_dict(), which hands each worker its own")
        if not isinstance(worker, Mapping) or set(worker) != set(WORKER_STATE_KEYS):
            raise StateError(f"a DataLoader worker's state holds \"worker\": a dict of exactly "
                             f"{', '.join(WORKER_STATE_KEYS)}; got {show(worker)}: pass the state saved, unchanged")
        num_workers = check_int(worker["num_workers"], "the worker state's num_workers", 1, error=StateError)
        if num_workers != info.num_workers:
            raise StateError(
                f"this loader state was saved with num_workers={num_workers}, and this DataLoader has "
                f"num_workers={info.num_workers}: each worker's state says how far it read its own share of the "
                "epoch, and the shares depend on the number of workers; resume with "
                f"num_workers={num_workers} (or save and resume with the dataset's own state_dict(batches_consumed=k), "
                "which any number of workers continues)")
        worker_id = check_int(worker["id"], "the worker state's id", 0, num_workers - 1, error=StateError)
        if worker_id != info.id:
            raise StateError(f"DataLoader worker {info.id} was handed the state of worker {worker_id}: pass the "
                             "StatefulDataLoader's state as saved, unchanged")
        layout = {"batch_size": check_int(worker["batch_size"], "the worker state's batch_size", 1, error=StateError),
                  "world_size": check_int(worker["world_size"], "the worker state's world_size", 1, error=StateError),
                  "drop_last": check_bool(worker["drop_last"], "the worker state's drop_last", error=StateError)}
        mine = {"batch_size": self.batch_size, "world_size": self.world_size, "drop_last": self.drop_last}
        if layout != mine:
            differ = ", ".join(f"{k}={show(v)} (now {show(mine[k])})" for k, v in layout.items() if v != mine[k])
            raise StateError(
                f"this loader state was saved with {differ}: a DataLoader worker's state counts the batches of its "
                "share in that batch layout; resume with the saved one (or save and resume with the dataset's own "
                "state_dict(batches_consumed=k), which another batch size or world size continues where the "
                "position falls on one of its steps)")
        epoch, position = self.check_state({k: v for k, v in state.items() if k != "worker"})
        share = len(part.worker_batches(self._epoch_batches(position), worker=info.id, num_workers=num_workers))
        batches = check_int(worker["batches"], "the worker state's batches", 0, share, error=StateError)
        self._worker_progress = None
        # The saved loop's epoch is the one its dataset was set to when its workers began it. A state is saved
        # as the loader's last iteration left it, also after the loop moved on with set_epoch (before its next
        # iter()), which no worker saw: the dataset set to a later epoch reads that one whole, as the saved run
        # would have; one set to an earlier epoch than the state's unfinished one is refused (a set_epoch missing).
        if epoch < self.epoch or (epoch > self.epoch and batches == share):
            self._worker_loaded = None
            if epoch < self.epoch and batches < share:  # not silent: a rollback that forgot set_epoch lands here too
                warnings.warn(ResumeWarning(
                    f"datapipe: the loader state resumes epoch {epoch} (DataLoader worker {info.id} had read {batches} "
                    f"of its {share} batches), and the dataset is set to epoch {self.epoch}, which is read whole (the "
                    f"loop moved on with set_epoch after the state was saved); to resume epoch {epoch}, call "
                    f"dataset.set_epoch({epoch}) before iterating the resumed loader"), stacklevel=2)
            return
        if epoch > self.epoch:
            raise StateError(
                f"this loader state resumes epoch {epoch} (DataLoader worker {info.id} had read {batches} of its "
                f"{share} batches), but the dataset is set to epoch {self.epoch}: call dataset.set_epoch({epoch}) "
                "before iterating the resumed loader, as the saved run had (set to a later epoch, the loader reads "
                "that epoch whole)")
        self._worker_loaded = (epoch, position, batches)

    def check_state(self, state: object) -> tuple[int, int]:
        """Validate a saved state against this dataset; returns its (epoch, position)."""
        if not isinstance(state, Mapping):
            raise StateError(f"a loader state is a dict (from state_dict()), got {type(state).__name__}")
        version = state.get("version")
        if version == 1 and is_int(version):
            raise StateError(
                "this loader state was saved by an earlier datapipe (state version 1), which did not record the "
                "build of the cache it belongs to, so it cannot be checked against this cache; resume at the start "
                f"of its epoch with set_epoch({show(state.get('epoch'))}) instead (that epoch is then read whole)")
        if not is_int(version) or version not in (2, STATE_VERSION):
            raise StateError(f"unknown loader state version {show(version)}; this datapipe reads versions 2 and "
                             f"{STATE_VERSION} (a dict from StreamingDataset/DeviceLoader.state_dict())")
        # a version 2 state (no contents) is checked against the cache's build, not against what it holds
        named = STATE_KEYS if version == STATE_VERSION else STATE_KEYS[:-1]
        keys = named + (SHARD_STATE_KEYS if "order" in state else ())
        missing = [k for k in keys if k not in state]
        extra = [show(k) for k in state if k not in keys]
        if missing or extra:
            what = f"lacks {', '.join(missing)}" if missing else f"has unknown keys {', '.join(extra[:5])}"
            raise StateError(f"the loader state {what}; a version {int(version)} state holds exactly "
                             f"{', '.join(named)}: pass the dict state_dict() returned, unchanged")
        n = len(self.cache)
        epoch = check_int(state["epoch"], "the state's epoch", 0, ORDER_LIMIT - 1, error=StateError)
        seed = check_int(state["seed"], "the state's seed", 0, ORDER_LIMIT - 1, error=StateError)
        num_samples = check_int(state["num_samples"], "the state's num_samples", 0, error=StateError)
        shuffle = check_bool(state["shuffle"], "the state's shuffle", error=StateError)
        for key in [k for k in ("config_hash", "build_id", "contents") if k in named]:
            if not isinstance(state[key], str):
                raise StateError(f"the state's {key} must be a string, got {show(state[key])} "
                                 f"({type(state[key]).__name__})")
        build_id, config_hash = self._identity
        mismatch = lambda key, saved, mine: StateError(  # noqa: E731
            f"the saved state is for {key}={show(saved)}, this dataset has {show(mine)} (cache {self.cache.root}); "
            "resume with the same cache, seed and shuffle")
        for key, mine in (("build_id", build_id), ("config_hash", config_hash)):
            if state[key] != mine:
                raise mismatch(key, state[key], mine)
        # the same build of the same configuration, with other samples: the cache was rebuilt in place
        if ("contents" in state and state["contents"] != self._contents) or num_samples != n:
            was = (f"contents {show(state['contents'])}, now {self._contents}" if num_samples == n
                   else f"{num_samples:,} samples, now {n:,}" if num_samples < 10**18 else f"{show(num_samples)} samples, now {n:,}")
            raise StateError(f"the saved state is for other contents of cache {self.cache.root} ({was}): it was "
                             f"rebuilt in place from changed inputs since the state was saved, so its position would "
                             f"resume another order over other samples or labels; start its epoch again with "
                             f"set_epoch({epoch}) instead")
        if seed != self.seed:
            raise mismatch("seed", seed, self.seed)
        if shuffle != self.shuffle:
            raise mismatch("shuffle", shuffle, self.shuffle)
        self._check_state_order(state)
        position = check_int(state["position"], "the state's position", 0, n, error=StateError)
        step = self.batch_size * self.world_size
        if position < n and position % step:
            raise StateError(
                f"cannot resume at sample {position} of epoch {epoch} with world_size="
                f"{self.world_size} × batch_size={self.batch_size}: it is not a multiple of {step}. "
                "Resume with a global batch that divides the position (e.g. the saved one).")
        return epoch, position

    def _check_state_order(self, state: Mapping) -> None:
        """The state's order (and for "shards" its window and nodes) is this dataset's."""
        if "order" not in state:
            saved: tuple = ("global", self.window, self.nodes)
        else:
            if state["order"] != "shards":
                raise StateError(f"the state's order must be 'shards' (a global-order state has no order key), "
                                 f"got {show(state['order'])}")
            saved = ("shards", check_int(state["window"], "the state's window", 1, error=StateError),
                     check_int(state["nodes"], "the state's nodes", 1, error=StateError))
        for key, was, mine in zip(SHARD_STATE_KEYS, saved, (self.order, self.window, self.nodes), strict=True):
            if was != mine:
                raise StateError(f"the saved state is for {key}={show(was)}, this dataset has {show(mine)} "
                                 f"(cache {self.cache.root}); resume with the same order, window and nodes "
                                 "(nodes: WORLD_SIZE // LOCAL_WORLD_SIZE)")

    def close(self) -> None:
        """Close the cache's shard files in this process (and, for a cache in object storage, release its hold
        on the node's copies): see :meth:`Cache.close`. The dataset stays usable (a later epoch opens what it
        reads again); DataLoader workers hold files of their own, closed when they exit.
        ``with StreamingDataset(...) as ds:`` closes it at the end of the block."""
        self.cache.close()

    def __enter__(self) -> StreamingDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"StreamingDataset({str(self.cache.root)!r}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, seed={self.seed}, rank={self.rank}/{self.world_size}, "
                f"batches={self._epoch_batches()})")
