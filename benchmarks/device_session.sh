#!/usr/bin/env bash
# One visit to the lent GPU: install the NumPy wheel, run the GPU test suite, compute-sanitizer, the bench.
# Usage (from the repo root on the device): bash benchmarks/device_session.sh [bench args...]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import numpy, numba, numba_cuda, llvmlite; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'llvmlite', llvmlite.__version__)"
if [ -z "${SKIP_TESTS:-}" ]; then
  # PYTEST_K: an optional -k expression
  # PYTEST_FILES: optional test files (default: tests)
  python3 -m pytest -q -x ${PYTEST_FILES:-tests} -p no:cacheprovider --durations=8 ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -15
fi
if [ -z "${SKIP_SANITIZER:-}" ]; then
  # SANITIZE: an optional family list for benchmarks/sanitize.py (default: all)
  compute-sanitizer --tool memcheck --print-limit 5 python3 benchmarks/sanitize.py ${SANITIZE:-} 2>&1 | tail -4 | tee "$OUT/memcheck.log"
  compute-sanitizer --tool racecheck --print-limit 5 python3 benchmarks/sanitize.py ${SANITIZE:-} 2>&1 | tail -3 | tee "$OUT/racecheck.log"
fi
if [ "$#" -gt 0 ]; then
  python3 -m kbit_numba.bench "$@" --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>"$OUT/bench_progress.log" | tee "$OUT/bench.txt"
fi
