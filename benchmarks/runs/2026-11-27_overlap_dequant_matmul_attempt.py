"""Dequantize + cuBLAS with the dequantize of column chunk j + 1 overlapping the GEMM of chunk j (an experiment;
H100/H200, needs torch).

    python benchmarks/overlap_dequant_matmul.py [K x N list] [M list] [chunk counts]

At large M cuBLAS' GEMM is compute-bound and the dequantize memory-bound, yet ``dispatch.dequant_matmul`` runs
them one after the other. Here the weight's columns go in P chunks (the code layout's blocks of consecutive columns
are contiguous: a chunk is a zero-copy view): chunk j is dequantized on the capture stream into its rows of the
usual [N, K] float16 buffer, and a second stream, waiting on an event per chunk, multiplies it into its column
slice of C (cuBLAS writes the slice in place, leading dimension N). Prints us (CUDA graphs, rotating L2-cold
weights, k = 4, code layout) for cuBLAS fp16 on the float16 weight, the sequential dequantize + cuBLAS and the
overlapped one per P, and checks the overlapped output against the sequential one.
"""
import sys

import numpy as np
import torch
from numba import cuda

from kbit_numba import bench, codec, pair_gemv
from kbit_numba._timing import graph_time_us, rotation_count
from kbit_numba.formats import BLOCK, KbitCodes

shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else
                                                         "4096x14336,14336x4096,4096x6144").split(",")]
ms = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "128,512,2048").split(",")]
parts = [int(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "2,4,8").split(",")]
k = 4
rng = np.random.default_rng(1)


def column_chunk(kc, c0, c1):
    """Columns c0..c1-1 of a KbitCodes weight, as a view of its arrays."""
    kbr = kc.shape[1] // BLOCK
    return KbitCodes(kc.packed[c0 * kbr * kc.k:c1 * kbr * kc.k], kc.absmax[c0 * kbr:c1 * kbr], kc.codebook, kc.k,
                     (c1 - c0, kc.shape[1]), kc.absmax_format)


side = torch.cuda.Stream()
print(f"{'K x N':>11} {'M':>5} {'cuBLAS':>8} {'dq+mm':>8} " + " ".join(f"{f'P={p}':>8}" for p in parts) + "   us")
for K, N in shapes:
    nbytes = N * K // 32 * (4 * k + 1)
    n = rotation_count(nbytes)
    kcs = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, k, n, rng)]
    wfull = torch.empty((N, K), device="cuda", dtype=torch.float16)
    cuts = {p: [N * j // p // 64 * 64 for j in range(p)] + [N] for p in parts}
    views = {p: [[column_chunk(kc, c[j], c[j + 1]) for j in range(p)] for kc in kcs] for p, c in cuts.items()}
    for M in ms:
        A = torch.randn((M, K), device="cuda", dtype=torch.float16)
        out = torch.empty((M, N), device="cuda", dtype=torch.float16)

        def sequential(i, s):
            codec.dequantize(kcs[i % n], out=cuda.as_cuda_array(wfull), stream=s)
            torch.matmul(A, wfull.t(), out=out)

        def overlapped(i, s, p):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            c = cuts[p]
            for j, v in enumerate(views[p][i % n]):
                w = wfull[c[j]:c[j + 1]]
                codec.dequantize(v, out=cuda.as_cuda_array(w), stream=s)
                ev = torch.cuda.Event()
                ev.record(main)
                with torch.cuda.stream(side):
                    side.wait_event(ev)
                    torch.matmul(A, w.t(), out=out[:, c[j]:c[j + 1]])
            main.wait_stream(side)

        sequential(0, 0)
        want = out.clone()
        out.zero_()
        overlapped(0, 0, parts[-1])
        torch.cuda.synchronize()
        err = (out.float() - want.float()).abs().max().item()
        reps = n * max(1, 8 // n)
        t_cub = bench.cublas_row(K, N, M)
        t_seq = graph_time_us(sequential, reps)
        t_ov = [graph_time_us(lambda i, s, p=p: overlapped(i, s, p), reps) for p in parts]
        print(f"{K}x{N:>6} {M:5} {t_cub:8.2f} {t_seq:8.2f} " + " ".join(f"{t:8.2f}" for t in t_ov)
              + f"   (max |overlapped - sequential| {err:g})", flush=True)
