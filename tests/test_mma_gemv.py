"""Tensor-core GEMV (swap AB, code layout, M = 1..8) against reference.gemm, on the simulator (CI) and the GPU."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda

from kbit_numba import mma_gemv, pair_gemv, reference as ref
from kbit_numba.formats import CODES_K
from helpers import EXAMPLES, SIM, adversarial_weight, gpu_examples, gpu_split, random_weight, seeds, sizes, weight_kinds
from test_gemm import check_gemm
from test_gemv import _activations

MAX_N = 20 if SIM else 700
# K = 64 * kb2: one warp with idle lanes (K < 256), a partial K-warp, two K-warps on the simulator; up to the
# kernel's 8192 (32 K-warps) on the GPU
KB2 = st.sampled_from([1, 5, 6]) if SIM else st.integers(1, 128)
SPLIT = [(k, a) for k in CODES_K for a in ("float16", "bfloat16")]


@gpu_split("k_split, a_split", SPLIT)
@settings(max_examples=gpu_examples(EXAMPLES * 2, len(SPLIT)))
@given(seeds, st.sampled_from(CODES_K), st.integers(1, 8), sizes(MAX_N, 20000), KB2, st.sampled_from(["e4m4", "fp32"]),
       st.sampled_from(["float16", "bfloat16"]), st.sampled_from([np.float16, np.float32]), weight_kinds)
def test_mma_gemv(k_split, a_split, seed, k, M, N, kb2, fmt, a_dtype, out_dtype, kind):
    k, a_dtype = k_split or k, a_split or a_dtype
    rng = np.random.default_rng(seed)
    K = 64 * kb2
    qw = ref.quantize(adversarial_weight(rng, N, K, kind), k=k, absmax_format=fmt)
    A = _activations(rng, M, K, a_dtype)
    bf16 = a_dtype == "bfloat16"
    out = mma_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=out_dtype, bf16=bf16).launch()
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    check_gemm(out.copy_to_host(), A, qw, bf16, out_dtype)


def test_mma_gemv_vector_input_out_buffer_prepare_and_pdl():
    """A 1-D input, an ``out`` buffer on another stream, a prepared launch, and a PDL chain of two layers."""
    rng = np.random.default_rng(5)
    qw = ref.quantize(random_weight(rng, 70, 128), k=4)
    kc = pair_gemv.to_codes(qw)
    a = _activations(rng, 1, 128, "float16", one_d=True)
    out = cuda.device_array(70, np.float32)
    assert mma_gemv.gemv(cuda.to_device(a), kc, out=out, stream=cuda.stream()) is out
    check_gemm(out.copy_to_host()[None], a[None], qw)
    A = cuda.to_device(_activations(rng, 6, 128, "float16"))
    step = mma_gemv.prepare(A, kc)
    check_gemm(step.run().copy_to_host(), A.copy_to_host(), qw, out_dtype=np.float16)
    sq = ref.quantize(random_weight(rng, 128, 128), k=2)
    first = mma_gemv.prepare(A, pair_gemv.to_codes(sq), pdl=True)
    second = mma_gemv.prepare(first.out, pair_gemv.to_codes(sq), pdl=True)
    first.run()
    got = second.run().copy_to_host()
    check_gemm(got, first.out.copy_to_host(), sq, out_dtype=np.float16)


def test_mma_gemv_refuses():
    rng = np.random.default_rng(6)
    kc = ref.to_codes(ref.quantize(random_weight(rng, 4, 64), k=4))
    with pytest.raises(ValueError, match="M = 1..8"):
        mma_gemv.gemv(np.zeros((9, 64), np.float16), kc)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        mma_gemv.gemv(np.zeros((1, 64), np.float32), kc)
    with pytest.raises(ValueError, match="multiple of 64"):
        mma_gemv.gemv(np.zeros((1, 96), np.float16), ref.to_codes(ref.quantize(random_weight(rng, 4, 96), k=4)))
    with pytest.raises(ValueError, match="up to 8192"):
        mma_gemv.plan(np.zeros((1, 8256), np.float16), ref.to_codes(ref.quantize(random_weight(rng, 1, 8256), k=2)))
    with pytest.raises(TypeError, match="code layout"):     # a KbitWeight: convert it once with to_codes
        mma_gemv.gemv(np.zeros((1, 64), np.float16), ref.quantize(random_weight(rng, 4, 64), k=4))
