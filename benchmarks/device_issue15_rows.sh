#!/usr/bin/env bash
# Issue 15's rows (README's "Where issue 15's goals stand" tables) in one device call, within a deadline:
#     ROWS_DEADLINE=<seconds from now> bash benchmarks/device_issue15_rows.sh
# k = 2 first (the pair gemv at M = 1, float16 sums and PDL chains: ~40 s warm), then k = 4 (the pair and tensor-core
# gemvs at M = 1, 4, 16, both layouts: ~4-5 minutes on a fresh H100, most of it compiling) with the time left. Leaves
# $OUT/rows.txt (both tables) and $OUT/rows.json ({"k2": ..., "k4": ...}, each the bench's --json): two files, so that
# it can follow device_tune_codes.sh (six) in the same call, inside the device tool's eight. Why a script: the same
# command ran on five visits (runs/*_issue15_rows.txt); a deadline lets a call that starts with a tune use what is left.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
end=$(( $(date +%s) + ${ROWS_DEADLINE:-560} ))
shapes=2048x5120,4096x14336
run() {         # $1: k; the rest: bench arguments. Runs only with at least 30 s left.
  local left=$(( end - $(date +%s) )); [ "$left" -ge 30 ] || { echo "k = $1: skipped, $left s left"; return; }
  timeout "$left" python3 -m kbit_numba.bench --shapes $shapes --k "$@" --json "/tmp/rows_k$1.json" \
    > "/tmp/rows_k$1.txt" 2> "/tmp/rows_k$1.err"
  local rc=$?; echo "k = $1: rc $rc"; [ "$rc" -eq 0 ] || tail -n 3 "/tmp/rows_k$1.err"
  echo "## k = $1" >> "$OUT/rows.txt"; cat "/tmp/rows_k$1.txt" >> "$OUT/rows.txt"
}
: > "$OUT/rows.txt"; rm -f /tmp/rows_k2.json /tmp/rows_k4.json
run 2 --m 1 --kernels pair_gemv --pair-f16 --pdl
run 4 --m 1,4,16 --kernels pair_gemv,mma_gemv --pair-f16 --pdl --fragments
python3 - "$OUT/rows.json" <<'PY'
import json, os, sys
json.dump({k: json.load(open(f"/tmp/rows_{k}.json")) for k in ("k2", "k4") if os.path.exists(f"/tmp/rows_{k}.json")},
          open(sys.argv[1], "w"), indent=1)
PY
cat "$OUT/rows.txt"; date -u
