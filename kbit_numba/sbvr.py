"""SBVR (bitvector sums) GEMV, M = 1..4, and its ballot-based activation quantizer.

Format (``formats.SbvrWeight``, arXiv 2509.18172): in each group of 128 K values of a column,
``w = sum_s coeff[s] * bit_s`` over 4 bit planes; the 4 coefficients are a row of a global float16
cache picked by a per-group index. Activations are 7-bit (RTN per group of 128, x ~ q * d) and stored
as 8 two's-complement bit planes per 32 values. The dot product of 32 weights with 32 activations is
then pure bit arithmetic:

    sum_j w_j q_j = sum_s coeff_s * sum_p sign_p 2**p * popc(wplane_s & aplane_p)   (sign_7 = -1)

Design:

* **A lane per column**, 32 columns per CTA: a column's 4 planes of one 32-value chunk are 16
  contiguous bytes (``bvr[c, n, :]``), so lane t's ``ld.global.nc.v4`` and its neighbours' make one
  512-byte line. The 8 activation planes of a chunk (32 bytes) are the same for every lane (broadcast).
* Per chunk and row: 8 x 4 AND + ``popc``, shifted by the plane weight into 4 integer sums; per group
  the 4 sums meet the 4 coefficients (float) and the group's activation scale.
* **K split across the CTA's warps** (groups w, w + KW, ...), summed in shared memory.

The activation quantizer: a warp per (row, group of 128): a warp max, 4 values per lane, and one
``ballot_sync`` per plane and 32 values.

Reference twins: ``reference.sbvr_encode`` (the encoder, host), ``sbvr_quantize_activations``,
``sbvr_gemv``. Tests: ``tests/test_sbvr.py``.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .device import FULL_MASK, WARP, make_cta_sum, make_loader, sm_count, warp_max
from .formats import BLOCK, INT8_MAX, SBVR_ACT_PLANES, SBVR_GROUP, SBVR_PLANES, SbvrWeight
from .intrinsics import f16_bits_to_f32, ldg128
from .launch import prepare_plan, run_plan, run_steps
from .scalar_gemv import MAX_M

MAX_KW = 16                       # warps per CTA: 512 threads fit the register file at M = 4
CTA_WARPS_TARGET = 32
CHUNKS = SBVR_GROUP // BLOCK          # 4 chunks of 32 values per group
SIGN_PLANE = SBVR_ACT_PLANES - 1      # plane 7 carries -128
QUANT_WARPS = 4
Q_MAX = np.float32(INT8_MAX)


@lru_cache(maxsize=None)
def make_sbvr_gemv(M, out_dtype):
    """Kernel(planes, d, bvr, cidx, cache, out, N, K), grid ceil(N/32), KW warps per CTA.

    planes: uint32 [M * K/32 * 8]; d: float32 [M * K/128]; bvr: uint32 flat [K/32 * N * 4]; cidx: uint8
    or uint16 [K/128 * N]; cache: uint32 view of the float16 [lines, 4] (2 words a line); out [M*N]."""
    assert 1 <= M <= MAX_M
    f16_out = np.dtype(out_dtype) == np.float16
    cta_sum = make_cta_sum(M)

    def kernel(planes, d, bvr, cidx, cache, out, N, K):
        part = cuda.shared.array((MAX_KW, WARP, MAX_M), np.float32)
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        n_warps = cuda.blockDim.x // WARP
        n = cuda.blockIdx.x * WARP + lane
        live = n < N
        if not live:
            n = N - 1                              # a valid address; the result is not stored
        n_groups = K // SBVR_GROUP
        n_chunks = K // BLOCK
        acc = cuda.local.array(M, np.float32)
        isum = cuda.local.array((M, SBVR_PLANES), np.int32)
        for m in range(M):
            acc[m] = np.float32(0.0)
        for g in range(warp, n_groups, n_warps):
            line = np.int32(cidx[g * N + n])
            c01 = cache[2 * line]
            c23 = cache[2 * line + 1]
            for m in range(M):
                for s in range(SBVR_PLANES):
                    isum[m, s] = np.int32(0)
            for cc in range(CHUNKS):
                c = g * CHUNKS + cc
                wp = ldg128(bvr, (c * N + n) * SBVR_PLANES)          # this column's 4 planes
                for m in range(M):
                    a_lo = ldg128(planes, (m * n_chunks + c) * SBVR_ACT_PLANES)       # planes 0..3
                    a_hi = ldg128(planes, (m * n_chunks + c) * SBVR_ACT_PLANES + 4)   # planes 4..7
                    for s in range(SBVR_PLANES):
                        t = np.int32(0)
                        for p in range(4):                    # planes 0..3: weights 1, 2, 4, 8
                            t += np.int32(cuda.popc(np.uint32(wp[s] & a_lo[p]))) << np.int32(p)
                        for p in range(3):                    # planes 4..6: 16, 32, 64
                            t += np.int32(cuda.popc(np.uint32(wp[s] & a_hi[p]))) << np.int32(p + 4)
                        t -= np.int32(cuda.popc(np.uint32(wp[s] & a_hi[3]))) << np.int32(SIGN_PLANE)
                        isum[m, s] += t
            k0 = f16_bits_to_f32(c01)
            k1 = f16_bits_to_f32(c01 >> np.uint32(16))
            k2 = f16_bits_to_f32(c23)
            k3 = f16_bits_to_f32(c23 >> np.uint32(16))
            for m in range(M):
                dot = (k0 * np.float32(isum[m, 0]) + k1 * np.float32(isum[m, 1])
                       + k2 * np.float32(isum[m, 2]) + k3 * np.float32(isum[m, 3]))
                acc[m] += d[m * n_groups + g] * dot
        cta_sum(acc, part)
        if warp == 0 and live:
            for m in range(M):
                out[m * N + n] = np.float16(acc[m]) if f16_out else acc[m]

    return cuda.jit(kernel)


@lru_cache(maxsize=None)
def make_act_kernel(a_src):
    """Kernel(A[M*K], planes[M * K/32 * 8], d[M * K/128], M, K): a warp per (row, group of 128)."""
    load = make_loader(a_src)

    def kernel(A, planes, d, M, K):
        lane = cuda.threadIdx.x % WARP
        item = cuda.blockIdx.x * QUANT_WARPS + cuda.threadIdx.x // WARP
        n_groups = K // SBVR_GROUP
        live = item < M * n_groups                  # whole warps only: the ballots need every lane
        if not live:
            item = 0
        m = item // n_groups
        g = item % n_groups
        base = m * K + g * SBVR_GROUP
        x = cuda.local.array(CHUNKS, np.float32)
        amax = np.float32(0.0)
        for c in range(CHUNKS):
            x[c] = load(A, base + c * BLOCK + lane)
            amax = max(amax, abs(x[c]))
        amax = warp_max(amax)
        s = Q_MAX / amax if amax > np.float32(0.0) else np.float32(0.0)
        if live and lane == 0:
            d[item] = np.float32(1.0) / s if s > np.float32(0.0) else np.float32(0.0)
        for c in range(CHUNKS):
            q = np.int32(round(x[c] * s))
            q = min(max(q, np.int32(-127)), np.int32(127))
            byte = np.uint32(q) & np.uint32(0xFF)          # two's complement
            for p in range(SBVR_ACT_PLANES):
                word = cuda.ballot_sync(FULL_MASK, (byte >> np.uint32(p)) & np.uint32(1))
                if live and lane == p:
                    planes[((m * (K // BLOCK)) + g * CHUNKS + c) * SBVR_ACT_PLANES + p] = word

    return cuda.jit(kernel)


def _act_step(Ad, a_src, stream, planes=None, d=None):
    shape = tuple(Ad.shape)
    M, K = (1, shape[0]) if len(shape) == 1 else shape
    if K % SBVR_GROUP:
        raise ValueError(f"SBVR needs K % {SBVR_GROUP} == 0, got K={K}")
    planes = _arrays.output(planes, "planes", (M, K // BLOCK, SBVR_ACT_PLANES), np.uint32, stream)
    d = _arrays.output(d, "d", (M, K // SBVR_GROUP), np.float32, stream)
    items = M * (K // SBVR_GROUP)
    step = (make_act_kernel(a_src), -(-items // QUANT_WARPS), QUANT_WARPS * WARP,
            (_arrays.flat_view(Ad), _arrays.flat_view(planes), _arrays.flat_view(d), np.int32(M), np.int32(K)))
    return step, planes, d


def quantize_activations(A, stream=None, bf16=False, planes=None, d=None):
    """7-bit per-128 activations as bit planes: (planes uint32 [M, K/32, 8], d float32 [M, K/128])."""
    stream = _arrays.as_stream(stream)
    Ad, a_src = _arrays.float_input(A, "A", bf16, (1, 2), stream)
    step, planes, d = _act_step(Ad, a_src, stream, planes, d)
    run_steps([step], stream)
    return planes, d


def encode(W, lines=1024, **kw):
    """The host encoder (``reference.sbvr_encode``) -> SbvrWeight on the device."""
    from .reference import sbvr_encode
    return sbvr_encode(_arrays.to_host(W).astype(np.float32), lines, **kw).to_device()


def _plan(A, sw, out, stream, out_dtype, bf16):
    """Checked inputs -> (steps, A, out): the plane quantizer and the GEMV launch."""
    sw = _arrays.device_weight(sw, SbvrWeight, stream)
    N, K = sw.shape
    Ad, a_src, M, out = _arrays.gemv_io(A, sw.shape, out, out_dtype, bf16, stream, "sbvr.gemv", MAX_M)
    step, planes, d = _act_step(Ad, a_src, stream)
    n_ctas = -(-N // WARP)
    kw = max(1, min(MAX_KW, K // SBVR_GROUP, -(-sm_count() * CTA_WARPS_TARGET // n_ctas)))
    gemv_step = (make_sbvr_gemv(M, out.dtype.name), n_ctas, kw * WARP,
                 (_arrays.flat_view(planes), _arrays.flat_view(d), _arrays.flat_view(sw.bvr),
                  _arrays.flat_view(sw.coeff_idx), _arrays.flat_view(sw.coeff_cache, np.uint32),
                  _arrays.flat_view(out), np.int32(N), np.int32(K)))
    return [step, gemv_step], Ad, out


def gemv(A, sw, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """C[M, N] = A[M, K] @ W^T for M = 1..4 with W an SbvrWeight; A is first quantized to 7-bit planes
    (one extra launch). Returns [M, N] (or [N]) of out_dtype, or writes into ``out``."""
    return run_plan(_plan, A, sw, out, stream, out_dtype, bf16)


def prepare(A, sw, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """``gemv`` bound to its buffers (``launch.PreparedSteps``): write new activations into ``.A``."""
    return prepare_plan(_plan, A, sw, out, stream, out_dtype, bf16)


def kernel_specializations():
    from numba import types as t
    nb = {"float16": t.float16[::1], "float32": t.float32[::1]}
    specs = [(f"sbvr M={M} out={od} idx={it}", make_sbvr_gemv(M, od),
              (t.uint32[::1], t.float32[::1], t.uint32[::1], it_t[::1], t.uint32[::1], nb[od], t.int32, t.int32))
             for M in (1, 2, 3, 4) for od in ("float16", "float32") for it, it_t in (("u8", t.uint8), ("u16", t.uint16))
             if (od == "float16" and it == "u16") or M == 2]
    specs += [(f"sbvr_act A={a}", make_act_kernel(a), (nb[a], t.uint32[::1], t.float32[::1], t.int32, t.int32))
              for a in ("float16", "float32")]
    return specs
