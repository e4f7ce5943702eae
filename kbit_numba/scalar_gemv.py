"""Scalar GEMV for decoding: C[M, N] = A[M, K] @ W[N, K]^T for M = 1..4 (kbit weights, k = 2..5).

Design (numbers in benchmarks/README.md):

* **A lane owns one 32-element K-block for the whole launch.** A CTA has ``KW = ceil(K / 1024)`` warps
  side by side along K, so lane ``l`` of warp ``w`` owns block ``kb = 32 w + l``. Its 32 x M activations
  are loaded once into registers and reused for every column the CTA visits (a persistent grid walks
  the columns), so A costs no loads in the inner loop.
* **Per column a lane reads its block's k bit-plane words** (one 16-byte ``ld.global.nc.v4`` for k = 4,
  8 bytes for k = 2, k words otherwise: the warp reads 32*k*4 contiguous bytes) and one absmax. The
  loads of the next group of ``cols`` columns are issued before the current group is decoded (a register
  double buffer), and the very first ones before A is loaded, so DRAM latency overlaps work.
* **Decode = a bit-matrix transpose into byte fields.** Word ``F_i`` (i = 0..7) gathers bit i+8t of
  every plane into byte t, already multiplied by 4: ``F_i = OR_b ((plane_b >> i) & 0x01010101) << (b+2)``
  (one shift and one and-or per plane and word: k/2 integer ops per weight). Byte t of ``F_i`` is then
  the byte offset of element ``i + 8t``'s codebook entry in shared memory (float32, 2**k words in
  distinct banks: conflict-free whatever the indices). The A registers are stored in that element
  order, so the permutation costs nothing.
* **Each weight is looked up once and used for all M rows** (M FMAs, float32 accumulate); the block's
  sum is scaled by its absmax once.
* **Reduction**: the cols*M partial sums of a lane are reduced across the warp by a reduce-scatter
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
from .core import (MAX_M, check_grouped, device_weight, fit_threads, k_warps, max_tokens_per_expert, sm_count,
                   unused_i32)
from .device import (WARP, e4m4_decode, i32, jit_kernel, make_warp_reduce_scatter, make_word_unpacker,
                     slot_expert, tiled_block, u32)
from .formats import ABSMAX_FORMATS, BLOCK, K_BITS, LAYOUTS, MAX_CODES, KbitWeight, check_k, padded_k
from .intrinsics import BYTE_ONES, ldg64, ldg128, lds_f32, prmt, shared_addr, u32_as_f32
from .launch import NUMBA_TYPES, OUT_TYPES, Plan, Spec, Step, type_name

MAX_KW = 32                      # warps per CTA along K: K <= 32 * 32 * 32 = 32768
FIELD = 8                        # bits per index field in the transposed words
N_FIELDS = BLOCK // FIELD        # 4 fields (elements i, i+8, i+16, i+24) per word
N_WORDS = FIELD                  # 8 transposed words per block
CTA_WARPS_TARGET = 32            # resident warps per SM the grid aims for
CODEBOOK_ALIGN = 256             # codebook's shared address has a zero low byte
PRMT_KEEP_HIGH = 0x7650          # prmt selector: bytes 1..3 from the 2nd operand (the address)
COL_CHOICES = (1, 2, 4, 8)       # columns per iteration a kernel can be built for
# The defaults table (the launch knobs a plan uses unless the caller or the per-GPU table says otherwise),
# from the H200 sweeps in benchmarks/README.md: 2 columns per iteration was best or within 5% of best
# for M = 1..4 on 2048x5120 and 4096x14336; register caps only hurt (spills).
DEFAULTS = {"cols": 2, "max_registers": None}


@dataclass(frozen=True)
class GemvSpec(Spec):
    """The scalar gemv's compile-time choices: the key of :func:`make_gemv_kernel`."""
    FAMILY = "gemv"
    k: int
    M: int
    cols: int = DEFAULTS["cols"]            # columns per iteration (a lane's loads in flight)
    layout: str = "flat"
    absmax_format: str = "e4m4"
    a_type: str = "float16"                 # float16, float32, bfloat16 (int16 bits)
    out_dtype: str = "float16"
    max_registers: object = None            # a per-thread register cap, or None
    grouped: bool = False                   # the MoE variant

    def normalise(self):
        if not 1 <= self.M <= MAX_M:
            raise ValueError(f"gemv handles M = 1..{MAX_M} rows, got M={self.M}")
        if self.cols not in COL_CHOICES:
            raise ValueError(f"cols must be one of {COL_CHOICES}, got {self.cols!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"gemv reads the layouts {LAYOUTS}, got {self.layout!r}")
        if self.absmax_format not in ABSMAX_FORMATS:
            raise ValueError(f"absmax_format must be one of {ABSMAX_FORMATS}, got {self.absmax_format!r}")
        return dict(k=check_k(self.k), M=int(self.M), cols=int(self.cols), a_type=type_name(self.a_type, "a_type"),
                    out_dtype=type_name(self.out_dtype, "out_dtype", OUT_TYPES),
                    max_registers=int(self.max_registers) if self.max_registers else None,
                    grouped=bool(self.grouped))


@lru_cache(maxsize=None)
def make_gemv_kernel(spec):
    """Kernel(A[T*K], packed, absmax, codebook, out[T*N], N, K, n_kb, offsets), KW warps per CTA, for a
    :class:`GemvSpec`.

    k: bits; M: rows of A (1..4); cols (NCOL here): columns per iteration; max_registers: a register
    cap per thread (more resident warps against fewer registers; see benchmarks/README.md).
    grouped: the MoE variant. Expert e's weights follow the previous experts' in packed/absmax; its tokens
    are rows offsets[e] .. offsets[e+1]-1 of A and out (at most M of them). blockIdx.y is a slot: with
    gridDim.y = E slots, slot e is expert e; with fewer (T < E tokens: a decode step, where most experts
    have none) slot y is row y, and it runs row y's expert when y is that expert's first row. Either way no
    CTA is launched for nothing but a handful, and CTAs without work exit at once. Not grouped: offsets is
    unused, the M rows are 0..M-1."""
    k, M, NCOL, grouped = spec.k, spec.M, spec.cols, spec.grouped       # (checked by GemvSpec)
    layout, absmax_format, a_src, out_dtype = spec.layout, spec.absmax_format, spec.a_type, spec.out_dtype
    n_codes = 1 << k
    CM = NCOL * M                                  # partial sums per lane per iteration ...
    tiled = layout == "tiled"
    e4m4 = absmax_format == "e4m4"
    f16_out = np.dtype(out_dtype) == np.float16
    word_to_f32, A_PER_WORD = make_word_unpacker(a_src)   # A is read as uint32 words
    absmax_t = np.uint8 if e4m4 else np.float32
    V = 1 << (CM - 1).bit_length()                 # ... padded to a power of two (<= 32)
    reduce_scatter = make_warp_reduce_scatter(V)
    COL_IDX = tuple(range(NCOL))                   # literal_unroll(COL_IDX/ROWS): loops fully unrolled,
    ROWS = tuple(range(M))                         # so per-column registers never spill to local memory

    @cuda.jit(device=True, inline="always")     # (inlined by NVVM instead, its buffers went to local memory at k = 2)
    def load_group(packed, absmax, g, first_slot, kb, active, N, n_kb, nxt, nxt_absmax):
        """Issue the loads of column group g: this lane's block of each of its NCOL columns (k plane
        words in one 16- or 8-byte load where k allows, and the absmax) into nxt / nxt_absmax."""
        for c in literal_unroll(COL_IDX):
            n = g * NCOL + c
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
            expert = slot_expert(offsets)
            if expert < 0:                          # whole CTA: no barrier is skipped by a subset
                return
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
        cb_sh = cuda.shared.array(MAX_CODES, np.float32, alignment=CODEBOOK_ALIGN)
        part = cuda.shared.array((2, MAX_KW, WARP), np.float32)   # double-buffered warp partials
        tid = cuda.threadIdx.x
        lane = tid % WARP
        warp = tid // WARP
        n_warps = cuda.blockDim.x // WARP
        kb = warp * WARP + lane
        active = kb < K // BLOCK
        n_groups = (N + NCOL - 1) // NCOL
        g = cuda.blockIdx.x

        # ---- 1. start the first column group's weight loads: DRAM latency overlaps the setup below ---
        nxt = cuda.local.array((NCOL, k), np.uint32)
        nxt_absmax = cuda.local.array(NCOL, absmax_t)
        for c in literal_unroll(COL_IDX):          # columns past N (and idle lanes) contribute zeros
            for b in range(k):
                nxt[c, b] = u32(0)
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

        planes = cuda.local.array((NCOL, k), np.uint32)
        scale = cuda.local.array(NCOL, np.float32)
        acc = cuda.local.array(V, np.float32)
        s = cuda.local.array(M, np.float32)
        parity = 0
        while g < n_groups:
            n0 = g * NCOL
            # ---- 3. take the prefetched group, start loading the next one ----------------------
            for c in literal_unroll(COL_IDX):
                for b in range(k):
                    planes[c, b] = nxt[c, b]
                scale[c] = e4m4_decode(nxt_absmax[c]) if e4m4 else nxt_absmax[c]
            g += cuda.gridDim.x
            load_group(packed, absmax, g, first_slot, kb, active, N, n_kb, nxt, nxt_absmax)
            # ---- 4. decode each block once, use it for all M rows --------------------------------
            for j in range(CM, V):
                acc[j] = np.float32(0.0)
            for c in literal_unroll(COL_IDX):
                for m in range(M):
                    s[m] = np.float32(0.0)
                for i in range(N_WORDS):
                    f = u32(0)
                    for b in range(k):
                        sh = i - b - 2                      # move bit i+8t of plane b to bit b+2 of byte t
                        moved = planes[c, b] >> u32(sh) if sh >= 0 else planes[c, b] << u32(-sh)
                        f |= moved & u32(BYTE_ONES << (b + 2))
                    for t in range(N_FIELDS):
                        # one prmt: byte t of f (= 4*idx) becomes the low byte of the codebook address
                        v = lds_f32(cb_sh, prmt(f, cb_addr, u32(t | PRMT_KEEP_HIGH)))
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
            col = i32(n0) + i32(tid)
            if grouped and rows > M and tid < NCOL and col < N:
                nan = u32_as_f32(u32(0x7FC00000))    # (a float16 NaN literal is invalid NVVM IR)
                for r in range(M, rows):              # more tokens than this kernel holds: NaN, never
                    out[i32(row0 + r) * i32(N) + col] = np.float16(nan) if f16_out else nan
            parity ^= 1

    return jit_kernel(gemv_kernel, spec.max_registers)


def _launch(spec, N, K, E=1, T=None):
    """(grid, block) of a launch: KW warps per CTA along K, a persistent grid over the column groups that
    aims at CTA_WARPS_TARGET warps per SM, shared among the experts that can have tokens: at most
    min(E, T) of them, one grid row (slot) each (see make_gemv_kernel)."""
    kw = k_warps(K)
    n_groups = -(-N // spec.cols)
    slots = max(1, min(E, T)) if T is not None else E
    grid = max(1, min(n_groups, -(-sm_count() * max(1, CTA_WARPS_TARGET // kw) // max(1, slots))))
    return (grid, slots) if spec.grouped else grid, kw * WARP


def plan(A, qw, out=None, stream=None, out_dtype=np.float16, bf16=False, cols=None, max_registers=None):
    """Checked inputs of ``C = A @ W^T`` bound into a :class:`launch.Plan` (one launch).
    ``cols``/``max_registers`` override the ``DEFAULTS`` table (the bench's sweeps, the per-GPU table)."""
    stream = _arrays.as_stream(stream)
    qw = device_weight(qw, KbitWeight, stream)
    N, K = qw.shape
    if K > MAX_KW * WARP * BLOCK:
        raise ValueError(f"gemv handles K <= {MAX_KW * WARP * BLOCK}, got K={K}")
    Ad, a_src, M, out = _arrays.gemv_io(A, qw.shape, out, out_dtype, bf16, stream, "gemv", MAX_M)
    _arrays.check_aligned(Ad, 16, "A")
    spec = GemvSpec(qw.k, M, DEFAULTS["cols"] if cols is None else cols, qw.layout, qw.absmax_format, a_src,
                    out.dtype, DEFAULTS["max_registers"] if max_registers is None else max_registers)
    grid, block = _launch(spec, N, K)
    args = (_arrays.flat_view(Ad, np.uint32), qw.packed, qw.absmax, qw.codebook, _arrays.flat_view(out),
            i32(N), i32(K), i32(qw.n_kblocks), unused_i32())
    spec, kern, _, max_threads = fit_threads(make_gemv_kernel, spec, args, block)   # long K at M = 4
    if block > max_threads:
        raise ValueError(f"gemv at M={M} fits {max_threads} threads per CTA: K <= {max_threads * BLOCK}, got K={K}")
    return Plan([Step(kern, grid, block, args)], Ad, out, stream)


def gemv(A, qw, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """C[M, N] = A[M, K] @ W^T for M = 1..4 with W a kbit weight (flat or tiled, E4M4 or fp32 absmax).

    A: float16/float32 [M, K] or [K] (bfloat16 as int16 bits with ``bf16=True``); returns a device array
    [M, N] (or [N]) of ``out_dtype`` (float16 or float32), or writes into ``out``."""
    return plan(A, qw, out, stream, out_dtype, bf16).launch()


def prepare(A, qw, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """The fast path for repeated gemv calls (decode loops, CUDA graphs): a :class:`launch.Prepared` whose
    ``run()`` is one driver launch. Write the next activations into ``.A``; results land in ``.out``."""
    return plan(A, qw, out, stream, out_dtype, bf16).prepare()


def plan_grouped(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False,
                 max_tokens=None):
    """Checked inputs of :func:`grouped_gemv` bound into a :class:`launch.Plan` (one launch, or none when
    there are no tokens or experts)."""
    stream = _arrays.as_stream(stream)
    Ad, a_src, T, offs, experts = check_grouped(A, experts, expert_offsets, bf16, stream)
    if experts.layout == "codes":
        raise ValueError("grouped_gemv reads flat or tiled experts; code-layout experts: mma_gemv.grouped_gemv")
    E = experts.n_experts
    N, K = experts.expert_shape
    if max_tokens is None:
        h = expert_offsets if isinstance(expert_offsets, np.ndarray) else offs.copy_to_host()
        max_tokens = max_tokens_per_expert(h, T)
    if max_tokens > MAX_M:
        raise ValueError(f"grouped_gemv handles up to {MAX_M} tokens per expert, got {max_tokens}")
    out_dtype = _arrays.output_dtype(out, out_dtype)
    out = _arrays.output(out, "out", (T, N), out_dtype, stream)
    _arrays.check_aligned(Ad, 16, "A")
    spec = GemvSpec(experts.k, max(1, int(max_tokens)), DEFAULTS["cols"], experts.layout, experts.absmax_format,
                    a_src, out_dtype, grouped=True)
    grid, block = _launch(spec, N, K, E, T)
    steps = [] if not (E and T) else [Step(
        make_gemv_kernel(spec), grid, block,
        (_arrays.flat_view(Ad, np.uint32), experts.packed, experts.absmax, experts.codebook, _arrays.flat_view(out),
         i32(N), i32(K), i32(padded_k(K, experts.layout) // BLOCK), offs))]
    return Plan(steps, Ad, out, stream)


def grouped_gemv(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False,
                 max_tokens=None):
    """MoE expert GEMV in one launch: out[t] = A[t] @ W_e^T for the tokens t of each expert e.

    A: [T, K] tokens sorted by expert; expert_offsets: int32 [E+1], expert e's tokens are rows
    offsets[e] .. offsets[e+1]-1 (0..4 per expert; empty experts cost nothing); experts: KbitExperts.
    Returns out [T, N]. The kernel is specialised for at most ``max_tokens`` tokens per expert; left
    None it is read from the offsets (a small device-to-host copy when they live on the device). Rows of
    an expert beyond ``max_tokens`` come out NaN, never silently wrong (use a larger ``max_tokens``)."""
    return plan_grouped(A, experts, expert_offsets, out, stream, out_dtype, bf16, max_tokens).launch()


def ptx_specs():
    """The specialisations the PTX checks compile: every (k, M) at the defaults, and every value of each
    other choice (cols, layout, absmax format, A type, output type, grouped) with every k. (A full product
    would be 768 compilations of several seconds each.)"""
    variants = [dict(M=M) for M in (1, 2, 3, 4)]
    variants += [dict(M=2, cols=c) for c in COL_CHOICES if c != DEFAULTS["cols"]]
    variants += [dict(layout="tiled", M=3), dict(absmax_format="fp32", M=4), dict(a_type="float32", M=2),
                 dict(a_type="bfloat16", M=1), dict(out_dtype="float32", M=3), dict(grouped=True, M=2)]
    return [GemvSpec(k=k, **v) for k in K_BITS for v in variants]


def argtypes(spec):
    """The kernel's argument types for ``spec`` (what a plan passes)."""
    from numba import types as t
    return (t.uint32[::1], t.uint32[::1], t.uint8[::1] if spec.absmax_format == "e4m4" else t.float32[::1],
            t.float32[::1], NUMBA_TYPES[spec.out_dtype], t.int32, t.int32, t.int32, t.int32[::1])


def kernel_specializations():
    """(name, kernel, argument types) for the PTX checks, from :func:`ptx_specs`."""
    return [(spec.name, make_gemv_kernel(spec), argtypes(spec)) for spec in ptx_specs()]
