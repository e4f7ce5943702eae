"""A/B of the pair gemv against another version of itself, in one run (CUDA-graph timed, L2-cold, the
read floor and cuBLAS fp16 in the same run):

    git show REV:kbit_numba/pair_gemv.py \\
        | sed 's/^from \\. /from kbit_numba /; s/^from \\./from kbit_numba./' > benchmarks/_b_pair_gemv.py
    python benchmarks/ab_pair_gemv.py benchmarks/_b_pair_gemv.py [K x N list] [k list] [M list]

Prints, per shape, k, M and accumulation (fp32, f16_acc), the time of the working tree's kernel (A) and
of the other file's (B), each at its own default plan, alternating A and B three times to expose drift.
REV must be from commit 35dd0d8 on (plan() returning a launch.Plan); for older revisions, compare the whole
package with benchmarks/device_ab_bench.sh. ``--mma``: the same for the tensor-core gemv (``mma_gemv.py`` of REV
as the B file; float16 A only, so one accumulation); ``--fragments`` with it: both on the fragment layout
(``mma_gemv.to_fragments``; N a multiple of 16, K of 256). ``--layouts``: the working tree's pair gemv on the fragment
layout (A) against itself on the code layout (B); give ``-`` for the B file. ``--a-cols=C``, ``--a-warps=W``: A's
plan with those knobs (cols, cta_warps) instead of the defaults. ``--silu`` with ``--mma``: both with the SiLU
epilogue (``silu_pairs=True``, an [M, N / 2] output; give N as the interleaved gate/up width, e.g. 4096x28672).
"""
import importlib.util
import sys

import numpy as np
from numba import cuda

from kbit_numba import bench, mma_gemv, pair_gemv
from kbit_numba.formats import kbit_nbytes
from kbit_numba._timing import graph_time_us, rotation_count

mma = "--mma" in sys.argv
fragments = "--fragments" in sys.argv
layouts = "--layouts" in sys.argv
silu = "--silu" in sys.argv
a_knobs = {name: int(a.split("=")[1]) for a in sys.argv
           for flag, name in (("--a-cols=", "cols"), ("--a-warps=", "cta_warps")) if a.startswith(flag)}
FLAGS = ("--mma", "--fragments", "--layouts", "--silu")
sys.argv = [a for a in sys.argv if a not in FLAGS and not a.startswith("--a-")]
if layouts:
    other = pair_gemv
else:
    spec = importlib.util.spec_from_file_location("gemv_b", sys.argv[1])
    other = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = other               # (its dataclass Spec looks its module up there)
    spec.loader.exec_module(other)
shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[2] if len(sys.argv) > 2 else
                                                         "4096x14336,2048x5120,2048x512").split(",")]
ks = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "4").split(",")]
ms = [int(v) for v in (sys.argv[4] if len(sys.argv) > 4 else "1,4").split(",")]
rng = np.random.default_rng(1)
print(f"{'K x N':>11} {'k':>1} {'M':>2} {'acc':>4} {'A us':>7} {'B us':>7} {'A/B':>6} {'floor':>6} {'A %fl':>6} "
      f"{'cuBLAS':>7} {'A vs cuBLAS':>11}")
for K, N in shapes:
    for k in ks:
        nbytes = kbit_nbytes(N, K, k)
        n = rotation_count(nbytes)
        codes = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, k, n, rng)]
        kcs = [mma_gemv.to_fragments(kc) for kc in codes] if fragments or layouts else codes     # A's weights
        kcs_b = codes if layouts else kcs
        for M in ms:
            A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
            out = cuda.device_array((M, N // 2 if silu else N), np.float16)
            floor = bench.floor_us(nbytes + M * K * 2 + M * out.shape[1] * 2)
            cub = bench.cublas_row(K, N, M) or 0.0
            for f16 in (False,) if mma else (False, True):
                ts = {}
                for rep in range(3):
                    for name, mod in (("A", mma_gemv if mma else pair_gemv), ("B", other)):
                        options = {"silu_pairs": True} if silu else {} if mma else {"f16_acc": f16}
                        options.update(a_knobs if name == "A" else {})
                        weights = kcs if name == "A" else kcs_b
                        launches = [mod.plan(A, kc, out, 0, **options).prepare().run for kc in weights]
                        t = graph_time_us(lambda i, s: launches[i % n](s), n * max(1, 64 // n))
                        ts.setdefault(name, []).append(t)
                a, b = min(ts["A"]), min(ts["B"])
                print(f"{K:>5}x{N:<5} {k} {M:>2} {'f16' if f16 else 'fp32':>4} {a:7.2f} {b:7.2f} {a / b:6.3f} "
                      f"{floor:6.2f} {100 * floor / a:6.1f} {cub:7.2f} {cub / a:10.2f}x   "
                      f"(A {' '.join(f'{x:.2f}' for x in ts['A'])}; B {' '.join(f'{x:.2f}' for x in ts['B'])})",
                      flush=True)
