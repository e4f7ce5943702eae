"""Pair-table GEMV: C[M, N] = A[M, K] @ W[N, K]^T for M = 1..4 on the kernel-native code layout (k = 2, 4).

The scalar gemv (``scalar_gemv``) spends ~10 SASS instructions per weight, most of them transposing bit
planes into indices. At DRAM speed an H100 affords ~5.7 issue slots per weight in all, of which at most
~2.9 integer ops and ~1.4 shared loads (``benchmarks/README.md``). This kernel moves the transpose
offline and looks weights up several at a time:

* **Layout** (``formats.KbitCodes``, made once by :func:`to_codes`): a block's k words hold its indices
  as k-bit fields in element order, so byte c of word w is one *group* of ``G = 8 // k`` consecutive
  elements (a pair at k = 4, a quad at k = 2). Same bytes per weight as the bit planes.
* **Group table**: 256 entries (one per byte value) of G float32 codebook values, in 64 KB of dynamic
  shared memory laid out ``[code][copy]`` with one 256-byte row per code and ``64 // G`` copies per row,
  so that lane l reads copy ``l % copies``: the 32 lanes of an ``ld.shared.v2`` (v4 at k = 2) always hit
  distinct banks, whatever their codes. Because a row is exactly 256 bytes, the address of code byte c is
  ``code * 256 + copy * 4G``: **one prmt** drops the byte into bits 8..15 next to the lane's copy offset.
* **Per group of G weights**: 1 prmt + 1 shared load + G*M float32 FMAs (k = 4, M = 1: 2 instructions
  per weight). The block's sum is scaled by its absmax once.
* **Geometry**: as in the scalar gemv, lane l of K-warp w owns block kb = 32 w + l for the whole launch
  (its activations stay in registers) and a persistent grid walks the columns, CB per warp per
  iteration. Its 8- or 16-byte loads run two iterations ahead (three code buffers in registers, the
  loop unrolled three times), and all index math is 32-bit.
  The table must be shared by many warps, so a CTA holds ``S`` *slices* of ``KW = ceil(K / 1024)`` warps;
  slice s takes columns ``s*CB .. s*CB+CB-1`` of each group of S*CB columns. Lane sums are reduced by a
  warp reduce-scatter, then over the KW warps in shared memory (double-buffered, one barrier per
  iteration).

Reference twin: ``reference.gemv`` (which reads ``KbitCodes`` too). Tests: ``tests/test_pair_gemv.py``.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda

from numba.cuda.misc.special import literal_unroll

from . import _arrays
from .codec import _device_weight
from .device import WARP, e4m4_decode, jit_kernel, make_warp_reduce_scatter, make_word_unpacker, sm_count
from .formats import BLOCK, CODES_K, KbitCodes, KbitWeight
from .intrinsics import (SIMULATOR, f16_bits_to_f32, f16x2_as_u32, f32_as_u32, hfma2, ldg64, ldg128, lds64, lds128,
                         lds_u32, prmt, shared_addr, sts128, u32_as_f32)
from .launch import PreparedLaunch

MAX_M = 4
MAX_KW = 32                       # K-warps per slice: K <= 32 * 32 * 32 = 32768
CODES = 256                       # table entries: one per code byte
ROW_BYTES = 256                   # one table row per code, so a code byte shifted by 8 is its row address
TABLE_BYTES = CODES * ROW_BYTES   # 64 KB of dynamic shared memory
TABLE_FLOATS = TABLE_BYTES // 4
CHUNK_BYTES = 16                  # the fill writes the table 16 bytes (one st.shared.v4) at a time
ABSMAX_CODES = 256                # E4M4 bytes, decoded once per CTA into shared memory after the table
CODEBOOK = TABLE_FLOATS + ABSMAX_CODES   # float offset of the codebook (<= 16 values, staged for the fill)
PART = CODEBOOK + 16              # float offset of the cross-warp partial sums
# prmt selector for code byte t of a word: result byte 0 <- the lane's copy offset (byte 4 of {b, a}),
# byte 1 <- byte t of the code word, bytes 2, 3 <- byte 5 (zero: the offset is < 256).
PRMT_ROW = 0x5504
DEFAULT_CB = 4                    # columns per warp per iteration (CB * 16 bytes in flight per lane) ...
SMALL_WEIGHT = 1 << 24            # ... but 2 at M = 1 below this many weights (see default_cb)
CTA_WARPS = 2 if SIMULATOR else 16   # warps per CTA the plan aims for (the table is filled once per CTA)
REGISTERS_PER_SM = 65536


@lru_cache(maxsize=None)
def make_pair_gemv_kernel(k, M, CB, absmax_format, a_src, out_dtype, f16_acc=False):
    """Kernel(A words, packed codes, absmax, codebook, out[M*N], N, n_kb); blockDim = 32 * KW * S.

    k: 2 or 4; M: rows of A (1..4); CB: columns per warp per iteration; a_src: 'float16', 'float32' or
    'bfloat16' (A read as uint32 words); out_dtype: 'float16' or 'float32'. Launch with
    ``TABLE_BYTES + part_bytes(...)`` bytes of dynamic shared memory.
    f16_acc (float16 A only): the table holds f16x2 pairs and a block's products are summed by
    ``fma.rn.f16x2`` (one instruction per pair and row instead of two FFMAs), in float16; blocks are summed
    in float32 (error bound: tests/test_pair_gemv.py)."""
    if k not in CODES_K or not 1 <= M <= MAX_M:
        raise ValueError(f"pair gemv handles k in {CODES_K} and M = 1..{MAX_M}, got k={k}, M={M}")
    if f16_acc and a_src != "float16":
        raise ValueError(f"f16_acc needs float16 activations, got {a_src}")
    G = 8 // k                                     # elements per code byte
    ENTRY = 2 * G if f16_acc else 4 * G            # bytes of one table entry (G values)
    COPIES = min(WARP, ROW_BYTES // ENTRY)         # copies per row: 32, or 16 for float32 quads (k = 2)
    USED_CHUNKS = COPIES * ENTRY // CHUNK_BYTES    # chunks of a row the copies fill (f16, k = 4: half)
    WORDS_PER_ENTRY = ENTRY // 4
    PAIRS = BLOCK // 2                             # f16x2 words of a block's activations
    CODE_MASK = (1 << k) - 1
    N_CODES = 1 << k
    CM = CB * M
    V = 1 << (CM - 1).bit_length()                 # partial sums per lane, padded to a power of two
    e4m4 = absmax_format == "e4m4"
    absmax_t = np.uint8 if e4m4 else np.float32
    f16_out = np.dtype(out_dtype) == np.float16
    word_to_f32, A_PER_WORD = make_word_unpacker(a_src)
    reduce_scatter = make_warp_reduce_scatter(V)
    ROWS = tuple(range(M))
    U = np.uint32

    @cuda.jit(device=True, inline="always")
    def load_columns(packed, absmax, n0, kb, last4, n_kb, codes, code_absmax):
        """Issue the loads of columns n0 .. n0+CB-1 of this lane's block (k words in one 16- or 8-byte
        load, and the absmax) into codes / code_absmax.
        The loads are unconditional: a column past N (or a lane past the last block) reads the last
        block instead (last4 = 4 x its index), whose sums are never written (or meet zero activations).
        That is one min per column instead of a compare and a predicate, and fewer registers (a
        predicated load must keep its register's old value). ptxas still issues these loads after
        the decode that follows them in the source, whichever form: hence the loop's three buffers.
        All index math is 32-bit and unsigned (Numba's default int64 indexing costs ~20 SASS
        instructions per column: 64-bit multiplies, compares and wraparound checks): w4 (4 x the
        block index, its first word) of column n0 + c is one add after column c - 1's."""
        w4 = U(U(n0 * n_kb + kb) * U(4))            # Numba widens every sum to 64 bits: U() narrows
        for c in range(CB):
            i4 = min(w4, last4)
            if k == 4:
                codes[c, 0], codes[c, 1], codes[c, 2], codes[c, 3] = ldg128(packed, i4)
            else:
                codes[c, 0], codes[c, 1] = ldg64(packed, U(i4 >> U(1)))
            code_absmax[c] = absmax[U(i4 >> U(2))]
            w4 = U(w4 + U(n_kb * U(4)))

    @cuda.jit(device=True, inline="always")
    def decode_columns(smem, table, lane_off, codes, code_absmax, a, ah, acc):
        """acc[c * M + m] = this lane's block of column c (codes[c, :], absmax code_absmax[c]) dotted with
        its activations of row m: one prmt and one shared load per code byte, G * M FMAs
        (f16_acc: G // 2 * M HFMA2s), one scale per block."""
        s = cuda.local.array(M, np.float32)
        hs = cuda.local.array(M, np.uint32)
        for j in range(CM, V):
            acc[j] = np.float32(0.0)
        for c in range(CB):
            scale = smem[U(U(TABLE_FLOATS) + U(code_absmax[c]))] if e4m4 else code_absmax[c]
            for m in range(M):
                s[m] = np.float32(0.0)
                hs[m] = np.uint32(0)
            for wd in range(k):
                for t in range(4):
                    addr = table + prmt(codes[c, wd], lane_off, np.uint32(PRMT_ROW | (t << 4)))
                    e0 = (wd * 4 + t) * G            # first element of this group
                    if f16_acc and G == 2:           # one f16x2 pair, one HFMA2 per row
                        x = lds_u32(smem, addr)
                        for m in range(M):
                            hs[m] = hfma2(x, ah[m, e0 // 2], hs[m])
                    elif f16_acc:                    # a quad: two pairs
                        x0, x1 = lds64(smem, addr)
                        for m in range(M):
                            hs[m] = hfma2(x0, ah[m, e0 // 2], hs[m])
                            hs[m] = hfma2(x1, ah[m, e0 // 2 + 1], hs[m])
                    elif G == 2:
                        x0, x1 = lds64(smem, addr)
                        v0 = u32_as_f32(x0)
                        v1 = u32_as_f32(x1)
                        for m in range(M):               # separate statements: two FFMAs
                            s[m] += v0 * a[m, e0]
                            s[m] += v1 * a[m, e0 + 1]
                    else:
                        x0, x1, x2, x3 = lds128(smem, addr)
                        v0 = u32_as_f32(x0)
                        v1 = u32_as_f32(x1)
                        v2 = u32_as_f32(x2)
                        v3 = u32_as_f32(x3)
                        for m in range(M):
                            s[m] += v0 * a[m, e0]
                            s[m] += v1 * a[m, e0 + 1]
                            s[m] += v2 * a[m, e0 + 2]
                            s[m] += v3 * a[m, e0 + 3]
            for m in range(M):
                if f16_acc:                      # the block's two float16 half-sums, in float32
                    s[m] = f16_bits_to_f32(hs[m]) + f16_bits_to_f32(hs[m] >> np.uint32(16))
                acc[c * M + m] = s[m] * scale

    @cuda.jit(device=True, inline="always")
    def reduce_columns(smem, acc, lane, tid, part, flip, slices, kw, n_first, out, N):
        """Sum acc over the CTA's K-warps: a warp reduce-scatter, one partial per (warp, value) into the
        shared buffer half ``flip`` (double-buffered: one barrier per iteration), then one thread per
        (slice, column, row) adds the slice's KW partials and writes column n_first + s * CB + c."""
        r, v_idx, owner = reduce_scatter(acc, lane)
        if owner:
            smem[U(part + flip + U(v_idx))] = r
        cuda.syncthreads()
        if tid < U(slices * U(CM)):                # one thread per (slice, column, row): sum the K-warps
            s_out = U(tid // U(CM))
            v = U(tid - s_out * U(CM))
            col = U(v // U(M))
            row = U(v - col * U(M))
            n = U(n_first + s_out * U(CB) + col)
            p = U(U(PART) + flip + s_out * kw * U(V) + v)
            p_end = U(p + kw * U(V))
            total = np.float32(0.0)
            while p < p_end:
                total += smem[p]
                p = U(p + U(V))
            if n < U(N):
                out[U(row * U(N) + n)] = np.float16(total) if f16_out else total

    def pair_gemv(A, packed, absmax, cb, out, N, n_kb):
        smem = cuda.shared.array(0, np.float32)    # [group table][E4M4 table][codebook][partials]
        # Every index below is uint32 (see load_columns): Numba would make them int64.
        tid = U(cuda.threadIdx.x)
        lane = tid % U(WARP)
        warp = tid // U(WARP)
        nkb = U(n_kb)
        kw = U((nkb + U(WARP - 1)) // U(WARP))     # K-warps per slice
        slices = U(U(cuda.blockDim.x) // U(U(WARP) * kw))
        sl = U(warp // kw)
        w = U(warp - sl * kw)
        kb = U(w * U(WARP) + lane)
        active = kb < nkb
        group_cols = U(slices * U(CB))
        col0 = U(sl * U(CB))                       # the slice's first column in a group
        n_groups = U((U(N) + group_cols - U(1)) // group_cols)
        g = U(cuda.blockIdx.x)
        last4 = U(U(U(N) * nkb - U(1)) * U(4))     # 4 x the index of the weight's last block

        # ---- 1. the first columns' weight loads go out before anything else ----------------------
        # three buffers of CB columns' codes and absmax: the loads run two iterations ahead
        codes_a = cuda.local.array((CB, k), np.uint32)
        codes_b = cuda.local.array((CB, k), np.uint32)
        codes_c = cuda.local.array((CB, k), np.uint32)
        absmax_a = cuda.local.array(CB, absmax_t)
        absmax_b = cuda.local.array(CB, absmax_t)
        absmax_c = cuda.local.array(CB, absmax_t)
        grid = U(cuda.gridDim.x)
        load_columns(packed, absmax, U(g * group_cols + col0), kb, last4, nkb, codes_a, absmax_a)
        load_columns(packed, absmax, U((g + grid) * group_cols + col0), kb, last4, nkb, codes_b, absmax_b)

        # ---- 2. the group table: entry (code, copy) = G codebook values, element e from bits k*e ----
        #         (read from a shared copy of the codebook: 16384 global reads would serialise the fill).
        #         A thread writes 16 bytes a store, one chunk of a row: the chunk's 4 floats are
        #         4 // G copies of the row's G values.
        if tid < N_CODES:
            smem[CODEBOOK + tid] = cb[tid]
        cuda.syncthreads()
        table = shared_addr(smem)
        chunk = np.uint32(tid)
        while chunk < np.uint32(CODES * USED_CHUNKS):
            code = chunk // np.uint32(USED_CHUNKS)
            vals = cuda.local.array(4, np.uint32)
            for wd in range(4):                     # word wd of the chunk: word wd % WORDS_PER_ENTRY of an entry
                e = (wd % WORDS_PER_ENTRY) * (2 if f16_acc else 1)      # its (first) element
                v0 = smem[np.uint32(CODEBOOK) + ((code >> np.uint32(k * e)) & np.uint32(CODE_MASK))]
                if f16_acc:
                    v1 = smem[np.uint32(CODEBOOK) + ((code >> np.uint32(k * (e + 1))) & np.uint32(CODE_MASK))]
                    vals[wd] = f16x2_as_u32(np.float16(v0), np.float16(v1))
                else:
                    vals[wd] = f32_as_u32(v0)
            dst = code * np.uint32(ROW_BYTES) + (chunk - code * np.uint32(USED_CHUNKS)) * np.uint32(CHUNK_BYTES)
            sts128(smem, table + dst, vals[0], vals[1], vals[2], vals[3])
            chunk = np.uint32(chunk + np.uint32(cuda.blockDim.x))   # (stays 32-bit)
        i = tid
        while e4m4 and i < U(ABSMAX_CODES):          # every E4M4 byte's value: one shared load per block
            smem[U(U(TABLE_FLOATS) + i)] = e4m4_decode(np.uint8(i))
            i = U(i + U(cuda.blockDim.x))

        # ---- 3. this lane's 32 x M activations, element order, 16-byte loads ---------------------
        a = cuda.local.array((M, BLOCK), np.float32)       # (f16_acc: unused)
        ah = cuda.local.array((M, PAIRS), np.uint32)       # f16_acc: the f16x2 words as loaded
        for m in literal_unroll(ROWS):              # (once per launch: range(M) stays rolled at M = 4)
            a_base = (m * n_kb * BLOCK + kb * BLOCK) // A_PER_WORD if active else 0
            a_live = np.float32(1.0) if active else np.float32(0.0)
            for q in range(BLOCK // A_PER_WORD // 4):
                w4 = ldg128(A, a_base + 4 * q)
                for h in range(4):
                    if f16_acc:
                        ah[m, 4 * q + h] = w4[h] if active else np.uint32(0)
                    else:
                        for e in range(A_PER_WORD):
                            a[m, (4 * q + h) * A_PER_WORD + e] = word_to_f32(w4[h], e) * a_live
        lane_off = np.uint32((lane % COPIES) * ENTRY)
        cuda.syncthreads()

        part = U(U(PART) + (sl * kw + w) * U(V))     # this warp's partial sums (double-buffered: + flip)
        flip = U(0)
        FLIP = U(slices * kw * U(V))
        acc = cuda.local.array(V, np.float32)
        # ---- 4. the persistent loop, unrolled three times: a buffer is decoded while the loads of the
        #         group two iterations ahead go into the buffer decoded last. ptxas issues those loads
        #         late, after the decode (a load one iteration ahead would meet its use right after
        #         the barrier), so two iterations ahead is what keeps a whole decode between a load
        #         and its use.
        ahead = U(U(2) * grid * group_cols)
        while g < n_groups:
            load_columns(packed, absmax, U(g * group_cols + ahead + col0), kb, last4, nkb, codes_c, absmax_c)
            decode_columns(smem, table, lane_off, codes_a, absmax_a, a, ah, acc)
            reduce_columns(smem, acc, lane, tid, part, flip, slices, kw, U(g * group_cols), out, N)
            flip = U(FLIP - flip)
            g = U(g + grid)
            if g >= n_groups:
                break
            load_columns(packed, absmax, U(g * group_cols + ahead + col0), kb, last4, nkb, codes_a, absmax_a)
            decode_columns(smem, table, lane_off, codes_b, absmax_b, a, ah, acc)
            reduce_columns(smem, acc, lane, tid, part, flip, slices, kw, U(g * group_cols), out, N)
            flip = U(FLIP - flip)
            g = U(g + grid)
            if g >= n_groups:
                break
            load_columns(packed, absmax, U(g * group_cols + ahead + col0), kb, last4, nkb, codes_b, absmax_b)
            decode_columns(smem, table, lane_off, codes_c, absmax_c, a, ah, acc)
            reduce_columns(smem, acc, lane, tid, part, flip, slices, kw, U(g * group_cols), out, N)
            flip = U(FLIP - flip)
            g = U(g + grid)

    return jit_kernel(pair_gemv)


def part_bytes(M, CB, slices, kw):
    """Dynamic shared bytes after the group table: the E4M4 table, the codebook and the double-buffered
    partials [2, slices, kw, V] float32."""
    V = 1 << (CB * M - 1).bit_length()
    return 4 * (PART - TABLE_FLOATS) + 2 * slices * kw * V * 4


# ------------------------------------------------------------------------------------------------
# The layout
# ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def make_to_codes_kernel(k):
    """Kernel(planes, codes, n_blocks): one thread per block, bit planes -> k-bit fields (element order)."""
    PER_WORD = BLOCK // k

    @cuda.jit
    def to_codes_kernel(planes, codes, n_blocks):
        blk = cuda.grid(1)
        if blk >= n_blocks:
            return
        for wd in range(k):
            word = np.uint32(0)
            for f in range(PER_WORD):
                j = wd * PER_WORD + f               # element j of the block
                for b in range(k):
                    bit = (planes[blk * k + b] >> np.uint32(j)) & np.uint32(1)
                    word |= bit << np.uint32(k * f + b)
            codes[blk * k + wd] = word

    return to_codes_kernel


def to_codes(qw, stream=None):
    """KbitWeight (flat layout, k = 2 or 4) -> KbitCodes on the device: the same indices re-packed once
    from bit planes into k-bit fields (what :func:`gemv` reads). ``reference.to_codes`` is its twin,
    ``reference.from_codes`` the exact inverse."""
    if isinstance(qw, KbitCodes):
        return _device_weight(qw, _arrays.as_stream(stream))
    if not isinstance(qw, KbitWeight):
        raise TypeError(f"to_codes needs a KbitWeight, got {type(qw).__name__}")
    if qw.k not in CODES_K:
        raise ValueError(f"the code layout holds k in {CODES_K}, got k={qw.k} (use scalar_gemv.gemv)")
    if qw.layout != "flat":
        raise ValueError(f"to_codes reads the flat layout, got layout={qw.layout!r}")
    stream = _arrays.as_stream(stream)
    qw = _device_weight(qw, stream)
    n_blocks = qw.n_blocks
    codes = cuda.device_array(n_blocks * qw.k, np.uint32, stream=stream)
    tpb = 256
    make_to_codes_kernel(qw.k)[(n_blocks + tpb - 1) // tpb, tpb, stream](qw.packed, codes, np.int32(n_blocks))
    return KbitCodes(codes, qw.absmax, qw.codebook, qw.k, qw.shape, qw.absmax_format)


# ------------------------------------------------------------------------------------------------
# Launch
# ------------------------------------------------------------------------------------------------
def _kernel_limits(kern, args):
    """(registers per thread, most threads per CTA) of the kernel compiled for ``args``, as the driver
    reports them (registers decide how large a CTA can be); (0, 1024) under the simulator."""
    if SIMULATOR:
        return 0, 1024
    sig = tuple(kern.typeof_pyval(x) for x in args)
    attrs = kern.compile(sig)._codelibrary.get_cufunc().attrs
    return attrs.regs, attrs.maxthreads


def default_cb(M, N, K):
    """Columns per warp per iteration, from the H100 sweep (``benchmarks/runs/2026-11-23_h100_pair_gemv_sweep.txt``):
    2 at M = 1 on weights under 2**24 elements (9-12% faster there), else 4 (up to 16% faster at M = 4
    and on 4096 x 14336)."""
    return 2 if M == 1 and N * K < SMALL_WEIGHT else DEFAULT_CB


def plan(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, CB=None, cta_warps=None, f16_acc=False):
    """Checked inputs and the launch: (PreparedLaunch, device A, out). ``kc``: KbitCodes (a KbitWeight
    is re-packed with :func:`to_codes`, a copy per call: keep the KbitCodes for repeated use).
    CB (default :func:`default_cb`) and cta_warps (warps per CTA aimed at) are tuning knobs
    (``benchmarks/sweep_pair_gemv.py``); f16_acc: see :func:`make_pair_gemv_kernel` (float16 A only)."""
    stream = _arrays.as_stream(stream)
    kc = to_codes(kc, stream)                              # checked device arrays (re-packed if a KbitWeight)
    N, K = kc.shape
    Ad, a_src, M, out = _arrays.gemv_io(A, kc.shape, out, out_dtype, bf16, stream, "pair gemv", MAX_M)
    CB = default_cb(M, N, K) if CB is None else CB
    if CB not in (1, 2, 4, 8):
        raise ValueError(f"CB must be 1, 2, 4 or 8, got {CB}")
    n_kb = K // BLOCK
    kw = -(-n_kb // WARP)
    if kw > MAX_KW:
        raise ValueError(f"pair gemv handles K <= {MAX_KW * WARP * BLOCK}, got K={K}")
    _arrays.check_aligned(Ad, 16, "A")
    kern = make_pair_gemv_kernel(kc.k, M, CB, kc.absmax_format, a_src, out.dtype.name, bool(f16_acc))
    args = (_arrays.flat_view(Ad, np.uint32), kc.packed, kc.absmax, kc.codebook, _arrays.flat_view(out),
            np.int32(N), np.int32(n_kb))
    regs, max_threads = _kernel_limits(kern, args)
    if kw * WARP > max_threads:
        raise ValueError(f"pair gemv with M={M}, CB={CB} fits {max_threads} threads per CTA: K <= "
                         f"{max_threads * BLOCK}, got K={K} (use a smaller CB)")
    n_sm = sm_count()
    slices = max(1, min((cta_warps or CTA_WARPS) // kw, max_threads // (kw * WARP)))
    slices = min(slices, -(-N // CB))                      # no slice without a column
    n_groups = -(-N // (slices * CB))
    shared = TABLE_BYTES + part_bytes(M, CB, slices, kw)
    regs_alloc = max(8, -(-regs // 8) * 8)                 # registers are allocated in units of 8
    per_sm = max(1, min(REGISTERS_PER_SM // (slices * kw * WARP * regs_alloc),
                        (228 * 1024) // (shared + 1024)))
    grid = min(n_groups, n_sm * per_sm)
    return PreparedLaunch(kern, grid, slices * kw * WARP, args, stream, shared), Ad, out


def gemv(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, f16_acc=False):
    """C[M, N] = A[M, K] @ W^T for M = 1..4 with W a KbitCodes (k = 2 or 4; see :func:`to_codes`).

    A: float16/float32 [M, K] or [K] (bfloat16 as int16 bits with ``bf16=True``); returns a device array
    [M, N] (or [N]) of ``out_dtype`` (float16 or float32), or writes into ``out``. ``f16_acc=True``
    (float16 A): each 32-weight block is summed in float16 by f16x2 FMAs, blocks in float32."""
    launch, _, out = plan(A, kc, out, stream, out_dtype, bf16, f16_acc=f16_acc)
    launch()
    return out


class PreparedPairGemv:
    """A pair gemv bound to its buffers and stream: each ``run()`` is one driver launch. Write the next
    activations into ``prepared.A`` before ``run()``; results land in ``prepared.out``."""

    def __init__(self, A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, f16_acc=False):
        if isinstance(A, np.ndarray):
            raise TypeError("prepare binds buffers by address: pass A as a device array")
        self._launch, self.A, self.out = plan(A, kc, out, stream, out_dtype, bf16, f16_acc=f16_acc)

    def run(self, stream=None):
        self._launch(None if stream is None else _arrays.as_stream(stream))
        return self.out


def prepare(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, f16_acc=False):
    """The fast path for repeated calls: see :class:`PreparedPairGemv`."""
    return PreparedPairGemv(A, kc, out, stream, out_dtype, bf16, f16_acc)


def kernel_specializations():
    """(name, kernel, argument types) for the PTX checks: every (k, M) at the default CB, and each other
    value of CB, absmax format, A type and output type with every k."""
    from numba import types as t
    nb = {"float16": t.float16[::1], "float32": t.float32[::1]}
    base = dict(M=1, CB=DEFAULT_CB, fmt="e4m4", a_src="float16", od="float16", f16=False)
    variants = [dict(M=M) for M in (1, 2, 3, 4)] + [dict(M=M, f16=True) for M in (1, 4)]
    variants += [dict(M=2, CB=cb) for cb in (1, 2, 8)]
    variants += [dict(fmt="fp32", M=3), dict(a_src="float32", M=2), dict(a_src="bfloat16"), dict(od="float32")]
    specs = []
    for k in CODES_K:
        for v in variants:
            c = dict(base, **v)
            am = t.uint8[::1] if c["fmt"] == "e4m4" else t.float32[::1]
            name = (f"pair_gemv k={k} M={c['M']} CB={c['CB']} {c['fmt']} A={c['a_src']} out={c['od']}"
                    + (" f16_acc" if c["f16"] else ""))
            kern = make_pair_gemv_kernel(k, c["M"], c["CB"], c["fmt"], c["a_src"], c["od"], c["f16"])
            specs.append((name, kern, (t.uint32[::1], t.uint32[::1], am, t.float32[::1], nb[c["od"]],
                                       t.int32, t.int32)))
        specs.append((f"to_codes k={k}", make_to_codes_kernel(k), (t.uint32[::1], t.uint32[::1], t.int32)))
    return specs
