"""The fused MLP against the two launches it replaces, one layer at a time (GPU):

    python benchmarks/fused_mlp_ab.py [--model llama3-8b] [--k 4,2] [--layers 8] [--json out.json]
    python benchmarks/fused_mlp_ab.py --check      # (also on the simulator: small shapes, no timing)
    ncu -k regex:pair_gemv ... python benchmarks/fused_mlp_ab.py --k 4 --once 2   # eager launches for Nsight Compute

For each k, a chain of ``--layers`` MLPs at the model's shape (M = 1, float16 sums, programmatic dependent launches,
the norm's scale inside gate/up as the decode step runs it) captured in one CUDA graph, each layer on its own copy of
the weights (rotated past the L2, ``_timing.rotation_count``), timed per layer:

* ``two launches``: gate/up through the pair gemv's SiLU epilogue (``rms_eps``) with the knobs ``linear``'s table gives
  that build (``dispatch.KbitLinear``), then down on the code layout, float16 out: what the step runs today;
* ``fused``: ``fused_mlp.plan``, one launch (down K-major, the sums into a float32 accumulator by L2 reductions);
  ``fused 1 load``: the same with one 16-byte load a lane an item in its down phase (``down_loads=1``: more passes,
  the first passes' sums sent while the rest stream; where the default is not already one);
* ``gate/up alone`` and ``down alone``: each half of the two launches as its own chain;
* ``floor``: a pure-read kernel over the layer's bytes (``bench.floor_us``).

``--check`` runs each path once at a small shape and compares the fused sums with the two launches' output (the
float16 rounding of down's output and of the block sums apart): the plumbing, before any timing.
"""
import argparse
import json

import numpy as np
from numba import cuda

from kbit_numba import bench_model, fused_mlp, pair_gemv, quantize, reference as ref
from kbit_numba.dispatch import KbitLinear
from kbit_numba.formats import kbit_nbytes

EPS = bench_model.NORM_EPS


def build(H, inter, k, copies, seed=0):
    """``copies`` device copies of one layer: (gate/up KbitCodes with interleaved rows, down KbitCodes, down
    KbitKMajor)."""
    rng = np.random.default_rng(seed)
    # (the GPU quantizer, bit-exact with reference.quantize, which would take minutes at these shapes)
    gu = quantize(bench_model.interleave_pairs(rng.standard_normal((2 * inter, H), dtype=np.float32) * 0.02),
                  k=k).to_numpy()
    dn = quantize(rng.standard_normal((H, inter), dtype=np.float32) * 0.02, k=k).to_numpy()
    gu_c, dn_c = ref.to_codes(gu), ref.to_codes(dn)
    dn_m = ref.to_kmajor(dn_c)
    return [(pair_gemv.to_codes(gu_c), pair_gemv.to_codes(dn_c), fused_mlp.to_kmajor(dn_m)) for _ in range(copies)]


def plans(layers, x, H, inter, pdl=True):
    """Per copy, the prepared launches of each mode: (gate/up, down) of the two launches, the fused one, and the fused
    one with one load an item (None where that is the default)."""
    h = cuda.device_array((1, inter), np.float16)
    y = cuda.device_array((1, H), np.float16)
    acc = cuda.to_device(np.zeros((1, H), np.float32))
    out = []
    for gu, dn, km in layers:
        two = (KbitLinear(gu, f16_acc=True, pdl=pdl).plan(x, out=h, silu_pairs=True, rms_eps=EPS).prepare(),
               KbitLinear(dn, f16_acc=True, pdl=pdl).plan(h, out=y).prepare())
        one = fused_mlp.prepare(x, gu, km, acc=acc, h=h, rms_eps=EPS, pdl=pdl)
        one_load = (None if fused_mlp.DOWN_LOADS[gu.k] == 1 else
                    fused_mlp.prepare(x, gu, km, acc=acc, h=h, rms_eps=EPS, pdl=pdl, down_loads=1))
        out.append((two, one, one_load))
    return out, h, y, acc


def check(k=4, H=64, inter=64):
    """One launch of each path at a small shape: the fused sums against down of the fused launch's own h, and the two
    launches' float16 output against the same, within float16 rounding."""
    x = cuda.to_device(np.random.default_rng(1).standard_normal((1, H)).astype(np.float16))
    layers = build(H, inter, k, 1)
    prepared, h, y, acc = plans(layers, x, H, inter, pdl=False)
    two, one, _ = prepared[0]
    one.run()
    got, h1 = acc.copy_to_host()[0], h.copy_to_host()
    want = ref.gemv(h1.astype(np.float32), ref.from_kmajor(layers[0][2].to_numpy()))[0]
    two[0].run()
    two[1].run()
    y2, h2 = y.copy_to_host()[0].astype(np.float32), h.copy_to_host()
    scale = np.abs(want).max() + 1e-30
    print(f"k={k}: fused vs down(h) {np.abs(got - want).max() / scale:.2e}, two launches vs fused "
          f"{np.abs(y2 - got).max() / scale:.2e}, h equal: {np.array_equal(h1, h2)}")
    assert np.abs(got - want).max() <= 0.01 * scale and np.abs(y2 - got).max() <= 0.02 * scale


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--k", default="4,2")
    ap.add_argument("--layers", type=int, default=8, help="launch pairs (or fused launches) a graph")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--check", action="store_true", help="compare the paths once at a small shape, no timing")
    ap.add_argument("--once", type=int, default=0, help="eager rounds of fused, gate/up, down for a profiler")
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    if args.check:
        for k in ks:
            check(k)
        return
    from kbit_numba._timing import graph_time_us, rotation_count
    from kbit_numba.bench import floor_us
    cfg = bench_model.MODELS[args.model]
    H, inter = cfg["hidden"], cfg["intermediate"]
    rows = []
    for k in ks:
        if args.once:
            x = cuda.to_device(np.random.default_rng(2).standard_normal((1, H)).astype(np.float16))
            (two, one, _), = plans(build(H, inter, k, 1), x, H, inter)[0]
            for _ in range(args.once):
                for p in (one,) + two:
                    p.run()
            cuda.synchronize()
            continue
        layer_bytes = kbit_nbytes(2 * inter, H, k) + kbit_nbytes(H, inter, k)
        copies = max(rotation_count(layer_bytes), 2)
        x = cuda.to_device(np.random.default_rng(2).standard_normal((1, H)).astype(np.float16))
        ps, h, y, acc = plans(build(H, inter, k, copies), x, H, inter)
        n = args.layers
        modes = {
            "two launches": lambda i, s: [p.run(s) for p in ps[i % copies][0]],
            "fused": lambda i, s: ps[i % copies][1].run(s),
            "gate/up alone": lambda i, s: ps[i % copies][0][0].run(s),
            "down alone": lambda i, s: ps[i % copies][0][1].run(s),
        }
        if ps[0][2] is not None:
            modes["fused 1 load"] = lambda i, s: ps[i % copies][2].run(s)
        times = {name: graph_time_us(fn, n) for name, fn in modes.items()}
        times["floor"] = floor_us(layer_bytes)
        for name, t in times.items():
            rows.append(dict(model=args.model, k=k, mode=name, us_per_layer=t, layer_bytes=layer_bytes,
                             pct_floor=100 * times["floor"] / t, copies=copies, layers=n))
            print(f"k={k} {name:<14} {t:8.2f} us a layer  {100 * times['floor'] / t:5.0f}% of the floor")
        print(f"k={k} fused - two launches: {times['fused'] - times['two launches']:+.2f} us a layer")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
