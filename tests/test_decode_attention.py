"""bench_model's decode_attention (the decode step's attention stand-in) against its NumPy twin: grouped query
heads over a cache split into slices that the last CTA of each (row, KV head) merges, or (the cluster build, GPU
only) the slices' thread block cluster. No torch needed."""
import numpy as np
import pytest
from numba import cuda

from kbit_numba import bench_model
from kbit_numba.launch import PreparedLaunch
from helpers import SIM

# (query heads per KV head, KV heads, head_dim, cache tokens, warps, batch): the simulator's case has two slices of
# 16 tokens; on the GPU llama3-8b's and qwen3-30b-a3b's heads at a 1024-token cache, as the step plans them
CASES = [(2, 1, 128, 32, 1, 1)] if SIM else [(2, 1, 128, 32, 1, 1), (2, 2, 128, 256, 2, 3), (4, 8, 128, 1024, 4, 1),
                                             (4, 8, 128, 1024, 8, 1),
                                             (4, 8, 128, 1024, 8, 2), (8, 4, 128, 1024, 2, 1), (8, 4, 128, 1024, 8, 4),
                                             (8, 4, 128, 512, 1, 4)]


# and the cluster build (GPU) where a cluster holds a head's slices
BUILDS = [c + (False,) for c in CASES] + [c + (True,) for c in CASES if not SIM and
                                          c[3] // (bench_model.ATT_TILE * c[4]) <= bench_model.ATT_MAX_CLUSTER]


@pytest.mark.parametrize("G, NKV, HD, S, W, B, cluster", BUILDS)
def test_decode_attention_equals_its_twin(G, NKV, HD, S, W, B, cluster):
    rng = np.random.default_rng(G * 1000 + S + B)
    nq = G * NKV
    qkv = rng.standard_normal((B, (nq + 2 * NKV) * HD)).astype(np.float16)
    k, v = (rng.standard_normal((B, NKV, S, HD)).astype(np.float16) for _ in range(2))
    slices = B * NKV * S // (bench_model.ATT_TILE * W)
    size = bench_model.att_cluster(S // (bench_model.ATT_TILE * W)) if cluster else 1
    assert size > 1 or not cluster
    kernel = bench_model._kernel("decode_attention", (G, NKV, HD, S, W), cluster=cluster)
    words = [cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(np.uint32)) for a in (qkv, k, v)]
    part = cuda.device_array(slices * G * HD, np.float32)
    stats = cuda.device_array(slices * G * 2, np.float32)
    count = cuda.to_device(np.zeros(B * NKV, np.int32))
    want = bench_model.attention_numpy(qkv[:, :nq * HD].reshape(B, nq, HD), k, v)
    for _ in range(2):                       # the second launch finds the counts the first one reset
        out = cuda.to_device(np.zeros((B, nq * HD), np.float16))
        PreparedLaunch(kernel, slices, 32 * W, (*words, out, part, stats, count), cluster=size)()
        # (the softmax weights enter the second product as float16, as in flash attention)
        np.testing.assert_allclose(out.copy_to_host().astype(np.float64), want, rtol=5e-3, atol=3e-3)
        assert not count.copy_to_host().any()


def test_attention_plan_fits_the_cache():
    llama, qwen = bench_model.MODELS["llama3-8b"], bench_model.MODELS["qwen3-30b-a3b"]
    assert bench_model.attention_plan(llama, 1024) == 8          # batch 1: 64 CTAs of 128 tokens (ATT_MIN_CTAS)
    assert bench_model.attention_plan(dict(heads=8, kv_heads=2, head_dim=128), 1024) == 4   # 16 CTAs: halved once
    assert bench_model.attention_plan(llama, 1024, 4) == 8       # 128-token slices once the batch fills the GPU
    assert bench_model.attention_plan(qwen, 1024) == 8           # 8 heads a group: 8 slices to merge, not 32
    assert bench_model.attention_plan(llama, 4096) == 8          # (no more than 32 slices)
    assert bench_model.attention_plan(dict(heads=2, kv_heads=1, head_dim=128), 64) == 1
    with pytest.raises(ValueError, match="multiple of 16 tokens"):
        bench_model.attention_plan(dict(heads=2, kv_heads=1, head_dim=128), 24)
    with pytest.raises(ValueError, match="at most 32 slices"):
        bench_model.attention_plan(llama, 8192)
    with pytest.raises(ValueError, match="head_dim 128 and at most 8 query heads"):
        bench_model.attention_plan(dict(heads=4, kv_heads=2, head_dim=64), 1024)
    with pytest.raises(ValueError, match="head_dim 128 and at most 8 query heads"):
        bench_model.attention_plan(dict(heads=32, kv_heads=2, head_dim=128), 1024)


def test_auto_attention_is_decode_attention_up_to_batch_4():
    assert [bench_model.attention_kernel("auto", B) for B in (1, 4, 16)] == ["numba", "numba", "sdpa"]
    assert bench_model.attention_kernel("sdpa", 1) == "sdpa" and bench_model.attention_kernel("numba", 16) == "numba"
    with pytest.raises(ValueError, match="known are auto, numba, sdpa"):
        bench_model.attention_kernel("flash", 1)
