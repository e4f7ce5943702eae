"""BitNet b1.58 W2A8 GEMV (M = 1..4): ternary weights, int8 activations, lop3 decode + dp4a.

Format (``formats.BitnetWeight``): 2-bit codes ``w + 2`` in blocks of 16 columns x 32 K values; a
block is 32 words, word ``2r + h`` = column r of the block, K half h (16 values). Within a word, value
``BITNET_ORDER[p]`` sits in slot p (bits 2p, 2p+1), so ``(word >> 2s) & 0x03030303`` holds values
4s .. 4s+3 in its 4 bytes: one shift and one mask per 4 weights, and the 4 activations they meet are
one int32 of the natural int8 row.

Design:

* **A lane per (column, K half)**: lane t of a warp reads word t of a block (the warp's 32 loads are one
  128-byte line) and accumulates column ``16 nb + t/2`` over K half ``t % 2`` of every block it visits;
  the pair (t, t^1) is added at the end by one shuffle. No per-block warp reduction.
* **Activations**: lane t needs 16 int8 values = one 16-byte load per block and row (all lanes of a
  half read the same line: a broadcast from L1).
* **Decode**: one ``lop3`` computes ``(word >> 2s) & 0x03030303 | 0x80808080``: code c (1..3) becomes
  the signed byte c - 128 = w - 126. ``dp4a`` sums (w - 126) * a; the -126 * sum(a) is added back with
  a second dp4a against 0x01 bytes. Integer accumulation is exact: the output is
  ``acc * d[m] * w_scale[part]`` with d = 1/s of the per-token quantizer.
* **K split across the CTA's warps** (enough warps in flight for the 16-column grid), summed in shared
  memory (``device.make_cta_sum``).

Reference twins: ``reference.bitnet_quantize`` / ``bitnet_gemv``. Tests: ``tests/test_bitnet.py``.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .act_quant import int8_step, quantize_int8, words_per_row
from .core import MAX_M, RowsSpec, device_weight, sm_count
from .device import FULL_MASK, WARP, i32, jit_kernel, make_cta_sum, u32
from .formats import BITNET_BLOCK_K, BITNET_BLOCK_N, BitnetWeight
from .intrinsics import BYTE_ONES, LOP3_AND_OR, dp4a, ldg128, lop3
from .launch import NUMBA_TYPES, OUT_TYPES, Plan, Step

MAX_KW = 32
CTA_WARPS_TARGET = 32             # resident warps per SM the grid aims for
CODE_MASK = 0x03030303            # the 2-bit code of each byte after a shift by 2s
BYTE_BIAS = 0x80808080            # bit 7 of each byte: code c reads as the int8 c - 128
W_OFFSET = 126                    # c - 128 = w - 126
MAX_K = 65536                     # |126 * 127 * K| stays below 2**31


class BitnetGemvSpec(RowsSpec):
    """The BitNet gemv's compile-time choices (M, out_dtype): the key of :func:`make_bitnet_gemv`."""
    FAMILY = "bitnet"


@lru_cache(maxsize=None)
def make_bitnet_gemv(spec):
    """Kernel(Aw, d, packed, w_scale, out, N, K, part_cols) for a :class:`BitnetGemvSpec`, grid N/16, KW warps
    per CTA.

    Aw: uint32 [M * K/4] int8 activations (natural order); d: float32 [M]; packed: uint32 flat
    [N/16 * K/32 * 32]; w_scale: float32 [parts]; out: [M*N]."""
    M, out_dtype = spec.M, spec.out_dtype
    f16_out = np.dtype(out_dtype) == np.float16
    cta_sum = make_cta_sum(M)
    ROWS = M

    def kernel(Aw, d, packed, w_scale, out, N, K, part_cols):
        part = cuda.shared.array((MAX_KW, WARP, MAX_M), np.int32)
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        n_warps = cuda.blockDim.x // WARP
        nb = cuda.blockIdx.x
        n_kb = K // BITNET_BLOCK_K
        h = lane % 2
        acc = cuda.local.array(ROWS, np.int32)
        asum = cuda.local.array(ROWS, np.int32)
        for m in range(M):
            acc[m] = i32(0)
            asum[m] = i32(0)
        for kb in range(warp, n_kb, n_warps):
            word = packed[(nb * n_kb + kb) * WARP + lane]
            for m in range(M):
                a = ldg128(Aw, (m * K + kb * BITNET_BLOCK_K + h * 16) // 4)   # this half's 16 int8
                for s in range(4):
                    x = lop3(word >> u32(2 * s), u32(CODE_MASK), u32(BYTE_BIAS), LOP3_AND_OR)
                    acc[m] = dp4a(x, a[s], acc[m])
                    asum[m] = dp4a(u32(BYTE_ONES), a[s], asum[m])
        for m in range(M):
            acc[m] += i32(W_OFFSET) * asum[m]
            acc[m] += cuda.shfl_xor_sync(FULL_MASK, acc[m], 1)    # the two K halves of a column
        cta_sum(acc, part)
        if warp == 0 and h == 0:
            n = nb * BITNET_BLOCK_N + lane // 2
            ws = w_scale[n // part_cols]
            for m in range(M):
                v = np.float32(acc[m]) * d[m] * ws
                out[m * N + n] = np.float16(v) if f16_out else v

    return jit_kernel(kernel)


def quantize(W, parts=1):
    """Absmean ternary quantisation (host, as ``reference.bitnet_quantize``) -> BitnetWeight on the device."""
    from .reference import bitnet_quantize
    return bitnet_quantize(_arrays.to_host(W), parts).to_device()


def quantize_activations(A, stream=None, bf16=False, words=None, d=None):
    """Per-token int8 activations for the BitNet kernel: (words uint32 [M, K/4], d float32 [M])."""
    return quantize_int8(A, 0, stream, bf16, words, d)


def act_shapes(M, K):
    """Shapes of the quantized activations of M rows: (words uint32, d float32), as ``int8_step`` makes them."""
    return (M, words_per_row(K, 0)), (M,)


def plan(A, bw, out=None, stream=None, out_dtype=np.float16, bf16=False, act=None):
    """Checked inputs bound into a :class:`launch.Plan`: the int8 quantizer and the GEMV launch. ``act``:
    preallocated (words uint32 [M, K/4], d float32 [M]) for the quantized activations, else allocated here
    (a CUDA-graph capture must pass them: no allocation may happen inside one)."""
    stream = _arrays.as_stream(stream)
    bw = device_weight(bw, BitnetWeight, stream)
    N, K = bw.shape
    if K > MAX_K:
        raise ValueError(f"bitnet.gemv handles K <= {MAX_K}, got {K}")
    Ad, a_src, M, out = _arrays.gemv_io(A, bw.shape, out, out_dtype, bf16, stream, "bitnet.gemv", MAX_M)
    step, words, d = int8_step(Ad, a_src, 0, stream, *(act or (None, None)))
    n_blocks = N // BITNET_BLOCK_N
    kw = max(1, min(MAX_KW, K // BITNET_BLOCK_K, -(-sm_count() * CTA_WARPS_TARGET // n_blocks)))
    gemv_step = Step(make_bitnet_gemv(BitnetGemvSpec(M, out.dtype)), n_blocks, kw * WARP,
                     (_arrays.flat_view(words), d, _arrays.flat_view(bw.packed), bw.w_scale, _arrays.flat_view(out),
                      i32(N), i32(K), i32(N // bw.w_scale.size)))
    return Plan([step, gemv_step], Ad, out, stream)


def gemv(A, bw, out=None, stream=None, out_dtype=np.float16, bf16=False, act=None):
    """C[M, N] = A[M, K] @ W^T for M = 1..4 with W a BitnetWeight; A (float16/float32, or bf16 bits)
    is quantized per token to int8 first (one extra launch; ``act``: see :func:`plan`). Returns [M, N]
    (or [N]) of out_dtype."""
    return plan(A, bw, out, stream, out_dtype, bf16, act).launch()


def prepare(A, bw, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """``gemv`` bound to its buffers (a :class:`launch.Prepared`): write new activations into ``.A``."""
    return plan(A, bw, out, stream, out_dtype, bf16).prepare()


def ptx_specs():
    return [BitnetGemvSpec(M, od) for M in (1, 2, 3, 4) for od in OUT_TYPES if od == "float16" or M == 2]


def kernel_specializations():
    from numba import types as t
    return [(spec.name, make_bitnet_gemv(spec), (t.uint32[::1], t.float32[::1], t.uint32[::1], t.float32[::1],
                                                 NUMBA_TYPES[spec.out_dtype], t.int32, t.int32, t.int32))
            for spec in ptx_specs()]
