"""What ``datapipe info --env`` and the benchmark report about this machine's software."""

from __future__ import annotations

import os
import platform


def physical_memory() -> int:
    """Bytes of memory on this machine (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def environment() -> dict:
    """Versions of datapipe, Python and the libraries it uses, and the active decoders and CPU kernels."""
    from . import __version__, native, samples
    from .codecs import decoder_info

    env = {"datapipe": __version__, "python": platform.python_version(), "platform": platform.platform(),
           "cpus": os.cpu_count(), "decoders": decoder_info(), "cpu_kernel": native.describe(),
           "jpeg_crop_decoder": samples.describe_decoder()}
    for name in ("numpy", "torch", "kornia", "zarr", "dask", "distributed", "bokeh"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001
            env[name] = f"unavailable ({type(exc).__name__})"
    return env
