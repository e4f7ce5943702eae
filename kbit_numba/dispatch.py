"""One entry point for C = A @ W^T: ``linear`` picks scalar GEMV, pair GEMV, tensor-core GEMV or GEMM, or dequantize + cuBLAS.

The choice depends on M and the shape and comes from a per-GPU table, ``kbit_numba/tuning/<gpu>.json``,
written by ``python -m kbit_numba.bench --tune`` on that GPU (loaded by device name; unknown GPUs get
``DEFAULT_TABLE``). A table holds general rules (``[[max_m, kernel], ...]``, the first rule with
M <= max_m wins, ``null`` = any M) and per-shape rules for the shapes it measured (key ``"KxN"``).

A rule is only followed when its kernel applies; otherwise the next applicable one in ``FALLBACK``:
``gemv`` needs M <= 4 (bigger M runs it in slices of 4 rows), ``gemm`` the tiled layout,
``dequant_matmul`` torch or CuPy for the cuBLAS call. A weight in the code layout (``KbitCodes``, k = 2, 4) is read
by ``pair_gemv``, by ``mma_gemv`` (M <= 32 as far as ``mma_gemv_max_m`` allows; float16/bfloat16 A, K a multiple of
64; K split past 8192, or past 4096 where a CTA of all its K-warps would spill: ``mma_gemv.k_splits``) and by ``gemm``
(K a multiple of 64); the table's ``codes_rules`` (default ``CODES_RULES``) choose between them, and its
``codes_variants`` and ``codes_shapes`` (``python -m kbit_numba.bench --tune-codes``) hold rules with the pair gemv's
launch knobs measured best on that GPU, or the tensor-core gemv where it was faster, for any shape and per shape
(``codes_rules()``). Where those rules give the
gemm or dequantize + cuBLAS, ``codes_mm_rules`` / ``codes_mm_shapes`` (``--tune``) pick between the two.

For MoE experts (``KbitExperts``), ``grouped_linear`` and ``KbitExpertsLinear`` pick one of the grouped kernels per
routing (``choose_grouped``: the grouped pair gemv, the tensor-core gemv, the scalar grouped gemv or the grouped gemm),
by a rule measured on the H100 rather than a per-GPU table.

``KbitLinear`` keeps a weight ready for repeated calls: by default the code layout where it can (k = 2, 4, K a
multiple of 64: the pair and tensor-core gemvs for decode, the gemm and dequantize + cuBLAS for larger M), else a tiled copy
(which serves gemv and gemm); on request the fragment layout (``layout="fragments"``: the tensor-core gemv for M = 1..32,
dequantize + cuBLAS beyond; ``FRAGMENT_RULES``); a ``Workspace`` (split-K sums, the dequantized weight) and prepared
launches for decode loops.
"""
from __future__ import annotations

import json
import os
import re
from functools import lru_cache, partial

import numpy as np
from numba import cuda

from . import _arrays, mma_gemv, pair_gemv, scalar_gemv, tensor_gemm
from .codec import plan_dequantize, repack_tiled
from .core import MAX_M, device_weight, k_warps
from .formats import CODE_LAYOUTS, CODES_K, TILE_N, KbitCodes, KbitFragments, KbitWeight, check_fragment_shape
from .intrinsics import SIMULATOR
from .launch import HostStep, Plan, stream_handle

KERNELS = ("gemv", "pair_gemv", "mma_gemv", "gemm", "dequant_matmul")
EPILOGUE_GEMVS = ("pair_gemv", "mma_gemv")   # the code and fragment layouts' gemvs: PDL builds, the silu_pairs epilogue
LAYOUTS = ("auto", "tiled", "codes", "fragments")  # what KbitLinear keeps on the device ("auto": codes where it can)
FALLBACK = ("gemm", "dequant_matmul", "gemv")
FALLBACK_CODES = ("gemm", "pair_gemv")   # (the pair gemv reads every code-layout weight)
TUNING_DIR = os.path.join(os.path.dirname(__file__), "tuning")
DEFAULT_TABLE = {"device": "default", "rules": [[4, "gemv"], [256, "gemm"], [None, "dequant_matmul"]],
                 "shapes": {}}
# The code layout, when a table has no codes_rules (H100, benchmarks/README.md): the pair gemv at M <= 2, the
# tensor-core gemv to M = 8 (faster than the pair gemv at M = 4 and the gemm at M = 8 on every measured shape;
# to 16 at k = 4: MMA_GEMV_MAX_M), the gemm to 64, dequantize + cuBLAS from the tiled tables' crossover on. Past
# K = 8192 the tensor-core gemv splits K (a llama3-8b down projection: 14336x4096 k = 4 M = 4 19.8 us against the
# gemm's 32.0 and the float16-sum pair gemv's 24.6; H200, benchmarks/README.md "Thirty-ninth session"), and past
# K = 4096 where its whole CTA would spill (K = 5120: "Forty-third session"). Where it
# does not apply (float32 A) the pair gemv runs to M = 4 if its CTA of all K's warps fits without a register cap
# (PAIR_GEMV_MAX_ROW_WARPS), else the gemm.
CODES_RULES = [[2, "pair_gemv"], [16, "mma_gemv"], [64, "gemm"], [None, "dequant_matmul"]]   # (see MMA_GEMV_MAX_M)
PAIR_GEMV_MAX_ROW_WARPS = 32       # M * ceil(K / 1024): M = 4 at K = 14336 (56) spilled, 85 us vs the gemm's 38
# ... but with float16 block sums (f16_acc) the pair gemv keeps fewer values a lane: at M = 3, 4 on K = 11008 and
# 14336 (row-warps 33..56) it took 14.1-24.8 us against the gemm's 20.4-32.4 (H100, k = 2 and 4; benchmarks/README.md)
PAIR_GEMV_MAX_ROW_WARPS_F16 = 56
# With f16_acc at k = 4 the pair gemv also beats the tensor-core gemv at M = 3 (7-15% on five llama/qwen shapes; the
# llama3-8b B = 3 step 8% faster), not at M = 4; at k = 2 it does not (that step 3% slower). H100, benchmarks/README.md.
# This holds where a table has no tuned rules for the variant: ``bench --tune-codes`` times the tensor-core gemv beside
# the pair gemv's knob sets at each M it tunes (from ``bench.CODES_TUNE_MMA_FROM_M``), so tuned rules say which is
# faster themselves (as PDL chains on the H200 the tensor-core gemv won by 8-15% at M = 2, 3 on three of eight points;
# benchmarks/README.md, "Seventy-second session").
PAIR_GEMV_F16_MAX_M = {4: 3}       # k -> the largest M the pair gemv with float16 block sums takes from it
# The tensor-core gemv's two token tiles (M = 9..16) take 10-20% less time than the tiled gemm and 25-28% less than
# the code layout's at k = 4 (M = 12, 16 on 4096x14336, 2048x5120, 4096x6144), but up to 1.8x more at k = 2. H100,
# benchmarks/README.md. Past this M (one tile, 8, for other k) the rules' mma_gemv rows run the gemm. A GPU's table
# may set its own caps (``mma_gemv_max_m``, by k): since k = 2 loads its activations in k = 4's order (A_SWAP) its two
# tiles beat the code layout's gemm by 2-29% at M = 12 and by 17-30% on three of five shapes at M = 16 (3.5-3.7%
# slower on two) on the H200 (benchmarks/README.md, "Thirty-ninth session"). Both GPUs' tables take it to M = 32 at
# k = 2 and 4 (on the H100 since 2026-12-07: 6-45% less time than the code layout's gemm at k = 4, M = 8..32, on the six
# seed shapes; at k = 2 ahead or within 5%, the table capping 2048x512 at 24; "Ninety-eighth session").
MMA_GEMV_MAX_M = {4: 16}           # k -> the largest M the tensor-core gemv takes (tables without a cap)
# Its three and four token tiles (M = 17..32, CTAs of at most 8 K-warps: mma_gemv.WIDE_KW) took 6-37% less time than
# the code layout's gemm at M = 24 and 32 on all ten measured shapes with K <= 5120 at k = 4 (H200; at k = 2 on most:
# the H200 table's caps); past K = 8192, where the K-warps split over several CTAs, 29-31% less at k = 4 and 17-21% at
# k = 2 on 14336x4096 (28.96 us against 40.99 at M = 24) once the split grid stopped launching a CTA past the resident
# ones (benchmarks/README.md, "Forty-sixth session" and "Forty-seventh session").
# A table may also cap it per shape (``mma_gemv_max_m_shapes``, {"KxN": {k: cap}}; ``bench --tune`` writes them:
# ``bench.mma_gemv_caps``). On the H200 its two token tiles took 23.4 us at 5120x2048 k = 4 M = 16 against the code
# layout's gemm's 13.0 while a CTA of 20 K-warps ran at 64 registers; split in two (``mma_gemv.k_splits``, since the
# forty-third session) they took 10.2, so that shape's hand-entered cap went. benchmarks/README.md, "Forty-second
# session" and "Forty-third session".
# The fragment layout (``KbitLinear(layout="fragments")``, an option for batched decode; ``mma_gemv.to_fragments``):
# the tensor-core gemv reads it 5-17% faster than the code layout at M = 3..8 (0-10% at 16) and, at M = 1, faster
# than the pair gemv reads it (H100, 4096x14336, k = 4: 16.15 us against 17.41 with float16 block sums; the pair gemv
# on the code layout 13.9; H200 14336x4096 M = 4 split in K: 16.38 against 19.77; benchmarks/README.md). No gemm
# reads it. So the tensor-core gemv takes M = 1..32 (float16/bfloat16 A; no cap by k or K: the kernel it would give
# way to is dequantize + cuBLAS, which its three and four token tiles beat by 15-38% at M = 24, 32 on 2048x4096,
# 2048x5120 and 4096x4096 and by 59-66% on 4096x14336 and 14336x4096, k = 2 and 4; H200, benchmarks/README.md,
# "Forty-seventh session"), the pair gemv float32 A to M = 4 where its registers fit (PAIR_GEMV_MAX_ROW_WARPS, as on
# the code layout), and dequantize + cuBLAS the rest (with no cuBLAS route: the pair gemv, 4 rows a launch). No
# per-GPU table. Measured as a whole (H200, llama3-8b step, 2026-11-29; benchmarks/README.md, "Forty-first session"):
# B = 4..16 8-11% faster than the code layout, B = 1 24-25% slower than its pair gemv with float16 sums.
# (The pair gemv with float16 sums took the down projection, K = 14336, at M = 1, 2 for one session: 14.1 us against
# the split tensor-core gemv's 16.9 as a chain of itself, but the B = 1 step ran 56 us slower, its QKV launches the
# most: benchmarks/README.md, "Seventy-fifth session".)
FRAGMENT_RULES = [[32, "mma_gemv"], [MAX_M, "pair_gemv"], [None, "dequant_matmul"]]


def mma_gemv_max_m(table, k, N=None, K=None):
    """The largest M the tensor-core gemv takes on an N x K weight of ``k`` bits: the table's cap for that shape
    (``mma_gemv_max_m_shapes["KxN"][str(k)]``), else its cap for ``k`` (``mma_gemv_max_m[str(k)]``; both measured on
    its GPU), else ``MMA_GEMV_MAX_M[k]``, else one token tile (8)."""
    shape = table.get("mma_gemv_max_m_shapes", {}).get(f"{K}x{N}", {})
    if str(k) in shape:
        return int(shape[str(k)])
    return int(table.get("mma_gemv_max_m", {}).get(str(k), MMA_GEMV_MAX_M.get(k, mma_gemv.N8)))


# ---- the per-GPU table ---------------------------------------------------------------------------
def device_key(name):
    """'NVIDIA H200' -> 'nvidia_h200' (the table's file name)."""
    if isinstance(name, bytes):
        name = name.decode()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@lru_cache(maxsize=None)
def load_table(name=None):
    """The table for GPU ``name`` (default: the current device), or DEFAULT_TABLE."""
    if name is None:
        try:
            name = cuda.get_current_device().name
        except Exception:          # the simulator
            return DEFAULT_TABLE
    path = os.path.join(TUNING_DIR, device_key(name) + ".json")
    if not os.path.exists(path):
        return DEFAULT_TABLE
    with open(path) as f:
        return json.load(f)


def gemm_reads(layout, K):
    """Whether the tensor-core gemm reads a weight of ``layout`` with K columns: the tiled layout, or the
    code layout with K a multiple of its K tile (64)."""
    return layout == "tiled" or (layout == "codes" and K % tensor_gemm.BK == 0)


def mma_reads(M, K, half=True):
    """Whether the tensor-core gemv takes M rows of ``half`` (float16/bfloat16) activations on a code-layout
    weight with K columns."""
    return half and mma_gemv.reads(M, K)


def codes_variant(k, f16_acc=False, pdl=False):
    """The key of a code-layout weight's rules in a table's ``codes_variants`` and ``codes_shapes``: its bits,
    whether the pair gemv sums blocks in float16, and whether it runs as a programmatic dependent launch (the best
    launch knobs differ: in a PDL chain a launch's prologue overlaps the kernel before it)."""
    return f"k={k}" + (" f16_acc" if f16_acc else "") + (" pdl" if pdl else "")


def tuned_codes_rules(table, N, K, k=None, f16_acc=False, pdl=False):
    """The rules that ``bench --tune-codes`` wrote on this GPU for an N x K weight of ``k`` bits and that variant:
    the per-shape ones (``codes_shapes["KxN"][codes_variant(k, f16_acc, pdl)]``: the pair gemv's launch knobs, or
    the tensor-core gemv, measured best on that shape at each tuned M), else the variant's rules for any shape
    (``codes_variants``), else None."""
    variant = codes_variant(k, f16_acc, pdl)
    return (table.get("codes_shapes", {}).get(f"{K}x{N}", {}).get(variant)
            or table.get("codes_variants", {}).get(variant))


def codes_rules(table, N, K, k=None, f16_acc=False, pdl=False):
    """The code layout's rules for an N x K weight of ``k`` bits: the tuned ones (:func:`tuned_codes_rules`), else
    the table's ``codes_rules``, else ``CODES_RULES``."""
    return tuned_codes_rules(table, N, K, k, f16_acc, pdl) or table.get("codes_rules", CODES_RULES)


SILU = " silu"       # a codes_shapes variant key's suffix: the pair gemv's knobs for its SiLU epilogue's build
ACC = " acc"         # ... and for its residual-add build (``accumulate``: a decode step's o and down projections)
EPILOGUES = (SILU, ACC)
EPILOGUE_KNOBS = ("cols", "cta_warps")   # the launch knobs an epilogue build's own rule replaces


def epilogue_knobs(table, N, K, M, k=None, f16_acc=False, pdl=False, epilogue=SILU):
    """The pair gemv's launch knobs for one of its epilogue builds (``epilogue``: ``SILU`` for ``silu_pairs``, ``ACC``
    for ``accumulate``; the one takes more registers than the plain build, the other reads and writes its output in
    place, so other knobs may win) at M rows of an
    N x K weight: the table's per-shape rules under ``codes_variant(k, f16_acc, pdl) + epilogue`` where it has them
    and they run the pair gemv at M, else None (the plain build's knobs apply). Which kernel runs is the plain rules'
    choice either way (``kernel_for`` does not know the epilogue). Measured (H200): llama3-8b's gate/up, k = 4, M = 1,
    float16 sums, alone and as a PDL chain, ``cols = 2`` with 8-warp CTAs 5.5% faster than the plain build's knobs;
    with float32 sums no knob set was 3% faster (benchmarks/README.md, "Fifty-second session"). The residual-add
    build's rules (``ACC``): on the H100, llama3-8b's down (14336x4096) at k = 4, M = 1, float16 sums with PDL,
    runs the plan's defaults and o (4096x4096) ``cols = 2``, 3.6% and 7% faster alone than the plain rule's knobs
    and -16.7 us in the decode step (benchmarks/README.md, "Eighty-first session")."""
    rules = table.get("codes_shapes", {}).get(f"{K}x{N}", {}).get(codes_variant(k, f16_acc, pdl) + epilogue)
    try:
        kernel, params = _first_rule(rules or [], M)
    except StopIteration:          # (no rule for M: the plain build's knobs)
        return None
    return params if kernel == "pair_gemv" else None


def silu_knobs(table, N, K, M, k=None, f16_acc=False, pdl=False):
    """:func:`epilogue_knobs` of the SiLU epilogue's build (``silu_pairs``)."""
    return epilogue_knobs(table, N, K, M, k, f16_acc, pdl, SILU)


def with_epilogue_knobs(params, knobs):
    """``params`` (a plain rule's) with an epilogue build's own knobs (``epilogue_knobs``; None: none) in place of
    its ``EPILOGUE_KNOBS`` (its other parameters, e.g. ``max_registers``, stay)."""
    if knobs is None:
        return params
    return {key: v for key, v in params.items() if key not in EPILOGUE_KNOBS} | knobs


def _first_rule(rules, M):
    """(kernel, launch parameters) of the first rule ``[max_m, kernel(, params)]`` with M <= max_m (None: any M);
    StopIteration where none has (a table's plain rules end with an any-M rule; epilogue rules may stop short)."""
    return next((r[1], dict(r[2]) if len(r) > 2 else {}) for r in rules if r[0] is None or M <= r[0])


def choose_rule(M, N, K, layout, table=None, backend=None, half=True, f16_acc=False, k=None, pdl=False):
    """(kernel, launch parameters) that ``linear`` runs for an M x K input and an N x K weight of
    ``layout``. A table rule is ``[max_m, kernel]`` or ``[max_m, kernel, {parameter: value}]``: the
    parameters (e.g. ``{"cols": 2}`` for gemv, ``{"split": 4, "m_tile": 2}`` for gemm) go to that
    kernel's ``plan`` and override its ``DEFAULTS`` table; a fallback kernel runs with its defaults.
    ``backend``: the cuBLAS route ('torch', 'cupy', 'host' on the simulator, or False for none); None asks
    ``matmul_backend()``.
    ``half``: the activations are float16 or bfloat16 (what the tensor-core gemv takes). ``f16_acc``: a pair
    gemv would sum its blocks in float16 (float16 activations, ``f16_acc`` asked for): it then stays the choice to
    a longer K at M = 3, 4 (``PAIR_GEMV_MAX_ROW_WARPS_F16``) and, for the weight's bits ``k``, takes M = 3 from the
    tensor-core gemv at k = 4 (``PAIR_GEMV_F16_MAX_M``) unless the table's tuned rules for the variant say which of
    the two is faster (:func:`tuned_codes_rules`). The tensor-core gemv takes M up to
    :func:`mma_gemv_max_m` (the table's cap for the shape and ``k``, or for ``k``, else ``MMA_GEMV_MAX_M``, else 8),
    the gemm beyond. ``pdl``: the gemv would run as a programmatic dependent launch (``KbitLinear(pdl=True)``; the
    table's rules for that variant apply: :func:`codes_rules`). The fragment layout follows ``FRAGMENT_RULES`` (no table)."""
    table = table or load_table()
    if layout == "fragments":
        return _fragment_rule(M, K, half, backend)
    codes = layout == "codes"      # (pair gemv, tensor-core gemv and gemm where K allows, dequantize + cuBLAS)
    rules = (codes_rules(table, N, K, k, f16_acc, pdl) if codes
             else table.get("shapes", {}).get(f"{K}x{N}", table["rules"]))
    want, params = _first_rule(rules, M)
    if codes and want == "mma_gemv" and M > mma_gemv_max_m(table, k, N, K):
        want, params = "gemm", {}
    if codes and want in ("gemm", "dequant_matmul"):   # past the gemvs: the crossover --tune measured for this layout
        mm = table.get("codes_mm_shapes", {}).get(f"{K}x{N}") or table.get("codes_mm_rules")
        if mm:
            want, params = _first_rule(mm, M)
    gemm_ok = gemm_reads(layout, K)
    mma_ok = codes and mma_reads(M, K, half)
    f16_pair = (f16_acc and M <= PAIR_GEMV_F16_MAX_M.get(k, 0)       # (the H100's rule, where nothing tuned says)
                and not tuned_codes_rules(table, N, K, k, f16_acc, pdl))
    if codes and want == "mma_gemv" and (not mma_ok or f16_pair) and M <= MAX_M:
        want, params = "pair_gemv", {}
    most_row_warps = PAIR_GEMV_MAX_ROW_WARPS_F16 if f16_acc else PAIR_GEMV_MAX_ROW_WARPS
    if codes and want == "pair_gemv" and M <= MAX_M and M * k_warps(K) > most_row_warps and gemm_ok:
        want, params = "gemm", {}
    usable = {"gemv": not codes and M <= MAX_M, "pair_gemv": codes, "mma_gemv": mma_ok, "gemm": gemm_ok,
              "dequant_matmul": bool(backend if backend is not None else matmul_backend())}
    if usable.get(want, False):
        return want, params
    for kern in FALLBACK_CODES if codes else FALLBACK:
        if usable[kern]:
            return kern, {}
    return "gemv", {}              # any M, in slices of 4 rows


def _fragment_rule(M, K, half, backend):
    """``FRAGMENT_RULES``' first rule whose kernel applies: the tensor-core gemv takes ``half`` activations only, the
    pair gemv M rows of all K's warps where they fit its registers, dequantize + cuBLAS needs a cuBLAS route; with none
    of them the pair gemv (any M, 4 rows a launch)."""
    usable = {"mma_gemv": mma_reads(M, K, half), "pair_gemv": M * k_warps(K) <= PAIR_GEMV_MAX_ROW_WARPS,
              "dequant_matmul": bool(backend if backend is not None else matmul_backend())}
    kernel = next((kern for max_m, kern in FRAGMENT_RULES if (max_m is None or M <= max_m) and usable[kern]),
                  "pair_gemv")
    return kernel, {}


def choose(M, N, K, layout, table=None, backend=None, half=True, f16_acc=False, k=None, pdl=False):
    """The kernel ``linear`` runs (see :func:`choose_rule`)."""
    return choose_rule(M, N, K, layout, table, backend, half, f16_acc, k, pdl)[0]


# ---- dequantize + cuBLAS ---------------------------------------------------------------------------
@lru_cache(maxsize=None)
def matmul_backend():
    """'torch' or 'cupy' (whichever imports, torch first) for the cuBLAS call, or None. Under the simulator
    'host': its device arrays are host memory, which cuBLAS cannot read, so NumPy does the matmul the way cuBLAS
    does (float32 sums, one rounding to the output type) and CI runs the rest of the dequantize + matmul plan."""
    if SIMULATOR:
        return "host"
    for name in ("torch", "cupy"):
        try:
            __import__(name)
            return name
        except Exception:
            continue
    return None


class Workspace:
    """Reusable device buffers for ``linear``: the float32 split-K sums (kept zeroed by the kernels) and
    the dequantized weight. Grown on demand; one launch at a time per workspace."""

    def __init__(self):
        self._sums = None
        self._weights = {}

    def sums(self, n, stream=0):
        if self._sums is None or self._sums.shape[0] < n:
            self._sums = tensor_gemm.new_workspace(n, 1, stream)
        return self._sums

    def weight(self, shape, dtype, stream=0):
        key = (tuple(shape), np.dtype(dtype).str)
        if key not in self._weights:
            self._weights[key] = cuda.device_array(shape, dtype, stream=stream)
        return self._weights[key]


def _cublas_matmul(Ad, Wd, out, stream, bf16=False):
    """out = Ad @ Wd^T with torch or CuPy on ``stream`` (all device arrays, same float dtype; ``bf16``: Ad and Wd
    hold bfloat16 bits as int16, torch only (:func:`bf16_matmul_backend`), the product rounded to bfloat16 before
    ``out``'s type)."""
    backend = matmul_backend()
    if backend == "host":             # the simulator (synchronous: every stream is in order); its arrays wrap
        a, w, o = (x._ary for x in (Ad, Wd, out))     # NumPy arrays (._ary)
        if bf16:
            from .reference import bf16_bits_to_float32, float32_to_bf16_bits
            prod = bf16_bits_to_float32(a) @ bf16_bits_to_float32(w).T
            o[...] = bf16_bits_to_float32(float32_to_bf16_bits(prod.astype(np.float32))).astype(o.dtype)
            return
        o[...] = (a.astype(np.float32) @ w.astype(np.float32).T).astype(o.dtype)
        return
    handle = stream_handle(stream)
    if backend == "torch":
        import torch
        a, w, o = (torch.as_tensor(x, device="cuda") for x in (Ad, Wd, out))
        if bf16:
            a, w = a.view(torch.bfloat16), w.view(torch.bfloat16)
        s = torch.cuda.ExternalStream(handle) if handle else torch.cuda.default_stream()
        with torch.cuda.stream(s):
            if o.dtype == a.dtype:
                torch.matmul(a, w.t(), out=o)
            else:
                o.copy_(torch.matmul(a, w.t()))
    elif backend == "cupy":            # (never with bf16: plan_dequant_matmul refuses it first)
        import cupy
        a, w, o = (cupy.asarray(x) for x in (Ad, Wd, out))
        with cupy.cuda.ExternalStream(handle) if handle else cupy.cuda.Stream.null:
            if o.dtype == a.dtype:
                cupy.matmul(a, w.T, out=o)
            else:
                o[...] = cupy.matmul(a, w.T)
    else:
        raise RuntimeError("dequant_matmul needs torch or CuPy for the cuBLAS call; neither is installed")


def bf16_matmul_backend():
    """Whether the cuBLAS call takes bfloat16 (torch, or NumPy on the simulator; not CuPy)."""
    return matmul_backend() in ("torch", "host")


def plan_dequant_matmul(A, qw, out=None, stream=None, out_dtype=np.float16, workspace=None, bf16=False):
    """Checked inputs of :func:`dequant_matmul` bound into a :class:`launch.Plan`: the dequantize launch
    and the cuBLAS call (a ``HostStep``)."""
    stream = _arrays.as_stream(stream)
    if bf16 and not bf16_matmul_backend():
        raise ValueError("dequant_matmul takes bfloat16 activations through torch only (CuPy has no bfloat16)")
    Ad, _ = _arrays.float_input(A, "A", bf16, (1, 2), stream)
    N, K = qw.shape
    if tuple(Ad.shape)[-1] != K:
        raise ValueError(f"A has K={tuple(Ad.shape)[-1]}, the weight has K={K}")
    out_dtype = _arrays.output_dtype(out, out_dtype)
    out = _arrays.output(out, "out", tuple(Ad.shape)[:-1] + (N,), out_dtype, stream)
    ws = workspace or Workspace()
    w_dtype = np.dtype(np.int16) if bf16 else Ad.dtype             # (bfloat16 bits as int16)
    dq = plan_dequantize(qw, "bfloat16" if bf16 else Ad.dtype, ws.weight((N, K), w_dtype, stream), stream)
    Wd = dq.out
    return Plan(dq.steps + [HostStep(partial(_cublas_matmul, Ad, Wd, out, bf16=bf16))], Ad, out, stream)


def dequant_matmul(A, qw, out=None, stream=None, out_dtype=np.float16, workspace=None, bf16=False):
    """C = A @ W^T as ``dequantize`` into a reusable buffer, then cuBLAS (torch or CuPy). A float16 or
    float32, or bfloat16 bits as int16 with ``bf16=True`` (torch only); the weight is dequantized to A's type."""
    return plan_dequant_matmul(A, qw, out, stream, out_dtype, workspace, bf16).launch()


# ---- the entry point -------------------------------------------------------------------------------
def _rows(A):
    shape = tuple(A.shape)
    return 1 if len(shape) == 1 else shape[0]


def half_input(A, bf16=False):
    """Whether activations ``A`` are float16 (a NumPy, device or torch array) or bfloat16 bits (``bf16``)."""
    return bool(bf16) or f16_input(A, bf16)


def f16_input(A, bf16=False):
    """Whether activations ``A`` are float16 (what the pair gemv's float16 block sums take)."""
    return not bf16 and str(A.dtype) in ("float16", "torch.float16")


def _bf16_runnable(kernel, params, layout, K, bf16):
    """(kernel, params) as a call runs them: bfloat16 activations cannot take dequantize + cuBLAS without torch (CuPy
    has no bfloat16), so there the gemm runs instead (or a gemv where the gemm does not read the layout)."""
    if bf16 and kernel == "dequant_matmul" and not bf16_matmul_backend():
        return ("gemm" if gemm_reads(layout, K) else "pair_gemv" if layout in CODE_LAYOUTS else "gemv"), {}
    return kernel, params


def plan(A, qw, out=None, stream=None, workspace=None, out_dtype=np.float16, bf16=False, kernel=None,
         table=None, f16_acc=False, params=None):
    """Checked inputs of :func:`linear` bound into a :class:`launch.Plan` for the kernel it chooses (M > 4
    on a gemv: one launch per slice of 4 rows). ``params``: launch parameters for a forced ``kernel``
    (a chosen one takes its table rule's)."""
    if not isinstance(qw, (KbitWeight, KbitCodes, KbitFragments)):
        raise TypeError(f"qw must be a KbitWeight, KbitCodes or KbitFragments, got {type(qw).__name__}")
    stream = _arrays.as_stream(stream)
    A = _arrays.check_array(A, "A")
    M = _rows(A)
    N, K = qw.shape
    params = dict(params or {})
    if kernel is None:
        kernel, params = choose_rule(M, N, K, qw.layout, table, half=half_input(A, bf16),
                                     f16_acc=f16_acc and f16_input(A, bf16), k=qw.k)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    native = qw.layout in CODE_LAYOUTS
    if ((kernel in ("gemv", "pair_gemv", "mma_gemv") and (kernel != "gemv") != native)
            or (kernel == "gemm" and qw.layout == "fragments")):
        raise ValueError(f"kernel {kernel!r} does not read the {qw.layout} layout (pair_gemv and mma_gemv read "
                         "KbitCodes and KbitFragments, gemv KbitWeight, gemm KbitWeight and KbitCodes, dequant_matmul "
                         "all three)")
    if f16_acc and kernel != "pair_gemv":
        raise ValueError(f"f16_acc applies to the pair gemv (KbitCodes), not to kernel {kernel!r}")
    kernel, params = _bf16_runnable(kernel, params, qw.layout, K, bf16)
    if kernel == "gemm":      # (the gemm and the tensor-core gemv draw split-K sums from the Workspace when they
        return tensor_gemm.plan(A, qw, out, stream, out_dtype, bf16, workspace, **params)   # split: core.split_sums)
    if kernel == "dequant_matmul":
        return plan_dequant_matmul(A, qw, out, stream, out_dtype, workspace, bf16)
    if kernel == "mma_gemv":
        return mma_gemv.plan(A, qw, out, stream, out_dtype, bf16, workspace=workspace, **params)
    gemv_plan = (partial(pair_gemv.plan, f16_acc=f16_acc, **params) if kernel == "pair_gemv"
                 else partial(scalar_gemv.plan, **params))
    if M <= MAX_M:
        return gemv_plan(A, qw, out, stream, out_dtype, bf16)
    if params.get("silu_pairs"):
        raise ValueError(f"silu_pairs takes M = 1..{MAX_M} rows (one pair gemv launch), got M={M}")
    Ad, _ = _arrays.float_input(A, "A", bf16, 2, stream)   # a gemv in slices of 4 rows
    out_dtype = _arrays.output_dtype(out, out_dtype)
    out = _arrays.output(out, "out", (M, N), out_dtype, stream)
    slices = [gemv_plan(Ad[r:r + MAX_M], qw, out[r:r + MAX_M], stream, out_dtype, bf16) for r in range(0, M, MAX_M)]
    return Plan([s for p in slices for s in p.steps], Ad, out, stream)


def linear(A, qw, out=None, stream=None, workspace=None, out_dtype=np.float16, bf16=False, kernel=None,
           table=None, f16_acc=False):
    """C[M, N] = A[M, K] @ W^T for any M, by the fastest applicable kernel for this GPU, M and shape.

    A: float16/float32 [M, K] or [K] (bfloat16 as int16 bits with ``bf16=True``); qw: a KbitWeight (the
    tensor-core GEMM needs the tiled layout: ``KbitLinear`` keeps one) or a KbitCodes (the pair gemv).
    ``workspace``: a ``Workspace`` reused across calls (else buffers are allocated per call). ``kernel``
    forces one of ``KERNELS``. ``f16_acc``: the pair gemv sums each 32-weight block in float16
    (``pair_gemv.gemv``; float16 A). Returns a device array [M, N] (or [N]) of ``out_dtype``, or ``out``."""
    return plan(A, qw, out, stream, workspace, out_dtype, bf16, kernel, table, f16_acc).launch()


def _weights_ready(stream):
    """Wait until weights just made or copied on ``stream`` (or any stream) are written: a programmatic dependent
    launch may load its weights before the kernel before it ends."""
    if stream:
        stream.synchronize()
    else:
        cuda.synchronize()


class KbitLinear:
    """A kbit weight kept ready for repeated ``linear`` calls (decode and prefill steps), one copy of it.

    ``layout="auto"`` (the default) keeps the **code layout** (``KbitCodes``, the same bytes) for k = 2, 4
    when K is a multiple of 64 (and the weight is flat or already codes), else the tiled layout. The
    code layout serves every M: the pair gemv at M = 1, 2 (the fastest kbit kernel there: 1.6x the tiled gemv at
    4096x14336 on the H100), the tensor-core gemv to M = 8, 16 at k = 4, 32 on the H200 where its table says
    (float16/bfloat16 A; K split past 8192, or past 4096 where a whole CTA would spill), the tensor-core gemm above,
    and dequantize + cuBLAS for large M; its gemm is 0-17% slower than the tiled layout's at M = 8..16 (H200,
    benchmarks/README.md), so prefill-heavy use at k = 2, 4 may prefer ``layout="tiled"``. The tiled layout (N a
    multiple of 128; otherwise the flat layout, served by gemv and dequantize + cuBLAS) serves the scalar gemv and the
    gemm.

    ``layout="fragments"`` (k = 2, 4, N a multiple of 16 and K of 256; an option for batched decode) keeps the
    fragment layout (``KbitFragments``, the same bytes in the tensor-core gemv's load order): the tensor-core gemv
    runs M = 1..32 on it, 12-19% faster than on the code layout at M = 4..8 (9-13% at 16, 0-7% at 24, 32; H200), but
    M = 1, 2 run slower than the code layout's pair gemv with float16 sums, and no gemm reads it: dequantize + cuBLAS
    takes M > 32 (``FRAGMENT_RULES``). The llama3-8b decode step (H200) with it: B = 4..16 8-11% faster, B = 1 24-25%
    slower than the code layout with ``f16_acc``.

    ``layer(A)`` is ``linear(A, weight, workspace=...)``; ``layer.prepare(A, out)`` binds buffers once and
    returns an object whose ``run()`` replays the chosen launches with no argument checking (CUDA-graph
    capturable; write new inputs into the bound ``A``).

    ``keep_flat=True`` (tiled only) also keeps the flat layout for the scalar GEMV (twice the weight
    memory): the gemv reads the tiled layout with scattered 16-byte loads and was up to 26% slower at
    M = 1..4 on the H100 and H200 grids (4096x14336 M=1: 27.3 vs 21.7 us; benchmarks/README.md).

    With the code layout, ``f16_acc=True`` makes the pair gemv sum each 32-weight block in float16 when the
    activations are float16 (faster, error bound in tests/test_pair_gemv.py; float32 and bfloat16
    activations keep float32 sums), and ``pdl=True`` launches the pair and tensor-core gemvs as programmatic
    dependent launches (sm_90): in a chain of layers each one's weight loads and table fill overlap the previous
    kernel's tail (``launch.py``; 11-44% less time per layer in the H100 bench's chains of same-shape
    layers at M = 1)."""

    def __init__(self, qw, table=None, stream=None, keep_flat=False, layout="auto", f16_acc=False, pdl=False):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        stream = _arrays.as_stream(stream)
        if layout == "auto":        # (a weight already in the fragment layout stays in it)
            layout = ("fragments" if isinstance(qw, KbitFragments)
                      else "codes" if self.codes_apply(qw) and not keep_flat else "tiled")
        if layout in CODE_LAYOUTS:
            frag = layout == "fragments"
            packed = (KbitCodes, KbitFragments) if frag else (KbitCodes,)   # (already in a k-bit-field layout)
            if not (isinstance(qw, packed)
                    or (isinstance(qw, KbitWeight) and qw.k in CODES_K and qw.layout == "flat")):
                raise ValueError(f"layout={layout!r} needs a flat KbitWeight with k in {CODES_K} (or a "
                                 f"KbitCodes{', KbitFragments' if frag else ''}), got "
                                 f"{getattr(qw, 'layout', type(qw).__name__)}, k={getattr(qw, 'k', None)}")
            if frag:        # (N a multiple of 16, K of 256: whole fragment tiles)
                check_fragment_shape(*qw.shape)
                kc = qw if isinstance(qw, KbitFragments) else pair_gemv.to_codes(qw, stream)
                self.weight = mma_gemv.to_fragments(kc, stream)
            else:
                self.weight = pair_gemv.to_codes(qw, stream)
            self.flat_weight = None
            self.table, self.workspace, self.f16_acc, self.pdl = table, Workspace(), bool(f16_acc), bool(pdl)
            if self.pdl:
                _weights_ready(stream)
            return
        if f16_acc or pdl:
            raise ValueError(f"f16_acc and pdl apply to the gemvs that read the code layout or the fragment layout "
                             f"(k in {CODES_K}, a flat KbitWeight or KbitCodes), not this {layout} one")
        self.f16_acc = self.pdl = False
        qw = device_weight(qw, KbitWeight, stream)
        self.flat_weight = qw if qw.layout == "flat" else None
        if qw.layout == "flat" and qw.shape[0] % TILE_N == 0:
            qw = repack_tiled(qw, stream=stream)
        if not keep_flat or self.flat_weight is qw:
            self.flat_weight = None
        self.weight = qw
        self.table = table
        self.workspace = Workspace()

    @staticmethod
    def codes_apply(qw):
        """Whether ``layout="auto"`` keeps ``qw`` in the code layout: a KbitCodes, or a flat KbitWeight with
        k = 2 or 4, and K a multiple of 64 (what the gemm on the code layout reads)."""
        flat_ok = isinstance(qw, KbitCodes) or (isinstance(qw, KbitWeight) and qw.layout == "flat"
                                                and qw.k in CODES_K)
        return flat_ok and gemm_reads("codes", qw.shape[1])

    def _weight_for(self, kernel):
        """The flat copy for the scalar GEMV when one is kept, else the (tiled) weight."""
        return self.flat_weight if kernel == "gemv" and self.flat_weight is not None else self.weight

    def kernel_for(self, M, half=True, bf16=False):
        """The kernel a call with M rows runs (``half``: float16 or bfloat16 activations; ``bf16``: bfloat16)."""
        N, K = self.weight.shape
        kernel = choose(M, N, K, self.weight.layout, self.table, half=half, f16_acc=self.f16_acc and half and not bf16,
                        k=self.weight.k, pdl=self.pdl)
        return _bf16_runnable(kernel, {}, self.weight.layout, K, bf16)[0]

    def __call__(self, A, out=None, stream=None, out_dtype=np.float16, bf16=False, kernel=None, silu_pairs=False,
                 rms_eps=None, accumulate=False):
        return self.plan(A, out, stream, out_dtype, bf16, kernel, silu_pairs, rms_eps, accumulate).launch()

    def plan(self, A, out=None, stream=None, out_dtype=np.float16, bf16=False, kernel=None, silu_pairs=False,
             rms_eps=None, accumulate=False):
        """``linear``'s :class:`launch.Plan` for this layer's weight and workspace (the table's launch
        parameters included when the kernel is the table's choice). ``silu_pairs``: the pair or tensor-core gemv's
        epilogue (``pair_gemv.plan``, ``mma_gemv.plan``), an [M, N / 2] output; a ValueError where the call runs
        another kernel. ``rms_eps`` and ``accumulate``: the pair gemv's RMSNorm scale and residual add, a decode step's
        add + norm inside its linears (``pair_gemv.plan``); a ValueError where the call runs another kernel."""
        params, chosen = {}, kernel is None
        if chosen:
            N, K = self.weight.shape
            kernel, params = choose_rule(_rows(_arrays.check_array(A, "A")), N, K, self.weight.layout, self.table,
                                         half=half_input(A, bf16), f16_acc=self.f16_acc and f16_input(A, bf16),
                                         k=self.weight.k, pdl=self.pdl)
        if self.pdl and kernel in EPILOGUE_GEMVS:
            params = dict(params, pdl=True)
        if silu_pairs:
            if kernel not in EPILOGUE_GEMVS:
                raise ValueError(f"silu_pairs is the pair and tensor-core gemvs' epilogue; this call runs {kernel!r} "
                                 "(kernel_for(M) says which kernel a batch runs)")
            if kernel == "pair_gemv" and chosen:      # the SiLU build's own knobs replace the plain build's
                params = with_epilogue_knobs(params, self._epilogue_knobs(A, bf16, SILU))
            params = dict(params, silu_pairs=True)
        if rms_eps is not None or accumulate:
            if kernel != "pair_gemv":
                raise ValueError(f"rms_eps and accumulate are the pair gemv's; this call runs {kernel!r} "
                                 "(kernel_for(M) says which kernel a batch runs)")
            if accumulate and chosen:                   # and the residual-add build's its own (ACC rules)
                params = with_epilogue_knobs(params, self._epilogue_knobs(A, bf16, ACC))
            params = dict(params, rms_eps=rms_eps, accumulate=accumulate)
        # f16_acc sums in float16 only float16 activations; float32 and bfloat16 ones keep float32 sums
        # (and only in the pair gemv: the gemm's MMAs have no such option)
        f16_acc = self.f16_acc and kernel == "pair_gemv" and f16_input(A, bf16)
        return plan(A, self._weight_for(kernel), out, stream, self.workspace, out_dtype, bf16, kernel,
                    self.table, f16_acc, params)

    def _epilogue_knobs(self, A, bf16, epilogue):
        """The table's knobs for the pair gemv's ``epilogue`` build at A's rows (:func:`epilogue_knobs`), or None."""
        return epilogue_knobs(self.table or load_table(), *self.weight.shape, _rows(A), self.weight.k,
                              self.f16_acc and f16_input(A, bf16), self.pdl, epilogue)

    def prepare(self, A, out=None, stream=None, out_dtype=np.float16, bf16=False, kernel=None):
        """Buffers bound once: a :class:`launch.Prepared` whose ``run()`` replays the chosen launches with
        one driver call each and no argument checking (CUDA-graph capturable; write new inputs into the
        bound ``A``)."""
        return self.plan(A, out, stream, out_dtype, bf16, kernel).prepare()


# ---- MoE experts: one entry that picks the grouped kernel per routing ------------------------------
GROUPED_KERNELS = ("pair_gemv", "mma_gemv", "grouped_gemv", "grouped_gemm")
# The rule between the grouped kernels (H100, qwen3-30b-a3b's expert shapes; benchmarks/README.md, twenty-ninth and
# thirtieth sessions). The grouped pair gemv runs a row a grid slot and re-reads an expert's weight for each of its
# rows (from L2 after the first). With float16 block sums it beat the tensor-core gemv while no expert had more than
# 4 rows (runs/2026-11-27_h100_grouped_pair_ab.txt; the qwen3 step -17% / -23% at B = 1 for k = 4 / 2, -8% / -4% at
# B = 4, -4% / -1.3% at B = 16). With float32 sums it won only at k = 2 on a B = 1 step's 8 rows (1872 -> 1708 us;
# B = 2 +4.8%, and k = 4 +4% at B = 1: runs/2026-11-27_h100_qwen3_step_ab_pair_fragments.txt).
# With both grouped grids rounded down to the resident CTAs (H200, 2026-12-01) the f16_acc rule still held in the
# qwen3-30b-a3b step: the tensor-core gemv for every routing took 9-20% longer at B = 1 / 4 / 16 (1556 / 3165 / 8235
# us against 1429 / 2649 / 6936, k = 4), though alone its B = 1 launches were 10% faster
# (runs/2026-12-01_h200_qwen3_step_grids_rounded_down.txt).
PAIR_GROUPED_MAX_ROWS = 4           # f16_acc: the pair gemv while the largest expert has at most this many rows
PAIR_GROUPED_F32_MAX_ROWS = {2: 8}  # float32 sums: k -> the pair gemv while all experts have at most this many rows
# Where the grouped tensor-core gemv splits K (``mma_gemv.k_splits``: two launches and atomics; k = 4 past K = 4096)
# the pair gemv's float32 path beat it: B = 1 (8 rows) 38.79 vs 53.10 us on 5120x3072, 57.99 vs 96.18 on 7168x4096;
# B = 4 (32 rows) 124.70 vs 146.46 and 281.04 vs 278.99 (H200, E = 128, top-8; benchmarks/README.md, "Forty-fourth
# session"). With both grouped grids rounded down to the resident CTAs (forty-seventh and forty-eighth sessions) the
# two shapes part: 5120x3072 the tensor-core gemv wins (B = 1 33.96 vs 39.32 us, B = 4 113.62 vs 134.11), 7168x4096
# the pair gemv still does (58.04 vs 64.79, 214.59 vs 223.76); one cap per k cannot say both, so it stays
# (runs/2026-12-01_h200_grouped_pair_grid_rounded_down.txt).
PAIR_GROUPED_F32_MAX_ROWS_SPLIT = {2: 8, 4: 32}   # the same where it splits (k = 2 there: not measured, kept at 8)


def pair_grouped_f32_max_rows(k, K):
    """The most rows (all experts') the grouped pair gemv with float32 sums takes for ``k`` bits and K columns."""
    split = mma_gemv.k_splits(K, None, k, mma_gemv.N8)[0] > 1      # (a grouped launch: one token tile)
    return (PAIR_GROUPED_F32_MAX_ROWS_SPLIT if split else PAIR_GROUPED_F32_MAX_ROWS).get(k, 0)


def choose_grouped(most, rows, k, K, codes_layout=None, layout=None, half=True, f16_acc=False):
    """The grouped kernel for a routing whose largest expert has ``most`` of the ``rows`` rows, or None where none
    applies. ``codes_layout``: the layout of a code- or fragment-layout copy of the experts (None: no such copy);
    ``layout``: that of a flat or tiled copy (None: none); ``half``: float16 or bfloat16 activations; ``f16_acc``:
    float16 activations summed in float16 blocks (the pair gemv's ``f16_acc``). In order: the grouped pair gemv
    (the rule above), the tensor-core gemv (at most ``mma_gemv.N8`` rows an expert, half activations, K a multiple
    of 64 up to ``mma_gemv.MAX_K``), the scalar grouped gemv (at most ``MAX_M`` rows an expert), the grouped gemm
    (tiled), and last the pair gemv for any routing (a slot a row: correct, not fast, past 8 rows an expert)."""
    if codes_layout is not None:
        pair = most <= PAIR_GROUPED_MAX_ROWS if f16_acc else rows <= pair_grouped_f32_max_rows(k, K)
        if pair:
            return "pair_gemv"
        if half and most <= mma_gemv.N8 and K % 64 == 0 and K <= mma_gemv.MAX_K:
            return "mma_gemv"
    if layout is not None and most <= MAX_M:
        return "grouped_gemv"
    if layout == "tiled":
        return "grouped_gemm"
    return "pair_gemv" if codes_layout is not None else None


class KbitExpertsLinear:
    """MoE experts of one projection (``KbitExperts``) kept ready for grouped calls: ``layer(A, offsets)`` is
    out[t] = A[t] @ W_e^T for the rows t of each expert e, by the grouped kernel :func:`choose_grouped` picks for
    that routing (``kernel_for``), as ``KbitLinear`` does for one weight and M.

    ``experts``: KbitExperts in any layout; ``codes``: optionally a second copy in the code or fragment layout
    (``stack_experts`` of ``pair_gemv.to_codes`` / ``mma_gemv.to_fragments`` weights) beside a tiled ``experts``: the
    decode kernels read it and the grouped gemm the tiled one (twice the experts' memory, for batches of any size).
    Code- or fragment-layout experts alone serve every routing (past 8 rows an expert by the pair gemv, slowly);
    flat ones at most 4 rows an expert. ``f16_acc``: the pair gemv's float16 block sums (float16 activations);
    ``pdl``: the pair and tensor-core gemvs as programmatic dependent launches (sm_90).

    A: [T, K] rows sorted by expert; offsets: int32 [E + 1] (expert e's rows are offsets[e] .. offsets[e + 1] - 1).
    The kernel is chosen from the offsets' largest expert: host offsets are read as they are, device ones are copied
    to the host unless ``max_tokens`` (at most that many rows an expert) says it. With device offsets and ``out``
    given, ``plan(...).prepare()`` allocates nothing at ``run()`` (CUDA-graph capturable)."""

    def __init__(self, experts, codes=None, f16_acc=False, pdl=False, stream=None):
        from .formats import KbitExperts
        for name, x in (("experts", experts), ("codes", codes)):
            if x is not None and not isinstance(x, KbitExperts):
                raise TypeError(f"{name} must be KbitExperts (stack_experts(...)), got {type(x).__name__}")
        native = experts.layout in ("codes", "fragments")
        if codes is not None and (native or codes.layout not in ("codes", "fragments")
                                  or (codes.n_experts, codes.expert_shape, codes.k)
                                  != (experts.n_experts, experts.expert_shape, experts.k)):
            raise ValueError("codes is a second copy of flat or tiled experts (the same experts, shape and k) in the code "
                             f"or fragment layout; got {codes.layout} experts beside {experts.layout} ones")
        stream = _arrays.as_stream(stream)
        self.codes = experts if native else codes
        self.experts = None if native else experts
        self.f16_acc, self.pdl = bool(f16_acc), bool(pdl)
        self.k = experts.k
        self.expert_shape = experts.expert_shape
        self.workspace = Workspace()
        if self.pdl:
            _weights_ready(stream)

    def kernel_for(self, most, rows, half=True, f16=True):
        """The kernel a routing with ``most`` rows in its largest expert and ``rows`` in all runs (``half``: float16
        or bfloat16 activations; ``f16``: float16)."""
        return choose_grouped(most, rows, self.k, self.expert_shape[1],
                              None if self.codes is None else self.codes.layout,
                              None if self.experts is None else self.experts.layout, half, self.f16_acc and f16)

    def __call__(self, A, offsets, out=None, stream=None, out_dtype=np.float16, bf16=False, kernel=None,
                 silu_pairs=False, max_tokens=None):
        return self.plan(A, offsets, out, stream, out_dtype, bf16, kernel, silu_pairs, max_tokens).launch()

    def plan(self, A, offsets, out=None, stream=None, out_dtype=np.float16, bf16=False, kernel=None, silu_pairs=False,
             max_tokens=None):
        """The chosen kernel's :class:`launch.Plan` (``kernel``: one of ``GROUPED_KERNELS`` instead). ``silu_pairs``:
        every expert's gate/up rows interleaved, out [T, N / 2], by the pair or tensor-core gemv's epilogue; a
        ValueError where the routing runs another kernel."""
        from .core import max_tokens_per_expert
        stream = _arrays.as_stream(stream)
        A = _arrays.check_array(A, "A")
        T = _rows(A)
        if max_tokens is None:
            most = max_tokens_per_expert(_arrays.to_host(offsets).astype(np.int64), T)
        else:
            most = int(max_tokens)
        f16 = f16_input(A, bf16)
        if kernel is None:
            kernel = self.kernel_for(most, T, half_input(A, bf16), f16)
            if kernel is None:
                raise ValueError(f"flat experts serve at most {MAX_M} rows an expert (the scalar grouped gemv); "
                                 f"this routing has {most}: stack repack_tiled(...) weights")
        if kernel not in GROUPED_KERNELS:
            raise ValueError(f"kernel must be one of {GROUPED_KERNELS}, got {kernel!r}")
        weight = self.codes if kernel in EPILOGUE_GEMVS else self.experts
        if weight is None:
            raise ValueError(f"kernel {kernel!r} reads " + ("code- or fragment-layout experts"
                                                            if kernel in EPILOGUE_GEMVS else "flat or tiled experts")
                             + ", which this layer does not keep")
        if silu_pairs and kernel not in EPILOGUE_GEMVS:
            raise ValueError(f"silu_pairs is the pair and tensor-core gemvs' epilogue; this routing runs {kernel!r} "
                             "(kernel_for says which kernel a routing runs)")
        if kernel == "pair_gemv":
            return pair_gemv.plan_grouped(A, weight, offsets, out, stream, out_dtype, bf16, f16_acc=self.f16_acc and f16,
                                          pdl=self.pdl, silu_pairs=silu_pairs)
        if kernel == "mma_gemv":    # (where it splits K its sums come from the layer's workspace, as the gemm's)
            return mma_gemv.plan_grouped(A, weight, offsets, out, stream, out_dtype, bf16, max_tokens=most,
                                         pdl=self.pdl, silu_pairs=silu_pairs, workspace=self.workspace)
        if kernel == "grouped_gemv":
            return scalar_gemv.plan_grouped(A, weight, offsets, out, stream, out_dtype, bf16, max_tokens=most)
        return tensor_gemm.plan_grouped(A, weight, offsets, out, stream, out_dtype, bf16,
                                        workspace=self.workspace,
                                        m_tile=tensor_gemm.m_tile_for(max(1, most)))


def grouped_linear(A, experts, offsets, out=None, stream=None, out_dtype=np.float16, bf16=False, kernel=None,
                   f16_acc=False, max_tokens=None):
    """MoE experts in one call: out[t] = A[t] @ W_e^T for the rows t of each expert e, by the grouped kernel
    :func:`choose_grouped` picks for the experts' layout and the routing (``KbitExpertsLinear(experts)(A, offsets)``).
    Returns a device array [T, N] of ``out_dtype``, or ``out``."""
    return KbitExpertsLinear(experts, f16_acc=f16_acc)(A, offsets, out, stream, out_dtype, bf16, kernel,
                                                       max_tokens=max_tokens)
