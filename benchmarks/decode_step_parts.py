"""Where a llama3-8b decode step's time outside the linear layers goes, and a same-run A/B of the step's fused
kernels (needs torch and a GPU):

    python benchmarks/decode_step_parts.py [--model llama3-8b] [--batch 1,4] [--variants "fp16,kbit k=4 pdl f16_acc"]
                                           [--old OLD.py] [--no-parts]

* parts: CUDA graphs of the 32 layers' calls of one op alone (add_rmsnorm, the attention stand-in, silu_mul;
  ``attention x32 L2``: every call over one layer's cache, so that it is read from the L2), for both attention
  kernels: ``fused`` (decode_attention at every batch) and ``sdpa`` (torch's SDPA);
* steps: the whole step per variant, alternating the step's configurations on the same linears (best of
  ``--rounds``): ``fused`` (the committed fused kernels, decode_attention at every batch), ``sdpa`` (the same
  with torch's SDPA as the attention), ``fused pdl`` and ``sdpa pdl`` (as programmatic dependent launches, for
  variants whose linears are), ``fused pdl, experts plain`` (a MoE model's pdl variants with the grouped
  expert kernels launched without PDL), ``torch gather`` (MoE: the routed rows gathered by ``index_select``
  instead of ``gather_rows``), and ``old norm`` when ``--old`` names a previous ``bench_model.py``
  (its ``add_rmsnorm`` kernel, launched as that version did).
"""
import argparse
import functools
import importlib.util

import torch

from kbit_numba import bench_model as bm


def old_norm_step(path):
    spec = importlib.util.spec_from_file_location("old_bench_model", path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)

    class OldNorm(bm.DecodeStep):
        def add_rmsnorm(self, res, y, w, eps=1e-6):
            from numba import cuda
            h = torch.empty_like(res)
            s = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
            threads = old.norm_threads(res.shape[1]) if hasattr(old, "norm_threads") else old.NORM_THREADS
            old._kernels()["add_rmsnorm"][res.shape[0], threads, s](
                cuda.as_cuda_array(res), cuda.as_cuda_array(y), cuda.as_cuda_array(w), cuda.as_cuda_array(h), eps)
            return h
    return OldNorm


class ExpertsPlain(bm.DecodeStep):
    """The step with the expert sets bound without PDL (the rest as given)."""

    def _bind_experts(self, torch_, dev, f16):
        sets = [e for layer in self.linears for e in layer[2:]]
        saved = [e.pdl for e in sets]
        for e in sets:
            e.pdl = False
        try:
            super()._bind_experts(torch_, dev, f16)
        finally:
            for e, p in zip(sets, saved):
                e.pdl = p


class TorchGather(bm.DecodeStep):
    """The step with the routed rows gathered by ``torch.index_select`` (as before ``gather_rows``)."""

    def gather_rows(self, h, src, out):
        return torch.index_select(h, 0, src, out=out)


def parts(cfg, B, step):
    H, L = cfg["hidden"], cfg["layers"]
    dev = "cuda"
    res = [torch.randn(B, H, device=dev, dtype=torch.float16) for _ in range(L)]
    y = [torch.randn(B, H, device=dev, dtype=torch.float16) for _ in range(L)]
    w = [torch.ones(H, device=dev, dtype=torch.float16) for _ in range(L)]
    q, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    qkv = [torch.randn(B, q + 2 * kv, device=dev, dtype=torch.float16) for _ in range(L)]
    gu = [torch.randn(B, 2 * cfg["intermediate"], device=dev, dtype=torch.float16) for _ in range(L)]
    ops = {
        "add_rmsnorm x32": lambda: [step.add_rmsnorm(r, a, b) for r, a, b in zip(res, y, w)],
        "attention x32": lambda: [step._attention(x, c) for x, c in zip(qkv, step.kv)],
        # every call over layer 0's cache (4 MB at llama3-8b's batch 1): read from the L2 after the first
        "attention x32 L2": lambda: [step._attention(x, step.kv[0]) for x in qkv],
        "silu_mul x32": lambda: [step.silu_mul(g) for g in gu],
    }
    return {name: bm.graph_us(torch, fn) for name, fn in ops.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--no-parts", action="store_true")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--variants", default="fp16,kbit k=4 pdl f16_acc")
    ap.add_argument("--old", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    cfg = bm.MODELS[args.model]
    print(f"device: {torch.cuda.get_device_name()}")
    numba_att, sdpa_att = (functools.partial(bm.DecodeStep, attention=a) for a in ("numba", "sdpa"))
    configs = {"fused": (numba_att, False), "sdpa": (sdpa_att, False)}
    if args.old:
        configs["old norm"] = (old_norm_step(args.old), False)
    import numpy as np
    rng = np.random.default_rng(0)
    base = {name: rng.standard_normal((N, K), dtype=np.float32) * 0.02 for name, N, K in bm.projections(cfg)}
    if bm.is_moe(cfg):
        for name, N, K in bm.projections(cfg)[2:]:
            base[name] = [rng.standard_normal((N, K), dtype=np.float32) * 0.02 for _ in range(bm.DISTINCT_EXPERTS)]
    with torch.no_grad():
        for B in ([] if args.no_parts or bm.is_moe(cfg) else map(int, args.batch.split(","))):
            for name, (cls, _) in configs.items():
                for op, us in parts(cfg, B, cls(cfg, [None] * cfg["layers"], B)).items():
                    print(f"B={B} {name:<10} {op:<18} {us:8.1f} us  ({us / 32:.2f} us a call)", flush=True)
        for variant in args.variants.split(","):
            linears = bm.build_linears(cfg, variant, base, lambda m: None)
            runs = dict(configs)
            if bm.is_moe(cfg):
                runs["torch gather"] = (TorchGather, False)
            if bm.uses_pdl(variant):
                runs["fused pdl"] = (numba_att, True)
                runs["sdpa pdl"] = (sdpa_att, True)
                if bm.is_moe(cfg):
                    runs["fused pdl, experts plain"] = (ExpertsPlain, True)
                    runs["fused pdl, torch gather"] = (TorchGather, True)
            for B in map(int, args.batch.split(",")):
                best = {}
                for _ in range(args.rounds):
                    for name, (cls, pdl) in runs.items():
                        step = cls(cfg, linears, B, pdl=pdl)
                        with torch.no_grad():
                            t = bm.graph_us(torch, step.step)
                        best[name] = min(best.get(name, 1e18), t)
                        del step
                line = "  ".join(f"{n}: {t:.0f} us" for n, t in best.items())
                print(f"{variant:<24} B={B:<3} step  {line}", flush=True)
            del linears
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
