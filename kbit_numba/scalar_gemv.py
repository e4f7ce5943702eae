"""Scalar GEMV for decoding: C[M, N] = A[M, K] @ W[N, K]^T for M = 1..4 (kbit weights, k = 2..5).

Design (numbers in benchmarks/README.md):

* **A lane owns one 32-element K-block for the whole launch.** A CTA has ``KW = ceil(K / 1024)`` warps
  side by side along K, so lane ``l`` of warp ``w`` owns block ``kb = 32 w + l``. Its 32 x M activations
  are loaded once into registers and reused for every column the CTA visits (a persistent grid walks
  the columns), so A costs no loads in the inner loop.
* **Per column a lane reads its block's k bit-plane words** (one 16-byte ``ld.global.nc.v4`` for k = 4,
  8 bytes for k = 2, k words otherwise: the warp reads 32*k*4 contiguous bytes) and one absmax. The
  loads of the next group of ``CB`` columns are issued before the current group is decoded (a register
  double buffer), and the very first ones before A is loaded, so DRAM latency overlaps work.
* **Decode = a bit-matrix transpose into byte fields.** Word ``F_i`` (i = 0..7) gathers bit i+8t of
  every plane into byte t, already multiplied by 4: ``F_i = OR_b ((plane_b >> i) & 0x01010101) << (b+2)``
  (one shift and one and-or per plane and word: k/2 integer ops per weight). Byte t of ``F_i`` is then
  the byte offset of element ``i + 8t``'s codebook entry in shared memory (float32, 2**k words in
  distinct banks: conflict-free whatever the indices). The A registers are stored in that element
  order, so the permutation costs nothing.
* **Each weight is looked up once and used for all M rows** (M FMAs, float32 accumulate); the block's
  sum is scaled by its absmax once.
* **Reduction**: the CB*M partial sums of a lane are reduced across the warp by a reduce-scatter
  butterfly (31 shuffles for 32 values instead of 5 per value), then across the KW warps in shared
  memory (double-buffered: one barrier per iteration).
* **Grouped (MoE)** is the same kernel with a flag: ``blockIdx.y`` picks an expert, its weights sit after
  the previous experts', its token rows come from ``offsets``.

Measured on an H200 the kernel is issue-bound (~10 SASS instructions per weight), not memory-bound;
benchmarks/README.md has the numbers and the next steps. K is limited to 32768 (32 warps x 1024).

Reference twins: ``reference.gemv``, ``reference.grouped_gemv``. Tests: ``tests/test_gemv.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda
from numba.cuda.misc.special import literal_unroll

from . import _arrays
from .codec import _device_weight, MAX_CODES
from .device import (WARP, e4m4_decode, jit_kernel, make_warp_reduce_scatter, make_word_unpacker, sm_count,
                     tiled_block)
from .formats import BLOCK, KbitWeight, padded_k
from .intrinsics import ldg64, ldg128, lds_f32, prmt, shared_addr, u32_as_f32
from .launch import PreparedLaunch

MAX_M = 4
MAX_KW = 32                      # warps per CTA along K: K <= 32 * 32 * 32 = 32768
FIELD = 8                        # bits per index field in the transposed words
N_FIELDS = BLOCK // FIELD        # 4 fields (elements i, i+8, i+16, i+24) per word
N_WORDS = FIELD                  # 8 transposed words per block
ONES = 0x01010101                # bit 0 of every byte
CTA_WARPS_TARGET = 32            # resident warps per SM the grid aims for
CB_ALIGN = 256                   # codebook's shared address has a zero low byte
PRMT_KEEP_HIGH = 0x7650          # prmt selector: bytes 1..3 from the 2nd operand (the address)
# Tuning from the H200 sweeps in benchmarks/README.md: 2 columns per iteration was best or within 5%
# of best for M = 1..4 on 2048x5120 and 4096x14336; register caps only hurt (spills).
DEFAULT_CB = 2
MAX_REGISTERS = {1: None, 2: None, 3: None, 4: None}


@lru_cache(maxsize=None)
def make_gemv_kernel(k, M, CB, layout, absmax_format, a_src, out_dtype, max_registers=None, grouped=False):
    """Kernel(A[T*K], packed, absmax, codebook, out[T*N], N, K, n_kb, offsets), KW warps per CTA.

    k: bits; M: rows of A (1..4); CB: columns per iteration (1, 2, 4 or 8); max_registers: a register
    cap per thread (more resident warps against fewer registers; see benchmarks/README.md).
    grouped: the MoE variant. blockIdx.y is an expert e whose weights follow the previous experts' in
    packed/absmax; its tokens are rows offsets[e] .. offsets[e+1]-1 of A and out (at most M of them;
    CTAs of experts without tokens exit at once). Not grouped: offsets is unused, the M rows are 0..M-1."""
    assert 1 <= M <= MAX_M and CB in (1, 2, 4, 8)
    n_codes = 1 << k
    CM = CB * M                                    # partial sums per lane per iteration ...
    tiled = layout == "tiled"
    e4m4 = absmax_format == "e4m4"
    f16_out = np.dtype(out_dtype) == np.float16
    word_to_f32, A_PER_WORD = make_word_unpacker(a_src)   # A is read as uint32 words
    absmax_t = np.uint8 if e4m4 else np.float32
    V = 1 << (CM - 1).bit_length()                 # ... padded to a power of two (<= 32)
    reduce_scatter = make_warp_reduce_scatter(V)
    COLS = tuple(range(CB))                        # literal_unroll(COLS/ROWS): loops fully unrolled,
    ROWS = tuple(range(M))                         # so per-column registers never spill to local memory

    @cuda.jit(device=True, inline="always")
    def load_group(packed, absmax, g, first_slot, kb, active, N, n_kb, nxt, nxt_absmax):
        """Issue the loads of column group g: this lane's block of each of its CB columns (k plane
        words in one 16- or 8-byte load where k allows, and the absmax) into nxt / nxt_absmax."""
        for c in literal_unroll(COLS):
            n = g * CB + c
            if active and n < N:
                slot = first_slot + (tiled_block(n, kb, N) if tiled else n * n_kb + kb)
                if k == 4:
                    nxt[c, 0], nxt[c, 1], nxt[c, 2], nxt[c, 3] = ldg128(packed, slot * 4)
                elif k == 2:
                    nxt[c, 0], nxt[c, 1] = ldg64(packed, slot * 2)
                else:
                    for b in range(k):
                        nxt[c, b] = packed[slot * k + b]
                nxt_absmax[c] = absmax[slot]

    def gemv_kernel(A, packed, absmax, cb, out, N, K, n_kb, offsets):
        if grouped:                                 # this CTA's expert and its token rows
            expert = cuda.blockIdx.y
            row0 = offsets[expert]
            rows = offsets[expert + 1] - row0
            if rows <= 0:                           # whole CTA: no barrier is skipped by a subset
                return
            first_slot = expert * N * n_kb
        else:
            row0 = 0
            rows = M
            first_slot = 0
        # 256-byte aligned, so an index byte (idx*4 < 128) can be merged into the address's low byte
        cb_sh = cuda.shared.array(MAX_CODES, np.float32, alignment=CB_ALIGN)
        part = cuda.shared.array((2, MAX_KW, WARP), np.float32)   # double-buffered warp partials
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        n_warps = cuda.blockDim.x // WARP
        kb = warp * WARP + lane
        active = kb < K // BLOCK
        n_groups = (N + CB - 1) // CB
        g = cuda.blockIdx.x

        # ---- 1. start the first column group's weight loads: DRAM latency overlaps the setup below ---
        nxt = cuda.local.array((CB, k), np.uint32)
        nxt_absmax = cuda.local.array(CB, absmax_t)
        for c in literal_unroll(COLS):          # columns past N (and idle lanes) contribute zeros
            for b in range(k):
                nxt[c, b] = np.uint32(0)
            nxt_absmax[c] = absmax_t(0)
        load_group(packed, absmax, g, first_slot, kb, active, N, n_kb, nxt, nxt_absmax)

        # ---- 2. this lane's activations, 16-byte loads, in the transposed element order --------------
        #         a[m, 4i + t] = A[m, 32 kb + i + 8t]
        a = cuda.local.array((M, BLOCK), np.float32)
        for m in literal_unroll(ROWS):
            live = active and m < rows
            a_live = np.float32(1.0) if live else np.float32(0.0)
            base = ((row0 + m) * K + kb * BLOCK) // A_PER_WORD
            if not live:                                       # a valid address; values zeroed below
                base = 0
            for q in range(BLOCK // A_PER_WORD // 4):          # 4 words per 16-byte load
                w4 = ldg128(A, base + 4 * q)
                for h in range(4):
                    for e in range(A_PER_WORD):                 # element j of the block
                        j = (4 * q + h) * A_PER_WORD + e
                        a[m, (j % FIELD) * N_FIELDS + j // FIELD] = word_to_f32(w4[h], e) * a_live
        if tid < n_codes:
            cb_sh[tid] = cb[tid]
        cb_addr = shared_addr(cb_sh)
        cuda.syncthreads()

        planes = cuda.local.array((CB, k), np.uint32)
        scale = cuda.local.array(CB, np.float32)
        acc = cuda.local.array(V, np.float32)
        s = cuda.local.array(M, np.float32)
        parity = 0
        while g < n_groups:
            n0 = g * CB
            # ---- 3. take the prefetched group, start loading the next one ----------------------
            for c in literal_unroll(COLS):
                for b in range(k):
                    planes[c, b] = nxt[c, b]
                scale[c] = e4m4_decode(nxt_absmax[c]) if e4m4 else nxt_absmax[c]
            g += cuda.gridDim.x
            load_group(packed, absmax, g, first_slot, kb, active, N, n_kb, nxt, nxt_absmax)
            # ---- 4. decode each block once, use it for all M rows --------------------------------
            for j in range(CM, V):
                acc[j] = np.float32(0.0)
            for c in literal_unroll(COLS):
                for m in range(M):
                    s[m] = np.float32(0.0)
                for i in range(N_WORDS):
                    f = np.uint32(0)
                    for b in range(k):
                        sh = i - b - 2                      # move bit i+8t of plane b to bit b+2 of byte t
                        moved = planes[c, b] >> np.uint32(sh) if sh >= 0 else planes[c, b] << np.uint32(-sh)
                        f |= moved & np.uint32(ONES << (b + 2))
                    for t in range(N_FIELDS):
                        # one prmt: byte t of f (= 4*idx) becomes the low byte of the codebook address
                        v = lds_f32(cb_sh, prmt(f, cb_addr, np.uint32(t | PRMT_KEEP_HIGH)))
                        for m in range(M):
                            s[m] += v * a[m, i * N_FIELDS + t]
                for m in range(M):
                    acc[c * M + m] = s[m] * scale[c]
            # ---- 5. reduce-scatter over the warp: one lane per value ends with its warp sum --------
            r, v_idx, owner = reduce_scatter(acc, lane)
            if owner:
                part[parity, warp, v_idx] = r
            # ---- 6. across the K-warps; the other parity's buffer is next iteration's -------------
            cuda.syncthreads()
            if tid < CM:
                c = tid // M
                m = tid - c * M
                n = n0 + c
                total = np.float32(0.0)
                for w in range(n_warps):
                    total += part[parity, w, tid]
                if n < N and m < rows:
                    out[(row0 + m) * N + n] = np.float16(total) if f16_out else total
            col = np.int32(n0) + np.int32(tid)
            if grouped and rows > M and tid < CB and col < N:
                nan = u32_as_f32(np.uint32(0x7FC00000))    # (a float16 NaN literal is invalid NVVM IR)
                for r in range(M, rows):              # more tokens than this kernel holds: NaN, never
                    out[np.int32(row0 + r) * np.int32(N) + col] = np.float16(nan) if f16_out else nan
            parity ^= 1

    return jit_kernel(gemv_kernel, max_registers)


@lru_cache(maxsize=None)
def _no_offsets():
    """The offsets argument of a plain (not grouped) launch: unused, but the kernel ABI has it."""
    return cuda.to_device(np.zeros(2, np.int32))




def _plan(A, qw, out, stream, out_dtype, bf16, tuning=None):
    """Validate the inputs and choose the specialisation: (kernel, grid, block, args, out)."""
    Ad, a_src, M, shape = _arrays.activations(A, qw, bf16, stream)
    N, K = qw.shape
    if not 1 <= M <= MAX_M:
        raise ValueError(f"gemv handles M = 1..{MAX_M} rows, got M={M}")
    if K > MAX_KW * WARP * BLOCK:
        raise ValueError(f"gemv handles K <= {MAX_KW * WARP * BLOCK}, got K={K}")
    out_dtype = _arrays.output_dtype(out, out_dtype)
    qw = _device_weight(qw, stream)
    out = _arrays.output(out, "out", (M, N) if len(shape) == 2 else (N,), out_dtype, stream)
    n_sm = sm_count()
    CB, max_regs = tuning or (DEFAULT_CB, MAX_REGISTERS[M])
    kw = -(-(K // BLOCK) // WARP)
    kern = make_gemv_kernel(qw.k, M, CB, qw.layout, qw.absmax_format, a_src, out_dtype.name, max_regs)
    grid = min(-(-N // CB), n_sm * max(1, CTA_WARPS_TARGET // kw))
    _arrays.check_aligned(Ad, 16, "A")
    args = (_arrays.flat_view(Ad, np.uint32), qw.packed, qw.absmax, qw.codebook, _arrays.flat_view(out),
            np.int32(N), np.int32(K), np.int32(qw.n_kblocks), _no_offsets())
    return kern, grid, kw * WARP, args, out


def gemv(A, qw, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """C[M, N] = A[M, K] @ W^T for M = 1..4 with W a kbit weight (flat or tiled, E4M4 or fp32 absmax).

    A: float16/float32 [M, K] or [K] (bfloat16 as int16 bits with ``bf16=True``); returns a device array
    [M, N] (or [N]) of ``out_dtype`` (float16 or float32), or writes into ``out``."""
    stream = _arrays.as_stream(stream)
    kern, grid, block, args, out = _plan(A, qw, out, stream, out_dtype, bf16)
    kern[grid, block, stream](*args)
    return out


class PreparedGemv:
    """A gemv bound to its activation buffer, weight, output buffer and stream, for decode loops and
    CUDA graphs: each ``run()`` is one driver launch (no argument typing or checking).

    Write the next activations into ``prepared.A`` (same shape, dtype and address) before ``run()``;
    results land in ``prepared.out``."""

    def __init__(self, A, qw, out=None, stream=None, out_dtype=np.float16, bf16=False):
        stream = _arrays.as_stream(stream)
        if isinstance(A, np.ndarray):
            raise TypeError("prepare_gemv binds buffers by address: pass A as a device array")
        kern, grid, block, args, self.out = _plan(A, qw, out, stream, out_dtype, bf16)
        self.A = A
        self._launch = PreparedLaunch(kern, grid, block, args, stream)

    def run(self, stream=None):
        """Launch (on ``stream`` if given, else the bound one); returns ``out``."""
        self._launch(None if stream is None else _arrays.as_stream(stream))
        return self.out


def prepare_gemv(A, qw, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """The fast path for repeated gemv calls: see :class:`PreparedGemv`."""
    return PreparedGemv(A, qw, out, stream, out_dtype, bf16)


@dataclass(frozen=True)
class KbitExperts:
    """E kbit weights of one shape, k, layout, absmax format and codebook, stored back to back:
    expert e's words are packed[e*words : (e+1)*words] (its own flat or tiled layout), its absmax
    values absmax[e*blocks : (e+1)*blocks]. Build with :func:`stack_experts`."""
    packed: object
    absmax: object
    codebook: object
    k: int
    expert_shape: tuple
    n_experts: int
    layout: str = "flat"
    absmax_format: str = "e4m4"

    def expert(self, e):
        """Expert e as a KbitWeight (views, no copy)."""
        N, K = self.expert_shape
        b = N * padded_k(K, self.layout) // BLOCK
        w = b * self.k
        return KbitWeight(self.packed[e * w:(e + 1) * w], self.absmax[e * b:(e + 1) * b], self.codebook,
                          self.k, self.expert_shape, self.layout, self.absmax_format)


def stack_experts(experts, stream=None):
    """A list of KbitWeights (same shape, k, layout, absmax format, codebook) -> KbitExperts on the device."""
    experts = list(experts)
    if not experts or not all(isinstance(w, KbitWeight) for w in experts):
        raise TypeError("stack_experts needs a non-empty list of KbitWeight")
    w0 = experts[0]
    key = (w0.shape, w0.k, w0.layout, w0.absmax_format)
    cb0 = _arrays.to_host(w0.codebook)
    for w in experts[1:]:
        if (w.shape, w.k, w.layout, w.absmax_format) != key:
            raise ValueError(f"every expert must have shape/k/layout/absmax_format {key}, "
                             f"got {(w.shape, w.k, w.layout, w.absmax_format)}")
        if not np.array_equal(_arrays.to_host(w.codebook), cb0):
            raise ValueError("every expert must use the same codebook")
    stream = _arrays.as_stream(stream)
    packed = np.concatenate([_arrays.to_host(w.packed).reshape(-1) for w in experts])
    absmax = np.concatenate([_arrays.to_host(w.absmax).reshape(-1) for w in experts])
    return KbitExperts(cuda.to_device(packed, stream=stream), cuda.to_device(absmax, stream=stream),
                       cuda.to_device(cb0.astype(np.float32), stream=stream), w0.k, w0.shape, len(experts),
                       w0.layout, w0.absmax_format)


def check_grouped(A, experts, expert_offsets, bf16, stream):
    """Checked MoE inputs: (device A, its element type, T, device offsets). A: [T, K] tokens sorted by
    expert; expert_offsets: int32 [E+1]. Host offsets are also checked to rise from 0 to T."""
    if not isinstance(experts, KbitExperts):
        raise TypeError(f"experts must be a KbitExperts (see stack_experts), got {type(experts).__name__}")
    E = experts.n_experts
    K = experts.expert_shape[1]
    Ad, a_src = _arrays.float_input(A, "A", bf16, 2, stream)
    T = tuple(Ad.shape)[0]
    if tuple(Ad.shape)[1] != K:
        raise ValueError(f"A has K={tuple(Ad.shape)[1]}, the experts have K={K}")
    offs = _arrays.device_array(expert_offsets, "expert_offsets", (np.int32,), 1, stream)
    if offs.shape[0] != E + 1:
        raise ValueError(f"expert_offsets must hold E+1 = {E + 1} values, got {offs.shape[0]}")
    return Ad, a_src, T, offs


def max_tokens_per_expert(host_offsets, T):
    """The largest expert's token count, after checking that the offsets rise from 0 to T."""
    h = host_offsets
    if h[0] != 0 or h[-1] != T or np.any(np.diff(h) < 0):
        raise ValueError(f"expert_offsets must rise from 0 to T={T}")
    return int(np.max(np.diff(h))) if len(h) > 1 else 0


def grouped_gemv(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False,
                 max_tokens=None):
    """MoE expert GEMV in one launch: out[t] = A[t] @ W_e^T for the tokens t of each expert e.

    A: [T, K] tokens sorted by expert; expert_offsets: int32 [E+1], expert e's tokens are rows
    offsets[e] .. offsets[e+1]-1 (0..4 per expert; empty experts cost nothing); experts: KbitExperts.
    Returns out [T, N]. The kernel is specialised for at most ``max_tokens`` tokens per expert; left
    None it is read from the offsets (a small device-to-host copy when they live on the device). Rows of
    an expert beyond ``max_tokens`` come out NaN, never silently wrong (use a larger ``max_tokens``)."""
    stream = _arrays.as_stream(stream)
    Ad, a_src, T, offs = check_grouped(A, experts, expert_offsets, bf16, stream)
    E = experts.n_experts
    N, K = experts.expert_shape
    if max_tokens is None:
        h = expert_offsets if isinstance(expert_offsets, np.ndarray) else offs.copy_to_host()
        max_tokens = max_tokens_per_expert(h, T)
    if max_tokens > MAX_M:
        raise ValueError(f"grouped_gemv handles up to {MAX_M} tokens per expert, got {max_tokens}")
    M = max(1, int(max_tokens))
    out_dtype = _arrays.output_dtype(out, out_dtype)
    out = _arrays.output(out, "out", (T, N), out_dtype, stream)
    _arrays.check_aligned(Ad, 16, "A")
    n_sm = sm_count()
    kw = -(-(K // BLOCK) // WARP)
    CB = DEFAULT_CB
    n_groups = -(-N // CB)
    gx = max(1, min(n_groups, -(-n_sm * max(1, CTA_WARPS_TARGET // kw) // max(1, E))))
    kern = make_gemv_kernel(experts.k, M, CB, experts.layout, experts.absmax_format, a_src, out_dtype.name,
                            None, True)
    n_kb = padded_k(K, experts.layout) // BLOCK
    if E and T:
        kern[(gx, E), kw * WARP, stream](_arrays.flat_view(Ad, np.uint32), experts.packed, experts.absmax,
                                         experts.codebook, _arrays.flat_view(out), np.int32(N), np.int32(K),
                                         np.int32(n_kb), offs)
    return out


def kernel_specializations():
    """(name, kernel, argument types) for the PTX checks: every (k, M) at the default configuration,
    and every value of each other factor (CB, layout, absmax format, A type, output type) with every k.
    (A full product would be 768 compilations of several seconds each.)"""
    from numba import types as t
    nb = {"float16": t.float16[::1], "float32": t.float32[::1], "bfloat16": t.int16[::1]}
    base = dict(M=1, CB=8, layout="flat", fmt="e4m4", a_src="float16", od="float16")
    variants = [dict(M=M) for M in (1, 2, 3, 4)]
    variants += [dict(M=2, CB=cb) for cb in (1, 2, 4)]
    variants += [dict(layout="tiled", M=3), dict(fmt="fp32", M=4), dict(a_src="float32", M=2),
                 dict(a_src="bfloat16"), dict(od="float32", M=3), dict(grouped=True, M=2)]
    specs = []
    for k in (2, 3, 4, 5):
        for v in variants:
            c = dict(base, **v)
            am = t.uint8[::1] if c["fmt"] == "e4m4" else t.float32[::1]
            name = f"gemv k={k} M={c['M']} CB={c['CB']} {c['layout']} {c['fmt']} A={c['a_src']} out={c['od']}"
            kern = make_gemv_kernel(k, c["M"], c["CB"], c["layout"], c["fmt"], c["a_src"], c["od"], None,
                                    c.get("grouped", False))
            name += " grouped" if c.get("grouped") else ""
            specs.append((name, kern, (t.uint32[::1], t.uint32[::1], am, t.float32[::1], nb[c["od"]],
                                       t.int32, t.int32, t.int32, t.int32[::1])))
    return specs
