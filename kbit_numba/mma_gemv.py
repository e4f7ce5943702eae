"""Tensor-core GEMV ("swap AB"): C[M, N] = A[M, K] @ W[N, K]^T for M = 1..32 on the code layout (k = 2, 4).

The pair gemv (``pair_gemv``) spends G * M FMAs per code byte, so its cost grows with M; the tiled gemm
(``tensor_gemm``) puts the tokens in the MMA's 16-row A operand, stages every weight through shared memory
and waits on its own dependency chains. This kernel streams the weights the pair gemv's way and lets one
``mma.sync.m16n8k16`` do the multiply-adds of 16 columns x 16 k x 8 tokens:

* **Weights are the A operand** (16 rows = 16 columns of W), **tokens the B operand** (n8: M <= 8 wastes no
  MMA work at M = 8, and the MMA count does not grow with M). M = 9..16 takes two n8 tiles (``tiles=2``): each
  decoded A fragment feeds two MMAs, so the decode, the per-weight cost, is paid once for 16 tokens. M = 17..32
  takes three or four, in CTAs of at most 8 K-warps (``WIDE_KW``: their B fragments take 96-128 registers).
* **The k order inside an MMA is free** (it is summed over), so lane (g, t) = (lane // 4, lane % 4) holds two
  of the warp's 8 blocks of columns g and g + 8 of the strip, chosen so that every load instruction of a quad
  reads whole 32-byte sectors: at k = 4 (16-byte blocks) blocks ``t`` and ``t + 4`` (each 16-byte load of a
  quad is 64 contiguous bytes), at k = 2 (8-byte blocks) blocks ``2t`` and ``2t + 1`` (one 16-byte load).
  MMA s (0..7) of block b takes the block's elements 4s .. 4s+3: a0 = pair (4s, 4s+1) of column g,
  a2 = pair (4s+2, 4s+3), a1 / a3 the same of column g + 8; the B fragment b0, b1 is the same four
  elements of token g's activations: 8 contiguous bytes, loaded once per launch into 32 registers (64 with
  two tiles: token g + 8 is the second tile's).
* **Two weight layouts**: the code layout (``KbitCodes``, the pair gemv's: a column's blocks together) or the
  fragment layout (``KbitFragments``, :func:`to_fragments`: tiles of 16 columns x 8 blocks stored in the order
  this kernel's lanes load them). In the first a load instruction of a warp reads 64 bytes of each of 8 columns,
  in the second 512 contiguous bytes: 5-13% faster at M = 4 (benchmarks/README.md). Only the load addresses differ.
* **Decode**: the pair gemv's group table with float16 (bfloat16) entries: at k = 4 one ``prmt`` and one
  ``ld.shared`` per pair, at k = 2 one of each per quad (two pairs); one ``mul.rn.f16x2`` per pair
  scales it by the block's absmax (the same roundings as the tiled gemm: codebook value, absmax and
  their product in the MMA's type): ~1.6 instructions per weight at k = 4 whatever M is (with the loads,
  the reduction and the loop, 2.84 at M = 1 and 3.20 at M = 8 measured: benchmarks/README.md).
* **Geometry** as the pair gemv's: a CTA holds ``S`` slices of ``KW = ceil(K / 256)`` warps (K <= 8192; S up to
  the aim, the one whose launch puts the fewest strips on the busiest SM: :func:`busiest_sm_slices`),
  a persistent grid walks 16-column strips, loads run two iterations ahead in three register buffers,
  and the KW warps' partial C tiles are summed in shared memory, three strips at a time (one barrier per three
  strips: ``BATCH``; with one token tile up to eight where a CTA walks more than three: :func:`long_batch`), stored
  in fragment order (a lane's 4 values of a token tile: one 16-byte store).
* **Split-K** (``split_k``; K > 8192, e.g. a llama3-8b down projection, K = 14336; K > 4096 but for k = 2 at M <= 8,
  where a CTA of all K-warps gets 64 registers and spills; or ``plan(split=)``): a CTA
  holds only its share of the K-warps (grid.y = the splits, ~``SPLIT_KW`` warps each: a CTA of all 56 would need
  1792 threads), its sums go into a float32 workspace by atomic adds, and the gemm's finish launch
  (``core.finish_step``, a PDL launch where the split launch is one) writes the output and zeroes the workspace
  again. Grouped launches split the same way
  (grid z the shares, y the slots; by default as a plain launch of M = 8).
* ``pdl=True``: built for a programmatic dependent launch, as the pair gemv, but its first two strips' weight loads
  really go out before the tables and the wait: ordinary loads, which ptxas keeps there, after the codebook's
  ``cp.async`` (``EARLY_LOADS``; M = 4 chains 4-13% faster, H200). Grouped: only the tables before the wait (the
  offsets, and so the weights a CTA loads, come from the kernel before it).
* ``silu_pairs=True``: the SiLU epilogue of a gate/up weight with interleaved rows, as ``pair_gemv``'s: the thread
  that sums column 2j's tiles sums 2j + 1's too and writes silu(gate) * up into an [M, N / 2] output (with K split,
  the finishing launch does: ``core.finish_step``).
* ``grouped=True``: MoE experts (``grouped_gemv``): a grid row (slot) per expert, or per token row when there
  are fewer rows than experts (a decode step: the slot runs the expert whose first row it is, as
  ``scalar_gemv``'s grouped kernel); a CTA takes its expert's rows (up to 8) as its B fragments and walks that
  expert's strips.

Reference twin: ``reference.gemm`` (the same weight roundings). Tests: ``tests/test_mma_gemv.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .core import (SHARED_PER_SM, busiest_sm_items, check_grouped, device_weight, expected_active, finish_step,
                   fit_threads, make_finish_kernel, max_tokens_per_expert, persistent_grid, row_share, slot_share,
                   split_sums, unused_i32)
from .device import (CODEBOOK, FULL_MASK, PRMT_ROW, TABLE_BYTES, TABLE_FLOATS, WARP, e4m4_decode, f32_to_bf16_bits, i32,
                     jit_kernel, make_table_fill, silu_mul, slot_expert, stage_codebook, u32)
from .formats import (ABSMAX_FORMATS, BLOCK, CODES_K, KbitCodes, KbitFragments, check_fragment_shape,
                      fragment_position)
from .intrinsics import (bmul2, f16x2_as_u32, f32_as_u32, griddep_launch_dependents, griddep_wait, hmul2, ld128,
                         ldg128, lds64, lds128, lds_u32, mma_bf16, mma_f16, prmt, shared_addr, sts128, u32_as_f32)
from .launch import NUMBA_TYPES, OUT_TYPES, Plan, Spec, Step, launch_step, type_name

N8 = 8                            # the MMA's n8: tokens per tile
MAX_TILES = 4                     # n8 tiles per launch: each A fragment feeds this many MMAs
MAX_TOKENS = N8 * MAX_TILES       # rows of A a launch takes
STRIP = 16                        # columns per warp per iteration: the MMA's m16
KB_WARP = 8                       # blocks per warp (256 k): 2 per lane of a quad
KB_LANE = 2
MMAS_PER_BLOCK = BLOCK // 4       # MMA s takes elements 4s .. 4s+3 of a lane's block
FRAG_FLOATS = 4 * WARP            # a warp's C fragments of one token tile: 4 floats a lane, in lane order
MAX_KW = 32                       # warps per slice (1024 threads): K <= 32 * 256 = 8192 in one CTA
MAX_K = MAX_KW * KB_WARP * BLOCK
SPLIT_KW = 16                     # K-warps a split aims for past MAX_K (K = 14336: 4 splits of 14; DEFAULTS' CTA)
# ... and past SPLIT_KW too: a CTA of 17..32 K-warps gets 64 registers (core.register_cap; the builds take 121-134), so
# K = 5120 spilled. Split in two it ran 20-56% faster at M = 4..16 on three K = 5120 shapes, k = 4, and at M = 12, 16,
# k = 2, but 5-18% slower with k = 2's one tile (M <= 8), whose spills cost less than the split's atomics and second
# launch (H200, benchmarks/README.md, "Forty-third session"). With silu_pairs a split launch leaves the SiLU to the
# finishing launch; silu_pairs and grouped launches follow the same rule (at K = 5120 silu_pairs' split2 within 2% of
# the plain one, the grouped split2 32-40% faster at B = 1: "Forty-fourth session").
UNSPLIT_UNDER_CAP = {2: N8}       # k -> the largest M that keeps a CTA of SPLIT_KW..MAX_KW K-warps whole
# Three and four token tiles (M = 17..32) hold their B fragments in 96-128 registers: the builds take 165-255 a thread
# (local ptxas, sm_90: k = 4 205 / 237, k = 2 165 / 255 with 8 bytes spilled), so a CTA holds at most 8 K-warps
# (256 threads x 255 registers fill the register file) and K splits past K = 2048 (``k_splits``).
WIDE_TILES = 3                    # from this many token tiles on ...
WIDE_KW = 8                       # ... a CTA holds at most this many K-warps
K_STEP = KB_LANE * BLOCK          # K a multiple of 64 (at k = 2 a lane's two blocks are one 16-byte piece)
# Block b of lane t in its warp's 8 blocks: t * LANE_STRIDE + b * BLOCK_STRIDE (see the docstring: whole sectors)
LANE_STRIDE = {2: 2, 4: 1}
BLOCK_STRIDE = {2: 1, 4: 4}
SCALES = TABLE_FLOATS             # word offset of the E4M4 table (absmax byte -> its value as a packed pair)
PART = CODEBOOK + 16              # float offset of the cross-warp partial C tiles
MMA_TYPES = ("float16", "bfloat16")
DEFAULTS = {"cta_warps": 16}      # warps per CTA the plan aims for (the table is filled once per CTA)
# k = 2's two-tile build (128 registers) fits two slices of 8 K-warps in a CTA at K = 2048, yet runs 22-28% faster
# with one (H200, 2048x4096 and 2048x5120, M = 12 and 16: 6.88-8.68 us against 8.86-12.01); k = 4's (134 registers)
# fits one slice either way (within 2%). benchmarks/README.md, "Forty-sixth session".
CTA_WARPS_BY_K_TILES = {(2, 2): 8}   # (k, tiles) -> the warps per CTA the plan aims for instead of DEFAULTS
BATCH = 3                         # strips whose partial C tiles are summed after one barrier (the loop's unroll)
# Longer batches the plan may take where a CTA walks more strips than BATCH (:func:`long_batch`): fewer barriers, at
# the cost of shared memory and of counting the strip at run time. A short list, so that few builds exist. With one
# token tile 4096x14336 (7 strips a CTA: batch 8) ran 4-8% faster at k = 4 and 6-13% at k = 2, M = 1 and 4, and
# 4096x28672 8-10% at M = 1..8; two tiles with batch 4 (8 does not fit) 3-6% slower (H100, benchmarks/README.md,
# "Eighty-seventh session"): at the 128-register cap the device's batch-4 builds spill 24-32 bytes a thread, 15 local
# accesses in the strip loop, where batch 3's plain build spills none ("Ninety-second session"). Split in K too:
# 14336x4096 (4 shares, 8 strips a CTA: batch 8) 6-10% faster at M = 1, 4, 8, k = 4 and 2 ("Eighty-eighth session").
LONG_BATCHES = (4, 6, 8)
SHARED_PER_CTA = SHARED_PER_SM - 1024   # the most dynamic shared memory a CTA may opt in to (sm_90: 227 KB)

# This kernel's own helpers are inlined by Numba's IR inliner, not by NVVM like device.py's (device.inlined): with
# NVVM's the kernel ran 0.5-3.4% slower at M = 1..8 (8.5% at 2048x5120, M = 8; H100, benchmarks/README.md
# "Compile time"), for a compile about twice as fast.
ir_inlined = cuda.jit(device=True, inline="always")


@dataclass(frozen=True)
class MmaGemvSpec(Spec):
    """The tensor-core gemv's compile-time choices: the key of :func:`make_mma_gemv_kernel`."""
    FAMILY = "mma_gemv"
    k: int
    absmax_format: str = "e4m4"
    a_type: str = "float16"         # the MMA input type: float16 or bfloat16
    out_dtype: str = "float16"
    pdl: bool = False
    grouped: bool = False           # MoE experts: blockIdx.y is a slot (see the module docstring)
    tiles: int = 1                  # n8 token tiles: M <= 8 * tiles (2: M = 9..16)
    fragments: bool = False         # the weight is a KbitFragments (else KbitCodes): see load_strip
    batch: int = BATCH              # strips per barrier and sum (1: where BATCH's partial tiles do not fit)
    max_registers: object = None
    silu_pairs: bool = False        # the epilogue silu(C[:, 2j]) * C[:, 2j + 1] into an [M, N / 2] output
    split_k: bool = False           # grid.y splits K; out is a float32 workspace the sums are added to (atomics)

    def normalise(self):
        if self.k not in CODES_K:
            raise ValueError(f"mma gemv reads the code layout, k in {CODES_K}; got k={self.k}")
        if self.absmax_format not in ABSMAX_FORMATS:
            raise ValueError(f"absmax_format must be one of {ABSMAX_FORMATS}, got {self.absmax_format!r}")
        if self.tiles not in range(1, MAX_TILES + 1):
            raise ValueError(f"mma gemv takes 1..{MAX_TILES} n8 token tiles, got tiles={self.tiles}")
        if self.batch not in (1, BATCH) + LONG_BATCHES:
            raise ValueError(f"mma gemv sums the partial tiles of 1, {BATCH} or {LONG_BATCHES} strips at a time, "
                             f"got batch={self.batch}")
        if self.split_k and (self.silu_pairs or type_name(self.out_dtype, "out_dtype", OUT_TYPES) != "float32"):
            raise ValueError("split_k adds plain sums into a float32 workspace: not silu_pairs (the finishing launch "
                             "applies it), out_dtype float32")
        return dict(k=int(self.k), a_type=type_name(self.a_type, "a_type", MMA_TYPES),
                    out_dtype=type_name(self.out_dtype, "out_dtype", OUT_TYPES), pdl=bool(self.pdl),
                    grouped=bool(self.grouped), tiles=int(self.tiles), fragments=bool(self.fragments),
                    batch=int(self.batch), max_registers=int(self.max_registers) if self.max_registers else None,
                    silu_pairs=bool(self.silu_pairs), split_k=bool(self.split_k))


@lru_cache(maxsize=None)
def make_mma_gemv_kernel(spec):
    """Kernel(A words, packed codes, absmax, codebook, out[M*N], N, n_kb, M, offsets) for a
    :class:`MmaGemvSpec`; blockDim = 32 * KW * S, :func:`cta_shared` (S, KW) bytes of dynamic shared
    memory. A: the [M, K] activations as uint32 words of two float16 (bfloat16) values, M <= 8 * spec.tiles;
    n_kb = K / 32, even.
    Grouped: A [T, K] and out [T, N] hold every expert's rows (offsets: int32 [E + 1]), M is unused.
    Split-K: out is a zeroed float32 workspace [M*N] (grouped: [T*N]); CTA row blockIdx.y (grouped: blockIdx.z, y being
    the slot) adds the sums of its share of the K-warps."""
    k, absmax_format, out_dtype, PDL, GROUPED = spec.k, spec.absmax_format, spec.out_dtype, spec.pdl, spec.grouped
    bf16 = spec.a_type == "bfloat16"
    # the tables' barrier before griddep_wait, as pair_gemv's EARLY_BARRIER: at k = 4 the llama3-8b B = 4 step
    # 2825-2830 -> 2808-2813 us; at k = 2 it lost (2274-2291 -> 2302-2304), and the grouped build (qwen3) did not move
    # (benchmarks/README.md, "the tables' barrier before the wait")
    EARLY_BARRIER = PDL and k == 4 and not GROUPED
    load_a = ld128 if PDL else ldg128     # the activations: as pair_gemv's (an ordinary load after griddep_wait)
    # PDL (not grouped): the codebook staged by cp.async before the first weight loads, which are ordinary loads so that
    # ptxas keeps them before the tables and griddep_wait (see load_first)
    EARLY_LOADS = PDL and not GROUPED
    fill_table, ENTRY, COPIES = make_table_fill(k, spec.a_type, staged=EARLY_LOADS)
    mma = mma_bf16 if bf16 else mma_f16
    mul2 = bmul2 if bf16 else hmul2
    e4m4 = absmax_format == "e4m4"
    absmax_t = np.uint8 if e4m4 else np.float32
    f16_out = np.dtype(out_dtype) == np.float16
    BLOCK_WORDS = k                                # a block's code words
    CODE_WORDS = KB_LANE * k                       # a lane's code words per column (its two blocks)
    A_WORDS = BLOCK // 2                           # a block's activation words (two values each)
    TSTRIDE, BSTRIDE = LANE_STRIDE[k], BLOCK_STRIDE[k]
    TILES = spec.tiles
    FRAGMENTS = spec.fragments
    BATCH_ = spec.batch                            # strips per barrier and sum
    # 1 or BATCH: a strip's slot in the batch is its place in the loop body, a constant; a longer batch counts them
    COUNTED = BATCH_ not in (1, BATCH)
    PIECE_BLOCKS = 2 if BSTRIDE == 1 else 1         # blocks in a lane's 16-byte load
    TOKENS = N8 * TILES                            # rows of A a CTA takes
    TILE = STRIP * TOKENS                          # floats of one warp's partial C tile
    ACC = 4 * TILES                                # a lane's C fragment values
    FRAG_SLOTS = TILES * WARP                      # 4-float slots of a warp's tile (token tile j, lane l)
    # The summing threads' loads in flight (sum_tiles: every warp waits at the next barrier for the slowest sum, a
    # chain of KW 16-byte loads). Two tiles keep one: the loop's registers exceed the 128 a 512-thread CTA may have,
    # and each more set spilled more of them (H200: 4096x14336 M = 16 18.3 us with one, 20.8 with two, 21.0 with four).
    SUM_SETS = 4 if TILES == 1 else 1
    assert BSTRIDE == 1 and CODE_WORDS == 4 or BLOCK_WORDS == 4, "a 16-byte load is one block or a block pair"
    SILU_PAIRS = spec.silu_pairs
    SPLIT_K = spec.split_k
    # k = 2's lane holds blocks 2t, 2t + 1 (one 16-byte weight load), but loads its activations as k = 4 does (blocks
    # t, t + 4) and swaps them into place with shuffles, once a launch: its own blocks' 16-byte loads put a quad's four
    # lanes 128 bytes apart, so each load instruction touched 32 cache lines instead of 16, and the prologue's
    # activation loads backed up (H200, 2048x5120 M = 8: 35% `lg` stalls; benchmarks/README.md, "Thirty-eighth session")
    A_SWAP = BSTRIDE == 1

    @ir_inlined
    def mark_rows(out, start, count, tid):
        """NaN into out[start .. start + count - 1] (the rows past the tiles, in the epilogue's [T, N / 2] output)."""
        nan = u32_as_f32(u32(0x7FC00000))
        i = tid
        while i < count:
            out[u32(start + i)] = np.float16(nan) if f16_out else nan
            i = u32(i + u32(cuda.blockDim.x))

    @ir_inlined
    def pair_bits(v):
        """float32 -> the value twice, packed in the MMA's type."""
        if bf16:
            h = f32_to_bf16_bits(v)
            return h | (h << u32(16))
        return f16x2_as_u32(np.float16(v), np.float16(v))

    def make_load_strip(load128):
        """load_strip with the given 16-byte weight load (see load_first below)."""
        @ir_inlined
        def load_strip(packed, absmax, first, n0, kb0, last, n_kb, codes, am):
            """Issue the loads of this lane's two blocks kb0 and kb0 + BSTRIDE of columns n0 + g and n0 + g + 8
            (g: the lane's quad; n0 includes it) of the weight whose blocks start at ``first`` into codes[c, :] /
            am[c, :]. Unconditional: a block past ``last`` (the weight's last block; at k = 2 its last pair's
            first) reads that one instead, whose sums are never written or meet zero activations. 32-bit index
            math (see pair_gemv).
            The code layout (KbitCodes) keeps a column's blocks together, so a load instruction of the warp reads 64
            bytes of each of 8 columns (8 cache lines); the fragment layout (KbitFragments) stores the warp's tile of
            the strip in load order, so the same instruction reads 512 contiguous bytes (4 lines), and the absmax
            bytes 32 contiguous ones: 5-11% faster (benchmarks/README.md, "fragment layout")."""
            if FRAGMENTS:   # tile (strip n0 // 16, chunk kb0 // 8) of n_kb // 8 a strip; piece i of lane l at 32i + l
                lane = u32(u32(4) * (n0 & u32(STRIP - 1)) + (kb0 & u32(KB_WARP - 1)) // u32(TSTRIDE))
                tile = u32(first + u32(u32(u32(n0 // u32(STRIP)) * u32(n_kb // u32(KB_WARP)) + kb0 // u32(KB_WARP))
                                       * u32(STRIP * KB_WARP)))
            for c in range(2):
                col = u32(first + u32(n0 + u32(8 * c)) * n_kb + kb0)
                if BSTRIDE == 1:                       # k = 2: both blocks in one 16-byte load
                    if FRAGMENTS:
                        col = u32(tile + u32(PIECE_BLOCKS) * u32(u32(WARP * c) + lane))
                    blk = min(col, last)
                    codes[c, 0], codes[c, 1], codes[c, 2], codes[c, 3] = load128(packed, u32(blk * u32(BLOCK_WORDS)))
                    am[c, 0] = absmax[blk]
                    am[c, 1] = absmax[u32(blk + u32(1))]
                else:                                  # k = 4: one 16-byte load per block
                    for b in range(KB_LANE):
                        if FRAGMENTS:
                            blk = min(u32(tile + u32(WARP * (KB_LANE * c + b)) + lane), last)
                        else:
                            blk = min(u32(col + u32(b * BSTRIDE)), last)
                        codes[c, 4 * b], codes[c, 4 * b + 1], codes[c, 4 * b + 2], codes[c, 4 * b + 3] = \
                            load128(packed, u32(blk * u32(BLOCK_WORDS)))
                        am[c, b] = absmax[blk]

        return load_strip

    load_strip = make_load_strip(ldg128)
    # The first two strips' loads in a PDL build: ordinary (coherent) loads, which ptxas keeps where the source puts
    # them, before the table fill's barriers and griddep_wait, so that they overlap the kernel before. As
    # ld.global.nc loads ptxas moved them below both (SASS, 2026-11-27). Measured (H200, benchmarks/README.md,
    # "Thirty-third session"): its PDL chains 4.4-13% faster at M = 4; the same in the plain kernel and the pair gemv
    # was up to 8% slower, so they keep the read-only loads.
    load_first = make_load_strip(ld128) if EARLY_LOADS else load_strip

    @ir_inlined
    def decode_strip(smem, table, lane_off, codes, am, bx, acc):
        """acc[4j:4j+4] = this lane's C fragment of token tile j (columns g, g + 8 x tokens 8j + 2t, + 1) of the
        strip over its two blocks: per MMA, four scaled pairs from the group table, fed to each tile's MMA."""
        for r in range(ACC):
            acc[r] = np.float32(0.0)
        for b in range(KB_LANE):
            if e4m4:
                s0 = lds_u32(smem, table + u32(4) * u32(u32(SCALES) + u32(am[0, b])))
                s1 = lds_u32(smem, table + u32(4) * u32(u32(SCALES) + u32(am[1, b])))
            else:
                s0 = pair_bits(am[0, b])
                s1 = pair_bits(am[1, b])
            for s in range(MMAS_PER_BLOCK):
                if k == 4:                         # pairs 2s, 2s + 1: word s // 2, bytes 2 (s % 2) and + 1
                    wd = b * BLOCK_WORDS + s // 2
                    sel0 = u32(PRMT_ROW | ((2 * (s % 2)) << 4))
                    sel1 = u32(PRMT_ROW | ((2 * (s % 2) + 1) << 4))
                    a0 = mul2(lds_u32(smem, table + prmt(codes[0, wd], lane_off, sel0)), s0)
                    a2 = mul2(lds_u32(smem, table + prmt(codes[0, wd], lane_off, sel1)), s0)
                    a1 = mul2(lds_u32(smem, table + prmt(codes[1, wd], lane_off, sel0)), s1)
                    a3 = mul2(lds_u32(smem, table + prmt(codes[1, wd], lane_off, sel1)), s1)
                else:                              # quad s: word s // 4, byte s % 4 (two pairs)
                    wd = b * BLOCK_WORDS + s // 4
                    sel = u32(PRMT_ROW | ((s % 4) << 4))
                    x0, x2 = lds64(smem, table + prmt(codes[0, wd], lane_off, sel))
                    x1, x3 = lds64(smem, table + prmt(codes[1, wd], lane_off, sel))
                    a0 = mul2(x0, s0)
                    a2 = mul2(x2, s0)
                    a1 = mul2(x1, s1)
                    a3 = mul2(x3, s1)
                for j in range(TILES):
                    acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3] = mma(
                        a0, a1, a2, a3, bx[j, b, s, 0], bx[j, b, s, 1],
                        acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3])

    @ir_inlined
    def end_strip(smem, table, acc, lane, tid, part, flip, slot, r, grp, grid, n_groups, slices, kw, group_cols, out,
                  N, M, row0):
        """Put this lane's C fragment of the strip in its warp's tile of slot r (of BATCH) of the shared buffer half
        ``flip``: the tile in fragment order (tile j's lane l at floats 128 j + 4 l), so that a lane stores its 4 values
        of a token tile with one 16-byte store (the 32 lanes' 512 bytes in 4 bank phases, no conflict) and the summing
        threads read them back the same way. After a batch's last strip (or the CTA's), meet the CTA at one barrier
        and sum the batch's tiles over the K-warps (:func:`sum_tiles`); return the half the next batch writes.
        One barrier per BATCH strips: each barrier and each summing chain is a wait on every warp's critical
        path, now shared by three strips (benchmarks/README.md, "Batched reduction")."""
        tile = u32(part + flip + u32(r) * slot + u32(4) * lane)
        for j in range(TILES):
            sts128(smem, table + u32(4) * u32(tile + u32(FRAG_FLOATS * j)), f32_as_u32(acc[4 * j]),
                   f32_as_u32(acc[4 * j + 1]), f32_as_u32(acc[4 * j + 2]), f32_as_u32(acc[4 * j + 3]))
        if r == BATCH_ - 1 or u32(grp + grid) >= n_groups:
            cuda.syncthreads()
            sum_tiles(smem, table, tid, flip, slot, u32(r + 1), u32(grp - u32(r) * grid), grid, slices, kw,
                      group_cols, out, N, M, row0)
            return u32(u32(BATCH_) * slot - flip)
        return flip

    @ir_inlined
    def batch_slot(r, place):
        """The slot of the strip at ``place`` (0..2) of the loop body: its place, or the counted ``r``."""
        if COUNTED:
            return r
        return u32(place % BATCH_)

    @ir_inlined
    def next_slot(r, half, flip):
        """The next strip's counted slot: 0 where end_strip began a batch (its buffer half flipped), else r + 1."""
        if COUNTED:
            return u32(0) if half != flip else u32(r + 1)
        return r

    @ir_inlined
    def sum_fragment(smem, table, p, p_end):
        """The sums of the four values at float p, p + TILE, ... (< p_end) of the partial tiles: one 16-byte load a
        tile, SUM_SETS loads in flight (as many sets of sums, so that a load does not wait for another's adds)."""
        s = cuda.local.array((SUM_SETS, 4), np.float32)
        for a in range(SUM_SETS):
            for e in range(4):
                s[a, e] = np.float32(0.0)
        while p + u32((SUM_SETS - 1) * TILE) < p_end:
            for a in range(SUM_SETS):
                v = lds128(smem, table + u32(4) * u32(p + u32(a * TILE)))
                for e in range(4):
                    s[a, e] += u32_as_f32(v[e])
            p = u32(p + u32(SUM_SETS * TILE))
        while p < p_end:
            v = lds128(smem, table + u32(4) * p)
            for e in range(4):
                s[0, e] += u32_as_f32(v[e])
            p = u32(p + u32(TILE))
        for a in range(1, SUM_SETS):
            for e in range(4):
                s[0, e] += s[a, e]
        return s[0, 0], s[0, 1], s[0, 2], s[0, 3]

    @ir_inlined
    def sum_gate_up(smem, table, p, p_end):
        """silu_pairs: the sums of the two values at float p (gate column, tokens tok and tok + 1) and the two at
        p + 16 (its up column, the next quad's slot) of each of the tiles TILE floats apart below p_end."""
        g0, g1, u0, u1 = np.float32(0.0), np.float32(0.0), np.float32(0.0), np.float32(0.0)
        while p < p_end:
            x0, x1 = lds64(smem, table + u32(4) * p)
            y0, y1 = lds64(smem, table + u32(4) * u32(p + u32(16)))
            g0 += u32_as_f32(x0)
            g1 += u32_as_f32(x1)
            u0 += u32_as_f32(y0)
            u1 += u32_as_f32(y1)
            p = u32(p + u32(TILE))
        return g0, g1, u0, u1

    @ir_inlined
    def store_out(out, row, n, N, v):
        if n < u32(N):
            if SPLIT_K:             # one of the splits' sums (a red.global.add: the result is unused)
                cuda.atomic.add(out, u32(row * u32(N) + n), v)
            else:
                out[u32(row * u32(N) + n)] = np.float16(v) if f16_out else v

    @ir_inlined
    def store_silu(out, row, n, N, gate, up):
        """silu(gate) * up of gate/up column pair (n, n + 1) into out[row, n / 2] of an [M, N / 2] output."""
        if n < u32(N):
            y = silu_mul(gate, up)
            out[u32(row * u32(u32(N) // u32(2)) + n // u32(2))] = np.float16(y) if f16_out else y

    @ir_inlined
    def sum_tiles(smem, table, tid, flip, slot, count, grp0, grid, slices, kw, group_cols, out, N, M, row0):
        """One thread per (strip, slice, token tile, lane slot) of the batch's ``count`` strips (strip r is column
        group grp0 + r * grid) adds the slot's four values over the slice's KW tiles (:func:`sum_fragment`) and writes
        them: columns g and g + 8 of the strip (g, t: the slot's lane quad and place) x tokens 8j + 2t and + 1 of rows
        row0 + token. Slots whose tokens are all past M are skipped. A loop: a CTA of one warp has fewer threads than
        the slots. The other threads go on to the next strip meanwhile (sharing each sum among several threads
        with shuffles was slower: everyone waited for it).
        silu_pairs: the slots of quads g (even: gate columns n, n + 8) and g + 1 (up columns n + 1, n + 9) make two
        gate/up pairs; the even quad's thread writes silu(gate) * up of pair n, the odd one's of pair n + 8, for both
        token rows (:func:`sum_gate_up`: 8-byte loads, as few registers as the plain sums)."""
        per_strip = u32(slices * u32(FRAG_SLOTS))
        i = tid
        while i < u32(count * per_strip):
            q = u32(i // u32(FRAG_SLOTS))          # (strip r, slice) of the batch
            slot_j = u32(i - q * u32(FRAG_SLOTS))  # (token tile j, lane l): 4 floats at 4 slot_j of each tile
            r = u32(0)
            for b in range(1, BATCH_):
                if q >= u32(b * slices):
                    r = u32(r + u32(1))
            s_out = u32(q - r * slices)
            lane = slot_j % u32(WARP)
            g = lane >> u32(2)
            tok = u32(u32(N8) * (slot_j // u32(WARP)) + u32(2) * (lane & u32(3)))
            if tok < M:
                p = u32(u32(PART) + flip + r * slot + s_out * kw * u32(TILE) + u32(4) * slot_j)
                p_end = u32(p + kw * u32(TILE))
                n = u32(u32(u32(grp0 + r * grid) * group_cols) + s_out * u32(STRIP) + g)
                row = u32(row0 + tok)
                if SILU_PAIRS:
                    # gate/up column pairs (n, n + 1) sit in the slots of quads g and g + 1 (16 floats on): an even
                    # quad's thread takes its slot's column n (floats 0, 1: tokens tok, tok + 1), an odd quad's the
                    # even neighbour's column n - 1 + 8 (floats 2, 3)
                    odd = g % u32(2)
                    p = u32(p - odd * u32(14))
                    gate0, gate1, up0, up1 = sum_gate_up(smem, table, p, u32(p_end - odd * u32(14)))
                    pair = u32(n + odd * u32(7))
                    store_silu(out, row, pair, N, gate0, up0)
                    if u32(tok + u32(1)) < M:
                        store_silu(out, u32(row + u32(1)), pair, N, gate1, up1)
                else:
                    v0, v1, v2, v3 = sum_fragment(smem, table, p, p_end)   # (n, tok), (n, tok + 1), (n + 8, tok), ..
                    store_out(out, row, n, N, v0)
                    store_out(out, row, u32(n + u32(8)), N, v2)
                    if u32(tok + u32(1)) < M:
                        store_out(out, u32(row + u32(1)), n, N, v1)
                        store_out(out, u32(row + u32(1)), u32(n + u32(8)), N, v3)
            i = u32(i + u32(cuda.blockDim.x))

    @ir_inlined
    def fill_tables(smem, cb, tid):
        """The group table (pairs or quads in the MMA's type) and the E4M4 table."""
        fill_table(smem, cb, tid)
        i = tid
        while e4m4 and i < u32(256):
            smem[u32(u32(SCALES) + i)] = u32_as_f32(pair_bits(e4m4_decode(np.uint8(i))))
            i = u32(i + u32(cuda.blockDim.x))

    def mma_gemv(A, packed, absmax, cb, out, N, n_kb, M, offsets):
        smem = cuda.shared.array(0, np.float32)    # [group table][E4M4 table][codebook][partial C tiles]
        tid = u32(cuda.threadIdx.x)
        nkb = u32(n_kb)
        if PDL:                     # the next kernel may start now: it waits for this one in griddep_wait
            griddep_launch_dependents()
        if EARLY_LOADS:
            stage_codebook(smem, cb, tid, u32(CODEBOOK), u32(len(cb)))   # the fill's one global read goes out first
        if GROUPED and PDL:         # the offsets are the router's output, and the weights to load follow from
            fill_tables(smem, cb, tid)      # them: before the wait only the tables (the plain kernel loads first)
            griddep_wait()
        if GROUPED:                 # this CTA's expert (its blocks start at `first`) and its rows
            expert = slot_expert(offsets)
            if expert < 0:          # whole CTA: no barrier is skipped by a subset
                return
            row0 = u32(offsets[expert])
            rows = u32(offsets[expert + 1]) - row0
            if rows == u32(0):
                return
            first = u32(u32(expert) * u32(N) * nkb)
            if SILU_PAIRS:                                        # (the same into an [T, N / 2] output)
                if rows > u32(TOKENS) and cuda.blockIdx.x == 0:
                    half = u32(u32(N) // u32(2))
                    mark_rows(out, u32(u32(row0 + u32(TOKENS)) * half), u32((rows - u32(TOKENS)) * half), tid)
            elif rows > u32(TOKENS) and cuda.blockIdx.x == 0:     # more rows than the tiles take: NaN, never
                nan = u32_as_f32(u32(0x7FC00000))                 # silently wrong (the plan refuses them
                i = tid                                           # when it can see the offsets)
                while i < u32((rows - u32(TOKENS)) * u32(N)):
                    out[u32(u32(row0 + u32(TOKENS)) * u32(N) + i)] = np.float16(nan) if f16_out else nan
                    i = u32(i + u32(cuda.blockDim.x))
            m = min(rows, u32(TOKENS))
        else:
            row0 = u32(0)
            first = u32(0)
            m = u32(M)
        lane = tid % u32(WARP)
        warp = tid // u32(WARP)
        g = lane >> u32(2)
        t = lane & u32(3)
        kw = u32((nkb + u32(KB_WARP - 1)) // u32(KB_WARP))     # K-warps per slice
        if SPLIT_K:                 # this CTA's share of them: split blockIdx.y of gridDim.y (grouped: z)
            shares = u32(cuda.gridDim.z) if GROUPED else u32(cuda.gridDim.y)
            kw = u32((kw + shares - u32(1)) // shares)
        slices = u32(u32(cuda.blockDim.x) // u32(u32(WARP) * kw))
        sl = u32(warp // kw)
        w = u32(warp - sl * kw)
        share = u32(cuda.blockIdx.z) if GROUPED else u32(cuda.blockIdx.y)
        wk = u32(share * kw + w) if SPLIT_K else w                  # the warp's place along K
        kb0 = u32(wk * u32(KB_WARP) + u32(TSTRIDE) * t)         # this lane's first block
        group_cols = u32(slices * u32(STRIP))
        col0 = u32(sl * u32(STRIP) + g)                          # the lane's first column in a group
        n_groups = u32((u32(N) + group_cols - u32(1)) // group_cols)
        grp = u32(cuda.blockIdx.x)
        grid = u32(cuda.gridDim.x)
        last = u32(first + u32(N) * nkb - u32(KB_LANE if BSTRIDE == 1 else 1))   # the last block (pair) a lane loads

        # ---- 1. the first strips' weight loads, two iterations ahead (three buffers) --------------------
        codes_a = cuda.local.array((2, CODE_WORDS), np.uint32)
        codes_b = cuda.local.array((2, CODE_WORDS), np.uint32)
        codes_c = cuda.local.array((2, CODE_WORDS), np.uint32)
        am_a = cuda.local.array((2, KB_LANE), absmax_t)
        am_b = cuda.local.array((2, KB_LANE), absmax_t)
        am_c = cuda.local.array((2, KB_LANE), absmax_t)
        load_first(packed, absmax, first, u32(grp * group_cols + col0), kb0, last, nkb, codes_a, am_a)
        load_first(packed, absmax, first, u32((grp + grid) * group_cols + col0), kb0, last, nkb, codes_b, am_b)

        # ---- 2. the group table and the E4M4 table (grouped PDL: filled above) -------------------------
        if not (GROUPED and PDL):
            fill_tables(smem, cb, tid)
        table = shared_addr(smem)
        if EARLY_BARRIER:           # the tables' barrier before the wait (see EARLY_BARRIER)
            cuda.syncthreads()
        if PDL and not GROUPED:     # the activations (and out) may be the previous kernel's: wait for it
            griddep_wait()
        # ---- 3. token g's (and g + 8's) activations of the lane's two blocks, as B fragments (zeros past M, K)
        bx = cuda.local.array((TILES, KB_LANE, MMAS_PER_BLOCK, 2), np.uint32)
        for j in range(TILES):
            tok = u32(g + u32(N8 * j))
            for b in range(KB_LANE):
                # blocks t and t + 4 of the warp's 8 at both k (k = 2: see A_SWAP; k = 4 keeps its own expression of
                # the same blocks, whose PTX every k = 4 measurement ran), so a quad's four loads of a row span 256 bytes
                if A_SWAP:
                    kb = u32(u32(wk * u32(KB_WARP)) + t + u32(4 * b))
                else:
                    kb = u32(kb0 + u32(b * BSTRIDE))
                live = tok < m and kb < nkb
                base = u32(u32(u32(row0 + tok) * nkb + kb) * u32(A_WORDS)) if live else u32(0)
                for q in range(A_WORDS // 4):      # words 4q .. 4q+3: MMAs 2q and 2q + 1
                    w4 = load_a(A, u32(base + u32(4 * q)))
                    for h in range(4):
                        bx[j, b, 2 * q + h // 2, h % 2] = w4[h] if live else u32(0)
            if A_SWAP:      # k = 2: lane t needs blocks 2t, 2t + 1; block 2t + c is in quad lane (2t + c) % 4, in its
                src0 = u32((lane & u32(~3 & 0xFFFFFFFF)) | ((u32(2) * t) & u32(3)))        # first set if t < 2,
                src1 = u32((lane & u32(~3 & 0xFFFFFFFF)) | ((u32(2) * t + u32(1)) & u32(3)))   # else its second
                hi = t >= u32(2)
                for s in range(MMAS_PER_BLOCK):
                    for h in range(2):
                        x0, x1 = i32(bx[j, 0, s, h]), i32(bx[j, 1, s, h])     # (shfl_sync takes signed words)
                        a0 = cuda.shfl_sync(FULL_MASK, x0, src0)
                        a1 = cuda.shfl_sync(FULL_MASK, x1, src0)
                        c0 = cuda.shfl_sync(FULL_MASK, x0, src1)
                        c1 = cuda.shfl_sync(FULL_MASK, x1, src1)
                        bx[j, 0, s, h] = u32(a1 if hi else a0)
                        bx[j, 1, s, h] = u32(c1 if hi else c0)
        lane_off = u32((lane % u32(COPIES)) * u32(ENTRY))
        if not EARLY_BARRIER:       # (the activation loads above overlap the barrier)
            cuda.syncthreads()

        part = u32(u32(PART) + (sl * kw + w) * u32(TILE))   # this warp's partial tile (+ flip + slot r)
        slot = u32(slices * kw * u32(TILE))                 # floats of one strip's tiles; a half holds BATCH
        flip = u32(0)
        acc = cuda.local.array(ACC, np.float32)
        r = u32(0)                                          # (the strip's slot in a counted batch)
        # ---- 4. the persistent loop, unrolled three times (pair_gemv says why): a batch of BATCH strips a barrier
        ahead = u32(u32(2) * grid * group_cols)
        while grp < n_groups:
            load_strip(packed, absmax, first, u32(grp * group_cols + ahead + col0), kb0, last, nkb, codes_c, am_c)
            decode_strip(smem, table, lane_off, codes_a, am_a, bx, acc)
            half = end_strip(smem, table, acc, lane, tid, part, flip, slot, batch_slot(r, 0), grp, grid, n_groups,
                             slices, kw, group_cols, out, N, m, row0)
            r = next_slot(r, half, flip)
            flip = half
            grp = u32(grp + grid)
            if grp >= n_groups:
                break
            load_strip(packed, absmax, first, u32(grp * group_cols + ahead + col0), kb0, last, nkb, codes_a, am_a)
            decode_strip(smem, table, lane_off, codes_b, am_b, bx, acc)
            half = end_strip(smem, table, acc, lane, tid, part, flip, slot, batch_slot(r, 1), grp, grid, n_groups,
                             slices, kw, group_cols, out, N, m, row0)
            r = next_slot(r, half, flip)
            flip = half
            grp = u32(grp + grid)
            if grp >= n_groups:
                break
            load_strip(packed, absmax, first, u32(grp * group_cols + ahead + col0), kb0, last, nkb, codes_b, am_b)
            decode_strip(smem, table, lane_off, codes_c, am_c, bx, acc)
            half = end_strip(smem, table, acc, lane, tid, part, flip, slot, batch_slot(r, 2), grp, grid, n_groups,
                             slices, kw, group_cols, out, N, m, row0)
            r = next_slot(r, half, flip)
            flip = half
            grp = u32(grp + grid)

    return jit_kernel(mma_gemv, spec.max_registers)


@lru_cache(maxsize=None)
def make_to_fragments_kernel(k):
    """Kernel(codes, absmax, fragments, frag_absmax, n_kb, n_blocks): one thread per block of a KbitCodes, which
    it copies to its fragment position (``formats.fragment_position``: the same function as the reference's)."""
    position = cuda.jit(device=True)(fragment_position)

    @jit_kernel
    def to_fragments_kernel(codes, absmax, fragments, frag_absmax, n_kb, n_blocks):
        blk = cuda.grid(1)
        if blk >= n_blocks:
            return
        pos = position(blk // n_kb, blk % n_kb, n_kb, k)
        for wd in range(k):
            fragments[pos * k + wd] = codes[blk * k + wd]
        frag_absmax[pos] = absmax[blk]

    return to_fragments_kernel


def to_fragments(kc, stream=None):
    """KbitCodes (``pair_gemv.to_codes`` makes one from a flat KbitWeight) -> KbitFragments on the device, once:
    the same blocks in this kernel's load order (N a multiple of 16, K of 256). ``reference.to_fragments`` is
    its twin, ``reference.from_fragments`` the exact inverse."""
    stream = _arrays.as_stream(stream)
    if isinstance(kc, KbitFragments):
        return device_weight(kc, KbitFragments, stream)
    if not isinstance(kc, KbitCodes):
        raise TypeError(f"to_fragments reads the code layout (KbitCodes), got {type(kc).__name__}: convert the "
                        "weight once with pair_gemv.to_codes(qw)")
    check_fragment_shape(*kc.shape)
    kc = device_weight(kc, KbitCodes, stream)
    frag = KbitFragments(cuda.device_array(kc.n_blocks * kc.k, np.uint32, stream=stream),
                         cuda.device_array(kc.n_blocks, kc.absmax.dtype, stream=stream),
                         kc.codebook, kc.k, kc.shape, kc.absmax_format)
    tpb = 256
    launch_step(Step(make_to_fragments_kernel(kc.k), -(-kc.n_blocks // tpb), tpb,
                     (kc.packed, kc.absmax, frag.packed, frag.absmax, i32(kc.n_kblocks), i32(kc.n_blocks))), stream)
    return frag


def reads(M, K):
    """Whether a launch takes M rows on a code-layout weight with K columns (the activations must also be
    float16 or bfloat16); past ``SPLIT_KW`` K-warps it may split K (:func:`k_splits`)."""
    return 1 <= M <= MAX_TOKENS and K % K_STEP == 0


def k_splits(K, split=None, k=4, M=1):
    """(splits of K, K-warps a split) of a launch of M rows (a grouped launch: ``N8``) on K columns of ``k`` bits:
    ``split`` as asked (no split left empty), else about ``SPLIT_KW`` warps a split past ``SPLIT_KW`` K-warps
    (K > 4096), unless K <= ``MAX_K`` and the CTA's registers spill less than splitting costs
    (``UNSPLIT_UNDER_CAP``); three or four token tiles (M > 16): at most ``WIDE_KW`` a split."""
    kw = -(-(K // BLOCK) // KB_WARP)
    if split is None and tiles_for(M) >= WIDE_TILES:
        split = -(-kw // WIDE_KW)
    elif split is None:
        whole = M <= UNSPLIT_UNDER_CAP.get(k, 0)
        split = 1 if kw <= SPLIT_KW or (whole and kw <= MAX_KW) else -(-kw // SPLIT_KW)
    elif isinstance(split, bool) or not isinstance(split, (int, np.integer)) or not 1 <= split <= kw:
        raise ValueError(f"split must be an integer from 1 to K / 256 rounded up ({kw}), got {split!r}")
    per = -(-kw // int(split))
    if per > MAX_KW:
        raise ValueError(f"split={split} leaves {per} K-warps a CTA; at most {MAX_KW} (K <= {MAX_K} a split)")
    return -(-kw // per), per


def tiles_for(M):
    """The n8 token tiles a launch of M rows takes: one to M = 8, two to 16, three to 24, four to 32."""
    return max(1, -(-M // N8))


def part_bytes(slices, kw, tiles=1, batch=BATCH):
    """Dynamic shared bytes after the group table: the E4M4 table, the codebook and the double-buffered
    partial C tiles [2, batch, slices, kw, tiles, 32 lanes, 4] float32 (a warp's 16 x 8 C tile a token tile, in fragment
    order)."""
    return 4 * (PART - TABLE_FLOATS) + 2 * batch * slices * kw * STRIP * N8 * tiles * 4


def cta_shared(slices, kw, tiles=1, batch=BATCH):
    """A CTA's dynamic shared bytes: the group table and :func:`part_bytes`."""
    return TABLE_BYTES + part_bytes(slices, kw, tiles, batch)


def plan(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, cta_warps=None, pdl=False, silu_pairs=False,
         split=None, workspace=None):
    """Checked inputs bound into a :class:`launch.Plan`. ``kc``: KbitCodes (k = 2, 4; K a multiple of 64;
    ``pair_gemv.to_codes`` makes one from a flat KbitWeight) or KbitFragments (:func:`to_fragments`;
    N a multiple of 16, K of 256). A: float16 or
    bfloat16 (``bf16=True``, int16 bits) [M, K] or [K], M = 1..32 (float32 A: use ``tensor_gemm`` or
    ``pair_gemv``). ``cta_warps`` overrides ``DEFAULTS``; ``pdl`` and ``silu_pairs`` (an [M, N / 2] output): see
    ``pair_gemv.plan``. ``split``: K's splits (:func:`k_splits`; by default past K = 8192, and past 4096 where
    a whole CTA would spill): then the sums go into
    ``workspace`` (a zeroed float32 device array of >= M*N values, left zeroed, or a ``dispatch.Workspace`` to draw
    it from; allocated if not given) and a second
    launch (``core.finish_step``; with ``silu_pairs``, its SiLU epilogue) writes ``out``."""
    stream = _arrays.as_stream(stream)
    if not isinstance(kc, (KbitCodes, KbitFragments)):
        raise TypeError(f"mma gemv reads the code layout (KbitCodes) or the fragment layout (KbitFragments), got "
                        f"{type(kc).__name__}: convert the weight once with pair_gemv.to_codes(qw) (or to_fragments)")
    kc = device_weight(kc, type(kc), stream)
    N, K = kc.shape
    _arrays.check_silu_pairs(silu_pairs, N)
    Ad, a_src, M, out = _arrays.gemv_io(A, (N // 2, K) if silu_pairs else kc.shape, out, out_dtype, bf16, stream,
                                        "mma gemv", MAX_TOKENS)
    _check_inputs(a_src, K)
    n_kb = K // BLOCK
    _arrays.check_aligned(Ad, 16, "A")
    splits, _ = k_splits(K, split, kc.k, M)
    spec = MmaGemvSpec(kc.k, kc.absmax_format, a_src, out.dtype, pdl, tiles=tiles_for(M),
                       fragments=isinstance(kc, KbitFragments), silu_pairs=silu_pairs)
    ws = split_sums(workspace, M * N, stream) if splits > 1 else None     # (split: the kernel writes the sums)
    args = (_arrays.flat_view(Ad, np.uint32), kc.packed, kc.absmax, kc.codebook,
            _arrays.flat_view(out) if ws is None else ws, i32(N), i32(n_kb), i32(M), unused_i32())
    if ws is None:
        return Plan([_step(spec, args, N, K, cta_warps)], Ad, out, stream)
    return Plan(_split_steps(spec, args, N, K, cta_warps, splits, ws, out, M), Ad, out, stream, ws)


def _split_steps(spec, args, N, K, cta_warps, splits, ws, out, rows, slots=None, active=None):
    """A split launch's two steps: the CTAs add plain sums into the workspace ``ws`` (``args``' output), then the
    finishing launch writes ``out``'s rows x N values (or rows x N / 2: the SiLU epilogue of ``spec.silu_pairs``)."""
    main = _step(replace(spec, out_dtype="float32", split_k=True, silu_pairs=False), args, N, K, cta_warps,
                 slots=slots, splits=splits, active=active)
    return [main, finish_step(ws, out, rows * N // 2, N, pdl=spec.pdl) if spec.silu_pairs
            else finish_step(ws, out, rows * N, pdl=spec.pdl)]


def _check_inputs(a_src, K):
    """The activations' type and the weight's K that every launch needs (plain and grouped alike)."""
    if a_src not in MMA_TYPES:
        raise ValueError(f"mma gemv takes float16 or bfloat16 activations (the MMA's types), got {a_src}")
    if not reads(1, K):
        raise ValueError(f"mma gemv handles K a multiple of {K_STEP}, got K={K}")


def _step(spec, args, N, K, cta_warps=None, slots=None, splits=1, active=None):
    """The launch: S slices of KW = K / 256 warps (S from ``cta_warps``), a persistent grid over the column
    groups of one weight, or (grouped) over each of ``slots`` experts' column groups, of which about ``active``
    have rows (:func:`core.slot_share`), or (split-K) over each of ``splits`` shares of the K-warps (KW a share;
    grouped: grid (groups, slots, splits))."""
    kw = -(-(-(-(K // BLOCK) // KB_WARP)) // splits)     # ceil(ceil(K / 256) / splits)
    aim = cta_warps or CTA_WARPS_BY_K_TILES.get((spec.k, spec.tiles), DEFAULTS["cta_warps"])
    most_slices = max(1, min(aim // kw, -(-N // STRIP)))
    if cta_shared(most_slices, kw, spec.tiles, spec.batch) > SHARED_PER_CTA:
        spec = replace(spec, batch=1)                      # K > 6656 with two tiles: a barrier per strip
    spec, kern, regs, max_threads = fit_threads(make_mma_gemv_kernel, spec, args, kw * WARP)
    slices = min(most_slices, max(1, max_threads // (kw * WARP)))
    rows = (slots or 1) * splits                           # grid.y: experts, or shares of K; grouped split: y x z
    one_weight = rows == 1 and slots is None
    if one_weight and cta_warps is None:
        slices = busiest_sm_slices(N, kw, slices, regs, spec)
    n_groups = -(-N // (slices * STRIP))
    shared = cta_shared(slices, kw, spec.tiles, spec.batch)
    threads = slices * kw * WARP
    resident = persistent_grid(n_groups * rows, threads, regs, shared)
    # grid.x: every resident CTA for one weight; else the resident CTAs shared among the rows, rounded down (or more:
    # see slot_share)
    x = (resident if one_weight else row_share(n_groups, rows, resident) if active is None else
         slot_share(n_groups, rows, resident, active * splits))
    if slots is None:               # one weight, whole or split in K: a CTA walks ceil(n_groups / x) strips
        batch = long_batch(n_groups, x, slices, kw, regs, spec, rows)
        if batch != spec.batch:     # (its own build, kept if its registers leave the launch as it is)
            long_spec, long_kern, long_regs, _ = fit_threads(make_mma_gemv_kernel, replace(spec, batch=batch), args,
                                                             threads)
            long_shared = cta_shared(slices, kw, spec.tiles, batch)
            if persistent_grid(n_groups * rows, threads, long_regs, long_shared) == resident:
                spec, kern, shared = long_spec, long_kern, long_shared
    grid = x if one_weight else (x, slots, splits) if slots and splits > 1 else (x, rows)
    return Step(kern, grid, threads, args, shared, spec.pdl)


def busiest_sm_slices(N, kw, most, regs, spec):
    """The slices a CTA (1..``most``) whose persistent launch puts the fewest strips on its busiest SM
    (:func:`core.busiest_sm_items`); of equals the most (fewer CTAs fill the table). At 2048x5120 two slices make 160
    groups of two strips for 132 CTAs (4 strips on the busiest SM), one slice 320 strips for 264 (3): one ran 3-10%
    faster at M = 1..8 (but k = 2 on the code layout: -2.6..+1.5%); at 2048x4096 (2 strips either way) two ran up to
    9% faster (H100, benchmarks/README.md, "Eighty-sixth session")."""
    def busiest(s):
        groups = -(-N // (s * STRIP))
        shared = cta_shared(s, kw, spec.tiles, spec.batch)
        return busiest_sm_items(groups, s, persistent_grid(groups, s * kw * WARP, regs, shared))
    return min(range(most, 0, -1), key=busiest)      # (min keeps the first of equals: the most slices)


def long_batch(n_groups, grid, slices, kw, regs, spec, rows=1):
    """The batch (strips a barrier) of a persistent launch of ``grid`` CTAs (a row's, of ``rows``: K's shares) over
    ``n_groups`` strip groups: BATCH, or, with one token tile, of LONG_BATCHES the one that gives the busiest CTA
    (ceil(n_groups / grid) groups) the fewest barriers, if fewer than BATCH's, whose partial tiles fit in the shared
    memory without fewer CTAs an SM (of equals the smallest). At 4096x14336 a CTA walks 7 strips: 3 barriers with
    BATCH, 1 with 8; the llama3-8b down projection (14336x4096, 4 shares of 33 CTAs) 8. Two token tiles keep BATCH:
    there batch 4 (2 barriers) ran 3-6% slower in three of four builds (see LONG_BATCHES). Plans of one weight ask,
    whole or split in K (:func:`_step`); grouped launches keep their batch."""
    if spec.batch != BATCH or spec.tiles > 1:
        return spec.batch
    threads = slices * kw * WARP
    resident = persistent_grid(n_groups * rows, threads, regs, cta_shared(slices, kw, spec.tiles))
    walks = -(-n_groups // grid)
    best, fewest = BATCH, -(-walks // BATCH)
    for batch in LONG_BATCHES:
        shared = cta_shared(slices, kw, spec.tiles, batch)
        if shared > SHARED_PER_CTA or persistent_grid(n_groups * rows, threads, regs, shared) < resident:
            break
        if -(-walks // batch) < fewest:
            best, fewest = batch, -(-walks // batch)
    return best


def plan_grouped(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False,
                 max_tokens=None, cta_warps=None, pdl=False, silu_pairs=False, split=None, workspace=None):
    """Checked inputs of :func:`grouped_gemv` bound into a :class:`launch.Plan` (one launch, or none when there
    are no rows or experts). ``pdl``: a programmatic dependent launch (sm_90) whose CTAs fill their tables
    before they wait for the kernel before it; the offsets, activations and weight loads come after the wait
    (which expert a CTA runs, and so which weights it loads, is the router's output). ``silu_pairs``: every
    expert's gate/up rows interleaved, out [T, N / 2] (see ``pair_gemv.plan``). ``split``: K's splits
    (:func:`k_splits`; by default as a plain launch of 8 rows): each slot's CTAs then add their share's sums into
    ``workspace`` (zeroed float32, >= T*N values, left zeroed, or a ``dispatch.Workspace``; allocated if not given)
    and a second launch
    (``core.finish_step``, with the SiLU epilogue if asked) writes ``out``."""
    stream = _arrays.as_stream(stream)
    Ad, a_src, T, offs, experts = check_grouped(A, experts, expert_offsets, bf16, stream)
    if experts.layout not in ("codes", "fragments"):
        raise ValueError("mma gemv reads code-layout experts: stack_experts of pair_gemv.to_codes(...) weights, or of "
                         f"to_fragments(...) ones (got the {experts.layout} layout)")
    E = experts.n_experts
    N, K = experts.expert_shape
    _check_inputs(a_src, K)
    splits, _ = k_splits(K, split, experts.k, N8)
    if max_tokens is None and isinstance(expert_offsets, np.ndarray):
        max_tokens = max_tokens_per_expert(expert_offsets, T)
    if max_tokens is not None and max_tokens > N8:
        raise ValueError(f"the grouped mma gemv handles up to {N8} tokens per expert, got {max_tokens}")
    _arrays.check_silu_pairs(silu_pairs, N)
    out_dtype = _arrays.output_dtype(out, out_dtype)
    out = _arrays.output(out, "out", (T, N // 2 if silu_pairs else N), out_dtype, stream)
    _arrays.check_aligned(Ad, 16, "A")
    if T * max(K, N) >= 2**32 or E * N * (K // BLOCK) >= 2**32:
        raise ValueError("the grouped mma gemv uses 32-bit indices: T*K, T*N and E*N*K/32 must stay < 2**32")
    if T == 0 or E == 0:
        return Plan([], Ad, out, stream)
    spec = MmaGemvSpec(experts.k, experts.absmax_format, a_src, out.dtype, pdl, grouped=True,
                       fragments=experts.layout == "fragments", silu_pairs=silu_pairs)
    ws = split_sums(workspace, T * N, stream) if splits > 1 else None     # (rows past an expert's 8: NaN there too)
    args = (_arrays.flat_view(Ad, np.uint32), experts.packed, experts.absmax, experts.codebook,
            _arrays.flat_view(out) if ws is None else ws, i32(N), i32(K // BLOCK), i32(0), offs)
    # the slots with rows: counted where the offsets are on the host, else expected (a CUDA graph's router output)
    active = (int((np.diff(expert_offsets) > 0).sum()) if isinstance(expert_offsets, np.ndarray) else
              expected_active(E, T))
    if ws is None:
        return Plan([_step(spec, args, N, K, cta_warps, slots=min(E, T), active=active)], Ad, out, stream)
    return Plan(_split_steps(spec, args, N, K, cta_warps, splits, ws, out, T, slots=min(E, T), active=active), Ad,
                out, stream, ws)


def grouped_gemv(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False,
                 max_tokens=None):
    """MoE experts on the tensor cores in one launch: out[t] = A[t] @ W_e^T for the rows t of each expert e.

    A: [T, K] rows sorted by expert (float16, or bfloat16 bits with ``bf16=True``); expert_offsets: int32
    [E + 1] (host or device; expert e's rows are offsets[e] .. offsets[e+1]-1, at most 8 each: more are
    refused when the offsets are a NumPy array or ``max_tokens`` says so, and come out NaN otherwise);
    experts: KbitExperts in the code layout (``stack_experts`` of ``pair_gemv.to_codes`` weights; k = 2, 4,
    K a multiple of 64; past 4096 (k = 4) or 8192 (k = 2) split in K, with a float32 workspace and a second launch:
    :func:`plan_grouped`) or the fragment layout (of :func:`to_fragments` weights). Returns out [T, N]. With device
    offsets and ``out`` given (and K unsplit) it allocates nothing, so it can be captured into a CUDA graph."""
    return plan_grouped(A, experts, expert_offsets, out, stream, out_dtype, bf16, max_tokens).launch()


def gemv(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False):
    """C[M, N] = A[M, K] @ W^T for M = 1..32 on the tensor cores, W a KbitCodes (k = 2, 4; K a multiple of 64;
    split past 8192, or past 4096 where a whole CTA would spill: :func:`plan`) or a KbitFragments
    (:func:`to_fragments`). A: float16 (bfloat16 as int16 bits with ``bf16=True``) [M, K] or [K]; returns a device
    array [M, N] (or [N]) of ``out_dtype`` (float16 or float32), or writes into ``out``."""
    return plan(A, kc, out, stream, out_dtype, bf16).launch()


def prepare(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, pdl=False, split=None):
    """A :class:`launch.Prepared` (one driver launch per ``run()``); see ``pair_gemv.prepare``."""
    return plan(A, kc, out, stream, out_dtype, bf16, pdl=pdl, split=split).prepare()


def ptx_specs():
    """Every k with float16 A and E4M4 absmax (plain with one and two token tiles, pdl, grouped, grouped pdl,
    the fragment layout with one and two tiles and grouped, a sum per strip with two tiles: K > 6656, counted batches
    (:func:`long_batch`) of 8 strips (fragments; the silu_pairs PDL build; split-K PDL), the silu_pairs
    epilogue plain and grouped, split-K with one tile, with two as a PDL launch and grouped, with three and four), and
    each other choice with every k."""
    variants = [dict(), dict(tiles=2), dict(pdl=True), dict(grouped=True), dict(grouped=True, pdl=True),
                dict(fragments=True), dict(fragments=True, tiles=2), dict(fragments=True, grouped=True),
                dict(tiles=2, batch=1), dict(fragments=True, batch=8), dict(pdl=True, silu_pairs=True, batch=8),
                dict(split_k=True, out_dtype="float32", pdl=True, batch=8),
                dict(a_type="bfloat16"),
                dict(absmax_format="fp32"),
                dict(out_dtype="float32"),
                dict(pdl=True, silu_pairs=True), dict(grouped=True, pdl=True, fragments=True, silu_pairs=True),
                dict(split_k=True, out_dtype="float32"), dict(split_k=True, out_dtype="float32", tiles=2, pdl=True),
                dict(split_k=True, out_dtype="float32", grouped=True),
                dict(tiles=4), dict(split_k=True, out_dtype="float32", tiles=3),
                dict(split_k=True, out_dtype="float32", tiles=4)]
    return [MmaGemvSpec(k=k, **v) for k in CODES_K for v in variants]


def argtypes(spec):
    from numba import types as t
    return (t.uint32[::1], t.uint32[::1], t.uint8[::1] if spec.absmax_format == "e4m4" else t.float32[::1],
            t.float32[::1], NUMBA_TYPES[spec.out_dtype], t.int32, t.int32, t.int32, t.int32[::1])


def kernel_specializations():
    """(name, kernel, argument types) for the PTX checks: :func:`ptx_specs` and the fragment conversion."""
    from numba import types as t
    return [(spec.name, make_mma_gemv_kernel(spec), argtypes(spec)) for spec in ptx_specs()] + [
        (f"to_fragments k={k}", make_to_fragments_kernel(k),
         (t.uint32[::1], t.uint8[::1], t.uint32[::1], t.uint8[::1], t.int32, t.int32)) for k in CODES_K] + [
        (f"finish_step out={out} silu={silu} pdl={pdl}", make_finish_kernel(out, silu, pdl),
         (t.float32[::1], NUMBA_TYPES[out], t.int32, t.int32))
        for out in ("float16", "float32") for silu in (False, True) for pdl in (False, True)]
