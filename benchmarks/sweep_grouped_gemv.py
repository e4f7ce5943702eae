"""Launch knobs of grouped_gemv at a decode step's routing (E = 128 experts, top-8; the qwen3-30b-a3b expert
shapes, k = 4, tiled layout as bench --model uses): columns per iteration x resident warps per SM the grid aims
for (``scalar_gemv.DEFAULTS["cols"]``, ``scalar_gemv.CTA_WARPS_TARGET``). CUDA graphs, two L2-cold expert sets;
the floor is a pure-read kernel over the active experts' bytes.

    python benchmarks/sweep_grouped_gemv.py [B list] [cols list] [warps list]
"""
import sys

import numpy as np
from numba import cuda

import kbit_numba as kb
from kbit_numba import bench, reference as ref, scalar_gemv
from kbit_numba.formats import kbit_nbytes
from kbit_numba._timing import graph_time_us

args = sys.argv[1:]
batches = [int(v) for v in (args[0] if args else "1,4").split(",")]
cols_list = [int(v) for v in (args[1] if len(args) > 1 else "1,2,4,8").split(",")]
warps_list = [int(v) for v in (args[2] if len(args) > 2 else "32,64").split(",")]
rng = np.random.default_rng(3)
E, top, k = 128, 8, 4
for K, N in ((2048, 1536), (768, 2048)):
    base = [ref.repack_tiled(ref.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.02, k=k)) for _ in range(8)]
    sets = [kb.stack_experts([base[(e + s) % 8] for e in range(E)]) for s in range(2)]
    for B in batches:
        routes = np.stack([rng.choice(E, top, replace=False) for _ in range(B)])
        counts = np.bincount(routes.reshape(-1), minlength=E)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        T, mt = int(offsets[-1]), int(counts.max())
        A = cuda.to_device(rng.standard_normal((T, K)).astype(np.float16))
        out = cuda.device_array((T, N), np.float16)
        d_off = cuda.to_device(offsets)
        floor = bench.floor_us(int((counts > 0).sum()) * kbit_nbytes(N, K, k))
        line = []
        for cols in cols_list:
            for warps in warps_list:
                scalar_gemv.DEFAULTS["cols"], scalar_gemv.CTA_WARPS_TARGET = cols, warps
                runs = [scalar_gemv.plan_grouped(A, s, d_off, out=out, max_tokens=mt).prepare().run for s in sets]
                line.append(f"c{cols}/w{warps} {graph_time_us(lambda i, s: runs[i % 2](s), 16):6.2f}")
        print(f"K={K} N={N} B={B} active={(counts > 0).sum()} floor {floor:.2f} us | " + "  ".join(line), flush=True)
