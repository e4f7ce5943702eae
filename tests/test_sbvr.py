"""SBVR: the encoder, the ballot activation quantizer and the popc GEMV against the reference."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kbit_numba import reference as ref, sbvr
from helpers import EXAMPLES, SIM, assert_within, gpu_examples, gpu_split, Out, out_modes, seeds

MAX_N = 40 if SIM else 300
MAX_G = 2 if SIM else 40           # K = 128 * g


def test_encoder_error_and_index_types():
    rng = np.random.default_rng(0)
    W = rng.standard_normal((160, 256)).astype(np.float32)     # 320 groups
    for lines, itype in ((64, np.uint8), (300, np.uint16)):
        sw = ref.sbvr_encode(W, lines=lines)
        assert sw.coeff_idx.dtype == itype and sw.coeff_cache.shape == (lines, 4)
        err = np.linalg.norm(ref.sbvr_dequantize(sw) - W) / np.linalg.norm(W)
        # 4 planes = 16 levels per group: well below a 3-bit uniform grid's error (~0.17 here)
        assert err < 0.15, err


@settings(max_examples=EXAMPLES)
@given(seeds, st.integers(1, 4), st.integers(1, 3), st.sampled_from(["float16", "float32"]))
def test_activation_planes_equal_reference(seed, M, g, a_dtype):
    rng = np.random.default_rng(seed)
    A = (rng.standard_normal((M, 128 * g)) * np.exp(rng.uniform(-3, 2, (M, 1)))).astype(a_dtype)
    A[0, :128] = 0                                                   # an all-zero group
    planes, d = sbvr.quantize_activations(A)
    _, dd, pp = ref.sbvr_quantize_activations(A)
    assert np.array_equal(planes.copy_to_host(), pp) and np.array_equal(d.copy_to_host(), dd)


@gpu_split("lines_split", [16, 1000])
@settings(max_examples=gpu_examples(EXAMPLES * 2, 2))
@given(seeds, st.integers(1, 4), st.integers(1, MAX_N), st.integers(1, MAX_G), st.sampled_from([16, 1000]),
       st.sampled_from([np.float16, np.float32]), out_modes)
def test_sbvr_gemv(lines_split, seed, M, N, g, lines, out_dtype, out_mode):
    lines = lines_split or lines
    rng = np.random.default_rng(seed)
    K = 128 * g
    sw = ref.sbvr_encode(rng.standard_normal((N, K)) * np.exp(rng.uniform(-3, 1, (N, 1))), lines=lines,
                         iters=2, kmeans_iters=2)
    A = rng.standard_normal((M, K)).astype(np.float16)
    o = Out(out_mode, (M, N), out_dtype)
    got = sbvr.gemv(A, sw, out_dtype=out_dtype, **o.kwargs)
    assert got.shape == (M, N) and got.dtype == np.dtype(out_dtype)
    want = ref.sbvr_gemv(A, sw)
    q, d, _ = ref.sbvr_quantize_activations(A)
    Aq = np.abs(q.astype(np.float64).reshape(M, -1, 128) * d[..., None]).reshape(M, K)
    tol = 1e-5 * (Aq @ np.abs(ref.sbvr_dequantize(sw)).astype(np.float64).T) + 1e-30
    assert_within(o.host(got), want, tol, out_dtype)


def test_rejects():
    sw = ref.sbvr_encode(np.ones((4, 128), np.float32), lines=4)
    with pytest.raises(ValueError, match="K"):
        sbvr.gemv(np.ones((1, 256), np.float16), sw)
    with pytest.raises(ValueError, match="M = 1..4"):
        sbvr.gemv(np.ones((5, 128), np.float16), sw)
    with pytest.raises(ValueError, match="K % 128"):
        ref.sbvr_encode(np.ones((4, 96), np.float32))


def test_prepared_run_rebinds_inputs():
    from numba import cuda
    rng = np.random.default_rng(7)
    sw = sbvr.encode(rng.standard_normal((40, 128)), lines=32)
    A = cuda.to_device(rng.standard_normal((2, 128)).astype(np.float16))
    prep = sbvr.prepare(A, sw, out_dtype=np.float32)
    for _ in range(2):
        want = ref.sbvr_gemv(A.copy_to_host(), sw.to_numpy())
        assert np.allclose(prep.run().copy_to_host(), want, rtol=1e-5, atol=1e-4)
        A.copy_to_device(rng.standard_normal((2, 128)).astype(np.float16))
