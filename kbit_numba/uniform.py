"""GemLite-style uniform n-bit GEMV (bits 1, 2, 3, 4, 8; M = 1..4) and its GPU quantizer.

Format (``formats.UniformWeight``): ``w = (q - zero) * scale`` with a float16 (scale, zero) pair per
group of 32/64/128 K values or per tensor; q packed ``epw = 32 // bits`` to an int32 word with
stride 32: word t of a 32-word chunk holds the values ``32 j + t`` of the chunk, so lane t of a warp
reads word t (one 128-byte line per warp) and its values ``j`` sit 32 apart in K. 3 bits: 10 values per
word, K zero-padded to whole chunks of 320 (the padding upstream GemLite got wrong).

Design:

* **Warps along K, activations in registers.** A CTA has KW warps; warp w owns WPL = 32 // epw
  consecutive chunks (32 values per lane, 30 at 3 bits; like the kbit gemv's block), so lane t of warp
  w holds its WPL*epw activations (x M rows) in registers for the whole launch, and the CTA walks
  columns with a grid stride. Per column a lane issues WPL 4-byte loads (the next column's are issued first).
* **Runs of one group.** A lane's values j of one word lie 32 apart in K, so a group of G values
  covers G/32 consecutive j. A *run* (RL values) shares one (scale, zero). A lane sees at most 32 runs
  per column, so lane r loads and converts run r's float16 pair once (conversions run at a quarter of
  the FMA rate) and the warp reads the pairs with ``shfl.sync``. fp16 path per weight:
  ``(word >> bits*j) & mask`` OR-ed into the mantissa of 2**23 and 2**23 subtracted (float(q) without
  the quarter-rate I2F), one FMA ``q*scale - zero*scale``, then M FMAs.
* **int8 path (dp4a).** Activations quantized per token (``act_quant``, lane order): a lane's int32
  activation word holds 4 of its values. The 4 matching weights are shifted into the 4 bytes of one
  word, and one ``dp4a`` gives sum(q * a); the zero needs sum(a) over the same bytes (a second dp4a with
  0x01 bytes): ``acc += scale * (dot - zero * asum)``. dp4a's bytes are signed, so 8-bit q enters as
  q - 128 (one xor) with the zero shifted by 128. Runs shorter than 4 values (G = 32 or 64, or
  3-bit with G = 128) mask the bytes of other groups. Per tensor, the integer sums run over the whole
  lane before one float step.
* **Reduction**: butterfly over the warp (5 shuffles per row), then across the KW warps in shared
  memory (double-buffered: one barrier per column).

Reference twins: ``reference.uniform_quantize`` / ``uniform_gemv``. Tests: ``tests/test_uniform.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .act_quant import int8_step
from .core import MAX_M, device_weight, fit_threads, sm_count
from .device import F32_MAX, FULL_MASK, WARP, block_max, i32, inlined, jit_kernel, make_loader, small_int_to_f32, u32
from .formats import LANES, UNIFORM_BITS, UNIFORM_GROUPS, UniformWeight, uniform_elements_per_word
from .intrinsics import BYTE_ONES, dp4a, f16_bits_to_f32, u32_as_f32
from .launch import NUMBA_TYPES, OUT_TYPES, Plan, Spec, Step, type_name

MAX_KW = 32                       # warps per CTA along K
F32_2P23_BITS = u32(0x4B000000)     # the float 2**23: OR-ing q < 2**23 into it gives 2**23 + q
F32_2P23 = np.float32(8388608.0)
CTA_WARPS_TARGET = 32             # resident warps per SM the grid aims for
QUANT_THREADS = 256


def _geometry(bits, group_size):
    """(epw, WPL words per lane, RL values per run, group rows G/32 (0 per tensor))."""
    epw = uniform_elements_per_word(bits)
    wpl = max(1, LANES // epw)
    gr = (group_size // LANES) if group_size else 0
    rl = epw if gr == 0 else math.gcd(gr, epw)
    return epw, wpl, rl, gr


@dataclass(frozen=True)
class UniformGemvSpec(Spec):
    """The uniform gemv's compile-time choices: the key of :func:`make_uniform_gemv`."""
    FAMILY = "uniform"
    bits: int
    M: int
    group_size: object = 128                # 32, 64, 128, or None (one scale and zero per tensor)
    a_type: str = "float16"                 # the fp16 path's activations (int8: unused, float16)
    out_dtype: str = "float16"
    int8: bool = False                      # int8 activations + dp4a
    max_registers: object = None            # a per-thread register cap (long K at M = 4), or None

    def normalise(self):
        if self.bits not in UNIFORM_BITS:
            raise ValueError(f"bits must be one of {UNIFORM_BITS}, got {self.bits!r}")
        if self.group_size not in UNIFORM_GROUPS:
            raise ValueError(f"group_size must be one of {UNIFORM_GROUPS}, got {self.group_size!r}")
        if not 1 <= self.M <= MAX_M:
            raise ValueError(f"uniform.gemv handles M = 1..{MAX_M} rows, got M={self.M}")
        int8 = bool(self.int8)
        return dict(bits=int(self.bits), M=int(self.M), group_size=self.group_size and int(self.group_size),
                    a_type="float16" if int8 else type_name(self.a_type, "a_type"),
                    out_dtype=type_name(self.out_dtype, "out_dtype", OUT_TYPES), int8=int8,
                    max_registers=int(self.max_registers) if self.max_registers else None)


@lru_cache(maxsize=None)
def make_uniform_gemv(spec):
    """Kernel(A, packed, sz, d_act, out, N, K, n_chunks, n_groups) for a :class:`UniformGemvSpec`, KW warps
    per CTA.

    A: float16/float32/bf16-bits [M*K] (fp16 path) or uint32 int8 words [M*W] (int8 path, with d_act
    [M] its per-token scales; unused otherwise); packed: uint32 [N * n_chunks*32]; sz: uint32 view of
    the float16 (scale, zero) pairs; out: [M*N]."""
    bits, M, group_size, a_src, out_dtype, int8 = (spec.bits, spec.M, spec.group_size, spec.a_type,
                                                   spec.out_dtype, spec.int8)
    epw, WPL, RL, GR = _geometry(bits, group_size)
    MASK = u32((1 << bits) - 1)
    QPW = -(-epw // 4)                       # int8 words (quads of 4 values) per weight word
    SUB = 4 // RL if RL < 4 else 1           # int8: runs per quad (byte masks when runs are short)
    SUB_RL = 4 // SUB
    per_tensor = GR == 0
    # dp4a multiplies *signed* bytes: 8-bit q (0..255) goes in as q - 128 (flip bit 7 of every byte),
    # and the zero moves by the same 128
    SIGN_FLIP = u32(0x80808080 if bits == 8 else 0)
    Z_SHIFT = np.float32(128.0 if (bits == 8 and int8) else 0.0)
    RUNS_W = epw // RL                       # runs per weight word
    RUNS = WPL * RUNS_W                      # runs per lane and column: <= 32, one per lane
    assert RUNS <= WARP
    f16_out = np.dtype(out_dtype) == np.float16
    load = make_loader(a_src)
    A_REGS = WPL * (QPW if int8 else epw)
    A_DTYPE = np.uint32 if int8 else np.float32

    @inlined
    def scale_zero(sz, n, row, n_groups):
        """(scale, zero) of the group holding K row ``row`` (of 32 values) of column n."""
        if per_tensor:
            p = sz[0]
        else:
            p = sz[n * n_groups + min(row // GR, n_groups - 1)]
        return f16_bits_to_f32(p), f16_bits_to_f32(p >> u32(16))

    @inlined
    def quad(word, s4):
        """Values 4*s4 .. 4*s4+3 of a weight word in the 4 bytes of a uint32 (0 past epw)."""
        x = u32(0)
        for i in range(4):
            j = 4 * s4 + i
            if j < epw:
                x |= ((word >> u32(bits * j)) & MASK) << u32(8 * i)
        return x

    def kernel(A, packed, sz, d_act, out, N, K, n_chunks, n_groups):
        part = cuda.shared.array((2, MAX_KW, MAX_M), np.float32)
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        n_warps = cuda.blockDim.x // WARP
        n_words = n_chunks * LANES
        chunk0 = warp * WPL

        # ---- this lane's activations, loaded once: a[m, i*epw + j] = A[m, (c_i*epw + j)*32 + lane] ----
        a = cuda.local.array((M, A_REGS), A_DTYPE)
        for m in range(M):
            for i in range(WPL):
                ci = chunk0 + i
                if int8:
                    W = n_chunks * QPW * LANES
                    for s4 in range(QPW):
                        a[m, i * QPW + s4] = A[m * W + (ci * QPW + s4) * LANES + lane] if ci < n_chunks \
                            else u32(0)
                else:
                    for j in range(epw):
                        kk = (ci * epw + j) * LANES + lane
                        a[m, i * epw + j] = load(A, m * K + kk) if (ci < n_chunks and kk < K) \
                            else np.float32(0.0)

        w = cuda.local.array(WPL, np.uint32)
        nxt = cuda.local.array(WPL, np.uint32)
        acc = cuda.local.array(M, np.float32)
        dot_t = cuda.local.array(M, np.int32)             # int8 per tensor: integer sums over the lane
        sum_t = cuda.local.array(M, np.int32)
        n = cuda.blockIdx.x
        for i in range(WPL):
            nxt[i] = packed[n * n_words + (chunk0 + i) * LANES + lane] if (n < N and chunk0 + i < n_chunks) \
                else u32(0)
        parity = 0
        while n < N:
            for i in range(WPL):
                w[i] = nxt[i]
            n_next = n + cuda.gridDim.x                 # the next column's words are in flight meanwhile
            for i in range(WPL):
                nxt[i] = packed[n_next * n_words + (chunk0 + i) * LANES + lane] \
                    if (n_next < N and chunk0 + i < n_chunks) else u32(0)
            for m in range(M):
                acc[m] = np.float32(0.0)
            # ---- the column's (scale, zero) pairs: lane r converts run r's once (float16 -> float32 is a
            #      quarter-rate instruction), the warp reads them with shuffles. c = -zero * scale ----
            run_sc = np.float32(0.0)
            run_c = np.float32(0.0)
            if lane < RUNS:
                run_sc, zr = scale_zero(sz, n, (chunk0 + lane // RUNS_W) * epw + (lane % RUNS_W) * RL, n_groups)
                run_c = -(zr - Z_SHIFT) * run_sc
            if int8:
                for m in range(M):
                    dot_t[m] = i32(0)
                    sum_t[m] = i32(0)
                for i in range(WPL):
                    for s4 in range(QPW):
                        x = quad(w[i], s4) ^ SIGN_FLIP
                        for u in range(SUB):
                            msk = u32(((1 << (8 * SUB_RL)) - 1) << (8 * SUB_RL * u)) if SUB > 1 \
                                else u32(FULL_MASK)
                            xm = x & msk
                            ones = u32(BYTE_ONES) & msk
                            if per_tensor:
                                for m in range(M):
                                    dot_t[m] = dp4a(xm, a[m, i * QPW + s4], dot_t[m])
                                    sum_t[m] = dp4a(ones, a[m, i * QPW + s4], sum_t[m])
                            elif 4 * s4 + SUB_RL * u < epw:
                                rid = i * RUNS_W + (4 * s4 + SUB_RL * u) // RL
                                sc = cuda.shfl_sync(FULL_MASK, run_sc, rid)
                                c = cuda.shfl_sync(FULL_MASK, run_c, rid)
                                for m in range(M):
                                    dot = dp4a(xm, a[m, i * QPW + s4], i32(0))
                                    asum = dp4a(ones, a[m, i * QPW + s4], i32(0))
                                    acc[m] += sc * small_int_to_f32(dot) + c * small_int_to_f32(asum)
                if per_tensor:
                    sc = cuda.shfl_sync(FULL_MASK, run_sc, 0)
                    c = cuda.shfl_sync(FULL_MASK, run_c, 0)
                    for m in range(M):
                        acc[m] = sc * small_int_to_f32(dot_t[m]) + c * small_int_to_f32(sum_t[m])
            else:
                for i in range(WPL):
                    for r in range(RUNS_W):
                        sc = cuda.shfl_sync(FULL_MASK, run_sc, i * RUNS_W + r)
                        c = cuda.shfl_sync(FULL_MASK, run_c, i * RUNS_W + r)
                        for jr in range(RL):
                            j = r * RL + jr
                            # float(q) without the quarter-rate I2F: q in the mantissa of 2**23, minus 2**23
                            q = u32_as_f32(((w[i] >> u32(bits * j)) & MASK) | F32_2P23_BITS) - F32_2P23
                            wv = q * sc + c                       # (q - zero) * scale
                            for m in range(M):
                                acc[m] += wv * a[m, i * epw + j]
            # ---- reduce: over the warp, then over the K-warps ----
            for m in range(M):
                v = acc[m]
                for off in (16, 8, 4, 2, 1):
                    v += cuda.shfl_xor_sync(FULL_MASK, v, off)
                if lane == 0:
                    part[parity, warp, m] = v
            cuda.syncthreads()
            if tid < M:
                total = np.float32(0.0)
                for ww in range(n_warps):
                    total += part[parity, ww, tid]
                if int8:
                    total *= d_act[tid]
                out[tid * N + n] = np.float16(total) if f16_out else total
            parity ^= 1
            n = n_next

    return jit_kernel(kernel, spec.max_registers)


# ---------------------------------------------------------------------------------------------
# GPU quantizer
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class UniformQuantizeSpec(Spec):
    """The GPU quantizer's choices: the key of :func:`make_quantize_kernels`."""
    FAMILY = "uniform_quantize"
    bits: int
    group_size: object = 128
    w_type: str = "float16"

    def normalise(self):
        if self.bits not in UNIFORM_BITS:
            raise ValueError(f"bits must be one of {UNIFORM_BITS}, got {self.bits!r}")
        if self.group_size not in UNIFORM_GROUPS:
            raise ValueError(f"group_size must be one of {UNIFORM_GROUPS}, got {self.group_size!r}")
        return dict(bits=int(self.bits), group_size=self.group_size and int(self.group_size),
                    w_type=type_name(self.w_type, "w_type", ("float16", "float32")))


@lru_cache(maxsize=None)
def make_quantize_kernels(spec):
    """(scale_zero kernel, pack kernel) for a :class:`UniformQuantizeSpec`. The first: one CTA per group
    (one for the whole tensor), block min/max, then scale and zero as in the reference; a NaN or Inf sets
    err[0]. The second: one thread per packed word."""
    bits, group_size = spec.bits, spec.group_size
    load = make_loader(spec.w_type)
    levels = np.float32((1 << bits) - 1)
    epw = uniform_elements_per_word(bits)
    G = group_size or 0
    F16_MAX = np.float32(65504.0)

    def scale_zero_kernel(W, sz, N, K, err):
        scratch = cuda.shared.array(LANES, np.float32)
        g = cuda.blockIdx.x
        if G:
            n = g // (K // G)
            base = n * K + (g % (K // G)) * G
            count = G
        else:
            base = 0
            count = N * K
        mn = np.float32(3.0e38)
        mx = np.float32(-3.0e38)
        for i in range(cuda.threadIdx.x, count, cuda.blockDim.x):
            v = load(W, base + i)
            if not abs(v) <= F32_MAX:             # NaN or Inf: flag it (quantize refuses W)
                err[0] = 1
                v = np.float32(0.0)
            mn = min(mn, v)
            mx = max(mx, v)
        mx = block_max(mx, scratch)
        mn = -block_max(-mn, scratch)
        if cuda.threadIdx.x == 0:
            scale = np.float32(np.float16(min((mx - mn) / levels, F16_MAX)))   # (as the reference: a float16
            if not scale > np.float32(0.0):                                     #  step, at most 65504, 1
                scale = np.float32(1.0)                                         #  where it rounds to 0)
            s16 = np.float16(scale)
            z = -mn / np.float32(s16)
            z = min(max(z, -F16_MAX), F16_MAX) + np.float32(0.0)   # (-0.0 + 0.0 = +0.0: one sign for zero,
            sz[2 * g] = s16                                         #  whichever sign the block min had)
            sz[2 * g + 1] = np.float16(z)

    def pack_kernel(W, sz, packed, N, K, n_chunks):
        idx = cuda.grid(1)
        if idx >= N * n_chunks * LANES:
            return
        n = idx // (n_chunks * LANES)
        c = (idx // LANES) % n_chunks
        t = idx % LANES
        word = u32(0)
        for j in range(epw):
            kk = (c * epw + j) * LANES + t
            if kk < K:
                g = (n * (K // G) + kk // G) if G else 0
                s = np.float32(sz[2 * g])
                z = np.float32(sz[2 * g + 1])
                q = i32(round(load(W, n * K + kk) / s + z))
                q = min(max(q, i32(0)), i32(levels))
                word |= u32(q) << u32(bits * j)
        packed[idx] = word

    return jit_kernel(scale_zero_kernel), jit_kernel(pack_kernel)


def quantize(W, bits=4, group_size=128, stream=None):
    """GPU min-max quantizer: W [N, K] float16/float32 (NumPy or device) -> UniformWeight on the device.
    The same arithmetic as ``reference.uniform_quantize`` (equal results)."""
    if bits not in UNIFORM_BITS:
        raise ValueError(f"bits must be one of {UNIFORM_BITS}, got {bits!r}")
    stream = _arrays.as_stream(stream)
    Wd = _arrays.device_array(W, "W", (np.float16, np.float32), 2, stream)
    N, K = Wd.shape
    if K % LANES or (group_size and K % group_size):
        raise ValueError(f"K must be a multiple of 32 and of group_size, got K={K}")
    if group_size not in UNIFORM_GROUPS:
        raise ValueError(f"group_size must be one of {UNIFORM_GROUPS}, got {group_size!r}")
    epw = uniform_elements_per_word(bits)
    n_chunks = -(-K // (LANES * epw))
    n_groups = N * K // group_size if group_size else 1
    sz_shape = (N, K // group_size, 2) if group_size else (1, 1, 2)
    sz = cuda.device_array(sz_shape, np.float16, stream=stream)
    packed = cuda.device_array((N, n_chunks * LANES), np.uint32, stream=stream)
    sz_kernel, pack_kernel = make_quantize_kernels(UniformQuantizeSpec(bits, group_size, Wd.dtype))
    flatW, flat_sz = _arrays.flat_view(Wd), _arrays.flat_view(sz)
    threads = group_size or QUANT_THREADS          # a thread per value of a group (32..128)
    err = cuda.to_device(np.zeros(1, np.int32), stream=stream)
    sz_kernel[n_groups, threads, stream](flatW, flat_sz, i32(N), i32(K), err)
    if err.copy_to_host(stream=stream)[0]:
        raise ValueError("W contains NaN or Inf")
    total = N * n_chunks * LANES
    pack_kernel[-(-total // QUANT_THREADS), QUANT_THREADS, stream](flatW, flat_sz, _arrays.flat_view(packed),
                                                                   i32(N), i32(K), i32(n_chunks))
    return UniformWeight(packed, sz, bits, (N, K), group_size)


# ---------------------------------------------------------------------------------------------
# GEMV
# ---------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
@lru_cache(maxsize=None)
def _dummy_scales():
    """The float16 path's unused activation-scale argument: one array for every call (no allocation per call,
    so that a call can be captured into a CUDA graph)."""
    return cuda.to_device(np.ones(1, np.float32))


def plan(A, uw, out=None, stream=None, out_dtype=np.float16, int8=False, bf16=False):
    """Checked inputs bound into a :class:`launch.Plan`: the activation quantizer (int8 path) and the GEMV."""
    stream = _arrays.as_stream(stream)
    uw = device_weight(uw, UniformWeight, stream)
    N, K = uw.shape
    Ad, a_src, M, out = _arrays.gemv_io(A, uw.shape, out, out_dtype, bf16, stream, "uniform.gemv", MAX_M)
    epw, wpl, _, _ = _geometry(uw.bits, uw.group_size)
    kw = -(-uw.n_chunks // wpl)
    if kw > MAX_KW:
        raise ValueError(f"K={K} is too large for {uw.bits}-bit uniform.gemv (at most "
                         f"{MAX_KW * wpl * epw * LANES})")
    steps = []
    if int8:
        step, words, d_act = int8_step(Ad, a_src, epw, stream)
        steps.append(step)
        a_arg = _arrays.flat_view(words)
    else:
        a_arg, d_act = _arrays.flat_view(Ad), _dummy_scales()
    n_groups = K // uw.group_size if uw.group_size else 1
    args = (a_arg, _arrays.flat_view(uw.packed), _arrays.flat_view(uw.scale_zero, np.uint32), d_act,
            _arrays.flat_view(out), i32(N), i32(K), i32(uw.n_chunks), i32(n_groups))
    spec = UniformGemvSpec(uw.bits, M, uw.group_size, a_src, out.dtype, int8)
    spec, kern, _, max_threads = fit_threads(make_uniform_gemv, spec, args, kw * WARP)
    if kw * WARP > max_threads:
        raise ValueError(f"{uw.bits}-bit uniform.gemv at M={M} fits {max_threads} threads per CTA, K={K} needs "
                         f"{kw * WARP}")
    grid = max(1, min(N, sm_count() * max(1, CTA_WARPS_TARGET // kw)))
    steps.append(Step(kern, grid, kw * WARP, args))
    return Plan(steps, Ad, out, stream)


def gemv(A, uw, out=None, stream=None, out_dtype=np.float16, int8=False, bf16=False):
    """C[M, N] = A[M, K] @ W^T for M = 1..4 with W a UniformWeight.

    A: float16/float32 [M, K] or [K] (bfloat16 bits as int16 with ``bf16=True``). ``int8=True``
    quantizes A per token to int8 first (``act_quant``, one more launch) and runs the dp4a kernel.
    Returns a device array [M, N] (or [N]) of ``out_dtype``, or writes into ``out``."""
    return plan(A, uw, out, stream, out_dtype, int8, bf16).launch()


def prepare(A, uw, out=None, stream=None, out_dtype=np.float16, int8=False, bf16=False):
    """``gemv`` bound to its buffers for decode loops and CUDA graphs (``launch.PreparedSteps``): write
    the next activations into ``.A`` (a device array) and call ``.run()``."""
    return plan(A, uw, out, stream, out_dtype, int8, bf16).prepare()


def ptx_specs():
    """Every (bits, M = 1, 4) for the fp16 and int8 paths at group 128, every group size at 4 and 3 bits,
    and the other A / output types once."""
    specs = [UniformGemvSpec(b, M, 128, int8=i8) for b in UNIFORM_BITS for M in (1, 4) for i8 in (False, True)]
    specs += [UniformGemvSpec(b, 2, g, int8=i8) for b in (3, 4) for g in (32, 64, None) for i8 in (False, True)]
    return specs + [UniformGemvSpec(4, 3, 128, "float32", "float32"), UniformGemvSpec(2, 1, 64, "bfloat16")]


def kernel_specializations():
    from numba import types as t
    specs = [(spec.name, make_uniform_gemv(spec),
              (t.uint32[::1] if spec.int8 else NUMBA_TYPES[spec.a_type], t.uint32[::1], t.uint32[::1], t.float32[::1],
               NUMBA_TYPES[spec.out_dtype], t.int32, t.int32, t.int32, t.int32)) for spec in ptx_specs()]
    for bits in UNIFORM_BITS:
        szk, pk = make_quantize_kernels(UniformQuantizeSpec(bits, 64))
        specs.append((f"uniform_quantize_sz bits={bits}", szk,
                      (t.float16[::1], t.float16[::1], t.int32, t.int32, t.int32[::1])))
        specs.append((f"uniform_quantize_pack bits={bits}", pk,
                      (t.float16[::1], t.float16[::1], t.uint32[::1], t.int32, t.int32, t.int32)))
    return specs
