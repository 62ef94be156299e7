#!/usr/bin/env bash
# The GPU checks as one command on a CUDA machine without network, from a checkout (about 6 minutes on a
# 16-core H200 machine): installs the wheels benchmarks/gpu_wheels.sh fetched (in .whl/, if there) into a
# folder of their own, builds the compiled CPU kernels for this Python where a C compiler is present (else
# torch's kernels run), then runs benchmarks/gpu_check.py and benchmarks/gpu_decode.py, each cut at its
# own limit. JSON, logs and the machine's description go into $OUT (default ./gpu_out).
#
#     OUT=DIR bash benchmarks/gpu_run.sh [CHECK_SECONDS=330] [DECODE_SECONDS=210] [ARGS...]
#
# ARGS go to both scripts (--cpu-smoke runs the whole command on a machine without a GPU).
# Exits non-zero when either script does (a parity failure, a failed cuda test, a script cut short).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
check_s=${1:-330}
decode_s=${2:-210}
shift $(( $# < 2 ? $# : 2 ))
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
    python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    nproc
} > "$OUT/machine.txt" 2>&1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install --quiet --no-index --no-deps --no-compile --target /tmp/datapipe-site .whl/*.whl \
        > "$OUT/setup.log" 2>&1 || { echo "gpu_run: the wheels in .whl/ did not install:"; tail -5 "$OUT/setup.log"; exit 2; }
    export PYTHONPATH=/tmp/datapipe-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 setup.py --quiet build_ext --inplace >> "$OUT/setup.log" 2>&1 \
    || echo "gpu_run: no compiled kernels here (torch's run instead): $(tail -1 "$OUT/setup.log")"
python3 -c 'import datapipe.native as n, zarr, simplejpeg; print("kernels:", n.describe())' 2>&1 | tee -a "$OUT/machine.txt"
rc=0
timeout -k 10 "$check_s" python3 benchmarks/gpu_check.py --out "$OUT" "$@" > "$OUT/gpu_check.log" 2>&1 || rc=$?
echo "gpu_check.py exit $rc"; tail -4 "$OUT/gpu_check.log"
rc2=0
timeout -k 10 "$decode_s" python3 benchmarks/gpu_decode.py --out "$OUT" "$@" > "$OUT/gpu_decode.log" 2>&1 || rc2=$?
echo "gpu_decode.py exit $rc2"; tail -4 "$OUT/gpu_decode.log"
exit $(( rc || rc2 ))
