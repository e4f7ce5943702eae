"""What a decode step's linear layers cost at the read floor, as one launch a layer and as one persistent launch (GPU):

    python benchmarks/step_floor.py [--model llama3-8b] [--k 4,2] [--replays 7] [--projections qkv,o,gate_up,down]
    python benchmarks/step_floor.py --real "pdl f16_acc" [--k 4,2] [--projections ...]    (needs torch)

No kernel here decodes anything: each only reads the bytes of the B = 1 step's linear layers (every layer's QKV, O,
gate/up and down, in the step's order; ``bench_model.projections``, kbit bytes ``formats.kbit_nbytes``) from DRAM with
16-byte loads. The question is what the layer boundaries cost when the reading itself is as cheap as it gets, and
how much of that a persistent kernel could win back: if it is small, fusing the step's layers into one launch cannot
move issue 16's B = 1 numbers and the kernels' own work is what is left (``benchmarks/README.md``, "Fifty-first
session"). Every mode is one CUDA graph of the whole step, timed by replays (``_timing.graph_time_us``):

* ``one read``: all of the step's bytes in one floor launch (one 16-byte load a thread, every load in flight from the
  start): no boundary at all, the bound the others are measured against.
* ``launches``: one such floor launch a layer, in order (``bench.floor_us``'s kernel).
* ``launches pdl``: the same as programmatic dependent launches: a layer's CTAs issue their loads, then
  ``griddepcontrol.wait``, then write (as the package's PDL gemvs wait before reading activations). Only CTAs that
  fit on an SM beside the previous layer's start early.
* ``persistent``: one launch of one 1024-thread CTA an SM that reads layer after layer (each thread 4 loads in flight)
  and meets the whole grid at a barrier after each layer (an arrival counter and a generation word in global memory:
  the last CTA to arrive opens it; the others poll it with acquire loads), as a kernel running the whole step would
  have to between dependent layers.
* ``persistent prefetch``: the same, but each thread issues its first four loads of the next layer before the barrier
  (weights do not depend on the previous layer; only the activations read after the barrier do).
* ``persistent arrive-prefetch``: those loads issued after the CTA has arrived at the barrier, before it waits (so
  that neither the CTA's ``syncthreads`` nor the arrival's release can wait for them).
* ``persistent no barrier``: the same reads with no barrier (not a valid step: how fast this way of reading streams).

``--real SUFFIX`` times, beside ``one read`` and ``launches pdl`` only, the real kernels over the same layers: the
step's linears as ``bench --model`` builds them (variant ``kbit k=K SUFFIX``, B = 1, the gate/up through the SiLU
epilogue where the variant fuses it), one graph of every selected layer's launch on static inputs (as
``DecodeStep.linears_only``), for all projections together and for each projection alone. What a real launch costs
over its floor launch is then seen per projection. Between the two, six ``shaped`` modes (:func:`make_shaped`): a
pure-read chain launched with each real launch's grid, CTA size and residency, then with the pair gemv's table fill,
its activation reads (every slice reads all of A) followed by a barrier, or both: what the gemv's start costs apart
from its decode; both with A read once a CTA (``shaped + table + A once``), what sharing the activations among a
CTA's slices could win at most; and both with no barrier after the activations (``shaped + table + A unsynced``: their
L2 traffic alone, as in the k = 4 PDL build, which has no barrier after its activation reads).
On the H200 the unsynced reads cost what the synced ones do: the activations cost their traffic, not a wait. The
``A once`` bound holds only for a build in which no warp waits for another's copy: the fifty-third session's six
builds that shared A within a CTA all lost (benchmarks/README.md).

The persistent grid must be resident all at once (its barrier waits for every CTA): one CTA an SM, nothing else
running. Prints us a step for each mode and k, and each mode's cost over ``one read`` per layer boundary.
"""
import argparse

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

from kbit_numba import bench, bench_model
from kbit_numba._timing import graph_time_us
from kbit_numba.formats import kbit_nbytes
from kbit_numba.intrinsics import _element_ptr, griddep_launch_dependents, griddep_wait, ld128, ldg128
from kbit_numba.launch import PreparedLaunch

THREADS = 1024          # the persistent CTA: 1024 threads x 4 loads x 16 bytes = 64 KB in flight an SM
FLOOR_THREADS = bench.FLOOR_THREADS
MAGIC = np.uint32(0x9E3779B9)   # a value no XOR of these buffers is expected to hit (keeps the loads alive)
u32 = np.uint32


@cuda.jit(device=True)
def xor4(t):
    return t[0] ^ t[1] ^ t[2] ^ t[3]


def _sync_op(text, with_value):
    """An intrinsic (arr, index[, value]) -> u32 (or nothing) around one PTX memory instruction on arr[index]."""
    ret = text.split(" ")[1].startswith("$0")

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[2:], sig.args[2:])]
        fty = ir.FunctionType(ir.IntType(32) if ret else ir.VoidType(), [ptr.type] + [ir.IntType(32)] * len(vals))
        cons = ",".join((["=r"] if ret else []) + ["l"] + ["r"] * len(vals)) + ",~{memory}"
        return builder.call(ir.InlineAsm(fty, text, cons, side_effect=True), [ptr] + vals)

    result = types.uint32 if ret else types.void
    if with_value:
        @intrinsic
        def op(typingctx, arr, index, value):
            return result(arr, index, value), codegen
    else:
        @intrinsic
        def op(typingctx, arr, index):
            return result(arr, index), codegen
    return op


ld_acquire = _sync_op("ld.acquire.gpu.global.u32 $0, [$1];", False)           # poll: no atomic, past L1
atom_add_acq_rel = _sync_op("atom.acq_rel.gpu.global.add.u32 $0, [$1], $2;", True)   # arrive: the old count
red_add_release = _sync_op("red.release.gpu.global.add.u32 [$0], $1;", True)         # open: earlier writes first


@cuda.jit(device=True)
def grid_arrive(sync, tid):
    """The first half of a barrier every CTA of the grid meets (``grid_wait`` the second; every CTA resident at
    once). sync[0] counts arrivals, sync[1] is the generation: thread 0 reads the generation before it arrives (it
    cannot move on before this CTA arrives); the last CTA to arrive resets the count and opens the barrier by
    advancing the generation (a release, after the reset). Returns the generation to wait past (thread 0's)."""
    cuda.syncthreads()
    gen = u32(0)
    if tid == 0:
        gen = ld_acquire(sync, 1)
        if atom_add_acq_rel(sync, 0, u32(1)) == u32(cuda.gridDim.x - 1):
            sync[0] = u32(0)
            red_add_release(sync, 1, u32(1))
    return gen


@cuda.jit(device=True)
def grid_wait(sync, tid, gen):
    """The second half: thread 0 polls the generation with acquire loads (no atomics), then the CTA meets."""
    if tid == 0:
        while ld_acquire(sync, 1) == gen:
            pass
    cuda.syncthreads()


PREFETCH = (None, "before", "after")


def make_persistent(prefetch=None, barrier=True):
    """The persistent reader: layer L is chunks [starts[L], starts[L] + chunks[L]) of 16 bytes; thread t of T reads
    chunks t, t + T, ... four at a time. ``prefetch``: each thread's first four of the next layer issued "before" the
    barrier (before the CTA's own ``syncthreads`` and arrival) or "after" its arrival (before the wait); ordinary
    loads, which stay where they are written (ptxas sinks read-only ones). ``barrier=False``: no barrier at all
    (layers read back to back: how fast this way of reading streams, boundaries aside)."""
    assert prefetch in PREFETCH

    @cuda.jit(device=True)
    def next_four(src, starts, chunks, L, t, T):
        """The first four chunks of layer L + 1 for thread t (clamped: a short layer reads its last chunk again)."""
        nb, last = starts[L + 1], chunks[L + 1] - 1
        return (ld128(src, 4 * (nb + min(t, last))), ld128(src, 4 * (nb + min(t + T, last))),
                ld128(src, 4 * (nb + min(t + 2 * T, last))), ld128(src, 4 * (nb + min(t + 3 * T, last))))

    @cuda.jit
    def persistent(src, starts, chunks, sync, out):
        tid = cuda.threadIdx.x
        T = cuda.gridDim.x * cuda.blockDim.x
        t = cuda.blockIdx.x * cuda.blockDim.x + tid
        acc = u32(0)
        n_layers = starts.shape[0]
        z = (u32(0), u32(0), u32(0), u32(0))
        p = (z, z, z, z)
        for L in range(n_layers):
            base, n = starts[L], chunks[L]
            i = t
            if prefetch is not None and L > 0:     # this layer's first four, issued before the barrier's end and
                acc ^= xor4(p[0]) ^ xor4(p[1]) ^ xor4(p[2]) ^ xor4(p[3])     # used only after it
                i = t + 4 * T
            while i + 3 * T < n:
                a = ldg128(src, 4 * (base + i))
                b = ldg128(src, 4 * (base + i + T))
                c = ldg128(src, 4 * (base + i + 2 * T))
                d = ldg128(src, 4 * (base + i + 3 * T))
                acc ^= xor4(a) ^ xor4(b) ^ xor4(c) ^ xor4(d)
                i += 4 * T
            while i < n:
                acc ^= xor4(ldg128(src, 4 * (base + i)))
                i += T
            if L + 1 < n_layers:
                if prefetch == "before":
                    p = next_four(src, starts, chunks, L, t, T)
                if barrier:
                    gen = grid_arrive(sync, tid)
                    if prefetch == "after":
                        p = next_four(src, starts, chunks, L, t, T)
                    grid_wait(sync, tid, gen)
        if acc == MAGIC:
            out[0] = acc
    return persistent


@cuda.jit
def floor_pdl(src, first_word, n_words, out):
    """bench's floor kernel as a programmatic dependent launch: loads, then the wait, then the write."""
    griddep_launch_dependents()
    i = cuda.grid(1) * 4
    v = u32(0)
    if i < n_words:
        v = xor4(ld128(src, first_word + i))     # (ordinary loads: ptxas keeps them before the wait)
    griddep_wait()
    if v == MAGIC:
        out[0] = v


TABLE_WORDS = 8192      # the group table's stores (32 KB: what the k = 4 float16-sum build fills, half of each
                        # 256-byte row; the same count stands in for every build)
A_WORDS = 16            # a lane's activations at M = 1: its block's 32 float16 values, four 16-byte loads


def make_shaped(with_table, a_reads, a_barrier):
    """A pure-read kernel launched with a real gemv's grid, CTA size and dynamic shared bytes (``--real``'s
    ``shaped`` modes): thread t of T reads 16-byte chunks t, t + T, ... of the layer's bytes, its first two before
    ``griddepcontrol.wait`` (as the pair gemv's PDL build writes its first two column groups), the rest four at a time
    after it. ``with_table``: before the wait, one codebook word read from global memory and ``TABLE_WORDS`` shared
    stores a CTA that depend on it, then a barrier (the pair gemv's table fill). ``a_reads``: after the wait, "slice":
    lane l of every slice of ``slice_threads`` threads reads block l's activations (``A_WORDS`` words: every slice
    reads all of A, as the pair gemv's lanes do); "cta": thread l of the CTA reads block l's (A once a CTA, what a
    gemv whose slices shared their activations would read); then a barrier (``a_barrier``; without it the reads only
    add their L2 traffic, as in the k = 4 PDL build, whose tables' barrier comes before the wait and whose warps each
    wait for their own activations only). None: no activations. The weights are
    read with ordinary loads (ptxas keeps them where they are written). Nothing is decoded or reduced: what each part
    of the gemv's start costs in a chain."""
    @cuda.jit
    def shaped(src, first_word, n_words, A, n_kb, slice_threads, cb, out):
        smem = cuda.shared.array(0, np.uint32)
        griddep_launch_dependents()
        tid = cuda.threadIdx.x
        T = cuda.gridDim.x * cuda.blockDim.x
        i = (cuda.blockIdx.x * cuda.blockDim.x + tid) * 4
        acc = u32(0)
        if i < n_words:
            acc ^= xor4(ld128(src, first_word + i))
        i += 4 * T
        if i < n_words:
            acc ^= xor4(ld128(src, first_word + i))
        i += 4 * T
        if with_table:
            c = cb[tid % 16]
            w = tid
            while w < TABLE_WORDS:
                smem[w] = u32(w) ^ c
                w += cuda.blockDim.x
            cuda.syncthreads()
        griddep_wait()
        if a_reads is not None:
            kb = tid % slice_threads if a_reads == "slice" else tid
            if kb < n_kb:
                for q in range(A_WORDS // 4):
                    acc ^= xor4(ld128(A, kb * A_WORDS + 4 * q))
            if a_barrier:
                cuda.syncthreads()
        while i + 12 * T < n_words:
            a = ld128(src, first_word + i)
            b = ld128(src, first_word + i + 4 * T)
            c2 = ld128(src, first_word + i + 8 * T)
            d = ld128(src, first_word + i + 12 * T)
            acc ^= xor4(a) ^ xor4(b) ^ xor4(c2) ^ xor4(d)
            i += 16 * T
        while i < n_words:
            acc ^= xor4(ld128(src, first_word + i))
            i += 4 * T
        if with_table:
            acc ^= smem[tid]
        if acc == MAGIC:
            out[0] = acc
    return shaped


# (label, table fill, activation reads, a barrier after them): make_shaped's arguments for each mode
SHAPED = (("shaped", False, None, True), ("shaped + table", True, None, True), ("shaped + A", False, "slice", True),
          ("shaped + table + A", True, "slice", True), ("shaped + table + A once", True, "cta", True),
          ("shaped + table + A unsynced", True, "slice", False))


def layer_bytes(model, k, only=None):
    """Bytes of each linear layer of one B = 1 step of ``model``, in the step's order (16-byte multiples); ``only``:
    the projections to keep (names from ``bench_model.projections``, e.g. ("o",): that projection's launches alone)."""
    cfg = bench_model.MODELS[model]
    one = [kbit_nbytes(N, K, k) for name, N, K in bench_model.projections(cfg) if only is None or name in only]
    return [-(-b // 16) * 16 for _ in range(cfg["layers"]) for b in one]


MODES = ("one read", "launches", "launches pdl", "persistent", "persistent prefetch", "persistent arrive-prefetch",
         "persistent no barrier")


def run(model, k, replays, only=None, keep=MODES, shapes=None):
    """Prints and returns {mode: us a step}. ``shapes``: projection name -> (grid, threads, shared bytes, slice
    threads, K) of its real launch, for the ``shaped`` modes (``--real``)."""
    sizes = layer_bytes(model, k, only)
    chunks = np.array([b // 16 for b in sizes], np.int64)
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]]).astype(np.int64)
    total = int(chunks.sum())
    src = cuda.device_array(4 * total, np.uint32)     # (what it holds does not matter: only that it is read)
    out = cuda.device_array(1, np.uint32)
    sync = cuda.to_device(np.zeros(2, np.uint32))
    d_starts, d_chunks = cuda.to_device(starts), cuda.to_device(chunks)
    floor = bench._floor_kernel()
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT

    def one_read(i, s):
        floor[-(-total // FLOOR_THREADS), FLOOR_THREADS, s](src, np.int64(0), np.int64(4 * total), out)

    def launches(i, s):
        for st, n in zip(starts, chunks):
            floor[-(-int(n) // FLOOR_THREADS), FLOOR_THREADS, s](src, np.int64(4 * st), np.int64(4 * n), out)

    pdl = [PreparedLaunch(floor_pdl, -(-int(n) // FLOOR_THREADS), FLOOR_THREADS,
                          (src, np.int64(4 * st), np.int64(4 * n), out), pdl=True) for st, n in zip(starts, chunks)]

    def launches_pdl(i, s):
        for p in pdl:
            p(s)

    def persistent(prefetch=None, barrier=True):
        kern = make_persistent(prefetch, barrier)

        def launch(i, s):
            kern[sms, THREADS, s](src, d_starts, d_chunks, sync, out)
        return launch

    modes = [("one read", one_read), ("launches", launches), ("launches pdl", launches_pdl),
             ("persistent", persistent()), ("persistent prefetch", persistent("before")),
             ("persistent arrive-prefetch", persistent("after")), ("persistent no barrier", persistent(barrier=False))]
    modes = [(name, fn) for name, fn in modes if name in keep]
    if shapes:
        cfg = bench_model.MODELS[model]
        names = [name for _ in range(cfg["layers"]) for name, _, _ in bench_model.projections(cfg)
                 if only is None or name in only]
        cb = cuda.to_device(np.arange(16, dtype=np.uint32))
        acts = {K: cuda.to_device(np.ones(K // 2, np.uint32)) for _, _, _, _, K in shapes.values()}
        for label, with_table, a_reads, a_barrier in SHAPED:
            kern = make_shaped(with_table, a_reads, a_barrier)
            launches_ = []
            for name, st, n in zip(names, starts, chunks):
                grid, threads, shared, slice_threads, K = shapes[name]
                args = (src, np.int64(4 * st), np.int64(4 * n), acts[K], np.int32(K // 32), np.int32(slice_threads),
                        cb, out)
                launches_.append(PreparedLaunch(kern, grid, threads, args, shared_bytes=shared, pdl=True))

            def chain(i, s, launches_=launches_):
                for p in launches_:
                    p(s)
            modes.append((label, chain))
    res = {name: graph_time_us(fn, 1, replays=replays) for name, fn in modes}
    if shapes:
        print("launch shapes (grid, threads, shared bytes, slice threads, K): "
              + "; ".join(f"{n} {v}" for n, v in shapes.items() if only is None or n in only))
    gib = total * 16 / 2**30
    print(f"\n{model} k = {k}{'' if only is None else ' (' + ','.join(only) + ' only)'}: {len(sizes)} layers, "
          f"{gib:.3f} GiB a step; {sms} SMs")
    print(f"{'mode':<28}{'us a step':>11}{'TB/s':>8}{'us a boundary over one read':>30}")
    for name, _ in modes:
        t = res[name]
        extra = (t - res["one read"]) / (len(sizes) - 1)
        print(f"{name:<28}{t:>11.1f}{total * 16 / t / 1e6:>8.2f}{extra:>30.2f}", flush=True)
    return res


def build_real(model, variant):
    """The step's linears of ``variant`` as ``bench --model`` builds them, B = 1 static inputs (one per K), and
    whether the gate/up rows are interleaved for the SiLU epilogue."""
    import torch
    linears, fused = bench_model.build_step_linears(model, variant)
    static = {K: torch.randn(1, K, device="cuda", dtype=torch.float16) * 0.1
              for _, _, K in bench_model.projections(bench_model.MODELS[model])}
    return linears, static, fused


def launch_shapes(model, linears, static, fused):
    """Projection name -> (grid, threads, shared bytes, slice threads, K) of its real B = 1 launch (a pair gemv),
    the shared bytes raised where needed so that, as with the real kernel's registers, one more CTA does not fit
    on an SM beside the launch's own: the next launch's CTAs start only as these exit."""
    from kbit_numba.core import SHARED_PER_SM, k_warps
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    shapes = {}
    for lin, (name, _, K) in zip(linears[0], bench_model.projections(bench_model.MODELS[model])):
        x = static[K]
        silu = name == "gate_up" and bench_model.epilogue_silu(lin, x, fused)
        steps = lin.runtime.plan(cuda.as_cuda_array(x), silu_pairs=silu).steps
        if len(steps) != 1 or "pair_gemv" not in steps[0].kernel.py_func.__qualname__:
            raise ValueError(f"{name}: the shaped modes model one pair gemv launch, this plan has {steps}")
        st = steps[0]
        grid = st.grid if isinstance(st.grid, int) else int(np.prod(st.grid))
        per_sm = -(-grid // sms)
        shared = max(int(st.shared), SHARED_PER_SM // (per_sm + 1) - 1024 + 256)
        shapes[name] = (grid, int(st.block), shared, k_warps(K) * 32, K)
    return shapes


def real_chains(model, linears, static, fused, variant, selections, replays, floors):
    """Microseconds of one graph of the real linears' launches for each selection (None: every projection), B = 1,
    printed beside ``floors`` (selection -> run()'s result) with each mode's excess a launch over ``launches pdl``."""
    import torch
    cfg = bench_model.MODELS[model]
    names = [name for name, _, _ in bench_model.projections(cfg)]
    cols = ["one read", "launches pdl"] + [label for label, *_ in SHAPED] + ["real"]
    print(f"\n{variant} (gate/up through the SiLU epilogue: {fused}), B = 1, us a step (median of {replays} graph "
          f"replays); below it, us a launch over `launches pdl`")
    print(f"{'projections':<24}{'launches':>9}" + "".join(f"{c:>20}" for c in cols))
    out = {}
    for only in selections:
        chain = [(lin, name, K) for layer in linears for lin, (name, _, K) in zip(layer, bench_model.projections(cfg))
                 if only is None or name in only]

        def fn():
            for lin, name, K in chain:
                bench_model.run_linear(lin, name, static[K], fused)
        with torch.no_grad():
            t = bench_model.graph_us(torch, fn, replays=replays)
        row = dict(floors[only], real=t)
        label = ",".join(only) if only else ",".join(names)
        print(f"{label:<24}{len(chain):>9}" + "".join(f"{row[c]:>20.1f}" for c in cols))
        print(f"{'':<33}" + "".join(f"{(row[c] - row['launches pdl']) / len(chain):>20.2f}" for c in cols), flush=True)
        out[only] = t
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dense = sorted(m for m, cfg in bench_model.MODELS.items() if not bench_model.is_moe(cfg))
    ap.add_argument("--model", default="llama3-8b", choices=dense)
    ap.add_argument("--k", default="4,2")
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--projections", default=None,
                    help="comma-separated projections to keep (e.g. qkv,o; default: all), each layer's in step order")
    ap.add_argument("--real", default=None, metavar="SUFFIX",
                    help='also time the real kernels of variant "kbit k=K SUFFIX" (e.g. "pdl f16_acc"): all the '
                         'selected projections together, then each alone, beside their floor chains (needs torch)')
    a = ap.parse_args(argv)
    only = None if a.projections is None else tuple(a.projections.split(","))
    known = [name for name, _, _ in bench_model.projections(bench_model.MODELS[a.model])]
    if only is not None and not set(only) <= set(known):
        ap.error(f"--projections takes names from {known}, got {a.projections!r}")
    ks = [int(x) for x in a.k.split(",")]
    if a.real is not None:
        bench_model.check_names(a.model, [f"kbit k={k} {a.real}" for k in ks])
    name = cuda.get_current_device().name
    print("device:", name.decode() if isinstance(name, bytes) else name)
    for k in ks:
        if a.real is None:
            run(a.model, k, a.replays, only)
            continue
        variant = f"kbit k={k} {a.real}"
        linears, static, fused = build_real(a.model, variant)
        shapes = launch_shapes(a.model, linears, static, fused)
        selections = [only] + [(p,) for p in (only or known)]
        floors = {sel: run(a.model, k, a.replays, sel, keep=("one read", "launches pdl"), shapes=shapes)
                  for sel in selections}
        real_chains(a.model, linears, static, fused, variant, selections, a.replays, floors)
        del linears


if __name__ == "__main__":
    main()
