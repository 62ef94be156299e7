"""The benchmark harness: ``datapipe bench``, ``datapipe demo`` and ``datapipe sample``.

Installed with the ``bench`` extra (``pip install "datapipe[bench]"``; the ``peers`` extra adds the
other loaders it compares against). Nothing in the core package imports it.

* :mod:`.harness` — the measurements and the report (:class:`BenchSpec`, :func:`run`, :func:`format_table`, :func:`plot`);
* :mod:`.peers` — today's loaders, on the same data with the same output;
* :mod:`.timing` — the one way a loader pass is timed;
* :mod:`.sample` — the ImageNet-like sample image folder;
* :mod:`.demo` — the whole way in one command.
"""

from __future__ import annotations

from .harness import BenchResult, BenchSpec, Measurement, describe_machine, format_table, measure_stages, plot, run

__all__ = ["BenchResult", "BenchSpec", "Measurement", "describe_machine", "format_table", "measure_stages", "plot", "run"]
