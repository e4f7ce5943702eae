"""Where a decode step's time goes, kernel by kernel, from the GPU's own timestamps (GPU, torch):

    python benchmarks/decode_step_trace.py [--model llama3-8b] [--batch 1] [--variants "kbit k=4 pdl f16_acc,..."]
                                           [--keep DIR]

Builds the step of ``bench --model`` (``bench_model.DecodeStep``), replays its CUDA graph and its linears-only graph
under ``torch.profiler`` (CUPTI records every kernel of a graph with its start and end), and prints, averaged over
the replays after the first, each kernel's **increment**: how far its end moved the step's running end (the max of
the ends before it). With programmatic dependent launches kernels overlap, so a kernel's duration includes the time it
waited for the one before; the increments add up to the step. Kernels are named by their place in a decoder layer
(llama3-8b: norm1, qkv, attention, o, norm2, gate_up with the SiLU epilogue or a silu kernel after it, down; a
step with a norm inside its gemvs has no norm2, and with both inside, no norm1 either). The
profiler adds host overhead between replays, not on the GPU: the replays' spans match the untraced times printed
beside them. ``--keep DIR``: the gzipped Chrome traces.
"""
import argparse
import collections
import gzip
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from kbit_numba import bench_model as bm

GAP_US = 30.0        # replays are synchronised one by one: a gap this long between kernels starts the next replay


def kernels(trace_path):
    """[(start us, end us, name)] of the GPU's kernels, copies and sets in a Chrome trace, by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e.get("name", "")) for e in events
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))


def replays(evs):
    """The kernels split into replays at gaps longer than GAP_US."""
    out, cur = [], [evs[0]]
    for e in evs[1:]:
        if e[0] - max(x[1] for x in cur[-8:]) > GAP_US:
            out.append(cur)
            cur = []
        cur.append(e)
    return out + [cur]


def layer_labels(layer, names):
    """Labels of one decoder layer's kernels [(start, end, name)]: a split-K launch's finishing kernel (``FINISH`` in
    its name: ``core.finish_step``) as "<the kernel before> finish", the others by ``names[n]``, n the count of
    those others (else k0, k1, ...)."""
    main = [e for e in layer if FINISH not in e[2]]
    own = names.get(len(main), [f"k{i}" for i in range(len(main))])
    labels, i = [], 0
    for e in layer:
        if FINISH in e[2]:
            labels.append(labels[-1] + " finish")      # (a layer starts with a norm or a gemv, never a finish)
        else:
            labels.append(own[i])
            i += 1
    return labels


def increments(rep, first, layers, labels):
    """{label: us} of one replay whose kernels first .. are ``layers`` decoder layers of equally many kernels each,
    labelled by ``labels`` (:func:`layer_labels`); the kernels before and after: "other"."""
    per = (len(rep) - first) // layers
    out = collections.defaultdict(float)
    end = rep[0][0]
    for i, (_, stop, _) in enumerate(rep):
        j = i - first
        out[labels[j % per] if 0 <= j < layers * per else "other"] += max(0.0, stop - end)
        end = max(end, stop)
    return out


STEP_NAMES = {5: ["qkv", "attention", "o", "gate_up", "down"],               # both norms inside the linears
              6: ["norm1", "qkv", "attention", "o", "gate_up", "down"],      # norm2 inside gate/up (NORM_IN_GATE_UP)
              7: ["norm1", "qkv", "attention", "o", "norm2", "gate_up", "down"],     # SiLU in gate_up's epilogue
              8: ["norm1", "qkv", "attention", "o", "norm2", "gate_up", "silu", "down"]}
LINEAR_NAMES = {4: ["qkv", "o", "gate_up", "down"]}
FINISH = "finish_kernel"        # core.make_finish_kernel's kernel: the second launch of a split-K gemv (e.g. the
                                # tensor-core gemv's down projection, K = 14336, on the fragment layout at B = 4)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", default="kbit k=4 pdl f16_acc,kbit k=2 pdl f16_acc")
    ap.add_argument("--keep", metavar="DIR")
    args = ap.parse_args()
    cfg = bm.MODELS[args.model]
    if bm.is_moe(cfg):
        raise SystemExit("decode_step_trace.py names a dense model's kernels (llama3-8b); a MoE layer has more")
    base = bm.random_weights(cfg)
    for variant in args.variants.split(","):
        step = bm.decode_step(args.model, variant, args.batch, base=base)
        graphs = (step.step, step.linears_only)
        with torch.no_grad():
            untraced = [bm.graph_us(torch, fn) for fn in graphs]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for fn in graphs:
                    bm.graph_us(torch, fn, replays=5, warmup=1, spaced=True)   # (gaps tell the replays apart)
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(path)
        reps = replays(kernels(path))
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            with open(path, "rb") as f, gzip.open(os.path.join(args.keep, f"{variant.replace(' ', '_')}_B{args.batch}"
                                                                         f".json.gz"), "wb") as g:
                g.write(f.read())
        print(f"\n{args.model} B={args.batch} {variant} (increments in us, averaged over replays 2..6)")
        counts = collections.Counter(len(r) for r in reps)
        sizes = sorted((n for n, c in counts.items() if c >= 3 and n > 1), reverse=True)[:2]
        if len(sizes) < 2:                              # (the step has more kernels than its linears)
            print(f"\n{variant}: the replays could not be told apart (kernels a replay: {dict(counts)})")
            continue
        for fn, t, size in zip(graphs, untraced, sizes):
            mine = [r for r in reps if len(r) == size][1:]
            # the step's clone (and zeros) come before the first norm or gemv
            first = next((i for i, e in enumerate(mine[0]) if "kbit_numba" in e[2]), 0)
            per = (size - first) // cfg["layers"]
            labels = layer_labels(mine[0][first:first + per], STEP_NAMES if fn == step.step else LINEAR_NAMES)
            totals = collections.defaultdict(float)
            for r in mine:
                inc = increments(r, first, cfg["layers"], labels)
                for k, v in inc.items():
                    totals[k] += v / len(mine)
            spans = [max(e[1] for e in r) - r[0][0] for r in mine]    # (with PDL the last to start may not end last)
            print(f"  {fn.__name__}: {size} kernels a replay, span {min(spans):.0f}-{max(spans):.0f} us "
                  f"(untraced {t:.0f} us); total of increments {sum(totals.values()):.0f} us")
            print("    " + "  ".join(f"{k} {totals[k]:.1f}" for k in labels + ["other"]))
        del step


if __name__ == "__main__":
    main()
