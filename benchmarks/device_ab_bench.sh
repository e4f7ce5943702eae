#!/usr/bin/env bash
# Same-visit A/B of the whole package: the working tree's kbit_numba against another revision's, each
# timed by its own `python -m kbit_numba.bench` (cuBLAS fp16 and the read floor in every run), in turns.
# Prepare the other revision here first (it travels as an ignored, carried folder):
#     rm -rf .old && mkdir .old && git archive REV kbit_numba | tar -x -C .old
# then on the device:  bash benchmarks/device_ab_bench.sh ROUNDS [bench args...]   (logs under $OUT)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rounds=$1; shift
for r in $(seq 1 "$rounds"); do
  for side in new old; do
    root=$PWD; [ "$side" = old ] && root=$PWD/.old
    (cd "$root" && PYTHONPATH=/tmp/site:$root python3 -m kbit_numba.bench "$@" --json "$OUT/ab_${side}_$r.json" \
       2>>"$OUT/ab_progress.log" > "$OUT/ab_${side}_$r.txt") || echo "$side round $r failed"
    echo "== $side round $r"; grep -E "^ *(gemv|pair|gemm|linear)" "$OUT/ab_${side}_$r.txt" | head -40
  done
done
