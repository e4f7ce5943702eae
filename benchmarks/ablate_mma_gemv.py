"""Where the tensor-core gemv's time goes: the kernel timed with parts of it taken out (an ablation).

    python benchmarks/ablate_mma_gemv.py [K x N list] [M list] [variant list] [k]

Each variant is ``kbit_numba/mma_gemv.py`` with text substitutions (``ABLATIONS``), loaded as its own module
and timed like every row (CUDA graphs, L2-cold rotating weights, k = 4 or the last argument), beside the unchanged kernel, the pair
gemv with float16 block sums (M <= 4), the read floor and cuBLAS fp16 of the same run. An ablated kernel
computes garbage: only its time means something. Two rounds, alternating the variants; the best is printed.

Variants (``+`` combines them, e.g. ``no_lds+no_mma``):
  no_lds     the group-table ``ld.shared`` per weight pair left out (its address is used as the pair)
  no_mma     each ``mma.sync`` replaced by one float add of its operands' xor
  no_reduce  no reduction: no partial tiles, no barriers, no output (a never-taken store keeps the sums alive)
  no_sync    the reduction without its barriers (wrong sums, same work)
  no_fill    no table fill in the prologue
  lane_linear  (k = 4) each 16-byte load instruction of a warp reads 512 contiguous bytes (32 blocks, lane order)
             of the warp's 2 KB of the CTA's strip, instead of 64 bytes of each of 8 columns: the loads a
             fragment-major weight layout would allow (the same bytes per CTA and strip, permuted), with
             the absmax bytes read the same way
  codes_linear, absmax_linear  the same for the code words alone, or the absmax bytes alone
  one_block  (k = 4; not an ablation: a correct kernel) a lane holds one block of each column instead of two: a
             warp takes 128 k of a strip, twice the K-warps a strip (K <= 4096), half the loads in flight a warp
  no_a       the activations (the B fragments) not loaded: each lane makes its words from its addresses, so the
             time without the prologue's M x K activation reads (every CTA reads all of A from the L2)
  cap64      (not an ablation) every build capped at 64 registers a thread (``one_block+cap64``: two CTAs an SM)

Each line also gives the largest difference of the variant's output from the unchanged kernel's (over one launch):
about 0 for the variants that are not ablations, garbage for the others.
"""
import importlib.util
import sys
from pathlib import Path

import numpy as np
from numba import cuda

from kbit_numba import bench, mma_gemv, pair_gemv
from kbit_numba.formats import kbit_nbytes
from kbit_numba._timing import graph_time_us, rotation_count

SOURCE = Path(mma_gemv.__file__).read_text()
SINK = '''    @ir_inlined
    def sink(acc, out):
        """Keep the sums alive without a store that runs (an ablation)."""
        if (acc[0] + acc[1]) + (acc[2] + acc[3]) == np.float32(1.2345e-30):
            out[0] = np.float16(acc[0]) if f16_out else acc[0]

    @ir_inlined
    def fill_tables('''
MMA_CALL = '''                    acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3] = mma(
                        a0, a1, a2, a3, bx[j, b, s, 0], bx[j, b, s, 1],
                        acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3])'''
# end_strip's first line (no_reduce returns before it)
TILE_LINE = "        tile = u32(part + flip + u32(r) * slot + u32(4) * lane)\n"
# load_strip's text that the *_linear variants replace (inside make_load_strip: 16 spaces)
COL = "                col = u32(first + u32(n0 + u32(8 * c)) * n_kb + kb0)"
LANE_CHUNK = ("                lane_i = u32(cuda.threadIdx.x) % u32(WARP)\n"
              "                chunk = u32(first + u32(n0 - (lane_i >> u32(2))) * n_kb + u32(kb0 - (lane_i & u32(3))) * "
              "u32(STRIP))\n")
LIN = "                lin = u32(chunk + u32(2 * WARP * c) + lane_i)"
ABLATIONS = {
    "no_lds": [("lds_u32(smem, table + prmt(", "(table + prmt(")],
    "no_mma": [(MMA_CALL, "                    acc[4 * j] += u32_as_f32(((a0 ^ a1) ^ (a2 ^ a3)) ^ "
                          "(bx[j, b, s, 0] ^ bx[j, b, s, 1]))")],
    "no_reduce": [(TILE_LINE, "        sink(acc, out)\n        return flip\n" + TILE_LINE),
                  ("    @ir_inlined\n    def fill_tables(", SINK)],
    "no_sync": [("            cuda.syncthreads()\n            sum_tiles(", "            sum_tiles(")],
    "lane_linear": [
        (COL, LANE_CHUNK + "                col = u32(chunk + u32(2 * WARP * c) + lane_i)"),
        ("                        blk = min(u32(col + u32(b * BSTRIDE)), last)",
         "                        blk = min(u32(col + u32(b * WARP)), last)")],
    "codes_linear": [
        (COL, COL + "\n" + LANE_CHUNK + LIN),
        ("                            load128(packed, u32(blk * u32(BLOCK_WORDS)))",
         "                            load128(packed, u32(min(u32(lin + u32(b * WARP)), last) * u32(BLOCK_WORDS)))")],
    "absmax_linear": [
        (COL, COL + "\n" + LANE_CHUNK + LIN),
        ("                        am[c, b] = absmax[blk]",
         "                        am[c, b] = absmax[min(u32(lin + u32(b * WARP)), last)]")],
    "one_block": [("KB_WARP = 8 ", "KB_WARP = 4 "), ("KB_LANE = 2\n", "KB_LANE = 1\n")],
    "no_a": [("                    w4 = load_a(A, u32(base + u32(4 * q)))",
              "                    w4 = (u32(base + u32(4 * q)), u32(base ^ u32(q)), u32(base + u32(7)), u32(tok))")],
    "cap64": [("    max_registers: object = None\n", "    max_registers: object = 64\n")],
    "no_fill": [("            fill_tables(smem, cb, tid)\n        table = shared_addr(smem)",
                 "            pass\n        table = shared_addr(smem)")],
}


def variant(name):
    """mma_gemv.py with the named ablations applied, as a module (the unchanged module for "base")."""
    if name == "base":
        return mma_gemv
    src = SOURCE
    for part in name.split("+"):
        for old, new in ABLATIONS[part]:
            if old not in src:
                raise SystemExit(f"ablation {part}: text not found in mma_gemv.py: {old[:60]!r}")
            src = src.replace(old, new)
    src = src.replace("from . import", "from kbit_numba import").replace("from .", "from kbit_numba.")
    path = Path("/tmp") / f"_ablate_mma_gemv_{name.replace('+', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"ablate_{name.replace('+', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # (its dataclass Spec looks its module up there)
    spec.loader.exec_module(module)
    return module


def main():
    shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else
                                                             "4096x14336,2048x5120").split(",")]
    ms = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1,4").split(",")]
    names = ["base"] + (sys.argv[3].split(",") if len(sys.argv) > 3 else
                        ["no_lds", "no_mma", "no_reduce", "no_sync", "no_fill", "no_lds+no_mma+no_reduce+no_fill"])
    modules = {name: variant(name) for name in names}
    rng = np.random.default_rng(1)
    k = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    for K, N in shapes:
        nbytes = kbit_nbytes(N, K, k)
        n = rotation_count(nbytes)
        codes = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, k, n, rng)]
        for M in ms:
            A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
            out = cuda.device_array((M, N), np.float16)
            floor = bench.floor_us(nbytes + M * K * 2 + M * N * 2)
            cub = bench.cublas_row(K, N, M) or float("nan")
            plans = {name: (lambda w, mod=mod: mod.plan(A, w, out, 0)) for name, mod in modules.items()}
            if M <= 4:
                plans["pair,f16"] = lambda w: pair_gemv.plan(A, w, out, 0, f16_acc=True)
            times = {}
            for _ in range(2):
                for name, make in plans.items():
                    runs = [make(w).prepare().run for w in codes]
                    times.setdefault(name, []).append(
                        graph_time_us(lambda i, s: runs[i % n](s), n * max(1, 64 // n)))
            base = min(times["base"])
            outs = {}
            for name, make in plans.items():
                make(codes[0]).prepare().run()
                cuda.synchronize()
                outs[name] = out.copy_to_host().astype(np.float32)
            print(f"{K}x{N} k={k} M={M}: floor {floor:.2f} us, cuBLAS {cub:.2f} us", flush=True)
            for name, ts in times.items():
                t = min(ts)
                print(f"  {name:<34} {t:7.2f} us  {t / base:6.3f} of base  {100 * floor / t:5.1f}% floor   "
                      f"max |out - base| {np.abs(outs[name] - outs['base']).max():9.3g}   "
                      f"({' '.join(f'{x:.2f}' for x in ts)})", flush=True)


if __name__ == "__main__":
    main()
