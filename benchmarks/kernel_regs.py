"""Registers per thread of the decode GEMV specialisations (needs the GPU: ptxas runs at load time).

    python benchmarks/kernel_regs.py
"""
import numpy as np
from numba import cuda

import kbit_numba as kb

rng = np.random.default_rng(0)
W = rng.standard_normal((256, 1024)).astype(np.float32)
qw = kb.quantize(W, k=4)
uw = kb.uniform.quantize(W, 4, 128)
for M in (1, 2, 3, 4):
    A = cuda.to_device(rng.standard_normal((M, 1024)).astype(np.float16))
    kb.gemv(A, qw)
    kb.uniform.gemv(A, uw)
    kb.uniform.gemv(A, uw, int8=True)
    U = kb.uniform
    for name, kern in (("kbit gemv k=4", kb.scalar_gemv.make_gemv_kernel(kb.scalar_gemv.GemvSpec(4, M))),
                       ("uniform 4-bit fp16", U.make_uniform_gemv(U.UniformGemvSpec(4, M, 128))),
                       ("uniform 4-bit int8", U.make_uniform_gemv(U.UniformGemvSpec(4, M, 128, int8=True)))):
        regs = sorted({compiled.regs_per_thread for compiled in kern.overloads.values()})
        print(f"M={M} {name:<20} registers/thread: {regs}")
