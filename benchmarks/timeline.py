"""When each warp of a gemv launch starts, finishes its prologue, ends each column group, and exits (GPU machine).

    python benchmarks/timeline.py [K x N list] [kernel list]
    e.g. python benchmarks/timeline.py 4096x14336,2048x5120 pair4,pair2,pair4+pdl,mma4m4+frag,pair4@early
    python benchmarks/timeline.py --gap [MB list]       # what sets the time between two launches of a graph

A kernel's time is its bytes at the read floor plus what the launch spends beyond them (benchmarks/README.md,
"What a launch spends beyond its bytes": ~2 us a launch for the pair gemv). This script shows *where* in the launch
that time goes. It loads ``pair_gemv.py`` / ``mma_gemv.py`` with text insertions (as ``ablate_mma_gemv.py`` does)
so that lane 0 of every warp writes ``%globaltimer_lo`` and ``%clock`` at four kinds of points:

    entry      after the index set-up, before the first weight loads
    prologue   after the barrier that ends the prologue (tables filled, activations loaded; in a k = 4 PDL build,
               whose barrier comes before griddepcontrol.wait: once the wait is over and the activations' loads
               are issued)
    group j    after the warp's j-th column group (strip) has been reduced (the first GROUPS of them)
    exit       when the warp leaves the persistent loop

into the kernels' ``offsets`` argument (an int32 array a non-grouped launch does not read), one record of ``REC``
words a warp. The same is done to the floor kernel (a CTA's thread 0, at entry and exit). Launches run as every
row does (CUDA graphs, L2-cold rotating weights, one stamp buffer per weight copy); the last replay's stamps are
read back. Each launch's times are relative to its first warp's entry. The instrumented kernel's time is printed
beside the unchanged one's, so that what the stamps cost is visible.

Kernels: ``pairK`` (the pair gemv, k = K, M = 1, float16 block sums, KbitLinear's M = 1 kernel; ``+f32``: float32
sums), ``mmaKmM`` (the tensor-core gemv, k = K, M rows, fragment layout when ``+frag``), ``+pdl`` (as a PDL chain:
launches overlap); ``@v1+v2``: the kernel with the text substitutions of ``VARIANTS`` v1 and v2, timed beside the
unchanged one (``early``, ``a_first``, ``a_coherent``, ``w_last``, ``cb_first``, ``no_cb``; see VARIANTS).
``TIMELINE_STAMPS=0``: only the unchanged and the variant kernels' times (an A/B of the variants, no timeline).
Writes the raw stamps to ``$OUT/timeline_<variant>_<K>x<N>.npz`` when ``$OUT`` is set.
"""
import importlib.util
import os
import re
import sys
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.core.extending import intrinsic

from kbit_numba import bench, mma_gemv, pair_gemv
from kbit_numba.formats import kbit_nbytes
from kbit_numba._timing import graph_time_us, rotation_count
from kbit_numba.intrinsics import ldg128

# a warp's record, REC int32 words: smid, groups seen, entry timer and clock, prologue timer and clock, the timer at the
# end of each of the first GROUPS groups, exit timer and clock
REC = 32
GROUPS = 24
STAMPS = os.environ.get("TIMELINE_STAMPS", "1") != "0"     # 0: time the variants only (no stamped build, no timeline)
ENTRY, PROLOGUE, GROUP0, EXIT = 2, 4, 6, 6 + GROUPS


def _special(reg):
    @intrinsic
    def read(typingctx):
        def codegen(context, builder, signature, args):    # volatile: neither CSE'd nor moved by LLVM
            fty = ir.FunctionType(ir.IntType(32), [])
            return builder.call(ir.InlineAsm(fty, f"mov.u32 $0, %{reg};", "=r", side_effect=True), [])
        return types.uint32(), codegen
    return read


gtimer, clock, smid = _special("globaltimer_lo"), _special("clock"), _special("smid")


@cuda.jit(device=True, inline="always")
def stamp(buf, rec, slot, lane):
    """The global timer and the SM's clock into words slot, slot + 1 of the warp's record."""
    if lane == 0:
        buf[np.uint32(rec + np.uint32(slot))] = np.int32(gtimer())
        buf[np.uint32(rec + np.uint32(slot + 1))] = np.int32(clock())


@cuda.jit(device=True, inline="always")
def stamp_entry(buf, rec, lane):
    if lane == 0:
        buf[rec] = np.int32(smid())
        buf[rec + 1] = 0
    stamp(buf, rec, ENTRY, lane)


@cuda.jit(device=True, inline="always")
def stamp_group(buf, rec, j, lane):
    """The global timer alone (fewer registers held in the loop) at the end of the warp's j-th group."""
    if lane == 0:
        if j < np.uint32(GROUPS):
            buf[np.uint32(rec + np.uint32(GROUP0) + j)] = np.int32(gtimer())
        buf[np.uint32(rec + np.uint32(1))] = np.int32(j + np.uint32(1))
    return np.uint32(j + np.uint32(1))


REC_EXPR = "u32(u32(u32(cuda.blockIdx.x) * u32(cuda.blockDim.x // 32) + warp) * u32(32))"
ENTRY_TEXT = f"        trec = {REC_EXPR}\n        stamp_entry(offsets, trec, lane)\n        tgi = u32(0)\n"
PROLOGUE_ANCHOR = ("        if not EARLY_BARRIER:       # (the activation loads above overlap the barrier)\n"
                   "            cuda.syncthreads()\n")
# (anchor, text, "before" | "after"): every occurrence of the anchor gets the text
INSERTS = {
    "pair_gemv": [
        ("        last4 = u32(u32(u32(N) * nkb - u32(1)) * u32(4))     # 4 x the index of the weight's last block\n",
         ENTRY_TEXT, "after"),
        (PROLOGUE_ANCHOR, "        stamp(offsets, trec, PROLOGUE, lane)\n", "after"),
        ("            g = u32(g + grid)\n", "            tgi = stamp_group(offsets, trec, tgi, lane)\n", "before"),
        ("    return jit_kernel(pair_gemv", "        stamp(offsets, trec, EXIT, lane)\n\n", "before")],
    "mma_gemv": [
        ("        last = u32(first + u32(N) * nkb - u32(KB_LANE if BSTRIDE == 1 else 1))"
         "   # the last block (pair) a lane loads\n", ENTRY_TEXT, "after"),
        (PROLOGUE_ANCHOR, "        stamp(offsets, trec, PROLOGUE, lane)\n", "after"),
        ("            grp = u32(grp + grid)\n", "            tgi = stamp_group(offsets, trec, tgi, lane)\n", "before"),
        ("    return jit_kernel(mma_gemv", "        stamp(offsets, trec, EXIT, lane)\n\n", "before")],
}


def _load_columns_copy(src):
    """pair_gemv's load_columns as ``load_first`` with coherent loads (still L1::no_allocate)."""
    start = src.index("    @inlined\n    def load_columns(")
    end = src.index("    @inlined\n", start + 10)
    body = src[start:end].replace("def load_columns(", "def load_first(")
    return body.replace("ldg128_stream(", "ld128_stream(").replace("ldg64_stream(", "ld64_stream(")


FIRST_LOADS = ("        load_columns(packed, absmax, u32(g * group_cols + col0), kb_at, last4, nkb, codes_a, "
               "absmax_a)\n"
               "        load_columns(packed, absmax, u32((g + grid) * group_cols + col0), kb_at, last4, nkb, codes_b, "
               "absmax_b)\n")


def _a_first(src):
    """pair_gemv with its activation loads (section 3) moved before the first weight loads (section 1)."""
    a0 = src.index("        # ---- 3. this lane's 32 x M activations")
    a1 = src.index("        lane_off = u32((lane % COPIES) * ENTRY)\n")
    w0 = src.index("        # ---- 1. the first columns' weight loads")
    if "stage_codebook(smem, cb, tid)\n" + src[w0:w0 + 10] in src:     # (cb_first: its copy stays first)
        w0 = src.index("        stage_codebook(smem, cb, tid)\n")
    return src[:w0] + src[a0:a1] + src[w0:a0] + src[a1:]


def _w_last(src):
    """pair_gemv with its first two groups' weight loads (section 1) moved after the prologue's last barrier, so that
    the prologue's reads (codebook, activations) do not queue behind them."""
    w0 = src.index("        # ---- 1. the first columns' weight loads")
    w1 = src.index("        # ---- 2. the group table")
    block = src[w0:w1]
    src = src[:w0] + src[w1:]
    at = src.index(PROLOGUE_ANCHOR) + len(PROLOGUE_ANCHOR)
    return src[:at] + block + src[at:]


FILL = '    fill_table, ENTRY, COPIES = make_table_fill(k, "float16" if f16_acc else "float32")'
SECTION_1 = "        # ---- 1. the first columns' weight loads go out before anything else"
# Variants: (family, anchor, replacement) substitutions; a callable replacement gets the source (anchor "": the whole
# source)
VARIANTS = {
    # the activations' loads first (plain builds: no griddep_wait to stay below)
    "a_first": [("pair_gemv", "", _a_first)],
    # the activations by coherent loads in every build (ptxas keeps them where the source puts them; read-only ones it
    # sinks below the table fill's barrier)
    "a_coherent": [("pair_gemv", "    load_a = ld128 if PDL else ldg128", "    load_a = ld128")],
    # the first weights only after the prologue (with a_first: the prologue's reads all go out at once, first)
    "w_last": [("pair_gemv", "", _w_last)],
    # the codebook copied to shared memory by cp.async before any other load; the fill waits for the copy
    "cb_first": [("pair_gemv", FILL, FILL[:-1] + ", staged=True)"),
                 ("pair_gemv", SECTION_1, "        stage_codebook(smem, cb, tid)\n" + SECTION_1)],
    # the first two groups' weight loads before the table fill (coherent loads: ptxas keeps them there; it sinks the
    # read-only ones below the fill's barriers and griddep_wait)
    "early": [("pair_gemv", "    @inlined\n    def decode_columns(", lambda src: _load_columns_copy(src)
               + "    @inlined\n    def decode_columns("),
              ("pair_gemv", FIRST_LOADS, FIRST_LOADS.replace("load_columns(", "load_first("))],
    # an ablation: the codebook not read from global memory (the table then holds garbage)
    "no_cb": [("device", "            smem[u32(CODEBOOK) + tid] = cb[tid]",
               "            smem[u32(CODEBOOK) + tid] = np.float32(tid) * np.float32(0.01)")],
}


def _module(path_name, src, label):
    src = src.replace("from . import", "from kbit_numba import").replace("from .", "from kbit_numba.")
    path = Path("/tmp") / f"_timeline_{path_name}_{label}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"timeline_{path_name}_{label}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod          # (its dataclass Spec looks its module up there)
    spec.loader.exec_module(mod)
    return mod


def _substitute(src, anchor, text, name):
    if anchor == "":
        return text(src)
    if anchor not in src:
        raise SystemExit(f"timeline: text not found in {name}.py: {anchor[:70]!r}")
    return src.replace(anchor, text(src) if callable(text) else text)


def instrumented(module, variants=(), stamps=True):
    """The family's module with the named variants' substitutions and (``stamps``) the stamps inserted, loaded as its
    own module (every anchor must be found)."""
    from kbit_numba import device, intrinsics
    name = module.__name__.rsplit(".", 1)[1]
    label = "_".join(variants) + ("_stamped" if stamps else "_plain")
    src = Path(module.__file__).read_text()
    dev_src = dev_orig = Path(device.__file__).read_text()
    for v in variants:
        if not any(fam in (name, "device") for fam, _, _ in VARIANTS[v]):
            raise SystemExit(f"timeline: variant {v} changes nothing in {name}.py")
        for fam, anchor, text in VARIANTS[v]:
            if fam == name:
                src = _substitute(src, anchor, text, name)
            elif fam == "device":
                dev_src = _substitute(dev_src, anchor, text, "device")
    for anchor, text, where in (INSERTS[name] if stamps else []):
        src = _substitute(src, anchor, text + anchor if where == "before" else anchor + text, name)
    mod = _module(name, src, label)
    if dev_src != dev_orig:     # the kernels' table fill from the changed device.py
        mod.make_table_fill = _module("device", dev_src, label).make_table_fill
    mod.stamp, mod.stamp_entry, mod.stamp_group = stamp, stamp_entry, stamp_group    # (read when the kernel compiles)
    mod.PROLOGUE, mod.EXIT = PROLOGUE, EXIT
    mod.stage_codebook = device.stage_codebook
    mod.ld128_stream = intrinsics.make_ldg(4, intrinsics.STREAM_HINT, nc=False)
    mod.ld64_stream = intrinsics.make_ldg(2, intrinsics.STREAM_HINT, nc=False)
    return mod


@cuda.jit(device=True, inline="always")
def stamp_cta(buf, t0, c0):
    """Once the CTA's threads are done (a barrier), thread 0 writes its SM, the entry timer and clock (t0, c0) and the
    exit ones into the CTA's record of 8 words."""
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        r = cuda.blockIdx.x * 8
        buf[r] = np.int32(smid())
        buf[r + 2] = np.int32(t0)
        buf[r + 3] = np.int32(c0)
        buf[r + 4] = np.int32(gtimer())
        buf[r + 5] = np.int32(clock())


@cuda.jit
def floor_read(src, first_word, n_words, out, buf):
    """bench's floor kernel, with thread 0 of each CTA stamping its entry and exit."""
    t0 = gtimer()
    c0 = clock()
    i = cuda.grid(1) * 4
    if i < n_words:
        a, b, c, d = ldg128(src, first_word + i)
        if (a ^ b ^ c ^ d) == np.uint32(0x9E3779B9):
            out[0] = a
    stamp_cta(buf, t0, c0)


def rel(v, t0):
    return ((v.astype(np.int64) - t0) + 2**31) % 2**32 - 2**31     # 32-bit timer differences (wraps every 4.3 s)


def pct(x, qs=(0, 50, 90, 100)):
    x = np.asarray(x, dtype=np.float64)
    return " ".join(f"{np.percentile(x, q) / 1e3:6.2f}" for q in qs) if x.size else "-"


def steady_rate(r, t0, weight_bytes):
    """(TB/s, t1, t2): the weight bytes whose groups the warps finished between t1 (p90 of the first group's end) and
    t2 (p10 of the last group's end), per second. A warp's group is weight_bytes / (all warps' groups) bytes (every
    warp of a launch takes an equal share of each of its CTA's groups)."""
    n = r[:, 1]
    if n.sum() == 0 or (n > GROUPS).any():
        return float("nan"), 0, 0
    ends = [rel(w[GROUP0:GROUP0 + c], t0) for w, c in zip(r, n) if c > 0]
    t1 = np.percentile([e[0] for e in ends], 90)
    t2 = np.percentile([e[-1] for e in ends], 10)
    if t2 <= t1:
        return float("nan"), t1, t2
    done = sum(int(((e > t1) & (e <= t2)).sum()) for e in ends)
    return done * weight_bytes / n.sum() / ((t2 - t1) * 1e-9) / 1e12, t1, t2


def report(label, bufs, warps_per_cta, weight_bytes=None):
    """Per launch (ordered by start): the warps' times relative to the launch's first entry, in us (min p50 p90
    max), and the gap to the next launch; then the medians over launches; with ``weight_bytes``, the steady-state
    rate (:func:`steady_rate`) of each launch."""
    recs = [b.reshape(-1, REC) for b in bufs]
    starts = [rel(r[:, ENTRY], 0).min() for r in recs]
    order = np.argsort([s - starts[0] for s in starts])
    lines = []
    spans, gaps = [], []
    for pos, i in enumerate(order):
        r = recs[i]
        t0 = r[:, ENTRY].astype(np.int64).min()
        e = rel(r[:, ENTRY], t0)
        p = rel(r[:, PROLOGUE], t0)
        x = rel(r[:, EXIT], t0)
        n = r[:, 1]
        g0 = rel(r[n > 0, GROUP0], t0)
        last = rel(np.array([w[GROUP0 + min(c, GROUPS) - 1] for w, c in zip(r, n) if c > 0]), t0)
        steady = []
        for w, c in zip(r, n):
            c = min(c, GROUPS)
            if c >= 3:      # the second group's end onwards (the first carries the prologue)
                ts = rel(w[GROUP0 + 1: GROUP0 + c], t0)
                steady.extend(np.diff(ts))
        cyc = (rel(r[:, EXIT + 1], 0) - rel(r[:, ENTRY + 1], 0)).astype(np.float64)
        ns = (x - e).astype(np.float64)
        ghz = np.median(cyc[ns > 2000] / ns[ns > 2000]) if (ns > 2000).any() else float("nan")
        span = x.max()
        spans.append(span)
        if pos + 1 < len(order):
            nxt = rel(np.array([recs[order[pos + 1]][:, ENTRY].astype(np.int64).min()]), t0)[0]
            gaps.append(nxt - span)
        lines.append((span, e, p, g0, np.array(steady), last, x, n, ghz,
                      steady_rate(r, t0, weight_bytes) if weight_bytes else None))
    span, e, p, g0, steady, last, x, n, ghz, rate = lines[len(lines) // 2]     # the median-span launch
    print(f"  {label}: {len(recs[0])} warps ({warps_per_cta} a CTA); launch spans (first entry -> last exit) "
          f"{' '.join(f'{s / 1e3:.2f}' for s in sorted(spans))} us; gaps to the next launch's first entry "
          f"{' '.join(f'{g / 1e3:.2f}' for g in gaps)} us; SM clock ~{ghz:.2f} GHz")
    print("    the median launch, us (min p50 p90 max over warps):")
    print(f"      entry                {pct(e)}")
    print(f"      prologue done        {pct(p)}   (own time: {pct(p - e)})")
    print(f"      first group done     {pct(g0)}")
    print(f"      a later group (dt)   {pct(steady)}   ({steady.size} intervals)")
    print(f"      last group done      {pct(last)}")
    print(f"      exit                 {pct(x)}")
    counts = np.bincount(n)
    print("      groups a warp: " + ", ".join(f"{c} x{v}" for v, c in enumerate(counts) if c))
    if weight_bytes and not np.isfinite(rate[0]):
        print("      steady state: - (no group ends between the first and the last)")
    elif weight_bytes:
        print(f"      steady state: {rate[0]:.2f} TB/s of weights between {rate[1] / 1e3:.2f} and "
              f"{rate[2] / 1e3:.2f} us "
              f"(every launch: {' '.join(f'{line[-1][0]:.2f}' for line in lines)} TB/s)")


def floor_report(bufs):
    spans, firsts, lastin = [], [], []
    for b in bufs:
        r = b.reshape(-1, 8)
        t0 = r[:, 2].astype(np.int64).min()
        e, x = rel(r[:, 2], t0), rel(r[:, 4], t0)
        spans.append(x.max())
        firsts.append(x.min())
        lastin.append(e.max())
    m = np.argsort(spans)[len(spans) // 2]
    print(f"  floor kernel: spans {' '.join(f'{s / 1e3:.2f}' for s in sorted(spans))} us; the median launch: "
          f"first CTA exit {firsts[m] / 1e3:.2f} us, last CTA entry {lastin[m] / 1e3:.2f} us")


def gemv_timeline(K, N, name, rng, out_dir):
    m = re.fullmatch(r"(pair|mma)(\d)(?:m(\d+))?((?:\+\w+)*)(?:@([\w+]+))?", name)
    fam, k, M, tags = m.group(1), int(m.group(2)), int(m.group(3) or 1), m.group(4).split("+")[1:]
    variants = m.group(5).split("+") if m.group(5) else []
    pdl, frag, f16 = "pdl" in tags, "frag" in tags, "f32" not in tags
    if pdl and ("a_first" in variants or "w_last" in variants):   # (a_first: A read before griddep_wait, a race)
        raise SystemExit("timeline: a_first and w_last are for builds without PDL")
    base = pair_gemv if fam == "pair" else mma_gemv
    plain_mod = instrumented(base, variants, stamps=False)
    stamped_mod = instrumented(base, variants) if STAMPS else None
    nbytes = kbit_nbytes(N, K, k)
    n = rotation_count(nbytes)
    ws = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, k, n, rng)]
    if frag:
        ws = [mma_gemv.to_fragments(w) for w in ws]
    A = cuda.to_device(rng.standard_normal((M, K)).astype(np.float16))
    out = cuda.device_array((M, N), np.float16)
    bufs = [cuda.to_device(np.zeros(1 << 18, np.int32)) for _ in range(n)]

    def make(module, w, buf=None):
        plan = module.plan(A, w, out, 0, f16_acc=f16, pdl=pdl) if fam == "pair" else module.plan(A, w, out, 0, pdl=pdl)
        if buf is not None:
            step = plan.steps[0]
            plan.steps[0] = step._replace(args=step.args[:-1] + (buf,))
            assert (step.grid if isinstance(step.grid, int) else step.grid[0]) * step.block // 32 * REC <= buf.size
        return plan

    runs = {"unchanged": [make(base, w).prepare().run for w in ws]}
    if variants:
        runs["variant"] = [make(plain_mod, w).prepare().run for w in ws]
    if STAMPS:
        runs["stamped"] = [make(stamped_mod, w, b).prepare().run for w, b in zip(ws, bufs)]
    outs = {}
    for label, rs in runs.items():
        rs[0]()
        cuda.synchronize()
        outs[label] = out.copy_to_host().astype(np.float32)
    times = {label: [] for label in runs}
    for _ in range(2):
        for label, rs in runs.items():
            times[label].append(graph_time_us(lambda i, s, rs=rs: rs[i % n](s), n * max(1, 64 // n)))
    if not STAMPS:
        worst = max(float(np.abs(o - outs["unchanged"]).max()) for o in outs.values())
        print(f"{name} {K}x{N} k={k} M={M}: us per launch in the graph "
              + ", ".join(f"{label} {min(t):.2f} ({' '.join(f'{x:.2f}' for x in t)})" for label, t in times.items())
              + (f"; variant / unchanged {min(times['variant']) / min(times['unchanged']):.3f}" if variants else "")
              + f"; max |out - unchanged's| {worst:.3g}", flush=True)
        return None
    step = make(stamped_mod, ws[0], bufs[0]).steps[0]
    host = [b.copy_to_host() for b in bufs]
    grid = step.grid if isinstance(step.grid, int) else step.grid[0]
    used = [h[: grid * step.block // 32 * REC] for h in host]
    floor = bench.floor_us(nbytes + M * K * 2 + M * N * 2)
    diff = {label: float(np.abs(o - outs["unchanged"]).max()) for label, o in outs.items()}
    print(f"{name} {K}x{N} k={k} M={M}: grid {step.grid} x {step.block} threads; us per launch in the graph "
          + ", ".join(f"{label} {min(t):.2f} ({' '.join(f'{x:.2f}' for x in t)}; max |out - unchanged's| "
                      f"{diff[label]:.3g})" for label, t in times.items())
          + f"; read floor {floor:.2f} us", flush=True)
    report(name, used, step.block // 32, nbytes)
    if out_dir:
        np.savez(os.path.join(out_dir, f"timeline_{re.sub('[^a-z0-9]', '_', name)}_{K}x{N}.npz"), *used)
    return nbytes + M * K * 2 + M * N * 2


def floor_timeline(nbytes):
    """The floor kernel's own timeline over the same bytes."""
    n_words = -(-nbytes // 16) * 4
    nf = rotation_count(n_words * 4)
    src = cuda.device_array(nf * n_words, np.uint32)
    o = cuda.device_array(1, np.uint32)
    fgrid = -(-n_words // 4 // 512)
    fbufs = [cuda.to_device(np.zeros(fgrid * 8, np.int32)) for _ in range(nf)]
    graph_time_us(lambda i, s: floor_read[fgrid, 512, s](src, np.int64((i % nf) * n_words), np.int64(n_words),
                                                         o, fbufs[i % nf]), nf * max(1, 64 // nf))
    floor_report([b.copy_to_host() for b in fbufs])


@cuda.jit
def persistent_read(src, first_word, n_words, out, buf, store):
    """A persistent read: 132 x 512 threads walk the bytes 16 at a time (four loads in flight a thread), stamping as
    floor_read; ``store``: every thread writes one word at the end (as a gemv writes its outputs); the launch may
    give it dynamic shared memory (one word of it is written, so that it is used)."""
    sm = cuda.shared.array(0, np.uint32)
    t0 = gtimer()
    c0 = clock()
    stride = cuda.gridsize(1) * 4
    i = cuda.grid(1) * 4
    acc = np.uint32(0)
    while i + 3 * stride < n_words:
        a0, b0, c0_, d0 = ldg128(src, first_word + i)
        a1, b1, c1, d1 = ldg128(src, first_word + i + stride)
        a2, b2, c2, d2 = ldg128(src, first_word + i + 2 * stride)
        a3, b3, c3, d3 = ldg128(src, first_word + i + 3 * stride)
        acc ^= (a0 ^ b0 ^ c0_ ^ d0) ^ (a1 ^ b1 ^ c1 ^ d1) ^ (a2 ^ b2 ^ c2 ^ d2) ^ (a3 ^ b3 ^ c3 ^ d3)
        i += 4 * stride
    while i < n_words:
        a, b, c, d = ldg128(src, first_word + i)
        acc ^= a ^ b ^ c ^ d
        i += stride
    if store:
        out[cuda.grid(1)] = acc
    elif acc == np.uint32(0x9E3779B9):
        out[0] = acc
    if len(sm) > 0 and cuda.threadIdx.x == 0:
        sm[0] = acc
    stamp_cta(buf, t0, c0)


def gap_probe(nbytes, sms):
    """What sets the time between one launch's last CTA exit and the next launch's first CTA entry in a graph: the floor
    kernel, a persistent read (one CTA an SM), with 70 KB of dynamic shared memory, with a store a thread, both."""
    from kbit_numba.launch import PreparedLaunch
    n_words = -(-nbytes // 16) * 4
    nf = rotation_count(n_words * 4)
    src = cuda.device_array(nf * n_words, np.uint32)
    out = cuda.device_array(sms * 512, np.uint32)
    print(f"gap probe, {nbytes / 1e6:.2f} MB a launch: us per launch in the graph; span (first CTA entry -> last "
          f"exit) and gap to the next launch's first entry, medians over the launches", flush=True)
    for label, shared, store in (("persistent", 0, 0), ("persistent + 70 KB shared", 70 * 1024, 0),
                                 ("persistent + a store a thread", 0, 1), ("persistent + both", 70 * 1024, 1)):
        bufs = [cuda.to_device(np.zeros(sms * 8, np.int32)) for _ in range(nf)]
        launches = [PreparedLaunch(persistent_read, sms, 512, (src, np.int64(i * n_words), np.int64(n_words), out,
                                                                bufs[i], np.int32(store)), 0, shared)
                    for i in range(nf)]
        t = graph_time_us(lambda i, s: launches[i % nf](s), nf * max(1, 64 // nf))
        spans, gaps = _spans_gaps([b.copy_to_host().reshape(-1, 8) for b in bufs])
        print(f"  {label:<32} {t:6.2f} us; span {np.median(spans) / 1e3:.2f} us, gap {np.median(gaps) / 1e3:.2f} us",
              flush=True)
    fgrid = -(-n_words // 4 // 512)
    bufs = [cuda.to_device(np.zeros(fgrid * 8, np.int32)) for _ in range(nf)]
    o = cuda.device_array(1, np.uint32)
    t = graph_time_us(lambda i, s: floor_read[fgrid, 512, s](src, np.int64((i % nf) * n_words), np.int64(n_words),
                                                             o, bufs[i % nf]), nf * max(1, 64 // nf))
    spans, gaps = _spans_gaps([b.copy_to_host().reshape(-1, 8) for b in bufs])
    print(f"  {'floor kernel (' + str(fgrid) + ' CTAs)':<32} {t:6.2f} us; span {np.median(spans) / 1e3:.2f} us, gap "
          f"{np.median(gaps) / 1e3:.2f} us", flush=True)


def _spans_gaps(recs):
    """Spans and gaps (ns) of launches whose per-CTA records hold the entry timer at 2 and the exit timer at 4."""
    t0s = [r[:, 2].astype(np.int64).min() for r in recs]
    order = np.argsort([rel(np.array([t]), t0s[0])[0] for t in t0s])
    spans, gaps = [], []
    for pos, i in enumerate(order):
        r, t0 = recs[i], t0s[i]
        end = rel(r[:, 4], t0).max()
        spans.append(end)
        if pos + 1 < len(order):
            gaps.append(rel(np.array([t0s[order[pos + 1]]]), t0)[0] - end)
    return np.array(spans), np.array(gaps)


def main():
    if sys.argv[1:2] == ["--gap"]:
        from kbit_numba.core import sm_count
        for nbytes in (int(float(v) * 1e6) for v in (sys.argv[2] if len(sys.argv) > 2 else "31.2,5.57").split(",")):
            gap_probe(nbytes, sm_count())
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[1] if len(sys.argv) > 1 else
                                                             "4096x14336,2048x5120").split(",")]
    names = (sys.argv[2] if len(sys.argv) > 2 else "pair4,pair2,pair4+pdl,mma4m4,mma4m16").split(",")
    rng = np.random.default_rng(5)
    out_dir = os.environ.get("OUT")
    for K, N in shapes:
        floors = set()
        for name in names:
            floors.add(gemv_timeline(K, N, name, rng, out_dir))
        for nbytes in sorted(b for b in floors if b):
            floor_timeline(nbytes)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
