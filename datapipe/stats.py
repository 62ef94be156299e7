"""The data-stall meter: how long the training loop waited for each batch, and images/s."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

log = logging.getLogger("datapipe")


class StallMeter:
    """Counts batches, images and the time the loop spent blocked waiting for data.

    ``wait_share`` is waiting time over wall time since the first batch was asked for: 0 means the
    loop never waited (the model is the bottleneck), values near 1 mean the loop is starved. Time
    the loop's own thread spends on the data counts as waiting: a generic augmentation module on the
    CPU runs there, an iteration begun while the readers finish the one it replaces waits for them,
    and a wait that ended in an error (a timeout the loop caught) was a wait too.

    The wall time runs until the loop is done with the last batch it received — when it asks for
    the next one, or ends the iteration (a ``break``), or, where it has done neither, when
    :meth:`stats` is first called after that batch — so N batches count N steps of the loop's work,
    the last one's too (``images_per_s`` is at most ``batch / step time``). :meth:`stats` records only
    when it was first asked after the latest batch (that step's end, until the loop says): called in the
    loop's body (a live meter) it changes none of the loop's figures, and it may be called from another
    thread.
    """

    def __init__(self, *, log_every: int = 0, window: int = 50) -> None:
        self.log_every = int(log_every)
        self.recent: deque[tuple[float, float, int]] = deque(maxlen=window)  # (wait, interval, images)
        self._lock = threading.Lock()
        self.reset()

    def after_fork(self) -> None:
        """In a child made by fork: a lock held by a thread of the parent at the fork stays held; made anew."""
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.batches = 0
            self.images = 0
            self.wait = 0.0
            self.pending = 0.0  # waited outside a batch's request (see add_wait): told with the next batch's
            self.first: float | None = None
            self.last: float | None = None  # when the last batch was received
            self.done: float | None = None  # when the loop was done with the batches received, when known
            self.asked: float | None = None  # when stats() was first called after the last batch (done unknown)
            self.waited: float | None = None  # when the latest wait outside a delivered batch ended (add_wait)
            self.recent.clear()

    def begin(self) -> float:
        """The loop asks for data now (a batch, or an iteration): done with the last batch's step."""
        with self._lock:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
            if self.last is not None:  # the loop came back for more: done with the last batch's step
                self.done = now
            return now

    def add_wait(self, seconds: float) -> None:
        """The loop's thread was blocked on data for ``seconds`` outside a delivered batch's wait: beginning an
        iteration (the readers finishing the one it replaces), or a wait that ended in an error."""
        with self._lock:
            self.wait += seconds
            self.pending += seconds
            self.waited = time.perf_counter()  # the wall time runs at least to here: no batch may follow

    def finish(self) -> None:
        """The loop is done with the last batch it received (it asked for one more, and the epoch had none, or it
        ended the iteration)."""
        with self._lock:
            if self.last is not None and (self.done is None or self.done <= self.last):
                self.done = time.perf_counter()

    def record(self, started: float, waited: float, images: int) -> None:
        with self._lock:
            now = time.perf_counter()
            # since the last batch arrived (any wait between is inside), or for the first: its request and the
            # wait before it outside a batch (the iteration's beginning)
            interval = now - self.last if self.last is not None else now - started + self.pending
            self.last = now
            self.batches += 1
            self.images += images
            self.wait += waited
            self.recent.append((waited + self.pending, interval, images))
            self.pending = 0.0
            if not (self.log_every and self.batches % self.log_every == 0):
                return
            s = self._figures(now)  # mid-run: up to this batch, without its step (nothing is frozen)
        log.info("datapipe: %d batches, %.0f img/s, waiting %.1f%% of the time (last %d: %.0f img/s, %.1f%%)",
                 s["batches"], s["images_per_s"], 100 * s["wait_share"], s["recent"]["batches"],
                 s["recent"]["images_per_s"], 100 * s["recent"]["wait_share"])

    def stats(self) -> dict:
        """batches, images, seconds, images/s, wait_s and wait_share since the first batch was asked for
        (until the loop was done with the last batch), and the same over the ``window`` latest batches
        (their waits and steps, the latest's step too)."""
        with self._lock:
            end = self.done
            if self.last is not None and (end is None or end <= self.last):  # the last step's end is not known yet
                if self.asked is None or self.asked <= self.last:
                    self.asked = time.perf_counter()  # it ended by now: later calls give the same figures
                end = self.asked
            return self._figures(end)

    def _figures(self, end: float | None) -> dict:
        if self.waited is not None and (end is None or end < self.waited):
            end = self.waited  # waits that ended in an error after the last batch (or with none): waited all the same
        wall = (end - self.first) if self.first is not None and end is not None else 0.0
        r_wait = sum(w for w, _, _ in self.recent) + self.pending
        r_wall = sum(i for _, i, _ in self.recent)
        if self.recent and end is not None and self.last is not None:
            r_wall += max(0.0, end - self.last)  # the latest batch's step (and any wait since)
        elif not self.recent and end is not None and self.first is not None:
            r_wall = end - self.first  # no batch yet: waits that ended in an error, all of the time so far
        r_img = sum(n for _, _, n in self.recent)
        return {
            "batches": self.batches,
            "images": self.images,
            "seconds": wall,
            "images_per_s": self.images / wall if wall > 0 else 0.0,
            "wait_s": self.wait,
            "wait_share": min(1.0, self.wait / wall) if wall > 0 else 0.0,
            "recent": {
                "batches": len(self.recent),
                "images_per_s": r_img / r_wall if r_wall > 0 else 0.0,
                "wait_share": min(1.0, r_wait / r_wall) if r_wall > 0 else 0.0,
            },
        }
