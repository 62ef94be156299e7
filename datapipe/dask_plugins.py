"""Dask worker plugins of the build (imported only when a build starts a cluster)."""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING

from distributed.diagnostics.plugin import WorkerPlugin

if TYPE_CHECKING:
    from distributed import Worker


class IgnoreSigint(WorkerPlugin):
    """The LocalCluster's workers ignore SIGINT.

    Ctrl-C in a terminal reaches every process of the foreground group, and each worker would print
    a KeyboardInterrupt traceback. The build's own process handles it and stops the workers instead.
    Registered as a plugin, so a worker restarted during the build ignores it too.
    """

    idempotent = True

    def setup(self, worker: Worker) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
