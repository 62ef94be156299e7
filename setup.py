"""The compiled parts of datapipe: two optional CPU extensions, loaded with ctypes.

* ``datapipe._native``: the uint8 resize and conversion kernels and the guarded reads (datapipe/_native.c,
  datapipe/native.py).
* ``datapipe._jpegcrop``: the partial JPEG decoder of a crop (datapipe/_jpegcrop.c, used by
  datapipe.samples.decode_crop). It is compiled against libjpeg-turbo's public headers vendored in
  datapipe/_vendor/libjpeg and opens the libjpeg-turbo that Pillow bundles at run time, so neither needs
  a system package.

Everything else is declared in pyproject.toml. Both extensions are optional: where no C compiler is
available the install still succeeds and datapipe uses torch's kernels and simplejpeg's full decode.
"""

import sys

from setuptools import Extension, setup

_VENDOR = "datapipe/_vendor/libjpeg"

setup(ext_modules=[
    Extension("datapipe._native", sources=["datapipe/_native.c"], optional=True, extra_compile_args=["-O2"], libraries=["m"]),
    Extension("datapipe._jpegcrop", sources=["datapipe/_jpegcrop.c"], optional=True, extra_compile_args=["-O2"],
              include_dirs=[_VENDOR], depends=[f"{_VENDOR}/{name}" for name in ("jpeglib.h", "jmorecfg.h", "jconfig.h")],
              libraries=["dl"] if sys.platform.startswith("linux") else []),
])
