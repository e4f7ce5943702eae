"""Same-run A/B of grouped_gemv at a decode step's routing (E = 128 experts, top-8, B = 1 and 4 tokens; the
qwen3-30b-a3b expert shapes): an older revision's scalar_gemv against the working tree's, best of two
alternations each, CUDA graphs, two L2-cold expert sets.

    git show REV:kbit_numba/scalar_gemv.py | sed 's/^from \. /from kbit_numba /; s/^from \./from kbit_numba./' \
        > benchmarks/_b_scalar_gemv.py
    PYTHONPATH=benchmarks python benchmarks/ab_grouped_gemv.py        # then delete benchmarks/_b_scalar_gemv.py
"""
import numpy as np
from numba import cuda
import kbit_numba as kb
from kbit_numba import scalar_gemv as new, reference as ref, bench
from kbit_numba._timing import graph_time_us
import _b_scalar_gemv as old

rng = np.random.default_rng(3)
E, top = 128, 8
for K, N in ((2048, 1536), (768, 2048)):
    base = [ref.repack_tiled(ref.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.02, k=4)) for _ in range(8)]
    sets = [kb.stack_experts([base[(e + s) % 8] for e in range(E)]) for s in range(2)]
    for B in (1, 4):
        routes = np.stack([rng.choice(E, top, replace=False) for _ in range(B)])
        counts = np.bincount(routes.reshape(-1), minlength=E)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        T = int(offsets[-1]); mt = int(counts.max())
        A = cuda.to_device(rng.standard_normal((T, K)).astype(np.float16))
        out = cuda.device_array((T, N), np.float16)
        d_off = cuda.to_device(offsets)
        res = {}
        for name, mod in (("old", old), ("new", new), ("old2", old), ("new2", new)):
            runs = [mod.plan_grouped(A, s, d_off, out=out, max_tokens=mt).prepare().run for s in sets]
            res[name] = graph_time_us(lambda i, s: runs[i % 2](s), 16)
        nbytes = int((counts > 0).sum()) * N * K // 32 * 17
        floor = bench.floor_us(nbytes)
        print(f"K={K} N={N} E={E} B={B} T={T} active={(counts > 0).sum()} grouped_gemv old {min(res['old'], res['old2']):.2f} us"
              f" new {min(res['new'], res['new2']):.2f} us  (floor over the active experts' bytes {floor:.2f} us)", flush=True)
    got = new.grouped_gemv(A, sets[0], d_off, out_dtype=np.float32).copy_to_host()
    want = ref.grouped_gemv(A.copy_to_host(), sets[0], offsets)
    print("  new vs reference max rel err", float(np.abs(got - want).max() / np.abs(want).max()))
