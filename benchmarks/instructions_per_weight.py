"""SASS instructions executed per weight, measured with Nsight Compute, for the kbit GEMVs (GPU machine):

    python benchmarks/instructions_per_weight.py [K x N list] [k list] [M list] [kernel list] [--metrics m1,m2]
    e.g. python benchmarks/instructions_per_weight.py 2048x5120,4096x14336 4 1,4
         python benchmarks/instructions_per_weight.py 4096x14336 4 1 pair_gemv_f16,floor \
             --metrics sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max

Runs itself under ``ncu --metrics smsp__inst_executed.sum`` (one launch of each kernel per point) and
prints warp instructions x 32 / (N K): the instructions a lane issues per weight, loads, decode, FMAs,
reduction and loop control included (issue 15's budget: <= 3 at k = 4, 2 at k = 2). ``floor`` is the bench's
pure-read kernel over the pair gemv's bytes of that point (k-bit codes and absmax), for comparing other metrics;
``--metrics`` adds Nsight metrics, printed raw per launch (e.g. ``sm__cycles_active.min/avg/max``: how evenly
the SMs were kept busy).
"""
import csv
import io
import subprocess
import sys

import numpy as np

KERNELS = ("gemv", "pair_gemv", "pair_gemv_f16", "mma_gemv")   # pair_gemv_f16: f16_acc=True
# also: mma_gemv_f, the tensor-core gemv on the fragment layout (mma_gemv.to_fragments); mma_gemv_silu, the
# tensor-core gemv's SiLU epilogue (silu_pairs=True, code layout: the decode step's gate/up; N = the gate/up width);
# pair_gemv_silu and pair_gemv_silu_rms, the pair gemv's SiLU build as the llama3-8b B = 1 step runs its gate/up
# (float16 sums, PDL, the H200 rules' knobs), without and with the norm's scale (rms_eps)
INST = "smsp__inst_executed.sum"
STEP_SILU_KNOBS = {4: dict(cols=2, cta_warps=8), 2: dict(cols=4, cta_warps=16)}   # (tuning/nvidia_h200.json, M = 1)


def _points(argv):
    shapes = [tuple(int(v) for v in s.split("x")) for s in (argv[0] if argv else "2048x5120,4096x14336").split(",")]
    ks = [int(v) for v in (argv[1] if len(argv) > 1 else "4").split(",")]
    ms = [int(v) for v in (argv[2] if len(argv) > 2 else "1,4").split(",")]
    kernels = argv[3].split(",") if len(argv) > 3 else KERNELS
    return [(K, N, k, M, kern) for K, N in shapes for k in ks for M in ms for kern in kernels
            if M <= 4 or kern in ("mma_gemv", "mma_gemv_f", "mma_gemv_silu", "floor")]


def launch(points):
    """One launch of each (K, N, k, M, kernel), in order (the profiled child)."""
    from numba import cuda

    import kbit_numba as kb
    from kbit_numba import mma_gemv, pair_gemv

    rng = np.random.default_rng(0)
    from kbit_numba import bench

    for K, N, k, M, kern in points:
        if kern == "floor":                     # the pair gemv's bytes: N K k / 8 of codes, N K / 32 of absmax
            n_words = -(-(N * K * k // 8 + N * K // 32) // 16) * 4
            src = cuda.device_array(n_words, np.uint32)
            out = cuda.device_array(1, np.uint32)
            bench._floor_kernel()[-(-n_words // 4 // bench.FLOOR_THREADS), bench.FLOOR_THREADS](
                src, np.int64(0), np.int64(n_words), out)
            cuda.synchronize()
            continue
        qw = kb.quantize((rng.standard_normal((N, K)) * 0.02).astype(np.float16), k=k)
        A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
        if kern == "gemv":
            kb.prepare_gemv(A, qw).run()
        elif kern == "mma_gemv":
            mma_gemv.prepare(A, pair_gemv.to_codes(qw)).run()
        elif kern == "mma_gemv_f":
            mma_gemv.prepare(A, mma_gemv.to_fragments(pair_gemv.to_codes(qw))).run()
        elif kern == "mma_gemv_silu":
            mma_gemv.plan(A, pair_gemv.to_codes(qw), silu_pairs=True).launch()
        elif kern in ("pair_gemv_silu", "pair_gemv_silu_rms"):
            pair_gemv.plan(A, pair_gemv.to_codes(qw), f16_acc=True, pdl=True, silu_pairs=True, **STEP_SILU_KNOBS[k],
                           rms_eps=1e-6 if kern.endswith("_rms") else None).launch()
        else:
            pair_gemv.prepare(A, pair_gemv.to_codes(qw), f16_acc=kern == "pair_gemv_f16").run()
        cuda.synchronize()


def main(argv):
    extra = []
    if "--metrics" in argv:
        i = argv.index("--metrics")
        extra = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2:]
    if argv and argv[0] == "--launch":
        return launch(_points(argv[1:]))
    points = _points(argv)
    cmd = ["ncu", "--clock-control", "none", "--csv", "--metrics", ",".join([INST, *extra]),
           sys.executable, __file__, "--launch", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    # every launch is profiled (Numba's kernel names are mangled): keep the GEMVs and the floor, not quantize,
    # to_codes or to_fragments; the CSV has one row per (launch, metric)
    launches = {}
    for r in csv.DictReader(io.StringIO(proc.stdout[proc.stdout.find('"ID"'):])):
        name = r.get("Kernel Name", "")
        if "to_codes" not in name and "to_fragments" not in name and any(n in name for n in ("gemv_kernel", "pair_gemv", "mma_gemv", "floor_read")):
            launches.setdefault(r["ID"], {})[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
    rows = list(launches.values())
    if len(rows) != len(points):
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit(f"expected {len(points)} profiled kernels, got {len(rows)}")
    print(f"{'kernel':<14} {'K x N':>11} {'k':>2} {'M':>2} {'warp instr':>12} {'instr/weight':>12}"
          + "".join(f" {m:>28}" for m in extra))
    for (K, N, k, M, kern), r in zip(points, rows):
        inst = r[INST]
        print(f"{kern:<14} {f'{K}x{N}':>11} {k:>2} {M:>2} {inst:12.0f} {inst * 32 / (N * K):12.2f}"
              + "".join(f" {r.get(m, float('nan')):28.1f}" for m in extra))


if __name__ == "__main__":
    main(sys.argv[1:])
