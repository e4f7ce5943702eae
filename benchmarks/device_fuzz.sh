#!/usr/bin/env bash
# The GPU fuzz profile (issue 14): KBIT_FUZZ examples per kernel family (tests/helpers.FUZZ_FAMILIES), over the
# machine's cores; the examples each family ran are counted and printed (benchmarks/fuzz_counts.py).
# Usage (repo root on the device): [KBIT_FUZZ=N] [FUZZ_TIMEOUT=s] [LOG=name] bash benchmarks/device_fuzz.sh
# Kernels compiled by earlier runs on the same machine come from the on-disk cache (README: "Compiled kernels").
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1 KBIT_FUZZ=${KBIT_FUZZ:-2000}
# the run's kernel variants (tests/helpers.variants): KBIT_FUZZ_SEED=s draws the same ones again
export KBIT_FUZZ_SEED=${KBIT_FUZZ_SEED:-$RANDOM}; echo "KBIT_FUZZ_SEED=$KBIT_FUZZ_SEED"
# (BLAS threads are left at NumPy's default: one thread per worker was ~4x slower, tests/README.md)
log=${OUT:-/tmp}/${LOG:-fuzz}.log
export KBIT_FAILURE_LOG=${OUT:-/tmp}/${LOG:-fuzz}_failures.log   # failures as they happen (tests/conftest.py)
export KBIT_FUZZ_COUNTS=/tmp/${LOG:-fuzz}_counts; rm -f $KBIT_FUZZ_COUNTS.*   # examples per property (conftest.py)
export KBIT_COMPILE_LOG=/tmp/${LOG:-fuzz}_compiles; rm -f $KBIT_COMPILE_LOG.*  # kernel compiles per test (conftest.py)
(cd tests && /usr/bin/time -f "fuzz wall %e s" timeout ${FUZZ_TIMEOUT:-580} python -m pytest -v -rfE -n $(nproc) --dist worksteal \
   -p no:cacheprovider -m fuzz --durations=0 . > $log 2>&1)
echo "KBIT_FUZZ=$KBIT_FUZZ: $(grep -E '(passed|failed).* in ' $log | tail -1); $(grep 'fuzz wall' $log)"
echo "summed property time $(grep -E '^[0-9.]+s call' $log | awk '{s += $1} END {print s}') s; kernels in the cache: $(find ${KBIT_NUMBA_CACHE_DIR:-$HOME/.cache/kbit_numba} -name '*.nbk' | wc -l)"
cat $KBIT_FUZZ_COUNTS.* > ${OUT:-/tmp}/${LOG:-fuzz}_examples.jsonl; python benchmarks/fuzz_counts.py $KBIT_FUZZ_COUNTS --need $KBIT_FUZZ | tee ${OUT:-/tmp}/${LOG:-fuzz}_counts.txt
grep -E "^FAILED|^ERROR|\] (FAILED|ERROR) |Falsifying|reproduce_failure" $log | head -20
[ -s $KBIT_FAILURE_LOG ] && grep -A12 "Falsifying example" $KBIT_FAILURE_LOG | head -60
grep -E '^[0-9.]+s call' $log | head -8
python benchmarks/compile_log.py $KBIT_COMPILE_LOG 8 | head -24
