"""The L2's rate for float32 reductions from a full grid, and how many thread block clusters the GPU runs at once
(GPU): the two numbers the fused gate/up + down design needed (benchmarks/README.md, "Seventy-sixth session": each
CTA's partial of all of down's outputs summed in its cluster, then added into a float32 accumulator; built without the
clusters, measured and reverted in the seventy-eighth session).

    python benchmarks/atomic_rate.py [--ctas 132] [--threads 512] [--outputs 4096] [--shared 120000]

Each mode is one launch of ``ctas`` CTAs of ``threads`` threads, timed in CUDA graphs (``_timing.graph_time_us``, 20
launches a graph), for ``per = outputs / cluster`` floats a CTA with cluster in 1, 2, 4, 8 (what a CTA adds once its
cluster of that many CTAs has summed its members' partials in distributed shared memory):
- ``empty``: the launch alone;
- ``store``: each CTA writes its ``per`` floats to its own row of a float32 workspace (plain stores: the sum left to a
  later kernel);
- ``red``: each CTA adds its ``per`` floats into a float32 accumulator of ``outputs`` values (``red.global.add.f32``),
  CTA c at offset (c % cluster) * per, so every address gets ctas / cluster adds, as in the design;
- ``red4``: the same, four floats an instruction (``red.global.add.v4.f32``, sm_90).
Printed: us a launch, and beside ``red`` / ``red4`` the reductions a microsecond beyond ``empty``. The accumulator is
checked after the timing (every address the same nonzero multiple of ctas / cluster). Then, for a kernel of ``threads``
threads and ``shared`` bytes of dynamic shared memory, the clusters of 2, 4 and 8 CTAs the device runs at once
(``cuOccupancyMaxActiveClusters``) and so the SMs they leave idle. The default 120,000 bytes is more than half an SM's
shared memory, so one CTA fits an SM, as for a kernel with the pair gemv's 64 KB table and ~100 registers a thread at
512 threads (the first run's 70,000 let this probe's small kernel fit three an SM: its idle counts came out
negative, benchmarks/README.md, "Seventy-eighth session").

The two reductions are local inline-PTX intrinsics of this probe; a kernel that keeps one gets it in
``kbit_numba/intrinsics.py`` with a Python twin.
"""
import argparse

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.core.extending import intrinsic

from kbit_numba._timing import graph_time_us
from kbit_numba.core import sm_count
from kbit_numba.intrinsics import _element_ptr
from kbit_numba.launch import PreparedLaunch

LAUNCHES = 20                   # launches a graph


def _red_codegen(n):
    """Codegen of arr[index .. index + n - 1] += n float32 values by one ``red.global.add`` (n = 1, or 4: ``.v4``,
    sm_90, index % 4 == 0); no result comes back."""
    operands = "$1" if n == 1 else "{" + ", ".join(f"${j + 1}" for j in range(n)) + "}"
    text = f"red.global.add{'.v4' if n > 1 else ''}.f32 [$0], {operands};"

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        vals = [context.cast(builder, x, t, types.float32) for x, t in zip(args[2:], sig.args[2:])]
        fty = ir.FunctionType(ir.VoidType(), [ptr.type] + [ir.FloatType()] * n)
        builder.call(ir.InlineAsm(fty, text, "l" + ",f" * n + ",~{memory}", side_effect=True), [ptr] + vals)
        return context.get_dummy_value()

    return codegen


@intrinsic
def red_f32(typingctx, arr, index, v):
    """arr[index] += v, red.global.add.f32."""
    return types.void(arr, index, v), _red_codegen(1)


@intrinsic
def red_v4_f32(typingctx, arr, index, a, b, c, d):
    """arr[index .. index + 3] += (a, b, c, d), red.global.add.v4.f32."""
    return types.void(arr, index, a, b, c, d), _red_codegen(4)


@cuda.jit
def empty_kernel(acc, per, cluster):
    pass


@cuda.jit
def store_kernel(acc, per, cluster):
    row = cuda.blockIdx.x * per
    i = cuda.threadIdx.x
    while i < per:
        acc[row + i] = np.float32(1.0)
        i += cuda.blockDim.x


@cuda.jit
def red_kernel(acc, per, cluster):
    base = (cuda.blockIdx.x % cluster) * per
    i = cuda.threadIdx.x
    while i < per:
        red_f32(acc, base + i, np.float32(1.0))
        i += cuda.blockDim.x


@cuda.jit
def red4_kernel(acc, per, cluster):
    base = (cuda.blockIdx.x % cluster) * per
    i = 4 * cuda.threadIdx.x
    while i < per:
        one = np.float32(1.0)
        red_v4_f32(acc, base + i, one, one, one, one)
        i += 4 * cuda.blockDim.x


MODES = {"empty": empty_kernel, "store": store_kernel, "red": red_kernel, "red4": red4_kernel}


def time_mode(name, ctas, threads, outputs, cluster):
    per = outputs // cluster
    acc = cuda.to_device(np.zeros(ctas * per if name == "store" else outputs, np.float32))
    launch = PreparedLaunch(MODES[name], ctas, threads, (acc, np.int32(per), np.int32(cluster)))
    us = graph_time_us(lambda i, stream: launch(stream), LAUNCHES)
    cuda.synchronize()
    if name in ("red", "red4"):     # each launch (direct or replayed: the host does not count replays) adds ctas /
        got = acc.copy_to_host()    # cluster to every address, so all hold one nonzero multiple of it
        adds = ctas // cluster
        if not (got[0] > 0 and np.all(got == got[0]) and got[0] % adds == 0):
            raise SystemExit(f"{name} cluster={cluster}: the accumulator holds {np.unique(got)[:4]}, not one "
                             f"nonzero multiple of {adds}")
    return us


def active_clusters(threads, shared, cluster):
    """cuOccupancyMaxActiveClusters for red_kernel's build at ``threads`` threads, ``shared`` dynamic bytes."""
    acc = cuda.to_device(np.zeros(4096, np.float32))
    launch = PreparedLaunch(red_kernel, sm_count() * 2 // cluster * cluster, threads, (acc, np.int32(1), np.int32(1)),
                            shared_bytes=shared, cluster=cluster)
    err, n = launch._driver.cuOccupancyMaxActiveClusters(launch._func, launch._config)
    return int(n) if err == launch._driver.CUresult.CUDA_SUCCESS else f"error {err}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctas", type=int, default=None, help="CTAs a launch (default: one an SM)")
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument("--outputs", type=int, default=4096)
    ap.add_argument("--shared", type=int, default=120000, help="dynamic shared bytes for the cluster occupancy "
                    "(more than half an SM's, so that one CTA fits an SM and 'SMs idle' counts SMs)")
    args = ap.parse_args()
    sms = sm_count()
    ctas = args.ctas or sms
    print(f"{cuda.get_current_device().name}: {sms} SMs; {ctas} CTAs of {args.threads} threads, {args.outputs} outputs")
    print(f"{'cluster':>8}{'per CTA':>9}{'empty us':>10}{'store us':>10}{'red us':>9}{'red4 us':>9}"
          f"{'red /us':>10}{'red4 /us':>10}")
    for cluster in (1, 2, 4, 8):
        if ctas % cluster:
            continue
        t = {m: time_mode(m, ctas, args.threads, args.outputs, cluster) for m in MODES}
        n = ctas * (args.outputs // cluster)                     # reductions a launch
        rate = {m: n / max(t[m] - t["empty"], 1e-3) for m in ("red", "red4")}
        print(f"{cluster:>8}{args.outputs // cluster:>9}{t['empty']:>10.2f}{t['store']:>10.2f}{t['red']:>9.2f}"
              f"{t['red4']:>9.2f}{rate['red']:>10.0f}{rate['red4']:>10.0f}")
    for cluster in (2, 4, 8):
        n = active_clusters(args.threads, args.shared, cluster)
        idle = sms - n * cluster if isinstance(n, int) else "?"
        print(f"clusters of {cluster} ({args.threads} threads, {args.shared} shared bytes): {n} at once, "
              f"SMs idle: {idle}")


if __name__ == "__main__":
    main()
