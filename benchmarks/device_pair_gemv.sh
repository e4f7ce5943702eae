#!/usr/bin/env bash
# One device visit for a pair-gemv change: its tests and the intrinsics', memcheck + racecheck, Nsight
# instructions per weight, and the bench rows (gemv vs pair_gemv with cuBLAS fp16 and the read floor in
# the same run). Needs .whl (see shared/device.md). Usage: bash benchmarks/device_pair_gemv.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
(cd tests && timeout 200 python -m pytest -q -x -n 16 test_pair_gemv.py test_intrinsics.py -p no:cacheprovider 2>&1 | tail -3)
timeout 120 compute-sanitizer --tool memcheck python benchmarks/sanitize.py pair 2>&1 | tail -2
timeout 120 compute-sanitizer --tool racecheck python benchmarks/sanitize.py pair 2>&1 | tail -2
timeout 200 python benchmarks/instructions_per_weight.py 2048x5120,4096x14336,2048x512 4 1,4 2>&1 | tee $OUT/inst_per_weight.txt | tail -15
timeout 280 python -m kbit_numba.bench --shapes 2048x5120,4096x14336,5120x2048,2048x512 --k 2,4 --m 1,2,4 --kernels gemv,pair_gemv --json $OUT/pair_bench.json 2>$OUT/progress.log | tee $OUT/pair_bench.txt
tail -3 $OUT/progress.log
