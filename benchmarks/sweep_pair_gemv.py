"""Sweep the pair gemv's launch knobs on the GPU at chosen Ms (CUDA-graph timed, L2-cold, the read floor and cuBLAS
fp16 in the same run); the timing is ``kbit_numba.bench.codes_tune_rows``, the one ``bench --tune-codes`` uses:

    python benchmarks/sweep_pair_gemv.py [K x N list, or model names] [k] [M list] [f16|fp32|f16+pdl|fp32+pdl][+silu|+acc] [knob sets]

Knobs: cols (columns per warp per iteration), cta_warps (warps per CTA aimed at) and max_registers (a per-thread
register cap; e.g. ``"cols=4,cta_warps=8,max_registers=80"``). Prints one row per point and
knob set; the default plan is the first of each shape/M, and from M = 2 (not with ``+silu`` / ``+acc``) the
tensor-core gemv's default plan the last, timed in the same turns. ``f16``: block sums in float16 (``f16_acc=True``); ``+pdl``:
timed as a chain of programmatic dependent launches; ``+silu``: the SiLU epilogue's build (give N as the interleaved
gate/up width, e.g. 4096x28672); ``+acc``: the residual-add build (``accumulate``, out += A W^T in place: the
step's o and down). Knob sets (default: ``KNOBS``): e.g.
``"cols=2;cta_warps=20;cols=2,cta_warps=8"``. ``REPS=3`` in the environment times the knob sets in turns three times
and prints the best of each, then every turn (drift shows as a spread). A knob set that gives the same launch as
an earlier one is timed once and listed after the table.
"""
import os
import sys

from kbit_numba import bench

KNOBS = [dict(cols=2), dict(cols=4), dict(cols=8), dict(cta_warps=8), dict(cols=2, cta_warps=8),
         dict(cols=2, cta_warps=32)]


def main(argv):
    shapes = bench._parse_shapes(argv[0] if argv else "2048x5120,5120x2048,2048x512,4096x14336")
    k = int(argv[1]) if len(argv) > 1 else 4
    ms = [int(v) for v in (argv[2] if len(argv) > 2 else "1,4").split(",")]
    variant = argv[3] if len(argv) > 3 else "fp32"
    silu, accumulate = variant.endswith("+silu"), variant.endswith("+acc")
    variant = variant.removesuffix("+silu").removesuffix("+acc")
    knobs = KNOBS if len(argv) < 5 else [{kv.split("=")[0]: int(kv.split("=")[1]) for kv in knob.split(",")}
                                         for knob in argv[4].split(";")]
    reps = int(os.environ.get("REPS", "1"))
    read_bw, copy_bw = bench.measure_ceilings()
    rows = bench.codes_tune_rows(shapes, [k], dict(read_GBps=read_bw, copy_GBps=copy_bw), lambda text: None,
                                 reps=reps, variants=[bench.CODES_TUNE_VARIANT_NAMES[variant]], knob_sets=knobs, ms=ms,
                                 silu=silu, accumulate=accumulate)
    rows = bench.add_floor_and_cublas(rows)
    print(f"read ceiling {read_bw:.0f} GB/s; the best of {reps} turn(s) of each knob set")
    print(bench.format_table([r for r in rows if "same_as" not in r], width=44))
    for r in rows:
        if "same_as" in r:
            print(f"{r['kernel']} {r['shape']} M={r['M']}: the same launch as {r['same_as']}")
        elif reps > 1:
            print(f"{r['kernel']} {r['shape']} M={r['M']} turns: {' '.join(f'{t:.2f}' for t in r['turns_us'])}")


if __name__ == "__main__":
    main(sys.argv[1:])
