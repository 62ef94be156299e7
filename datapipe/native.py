"""The optional compiled CPU kernel (``datapipe/_native.c``), called through ctypes.

It converts one uint8 RGB image (or a crop of one) to normalised float32 — planar (NCHW) or
interleaved (channels_last), mirrored on request — in a single pass, where torch needs a converting
copy and a broadcast multiply-add whose strided loop does not vectorise: ~0.04 against ~0.12 ms for
a 224² sample here, which is most of the CPU loader's per-sample cost after the resize.

``pip install`` builds it when a C compiler is present; the extension is optional, so an install
without a compiler still succeeds and the augment presets use the torch kernels, which give the
same values (the tests compare the two). ctypes releases the GIL for each call, so the loader's
reader threads convert in parallel. ``DATAPIPE_NATIVE=0`` turns it off; ``datapipe info --env``
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
from functools import lru_cache
from pathlib import Path

import torch

ABI = 1  # must match DATAPIPE_NATIVE_ABI in _native.c


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library or None, a line saying which and why)."""
    if os.environ.get("DATAPIPE_NATIVE", "1").strip() == "0":
        return None, "off (DATAPIPE_NATIVE=0): torch kernels"
    here = Path(__file__).resolve().parent
    paths = [here / f"_native{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in paths if p.exists()), None)
    if path is None:
        return None, "not built (no C compiler at install time): torch kernels"
    try:
        lib = ctypes.CDLL(str(path))
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
    return lib, f"{path.name} (AVX2 uint8 -> float conversion)"


def available() -> bool:
    return _library()[0] is not None


def describe() -> str:
    """One line for ``datapipe info --env``."""
    return _library()[1]


def scale_shift(mean, std) -> tuple[list[float], list[float]]:
    """Per channel, (x * scale + shift) on 0..255 values == (x / 255 - mean) / std."""
    return [1.0 / (255.0 * s) for s in std], [-m / s for m, s in zip(mean, std)]


class Converter:
    """``conv(src, dst, flip)``: dst = (src / 255 - mean) / std, from uint8 [H, W, 3] to float32 [3, H, W].

    ``src`` may be a crop (rows strided) but its pixels must be packed (strides (row, 3, 1)); ``dst``
    is a float32 [3, H, W] tensor that is either contiguous or a channels_last slice (strides
    (1, 3W, 3)). ``stream`` writes with non-temporal stores, for outputs that are read later (a
    batch), not right away. Loops over a batch check it once with :meth:`destination` and then call
    :meth:`raw` with addresses, which skips the per-call checks.
    """

    def __init__(self, lib: ctypes.CDLL, mean, std) -> None:
        self._fn = lib.datapipe_u8_to_f32
        self._params = torch.tensor(scale_shift(mean, std), dtype=torch.float32)  # [2, 3], kept alive with self
        self._scale = self._params.data_ptr()
        self._shift = self._scale + 3 * 4

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, flip: bool, stream: bool = True) -> None:
        h, w, c = src.shape
        rs, ps, cs = src.stride()
        if src.dtype != torch.uint8 or c != 3 or ps != 3 or cs != 1 or src.device.type != "cpu":
            raise ValueError(f"expected packed uint8 [H, W, 3] pixels on the CPU, got {tuple(src.shape)} "
                             f"{src.dtype} strides {src.stride()}")
        base, _, planar = self.destination(dst[None], h, w)
        self._fn(src.data_ptr(), h, w, rs, int(flip), planar, self._scale, self._shift, base, int(stream))

    @staticmethod
    def destination(out: torch.Tensor, h: int, w: int) -> tuple[int, int, int]:
        """(address of sample 0, bytes from one sample to the next, planar) of a float32 [B, 3, h, w] batch."""
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
        """Unchecked call with addresses (``data_ptr()``), for a loop that checked its tensors once."""
        self._fn(src, h, w, row_bytes, flip, planar, self._scale, self._shift, dst, 1)


@lru_cache(maxsize=16)
def converter(mean: tuple, std: tuple) -> Converter | None:
    """A :class:`Converter` for (mean, std), or None where the kernel is not available."""
    lib = _library()[0]
    return None if lib is None else Converter(lib, mean, std)
