"""GPU quantize / dequantize / repack against the NumPy reference (simulator in CI, GPU otherwise)."""
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from numba import cuda

import kbit_numba as kb
from kbit_numba import reference as ref
from helpers import (EXAMPLES, MAX_KB, MAX_KB_TILED, MAX_N, MAX_TILES, Out, out_modes, SIM_EXPLICIT_ONLY, ks,
                     random_weight, seeds, sizes, take_rows, weight_kinds, weight_rows)

fmts = st.sampled_from(["e4m4", "fp32"])
src_dtypes = st.sampled_from(["float32", "float16", "bfloat16"])


def _src(W, src):
    if src == "bfloat16":
        return ref.float32_to_bf16_bits(W), True
    return W.astype(src), False


@settings(max_examples=EXAMPLES)
@given(seeds, ks, sizes(MAX_N, 20000), sizes(MAX_KB, 512), fmts, src_dtypes, weight_kinds, out_modes)
def test_quantize_flat_bit_exact(seed, k, N, kbn, fmt, src, kind, out_mode):
    """The GPU quantizer's bytes are the reference's, and dequantize gives its values (rounded once to the output
    type), into a fresh array or a preallocated view, on the default or another stream. (A large draw's rows repeat
    a pool's: helpers.weight_rows; the reference runs over the pool.)"""
    rng = np.random.default_rng(seed)
    pool, rows = weight_rows(rng, N, 32 * kbn, kind)
    W, bf16 = _src(pool[rows], src)
    got = kb.quantize(W, k=k, absmax_format=fmt, bf16=bf16)
    assert got.on_device and got.layout == "flat"
    want = take_rows(ref.quantize(_src(pool, src)[0], k=k, absmax_format=fmt, bf16=bf16), rows)
    host = got.to_numpy()
    np.testing.assert_array_equal(host.packed, want.packed)
    np.testing.assert_array_equal(host.absmax, want.absmax)
    # dequantised values: the reference's, rounded once to the output dtype
    values = ref.dequantize(want)
    o = Out(out_mode, W.shape, np.float32)
    np.testing.assert_array_equal(o.host(kb.dequantize(got, dtype=np.float32, **o.kwargs)), values)
    np.testing.assert_array_equal(kb.dequantize(got).copy_to_host(), values.astype(np.float16))


@settings(max_examples=EXAMPLES, **SIM_EXPLICIT_ONLY)
@given(seeds, ks, st.integers(1, MAX_TILES), st.integers(1, MAX_KB_TILED), fmts)
@example(seed=1, k=2, ntiles=1, kbn=3, fmt="e4m4")      # K = 96 pads to two K tiles: a zero padding block
@example(seed=2, k=5, ntiles=1, kbn=2, fmt="fp32")
def test_quantize_tiled_bit_exact(seed, k, ntiles, kbn, fmt):
    rng = np.random.default_rng(seed)
    W = random_weight(rng, 128 * ntiles, 32 * kbn)
    flat = ref.quantize(W, k=k, absmax_format=fmt)   # (the GPU's flat quantize is bit-exact: tested above)
    want = ref.repack_tiled(flat)
    for got in (kb.quantize(W, k=k, absmax_format=fmt, layout="tiled"), kb.repack_tiled(flat)):
        host = got.to_numpy()
        assert host.layout == "tiled"
        np.testing.assert_array_equal(host.packed, want.packed)
        np.testing.assert_array_equal(host.absmax, want.absmax)
    np.testing.assert_array_equal(kb.dequantize(want, dtype=np.float32).copy_to_host(), ref.dequantize(want))


@settings(max_examples=EXAMPLES)
@given(seeds, ks, st.integers(1, MAX_N), st.integers(1, MAX_KB), fmts,
       st.sampled_from([1e-6, 1e-3, 1.0, 25.0, 1e4]))
def test_dequantize_error_bound(seed, k, N, kbn, fmt, scale):
    """Every block's error is within half the largest codebook gap times its absmax, plus the
    E4M4 rounding of the absmax (reference.block_error_bound), at extreme magnitudes too."""
    rng = np.random.default_rng(seed)
    W = random_weight(rng, N, 32 * kbn, scale=scale)
    qw = kb.quantize(W, k=k, absmax_format=fmt)
    err = np.abs(W - kb.dequantize(qw, dtype=np.float32).copy_to_host()).reshape(-1, 32).max(axis=1)
    bound = ref.block_error_bound(qw.to_numpy(), W)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-30)


@settings(max_examples=EXAMPLES)
@given(seeds, st.sampled_from([2, 4]), st.integers(1, MAX_N), st.integers(1, MAX_KB), fmts,
       st.sampled_from([np.float16, np.float32]), st.sampled_from(["codes", "fragments"]))
def test_dequantize_code_layout(seed, k, N, kbn, fmt, dtype, layout):
    """The code layout (KbitCodes) and the fragment layout (KbitFragments: N rounded up to 16 and K to 256, whole
    tiles) dequantize to exactly what their flat twin does."""
    rng = np.random.default_rng(seed)
    N, K = (-(-N // 16) * 16, -(-kbn // 8) * 256) if layout == "fragments" else (N, 32 * kbn)
    flat = ref.quantize(random_weight(rng, N, K), k=k, absmax_format=fmt)
    native = ref.to_fragments(flat) if layout == "fragments" else ref.to_codes(flat)
    got = kb.dequantize(native, dtype=dtype).copy_to_host()
    np.testing.assert_array_equal(got, ref.dequantize(flat).astype(dtype))


@pytest.mark.parametrize("k, fmt, dtype", [(2, "e4m4", np.float16), (4, "fp32", np.float32), (4, "e4m4", "bfloat16")])
def test_dequantize_fragment_layout(k, fmt, dtype):
    """The fragment layout (KbitFragments: the code layout's blocks permuted) dequantizes to exactly what its flat
    twin does: 2 x 2 tiles of 16 columns x 256 (a wrong block position moves whole blocks and fails it)."""
    rng = np.random.default_rng(k)
    flat = ref.quantize(random_weight(rng, 32, 512), k=k, absmax_format=fmt)
    want = ref.dequantize(flat)
    want = ref.float32_to_bf16_bits(want) if dtype == "bfloat16" else want.astype(dtype)
    np.testing.assert_array_equal(kb.dequantize(ref.to_fragments(flat), dtype=dtype).copy_to_host(), want)


@pytest.mark.parametrize("layout, k", [("flat", 5), ("codes", 2)])
def test_dequantize_chunks_of_a_thread(layout, k):
    """A thread writes several 8-output chunks (``chunks``), all loaded before any is decoded. 480 chunks in a
    CTA of 3 x 256: the second chunk is partly written, the third not at all. (Larger draws of the tests
    above cover full CTAs on the GPU; the tiled layout's examples cover it on the simulator.)"""
    rng = np.random.default_rng(k)
    flat = ref.quantize(random_weight(rng, 40, 96), k=k)
    qw = ref.to_codes(flat) if layout == "codes" else flat
    got = kb.codec.plan_dequantize(qw, np.float16, chunks=3).launch().copy_to_host()
    np.testing.assert_array_equal(got, ref.dequantize(flat).astype(np.float16))


@pytest.mark.parametrize("layout, k", [("flat", 3), ("tiled", 5), ("codes", 4), ("codes", 2)])
def test_dequantize_to_bfloat16(layout, k):
    """dtype="bfloat16": each reference value rounded once to the nearest bfloat16, as int16 bits (dequantize +
    cuBLAS for bfloat16 activations); an int16 out asks for the same."""
    rng = np.random.default_rng(k)
    W = random_weight(rng, 128 if layout == "tiled" else 24, 64)
    flat = ref.quantize(W, k=k)
    qw = ref.to_codes(flat) if layout == "codes" else ref.repack_tiled(flat) if layout == "tiled" else flat
    want = ref.float32_to_bf16_bits(ref.dequantize(flat))
    got = kb.dequantize(qw, dtype="bfloat16")
    assert got.dtype == np.int16
    np.testing.assert_array_equal(got.copy_to_host(), want)
    out = cuda.device_array(W.shape, np.int16)
    kb.dequantize(qw, out=out)
    np.testing.assert_array_equal(out.copy_to_host(), want)


def test_user_codebook_and_zero_blocks():
    cb = np.array([-1, -0.1, 0.2, 0.9], np.float32)
    W = np.zeros((3, 64), np.float32)
    W[1] = np.linspace(-2, 2, 64)
    qw = kb.quantize(W, k=2, codebook=cb)
    want = ref.quantize(W, k=2, codebook=cb)
    np.testing.assert_array_equal(qw.to_numpy().packed, want.packed)
    host = kb.dequantize(qw, dtype=np.float32).copy_to_host()
    np.testing.assert_array_equal(host[0], 0)
    np.testing.assert_array_equal(host, ref.dequantize(want))


def test_device_inputs_and_preallocated_out():
    rng = np.random.default_rng(3)
    W = random_weight(rng, 4, 64).astype(np.float16)
    qw = kb.quantize(cuda.to_device(W), k=4)                  # a Numba device array, no copy
    out = cuda.device_array((4, 64), np.float16)
    res = kb.dequantize(qw, out=out, stream=cuda.stream())
    assert res is out
    np.testing.assert_array_equal(out.copy_to_host(), ref.dequantize(ref.quantize(W, k=4)).astype(np.float16))
    # a KbitWeight of NumPy arrays is accepted too (copied to the device)
    np.testing.assert_array_equal(kb.dequantize(qw.to_numpy()).copy_to_host(), out.copy_to_host())


@pytest.mark.skipif(kb.SIMULATOR, reason="torch tensors reach kernels through the CUDA array interface (GPU only)")
def test_torch_tensor_zero_copy():
    torch = pytest.importorskip("torch")
    W = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    qw = kb.quantize(W.view(torch.int16), k=4, bf16=True)
    want = ref.quantize(W.view(torch.int16).cpu().numpy(), k=4, bf16=True)
    np.testing.assert_array_equal(qw.to_numpy().packed, want.packed)
    out = torch.empty(128, 256, device="cuda", dtype=torch.float16)
    kb.dequantize(qw, out=out)
    np.testing.assert_array_equal(out.cpu().numpy(), ref.dequantize(want).astype(np.float16))


@pytest.mark.parametrize("W, kwargs, err, match", [
    (np.ones((2, 48), np.float32), {}, ValueError, "multiple of 32"),
    (np.ones((2, 64), np.float32), dict(k=7), ValueError, "k must be"),
    (np.ones((2, 64), np.float32), dict(codebook=np.linspace(-1, 1, 8)), ValueError, "shape"),
    (np.ones((2, 64), np.float32), dict(layout="tiled"), ValueError, "N % 128"),
    (np.ones((2, 64), np.float32), dict(layout="diagonal"), ValueError, "layout"),
    (np.ones((2, 64), np.float64), {}, TypeError, "dtype"),
    (np.ones((2, 64), np.int32), {}, TypeError, "dtype"),
    (np.ones(64, np.float32), {}, ValueError, "2-D"),
    (np.ones((2, 128), np.float32)[:, ::2], {}, ValueError, "contiguous"),
    (np.full((2, 64), np.nan, np.float32), {}, ValueError, "NaN"),
    ([[1.0] * 32], {}, TypeError, "NumPy array"),
])
def test_quantize_rejects_bad_input(W, kwargs, err, match):
    with pytest.raises(err, match=match):
        kb.quantize(W, **kwargs)


def test_nan_on_device_is_reported():
    W = np.ones((2, 64), np.float32)
    W[1, 3] = np.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        kb.quantize(cuda.to_device(W))


def test_dequantize_rejects_bad_input():
    qw = ref.quantize(np.ones((2, 64), np.float32), k=2)
    with pytest.raises(TypeError, match="float16 or float32"):
        kb.dequantize(qw, dtype=np.int8)
    with pytest.raises(ValueError, match="shape"):
        kb.dequantize(qw, out=cuda.device_array((2, 32), np.float16))
    with pytest.raises(TypeError, match="KbitWeight"):
        kb.dequantize(qw.packed)
    with pytest.raises(ValueError, match="N % 128"):
        kb.repack_tiled(qw)
