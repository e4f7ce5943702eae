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

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .core import MAX_M, RowsSpec, device_weight, sm_count
from .device import FULL_MASK, WARP, i32, jit_kernel, make_cta_sum, make_loader, u32, warp_max
from .formats import BLOCK, INT8_MAX, SBVR_ACT_PLANES, SBVR_GROUP, SBVR_PLANES, SbvrWeight
from .intrinsics import f16_bits_to_f32, ldg128
from .launch import NUMBA_TYPES, OUT_TYPES, Plan, Spec, Step, launch_step, type_name

MAX_KW = 16                       # warps per CTA: 512 threads fit the register file at M = 4
CTA_WARPS_TARGET = 32
CHUNKS = SBVR_GROUP // BLOCK          # 4 chunks of 32 values per group
SIGN_PLANE = SBVR_ACT_PLANES - 1      # plane 7 carries -128
QUANT_WARPS = 4
Q_MAX = np.float32(INT8_MAX)


class SbvrGemvSpec(RowsSpec):
    """The SBVR gemv's compile-time choices (M, out_dtype): the key of :func:`make_sbvr_gemv` (the
    coefficient-index dtype, uint8 or uint16, is an argument type: Numba compiles one version per type)."""
    FAMILY = "sbvr"


@lru_cache(maxsize=None)
def make_sbvr_gemv(spec):
    """Kernel(planes, d, bvr, cidx, cache, out, N, K) for a :class:`SbvrGemvSpec`, grid ceil(N/32), KW warps
    per CTA.

    planes: uint32 [M * K/32 * 8]; d: float32 [M * K/128]; bvr: uint32 flat [K/32 * N * 4]; cidx: uint8
    or uint16 [K/128 * N]; cache: uint32 view of the float16 [lines, 4] (2 words a line); out [M*N]."""
    M, out_dtype = spec.M, spec.out_dtype
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
            line = i32(cidx[g * N + n])
            c01 = cache[2 * line]
            c23 = cache[2 * line + 1]
            for m in range(M):
                for s in range(SBVR_PLANES):
                    isum[m, s] = i32(0)
            for cc in range(CHUNKS):
                c = g * CHUNKS + cc
                wp = ldg128(bvr, (c * N + n) * SBVR_PLANES)          # this column's 4 planes
                for m in range(M):
                    a_lo = ldg128(planes, (m * n_chunks + c) * SBVR_ACT_PLANES)       # planes 0..3
                    a_hi = ldg128(planes, (m * n_chunks + c) * SBVR_ACT_PLANES + 4)   # planes 4..7
                    for s in range(SBVR_PLANES):
                        t = i32(0)
                        for p in range(4):                    # planes 0..3: weights 1, 2, 4, 8
                            t += i32(cuda.popc(u32(wp[s] & a_lo[p]))) << i32(p)
                        for p in range(3):                    # planes 4..6: 16, 32, 64
                            t += i32(cuda.popc(u32(wp[s] & a_hi[p]))) << i32(p + 4)
                        t -= i32(cuda.popc(u32(wp[s] & a_hi[3]))) << i32(SIGN_PLANE)
                        isum[m, s] += t
            k0 = f16_bits_to_f32(c01)
            k1 = f16_bits_to_f32(c01 >> u32(16))
            k2 = f16_bits_to_f32(c23)
            k3 = f16_bits_to_f32(c23 >> u32(16))
            for m in range(M):
                dot = (k0 * np.float32(isum[m, 0]) + k1 * np.float32(isum[m, 1])
                       + k2 * np.float32(isum[m, 2]) + k3 * np.float32(isum[m, 3]))
                acc[m] += d[m * n_groups + g] * dot
        cta_sum(acc, part)
        if warp == 0 and live:
            for m in range(M):
                out[m * N + n] = np.float16(acc[m]) if f16_out else acc[m]

    return jit_kernel(kernel)


@dataclass(frozen=True)
class SbvrActSpec(Spec):
    """The activation-plane quantizer's choice (A's element type): the key of :func:`make_act_kernel`."""
    FAMILY = "sbvr_act"
    a_type: str

    def normalise(self):
        return dict(a_type=type_name(self.a_type, "a_type"))


@lru_cache(maxsize=None)
def make_act_kernel(spec):
    """Kernel(A[M*K], planes[M * K/32 * 8], d[M * K/128], M, K) for an :class:`SbvrActSpec`: a warp per
    (row, group of 128)."""
    load = make_loader(spec.a_type)

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
            q = i32(round(x[c] * s))
            q = min(max(q, i32(-127)), i32(127))
            byte = u32(q) & u32(0xFF)          # two's complement
            for p in range(SBVR_ACT_PLANES):
                word = cuda.ballot_sync(FULL_MASK, (byte >> u32(p)) & u32(1))
                if live and lane == p:
                    planes[((m * (K // BLOCK)) + g * CHUNKS + c) * SBVR_ACT_PLANES + p] = word

    return jit_kernel(kernel)


def act_shapes(M, K):
    """Shapes of the quantized activations of M rows: (planes uint32, d float32)."""
    return (M, K // BLOCK, SBVR_ACT_PLANES), (M, K // SBVR_GROUP)


def _act_step(Ad, a_src, stream, planes=None, d=None):
    shape = tuple(Ad.shape)
    M, K = (1, shape[0]) if len(shape) == 1 else shape
    if K % SBVR_GROUP:
        raise ValueError(f"SBVR needs K % {SBVR_GROUP} == 0, got K={K}")
    planes_shape, d_shape = act_shapes(M, K)
    planes = _arrays.output(planes, "planes", planes_shape, np.uint32, stream)
    d = _arrays.output(d, "d", d_shape, np.float32, stream)
    items = M * (K // SBVR_GROUP)
    step = Step(make_act_kernel(SbvrActSpec(a_src)), -(-items // QUANT_WARPS), QUANT_WARPS * WARP,
                (_arrays.flat_view(Ad), _arrays.flat_view(planes), _arrays.flat_view(d), i32(M), i32(K)))
    return step, planes, d


def quantize_activations(A, stream=None, bf16=False, planes=None, d=None):
    """7-bit per-128 activations as bit planes: (planes uint32 [M, K/32, 8], d float32 [M, K/128])."""
    stream = _arrays.as_stream(stream)
    Ad, a_src = _arrays.float_input(A, "A", bf16, (1, 2), stream)
    step, planes, d = _act_step(Ad, a_src, stream, planes, d)
    launch_step(step, stream)
    return planes, d


def encode(W, lines=1024, **kw):
    """The host encoder (``reference.sbvr_encode``) -> SbvrWeight on the device."""
    from .reference import sbvr_encode
    return sbvr_encode(_arrays.to_host(W).astype(np.float32), lines, **kw).to_device()


def plan(A, sw, out=None, stream=None, out_dtype=np.float16, bf16=False, act=None):
    """Checked inputs bound into a :class:`launch.Plan`: the plane quantizer and the GEMV launch. ``act``:
    preallocated (planes uint32 [M, K/32, 8], d float32 [M, K/128]) for the quantized activations, else
    allocated here (a CUDA-graph capture must pass them: no allocation may happen inside one)."""
    stream = _arrays.as_stream(stream)
    sw = device_weight(sw, SbvrWeight, stream)
    N, K = sw.shape
    Ad, a_src, M, out = _arrays.gemv_io(A, sw.shape, out, out_dtype, bf16, stream, "sbvr.gemv", MAX_M)
    step, planes, d = _act_step(Ad, a_src, stream, *(act or (None, None)))
    n_ctas = -(-N // WARP)
    kw = max(1, min(MAX_KW, K // SBVR_GROUP, -(-sm_count() * CTA_WARPS_TARGET // n_ctas)))
    gemv_step = Step(make_sbvr_gemv(SbvrGemvSpec(M, out.dtype)), n_ctas, kw * WARP,
                     (_arrays.flat_view(planes), _arrays.flat_view(d), _arrays.flat_view(sw.bvr),
                      _arrays.flat_view(sw.coeff_idx), _arrays.flat_view(sw.coeff_cache, np.uint32),
                      _arrays.flat_view(out), i32(N), i32(K)))
    return Plan([step, gemv_step], Ad, out, stream)


def gemv(A, sw, out=None, stream=None, out_dtype=np.float16, bf16=False, act=None):
    """C[M, N] = A[M, K] @ W^T for M = 1..4 with W an SbvrWeight; A is first quantized to 7-bit planes
    (one extra launch; ``act``: see :func:`plan`). Returns [M, N] (or [N]) of out_dtype, or writes into ``out``."""
    return plan(A, sw, out, stream, out_dtype, bf16, act).launch()


def prepare(A, sw, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """``gemv`` bound to its buffers (a :class:`launch.Prepared`): write new activations into ``.A``."""
    return plan(A, sw, out, stream, out_dtype, bf16).prepare()


def ptx_specs():
    """(spec, coefficient-index type) pairs: every M with float16 out and uint16 indices, M = 2 with each."""
    return [(SbvrGemvSpec(M, od), it) for M in (1, 2, 3, 4) for od in OUT_TYPES for it in ("uint8", "uint16")
            if (od == "float16" and it == "uint16") or M == 2]


def kernel_specializations():
    from numba import types as t
    specs = [(f"{spec.name} idx={it}", make_sbvr_gemv(spec),
              (t.uint32[::1], t.float32[::1], t.uint32[::1], getattr(t, it)[::1], t.uint32[::1],
               NUMBA_TYPES[spec.out_dtype], t.int32, t.int32)) for spec, it in ptx_specs()]
    for spec in (SbvrActSpec("float16"), SbvrActSpec("float32")):
        specs.append((spec.name, make_act_kernel(spec),
                      (NUMBA_TYPES[spec.a_type], t.uint32[::1], t.float32[::1], t.int32, t.int32)))
    return specs
