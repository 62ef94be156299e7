"""JPEG samples decoded on the GPU for the CUDA DeviceLoader: nvImageCodec, else torchvision's nvjpeg.

A CUDA DeviceLoader over a JPEG cache decodes each batch on the GPU when a decoder is installed and
works here — ``nvidia-nvimgcodec-cu12`` or ``-cu13``, matching torch's CUDA (``nvimgcodec``) first, else torchvision's batched
``decode_jpeg(device="cuda")`` (only if torchvision imports cleanly beside this torch) — and on the
host (libjpeg-turbo) otherwise. The environment variable ``DATAPIPE_GPU_DECODE`` overrides the
choice: ``0`` decodes on the host, ``nvimgcodec`` or ``torchvision`` requires that decoder (an
ArgumentError when it is unavailable, rather than a quiet fall-back). It concerns CUDA loaders only.

Each candidate decodes a small probe JPEG when it is selected, so a decoder that imports but cannot
run here (a CPU-only torchvision build, a driver too old) is passed over, not found mid-epoch.

The GPU decoders' IDCT and chroma upsampling are not libjpeg-turbo's: the decoded pixels differ from
the host decode by a little (nvImageCodec runs with fancy upsampling, as libjpeg-turbo does). The
tolerance — per image, mean absolute difference <= :data:`MEAN_TOL` uint8 levels and 99.9th
percentile <= :data:`P999_TOL` — is checked by tests/test_gpu_decode.py on a GPU and documented in
docs/loader.md.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from .errors import ArgumentError, CorruptShardError
from .samples import REWRITE_ADVICE, decode_jpeg, encode

ENV = "DATAPIPE_GPU_DECODE"
DECODERS = ("nvimgcodec", "torchvision")  # in the order the automatic choice tries them
INSTALL = {"nvimgcodec": "pip install nvidia-nvimgcodec-cu12 (-cu13 for CUDA 13)",
           "torchvision": "pip install the torchvision built for this torch"}
MEAN_TOL = 1.5  # uint8 levels: the mean absolute difference to the host decode, per image
P999_TOL = 32.0  # uint8 levels: the 99.9th percentile of the absolute difference, per image


# Padding samples of varying shapes goes through a (strided) nested tensor, whose prototype warning says nothing to a user.
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage", category=UserWarning)


class GpuJpegDecoder:
    """Decodes a batch of stored JPEG samples on a CUDA device, on a given stream.

    Subclasses implement :meth:`_decode` (the library's batched call); this class checks what comes
    back against the sample index and names the sample of any failure.
    """

    name = "gpu"

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available here")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.host_threads = 0  # threads the library starts per decoding thread (0: none of its own / its default)

    def decode(self, data: Sequence[np.ndarray], shapes: Sequence[tuple[int, int]], wheres: Sequence[str],
               device: torch.device | None = None, stream: torch.cuda.Stream | None = None) -> list[torch.Tensor]:
        """uint8 [h, w, 3] CUDA tensors of the stored JPEG bytes ``data`` (1-D uint8 arrays), decoded in
        order on ``stream`` (default: the current stream): work queued on that stream afterwards sees them.

        Raises:
            CorruptShardError: a sample does not decode (on the host either), or decodes to another
                shape than its index row says; the message names ``wheres[i]``, its shard file and sample.
            RuntimeError: the GPU decoder failed on samples that the host decodes (the message says
                how to decode on the host instead).
        """
        if not data:
            return []
        dev = self.device if device is None else torch.device(device)
        stream = torch.cuda.current_stream(dev) if stream is None else stream
        with torch.cuda.stream(stream):
            try:
                images = self._decode(data, dev, stream)
            except (RuntimeError, ValueError) as exc:  # a batched call fails whole: find the sample on the host
                raise failure(self.name, data, shapes, wheres, range(len(data)), exc) from None
        if len(images) != len(data):  # nvImageCodec before 0.5 dropped the images it failed on from its list
            raise failure(self.name, data, shapes, wheres, range(len(data)), None)
        failed = [i for i, x in enumerate(images) if x is None]
        if failed:
            raise failure(self.name, data, shapes, wheres, failed, None)
        decoded = [x for x in images if x is not None]
        for x, (h, w), where in zip(decoded, shapes, wheres, strict=True):
            if tuple(x.shape) != (h, w, 3):
                raise CorruptShardError(f"{where}: the stored JPEG decodes ({self.name}) to {tuple(x.shape)}, "
                                        f"the sample index says {h}x{w}x3; {REWRITE_ADVICE}")
        return decoded

    def _decode(self, data: Sequence[np.ndarray], device: torch.device, stream: torch.cuda.Stream) -> list[torch.Tensor | None]:
        raise NotImplementedError

    def probe(self) -> GpuJpegDecoder:
        """Decode a small JPEG once, so that a decoder that cannot run here is never selected."""
        rng = np.random.default_rng(0)
        image = rng.integers(0, 256, size=(24, 40, 3), dtype=np.uint8)
        blob = np.frombuffer(bytes(encode(image, "jpeg")), dtype=np.uint8)
        out = self.decode([blob], [(24, 40)], ["the probe image"], self.device)
        torch.cuda.synchronize(self.device)
        if tuple(out[0].shape) != (24, 40, 3):  # pragma: no cover - decode() checks the shape
            raise RuntimeError(f"{self.name} decoded the probe to {tuple(out[0].shape)}")
        return self


def failure(name: str, data: Sequence[np.ndarray], shapes: Sequence[tuple[int, int]], wheres: Sequence[str],
            suspects: Sequence[int], exc: BaseException | None) -> Exception:
    """The error for samples the GPU decoder ``name`` did not decode (``suspects``: their positions).

    Raises the host decoder's CorruptShardError for the first that is damaged (it names the shard file
    and sample); returns — the data is sound — a RuntimeError naming the decoder, the sample and the way out."""
    for i in suspects:
        decode_jpeg(data[i], shapes[i][0], shapes[i][1], where=wheres[i])  # raises CorruptShardError when damaged
    why = f" ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})" if exc is not None else ""
    return RuntimeError(f"{wheres[suspects[0]]}: the GPU JPEG decoder {name} failed on samples the host decodes{why}; "
                        f"set {ENV}=0 to decode on the host")


class NvImageCodecDecoder(GpuJpegDecoder):
    """nvImageCodec (``nvidia.nvimgcodec``): one batched ``Decoder.decode`` call per batch, ordered on
    the given stream (``cuda_stream``). One decoder per calling thread (reader threads decode at
    once), each with ``host_threads`` CPU threads of its own for the host side of the decode."""

    name = "nvimgcodec"

    def __init__(self, device: torch.device, host_threads: int = 0) -> None:
        from nvidia import nvimgcodec  # first: a missing library is the likelier and more useful reason

        super().__init__(device)
        self._lib = nvimgcodec
        self.host_threads = max(0, int(host_threads))
        self._local = threading.local()
        # as libjpeg-turbo: RGB, no EXIF rotation (a cache's samples carry none), fancy (interpolated) chroma upsampling
        rgb = getattr(nvimgcodec.ColorSpec, "SRGB", None) or nvimgcodec.ColorSpec.RGB  # SRGB from 0.7, RGB before
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=rgb)

    def _decoder(self):
        dec = getattr(self._local, "decoder", None)
        if dec is None:
            dec = self._lib.Decoder(device_id=self.device.index, max_num_cpu_threads=self.host_threads,
                                    options=":fancy_upsampling=1")
            self._local.decoder = dec
        return dec

    def _decode(self, data: Sequence[np.ndarray], device: torch.device, stream: torch.cuda.Stream) -> list[torch.Tensor | None]:
        blobs = [np.ascontiguousarray(d).tobytes() for d in data]
        images = self._decoder().decode(blobs, params=self._params, cuda_stream=stream.cuda_stream)
        # torch.as_tensor reads __cuda_array_interface__ without copying; the tensor holds the Image (its memory) alive
        return [None if x is None else torch.as_tensor(x, device=device) for x in images]


class TorchvisionDecoder(GpuJpegDecoder):
    """torchvision's ``decode_jpeg(list, device="cuda")`` (nvjpeg, batched, thread-safe), which runs on
    the current stream; its [3, h, w] outputs are handed back as [h, w, 3] views."""

    name = "torchvision"

    def __init__(self, device: torch.device) -> None:
        from torchvision.io import ImageReadMode, decode_jpeg

        super().__init__(device)
        self._decode_jpeg, self._rgb = decode_jpeg, ImageReadMode.RGB

    def _decode(self, data: Sequence[np.ndarray], device: torch.device, stream: torch.cuda.Stream) -> list[torch.Tensor | None]:
        blobs = [torch.from_numpy(np.ascontiguousarray(d)) for d in data]
        return [x.permute(1, 2, 0) for x in self._decode_jpeg(blobs, mode=self._rgb, device=device)]


def requested() -> str:
    """What ``DATAPIPE_GPU_DECODE`` asks for: ``"auto"`` (unset), ``"off"`` (``0``), or a decoder's name.

    Raises:
        ArgumentError: any other value (the message names the variable and the values it takes).
    """
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "auto", "1"):
        return "auto"
    if raw in ("0", "off", "cpu", "host"):
        return "off"
    if raw in DECODERS:
        return raw
    raise ArgumentError(f"{ENV}={raw!r} is not a choice: set it to 0 (decode JPEG samples on the host), "
                        f"{' or '.join(DECODERS)}, or unset it (automatic)")


def select(choice: str, candidates: Mapping[str, Callable[[], GpuJpegDecoder]]) -> GpuJpegDecoder | None:
    """The decoder ``choice`` (see :func:`requested`) gets from ``candidates`` (name -> constructor that
    raises when its library is missing or cannot decode here): the first that works for ``"auto"``
    (None when none does), none for ``"off"``, that one or an ArgumentError for a name."""
    if choice == "off":
        return None
    names = DECODERS if choice == "auto" else (choice,)
    reasons: dict[str, str] = {}
    for name in names:
        try:
            return candidates[name]()
        except Exception as exc:  # noqa: BLE001 - a decoder library that is missing, broken, or cannot run here
            reasons[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if choice == "auto":
        return None
    raise ArgumentError(f"{ENV}={choice} but {choice} cannot decode here ({reasons[choice]}): {INSTALL[choice]}, "
                        f"or set {ENV}=0 to decode on the host")


def jpeg_decoder(device: str | torch.device, *, host_threads: int = 0) -> GpuJpegDecoder | None:
    """The GPU JPEG decoder a loader on ``device`` uses: nvImageCodec, else torchvision, else None (decode
    on the host); ``DATAPIPE_GPU_DECODE`` overrides it (see the module). None for a device that is not CUDA.

    Raises:
        ArgumentError: ``DATAPIPE_GPU_DECODE`` has an unknown value, or names a decoder that cannot
            decode here (not installed, no CUDA, a failed probe decode).
    """
    choice = requested()
    dev = torch.device(device)
    if dev.type != "cuda" or (choice == "auto" and not torch.cuda.is_available()):
        return None
    return select(choice, {
        "nvimgcodec": lambda: NvImageCodecDecoder(dev, host_threads).probe(),
        "torchvision": lambda: TorchvisionDecoder(dev).probe(),
    })


def pad_batch(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 [B, Hmax, Wmax, 3] tensor of [h, w, 3] samples on one device: stacked when they share a
    shape, else zero-padded at the bottom and right (a crop inside each sample's own extent never reads
    the padding) — in a few batched kernels through a nested tensor, with no loop over the samples here."""
    if not images:
        raise ValueError("pad_batch needs at least one sample")
    if all(x.shape == images[0].shape for x in images):
        return torch.stack(list(images))
    h, w = max(int(x.shape[0]) for x in images), max(int(x.shape[1]) for x in images)
    nested = torch.nested.as_nested_tensor(list(images))
    return torch.nested.to_padded_tensor(nested, 0, output_size=(len(images), h, w, 3))
