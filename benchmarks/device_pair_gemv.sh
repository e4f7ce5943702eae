#!/usr/bin/env bash
# One device visit for a pair-gemv change: its tests and the intrinsics' and linear's, memcheck + racecheck,
# Nsight instructions per weight, and the bench rows (gemv, pair_gemv, pair_gemv[f16] and linear on the
# code layout, with cuBLAS fp16 and the read floor in the same run). Logs under $OUT. Needs .whl (see
# shared/device.md). Usage: bash benchmarks/device_pair_gemv.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee $OUT/tests.txt
(cd tests && timeout 240 python -m pytest -q -x -n 16 test_pair_gemv.py test_intrinsics.py test_linear.py -p no:cacheprovider 2>&1 | tail -5) | tee -a $OUT/tests.txt
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool python benchmarks/sanitize.py pair 2>&1 | tail -2 | tee -a $OUT/tests.txt
done
timeout 200 python benchmarks/instructions_per_weight.py 2048x5120,4096x14336,2048x512 4 1,4 2>&1 | tee $OUT/inst_per_weight.txt | tail -20
timeout 300 python -m kbit_numba.bench --shapes 2048x5120,4096x14336,5120x2048,2048x512 --k 2,4 --m 1,2,4 --kernels gemv,pair_gemv,linear --pair-f16 --json $OUT/pair_bench.json 2>$OUT/progress.log > $OUT/pair_bench.txt
tail -3 $OUT/progress.log; cat $OUT/tests.txt
