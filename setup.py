"""The one compiled part of datapipe: an optional CPU kernel (see datapipe/_native.c and datapipe/native.py).

Everything else is declared in pyproject.toml. The extension is optional: where no C compiler is
available the install still succeeds and datapipe uses the equivalent torch kernels.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("datapipe._native", sources=["datapipe/_native.c"], optional=True,
                             extra_compile_args=["-O2"], libraries=["m"])])
