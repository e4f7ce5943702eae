"""GemLite-style uniform n-bit: packing, the GPU quantizer and both GEMV paths against the reference."""
import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from numba import cuda

from kbit_numba import act_quant, reference as ref, uniform
from kbit_numba.formats import UNIFORM_BITS
from helpers import (EXAMPLES, SIM, adversarial_weight, assert_within, gpu_examples, gpu_split, Out, out_modes, seeds,
                     sizes, variants, weight_kinds, weight_rows)

MAX_N = 5 if SIM else 300
MAX_KB = 10 if SIM else 140        # K = 32 * kb: 3-bit chunks of 320 padded, several K-warps on the GPU
bits_st = st.sampled_from(UNIFORM_BITS)


def _case(draw_seed, bits, kbn, gsel):
    """K = 32 * kbn and a group size dividing it (or per tensor)."""
    K = 32 * kbn
    groups = [g for g in (32, 64, 128) if K % g == 0] + [None]
    return K, groups[gsel % len(groups)]


@settings(max_examples=EXAMPLES * 3)
@given(seeds, bits_st, st.integers(1, 4), st.integers(1, 12), st.integers(0, 3))
def test_pack_roundtrip_and_quantizer_error(seed, bits, N, kbn, gsel):
    rng = np.random.default_rng(seed)
    K, G = _case(seed, bits, kbn, gsel)
    W = rng.standard_normal((N, K)).astype(np.float32)
    uw = ref.uniform_quantize(W, bits, G)
    q = ref.uniform_unpack(uw.packed, bits, K)
    assert q.max() < 2 ** bits and np.array_equal(ref.uniform_pack(q, bits), uw.packed)
    # round to nearest: each weight within half a step of its own group's stored scale, plus the float16
    # zero's and scale's rounding (each at most 2**bits * 2**-11 steps, at the clipped ends of the range)
    sz = uw.scale_zero.astype(np.float32)
    step = np.repeat(sz[..., 0], G, axis=1) if G else np.full((N, K), sz[0, 0, 0])
    err = np.abs(ref.uniform_dequantize(uw) - W)
    bound = (0.5 + 2e-3 * (2 ** bits)) * step + 1e-6
    assert np.all(err <= bound), f"max error / step {np.max(err / step)}"


@gpu_split("bits_split", UNIFORM_BITS)
@settings(max_examples=gpu_examples(EXAMPLES * 2, len(UNIFORM_BITS)))
@given(seeds, variants(sorted(UNIFORM_BITS, key=lambda b: b != 4), (1, 2, 3, 4), (0, 1, 2, 3), (False, True),
                ("float16", "float32", "bfloat16"), (np.float16, np.float32)),
       sizes(MAX_N, 20000), sizes(MAX_KB, 512), weight_kinds, out_modes)
def test_uniform_gemv(bits_split, seed, v, N, kbn, kind, out_mode):
    bits, M, gsel, int8, a_dtype, out_dtype = v   # (gsel: the group size, one of those dividing K)
    bits = bits_split or bits
    rng = np.random.default_rng(seed)
    K, G = _case(seed, bits, kbn, gsel)
    W, rows = weight_rows(rng, N, K, kind)       # (a large draw: rows of a pool, checked over the pool)
    pool = ref.uniform_quantize(W, bits, G)
    uw = dataclasses.replace(pool, packed=pool.packed[rows], shape=(N, K),
                             scale_zero=pool.scale_zero[rows] if G else pool.scale_zero)
    A = rng.standard_normal((M, K)).astype(np.float32)
    bf16 = a_dtype == "bfloat16"
    A = ref.float32_to_bf16_bits(A) if bf16 else A.astype(a_dtype)
    o = Out(out_mode, (M, N), out_dtype)
    got = uniform.gemv(A, uw, out_dtype=out_dtype, int8=int8, bf16=bf16, **o.kwargs)
    assert got.shape == (M, N) and got.dtype == np.dtype(out_dtype)
    want = ref.uniform_gemv(A, pool, int8=int8, bf16=bf16)[:, rows]
    Af = np.abs(ref.as_float32(A, bf16)).astype(np.float64)
    tol = 2e-5 * (Af @ np.abs(ref.uniform_dequantize(pool)).astype(np.float64).T)[:, rows] + 1e-30
    if int8 and bits == 8:
        # the dp4a path shifts 8-bit q and the zero by 128 (signed bytes): the float32 zero - 128 keeps the zero
        # to 2**-17 absolute, so a group whose w = (q - zero) * scale is far below its scale (a near-zero zero
        # point, the subnormal draws) has an error up to 2**-17 |scale| sum |a| beyond float32 accumulation
        scales = np.abs(ref.uniform_dequantize(dataclasses.replace(
            pool, packed=np.zeros_like(pool.packed), scale_zero=np.stack(
                [pool.scale_zero[..., 0], np.full_like(pool.scale_zero[..., 0], -1)], axis=-1))))
        tol = tol + 2.0 ** -16 * (Af @ scales.astype(np.float64).T)[:, rows]
    assert_within(o.host(got), want, tol, out_dtype)


@pytest.mark.skipif(SIM, reason="the simulator has no register limit (and K = 14336 is slow there)")
@pytest.mark.parametrize("int8", [False, True])
def test_uniform_gemv_long_k_at_m4(int8):
    """M = 4 at K = 14336 (a llama3-8b down projection, 4-bit g128): the launch failed with
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES until the plan capped the registers (core.fit_threads; bench --model)."""
    rng = np.random.default_rng(4)
    uw = ref.uniform_quantize(rng.standard_normal((40, 14336)), 4, 128)
    A = rng.standard_normal((4, 14336)).astype(np.float16)
    want = ref.uniform_gemv(A, uw, int8=int8)
    tol = 2e-5 * (np.abs(A).astype(np.float64) @ np.abs(ref.uniform_dequantize(uw)).astype(np.float64).T) + 1e-30
    assert_within(uniform.gemv(A, uw, int8=int8).copy_to_host(), want, tol, np.float16)


@settings(max_examples=EXAMPLES)
@given(seeds, bits_st, st.integers(1, 3), st.integers(1, 12), st.integers(0, 3), st.sampled_from(["float16", "float32"]),
       weight_kinds)
def test_gpu_quantizer_equals_reference(seed, bits, N, kbn, gsel, w_dtype, kind):
    """Byte-equal to the reference, adversarial weights included (all-zero groups: the zero point's sign)."""
    rng = np.random.default_rng(seed)
    K, G = _case(seed, bits, kbn, gsel)
    W = adversarial_weight(rng, N, K, kind, w_dtype)
    want = ref.uniform_quantize(W, bits, G)
    got = uniform.quantize(W, bits, G).to_numpy()
    assert np.array_equal(got.packed, want.packed)
    assert np.array_equal(got.scale_zero.view(np.uint16), want.scale_zero.view(np.uint16))


@gpu_split("epw_split", act_quant.EPW_CHOICES)
@settings(max_examples=gpu_examples(EXAMPLES * 2, len(act_quant.EPW_CHOICES)))
@given(seeds, st.sampled_from(act_quant.EPW_CHOICES), st.integers(1, 4 if SIM else 64), sizes(10, 512),
       st.sampled_from(["float16", "float32", "bfloat16"]), st.sampled_from([1.0, 1e-3, 1e-6, 3e4]), st.booleans())
@example(seed=0, epw=10, M=3, kbn=10, a_dtype="float16", scale=1.0, stream=False)    # K = 320: 3-bit chunks
def test_int8_activation_quantizer(epw_split, seed, epw, M, kbn, a_dtype, scale, stream):
    """The per-token int8 activation quantizer (uniform gemv's int8 path) is byte-equal to the reference in each
    word order: rows of every magnitude, an all-zero row, float16/float32/bfloat16 input, another stream."""
    epw = epw if epw_split is None else epw_split
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    A = rng.standard_normal((M, K)) * scale * np.exp(rng.uniform(-3, 1, (M, 1)))
    A[rng.random(M) < 0.2] = 0                                                     # all-zero rows
    A = np.clip(A, -6e4, 6e4)                      # finite in float16 too (scale 3e4 draws reach ~3e5)
    bf16 = a_dtype == "bfloat16"
    A = ref.float32_to_bf16_bits(A.astype(np.float32)) if bf16 else A.astype(a_dtype)
    s = cuda.stream() if stream else None
    words, d = act_quant.quantize_int8(A, epw, stream=s, bf16=bf16)
    if s is not None:
        s.synchronize()
    q, dd = ref.int8_per_token(A, bf16)
    want = q.view(np.uint32) if epw == 0 else ref.uniform_int8_words(q, 32 // epw)
    assert np.array_equal(words.copy_to_host(), want.reshape(M, -1))
    assert np.array_equal(d.copy_to_host(), dd)


def test_vector_input_and_out_buffer():
    rng = np.random.default_rng(3)
    uw = uniform.quantize(rng.standard_normal((6, 128)).astype(np.float32), 4, 64)
    a = rng.standard_normal(128).astype(np.float16)
    out = cuda.device_array(6, np.float32)
    assert uniform.gemv(cuda.to_device(a), uw, out=out, stream=cuda.stream()) is out
    want = ref.uniform_gemv(a, uw)[0]
    assert np.allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-4)


def test_rejects():
    uw = ref.uniform_quantize(np.ones((4, 64), np.float32), 2, 32)
    with pytest.raises(ValueError, match="bits"):
        ref.uniform_quantize(np.ones((4, 64), np.float32), 5, 32)
    with pytest.raises(ValueError, match="K"):
        uniform.gemv(np.ones((1, 32), np.float16), uw)
    with pytest.raises(ValueError, match="M = 1..4"):
        uniform.gemv(np.ones((5, 64), np.float16), uw)
    with pytest.raises(TypeError, match="UniformWeight"):
        uniform.gemv(np.ones((1, 64), np.float16), object())
    with pytest.raises(ValueError, match="group_size"):
        ref.uniform_quantize(np.ones((4, 96), np.float32), 2, 64)


@pytest.mark.parametrize("int8", [False, True])
def test_prepared_run_rebinds_inputs(int8):
    rng = np.random.default_rng(7)
    uw = uniform.quantize(rng.standard_normal((5, 256)).astype(np.float32), 3, 64)
    A = cuda.to_device(rng.standard_normal((2, 256)).astype(np.float16))
    prep = uniform.prepare(A, uw, out_dtype=np.float32, int8=int8)
    for _ in range(2):
        want = ref.uniform_gemv(A.copy_to_host(), uw, int8=int8)
        assert np.allclose(prep.run().copy_to_host(), want, rtol=1e-4, atol=1e-4)
        A.copy_to_device(rng.standard_normal((2, 256)).astype(np.float16))   # the next step's activations
