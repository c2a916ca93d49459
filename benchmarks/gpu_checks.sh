#!/usr/bin/env bash
# The checks that need a CUDA device, in one call of a lent device machine (the project's
# `device` tool): the GPU tests (tests/gpu) and the GPU mode of the save/restore benchmark.
# The machine's image has torch, safetensors, numpy, xxhash and tqdm; zstandard and blake3
# travel as wheels in .whl (benchmarks/README.md says how to fetch them). Logs go to $OUT.
#   usage: benchmarks/gpu_checks.sh [SIZE_GB] [REPEATS]
set -u
OUT=${OUT:-/tmp/gpu_checks}
SIZE_GB=${1:-8}
REPEATS=${2:-2}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc; free -g | head -2; df -h /tmp | tail -1
  python3 -c "import sys, torch, ckptflow; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
  # the disk's own write+fsync rate, the bound a save is measured against
  python3 - <<'EOF'
import os, time
buf = os.urandom(1 << 26) * 16
start = time.perf_counter()
with open("/tmp/dd.bin", "wb") as f:
    f.write(buf); f.flush(); os.fsync(f.fileno())
print(f"dd-style write+fsync of 1 GiB: {time.perf_counter() - start:.3f} s")
os.unlink("/tmp/dd.bin")
EOF
} 2>&1 | tee "$OUT/machine.txt"

# not the project's pytest settings: their warning filters name Dagster's classes, and Dagster is not there
PYTHONPATH=$PYTHONPATH:$PWD/tests timeout 180 python3 -m pytest -q -p no:cacheprovider -c /dev/null --rootdir "$PWD" \
  --import-mode=importlib tests/gpu tests/dcp/test_host_copies.py tests/dcp/test_staging.py tests/training/test_staging.py 2>&1 | tee "$OUT/tests.log"
echo "tests rc=${PIPESTATUS[0]}"

timeout 270 python3 benchmarks/save_restore.py --device cuda --size-gb "$SIZE_GB" --repeats "$REPEATS" \
  --dir /tmp/bench 2>&1 | tee "$OUT/bench.log"
echo "bench rc=${PIPESTATUS[0]}"

# the library's CPU suites with CUDA present: a CPU-only state must not start a CUDA context or slow down
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 8"
PYTHONPATH=$PYTHONPATH:$PWD/tests timeout "${SUITE_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -c /dev/null \
  --rootdir "$PWD" --import-mode=importlib $XDIST tests/training tests/dcp tests/chunks \
  --ignore=tests/dcp/test_distributed_s3.py -k "not s3" --tb=short -W ignore 2>&1 | tee "$OUT/suites.log" | tail -60
echo "suites rc=${PIPESTATUS[0]}"
