"""The tensor-core gemv (``mma_gemv``) against the other code-layout kernels and the tiled gemm, one run
(CUDA-graph timed, L2-cold weights, cuBLAS fp16 and the read floor of the same run):

    python benchmarks/mma_gemv_bench.py [K x N list] [k list] [M list] [--pdl] [--split=S] [--quarters] [--silu]
                                      [--cta-warps=W] [--dq]

Columns: mma(c), mma(f) (the same kernel on the fragment layout, ``KbitFragments``, where N % 16 = K % 256 = 0),
(and mma(c) launched with PDL in a chain of its own launches, ``--pdl``), the pair gemv
(M <= 4; float32 and float16 block sums; ``pair(f),f16``: float16 sums on the fragment layout, what a
``KbitLinear(layout="fragments")`` could run at M = 1, 2 instead of mma(f)), the gemm on the code layout and on the
tiled layout. "mma vs best other" compares with the code and tiled layouts' other kernels.

For a CTA of more than 16 K-warps (K = 5120: 20), where ``core.fit_threads`` caps the registers at 64 (two tiles
take 134; benchmarks/README.md, "Forty-second session"): ``--split=S`` adds mma(c) with K split S ways
(``mma_gemv.plan(split=S)``: S CTAs a strip, sums by atomics, one finishing launch), ``--quarters`` mma(c) with the cap
from the register file's four quarters (16384 / (ceil(warps / 4) * 32), down to a multiple of 8: 96 for 20 warps).
``--silu``: every gemv column with the gate/up SiLU epilogue (``silu_pairs``, an [M, N / 2] output; with K split the
finishing launch applies it); the gemm columns are left out (no epilogue there). ``--cta-warps=W`` adds ``mma,wW``:
mma(c) with CTAs of about W warps (``mma_gemv.plan(cta_warps=W)``; the default aims for ``DEFAULTS["cta_warps"]``, 16,
except k = 2's two tiles, 8: ``CTA_WARPS_BY_K_TILES``, measured with this option; then ``busiest_sm_slices`` may take
fewer slices, which an asked W skips: ``--cta-warps=16`` beside the default times the rule at K = 2048).
``--dq`` adds ``dq(c)`` and ``dq(f)``:
dequantize + cuBLAS (``linear(kernel="dequant_matmul")``; needs torch or cupy) from the code and the fragment layout,
what ``linear`` runs past the tensor-core gemv (the fragment layout has no gemm).
"""
import sys
from functools import partial
from unittest.mock import patch

import numpy as np
from numba import cuda

from kbit_numba import bench, core, dispatch, mma_gemv, pair_gemv, tensor_gemm
from kbit_numba.formats import kbit_nbytes
from kbit_numba.codec import repack_tiled
from kbit_numba._timing import graph_time_us, rotation_count

args = [a for a in sys.argv[1:] if not a.startswith("--")]
pdl = "--pdl" in sys.argv
split = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--split=")), None)
quarters = "--quarters" in sys.argv
silu = "--silu" in sys.argv
cta_warps = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("--cta-warps=")), None)
dq = "--dq" in sys.argv


def register_cap_quarters(warps):
    """``core.register_cap`` from the register file's quarters: ceil(warps / 4) warps a quarter."""
    return min(core.MAX_REGISTERS, core.REGISTERS_PER_SM // 4 // (core.WARP * -(-warps // 4)) // 8 * 8)


def quarters_plan(*a, **kw):
    """mma_gemv.plan with ``register_cap_quarters`` (``core.register_cap`` patched for this call only)."""
    with patch.object(core, "register_cap", register_cap_quarters):
        return mma_gemv.plan(*a, **kw)


shapes = [tuple(int(v) for v in s.split("x")) for s in (args[0] if args else
                                                         "4096x14336,2048x5120,4096x6144,4096x4096").split(",")]
ks = [int(v) for v in (args[1] if len(args) > 1 else "4,2").split(",")]
ms = [int(v) for v in (args[2] if len(args) > 2 else "1,2,4,8").split(",")]
rng = np.random.default_rng(1)
cols = (["mma(c)", "mma(f)"] + (["mma,pdl"] if pdl else [])
        + ([f"mma,split{split}", f"mma(f),split{split}"] if split else []) + (["mma,q"] if quarters else [])
        + ([f"mma,w{cta_warps}"] if cta_warps else [])
        + ["pair(c)", "pair,f16", "pair(f),f16", "gemm(c)", "gemm(t)"] + (["dq(c)", "dq(f)"] if dq else []))
width = {c: max(8, len(c)) for c in cols}
print(f"{'K x N':>11} {'k':>1} {'M':>2} " + " ".join(f"{c:>{width[c]}}" for c in cols) + f" {'cuBLAS':>7} {'floor':>6}"
      " %floor(mma) mma vs cuBLAS  mma vs best other  mma(f)/mma(c)")
for K, N in shapes:
    for k in ks:
        nbytes = kbit_nbytes(N, K, k)
        n = rotation_count(nbytes)
        flats = bench._rotating_weights(K, N, k, n, rng)
        codes = [pair_gemv.to_codes(w) for w in flats]
        tiled = [repack_tiled(w) for w in flats]
        frags = [mma_gemv.to_fragments(c) for c in codes] if N % 16 == 0 and K % 256 == 0 else None
        del flats
        for M in ms:
            A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
            out = cuda.device_array((M, N // 2 if silu else N), np.float16)
            sums = tensor_gemm.new_workspace(M, N)
            space = dispatch.Workspace()
            dq_plan = partial(dispatch.plan, A, out=out, stream=0, workspace=space, kernel="dequant_matmul")
            plans = {
                "mma(c)": lambda w: mma_gemv.plan(A, w, out, 0, silu_pairs=silu),
                "mma(f)": (lambda w: mma_gemv.plan(A, w, out, 0, silu_pairs=silu)) if frags else None,
                "mma,pdl": lambda w: mma_gemv.plan(A, w, out, 0, pdl=True, silu_pairs=silu),
                f"mma,split{split}": lambda w: mma_gemv.plan(A, w, out, 0, split=split, silu_pairs=silu),
                f"mma(f),split{split}": ((lambda w: mma_gemv.plan(A, w, out, 0, split=split, silu_pairs=silu))
                                         if frags else None),
                "mma,q": lambda w: quarters_plan(A, w, out, 0, silu_pairs=silu),
                f"mma,w{cta_warps}": lambda w: mma_gemv.plan(A, w, out, 0, cta_warps=cta_warps, silu_pairs=silu),
                "pair(c)": (lambda w: pair_gemv.plan(A, w, out, 0, silu_pairs=silu)) if M <= 4 else None,
                "pair,f16": (lambda w: pair_gemv.plan(A, w, out, 0, f16_acc=True, silu_pairs=silu)) if M <= 4 else None,
                "pair(f),f16": ((lambda w: pair_gemv.plan(A, w, out, 0, f16_acc=True, silu_pairs=silu))
                                if M <= 4 and frags else None),
                "gemm(c)": None if silu else lambda w: tensor_gemm.plan(A, w, out, 0, workspace=sums),
                "gemm(t)": None if silu else lambda w: tensor_gemm.plan(A, w, out, 0, workspace=sums),
                "dq(c)": None if silu else dq_plan,
                "dq(f)": None if silu or not frags else dq_plan,
            }
            t = {}
            for name in cols:
                make = plans[name]
                if make is None or (name.startswith("mma") and not mma_gemv.reads(M, K)):
                    continue
                weights = tiled if name == "gemm(t)" else frags if "(f)" in name else codes
                runs = [make(w).prepare().run for w in weights]
                t[name] = graph_time_us(lambda i, s: runs[i % n](s), n * max(1, 64 // n))
            floor = bench.floor_us(nbytes + M * K * 2 + M * N * 2)
            cub = bench.cublas_row(K, N, M) or float("nan")
            mma = t.get("mma(c)", float("nan"))
            other = min((v for key, v in t.items() if not key.startswith("mma") and "(f)" not in key),
                        default=float("nan"))
            print(f"{K:>5}x{N:<5} {k} {M:>2} " + " ".join(f"{t[c]:{width[c]}.2f}" if c in t else f"{'-':>{width[c]}}" for c in cols)
                  + f" {cub:7.2f} {floor:6.2f} {100 * floor / mma:10.0f}% {cub / mma:12.2f}x {other / mma:17.2f}x"
                  f" {t.get('mma(f)', float('nan')) / mma:14.3f}",
                  flush=True)
