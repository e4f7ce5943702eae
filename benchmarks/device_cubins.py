"""The device's own machine code of a tensor-core gemv build (GPU): registers, local (spill) bytes and the cubin.

    python benchmarks/device_cubins.py TAG K N k M [--fragments] [--pdl]      (cubins to $OUT, else /tmp)

Builds ``mma_gemv.plan`` for an M x K float16 activation and a random K x N weight (code layout, or the fragment
layout with ``--fragments``; a PDL build with ``--pdl``), launches it once, and for each launch of the plan prints the
registers a thread and the local bytes a thread the driver reports, and writes its cubin as ``cubin_TAG_<step>.cubin``.
Disassemble it anywhere with ``nvdisasm -c`` (CUDA toolkit, or ``pip install nvidia-cuda-nvdisasm``).

Why: the local ptxas (``sass_stats.py``) and the device's linker (nvJitLink) need not agree. On 2026-12-06 the local
ptxas spilled 16 / 16 bytes in main's plain two-tile fragment build where the H200's build spilled nothing, and only
the device's cubins showed why a candidate's plain build ran 4% slower: 48 more instructions of address arithmetic
(benchmarks/README.md, "Eighty-fifth session").
"""
import argparse
import os

import numpy as np
from numba import cuda

import kbit_numba as kb

p = argparse.ArgumentParser()
p.add_argument("tag")
p.add_argument("K", type=int)
p.add_argument("N", type=int)
p.add_argument("k", type=int)
p.add_argument("M", type=int)
p.add_argument("--fragments", action="store_true")
p.add_argument("--pdl", action="store_true")
a = p.parse_args()

rng = np.random.default_rng(0)
kc = kb.pair_gemv.to_codes(kb.quantize((rng.standard_normal((a.N, a.K)) * 0.02).astype(np.float16), k=a.k))
A = cuda.to_device(rng.standard_normal((a.M, a.K)).astype(np.float16))
plan = kb.mma_gemv.plan(A, kb.mma_gemv.to_fragments(kc) if a.fragments else kc, pdl=a.pdl)
plan.launch()
cuda.synchronize()
cc = cuda.get_current_device().compute_capability
for i, step in enumerate(plan.steps):
    for kernel in step.kernel.overloads.values():
        code = kernel.library.get_cubin(cc=cc)
        code = bytes(getattr(code, "code", code))       # (a cuda.core ObjectCode where numba-cuda links with it)
        path = os.path.join(os.environ.get("OUT", "/tmp"), f"cubin_{a.tag}_{i}.cubin")
        with open(path, "wb") as f:
            f.write(code)
        print(f"{a.tag} step {i}: {kernel.regs_per_thread} registers, {kernel.local_mem_per_thread} local bytes a "
              f"thread, cubin {path} ({len(code)} bytes)")
