"""Scalar GEMV (M = 1..4) against reference.gemv, on the simulator (CI) and the GPU."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda

import kbit_numba as kb
from kbit_numba import reference as ref
from helpers import (assert_within, EXAMPLES, gpu_examples, gpu_split, kbit_weight, MAX_KB_TILED, MAX_TILES, Out,
                     out_modes, pick, SIM, SIM_EXPLICIT_ONLY, sim_example, random_weight, seeds, sizes, variants,
                     weight_kinds)

MAX_N = 12 if SIM else 700
KS = [2, 3, 4, 5]                 # (on the GPU the long properties run once per k: helpers.gpu_split)
MAX_KB = 5 if SIM else 70          # K = 32 * kb: odd multiples of 32, and past 1024 (several warps) on the GPU


def check_close(got, A, qw, bf16=False, out_dtype=np.float32, rows=None):
    """Tolerance of float32 accumulation: 1e-5 of sum_j |a_j w_j| (K <= 2240 terms, relative eps 6e-8
    each, with margin), plus one float16 rounding of the result when the output is float16. ``rows``: ``qw``
    is a pool and output column n belongs to its row rows[n] (helpers.kbit_weight)."""
    want = ref.gemv(A, qw, bf16=bf16)
    Af = ref.as_float32(A, bf16).reshape(want.shape[0], -1).astype(np.float64)
    scale = np.abs(Af) @ np.abs(ref.dequantize(qw).astype(np.float64)).T
    if rows is not None:
        want, scale = pick(rows, want, scale)
    tol = 1e-5 * scale + 1e-30
    assert_within(got, want, tol, out_dtype)


def _activations(rng, M, K, a_dtype, one_d=False):
    A = rng.standard_normal((M, K)).astype(np.float32)
    if a_dtype == "bfloat16":
        A = ref.float32_to_bf16_bits(A)
    else:
        A = A.astype(a_dtype)
    return A[0] if one_d else A


@gpu_split("k_split", KS)
@settings(max_examples=gpu_examples(EXAMPLES * 2, len(KS)))
@given(seeds, variants((4, 2, 3, 5), (1, 2, 3, 4), ("e4m4", "fp32"), ("float16", "float32", "bfloat16"),
                (np.float16, np.float32)), sizes(MAX_N, 20000), sizes(MAX_KB, 512), weight_kinds, out_modes)
def test_gemv_flat(k_split, seed, v, N, kbn, kind, out_mode):
    k, M, fmt, a_dtype, out_dtype = v
    k = k_split or k
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    qw, pool, rows = kbit_weight(rng, N, K, kind, k, fmt)
    A = _activations(rng, M, K, a_dtype)
    bf16 = a_dtype == "bfloat16"
    o = Out(out_mode, (M, N), out_dtype)
    out = kb.gemv(A, qw, out_dtype=out_dtype, bf16=bf16, **o.kwargs)
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    check_close(o.host(out), A, pool, bf16, out_dtype, rows)


@gpu_split("k_split", KS)
@settings(max_examples=gpu_examples(EXAMPLES, len(KS)), **SIM_EXPLICIT_ONLY)
@given(seeds, variants((4, 2, 3, 5), (1, 2, 3, 4), ("e4m4", "fp32")), st.integers(1, MAX_TILES),
       st.integers(1, MAX_KB_TILED if SIM else MAX_KB))
@sim_example(seed=1, v=(3, 4, "e4m4"), ntiles=1, kbn=3)    # (k, M, absmax format); K = 96: a padded K tile
@sim_example(seed=2, v=(5, 1, "fp32"), ntiles=1, kbn=2)
def test_gemv_tiled(k_split, seed, v, ntiles, kbn):
    k, M, fmt = v
    k = k_split or k
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    flat = ref.quantize(random_weight(rng, 128 * ntiles, K), k=k, absmax_format=fmt)
    tiled = ref.repack_tiled(flat)           # (the GPU repack is tested in test_codec)
    A = _activations(rng, M, K, "float16")
    got = kb.gemv(A, tiled, out_dtype=np.float32).copy_to_host()
    check_close(got, A, flat)


def test_pooled_weight_is_its_rows(monkeypatch):
    """The fuzz run's large draws (helpers.kbit_weight): the gathered bytes are exactly the reference's for the
    gathered rows, and a gemv checked against the pool passes, and fails with a wrong row map."""
    import helpers
    monkeypatch.setattr(helpers, "POOL_ABOVE", 0)
    W, rows = helpers.weight_rows(np.random.default_rng(0), 40, 64, "one_huge")
    assert W.shape == (helpers.POOL_ROWS, 64) and len(rows) == 40 and len(set(rows.tolist())) > 1
    qw, pool, rows = helpers.kbit_weight(np.random.default_rng(0), 40, 64, "one_huge", k=3)
    whole = ref.quantize(W[rows], k=3)
    assert np.array_equal(qw.packed, whole.packed) and np.array_equal(qw.absmax, whole.absmax)
    A = _activations(np.random.default_rng(1), 2, 64, "float16")
    got = kb.gemv(A, qw, out_dtype=np.float32).copy_to_host()
    check_close(got, A, pool, rows=rows)
    with pytest.raises(AssertionError):
        check_close(got, A, pool, rows=np.roll(rows, 1))


def test_gemv_vector_input_and_out_buffer():
    rng = np.random.default_rng(5)
    qw = kb.quantize(random_weight(rng, 7, 96), k=3)
    a = _activations(rng, 1, 96, "float16", one_d=True)
    out = cuda.device_array(7, np.float32)
    res = kb.gemv(cuda.to_device(a), qw, out=out, stream=cuda.stream())
    assert res is out
    check_close(out.copy_to_host()[None], a[None], qw.to_numpy())


@pytest.mark.parametrize("k, layout, M", [(4, "flat", 3), (3, "tiled", 1)])
def test_gemv_several_k_warps_and_persistent_loop(monkeypatch, k, layout, M):
    """The paths small simulator draws miss: K = 1056 (two K-warps, the second with one live lane, so the
    cross-warp sum runs) and one SM (a grid of 16 CTAs over more column groups, so each CTA walks the
    persistent loop several times and its prefetch of the next group runs)."""
    from kbit_numba import scalar_gemv
    monkeypatch.setattr(scalar_gemv, "sm_count", lambda: 1)
    rng = np.random.default_rng(k)
    N, K = (80, 1056) if layout == "flat" else (128, 1056)
    flat = ref.quantize(random_weight(rng, N, K), k=k)
    qw = flat if layout == "flat" else ref.repack_tiled(flat)
    A = _activations(rng, M, K, "float16")
    p = scalar_gemv.plan(A, qw, out_dtype=np.float32)
    step = p.steps[0]
    assert step.block == 64 and step.grid == 16 and -(-N // 2) > step.grid     # 2 K-warps, loops over groups
    check_close(p.launch().copy_to_host(), A, flat)


@pytest.mark.skipif(SIM, reason="the simulator has no register limit (and K = 14336 is slow there)")
@pytest.mark.parametrize("k, layout", [(5, "flat"), (4, "tiled")])
def test_gemv_long_k_at_m4_caps_registers(k, layout):
    """M = 4 at K = 14336 (a llama3-8b down projection): 448 threads per CTA do not fit the kernel's
    registers, so the plan recompiles it with a register cap (it failed to launch before)."""
    rng = np.random.default_rng(k)
    qw = ref.quantize(random_weight(rng, 128, 14336), k=k)
    A = _activations(rng, 4, 14336, "float16")
    out = kb.gemv(A, ref.repack_tiled(qw) if layout == "tiled" else qw)
    check_close(out.copy_to_host(), A, qw, False, np.float16)


def test_prepared_gemv_matches_and_rebinds_inputs():
    rng = np.random.default_rng(6)
    qw = kb.quantize(random_weight(rng, 9, 64), k=4)
    A = cuda.to_device(_activations(rng, 2, 64, "float16"))
    prep = kb.prepare_gemv(A, qw, out_dtype=np.float32)
    check_close(prep.run().copy_to_host(), A.copy_to_host(), qw.to_numpy())
    A2 = _activations(rng, 2, 64, "float16")
    A.copy_to_device(A2)                          # the next step's activations, same buffer
    check_close(prep.run().copy_to_host(), A2, qw.to_numpy())


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(M=5), ValueError, "M = 1..4"),
    (dict(K=96), ValueError, "K=96"),
    (dict(a_dtype=np.int8), TypeError, "dtype"),
    (dict(out_dtype=np.int32), TypeError, "float16 or float32"),
])
def test_gemv_rejects_bad_input(kwargs, err, match):
    qw = ref.quantize(np.ones((4, 64), np.float32), k=2)
    M, K = kwargs.get("M", 1), kwargs.get("K", 64)
    A = np.ones((M, K), kwargs.get("a_dtype", np.float16))
    with pytest.raises(err, match=match):
        kb.gemv(A, qw, out_dtype=kwargs.get("out_dtype", np.float16))
    with pytest.raises(TypeError, match="KbitWeight"):
        kb.gemv(np.ones((1, 64), np.float16), qw.packed)
    with pytest.raises(TypeError, match="device array"):       # results could never reach a NumPy out
        kb.gemv(np.ones((1, 64), np.float16), qw, out=np.zeros((1, 4), np.float16))


@pytest.mark.skipif(SIM, reason="CUDA graphs need a GPU")
def test_gemv_captured_in_torch_cuda_graph():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    W = random_weight(rng, 512, 2048)
    qw = kb.quantize(W, k=4)
    A = torch.randn(4, 2048, device="cuda", dtype=torch.float16)
    out = torch.empty(4, 512, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        prep = kb.prepare_gemv(A, qw, out=out, stream=side)
        prep.run()                                            # warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # defer_cleanup: a Numba array freed inside the capture (any garbage of earlier tests, when Numba's deallocation
    # queue fills) would be a cuMemFree there and invalidate it (seen once in the GPU suite, 2026-11-29)
    with cuda.defer_cleanup(), torch.cuda.graph(g):
        s = torch.cuda.current_stream()
        prep.run(stream=s)                                     # the prepared launch ...
        kb.gemv(A[:1], qw, out=out[:1], stream=s)              # ... and a plain one, both captured
    for _ in range(2):
        A.copy_(torch.randn(4, 2048, device="cuda", dtype=torch.float16))
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        check_close(out.cpu().numpy(), A.cpu().numpy(), qw.to_numpy(), out_dtype=np.float16)


# ---- grouped expert GEMV (MoE) ---------------------------------------------------------------------
def routed_case(rng, counts, N, K, k, layout):
    """A grouped call's inputs: a random [N, K] k-bit weight per entry of ``counts`` (the flat KbitWeights), the
    experts they make through ``layout`` (e.g. ``ref.to_codes``), stacked; int32 offsets for counts[e] rows of
    expert e; float16 activations for those rows ([0, K] when there are none). (flats, experts, offsets, A)"""
    flats = [ref.quantize(random_weight(rng, N, K), k=k) for _ in counts]
    experts = kb.stack_experts([layout(w) for w in flats])
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    T = int(offsets[-1])
    return flats, experts, offsets, _activations(rng, max(T, 1), K, "float16")[:T]


def _experts(rng, E, N, K, k, layout="flat"):
    ws = [ref.quantize(random_weight(rng, N, K), k=k) for _ in range(E)]
    if layout == "tiled":
        ws = [ref.repack_tiled(w) for w in ws]
    return kb.stack_experts(ws)


@gpu_split("k_split", KS)
# (each (k, max tokens, dtype) is a new compilation)
@settings(max_examples=gpu_examples(EXAMPLES if SIM else max(4, EXAMPLES // 2), len(KS)))
@given(seeds, variants((4, 2, 3, 5), (np.float16, np.float32), (4, 1, 2, 3)),
       st.lists(st.integers(0, 4), min_size=1, max_size=4 if SIM else 16), sizes(10, 4096),
       st.integers(1, MAX_KB // 2 + 1), out_modes)
def test_grouped_gemv(k_split, seed, v, counts, N, kbn, out_mode):
    """Tokens routed to experts (0..4 each, empty experts included) in one launch, into a fresh output or a
    view, on the default stream or another. The kernel is specialised for the largest expert's count: drawn as
    a variant (``most``), the largest drawn count becomes it and the others are capped by it."""
    k, out_dtype, most = v
    k = k_split or k
    if max(counts) > 0:
        top = counts.index(max(counts))
        counts = [most if i == top else min(c, most) for i, c in enumerate(counts)]
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    experts = _experts(rng, len(counts), N, K, k)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    A = rng.standard_normal((max(1, offsets[-1]), K)).astype(np.float16)[:offsets[-1]]
    if offsets[-1] == 0:
        A = np.zeros((0, K), np.float16)
    o = Out(out_mode, (int(offsets[-1]), N), out_dtype)
    got = o.host(kb.grouped_gemv(A, experts, offsets, out_dtype=out_dtype, **o.kwargs))
    assert got.shape == (offsets[-1], N)
    if offsets[-1]:
        want = ref.grouped_gemv(A, experts, offsets)
        Af = A.astype(np.float64)
        scale = np.zeros_like(want, dtype=np.float64)
        for e in range(len(counts)):
            t0, t1 = offsets[e], offsets[e + 1]
            scale[t0:t1] = np.abs(Af[t0:t1]) @ np.abs(ref.dequantize(experts.expert(e)).astype(np.float64)).T
        tol = 1e-5 * scale + (np.abs(want) * 2.0 ** -11 + 6e-8 if out_dtype == np.float16 else 1e-30)
        assert np.all(np.abs(got - want) <= tol)


def test_grouped_gemv_tiled_and_device_offsets():
    rng = np.random.default_rng(8)
    experts = _experts(rng, 3, 128, 64, 4, layout="tiled")
    offsets = np.array([0, 2, 2, 3], np.int32)
    A = rng.standard_normal((3, 64)).astype(np.float16)
    got = kb.grouped_gemv(cuda.to_device(A), experts, cuda.to_device(offsets), out_dtype=np.float32)
    np.testing.assert_allclose(got.copy_to_host(), ref.grouped_gemv(A, experts, offsets), rtol=1e-4, atol=1e-4)


def test_grouped_gemv_fewer_tokens_than_experts():
    """T < E (a decode step: most experts idle): one grid slot per row, each running the expert whose first row
    it is; empty experts before, between and after the active ones, and an expert with two rows."""
    rng = np.random.default_rng(10)
    experts = _experts(rng, 7, 9, 96, 3)
    offsets = np.array([0, 0, 2, 2, 3, 3, 4, 4], np.int32)       # T = 4 rows, 3 active experts of 7
    A = rng.standard_normal((4, 96)).astype(np.float16)
    got = kb.grouped_gemv(A, experts, cuda.to_device(offsets), out_dtype=np.float32).copy_to_host()
    np.testing.assert_allclose(got, ref.grouped_gemv(A, experts, offsets), rtol=1e-4, atol=1e-4)


def test_grouped_gemv_more_tokens_than_specialised_gives_nan_not_garbage():
    rng = np.random.default_rng(9)
    experts = _experts(rng, 2, 4, 32, 2)
    offsets = np.array([0, 3, 4], np.int32)
    A = rng.standard_normal((4, 32)).astype(np.float16)
    got = kb.grouped_gemv(A, experts, cuda.to_device(offsets), out_dtype=np.float32, max_tokens=2).copy_to_host()
    want = ref.grouped_gemv(A, experts, offsets)
    np.testing.assert_allclose(got[[0, 1, 3]], want[[0, 1, 3]], rtol=1e-4, atol=1e-4)
    assert np.all(np.isnan(got[2]))
    with pytest.raises(ValueError, match="up to 4 tokens"):
        kb.grouped_gemv(np.zeros((5, 32), np.float16), experts, np.array([0, 5, 5], np.int32))


def test_stack_experts_rejects_mixed_experts():
    a = ref.quantize(np.ones((4, 32), np.float32), k=2)
    b = ref.quantize(np.ones((4, 64), np.float32), k=2)
    with pytest.raises(ValueError, match="shape"):
        kb.stack_experts([a, b])
    with pytest.raises(TypeError):
        kb.stack_experts([])
