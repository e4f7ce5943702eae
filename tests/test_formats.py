"""The kbit format on the host: codebooks, E4M4, bit planes, reference quantize/dequantize."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import kbit_numba as kb
from kbit_numba import reference as ref
from helpers import ks, random_weight, seeds


def _ppf_bisect(p):
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_codebook_is_derived_normal_float(k):
    n = 1 << k
    v = np.array([_ppf_bisect(p) for p in np.linspace(0.5 / n, 1 - 0.5 / n, n)])
    want = (v / np.abs(v).max()).astype(np.float32)
    cb = kb.codebook(k)
    assert cb.dtype == np.float32 and cb.shape == (n,)
    np.testing.assert_array_equal(cb, want)
    assert np.all(np.diff(cb) > 0) and np.all(cb != 0)
    np.testing.assert_array_equal(cb, -cb[::-1])


def test_codebook_published_values():
    np.testing.assert_allclose(kb.codebook(2), [-1, -0.2770, 0.2770, 1], atol=1e-4)
    pos = [0.0421, 0.1273, 0.2159, 0.3109, 0.4168, 0.5422, 0.7076, 1.0]
    np.testing.assert_allclose(kb.codebook(4)[8:], pos, atol=1e-4)


def test_e4m4_every_byte_round_trips():
    b = np.arange(256, dtype=np.uint8)
    v = kb.e4m4_decode(b)
    assert v[0] == 0 and np.all(np.diff(v) > 0)          # monotonic: no two bytes share a value
    np.testing.assert_array_equal(kb.e4m4_encode(v), b)
    assert v[255] == 31.0 and v[1] == np.float32(2.0 ** -14)


def test_e4m4_known_values_and_rounding():
    assert kb.e4m4_decode(np.uint8(11 << 4)) == 1.0          # e = bias, m = 0
    assert kb.e4m4_encode(np.float32(1.0)) == 11 << 4
    # 1 + 1/32 lies half-way between m=0 and m=1: ties to even (m=0); just above rounds up
    assert kb.e4m4_encode(np.float32(1 + 1 / 32)) == 11 << 4
    assert kb.e4m4_encode(np.float32(1 + 1 / 32 + 1e-6)) == (11 << 4) | 1
    assert kb.e4m4_encode(np.float32(1e6)) == 255 and kb.e4m4_encode(np.float32(0)) == 0


@given(st.floats(min_value=2.0 ** -10, max_value=30.0))
def test_e4m4_relative_error_normal_range(v):
    """Normal bytes (e >= 1, values >= 2**-10): half a mantissa step, 1/32 relative."""
    v = np.float32(v)
    d = kb.e4m4_decode(kb.e4m4_encode(v))
    assert abs(float(d) - float(v)) <= float(v) / 32 * (1 + 1e-6)


@given(st.floats(min_value=0.0, max_value=2.0 ** -10))
def test_e4m4_absolute_error_subnormal_range(v):
    """Subnormal bytes (e = 0): steps of 2**-14, rounded to nearest (half a step) except just under
    2**-10, where the mantissa clamps at 15 instead of carrying into the exponent (the bitsandbytes
    rule): there the error reaches one step."""
    v = np.float32(v)
    d = kb.e4m4_decode(kb.e4m4_encode(v))
    half_step = 2.0 ** -15 if float(v) < 15.5 * 2.0 ** -14 else 2.0 ** -14
    assert abs(float(d) - float(v)) <= half_step * (1 + 1e-6)


@given(seeds, ks, st.integers(1, 20))
def test_bitplanes_round_trip(seed, k, nblocks):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, 1 << k, size=(nblocks, 32))
    words = ref.pack_bitplanes(idx, k)
    assert words.dtype == np.uint32 and words.shape == (nblocks, k)
    np.testing.assert_array_equal(ref.unpack_bitplanes(words, k), idx)
    # element j of word b is bit j: check one element by hand
    j, b = 5, k - 1
    assert (int(words[0, b]) >> j) & 1 == (int(idx[0, j]) >> b) & 1


@given(seeds, ks, st.integers(1, 9), st.integers(1, 6), st.sampled_from(["e4m4", "fp32"]))
def test_reference_error_bound(seed, k, N, kbn, fmt):
    rng = np.random.default_rng(seed)
    W = random_weight(rng, N, 32 * kbn)
    qw = ref.quantize(W, k=k, absmax_format=fmt)
    err = np.abs(W - ref.dequantize(qw)).reshape(-1, 32).max(axis=1)
    bound = ref.block_error_bound(qw, W)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-30)


def test_zero_blocks_dequantize_to_zero():
    W = np.zeros((2, 64), np.float32)
    W[1, 32:] = 1.0
    qw = ref.quantize(W, k=3)
    assert qw.absmax[0] == 0 and qw.absmax[2] == 0
    np.testing.assert_array_equal(ref.dequantize(qw)[0], 0)


@given(seeds, ks, st.integers(1, 3), st.integers(1, 5))
def test_tiled_round_trip(seed, k, ntiles, kbn):
    rng = np.random.default_rng(seed)
    W = random_weight(rng, 128 * ntiles, 32 * kbn)
    flat = ref.quantize(W, k=k)
    tiled = ref.repack_tiled(flat)
    assert tiled.layout == "tiled" and tiled.packed.size == 128 * ntiles * (-(-kbn // 2) * 2) * k
    back = ref.to_flat(tiled)
    np.testing.assert_array_equal(back.packed, flat.packed)
    np.testing.assert_array_equal(ref.dequantize(tiled), ref.dequantize(flat))


def test_tiled_index_formula_by_hand():
    # column 130 (tile 1, col 2), block 3 (k_tile 1, kb 1), N = 256 -> tile = 1*2 + 1 = 3
    from kbit_numba.formats import tiled_absmax_index, tiled_word_index
    assert tiled_word_index(130, 3, 2, 256, 4) == 3 * (128 * 2 * 4) + (2 * 2 + 1) * 4 + 2
    assert tiled_absmax_index(130, 3, 256) == 3 * 256 + 2 * 2 + 1


def test_reference_gemv_matches_matmul():
    rng = np.random.default_rng(1)
    W = random_weight(rng, 16, 96)
    A = rng.standard_normal((3, 96)).astype(np.float32)
    qw = ref.quantize(W, k=4)
    np.testing.assert_allclose(ref.gemv(A, qw), A @ ref.dequantize(qw).T, rtol=1e-5, atol=1e-5)


def test_bf16_bits_round_trip():
    x = np.array([1.0, -2.5, 3.140625, 0.0], np.float32)
    np.testing.assert_array_equal(ref.bf16_bits_to_float32(ref.float32_to_bf16_bits(x)), x)


@pytest.mark.parametrize("bad, err", [
    (dict(k=6), ValueError), (dict(k=1), ValueError), (dict(codebook=np.zeros(3)), ValueError),
    (dict(codebook=np.array([1, 0.5, -0.5, -1.0])), ValueError),
    (dict(codebook=np.array([-2, -0.5, 0.5, 1.0])), ValueError)])
def test_reference_rejects_bad_arguments(bad, err):
    args = dict(k=2)
    args.update(bad)
    with pytest.raises(err):
        ref.quantize(np.ones((2, 32), np.float32), **args)


def test_kbitweight_validates():
    qw = ref.quantize(np.ones((2, 64), np.float32), k=2)
    with pytest.raises(ValueError, match="packed"):
        kb.KbitWeight(qw.packed[:-1], qw.absmax, qw.codebook, 2, (2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        kb.KbitWeight(qw.packed, qw.absmax, qw.codebook, 2, (4, 48))
    with pytest.raises(ValueError, match="N % 128"):
        kb.KbitWeight(qw.packed, qw.absmax, qw.codebook, 2, (2, 64), layout="tiled")
    assert qw.nbytes == 4 * (4 * 2 + 1)


@given(N=st.integers(1, 6), blocks=st.integers(1, 6), k=st.sampled_from((2, 3, 4, 5)),
       absmax_format=st.sampled_from(("e4m4", "fp32")))
def test_kbit_nbytes_is_a_weights_nbytes(N, blocks, k, absmax_format):
    """``formats.kbit_nbytes`` (the benchmarks' byte counts, no weight needed) equals the quantized weight's."""
    from kbit_numba.formats import kbit_nbytes
    qw = ref.quantize(np.ones((N, 32 * blocks), np.float32), k=k, absmax_format=absmax_format)
    nbytes = kbit_nbytes(N, 32 * blocks, k, absmax_format)
    assert nbytes == qw.nbytes == qw.packed.nbytes + qw.absmax.nbytes
