"""The kbit kernels on the two layouts KbitLinear can keep, in one run (CUDA-graph timed, L2-cold weights,
cuBLAS fp16 and the read floor of the same run):

    python benchmarks/codes_vs_tiled.py [K x N list] [k list] [M list] [--chunk8] [--stages=S] [--ab=FILE]

Per shape, k and M: the pair gemv and the tensor-core gemm on the code layout (``KbitCodes``), the scalar
gemv and the gemm on the tiled layout, and what ``linear`` picks for each layout. Decides whether the code
layout can be KbitLinear's default (one copy of the weight that serves every M).

``--chunk8`` adds ``gemm(c),C8``: the code-layout gemm under the absmax chunk rule before the forty-fourth session
(chunks of 8 K tiles only, K a multiple of 512, every split rounded up to 8 tiles) against today's
``tensor_gemm.absmax_chunk`` (8, 4 or 2 tiles, keeping 3/4 of the splits). ``--stages=S`` adds ``gemm(c),SS`` and
``gemm(t),SS``: both gemms with a ring of S K tiles (``tensor_gemm.plan(stages=S)``) instead of ``default_stages``.
``--ab=FILE`` adds ``gemm(c),ab`` and ``gemm(t),ab``: both gemms from another version of ``tensor_gemm.py`` (e.g.
``git show REV:kbit_numba/tensor_gemm.py > /tmp/tg.py``), timed in the same process as today's: an A/B of a kernel
change without two processes (the kernel cache keys each build by its code).
"""
import importlib.util
import sys
from unittest.mock import patch

import numpy as np
from numba import cuda

from kbit_numba import bench, dispatch, pair_gemv, scalar_gemv, tensor_gemm
from kbit_numba.formats import kbit_nbytes
from kbit_numba.codec import repack_tiled
from kbit_numba._timing import graph_time_us, rotation_count

args = [a for a in sys.argv[1:] if not a.startswith("--")]
chunk8 = "--chunk8" in sys.argv
stages = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--stages=")), None)
ab_file = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--ab=")), None)
if ab_file:                  # the other version as a module of the package (its relative imports resolve there)
    spec = importlib.util.spec_from_file_location("kbit_numba._tensor_gemm_ab", ab_file)
    tensor_gemm_ab = sys.modules[spec.name] = importlib.util.module_from_spec(spec)    # (dataclasses look it up)
    spec.loader.exec_module(tensor_gemm_ab)
shapes = [tuple(int(v) for v in s.split("x")) for s in (args[0] if args else
                                                         "4096x14336,2048x5120,4096x6144,14336x4096").split(",")]
ks = [int(v) for v in (args[1] if len(args) > 1 else "4,2").split(",")]
ms = [int(v) for v in (args[2] if len(args) > 2 else "1,2,4,5,8,16,32").split(",")]
rng = np.random.default_rng(1)
cols = (["pair(c)", "gemm(c)"] + (["gemm(c),C8"] if chunk8 else []) + ([f"gemm(c),S{stages}"] if stages else [])
        + (["gemm(c),ab"] if ab_file else []) + ["gemv(t)", "gemm(t)"] + ([f"gemm(t),S{stages}"] if stages else [])
        + (["gemm(t),ab"] if ab_file else []) + ["lin(c)", "lin(t)"])


def chunk8_rule(K, per, stages):
    """The absmax chunk rule before the forty-fourth session: 8 K tiles where K % 512 == 0, splits rounded up."""
    return (8, -(-per // 8) * 8) if K % 512 == 0 else (0, per)


def chunk8_plan(*a, **kw):
    """tensor_gemm.plan under ``chunk8_rule`` (patched for this call only)."""
    with patch.object(tensor_gemm, "absmax_chunk", chunk8_rule):
        return tensor_gemm.plan(*a, **kw)


width = {c: max(8, len(c)) for c in cols}
print(f"{'K x N':>11} {'k':>1} {'M':>2} " + " ".join(f"{c:>{width[c]}}" for c in cols) + f" {'cuBLAS':>7} {'floor':>6}"
      " best(c)/best(t) best(c) vs cuBLAS")
for K, N in shapes:
    for k in ks:
        nbytes = kbit_nbytes(N, K, k)
        n = rotation_count(nbytes)
        flats = bench._rotating_weights(K, N, k, n, rng)
        codes = [pair_gemv.to_codes(w) for w in flats]
        tiled = [repack_tiled(w) for w in flats]
        del flats
        for M in ms:
            A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
            out = cuda.device_array((M, N), np.float16)
            ws = dispatch.Workspace()
            plans = {
                "pair(c)": (lambda w: pair_gemv.plan(A, w, out, 0)) if M <= 4 else None,
                "gemm(c)": lambda w: tensor_gemm.plan(A, w, out, 0, workspace=ws.sums(M * N)),
                "gemm(c),C8": lambda w: chunk8_plan(A, w, out, 0, workspace=ws.sums(M * N)),
                f"gemm(c),S{stages}": lambda w: tensor_gemm.plan(A, w, out, 0, workspace=ws.sums(M * N), stages=stages),
                f"gemm(t),S{stages}": lambda w: tensor_gemm.plan(A, w, out, 0, workspace=ws.sums(M * N), stages=stages),
                "gemm(c),ab": lambda w: tensor_gemm_ab.plan(A, w, out, 0, workspace=ws.sums(M * N)),
                "gemm(t),ab": lambda w: tensor_gemm_ab.plan(A, w, out, 0, workspace=ws.sums(M * N)),
                "gemv(t)": (lambda w: scalar_gemv.plan(A, w, out, 0)) if M <= 4 else None,
                "gemm(t)": lambda w: tensor_gemm.plan(A, w, out, 0, workspace=ws.sums(M * N)),
                "lin(c)": lambda w: dispatch.plan(A, w, out, 0, ws),
                "lin(t)": lambda w: dispatch.plan(A, w, out, 0, ws),
            }
            t = {}
            for name, make in plans.items():
                if make is None or name not in cols:
                    continue
                weights = codes if "(c)" in name else tiled
                runs = [make(w).prepare().run for w in weights]
                t[name] = graph_time_us(lambda i, s: runs[i % n](s), n * max(1, 64 // n))
            floor = bench.floor_us(nbytes + M * K * 2 + M * N * 2)
            cub = bench.cublas_row(K, N, M) or float("nan")
            best_c = min(v for key, v in t.items() if key in ("pair(c)", "gemm(c)"))   # (today's rule)
            best_t = min(v for key, v in t.items() if key in ("gemv(t)", "gemm(t)"))
            print(f"{K:>5}x{N:<5} {k} {M:>2} "
                  + " ".join(f"{t[c]:{width[c]}.2f}" if c in t else f"{'-':>{width[c]}}" for c in cols)
                  + f" {cub:7.2f} {floor:6.2f} {best_c / best_t:15.3f} {cub / best_c:14.2f}x", flush=True)
