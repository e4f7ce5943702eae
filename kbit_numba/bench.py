"""``python -m kbit_numba.bench``: the benchmark grid against cuBLAS fp16, timed honestly.

Every number is GPU time per launch from CUDA-graph replays over rotating weight buffers whose total
exceeds the L2 cache (see ``_timing``), median of several replays. The device's read and copy bandwidth
ceilings are measured in the same run, and every kernel row reports its bandwidth on the bytes it must
read (and write) as a % of the matching ceiling, next to cuBLAS fp16 (``torch.matmul``) on the same shape.

Without a GPU it says so and runs a tiny correctness demo on Numba's CUDA simulator instead.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from functools import lru_cache, partial

import numpy as np

from .bench_peers import PEERS, peer_rows, peer_summary
from .core import MAX_M
from .formats import CODES_K, kbit_nbytes

SEED_SHAPES = ["2048x5120", "5120x2048", "2048x4096", "2048x512", "4096x2048", "4096x14336"]  # K x N
KS = [2, 3, 4, 5]
MS = [1, 2, 3, 4, 8, 16, 32, 64, 128, 512]
KERNELS = ["gemv", "pair_gemv", "gemm", "dequant_matmul", "linear", "dequantize"]
# (12 and 24: the tensor-core gemv's caps fall between powers of two, where its second and third token tiles start:
# the H200's k = 2 caps are 8, 12 and 24 on three shapes)
TUNE_MS = [1, 2, 3, 4, 8, 12, 16, 24, 32, 64, 128, 256, 512]
READ_CEILING_BYTES = 1 << 30


def _parse_list(text, conv=str):
    return [conv(t) for t in text.split(",") if t]


def _shape(text):
    K, N = (int(v) for v in text.lower().split("x"))
    return K, N


def _parse_shapes(text):
    """``--shapes``: "KxN" items and model names (``bench_model.dense_shapes``), in order, each shape once."""
    from . import bench_model

    items = [s for t in _parse_list(text) for s in (bench_model.dense_shapes(t) if t in bench_model.MODELS else [t])]
    try:
        return [_shape(s) for s in dict.fromkeys(items)]
    except ValueError:
        raise ValueError(f"--shapes takes KxN items (e.g. 2048x5120) or model names ({', '.join(bench_model.MODELS)}), "
                         f"got {text!r}") from None


# ------------------------------------------------------------------------------------------------
# Ceilings
# ------------------------------------------------------------------------------------------------
def _ceiling_kernels():
    from numba import cuda

    from .intrinsics import ldg128, stg128

    @cuda.jit
    def read_kernel(src, out):
        """Every thread reads 16 bytes per step (grid-stride); the xor keeps the loads alive."""
        i = cuda.grid(1) * 4
        stride = cuda.gridsize(1) * 4
        acc = np.uint32(0)
        while i < src.size:
            a, b, c, d = ldg128(src, i)
            acc ^= a ^ b ^ c ^ d
            i += stride
        if acc == np.uint32(0x9E3779B9):
            out[0] = acc

    @cuda.jit
    def copy_kernel(src, dst):
        i = cuda.grid(1) * 4
        stride = cuda.gridsize(1) * 4
        while i < src.size:
            a, b, c, d = ldg128(src, i)
            stg128(dst, i, a, b, c, d)
            i += stride

    return read_kernel, copy_kernel


def measure_ceilings():
    """(read GB/s, copy GB/s counting bytes read + written) of simple 16-byte-per-thread Numba kernels."""
    from numba import cuda

    from ._timing import graph_time_us

    read_kernel, copy_kernel = _ceiling_kernels()
    n_words = READ_CEILING_BYTES // 4
    src = cuda.device_array(n_words, np.uint32)
    dst = cuda.device_array(n_words, np.uint32)
    out = cuda.device_array(1, np.uint32)
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    grid, block = sms * 8, 256
    t_read = graph_time_us(lambda i, s: read_kernel[grid, block, s](src, out), 4)
    t_copy = graph_time_us(lambda i, s: copy_kernel[grid, block, s](src, dst), 4)
    return READ_CEILING_BYTES / t_read / 1e3, 2 * READ_CEILING_BYTES / t_copy / 1e3


FLOOR_THREADS = 512


@lru_cache(maxsize=None)
def _floor_kernel():                 # one compiled kernel for every floor of the run
    from numba import cuda

    from .intrinsics import ldg128

    @cuda.jit
    def floor_read(src, first_word, n_words, out):
        """One 16-byte load per thread, so every load of the launch is in flight from the start."""
        i = cuda.grid(1) * 4
        if i < n_words:
            a, b, c, d = ldg128(src, first_word + i)
            if (a ^ b ^ c ^ d) == np.uint32(0x9E3779B9):
                out[0] = a
    return floor_read


def floor_us(nbytes):
    """The read floor of a kernel that must read ``nbytes``: a pure-read Numba kernel over exactly that
    many bytes (rotating L2-cold copies, CUDA-graph timed, like every row)."""
    from numba import cuda

    from ._timing import graph_time_us, rotation_count

    kern = _floor_kernel()
    n_words = -(-nbytes // 16) * 4
    n = rotation_count(n_words * 4)
    src = cuda.device_array(n * n_words, np.uint32)
    out = cuda.device_array(1, np.uint32)
    grid = -(-n_words // 4 // FLOOR_THREADS)
    return graph_time_us(lambda i, s: kern[grid, FLOOR_THREADS, s](src, np.int64((i % n) * n_words),
                                                                   np.int64(n_words), out), n * max(1, 64 // n))


# ------------------------------------------------------------------------------------------------
# Rows
# ------------------------------------------------------------------------------------------------
def _rotating_weights(K, N, k, n_copies, rng):
    """n_copies independent quantized weights of one shape (the rotation that defeats the L2)."""
    from . import codec

    base = rng.standard_normal((N, K)).astype(np.float16) * np.float16(0.02)
    return _device_copies(codec.quantize(base, k=k), n_copies, ("packed", "absmax"))


def cublas_row(K, N, M):
    """cuBLAS fp16 (torch.matmul) time for A[M, K] @ W[K, N] with rotating W, or None without torch."""
    from ._timing import graph_time_us, rotation_count, torch

    if torch is None or not torch.cuda.is_available():
        return None
    n = rotation_count(K * N * 2)
    Ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(n)]
    A = torch.randn(M, K, device="cuda", dtype=torch.float16)
    C = torch.empty(M, N, device="cuda", dtype=torch.float16)

    def launch(i, _stream):
        torch.matmul(A, Ws[i % n].t(), out=C)

    t = graph_time_us(launch, n * max(1, 64 // n))
    return t


def _gemv_grid_rows(shapes, ks, ms, max_m, prepare, variants, ceilings, progress):
    """Rows of a GEMV family: every shape x k x M (M <= max_m) x variant, on rotating L2-cold weights.
    ``prepare(weights)`` -> the family's form of them; ``variants``: (label, launchers, params), where
    ``launchers(A, weight, out)`` -> a callable(stream) that launches once."""
    from numba import cuda

    from ._timing import graph_time_us, rotation_count

    rows = []
    rng = np.random.default_rng(1)
    for K, N in shapes:
        for k in ks:
            nbytes = kbit_nbytes(N, K, k)
            n = rotation_count(nbytes)
            ws = prepare(_rotating_weights(K, N, k, n, rng))
            for M in [m for m in ms if m <= max_m]:
                A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
                out = cuda.device_array((M, N), np.float16)
                for label, launcher, params in variants:
                    progress(f"{label} {K}x{N} k={k} M={M}")
                    launches = [launcher(A, w, out) for w in ws]
                    t = graph_time_us(lambda i, s, launches=launches: launches[i % n](s), n * max(1, 64 // n))
                    rows.append(_mm_row(label, K, N, k, M, t, nbytes, ceilings, params))
    return rows


def _prepared(plan):
    """A launcher(stream) for a family's Plan: its steps bound once (one driver call each, as a decode loop
    or a CUDA graph runs them)."""
    return plan.prepare().run


def gemv_rows(shapes, ks, ms, ceilings, progress, tunings=(None,)):
    """Scalar GEMV rows: every shape x k x M (M <= 4), each tuning (None = the package's ``DEFAULTS``, else a
    dict of ``scalar_gemv.plan`` parameters, e.g. ``{"cols": 4, "max_registers": None}``: the row keeps it
    under ``params``, and ``--tune`` may write it into the linear table)."""
    from . import scalar_gemv

    def label(t):
        return "gemv" if t is None else "gemv[" + ",".join(f"{k}={v}" for k, v in t.items()) + "]"

    variants = [(label(t), lambda A, w, out, t=t: _prepared(scalar_gemv.plan(A, w, out, 0, **(t or {}))), t)
                for t in tunings]
    return _gemv_grid_rows(shapes, ks, ms, MAX_M, list, variants, ceilings, progress)


def pair_gemv_rows(shapes, ks, ms, ceilings, progress, cols=(None,), f16_acc=False, pdl=False, fragments=False):
    """Pair-table GEMV rows (k = 2, 4; the code layout made once per weight): shape x k x M (M <= 4),
    each columns-per-iteration choice (None = the default); ``f16_acc``: the float16-accumulating variant,
    labelled [f16]; ``pdl``: programmatic dependent launches, labelled [pdl] (the graph's launches then
    overlap as in a chain of layers: a launch's prologue runs during the previous one's tail); ``fragments``: on
    the tensor-core gemv's fragment layout instead (``pair_gemv+frags``; N a multiple of 16, K of 256), which
    ``KbitLinear(layout="fragments")`` would keep for every M."""
    from . import mma_gemv, pair_gemv

    def label(c):
        tags = ([] if c is None else [f"cols={c}"]) + (["f16"] if f16_acc else []) + (["pdl"] if pdl else [])
        return "pair_gemv" + ("+frags" if fragments else "") + (f"[{','.join(tags)}]" if tags else "")

    def prepare(ws):
        codes = [pair_gemv.to_codes(w) for w in ws]
        return [mma_gemv.to_fragments(c) for c in codes] if fragments else codes

    variants = [(label(c), lambda A, kc, out, c=c: _prepared(pair_gemv.plan(A, kc, out, 0, f16_acc=f16_acc, cols=c,
                                                                          pdl=pdl)),
                 None if c is None else {"cols": c}) for c in cols]
    shapes = [(K, N) for K, N in shapes if not (fragments and (N % 16 or K % 256))]
    return _gemv_grid_rows(shapes, [k for k in ks if k in CODES_K], ms, MAX_M, prepare, variants, ceilings, progress)


def mma_gemv_rows(shapes, ks, ms, ceilings, progress, pdl=False, fragments=False):
    """Tensor-core gemv rows on their own (k = 2, 4, M <= 32): on the code layout (``mma_gemv+codes``, as
    :func:`matmul_rows` times it) or, with ``fragments``, on the fragment layout (``mma_gemv+frags``:
    ``mma_gemv.to_fragments``, N a multiple of 16, K of 256); ``pdl``: as a chain of programmatic dependent
    launches, labelled [pdl], as :func:`pair_gemv_rows` times the pair gemv's chains."""
    from . import mma_gemv, pair_gemv

    layout = "frags" if fragments else "codes"
    label = f"mma_gemv+{layout}" + ("[pdl]" if pdl else "")

    def prepare(ws):
        codes = [pair_gemv.to_codes(w) for w in ws]
        return [mma_gemv.to_fragments(c) for c in codes] if fragments else codes

    variants = [(label, lambda A, w, out: _prepared(mma_gemv.plan(A, w, out, 0, pdl=pdl)), None)]
    shapes = [(K, N) for K, N in shapes if mma_gemv.reads(1, K) and not (fragments and (N % 16 or K % 256))]
    return _gemv_grid_rows(shapes, [k for k in ks if k in CODES_K], ms, mma_gemv.MAX_TOKENS, prepare, variants,
                           ceilings, progress)


def _tiled_copies(ws):
    from . import codec
    return [codec.repack_tiled(w) for w in ws]


def _mm_row(label, K, N, k, M, t, nbytes, ceilings, params=None):
    moved = nbytes + M * K * 2 + M * N * 2
    row = dict(kernel=label, shape=f"{K}x{N}", k=k, M=M, us=t, GBps=moved / t / 1e3,
               pct_ceiling=100 * moved / t / 1e3 / ceilings["read_GBps"], ceiling="read", floor_bytes=moved)
    if params:
        row["params"] = dict(params)
    return row


def matmul_rows(shapes, ks, ms, ceilings, progress, kernels=("gemm", "dequant_matmul", "linear")):
    """Any-M rows on rotating tiled weights: the tensor-core GEMM, dequantize + cuBLAS fp16 (torch), and
    ``linear`` (whatever the package's table picks), and for k = 2, 4 the same on the code layout (KbitLinear's
    default there), with ``"mma_gemv"`` in ``kernels`` the tensor-core gemv on it too (M <= 32). Percent of the read
    ceiling counts the kbit bytes."""
    from numba import cuda

    from . import codec, dispatch as lin, mma_gemv, pair_gemv, tensor_gemm
    from ._timing import graph_time_us, rotation_count, torch

    rows = []
    rng = np.random.default_rng(4)
    for K, N in shapes:
        if N % 128:
            continue
        for k in ks:
            nbytes = kbit_nbytes(N, K, k)
            n = rotation_count(nbytes)
            flats = _rotating_weights(K, N, k, n, rng)
            ws = _tiled_copies(flats)
            codes = [pair_gemv.to_codes(w) for w in flats] if k in CODES_K and lin.gemm_reads("codes", K) else []
            wbuf = cuda.device_array((N, K), np.float16)
            space = lin.Workspace()
            for M in ms:
                A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
                out = cuda.device_array((M, N), np.float16)
                sums = space.sums(M * N)
                cases = []
                if "gemm" in kernels:
                    plans = [_prepared(tensor_gemm.plan(A, w, out, 0, np.float16, False, sums)) for w in ws]

                    def gemm_launch(i, s, plans=plans):
                        plans[i % n](s)
                    cases.append(("gemm", gemm_launch))
                    if codes:
                        cplans = [_prepared(tensor_gemm.plan(A, w, out, 0, np.float16, False, sums)) for w in codes]

                        def cgemm_launch(i, s, plans=cplans):
                            plans[i % n](s)
                        cases.append(("gemm+codes", cgemm_launch))
                if "dequant_matmul" in kernels and torch is not None:
                    At, Ot, Wt = (torch.as_tensor(x, device="cuda") for x in (A, out, wbuf))

                    def dq_launch(i, s, weights, At=At, Ot=Ot, Wt=Wt):
                        codec.dequantize(weights[i % n], out=wbuf, stream=s)
                        torch.matmul(At, Wt.t(), out=Ot)      # torch's current stream is the capture stream
                    cases.append(("dequant_matmul", partial(dq_launch, weights=ws)))
                    if codes:                           # the same from the code layout
                        cases.append(("dequant_matmul+codes", partial(dq_launch, weights=codes)))
                if "mma_gemv" in kernels and codes and M <= mma_gemv.MAX_TOKENS and lin.mma_reads(M, K):
                    mplans = [_prepared(mma_gemv.plan(A, w, out, 0, workspace=sums)) for w in codes]

                    def mma_launch(i, s, plans=mplans):
                        plans[i % n](s)
                    cases.append(("mma_gemv+codes", mma_launch))   # (what --tune caps per shape: tune_table)
                if "linear" in kernels:               # KbitLinear(layout="tiled")
                    choice = lin.choose(M, N, K, "tiled")

                    def lin_launch(i, s):              # (the table's choice, with its rule's launch parameters)
                        lin.linear(A, ws[i % n], out=out, stream=s, workspace=space)
                    cases.append((f"linear[{choice}]", lin_launch))
                    if choice == "gemv":                # KbitLinear(keep_flat=True): gemv on the flat copy
                        def flat_launch(i, s):
                            lin.linear(A, flats[i % n], out=out, stream=s, workspace=space, kernel="gemv")
                        cases.append(("linear+flat[gemv]", flat_launch))
                    if codes:                           # KbitLinear's default for k = 2, 4: the code layout
                        cchoice = lin.choose(M, N, K, "codes", k=k)

                        def codes_launch(i, s):
                            lin.linear(A, codes[i % n], out=out, stream=s, workspace=space)
                        cases.append((f"linear+codes[{cchoice}]", codes_launch))
                for label, fn in cases:
                    progress(f"{label} {K}x{N} k={k} M={M}")
                    t = graph_time_us(fn, n * max(1, 32 // n))
                    rows.append(_mm_row(label, K, N, k, M, t, nbytes, ceilings))
    return rows


def tune_table(rows, device):
    """The ``linear`` table from measured rows: per shape, the fastest kernel at each measured M (a rule
    covers the Ms up to the next measured one); the general rules pick, per M, the kernel with the best
    geometric-mean time relative to the per-shape best. Rows of several bit widths (``--k 4,2``) are separate
    points: a shape's rule at M is the kernel with the best geometric mean over its k's (the table has no k
    dimension), never the faster time of one k against the other's. A row run with non-default parameters
    (``--sweep``) competes as its own candidate; when it wins, its parameters go into the rule
    (``[max_m, kernel, params]``). Rows on the code layout (``gemm+codes``, ``dequant_matmul+codes``) give the same
    for that layout's choice between the gemm and dequantize + cuBLAS: ``codes_mm_rules`` and ``codes_mm_shapes``.
    The last rule of each list covers every M past the last measured one (None): :func:`merge_tuned` puts the
    rules of the table before back there."""
    by_layout = {"": {}, "codes": {}}
    for r in rows:
        kern, _, layout = r["kernel"].split("[")[0].partition("+")
        if kern in ("gemv", "gemm", "dequant_matmul") and r["M"] and layout in by_layout:
            cand = (kern, json.dumps(r.get("params") or {}, sort_keys=True))
            point = by_layout[layout].setdefault((r["shape"], r["M"]), {}).setdefault(r.get("k"), {})
            point[cand] = min(r["us"], point.get(cand, r["us"]))
    rules, shapes = _fastest_rules(by_layout[""])
    table = dict(device=device, rules=rules, shapes=shapes,
                 note="written by python -m kbit_numba.bench --tune (GPU time, CUDA graphs, L2-cold)")
    if by_layout["codes"]:
        table["codes_mm_rules"], table["codes_mm_shapes"] = _fastest_rules(by_layout["codes"])
    caps = mma_gemv_caps(rows)
    if caps:
        table["mma_gemv_max_m_shapes"] = caps
    return table


def _measured_max_m(rows):
    """{layout ('' or 'codes'): {shape: the largest M tuned}} of the rows tune_table reads."""
    most = {"": {}, "codes": {}}
    for r in rows:
        kern, _, layout = r["kernel"].split("[")[0].partition("+")
        if kern in ("gemv", "gemm", "dequant_matmul") and r["M"] and layout in most:
            most[layout][r["shape"]] = max(r["M"], most[layout].get(r["shape"], 0))
    return most


def _splice(new, old, max_m):
    """``new`` rules up to ``max_m`` (the last M measured), then ``old``'s past it; neighbours that run the same kernel
    with the same parameters become one rule."""
    if not old:
        return new
    rules = [list(r) for r in new]
    rules[-1][0] = max_m
    rules += [list(r) for r in old if r[0] is None or r[0] > max_m]
    merged = []
    for r in rules:
        if merged and merged[-1][1:] == r[1:]:
            merged[-1][0] = r[0]
        else:
            merged.append(r)
    return merged


def merge_tuned(old, new, rows):
    """The table ``bench --tune`` writes: ``new`` (:func:`tune_table` of this run's ``rows``) merged into ``old`` (the
    table at that path, {} if none). Per layout (tiled: ``rules``/``shapes``; the code layout's gemm vs dequantize +
    cuBLAS: ``codes_mm_rules``/``codes_mm_shapes``): a measured shape's rules up to the largest M measured, past it
    the rules it followed before (its own, else the general ones); shapes not measured keep theirs; the general rules
    are this run's up to its largest M. The tensor-core gemv caps merge per shape and k (:func:`merge_mma_caps`); every
    other key of ``old`` (the pair gemv's, written by ``--tune-codes``) is kept."""
    table = dict(old)
    table.update(device=new["device"], note=new["note"] + "; merged into the table before (bench.merge_tuned)")
    most = _measured_max_m(rows)
    for layout, general, per_shape in (("", "rules", "shapes"), ("codes", "codes_mm_rules", "codes_mm_shapes")):
        if general not in new:
            continue
        before = old.get(per_shape, {})
        table[general] = _splice(new[general], old.get(general), max(most[layout].values()))
        table[per_shape] = dict(sorted({**before, **{
            shape: _splice(rules, before.get(shape) or old.get(general), most[layout][shape])
            for shape, rules in new[per_shape].items()}}.items()))
    caps = merge_mma_caps(old.get("mma_gemv_max_m_shapes"), new.get("mma_gemv_max_m_shapes"))
    table.pop("mma_gemv_max_m_shapes", None)
    if caps:
        table["mma_gemv_max_m_shapes"] = caps
    return table


MMA_CAP_MARGIN = 0.03              # a loss of at most this much (the tensor-core gemv or the gemm) counts as none
MMA_CAP_FROM_M = 3                 # (M = 1, 2: the codes rules' choice, from --tune-codes; a cap is never below 2)


def mma_gemv_caps(rows):
    """``{"KxN": {"k": cap}}`` from ``mma_gemv+codes`` rows beside the code layout's gemm and dequantize + cuBLAS rows
    (``--tune``): per shape and k, the cap (the largest M the tensor-core gemv takes; past it ``linear`` runs the
    faster of the two) whose worst loss over the measured Ms >= 3 is the smallest, a loss being how much slower the
    kernel a cap picks at an M is than the fastest there, less ``MMA_CAP_MARGIN``. The candidates are 2, each
    measured M and None (no cap: the table's cap for k holds); of equal worst losses the largest cap wins. So a gemv
    that loses from some M on is capped before it, and one that loses at one M but wins past it by more is not
    (H100, 5120x2048 k = 2: 5% behind the gemm at M = 12, 9-15% ahead at 24 and 32; benchmarks/README.md,
    "Ninety-eighth session"). Every measured shape and k gets an entry, ``None`` where no cap is best: ``bench
    --tune`` merges them into the table (:func:`merge_mma_caps`), so a later tune of other shapes keeps these."""
    times = {}
    for r in rows:
        kern = r["kernel"]
        if kern in ("mma_gemv+codes", "gemm+codes", "dequant_matmul+codes") and r["M"] and r["M"] >= MMA_CAP_FROM_M:
            point = times.setdefault((r["shape"], str(r.get("k"))), {}).setdefault(r["M"], {})
            point[kern] = min(r["us"], point.get(kern, r["us"]))
    caps = {}
    for (shape, k), by_m in sorted(times.items()):
        points = []                    # (M, the gemv's time, the faster other's)
        for M in sorted(by_m):
            others = [by_m[M][o] for o in ("gemm+codes", "dequant_matmul+codes") if o in by_m[M]]
            if "mma_gemv+codes" in by_m[M] and others:
                points.append((M, by_m[M]["mma_gemv+codes"], min(others)))
        if not points:
            continue

        def worst(cap):
            return max(max(0.0, (g if cap is None or M <= cap else o) / min(g, o) - 1 - MMA_CAP_MARGIN)
                       for M, g, o in points)
        candidates = [None] + [M for M, _, _ in reversed(points)] + [MMA_CAP_FROM_M - 1]
        caps.setdefault(shape, {})[k] = min(candidates, key=worst)   # (min keeps the first, largest, of a tie)
    return caps


def merge_mma_caps(old, new):
    """The table's ``mma_gemv_max_m_shapes`` after a tune: ``old`` with each shape x k that ``new`` measured replaced
    (dropped where ``new`` says None), others kept; shapes left without a cap are dropped."""
    merged = {shape: dict(ks) for shape, ks in (old or {}).items()}
    for shape, ks in (new or {}).items():
        for k, cap in ks.items():
            if cap is None:
                merged.get(shape, {}).pop(k, None)
            else:
                merged.setdefault(shape, {})[k] = cap
    return {shape: ks for shape, ks in merged.items() if ks}


def _fastest_rules(times):
    """(general rules, {shape: rules}) from ``times[(shape, M)][k][(kernel, params json)] = us``: see tune_table."""
    def rule(M, cand):
        params = json.loads(cand[1])
        return [M, cand[0], params] if params else [M, cand[0]]

    def compress(points):
        rules = []
        for M, cand in sorted(points):
            if rules and rules[-1][1:] == rule(M, cand)[1:]:
                rules[-1][0] = M
            else:
                rules.append(rule(M, cand))
        rules[-1][0] = None
        return rules

    def fastest(points):
        """The candidate with the best geometric-mean time relative to each point's best, among those measured at
        the most points (a point: one shape, M and k)."""
        score = {}
        for t in points:
            best = min(t.values())
            for cand, us in t.items():
                score.setdefault(cand, []).append(np.log(us / best))
        most = max(len(v) for v in score.values())
        return min((c for c, v in score.items() if len(v) == most), key=lambda c: np.mean(score[c]))

    shapes = {}
    for shape in sorted({s for s, _ in times}):
        shapes[shape] = compress([(M, fastest(by_k.values())) for (s, M), by_k in times.items() if s == shape])
    general = [(M, fastest([t for (_, m), by_k in times.items() if m == M for t in by_k.values()]))
               for M in sorted({M for _, M in times})]
    return compress(general), shapes


# The pair gemv's launch knobs --tune-codes tries at each point (cols x cta_warps; None = the plan's own choice);
# knob sets that give the same launch as one before them (same cols, CTA and grid) are timed once
CODES_TUNE_COLS = (2, 4, 8)
CODES_TUNE_CTA_WARPS = (None, 8, 12, 16, 24, 32)
CODES_TUNE_MS = (1, 2, 3, 4)      # tuned where the table's rules run the pair gemv at that M
CODES_TUNE_REPS = 2               # every knob set timed in turns this many times; the best time counts
CODES_TUNE_MARGIN = 0.03          # a knob set replaces the default plan only when this much faster
# (f16_acc, pdl) variants tuned: float32 / float16 block sums, alone or as a PDL chain of launches (each launch's
# prologue overlapping the one before, as in a model's step: the knobs that win differ)
CODES_TUNE_VARIANT_NAMES = {"fp32": (False, False), "f16": (True, False), "fp32+pdl": (False, True),
                            "f16+pdl": (True, True)}          # --tune-variants: name -> (f16_acc, pdl)
CODES_TUNE_VARIANTS = tuple(CODES_TUNE_VARIANT_NAMES.values())
# From this M on, the tune also times the tensor-core gemv (its default plan; a PDL chain in the pdl variants) beside
# the pair gemv's knob sets, and its rules name it where it is the fastest: which of the two wins at M = 2, 3 depends
# on the shape (H200 PDL chains, benchmarks/README.md, "Seventy-second session"), and since the long batches at M = 1
# with float32 sums too (H100 PDL chains, k = 2, two runs on one machine: 4096x14336 11.34 us against the best knob
# set's 11.83 in the tune after it, 14336x4096 12.23 against 12.88; "Eighty-ninth session"). With float16 sums the pair
# gemv wins M = 1 by 20-30% there.
CODES_TUNE_MMA_FROM_M = 1
MMA = "mma_gemv"                  # tune_codes_table's key of the tensor-core gemv among the pair gemv's knob sets


def _default_knob_sets():
    """The pair gemv's knob sets --tune-codes tries beside its default plan: ``CODES_TUNE_COLS`` x
    ``CODES_TUNE_CTA_WARPS``."""
    return [dict(cols=c, cta_warps=w) if w else dict(cols=c) for c in CODES_TUNE_COLS for w in CODES_TUNE_CTA_WARPS]


def _codes_tune_points(shapes, ks, table, variants, knob_sets, ms, silu, accumulate, rotations, part=None):
    """The points ``codes_tune_rows`` times, in its order, and their candidates' plans (not yet prepared):
    ``(K, N, k, nbytes, n, f16, pdl, M, [(j, plans)], twin)`` with ``n = rotations(nbytes)`` weight copies (one plan
    each), ``j`` the index of the knob set in ``knob_sets`` (``len(knob_sets)``: the tensor-core gemv) and ``twin``
    {j: the earlier j of the same launch}, a knob set not timed again. Making a plan compiles its kernel (the launch
    is fitted to its registers: ``core.fit_threads``). ``part = (i, parts)``: only the points whose build key (k,
    f16, pdl, M: the kernels' compile-time choices, numbered in first-seen order) is the i-th modulo ``parts``, so
    that ``parts`` processes plan, and so compile, disjoint shares (``codes_tune_compile``)."""
    from numba import cuda

    from . import dispatch, mma_gemv, pair_gemv

    general = {k: v for k, v in (table or dispatch.load_table()).items() if k not in ("codes_shapes", "codes_variants")}
    rng = np.random.default_rng(1)
    keys = {}                                   # build key -> its number (every process numbers them alike)
    for K, N in shapes:
        for k in [k for k in ks if k in CODES_K]:
            points = [(f16, pdl, M) for f16, pdl in variants
                      for M in ms or [m for m in CODES_TUNE_MS if dispatch.choose(
                          m, N, K, "codes", general, backend=False, f16_acc=f16, k=k) == "pair_gemv"]]
            if part is not None:              # (every point is numbered, in every process, before the filter)
                points = [p for p in points if keys.setdefault((k, *p), len(keys)) % part[1] == part[0]]
                if not points:
                    continue
            nbytes = kbit_nbytes(N, K, k)
            n = rotations(nbytes)
            kcs = [pair_gemv.to_codes(w) for w in _rotating_weights(K, N, k, n, rng)]
            for f16, pdl, M in points:
                A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
                out = cuda.device_array((M, N // 2 if silu else N), np.float16)
                cands, twin, seen = [], {}, {}
                for j, knobs in enumerate(knob_sets):
                    try:
                        plans = [pair_gemv.plan(A, kc, out, 0, f16_acc=f16, pdl=pdl, silu_pairs=silu,
                                                accumulate=accumulate, **(knobs or {})) for kc in kcs]
                    except ValueError:             # (e.g. cols = 8 at a long K: the CTA does not fit)
                        continue
                    step = plans[0].steps[0]
                    key = (step.kernel, step.grid, step.block)
                    if key in seen:
                        twin[j] = seen[key]
                    else:
                        seen[key] = j
                        cands.append((j, plans))
                if M >= CODES_TUNE_MMA_FROM_M and not (silu or accumulate) and mma_gemv.reads(M, K):
                    cands.append((len(knob_sets), [mma_gemv.plan(A, kc, out, 0, pdl=pdl) for kc in kcs]))
                yield K, N, k, nbytes, n, f16, pdl, M, cands, twin


def codes_tune_kernels(shapes, ks, table=None, variants=CODES_TUNE_VARIANTS, knob_sets=None, part=None):
    """The distinct kernel launches the ``--tune-codes`` of these arguments compiles, in its order (of the points of
    ``part``, as ``_codes_tune_points``): one step (the kernel and its arguments) per distinct kernel (a knob set
    that changes only the grid or CTA reuses a build)."""
    knob_sets = [None] + list(_default_knob_sets() if knob_sets is None else knob_sets)
    steps = {}
    for *_, cands, _twin in _codes_tune_points(shapes, ks, table, variants, knob_sets, None, False, False,
                                               lambda nbytes: 1, part):
        for _, plans in cands:
            for step in plans[0].steps:
                if hasattr(step, "kernel"):             # (not a HostStep)
                    steps.setdefault(id(step.kernel), step)
    return list(steps.values())


def codes_tune_compile(shapes, ks, table, variants, part, parts):
    """Compile (into the kernel cache, ``_cache.py``), without timing them, the kernels of the ``part``-th (0-based)
    of ``parts`` shares of the ``--tune-codes`` points (``_codes_tune_points``): ``--tune-compile-part``. ``parts``
    processes at once fill the cache that a cold ``--tune-codes`` fills one compile after another; a kernel two
    shares use (the tensor-core gemv's at M = 1..3) compiles in both. Returns how many kernels this share has. (The
    first version split the kernels of the whole tune, whose plans every process made, and so compiled, in full:
    16 processes took 198 s, no faster than one; benchmarks/README.md, "Ninety-third session".)"""
    mine = codes_tune_kernels(shapes, ks, table, variants, part=(part, parts))
    for step in mine:                  # (most compiled already, by their plans: these load from memory)
        step.kernel.compile(tuple(step.kernel.typeof_pyval(a) for a in step.args))
    return len(mine)


def codes_tune_rows(shapes, ks, ceilings, progress, table=None, reps=CODES_TUNE_REPS, variants=CODES_TUNE_VARIANTS,
                    knob_sets=None, ms=None, silu=False, accumulate=False):
    """``--tune-codes``: the pair gemv on the code layout at every shape x k (2, 4) x variant (``CODES_TUNE_VARIANTS``)
    x M of ``CODES_TUNE_MS`` where ``table``'s general rules run it (or every M of ``ms``), with its default plan
    (params None) and each knob set (default: ``CODES_TUNE_COLS`` x ``CODES_TUNE_CTA_WARPS``), timed in turns
    ``reps`` times: the best counts, every turn's time is under ``turns_us``. A knob set whose launch equals an
    earlier one's (same kernel, CTA and grid) is timed once: its row repeats that time and names the twin under
    ``same_as``. ``silu``: the SiLU epilogue's build (``silu_pairs=True``, an [M, N / 2] output; rows marked ``silu``,
    which ``tune_codes_table`` does not read: their rules are ``dispatch.silu_knobs``', written by hand).
    ``accumulate``: the residual-add build (``accumulate=True``: out += A W^T in place, the step's o and down; rows
    marked ``accumulate``, which ``tune_codes_table`` does not read either: ``dispatch.epilogue_knobs``' ``" acc"``
    rules, written by hand). From ``CODES_TUNE_MMA_FROM_M`` on (not with ``silu`` or ``accumulate``) the tensor-core
    gemv's default plan is timed in the same turns, a PDL chain in the pdl variants: a ``mma_gemv`` row carrying the
    variant's ``f16_acc`` and ``pdl``."""
    from ._timing import graph_time_us, rotation_count

    knob_sets = [None] + list(_default_knob_sets() if knob_sets is None else knob_sets)
    rows = []
    for K, N, k, nbytes, n, f16, pdl, M, cand_plans, twin in _codes_tune_points(
            shapes, ks, table, variants, knob_sets, ms, silu, accumulate, rotation_count):
        mma = len(knob_sets)         # (the tensor-core gemv's index among the candidates)
        cands = [(j, [p.prepare().run for p in plans]) for j, plans in cand_plans]
        turns = {}
        for rep in range(reps):
            for j, runs in cands:
                name = MMA if j == mma else f"pair_gemv {knob_sets[j] or 'default'}{' f16' if f16 else ''}"
                progress(f"{name}{' pdl' if pdl else ''} {K}x{N} k={k} M={M}")
                turns.setdefault(j, []).append(
                    graph_time_us(lambda i, s, runs=runs: runs[i % n](s), n * max(1, 64 // n)))
        for j in sorted((set(turns) | set(twin)) - {mma}):
            knobs = knob_sets[j]
            tags = ([f"{a}={b}" for a, b in (knobs or {}).items()] + (["f16"] if f16 else [])
                    + (["pdl"] if pdl else []) + (["silu"] if silu else [])
                    + (["acc"] if accumulate else []))
            row = _mm_row("pair_gemv" + (f"[{','.join(tags)}]" if tags else ""), K, N, k, M,
                          min(turns[twin.get(j, j)]), nbytes, ceilings, knobs)
            row["f16_acc"], row["pdl"], row["turns_us"] = f16, pdl, turns[twin.get(j, j)]
            if silu:
                row["silu"] = True
            if accumulate:
                row["accumulate"] = True
            if j in twin:
                row["same_as"] = knob_sets[twin[j]] or "default"
            rows.append(row)
        if mma in turns:             # (after the pair gemv's rows, whose first is its default plan)
            row = _mm_row(MMA + ("[pdl]" if pdl else ""), K, N, k, M, min(turns[mma]), nbytes, ceilings)
            row["f16_acc"], row["pdl"], row["turns_us"] = f16, pdl, turns[mma]
            rows.append(row)
    return rows


def tune_codes_table(rows, table, margin=CODES_TUNE_MARGIN, keep_general=False):
    """``table`` with its ``codes_variants`` and ``codes_shapes`` rewritten from ``codes_tune_rows`` rows, per
    variant (``dispatch.codes_variant``: k, the block sums' type, PDL or not) and tuned M. The candidates are the
    pair gemv's knob sets and, where it was timed, the tensor-core gemv (a ``mma_gemv`` rule at that M):

    - the general knob set (``codes_variants``, for shapes not measured): the one with the least geometric mean of
      its time over the fastest one's across the measured shapes, if that mean is ``margin`` below the default
      plan's; else the default plan;
    - per shape (``codes_shapes``): the shape's fastest knob set where it is ``margin`` faster than the general
      one, else the general one. Every measured shape gets its entry, even one equal to the general rules, so that a
      later tune over other shapes (which rewrites the general rules from its own shapes) leaves it as it was.

    Rules carry the knobs as parameters (none for the default plan) at the tuned Ms, followed for larger M by the
    entry's rules before this tune (the shape's for the variant, else the variant's general ones, else the table's
    ``codes_rules``): a tune of M = 1..3 leaves a shape's tensor-core gemv cap at 32 as it was (it had put
    ``codes_rules``' 16 there: 2026-12-05).

    ``keep_general`` (``--tune-keep-general``): the general rules stay as they are, and each tuned shape is judged
    against the rules it runs now (its entry for the variant, else the general rules): the fastest candidate where it
    beats their choice at M by ``margin`` (or where that choice was not timed), else their choice. A tune of shapes
    other than the seed shapes then sets their entries without setting every other shape's rules from them."""
    from . import dispatch

    table = dict(table)
    tail = table.get("codes_rules", dispatch.CODES_RULES)
    times = {}                 # variant -> M -> shape -> {knobs as JSON: us}
    for r in rows:
        if (r["kernel"].startswith(("pair_gemv", MMA)) and "f16_acc" in r and not r.get("silu")
                and not r.get("accumulate")):
            variant = dispatch.codes_variant(r["k"], r["f16_acc"], r.get("pdl", False))
            point = times.setdefault(variant, {}).setdefault(r["M"], {})
            cand = MMA if r["kernel"].startswith(MMA) else json.dumps(r.get("params") or {}, sort_keys=True)
            point.setdefault(r["shape"], {})[cand] = r["us"]

    def as_rules(chosen, before):   # {M: knobs JSON or MMA} for Ms 1, 2, .. (stops at a gap) -> rules, then
        rules = []                  # ``before``'s (the entry's rules before this tune) past the last tuned M
        for M in sorted(chosen):
            if rules and M != rules[-1][0] + 1:
                break
            knobs = {} if chosen[M] == MMA else json.loads(chosen[M])
            kernel = MMA if chosen[M] == MMA else "pair_gemv"
            rules.append([M, kernel, knobs] if knobs else [M, kernel])
        return rules + [r for r in before if r[0] is None or r[0] > rules[-1][0]]

    variants = dict(table.get("codes_variants", {}))
    shapes = {s: dict(v) for s, v in table.get("codes_shapes", {}).items()}

    def current(rules, M):          # the rules' choice at M as the candidate key of its times (None: neither gemv)
        try:
            kernel, knobs = dispatch._first_rule(rules, M)
        except StopIteration:       # (no rule reaches M)
            return None
        return MMA if kernel == MMA else json.dumps(knobs, sort_keys=True) if kernel == "pair_gemv" else None

    for variant, by_m in sorted(times.items()):
        old_general = variants.get(variant) or tail
        general = {}
        if not keep_general:                  # the general rules, from the shapes timed
            n_shapes = max(len(by_shape) for by_shape in by_m.values())
            for M, by_shape in sorted(by_m.items()):
                if len(by_shape) == n_shapes:     # (an M only some shapes ran gets no general knobs)
                    everywhere = set.intersection(*(set(t) for t in by_shape.values()))
                    gm = {c: np.mean([np.log(t[c] / min(t.values())) for t in by_shape.values()]) for c in everywhere}
                    best = min(sorted(gm), key=gm.get)
                    general[M] = best if gm[best] < gm["{}"] + np.log(1 - margin) else "{}"
            if any(c != "{}" for c in general.values()):
                variants[variant] = as_rules(general, old_general)     # (in place: a retune's JSON diff stays short)
            else:
                variants.pop(variant, None)
        per_shape = {}
        for M, by_shape in sorted(by_m.items()):
            for shape, t in by_shape.items():
                fastest = min(sorted(t), key=t.get)
                mine = (current(shapes.get(shape, {}).get(variant) or old_general, M) if keep_general
                        else general.get(M, "{}"))    # (the fastest where that choice was not timed)
                per_shape.setdefault(shape, {})[M] = mine if mine in t and t[fastest] >= (1 - margin) * t[mine] \
                    else fastest
        for shape, chosen in per_shape.items():
            entry = shapes.setdefault(shape, {})
            entry[variant] = as_rules(chosen, entry.get(variant) or old_general)
    table["codes_variants"], table["codes_shapes"] = variants, shapes
    return table


def moe_rows(progress, E=512, batch=32, top_k=8, k=4, shapes=((2048, 512), (512, 2048))):
    """MoE step: ``batch`` tokens routed top-``top_k`` over E experts of one shape. Ways: grouped_gemv (one
    launch) and one gemv launch per active expert (only while every expert has <= 4 tokens),
    grouped_gemm on tiled copies (one launch, any token count), and a cuBLAS fp16 matmul per active
    expert; each timed as a whole step in a CUDA graph, alternating between two copies of every expert
    (each copy larger than the L2)."""
    from numba import cuda

    import kbit_numba as kb
    from . import scalar_gemv, tensor_gemm
    from ._timing import graph_time_us, torch

    rng = np.random.default_rng(3)
    routes = np.stack([rng.choice(E, top_k, replace=False) for _ in range(batch)])   # [batch, top_k]
    counts = np.bincount(routes.reshape(-1), minlength=E)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    active = np.nonzero(counts)[0]
    T = int(offsets[-1])
    rows = []
    for K, N in shapes:
        progress(f"MoE {E} experts {K}x{N}: quantizing")
        base = [kb.reference.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.02, k=k)
                for _ in range(8)]                             # 8 distinct weights, reused round-robin
        sets = [kb.stack_experts([base[(e + s) % 8] for e in range(E)]) for s in range(2)]
        tiled = [kb.reference.repack_tiled(b) for b in base]
        tsets = [kb.stack_experts([tiled[(e + s) % 8] for e in range(E)]) for s in range(2)]
        A = cuda.to_device(rng.standard_normal((T, K)).astype(np.float16))
        out = cuda.device_array((T, N), np.float16)
        d_offsets = cuda.to_device(offsets)
        max_tok = int(counts.max())
        nbytes = len(active) * kbit_nbytes(N, K, k)

        def grouped(i, s):
            kb.grouped_gemv(A, sets[i % 2], d_offsets, out=out, stream=s, max_tokens=max_tok)

        ws = tensor_gemm.new_workspace(T, N)

        def grouped_mma(i, s):
            kb.grouped_gemm(A, tsets[i % 2], d_offsets, out=out, stream=s, workspace=ws,
                            m_tile=tensor_gemm.m_tile_for(max_tok))

        cases = [("grouped_gemm", grouped_mma)]
        if max_tok <= MAX_M:
            plans = [[scalar_gemv.plan(A[offsets[e]:offsets[e + 1]], st.expert(e), out[offsets[e]:offsets[e + 1]])
                      for e in active] for st in sets]

            def per_expert(i, s):
                for p in plans[i % 2]:
                    p.launch(s)

            cases = [("grouped_gemv", grouped), ("gemv per expert", per_expert)] + cases
        if torch is not None and torch.cuda.is_available():
            Ws = [[torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(E)] for _ in range(2)]
            At = torch.randn(T, K, device="cuda", dtype=torch.float16)
            Ot = torch.empty(T, N, device="cuda", dtype=torch.float16)

            def cublas(i, s):
                for e in active:
                    torch.matmul(At[offsets[e]:offsets[e + 1]], Ws[i % 2][e].t(), out=Ot[offsets[e]:offsets[e + 1]])

            cases.append(("cuBLAS fp16 per expert", cublas))
        for name, fn in cases:
            progress(f"MoE {K}x{N}: {name}")
            t = graph_time_us(fn, 8)
            rows.append(dict(kernel=name, shape=f"{K}x{N}", experts=E, batch=batch, active=int(len(active)), tokens=T,
                             max_tokens=max_tok, us=t, GBps=nbytes / t / 1e3))
    return rows


FORMAT_KERNELS = ("uniform", "uniform_int8", "sbvr", "bitnet")
UNIFORM_BENCH_BITS = (1, 2, 3, 4, 8)
UNIFORM_BENCH_GROUP = 128


def _device_copies(weight, n, fields=None):
    """n device copies of a weight container: same values, fresh buffers for its ``fields`` (default: all
    its ``ARRAYS``): a device-to-device copy is enough to defeat the L2 cache."""
    from dataclasses import replace

    from numba import cuda
    w = weight.to_device()
    copies = [w]
    for _ in range(n - 1):
        fresh = {}
        for f in fields or w.ARRAYS:
            a = getattr(w, f)
            b = cuda.device_array_like(a)
            b.copy_to_device(a)
            fresh[f] = b
        copies.append(replace(w, **fresh))
    return copies


def format_rows(kinds, shapes, ms, ceilings, progress, uniform_bits=UNIFORM_BENCH_BITS):
    """The other seed systems' GEMVs (M <= 4) on rotating weights: uniform n-bit (group 128, fp16 and
    int8 activations), SBVR and BitNet. Times include the activation quantizer launch where the system
    has one (what a caller of ``gemv`` runs). ``k`` is the bits per value; ``bpw`` the bits per weight
    read (with scales and indices), to compare with the kbit gemv at k + 0.25."""
    from numba import cuda

    from . import bitnet, sbvr, uniform
    from . import reference as ref
    from ._timing import graph_time_us, rotation_count

    rows = []
    rng = np.random.default_rng(2)
    for K, N in shapes:
        W = (rng.standard_normal((N, K)) * 0.02).astype(np.float32)
        systems = []
        for kind in kinds:
            if kind in ("uniform", "uniform_int8"):
                for b in uniform_bits:
                    progress(f"quantize uniform {b}-bit {K}x{N}")
                    w = uniform.quantize(W, b, UNIFORM_BENCH_GROUP)
                    systems.append((f"{kind}[g{UNIFORM_BENCH_GROUP}]", b, w,
                                    lambda A, w, out, i8=(kind == "uniform_int8"):
                                    uniform.plan(A, w, out, 0, np.float16, i8)))
            elif kind == "sbvr":
                progress(f"encode SBVR {K}x{N} (host)")
                w = ref.sbvr_encode(W, lines=1024, iters=2, kmeans_iters=3)
                systems.append(("sbvr", 4, w, lambda A, w, out: sbvr.plan(A, w, out, 0)))
            elif kind == "bitnet":
                w = ref.bitnet_quantize(W)
                systems.append(("bitnet", 2, w, lambda A, w, out: bitnet.plan(A, w, out, 0)))
        for label, bits, w, plan in systems:
            n = rotation_count(w.nbytes)
            copies = _device_copies(w, n)
            for M in [m for m in ms if m <= 4]:
                progress(f"{label} {K}x{N} bits={bits} M={M}")
                A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
                out = cuda.device_array((M, N), np.float16)
                plans = [_prepared(plan(A, c, out)) for c in copies]

                def launch(i, s, plans=plans):
                    plans[i % n](s)

                t = graph_time_us(launch, n * max(1, 64 // n))
                moved = w.nbytes + M * K * 2 + M * N * 2
                rows.append(dict(kernel=label, shape=f"{K}x{N}", k=bits, M=M, us=t, GBps=moved / t / 1e3,
                                 bpw=8 * w.nbytes / (N * K),
                                 pct_ceiling=100 * moved / t / 1e3 / ceilings["read_GBps"], ceiling="read"))
    return rows


def host_overhead_rows(progress, K=2048, N=5120, k=4, calls=3000):
    """Host microseconds per call: gemv() through the dispatcher, a prepared gemv's run() (launch.Prepared),
    and a small torch op, measured the same way (wall clock over many calls, one sync at the end)."""
    import time

    from numba import cuda

    import kbit_numba as kb
    from ._timing import torch

    rng = np.random.default_rng(2)
    qw = kb.quantize(rng.standard_normal((N, K)).astype(np.float16), k=k)
    A = cuda.to_device(rng.standard_normal((1, K)).astype(np.float16))
    out = cuda.device_array((1, N), np.float16)
    prep = kb.prepare_gemv(A, qw, out=out)
    cases = [("gemv() dispatcher call", lambda: kb.gemv(A, qw, out=out)),
             ("prepare_gemv(...).run()", prep.run)]
    if torch is not None and torch.cuda.is_available():
        x = torch.randn(1, K, device="cuda", dtype=torch.float16)
        w = torch.randn(K, 8, device="cuda", dtype=torch.float16)
        y = torch.empty(1, 8, device="cuda", dtype=torch.float16)
        cases.append(("torch.matmul(out=) (a torch op)", lambda: torch.matmul(x, w, out=y)))
    rows = []
    for name, fn in cases:
        progress(f"host overhead: {name}")
        for _ in range(100):
            fn()
        cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        cuda.synchronize()
        rows.append(dict(what=name, host_us_per_call=(t1 - t0) / calls * 1e6))
    return rows


def dequantize_rows(shapes, ks, ceilings, progress):
    from numba import cuda

    from . import codec, pair_gemv
    from ._timing import graph_time_us, rotation_count

    rows = []
    rng = np.random.default_rng(0)
    for K, N in shapes:
        out = cuda.device_array((N, K), np.float16)
        for k in ks:
            progress(f"dequantize {K}x{N} k={k}")
            nbytes = kbit_nbytes(N, K, k)
            n = rotation_count(nbytes)
            ws = _rotating_weights(K, N, k, n, rng)
            moved = nbytes + N * K * 2
            layouts = [("dequantize", ws)]
            if k in CODES_K and K % 64 == 0:     # KbitLinear's default layout (dequantize + cuBLAS at large M)
                layouts.append(("dequantize+codes", [pair_gemv.to_codes(w) for w in ws]))
            for label, weights in layouts:
                t = graph_time_us(lambda i, s: codec.dequantize(weights[i % n], out=out, stream=s),
                                  n * max(1, 64 // n))
                rows.append(dict(kernel=label, shape=f"{K}x{N}", k=k, M=None, us=t,
                                 GBps=moved / t / 1e3, pct_ceiling=100 * moved / t / 1e3 / ceilings["copy_GBps"],
                                 ceiling="copy (read+write)"))
    return rows


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------
def format_table(rows, width=22):
    head = (f"{'kernel':<{width}} {'K x N':>11} {'k':>2} {'M':>3} {'us':>8} {'GB/s':>7} {'%ceil':>6} {'floor us':>8} "
            f"{'%floor':>6} {'cuBLAS us':>9} {'speedup':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        cb = r.get("cublas_us")
        m = r["M"] if r["M"] else "-"
        cb_txt = f"{cb:9.2f}" if cb else "        -"
        sp_txt = f"{cb / r['us']:6.2f}x" if cb else "      -"
        fl = r.get("floor_us")
        fl_txt = f"{fl:8.2f} {100 * fl / r['us']:6.1f}" if fl else f"{'-':>8} {'-':>6}"
        lines.append(f"{r['kernel']:<{width}} {r['shape']:>11} {r['k']:>2} {m:>3} {r['us']:8.2f} {r['GBps']:7.0f} "
                     f"{r['pct_ceiling']:6.1f} {fl_txt} {cb_txt} {sp_txt}")
    return "\n".join(lines)


def plot(rows, path, device):
    """Speedup over cuBLAS fp16 against M, one panel per shape, one line per (kernel, k)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); no plot written")
        return
    rows = [r for r in rows if r["M"] and r.get("cublas_us")]
    shapes = sorted({r["shape"] for r in rows}, key=lambda s: [int(v) for v in s.split("x")])
    if not shapes:
        print("no rows with a cuBLAS baseline to plot")
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(3.2 * len(shapes), 3.2), squeeze=False, sharey=True)
    for ax, shape in zip(axes[0], shapes):
        for key in sorted({(r["kernel"], r["k"]) for r in rows if r["shape"] == shape}):
            pts = sorted((r["M"], r["cublas_us"] / r["us"]) for r in rows
                         if r["shape"] == shape and (r["kernel"], r["k"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]} k={key[1]}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"K x N = {shape}", fontsize=9)
        ax.set_xlabel("M")
    axes[0][0].set_ylabel("speedup vs cuBLAS fp16")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(device, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def _demo():
    """No GPU: a tiny correctness demo on the simulator."""
    import kbit_numba as kb

    rng = np.random.default_rng(0)
    W = rng.standard_normal((4, 64)).astype(np.float32)
    qw = kb.quantize(W, k=4)
    ok = np.array_equal(kb.dequantize(qw, dtype=np.float32).copy_to_host(), kb.reference.dequantize(qw))
    print(f"simulator demo: quantize + dequantize of a 4x64 matrix equals the NumPy reference: {ok}")
    return 0 if ok else 1


def _model_main(args, device, progress):
    """``--model``: the whole-model decode step of ``bench_model``, printed, and saved as JSON / a plot."""
    from . import bench_model
    variants = _parse_list(args.variants) if args.variants else None
    rows = bench_model.run(args.model, variants, _parse_list(args.batch, int), args.context, progress,
                           attention=args.attention)
    kernel = {"sdpa": "torch's SDPA", "numba": "bench_model's decode_attention (split cache)",
              "auto": f"bench_model's decode_attention (split cache) up to batch {bench_model.ATT_MAX_BATCH}, torch's "
                      "SDPA above"}[args.attention]
    print(f"device: {device}; model {args.model}, decode step in one CUDA graph, attention stand-in: {kernel} over a "
          f"{args.context}-token fp16 KV cache per layer (bench_model.py)"
          + ("; kbit variants on the code layout: SiLU in the gate/up gemv's epilogue where the pair or tensor-core "
             "gemv runs (bench_model.fuses_silu)" if any(r.get("silu_pairs") for r in rows) else ""))
    print(bench_model.format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, model=args.model, config=bench_model.MODELS[args.model],
                           attention=args.attention, rows=rows), f,
                      indent=1)
    if args.plot:
        bench_model.plot(rows, args.plot, device)
    return 0


def _read_table(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def add_floor_and_cublas(rows):
    """``rows`` with each one's read floor (``floor_us``) and cuBLAS fp16 time (``cublas_us``), each timed once per
    distinct byte count and shape x M."""
    floors, cublas = {}, {}
    for r in rows:
        b, key = r["floor_bytes"], (r["shape"], r["M"])
        r["floor_us"] = floors[b] = floors[b] if b in floors else floor_us(b)
        r["cublas_us"] = cublas[key] = cublas[key] if key in cublas else cublas_row(*_shape(r["shape"]), r["M"])
    return rows


def _tune_codes_main(args, name, progress, shapes, ks, variants):
    """``--tune-codes`` on GPU ``name``: the pair gemv's knob rows (with the read floor and cuBLAS of each point),
    printed, and the winners written into the table (``tune_codes_table``). Shapes are timed one after another, and
    after each one the table (from the table as it was and every row so far) and the ``--json`` rows are written, so
    a tune cut short (a device call's time limit: 2026-12-06, a cold kernel cache) keeps the shapes it finished;
    without ``--tune-keep-general`` the general rules are then those of the finished shapes."""
    from .dispatch import DEFAULT_TABLE, TUNING_DIR, device_key

    path = args.tune_codes or os.path.join(TUNING_DIR, device_key(name) + ".json")
    before = _read_table(path) or dict(DEFAULT_TABLE, device=name)
    if args.tune_compile_part:
        part, parts = map(int, args.tune_compile_part.split("/"))
        t0 = time.perf_counter()
        count = codes_tune_compile(shapes, ks, before, variants, part, parts)
        print(f"part {part}/{parts}: {count} kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)
        return 0
    if args.tune_compile_workers:
        _compile_in_workers(args.tune_compile_workers, progress)
    read_bw, copy_bw = measure_ceilings()
    print(f"device: {name}; read ceiling {read_bw:.0f} GB/s; the pair gemv's launch knobs (best of "
          f"{CODES_TUNE_REPS} turns; the first row of each point is the default plan, the last from M = "
          f"{CODES_TUNE_MMA_FROM_M} on the tensor-core gemv)", flush=True)
    rows, table = [], before
    for shape in shapes:
        done = add_floor_and_cublas(codes_tune_rows([shape], ks, dict(read_GBps=read_bw, copy_GBps=copy_bw), progress,
                                                    before, variants=variants))
        rows += done
        print(format_table([r for r in done if "same_as" not in r], width=44), flush=True)
        table = tune_codes_table(rows, before, keep_general=args.tune_keep_general)
        _write_json(path, table)
        if args.json:
            _write_json(args.json, dict(device=name, rows=rows, codes_variants=table["codes_variants"],
                                        codes_shapes=table["codes_shapes"]))
    print(f"linear() table written to {path}: codes_variants {json.dumps(table['codes_variants'])}, codes_shapes "
          f"{json.dumps(table['codes_shapes'])}")
    return 0


def _compile_in_workers(workers, progress, argv=None):
    """Fill the kernel cache for this ``--tune-codes`` in ``workers`` processes at once, each this command with
    ``--tune-compile-part i/workers`` (``codes_tune_compile``): on a cold cache the tune compiles its builds one after
    another (34 for float16 sums over the seed shapes, k = 2 and 4; 2026-12-06, an H100: a two-variant tune took 258 s
    cold and 17 s warm), while the machine has more cores. More workers than the tune's build keys (k x variant x M)
    find nothing to do. A part that fails only leaves its builds to the tune. (2026-12-07, a fresh H100: 16 workers
    filled the cache for two variants over the seed shapes in 55 s, 8 of them with work; the tune after it took 21 s.)"""
    argv = list(sys.argv[1:] if argv is None else argv)
    drop = {"--tune-compile-workers"}
    kept = [a for i, a in enumerate(argv) if a.split("=")[0] not in drop and (i == 0 or argv[i - 1] not in drop)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", "kbit_numba.bench", *kept, f"--tune-compile-part={i}/{workers}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(workers)]
    for i, proc in enumerate(procs):
        text = proc.communicate()[0].strip().splitlines()
        progress(f"compile part {i}/{workers} rc {proc.returncode}: {text[-1] if text else ''}")
    progress(f"the kernel cache filled by {workers} processes in {time.perf_counter() - t0:.0f} s")


def _write_json(path, obj):
    """``obj`` as JSON at ``path``, whole or not at all (a temporary file renamed over it: a tune killed while
    writing leaves the last complete file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".part", path)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m kbit_numba.bench", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SEED_SHAPES),
                   help="K x N list, e.g. 2048x5120,4096x14336; a model name (llama3-8b, qwen3-30b-a3b) stands for "
                        "its linear layers' shapes (of a MoE model: QKV and O)")
    p.add_argument("--k", default=",".join(map(str, KS)))
    p.add_argument("--m", default=",".join(map(str, MS)))
    p.add_argument("--kernels", default=",".join(KERNELS),
                   help="any of %s, mma_gemv (the tensor-core gemv on the code layout, M <= 32), the other seed "
                        "systems %s, and the peers %s when they are importable (bench_peers.py; not in the default)"
                        % (",".join(KERNELS), ",".join(FORMAT_KERNELS), ",".join(PEERS)))
    p.add_argument("--bits", default=",".join(map(str, UNIFORM_BENCH_BITS)), help="uniform n-bit widths")
    p.add_argument("--json", help="write the rows and the ceilings as JSON to this file")
    p.add_argument("--csv", help="write the rows as CSV to this file")
    p.add_argument("--plot", help="write a speedup-vs-M plot (PNG) to this file (needs matplotlib)")
    p.add_argument("--sweep", help="gemv tunings cols:max_registers to time, e.g. 4:64,8:none "
                                    "(with --tune, the fastest tuning per point goes into the table)")
    p.add_argument("--pair-cols", help="pair_gemv columns per warp per iteration to time, e.g. 2,4,8")
    p.add_argument("--pair-f16", action="store_true",
                   help="also time pair_gemv with float16 accumulation inside a block (f16_acc)")
    p.add_argument("--pdl", action="store_true",
                   help="also time pair_gemv (and with mma_gemv in --kernels the tensor-core gemv) as "
                        "programmatic dependent launches (sm_90): the graph's launches overlap as a chain of layers "
                        "would (with --pair-f16: the pair gemv's f16_acc variant too)")
    p.add_argument("--fragments", action="store_true",
                   help="with mma_gemv (pair_gemv) in --kernels: also time the tensor-core gemv (the pair gemv, "
                        "with float16 sums under --pair-f16) on the fragment layout (mma_gemv.to_fragments; with "
                        "--pdl as a chain too)")
    p.add_argument("--overhead", action="store_true", help="also measure host time per call")
    p.add_argument("--moe", action="store_true", help="also time the MoE case (512 experts, batch 32, top-8)")
    p.add_argument("--tune", nargs="?", const="", metavar="FILE",
                   help="time gemv, gemm and dequant_matmul (k=4 unless --k is given) over --shapes and "
                        "M = %s (unless --m is given) and write the linear() table for this GPU (default: "
                        "kbit_numba/tuning/<gpu>.json)" % ",".join(map(str, TUNE_MS)))
    p.add_argument("--tune-codes", nargs="?", const="", metavar="FILE",
                   help="time the pair gemv's launch knobs (cols x cta_warps) on the code layout over --shapes, "
                        "k = 2, 4 (unless --k is given), float32 and float16 block sums, alone and as PDL chains, at "
                        "the M its rules give it, and write the winners into this GPU's linear() table (its "
                        "codes_variants and codes_shapes; the other rules kept)")
    p.add_argument("--tune-variants", default="fp32,f16,fp32+pdl,f16+pdl",
                   help="with --tune-codes: the variants to tune (block sums fp32 or f16, +pdl: as a PDL chain)")
    p.add_argument("--tune-keep-general", action="store_true",
                   help="with --tune-codes: keep the table's general rules (for shapes with no entry of their own) "
                        "and write only the tuned shapes' entries, each judged against the rules it runs now (for a "
                        "tune of shapes other than the seed shapes, which would otherwise set the general rules from "
                        "them alone)")
    p.add_argument("--tune-compile-workers", type=int, default=0, metavar="N",
                   help="with --tune-codes: first compile its kernels into the kernel cache in N processes at once "
                        "(a cold machine's tune spends most of its time compiling, one build after another)")
    p.add_argument("--tune-compile-part", help=argparse.SUPPRESS)   # (i/N: one of those processes)
    p.add_argument("--model", help="time a whole-model decode step instead of the kernel grid (needs torch): "
                                    "llama3-8b or qwen3-30b-a3b (MoE) (kbit_numba/bench_model.py)")
    p.add_argument("--batch", default="1,4,16", help="with --model: batch sizes (tokens per step)")
    p.add_argument("--variants", help="with --model: weight formats to time (default: all of "
                                      "bench_model.VARIANTS), e.g. 'fp16,kbit k=4'")
    p.add_argument("--context", type=int, default=1024, help="with --model: KV-cache tokens of the attention "
                                                             "stand-in")
    from .bench_model import ATT_MAX_BATCH, ATTENTIONS
    p.add_argument("--attention", default="auto", choices=ATTENTIONS,
                   help="with --model: the attention stand-in's kernel: bench_model's decode_attention (numba), "
                        "torch's scaled_dot_product_attention (sdpa, as before 2026-11-26), or auto (decode_attention "
                        f"up to batch {ATT_MAX_BATCH}, where it was faster, SDPA above)")
    p.add_argument("--demo", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    known = CODES_TUNE_VARIANT_NAMES
    if not set(_parse_list(args.tune_variants)) <= set(known):
        p.error(f"--tune-variants takes any of {','.join(known)}, got {args.tune_variants!r}")
    tune_variants = [known[v] for v in _parse_list(args.tune_variants)]     # (f16_acc, pdl) pairs
    try:
        shapes = _parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))
    if args.model:
        from . import bench_model
        try:
            bench_model.check_names(args.model, _parse_list(args.variants) if args.variants else [])
        except ValueError as e:
            p.error(str(e))

    from numba.core import config
    if args.demo or config.ENABLE_CUDASIM:
        return _demo()
    from numba import cuda
    if not cuda.is_available():
        print("No CUDA GPU found: timings need one. Running a correctness demo on Numba's CUDA simulator instead.")
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        return subprocess.call([sys.executable, "-m", "kbit_numba.bench", "--demo"], env=env)

    given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
    ks = _parse_list(args.k, int) if "--k" in given or args.tune is None else [4]
    ms = _parse_list(args.m, int) if "--m" in given or args.tune is None else TUNE_MS
    kernels = (_parse_list(args.kernels) if args.tune is None
               else ["gemv", "gemm", "dequant_matmul", "mma_gemv"])   # (+ codes; mma_gemv: on the code layout)

    def progress(msg):
        print(f"  .. {msg}", file=sys.stderr, flush=True)

    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    if args.model:
        return _model_main(args, name, progress)
    if args.tune_codes is not None:
        return _tune_codes_main(args, name, progress, shapes,
                                _parse_list(args.k, int) if "--k" in given else list(CODES_K), tune_variants)
    progress("measuring bandwidth ceilings")
    read_bw, copy_bw = measure_ceilings()
    ceilings = dict(read_GBps=read_bw, copy_GBps=copy_bw)
    rows = []
    if "dequantize" in kernels:
        rows += dequantize_rows(shapes, ks, ceilings, progress)
    if "gemv" in kernels:
        rows += gemv_rows(shapes, ks, ms, ceilings, progress)
    if "pair_gemv" in kernels:
        rows += pair_gemv_rows(shapes, ks, ms, ceilings, progress)
    mm = [kn for kn in ("gemm", "dequant_matmul", "linear", "mma_gemv") if kn in kernels]
    if mm:
        rows += matmul_rows(shapes, ks, ms, ceilings, progress, mm)
    fmt_kinds = [kn for kn in FORMAT_KERNELS if kn in kernels]
    if fmt_kinds:
        rows += format_rows(fmt_kinds, shapes, ms, ceilings, progress, _parse_list(args.bits, int))
    peer_kinds = [kn for kn in PEERS if kn in kernels]
    if peer_kinds:
        rows += peer_rows(peer_kinds, shapes, ks, ms, ceilings, progress)
    if args.sweep:
        tunings = [dict(zip(("cols", "max_registers"), (None if v == "none" else int(v) for v in t.split(":"))))
                   for t in _parse_list(args.sweep)]
        rows += gemv_rows(shapes, ks, [m for m in ms if m <= MAX_M], ceilings, progress, tunings)
    if args.pair_cols:
        rows += pair_gemv_rows(shapes, ks, ms, ceilings, progress, _parse_list(args.pair_cols, int))
    if args.pair_f16:
        rows += pair_gemv_rows(shapes, ks, ms, ceilings, progress, f16_acc=True)
    if args.pdl:
        for f16_acc in (False, True) if args.pair_f16 else (False,):
            rows += pair_gemv_rows(shapes, ks, ms, ceilings, progress, f16_acc=f16_acc, pdl=True)
    if "mma_gemv" in kernels and args.pdl:      # (the code layout's plain launches: matmul_rows above)
        rows += mma_gemv_rows(shapes, ks, ms, ceilings, progress, pdl=True)
    if "mma_gemv" in kernels and args.fragments:
        for pdl in (False, True) if args.pdl else (False,):
            rows += mma_gemv_rows(shapes, ks, ms, ceilings, progress, pdl=pdl, fragments=True)
    if "pair_gemv" in kernels and args.fragments:     # (the layout that could serve every M, if the pair gemv kept up)
        for pdl in (False, True) if args.pdl else (False,):
            rows += pair_gemv_rows(shapes, ks, ms, ceilings, progress, f16_acc=args.pair_f16, pdl=pdl, fragments=True)
    overhead = host_overhead_rows(progress) if args.overhead else []
    moe = (moe_rows(progress) + moe_rows(progress, batch=512)) if args.moe else []
    cublas = {}
    for r in rows:
        if r["M"] is not None:
            key = (r["shape"], r["M"])
            if key not in cublas:
                progress(f"cuBLAS fp16 {r['shape']} M={r['M']}")
                cublas[key] = cublas_row(*_shape(r["shape"]), r["M"])
            r["cublas_us"] = cublas[key]
    floors = {}
    for r in rows:
        if r.get("floor_bytes"):
            if r["floor_bytes"] not in floors:
                progress(f"read floor {r['floor_bytes']} bytes")
                floors[r["floor_bytes"]] = floor_us(r["floor_bytes"])
            r["floor_us"] = floors[r["floor_bytes"]]
    print(f"device: {name}; read ceiling {read_bw:.0f} GB/s, copy ceiling {copy_bw:.0f} GB/s (read+write)")
    if any(r["M"] for r in rows) and not any(r.get("cublas_us") for r in rows if r["M"]):
        print("cuBLAS baseline: unavailable (install torch to time it)")
    print(format_table(rows))
    summary = peer_summary(rows)
    if summary:
        print("\nthe peers beside the fastest kbit row of the same shape, M and bits (peer/kbit > 1: kbit is faster)")
        print("\n".join(summary))
    for r in overhead:
        print(f"host overhead  {r['what']:<34} {r['host_us_per_call']:7.1f} us/call")
    for r in moe:
        print(f"MoE {r['experts']} experts, batch {r['batch']} ({r['active']} active, {r['tokens']} token rows, "
              f"<= {r['max_tokens']} per expert) {r['shape']:>9}  "
              f"{r['kernel']:<24} {r['us']:8.2f} us  {r['GBps']:6.0f} GB/s")
    result = dict(device=name, ceilings=ceilings, rows=rows, host_overhead=overhead, moe=moe)
    if args.tune is not None:
        from .dispatch import TUNING_DIR, device_key
        path = args.tune or os.path.join(TUNING_DIR, device_key(name) + ".json")
        table = merge_tuned(_read_table(path), tune_table(rows, name), rows)
        _write_json(path, table)
        print(f"linear() table written to {path}: rules {table['rules']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot(rows, args.plot, name)
    if args.csv:
        import csv
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, keys)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
