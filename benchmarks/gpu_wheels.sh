#!/usr/bin/env bash
# Wheels of what datapipe needs beyond a CUDA machine's usual PyTorch image (Python, torch, numpy, Pillow,
# scikit-image, fsspec...), for a GPU machine that has no network: run it where pip can reach PyPI, copy the
# folder over with the checkout, and benchmarks/gpu_run.sh installs them there without an index.
#
#     benchmarks/gpu_wheels.sh [DEST=.whl] [PYTHON_VERSION=3.12]
#
# Binary wheels for manylinux x86_64 and that Python, without their dependencies (the image has those):
# zarr with numcodecs, donfig and google-crc32c; simplejpeg (libjpeg-turbo); kornia with kornia_rs (the
# colour jitter). Dask is left out: without it the GPU checks build their caches in one process. The
# versions are those the tests run with on Python 3.11 (a newer Python would otherwise get a newer zarr).
set -euo pipefail
dest=${1:-.whl}
py=${2:-3.12}
mkdir -p "$dest"
python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest "$dest" zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 simplejpeg==1.9.0 \
    kornia==0.9.0 kornia_rs==0.2.0
ls "$dest"
