"""``calibrate.quantize_gptq`` (NumPy, host): kbit bytes chosen with a layer's calibration inputs in mind."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kbit_numba as kb
from kbit_numba import reference as ref
from kbit_numba.calibrate import (E4M4_VALUES, fit_codebook, output_error, quantize_gptq, refine_indices,
                                  refit_scales)
from helpers import EXAMPLES, PTX_ONLY, ks, seeds

pytestmark = pytest.mark.skipif(PTX_ONLY, reason="not a PTX check")


def _inputs(rng, rows, K):
    """Correlated inputs (as a layer's are): X = Z (I + 0.9 G / sqrt(K))."""
    return rng.standard_normal((rows, K)) @ (np.eye(K) + 0.9 * rng.standard_normal((K, K)) / np.sqrt(K))


def _rtn_over_scale(W, k):
    """Nearest codebook value over the decoded E4M4 scale of each block's absmax."""
    cb = kb.codebook(k).astype(np.float64)
    B = W.reshape(-1, 32).astype(np.float64)
    s = kb.e4m4_decode(kb.e4m4_encode(np.abs(B).max(1))).astype(np.float64)
    y = B / s[:, None]
    return (cb[np.abs(y[..., None] - cb).argmin(-1)] * s[:, None]).reshape(W.shape)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_gptq_bytes_are_kbit_and_lower_the_output_error(k):
    rng = np.random.default_rng(k)
    N, K = 40, 160
    W = kb.reference.as_float32(rng.standard_normal((N, K)))
    X = _inputs(rng, 600, K)
    out_err = lambda Wq: np.linalg.norm((W - Wq) @ X.T)
    rtn = ref.dequantize(ref.quantize(W, k=k))
    for act_order in (False, True):
        for scale_search in (False, True):
            qw = quantize_gptq(W, X.T @ X, k=k, act_order=act_order, scale_search=scale_search)
            assert (qw.k, qw.shape, qw.layout, qw.absmax_format) == (k, (N, K), "flat", "e4m4")
            assert qw.packed.dtype == np.uint32 and qw.absmax.dtype == np.uint8
            assert qw.nbytes == ref.quantize(W, k=k).nbytes
            Wq = ref.dequantize(qw)                 # the format's own decoder reads the bytes
            assert out_err(Wq) < 0.9 * out_err(rtn), (act_order, scale_search)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_refined_scales_lower_the_output_error(k):
    """refit_scales never raises any row's output error, and quantize_gptq(refine=2) ends below refine=0 (it keeps
    the best round) on correlated inputs, in the same bytes."""
    rng = np.random.default_rng(10 + k)
    N, K = 24, 128
    W = rng.standard_normal((N, K))
    X = _inputs(rng, 500, K) * np.exp(rng.standard_normal(K))      # inputs of unequal energy, as a layer's are
    H = X.T @ X
    cb = kb.codebook(k).astype(np.float64)

    def error(qw):                                        # in float64 (ref.dequantize rounds to float32)
        idx = ref.unpack_bitplanes(qw.packed.reshape(-1, k), k).reshape(N, K)
        return idx, output_error(W, cb[idx] * np.repeat(E4M4_VALUES[qw.absmax.reshape(N, -1)], 32, axis=1), H)

    q0 = quantize_gptq(W, H, k=k)
    idx, e0 = error(q0)                                   # GPTQ's indices, held while the scales move
    absmax = refit_scales(W, idx, q0.absmax.reshape(N, -1), cb, H)
    e1 = output_error(W, cb[idx] * np.repeat(E4M4_VALUES[absmax], 32, axis=1), H)
    assert np.all(e1 <= e0 * (1 + 1e-9)) and e1.sum() < 0.99 * e0.sum()
    q2 = quantize_gptq(W, H, k=k, refine=2)
    assert q2.nbytes == q0.nbytes and q2.absmax.dtype == np.uint8
    assert error(q2)[1].sum() < e0.sum()


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_refined_indices_lower_the_output_error(k):
    """refine_indices never raises any row's output error (scales and codebook held), lowers the total on correlated
    inputs, and quantize_gptq(index_sweeps=2) ends below index_sweeps=0 with the same scales and bytes."""
    rng = np.random.default_rng(20 + k)
    N, K = 24, 128
    W = rng.standard_normal((N, K))
    X = _inputs(rng, 500, K) * np.exp(rng.standard_normal(K))
    H = X.T @ X
    cb = kb.codebook(k).astype(np.float64)

    def error(qw):
        idx = ref.unpack_bitplanes(qw.packed.reshape(-1, k), k).reshape(N, K)
        return idx, output_error(W, cb[idx] * np.repeat(E4M4_VALUES[qw.absmax.reshape(N, -1)], 32, axis=1), H)

    q0 = quantize_gptq(W, H, k=k, damp=0.01)
    idx, e0 = error(q0)
    scale = E4M4_VALUES[q0.absmax.reshape(N, -1)]
    idx1 = refine_indices(W, idx, scale, cb, H)
    e1 = output_error(W, cb[idx1] * np.repeat(scale, 32, axis=1), H)
    assert idx1.dtype == np.uint8 and idx1.max() < 2 ** k and np.array_equal(idx, error(q0)[0])   # (input kept)
    assert np.all(e1 <= e0 * (1 + 1e-9)) and e1.sum() < 0.99 * e0.sum()
    q2 = quantize_gptq(W, H, k=k, damp=0.01, index_sweeps=2)
    assert q2.nbytes == q0.nbytes and np.array_equal(q2.absmax, q0.absmax)
    assert error(q2)[1].sum() < e0.sum()


def test_gptq_without_correlations_is_round_to_nearest():
    """A diagonal Hessian feeds no error forward: in column order without the scale search every weight is its
    nearest codebook value over its block's scale."""
    rng = np.random.default_rng(7)
    W = rng.standard_normal((16, 96)).astype(np.float32)
    qw = quantize_gptq(W, np.diag(rng.uniform(0.5, 2.0, 96)), k=4, act_order=False, scale_search=False)
    np.testing.assert_allclose(ref.dequantize(qw), _rtn_over_scale(W, 4), rtol=1e-6)


@settings(max_examples=EXAMPLES)
@given(seeds, ks, st.integers(1, 20), st.integers(1, 6))
def test_gptq_property_diagonal_hessian_is_round_to_nearest(seed, k, N, kb_):
    """Any shape and k: with a diagonal Hessian (no feedback), column order and no scale search, the bytes decode
    to the nearest codebook value over each block's E4M4 scale, and every byte array has the format's size."""
    rng = np.random.default_rng(seed)
    K = 32 * kb_
    W = rng.standard_normal((N, K)).astype(np.float32) * np.exp(rng.uniform(-4, 2, (N, 1))).astype(np.float32)
    qw = quantize_gptq(W, np.diag(rng.uniform(0.1, 10.0, K)), k=k, act_order=False, scale_search=False)
    assert qw.packed.size == N * kb_ * k and qw.absmax.size == N * kb_
    np.testing.assert_allclose(ref.dequantize(qw), _rtn_over_scale(W, k), rtol=1e-6, atol=0)


def test_gptq_refuses_bad_input():
    W = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError, match="K a positive multiple"):
        quantize_gptq(np.ones((4, 40)), np.eye(40))
    with pytest.raises(ValueError, match="hessian"):
        quantize_gptq(W, np.eye(32))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_gptq(np.full((4, 64), np.nan), np.eye(64))
    with pytest.raises(ValueError, match="damp"):
        quantize_gptq(W, np.eye(64), damp=0)
    with pytest.raises(ValueError):
        quantize_gptq(W, np.eye(64), k=6)


def test_the_gemv_kernel_reads_gptq_bytes():
    """The bytes go through the GPU path unchanged (the simulator in CI): the scalar gemv equals the reference
    gemv on them."""
    rng = np.random.default_rng(11)
    W = rng.standard_normal((12, 64)).astype(np.float32)
    X = _inputs(rng, 200, 64)
    qw = quantize_gptq(W, X.T @ X, k=3)
    A = rng.standard_normal((1, 64)).astype(np.float16)
    got = kb.gemv(A, qw.to_device(), out_dtype=np.float32).copy_to_host()
    np.testing.assert_allclose(got.reshape(1, -1), ref.gemv(A, qw), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_fitted_codebook_is_valid_and_lowers_the_weighted_error(k):
    """``fit_codebook``: 2**k sorted values in [-1, 1] (quantize_gptq and the reference take it), and round to
    nearest with it has no more Hessian-weighted squared error than with the format's codebook (Lloyd's steps
    never raise it); on heavy-tailed (Student t) weights strictly less."""
    rng = np.random.default_rng(10 + k)
    W = rng.standard_t(3, size=(48, 128))
    H = np.diag(rng.uniform(0.1, 4.0, 128))
    cb = fit_codebook(W, k, H)
    assert cb.dtype == np.float32 and cb.shape == (1 << k,) and np.all(np.diff(cb) >= 0) and np.abs(cb).max() <= 1

    def weighted_error(codebook):
        qw = ref.quantize(W, k=k, codebook=codebook)
        return float((((ref.dequantize(qw) - W) ** 2) * np.diag(H)).sum())
    assert weighted_error(cb) < weighted_error(None)
    qw = quantize_gptq(W, H, k=k, codebook=cb)
    assert np.array_equal(qw.codebook, cb) and np.isfinite(ref.dequantize(qw)).all()


def test_asymmetric_target_aims_at_the_float_models_output():
    """``asymmetric_target``: with the float model's inputs it is W; otherwise it solves its ridge problem (the
    gradient of |Xf W^T - X W*^T|^2 + lambda |W* - W|^2 vanishes there) and its output on the quantized inputs is
    closer to the float model's than W's is (its refusals: tests/test_refusals.py)."""
    from kbit_numba.calibrate import asymmetric_target
    rng = np.random.default_rng(9)
    W = rng.standard_normal((24, 64))
    Xf = rng.standard_normal((300, 64)) * np.linspace(0.1, 3, 64)      # anisotropic inputs, as a model's are
    X = Xf + 0.2 * rng.standard_normal(Xf.shape)                       # what the quantized layers before it give
    assert np.allclose(asymmetric_target(W, Xf, Xf, 0.01), W)
    for damp in (0.01, 0.1):
        Ws = asymmetric_target(W, Xf, X, damp)
        lam = damp * np.mean(np.sum(X * X, axis=0))
        grad = (X @ Ws.T - Xf @ W.T).T @ X + lam * (Ws - W)
        assert np.abs(grad).max() < 1e-8 * np.abs(Xf @ W.T).max() * np.abs(X).max() * len(X)
        err = lambda V: np.linalg.norm(Xf @ W.T - X @ V.T)
        assert err(Ws) < 0.9 * err(W)
