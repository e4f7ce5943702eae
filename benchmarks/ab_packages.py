"""Whole-package A/B of the code-layout gemvs: several copies of ``kbit_numba`` timed in turns, each in its own process.

    python benchmarks/ab_packages.py ROUNDS NAME=DIR [NAME=DIR ...] [--shapes K x N list] [--k list] [--points list]

Each DIR holds a ``kbit_numba`` package (e.g. ``git archive REV kbit_numba | tar -x -C DIR``; ``.`` is the working
tree). A round runs one child process per package, in the order given, and each child times every point (CUDA
graphs, L2-cold rotating weights, the same seed for every package); the best of the rounds is printed per package,
with every round, and the read floor of the first package's first round. Points: ``pair1`` (the pair gemv, M = 1,
float16 block sums), ``mma4`` and ``mma16`` (the tensor-core gemv at M = 4 and 16), each alone and, with ``+pdl``, as a
chain of programmatic dependent launches (default: ``pair1,pair1+pdl,mma4,mma4+pdl,mma16``). Use it for a change
that spans modules (a kernel and ``device.py``), which ``ab_pair_gemv.py``'s one-file swap cannot compare.
"""
import json
import os
import subprocess
import sys

DEFAULT_POINTS = "pair1,pair1+pdl,mma4,mma4+pdl,mma16"


def child(shapes, ks, points):
    import numpy as np
    from numba import cuda

    from kbit_numba import bench, mma_gemv, pair_gemv
    from kbit_numba._timing import graph_time_us, rotation_count

    rng = np.random.default_rng(1)
    rows = []
    for K, N in shapes:
        for k in ks:
            nbytes = N * K // 32 * (4 * k + 1)
            n = rotation_count(nbytes)
            codes = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, k, n, rng)]
            for point in points:
                name, _, pdl = point.partition("+")
                M = int(name[4:] if name.startswith("pair") else name[3:])
                A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
                out = cuda.device_array((M, N), np.float16)
                try:
                    if name.startswith("pair"):
                        runs = [pair_gemv.plan(A, w, out, 0, f16_acc=True, pdl=bool(pdl)).prepare().run for w in codes]
                    else:
                        runs = [mma_gemv.plan(A, w, out, 0, pdl=bool(pdl)).prepare().run for w in codes]
                except ValueError:          # (a shape the kernel does not take, e.g. the tensor-core gemv at K > 8192)
                    continue
                us = graph_time_us(lambda i, s: runs[i % n](s), n * max(1, 64 // n))
                floor = bench.floor_us(nbytes + M * K * 2 + M * N * 2)
                rows.append(dict(shape=f"{K}x{N}", k=k, point=point, us=us, floor=floor))
    print("ROWS " + json.dumps(rows), flush=True)


def main(argv):
    opts = {a.split("=")[0]: a.split("=", 1)[1] for a in argv if a.startswith("--")}
    args = [a for a in argv if not a.startswith("--")]
    rounds, packages = int(args[0]), [a.split("=", 1) for a in args[1:]]
    shapes = opts.get("--shapes", "4096x14336,2048x5120,4096x4096,14336x4096")
    ks, points = opts.get("--k", "4,2"), opts.get("--points", DEFAULT_POINTS)
    results = {name: [] for name, _ in packages}
    for r in range(rounds):
        for name, root in packages:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(root), os.environ.get("PYTHONPATH", "")]))
            code = (f"import sys; sys.path.insert(0, {os.path.abspath(root)!r}); "
                    f"sys.argv = ['x', '--child', {shapes!r}, {ks!r}, {points!r}]; "
                    f"exec(open({os.path.abspath(__file__)!r}).read())")
            run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            line = [x for x in run.stdout.splitlines() if x.startswith("ROWS ")]
            if run.returncode or not line:
                print(f"{name} round {r + 1} failed:\n{run.stderr[-3000:]}", flush=True)
                continue
            results[name].append(json.loads(line[0][5:]))
            print(f"round {r + 1}: {name} done", flush=True)
    names = [name for name, _ in packages]
    first = results[names[0]][0]
    print(f"{'K x N':>11} {'k':>2} {'point':>10} {'floor':>6}  " + "  ".join(f"{n:>20}" for n in names))
    for i, row in enumerate(first):
        cells = []
        for name in names:
            ts = [rnd[i]["us"] for rnd in results[name]]
            assert all(rnd[i]["point"] == row["point"] for rnd in results[name])
            cells.append(f"{min(ts):7.2f} ({' '.join(f'{t:.2f}' for t in ts)})")
        base = min(rnd[i]["us"] for rnd in results[names[0]])
        rel = "  ".join(f"{min(rnd[i]['us'] for rnd in results[n]) / base - 1:+.1%}" for n in names[1:])
        print(f"{row['shape']:>11} {row['k']:>2} {row['point']:>10} {row['floor']:6.2f}  " + "  ".join(cells)
              + f"   vs {names[0]}: {rel}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child([tuple(int(v) for v in s.split("x")) for s in sys.argv[2].split(",")],
              [int(v) for v in sys.argv[3].split(",")], sys.argv[4].split(","))
    else:
        main(sys.argv[1:])
