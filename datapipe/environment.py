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


def memory_limit() -> tuple[int, str]:
    """The most memory this process can have (0 where nothing says) and what sets it: the machine's memory, its
    control group's limit (a container's: cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes``), or the
    address space a ``ulimit -v`` leaves it beside what it has mapped already."""
    limits = [(physical_memory(), "this machine's memory")]
    for controller, name in (("", "memory.max"), ("memory", "memory.limit_in_bytes")):
        limit = _cgroup_value(controller, name)
        if limit is not None:
            limits.append((limit, f"the memory limit of this process's control group ({name}: a container's limit)"))
            break
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm", "rb") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            limits.append((max(1, soft - mapped), "the address space the process's limit (ulimit -v) leaves it"))
    except (ImportError, OSError, ValueError, IndexError):
        pass
    limits = [(value, what) for value, what in limits if value > 0]
    return min(limits) if limits else (0, "")


def _cgroup_value(controller: str, name: str) -> int | None:
    """The smallest number in control group file ``name`` of this process's group and the groups above it (a parent's
    limit holds for its children) in hierarchy ``controller`` ("" for v2); None where none has one (no such file, or
    "max": no limit, as a v1 value past 2**60 is)."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2) if line.count(":") >= 2 else ("", "-", "")
        if controller not in controllers.split(","):
            continue
        root = "/sys/fs/cgroup" + (f"/{controller}" if controller else "")
        parts = [p for p in group.split("/") if p]
        found = []
        for depth in range(len(parts), -1, -1):  # the group's own, each above it, the root (a container's namespace)
            try:
                with open(os.path.join(root, *parts[:depth], name), encoding="utf-8") as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 1 << 60:
                found.append(int(text))
        return min(found) if found else None
    return None


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
