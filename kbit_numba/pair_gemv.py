"""Pair-table GEMV: C[M, N] = A[M, K] @ W[N, K]^T for M = 1..4 on the kernel-native code layout (k = 2, 4).

The scalar gemv (``scalar_gemv``) spends ~10 SASS instructions per weight, most of them transposing bit
planes into indices. At DRAM speed an H100 affords ~5.7 issue slots per weight in all, of which at most
~2.9 integer ops and ~1.4 shared loads (``benchmarks/README.md``). This kernel moves the transpose
offline and looks weights up several at a time:

* **Layout** (``formats.KbitCodes``, made once by :func:`to_codes`): a block's k words hold its indices
  as k-bit fields in element order, so byte c of word w is one *group* of ``G = 8 // k`` consecutive
  elements (a pair at k = 4, a quad at k = 2). Same bytes per weight as the bit planes.
* **Group table**: 256 entries (one per byte value) of G codebook values (float32, or float16 with
  ``f16_acc``), in 64 KB of dynamic shared memory laid out ``[code][copy]`` with one 256-byte row per code
  and 128 bytes of copies in it (``device.make_table_fill``), so that lane l reads copy ``l % copies``: the
  lanes that one shared-memory phase serves (128 bytes: 32 lanes of 4-byte loads, 16 of 8-byte, 8 of
  16-byte) always hit distinct banks, whatever their codes. Because a row is exactly 256 bytes, the address
  of code byte c is ``code * 256 + copy * ENTRY``: **one prmt** drops the byte into bits 8..15 next to the
  lane's copy offset.
* **Per group of G weights**: 1 prmt + 1 shared load + G*M float32 FMAs (k = 4, M = 1: 2 instructions
  per weight). The block's sum is scaled by its absmax once.
* **Geometry**: as in the scalar gemv, lane l of K-warp w owns block kb = 32 w + l for the whole launch
  (its activations stay in registers) and a persistent grid walks the columns, ``cols`` per warp per
  iteration. Its 8- or 16-byte loads run two iterations ahead (three code buffers in registers, the
  loop unrolled three times), and all index math is 32-bit.
  The table must be shared by many warps, so a CTA holds ``S`` *slices* of ``KW = ceil(K / 1024)`` warps;
  slice s takes columns ``s*cols .. s*cols+cols-1`` of each group of S*cols columns. Lane sums are reduced by a
  warp reduce-scatter, then over the KW warps in shared memory (double-buffered, one barrier per iteration,
  or per three at M = 1 with ``f16_acc``: the slice's own named barrier, so slices do not wait for each other).
  The plan takes S from ~16 warps a CTA up to where the persistent grid's rounds come out whole
  (:func:`whole_rounds`). Every slice loads all of A for itself (4-7 MB from the L2 a launch in the llama3-8b
  step, ~0.75 us of it); six builds that shared A among a CTA's slices instead (a copy in shared memory, by the TMA,
  or handed over by slice 0) were all slower, since each made warps wait for another warp's load
  (benchmarks/README.md, "Fifty-third session").
* **Programmatic dependent launch** (``pdl=True``, sm_90; ``launch.py``): a CTA lets the next kernel start
  at once and fills its tables *before* ``griddep_wait``; the activation loads (ordinary loads: ptxas moved
  ``ld.global.nc`` ones above the wait, a race; tests/test_pdl_reads.py) and the output writes come after it. In a
  chain of layers the next kernel's prologue then overlaps this one's tail. The source puts the first weight loads
  before the wait too, but ptxas sinks those read-only loads below it; keeping them early (as ordinary loads, as the
  tensor-core gemv's PDL build does) did not pay here (benchmarks/README.md, "Thirty-third session").

* **The SiLU epilogue** (``silu_pairs=True``): for a gate/up weight whose rows are interleaved (gate j at row 2j,
  up j at 2j + 1) the thread that sums column 2j also sums 2j + 1 and writes silu(gate) * up into an [M, N / 2]
  output, once per element: a SwiGLU MLP's SiLU kernel and its [M, N] round trip through memory go away.

* **A residual add and an RMSNorm inside the gemvs** (``accumulate=True``, ``rms_eps``): ``accumulate`` writes
  out += A W^T in place (a decode step's residual add); ``rms_eps`` scales its products by 1 / rms(A) =
  1 / sqrt(mean(A^2) + rms_eps) in the epilogue (an RMSNorm of A whose weight is folded into this weight). Each slice
  already holds all of A's rows, so it sums their squares itself: a lane's 32 squares a row after its activation
  loads, five shuffles and one shared atomic a warp into the slice's word, which the summing threads read after the
  slice's first barrier. A decode step's add + norm between two projections then needs no launch of its own
  (``bench_model.NORM_IN_GATE_UP``).

* **The fragment layout too** (``formats.KbitFragments``, the tensor-core gemv's; ``fragments=True``): the same blocks
  permuted, so only a block's address changes (``col_part`` + ``lane_part``). A warp's load then reads 8 runs of
  64 bytes (k = 4) instead of one of 512, and the kernel is 2-25% slower than on the code layout (H100;
  ``benchmarks/README.md``, "Thirtieth session" and "Why the fragment layout costs the pair gemv"); it lets one
  fragment-layout copy serve M = 1 too.

* **MoE experts** (``grouped=True``, :func:`grouped_gemv`): a grid row (slot) per token row, M = 1 each. The CTA
  finds its row's expert in the offsets (a binary search), narrows the weight, the activations and the output
  to that expert and row, and runs the plain kernel. At a decode step's B = 1 the 8 rows are 8 experts, one
  launch over their columns; ``mma_gemv.grouped_gemv`` instead takes up to 8 rows of one expert together.

Reference twin: ``reference.gemv`` (which reads ``KbitCodes`` too; ``reference.silu_pairs`` for the epilogue,
``reference.rms_gemv`` for ``rms_eps``).
Tests: ``tests/test_pair_gemv.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import cuda
from numba.cuda.misc.special import literal_unroll

from . import _arrays
from .core import (MAX_M, check_grouped, device_weight, fit_threads, k_warps, persistent_grid, row_share, sm_count,
                   unused_i32)
from .device import (ABSMAX_CODES, CODEBOOK, PRMT_ROW, TABLE_BYTES, TABLE_FLOATS, WARP, e4m4_decode, i32, inlined,
                     jit_kernel, make_silu_pair_out, make_table_fill, make_warp_reduce_scatter, make_word_unpacker,
                     rsqrt_mean, u32)
from .formats import ABSMAX_FORMATS, BLOCK, CODES_K, KbitCodes, KbitFragments, KbitWeight
from .intrinsics import (SIMULATOR, bar_sync, f16_bits_to_f32, griddep_launch_dependents, griddep_wait, hfma2, ld128,
                         ldg128, ldg64_stream, ldg128_stream, lds64, lds128, lds_u32, prmt, shared_addr, u32_as_f32)
from .launch import NUMBA_TYPES, OUT_TYPES, Plan, Spec, Step, launch_step, type_name

MAX_KW = 32                       # K-warps per slice: K <= 32 * 32 * 32 = 32768
MAX_SLICES = 16                   # a slice's named barrier is one of the CTA's 16 (bar.sync 0..15)
SQUARE_WORDS = MAX_SLICES * MAX_M  # rms_eps: a (slice, row)'s sum of squares of A, in static shared memory
PART = CODEBOOK + 16              # float offset of the cross-warp partial sums
BATCH = 3                         # column groups whose partials are summed after one barrier (the loop's unroll)
COL_CHOICES = (1, 2, 4, 8)        # columns per warp per iteration a kernel can be built for
PAIR_FULL_BATCHES_K = (2, 4)      # plan builds batch = 3 launches at these k with full_batches where a CTA runs one
# The defaults table, from the H100 sweep (benchmarks/runs/2026-11-23_h100_pair_gemv_sweep.txt):
# cols: columns per warp per iteration (cols * 16 bytes in flight per lane), but small_cols at M = 1 on
# weights under small_weight elements (9-12% faster there; see default_cols); cta_warps: warps per CTA
# the plan aims for (the table is filled once per CTA; 2 on the simulator, which runs threads slowly).
DEFAULTS = {"cols": 4, "small_cols": 2, "small_weight": 1 << 24, "cta_warps": 2 if SIMULATOR else 16}
# The grouped kernel's knobs (cols, cta_warps), from the H100 sweep at qwen3-30b-a3b's expert shapes
# (benchmarks/runs/2026-11-27_h100_grouped_pair_knobs.txt): 4 columns and 8 warps won or came within 9% at B = 1 for
# k = 2, 4, both block sums, alone and as PDL chains (vs the plain defaults: 30-45% faster on gate/up, 7-40% on
# down), but for float32 sums at k = 4 with K <= 1024 (one warp a row), where 8 columns and 4 warps took 6.8-8.5 us
# against 4/8's 9+ in two runs (at k = 2 the other way round: 4/8 7.6 us, 8/4 10.3; why was not measured).
# With many rows (B = 16 tokens, 128 slots; float16 sums as a PDL chain) 8 columns and 16 warps won instead:
# 15-21% faster than 4/8 on both shapes at k = 2 and 4 (4/8 had been measured at 8 and 32 rows only).
GROUPED_DEFAULTS = {"cols": 4, "cta_warps": 8 if not SIMULATOR else 2}
GROUPED_K4_F32_ONE_WARP = {"cols": 8, "cta_warps": 4 if not SIMULATOR else 2}
GROUPED_MANY_ROWS, GROUPED_MANY = 64, {"cols": 8, "cta_warps": 16 if not SIMULATOR else 2}


@dataclass(frozen=True)
class PairGemvSpec(Spec):
    """The pair gemv's compile-time choices: the key of :func:`make_pair_gemv_kernel`."""
    FAMILY = "pair_gemv"
    k: int
    M: int
    cols: int = DEFAULTS["cols"]
    absmax_format: str = "e4m4"
    a_type: str = "float16"
    out_dtype: str = "float16"
    f16_acc: bool = False
    pdl: bool = False
    batch: object = None                    # column groups per barrier, 1 or BATCH (None: BATCH at M = 1 with f16_acc)
    max_registers: object = None            # a per-thread register cap (long K at M = 4), or None
    silu_pairs: bool = False                # the epilogue silu(C[:, 2j]) * C[:, 2j + 1] into an [M, N / 2] output
    grouped: bool = False                   # MoE experts: blockIdx.y is a token row, M = 1 (see the module docstring)
    fragments: bool = False                 # the weight in the fragment layout (KbitFragments), not the code layout
    full_batches: bool = False              # batch = 3: whole batches run a loop with no branch inside (FULL_BATCHES)
    rms_eps: float = 0.0                    # > 0: out = (A W^T) / sqrt(mean(A^2) + rms_eps) (RMSNorm, w folded in W)
    accumulate: bool = False                # out += A W^T in place (float16): a decode step's residual add

    def normalise(self):
        if self.k not in CODES_K or not 1 <= self.M <= MAX_M:
            raise ValueError(f"pair gemv handles k in {CODES_K} and M = 1..{MAX_M}, got k={self.k}, M={self.M}")
        if self.cols not in COL_CHOICES:
            raise ValueError(f"cols must be one of {COL_CHOICES}, got {self.cols!r}")
        if self.grouped and self.M != 1:        # (a row a slot: each row its own expert's weights)
            raise ValueError(f"the grouped pair gemv runs one row a slot (M = 1), got M={self.M}")
        if (self.rms_eps or self.accumulate) and self.grouped:
            raise ValueError("rms_eps and accumulate take no grouped launch")
        if self.accumulate and (self.silu_pairs or type_name(self.out_dtype, "out_dtype", OUT_TYPES) != "float16"):
            raise ValueError("accumulate adds into a float16 output, without silu_pairs")
        if self.rms_eps and self.accumulate:
            raise ValueError("rms_eps and accumulate: not both in one launch (a step's add, then the next layer's norm)")
        if not 0 <= float(self.rms_eps) < 1:
            raise ValueError(f"rms_eps must be in [0, 1), got {self.rms_eps!r}")
        if self.silu_pairs and self.cols % 2:   # (a column pair must stay within one slice's columns)
            raise ValueError(f"silu_pairs needs an even cols, got {self.cols}")
        if self.absmax_format not in ABSMAX_FORMATS:
            raise ValueError(f"absmax_format must be one of {ABSMAX_FORMATS}, got {self.absmax_format!r}")
        a_type = type_name(self.a_type, "a_type")
        if self.f16_acc and a_type != "float16":
            raise ValueError(f"f16_acc needs float16 activations, got {a_type}")
        batch = (BATCH if self.f16_acc and self.M == 1 else 1) if self.batch is None else self.batch
        if batch not in (1, BATCH):              # the loop body holds BATCH groups: a batch ends with it or each group
            raise ValueError(f"pair gemv sums the partials of 1 or {BATCH} column groups at a time, got {batch}")
        if self.full_batches and batch != BATCH:
            raise ValueError(f"full_batches runs whole batches of {BATCH} column groups, got batch={batch}")
        return dict(k=int(self.k), M=int(self.M), cols=int(self.cols), a_type=a_type,
                    out_dtype=type_name(self.out_dtype, "out_dtype", OUT_TYPES), f16_acc=bool(self.f16_acc),
                    pdl=bool(self.pdl), batch=int(batch),
                    max_registers=int(self.max_registers) if self.max_registers else None,
                    silu_pairs=bool(self.silu_pairs), grouped=bool(self.grouped), fragments=bool(self.fragments),
                    full_batches=bool(self.full_batches), rms_eps=float(self.rms_eps),
                    accumulate=bool(self.accumulate))


@lru_cache(maxsize=None)
def make_pair_gemv_kernel(spec):
    """Kernel(A words, packed codes, absmax, codebook, out[M*N], N, n_kb) for a :class:`PairGemvSpec`;
    blockDim = 32 * KW * S.

    k: 2 or 4; M: rows of A (1..4); cols (NCOL here): columns per warp per iteration; a_type: 'float16',
    'float32' or 'bfloat16' (A read as uint32 words); out_dtype: 'float16' or 'float32'. Launch with
    ``TABLE_BYTES + part_bytes(...)`` bytes of dynamic shared memory.
    f16_acc (float16 A only): the table holds f16x2 pairs and a block's products are summed by
    ``fma.rn.f16x2`` (one instruction per pair and row instead of two FFMAs), in float16; blocks are summed
    in float32 (error bound: tests/test_pair_gemv.py). pdl: built for a programmatic dependent launch (the
    module docstring)."""
    k, M, NCOL, f16_acc, PDL = spec.k, spec.M, spec.cols, spec.f16_acc, spec.pdl   # (checked by PairGemvSpec)
    GROUPED, FRAGMENTS = spec.grouped, spec.fragments
    # Where block kb of column n sits (4 x its index, ``w4``): n * n_kb + kb in the code layout; in the fragment
    # layout (formats.fragment_position) col_part(n) + lane_part(kb) (the helpers below). A load_columns
    # call's columns n0 .. n0 + cols - 1 lie in one aligned group of cols <= 8 columns, where the next column's
    # block is COL_STEP4 / 4 blocks on (4 at k = 4, 8 at k = 2) in the fragment layout, n_kb in the code layout.
    COL_STEP4 = 4 * (4 if k == 4 else 8)
    BATCH_ = spec.batch                            # column groups per barrier and sum
    absmax_format, a_src, out_dtype = spec.absmax_format, spec.a_type, spec.out_dtype
    G = 8 // k                                     # elements per code byte
    fill_table, ENTRY, COPIES = make_table_fill(k, "float16" if f16_acc else "float32")
    PAIRS = BLOCK // 2                             # f16x2 words of a block's activations
    CM = NCOL * M
    V = 1 << (CM - 1).bit_length()                 # partial sums per lane, padded to a power of two
    e4m4 = absmax_format == "e4m4"
    absmax_t = np.uint8 if e4m4 else np.float32
    f16_out = np.dtype(out_dtype) == np.float16
    word_to_f32, A_PER_WORD = make_word_unpacker(a_src)
    reduce_scatter = make_warp_reduce_scatter(V)
    ROWS = tuple(range(M))
    # The barrier that makes the tables visible: at k = 4 with PDL it comes before griddep_wait, so that after the
    # wait each warp starts decoding as soon as its own activations arrive (they are the lane's alone) instead of
    # waiting for the CTA's slowest load: the llama3-8b B = 1 step 1918-1924 -> 1895-1896 us. At k = 2 the same
    # made that step 1457 -> 1466 us (the 4096x4096 and 14336x4096 chains slower), so k = 2, and the launches
    # without PDL, keep it after the activation loads, which then overlap it (benchmarks/README.md, "the tables'
    # barrier before the wait").
    EARLY_BARRIER = PDL and k == 4 and not GROUPED
    SILU_PAIRS, ACCUMULATE = spec.silu_pairs, spec.accumulate
    # A decode step's add + RMSNorm inside its gemvs, with no norm launch between them: the o projection's
    # ``accumulate`` build writes x = res + o(att) in place, and the gate/up projection's ``rms_eps`` build, on x,
    # scales its products by 1 / sqrt(mean(x^2) + eps) in the epilogue (the norm's weight folded into its own). The
    # squares are summed by the launch that reads x, from the activations each slice loads anyway: summed by the launch
    # that writes x (one atomic a row after each batch), they took that build from 80 to 100 registers, too many for
    # the next kernel's CTA to start beside it under PDL (benchmarks/README.md, "Sixty-seventh session").
    RMS, EPS = spec.rms_eps > 0, np.float32(spec.rms_eps)
    # The activations: with PDL the kernel before may still be writing them when this one starts, so an ordinary load
    # (ptxas moved ld.global.nc ones above griddep_wait: tests/test_pdl_reads.py); else the read-only path.
    load_a = ld128 if PDL else ldg128

    # the silu_pairs epilogue: column n's partial sums V apart, column n + 1's M after each
    silu_pair_out = make_silu_pair_out(V, M, f16_out)

    @inlined
    def col_part(n, n_kb):
        """Column n's share of a block's index: n * n_kb (code layout), or in the fragment layout the strip of
        16 columns (n & ~15) * n_kb plus n's place in a tile (k = 4: 64 (n / 8 % 2) + 4 (n % 8); k = 2: 8 (n % 16))."""
        if not FRAGMENTS:
            return u32(n * n_kb)
        strip = u32((n & u32(0xFFFFFFF0)) * n_kb)
        if k == 4:
            return u32(strip + u32(u32((n >> u32(3)) & u32(1)) * u32(64)) + u32((n & u32(7)) * u32(4)))
        return u32(strip + u32((n & u32(15)) * u32(8)))

    @inlined
    def lane_part(kb):
        """Block kb's share of its index: kb (code layout), or in the fragment layout its tile along K, 128 (kb / 8),
        plus its place in the tile (k = 4: 32 (kb / 4 % 2) + kb % 4; k = 2: kb % 8)."""
        if not FRAGMENTS:
            return kb
        tile = u32((kb >> u32(3)) * u32(128))
        if k == 4:
            return u32(tile + u32(u32((kb >> u32(2)) & u32(1)) * u32(32)) + u32(kb & u32(3)))
        return u32(tile + u32(kb & u32(7)))

    @inlined
    def load_columns(packed, absmax, n0, kb, last4, n_kb, codes, code_absmax):
        """Issue the loads of columns n0 .. n0+NCOL-1 of this lane's block (k words in one 16- or 8-byte
        load, and the absmax) into codes / code_absmax. The code words are read once: their loads skip L1
        (``ldg128_stream``: ``.L1::no_allocate``, 1-6% faster on the H100; benchmarks/README.md, eighth step).
        The absmax byte keeps Numba's plain load: read as ``ld.global.nc.L1::no_allocate.u8`` it cost 4-11%
        (H200; benchmarks/README.md, "Fifty-fourth session").
        The loads are unconditional: a column past N (or a lane past the last block) reads the last
        block instead (last4 = 4 x its index), whose sums are never written (or meet zero activations).
        That is one min per column instead of a compare and a predicate, and fewer registers (a
        predicated load must keep its register's old value). ptxas still issues these loads after
        the decode that follows them in the source, whichever form: hence the loop's three buffers.
        All index math is 32-bit and unsigned (Numba's default int64 indexing costs ~20 SASS
        instructions per column: 64-bit multiplies, compares and wraparound checks): w4 (4 x the
        block index, its first word) of column n0 + c is one add after column c - 1's."""
        w4 = u32(u32(col_part(n0, n_kb) + kb) * u32(4))    # Numba widens every sum to 64 bits: u32() narrows
        for c in range(NCOL):
            i4 = min(w4, last4)
            if k == 4:
                codes[c, 0], codes[c, 1], codes[c, 2], codes[c, 3] = ldg128_stream(packed, i4)
            else:
                codes[c, 0], codes[c, 1] = ldg64_stream(packed, u32(i4 >> u32(1)))
            code_absmax[c] = absmax[u32(i4 >> u32(2))]
            w4 = u32(w4 + (u32(COL_STEP4) if FRAGMENTS else u32(n_kb * u32(4))))

    @inlined
    def decode_columns(smem, table, lane_off, codes, code_absmax, a, ah, acc):
        """acc[c * M + m] = this lane's block of column c (codes[c, :], absmax code_absmax[c]) dotted with
        its activations of row m: one prmt and one shared load per code byte, G * M FMAs
        (f16_acc: G // 2 * M HFMA2s), one scale per block."""
        s = cuda.local.array(M, np.float32)
        hs = cuda.local.array(M, np.uint32)
        for j in range(CM, V):
            acc[j] = np.float32(0.0)
        for c in range(NCOL):
            scale = smem[u32(u32(TABLE_FLOATS) + u32(code_absmax[c]))] if e4m4 else code_absmax[c]
            for m in range(M):
                s[m] = np.float32(0.0)
                hs[m] = u32(0)
            for wd in range(k):
                for t in range(4):
                    addr = table + prmt(codes[c, wd], lane_off, u32(PRMT_ROW | (t << 4)))
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
                    s[m] = f16_bits_to_f32(hs[m]) + f16_bits_to_f32(hs[m] >> u32(16))
                acc[c * M + m] = s[m] * scale

    @inlined
    def accumulate_out(out, i, total):
        """ACCUMULATE: out[i] = out[i] + the float16 sum, rounded to float16 (a residual add: only this thread reads and
        writes element i). (The plain write stays inline at the call sites: routed through one helper, the M = 2 and 4
        builds' PTX changed.)"""
        out[i] = np.float16(np.float32(out[i]) + np.float32(np.float16(total)))

    @inlined
    def row_scale(squares, sl, row, k_len):
        """RMS: 1 / rms of A's row ``row``, from its sum of squares in the slice's word (summed before the slice's first
        barrier, so final in every epilogue); else 1."""
        if not RMS:
            return np.float32(1.0)
        return rsqrt_mean(squares[u32(sl * u32(M) + row)], k_len, EPS)

    @inlined
    def reduce_columns(smem, acc, lane, part, flip, sl, kw, slice_tid, n_first, out, N, squares, k_len):
        """Sum acc over the slice's K-warps: a warp reduce-scatter, one partial per (warp, value) into the
        shared buffer half ``flip`` (double-buffered: one barrier per iteration), then one thread per
        (column, row) of the slice adds its KW partials and writes column n_first + sl * NCOL + c.
        The slices share no partials, so each waits on its own named barrier (``bar_sync(sl, ...)``, KW
        warps) rather than on all the CTA's warps: a slow slice no longer holds the others. ``squares``, ``k_len``:
        the slices' sums of squares of A and K as a float32 (RMS, :func:`row_scale`)."""
        r, v_idx, owner = reduce_scatter(acc, lane)
        if owner:
            smem[u32(part + flip + u32(v_idx))] = r
        bar_sync(sl, u32(kw * u32(WARP)))
        if slice_tid < u32(CM):                        # one thread per (column, row): sum the K-warps
            col = u32(slice_tid // u32(M))
            row = u32(slice_tid - col * u32(M))
            n = u32(n_first + sl * u32(NCOL) + col)
            p = u32(u32(PART) + flip + sl * kw * u32(V) + slice_tid)
            scale = row_scale(squares, sl, row, k_len)
            if SILU_PAIRS:
                silu_pair_out(smem, p, kw, out, row, n, N, scale)
            else:
                p_end = u32(p + kw * u32(V))
                total = np.float32(0.0)
                while p < p_end:
                    total += smem[p]
                    p = u32(p + u32(V))
                if n < u32(N):
                    if ACCUMULATE:
                        accumulate_out(out, u32(row * u32(N) + n), total * scale)
                    else:
                        out[u32(row * u32(N) + n)] = np.float16(total * scale) if f16_out else total * scale

    @inlined
    def finish_batch(smem, flip, fw, slot, r, g, grid, sl, kw, slice_tid, group_cols, out, N, squares, k_len):
        """The end of a batch of r + 1 column groups (the last one g) whose partials are in the buffer half ``flip``:
        the slice meets at its barrier and one thread per (group, column, row), a lane of the slice's warp ``fw``,
        sums its KW partials and writes the output; returns the half the next batch writes."""
        bar_sync(sl, u32(kw * u32(WARP)))
        i = u32(slice_tid - fw * u32(WARP))          # (wraps past every item in the warps below fw)
        while i < u32(u32(r + 1) * u32(CM)):       # thread i: group i // CM of the batch, (column, row)
            rr = u32(i // u32(CM))
            v = u32(i - rr * u32(CM))
            col = u32(v // u32(M))
            row = u32(v - col * u32(M))
            n = u32(u32(u32(g - u32(u32(r) - rr) * grid) * group_cols) + sl * u32(NCOL) + col)
            p = u32(u32(PART) + flip + rr * slot + sl * kw * u32(V) + v)
            scale = row_scale(squares, sl, row, k_len)
            if SILU_PAIRS:
                silu_pair_out(smem, p, kw, out, row, n, N, scale)
            else:
                p_end = u32(p + kw * u32(V))
                total = np.float32(0.0)
                while p < p_end:
                    total += smem[p]
                    p = u32(p + u32(V))
                if n < u32(N):
                    if ACCUMULATE:
                        accumulate_out(out, u32(row * u32(N) + n), total * scale)
                    else:
                        out[u32(row * u32(N) + n)] = np.float16(total * scale) if f16_out else total * scale
            i = u32(i + kw * u32(WARP))
        return u32(u32(BATCH) * slot - flip)

    @inlined
    def end_group(smem, acc, lane, part, flip, slot, r, g, grid, n_groups, sl, kw, slice_tid, group_cols, out, N,
                  squares, k_len):
        """``batch = 3``: :func:`reduce_columns` with one barrier per three groups. The warp's partials go to
        slot r (of 3) of the buffer half ``flip``; after a batch's last group (or the CTA's) the slice meets at
        its barrier and one thread per (group, column, row) of the batch sums (:func:`finish_batch`); returns the
        half the next batch writes. 0.5-11% faster than a barrier a group at M = 1 with float16 sums, up to 11%
        slower at M = 4 (benchmarks/README.md, "three column groups a barrier"). Its sum is written out again rather
        than shared with reduce_columns: a shared helper changed batch 1's PTX and cost it up to 10% at M = 4."""
        rs, v_idx, owner = reduce_scatter(acc, lane)
        if owner:
            smem[u32(part + flip + u32(r) * slot + u32(v_idx))] = rs
        if r == BATCH - 1 or u32(g + grid) >= n_groups:
            return finish_batch(smem, flip, u32(0), slot, r, g, grid, sl, kw, slice_tid, group_cols, out, N, squares,
                                k_len)
        return flip

    @inlined
    def end_each(smem, acc, lane, part, flip, slot, r, g, grid, n_groups, sl, kw, slice_tid, group_cols, out, N,
                 squares, k_len):
        """``batch = 1``: :func:`reduce_columns` after every group (end_group's signature)."""
        reduce_columns(smem, acc, lane, part, flip, sl, kw, slice_tid, u32(g * group_cols), out, N, squares, k_len)
        return u32(slot - flip)

    end = end_group if BATCH_ > 1 else end_each        # how a column group ends (chosen here, not in the kernel)
    # With batch = 3 the loop below ends each group with a branch (is it the CTA's last?), so ptxas schedules every
    # group's reduction chain (five shuffles, each waiting on the last) at the end of its own basic block, where
    # nothing overlaps it (benchmarks/README.md, "Fifty-ninth session": 13% of the gate/up gemv's stall samples). While
    # three more groups remain, FULL_BATCHES runs a batch with no branch inside and stores its partials only after its
    # last decode; ptxas then puts the three decodes first and the three chains together after them. At k = 2, whose
    # loop is bound by its instructions, that made the llama3-8b B = 1 step 44 us faster (the gate/up gemv 9%); at
    # k = 4, where it also issues some of the next groups' loads later, 4-14 us slower at first (H200). Where no CTA
    # runs a whole batch the loop only costs (more registers): plan builds it only at PAIR_FULL_BATCHES_K and where one
    # does. Its batches' sums rotate through the slice's warps (fw): the warp that sums starts the next batch late and
    # the slice's next barrier waits for it, so always warp 0 put that delay on every batch. With the rotation the
    # llama3-8b B = 1 step got 12.7 us faster at k = 2 (most of it the down gemv, a slice of 14 K-warps, -3.5%), and the
    # loop now pays at k = 4 too: 21.0 us against the k = 4 step without it (the gate/up gemv -4.4%, its residency
    # unchanged; benchmarks/README.md, "Sixty-second session"). The other builds keep warp 0
    # (a CTA there runs one batch; with a rotating counter their builds took fewer registers, likely more CTAs an SM,
    # and the k = 2 o gemv ran 46% slower).
    FULL_BATCHES = spec.full_batches
    # (a batch's sums fit one warp, so the rotating warp fw finds every item: M = 1, cols <= 8)
    assert not FULL_BATCHES or BATCH * CM <= WARP, "whole batches sum their partials in one warp"

    @inlined
    def sum_squares(squares, ah, a, sl, lane):
        """RMS, once after the activation loads: add the sum of squares of each row's 32 activations this lane holds
        (float32, two chains) into the slice's word of that row: five shuffles and one shared atomic a warp and row.
        An inactive lane's activations are zeros."""
        for m in range(M):
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            for q in range(PAIRS):
                if f16_acc:
                    lo = f16_bits_to_f32(ah[m, q])
                    hi = f16_bits_to_f32(ah[m, q] >> u32(16))
                else:
                    lo = a[m, 2 * q]
                    hi = a[m, 2 * q + 1]
                s0 += lo * lo
                s1 += hi * hi
            s0 += s1
            for h in range(5):
                s0 += cuda.shfl_xor_sync(0xFFFFFFFF, s0, 16 >> h)
            if lane == u32(0):
                cuda.atomic.add(squares, u32(sl * u32(M) + u32(m)), s0)

    @inlined
    def fill_tables(smem, cb, tid):
        """The group table (make_table_fill) and every E4M4 byte's value (one shared load per block)."""
        fill_table(smem, cb, tid)
        i = tid
        while e4m4 and i < u32(ABSMAX_CODES):
            smem[u32(u32(TABLE_FLOATS) + i)] = e4m4_decode(np.uint8(i))
            i = u32(i + u32(cuda.blockDim.x))

    def pair_gemv(A, packed, absmax, cb, out, N, n_kb, offsets):
        # offsets: grouped, the experts' first rows [E + 1]; else unused
        smem = cuda.shared.array(0, np.float32)    # [group table][E4M4 table][codebook][partials]
        if RMS:                     # the slices' sums of squares of A, a (slice, row) word (declared in RMS builds only)
            squares = cuda.shared.array(SQUARE_WORDS, np.float32)
        else:
            squares = smem
        # Every index below is uint32 (see load_columns): Numba would make them int64.
        tid = u32(cuda.threadIdx.x)
        lane = tid % u32(WARP)
        warp = tid // u32(WARP)
        nkb = u32(n_kb)
        kw = u32((nkb + u32(WARP - 1)) // u32(WARP))     # K-warps per slice
        slices = u32(u32(cuda.blockDim.x) // u32(u32(WARP) * kw))
        sl = u32(warp // kw)                             # this warp's slice (and named barrier)
        w = u32(warp - sl * kw)
        slice_tid = u32(tid - sl * kw * u32(WARP))
        kb = u32(w * u32(WARP) + lane)
        active = kb < nkb
        kb_at = lane_part(kb)                            # block kb's share of its index (col_part: the column's)
        group_cols = u32(slices * u32(NCOL))
        col0 = u32(sl * u32(NCOL))                       # the slice's first column in a group
        n_groups = u32((u32(N) + group_cols - u32(1)) // group_cols)
        g = u32(cuda.blockIdx.x)
        last4 = u32(u32(u32(N) * nkb - u32(1)) * u32(4))     # 4 x the index of the weight's last block

        if PDL:                     # the next kernel may start now: it waits for this one in griddep_wait
            griddep_launch_dependents()
        if GROUPED:                 # slot = token row r, run by the expert whose rows hold it (offsets: [E + 1])
            if PDL:                 # the offsets are the router's output, and so are the weights to load: only
                fill_tables(smem, cb, tid)      # the tables before the wait
                griddep_wait()
            r = u32(cuda.blockIdx.y)
            lo = u32(0)             # the last expert whose first row is <= r (binary search; empty experts skipped)
            hi = u32(len(offsets) - 1)
            while hi - lo > u32(1):
                mid = u32((lo + hi) // u32(2))
                if u32(offsets[mid]) <= r:
                    lo = mid
                else:
                    hi = mid
            first = u32(lo * u32(N) * u32(n_kb))         # the expert's first block
            packed = packed[first * u32(k):]            # from here on the kernel reads one weight, one row
            absmax = absmax[first:]
            A = A[r * u32(n_kb * BLOCK // A_PER_WORD):]
            out = out[r * u32(N // 2 if SILU_PAIRS else N):]

        # ---- 1. the first columns' weight loads go out before anything else ----------------------
        # three buffers of NCOL columns' codes and absmax: the loads run two iterations ahead
        codes_a = cuda.local.array((NCOL, k), np.uint32)
        codes_b = cuda.local.array((NCOL, k), np.uint32)
        codes_c = cuda.local.array((NCOL, k), np.uint32)
        absmax_a = cuda.local.array(NCOL, absmax_t)
        absmax_b = cuda.local.array(NCOL, absmax_t)
        absmax_c = cuda.local.array(NCOL, absmax_t)
        grid = u32(cuda.gridDim.x)
        load_columns(packed, absmax, u32(g * group_cols + col0), kb_at, last4, nkb, codes_a, absmax_a)
        load_columns(packed, absmax, u32((g + grid) * group_cols + col0), kb_at, last4, nkb, codes_b, absmax_b)

        # ---- 2. the group table and the E4M4 table (grouped PDL: filled above) ---------------------
        if not (GROUPED and PDL):
            fill_tables(smem, cb, tid)
        if RMS and tid < u32(SQUARE_WORDS):     # (zeroed before the CTA's barrier below, which every atomic follows)
            squares[tid] = np.float32(0.0)
        table = shared_addr(smem)

        if EARLY_BARRIER:           # the tables' barrier before the wait (see EARLY_BARRIER)
            cuda.syncthreads()
        if PDL and not GROUPED:     # the activations (and out) may be the previous kernel's: wait for it
            griddep_wait()
        # ---- 3. this lane's 32 x M activations, element order, 16-byte loads ---------------------
        a = cuda.local.array((M, BLOCK), np.float32)       # (f16_acc: unused)
        ah = cuda.local.array((M, PAIRS), np.uint32)       # f16_acc: the f16x2 words as loaded
        for m in literal_unroll(ROWS):              # (once per launch: range(M) stays rolled at M = 4)
            a_base = (m * n_kb * BLOCK + kb * BLOCK) // A_PER_WORD if active else 0
            a_live = np.float32(1.0) if active else np.float32(0.0)
            for q in range(BLOCK // A_PER_WORD // 4):
                w4 = load_a(A, a_base + 4 * q)
                for h in range(4):
                    if f16_acc:
                        ah[m, 4 * q + h] = w4[h] if active else u32(0)
                    else:
                        for e in range(A_PER_WORD):
                            a[m, (4 * q + h) * A_PER_WORD + e] = word_to_f32(w4[h], e) * a_live
        k_len = np.float32(nkb * u32(BLOCK))               # (RMS: K, the mean's count)
        lane_off = u32((lane % COPIES) * ENTRY)
        if not EARLY_BARRIER:       # (the activation loads above overlap the barrier)
            cuda.syncthreads()
        if RMS:                     # the slice's sums of squares of its rows: its lanes hold all of A
            sum_squares(squares, ah, a, sl, lane)

        part = u32(u32(PART) + (sl * kw + w) * u32(V))     # this warp's partial sums (double-buffered: + flip)
        flip = u32(0)
        FLIP = u32(slices * kw * u32(V))                    # (batch = 3: a group's partials; a half holds three)
        acc = cuda.local.array(V, np.float32)
        # ---- 4. the persistent loop, unrolled three times: a buffer is decoded while the loads of the
        #         group two iterations ahead go into the buffer decoded last. ptxas issues those loads
        #         late, after the decode (a load one iteration ahead would meet its use right after
        #         the barrier), so two iterations ahead is what keeps a whole decode between a load
        #         and its use. With batch = 3 the three groups of a pass share one barrier.
        ahead = u32(u32(2) * grid * group_cols)
        if FULL_BATCHES:            # whole batches first: three groups with no branch between them (see FULL_BATCHES)
            full_end = u32(n_groups - u32(2) * grid) if n_groups > u32(2) * grid else u32(0)
            fw = u32(0)     # the slice's warp that sums the next whole batch (see FULL_BATCHES)
            while g < full_end:     # (g, g + grid and g + 2 grid are all < n_groups)
                load_columns(packed, absmax, u32(g * group_cols + ahead + col0), kb_at, last4, nkb, codes_c, absmax_c)
                decode_columns(smem, table, lane_off, codes_a, absmax_a, a, ah, acc)
                rs0, v_idx, owner = reduce_scatter(acc, lane)
                g = u32(g + grid)
                load_columns(packed, absmax, u32(g * group_cols + ahead + col0), kb_at, last4, nkb, codes_a, absmax_a)
                decode_columns(smem, table, lane_off, codes_b, absmax_b, a, ah, acc)
                rs1, v_idx, owner = reduce_scatter(acc, lane)
                g = u32(g + grid)
                load_columns(packed, absmax, u32(g * group_cols + ahead + col0), kb_at, last4, nkb, codes_b, absmax_b)
                decode_columns(smem, table, lane_off, codes_c, absmax_c, a, ah, acc)
                rs2, v_idx, owner = reduce_scatter(acc, lane)
                if owner:           # the three groups' partials, stored after the last decode (see FULL_BATCHES)
                    smem[u32(part + flip + u32(v_idx))] = rs0
                    smem[u32(part + flip + FLIP + u32(v_idx))] = rs1
                    smem[u32(part + flip + u32(2) * FLIP + u32(v_idx))] = rs2
                flip = finish_batch(smem, flip, fw, FLIP, 2, g, grid, sl, kw, slice_tid, group_cols, out, N, squares,
                                    k_len)
                fw = u32(fw + u32(1)) if fw + u32(1) < kw else u32(0)
                g = u32(g + grid)
        while g < n_groups:         # (the last, partial batch; every batch when FULL_BATCHES is off)
            load_columns(packed, absmax, u32(g * group_cols + ahead + col0), kb_at, last4, nkb, codes_c, absmax_c)
            decode_columns(smem, table, lane_off, codes_a, absmax_a, a, ah, acc)
            flip = end(smem, acc, lane, part, flip, FLIP, 0, g, grid, n_groups, sl, kw, slice_tid, group_cols, out, N,
                       squares, k_len)
            g = u32(g + grid)
            if g >= n_groups:
                break
            load_columns(packed, absmax, u32(g * group_cols + ahead + col0), kb_at, last4, nkb, codes_a, absmax_a)
            decode_columns(smem, table, lane_off, codes_b, absmax_b, a, ah, acc)
            flip = end(smem, acc, lane, part, flip, FLIP, 1, g, grid, n_groups, sl, kw, slice_tid, group_cols, out, N,
                       squares, k_len)
            g = u32(g + grid)
            if g >= n_groups:
                break
            load_columns(packed, absmax, u32(g * group_cols + ahead + col0), kb_at, last4, nkb, codes_b, absmax_b)
            decode_columns(smem, table, lane_off, codes_c, absmax_c, a, ah, acc)
            flip = end(smem, acc, lane, part, flip, FLIP, 2, g, grid, n_groups, sl, kw, slice_tid, group_cols, out, N,
                       squares, k_len)
            g = u32(g + grid)

    return jit_kernel(pair_gemv, spec.max_registers)


def part_bytes(M, cols, slices, kw, batch=1):
    """Dynamic shared bytes after the group table: the E4M4 table, the codebook and the double-buffered
    partials [2, batch, slices, kw, V] float32."""
    V = 1 << (cols * M - 1).bit_length()
    return 4 * (PART - TABLE_FLOATS) + 2 * batch * slices * kw * V * 4


def resident_bytes(spec, slices, kw):
    """Shared bytes a CTA of ``slices`` slices holds, for its residency: the dynamic ones (``TABLE_BYTES +
    part_bytes``) and, in an ``rms_eps`` build, the static sums of squares."""
    return (TABLE_BYTES + part_bytes(spec.M, spec.cols, slices, kw, spec.batch)
            + (4 * SQUARE_WORDS if spec.rms_eps else 0))


# ------------------------------------------------------------------------------------------------
# The layout
# ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def make_to_codes_kernel(k):
    """Kernel(planes, codes, n_blocks): one thread per block, bit planes -> k-bit fields (element order)."""
    PER_WORD = BLOCK // k

    @jit_kernel
    def to_codes_kernel(planes, codes, n_blocks):
        blk = cuda.grid(1)
        if blk >= n_blocks:
            return
        for wd in range(k):
            word = u32(0)
            for f in range(PER_WORD):
                j = wd * PER_WORD + f               # element j of the block
                for b in range(k):
                    bit = (planes[blk * k + b] >> u32(j)) & u32(1)
                    word |= bit << u32(k * f + b)
            codes[blk * k + wd] = word

    return to_codes_kernel


def to_codes(qw, stream=None):
    """KbitWeight (flat layout, k = 2 or 4) -> KbitCodes on the device: the same indices re-packed once
    from bit planes into k-bit fields (what :func:`gemv` reads). ``reference.to_codes`` is its twin,
    ``reference.from_codes`` the exact inverse."""
    if isinstance(qw, KbitCodes):
        return device_weight(qw, KbitCodes, _arrays.as_stream(stream))
    if isinstance(qw, KbitFragments):
        raise TypeError("to_codes re-packs a flat KbitWeight; a KbitFragments is already packed (the pair gemv reads "
                        "it as it is; reference.from_fragments converts back)")
    if not isinstance(qw, KbitWeight):
        raise TypeError(f"to_codes needs a KbitWeight, got {type(qw).__name__}")
    if qw.k not in CODES_K:
        raise ValueError(f"the code layout holds k in {CODES_K}, got k={qw.k} (use scalar_gemv.gemv)")
    if qw.layout != "flat":
        raise ValueError(f"to_codes reads the flat layout, got layout={qw.layout!r}")
    stream = _arrays.as_stream(stream)
    qw = device_weight(qw, KbitWeight, stream)
    n_blocks = qw.n_blocks
    codes = cuda.device_array(n_blocks * qw.k, np.uint32, stream=stream)
    tpb = 256
    launch_step(Step(make_to_codes_kernel(qw.k), (n_blocks + tpb - 1) // tpb, tpb, (qw.packed, codes, i32(n_blocks))),
                stream)
    return KbitCodes(codes, qw.absmax, qw.codebook, qw.k, qw.shape, qw.absmax_format)


# ------------------------------------------------------------------------------------------------
# Launch
# ------------------------------------------------------------------------------------------------
def default_cols(M, N, K):
    """Columns per warp per iteration from the ``DEFAULTS`` table: ``small_cols`` at M = 1 on weights under
    ``small_weight`` elements, else ``cols``."""
    return DEFAULTS["small_cols"] if M == 1 and N * K < DEFAULTS["small_weight"] else DEFAULTS["cols"]


def whole_rounds(slices, most, N, spec, kw, regs):
    """The slice count from ``slices`` up to ``most`` whose persistent launch has the least work on its busiest SM,
    counted in columns: CTAs an SM x slices x rounds (a round: every CTA takes one group of ``slices * cols``
    columns). A shape whose groups fill the grid's last round only in part pays for the whole round: 2048x5120 at
    M = 1 has 320 groups of 16 columns for 132 CTAs (three rounds for 2.4), and 10 slices make it 256 groups in two
    rounds, 3% faster (benchmarks/README.md, wave quantization). Only larger CTAs than the default are tried (fewer
    warps per SM hide less latency); ties keep the smallest."""
    best, sms = None, sm_count()
    for s in range(slices, most + 1):
        groups = -(-N // (s * spec.cols))
        grid = persistent_grid(groups, s * kw * WARP, regs, resident_bytes(spec, s, kw))
        cost = -(-grid // sms) * s * -(-groups // grid)
        if best is None or cost < best[0]:
            best = (cost, s)
    return best[1]


def plan(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, f16_acc=False, cols=None, cta_warps=None,
         pdl=False, silu_pairs=False, max_registers=None, rms_eps=None, accumulate=False):
    """Checked inputs bound into a :class:`launch.Plan` (one launch). ``kc``: KbitCodes or KbitFragments (slower:
    the module docstring; a KbitWeight is re-packed with :func:`to_codes`, a copy per call: keep the KbitCodes for
    repeated use). f16_acc: see :func:`make_pair_gemv_kernel` (float16 A only). pdl: a programmatic dependent launch (sm_90; the
    weights must not be written by the kernel just before it in the stream). ``cols`` (default :func:`default_cols`) and
    ``cta_warps`` (warps per CTA aimed at) override the ``DEFAULTS`` table (``benchmarks/sweep_pair_gemv.py``).
    Batches of three groups (M = 1, float16 sums) at a k of ``PAIR_FULL_BATCHES_K`` get the ``full_batches`` build
    where a CTA runs a whole batch (more groups than twice the grid; :func:`plan_grouped` never builds it):
    qwen3-30b-a3b's k = 2 step, whose dense launches run none, was 10 us slower with it in those and 21 us in its
    grouped ones (benchmarks/README.md, "Sixtieth session"). ``max_registers``: a per-thread register cap, so that more
    warps fit an SM (an experiment's knob for ``sweep_pair_gemv.py``: every cap measured was slower, even without
    spills, at k = 4 in the fifty-fourth session and at k = 2 in the sixty-first), or None.
    A decode step's add + RMSNorm inside its gemvs (no norm launch between them): ``accumulate=True`` (a float16
    ``out`` given: the residual stream) writes out += A W^T in place; ``rms_eps`` scales each output row m by
    1 / sqrt(mean(A[m]^2) + rms_eps) in the epilogue, the squares summed by the kernel from the activations it loads:
    an RMSNorm of A before the product whose weight w is folded into this weight beforehand (quantize W * w[None, :]);
    twin ``reference.rms_gemv``.
    """
    if accumulate and out is None:
        raise ValueError("accumulate adds into out in place: pass the float16 out (a decode step's residual stream)")
    stream = _arrays.as_stream(stream)
    kc = (device_weight(kc, KbitFragments, stream) if isinstance(kc, KbitFragments)
          else to_codes(kc, stream))                       # checked device arrays (re-packed if a KbitWeight)
    N, K = kc.shape
    _arrays.check_silu_pairs(silu_pairs, N)
    Ad, a_src, M, out = _arrays.gemv_io(A, (N // 2, K) if silu_pairs else kc.shape, out, out_dtype, bf16, stream,
                                        "pair gemv", MAX_M)
    n_kb = K // BLOCK
    kw = k_warps(K)
    if kw > MAX_KW:
        raise ValueError(f"pair gemv handles K <= {MAX_KW * WARP * BLOCK}, got K={K}")
    _arrays.check_aligned(Ad, 16, "A")
    args = (_arrays.flat_view(Ad, np.uint32), kc.packed, kc.absmax, kc.codebook, _arrays.flat_view(out),
            i32(N), i32(n_kb), unused_i32())
    cols = default_cols(M, N, K) if cols is None else cols
    spec = PairGemvSpec(kc.k, M, cols, kc.absmax_format, a_src, out.dtype, f16_acc, pdl, max_registers=max_registers,
                        silu_pairs=silu_pairs, fragments=isinstance(kc, KbitFragments), rms_eps=float(rms_eps or 0),
                        accumulate=accumulate)
    spec, kern, regs, max_threads = fit_threads(make_pair_gemv_kernel, spec, args, kw * WARP)
    if kw * WARP > max_threads:
        raise ValueError(f"pair gemv with M={M}, cols={spec.cols} fits {max_threads} threads per CTA: K <= "
                         f"{max_threads * BLOCK}, got K={K} (use fewer cols)")
    most = min(max_threads // (kw * WARP), -(-N // spec.cols), MAX_SLICES)   # a column and a barrier each
    slices = max(1, min((cta_warps or DEFAULTS["cta_warps"]) // kw, most))
    if cta_warps is None:
        slices = whole_rounds(slices, most, N, spec, kw, regs)
    n_groups = -(-N // (slices * spec.cols))
    shared = TABLE_BYTES + part_bytes(M, spec.cols, slices, kw, spec.batch)
    grid = persistent_grid(n_groups, slices * kw * WARP, regs, resident_bytes(spec, slices, kw))
    if spec.batch == BATCH and spec.k in PAIR_FULL_BATCHES_K and n_groups > 2 * grid:     # a CTA runs a whole batch
        spec, kern, regs, _ = fit_threads(make_pair_gemv_kernel, replace(spec, full_batches=True), args,
                                          slices * kw * WARP)
        grid = persistent_grid(n_groups, slices * kw * WARP, regs, resident_bytes(spec, slices, kw))
    return Plan([Step(kern, grid, slices * kw * WARP, args, shared, pdl)], Ad, out, stream)


def grouped_knobs(k, K, f16_acc, rows):
    """The grouped kernel's default cols and cta_warps (``GROUPED_DEFAULTS``) for k bits, K columns, the block sums
    and the number of rows (grid slots)."""
    if rows >= GROUPED_MANY_ROWS:
        return GROUPED_MANY
    return GROUPED_K4_F32_ONE_WARP if k == 4 and not f16_acc and k_warps(K) == 1 else GROUPED_DEFAULTS


def plan_grouped(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False, f16_acc=False,
                 cols=None, cta_warps=None, pdl=False, silu_pairs=False, max_registers=None):
    """Checked inputs of :func:`grouped_gemv` bound into a :class:`launch.Plan` (one launch, or none when there are
    no rows): a grid row (slot) per token row, each the plain kernel at M = 1 on its expert's weight; the CTAs a
    plain launch would take are shared among the slots. ``pdl``: the CTAs fill their tables before they wait for the
    kernel before it; the offsets, and so the weights to load, come after the wait. ``cols``, ``cta_warps``,
    ``silu_pairs`` (every expert's gate/up rows interleaved, out [T, N / 2]): as :func:`plan`; None: the
    :func:`grouped_knobs`. ``max_registers``: a per-thread register cap, so that more CTAs fit an SM (an experiment's
    knob, not yet measured: benchmarks/README.md, "Twenty-ninth session"), or None."""
    stream = _arrays.as_stream(stream)
    Ad, a_src, T, offs, experts = check_grouped(A, experts, expert_offsets, bf16, stream)
    if experts.layout not in ("codes", "fragments"):
        raise ValueError("the grouped pair gemv reads code- or fragment-layout experts: stack_experts of to_codes(...) "
                         f"or to_fragments(...) weights (got the {experts.layout} layout)")
    N, K = experts.expert_shape
    _arrays.check_silu_pairs(silu_pairs, N)
    out_dtype = _arrays.output_dtype(out, out_dtype)
    out = _arrays.output(out, "out", (T, N // 2 if silu_pairs else N), out_dtype, stream)
    _arrays.check_aligned(Ad, 16, "A")
    n_kb = K // BLOCK
    kw = k_warps(K)
    if kw > MAX_KW:
        raise ValueError(f"pair gemv handles K <= {MAX_KW * WARP * BLOCK}, got K={K}")
    if T * max(K, N) >= 2**32 or 4 * experts.n_experts * N * n_kb >= 2**32:
        raise ValueError("the grouped pair gemv uses 32-bit indices: T*K, T*N and E*N*K/8 must stay < 2**32")
    if T == 0:
        return Plan([], Ad, out, stream)
    args = (_arrays.flat_view(Ad, np.uint32), experts.packed, experts.absmax, experts.codebook,
            _arrays.flat_view(out), i32(N), i32(n_kb), offs)
    knobs = grouped_knobs(experts.k, K, f16_acc, T)
    cols = knobs["cols"] if cols is None else cols
    spec = PairGemvSpec(experts.k, 1, cols, experts.absmax_format, a_src, out.dtype, f16_acc, pdl,
                        max_registers=max_registers, silu_pairs=silu_pairs, grouped=True,
                        fragments=experts.layout == "fragments")
    spec, kern, regs, max_threads = fit_threads(make_pair_gemv_kernel, spec, args, kw * WARP)
    slices = max(1, min((cta_warps or knobs["cta_warps"]) // kw, max_threads // (kw * WARP),
                        -(-N // spec.cols), MAX_SLICES))
    n_groups = -(-N // (slices * spec.cols))
    shared = TABLE_BYTES + part_bytes(1, spec.cols, slices, kw, spec.batch)
    resident = persistent_grid(n_groups * T, slices * kw * WARP, regs, shared)
    grid = (row_share(n_groups, T, resident), T)                # the resident CTAs shared among the slots
    return Plan([Step(kern, grid, slices * kw * WARP, args, shared, pdl)], Ad, out, stream)


def grouped_gemv(A, experts, expert_offsets, out=None, stream=None, out_dtype=np.float16, bf16=False, f16_acc=False):
    """MoE experts in one launch: out[t] = A[t] @ W_e^T for every row t of each expert e, one row a slot (a decode
    step's few rows, each its own expert's weights; ``mma_gemv.grouped_gemv`` takes up to 8 rows of an expert
    together). A: [T, K] rows sorted by expert (float16 or float32; bfloat16 bits with ``bf16=True``);
    expert_offsets: int32 [E + 1] (host or device; expert e's rows are offsets[e] .. offsets[e+1]-1); experts:
    KbitExperts in the code layout (``stack_experts`` of :func:`to_codes` weights, k = 2, 4) or the fragment layout
    (of ``mma_gemv.to_fragments`` ones). Returns out [T, N].
    With device offsets and ``out`` given it allocates nothing, so it can be captured into a CUDA graph."""
    return plan_grouped(A, experts, expert_offsets, out, stream, out_dtype, bf16, f16_acc).launch()


def gemv(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, f16_acc=False):
    """C[M, N] = A[M, K] @ W^T for M = 1..4 with W a KbitCodes (k = 2 or 4; see :func:`to_codes`) or a KbitFragments.

    A: float16/float32 [M, K] or [K] (bfloat16 as int16 bits with ``bf16=True``); returns a device array
    [M, N] (or [N]) of ``out_dtype`` (float16 or float32), or writes into ``out``. ``f16_acc=True``
    (float16 A): each 32-weight block is summed in float16 by f16x2 FMAs, blocks in float32."""
    return plan(A, kc, out, stream, out_dtype, bf16, f16_acc).launch()


def prepare(A, kc, out=None, stream=None, out_dtype=np.float16, bf16=False, f16_acc=False, pdl=False):
    """The fast path for repeated calls: a :class:`launch.Prepared` whose ``run()`` is one driver launch.
    Write the next activations into ``.A`` before ``run()``; results land in ``.out``. ``pdl``: see
    :func:`plan`."""
    return plan(A, kc, out, stream, out_dtype, bf16, f16_acc, pdl=pdl).prepare()


def ptx_specs():
    """Every (k, M) at the default cols (and f16_acc at M = 1, 4; pdl at M = 1; the silu_pairs epilogue at M = 1, 3),
    M = 1 with f16_acc and ``full_batches`` (plain, and PDL with silu_pairs) at the k of ``PAIR_FULL_BATCHES_K``,
    M = 1 at ``small_cols``, grouped (plain, f16_acc + pdl + silu_pairs, and 8 columns + pdl), on the fragment layout
    (M = 1, M = 2 with f16_acc, grouped with pdl), the norm's builds (``rms_eps`` at M = 3, at M = 1 with PDL and in
    the step's SiLU build; ``accumulate`` at M = 1 with and without PDL and at M = 2), and each other value of cols,
    absmax format, A type and output type with every k."""
    variants = [dict(M=M) for M in (1, 2, 3, 4)] + [dict(M=M, f16_acc=True) for M in (1, 4)]
    variants += [dict(M=1, pdl=True), dict(M=1, f16_acc=True, pdl=True)]
    variants += [dict(M=1, f16_acc=True, pdl=True, silu_pairs=True), dict(M=3, silu_pairs=True)]   # the epilogue
    variants += [dict(M=1, cols=DEFAULTS["small_cols"])]             # what M = 1 runs on small weights
    variants += [dict(M=1, grouped=True), dict(M=1, f16_acc=True, pdl=True, grouped=True, silu_pairs=True)]   # MoE
    variants += [dict(M=1, grouped=True, cols=GROUPED_K4_F32_ONE_WARP["cols"], pdl=True)]
    variants += [dict(M=1, fragments=True), dict(M=2, f16_acc=True, fragments=True),        # the fragment layout
                 dict(M=1, grouped=True, pdl=True, fragments=True)]
    variants += [dict(M=2, cols=c) for c in COL_CHOICES if c != DEFAULTS["cols"]]
    variants += [dict(absmax_format="fp32", M=3), dict(a_type="float32", M=2), dict(a_type="bfloat16", M=1),
                 dict(out_dtype="float32", M=1)]
    whole = [dict(M=1, f16_acc=True, full_batches=True),                  # where plan builds whole batches
             dict(M=1, f16_acc=True, pdl=True, silu_pairs=True, full_batches=True),
             dict(M=1, f16_acc=True, pdl=True, silu_pairs=True, rms_eps=1e-6, full_batches=True)]   # the step's
    variants += [dict(M=3, rms_eps=1e-5), dict(M=1, f16_acc=True, pdl=True, rms_eps=1e-6),
                 dict(M=1, f16_acc=True, pdl=True, accumulate=True), dict(M=2, accumulate=True),
                 dict(M=1, f16_acc=True, accumulate=True)]  # (the norm)
    return ([PairGemvSpec(k=k, **v) for k in CODES_K for v in variants]
            + [PairGemvSpec(k=k, **v) for k in PAIR_FULL_BATCHES_K for v in whole])


def argtypes(spec):
    from numba import types as t
    return (t.uint32[::1], t.uint32[::1], t.uint8[::1] if spec.absmax_format == "e4m4" else t.float32[::1],
            t.float32[::1], NUMBA_TYPES[spec.out_dtype], t.int32, t.int32,
            t.int32[::1])


def kernel_specializations():
    """(name, kernel, argument types) for the PTX checks: :func:`ptx_specs` and the layout conversion."""
    from numba import types as t
    return ([(spec.name, make_pair_gemv_kernel(spec), argtypes(spec)) for spec in ptx_specs()]
            + [(f"to_codes k={k}", make_to_codes_kernel(k), (t.uint32[::1], t.uint32[::1], t.int32)) for k in CODES_K])
