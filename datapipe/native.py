"""The optional compiled CPU kernels (``datapipe/_native.c``), called through ctypes.

* :class:`Converter` turns one uint8 RGB image (or a crop of one) into normalised float32 — planar
  (NCHW) or interleaved (channels_last), mirrored on request — in a single pass, where torch needs a
  converting copy and a broadcast multiply-add whose strided loop does not vectorise: ~0.04 against
  ~0.12 ms for a 224² sample here.
* :func:`resize` is the antialiased bilinear resize of uint8 RGB, bit-identical to torch's
  (``F.interpolate(..., mode="bilinear", antialias=True)`` on uint8), reading a crop in place:
  ~0.10 against ~0.17 ms for the 340² -> 256² of a build, ~0.05 against ~0.07 ms for the loader's
  crops to 224².
* :func:`jitter` runs torchvision's ColorJitter operations (brightness, contrast, saturation, hue) on
  float images in place with torchvision's float32 arithmetic: ~0.3 against Kornia's ~4.7 ms for the
  hue of a 224² image here, ~0.2 against ~0.8 ms for contrast or saturation.
* Guarded reads of memory-mapped files: :class:`Mapping` maps a shard file, :func:`gather` copies
  samples out of it, and the resize and conversion above read their source under the same guard. A
  page that vanished under the read (the file was truncated) raises :class:`~datapipe.errors.MappedReadError`
  instead of killing the process with SIGBUS; every other SIGBUS goes on to the handler installed
  before (Python's faulthandler, or the default action). :func:`guard_available` says whether the
  guard is in place; the cache reads through memory maps only then, and with positioned reads
  otherwise.

``pip install`` builds it when a C compiler is present; the extension is optional, so an install
without a compiler still succeeds and the augment presets use the torch kernels, which give the
same values (the tests compare the two). ctypes releases the GIL for each call, so the loader's
reader threads convert in parallel. ``DATAPIPE_NATIVE=0`` (or off, false, no) turns it off; ``datapipe info --env``
says whether it is active.

Example:
    >>> import torch
    >>> from datapipe import native
    >>> conv = native.converter((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    >>> out = torch.empty(3, 2, 2)
    >>> conv is None or conv(torch.full((2, 2, 3), 255, dtype=torch.uint8), out, flip=False) or out.max().item()
    1.0
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .errors import MappedReadError

if TYPE_CHECKING:  # torch is imported by the loader's callers, never here: a build's workers only resize
    import torch

ABI = 5  # must match DATAPIPE_NATIVE_ABI in _native.c


OFF = ("0", "off", "false", "no")
ON = ("", "1", "on", "true", "yes", "auto")


def switched_off() -> str | None:
    """Why ``DATAPIPE_NATIVE`` turns the compiled kernels off (its value, one of OFF), or None when it does not.
    A value that is neither OFF nor ON leaves them on, and says so once: it is never taken silently."""
    raw = os.environ.get("DATAPIPE_NATIVE", "1").strip().lower()
    if raw in OFF:
        return f"DATAPIPE_NATIVE={raw}"
    if raw not in ON:
        _warn_unknown(raw)
    return None


@cache
def _warn_unknown(raw: str) -> None:
    """One line, once per process (the ``datapipe`` logger: a line of its own, with no source line of ours)."""
    import logging

    logging.getLogger("datapipe").warning(
        "datapipe: DATAPIPE_NATIVE=%r is neither on (%s) nor off (%s): the compiled kernels stay on", raw,
        ", ".join(v for v in ON if v), ", ".join(OFF))


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, a line saying which and why)."""
    if (off := switched_off()) is not None:
        return None, f"off ({off}): torch kernels"
    here = Path(__file__).resolve().parent
    paths = [here / f"_native{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in paths if p.exists()), None)
    if path is None:
        return None, "not built (no C compiler at install time): torch kernels"
    try:
        lib = ctypes.CDLL(str(path), use_errno=True)
        abi = lib.datapipe_native_abi()
    except (OSError, AttributeError) as exc:
        return None, f"unusable ({path.name}: {exc}): torch kernels"
    if abi != ABI:
        return None, f"stale build ({path.name} has ABI {abi}, this datapipe needs {ABI}; reinstall): torch kernels"
    if not lib.datapipe_native_simd():
        return None, "built, but this CPU lacks AVX2/FMA: torch kernels"
    f = lib.datapipe_u8_to_f32
    f.restype = None
    f.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_int,
                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    f = lib.datapipe_u8_to_f32_guarded
    f.restype = ctypes.c_int
    f.argtypes = lib.datapipe_u8_to_f32.argtypes
    for name in ("datapipe_resize_rgb", "datapipe_resize_rgb_guarded"):
        r = getattr(lib, name)
        r.restype = ctypes.c_ssize_t
        r.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_void_p,
                      ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_ssize_t]
    g = lib.datapipe_gather
    g.restype = ctypes.c_int
    g.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_size_t]
    gs = lib.datapipe_gather_spans
    gs.restype = ctypes.c_int
    gs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_ssize_t]
    hue = lib.datapipe_hue_f32
    hue.restype = None
    hue.argtypes = [ctypes.c_void_p] + [ctypes.c_ssize_t] * 5 + [ctypes.c_float]
    blend = lib.datapipe_blend_f32
    blend.restype = None
    blend.argtypes = [ctypes.c_void_p] + [ctypes.c_ssize_t] * 5 + [ctypes.c_float, ctypes.c_int]
    lib.datapipe_guard_arm.restype = ctypes.c_int
    lib.datapipe_guard_fault.restype = ctypes.c_size_t
    lib.datapipe_guard_faults.restype = ctypes.c_long
    lib.datapipe_map.restype = ctypes.c_void_p
    lib.datapipe_map.argtypes = [ctypes.c_int, ctypes.c_size_t]
    lib.datapipe_unmap.restype = ctypes.c_int
    lib.datapipe_unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return lib, f"{path.name} (AVX2 uint8 resize, uint8 -> float conversion, colour jitter)"


def available() -> bool:
    return _library()[0] is not None


def describe() -> str:
    """One line for ``datapipe info --env``: the kernel, and how the cache reads its shards."""
    line = _library()[1]
    if _library()[0] is None:
        return line + "; shards read with positioned reads"
    if not guard_available():
        return line + "; shards read with positioned reads (the SIGBUS guard cannot be installed)"
    return line + "; shards read from memory maps under a SIGBUS guard"


def scale_shift(mean: Sequence[float], std: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per channel, (x * scale + shift) on 0..255 values == (x / 255 - mean) / std."""
    return [1.0 / (255.0 * s) for s in std], [-m / s for m, s in zip(mean, std, strict=True)]


class Converter:
    """``conv(src, dst, flip)``: dst = (src / 255 - mean) / std, from uint8 [H, W, 3] to float32 [3, H, W].

    ``src`` may be a crop (rows strided) but its pixels must be packed (strides (row, 3, 1)); ``dst``
    is a float32 [3, H, W] tensor that is either contiguous or a channels_last slice (strides
    (1, 3W, 3)). ``stream`` writes with non-temporal stores; off by default: on an AMD EPYC host
    they took 2.3x the time of plain stores into a batch of 256 (0.15 vs 0.064 ms per 224² sample).
    Loops over a batch check it once with :meth:`destination` and then call :meth:`raw` with
    addresses, which skips the per-call checks.
    """

    def __init__(self, lib: ctypes.CDLL, mean: Sequence[float], std: Sequence[float]) -> None:
        import torch

        self._fn = lib.datapipe_u8_to_f32_guarded
        self._params = torch.tensor(scale_shift(mean, std), dtype=torch.float32)  # [2, 3], kept alive with self
        self._scale = self._params.data_ptr()
        self._shift = self._scale + 3 * 4

    @property
    def scale_shift_addresses(self) -> tuple[int, int]:
        """The float32 [3] scale and shift the kernel takes, as addresses (kept alive by this converter)."""
        return self._scale, self._shift

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, flip: bool, stream: bool = False) -> None:
        import torch

        h, w, c = src.shape
        rs, ps, cs = src.stride()
        if src.dtype != torch.uint8 or c != 3 or ps != 3 or cs != 1 or src.device.type != "cpu":
            raise ValueError(f"expected packed uint8 [H, W, 3] pixels on the CPU, got {tuple(src.shape)} "
                             f"{src.dtype} strides {src.stride()}")
        base, _, planar = self.destination(dst[None], h, w)
        _check_read(self._fn(src.data_ptr(), h, w, rs, int(flip), planar, self._scale, self._shift, base, int(stream)))

    @staticmethod
    def destination(out: torch.Tensor, h: int, w: int) -> tuple[int, int, int]:
        """(address of sample 0, bytes from one sample to the next, planar) of a float32 [B, 3, h, w] batch."""
        import torch

        if out.dtype != torch.float32 or tuple(out.shape[1:]) != (3, h, w) or out.device.type != "cpu":
            raise ValueError(f"expected a float32 [B, 3, {h}, {w}] destination, got {tuple(out.shape)} {out.dtype}")
        _, c, y, x = out.stride()
        if (c, y, x) == (h * w, w, 1):
            planar = 1
        elif (c, y, x) == (1, 3 * w, 3):
            planar = 0
        else:
            raise ValueError(f"destination must be contiguous or channels_last, got strides {out.stride()}")
        return out.data_ptr(), out.stride(0) * 4, planar

    def raw(self, src: int, h: int, w: int, row_bytes: int, flip: bool, planar: int, dst: int) -> None:
        """Unchecked call with addresses (``data_ptr()``), for a loop that checked its tensors once.

        The source is read under the guard: MappedReadError when it is a mapped file that shrank."""
        _check_read(self._fn(src, h, w, row_bytes, flip, planar, self._scale, self._shift, dst, 0))


def kernel_addresses() -> tuple[int, int] | None:
    """The addresses of the resize (``datapipe_resize_rgb``) and conversion (``datapipe_u8_to_f32``)
    kernels, unguarded, for compiled code that calls them on its own buffers (the partial JPEG
    decoder's batch of training crops); None where the kernels are not built."""
    lib = _library()[0]
    if lib is None:
        return None
    resize = ctypes.cast(lib.datapipe_resize_rgb, ctypes.c_void_p).value
    convert = ctypes.cast(lib.datapipe_u8_to_f32, ctypes.c_void_p).value
    return None if resize is None or convert is None else (resize, convert)


#: The colour jitter's operations that :func:`jitter` runs (torchvision's ColorJitter; the kernel's numbers).
JITTER_OPS = {"brightness": 0, "contrast": 1, "saturation": 2, "hue": 3}


def jitter(x: torch.Tensor, op: str, factors: Sequence[float]) -> bool:
    """One operation of torchvision's ColorJitter on each float32 [3, H, W] image of the CPU batch ``x``
    ([B, 3, H, W], values in [0, 1], any strides) with its factor, in place: ``"brightness"``,
    ``"contrast"``, ``"saturation"`` (blends with black, the mean grey, each pixel's grey) or ``"hue"``
    (HSV's hue turned by the factor, of a full turn). torchvision's float32 operations in its order: the
    same values bit for bit (the contrast's mean grey is summed in double: its last bit may differ).
    False (and ``x`` untouched) where the kernel is not built or ``x`` is not such a batch."""
    import torch

    lib = _library()[0]
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 4 or x.shape[1] != 3:
        return False
    code = JITTER_OPS[op]
    (_, sc, sy, sx), (_, _, h, w) = x.stride(), x.shape
    for i, f in enumerate(factors):
        if code == 3:
            lib.datapipe_hue_f32(x[i].data_ptr(), h, w, sc, sy, sx, float(f))
        else:
            lib.datapipe_blend_f32(x[i].data_ptr(), h, w, sc, sy, sx, float(f), code)
    return True


@lru_cache(maxsize=16)
def converter(mean: tuple, std: tuple) -> Converter | None:
    """A :class:`Converter` for (mean, std), or None where the kernel is not available."""
    lib = _library()[0]
    return None if lib is None else Converter(lib, mean, std)


class Resizer:
    """Antialiased bilinear resize of packed uint8 RGB (bit-identical to torch's uint8 kernel).

    :meth:`raw` takes addresses and row strides in bytes (pixels must be packed: 3 bytes apart). Each
    thread gets its own scratch buffer, grown on demand and reused. The source is read under the
    guard (MappedReadError when it is a mapped file that shrank); the scratch buffer is the
    caller's, so a read stopped by a fault leaves nothing half-allocated.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.datapipe_resize_rgb_guarded
        self._local = threading.local()

    def _workspace(self, nbytes: int) -> np.ndarray:
        ws = getattr(self._local, "ws", None)
        if ws is None or ws.size < nbytes:
            ws = self._local.ws = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        return ws

    def raw(self, src: int, in_h: int, in_w: int, src_row: int, dst: int, out_h: int, out_w: int,
            dst_row: int) -> None:
        """Unchecked call with addresses, for loops that checked their arrays."""
        ws = self._workspace(0)
        need = _check_read(self._fn(src, in_h, in_w, src_row, dst, out_h, out_w, dst_row, ws.ctypes.data, ws.size))
        if need:
            ws = self._workspace(need)
            _check_read(self._fn(src, in_h, in_w, src_row, dst, out_h, out_w, dst_row, ws.ctypes.data, ws.size))


@lru_cache(maxsize=1)
def resizer() -> Resizer | None:
    """The :class:`Resizer`, or None where the kernel is not available."""
    lib = _library()[0]
    return None if lib is None else Resizer(lib)


def _layout(a: np.ndarray | torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...], bool, bool]:
    """(address, shape, strides in bytes, uint8 on the CPU, writable) of a numpy array or a torch tensor."""
    if isinstance(a, np.ndarray):
        info = a.__array_interface__
        return info["data"][0], a.shape, a.strides, a.dtype == "uint8", bool(a.flags.writeable)
    import torch  # a tensor: torch is imported already

    ok = a.dtype == torch.uint8 and a.device.type == "cpu"
    return a.data_ptr(), tuple(a.shape), a.stride(), ok, True


def resize(src: np.ndarray | torch.Tensor, out: np.ndarray | torch.Tensor) -> bool:
    """Resize uint8 RGB ``src`` [H, W, 3] into ``out`` [h, w, 3] (numpy arrays or CPU tensors).

    Rows may be strided (a crop read in place) but each array's pixels must be packed (strides
    (row, 3, 1), row > 0). Returns False, leaving ``out`` alone, where the kernel is not available.
    """
    r = resizer()
    if r is None:
        return False
    (sp, sshape, sst, sok, _), (dp, dshape, dst, dok, writable) = _layout(src), _layout(out)
    dok = dok and writable
    for name, shape, st, ok in (("src", sshape, sst, sok), ("out", dshape, dst, dok)):
        if not ok or len(shape) != 3 or shape[2] != 3 or st[1:] != (3, 1) or st[0] < 3 * shape[1] or min(shape) < 1:
            raise ValueError(f"resize: {name} must be {'writable ' if name == 'out' else ''}uint8 [H, W, 3] with "
                             f"packed pixels on the CPU, got shape {shape} strides {st}")
    r.raw(sp, sshape[0], sshape[1], sst[0], dp, dshape[0], dshape[1], dst[0])
    return True


# ----------------------------------------------------------------------------- guarded reads


def _loaded() -> ctypes.CDLL:
    """The library, for calls that only run where it is loaded (a Mapping or a kernel exists)."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"datapipe's native kernel is not loaded: {describe()}")
    return lib


def _check_read(rc: int) -> int:
    """The result of a guarded kernel call; -1 (its source faulted) raises MappedReadError."""
    if rc == -1:
        raise fault_error()
    if rc == -2:  # sigaction failed: never seen; the source is no mapped file then (the cache checks the guard)
        raise OSError("datapipe: the SIGBUS guard cannot be installed")
    return rc


def fault_error() -> MappedReadError:
    """The error for the fault this thread's last guarded call stopped at."""
    address = int(_loaded().datapipe_guard_fault())
    return MappedReadError(f"a memory-mapped file shrank under a read (page at {address:#x} is gone); "
                           "reopen the cache, or rerun the same `datapipe build` if it is damaged", address)


@lru_cache(maxsize=1)
def guard_available() -> bool:
    """True when the SIGBUS guard is in place (the kernel is built and usable, and the handler installs)."""
    lib = _library()[0]
    return lib is not None and lib.datapipe_guard_arm() == 0


def guard_arm() -> None:
    """Check that the SIGBUS handler is still the one installed, and reinstall it over a newcomer
    (faulthandler enabled since), which it then chains to. :func:`gather` arms on each call; the
    per-sample resize and conversion do not (a sigaction call costs ~2 us): call this before a
    batch of them reads mapped memory."""
    if _loaded().datapipe_guard_arm() != 0:
        raise OSError("datapipe: the SIGBUS guard cannot be installed")


def guard_faults() -> int:
    """Faults the guard has caught in this process (0 without the kernel)."""
    lib = _library()[0]
    return 0 if lib is None else int(lib.datapipe_guard_faults())


class Mapping:
    """A private, copy-on-write mapping of a file's first ``length`` bytes (writes never reach the file).

    ``array()`` is a uint8 [length] numpy view of it; the mapping lasts until this object and every
    array (or torch tensor) over it are gone. Its pages must be read only through the guarded
    kernels: a read elsewhere of a page the file no longer has is a SIGBUS.
    """

    def __init__(self, fd: int, length: int) -> None:
        lib = _library()[0]
        if lib is None or length < 1:
            raise ValueError(f"Mapping needs the native kernel and a positive length, got {length}")
        address = lib.datapipe_map(fd, length)
        if not address:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        self.address, self.length = int(address), int(length)
        self._unmap = lib.datapipe_unmap
        self.__array_interface__ = {"shape": (self.length,), "typestr": "|u1", "data": (self.address, False),
                                    "version": 3}

    def array(self) -> np.ndarray:
        """The mapped bytes; the array keeps this mapping alive."""
        return np.asarray(self)

    def __contains__(self, address: int) -> bool:
        return self.address <= address < self.address + self.length

    def __del__(self) -> None:
        if getattr(self, "address", 0):
            self._unmap(self.address, self.length)
            self.address = 0


def gather_spans(dst: int, mapping: Mapping, offsets: np.ndarray, sizes: np.ndarray, dst_offsets: np.ndarray) -> None:
    """Copy spans of ``mapping`` (``offsets``, ``sizes``: int64 bytes) to ``dst + dst_offsets`` (an address) in
    one call under the guard; MappedReadError when a page faulted."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    dst_offsets = np.ascontiguousarray(dst_offsets, dtype=np.int64)
    n = offsets.shape[0]
    if sizes.shape[0] != n or dst_offsets.shape[0] != n:
        raise ValueError(f"gather_spans: {n} offsets, {sizes.shape[0]} sizes, {dst_offsets.shape[0]} destinations")
    rc = _loaded().datapipe_gather_spans(dst, mapping.address, mapping.length, offsets.ctypes.data, sizes.ctypes.data,
                                         dst_offsets.ctypes.data, n)
    if rc == -3:
        raise ValueError(f"gather_spans: a span lies outside the mapping of {mapping.length} bytes")
    _check_read(rc)


def gather(dst: int, mapping: Mapping, offsets: np.ndarray, nbytes: int) -> None:
    """Copy ``len(offsets)`` samples of ``nbytes`` from ``mapping`` at ``offsets`` (int64, bytes) to ``dst``
    (an address, sample i at dst + i * nbytes), under the guard; MappedReadError when a page faulted."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    rc = _loaded().datapipe_gather(dst, mapping.address, mapping.length, offsets.ctypes.data, offsets.shape[0], nbytes)
    if rc == -3:
        raise ValueError(f"gather: an offset lies outside the mapping of {mapping.length} bytes")
    _check_read(rc)
