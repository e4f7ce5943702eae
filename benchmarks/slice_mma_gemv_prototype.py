"""Prototype, not in the package: the tensor-core gemv with its B fragments read from shared memory, so that a warp
walks several K tiles of a strip and a *slice* of K-warps is small (as the pair gemv's), meeting at its own named
barrier instead of the whole CTA's.

    python benchmarks/slice_mma_gemv_prototype.py [K x N list] [M list] [KS list]

Why (benchmarks/README.md, "Forty-first session"): on the fragment layout the tensor-core gemv at M = 1 is 13-23%
slower than the pair gemv with float16 sums on the code layout (H200), so one fragment-layout copy cannot serve a
decode at B = 1, though it is 8-11% faster at B = 4..16. Their decode cores are alike (prmt + lds + one f16x2 op a
pair); what differs is the geometry. ``mma_gemv`` keeps token g's activations of the lane's two blocks in 32 registers
for the whole launch, so a warp owns one 256-k tile and a CTA holds all K / 256 warps (16 at K = 4096), which meet at
CTA-wide barriers to sum their partial tiles (13-18% of its stall samples are `barrier`, against 6-8% in the pair
gemv, whose 4-warp slices use named barriers). Here the activations are staged once a CTA into shared memory in the
order the B fragments want them, and each MMA pair's B fragments come from one ``ldmatrix.x4`` (0.0625 shared loads a
weight on top of the table's 0.5): a warp walks K / 256 / KS tiles of a strip, a slice is KS warps, the CTA
S = 16 / KS slices, and the MMAs accumulate across a warp's tiles in registers.

Scope: k = 4, the fragment layout (``mma_gemv.to_fragments``), float16 activations and output, E4M4 absmax, M = 1..8
(tokens past M read a zero row), (M + 1) * 2K bytes of activations in shared memory (K = 14336: M <= 2), the K tiles
a multiple of KS; no PDL, no split. Checked against ``mma_gemv.gemv`` on the same weight (the same roundings: the
pair's value and the absmax in float16, float32 sums; only the order of the sums differs); on the simulator at small
shapes, on the GPU at the given ones, then timed (CUDA graphs, L2-cold rotating weights) beside ``mma_gemv`` on the
same fragments and the pair gemv with float16 sums on the code layout, with the read floor of the same run.

Prediction (written before any GPU run): if the geometry is the difference, M = 1 on 4096x14336 k = 4 from mma(f)'s
14.2 us to ~12.5-13 (the pair gemv's 12.5), M = 4, 8 -5..-10% below mma(f); if it is slower, the barrier is not the
cause and the design is dropped.
"""
import sys

import numpy as np
from numba import cuda

from kbit_numba import bench, mma_gemv, pair_gemv, reference
from kbit_numba._arrays import flat_view
from kbit_numba._timing import graph_time_us, rotation_count
from kbit_numba.core import sm_count
from kbit_numba.device import (CODEBOOK, PRMT_ROW, TABLE_FLOATS, WARP, e4m4_decode, jit_kernel,
                               make_table_fill, u32)
from kbit_numba.formats import BLOCK
from kbit_numba.intrinsics import (SIMULATOR, bar_sync, f16x2_as_u32, f32_as_u32, hmul2, ldg128, ldmatrix_x4, lds128,
                                   lds_u32, mma_f16, prmt, shared_addr, sts128, u32_as_f32)
from kbit_numba.launch import Plan, Step

K = 4                              # bits (k = 4 only)
STRIP = 16                         # columns a strip (the MMA's m16)
TILE_KB = 8                        # blocks of a K tile (256 k)
TILE_BLOCKS = STRIP * TILE_KB      # blocks of a fragment tile (16 columns x 8 blocks)
PIECES = 4                         # a lane's 16-byte loads of a tile: piece p = 2c + b (column g + 8c, block t + 4b)
SCALES = TABLE_FLOATS              # word offset of the E4M4 table
PART = CODEBOOK + 16               # float offset of the partial C tiles
FRAG = 4 * WARP                    # floats of a warp's partial C tile (4 a lane, fragment order)
BATCH = 3                          # strips a barrier (the loop's unroll)
CTA_WARPS = 16
# the loop's state, one uint32 each in a local array the inlined helpers update: where the next load and the next
# MMAs are (strip, K tile of the warp's), the strip's slot in its batch, and the partial buffer's half
LOAD_STRIP, LOAD_TILE, STRIP_AT, TILE_AT, BATCH_SLOT, HALF = range(6)
TILE_ACT_BYTES = TILE_KB * BLOCK * 2     # a token's activations of one K tile: 512 bytes
ROW_PAD = 16                       # a token row's stride 2K + 16 bytes: an ldmatrix phase's 8 rows in distinct banks


def part_floats(S, KS):
    return 2 * BATCH * S * KS * FRAG


def act_offset(S, KS):
    """Byte offset of the staged activations (16-byte aligned) after the partial tiles."""
    return 4 * (PART + part_floats(S, KS))


def shared_bytes(S, KS, M, Kdim):
    return act_offset(S, KS) + (M + 1) * (2 * Kdim + ROW_PAD)


def make_kernel(S, KS):
    fill_table, ENTRY, COPIES = make_table_fill(K, "float16")
    SLICE_THREADS = KS * WARP
    ACT = act_offset(S, KS)                              # byte offset of the staged activations

    @cuda.jit(device=True, inline="always")
    def load(packed, absmax, st, tw, tiles_k, n_strips, stride, kt0, lane, codes, am):
        """This lane's 4 pieces of fragment tile (strip st[LOAD_STRIP], K tile kt0 + st[LOAD_TILE]); then advance
        the load position.
        Past the last strip it loads strip 0's (never used)."""
        strip = st[LOAD_STRIP] if st[LOAD_STRIP] < n_strips else u32(0)
        base = u32(u32(strip * tiles_k + kt0 + st[LOAD_TILE]) * u32(TILE_BLOCKS) + lane)
        for p in range(PIECES):
            blk = u32(base + u32(WARP * p))
            codes[p, 0], codes[p, 1], codes[p, 2], codes[p, 3] = ldg128(packed, u32(blk * u32(4)))
            am[p] = absmax[blk]
        st[LOAD_TILE] = u32(st[LOAD_TILE] + u32(1))
        if st[LOAD_TILE] == tw:
            st[LOAD_TILE] = u32(0)
            st[LOAD_STRIP] = u32(st[LOAD_STRIP] + stride)

    @cuda.jit(device=True, inline="always")
    def step(smem, table, lane_off, lane_act, codes, am, acc, st, tw, kt0, part, slot, n_strips, stride, tid, sl,
             out, N, m):
        """The MMAs of one K tile into acc; at a strip's last tile its partial tile goes to shared memory, and after
        a batch's last strip (or the slice's) the slice meets at its barrier and sums the batch."""
        kt = u32(kt0 + st[TILE_AT])
        for b in range(2):
            s0 = lds_u32(smem, table + u32(4) * u32(u32(SCALES) + u32(am[b])))
            s1 = lds_u32(smem, table + u32(4) * u32(u32(SCALES) + u32(am[2 + b])))
            for sp in range(4):
                r0, r1, r2, r3 = ldmatrix_x4(smem, u32(lane_act + kt * u32(TILE_ACT_BYTES) + u32(256 * b + 64 * sp)))
                for h in range(2):
                    s = 2 * sp + h
                    wd = s // 2
                    sel0 = u32(PRMT_ROW | ((2 * (s % 2)) << 4))
                    sel1 = u32(PRMT_ROW | ((2 * (s % 2) + 1) << 4))
                    a0 = hmul2(lds_u32(smem, table + prmt(codes[b, wd], lane_off, sel0)), s0)
                    a2 = hmul2(lds_u32(smem, table + prmt(codes[b, wd], lane_off, sel1)), s0)
                    a1 = hmul2(lds_u32(smem, table + prmt(codes[2 + b, wd], lane_off, sel0)), s1)
                    a3 = hmul2(lds_u32(smem, table + prmt(codes[2 + b, wd], lane_off, sel1)), s1)
                    b0 = r2 if h else r0
                    b1 = r3 if h else r1
                    acc[0], acc[1], acc[2], acc[3] = mma_f16(a0, a1, a2, a3, b0, b1, acc[0], acc[1], acc[2], acc[3])
        st[TILE_AT] = u32(st[TILE_AT] + u32(1))
        if st[TILE_AT] == tw:                                  # the strip's last tile
            st[TILE_AT] = u32(0)
            r = st[BATCH_SLOT]
            sts128(smem, table + u32(4) * u32(part + st[HALF] + r * slot), f32_as_u32(acc[0]), f32_as_u32(acc[1]),
                   f32_as_u32(acc[2]), f32_as_u32(acc[3]))
            for e in range(4):
                acc[e] = np.float32(0.0)
            strip = st[STRIP_AT]
            st[STRIP_AT] = u32(st[STRIP_AT] + stride)
            if r == u32(BATCH - 1) or st[STRIP_AT] >= n_strips:
                bar_sync(u32(1) + sl, u32(SLICE_THREADS))
                sum_batch(smem, table, st[HALF], slot, u32(r + u32(1)), u32(strip - r * stride), stride, tid, sl, out,
                          N, m)
                st[HALF] = u32(u32(BATCH) * slot - st[HALF])
                st[BATCH_SLOT] = u32(0)
            else:
                st[BATCH_SLOT] = u32(r + u32(1))

    @cuda.jit(device=True, inline="always")
    def sum_batch(smem, table, flip, slot, count, strip0, stride, tid, sl, out, N, m):
        """Thread i of the slice adds lane slot i % 32's four values of strip i // 32 over the slice's KS warps and
        writes columns g, g + 8 x tokens 2t, 2t + 1 (those below M)."""
        i = u32(tid - sl * u32(SLICE_THREADS))
        while i < count * u32(WARP):
            q = i // u32(WARP)
            ln = i % u32(WARP)
            tok = u32(u32(2) * (ln & u32(3)))
            if tok < m:
                p = u32(u32(PART) + flip + q * slot + sl * u32(KS * FRAG) + u32(4) * ln)
                v = cuda.local.array(4, np.float32)
                for e in range(4):
                    v[e] = np.float32(0.0)
                for x in range(KS):
                    wv = lds128(smem, table + u32(4) * u32(p + u32(x * FRAG)))
                    for e in range(4):
                        v[e] += u32_as_f32(wv[e])
                n = u32(u32(strip0 + q * stride) * u32(STRIP) + (ln >> u32(2)))
                out[u32(tok * u32(N) + n)] = np.float16(v[0])
                out[u32(tok * u32(N) + n + u32(8))] = np.float16(v[2])
                if u32(tok + u32(1)) < m:
                    out[u32(u32(tok + u32(1)) * u32(N) + n)] = np.float16(v[1])
                    out[u32(u32(tok + u32(1)) * u32(N) + n + u32(8))] = np.float16(v[3])
            i = u32(i + u32(SLICE_THREADS))

    def kernel(A, packed, absmax, cb, out, N, n_kb, M):
        smem = cuda.shared.array(0, np.float32)
        tid = u32(cuda.threadIdx.x)
        lane = tid % u32(WARP)
        warp = tid // u32(WARP)
        sl = warp // u32(KS)
        w = warp - sl * u32(KS)
        nkb = u32(n_kb)
        m = u32(M)
        tiles_k = nkb // u32(TILE_KB)
        tw = tiles_k // u32(KS)                          # K tiles a warp walks per strip
        kt0 = w * tw
        n_strips = u32(N) // u32(STRIP)

        # ---- 1. the group table, the E4M4 table, and the activations in B-fragment order ---------------------------
        fill_table(smem, cb, tid)
        table = shared_addr(smem)
        i = tid
        while i < u32(256):
            h = f16x2_as_u32(np.float16(e4m4_decode(np.uint8(i))), np.float16(e4m4_decode(np.uint8(i))))
            smem[u32(SCALES) + i] = u32_as_f32(h)
            i = u32(i + u32(cuda.blockDim.x))
        # Token r's row holds, per K tile, b = 0..1, s = 0..7, hi = 0..1 (16 bytes each): the pairs of elements
        # 4s + 2hi, + 1 of blocks t + 4b (t = 0..3) of the tile, so that ldmatrix gives lane (g, t) token g's pair of
        # its own block t + 4b, as the MMA's b0 (hi = 0) and b1 (hi = 1) want. Row M is zeros (tokens past M).
        act = u32(ACT)
        row_bytes = u32(nkb * u32(BLOCK * 2) + u32(ROW_PAD))
        units = u32(nkb * u32(4))                        # 16-byte units a row
        i = tid
        while i < (m + u32(1)) * units:
            r = i // units
            u = i - r * units
            tile = u >> u32(5)
            rem = u & u32(31)
            b = rem >> u32(4)
            s = (rem & u32(15)) >> u32(1)
            hi = rem & u32(1)
            wv = cuda.local.array(4, np.uint32)
            for tt in range(4):
                kb = u32(tile * u32(TILE_KB) + u32(tt) + u32(4) * b)
                wv[tt] = A[u32(r * nkb * u32(16) + kb * u32(16) + u32(2) * s + hi)] if r < m else u32(0)
            sts128(smem, table + act + r * row_bytes + u * u32(16), wv[0], wv[1], wv[2], wv[3])
            i = u32(i + u32(cuda.blockDim.x))
        cuda.syncthreads()
        # lanes 8i..8i+7 give matrix i's rows: token lane % 8 (the zero row past M), 16 bytes a matrix
        tok_row = lane % u32(8)
        lane_act = u32(table + act + min(tok_row, m) * row_bytes + u32(16) * (lane // u32(8)))
        lane_off = u32((lane % u32(COPIES)) * u32(ENTRY))
        part = u32(u32(PART) + (sl * u32(KS) + w) * u32(FRAG) + u32(4) * lane)
        slot = u32(S * KS * FRAG)                        # floats of one strip's partial tiles (all slices)
        stride = u32(u32(cuda.gridDim.x) * u32(S))       # strips between a slice's consecutive strips
        grp = u32(u32(cuda.blockIdx.x) * u32(S) + sl)    # this slice's first strip
        if grp >= n_strips:
            return

        # ---- 2. the flattened (strip, K tile) loop, loads two ahead in three buffers --------------------------------
        codes_a = cuda.local.array((PIECES, 4), np.uint32)
        codes_b = cuda.local.array((PIECES, 4), np.uint32)
        codes_c = cuda.local.array((PIECES, 4), np.uint32)
        am_a = cuda.local.array(PIECES, np.uint8)
        am_b = cuda.local.array(PIECES, np.uint8)
        am_c = cuda.local.array(PIECES, np.uint8)
        acc = cuda.local.array(4, np.float32)
        for e in range(4):
            acc[e] = np.float32(0.0)
        st = cuda.local.array(6, np.uint32)              # (LOAD_STRIP .. HALF)
        for e in range(6):
            st[e] = u32(0)
        st[LOAD_STRIP] = grp
        st[STRIP_AT] = grp
        load(packed, absmax, st, tw, tiles_k, n_strips, stride, kt0, lane, codes_a, am_a)
        load(packed, absmax, st, tw, tiles_k, n_strips, stride, kt0, lane, codes_b, am_b)
        while st[STRIP_AT] < n_strips:
            load(packed, absmax, st, tw, tiles_k, n_strips, stride, kt0, lane, codes_c, am_c)
            step(smem, table, lane_off, lane_act, codes_a, am_a, acc, st, tw, kt0, part, slot, n_strips, stride,
                 tid, sl, out, N, m)
            if st[STRIP_AT] >= n_strips:
                break
            load(packed, absmax, st, tw, tiles_k, n_strips, stride, kt0, lane, codes_a, am_a)
            step(smem, table, lane_off, lane_act, codes_b, am_b, acc, st, tw, kt0, part, slot, n_strips, stride,
                 tid, sl, out, N, m)
            if st[STRIP_AT] >= n_strips:
                break
            load(packed, absmax, st, tw, tiles_k, n_strips, stride, kt0, lane, codes_b, am_b)
            step(smem, table, lane_off, lane_act, codes_c, am_c, acc, st, tw, kt0, part, slot, n_strips, stride,
                 tid, sl, out, N, m)

    return jit_kernel(kernel)


_KERNELS = {}


def plan(A, frag, out, KS, S=None):
    """A Plan of one launch: A a device float16 [M, K], frag a device KbitFragments (k = 4), out float16 [M, N];
    KS K-warps a slice, S slices a CTA (default: CTA_WARPS // KS)."""
    M, Kdim = A.shape
    N = frag.shape[0]
    S = S or CTA_WARPS // KS
    assert frag.k == K and frag.absmax_format == "e4m4" and 1 <= M <= 8 and (Kdim // 256) % KS == 0
    key = (S, KS)
    if key not in _KERNELS:
        _KERNELS[key] = make_kernel(S, KS)
    shared = shared_bytes(S, KS, M, Kdim)
    assert shared <= 227 * 1024, f"{shared} bytes of shared memory"
    grid = max(1, min(sm_count(), -(-(N // STRIP) // S)))       # one CTA an SM (the table + activations)
    args = (flat_view(A, np.uint32), frag.packed, frag.absmax, frag.codebook, flat_view(out), np.int32(N),
            np.int32(Kdim // BLOCK), np.int32(M))
    return Plan([Step(_KERNELS[key], grid, S * KS * WARP, args, shared)], A, out, 0)


def check(A, frag, KS, S=None):
    """Max |prototype - mma_gemv| over max |mma_gemv| on the same activations and fragment-layout weight."""
    M, N = A.shape[0], frag.shape[0]
    ref = mma_gemv.gemv(A, frag).copy_to_host().astype(np.float32).reshape(M, N)
    out = cuda.device_array((M, N), np.float16)
    plan(A, frag, out, KS, S).launch()
    got = out.copy_to_host().astype(np.float32)
    return float(np.abs(got - ref).max() / max(1e-6, np.abs(ref).max()))


def random_case(Kdim, N, M, rng):
    w = np.asarray(rng.standard_normal((N, Kdim)), np.float32)
    frag = mma_gemv.to_fragments(pair_gemv.to_codes(reference.quantize(w, K)))
    return cuda.to_device(rng.standard_normal((M, Kdim)).astype(np.float16)), frag


def main(argv):
    rng = np.random.default_rng(1)
    if SIMULATOR:
        # small: K tiles walked by one warp (KS = 1) or split over two; slices whose strips end mid-batch, batches
        # of 3 (13 strips over 2 CTAs x 2 slices: 4, 3, 3, 3 strips), a partly filled last batch, tokens past M
        for Kdim, N, M, KS, S in ((512, 48, 1, 1, 1), (512, 48, 3, 2, 1), (512, 32, 8, 1, 1), (512, 208, 2, 1, 2),
                                  (768, 208, 5, 1, 2)):
            err = check(*random_case(Kdim, N, M, rng), KS, S)
            print(f"simulator K={Kdim} N={N} M={M} KS={KS} S={S}: max error / max |out| {err:.2e}")
            assert err < 2e-3, err
        return
    args = [a for a in argv if not a.startswith("--")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in (args[0] if args else
                                                             "4096x14336,4096x28672,14336x4096,4096x6144").split(",")]
    ms = [int(v) for v in (args[1] if len(args) > 1 else "1,4,8").split(",")]
    kss = [int(v) for v in (args[2] if len(args) > 2 else "2,4,8").split(",")]
    print(f"{'K x N':>11} {'M':>2} {'KS':>2} {'err':>8} {'proto':>7} {'mma(f)':>7} {'pair,f16':>8} {'floor':>6} "
          f"{'proto/mma(f)':>12} {'proto/pair':>10}")
    for Kdim, N in shapes:
        nbytes = N * Kdim // 32 * (4 * K + 1)
        n = rotation_count(nbytes)
        codes = [pair_gemv.to_codes(w) for w in bench._rotating_weights(Kdim, N, K, n, rng)]
        frags = [mma_gemv.to_fragments(c) for c in codes]
        for M in ms:
            A = cuda.to_device(rng.standard_normal((M, Kdim)).astype(np.float16))
            out = cuda.device_array((M, N), np.float16)
            t = {}
            runs = [mma_gemv.plan(A, f, out, 0).prepare().run for f in frags]
            t["mma"] = graph_time_us(lambda i, s: runs[i % n](s), n * max(1, 64 // n))
            if M <= 4:
                runs = [pair_gemv.plan(A, c, out, 0, f16_acc=True).prepare().run for c in codes]
                t["pair"] = graph_time_us(lambda i, s: runs[i % n](s), n * max(1, 64 // n))
            floor = bench.floor_us(nbytes + M * Kdim * 2 + M * N * 2)
            for KS in kss:
                if (Kdim // 256) % KS or shared_bytes(CTA_WARPS // KS, KS, M, Kdim) > 227 * 1024:
                    continue
                err = check(A, frags[0], KS)
                runs = [plan(A, f, out, KS).prepare().run for f in frags]
                p = graph_time_us(lambda i, s: runs[i % n](s), n * max(1, 64 // n))
                pair = t.get("pair", float("nan"))
                print(f"{Kdim:>5}x{N:<5} {M:>2} {KS:>2} {err:8.1e} {p:7.2f} {t['mma']:7.2f} {pair:8.2f} {floor:6.2f} "
                      f"{p / t['mma']:12.3f} {p / pair:10.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
