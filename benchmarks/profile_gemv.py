"""A few gemv launches for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
        --section SchedulerStats --section LaunchStats -k regex:gemv python benchmarks/profile_gemv.py K N k M [KERNEL]

KERNEL: ``gemv`` (the scalar gemv, default), ``pair`` or ``pair_f16`` (the pair gemv on the code layout,
fp32 or ``f16_acc`` sums; k = 2 or 4; ``pair_frag``, ``pair_f16_frag``: on the fragment layout), ``mma`` (the
tensor-core gemv, M <= 32; with K split the main launch is the one named mma_gemv; ``mma_frag``: on the fragment
layout; ``mma_silu``: its SiLU epilogue, N the gate/up width). ``PAIR_KNOBS=cols=2,cta_warps=8,silu_pairs=1,pdl=1``
(environment): the pair gemv's ``plan`` knobs, e.g. the decode step's build of a projection (the table's rule).
"""
import os
import sys

import numpy as np
from numba import cuda

import kbit_numba as kb

K, N, k, M = (int(v) for v in sys.argv[1:5]) if len(sys.argv) > 4 else (4096, 14336, 4, 1)
kernel = sys.argv[5] if len(sys.argv) > 5 else "gemv"
rng = np.random.default_rng(0)
qw = kb.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float16), k=k)
A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
if kernel == "gemv":
    prep = kb.prepare_gemv(A, qw)
elif kernel == "mma":
    prep = kb.mma_gemv.prepare(A, kb.pair_gemv.to_codes(qw))
elif kernel == "mma_frag":
    prep = kb.mma_gemv.prepare(A, kb.mma_gemv.to_fragments(kb.pair_gemv.to_codes(qw)))
elif kernel == "mma_silu":
    prep = kb.mma_gemv.plan(A, kb.pair_gemv.to_codes(qw), silu_pairs=True).prepare()
else:
    kc = kb.pair_gemv.to_codes(qw)
    knobs = {key: int(v) for key, v in (kv.split("=") for kv in os.environ.get("PAIR_KNOBS", "").split(",") if kv)}
    prep = kb.pair_gemv.plan(A, kb.mma_gemv.to_fragments(kc) if kernel.endswith("_frag") else kc,
                             f16_acc=kernel.startswith("pair_f16"), **knobs).prepare()
for _ in range(3):
    prep.run()
cuda.synchronize()
print("done", kernel, K, N, k, M)
