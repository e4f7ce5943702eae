"""bfloat16 activations through linear on the code layout at large M: us per call (CUDA graphs, L2-cold weights)."""
import sys
import numpy as np
import torch
from numba import cuda
import kbit_numba as kb
from kbit_numba import bench, dispatch as L, pair_gemv
from kbit_numba._timing import graph_time_us, rotation_count
print("package:", kb.__file__)
rng = np.random.default_rng(0)
for K, N in [(4096, 14336), (14336, 4096), (2048, 5120)]:
    nbytes = N * K // 32 * 17
    n = rotation_count(nbytes)
    kcs = [pair_gemv.to_codes(w) for w in bench._rotating_weights(K, N, 4, n, rng)]
    ws = L.Workspace()
    for M in (64, 128, 512, 2048):
        A = torch.randn((M, K), device="cuda", dtype=torch.bfloat16)
        Ab = cuda.as_cuda_array(A.view(torch.int16))
        out = cuda.device_array((M, N), np.float32)
        kern = L.choose(M, N, K, "codes", k=4)
        p = L.plan(Ab, kcs[0], out=out, bf16=True, workspace=ws)
        ran = "dequant" if len(p.steps) > 1 and "dequant" in str(p.steps[0].kernel) else type(p.steps[0]).__name__
        t = graph_time_us(lambda i, s: L.linear(Ab, kcs[i % n], out=out, stream=s, bf16=True, workspace=ws), n * max(1, 8 // n))
        ref32 = (A.float() @ torch.as_tensor(kb.dequantize(kcs[0], dtype=np.float32), device="cuda").t())
        L.linear(Ab, kcs[0], out=out, bf16=True, workspace=ws); cuda.synchronize()
        err = (torch.as_tensor(out, device="cuda") - ref32).abs().max().item() / ref32.abs().max().item()
        print(f"{K}x{N} M={M:5} table choice {kern:15} {t:9.2f} us  max rel err {err:.2e}", flush=True)
