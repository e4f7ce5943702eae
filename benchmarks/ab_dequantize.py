"""A/B of the dequantizer against another version of ``codec.py``, in one run (CUDA-graph timed, L2-cold
weights, the copy ceiling of the same run):

    git show REV:kbit_numba/codec.py \\
        | sed 's/^from \\. /from kbit_numba /; s/^from \\./from kbit_numba./' > benchmarks/_b_codec.py
    python benchmarks/ab_dequantize.py benchmarks/_b_codec.py [K x N list] [--chunks 1,2,4,8]

Prints, per shape, layout (flat k = 2..5, the code layout k = 2, 4, tiled k = 4, the fragment layout k = 2, 4 where N
is a multiple of 16 and K of 256) and output type float16, the time of the working tree's kernel (A, at each
``--chunks`` value; default: its default) and of the other file's (B; for the fragment layout B dequantizes the same
weights in the code layout, so A/B is the fragment layout's cost when the other file is this tree's codec.py),
alternating A and B three times, with each one's share of the copy ceiling: (weight bytes read + output bytes
written) / time, against a plain 16-byte-a-thread copy kernel's read + write rate (``bench.measure_ceilings``).
"""
import importlib.util
import sys

import numpy as np
from numba import cuda

from kbit_numba import bench, codec, mma_gemv, pair_gemv
from kbit_numba.formats import fits_fragments, kbit_nbytes
from kbit_numba._timing import graph_time_us, rotation_count

args = [a for a in sys.argv[1:] if not a.startswith("--")]
chunk_list = [None]
if "--chunks" in sys.argv:
    chunk_list = [int(v) for v in sys.argv[sys.argv.index("--chunks") + 1].split(",")]
    args = [a for a in args if a != sys.argv[sys.argv.index("--chunks") + 1]]
spec = importlib.util.spec_from_file_location("codec_b", args[0])
other = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = other                   # (its dataclass Spec looks its module up there)
spec.loader.exec_module(other)
shapes = [tuple(int(v) for v in s.split("x")) for s in (args[1] if len(args) > 1 else
                                                         "4096x14336,2048x5120,4096x4096").split(",")]
cases = [("flat", k) for k in (2, 3, 4, 5)] + [("codes", 2), ("codes", 4), ("tiled", 4), ("fragments", 2),
                                                ("fragments", 4)]
read_bw, copy_bw = bench.measure_ceilings()
name = cuda.get_current_device().name
print(f"{name.decode() if isinstance(name, bytes) else name}: copy ceiling {copy_bw:.0f} GB/s (read + write), "
      f"read ceiling {read_bw:.0f} GB/s")
print(f"{'K x N':>11} {'layout':>9} {'k':>1} {'chunks':>6} {'A us':>7} {'B us':>7} {'A/B':>6} {'A %copy':>8} "
      f"{'B %copy':>8}")
rng = np.random.default_rng(1)
for K, N in shapes:
    out = cuda.device_array((N, K), np.float16)
    for layout, k in cases:
        if layout == "fragments" and not fits_fragments(N, K):
            continue
        nbytes = kbit_nbytes(N, K, k)
        n = rotation_count(nbytes)
        ws = bench._rotating_weights(K, N, k, n, rng)
        if layout in ("codes", "fragments"):
            ws = [pair_gemv.to_codes(w) for w in ws]
        elif layout == "tiled":
            ws = [codec.repack_tiled(w) for w in ws]
        moved = nbytes + N * K * 2
        reps = n * max(1, 64 // n)
        plans_b = [other.plan_dequantize(w, np.float16, out=out) for w in ws]     # (fragments: B on the codes)
        if layout == "fragments":
            ws = [mma_gemv.to_fragments(w) for w in ws]
        for chunks in chunk_list:
            kw = {} if chunks is None else dict(chunks=chunks)
            plans_a = [codec.plan_dequantize(w, np.float16, out=out, **kw) for w in ws]
            ts = {"A": [], "B": []}
            for _ in range(3):
                for name, plans in (("A", plans_a), ("B", plans_b)):
                    ts[name].append(graph_time_us(lambda i, s: plans[i % n].launch(stream=s), reps))
            a, b = min(ts["A"]), min(ts["B"])
            label = "dflt" if chunks is None else chunks
            print(f"{K}x{N:>6} {layout:>9} {k} {label:>6} {a:7.2f} {b:7.2f} {a / b:6.3f} "
                  f"{100 * moved / a / 1e3 / copy_bw:8.1f} {100 * moved / b / 1e3 / copy_bw:8.1f}   "
                  f"A {' '.join(f'{t:.2f}' for t in ts['A'])}  B {' '.join(f'{t:.2f}' for t in ts['B'])}")
