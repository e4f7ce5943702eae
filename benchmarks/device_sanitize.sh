#!/usr/bin/env bash
# Every compute-sanitizer tool over every kernel family's small launches (benchmarks/sanitize.py; issue 14 item 3).
# Usage (repo root on the device): [TOOLS="memcheck racecheck synccheck initcheck"] [TOOL_TIMEOUT=s] bash benchmarks/device_sanitize.sh
# First the workload runs once per family in parallel without a sanitizer, so every kernel it launches is compiled
# into the on-disk cache (README: "Compiled kernels are cached on disk"); the sanitized runs then load them instead of
# compiling each one under the sanitizer (slow). Logs under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
start=$(date +%s)
for f in codec gemv pair mma pdl grouped grouped_pair gemm formats attention; do
  python benchmarks/sanitize.py $f > $OUT/fill_$f.log 2>&1 &
done
wait
echo "cache filled in $(( $(date +%s) - start )) s: $(grep -l 'workload done' $OUT/fill_*.log | wc -l) of 10 families ran"
for tool in ${TOOLS:-memcheck racecheck synccheck initcheck}; do
  t0=$(date +%s)
  timeout ${TOOL_TIMEOUT:-120} compute-sanitizer --tool $tool --print-limit 10 python benchmarks/sanitize.py > $OUT/$tool.log 2>&1
  echo "$tool: exit $? in $(( $(date +%s) - t0 )) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|workload done' $OUT/$tool.log | tr '\n' ' ')"
done
