"""A few tensor-core GEMM launches for Nsight Compute, and the kernel's registers per thread:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
        --section LaunchStats -k regex:gemm_kernel python benchmarks/profile_gemm.py K N k M [tiled|codes]

``codes``: the weight on the code layout (``pair_gemv.to_codes``: KbitLinear's default) instead of the tiled one.
"""
import sys

import numpy as np
from numba import cuda

import kbit_numba as kb

K, N, k, M = (int(v) for v in sys.argv[1:5]) if len(sys.argv) > 4 else (4096, 14336, 4, 8)
layout = sys.argv[5] if len(sys.argv) > 5 else "tiled"
rng = np.random.default_rng(0)
flat = kb.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float16), k=k)
qw = kb.pair_gemv.to_codes(flat) if layout == "codes" else kb.repack_tiled(flat)
A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
out = cuda.device_array((M, N), np.float16)
plan = kb.tensor_gemm.plan(A, qw, out, workspace=kb.tensor_gemm.new_workspace(M, N))   # what gemm() launches
for _ in range(3):
    plan.launch()
cuda.synchronize()
kern = plan.steps[0].kernel                               # the GEMM kernel (a finish kernel may follow)
print("done", K, N, k, M, layout, "registers/thread:", sorted({c.regs_per_thread for c in kern.overloads.values()}))
