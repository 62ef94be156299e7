"""DeviceLoader: pinned, prefetched batches on the device, augmented there, with a stall meter.

Reader threads (``num_workers``) gather whole batches from the memory-mapped shards straight into a
ring of host buffers (pinned when the device is CUDA) — numpy's gathers and torch's kernels release
the GIL, so threads scale without the extra copy through shared memory that worker processes cost.
With ``num_workers=0`` there are no reader threads: each batch is read in the loop's thread when the
loop asks for it (for a debugger), and the stream, the state and the statistics are the same.

* On CUDA, the main thread copies each batch to the device with ``non_blocking=True`` on a side
  stream and records an event; the consuming stream waits on that event, and a host buffer is only
  refilled after its event has completed (the reader synchronises on it first). Conversion to
  float, layout (NCHW or channels_last), normalisation and augmentation all run on the device.
* On CUDA with a JPEG cache and a GPU JPEG decoder (:mod:`datapipe.gpu_decode`: nvImageCodec, else
  torchvision; ``DATAPIPE_GPU_DECODE=0`` turns it off), each reader thread copies its batch's
  compressed bytes out of the shards and decodes them on the GPU on a stream of its own, pads them
  into one batch there and records an event; the consuming stream waits on it, and the decoder's
  outputs are kept until a reader refilling the buffer has seen that event complete. Decoding in the
  readers (not the loop's thread) keeps the decoders' host-side work (parsing, Huffman decoding) in
  parallel with the training step and with each other, and prefetches decoded batches.
  ``loader.decode_path`` says which decoder runs: ``"cpu"``, ``"nvimgcodec"`` or ``"torchvision"``.
* On the CPU, each reader thread also augments its batch (one intra-op thread per reader, so the
  threads do not fight over cores), cropping and flipping on uint8 before converting to float.
  With a preset (``augment.train``/``eval``) the batch is not gathered at all: each sample's crop
  is resized straight out of the memory-mapped shard, so only the pixels a crop covers are read.

Order, resume and exactly-once come from the dataset (see :mod:`datapipe.partition`); the loader
records in the dataset's count the batches handed to the loop, so ``state_dict()`` never counts
prefetched batches, and a new epoch, a loaded state or a new iteration starts that count afresh.
One iteration runs at a time (the readers, the ring and the count are the loader's): beginning
another ends the running one, whose next batch raises :class:`IterationSupersededError`.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import numpy as np
import torch
from torch import nn

from ._threads import renew_after_fork
from .augment import BatchAugment, BatchFn, Convert, EvalAugment, TrainAugment
from .dataset import StreamingDataset, check_int
from .environment import memory_limit
from .errors import (
    MAX_SECONDS,
    ArgumentError,
    IterationSupersededError,
    allocation_failed,
    thread_start_failed,
)
from .gpu_decode import GpuJpegDecoder, jpeg_decoder, pad_batch
from .stats import StallMeter
from .text import show

if TYPE_CHECKING:
    from .cache import Cache, EncodedBatch

# A batch as a reader reads it: (images, labels int64 [B], index int64 [B]); the images are a uint8
# [B, H, W, 3] tensor, [H, W, 3] views of the shard files, or stored JPEG samples (decoded by the preset).
_Images: TypeAlias = "torch.Tensor | list[torch.Tensor] | EncodedBatch"
_ReadBatch = tuple[_Images, torch.Tensor, torch.Tensor]
# A batch as the loop yields it: (images, labels) or (images, labels, index).
_OutBatch = tuple[torch.Tensor, ...]
# A reader's result: its slot, the batch (read, or transformed when the reader transforms) and its seed.
_Result = tuple["_Slot", Any, int]


def _seed_for(seed: int, epoch: int, position: int) -> int:
    """The augmentation seed of the batch that starts at ``position`` of the epoch's order."""
    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch & 0xFFFFFFFF, int(position)]).generate_state(1)[0])


@dataclass
class _Slot:
    images: torch.Tensor  # uint8 [B, H, W, 3]
    labels: torch.Tensor  # int64 [B]
    index: torch.Tensor  # int64 [B]
    event: torch.cuda.Event | None = None  # CUDA event of the last copy out of this buffer
    params: dict | None = None  # per-sample crops of a padded batch of samples of varying shapes
    decoded: torch.cuda.Event | None = None  # CUDA event after the GPU decode (and padding) of the batch last read into this slot
    keep: list[torch.Tensor] | None = None  # that decode's outputs (a GPU decoder's own memory): kept until the event has completed
    held: bool = False  # handed to the loop as its raw uint8 batch: in use until that iteration asks for another or ends


class _OutputPool:
    """CPU output buffers, reused once nothing outside the pool references their memory.

    Allocating a fresh 150 MB float batch costs more than filling it (every page faults in), so
    on the CPU batches are written into pooled buffers. A buffer is handed out as a new view and
    reused only when its storage has no other user — a batch the loop still holds (or any view
    of it) is never overwritten.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: list[tuple[torch.Tensor, int]] = []  # (buffer, storage use count when idle)
        self.lock = threading.Lock()

    @staticmethod
    def _uses(t: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    def get(self, shape: tuple[int, ...], channels_last: bool) -> torch.Tensor | None:
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        try:
            with self.lock:
                for buf, idle in self.items:
                    if buf.shape == shape and buf.is_contiguous(memory_format=fmt) and self._uses(buf) == idle:
                        return buf[:]
                if len(self.items) < self.capacity:
                    buf = torch.empty(shape, dtype=torch.float32, memory_format=fmt)
                    self.items.append((buf, self._uses(buf)))
                    return buf[:]
        except AttributeError:  # pragma: no cover - a torch without storage use counts: no reuse
            return None
        return None


_LIVE: weakref.WeakSet[DeviceLoader] = weakref.WeakSet()


@atexit.register
def _close_live_loaders() -> None:
    """Stop every reader thread before the interpreter finalises.

    A daemon thread that is still running when Python finalises is ended the moment it next takes
    the GIL — and torch takes it while freeing a tensor, inside a ``noexcept`` destructor, so the
    process would abort ("terminate called without an active exception", exit code 134) whenever a
    reader was still freeing its last batch as the script ended. ``atexit`` runs before that point.
    """
    for loader in list(_LIVE):
        loader.close()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class DeviceLoader:
    """Iterate a :class:`StreamingDataset` as augmented batches on ``device``.

    Args:
        dataset: the streaming dataset (its batch size, shuffle, seed and rank are used).
        device: ``"cuda"``, ``"cuda:N"``, ``"cpu"`` or ``"auto"`` (CUDA when available).
        augment: the batch transform, which also sets the output's dtype, normalisation and memory
            layout: ``datapipe.augment.train(224)`` / ``eval(224)``, ``augment.convert(...)`` (no
            augmentation), None (``augment.convert()``: normalised float32 NCHW at the cache's
            size), or any ``nn.Module`` taking float [B, 3, H, W] in [0, 1] (its random state is
            seeded per batch; ``augment.convert(module=m)`` with the defaults).
        output: ``"float"`` (default) or ``"uint8"``: raw [B, H, W, 3] batches (no augment); on the
            CPU such a batch is a view of a reused buffer, valid until the next batch is requested.
        num_workers: reader threads; 0 reads each batch in the loop's thread when it is asked for
            (no threads at all: for a debugger), with the same batches, state and statistics.
        prefetch: batches read ahead of the loop, beyond one per reader (unused with 0 readers).
        log_every: log images/s and the waiting share every N batches (logger ``datapipe``).
        timeout: seconds to wait for one batch before raising (a stuck reader never hangs the loop);
            with ``num_workers=0`` the batch is read in the loop's own thread, which no timeout interrupts.

    Raises:
        ArgumentError: an argument of the wrong type or out of range (the message names it), or an
            augmentation whose output batches the loader may hold at once (one per reader, the prefetched and
            two more on the CPU; two on CUDA) are larger than the memory the process can have there (the
            machine's, a container's limit, what ``ulimit -v`` leaves; their size and what to lower named).

    When a batch cannot be made for want of memory all the same (the samples read, the augmentation's
    temporaries), torch's error (a ``RuntimeError``; ``torch.cuda.OutOfMemoryError`` on CUDA) is raised as it is,
    with a note naming the batch and what to lower.

    Iterating yields ``(images, labels)`` on the device — images float [B, 3, h, w], labels int64
    [B] — or ``(images, labels, indices)`` when the dataset has ``return_index=True``.
    """

    def __init__(self, dataset: StreamingDataset, /, *, device: str | torch.device = "auto",
                 augment: nn.Module | None = None, output: str = "float", num_workers: int = 2, prefetch: int = 2,
                 log_every: int = 0, timeout: float = 300.0) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise ArgumentError(f"DeviceLoader reads a datapipe.StreamingDataset, got {type(dataset).__name__}")
        self.num_workers = check_int(num_workers, "num_workers", 0, 1024)
        self.prefetch = check_int(prefetch, "prefetch", 0, 1024)
        if output not in ("float", "uint8"):
            raise ArgumentError(f"output must be 'float' or 'uint8', got {show(output)}")
        if output == "uint8" and augment is not None:
            raise ArgumentError("output='uint8' hands out raw batches; pass augment=None with it")
        if augment is not None and not (isinstance(augment, (nn.Module, BatchAugment)) or callable(augment)):
            raise ArgumentError(f"augment must be datapipe.augment.train/eval, an nn.Module or None, "
                                f"got {show(augment)} ({type(augment).__name__})")
        self.dataset = dataset
        self.device = _resolve_device(device)
        self.cuda = self.device.type == "cuda"
        # the batch transform (None with output="uint8"): a generic module is wrapped in a conversion
        self.augment: BatchAugment | None = None if output == "uint8" else _batch_transform(augment)
        if self.augment is not None:  # the largest batch there is: batch_size may exceed the samples (one eval batch)
            _check_batch_fits(self.augment, self._slot_rows(), self._held_batches(), self.device,
                              scratch=self._scratch_batches())
        self.output = output
        self.timeout = _positive_seconds(timeout)
        self.meter = StallMeter(log_every=check_int(log_every, "log_every", 0))
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        # Held by an iteration's step (from asking for a batch to handing it out) and while one begins: an
        # iteration begun in another thread waits for the running step to end before it takes the buffers
        # back, so two threads never fill one buffer, and the older iteration raises at its next step.
        self._step = threading.RLock()
        self._results: dict[tuple[int, int], _Result | _Failure] = {}
        self._slots: list[_Slot] = []
        self._free: list[_Slot] = []
        # Bumped when an iteration begins or ends, and by close(): jobs and results of any other
        # iteration are dropped.
        self._generation = 0
        self._busy = 0  # jobs reader threads are handling now (counted by the readers themselves)
        self._closed = False
        self._started = False
        self._forked_at = 0  # the generation a forked child began with (_after_fork): older iterations are the parent's
        self._pool = _OutputPool(self._num_slots() + 2)
        # On the CPU the readers also augment — unless the augmentation is a generic module, whose
        # random state is torch's global generator: that runs in the loop's thread, batch by batch.
        generic = isinstance(self.augment, Convert) and self.augment.module is not None
        self._reader_transforms = not self.cuda and not generic
        # A preset on the CPU crops each sample straight from the shard files (views into the page
        # cache): only the cropped pixels are read, and the batch is never gathered first.
        self._direct = not self.cuda and self.augment is not None and self.augment.takes_views
        cache = dataset.cache
        self._varied = cache.fixed_shape is None
        if self._varied and not isinstance(self.augment, (TrainAugment, EvalAugment)):
            raise ArgumentError(f"the samples of {cache.root} vary in shape (built with --fit short): pass "
                                "augment=datapipe.augment.train(size) or eval(size), which crop them to one size")
        # JPEG samples on the CPU: decoded in the reader threads, each for its own crop (see augment.decode)
        self._decodes = self._direct and cache.encoding == "jpeg"
        # JPEG samples on CUDA: decoded on the GPU by the reader threads when a decoder works here
        self._gpu: GpuJpegDecoder | None = None
        if self.cuda and cache.encoding == "jpeg":
            self._gpu = jpeg_decoder(self.device, host_threads=max(1, (os.cpu_count() or 1) // max(1, self.num_workers)))
        #: which decoder turns the cache's JPEG samples into pixels: "cpu", "nvimgcodec" or "torchvision" (None: raw samples)
        self.decode_path: str | None = None if cache.encoding != "jpeg" else "cpu" if self._gpu is None else self._gpu.name
        self._decode_streams = threading.local()  # each reader thread's CUDA stream for its GPU decodes
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        _LIVE.add(self)  # its reader threads are stopped at interpreter exit
        renew_after_fork(self, "_after_fork")

    # ----------------------------------------------------------------- public surface
    def __len__(self) -> int:
        """Batches of a whole epoch on this rank (the same on every rank), also while a resumed epoch is read,
        which yields those after the loaded position (see ``StreamingDataset.__len__``)."""
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (call before each epoch); a new epoch's state says nothing of it was read."""
        self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict:
        """The dataset's state after the batches the loop has received of the current epoch (never the
        prefetched ones): the start of the epoch after ``set_epoch`` to a new one or ``iter()``, the
        loaded position after ``load_state_dict`` until a batch arrives, the end once the last one has."""
        return self.dataset.state_dict(batches_consumed=self.dataset.batches_consumed)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; every field is checked first (see StreamingDataset.load_state_dict).
        Load it on every rank: a rank that starts elsewhere is refused when the epoch begins.

        Raises:
            StateError: a malformed state, or one for another cache, seed or shuffle.
        """
        self.dataset.load_state_dict(state)

    def stats(self) -> dict:
        """images/s, batches, and the share of wall time the loop waited for data."""
        return self.meter.stats()

    def __reduce__(self) -> tuple:
        """Refused in one line: pickle's own error names a lock, not the loader nor what to do."""
        raise TypeError(
            "a datapipe.DeviceLoader cannot be pickled or copied: its reader threads, pinned buffers and CUDA "
            "streams belong to the process that made it. Make it in the process that reads it (under ddp_spawn "
            "or multiprocessing's spawn, there: e.g. in LightningModule.train_dataloader()), from a "
            "StreamingDataset, which can be passed to another process")

    def close(self) -> None:
        """Stop the reader threads (also done when the loader is garbage-collected). An iteration
        running meanwhile (this thread's loop, or another's) raises at its next batch that the loader
        was closed."""
        if self._closed:
            return
        with self._cond:
            self._closed = True
            self._generation += 1  # a loop waiting for a batch wakes up and says the loader was closed
            self._cond.notify_all()
        self._stop_threads()
        for slot in self._slots:  # a GPU decode still running must not lose its decoder's memory
            if slot.decoded is not None:
                slot.decoded.synchronize()
                slot.decoded = slot.keep = None

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        """The end of ``with DeviceLoader(...) as loader:``: :meth:`close` (the dataset stays open)."""
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()

    # ----------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[_OutBatch]:
        """Begin an iteration of the current epoch, here and now (not at its first batch).

        One iteration runs at a time: the reader threads and the ring of host buffers are the
        loader's, and the state counts one stream of batches. Beginning another (``iter(loader)``
        again, or ``set_epoch``/``load_state_dict`` to another position) ends the running one: its
        next ``next()`` raises :class:`IterationSupersededError`.
        """
        if self._closed:
            raise RuntimeError("this DeviceLoader was closed")
        with self._step:
            self._start_threads()
            with self._cond:
                self._generation += 1  # queued jobs of an earlier iteration are skipped, not read
                gen = self._generation
            began = self.meter.begin()
            try:
                self._drain()
                order, bounds = self.dataset.begin_iteration()
            finally:  # the loop waited on the readers finishing the iteration this one replaces
                self.meter.add_wait(time.perf_counter() - began)
            return self._batches(gen, self.dataset.iteration, order, bounds)

    def _batches(self, gen: int, iteration: int, order: np.ndarray, bounds: np.ndarray) -> Iterator[_OutBatch]:
        ds = self.dataset
        epoch = ds.epoch
        n = len(bounds)
        submitted = 0
        held: _Slot | None = None
        try:
            for j in range(n):
                receipt = None  # counted as the loop's when handed over, and only then (see StreamingDataset.take_back)
                try:
                    with self._step:
                        self._check_current(gen, iteration)
                        if held is not None:  # the previous raw uint8 batch is released when the next is asked for
                            self._give_back(held)
                            held = None
                        started = self.meter.begin()
                        while submitted < n and self._free:
                            begin, end = bounds[submitted]
                            self._submit(gen, submitted, order[begin:end], self._free.pop(),
                                         _seed_for(ds.seed, epoch, begin))
                            submitted += 1
                        try:
                            (slot, batch, seed), waited = self._wait(gen, j, started)
                        except BaseException as exc:  # a timeout the loop may catch, a reader's error: it waited all the same
                            self.meter.add_wait(time.perf_counter() - started)
                            self._explain_out_of_memory(exc)
                            raise
                        try:
                            if self.cuda:
                                batch = self._on_device(slot, batch, seed)
                            elif not self._reader_transforms:  # a generic module: here, in order, one at a time
                                t = time.perf_counter()
                                batch = self._transform(batch, seed)
                                waited += time.perf_counter() - t  # the loop's time on data, like a wait
                        except (MemoryError, RuntimeError) as exc:
                            self._explain_out_of_memory(exc)
                            raise
                        if not self.cuda:
                            if self.output == "uint8":
                                held, slot.held = slot, True
                            else:
                                self._release(slot)
                        receipt = ds.receipt()
                        ds.note_received(iteration, j + 1)
                        self.meter.record(started, waited, int(batch[1].shape[0]))
                    yield batch
                except GeneratorExit:  # closed at the yield (a break): the loop had the batch
                    raise
                except BaseException:
                    if receipt is not None:
                        with self._step:
                            ds.take_back(receipt)
                    raise
            self.meter.finish()  # the loop asked for a batch after the last: its last step is over
            if not self._closed:  # every batch was delivered: a close() after the last one ends nothing
                self._check_current(gen, iteration)
        finally:
            self.meter.finish()  # ended (a break, an error): done with the last batch's step, if not already
            ds.end_iteration(iteration)
            if held is not None:  # the loop's batch (a newer iteration took back every buffer but this one)
                self._give_back(held)
            with self._cond:
                if self._generation == gen:
                    self._generation += 1  # queued jobs of an abandoned iteration are skipped, not read

    def _explain_out_of_memory(self, exc: BaseException) -> None:
        """Add to ``exc``, when it is an allocation that failed (in a reader or here), a note naming the batch and
        what to lower: torch's message names neither. The exception keeps its type (torch's RuntimeError, CUDA's
        OutOfMemoryError), which batch-size finders catch to retry with a smaller batch."""
        if not allocation_failed(exc) or any(note.startswith("datapipe:") for note in getattr(exc, "__notes__", ())):
            return
        rows = self._slot_rows()
        if self.augment is not None and self.augment.size:
            one, shape = _output_batch(self.augment, rows)
            scratch = self._scratch_batches()
            made = f", and {scratch} of float32 it converts" if scratch else ""
            what = (f"batches of {shape} ({one / 2**30:,.2f} GiB each; it holds up to {self._held_batches()}{made}, "
                    "beside the samples read and the augmentation's temporaries)")
            lower = f"the augmentation's size ({self.augment.size}) or the batch size"
        else:
            what, lower = f"batches of {rows} samples", "the batch size"
        limit = _device_memory(self.device)[1] or f"the memory of {self.device}"
        exc.add_note(f"datapipe: the DeviceLoader ran out of {limit} making {what}: lower {lower}"
                     f"{', or num_workers and prefetch' if not self.cuda else ''}")

    def _check_current(self, gen: int, iteration: int) -> None:
        """Raise when the loader was closed or a newer iteration began since this one did (only the
        newest runs)."""
        if self._closed:
            raise RuntimeError("datapipe: this DeviceLoader was closed (close()) while an iteration ran; "
                               "create a new one to read on")
        if self._generation != gen and gen < self._forked_at:
            raise IterationSupersededError(
                "datapipe: this iteration of the DeviceLoader began in the parent process, before this one was forked "
                "from it (its reader threads are not here); begin a new one in this process (for batch in loader)")
        if self._generation != gen:
            raise IterationSupersededError(
                "datapipe: this DeviceLoader was iterated again (iter(loader)) while this iteration ran, and only the "
                "newest iteration runs; to look at a batch inside the loop, keep one the loop received "
                "(e.g. images[:8].clone()) instead of calling next(iter(loader))")
        if self.dataset.iteration != iteration:
            raise IterationSupersededError(
                "datapipe: the loader's epoch or position changed (set_epoch, load_state_dict) or its dataset began "
                "another iteration while this one ran; only the newest iteration runs: begin one after them "
                "(for batch in loader)")

    # ----------------------------------------------------------------- plumbing
    def _num_slots(self) -> int:
        """Host buffers: one per reader plus the prefetched; without readers, the batch being read."""
        return self.num_workers + self.prefetch if self.num_workers else 1

    def _held_batches(self) -> int:
        """Output batches the loader may hold at once: on the CPU its pool (see :class:`_OutputPool`), on CUDA the one
        being made and the one the loop holds."""
        return self._num_slots() + 2 if not self.cuda else 2

    def _scratch_batches(self) -> int:
        """float32 batches made beside the output batches: on the CPU a preset of another dtype (bfloat16, float16)
        fills a pooled float32 buffer, then converts it, one in each reader at a time (see :class:`_OutputPool`)."""
        if self.cuda or self.augment is None or self.augment.dtype == torch.float32 or not _fills_out(self.augment):
            return 0
        return max(1, self.num_workers)

    def _slot_rows(self) -> int:
        """Samples a buffer holds: a batch never holds more than the cache does."""
        return max(1, min(self.dataset.batch_size, len(self.dataset.cache)))

    def _start_threads(self) -> None:
        """Make the host buffers and start the reader threads, once. Interrupted part-way (Ctrl-C), it
        leaves nothing behind: the threads started are stopped, and the next iteration starts afresh."""
        if self._started:
            return
        # On the CPU each reader runs torch with one intra-op thread (readers must not fight over the cores).
        # torch.set_num_threads also sets the process's default, which every thread that has not used torch's
        # pool yet (the training loop's, often) would take: the caller's count is put back once each reader
        # has taken its one (OpenMP keeps a thread's own count).
        single = not self.cuda and self.num_workers > 0
        before = torch.get_num_threads()  # this thread's count, fixed now
        ready = threading.Barrier(self.num_workers + 1) if single else None
        try:
            # decoded on the GPU, the samples never pass through the host buffers: only labels and indices do
            _ = self.dataset.cache.labels  # open the label map here, not in several threads at once
            self._slots = [self._new_slot() for _ in range(self._num_slots())]
            self._free = list(self._slots)
            for i in range(self.num_workers):
                t = threading.Thread(target=_reader_loop, args=(weakref.ref(self), self._jobs, ready),
                                     name=f"datapipe-reader-{i}", daemon=True)
                self._threads.append(t)  # before it starts: an interrupt between the two must not lose it
                try:
                    t.start()
                except RuntimeError as exc:
                    self._threads.pop()
                    raise (thread_start_failed(exc, "the DeviceLoader's reader threads") or exc) from None
            if ready is not None:
                ready.wait()
        except BaseException:
            if ready is not None:
                ready.abort()  # readers waiting at it go on to their job loop, where they are stopped
            self._stop_threads()
            self._slots.clear()
            self._free = []
            raise
        finally:
            if ready is not None:
                torch.set_num_threads(before)  # also when this thread still has it: the default is what changed
        self._started = True

    def _after_fork(self) -> None:
        """In a child made by fork: none of the parent's reader threads are here, so jobs queued for them would be
        waited on for ``timeout``, and a lock one of them held at the fork stays held. The child starts afresh:
        new locks, queue and host buffers (a parent's batch in one is the parent's), its own readers started by
        its first iteration."""
        self._cond = threading.Condition()
        self._step = threading.RLock()
        self._jobs = queue.SimpleQueue()
        self._threads = []
        self._results = {}
        self._slots, self._free = [], []
        self._busy = 0
        self._started = False
        self._generation += 1  # an iteration of the parent's, carried over in a generator, stops at its next step
        self._forked_at = self._generation  # ... saying so (see _check_current)
        self._pool = _OutputPool(self._pool.capacity)
        self._decode_streams = threading.local()
        self.meter.after_fork()

    def _new_slot(self) -> _Slot:
        """One host buffer of the ring (pinned on CUDA)."""
        b, shape = self._slot_rows(), (0, 0, 3) if self._gpu is not None else self._buffer_shape()
        pin = self.cuda
        return _Slot(images=torch.empty((b, *shape), dtype=torch.uint8, pin_memory=pin),
                     labels=torch.empty(b, dtype=torch.int64, pin_memory=pin),
                     index=torch.empty(b, dtype=torch.int64, pin_memory=pin))

    def _stop_threads(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            if t.ident is not None and t is not threading.current_thread():  # started; not the caller (__del__)
                t.join(timeout=5)
        self._threads.clear()
        self._jobs = queue.SimpleQueue()  # a thread that never started leaves its stop in the old one

    def _buffer_shape(self) -> tuple[int, int, int]:
        """The shape of a sample's row in the host buffers: the samples' own, or for samples of varying
        shapes the largest (a padded batch, uploaded whole to the GPU; unused on the CPU, which reads
        each sample at its own shape)."""
        cache = self.dataset.cache
        if cache.fixed_shape is not None:
            return cache.fixed_shape
        if not self.cuda or not len(cache):
            return (0, 0, 3)
        return (*cache.shape_range[1], 3)

    def _read_padded(self, indices: np.ndarray, slot: _Slot, seed: int) -> int:
        """Samples of varying shapes for the GPU: each copied into its row of the padded host buffer,
        their crops drawn from their own shapes (the device crops and resizes the batch at once)."""
        cache = self.dataset.cache
        n = len(indices)
        images = cache.read_samples(indices, slot.labels.numpy()[:n], slot.index.numpy()[:n])
        rows = slot.images.numpy()
        for i, x in enumerate(images):
            rows[i, : x.shape[0], : x.shape[1]] = x
        shapes = torch.from_numpy(cache.shapes[slot.index.numpy()[:n]])
        assert isinstance(self.augment, (TrainAugment, EvalAugment))
        slot.params = self.augment.sample(n, shapes[:, 0], shapes[:, 1], seed)
        return n

    def _decode_on_gpu(self, indices: np.ndarray, slot: _Slot, seed: int) -> tuple[int, torch.Tensor]:
        """JPEG samples decoded on the GPU on this thread's stream, stacked or padded into one uint8
        [n, H, W, 3] batch there; an event marks the end of that work. Crops of samples of varying shapes
        are drawn from their own shapes, as :meth:`_read_padded` draws them."""
        assert self._gpu is not None
        encoded = self.dataset.cache.read_encoded(indices, slot.labels.numpy(), slot.index.numpy())
        n = len(encoded)
        stream = self._decode_stream()
        with torch.cuda.stream(stream):
            decoded = self._gpu.decode([e.data for e in encoded], [(e.height, e.width) for e in encoded],
                                       [e.where for e in encoded], self.device, stream)
            empty = (0, *self._buffer_shape())  # a rank's empty last batch
            images = pad_batch(decoded) if n else torch.empty(empty, dtype=torch.uint8, device=self.device)
            event = torch.cuda.Event(blocking=True)  # a thread that waits for it sleeps instead of spinning
            event.record(stream)
        slot.decoded, slot.keep = event, decoded
        if self._varied:
            assert isinstance(self.augment, (TrainAugment, EvalAugment))
            heights = torch.tensor([e.height for e in encoded], dtype=torch.int64)
            widths = torch.tensor([e.width for e in encoded], dtype=torch.int64)
            slot.params = self.augment.sample(n, heights, widths, seed)
        return n, images

    def _decode_stream(self) -> torch.cuda.Stream:
        """This thread's stream for GPU decodes (one per reader, so their decodes overlap)."""
        stream = getattr(self._decode_streams, "stream", None)
        if stream is None:
            stream = self._decode_streams.stream = torch.cuda.Stream(device=self.device)
        return stream

    def _submit(self, gen: int, j: int, indices: np.ndarray, slot: _Slot, seed: int) -> None:
        if self.num_workers:
            self._jobs.put((gen, j, indices, slot, seed))
        else:  # no reader threads: read it here, now (the loop asked for it)
            self._handle((gen, j, indices, slot, seed))

    def _release(self, slot: _Slot) -> None:
        self._free.append(slot)

    def _give_back(self, slot: _Slot) -> None:
        """The loop is done with its raw uint8 batch: the buffer goes back to the ring, unless a newer iteration
        replaced it meanwhile (see :meth:`_drain`; it is then freed with the last view of it)."""
        with self._cond:  # never between a newer iteration's _drain deciding which buffers it takes and taking them
            slot.held = False
            if any(slot is mine for mine in self._slots):
                self._free.append(slot)

    def _wait(self, gen: int, j: int, started: float) -> tuple[_Result, float]:
        deadline = started + self.timeout
        with self._cond:
            while (gen, j) not in self._results:
                if self._generation != gen:  # a newer iteration dropped this one's jobs: they never arrive
                    self._check_current(gen, self.dataset.iteration)
                if not self.num_workers:  # read in this thread just now: a missing result never arrives later
                    raise RuntimeError(f"datapipe: batch {j} of epoch {self.dataset.epoch} was read in the loop's "
                                       "thread (num_workers=0) but not delivered")
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"datapipe: batch {j} of epoch {self.dataset.epoch} did not arrive within "
                                       f"{self.timeout:g} s; a reader thread is stuck (slow storage?)")
                self._cond.wait(left)
            result = self._results.pop((gen, j))
        waited = time.perf_counter() - started
        if isinstance(result, _Failure):
            raise result.exc
        return result, waited

    def _drain(self) -> None:
        """Wait for the readers to finish the jobs of an abandoned iteration they began, then take back
        the buffers (its jobs still queued are skipped: their generation is gone) — all but the one its
        loop may still be reading, a raw uint8 batch (an iterator kept, or another thread's loop): that one
        leaves the ring, a new buffer takes its place, and it is freed when nothing views it any more."""
        deadline = time.perf_counter() + self.timeout
        with self._cond:
            while self._busy:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError("datapipe: reader threads did not finish the previous iteration")
                self._cond.wait(left)
            self._results.clear()
            self._slots = [slot if not slot.held else self._new_slot() for slot in self._slots]
            self._free = list(self._slots)

    def _handle(self, job: tuple[int, int, np.ndarray, _Slot, int]) -> None:
        """Read (and on the CPU, augment) one batch in a reader thread."""
        gen, j, indices, slot, seed = job
        # A reader counts the job it handles (the loop's own thread, num_workers=0, need not): never
        # the loop, which a Ctrl-C may stop between any two of its steps.
        counted = self.num_workers > 0
        with self._cond:
            if gen != self._generation:  # of an abandoned iteration: its buffer is another's now
                return
            if counted:
                self._busy += 1
        try:
            if slot.event is not None:
                slot.event.synchronize()  # the GPU has finished copying this buffer out
                slot.event = None
            if slot.decoded is not None:
                slot.decoded.synchronize()  # the last GPU decode into this slot is done: its outputs may go
                slot.decoded = None
            slot.keep = None
            cache = self.dataset.cache
            mapped = False
            slot.params = None
            images: _Images
            if self._gpu is not None:  # the stored JPEG bytes, decoded on the GPU into one batch there
                n, on_gpu = self._decode_on_gpu(indices, slot, seed)
                images = on_gpu
            elif self._decodes:  # the stored JPEG bytes: decoded per sample for its crop by the preset
                images = cache.read_encoded(indices, slot.labels.numpy(), slot.index.numpy())
                n = len(images)
            elif self._direct:  # views of the shard files' maps when only the guarded kernels read them
                assert isinstance(self.augment, BatchAugment)
                mapped = reads_mapped(cache, self.augment)
                images = cache.sample_views(indices, slot.labels.numpy(), slot.index.numpy(), out=slot.images,
                                            mapped=mapped)
                n = len(images)
            elif self._varied:
                n = self._read_padded(indices, slot, seed)
                images = slot.images[:n]
            else:
                n = cache.read_batch(indices, slot.images.numpy(), slot.labels.numpy(), slot.index.numpy())
                images = slot.images[:n]
            read: _ReadBatch = (images, slot.labels[:n], slot.index[:n])
            batch: _ReadBatch | _OutBatch = read
            if self._reader_transforms:
                # a shard file that shrank under a crop's read is an error naming it
                with cache.mapped_reads(slot.index[:n].numpy()) if mapped else contextlib.nullcontext():
                    batch = self._transform(read, seed)
            result: _Result | _Failure = (slot, batch, seed)
        except BaseException as exc:  # noqa: BLE001 - delivered to the training loop
            result = _Failure(exc)
        with self._cond:
            if counted:
                self._busy -= 1
            if gen == self._generation:
                self._results[(gen, j)] = result
            self._cond.notify_all()

    def _on_device(self, slot: _Slot, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seed: int) -> _OutBatch:
        images, labels, index = batch
        with torch.cuda.stream(self._copy_stream):
            if not images.is_cuda:  # decoded on the GPU already otherwise (see _decode_on_gpu)
                images = images.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            index = index.to(self.device, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # the reader waiting for it sleeps instead of spinning
            event.record(self._copy_stream)
        slot.event = event  # the reader refilling this buffer waits for the copy first
        params, slot.params = slot.params, None
        decoded = slot.decoded  # read before the slot goes back: only this thread hands slots to readers
        self._release(slot)
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        if decoded is not None:
            current.wait_event(decoded)  # the reader's GPU decode of this batch
        for t in (images, labels, index):
            t.record_stream(current)  # allocated on the copy stream (or a reader's decode stream), used on this one
        return self._transform((images, labels, index), seed, on_device=True, params=params)

    def _out_buffer(self, n: int, aug: BatchAugment) -> torch.Tensor | None:
        """A reused float32 buffer for ``n`` outputs of ``aug`` (CPU), in its memory layout."""
        h, w = aug.output_size(*self._buffer_shape()[:2])
        buf = self._pool.get((self._slot_rows(), 3, h, w), aug.channels_last)
        return None if buf is None else buf[:n]

    def _transform(self, batch: _ReadBatch, seed: int, on_device: bool = False,
                   params: dict[str, torch.Tensor] | None = None) -> _OutBatch:
        images, labels, index = batch
        if self.augment is None:  # output="uint8"
            out = cast(torch.Tensor, images)  # the gathered uint8 batch
        else:
            buf = None if on_device or not _fills_out(self.augment) else self._out_buffer(len(images), self.augment)
            if self._decodes:  # stored JPEG samples (the reader's CPU path)
                assert isinstance(self.augment, (TrainAugment, EvalAugment))
                out = self.augment.decode(cast("EncodedBatch", images), seed=seed, out=buf)
            elif params is not None:  # a padded batch of samples of varying shapes, with their crops
                out = self.augment(images, seed=seed, params=params)
            else:
                out = self.augment(images, seed=seed, out=buf)
        if not on_device and self.output != "uint8":
            labels = labels.clone()  # the host buffer is reused; the batch the loop holds must not change
            index = index.clone()
        return (out, labels, index) if self.dataset.return_index else (out, labels)


def _reader_loop(ref: weakref.ref[DeviceLoader], jobs: queue.SimpleQueue, ready: threading.Barrier | None) -> None:
    """A reader thread. It holds the loader only while handling a job, so an unused loader is
    garbage-collected (which stops its threads). With ``ready`` (the CPU), it takes one intra-op thread
    and then waits at it for the others (the loader then puts the process's default back)."""
    if ready is not None:
        torch.get_num_threads()  # torch sets up this thread's count at its first use: before ours, not after
        torch.set_num_threads(1)
        with contextlib.suppress(threading.BrokenBarrierError):  # the start was interrupted: stopped below
            ready.wait()
    while True:
        job = jobs.get()
        if job is None:
            return
        loader = ref()
        if loader is None:
            return
        loader._handle(job)
        del loader


def _resolve_device(device: str | torch.device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise ArgumentError(f"device must be 'cuda', 'cuda:N', 'cpu' or 'auto', got {show(device)} ({type(device).__name__})")
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ArgumentError(f"device must be 'cuda', 'cuda:N', 'cpu' or 'auto', got {show(device)} "
                            f"({' '.join(str(exc).split())[:80]})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ArgumentError(f"device must be 'cuda', 'cuda:N', 'cpu' or 'auto', got {show(device)}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ArgumentError(f"device={str(device)!r} but CUDA is not available here; use device='cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ArgumentError(f"device={str(device)!r} but this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "cuda" and dev.index is None:  # "cuda" is the current device: named by its index, as tensors name it
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _device_memory(device: torch.device) -> tuple[int, str]:
    """Bytes of memory ``device`` has in all, and what they are (for the CPU: the most this process can have, see
    :func:`memory_limit`); 0 where it cannot be told."""
    if device.type != "cuda":
        return memory_limit()
    try:
        return int(torch.cuda.get_device_properties(device).total_memory), f"the memory of {device}"
    except (RuntimeError, AttributeError):
        return 0, ""


def _check_batch_fits(aug: BatchAugment, batch_size: int, batches: int, device: torch.device, *,
                      scratch: int = 0) -> None:
    """ArgumentError when the ``batches`` output batches of ``aug`` (a fixed size) the loader may hold at once, and the
    ``scratch`` float32 batches it converts them from, are larger than ``device``'s memory: torch's own error for such
    an allocation ("can't allocate memory", "Storage size calculation overflowed"), or the kernel's out-of-memory kill,
    names neither the size nor what to change."""
    if not aug.size:
        return
    one, shape = _output_batch(aug, batch_size)
    wide = batch_size * 3 * aug.size * aug.size * 4  # a float32 batch
    total = one * batches + wide * scratch
    have, what = _device_memory(device)
    if have and total > have:
        made = f" and {scratch} float32 batches it converts them from" if scratch else ""
        raise ArgumentError(f"the loader holds up to {batches} output batches of {shape} ({one / 2**30:,.2f} GiB each)"
                            f"{made}, {total / 2**30:,.1f} GiB in all, more than the {have / 2**30:,.1f} GiB of {what}: "
                            f"lower the augmentation's size ({aug.size}) or the batch size"
                            f"{', or num_workers and prefetch' if device.type != 'cuda' else ''}")


def _output_batch(aug: BatchAugment, rows: int) -> tuple[int, str]:
    """The bytes of one output batch of ``rows`` samples of ``aug`` (a fixed size), and its shape and dtype in words."""
    assert aug.size
    itemsize = torch.empty((), dtype=aug.dtype).element_size()
    return rows * 3 * aug.size * aug.size * itemsize, f"{rows} x 3 x {aug.size} x {aug.size} {str(aug.dtype)[6:]}"


def reads_mapped(cache: Cache, aug: BatchAugment) -> bool:
    """Whether ``aug`` may read ``cache``'s samples on the CPU as views of the shard files' maps (see
    ``Cache.sample_views``): raw samples, mapped, and a preset whose checks hold for the smallest sample."""
    if not cache.mapped or cache.encoding != "raw" or not len(cache):
        return False
    return aug.reads_in_place(*cache.shape_range[0])


def _batch_transform(augment: BatchFn | None) -> BatchAugment:
    """The loader's batch transform: a BatchAugment as it is, None as the plain conversion, a
    generic module wrapped in one (it gets [0, 1] floats; the conversion normalises its output)."""
    if augment is None:
        return Convert()
    if isinstance(augment, BatchAugment):
        return augment
    return Convert(module=augment)


def _fills_out(aug: BatchAugment) -> bool:
    """Whether ``aug`` writes into the output buffer it is handed (else the buffer would be taken for nothing)."""
    return not isinstance(aug, Convert) or (aug.normalize and aug.module is None)


def _positive_seconds(timeout: float) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
            or not math.isfinite(timeout) or not 0 < timeout <= MAX_SECONDS:
        raise ArgumentError(f"timeout must be a positive number of seconds, at most {MAX_SECONDS:,.0f} (the longest "
                            f"wait the system takes), got {show(timeout)}")
    return float(timeout)
