r"""Does it cost bandwidth when one warp load instruction reads several short runs instead of 512 contiguous bytes?

A pure-read kernel, one 16-byte load per thread (every load of the launch in flight from the start, as the read
floor of ``bench.floor_us``), over the same bytes with different thread -> address maps. With runs of RUN bytes,
P = 512 / RUN consecutive warps share a region of P x 512 bytes, seen as P rows of 512 bytes: warp i of the region
reads bytes [i RUN, (i + 1) RUN) of every row, so each load instruction meets P runs of RUN bytes, 512 bytes apart.
RUN = 512 is the floor kernel's map (the code layout's pair gemv loads); RUN = 64 is what the pair gemv meets on the
fragment layout at k = 4 (8 runs of 64 bytes). Rotating L2-cold copies, CUDA graphs, both load forms (plain
``ld.global.nc`` and ``.L1::no_allocate``, which the pair gemv uses for weights).

    python benchmarks/read_patterns.py [MB list, default 29.4 (4096x14336 at k = 4), 5.6 (2048x5120)]
"""
import sys

import numpy as np
from numba import cuda

from kbit_numba._timing import graph_time_us, rotation_count
from kbit_numba.intrinsics import ldg128, ldg128_stream

THREADS = 512
RUNS = (512, 256, 128, 64, 32, 16)


def make_kernel(run, stream):
    load = ldg128_stream if stream else ldg128
    per_run = run // 16                    # lanes that read one run
    P = 512 // run                         # runs a load instruction meets (and warps sharing a region)

    @cuda.jit
    def read(src, first_word, n_words, out):
        g = cuda.grid(1)
        w, lane = g // 32, g % 32
        region, i = w // P, w % P
        r, q = lane // per_run, lane % per_run
        byte = region * P * 512 + r * 512 + i * run + q * 16
        if byte // 4 < n_words:
            a, b, c, d = load(src, first_word + byte // 4)
            if (a ^ b ^ c ^ d) == np.uint32(0x9E3779B9):
                out[0] = a
    return read


def main():
    sizes = [float(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [29.36, 5.57]
    name = cuda.get_current_device().name
    print(f"device: {name.decode() if isinstance(name, bytes) else name}")
    for mb in sizes:
        n_words = int(mb * 1e6) // (512 * 32) * (512 * 32) // 4      # whole regions of the widest map
        n = rotation_count(n_words * 4)
        src = cuda.device_array(n * n_words, np.uint32)
        out = cuda.device_array(1, np.uint32)
        grid = n_words // 4 // THREADS
        row = []
        for stream in (False, True):
            for run in RUNS:
                kern = make_kernel(run, stream)
                ts = [graph_time_us(lambda j, s: kern[grid, THREADS, s](src, np.int64((j % n) * n_words),
                                                                        np.int64(n_words), out), n * max(1, 64 // n))
                      for _ in range(3)]
                row.append((stream, run, min(ts)))
        base = {s: t for s, r, t in row if r == 512}
        for stream, run, t in row:
            form = "L1::no_allocate" if stream else "ld.global.nc   "
            print(f"{n_words * 4 / 1e6:6.2f} MB  {form}  runs of {run:3d} B "
                  f"({512 // run} a load instruction): {t:7.2f} us  {n_words * 4 / t / 1e6:5.2f} TB/s  "
                  f"x{t / base[stream]:.3f} of contiguous", flush=True)


if __name__ == "__main__":
    main()
