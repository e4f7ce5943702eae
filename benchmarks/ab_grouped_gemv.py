r"""Same-run A/B of grouped_gemv at a decode step's routing (E = 128 experts, top-8, B = 1, 4 and 16 tokens; the
qwen3-30b-a3b expert shapes, k = 4 unless ``--k``): an older revision's scalar_gemv (if
benchmarks/_b_scalar_gemv.py is there) against the working tree's, the tensor-core ``mma_gemv.grouped_gemv`` on
the same weights in the code layout (mma) and in the fragment layout (mma(f)), and ``pair_gemv.grouped_gemv`` (a
token row a grid slot) on the code layout with float32 and float16 block sums (pair, pair f16); best of two
alternations each, CUDA graphs, two L2-cold expert sets.

    git show REV:kbit_numba/scalar_gemv.py | sed 's/^from \. /from kbit_numba /; s/^from \./from kbit_numba./' \
        > benchmarks/_b_scalar_gemv.py
    PYTHONPATH=benchmarks python benchmarks/ab_grouped_gemv.py        # then delete benchmarks/_b_scalar_gemv.py

``python benchmarks/ab_grouped_gemv.py [K x N list] [--split=S[,S...]] [--cta-warps=W] [--batch=B[,B...]]
[--grid-x=X[,X...]] [--k=BITS]``: other
expert shapes (default the qwen3-30b-a3b ones, 2048x1536 and 768x2048), and the tensor-core gemv with K split S ways
too (``mma,splitS``: grid z the shares, a float32 workspace and a finishing launch; for K > 4096, where a CTA of all
K-warps runs at 64 registers; S = 1: unsplit, with ``--cta-warps``), its CTAs aiming at W warps (``mma,splitS,wW``:
smaller CTAs, more of them resident, so that the active experts' pieces spread over more SMs), at B tokens (default
1, 4, 16), and unsplit with grid.x forced to X (``mma,xX``: X CTAs an expert slot instead of
``core.slot_share``'s, so that more, shorter CTAs share the SMs that the empty slots leave), with k = BITS experts
(2 or 4: the code layout's; default 4).
"""
import sys
from contextlib import contextmanager

import numpy as np
from numba import cuda
import kbit_numba as kb
from kbit_numba import scalar_gemv as new, reference as ref, bench
from kbit_numba._timing import graph_time_us
from kbit_numba import mma_gemv, pair_gemv

try:
    import _b_scalar_gemv as old
except ImportError:                         # no older revision to compare: the working tree's kernels only
    old = None


def option(name, default):
    """The integers of ``--name=a,b,...``, or ``default``."""
    return next(([int(v) for v in a.split("=")[1].split(",")] for a in sys.argv[1:] if a.startswith(f"--{name}=")),
                default)


@contextmanager
def grid_x_rule(x):
    """mma_gemv's grouped grid.x rule (``core.slot_share``, which every grouped plan calls) replaced by ``x`` CTAs a
    slot (None: unchanged)."""
    rule = mma_gemv.slot_share
    if x is not None:
        mma_gemv.slot_share = lambda n_groups, *args: min(x, n_groups)
    try:
        yield
    finally:
        mma_gemv.slot_share = rule


# the most rows of one expert each kernel takes (the pair gemv: any number, one a grid slot)
MAX_ROWS = {mma_gemv: mma_gemv.MAX_TOKENS, new: new.MAX_M, **({old: old.MAX_M} if old is not None else {})}
args = [a for a in sys.argv[1:] if not a.startswith("--")]
splits = option("split", [])
cta_warps = option("cta-warps", [None])[0]
batches = option("batch", [1, 4, 16])
grid_xs = option("grid-x", [])
bits = option("k", [4])[0]
shapes = [tuple(int(v) for v in s.split("x")) for s in (args[0] if args else "2048x1536,768x2048").split(",")]
rng = np.random.default_rng(3)
E, top = 128, 8
for K, N in shapes:
    flat = [ref.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.02, k=bits) for _ in range(8)]
    base = [ref.repack_tiled(w) for w in flat]
    codes = [ref.to_codes(w) for w in flat]
    sets = [kb.stack_experts([base[(e + s) % 8] for e in range(E)]) for s in range(2)]
    csets = [kb.stack_experts([codes[(e + s) % 8] for e in range(E)]) for s in range(2)]
    frags = [ref.to_fragments(c) for c in codes]
    fsets = [kb.stack_experts([frags[(e + s) % 8] for e in range(E)]) for s in range(2)]
    for B in batches:
        routes = np.stack([rng.choice(E, top, replace=False) for _ in range(B)])
        counts = np.bincount(routes.reshape(-1), minlength=E)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        T = int(offsets[-1]); mt = int(counts.max())
        A = cuda.to_device(rng.standard_normal((T, K)).astype(np.float16))
        out = cuda.device_array((T, N), np.float16)
        d_off = cuda.to_device(offsets)
        res, grids = {}, {}
        cases = [("old", old, sets), ("new", new, sets), ("mma", mma_gemv, csets), ("mma(f)", mma_gemv, fsets),
                 ("pair", pair_gemv, csets), ("pair f16", pair_gemv, csets)]
        sums = cuda.to_device(np.zeros(T * N, np.float32))
        opts = {}                                   # case name -> the split launch's plan_grouped options
        k_warps = -(-(K // mma_gemv.BLOCK) // mma_gemv.KB_WARP)     # (as mma_gemv.k_splits: at most a share each)
        for s in (s for s in splits if s <= k_warps):
            name = f"mma,split{s}" + (f",w{cta_warps}" if cta_warps else "")
            cases.insert(3 + len(opts), (name, mma_gemv, csets))
            opts[name] = dict(split=s, workspace=sums, cta_warps=cta_warps)
        for x in grid_xs:
            cases.insert(3 + len(opts), (f"mma,x{x}", mma_gemv, csets))
            opts[f"mma,x{x}"] = dict(grid_x=x)
        for name, mod, ws in cases + cases:
            if mod is None or mt > MAX_ROWS.get(mod, mt):
                continue
            extra = dict(opts.get(name, {}))
            with grid_x_rule(extra.pop("grid_x", None)):
                plans = [mod.plan_grouped(A, w, d_off, out=out, f16_acc=name.endswith("f16")) if mod is pair_gemv else
                         mod.plan_grouped(A, w, d_off, out=out, max_tokens=mt, **extra) for w in ws]
            grids[name] = plans[0].steps[0].grid
            runs = [p.prepare().run for p in plans]
            t = graph_time_us(lambda i, s: runs[i % 2](s), 16)
            res[name] = min(res.get(name, t), t)
        nbytes = int((counts > 0).sum()) * flat[0].nbytes             # the active experts' planes and absmax
        floor = bench.floor_us(nbytes)
        print(f"k={bits} K={K} N={N} E={E} B={B} T={T} active={(counts > 0).sum()} max rows {mt} grouped_gemv "
              + "  ".join(f"{name} {us:.2f} us" for name, us in res.items())
              + f"  (floor over the active experts' bytes {floor:.2f} us)", flush=True)
        print("  grids: " + "  ".join(f"{name} {grid}" for name, grid in grids.items()), flush=True)
    want = ref.grouped_gemv(A.copy_to_host(), sets[0], offsets)
    for name, mod, ws in cases:
        if mod is not None and mt <= MAX_ROWS.get(mod, mt):
            f16 = dict(f16_acc=True) if name.endswith("f16") else {}
            if name in opts:
                o = dict(opts[name], workspace=None)
                with grid_x_rule(o.pop("grid_x", None)):
                    got = mma_gemv.plan_grouped(A, ws[0], d_off, out_dtype=np.float32, **o).launch().copy_to_host()
            else:
                got = mod.grouped_gemv(A, ws[0], d_off, out_dtype=np.float32, **f16).copy_to_host()
            print(f"  {name} vs reference (B = {B}) max rel err", float(np.abs(got - want).max() / np.abs(want).max()))
