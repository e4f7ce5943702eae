"""How much faster a gemv runs when its weights already sit in the L2 (GPU machine): the bound on anything that brings
weights in earlier (an L2 prefetch, a persistent kernel that streams the next layer, deeper loads in flight).

    python benchmarks/l2_warm_bound.py [K x N list] [k list] [kernel:M list]
    e.g. python benchmarks/l2_warm_bound.py 4096x14336,2048x5120 4,2 pair_f16:1,mma_frag:4,mma_frag:16

Each point is timed two ways, two turns each, in CUDA graphs (``_timing.graph_time_us``): **cold**, launches rotating
over enough copies of the weight to exceed 3x the L2 (as every bench row), and **warm**, every launch on one copy, which
stays in the L2 (N K k / 8 bytes of codes plus the absmax: < 50 MB on the seed shapes). Kernels: ``pair_f16`` (the
pair gemv, ``f16_acc``, code layout), ``mma`` / ``mma_frag`` (the tensor-core gemv on the code / fragment layout).
"""
import sys

import numpy as np
from numba import cuda

import kbit_numba as kb
from kbit_numba import mma_gemv, pair_gemv
from kbit_numba._timing import graph_time_us, rotation_count


def plans(name, A, out, copies):
    if name == "pair_f16":
        return [pair_gemv.plan(A, c, out, f16_acc=True).prepare() for c in copies]
    if name == "mma":
        return [mma_gemv.plan(A, c, out).prepare() for c in copies]
    if name == "mma_frag":
        return [mma_gemv.plan(A, mma_gemv.to_fragments(c), out).prepare() for c in copies]
    raise SystemExit(f"unknown kernel {name!r}: pair_f16, mma, mma_frag")


def main(argv):
    shapes = [tuple(int(v) for v in s.split("x")) for s in (argv[0] if argv else "4096x14336").split(",")]
    ks = [int(v) for v in (argv[1] if len(argv) > 1 else "4").split(",")]
    kernels = [(s.split(":")[0], int(s.split(":")[1]))
               for s in (argv[2] if len(argv) > 2 else "pair_f16:1,mma_frag:4,mma_frag:16").split(",")]
    rng = np.random.default_rng(0)
    print(f"{'K x N':>11} {'k':>2} {'kernel':>9} {'M':>3} {'MB':>6} {'cold us':>8} {'warm us':>8} {'warm/cold':>9}")
    for K, N in shapes:
        for k in ks:
            kc = pair_gemv.to_codes(kb.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float16), k=k))
            nbytes = kc.packed.nbytes + kc.absmax.nbytes
            n = rotation_count(nbytes)
            copies = [kc] + [type(kc)(cuda.to_device(kc.packed.copy_to_host()), cuda.to_device(kc.absmax.copy_to_host()),
                                      kc.codebook, kc.k, kc.shape, kc.absmax_format) for _ in range(n - 1)]
            for name, M in kernels:
                A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
                preps = plans(name, A, cuda.device_array((M, N), np.float16), copies)
                cold, warm = [], []
                for _ in range(2):
                    cold.append(graph_time_us(lambda i, s: preps[i % n].run(s), 2 * n))
                    warm.append(graph_time_us(lambda i, s: preps[0].run(s), 2 * n))
                print(f"{f'{K}x{N}':>11} {k:>2} {name:>9} {M:>3} {nbytes / 2**20:6.1f} {min(cold):8.2f} {min(warm):8.2f} "
                      f"{min(warm) / min(cold):9.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
