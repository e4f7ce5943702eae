"""The peers issue 15 names, timed beside kbit's rows by ``python -m kbit_numba.bench --kernels ...,gemlite,bnb``.

Neither peer is a dependency: a peer that is not importable is left out of the run with a line that says so.

- ``gemlite``: GemLite's Triton kernels (``GemLiteLinear``), W2 or W4 with group 128 (float16 scales and zeros, what
  its HQQ path makes), float16 activations, **its own default path**: the kernel GemLite picks per M
  (``GEMV_REVSPLITK`` up to M = 4, ``GEMM_SPLITK`` above) with its default autotuning on the first call of each M
  (outside the timed graph). Weight values are random codes: a kernel's time does not depend on them.
- ``bnb``: bitsandbytes' NF4 with block 64 (``quantize_4bit`` + ``matmul_4bit``): its gemv kernel at M = 1,
  dequantize + cuBLAS above, as a user's call runs.

Each is timed as every kbit row is (``_timing.graph_time_us``: CUDA-graph replays over rotating weight copies
whose total exceeds 3x the L2), its read floor computed over its own bytes (weights with their scales, activations,
output), and checked once against ``A @ W^T`` of its own dequantized weight before it is timed: a peer row is a
kernel that computed the right product.

``peer_summary`` then sets, per shape x M, the fastest kbit row of each k beside the peer of the same bits.
"""
from __future__ import annotations

PEERS = ("gemlite", "bnb")
GEMLITE_GROUP = 128
GEMLITE_BITS = (2, 4)            # GemLite's widths that kbit has (k = 2, 4); k = 3, 5 have no GemLite twin
BNB_BLOCK = 64
CHECK_RTOL = 2e-2                # |out - A W^T| / |A W^T| (max over the output) allowed before a peer is timed


def missing(name):
    """None when peer ``name`` can run here, else why not (a line for the run's output)."""
    try:
        import torch
    except ImportError:
        return f"{name}: torch is not installed"
    if not torch.cuda.is_available():
        return f"{name}: torch sees no CUDA device"
    module = {"gemlite": "gemlite", "bnb": "bitsandbytes"}[name]
    try:
        __import__(module)
    except Exception as e:                      # a peer's import may fail in any way (its native library, Triton)
        return f"{name}: `import {module}` failed ({type(e).__name__}: {e})"
    return None


def _relative_error(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6))


def _rows(label, K, N, bits, ms, nbytes, copies, call, dequantized, ceilings, progress):
    """Rows of one peer weight: each M checked against ``A @ dequantized^T``, then timed over the ``copies``."""
    import torch

    from ._timing import graph_time_us
    from .bench import _mm_row

    rows = []
    n = len(copies)
    for M in ms:
        A = torch.randn(M, K, device="cuda", dtype=torch.float16)
        progress(f"{label} {K}x{N} M={M}")
        err = _relative_error(call(A, copies[0]), A @ dequantized.t())     # (the first call also autotunes)
        if not err < CHECK_RTOL:
            raise RuntimeError(f"{label} {K}x{N} M={M}: output differs from A @ W^T by {err:.3g} (relative): "
                               "not timing a wrong product")
        t = graph_time_us(lambda i, s: call(A, copies[i % n]), n * max(1, 64 // n))
        row = _mm_row(label, K, N, bits, M, t, nbytes, ceilings)
        row.update(bpw=8 * nbytes / (N * K), check=err)
        rows.append(row)
    return rows


def gemlite_rows(shapes, ks, ms, ceilings, progress, group=GEMLITE_GROUP):
    """GemLite W{k} g``group`` rows for each k of ``ks`` that GemLite has (2, 4)."""
    import gemlite
    import torch
    from gemlite.core import forward_functional

    from ._timing import rotation_count

    rows = []
    for K, N in shapes:
        for bits in [b for b in ks if b in GEMLITE_BITS]:
            W_q = torch.randint(0, 2 ** bits, (N, K), dtype=torch.uint8, device="cuda")
            scales = (torch.rand(N, K // group, device="cuda") * 1e-2 + 1e-3).half()
            zeros = torch.full((N, K // group), 2 ** (bits - 1) - 0.5, device="cuda", dtype=torch.float16)
            mod = gemlite.GemLiteLinear(bits, group_size=group, in_features=K, out_features=N,
                                        input_dtype=gemlite.DType.FP16, output_dtype=gemlite.DType.FP16)
            mod.pack(W_q, scales, zeros, None)
            args, meta = mod.get_tensor_args(), mod.get_meta_args()
            nbytes = sum(t.numel() * t.element_size() for t in args[:3])     # packed codes, scales, zeros
            n = rotation_count(nbytes)
            copies = [args] + [[t.clone() for t in args[:3]] + args[3:] for _ in range(n - 1)]
            # GemLite's convention: W = (W_q - zeros) * scales, group-wise along K
            W = ((W_q.float().view(N, K // group, group) - zeros.float()[..., None]) * scales.float()[..., None])
            rows += _rows(f"gemlite W{bits} g{group}", K, N, bits, ms, nbytes, copies,
                          lambda A, a, meta=meta: forward_functional(A, None, a, meta), W.view(N, K).half(),
                          ceilings, progress)
    return rows


def bnb_rows(shapes, ks, ms, ceilings, progress, block=BNB_BLOCK):
    """bitsandbytes NF4 block ``block`` rows (when 4 is in ``ks``)."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F
    import torch

    from ._timing import rotation_count

    rows = []
    if 4 not in ks:
        return rows
    for K, N in shapes:
        def quantized():
            return F.quantize_4bit(torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02, blocksize=block,
                                   quant_type="nf4")
        w4, qs = quantized()
        nbytes = w4.numel() * w4.element_size() + qs.absmax.numel() * qs.absmax.element_size()
        n = rotation_count(nbytes)
        copies = [(w4, qs)] + [quantized() for _ in range(n - 1)]
        rows += _rows(f"bnb nf4 b{block}", K, N, 4, ms, nbytes, copies,
                      lambda A, c: bnb.matmul_4bit(A, c[0].t(), quant_state=c[1]), F.dequantize_4bit(w4, qs),
                      ceilings, progress)
    return rows


def peer_rows(kinds, shapes, ks, ms, ceilings, progress, say=print):
    """The rows of every peer in ``kinds`` that can run here; ``say`` gets a line for each one that cannot."""
    rows = []
    for name in kinds:
        why = missing(name)
        if why:
            say(f"peer left out: {why}")
            continue
        rows += (gemlite_rows if name == "gemlite" else bnb_rows)(shapes, ks, ms, ceilings, progress)
    return rows


def peer_summary(rows):
    """Lines setting, per shape x M x k, the fastest kbit row (any kernel of the package) beside each peer row of
    the same bits: ``peer us / kbit us`` > 1 means kbit is faster."""
    peers = [r for r in rows if r["kernel"].split()[0] in PEERS]
    if not peers:
        return []
    best = {}
    for r in rows:
        if r["kernel"].split()[0] not in PEERS and r.get("M"):
            key = (r["shape"], r["M"], r["k"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    lines = [f"{'K x N':>11} {'M':>3} {'k':>2} {'kbit best':<34} {'us':>8} {'peer':<18} {'us':>8} {'peer/kbit':>9}"]
    for p in sorted(peers, key=lambda r: (r["shape"], r["M"], r["k"], r["kernel"])):
        b = best.get((p["shape"], p["M"], p["k"]))
        kb = f"{b['kernel']:<34} {b['us']:8.2f}" if b else f"{'(no kbit row)':<34} {'-':>8}"
        ratio = f"{p['us'] / b['us']:8.2f}x" if b else f"{'-':>9}"
        lines.append(f"{p['shape']:>11} {p['M']:>3} {p['k']:>2} {kb} {p['kernel']:<18} {p['us']:8.2f} {ratio}")
    return lines
