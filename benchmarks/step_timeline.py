"""When each CTA of the decode step's gemvs and attention starts, passes its griddep_wait and ends (GPU, torch):

    python benchmarks/step_timeline.py [--model llama3-8b] [--batch 1] [--variant "kbit k=4 pdl f16_acc"] [--npz F]
                                       [--package benchmarks/_pk/NAME/kbit_numba]

``decode_step_trace.py`` gives each kernel's start and end; with programmatic dependent launches the kernels overlap,
and what happens inside a boundary (which CTAs of the next kernel start beside the last ones of this one, how long
they wait, how ragged a launch's end is) is not in it. This script copies the package to a temporary directory with
stamps inserted (text edits, as ``timeline.py`` does for one gemv): thread 0 of every CTA of the pair gemv and the
tensor-core gemv (the plain, not the grouped builds) and of ``decode_attention``'s cluster build takes a record from a
counter and writes the launch's CTAs (all of its grid) and block, its CTA index, its SM and ``%globaltimer`` (ns) at
entry, after the ``griddep_wait`` and at its end (after a barrier of the whole CTA, so the stamp is the CTA's end,
within a barrier's time); in the gemvs also once its tables are filled (``tables``: the pair gemv's own part of them,
first run 2026-12-04, seventy-first session; the tensor-core gemv's before their barrier). The records go to one
int32 buffer, passed where those kernels take an array they do not use in the step (the gemvs' ``offsets`` outside
grouped launches, the attention's ``count`` in its cluster build). The norm launches, a split launch's finishing
launch and the attention's L2-merge build (B = 3, 4 on 132 SMs: ``launch_names``) are not stamped. The step's graph
is captured once, replayed, the counter reset and one more replay read back.

Printed per projection (averaged over layers 2..L; us; "before" = the last CTA end of the stamped launch before it):
``first in``: the first CTA's entry; ``tables``: the median CTA's end of its table fill (gemvs); ``waited``: the
median CTA's pass of its wait; ``first out`` / ``median out`` / ``last out``: CTA ends; ``fill``: the median of a
CTA's own entry -> table fill (gemvs); ``run``: the median of a CTA's own wait -> end (its groups); ``early``:
CTAs that entered before the launch before had ended. A stamped step is slower than the real one by its stamps (an
atomic, three stores and a barrier a CTA); its untraced time is printed beside.
"""
import argparse
import os
import shutil
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
REC = 9                          # int32 words a CTA: tag, grid, block, CTA, SM, entry, after the wait, end, tables
TAG, GRID, BLOCK, CTA, SM, ENTRY, WAITED, END, FILLED = range(REC)
MAX_RECORDS = 1 << 17            # a llama3-8b B = 1 step stamps ~32,000 CTAs
PAIR, ATTENTION, MMA = 1, 2, 3   # the record's tag: the pair gemv, the attention, the tensor-core gemv
EXIT_BARRIER = 15                # the pair gemv's slices use named barriers 0 .. slices - 1

STAMPS_MODULE = f'''"""Stamps for benchmarks/step_timeline.py (inserted into a copy of the package)."""
import numpy as np
from llvmlite import ir
from numba import cuda, types
from numba.core.extending import intrinsic

REC, MAX_RECORDS = {REC}, {MAX_RECORDS}
BUFFER = []                      # the step's buffer (a torch int32 tensor), set by the script


def _special(reg):
    @intrinsic
    def read(typingctx):
        def codegen(context, builder, signature, args):
            fty = ir.FunctionType(ir.IntType(32), [])
            return builder.call(ir.InlineAsm(fty, "mov.u32 $0, %" + reg + ";", "=r", side_effect=True), [])
        return types.uint32(), codegen
    return read


gtimer, smid = _special("globaltimer_lo"), _special("smid")


@cuda.jit(device=True, inline="always")
def start(buf, sh, tid, tag):
    """Thread 0: a record for this CTA with the tag, the grid's CTAs, block, CTA index, SM and the entry time; its
    index into the CTA's shared word ``sh[0]`` (0: none), so that no register holds it through the kernel."""
    if tid == 0:
        rec = np.int32(0)
        slot = cuda.atomic.add(buf, 0, np.int32(1))
        if slot < np.int32(MAX_RECORDS):
            rec = np.int32(1 + slot * np.int32(REC))
            buf[rec] = np.int32(tag)
            buf[rec + 1] = np.int32(cuda.gridDim.x * cuda.gridDim.y * cuda.gridDim.z)   # (a split launch: y > 1)
            buf[rec + 2] = np.int32(cuda.blockDim.x)
            buf[rec + 3] = np.int32(cuda.blockIdx.x + cuda.gridDim.x * (cuda.blockIdx.y
                                                                    + cuda.gridDim.y * cuda.blockIdx.z))
            buf[rec + 4] = np.int32(smid())
            buf[rec + 5] = np.int32(gtimer())
        sh[0] = rec


@cuda.jit(device=True, inline="always")
def at(buf, sh, word, tid):
    """Thread 0: the time into word ``word`` of its CTA's record."""
    if tid == 0:
        rec = sh[0]
        if rec != np.int32(0):
            buf[rec + np.int32(word)] = np.int32(gtimer())


def device_buffer():
    """The buffer as a Numba device array (what the step's kernels get)."""
    return cuda.as_cuda_array(BUFFER[0])
'''

# (file, anchor, text, where): every anchor must occur exactly once
EDITS = [
    ("core.py", "    return cuda.to_device(np.zeros(2, np.int32))\n",
     "    from . import _stamps\n    return _stamps.device_buffer()\n", "replace"),
    ("pair_gemv.py", "        last4 = u32(u32(u32(N) * nkb - u32(1)) * u32(4))     # 4 x the index of the weight's last block\n",
     f"        st_sh = cuda.shared.array(1, np.int32)\n        if not GROUPED:\n"
     f"            _stamps.start(offsets, st_sh, tid, {PAIR})\n", "after"),
    ("pair_gemv.py", "        if PDL and not GROUPED:     # the activations (and out) may be the previous kernel's: wait for it\n"
                     "            griddep_wait()\n",
     f"        if not GROUPED:\n            _stamps.at(offsets, st_sh, {WAITED}, tid)\n", "after"),
    ("pair_gemv.py", "    return jit_kernel(pair_gemv, spec.max_registers)\n",
     f"        if not GROUPED:\n            bar_sync(u32({EXIT_BARRIER}), u32(cuda.blockDim.x))\n"
     f"            _stamps.at(offsets, st_sh, {END}, tid)\n\n", "before"),
    ("pair_gemv.py", "from . import _arrays\n", "from . import _arrays, _stamps\n", "replace"),
    ("pair_gemv.py", "        table = shared_addr(smem)\n",
     f"        if not GROUPED:\n            _stamps.at(offsets, st_sh, {FILLED}, tid)\n", "after"),
    ("mma_gemv.py", "from . import _arrays\n", "from . import _arrays, _stamps\n", "replace"),
    ("mma_gemv.py", "        smem = cuda.shared.array(0, np.float32)    "
                    "# [group table][E4M4 table][codebook][partial C tiles]\n        tid = u32(cuda.threadIdx.x)\n",
     f"        st_sh = cuda.shared.array(1, np.int32)\n        if not GROUPED:\n"
     f"            _stamps.start(offsets, st_sh, tid, {MMA})\n", "after"),
    ("mma_gemv.py", "        table = shared_addr(smem)\n        if EARLY_BARRIER:",
     f"        if not GROUPED:\n            _stamps.at(offsets, st_sh, {FILLED}, tid)\n"
     "        table = shared_addr(smem)\n        if EARLY_BARRIER:", "replace"),
    ("mma_gemv.py", "        if PDL and not GROUPED:     "
                    "# the activations (and out) may be the previous kernel's: wait for it\n"
                    "            griddep_wait()\n",
     f"        if not GROUPED:\n            _stamps.at(offsets, st_sh, {WAITED}, tid)\n", "after"),
    ("mma_gemv.py", "    return jit_kernel(mma_gemv, spec.max_registers)\n",
     f"        if not GROUPED:\n            cuda.syncthreads()\n"
     f"            _stamps.at(offsets, st_sh, {END}, tid)\n\n", "before"),
    ("bench_model.py", "                t = cuda.threadIdx.x\n                # the cluster build's receive buffers",
     f"                t = cuda.threadIdx.x\n                st_sh = cuda.shared.array(1, int32)\n"
     f"                if CLUSTER:\n                    _stamps.start(count, st_sh, t, {ATTENTION})\n"
     f"                # the cluster build's receive buffers", "replace"),
    ("bench_model.py", "                w_acc = cuda.shared.array((WARPS, CTA_VALUES), float32, alignment=16)  # and its P V, "
                       "[head, 64 hi + 8 m + g]\n                pdl_start()\n",
     f"                if CLUSTER:\n                    _stamps.at(count, st_sh, {WAITED}, t)\n", "after"),
    ("bench_model.py", "                        out[b, (kvh * G + h) * HD + x // 64 * 64 + 8 * (x % 8) + x % 64 // 8] = num / den\n"
                       "                    return\n",
     "                        out[b, (kvh * G + h) * HD + x // 64 * 64 + 8 * (x % 8) + x % 64 // 8] = num / den\n"
     f"                    cuda.syncthreads()\n                    _stamps.at(count, st_sh, {END}, t)\n"
     "                    return\n", "replace"),
    ("bench_model.py", "            self.att_count = torch.zeros(B * cfg[\"kv_heads\"], device=dev, dtype=torch.int32)\n",
     "            self.att_count = torch.zeros(B * cfg[\"kv_heads\"], device=dev, dtype=torch.int32)\n"
     "            if self.att_cluster > 1:             # (step_timeline.py: the cluster build stamps into it)\n"
     "                from . import _stamps\n                self.att_count = _stamps.BUFFER[0]\n", "replace_later"),
    ("bench_model.py", "import numpy as np\n", "import numpy as np\n\nfrom . import _stamps  # noqa: F401\n", "first"),
]


def stamped_copy(dest, src_pkg):
    """A copy of the package ``src_pkg`` under ``dest`` with the stamps inserted; its root (for sys.path)."""
    pkg = os.path.join(dest, "kbit_numba")
    shutil.copytree(src_pkg, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    with open(os.path.join(pkg, "_stamps.py"), "w") as f:
        f.write(STAMPS_MODULE)
    for name, anchor, text, where in EDITS:
        path = os.path.join(pkg, name)
        with open(path) as f:
            src = f.read()
        if src.count(anchor) != 1:
            raise SystemExit(f"step_timeline: {anchor[:70]!r} occurs {src.count(anchor)} times in {name}, not once")
        new = {"after": anchor + text, "before": text + anchor}.get(where, text)
        if where == "replace_later":            # (the attention's cluster size is set after att_count)
            src = src.replace(anchor, "")
            hook = "            self.att_cluster = att_cluster(per_head, self.att_slices)\n"
            if src.count(hook) != 1:
                raise SystemExit("step_timeline: DecodeStep's att_cluster line not found once")
            src = src.replace(hook, hook + new)
        else:
            src = src.replace(anchor, new, 1)
        with open(path, "w") as f:
            f.write(src)
    return dest


def launches(recs):
    """The records ([n, REC], times unwrapped to ns from the first entry) split into launches: sorted by entry, a new
    launch wherever (tag, grid, block) changes or a launch has all its grid's CTAs."""
    recs = recs[np.argsort(recs[:, ENTRY], kind="stable")]
    out, cur = [], []
    for r in recs:
        if cur and (tuple(r[[TAG, GRID, BLOCK]]) != tuple(cur[0][[TAG, GRID, BLOCK]]) or len(cur) == cur[0][GRID]):
            out.append(np.array(cur))
            cur = []
        cur.append(r)
    return out + ([np.array(cur)] if cur else [])


def launch_names(groups):
    """The labels of a layer's stamped launches: qkv, attention, o, gate_up, down, without the attention where no launch
    is the attention's (only its cluster build is stamped, and ``bench_model.att_cluster`` builds it only where the
    launch has no more CTAs than the GPU has SMs: llama3-8b at B = 1, 2, not at B = 3, 4 on 132 SMs)."""
    names = ["qkv", "attention", "o", "gate_up", "down"]
    return names if any(g[0, TAG] == ATTENTION for g in groups) else [n for n in names if n != "attention"]


def summarise(groups, names, layers):
    """{name: {metric: mean us over layers 2..}} for launches labelled cyclically by ``names``."""
    rows = {n: [] for n in names}
    per = len(names)
    if len(groups) != per * layers:
        raise SystemExit(f"step_timeline: {len(groups)} stamped launches, expected {per} x {layers}")
    for i, g in enumerate(groups):
        if i < per:                                 # (layer 1: no stamped launch before its first)
            continue
        before = groups[i - 1][:, END].max()
        filled = g[0, TAG] in (PAIR, MMA) and g.shape[1] > FILLED   # (the first run's records had no fill stamp)
        rows[names[i % per]].append({
            "first in": (g[:, ENTRY].min() - before) / 1e3,
            "waited": (np.median(g[:, WAITED]) - before) / 1e3,
            "first out": (g[:, END].min() - before) / 1e3,
            "median out": (np.median(g[:, END]) - before) / 1e3,
            "last out": (g[:, END].max() - before) / 1e3,
            "tables": (np.median(g[:, FILLED]) - before) / 1e3 if filled else float("nan"),
            "fill": np.median(g[:, FILLED] - g[:, ENTRY]) / 1e3 if filled else float("nan"),
            "run": np.median(g[:, END] - g[:, WAITED]) / 1e3,
            "early": float((g[:, ENTRY] < before).sum()),
            "CTAs": float(len(g)),
        })
    return {n: {k: float(np.mean([r[k] for r in v])) for k in v[0]} for n, v in rows.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variant", default="kbit k=4 pdl f16_acc")
    ap.add_argument("--npz", help="write the records (and the launches' labels) here")
    ap.add_argument("--package", default=os.path.join(ROOT, "kbit_numba"),
                    help="the kbit_numba tree to stamp (default this checkout's; e.g. a step_rules_ab.py copy)")
    args = ap.parse_args()
    sys.path.insert(0, stamped_copy(tempfile.mkdtemp(prefix="step_timeline_"), args.package))
    import torch
    from kbit_numba import _stamps, bench_model as bm
    assert "step_timeline_" in bm.__file__, bm.__file__
    buf = torch.zeros(1 + MAX_RECORDS * REC, device="cuda", dtype=torch.int32)
    _stamps.BUFFER.append(buf)
    cfg = bm.MODELS[args.model]
    if bm.is_moe(cfg):
        raise SystemExit("step_timeline.py labels a dense model's launches (qkv, attention, o, gate/up, down)")
    step = bm.decode_step(args.model, args.variant, args.batch)
    with torch.no_grad():
        untraced = bm.graph_us(torch, step.step)
        g = bm.capture_graph(torch, step.step, warm_calls=1)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        buf.zero_()
        g.replay()
        torch.cuda.synchronize()
    n = int(buf[0].item())
    recs = buf[1:1 + min(n, MAX_RECORDS) * REC].view(-1, REC).cpu().numpy().astype(np.int64)
    t0 = recs[:, ENTRY].min()
    for w in (ENTRY, WAITED, END, FILLED):          # (globaltimer's low 32 bits: unwrap from the first entry)
        recs[:, w] = (recs[:, w] - t0) % (1 << 32)
    groups = launches(recs)
    names = launch_names(groups)
    print(f"{args.model} B={args.batch} {args.variant}: {n} stamped CTAs in {len(groups)} launches; the stamped step "
          f"{untraced:.0f} us untraced; span of the stamps {(recs[:, END].max()) / 1e3:.0f} us")
    if "attention" not in names:
        print("the attention ran its L2 merge build, which is not stamped: o's 'before' is QKV's last CTA end")
    table = summarise(groups, names, cfg["layers"])
    cols = list(next(iter(table.values())))
    print(f"{'us after the launch before':<28}" + "".join(f"{c:>11}" for c in cols))
    for name, row in table.items():
        print(f"{name:<28}" + "".join(f"{row[c]:11.2f}" for c in cols))
    if args.npz:
        np.savez_compressed(args.npz, records=recs, launch=np.concatenate(
            [np.full(len(g), i) for i, g in enumerate(groups)]), names=np.array(names))


if __name__ == "__main__":
    main()
