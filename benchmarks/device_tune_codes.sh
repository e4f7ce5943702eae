#!/usr/bin/env bash
# Retune this GPU's linear() table for the code layout's gemvs and check it, in one device call:
#     TUNE_SHAPES=4096x28672,4096x6144 [TUNE_VARIANTS=fp32,fp32+pdl] [TUNE_K=2,4] [TUNE_KEEP_GENERAL=1] \
#       bash benchmarks/device_tune_codes.sh
# 1. `bench --tune-codes` over the shapes (its rows: $OUT/tc_rows.json and tc.txt; the retuned table: $OUT/tc.json),
#    written into kbit_numba/tuning/ on the device only;
# 2. test_linear.py on the GPU with that table (device_suite.sh; a table change needs it before it is committed);
# 3. `linear` beside the pair and tensor-core gemvs at M = 1, 2 on the shapes (is it within 5% of the best?).
# Then here: copy $OUT/tc.json over the table, and `git diff` shows the rules that moved (a retune keeps the
# variants' order). Why a routine: a kernel change that moves a gemv's row by more than ~5% leaves the tuned rules
# stale (the M = 2 rules of the eighty-ninth session); this catches it in ~4-6 minutes a GPU. It leaves six files
# under $OUT, seven with TUNE_CACHE_OUT=1 (the device tool brings back eight at most: a first version's eleven lost
# the table). Tune several shapes at once: the tune rewrites a variant's general rules (those of shapes it has no
# entry for) from the shapes it timed, so one shape's tune would set them from that shape alone; TUNE_KEEP_GENERAL=1
# (--tune-keep-general) keeps them and writes the shapes' entries only (for shapes other than the seed shapes). The
# tune writes the table after each shape, so one cut by TUNE_TIMEOUT leaves the shapes it finished in tc.json (and
# test_linear.py runs on that); on a cold machine the first compiles took more than 360 s for two variants over
# three shapes (2026-12-06), one after another. So the tune first compiles them in TUNE_COMPILE_WORKERS processes at
# once (bench --tune-compile-workers; default: one a core, 0 for none): 2026-12-07 on an H100, 72 compiles for two
# variants over the three seed shapes took 55 s in 16 processes (8 had work, one a build key), and the tune after it
# 21 s (benchmarks/README.md, "Ninety-fourth session"). The kernel cache below can also carry the builds from an
# earlier call.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
shapes=${TUNE_SHAPES:?TUNE_SHAPES=KxN,... (the shapes to tune)}
# The compiled-kernel cache (kbit_numba/_cache.py) as one file each way: a fresh machine compiles every knob set's
# build first (2026-12-06: a tune took 258 s on a fresh machine; another, whose kernels the call before had compiled
# on the same machine, 17 s; not yet tried with a carried cache). A carried .kcache.tgz (this script's
# $OUT/kcache.tgz of an earlier call: `cp .../kcache.tgz .kcache.tgz`, carry it) is unpacked into the cache before
# the tune, and TUNE_CACHE_OUT=1 packs the cache into $OUT/kcache.tgz after it (the device returns files of up to
# 16 MiB). Only the same package sources load it: the cache is keyed by them.
cache_base=$(python3 -c "from kbit_numba import _cache; print(_cache.cache_dir().parent)")
if [ -f .kcache.tgz ]; then mkdir -p "$cache_base" && tar -xzf .kcache.tgz -C "$cache_base" \
  && echo "kernel cache: $(find "$cache_base" -type f | wc -l) files unpacked"; fi
table=$(python3 -c "from numba import cuda; from kbit_numba import dispatch
print(dispatch.device_key(cuda.get_current_device().name))")
echo "table kbit_numba/tuning/$table.json; $(date -u)"
cp "kbit_numba/tuning/$table.json" "$OUT/tc.json" 2>/dev/null || echo '{}' > "$OUT/tc.json"
t0=$(date +%s)
timeout "${TUNE_TIMEOUT:-300}" python3 -m kbit_numba.bench --tune-codes "$OUT/tc.json" \
  --tune-compile-workers "${TUNE_COMPILE_WORKERS:-$(nproc)}" --tune-variants "${TUNE_VARIANTS:-fp32,fp32+pdl}" \
  --k "${TUNE_K:-2,4}" --shapes "$shapes" ${TUNE_KEEP_GENERAL:+--tune-keep-general} --json "$OUT/tc_rows.json" \
  > "$OUT/tc.txt" 2> /tmp/tc.err
rc=$?   # the time line and the pre-pass's summary also go into tc.txt: the device tool returns only the output's tail
echo "tune rc $rc $(( $(date +%s) - t0 )) s" | tee -a "$OUT/tc.txt"
# the pair gemv's default plan and the tensor-core gemv (every knob set's row is in tc.txt)
grep -E "^(mma_gemv|pair_gemv) " "$OUT/tc.txt" | head -80
grep -E "compile part|kernel cache filled" /tmp/tc.err | tail -3 | tee -a "$OUT/tc.txt"; tail -2 /tmp/tc.err
cp "$OUT/tc.json" "kbit_numba/tuning/$table.json"
t0=$(date +%s)
mkdir -p /tmp/suite && OUT=/tmp/suite SUITE_ONLY=1 SUITE_TIMEOUT=${SUITE_TIMEOUT:-200} SUITE_FILES=test_linear.py \
  bash benchmarks/device_suite.sh > /tmp/suite/out.log 2>&1
cp /tmp/suite/suite.log "$OUT/suite.log"
echo "test_linear.py $(( $(date +%s) - t0 )) s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/suite.log" | tail -1)"
t0=$(date +%s)
timeout "${GRID_TIMEOUT:-200}" python3 -m kbit_numba.bench --shapes "$shapes" --k "${TUNE_K:-2,4}" --m 1,2 \
  --kernels pair_gemv,mma_gemv,linear --json "$OUT/lin.json" > "$OUT/lin.txt" 2> /tmp/lin.err
echo "grid rc $? $(( $(date +%s) - t0 )) s"; grep -E "^ *(pair|mma|linear)" "$OUT/lin.txt"
if [ -n "${TUNE_CACHE_OUT:-}" ]; then
  here=$(python3 -c "from kbit_numba import _cache; print(_cache.cache_dir().name)")
  tar -C "$cache_base" -czf /tmp/kcache.tgz "$here" && size=$(stat -c %s /tmp/kcache.tgz)
  echo "kernel cache: $(find "$cache_base/$here" -type f | wc -l) files, $size bytes packed"
  [ "$size" -lt 16000000 ] && cp /tmp/kcache.tgz "$OUT/kcache.tgz"
fi
date -u
