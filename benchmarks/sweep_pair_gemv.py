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

With ``+silu`` / ``+acc`` the knobs that build runs today under this GPU's table (its ``"<variant> silu"`` /
``"<variant> acc"`` rule, else the plain rule's: ``dispatch.epilogue_knobs``) are timed too, and after the table a
line per shape and M names the fastest knob set; where it is ``MARGIN`` (3%) faster than today's, the line ends with
the ``benchmarks/step_rules_ab.py prepare`` argument of that rule, for the step's A/B (which decides).
"""
import os
import sys

from kbit_numba import bench, dispatch

MARGIN = 0.03           # a knob set this much faster than the build's knobs today is worth a step A/B

KNOBS = [dict(cols=2), dict(cols=4), dict(cols=8), dict(cta_warps=8), dict(cols=2, cta_warps=8),
         dict(cols=2, cta_warps=32)]


def todays_knobs(table, shape, k, M, f16, pdl, epilogue):
    """The launch knobs (cols, cta_warps) the ``epilogue`` build (``dispatch.SILU`` or ``ACC``) of the pair gemv runs
    at M rows of ``shape`` ("KxN") under ``table``, or None where the table's plain rule runs another kernel."""
    K, N = map(int, shape.split("x"))
    kernel, params = dispatch.choose_rule(M, N, K, "codes", table, backend=False, f16_acc=f16, k=k, pdl=pdl)
    if kernel != "pair_gemv":
        return None
    params = dispatch.with_epilogue_knobs(params, dispatch.epilogue_knobs(table, N, K, M, k, f16, pdl, epilogue))
    return {key: v for key, v in params.items() if key in dispatch.EPILOGUE_KNOBS}


def suggestions(rows, table, epilogue, margin=MARGIN):
    """One line per (shape, k, M, variant) of ``codes_tune_rows`` rows of an epilogue build: today's knobs
    (``todays_knobs``) and their time, the fastest knob set and its time, and where that is ``margin`` faster the
    ``step_rules_ab.py prepare`` argument of the rule that would run it."""
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["k"], r["M"], r["f16_acc"], r["pdl"]), []).append(r)
    lines = []
    for (shape, k, M, f16, pdl), rs in groups.items():
        variant = dispatch.codes_variant(k, f16, pdl) + epilogue
        today = todays_knobs(table, shape, k, M, f16, pdl, epilogue)
        if today is None:
            lines.append(f"{shape} {variant!r} M = {M}: the table runs another kernel there (no epilogue rule)")
            continue
        now = next((r for r in rs if r.get("params", {}) == today), None)
        best = min(rs, key=lambda r: r["us"])
        head = f"{shape} {variant!r} M = {M}: fastest {best.get('params') or 'default'} {best['us']:.2f} us"
        if now is None:
            lines.append(f"{head}; today's knobs {today or 'default'} were not timed")
            continue
        head += f", today's {today or 'default'} {now['us']:.2f} us ({100 * (best['us'] / now['us'] - 1):+.1f}%)"
        if best["us"] < (1 - margin) * now["us"]:
            knobs = ",".join(f"{a}={b}" for a, b in best.get("params", {}).items())
            head += f": step A/B with prepare NAME=\"{shape}/{variant}/{M}/{knobs}\""
        lines.append(head)
    return lines


def main(argv):
    shapes = bench._parse_shapes(argv[0] if argv else "2048x5120,5120x2048,2048x512,4096x14336")
    k = int(argv[1]) if len(argv) > 1 else 4
    ms = [int(v) for v in (argv[2] if len(argv) > 2 else "1,4").split(",")]
    variant = argv[3] if len(argv) > 3 else "fp32"
    silu, accumulate = variant.endswith("+silu"), variant.endswith("+acc")
    variant = variant.removesuffix("+silu").removesuffix("+acc")
    knobs = list(KNOBS) if len(argv) < 5 else [{kv.split("=")[0]: int(kv.split("=")[1]) for kv in knob.split(",")}
                                               for knob in argv[4].split(";")]
    reps = int(os.environ.get("REPS", "1"))
    f16, pdl = bench.CODES_TUNE_VARIANT_NAMES[variant]
    epilogue = dispatch.SILU if silu else dispatch.ACC if accumulate else None
    table = dispatch.load_table()
    if epilogue:            # (today's knobs of that build among the sets, so that the suggestion has its time)
        for (K, N) in shapes:
            for M in ms:
                today = todays_knobs(table, f"{K}x{N}", k, M, f16, pdl, epilogue)
                if today and today not in knobs:     # (no knobs: the default plan, always timed)
                    knobs.append(today)
    read_bw, copy_bw = bench.measure_ceilings()
    rows = bench.codes_tune_rows(shapes, [k], dict(read_GBps=read_bw, copy_GBps=copy_bw), lambda text: None,
                                 reps=reps, variants=[(f16, pdl)], knob_sets=knobs, ms=ms,
                                 silu=silu, accumulate=accumulate)
    rows = bench.add_floor_and_cublas(rows)
    print(f"read ceiling {read_bw:.0f} GB/s; the best of {reps} turn(s) of each knob set")
    print(bench.format_table([r for r in rows if "same_as" not in r], width=44))
    for r in rows:
        if "same_as" in r:
            print(f"{r['kernel']} {r['shape']} M={r['M']}: the same launch as {r['same_as']}")
        elif reps > 1:
            print(f"{r['kernel']} {r['shape']} M={r['M']} turns: {' '.join(f'{t:.2f}' for t in r['turns_us'])}")
    if epilogue:
        print("\n".join(suggestions(rows, table, epilogue)))


if __name__ == "__main__":
    main(sys.argv[1:])
