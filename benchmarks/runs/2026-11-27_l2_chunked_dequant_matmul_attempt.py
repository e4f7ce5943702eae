"""Dequantize + cuBLAS with the float16 weight kept in L2: an experiment (H100/H200; needs torch).

    python benchmarks/l2_chunked_dequant_matmul.py [K x N list] [M list] [chunk MB list]

``dispatch.dequant_matmul`` dequantizes the whole weight into an [N, K] float16 buffer, then runs one cuBLAS
GEMM: at 4096x14336 that is 117 MB written to DRAM and read back, 3.8x the kbit bytes. Here the columns go in
chunks of ~``chunk MB`` of float16: each chunk is dequantized into one reused buffer (small enough to stay in
L2, so its lines are overwritten there before they are written back) and multiplied at once into its slice of
the output (cuBLAS writes a column slice of C in place: leading dimension N). The code layout's blocks of
consecutive columns are contiguous, so a chunk of the weight is a zero-copy view.

Prints, per shape and M: cuBLAS fp16 on the float16 weight, the whole-weight dequantize + cuBLAS, and the chunked
version per chunk size (us, CUDA graphs, rotating L2-cold weights, k = 4, code layout), and checks that the chunked
output equals the whole one.
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
ms = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "32,64,128,256,512").split(",")]
chunk_mbs = [float(v) for v in (sys.argv[3] if len(sys.argv) > 3 else "8,16,24").split(",")]
k = 4
rng = np.random.default_rng(1)


def column_chunk(kc, c0, c1):
    """Columns c0..c1-1 of a KbitCodes weight, as a view of its arrays."""
    kbr = kc.shape[1] // BLOCK
    return KbitCodes(kc.packed[c0 * kbr * kc.k:c1 * kbr * kc.k], kc.absmax[c0 * kbr:c1 * kbr], kc.codebook, kc.k,
                     (c1 - c0, kc.shape[1]), kc.absmax_format)


print(f"{'K x N':>11} {'M':>4} {'cuBLAS':>8} {'dq+mm':>8} " + " ".join(f"{f'{mb:g}MB':>8}" for mb in chunk_mbs)
      + "   (us; chunk columns)")
for K, N in shapes:
    nbytes = N * K // 32 * (4 * k + 1)
    n = rotation_count(nbytes)
    kcs = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, k, n, rng)]
    wfull = torch.empty((N, K), device="cuda", dtype=torch.float16)
    chunk_cols = [max(64, int(mb * 2**20 / (2 * K)) // 64 * 64) for mb in chunk_mbs]
    views = {C: [[column_chunk(kc, c0, min(N, c0 + C)) for c0 in range(0, N, C)] for kc in kcs] for C in chunk_cols}
    bufs = {C: torch.empty((C, K), device="cuda", dtype=torch.float16) for C in chunk_cols}
    for M in ms:
        A = torch.randn((M, K), device="cuda", dtype=torch.float16)
        out = torch.empty((M, N), device="cuda", dtype=torch.float16)

        def full(i, s):
            codec.dequantize(kcs[i % n], out=cuda.as_cuda_array(wfull), stream=s)
            torch.matmul(A, wfull.t(), out=out)

        def chunked(i, s, C):
            buf = bufs[C]
            for j, v in enumerate(views[C][i % n]):
                c0 = j * C
                rows = v.shape[0]
                codec.dequantize(v, out=cuda.as_cuda_array(buf[:rows]), stream=s)
                torch.matmul(A, buf[:rows].t(), out=out[:, c0:c0 + rows])

        full(0, 0)
        want = out.clone()
        chunked(0, 0, chunk_cols[0])
        torch.cuda.synchronize()
        err = (out.float() - want.float()).abs().max().item()
        reps = n * max(1, 16 // n)
        t_cub = bench.cublas_row(K, N, M)
        t_full = graph_time_us(full, reps)
        t_ch = [graph_time_us(lambda i, s, C=C: chunked(i, s, C), reps) for C in chunk_cols]
        print(f"{K}x{N:>6} {M:4} {t_cub:8.2f} {t_full:8.2f} " + " ".join(f"{t:8.2f}" for t in t_ch)
              + f"   ({', '.join(str(C) for C in chunk_cols)}; max |chunked - whole| {err:g})", flush=True)
