"""A few gemv launches for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
        --section SchedulerStats --section LaunchStats -k regex:gemv python benchmarks/profile_gemv.py K N k M
"""
import sys

import numpy as np
from numba import cuda

import kbit_numba as kb

K, N, k, M = (int(v) for v in sys.argv[1:5]) if len(sys.argv) > 4 else (4096, 14336, 4, 1)
rng = np.random.default_rng(0)
qw = kb.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float16), k=k)
A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
prep = kb.prepare_gemv(A, qw)
for _ in range(3):
    prep.run()
cuda.synchronize()
print("done", K, N, k, M)
