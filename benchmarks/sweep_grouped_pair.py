r"""The grouped pair gemv's launch knobs (cols x cta_warps) at a decode step's routing: the qwen3-30b-a3b expert
shapes (gate/up 2048 -> 2 x 768 with the SiLU epilogue, down 768 -> 2048), E = 128 experts, top-8, B tokens;
k = 2, 4; float32 and float16 block sums; alone and as a PDL chain. CUDA graphs of 16 launches over two L2-cold
expert sets; best of two alternations. Prints, per point, the default knobs' time and the fastest knobs.

    python benchmarks/sweep_grouped_pair.py [--batch 1,4] [--k 2,4] [--sums f32,f16] [--pdl 0,1] [--max-registers R]
"""
import argparse
import itertools

import numpy as np
from numba import cuda

import kbit_numba as kb
from kbit_numba import bench, pair_gemv, reference as ref
from kbit_numba.formats import kbit_nbytes
from kbit_numba._timing import graph_time_us

p = argparse.ArgumentParser()
p.add_argument("--batch", default="1,4")
p.add_argument("--k", default="2,4")
p.add_argument("--cta-warps", default="4,8,16,32")
p.add_argument("--sums", default="f32,f16", help="block sums to time: f32, f16")
p.add_argument("--pdl", default="0,1", help="0: alone, 1: as a PDL chain")
p.add_argument("--max-registers", type=int, default=None, help="a per-thread register cap for every knob set")
args = p.parse_args()
rng = np.random.default_rng(5)
E, top = 128, 8
WARPS = [int(w) for w in args.cta_warps.split(",")]
for k in (int(x) for x in args.k.split(",")):
    for name, K, N, silu in (("gate_up", 2048, 1536, True), ("down", 768, 2048, False)):
        codes = [ref.to_codes(ref.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.02, k=k))
                 for _ in range(8)]
        sets = [kb.stack_experts([codes[(e + s) % 8] for e in range(E)]) for s in range(2)]
        for B in (int(b) for b in args.batch.split(",")):
            routes = np.stack([rng.choice(E, top, replace=False) for _ in range(B)])
            counts = np.bincount(routes.reshape(-1), minlength=E)
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            T = int(offsets[-1])
            A = cuda.to_device(rng.standard_normal((T, K)).astype(np.float16))
            out = cuda.device_array((T, N // 2 if silu else N), np.float16)
            d_off = cuda.to_device(offsets)
            floor = bench.floor_us(int((counts > 0).sum()) * kbit_nbytes(N, K, k))
            for f16, pdl in itertools.product([s == "f16" for s in args.sums.split(",")],
                                              [p == "1" for p in args.pdl.split(",")]):
                knobs = [(None, None)] + [(c, w) for c in pair_gemv.COL_CHOICES if not (silu and c % 2)
                                          for w in WARPS]
                res = {}
                for knob in knobs + knobs:
                    runs = [pair_gemv.plan_grouped(A, w, d_off, out=out, f16_acc=f16, pdl=pdl, silu_pairs=silu,
                                                   cols=knob[0], cta_warps=knob[1],
                                                   max_registers=args.max_registers).prepare().run for w in sets]
                    t = graph_time_us(lambda i, s: runs[i % 2](s), 16)
                    res[knob] = min(res.get(knob, t), t)
                best = min(res, key=res.get)
                top3 = sorted(res, key=res.get)[:3]
                cap = f" cap {args.max_registers}" if args.max_registers else ""
                print(f"k={k} {name} {N}x{K} B={B} T={T} {'f16' if f16 else 'f32'}{' pdl' if pdl else ''}{cap}: "
                      f"default {res[(None, None)]:.2f} us  best cols={best[0]} cta_warps={best[1]} "
                      f"{res[best]:.2f} us  (next: " + ", ".join(f"{c}/{w} {res[(c, w)]:.2f}" for c, w in top3[1:])
                      + f")  floor {floor:.2f} us", flush=True)
