"""Prototype (not in the package; benchmarks/README.md, "Thirty-fourth session"): a tensor-core gemv for M = 1 whose
n8 operand holds the 8 blocks of a warp's K tile on its diagonal.

B[kslot, n] = the activations of block n (n = 0..7 of the warp's 256-wide K tile) and 0 elsewhere, so the MMA puts
block n's partial dot product of each of the strip's 16 columns into C column n: the block's absmax then scales C
(a few FFMAs a lane and strip) instead of every decoded pair (one HMUL2 per pair in mma_gemv). Lane (g, t) holds, of
each block j of rows g and g + 8, the elements 8t .. 8t + 7 (k = 2: bytes 2t, 2t + 1; k = 4: word t of the block).
The weights are re-laid on the host (``to_diag``: the "diag layout") so that a lane's words for a strip are
contiguous (k = 4: 4, k = 2: 2 sixteen-byte loads) and its 4 absmax bytes one word. Knobs (environment):
DIAG_K2 = lds64 (8-byte lookups, moved into the MMA's register order; default) | lds32 | lds32x32 (4-byte lookups,
16 or 32 table copies); DIAG_CHAINS = independent accumulators of a strip's 16 MMAs; DIAG_SPI = strips a slice an iteration (one barrier);
DIAG_MODE = a (weights in A, the runs) | b (weights in B, built, not run); DIAG_HINT = load cache hint.
Run from the repository root (it was scratch/diag_proto.py):

    python benchmarks/runs/2026-11-27_diag_mma_gemv_prototype_attempt.py [K x N list] [k list]

It checks each shape against the reference, then times the pair gemv (f16_acc), the prototype and the read floor in
one process (CUDA graphs, rotating L2-cold weights).
"""
import sys

import numpy as np
from numba import cuda

from kbit_numba import bench, pair_gemv, reference as ref
from kbit_numba._timing import graph_time_us, rotation_count
from kbit_numba.core import kernel_limits, persistent_grid
from kbit_numba.launch import PreparedLaunch, Step, launch_step
from kbit_numba.device import (CODEBOOK, PRMT_ROW, TABLE_BYTES, TABLE_FLOATS, WARP, e4m4_decode, jit_kernel,
                               make_table_fill, u32)
from kbit_numba.intrinsics import f16x2_as_u32, sts128, ldg128, ldg128_stream, lds64, lds_u32, mma_f16, prmt, shared_addr

STRIP, KB_WARP = 16, 8
PART = CODEBOOK + 16

from llvmlite import ir as llir
from numba.core import types as nty
from numba.extending import intrinsic
from kbit_numba.intrinsics import _element_ptr


import os
HINT = os.environ.get("DIAG_HINT", "")


@cuda.jit(device=True, inline="always")
def f16_bits(x):
    return f16x2_as_u32(x, np.float16(0.0)) & u32(0xFFFF)


def _make_ld(ptx_type, arr_dtypes):
    text = f"ld.global.nc{HINT}.{ptx_type} $0, [$1];"

    @intrinsic
    def ld(typingctx, arr, base, off):
        """arr[base + off] (off an integer literal: an immediate offset from one address a base)."""
        sig = nty.uint32(arr, base, off)

        def codegen(context, builder, sig, args):
            p = _element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            p = builder.gep(p, [context.cast(builder, args[2], sig.args[2], nty.intp)])
            fty = llir.FunctionType(llir.IntType(32), [p.type])
            return builder.call(llir.InlineAsm(fty, text, "=r,l"), [p])
        return sig, codegen
    return ld


ldg32_at = _make_ld("u32", None)
ldg8_at = _make_ld("u8", None)


K2_MODE = os.environ.get("DIAG_K2", "lds64")       # lds32 (16 copies), lds32x32 (32 copies), lds64
CHAINS = int(os.environ.get("DIAG_CHAINS", "1"))    # independent accumulators of a strip's 16 MMAs
SPI = int(os.environ.get("DIAG_SPI", "1"))          # strips of 16 columns a slice takes an iteration (one barrier)


def make_diag_kernel(k):
    fill_table, ENTRY, COPIES = make_table_fill(k, "float16")
    if k == 2 and K2_MODE == "lds32x32":
        COPIES = 32                                  # 32 copies of the 8-byte quad fill the 256-byte row

        @cuda.jit(device=True, inline="always")
        def fill_table(smem, cb, tid):
            table = shared_addr(smem)
            i = tid
            while i < u32(4096):                     # 16-byte chunk i: row i // 16, copies 2 (i % 16), + 1
                code = u32(i >> u32(4))
                h = cuda.local.array(4, np.uint32)
                for e in range(4):
                    h[e] = u32(f16_bits(np.float16(cb[(code >> u32(2 * e)) & u32(3)])))
                w0 = u32(h[0] | (h[1] << u32(16)))
                w1 = u32(h[2] | (h[3] << u32(16)))
                sts128(smem, u32(table + u32(16) * i), w0, w1, w0, w1)
                i = u32(i + u32(cuda.blockDim.x))
            cuda.syncthreads()
    W = 16 if k == 4 else 8                     # code words a lane reads a strip (diag layout)
    SCOLS = STRIP * SPI                         # columns a slice takes an iteration
    WS, V2 = W * SPI, 2 * SPI                   # (local array sizes: constants)

    ir = cuda.jit(device=True, inline="always")

    @ir
    def load_strip(packed, absmax, strip, w, lane, last_strip, n_tiles, codes, am):
        """The diag layout: lane l of K-warp w reads W contiguous words of (strip, tile w) and one absmax word, for
        each of the SPI strips strip * SPI + i."""
        for i in range(SPI):
            st = min(u32(strip * u32(SPI) + u32(i)), last_strip)
            slot = u32(u32(u32(st * n_tiles + w) * u32(WARP)) + lane)
            for q in range(W // 4):
                (codes[i * W + 4 * q], codes[i * W + 4 * q + 1], codes[i * W + 4 * q + 2],
                 codes[i * W + 4 * q + 3]) = ldg128_stream(packed, u32(u32(slot * u32(W)) + u32(4 * q)))
            am[i] = ldg32_at(absmax, slot, 0)

    @ir
    def decode_strip(smem, table, lane_off, codes, am, bx, v, i):
        acc = cuda.local.array((CHAINS, 4), np.float32)    # independent MMA chains (DIAG_CHAINS), summed at the end
        for q in range(CHAINS):
            for e in range(4):
                acc[q, e] = np.float32(0.0)
        for j in range(KB_WARP):
            for h in range(2):
                if k == 2 and K2_MODE == "lds64":
                    sel = u32(PRMT_ROW | ((2 * (j % 2) + h) << 4))
                    x0, x2 = lds64(smem, table + prmt(codes[i * W + j // 2], lane_off, sel))
                    x1, x3 = lds64(smem, table + prmt(codes[i * W + 4 + j // 2], lane_off, sel))
                elif k == 2:    # word (c, j // 2): blocks j & ~1 (bytes 0, 1) and j | 1 (bytes 2, 3); byte h of the block
                    sel = u32(PRMT_ROW | ((2 * (j % 2) + h) << 4))
                    r0 = table + prmt(codes[i * W + j // 2], lane_off, sel)
                    r1 = table + prmt(codes[i * W + 4 + j // 2], lane_off, sel)
                    x0 = lds_u32(smem, r0)
                    x2 = lds_u32(smem, u32(r0 + u32(4)))
                    x1 = lds_u32(smem, r1)
                    x3 = lds_u32(smem, u32(r1 + u32(4)))
                else:
                    s0 = u32(PRMT_ROW | ((2 * h) << 4))
                    s1 = u32(PRMT_ROW | ((2 * h + 1) << 4))
                    x0 = lds_u32(smem, table + prmt(codes[i * W + j], lane_off, s0))
                    x2 = lds_u32(smem, table + prmt(codes[i * W + j], lane_off, s1))
                    x1 = lds_u32(smem, table + prmt(codes[i * W + 8 + j], lane_off, s0))
                    x3 = lds_u32(smem, table + prmt(codes[i * W + 8 + j], lane_off, s1))
                q = (2 * j + h) % CHAINS
                acc[q, 0], acc[q, 1], acc[q, 2], acc[q, 3] = mma_f16(x0, x1, x2, x3, bx[j, h, 0], bx[j, h, 1],
                                                                     acc[q, 0], acc[q, 1], acc[q, 2], acc[q, 3])
        for q in range(1, CHAINS):
            for e in range(4):
                acc[0, e] += acc[q, e]
        c0, c1, c2, c3 = acc[0, 0], acc[0, 1], acc[0, 2], acc[0, 3]
        # C[g, 2t], C[g, 2t + 1], C[g + 8, 2t], C[g + 8, 2t + 1]: blocks 2t, 2t + 1 of rows g, g + 8
        a = am[i]
        r0 = (c0 * smem[u32(TABLE_FLOATS + (a & u32(0xFF)))]
              + c1 * smem[u32(TABLE_FLOATS + ((a >> u32(8)) & u32(0xFF)))])
        r1 = (c2 * smem[u32(TABLE_FLOATS + ((a >> u32(16)) & u32(0xFF)))]
              + c3 * smem[u32(TABLE_FLOATS + (a >> u32(24)))])
        r0 += cuda.shfl_xor_sync(0xFFFFFFFF, r0, 1)
        r1 += cuda.shfl_xor_sync(0xFFFFFFFF, r1, 1)
        r0 += cuda.shfl_xor_sync(0xFFFFFFFF, r0, 2)
        r1 += cuda.shfl_xor_sync(0xFFFFFFFF, r1, 2)
        v[2 * i] = r0
        v[2 * i + 1] = r1

    @ir
    def end_strip(smem, v, g, t, tid, part, flip, grp, slices, kw, out, N):
        if t == u32(0):
            for i in range(SPI):
                smem[u32(part + flip + u32(STRIP * i) + g)] = v[2 * i]
                smem[u32(part + flip + u32(STRIP * i) + g + u32(8))] = v[2 * i + 1]
        cuda.syncthreads()
        if tid < u32(slices * u32(SCOLS)):
            s_ = u32(tid // u32(SCOLS))
            col = u32(tid - s_ * u32(SCOLS))
            p = u32(u32(PART) + flip + s_ * kw * u32(SCOLS) + col)
            p_end = u32(p + kw * u32(SCOLS))
            total = np.float32(0.0)
            while p < p_end:
                total += smem[p]
                p = u32(p + u32(SCOLS))
            n = u32(u32(grp * slices + s_) * u32(SCOLS) + col)
            if n < u32(N):
                out[n] = np.float16(total)

    @ir
    def decode_strip_all(smem, table, lane_off, codes, am, bx, v):
        for i in range(SPI):
            decode_strip(smem, table, lane_off, codes, am, bx, v, i)

    def diag_gemv(A, packed, absmax, cb, out, N, n_kb):
        smem = cuda.shared.array(0, np.float32)
        tid = u32(cuda.threadIdx.x)
        lane = tid % u32(WARP)
        warp = tid // u32(WARP)
        g = lane >> u32(2)
        t = lane & u32(3)
        nkb = u32(n_kb)
        kw = u32(nkb // u32(KB_WARP))
        slices = u32(u32(cuda.blockDim.x) // u32(u32(WARP) * kw))
        sl = u32(warp // kw)
        w = u32(warp - sl * kw)
        kb0 = u32(w * u32(KB_WARP))
        group_cols = u32(slices * u32(SCOLS))
        n_groups = u32((u32(N) + group_cols - u32(1)) // group_cols)
        grp = u32(cuda.blockIdx.x)
        grid = u32(cuda.gridDim.x)
        codes_a = cuda.local.array(WS, np.uint32)
        codes_b = cuda.local.array(WS, np.uint32)
        codes_c = cuda.local.array(WS, np.uint32)
        am_a = cuda.local.array(SPI, np.uint32)
        am_b = cuda.local.array(SPI, np.uint32)
        am_c = cuda.local.array(SPI, np.uint32)
        n_tiles = kw
        last_strip = u32(u32(N) // u32(STRIP) - u32(1))
        load_strip(packed, absmax, u32(grp * slices + sl), w, lane, last_strip, n_tiles, codes_a, am_a)
        load_strip(packed, absmax, u32((grp + grid) * slices + sl), w, lane, last_strip, n_tiles, codes_b, am_b)
        fill_table(smem, cb, tid)
        i = tid
        while i < u32(256):
            smem[u32(TABLE_FLOATS + i)] = e4m4_decode(np.uint8(i))
            i = u32(i + u32(cuda.blockDim.x))
        table = shared_addr(smem)
        # B: block g of the warp's tile, elements 8t .. 8t + 7, on the diagonal (column g of the MMAs of block g)
        w4 = ldg128(A, u32(u32(u32(kb0 + g) * u32(16)) + u32(4) * t))
        bx = cuda.local.array((KB_WARP, 2, 2), np.uint32)
        for j in range(KB_WARP):
            for h in range(2):
                for e in range(2):
                    bx[j, h, e] = w4[2 * h + e] if g == u32(j) else u32(0)
        sel = cuda.local.array(2, np.uint32)
        for h in range(2):
            sel[h] = u32(u32(PRMT_ROW) | u32(u32(u32(2) * (t & u32(1)) + u32(h)) << u32(4)))
        lane_off = u32((lane % u32(COPIES)) * u32(ENTRY))
        cuda.syncthreads()
        part = u32(u32(PART) + (sl * kw + w) * u32(SCOLS))
        flip = u32(0)
        FLIP = u32(slices * kw * u32(SCOLS))
        v = cuda.local.array(V2, np.float32)
        while grp < n_groups:
            load_strip(packed, absmax, u32(u32(grp + u32(2) * grid) * slices + sl), w, lane, last_strip, n_tiles, codes_c, am_c)
            decode_strip_all(smem, table, lane_off, codes_a, am_a, bx, v)
            end_strip(smem, v, g, t, tid, part, flip, grp, slices, kw, out, N)
            flip = u32(FLIP - flip)
            grp = u32(grp + grid)
            if grp >= n_groups:
                break
            load_strip(packed, absmax, u32(u32(grp + u32(2) * grid) * slices + sl), w, lane, last_strip, n_tiles, codes_a, am_a)
            decode_strip_all(smem, table, lane_off, codes_b, am_b, bx, v)
            end_strip(smem, v, g, t, tid, part, flip, grp, slices, kw, out, N)
            flip = u32(FLIP - flip)
            grp = u32(grp + grid)
            if grp >= n_groups:
                break
            load_strip(packed, absmax, u32(u32(grp + u32(2) * grid) * slices + sl), w, lane, last_strip, n_tiles, codes_b, am_b)
            decode_strip_all(smem, table, lane_off, codes_c, am_c, bx, v)
            end_strip(smem, v, g, t, tid, part, flip, grp, slices, kw, out, N)
            flip = u32(FLIP - flip)
            grp = u32(grp + grid)

    return jit_kernel(diag_gemv)


# ---- the other orientation: weights in the B operand (8 columns), the blocks' activations on A's diagonal ---------
MODE = os.environ.get("DIAG_MODE", "a")          # "a": weights in A (16 columns a strip); "b": weights in B (8)
BSTRIP = 8


def make_bdiag_kernel(k):
    """Weights as the MMA's B operand: lane (g, t) holds column g of an 8-column strip, elements 8t .. 8t + 7 of each
    of the warp's 8 blocks: one 8-byte lookup (k = 2) or two 4-byte ones (k = 4) fill b0, b1 in the MMA's order.
    A[m, kslot] = block m's activations for the MMA of block m, else 0 (rows 8..15 unused): C[m = block, n = column]."""
    fill_table, ENTRY, COPIES = make_table_fill(k, "float16")
    W = 8 if k == 4 else 4                      # code words a lane reads a strip (one column, 8 blocks)
    ir = cuda.jit(device=True, inline="always")

    @ir
    def load_strip(packed, absmax, strip, w, lane, last_strip, n_tiles, codes, am):
        st = min(strip, last_strip)
        slot = u32(u32(u32(st * n_tiles + w) * u32(WARP)) + lane)
        for q in range(W // 4):
            codes[4 * q], codes[4 * q + 1], codes[4 * q + 2], codes[4 * q + 3] = ldg128_stream(
                packed, u32(u32(slot * u32(W)) + u32(4 * q)))
        am[0] = ldg32_at(absmax, slot, 0)

    @ir
    def decode_strip(smem, table, lane_off, codes, am, ax, v):
        c0 = np.float32(0.0)
        c1 = np.float32(0.0)
        c2 = np.float32(0.0)
        c3 = np.float32(0.0)
        zero = u32(0)
        for j in range(KB_WARP):
            for h in range(2):
                if k == 2:      # word j // 2: blocks 2m (bytes 0, 1), 2m + 1 (bytes 2, 3); byte h of the block
                    sel = u32(PRMT_ROW | ((2 * (j % 2) + h) << 4))
                    b0, b1 = lds64(smem, table + prmt(codes[j // 2], lane_off, sel))
                else:
                    b0 = lds_u32(smem, table + prmt(codes[j], lane_off, u32(PRMT_ROW | ((2 * h) << 4))))
                    b1 = lds_u32(smem, table + prmt(codes[j], lane_off, u32(PRMT_ROW | ((2 * h + 1) << 4))))
                c0, c1, c2, c3 = mma_f16(ax[j, h, 0], zero, ax[j, h, 1], zero, b0, b1, c0, c1, c2, c3)
        a = am[0]           # columns 2t, 2t + 1 of block g
        r0 = c0 * smem[u32(TABLE_FLOATS + (a & u32(0xFF)))]
        r1 = c1 * smem[u32(TABLE_FLOATS + ((a >> u32(8)) & u32(0xFF)))]
        for x in (4, 8, 16):                    # over the 8 blocks (lanes g)
            r0 += cuda.shfl_xor_sync(0xFFFFFFFF, r0, x)
            r1 += cuda.shfl_xor_sync(0xFFFFFFFF, r1, x)
        v[0] = r0
        v[1] = r1

    @ir
    def end_strip(smem, v, g, t, tid, part, flip, grp, slices, kw, out, N):
        if g == u32(0):
            smem[u32(part + flip + u32(2) * t)] = v[0]
            smem[u32(part + flip + u32(2) * t + u32(1))] = v[1]
        cuda.syncthreads()
        if tid < u32(slices * u32(BSTRIP)):
            s_ = u32(tid // u32(BSTRIP))
            col = u32(tid - s_ * u32(BSTRIP))
            p = u32(u32(PART) + flip + s_ * kw * u32(BSTRIP) + col)
            p_end = u32(p + kw * u32(BSTRIP))
            total = np.float32(0.0)
            while p < p_end:
                total += smem[p]
                p = u32(p + u32(BSTRIP))
            n = u32(u32(grp * slices + s_) * u32(BSTRIP) + col)
            if n < u32(N):
                out[n] = np.float16(total)

    def bdiag_gemv(A, packed, absmax, cb, out, N, n_kb):
        smem = cuda.shared.array(0, np.float32)
        tid = u32(cuda.threadIdx.x)
        lane = tid % u32(WARP)
        warp = tid // u32(WARP)
        g = lane >> u32(2)
        t = lane & u32(3)
        nkb = u32(n_kb)
        kw = u32(nkb // u32(KB_WARP))
        slices = u32(u32(cuda.blockDim.x) // u32(u32(WARP) * kw))
        sl = u32(warp // kw)
        w = u32(warp - sl * kw)
        kb0 = u32(w * u32(KB_WARP))
        n_groups = u32((u32(N) + slices * u32(BSTRIP) - u32(1)) // (slices * u32(BSTRIP)))
        grp = u32(cuda.blockIdx.x)
        grid = u32(cuda.gridDim.x)
        codes_a = cuda.local.array(W, np.uint32)
        codes_b = cuda.local.array(W, np.uint32)
        codes_c = cuda.local.array(W, np.uint32)
        am_a = cuda.local.array(1, np.uint32)
        am_b = cuda.local.array(1, np.uint32)
        am_c = cuda.local.array(1, np.uint32)
        last_strip = u32(u32(N) // u32(BSTRIP) - u32(1))
        load_strip(packed, absmax, u32(grp * slices + sl), w, lane, last_strip, kw, codes_a, am_a)
        load_strip(packed, absmax, u32((grp + grid) * slices + sl), w, lane, last_strip, kw, codes_b, am_b)
        fill_table(smem, cb, tid)
        i = tid
        while i < u32(256):
            smem[u32(TABLE_FLOATS + i)] = e4m4_decode(np.uint8(i))
            i = u32(i + u32(cuda.blockDim.x))
        table = shared_addr(smem)
        w4 = ldg128(A, u32(u32(u32(kb0 + g) * u32(16)) + u32(4) * t))   # block g's elements 8t .. 8t + 7
        ax = cuda.local.array((KB_WARP, 2, 2), np.uint32)
        for j in range(KB_WARP):
            for h in range(2):
                for e in range(2):
                    ax[j, h, e] = w4[2 * h + e] if g == u32(j) else u32(0)
        lane_off = u32((lane % u32(COPIES)) * u32(ENTRY))
        cuda.syncthreads()
        part = u32(u32(PART) + (sl * kw + w) * u32(BSTRIP))
        flip = u32(0)
        FLIP = u32(slices * kw * u32(BSTRIP))
        v = cuda.local.array(2, np.float32)
        while grp < n_groups:
            load_strip(packed, absmax, u32(u32(grp + u32(2) * grid) * slices + sl), w, lane, last_strip, kw, codes_c,
                       am_c)
            decode_strip(smem, table, lane_off, codes_a, am_a, ax, v)
            end_strip(smem, v, g, t, tid, part, flip, grp, slices, kw, out, N)
            flip = u32(FLIP - flip)
            grp = u32(grp + grid)
            if grp >= n_groups:
                break
            load_strip(packed, absmax, u32(u32(grp + u32(2) * grid) * slices + sl), w, lane, last_strip, kw, codes_a,
                       am_a)
            decode_strip(smem, table, lane_off, codes_b, am_b, ax, v)
            end_strip(smem, v, g, t, tid, part, flip, grp, slices, kw, out, N)
            flip = u32(FLIP - flip)
            grp = u32(grp + grid)
            if grp >= n_groups:
                break
            load_strip(packed, absmax, u32(u32(grp + u32(2) * grid) * slices + sl), w, lane, last_strip, kw, codes_b,
                       am_b)
            decode_strip(smem, table, lane_off, codes_c, am_c, ax, v)
            end_strip(smem, v, g, t, tid, part, flip, grp, slices, kw, out, N)
            flip = u32(FLIP - flip)
            grp = u32(grp + grid)

    return jit_kernel(bdiag_gemv)


def to_bdiag(kc_host, k):
    """(packed words, absmax words) of the B-orientation layout: [strip of 8 columns][tile][g][t] lanes, each one
    column's (g) 8 blocks, elements 8t .. 8t + 7 (k = 4: word t of each block; k = 2: half t % 2 of word t // 2, two
    blocks a word); absmax word: bytes (column 2t, block g), (column 2t + 1, block g)."""
    N, K = kc_host.shape
    n_kb = K // 32
    T = n_kb // KB_WARP
    codes = np.asarray(kc_host.packed).reshape(N // BSTRIP, 8, T, KB_WARP, k)        # [s, g, tile, j, word]
    if k == 4:
        d = codes.transpose(0, 2, 1, 4, 3)                          # [s, tile, g, t, j]
    else:
        halves = np.stack([codes & 0xFFFF, codes >> 16], axis=-1).reshape(N // BSTRIP, 8, T, KB_WARP, 4)
        h = halves.transpose(0, 2, 1, 4, 3)                          # [s, tile, g, t, j]
        d = h[..., 0::2] | (h[..., 1::2] << 16)
    packed = np.ascontiguousarray(d, dtype=np.uint32).reshape(-1)
    ab = np.asarray(kc_host.absmax).reshape(N // BSTRIP, 8, T, KB_WARP).astype(np.uint32)   # [s, col, tile, blk]
    ab = ab.transpose(0, 2, 3, 1)                                    # [s, tile, blk (= lane g), col]
    lo, hi = ab[..., 0::2], ab[..., 1::2]                            # columns 2t, 2t + 1: [s, tile, g, t]
    words = lo | (hi << 8)
    return packed, np.ascontiguousarray(words, dtype=np.uint32).reshape(-1)


def argtypes():
    from numba import types as ty
    return (ty.uint32[::1], ty.uint32[::1], ty.uint32[::1], ty.float32[::1], ty.float16[::1], ty.int32, ty.int32)


def to_diag(kc_host, k):
    """(packed words, absmax words) of the diag layout from a host KbitCodes (N a multiple of 16, K of 256)."""
    N, K = kc_host.shape
    n_kb = K // 32
    T = n_kb // KB_WARP
    codes = np.asarray(kc_host.packed).reshape(N // STRIP, 2, 8, T, KB_WARP, k)      # [s, c, g, tile, j, word]
    if k == 4:
        d = codes.transpose(0, 3, 2, 5, 1, 4)                       # [s, tile, g, t(word), c, j]: lane (g, t), 16 words
    else:
        halves = np.stack([codes & 0xFFFF, codes >> 16], axis=-1)   # [s, c, g, tile, j, word, half]
        halves = halves.reshape(N // STRIP, 2, 8, T, KB_WARP, 4)     # [..., j, t]: t = 2 word + half
        h = halves.transpose(0, 3, 2, 5, 1, 4)                       # [s, tile, g, t, c, j]
        d = h[..., 0::2] | (h[..., 1::2] << 16)                       # word m: blocks 2m, 2m + 1
    packed = np.ascontiguousarray(d, dtype=np.uint32).reshape(-1)
    ab = np.asarray(kc_host.absmax).reshape(N // STRIP, 2, 8, T, 4, 2)   # [s, c, g, tile, t, block 2t + e]
    ab = ab.transpose(0, 3, 2, 4, 1, 5).reshape(N // STRIP, T, 8, 4, 4).astype(np.uint32)  # [s, tile, g, t, c e]
    words = ab[..., 0] | (ab[..., 1] << 8) | (ab[..., 2] << 16) | (ab[..., 3] << 24)
    return packed, np.ascontiguousarray(words, dtype=np.uint32).reshape(-1)


def launch_args(A, kc, out, cta_warps=16):
    N, K = kc.shape
    n_kb = K // 32
    kw = n_kb // KB_WARP
    slices = max(1, cta_warps // kw)
    threads = slices * kw * WARP
    strip = BSTRIP if MODE == "b" else STRIP * SPI
    shared = TABLE_BYTES + 4 * (PART - TABLE_FLOATS) + 2 * slices * kw * strip * 4
    groups = -(-N // (slices * strip))
    return threads, shared, groups


class _Host:
    def __init__(self, kc):
        self.packed, self.absmax, self.shape = kc.packed.copy_to_host(), kc.absmax.copy_to_host(), kc.shape


def diag_device(kc, k):
    p, a = (to_bdiag if MODE == "b" else to_diag)(_Host(kc), k)
    return cuda.to_device(p), cuda.to_device(a)


def main(argv):
    shapes = bench._parse_shapes(argv[0] if argv else "4096x14336,4096x4096,2048x5120,4096x6144,4096x28672")
    ks = [int(v) for v in (argv[1] if len(argv) > 1 else "2,4").split(",")]
    rng = np.random.default_rng(1)
    for K, N in shapes:
        for k in ks:
            kern = make_bdiag_kernel(k) if MODE == "b" else make_diag_kernel(k)
            # correctness first, against the reference
            qw = ref.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float32), k=k)
            kc = pair_gemv.to_codes(qw)
            A = rng.standard_normal((1, K)).astype(np.float16)
            Ad = cuda.to_device(A.reshape(-1).view(np.uint32))
            out = cuda.device_array(N, np.float16)
            threads, shared, groups = launch_args(A, kc, out)
            grid = min(groups, 132)
            dp_, da_ = diag_device(kc, k)
            launch_step(Step(kern, grid, threads, (Ad, dp_, da_, kc.codebook, out, np.int32(N),
                                                   np.int32(K // 32)), shared))
            got = out.copy_to_host().astype(np.float64)
            want = ref.gemv(A, qw)[0].astype(np.float64)
            scale = np.abs(A.astype(np.float64)) @ np.abs(ref.dequantize(qw).astype(np.float64)).T
            err = np.max(np.abs(got - want) / (scale[0] + 1e-30))
            # timing: rotating copies, the pair gemv (f16_acc, its default plan) and the floor in the same run
            nbytes = N * K // 32 * (4 * k + 1)
            n = rotation_count(nbytes)
            kcs = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, k, n, rng)]
            A16 = cuda.to_device(rng.standard_normal((1, K)).astype(np.float16))
            Aw = A16.reshape(-1).view(np.uint32)
            outs = cuda.device_array((1, N), np.float16)
            o1 = outs.reshape(-1)
            pair_runs = [pair_gemv.plan(A16, w, outs, 0, f16_acc=True).prepare().run for w in kcs]
            t_pair = graph_time_us(lambda i, s: pair_runs[i % n](s), n * max(1, 64 // n))

            diags = [diag_device(w, k) for w in kcs]

            def make_runs(cta):
                args0 = (Aw, diags[0][0], diags[0][1], kcs[0].codebook, o1, np.int32(N), np.int32(K // 32))
                regs, most = kernel_limits(kern, args0)
                th, sh, gr = launch_args(None, kcs[0], None, cta)
                if th > most:
                    return None, regs
                grid_ = persistent_grid(gr, th, regs, sh)
                runs = [PreparedLaunch(kern, grid_, th, (Aw, d[0], d[1], w.codebook, o1, np.int32(N),
                                                         np.int32(K // 32)), 0, sh) for w, d in zip(kcs, diags)]
                return [lambda s, r=r: r(s) for r in runs], regs
            res = []
            for cta in (8, 16, 32):
                runs, regs = make_runs(cta)
                res.append(None if runs is None else graph_time_us(lambda i, s: runs[i % n](s), n * max(1, 64 // n)))
            fmt = lambda x: "-" if x is None else f"{x:.2f}"
            floor = bench.floor_us(nbytes + K * 2 + N * 2)
            print(f"{K}x{N} k={k}: max err/sum|aw| {err:.2e}; pair gemv f16 {t_pair:.2f} us; diag ({regs} registers) "
                  f"8 / 16 / 32 warps a CTA {' / '.join(map(fmt, res))} us; floor {floor:.2f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
