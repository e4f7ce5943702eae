"""The SwiGLU MLP in one launch at M = 1: acc += down(silu(gate(x)) * up(x)) (k = 2, 4, float16 sums).

A decode step runs its MLP as two gemvs: gate/up (``pair_gemv`` with the SiLU epilogue) writes h = silu(gate) * up,
then down reads all of h. Down's column j needs only h_j, and the CTA that summed gate/up's rows 2j, 2j + 1 holds h_j,
so the MLP can be split over the intermediate dimension instead of over outputs, with no grid-wide wait between the
two products (``benchmarks/README.md``, "Designed, not built: gate/up, SiLU and down in one launch"):

* **Phase 1** is the pair gemv's M = 1 SiLU build unchanged (its ``down`` field adds phase 2): CTA c owns the
  column groups c, c + grid, ... of the interleaved gate/up weight and writes their h values (float16, as the two
  launches do) into ``h``.
* **Phase 2** (``pair_gemv.make_down_phase``): the CTA meets at one barrier (named barrier ``DOWN_BARRIER``: the
  slices use 0 .. slices - 1) and multiplies down's columns of its own h values with every row of down, a partial of
  all of down's outputs. Down is in the K-major layout (``formats.KbitKMajor``): word w (32 / k intermediate indices) of
  every row is contiguous, so a lane's 16-byte load holds one word of 4 rows and the CTA streams its ~220 KB (k = 4,
  llama3-8b) as a few contiguous runs. Per code byte one prmt and one shared load of down's table (in the unused
  halves of the pair gemv's table rows: ``device.make_table_fill(second=True)``), one ``fma.rn.f16x2`` per pair with
  the h pair; a word's float16 sum is scaled by its block's absmax into float32.
* **The partials** go into ``acc`` (float32, zeroed by its reader: a decode step's next norm) by
  ``red.global.add.v4.f32``, four rows an instruction: 132 CTAs x H / 4 requests a launch. Whether the L2 takes them
  fast enough, and whether a cluster's shared-memory sum first would pay, ``benchmarks/atomic_rate.py`` measures.

Geometry: a group of gate/up columns is ``slices * cols`` columns, so ``slices * cols / 2`` h values; the plan keeps
that a whole number of down's words (16 columns at k = 4: 4 columns and 4 slices) so that no word is split between
CTAs. Phase 2 takes *items*, a word over ``DOWN_LOADS[k]`` x 4 of the lane's rows (lane t: rows 4t .. 4t + 3 and
every 4 x threads on), pass by pass over the rows, a pass's sums reduced as soon as its last word is decoded; its loads
run ``pair_gemv.DOWN_DEPTH`` 16-byte loads ahead, the first ones issued before the barrier. Float32 sums from many CTAs
arrive in any order: the result varies in its last bits from run to run (tests compare against the reference with a
bound).

Reference twin: ``reference.fused_mlp``. Tests: ``tests/test_fused_mlp.py``. Not yet measured on a GPU.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
from numba import cuda

from . import _arrays, pair_gemv as pg, reference
from .core import device_weight, fit_threads, k_warps, unused_i32
from .device import TABLE_BYTES, WARP, i32
from .formats import BLOCK, CODES_K, KMAJOR_ROWS, KbitCodes, KbitKMajor, KbitWeight
from .intrinsics import SIMULATOR
from .launch import NUMBA_TYPES, Plan, Step

MAX_SLICES = pg.DOWN_BARRIER      # the CTA's barrier between the phases is the last named one: at most 15 slices
DOWN_COLS = {4: 4, 2: 8}          # gate/up columns a warp an iteration: with 4 slices a group is one down word
CTA_WARPS = 2 if SIMULATOR else 16   # warps a CTA, as the pair gemv's default
# 16-byte loads a lane an item of phase 2 (pair_gemv.make_down_phase): two cover llama3-8b's 4096 rows in one pass at
# 512 threads and spread the loop's own work (cursors, addresses, clamps: ~90 SASS instructions an item) over twice
# the weights: at k = 4 240 instructions an item of 64 weights, 3.75 a weight, against 139 for 32 (4.3) with one load
# an item, which would send half the sums before the end; at k = 2 274 for 128, 2.1 (local ptxas and nvdisasm; the
# k = 2 whole-batch build takes 138 registers either way, 128 under the plan's cap with 4 bytes spilled). Not measured
# on a GPU (benchmarks/fused_mlp_ab.py times one and two).
DOWN_LOADS = {4: 2, 2: 2}


def words_per_group(k, group_cols):
    """Down's words (32 / k intermediate indices each) that one group of gate/up columns (group_cols / 2 h values)
    covers, or 0 where a word would be split between groups."""
    per_word = 2 * (BLOCK // k)
    return group_cols // per_word if group_cols % per_word == 0 else 0


# ------------------------------------------------------------------------------------------------
# Layout and launch
# ------------------------------------------------------------------------------------------------
def to_kmajor(w, stream=None):
    """A down weight (KbitWeight with k = 2, 4, KbitCodes or KbitKMajor) -> KbitKMajor on the device. The transpose is
    ``reference.to_kmajor`` on the host, once (a weight is prepared once per model)."""
    stream = _arrays.as_stream(stream)
    if not isinstance(w, KbitKMajor):
        if not isinstance(w, (KbitWeight, KbitCodes)):
            raise TypeError(f"the down weight must be a KbitWeight, KbitCodes or KbitKMajor, got {type(w).__name__}")
        w = reference.to_kmajor(w.to_numpy())
    return device_weight(w, KbitKMajor, stream)


def loads_for(n_out, threads, most):
    """Phase 2's 16-byte loads a lane an item: as many as down's n_out rows need in one pass of ``threads`` threads,
    at most ``most``."""
    return max(1, min(most, -(-n_out // (KMAJOR_ROWS * threads)), pg.MAX_DOWN_LOADS))


def plan(x, gate_up, down, acc=None, h=None, stream=None, rms_eps=None, pdl=False, cols=None, cta_warps=None,
         down_loads=None):
    """Checked inputs bound into a :class:`launch.Plan` (one launch) of acc += down(silu(gate(x)) * up(x)).

    x: float16 [1, H] or [H] (device or host); gate_up: KbitCodes [2I, H] with gate row j at 2j and up row j at 2j + 1
    (k = 2, 4, E4M4 absmax; a KbitWeight is re-packed by ``pair_gemv.to_codes``); down: KbitKMajor [N, I] of the same
    k (or a KbitWeight / KbitCodes: :func:`to_kmajor`, a host copy per call: keep the KbitKMajor). acc: float32 [1, N]
    the partials are added into (None: zeros); h: float16 [1, I] for the SiLU outputs (None: allocated). ``rms_eps``:
    x is RMS-normalised first (the pair gemv's ``rms_eps``; the norm's weight folded into gate/up). ``pdl``: a
    programmatic dependent launch (sm_90). ``cols``, ``cta_warps``: gate/up's columns a warp and warps a CTA aimed at
    (default ``DOWN_COLS``, ``CTA_WARPS``); ``down_loads``: phase 2's loads a lane an item, at most (default
    ``DOWN_LOADS[k]``)."""
    stream = _arrays.as_stream(stream)
    gu = pg.to_codes(gate_up, stream)
    dn = to_kmajor(down, stream)
    N2, H = gu.shape
    n_out, inter = dn.shape
    if gu.k != dn.k or gu.absmax_format != "e4m4" or dn.absmax_format != "e4m4":
        raise ValueError(f"the fused MLP takes gate/up and down of one k with E4M4 absmax, got k={gu.k}, {dn.k} and "
                         f"{gu.absmax_format}, {dn.absmax_format}")
    _arrays.check_silu_pairs(True, N2)
    if inter != N2 // 2:
        raise ValueError(f"down's K ({inter}) must be gate/up's N / 2 ({N2 // 2}): one column of down per SiLU output")
    Ad, a_src, M, h = _arrays.gemv_io(x, (inter, H), h, np.float16, False, stream, "fused MLP", 1)
    if a_src != "float16":
        raise ValueError(f"the fused MLP takes float16 activations, got {a_src}")
    shape = (1, n_out) if h.ndim == 2 else (n_out,)
    acc = (cuda.to_device(np.zeros(shape, np.float32), stream=stream) if acc is None
           else _arrays.output(acc, "acc", shape, np.float32, stream))
    _arrays.check_aligned(Ad, 16, "x")
    _arrays.check_aligned(h, 16, "h")
    kw = k_warps(H)
    cols = DOWN_COLS[gu.k] if cols is None else cols
    group = 2 * (BLOCK // gu.k)                              # gate/up columns of one down word
    args = (_arrays.flat_view(Ad, np.uint32), gu.packed, gu.absmax, gu.codebook, _arrays.flat_view(h), i32(N2),
            i32(H // BLOCK), unused_i32(), dn.packed, dn.absmax.view(np.uint32), dn.codebook,
            _arrays.flat_view(h, np.uint32), _arrays.flat_view(acc), i32(n_out))
    spec = pg.PairGemvSpec(gu.k, 1, cols, "e4m4", "float16", "float16", f16_acc=True, pdl=pdl, silu_pairs=True,
                           rms_eps=float(rms_eps or 0), down=1)
    spec, kern, regs, max_threads = fit_threads(pg.make_pair_gemv_kernel, spec, args, kw * WARP)
    most = min(max_threads // (kw * WARP), MAX_SLICES)
    aim = max(1, (cta_warps or CTA_WARPS) // kw)
    fits = [s for s in range(1, most + 1)                       # groups of whole down words that tile N
            if words_per_group(gu.k, s * spec.cols) and N2 % (s * spec.cols) == 0]
    slices = max([s for s in fits if s <= aim], default=min(fits, default=None))
    if slices is None:
        raise ValueError(f"the fused MLP found no CTA for N={N2}, K={H}, cols={spec.cols}: a group of gate/up columns "
                         f"(slices x cols, at most {most} slices) must cover whole down words of {group} columns "
                         "and divide N")
    threads = slices * kw * WARP
    if n_out * inter >= 2**32 // 2 or N2 * H >= 2**32 // 2:
        raise ValueError("the fused MLP uses 32-bit indices: down's and gate/up's N x K must stay < 2**31")
    n_groups = N2 // (slices * spec.cols)
    spec = replace(spec, down=loads_for(n_out, threads, DOWN_LOADS[gu.k] if down_loads is None else down_loads))
    spec, kern, regs, _ = fit_threads(pg.make_pair_gemv_kernel, spec, args, threads)
    spec, kern, grid = pg.with_whole_batches(spec, kern, regs, args, slices, kw, n_groups)
    shared = TABLE_BYTES + pg.part_bytes(1, spec.cols, slices, kw, spec.batch)
    return Plan([Step(kern, grid, threads, args, shared, pdl)], Ad, acc, stream)


def mlp(x, gate_up, down, acc=None, stream=None, rms_eps=None, pdl=False):
    """acc += down(silu(gate(x)) * up(x)) for one row x (float16 [H] or [1, H]) in one launch; returns acc (float32,
    zeros if not given). gate_up: interleaved gate/up rows (KbitCodes); down: KbitKMajor (see :func:`plan`). Twin:
    ``reference.fused_mlp``."""
    return plan(x, gate_up, down, acc, None, stream, rms_eps, pdl).launch()


def prepare(x, gate_up, down, acc=None, h=None, stream=None, rms_eps=None, pdl=False, down_loads=None):
    """The fast path for repeated calls (a decode loop, a CUDA graph): a :class:`launch.Prepared` whose ``run()`` is
    one driver launch; write the next x into ``.A``; the sums land in ``.out`` (acc), which the caller zeroes."""
    return plan(x, gate_up, down, acc, h, stream, rms_eps, pdl, down_loads=down_loads).prepare()


def ptx_specs():
    """The builds a decode step runs at k = 2, 4 (PDL, the norm inside, whole batches) and a plain one."""
    PairGemvSpec = pg.PairGemvSpec
    step = dict(M=1, f16_acc=True, pdl=True, silu_pairs=True, rms_eps=1e-6)
    return ([PairGemvSpec(k=k, cols=DOWN_COLS[k], down=DOWN_LOADS[k], **step) for k in CODES_K]
            + [PairGemvSpec(k=k, cols=DOWN_COLS[k], full_batches=True, down=DOWN_LOADS[k], **step) for k in CODES_K]
            + [PairGemvSpec(k=4, cols=4, M=1, f16_acc=True, silu_pairs=True, down=1)])


def argtypes(spec):
    from numba import types as t
    return pg.argtypes(spec) + (t.uint32[::1], t.uint32[::1], t.float32[::1], t.uint32[::1], NUMBA_TYPES["float32"],
                               t.int32)


def kernel_specializations():
    """(name, kernel, argument types) for the PTX checks."""
    return [("fused_mlp " + spec.name, pg.make_pair_gemv_kernel(spec), argtypes(spec)) for spec in ptx_specs()]
