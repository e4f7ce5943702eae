#!/usr/bin/env bash
# One device visit: the whole GPU test suite (simulator off) over the machine's cores with pytest-xdist,
# slowest tests printed; then compute-sanitizer memcheck + racecheck of the pair gemv. Logs under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
(cd tests && /usr/bin/time -f "suite wall %e s" timeout ${SUITE_TIMEOUT:-420} python -m pytest -q -n $(nproc) -p no:cacheprovider --durations=25 . > $OUT/suite.log 2>&1; tail -32 $OUT/suite.log)
for tool in memcheck racecheck; do   # (skipped if SUITE_ONLY=1)
  [ -n "$SUITE_ONLY" ] && break
  timeout 200 compute-sanitizer --tool $tool python benchmarks/sanitize.py pair > $OUT/$tool.log 2>&1
  echo "$tool exit $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|workload done' $OUT/$tool.log | tr '\n' ' ')"
done
