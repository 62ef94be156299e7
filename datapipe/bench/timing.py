"""The one way the benchmarks time a loader: images, wall seconds and CPU seconds of a pass."""

from __future__ import annotations

import contextlib
import resource
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..dataset import StreamingDataset


class Pass(NamedTuple):
    """One timed pass over a loader."""

    images: int
    seconds: float  # wall time
    cpu_seconds: float  # this process, its workers and its reaped children


def timed_pass(loader: Iterable[Sequence[torch.Tensor]], batches: int | None = None, *, images: int | None = None,
               step_s: float = 0.0, sync: Callable[[], object] | None = None) -> Pass:
    """Iterate ``loader`` for ``batches`` batches and, with ``images``, until that many images came (a loader
    whose workers each end an epoch with a partial batch needs more batches for them), over as many epochs as
    that takes (each iteration of the loader is one epoch), or, where ``batches`` is None, to its end: one epoch.

    ``step_s`` sleeps after each batch, as a model step would; ``sync`` (e.g.
    ``torch.cuda.synchronize``) is called before the clock stops so queued device work counts. A
    datapipe loader (a StreamingDataset, or a DeviceLoader or DataLoader over one) moves to its next
    epoch before each pass, as a training loop does with ``set_epoch``.
    """
    dataset = _streaming_dataset(loader)
    seen, done, empty = 0, 0, 0

    def enough() -> bool:
        return batches is not None and done >= batches and (images is None or seen >= images)

    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    while empty < 2:  # two empty epochs in a row: the loader yields nothing (more), or batches without images
        before = seen
        if dataset is not None:
            dataset.set_epoch((dataset.epoch + 1) % (1 << 32))
        for batch in loader:
            seen += int(batch[0].shape[0])
            done += 1
            if step_s:
                time.sleep(step_s)
            if enough():
                break
        if batches is None or enough():
            break
        empty = empty + 1 if seen == before else 0
    if sync:
        sync()
    seconds = time.perf_counter() - t0
    return Pass(seen, seconds, cpu_seconds() - cpu0)


def _streaming_dataset(loader: object) -> StreamingDataset | None:
    """The datapipe StreamingDataset that ``loader`` iterates (itself or its ``dataset``), or None."""
    from ..dataset import StreamingDataset

    for candidate in (loader, getattr(loader, "dataset", None)):
        if isinstance(candidate, StreamingDataset):
            return candidate
    return None


def timeit(fn: Callable[[], object], *, min_time: float = 0.3, max_reps: int = 50) -> float:
    """Seconds per call of ``fn`` (after one warm-up call)."""
    fn()
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time or reps >= max_reps:
            return elapsed / reps


def cpu_seconds() -> float:
    """CPU seconds of this process, its live worker processes and its reaped children. This process's own
    (its reader threads) come from its CPU clock, to the microsecond: /proc, which psutil reads, counts in
    ticks of 10 ms, more than a short pass of a fast loader takes (it read 0.0). Live children are only
    known in ticks.

    The clock leaves out what measuring costs: walking /proc for the live children (and importing psutil
    the first time) takes milliseconds of this process's CPU, as much as a short pass itself, and is
    subtracted from this process's share, so a pass is charged for its own work only."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = _live_children_cpu()
    with _overhead_lock:
        overhead = _overhead
    return time.process_time() - overhead + live + kids.ru_utime + kids.ru_stime


_overhead = 0.0  # this process's CPU seconds spent finding its live children, never charged to a pass
_overhead_lock = threading.Lock()


def _live_children_cpu() -> float:
    """CPU seconds of this process's live descendants (worker processes), in /proc's ticks. What finding
    them costs the calling thread is added to ``_overhead``."""
    global _overhead
    t0 = time.thread_time()
    try:
        import psutil

        total = 0.0
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):  # exited meanwhile
                total += sum(child.cpu_times()[:2])
        return total
    finally:
        spent = time.thread_time() - t0
        with _overhead_lock:
            _overhead += spent


def settle(timeout: float = 10.0) -> None:
    """Wait until the previous loader's worker processes have exited (or idle), so that no system is
    timed while another one's teardown still uses the cores."""
    import gc

    gc.collect()
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:  # helpers that stay (a resource tracker) idle: no wait
        before = _live_children_cpu()
        time.sleep(0.1)
        if _live_children_cpu() - before < 0.01:
            return
