"""The llama3-8b decode step at B = 1 with and without its add+RMSNorm and SiLU*mul kernels (GPU, torch):

    python benchmarks/decode_step_bound.py ["fp16,kbit k=4 pdl f16_acc,..."]

"without": those kernels' outputs are replaced by static buffers, so the step computes nothing meaningful; its
time bounds what fusing them into the linear layers could save. Two rounds of both modes. (Since 2026-11-26 the kbit
code-layout variants take their SiLU from the gate/up gemv's epilogue at B = 1: there only the norms go.)
"""
import sys

from kbit_numba import bench_model as bm

variants = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fp16", "kbit k=4 pdl f16_acc", "kbit k=2 pdl f16_acc"]
real_norm, real_silu = bm.DecodeStep.add_rmsnorm, bm.DecodeStep.silu_mul


def no_norm(self, res, y, w, eps=1e-6):
    if not hasattr(self, "_h"):
        self._h = res.clone()
    return self._h


def no_silu(self, gu, out=None, pairs=False):
    if not hasattr(self, "_act"):
        self._act = gu[:, : gu.shape[1] // 2].contiguous()
    return self._act


for rep in range(2):
    for mode in ("with", "without"):
        patched = (real_norm, real_silu) if mode == "with" else (no_norm, no_silu)
        bm.DecodeStep.add_rmsnorm, bm.DecodeStep.silu_mul = patched
        rows = bm.run("llama3-8b", variants, batches=(1,), progress=lambda *a: None)
        for r in rows:
            nan = float("nan")
            print(f"rep {rep} {mode:>7} norm+silu  {r['variant']:<24} B=1 step {r.get('step_us', nan):8.0f} us "
                  f"linear {r.get('linear_us', nan):6.0f} us  x fp16 {r.get('vs_fp16', nan):.2f}", flush=True)
