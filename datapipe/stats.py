"""The data-stall meter: how long the training loop waited for each batch, and images/s."""

from __future__ import annotations

import logging
import time
from collections import deque

log = logging.getLogger("datapipe")


class StallMeter:
    """Counts batches, images and the time the loop spent blocked waiting for data.

    ``wait_share`` is waiting time over wall time since the first batch was asked for: 0 means the
    loop never waited (the model is the bottleneck), values near 1 mean the loop is starved. Time
    the loop's own thread spends on the data (a generic augmentation module on the CPU runs there)
    counts as waiting.

    The wall time runs until the loop is done with the last batch it received — when it asks for
    the next one, or, where it has not asked again, when :meth:`stats` is called — so N batches
    count N steps of the loop's work, the last one's too (``images_per_s`` is at most
    ``batch / step time``). Call :meth:`stats` right after the loop: the time until then counts as
    the last batch's step.
    """

    def __init__(self, *, log_every: int = 0, window: int = 50) -> None:
        self.log_every = int(log_every)
        self.recent: deque[tuple[float, float, int]] = deque(maxlen=window)  # (wait, interval, images)
        self.reset()

    def reset(self) -> None:
        self.batches = 0
        self.images = 0
        self.wait = 0.0
        self.first: float | None = None
        self.last: float | None = None  # when the last batch was received
        self.done: float | None = None  # when the loop was last known done with the batches received
        self.recent.clear()

    def begin(self) -> float:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if self.last is not None:  # the loop came back for more: done with the last batch's step
            self.done = now
        return now

    def finish(self) -> None:
        """The loop is done with the last batch it received (it asked for one more, and the epoch had none)."""
        if self.last is not None and (self.done is None or self.done <= self.last):
            self.done = time.perf_counter()

    def record(self, started: float, waited: float, images: int) -> None:
        now = time.perf_counter()
        interval = now - (self.last if self.last is not None else started)
        self.last = now
        self.batches += 1
        self.images += images
        self.wait += waited
        self.recent.append((waited, interval, images))
        if self.log_every and self.batches % self.log_every == 0:
            s = self._figures(now)  # mid-run: up to this batch, without its step (nothing is frozen)
            log.info("datapipe: %d batches, %.0f img/s, waiting %.1f%% of the time (last %d: %.0f img/s, %.1f%%)",
                     s["batches"], s["images_per_s"], 100 * s["wait_share"], s["recent"]["batches"],
                     s["recent"]["images_per_s"], 100 * s["recent"]["wait_share"])

    def stats(self) -> dict:
        """batches, images, seconds, images/s, wait_s and wait_share since the first batch was asked for
        (until the loop was done with the last batch), and the same over the ``window`` latest batches."""
        self.finish()  # where the loop has not asked again: its last step ended by now
        return self._figures(self.done)

    def _figures(self, end: float | None) -> dict:
        wall = (end - self.first) if self.first is not None and end is not None else 0.0
        r_wait = sum(w for w, _, _ in self.recent)
        r_wall = sum(i for _, i, _ in self.recent)
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
