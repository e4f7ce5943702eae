"""Split-K / m-tile (or pipeline stage) sweep of the tensor-core GEMM on the device (GPU time, CUDA
graphs, L2-cold):

    python benchmarks/sweep_gemm.py [KxN,...] [M,...] [stages,...]

Without a stage list: splits x m-tiles at the default pipeline depth; with one: those stage counts at
the automatic split and m-tile.
"""
import sys

import numpy as np
from numba import cuda

from kbit_numba import bench, tensor_gemm
from kbit_numba._timing import graph_time_us, rotation_count

shapes = [bench._shape(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "2048x5120,4096x14336").split(",")]
ms = [int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else "8,16,32,64").split(",")]
stage_list = [int(s) for s in sys.argv[3].split(",")] if len(sys.argv) > 3 else [None]
rng = np.random.default_rng(0)
sm = cuda.get_current_device().MULTIPROCESSOR_COUNT
print(f"{'K x N':>11} {'M':>4} {'MT':>3} {'split':>5} {'stages':>6} {'CTAs':>6} {'us':>8}  cuBLAS")
for K, N in shapes:
    nbytes = N * K // 32 * 17
    n = rotation_count(nbytes)
    ws = bench._tiled_copies(bench._rotating_weights(K, N, 4, n, rng))
    for M in ms:
        A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
        out = cuda.device_array((M, N), np.float16)
        sums = tensor_gemm.new_workspace(M, N)
        cub = bench.cublas_row(K, N, M)
        mt_auto = tensor_gemm.m_tile_for(M)
        auto = tensor_gemm.choose_split(M, N, K, mt_auto, sm)[0]
        combos = ([(mt, split, None) for mt in sorted({mt_auto, 1, 2}) for split in sorted({auto, 4, 8, 16, 32})]
                  if stage_list == [None] else [(mt_auto, auto, st) for st in stage_list])
        for mt, split, stages in combos:
            plans = [tensor_gemm.plan(A, w, out, 0, np.float16, False, sums, split, mt, stages).prepare() for w in ws]

            def launch(i, s, plans=plans):
                plans[i % n].run(s)
            t = graph_time_us(launch, n * max(1, 32 // n))
            grid = plans[0].plan.steps[0].grid
            ctas = grid[0] * grid[1] * grid[2]
            print(f"{K:>5}x{N:<5} {M:>4} {mt:>3} {split:>5} {stages or 'auto':>6} {ctas:>6} {t:8.2f}  {cub:7.2f}"
                  + ("  (auto)" if split == auto and mt == mt_auto and stages is None else ""), flush=True)
