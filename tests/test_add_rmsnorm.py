"""bench_model's add_rmsnorm (the decode step's fused residual add + RMSNorm) against a NumPy twin, at the row widths
whose thread counts differ (``norm_threads``: one 16-byte chunk a thread, 256..512 threads). No torch needed."""
import numpy as np
import pytest
from numba import cuda

from kbit_numba import bench_model
from kbit_numba.launch import PreparedLaunch
from helpers import SIM


def add_rmsnorm_numpy(res, y, w, eps):
    """(res + y rounded to float16, that sum / rms * w): float32 sums of squares, as the kernel computes them."""
    s = (res.astype(np.float32) + y.astype(np.float32)).astype(np.float16)
    x = s.astype(np.float32)
    inv = 1 / np.sqrt((x * x).sum(axis=1, keepdims=True) / x.shape[1] + np.float32(eps))
    return s, (x * inv * w.astype(np.float32)).astype(np.float16)


def test_norm_threads_take_a_chunk_each_within_bounds():
    assert [bench_model.norm_threads(H) for H in (64, 1000, 2048, 2056, 4096, 5120)] == [256, 256, 256, 288, 512, 512]


# (H, rows): 256 threads of one chunk (2048), of less (1000: 125 chunks), 512 threads of one (4096: llama3-8b's
# hidden size) and of two (5120: the last chunks of the second pass)
@pytest.mark.parametrize("H, B", [(1000, 1), (4096, 1)] if SIM else [(1000, 3), (2048, 2), (4096, 1), (4096, 3),
                                                                      (5120, 2)])
@pytest.mark.parametrize("pdl", [False] if SIM else [False, True])
def test_add_rmsnorm_equals_its_twin(H, B, pdl):
    rng = np.random.default_rng(H + B)
    res, y = (rng.standard_normal((B, H)).astype(np.float16) for _ in range(2))
    w = (rng.random(H) + 0.5).astype(np.float16)
    want_res, want_h = add_rmsnorm_numpy(res, y, w, 1e-6)
    words = [cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(np.uint32))
             for a in (res, y, w, np.zeros_like(res))]
    kernel = bench_model._kernel("add_rmsnorm", H, pdl)
    PreparedLaunch(kernel, B, bench_model.norm_threads(H), (*words, 1e-6), pdl=pdl)()
    got_res, got_h = (d.copy_to_host().view(np.float16).reshape(B, H) for d in (words[0], words[3]))
    assert np.array_equal(got_res, want_res)
    np.testing.assert_allclose(got_h.astype(np.float32), want_h.astype(np.float32), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("pdl", [False] if SIM else [False, True])
@pytest.mark.parametrize("threads, cap", [(None, None), (256, 32)])
def test_prefetch_build_equals_its_twin(monkeypatch, pdl, threads, cap):
    """The layer's first norm with NORM_PREFETCH_CTAS-style CTAs past the rows, which only ask the L2 for the
    attention cache's lines: the rows as the plain build's, the cache untouched. Also with ``NORM_MAX_THREADS = 256``
    and ``NORM_MAX_REGISTERS = 32``, the A/B knobs that let it fit beside the k = 4 down gemv's 28-warp CTA (two chunks
    a thread: a chunk left out would fail it)."""
    if threads:
        monkeypatch.setattr(bench_model, "NORM_MAX_THREADS", threads)
        monkeypatch.setattr(bench_model, "NORM_MAX_REGISTERS", cap)
        monkeypatch.setattr(bench_model, "_KERNELS", {})       # (the builds are cached by name and width only)
        assert bench_model.norm_threads(4096) == threads
    H, B, extra = 4096, 1 if SIM else 2, 2 if SIM else 32
    rng = np.random.default_rng(7)
    res, y = (rng.standard_normal((B, H)).astype(np.float16) for _ in range(2))
    w = (rng.random(H) + 0.5).astype(np.float16)
    cache = [rng.integers(0, 2**32, 2 * 4096 if SIM else 8 * 1024 * 128 // 2 * B, dtype=np.uint32) for _ in "kv"]
    want_res, want_h = add_rmsnorm_numpy(res, y, w, 1e-6)
    words = [cuda.to_device(np.ascontiguousarray(a).reshape(-1).view(np.uint32))
             for a in (res, y, w, np.zeros_like(res))]
    kv = [cuda.to_device(c) for c in cache]
    kernel = bench_model._kernel("add_rmsnorm", H, pdl, prefetch=True)
    PreparedLaunch(kernel, B + extra, bench_model.norm_threads(H), (*words, 1e-6, *kv), pdl=pdl)()
    got_res, got_h = (d.copy_to_host().view(np.float16).reshape(B, H) for d in (words[0], words[3]))
    assert np.array_equal(got_res, want_res)
    np.testing.assert_allclose(got_h.astype(np.float32), want_h.astype(np.float32), rtol=2e-3, atol=2e-3)
    for c, d in zip(cache, kv):
        assert np.array_equal(d.copy_to_host(), c)

