#!/usr/bin/env bash
# Same-visit A/B of the whole package: the working tree's kbit_numba against other revisions', each
# timed by its own `python -m kbit_numba.bench` (cuBLAS fp16 and the read floor in every run), in turns.
# Prepare the other revisions here first (each travels as an ignored, carried folder .NAME):
#     rm -rf .old && mkdir .old && git archive REV kbit_numba | tar -x -C .old
# then on the device:  bash benchmarks/device_ab_bench.sh ROUNDS [bench args...]   (logs and JSON under $OUT)
# AB_SIDES (default "new old"): the trees in the order each round times them; "new" is the working tree, any
# other NAME the folder .NAME. Summary, each side against "old": python benchmarks/ab_bench_table.py $OUT
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rounds=$1; shift
for r in $(seq 1 "$rounds"); do
  for side in ${AB_SIDES:-new old}; do
    root=$PWD; [ "$side" = new ] || root=$PWD/.$side
    (cd "$root" && PYTHONPATH=/tmp/site:$root python3 -m kbit_numba.bench "$@" --json "$OUT/ab_${side}_$r.json" \
       2>>"$OUT/ab_progress.log" > "$OUT/ab_${side}_$r.txt") || echo "$side round $r failed"
    echo "== $side round $r"; grep -E "^ *(gemv|pair|gemm|mma|linear)" "$OUT/ab_${side}_$r.txt" | head -40
  done
done
