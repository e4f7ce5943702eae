#!/usr/bin/env bash
# One device visit: the whole GPU test suite (simulator off) over the machine's cores with pytest-xdist,
# slowest tests printed; then compute-sanitizer memcheck + racecheck of the pair gemv. Logs under $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
# worksteal (pytest-xdist >= 3.2): an idle worker takes queued tests from a busy one, so the slow properties
# (tens of seconds of kernel compiles each) do not pile up behind each other on one worker
# SUITE_FILES: test files to run (relative to tests/, e.g. "test_gemm.py test_mma_gemv.py"; default: all)
files=${SUITE_FILES:-.}
# every kernel compile, by test (conftest.py; summed below by benchmarks/compile_log.py)
export KBIT_COMPILE_LOG=/tmp/suite_compiles; rm -f $KBIT_COMPILE_LOG.*
dist=$(python -c "import xdist; print('worksteal' if tuple(map(int, xdist.__version__.split('.')[:2])) >= (3, 2) else 'load')")
(cd tests && /usr/bin/time -f "suite wall %e s" timeout ${SUITE_TIMEOUT:-420} python -m pytest -v -n $(nproc) --dist $dist -p no:cacheprovider --durations=0 -o faulthandler_timeout=150 $files > $OUT/suite.log 2>&1
 grep -m1 "kernel variants of" $OUT/suite.log
 echo "dist $dist; test time summed over workers: $(grep -E '^[0-9.]+s (call|setup|teardown)' $OUT/suite.log | awk '{s += $1} END {print s}') s"
 grep -v -i warn $OUT/suite.log | grep -v -E "PASSED|SKIPPED|^[0-9.]+s (call|setup|teardown)" | tail -30
 grep -E '^[0-9.]+s (call|setup)' $OUT/suite.log | head -12
 # tests that never finished (a hang or the time limit): collected but without a result line
 python -m pytest -q --co -p no:cacheprovider $files 2>/dev/null | grep :: | sed 's|^tests/||' | sort > /tmp/collected.txt
 # (a result line can carry a warning's text after the test's id, and ids can hold spaces: match id, then end or space)
 echo "unfinished: $(python ../benchmarks/unfinished_tests.py $OUT/suite.log /tmp/collected.txt)")
cat $KBIT_COMPILE_LOG.* > $OUT/compiles.tsv 2>/dev/null; python benchmarks/compile_log.py $KBIT_COMPILE_LOG 12
for tool in memcheck racecheck; do   # (skipped if SUITE_ONLY=1)
  [ -n "$SUITE_ONLY" ] && break
  timeout 200 compute-sanitizer --tool $tool python benchmarks/sanitize.py pair > $OUT/$tool.log 2>&1
  echo "$tool exit $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|workload done' $OUT/$tool.log | tr '\n' ' ')"
done
