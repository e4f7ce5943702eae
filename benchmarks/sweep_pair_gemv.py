"""Sweep the pair gemv's launch knobs on the GPU (CUDA-graph timed, L2-cold, the read floor and cuBLAS fp16
in the same run):

    python benchmarks/sweep_pair_gemv.py [K x N list] [k] [M list] [f16|fp32] [knob sets]

Knobs: cols (columns per warp per iteration) and cta_warps (warps per CTA aimed at). Prints one row per
point; the default plan is the first of each shape/M. ``f16``: every point with ``f16_acc=True``. Knob sets
(default: ``KNOBS``): e.g. ``"cols=2;cta_warps=20;cols=2,cta_warps=8"``. ``REPS=3`` in the environment times
the knob sets in turns three times (drift shows as a spread) and prints the best of each.
"""
import os
import sys

import numpy as np
from numba import cuda

from kbit_numba import bench, pair_gemv
from kbit_numba._timing import graph_time_us, rotation_count

KNOBS = [dict(), dict(cols=2), dict(cols=4), dict(cols=8), dict(cta_warps=8), dict(cols=2, cta_warps=8),
         dict(cols=2, cta_warps=32)]

shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else
                                                         "2048x5120,5120x2048,2048x512,4096x14336").split(",")]
k = int(sys.argv[2]) if len(sys.argv) > 2 else 4
ms = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "1,4").split(",")]
if len(sys.argv) > 5:
    KNOBS = [dict()] + [{kv.split("=")[0]: int(kv.split("=")[1]) for kv in knob.split(",")}
                        for knob in sys.argv[5].split(";")]
if len(sys.argv) > 4 and sys.argv[4] == "f16":
    KNOBS = [dict(kn, f16_acc=True) for kn in KNOBS]
REPS = int(os.environ.get("REPS", "1"))
rng = np.random.default_rng(1)
print(f"{'K x N':>11} {'M':>2} {'knobs':<28} {'us':>7} {'floor':>6} {'%floor':>6} {'cuBLAS':>7} {'speedup':>7}")
for K, N in shapes:
    nbytes = N * K // 32 * (4 * k + 1)
    n = rotation_count(nbytes)
    kcs = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, k, n, rng)]
    for M in ms:
        A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
        out = cuda.device_array((M, N), np.float16)
        floor = bench.floor_us(nbytes + M * K * 2 + M * N * 2)
        cub = bench.cublas_row(K, N, M)
        times = {}
        for rep in range(REPS):                 # the knob sets in turns, REPS times: the best of each is printed
            for j, knobs in enumerate(KNOBS):
                launches = [pair_gemv.plan(A, kc, out, 0, **knobs).prepare().run for kc in kcs]
                times.setdefault(j, []).append(graph_time_us(lambda i, s: launches[i % n](s), n * max(1, 64 // n)))
        for j, knobs in enumerate(KNOBS):
            t = min(times[j])
            print(f"{K:>5}x{N:<5} {M:>2} {str(knobs):<28} {t:7.2f} {floor:6.2f} {100 * floor / t:6.1f} "
                  f"{cub or 0:7.2f} {(cub or 0) / t:6.2f}x" + (f"   ({' '.join(f'{x:.2f}' for x in times[j])})"
                                                             if REPS > 1 else ""), flush=True)
