"""Tensor-core GEMM: C[M, N] = A[M, K] @ W[N, K]^T for any M, with tiled kbit weights (k = 2..5) or the code layout.

Design (numbers in benchmarks/README.md):

* **A CTA of 4 warps computes a BM x 128 tile of C** (BM = 16 * MT rows, one column tile of the tiled
  layout) over a range of K tiles of 64 (two kbit blocks each). Warp w owns columns 32w .. 32w+31:
  four n8 tiles of ``mma.sync.m16n8k16`` (fp16 or bf16 in, float32 accumulate).
* **Everything a K tile needs goes global -> shared with ``cp.async``** (16 bytes a copy, no registers):
  A's rows (zero-filled past M and K), and the tile's plane words and absmax bytes, which the tiled
  layout stores contiguously, into a ring of 2 or 3 stages (``STAGES_FOR_MT``; one barrier per tile)
  that keeps 1-2 K tiles in flight while the MMAs run on another. Copies instead of loads into
  registers: a register double buffer held 32 more registers. (A 4-stage ring measured up to 8% slower
  at MT = 1, 2: Nsight shows the warps waiting on their own shared-load and ALU dependency chains, ~5
  cycles per instruction at 10 warps per SM, not on DRAM.)
  Staged A rows are padded to 72 halves (144 bytes): the 8 row addresses of one ``ldmatrix`` then start
  in 8 different 4-bank groups (conflict-free). ``ldmatrix.x4`` yields the A fragment of an m16n8k16 MMA
  in one instruction.
* **B fragments come straight from the bit planes.** Lane (g, t) = (lane // 4, lane % 4) needs elements
  2t, 2t+1 and 2t+8, 2t+9 (and +16) of column g's block: bits 2t, 2t+1 of every byte of each plane
  word. Masking plane b with ``0x03030303 << 2t`` and rotating it left by 2b lays the k planes side by
  side, so bits 8q+2t .. 8q+2t+2k-1 (mod 32) of their OR are the 2k-bit "pair code" of elements
  8q+2t, 8q+2t+1. One more rotation puts code q times 4 at bits 2.. of the word rotated by 8q; a
  ``lop3`` masks it and ORs in the base of a shared table of 2^(2k) codebook pairs (f16x2 words, aligned
  to its size) -- the lookup address in two instructions. k = 5: the fifth plane fills code bits 8, 9
  from a second word. The block's E4M4 absmax is decoded by a second shared table (256 f16x2 words) and
  one ``mul.rn.f16x2`` scales the pair. Every step is an explicit 32-bit instruction (``rotr``, ``lop3``):
  Numba's own integer shifts widen to 64 bits. The four lanes of a quad read the same plane words
  (``ld.shared.v4``/``v2``: one broadcast).
* **The code layout** (``KbitCodes``, k = 2, 4, K a multiple of 64; ``layout="codes"``; KbitLinear's default):
  a column's 2k words of a K tile are contiguous there too, so they are copied (zeros past N) into the
  same shared order. Lane (g, t)'s pair 8q+2t, 8q+2t+1 is one 2k-bit field at bit (8q+2t)k mod 32 of word
  (8q+2t)k / 32, so its table address is one ``rotr`` and one ``lop3``. The flat absmax gives a column 2
  bytes per K tile; one 4-byte copy per column per tile cost 15% of the time, so (``am_chunk``) one 16-byte copy
  per column brings 8 tiles' bytes (K a multiple of 512; or 4 or 2 tiles' bytes in 4-byte copies where a split
  of the K tiles is shorter: ``absmax_chunk``) into a ring of two chunks.
  Each K tile still reads 128 separate 32-byte pieces (the tiled layout: 4 KB in one piece), which
  keeps it 0-17% slower than the tiled gemm at M = 8, 16 (H200; benchmarks/README.md).
* **Split-K** over ``blockIdx.z`` when the C tiles are too few for the SMs: partial tiles are added
  atomically into a float32 workspace; a second small kernel writes the output and zeroes the
  workspace again, so a workspace stays ready for the next call (one launch at a time per workspace).

Precision: W's codebook values, absmax and their product are rounded to fp16 (bf16 with bf16 A), and
float32 A is converted to fp16 first; accumulation is float32 (tests/test_gemm.py states the tolerance).
Reference twin: ``reference.gemv`` (any M). Tests: ``tests/test_gemm.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .core import (FINISH_THREADS, check_grouped, device_weight, finish_step, max_tokens_per_expert,  # noqa: F401
                   new_workspace, sm_count, split_sums, unused_i32)        # (new_workspace: tensor_gemm's API)
from .device import WARP, e4m4_decode, f32_to_bf16_bits, i32, inlined, jit_kernel, stage_codebook, u32
from .formats import ABSMAX_FORMATS, CODES_K, K_BITS, TILE_K, TILE_N, KbitCodes, KbitWeight, check_k, padded_k
from .launch import NUMBA_TYPES, OUT_TYPES, Plan, Spec, Step, type_name
from .intrinsics import (LOP3_AND_OR, bmul2, cp_async4, cp_async16, cp_async_commit, cp_async_wait,
                         f16x2_as_u32, hmul2, ldmatrix_x4, lds64, lds128, lds_u32, lop3, mma_bf16, mma_f16, rotr,
                         shared_addr, u32_as_f32)

WARPS = 4
THREADS = WARPS * WARP
BN = TILE_N                      # 128 columns per CTA: one tile of the tiled layout
BK = TILE_K                      # 64 = two kbit blocks per K step
MMA_M, MMA_N = 16, 8
N_SUB = BN // WARPS // MMA_N     # 4 n8 MMA tiles per warp
ROW_WORDS = BK // 2 + 4          # staged A row: 64 halves + 8 halves of padding (conflict-free ldmatrix)
CHUNKS_PER_ROW = BK // 8         # 16-byte cp.async copies per staged row
PAIR_MASK = 0x03030303           # bits 0 and 1 of every byte: one element pair per byte
E4M4_CODES = 256                 # entries of the absmax table: one per E4M4 byte
M_TILES = (1, 2, 4)              # MT: BM = 16 * MT rows of A per CTA
# K tiles in the shared ring per MT (the tiles ahead of the one in the MMAs are in flight). Measured on the
# H100 and H200 (benchmarks/runs/2026-11-22_h1?0_gemm_stages_sweep.txt): at MT = 1, 2, 2 stages were the best
# or within 0.3% of it and up to 8% faster than 4 (the kernel waits on its instruction chains, not on DRAM);
# at MT = 4, 3 was best.
STAGES_FOR_MT = {1: 2, 2: 2, 4: 3}
MMA_TYPES = ("float16", "bfloat16")
LAYOUTS = ("tiled", "codes")     # what the B operand is decoded from: bit planes or k-bit fields
# The code layout's E4M4 absmax in chunks: at the first K tile of a chunk of C tiles each column's 2C bytes come
# in one 16-byte cp.async (C = 8) or C / 2 4-byte ones, into a ring of two chunks. (One 4-byte copy per column per
# K tile cost 15% of the gemm's time at 4096x14336: 128 separate lines per tile; benchmarks/README.md.) A split
# starts at a chunk, so C = 8 alone cut the splits of the shapes whose split is under 8 K tiles (2048x512: 16 CTAs
# where the tiled gemm ran 128): the plan takes the largest C that keeps 3/4 of the splits (``absmax_chunk``).
AM_CHUNK_TILES = (8, 4, 2)       # C: K tiles a chunk (K a multiple of 64 C: a column's chunk is aligned)
CHUNK_RING_WORDS = 2 * BN * 4    # two chunks of 128 columns x 16 bytes (C < 8: the first 2C bytes of each 16)
SHARED_BUDGET = 46 * 1024        # static shared memory per CTA stays under the 48 KB limit
CODEBOOK_WORDS = 1 << max(K_BITS)  # the codebook staged in shared memory for the pair table (float32)


# ---- the m16n8k16 fragment index math (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane (g, t) =
#      (lane // 4, lane % 4). Plain functions that run in Python (the twins: tests/test_gemm.py checks them
#      against the PTX layout) and, jitted below, as the kernel's device functions.
def py_b_fragment(lane):
    """(column, first k) of the B values this lane holds: b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]. So a
    lane decodes elements 2t, 2t+1 (and +8, +16, +24) of column g's kbit block."""
    return lane >> i32(2), i32(2) * (lane & i32(3))


def py_c_fragment(lane):
    """(row, column) in a 16 x 8 C tile of this lane's accumulators c0, c1 (columns col, col + 1); c2, c3
    are the same columns of row + 8."""
    return lane >> i32(2), i32(2) * (lane & i32(3))


def py_a_fragment_word(lane, mt, kb, s):
    """Word offset, in a staged K tile, of the row address this lane gives ``ldmatrix.x4`` for the A fragment
    of m-tile ``mt`` and MMA k-step ``s`` of kbit block ``kb``: lanes 0-15 name rows 0-15 of the 16 x 16 A
    block at its columns 0-7, lanes 16-31 the same rows at columns 8-15; the four 8 x 8 matrices they
    load are then registers a0-a3 of mma.m16n8k16. A staged row is ROW_WORDS words of two halves."""
    return ((i32(16) * i32(mt) + (lane & i32(15))) * i32(ROW_WORDS)
            + i32(16) * i32(kb) + i32(8) * i32(s) + (lane >> i32(4)) * i32(4))


b_fragment = inlined(py_b_fragment)
c_fragment = inlined(py_c_fragment)
a_fragment_word = inlined(py_a_fragment_word)


def _absmax_words(absmax_format, layout, am_chunk=0):
    """Staged absmax words per K tile: tiled E4M4 stores a tile's 256 bytes contiguously (64 words); the
    code layout's flat absmax gives each column's 2 bytes in the 4-byte word that holds them (128 words),
    or none with ``am_chunk`` (a separate ring of AM_CHUNK_TILES tiles); float32 absmax: 2 words per column."""
    if absmax_format != "e4m4":
        return 2 * BN
    if layout == "codes":
        return 0 if am_chunk else BN
    return 2 * BN // 4


def _stage_words(k, MT, absmax_format, layout="tiled", am_chunk=0):
    """(words of one pipeline stage, words of the pair and absmax tables, the absmax chunk ring and the staged
    codebook)."""
    e4m4 = absmax_format == "e4m4"
    tables = (2 * (1 << (2 * k)) + (2 * E4M4_CODES if e4m4 else 2) + (CHUNK_RING_WORDS if am_chunk else 0)
              + CODEBOOK_WORDS)
    return MMA_M * MT * ROW_WORDS + 2 * BN * k + _absmax_words(absmax_format, layout, am_chunk), tables


def default_stages(k, MT, absmax_format, layout="tiled", am_chunk=0):
    """``STAGES_FOR_MT[MT]``, fewer if the ring would not fit ``SHARED_BUDGET`` (never below 2)."""
    stage, tables = _stage_words(k, MT, absmax_format, layout, am_chunk)
    return max(2, min(STAGES_FOR_MT[MT], (SHARED_BUDGET - 4 * tables) // (4 * stage)))


@dataclass(frozen=True)
class GemmSpec(Spec):
    """The tensor-core GEMM's compile-time choices: the key of :func:`make_gemm_kernel`."""
    FAMILY = "gemm"
    k: int
    m_tile: int = 1                 # MT: 16-row MMA tiles per CTA (M_TILES)
    absmax_format: str = "e4m4"
    a_type: str = "float16"         # the MMA input type: float16 or bfloat16
    out_dtype: str = "float16"
    split_k: bool = True            # partial sums into a float32 workspace (grid.z > 1)
    grouped: bool = False           # the MoE variant
    stages: object = None           # K tiles in the shared ring; None: default_stages
    layout: str = "tiled"           # the weight's layout: 'tiled' (KbitWeight) or 'codes' (KbitCodes, k = 2, 4)
    am_chunk: int = 0               # codes, E4M4: the absmax in chunks of this many K tiles (AM_CHUNK_TILES; 0: none)

    def normalise(self):
        if self.m_tile not in M_TILES:
            raise ValueError(f"m_tile must be one of {M_TILES}, got {self.m_tile!r}")
        if self.absmax_format not in ABSMAX_FORMATS:
            raise ValueError(f"absmax_format must be one of {ABSMAX_FORMATS}, got {self.absmax_format!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        k = check_k(self.k)
        if self.layout == "codes" and (k not in CODES_K or self.grouped):
            raise ValueError(f"the gemm reads the code layout for k in {CODES_K}, not grouped; got k={k}, "
                             f"grouped={self.grouped}")
        chunk = int(self.am_chunk)
        if chunk not in (0,) + AM_CHUNK_TILES:
            raise ValueError(f"am_chunk must be 0 or one of {AM_CHUNK_TILES}, got {self.am_chunk!r}")
        if chunk and (self.layout != "codes" or self.absmax_format != "e4m4"):
            raise ValueError("am_chunk applies to the code layout with E4M4 absmax")
        stages = (default_stages(k, self.m_tile, self.absmax_format, self.layout, chunk)
                  if self.stages is None else int(self.stages))
        if stages < 2:
            raise ValueError(f"stages must be >= 2, got {stages}")
        if chunk and chunk < stages - 1:     # the copy of chunk c + 2 must come after the last use of chunk c
            raise ValueError(f"am_chunk={chunk} needs at most {chunk + 1} stages, got {stages}")
        return dict(k=k, m_tile=int(self.m_tile), a_type=type_name(self.a_type, "a_type", MMA_TYPES),
                    out_dtype=type_name(self.out_dtype, "out_dtype", OUT_TYPES), split_k=bool(self.split_k),
                    grouped=bool(self.grouped), stages=stages, layout=self.layout,
                    am_chunk=chunk)


@lru_cache(maxsize=None)
def make_gemm_kernel(spec):
    """Kernel(A_u32, packed, absmax_u32, codebook, out, workspace, M, N, K, tiles_per_split, offsets, tiles)
    for a :class:`GemmSpec`, 128 threads, grid (N / 128, ceil(M / (16 MT)), splits).

    k: bits; MT: 16-row MMA tiles per CTA (1, 2 or 4); a_type: 'float16' or 'bfloat16' (the MMA input
    type; A is read as uint32 words of two values); absmax_u32: the absmax array's bytes as uint32 words
    (E4M4 bytes or float32 bits: ``cp.async`` copies words); split_k: partial sums go atomically into the
    float32 workspace (grid.z > 1), else straight to ``out`` (workspace unused).
    grouped: the MoE variant (``grouped_gemm``). Row tile ``blockIdx.y`` is a work item: a binary search in
    ``tiles`` (tiles[e] = row tiles of the experts before e) finds its expert e, whose token rows are
    offsets[e] .. offsets[e+1]-1 of A and out and whose weights follow the previous experts' in
    packed/absmax. Not grouped: offsets and tiles are unused.
    stages: K tiles in the shared ring (default ``STAGES_FOR_MT[MT]``, fewer if ``SHARED_BUDGET`` says so)."""
    k, MT, absmax_format, a_type, out_dtype = spec.k, spec.m_tile, spec.absmax_format, spec.a_type, spec.out_dtype
    split_k, grouped, STAGES = spec.split_k, spec.grouped, spec.stages          # (checked by GemmSpec)
    codes = spec.layout == "codes"
    BM = MMA_M * MT
    N_PAIRS = 1 << (2 * k)
    TABLE_ALIGN = 4 * N_PAIRS                      # table base | (code * 4) == base + code * 4 ...
    TABLE_WORDS = 2 * N_PAIRS                      # ... for a base aligned inside a twice-as-large array
    X_PLANES = min(k, 4)                           # planes side by side in one word (k = 5: one more)
    LOW_MASK = ((1 << (2 * X_PLANES)) - 1) << 2    # code * 4 from planes 0..3
    HIGH_MASK = 3 << 10                            # code bits 8, 9 (plane 4) * 4
    WORDS = 2 * k                                  # plane words per column per K tile (two blocks)
    e4m4 = absmax_format == "e4m4"
    SCALE_WORDS = 2 * E4M4_CODES if e4m4 else 2    # the absmax table the same way (unused: 2 words)
    # One pipeline stage holds one K tile: [A rows | plane words | absmax words], each 16-byte aligned.
    A_WORDS = BM * ROW_WORDS
    W_WORDS = 2 * BN * k                           # 128 columns x 2 blocks x k plane words, contiguous
    AM_CHUNK = spec.am_chunk                       # C, or 0
    CHUNK_SHIFT = AM_CHUNK.bit_length() - 1        # kt >> CHUNK_SHIFT == kt // C
    AM_WORDS = _absmax_words(absmax_format, spec.layout, AM_CHUNK)   # their 256 absmax values (bytes or float32)
    STAGE_WORDS = A_WORDS + W_WORDS + AM_WORDS
    RING_WORDS = CHUNK_RING_WORDS if AM_CHUNK else 0
    assert (STAGE_WORDS, TABLE_WORDS + SCALE_WORDS + RING_WORDS + CODEBOOK_WORDS) == _stage_words(
        k, MT, absmax_format, spec.layout, AM_CHUNK)
    W_COPIES, AM_COPIES = W_WORDS // 4, AM_WORDS // 4
    # The code layout: a column's 2k words of a K tile are contiguous in it too, so they take 2k/4 16-byte
    # copies (k = 2: one, k = 4: two) into the same shared order as a tiled tile. The lane's pair
    # 8q+2t, 8q+2t+1 is the 2k-bit field at bit (8q+2t)k mod 32 of word (8q+2t)k / 32: one rotation puts
    # it, times 4, at bits 2.., and a lop3 masks it into the table base.
    COL_COPIES = 2 * k // 4
    CODE_MASK = ((1 << (2 * k)) - 1) << 2
    AM_BYTES = 1 if e4m4 else 4                    # absmax bytes per block
    SH_WORDS = STAGES * STAGE_WORDS + RING_WORDS   # the stages, then the absmax chunk ring (am_chunk)
    PENDING = STAGES - 2                           # groups left in flight when a tile's copies must be in
    CB_PENDING = STAGES - 1                        # ... when the codebook's (the group before the stages') must be in
    N_CODES = 1 << k
    bf16 = a_type == "bfloat16"
    mma = mma_bf16 if bf16 else mma_f16
    mul2 = bmul2 if bf16 else hmul2
    f16_out = np.dtype(out_dtype) == np.float16

    @inlined
    def half_bits(v):
        """float32 -> the 16-bit pattern of the MMA input type (round to nearest even)."""
        if bf16:
            return f32_to_bf16_bits(v)
        return f16x2_as_u32(np.float16(v), np.float16(0))

    @inlined
    def aligned_base(arr, align):
        """(shared address, word offset) of the first ``align``-byte boundary in ``arr``. (A shared array's
        ``alignment=4096`` did not give a 4096-byte aligned address on the H100: the k = 5 table broke.)"""
        a = shared_addr(arr)
        b = (a + u32(align - 1)) & ~u32(align - 1)
        return u32(b), i32((b - a) >> u32(2))

    @inlined
    def chunk_addr(sh_base, kt):
        """am_chunk: the shared byte address of the ring slot of K tile kt's absmax chunk (after the stages)."""
        return (sh_base + u32(4 * STAGES * STAGE_WORDS)
                + u32(16 * BN) * u32((kt >> i32(CHUNK_SHIFT)) & i32(1)))

    @inlined
    def stage(A, packed, absmax, sh, sh_base, kt, slot, w_tile, m0, m_end, N, K, tid):
        """cp.async K tile kt into pipeline slot ``slot``: rows m0 .. m0+BM-1 of A (zeros from m_end and
        K on), then the plane and absmax words of weight tile ``w_tile`` (contiguous in the tiled layout;
        the code layout: column tile ``w_tile``'s words of K tile kt, zeros from column N on)."""
        base = sh_base + u32(4) * u32(slot * i32(STAGE_WORDS))
        for i in range(MT):                        # BM * 8 copies = MT per thread
            c = tid + i32(i * THREADS)
            row = c // i32(CHUNKS_PER_ROW)
            ch = c % i32(CHUNKS_PER_ROW)
            grow = m0 + row
            gcol = kt * i32(BK) + ch * i32(8)
            ok = grow < m_end and gcol < K
            src = (grow * K + gcol) // i32(2) if ok else i32(0)
            dst = base + u32(4) * u32(row * i32(ROW_WORDS) + ch * i32(4))
            cp_async16(sh, dst, A, src, u32(16) if ok else u32(0))
        if codes:
            n_kb = K >> i32(5)
            for i in range(W_COPIES // THREADS):
                c = tid + i32(i * THREADS)
                col = w_tile * i32(BN) + c // i32(COL_COPIES)
                ok = col < N
                src = ((col * n_kb + i32(2) * kt) * i32(k) + i32(4) * (c % i32(COL_COPIES))) if ok else i32(0)
                cp_async16(sh, base + u32(4 * A_WORDS) + u32(16) * u32(c), packed, src, u32(16) if ok else u32(0))
            if AM_CHUNK:                           # first tile of a chunk: the chunk's 2C bytes per column
                if (kt & i32(AM_CHUNK - 1)) == i32(0):
                    col = w_tile * i32(BN) + tid
                    ok = col < N
                    src = ((col * n_kb + i32(2) * kt) >> i32(2)) if ok else i32(0)    # (absmax as uint32 words)
                    dst = chunk_addr(sh_base, kt) + u32(16) * u32(tid)
                    if AM_CHUNK == 8:
                        cp_async16(sh, dst, absmax, src, u32(16) if ok else u32(0))
                    else:
                        for w in range(AM_CHUNK // 2):
                            cp_async4(sh, dst + u32(4 * w), absmax, src + i32(w), u32(4) if ok else u32(0))
                return
            n_bytes = N * n_kb * i32(AM_BYTES)
            for i in range(AM_WORDS // THREADS):   # E4M4: the word holding the column's 2 bytes; fp32: 2 words
                c = tid + i32(i * THREADS)
                col = w_tile * i32(BN) + c // i32(AM_WORDS // BN)
                byte = (col * n_kb + i32(2) * kt) * i32(AM_BYTES) + i32(4) * (c % i32(AM_WORDS // BN))
                byte = byte & i32(-4)
                dst = base + u32(4 * (A_WORDS + W_WORDS)) + u32(4) * u32(c)
                if col < N and n_bytes - byte < i32(4):   # the array ends inside this word (E4M4 only): a
                    w = u32(0)                            # plain load (compute-sanitizer counts a shortened
                    for b in range(4):                    # cp.async as all 4 bytes read)
                        if byte + i32(b) < n_bytes:
                            w |= u32(absmax[byte + i32(b)]) << u32(8 * b)
                    sh[i32((dst - sh_base) >> u32(2))] = w
                else:
                    cp_async4(sh, dst, absmax, byte if col < N else i32(0), u32(4) if col < N else u32(0))
            return
        for i in range(-(-W_COPIES // THREADS)):
            c = tid + i32(i * THREADS)
            if W_COPIES % THREADS == 0 or c < i32(W_COPIES):
                cp_async16(sh, base + u32(4 * A_WORDS) + u32(16) * u32(c), packed,
                           w_tile * i32(W_WORDS) + i32(4) * c, u32(16))
        if tid < i32(AM_COPIES):
            cp_async16(sh, base + u32(4 * (A_WORDS + W_WORDS)) + u32(16) * u32(tid), absmax,
                       w_tile * i32(AM_WORDS) + i32(4) * tid, u32(16))

    @inlined
    def pair_addresses(wv, j, kb, pm, realign, tb, addr):
        """addr[q]: shared byte address in the pair table of this lane's element pair 8q+2t, 8q+2t+1 of
        block kb of its column j (pm[b]: the lane's mask of plane b once rotated left by 2b; realign:
        2t - 2 mod 32)."""
        x = lop3(wv[j, kb * k], pm[0], u32(0), LOP3_AND_OR)
        for b in range(1, X_PLANES):
            x = lop3(rotr(wv[j, kb * k + b], u32(32 - 2 * b)), pm[b], x, LOP3_AND_OR)
        x = rotr(x, realign)                       # code q * 4 at bits 2.. once rotated right by 8q
        if k == 5:                                 # plane 4 -> bits 10, 11 (code bits 8, 9, times 4)
            y = rotr(lop3(wv[j, kb * k + 4], pm[0], u32(0), LOP3_AND_OR), realign - u32(8))
        for q in range(4):
            xq = x if q == 0 else rotr(x, u32(8 * q))
            a = lop3(xq, u32(LOW_MASK), tb, LOP3_AND_OR)
            if k == 5:
                yq = y if q == 0 else rotr(y, u32(8 * q))
                a = lop3(yq, u32(HIGH_MASK), a, LOP3_AND_OR)
            addr[q] = a

    @inlined
    def code_addresses(wv, j, kb, rot0, rot1, tb, addr):
        """The code layout: addr[q] = the pair table address of this lane's pair 8q+2t, 8q+2t+1 of block kb
        of its column j (rot0, rot1: the rotations of fields at bit 2tk and 2tk + 16, minus 2)."""
        for q in range(4):
            w = wv[j, kb * k + (q * k) // 4]
            addr[q] = lop3(rotr(w, rot1 if (8 * q * k) % 32 else rot0), u32(CODE_MASK), tb, LOP3_AND_OR)

    def gemm_kernel(A, packed, absmax, cb, out, ws, M, N, K, tiles_per_split, offsets, tiles):
        table = cuda.shared.array(TABLE_WORDS, np.uint32)
        scales = cuda.shared.array(SCALE_WORDS, np.uint32)
        sh = cuda.shared.array(SH_WORDS, np.uint32, alignment=16)
        cbs = cuda.shared.array(CODEBOOK_WORDS, np.float32)        # the codebook, staged for the pair table
        tid = i32(cuda.threadIdx.x)
        lane = tid % i32(WARP)
        warp = tid // i32(WARP)
        g, two_t_i = b_fragment(lane)             # this lane's column g and element pair 2t, 2t+1
        n_tile = i32(cuda.blockIdx.x)
        n_tiles = N // i32(BN)
        k_tiles = (K + i32(BK - 1)) // i32(BK)
        if grouped:                                # work item -> (expert, its row tile): binary search
            n_experts = i32(offsets.shape[0] - 1)
            item = i32(cuda.blockIdx.y)
            if item >= tiles[n_experts]:           # the grid's bound on the work items overshoots
                return                             # (the whole CTA: no barrier is skipped by a subset)
            lo = i32(0)                       # invariant: tiles[lo] <= item < tiles[hi]
            hi = n_experts
            while hi - lo > i32(1):
                mid = (lo + hi) >> i32(1)
                if tiles[mid] <= item:
                    lo = mid
                else:
                    hi = mid
            m0 = i32(offsets[lo] + (item - tiles[lo]) * i32(BM))
            m_end = i32(offsets[lo + i32(1)])
            w_tile0 = i32(lo * n_tiles * k_tiles + n_tile)   # weight tiles of the experts before
        else:
            m0 = i32(i32(cuda.blockIdx.y) * i32(BM))
            m_end = M
            w_tile0 = n_tile
        kt0 = i32(i32(cuda.blockIdx.z) * tiles_per_split)
        kt1 = i32(min(kt0 + tiles_per_split, k_tiles))
        col0 = warp * i32(N_SUB * MMA_N) + g  # this lane's B column in the CTA tile (+ 8j)
        sh_base = shared_addr(sh)
        tb, t0 = aligned_base(table, TABLE_ALIGN)
        ts, s0 = aligned_base(scales, 4 * E4M4_CODES) if e4m4 else (u32(0), i32(0))

        # ---- the codebook, then the first STAGES - 1 K tiles in flight before anything else: the codebook first
        #      and as a copy into shared memory, so that its one read is not queued behind the tiles' copies and
        #      the table fill below waits for it alone (a plain load after the copies: ~10% of the code layout's
        #      stall samples at 2048x4096 M = 16 waited on it, benchmarks/README.md "Forty-fifth session") ----------
        stage_codebook(cbs, cb, tid, i32(0), i32(N_CODES))
        for s in range(STAGES - 1):
            if kt0 + i32(s) < kt1:
                kt = kt0 + i32(s)
                stage(A, packed, absmax, sh, sh_base, kt, i32(s), n_tile if codes else w_tile0 + kt * n_tiles,
                      m0, m_end, N, K, tid)
            cp_async_commit()

        cp_async_wait(CB_PENDING)                  # the codebook has landed (the tiles' copies may not) ...
        cuda.syncthreads()                         # ... everyone's share of it
        # ---- the pair table: tiled, code bit 2b (2b+1) is plane b of the even (odd) element; codes, the
        #      low (high) k bits are the even (odd) element's index ---------------------------------------
        for code in range(tid, N_PAIRS, THREADS):
            if codes:
                i0 = code & ((1 << k) - 1)
                i1 = code >> k
            else:
                i0 = 0
                i1 = 0
                for b in range(k):
                    i0 |= ((code >> (2 * b)) & 1) << b
                    i1 |= ((code >> (2 * b + 1)) & 1) << b
            table[t0 + code] = half_bits(cbs[i0]) | (half_bits(cbs[i1]) << u32(16))
        if e4m4:                                   # the absmax table: E4M4 byte -> its value twice, f16x2
            for c in range(tid, E4M4_CODES, THREADS):
                h = half_bits(e4m4_decode(np.uint8(c)))
                scales[s0 + c] = h | (h << u32(16))

        acc = cuda.local.array((MT, N_SUB, 4), np.float32)
        for mt in range(MT):
            for j in range(N_SUB):
                for r in range(4):
                    acc[mt, j, r] = np.float32(0.0)
        wv = cuda.local.array((N_SUB, WORDS), np.uint32)
        afr = cuda.local.array((MT, 2, 4), np.uint32)
        breg = cuda.local.array(4, np.uint32)
        addr = cuda.local.array(4, np.uint32)
        pm = cuda.local.array(X_PLANES, np.uint32)
        two_t = u32(two_t_i)                 # this lane's element pair sits at bits 2t, 2t+1
        for b in range(X_PLANES):                  # rotl(PAIR_MASK << 2t, 2b) (PAIR_MASK repeats per byte)
            pm[b] = rotr(u32(PAIR_MASK), u32(32 - 2 * b) - two_t)
        realign = two_t + u32(30)
        am_rot = u32(16) * u32(g & i32(1)) + u32(30)   # E4M4 byte of block 0, * 4
        rot0 = two_t * u32(k) + u32(30)            # codes: field at bit 2tk (+16) of a word, * 4
        rot1 = rot0 + u32(16)
        col_kb = cuda.local.array(N_SUB, np.int32)  # codes: the first block of column j, in absmax bytes
        for j in range(N_SUB):
            col_kb[j] = (n_tile * i32(BN) + col0 + i32(8 * j)) * (K >> i32(5))

        kt = kt0
        slot = i32(0)
        while kt < kt1:
            cp_async_wait(PENDING)                 # this thread's copies of tile kt have landed ...
            cuda.syncthreads()                     # ... and everyone's; the slot of tile kt-1 is free
            nxt = i32(kt + i32(STAGES - 1))
            if nxt < kt1:                          # refill that slot with tile kt + STAGES - 1
                refill = slot - i32(1) if slot > i32(0) else i32(STAGES - 1)
                stage(A, packed, absmax, sh, sh_base, nxt, refill, n_tile if codes else w_tile0 + nxt * n_tiles,
                      m0, m_end, N, K, tid)
            cp_async_commit()
            base = sh_base + u32(4) * u32(slot * i32(STAGE_WORDS))
            w_base = base + u32(4 * A_WORDS)
            am_base = base + u32(4 * (A_WORDS + W_WORDS))
            for j in range(N_SUB):                 # column col0 + 8j: 2k words at (col * 2k) * 4 bytes
                p = w_base + u32(4 * WORDS) * u32(col0 + i32(8 * j))
                if WORDS % 4 == 0:                 # k = 2, 4: 16-byte aligned
                    for q in range(WORDS // 4):
                        wv[j, 4 * q], wv[j, 4 * q + 1], wv[j, 4 * q + 2], wv[j, 4 * q + 3] = \
                            lds128(sh, p + u32(16 * q))
                else:                              # k = 3, 5: 8-byte aligned
                    for q in range(k):
                        wv[j, 2 * q], wv[j, 2 * q + 1] = lds64(sh, p + u32(8 * q))
            for kb in range(2):                    # the two kbit blocks of the tile = 2 x 2 MMA k-steps
                for mt in range(MT):
                    for s in range(2):
                        word = a_fragment_word(lane, mt, kb, s)
                        afr[mt, s, 0], afr[mt, s, 1], afr[mt, s, 2], afr[mt, s, 3] = \
                            ldmatrix_x4(sh, base + u32(4) * u32(word))
                for j in range(N_SUB):
                    col = col0 + i32(8 * j)
                    if codes:
                        code_addresses(wv, j, kb, rot0, rot1, tb, addr)
                    else:
                        pair_addresses(wv, j, kb, pm, realign, tb, addr)
                    # E4M4: the word holding the block's byte, and the rotation that puts that byte * 4 at
                    # bits 2..9 for the absmax table's address
                    if AM_CHUNK:                   # chunk kt / C: word (kt % C) / 2 of col's 2C bytes
                        w = lds_u32(sh, chunk_addr(sh_base, kt) + u32(16) * u32(col)
                                    + u32(4) * u32((kt & i32(AM_CHUNK - 1)) >> i32(1)))
                        rot = u32(8) * (u32(2) * u32(kt & i32(1)) + u32(kb)) + u32(30)
                    elif codes and e4m4:           # the word at col holds byte (col_kb + 2kt) % 4 (+ kb)
                        w = lds_u32(sh, am_base + u32(4) * u32(col))
                        rot = u32(8) * (u32((col_kb[j] + i32(2) * kt) & i32(3)) + u32(kb)) + u32(30)
                    elif e4m4:                     # bytes 2col, 2col+1: the word col // 2, half col % 2
                        w = lds_u32(sh, am_base + u32(4) * u32(col >> i32(1)))
                        rot = am_rot + u32(8 * kb)
                    if e4m4:
                        s2 = lds_u32(scales, lop3(rotr(w, rot), u32(4 * E4M4_CODES - 4), ts, LOP3_AND_OR))
                    else:
                        v = u32_as_f32(lds_u32(sh, am_base + u32(4) * u32(i32(2) * col
                                                                                        + i32(kb))))
                        s2 = half_bits(v)
                        s2 |= s2 << u32(16)
                    for q in range(4):             # elements 8q + 2t, 8q + 2t + 1
                        breg[q] = mul2(lds_u32(table, addr[q]), s2)
                    for mt in range(MT):
                        for s in range(2):
                            acc[mt, j, 0], acc[mt, j, 1], acc[mt, j, 2], acc[mt, j, 3] = mma(
                                afr[mt, s, 0], afr[mt, s, 1], afr[mt, s, 2], afr[mt, s, 3],
                                breg[2 * s], breg[2 * s + 1],
                                acc[mt, j, 0], acc[mt, j, 1], acc[mt, j, 2], acc[mt, j, 3])
            kt = i32(kt + i32(1))
            slot = i32(slot + i32(1)) if slot < i32(STAGES - 1) else i32(0)
        cp_async_wait(0)

        # ---- epilogue: c0, c1 = C[row, col..col+1]; c2, c3 = C[row+8, col..col+1] of each 16 x 8 tile ----
        c_row, c_col = c_fragment(lane)
        for mt in range(MT):
            for j in range(N_SUB):
                col = n_tile * i32(BN) + warp * i32(N_SUB * MMA_N) + i32(8 * j) + c_col
                for h in range(2):
                    row = m0 + i32(16 * mt + 8 * h) + c_row
                    if row < m_end:
                        i = row * N + col
                        for e in range(2):         # (the code layout's N need not fill the last column tile)
                            if not codes or col + i32(e) < N:
                                if split_k:
                                    cuda.atomic.add(ws, i + i32(e), acc[mt, j, 2 * h + e])
                                elif f16_out:
                                    out[i + i32(e)] = np.float16(acc[mt, j, 2 * h + e])
                                else:
                                    out[i + i32(e)] = acc[mt, j, 2 * h + e]

    return jit_kernel(gemm_kernel)


@lru_cache(maxsize=None)
def _to_half_kernel():
    def to_half(src, dst, n):
        i = cuda.grid(1)
        if i < n:
            dst[i] = np.float16(src[i])
    return jit_kernel(to_half)


def m_tile_for(M):
    """MT (16-row MMA tiles per CTA) for M rows: the fewest that cover M, at most 4."""
    for mt in M_TILES:
        if M <= MMA_M * mt:
            return mt
    return M_TILES[-1]


def choose_split(M, N, K_padded, MT, n_sm, target_waves=2):
    """K splits so that the CTAs fill about ``target_waves`` CTAs per SM (no split ever empty)."""
    k_tiles = K_padded // BK
    tiles = -(-N // BN) * -(-M // (MMA_M * MT))
    split = max(1, min(k_tiles, -(-target_waves * n_sm // tiles)))
    per = -(-k_tiles // split)
    return -(-k_tiles // per), per


def _k_split(Kp, split, M, N, MT):
    """(splits, K tiles per split): ``split`` as asked (no split left empty), else ``choose_split``."""
    if split is None:
        return choose_split(M, N, Kp, MT, sm_count())
    if isinstance(split, bool) or not isinstance(split, (int, np.integer)) or split < 1:
        raise ValueError(f"split must be an integer >= 1 (or None: chosen from the shape), got {split!r}")
    per = -(-(Kp // BK) // int(split))
    return -(-(Kp // BK) // per), per


def absmax_chunk(K, per, stages):
    """(C, K tiles a split) of the code layout's E4M4 absmax chunks for splits of ``per`` K tiles: the largest C of
    ``AM_CHUNK_TILES`` with K a multiple of 64 C and at least ``stages`` - 1 tiles (the ring's reuse distance) whose
    splits, rounded to a multiple of C tiles, are still >= 3/4 as many; else (0, per): a 4-byte copy per tile."""
    tiles = K // BK
    splits = -(-tiles // per)
    for c in AM_CHUNK_TILES:
        if K % (BK * c) or c < stages - 1:
            continue
        rounded = max(c, (per + c // 2) // c * c)        # the nearest multiple of C
        if 4 * -(-tiles // rounded) >= 3 * splits:
            return c, rounded
    return 0, per


def _half_activations(Ad, a_src, n, steps, stream):
    """(A, type) for the MMAs: float32 A gets a conversion to a new fp16 buffer appended to steps."""
    if a_src != "float32":
        return Ad, a_src
    half = cuda.device_array(n, np.float16, stream=stream)
    steps.append(Step(_to_half_kernel(), -(-n // FINISH_THREADS), FINISH_THREADS,
                      (_arrays.flat_view(Ad), half, i32(n))))
    return half, "float16"


def _mm_steps(steps, spec, grid, Ad, w, out, ws, rows, N, K, per, offsets, tiles):
    """The GEMM launch (and, split, the epilogue that writes ``out`` and re-zeroes the workspace)."""
    absmax = _arrays.flat_view(w.absmax, np.uint8 if spec.layout == "codes" and not spec.am_chunk else np.uint32)
    steps.append(Step(make_gemm_kernel(spec), grid, THREADS,
                      (_arrays.flat_view(Ad, np.uint32), w.packed, absmax,
                       w.codebook, _arrays.flat_view(out), ws, i32(rows), i32(N), i32(K),
                       i32(per), offsets, tiles)))
    if spec.split_k:
        steps.append(finish_step(ws, out, rows * N))


def plan(A, qw, out=None, stream=None, out_dtype=np.float16, bf16=False, workspace=None, split=None,
         m_tile=None, stages=None):
    """Checked inputs of ``C = A @ W^T`` bound into a :class:`launch.Plan`: [float32 A -> float16,] the
    GEMM [, the split-K epilogue]. ``split``/``m_tile``/``stages`` override the choices made from the
    shape (``choose_split``, ``m_tile_for``, ``default_stages``)."""
    stream = _arrays.as_stream(stream)
    Ad, a_src, M, shape = _arrays.activations(A, qw, bf16, stream)
    if isinstance(qw, KbitCodes):
        qw = device_weight(qw, KbitCodes, stream)
        if qw.K % BK:
            raise ValueError(f"gemm reads the code layout for K a multiple of {BK}, got K={qw.K} "
                             "(the pair gemv reads any K)")
    else:
        qw = device_weight(qw, KbitWeight, stream)
        if qw.layout != "tiled":
            raise ValueError("gemm reads the tiled layout or the code layout: convert the weight once with "
                             "repack_tiled(qw) or pair_gemv.to_codes(qw)")
    N, K = qw.shape
    if M * K >= 2**31 or M * N >= 2**31:
        raise ValueError(f"gemm needs M*K, M*N < 2**31 (32-bit indices), got M={M}")
    out_dtype = _arrays.output_dtype(out, out_dtype)
    out = _arrays.output(out, "out", (M, N) if len(shape) == 2 else (N,), out_dtype, stream)
    A_in, steps = Ad, []
    if M == 0:
        return Plan(steps, A_in, out, stream)
    Ad, a_src = _half_activations(Ad, a_src, M * K, steps, stream)   # the MMAs take fp16
    _arrays.check_aligned(Ad, 16, "A")
    MT = m_tile_for(M) if m_tile is None else m_tile
    layout = qw.layout if qw.layout == "codes" else "tiled"
    Kp = K if layout == "codes" else padded_k(K, "tiled")
    mt = MT if MT in M_TILES else 1              # (another m_tile is refused by GemmSpec below)
    n_split, per = _k_split(Kp, split, M, N, mt)
    am_chunk = 0
    if layout == "codes" and qw.absmax_format == "e4m4":     # absmax chunks of C tiles: a split starts at one
        ring = stages or default_stages(qw.k, mt, "e4m4", "codes", AM_CHUNK_TILES[-1])   # (any C: one ring size)
        am_chunk, per = absmax_chunk(K, per, ring)
        n_split = -(-(Kp // BK) // per)
    spec = GemmSpec(qw.k, MT, qw.absmax_format, a_src, out_dtype, n_split > 1, stages=stages, layout=layout,
                    am_chunk=am_chunk)
    ws = split_sums(workspace, M * N, stream) if spec.split_k else _no_workspace()
    _mm_steps(steps, spec, (-(-N // BN), -(-M // (MMA_M * MT)), n_split), Ad, qw, out, ws, M, N, K, per,
              unused_i32(), unused_i32())
    return Plan(steps, A_in, out, stream, ws if spec.split_k else None)


@lru_cache(maxsize=None)
def _no_workspace():
    return cuda.to_device(np.zeros(1, np.float32))


def gemm(A, qw, out=None, stream=None, out_dtype=np.float16, bf16=False, workspace=None, split=None,
         m_tile=None):
    """C[M, N] = A[M, K] @ W^T on the tensor cores, any M; W a tiled kbit weight (``repack_tiled``).

    A: float16 [M, K] or [K] (float32 is converted to float16 first; bfloat16 as int16 bits with
    ``bf16=True`` runs bf16 MMAs). Returns a device array [M, N] (or [N]) of ``out_dtype`` (float16 or
    float32), or writes into ``out``. ``workspace``: a zeroed float32 device array of >= M*N values for
    split-K, or a ``dispatch.Workspace`` to draw it from (allocated per call if needed and not given; it is left
    zeroed). ``split``/``m_tile``
    override the K-split count and the 16-row tiles per CTA (1, 2, 4) chosen from the shape."""
    return plan(A, qw, out, stream, out_dtype, bf16, workspace, split, m_tile).launch()


def ptx_specs():
    """Every (k, MT) with float16 A, E4M4 absmax and split-K, and each other choice (bf16 A, fp32 absmax,
    float32 out, no split, grouped) with every k."""
    variants = [dict(m_tile=mt) for mt in M_TILES]
    variants += [dict(a_type="bfloat16"), dict(absmax_format="fp32", m_tile=2),
                 dict(out_dtype="float32", split_k=False), dict(grouped=True, m_tile=2)]
    codes = [dict(m_tile=mt, layout="codes") for mt in M_TILES]
    codes += [dict(layout="codes", a_type="bfloat16", absmax_format="fp32", out_dtype="float32", split_k=False)]
    codes += [dict(m_tile=mt, layout="codes", am_chunk=8) for mt in M_TILES]
    codes += [dict(layout="codes", am_chunk=c) for c in AM_CHUNK_TILES[1:]]
    return [GemmSpec(k=k, **v) for k in K_BITS for v in variants] + [GemmSpec(k=k, **v) for k in CODES_K
                                                                     for v in codes]


def argtypes(spec):
    from numba import types as t
    absmax = t.uint8[::1] if spec.layout == "codes" and not spec.am_chunk else t.uint32[::1]
    return (t.uint32[::1], t.uint32[::1], absmax, t.float32[::1], NUMBA_TYPES[spec.out_dtype],
            t.float32[::1], t.int32, t.int32, t.int32, t.int32, t.int32[::1], t.int32[::1])


def kernel_specializations():
    """(name, kernel, argument types) for the PTX checks, from :func:`ptx_specs`."""
    return [(spec.name, make_gemm_kernel(spec), argtypes(spec)) for spec in ptx_specs()]


@lru_cache(maxsize=None)
def _tiles_buffer(E):
    """Per-expert row-tile offsets, one buffer per expert count: calls on concurrent streams with the same
    number of experts would share it (launch grouped_gemm on one stream at a time)."""
    return cuda.device_array(E + 1, np.int32)


@lru_cache(maxsize=None)
def _tile_offsets_kernel(BM):
    def tile_offsets(offsets, tiles):
        """tiles[e] = sum over experts before e of ceil(tokens / BM) (one thread: E is small)."""
        if cuda.grid(1) == 0:
            acc = i32(0)
            tiles[0] = acc
            for e in range(offsets.shape[0] - 1):
                acc += (offsets[e + 1] - offsets[e] + i32(BM - 1)) // i32(BM)
                tiles[e + 1] = acc
    return jit_kernel(tile_offsets)


def plan_grouped(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False,
                 workspace=None, split=None, m_tile=None):
    """Checked inputs of :func:`grouped_gemm` bound into a :class:`launch.Plan`: [float32 A -> float16,] the
    per-expert tile offsets, the GEMM [, the split-K epilogue]."""
    stream = _arrays.as_stream(stream)
    Ad, a_src, T, offs, experts = check_grouped(A, experts, expert_offsets, bf16, stream)
    if experts.layout != "tiled":
        raise ValueError("grouped_gemm reads the tiled layout: stack repack_tiled(...) weights")
    E = experts.n_experts
    N, K = experts.expert_shape
    if isinstance(expert_offsets, np.ndarray):
        m_tile = m_tile or m_tile_for(max(1, max_tokens_per_expert(expert_offsets, T)))
    MT = m_tile or 1
    if T * K >= 2**31 or T * N >= 2**31 or E * N * K // 32 * experts.k >= 2**31:
        raise ValueError("grouped_gemm uses 32-bit indices: T*K, T*N and the experts' words must stay < 2**31")
    out_dtype = _arrays.output_dtype(out, out_dtype)
    out = _arrays.output(out, "out", (T, N), out_dtype, stream)
    A_in, steps = Ad, []
    if T == 0 or E == 0:
        return Plan(steps, A_in, out, stream)
    Ad, a_src = _half_activations(Ad, a_src, T * K, steps, stream)
    _arrays.check_aligned(Ad, 16, "A")
    BM = MMA_M * MT
    tiles = _tiles_buffer(E)                     # (no allocation inside a CUDA-graph capture)
    steps.append(Step(_tile_offsets_kernel(BM), 1, 1, (offs, tiles)))
    items = T // BM + min(E, T)                  # >= the work items, whatever the routing
    n_split, per = _k_split(padded_k(K, "tiled"), split, T, N, MT if MT in M_TILES else 1)
    spec = GemmSpec(experts.k, MT, experts.absmax_format, a_src, out_dtype, n_split > 1, True)
    ws = split_sums(workspace, T * N, stream) if spec.split_k else _no_workspace()
    _mm_steps(steps, spec, (N // BN, items, n_split), Ad, experts, out, ws, T, N, K, per, offs, tiles)
    return Plan(steps, A_in, out, stream, ws if spec.split_k else None)


def grouped_gemm(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False,
                 workspace=None, split=None, m_tile=None):
    """MoE expert GEMM in one launch, any number of tokens per expert: out[t] = A[t] @ W_e^T for the tokens
    t of each expert e (rows offsets[e] .. offsets[e+1]-1 of A, sorted by expert).

    experts: KbitExperts in the tiled layout (``stack_experts`` of ``repack_tiled`` weights). Work items
    (expert, 16*MT-row tile) are found by a binary search over per-expert tile offsets computed on the
    device, so the offsets may live there (CUDA-graph friendly). ``m_tile``: MT, by default from the
    largest expert's token count when the offsets are a NumPy array, else 1. Other arguments as ``gemm``;
    with ``out`` and ``workspace`` given (and device offsets) a call allocates nothing, so it can be
    captured into a CUDA graph. One stream at a time: a small per-expert-count buffer is shared."""
    return plan_grouped(A, experts, expert_offsets, out, stream, out_dtype, bf16, workspace, split,
                        m_tile).launch()
