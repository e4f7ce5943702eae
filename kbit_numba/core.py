"""The host-side core every kernel family shares: weights on the device, MoE experts, launch geometry.

* ``device_weight(w, cls)``: any format container (``KbitWeight``, ``KbitCodes``, ``KbitExperts``,
  ``UniformWeight``, ``SbvrWeight``, ``BitnetWeight``) checked (its type, each array's dtype as the
  container's ``dtypes()`` names it, C-contiguity, a kbit codebook's size) with its arrays on the device.
* MoE: ``stack_experts`` builds a ``formats.KbitExperts``; ``check_grouped`` and
  ``max_tokens_per_expert`` check a grouped call's inputs (grouped gemv and grouped gemm).
* Geometry: ``MAX_M`` (rows a GEMV kernel holds in registers), ``sm_count()``, ``k_warps`` (warps side
  by side along K when a lane owns a 32-element block), ``unused_i32()`` (the dummy for a kernel
  argument a launch does not use).
* Split-K sums (the tensor-core gemm's and gemv's): ``new_workspace``, ``split_sums`` (a workspace checked or made),
  ``finish_step`` (the launch that writes the output from the sums and zeroes them again).

Kernel families import from here, ``formats``, ``device`` (device functions), ``intrinsics`` and
``launch``; never from each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .device import WARP, jit_kernel, silu_mul
from .formats import BLOCK, KbitCodes, KbitExperts, KbitFragments, KbitWeight
from .intrinsics import SIMULATOR, griddep_launch_dependents, griddep_wait
from .launch import OUT_TYPES, Spec, Step, type_name

MAX_M = 4                        # rows of A a GEMV kernel holds in registers (M = 1..4)


def sm_count():
    """Streaming multiprocessors of the current GPU: the launch geometry of every family sizes its
    grid from it (2 under the simulator, which has no such attribute)."""
    try:
        return cuda.get_current_device().MULTIPROCESSOR_COUNT
    except Exception:
        return 2


REGISTERS_PER_SM = 65536          # sm_90 (and sm_80): one CTA can use at most this many registers
MAX_REGISTERS = 255               # the most registers a thread can have
SHARED_PER_SM = 228 * 1024        # sm_90: shared memory per SM (1 KB of it reserved per CTA)


def kernel_attributes(kern, types):
    """The driver's attributes of the kernel compiled for argument ``types`` (GPU only): ``regs``, ``local`` (spill)
    bytes a thread, ``shared``, ``const`` and ``maxthreads`` (most threads a CTA)."""
    return kern.compile(tuple(types))._codelibrary.get_cufunc().attrs


def kernel_limits(kern, args):
    """(registers per thread, most threads per CTA) of the kernel compiled for ``args``, as the driver
    reports them (registers decide how large a CTA can be); (0, 1024) under the simulator."""
    if SIMULATOR:
        return 0, 1024
    attrs = kernel_attributes(kern, [kern.typeof_pyval(x) for x in args])
    return attrs.regs, attrs.maxthreads


def register_cap(warps):
    """The register cap ``fit_threads`` sets for a CTA of ``warps`` warps: the register file split over the warps
    rounded up to a power of two (a cap of 144 for 14 warps left room for only 12, the allocation granularity)."""
    return min(MAX_REGISTERS, REGISTERS_PER_SM // (WARP * (1 << (warps - 1).bit_length())))


def fit_threads(make, spec, args, threads):
    """(spec, kernel, registers, most threads per CTA) of ``make(spec)``, recompiled with a register cap
    (``spec.max_registers``, :func:`register_cap`) when its registers do not leave room for a CTA of ``threads``: a
    gemv CTA holds all of K's warps, so a long K at M = 4 (a llama3-8b down projection, K = 14336: 448 threads) needs
    one."""
    kern = make(spec)
    regs, max_threads = kernel_limits(kern, args)
    if threads > max_threads:
        spec = replace(spec, max_registers=register_cap(-(-threads // WARP)))
        kern = make(spec)
        regs, max_threads = kernel_limits(kern, args)
    return spec, kern, regs, max_threads


def persistent_grid(work, threads, regs, shared):
    """CTAs of a persistent launch over ``work`` items: as many as are resident at once on all SMs (by
    registers, allocated in units of 8 per thread, and by ``shared`` dynamic bytes plus the 1 KB the driver
    reserves per CTA), at least one per SM and never more than the work."""
    regs_alloc = max(8, -(-regs // 8) * 8)
    per_sm = max(1, min(REGISTERS_PER_SM // (threads * regs_alloc), SHARED_PER_SM // (shared + 1024)))
    return min(work, sm_count() * per_sm)


def busiest_sm_items(groups, items, ctas):
    """Work items on the busiest SM of a persistent launch of ``ctas`` CTAs over ``groups`` groups of ``items``
    items each: group g runs on CTA g % ctas (the kernels' grid-stride loop) and CTA c on SM c % SMs (the order in
    which the block scheduler fills an idle GPU). The launch takes about as long as its busiest SM: SM 0, which holds
    the most CTAs (0, SMs, 2 SMs, ...) and the most of the first ``extra`` CTAs that run one group more."""
    sms = sm_count()
    each, extra = divmod(groups, ctas)
    return items * (each * -(-ctas // sms) + -(-extra // sms))


def row_share(n_groups, rows, resident):
    """grid.x of a launch whose grid.y (and z) are ``rows`` (K's shares, a grouped launch's slots): the ``resident``
    CTAs (:func:`persistent_grid` of all the work) shared among the rows, rounded down, at least one and never more
    than the ``n_groups`` column groups. Rounded up, the CTAs past the resident ones wait for a second wave:
    14336x4096 at M = 24, 7 shares at one CTA an SM, took 19 x 7 = 133 CTAs on 132 SMs and 1.5x the time
    (benchmarks/README.md, "Forty-seventh session")."""
    return max(1, min(n_groups, resident // rows))


# a CTA's fixed work (its tables, B fragments, the pipeline's first loads) in column-group strips, fitted to the
# measurements slot_share cites: its model then picks the measured best x at both qwen3 shapes at B = 16 and 4 (and
# ranks all five x as measured at 2048x1536; at 768x2048, 26 groups, it puts x = 1 before 4 and 6, measured after)
CTA_OVERHEAD_STRIPS = 3
# ... and a larger x than row_share's must promise at least 10% less by it (a margin for the model's error)
MORE_CTAS_GAIN = 0.9


def slot_share(n_groups, rows, resident, active):
    """grid.x of a grouped launch with ``rows`` grid rows (slots, times K's shares) of which about ``active`` have
    work: the CTAs of the others return at once and free their SM for the next. :func:`row_share`'s x unless a
    larger one takes at least 10% fewer strip-times: x CTAs a slot run in about ceil(active x / resident) rounds of
    ceil(n_groups / x) strips plus ``CTA_OVERHEAD_STRIPS`` each. qwen3-30b-a3b's experts at B = 16 (84 of 128 slots
    active, one 16-warp CTA an SM on 132): x = 1 is one round of whole experts while 48 SMs idle; x = 3 two rounds of
    thirds, 20-24% less time (x = 2, two rounds of halves: +4%; x = 4, three of quarters: +11-13% on x = 3);
    at B = 4 (27-31 of 32 active, x = 4) x = 6, 8, 12 took 10-35% more (benchmarks/README.md, "Forty-ninth session")."""
    x0 = row_share(n_groups, rows, resident)
    active = max(1.0, min(rows, active))

    def strip_times(x):
        return math.ceil(active * x / resident) * (-(-n_groups // x) + CTA_OVERHEAD_STRIPS)

    best = min(range(x0, n_groups + 1), key=lambda x: (strip_times(x), x))
    return best if strip_times(best) <= MORE_CTAS_GAIN * strip_times(x0) else x0


def expected_active(E, T):
    """About how many of ``E`` experts ``T`` routed rows reach when the router spreads them evenly:
    E (1 - (1 - 1/E)^T) (qwen3-30b-a3b, E = 128 and top-8: 81 at B = 16, 28.5 at B = 4; measured 80-84, 27-31)."""
    return E * (1.0 - (1.0 - 1.0 / E) ** T) if E else 0.0


# ---- split-K sums (the tensor-core gemm's and gemv's): partial sums added atomically into a float32 workspace,
#      then one small launch writes the output and zeroes the workspace, ready for the next call
FINISH_THREADS = 256


def new_workspace(M, N, stream=0):
    """A zeroed float32 split-K workspace for an M x N output (the kernels leave it zeroed)."""
    return cuda.to_device(np.zeros(M * N, np.float32), stream=stream)


def split_sums(ws, n, stream):
    """The split-K workspace of a launch that splits: ``ws`` checked to hold n float32 values, or drawn from it when
    it is a reusable one (``dispatch.Workspace``: anything with ``sums(n, stream)``), or a new zeroed one. A plan
    calls it only when it splits, so a caller hands its reusable workspace over and the plan alone decides."""
    if hasattr(ws, "sums"):
        ws = ws.sums(n, stream)
    ws = _arrays.device_array(ws if ws is not None else new_workspace(n, 1, stream), "workspace",
                              (np.float32,), 1)
    if ws.shape[0] < n:
        raise ValueError(f"workspace must hold at least {n} float32 values (rows x N)")
    return ws


@lru_cache(maxsize=None)
def make_finish_kernel(out_dtype, silu_pairs=False, pdl=False):
    """Kernel(ws, out, n, N): out[i] = ws[i] (converted), ws[i] = 0 -- the split-K epilogue. With ``silu_pairs`` the
    gemvs' SiLU epilogue of an [M, N] workspace whose columns 2j, 2j + 1 are gate j and up j (n = M * N / 2 outputs):
    out[r, j] = silu(ws[r, 2j]) * ws[r, 2j + 1], both sums zeroed (twin: ``reference.silu_pairs``).
    ``pdl``: built for a programmatic dependent launch after a PDL split launch: it lets the next kernel start at once
    and waits in ``griddep_wait`` for the split launch's sums before it reads one (as a plain launch it was a point
    where a PDL chain serialised: the next kernel's prologue could not overlap it). H200, the llama3-8b step on the
    fragment layout (`kbit k=4 pdl frag`): B = 4 24.0 +- 1.3 us faster, B = 16 47.3 +- 2.0 (benchmarks/README.md,
    "Seventy-fourth session")."""
    f16_out = np.dtype(out_dtype) == np.float16
    SILU = bool(silu_pairs)
    PDL = bool(pdl)

    def finish_kernel(ws, out, n, N):
        if PDL:                     # (ws is also written here: its loads are ordinary ones, kept after the wait)
            griddep_launch_dependents()
            griddep_wait()
        i = cuda.grid(1)
        if i < n:
            if SILU:
                half = N >> 1
                row = i // half
                g = row * N + 2 * (i - row * half)          # gate j of row r; up j follows it
                v = silu_mul(ws[g], ws[g + 1])
                ws[g] = np.float32(0.0)
                ws[g + 1] = np.float32(0.0)
            else:
                v = ws[i]
                ws[i] = np.float32(0.0)
            out[i] = np.float16(v) if f16_out else v

    return jit_kernel(finish_kernel)


def finish_step(ws, out, n, silu_row=0, pdl=False):
    """The split-K epilogue's launch: the first n sums of ``ws`` into ``out`` (any shape, n values), ws zeroed; with
    ``silu_row`` (N, the workspace's row length) the SiLU epilogue of n = M * N / 2 gate/up pairs instead. ``pdl``: a
    programmatic dependent launch (after a split launch that is one too)."""
    return Step(make_finish_kernel(out.dtype.name, bool(silu_row), bool(pdl)), -(-n // FINISH_THREADS), FINISH_THREADS,
                (ws, _arrays.flat_view(out), np.int32(n), np.int32(silu_row)), pdl=bool(pdl))


def k_warps(K):
    """Warps side by side along K when lane l of warp w owns block 32 w + l: ceil(K / 1024)."""
    return -(-(K // BLOCK) // WARP)


@lru_cache(maxsize=None)
def unused_i32():
    """A small int32 device array for a kernel argument that a launch leaves unused (the ABI has it)."""
    return cuda.to_device(np.zeros(2, np.int32))


@dataclass(frozen=True)
class RowsSpec(Spec):
    """The Spec of a GEMV family whose only compile-time choices are M (1..MAX_M) and the output type
    (subclasses name the family)."""
    M: int
    out_dtype: str = "float16"

    def normalise(self):
        if not 1 <= self.M <= MAX_M:
            raise ValueError(f"{self.FAMILY}.gemv handles M = 1..{MAX_M} rows, got M={self.M}")
        return dict(M=int(self.M), out_dtype=type_name(self.out_dtype, "out_dtype", OUT_TYPES))


def device_weight(w, cls, stream=0):
    """``w`` checked to be a ``cls`` container (one class or a tuple), with checked device arrays: each
    array field has a dtype its ``dtypes()`` allows and is C-contiguous; NumPy arrays are copied to the
    device (a list/tuple codebook is converted first). A kbit codebook must hold 2**k values."""
    if not isinstance(w, cls):
        names = " or ".join(c.__name__ for c in (cls if isinstance(cls, tuple) else (cls,)))
        raise TypeError(f"the weight must be a {names}, got {type(w).__name__}")
    fixed = {}
    for field, dtypes in w.dtypes().items():
        a = getattr(w, field)
        if isinstance(a, (list, tuple)):
            a = np.asarray(a, dtypes[0])
        fixed[field] = _arrays.device_array(a, f"weight.{field}", dtypes, None, stream)
    if hasattr(w, "codebook") and fixed["codebook"].shape[0] != 1 << w.k:
        raise ValueError(f"codebook must hold {1 << w.k} values for k={w.k}, got {fixed['codebook'].shape[0]}")
    return replace(w, **fixed)


# ---- MoE experts ---------------------------------------------------------------------------------
def stack_experts(experts, stream=None):
    """A list of KbitWeights, of KbitCodes or of KbitFragments (same shape, k, layout, absmax format, codebook) ->
    KbitExperts on the device (layout "codes" or "fragments" for the last two: ``mma_gemv.grouped_gemv`` reads
    them)."""
    experts = list(experts)
    if not experts or not any(all(isinstance(w, cls) for w in experts)
                              for cls in (KbitWeight, KbitCodes, KbitFragments)):
        raise TypeError("stack_experts needs a non-empty list of KbitWeight (or of KbitCodes, or of KbitFragments)")
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
    """Checked MoE inputs: (device A, its element type, T, device offsets, device experts). A: [T, K]
    tokens sorted by expert; expert_offsets: int32 [E+1]."""
    experts = device_weight(experts, KbitExperts, stream)
    E = experts.n_experts
    K = experts.expert_shape[1]
    Ad, a_src = _arrays.float_input(A, "A", bf16, 2, stream)
    T = tuple(Ad.shape)[0]
    if tuple(Ad.shape)[1] != K:
        raise ValueError(f"A has K={tuple(Ad.shape)[1]}, the experts have K={K}")
    offs = _arrays.device_array(expert_offsets, "expert_offsets", (np.int32,), 1, stream)
    if offs.shape[0] != E + 1:
        raise ValueError(f"expert_offsets must hold E+1 = {E + 1} values, got {offs.shape[0]}")
    return Ad, a_src, T, offs, experts


def max_tokens_per_expert(host_offsets, T):
    """The largest expert's token count, after checking that the offsets rise from 0 to T."""
    h = host_offsets
    if h[0] != 0 or h[-1] != T or np.any(np.diff(h) < 0):
        raise ValueError(f"expert_offsets must rise from 0 to T={T}")
    return int(np.max(np.diff(h))) if len(h) > 1 else 0
