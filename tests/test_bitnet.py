"""BitNet W2A8: packing order, quantizers, and the lop3/dp4a GEMV against the exact integer reference."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kbit_numba import bitnet, reference as ref
from kbit_numba.formats import BITNET_ORDER
from helpers import EXAMPLES, SIM, assert_within, gpu_examples, gpu_split, Out, out_modes, seeds

MAX_NB = 3 if SIM else 40          # N = 16 * nb
MAX_KB = 6 if SIM else 200         # K = 32 * kb


def test_slot_order():
    """Value ORDER[p] of a 16-value half lands in bits 2p: values 4s..4s+3 are the bytes of word >> 2s."""
    wq = np.zeros((16, 32), np.int8)
    wq[0, :16] = np.array([1, 0, -1, 1, 0, 0, 1, -1, -1, 1, 0, 0, 1, 1, -1, 0])
    word = int(ref.bitnet_pack(wq)[0, 0, 0])
    for s in range(4):
        for i in range(4):
            assert ((word >> (2 * s + 8 * i)) & 3) - 2 == wq[0, 4 * s + i]
    assert list(BITNET_ORDER) == [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]


@gpu_split("parts_split", [1, 2, 4])
@settings(max_examples=gpu_examples(EXAMPLES * 2, 3))
@given(seeds, st.integers(1, 4), st.integers(1, MAX_NB), st.integers(1, MAX_KB), st.sampled_from([1, 2, 4]),
       st.sampled_from(["float16", "float32"]), st.sampled_from([np.float16, np.float32]), out_modes)
def test_bitnet_gemv(parts_split, seed, M, nb, kbn, parts, a_dtype, out_dtype, out_mode):
    parts = parts_split or parts
    rng = np.random.default_rng(seed)
    N, K = 16 * nb * parts, 32 * kbn
    W = rng.standard_normal((N, K)) * np.repeat(np.exp(rng.uniform(-3, 0, parts)), N // parts)[:, None]
    bw = ref.bitnet_quantize(W, parts)
    assert np.array_equal(ref.bitnet_pack(ref.bitnet_unpack(bw.packed, bw.shape)), bw.packed)
    A = (rng.standard_normal((M, K)) * 3).astype(a_dtype)
    o = Out(out_mode, (M, N), out_dtype)
    got = bitnet.gemv(A, bw, out_dtype=out_dtype, **o.kwargs)
    assert got.shape == (M, N) and got.dtype == np.dtype(out_dtype)
    want = ref.bitnet_gemv(A, bw)
    # exact integer dot on both sides: the two float32 products round at most twice
    assert_within(o.host(got), want, 3e-7 * np.abs(want) + 1e-30, out_dtype)


def test_bitnet_quantizer_is_absmean_ternary():
    rng = np.random.default_rng(0)
    W = rng.standard_normal((32, 64)).astype(np.float32)
    bw = ref.bitnet_quantize(W, parts=2)
    wq = ref.bitnet_unpack(bw.packed, bw.shape)
    assert set(np.unique(wq)) <= {-1, 0, 1}
    for p in range(2):
        half = W[16 * p:16 * (p + 1)]
        assert np.isclose(bw.w_scale[p], np.abs(half).mean(), rtol=1e-6)
        assert np.array_equal(wq[16 * p:16 * (p + 1)], np.clip(np.rint(half / bw.w_scale[p]), -1, 1))


def test_rejects():
    bw = ref.bitnet_quantize(np.ones((16, 64), np.float32))
    with pytest.raises(ValueError, match="K"):
        bitnet.gemv(np.ones((1, 32), np.float16), bw)
    with pytest.raises(ValueError, match="M = 1..4"):
        bitnet.gemv(np.ones((5, 64), np.float16), bw)
    with pytest.raises(ValueError, match="N % 16"):
        ref.bitnet_quantize(np.ones((8, 64), np.float32))
    with pytest.raises(TypeError, match="BitnetWeight"):
        bitnet.gemv(np.ones((1, 64), np.float16), ref.uniform_quantize(np.ones((16, 64)), 2, 32))


def test_prepared_run_rebinds_inputs():
    from numba import cuda
    rng = np.random.default_rng(7)
    bw = bitnet.quantize(rng.standard_normal((32, 96)))
    A = cuda.to_device(rng.standard_normal((3, 96)).astype(np.float16))
    prep = bitnet.prepare(A, bw, out_dtype=np.float32)
    for _ in range(2):
        want = ref.bitnet_gemv(A.copy_to_host(), bw.to_numpy())
        assert np.allclose(prep.run().copy_to_host(), want, rtol=1e-6, atol=1e-6)
        A.copy_to_device(rng.standard_normal((3, 96)).astype(np.float16))
