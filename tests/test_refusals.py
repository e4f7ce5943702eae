"""Bad input at every public entry: each row of the README's "What each entry refuses" table, raised as the
table says. Nothing here launches a kernel: every refusal comes before one."""
import os

import numpy as np
import pytest
from numba import cuda

import kbit_numba as kb
from kbit_numba import reference as ref

N, K = 128, 64
W = np.ones((N, K), np.float32)
FLAT = ref.quantize(W, k=4)
TILED = ref.repack_tiled(FLAT)
A1 = np.ones((1, K), np.float16)


def _nan_weight():
    w = W.copy()
    w[1, 2] = np.nan
    return w


def _long_k():
    """A 2 x 8256 k = 2 code-layout weight: K past 8192, where the tensor-core gemv splits K."""
    return ref.to_codes(ref.quantize(np.ones((2, 8256), np.float32), k=2))


def _huge_weight():
    """A 65536 x 65536 k = 2 weight whose arrays are zero-stride views (no memory behind them)."""
    n_blocks = 2**32 // 32
    return kb.KbitWeight(np.broadcast_to(np.uint32(0), (2 * n_blocks,)), np.broadcast_to(np.uint8(0), (n_blocks,)),
                         FLAT.codebook[:4], 2, (2**16, 2**16))


# (entry, refused input, error type, message fragment, the call)
ROWS = [
    ("quantize", "W not float16/float32 (e.g. int32, float64)", TypeError, "dtype",
     lambda: kb.quantize(W.astype(np.float64), k=4)),
    ("quantize", "W not 2-D", ValueError, "2-D", lambda: kb.quantize(W[0], k=4)),
    ("quantize", "K not a multiple of 32", ValueError, "multiple of 32",
     lambda: kb.quantize(np.ones((N, 40), np.float32), k=4)),
    ("quantize", "k outside 2..5", ValueError, "k must be one of", lambda: kb.quantize(W, k=6)),
    ("quantize", "NaN or Inf in W (also `reference.quantize`, `uniform.quantize`, `bitnet.quantize`, `sbvr.encode`)",
     ValueError, "NaN or Inf", lambda: kb.quantize(_nan_weight(), k=4)),
    ("quantize", "`layout='tiled'` with N % 128 != 0", ValueError, "N % 128",
     lambda: kb.quantize(W[:64], layout="tiled")),
    ("gemv", "A float64 or an integer type", TypeError, "dtype", lambda: kb.gemv(A1.astype(np.float64), FLAT)),
    ("gemv", "A a list, scalar or string", TypeError, "NumPy array or a CUDA array",
     lambda: kb.gemv([[1.0] * K], FLAT)),
    ("gemv", "A of K columns other than the weight's", ValueError, "K=32", lambda: kb.gemv(A1[:, :32], FLAT)),
    ("gemv", "M outside 1..4 (also `pair_gemv.gemv`, `uniform/sbvr/bitnet.gemv`)", ValueError, "M = 1..4",
     lambda: kb.gemv(np.ones((5, K), np.float16), FLAT)),
    ("gemv", "A not C-contiguous", ValueError, "C-contiguous",
     lambda: kb.gemv(np.ones((2, 2 * K), np.float16)[:, ::2], FLAT)),
    ("gemv", "`out` a NumPy array", TypeError, "device array",
     lambda: kb.gemv(A1, FLAT, out=np.zeros((1, N), np.float16))),
    ("gemv", "`out` of the wrong shape", ValueError, "shape",
     lambda: kb.gemv(A1, FLAT, out=cuda.device_array((1, N + 1), np.float16))),
    ("gemv", "`out` or `out_dtype` not float16/float32", TypeError, "float16 or float32",
     lambda: kb.gemv(A1, FLAT, out_dtype=np.float64)),
    ("gemv", "the weight not a KbitWeight (e.g. its packed array)", TypeError, "KbitWeight",
     lambda: kb.gemv(A1, FLAT.packed)),
    ("gemv", "a weight array of the wrong dtype", TypeError, "weight.packed must have dtype",
     lambda: kb.gemv(A1, kb.KbitWeight(FLAT.packed.view(np.int32), FLAT.absmax, FLAT.codebook, 4, (N, K)))),
    ("gemv", "`stream` not a Numba/torch/CuPy stream or a handle", TypeError, "stream must be",
     lambda: kb.gemv(A1, FLAT, stream="x")),
    ("gemm", "a flat weight (the tiled or code layout is needed)", ValueError, "repack_tiled",
     lambda: kb.gemm(A1, FLAT)),
    ("gemm", "a code-layout weight with K not a multiple of 64", ValueError, "multiple of 64",
     lambda: kb.gemm(np.ones((1, 96), np.float16), ref.to_codes(ref.quantize(np.ones((8, 96), np.float32), k=4)))),
    ("gemm", "`m_tile` outside 1, 2, 4", ValueError, "m_tile must be one of", lambda: kb.gemm(A1, TILED, m_tile=3)),
    ("gemm", "`split` < 1 or not an integer", ValueError, "split must be an integer >= 1",
     lambda: kb.gemm(A1, TILED, split=0)),
    ("gemm", "a split-K `workspace` smaller than M x N", ValueError, "workspace",
     lambda: kb.gemm(np.ones((1, 128), np.float16), ref.repack_tiled(ref.quantize(np.ones((N, 128), np.float32))),
                     split=2, workspace=cuda.device_array(10, np.float32))),
    ("linear", "`kernel` not one of gemv, pair_gemv, mma_gemv, gemm, dequant_matmul", ValueError, "kernel must be one of",
     lambda: kb.linear(A1, FLAT, kernel="magic")),
    ("linear", "a kernel that does not read the weight's layout", ValueError, "does not read",
     lambda: kb.linear(A1, FLAT, kernel="pair_gemv")),
    ("linear", "`f16_acc=True` for a kernel other than the pair gemv", ValueError, "f16_acc applies",
     lambda: kb.linear(A1, FLAT, f16_acc=True)),
    ("KbitLinear", "`layout` other than 'auto', 'tiled', 'codes' or 'fragments'", ValueError, "layout must be one of",
     lambda: kb.KbitLinear(FLAT, layout="flat")),
    ("KbitLinear", "`f16_acc=True` or `pdl=True` when the weight is not kept in the code or fragment layout",
     ValueError, "apply to the gemvs that read the code layout", lambda: kb.KbitLinear(FLAT, layout="tiled", pdl=True)),
    ("KbitLinear", "`layout='fragments'` with N not a multiple of 16 or K not a multiple of 256 (whole fragment "
     "tiles), or a weight other than a flat one with k = 2, 4, a KbitCodes or a KbitFragments", ValueError,
     "fragment layout needs", lambda: kb.KbitLinear(ref.quantize(np.ones((24, 256), np.float32), k=4),
                                                    layout="fragments")),
    ("pair_gemv.to_codes", "k = 3 or 5, or a tiled weight", ValueError, "code layout",
     lambda: kb.pair_gemv.to_codes(ref.quantize(W, k=3))),
    ("pair_gemv.gemv", "`f16_acc=True` with float32 or bfloat16 A", ValueError, "f16_acc needs float16",
     lambda: kb.pair_gemv.gemv(A1.astype(np.float32), ref.to_codes(FLAT), f16_acc=True)),
    ("mma_gemv.gemv", "M > 32", ValueError, r"M = 1\.\.32",
     lambda: kb.mma_gemv.gemv(np.zeros((33, 64), np.float16), ref.to_codes(FLAT))),
    ("mma_gemv.gemv", "float32 A (the MMA takes float16 or bfloat16)", ValueError, "float16 or bfloat16",
     lambda: kb.mma_gemv.gemv(A1.astype(np.float32), ref.to_codes(FLAT))),
    ("mma_gemv.gemv", "K not a multiple of 64", ValueError, "multiple of 64",
     lambda: kb.mma_gemv.gemv(np.zeros((1, 96), np.float16), ref.to_codes(ref.quantize(np.ones((4, 96), np.float32), k=4)))),
    ("mma_gemv.plan", "`split` not an integer from 1 to K / 256, or one that leaves a CTA more than 32 K-warps "
     "(K > 8192 a split); a `workspace` of fewer than M * N float32 values",
     ValueError, "leaves 33 K-warps a CTA",
     lambda: kb.mma_gemv.plan(np.zeros((1, 8256), np.float16), _long_k(), split=1)),
    ("mma_gemv.plan_grouped", "`split` as `mma_gemv.plan` refuses it (e.g. one that leaves a CTA more than 32 K-warps)",
     ValueError, "leaves 33 K-warps a CTA",
     lambda: kb.mma_gemv.plan_grouped(np.zeros((1, 8256), np.float16), kb.stack_experts([_long_k()]),
                                      np.array([0, 1], np.int32), split=1)),
    ("mma_gemv.gemv", "a weight not in the code or fragment layout (a KbitWeight: `pair_gemv.to_codes` it once)",
     TypeError, "code layout", lambda: kb.mma_gemv.gemv(A1, FLAT)),
    ("mma_gemv.to_fragments", "N not a multiple of 16 or K not a multiple of 256 (the fragment layout has no padding)",
     ValueError, "fragment layout needs",
     lambda: kb.mma_gemv.to_fragments(ref.to_codes(ref.quantize(np.ones((8, 96), np.float32), k=4)))),
    ("pair_gemv.to_codes", "a weight already in the fragment layout (`KbitFragments`: the pair gemv reads it as it is)",
     TypeError, "already packed",
     lambda: kb.pair_gemv.to_codes(ref.to_fragments(ref.quantize(np.ones((16, 256), np.float32), k=4)))),
    ("grouped_gemv", "`expert_offsets` not E + 1 values", ValueError, r"E\+1",
     lambda: kb.grouped_gemv(A1, kb.stack_experts([FLAT] * 2), np.array([0, 1], np.int32))),
    ("grouped_gemv", "`expert_offsets` not rising from 0 to T", ValueError, "rise from 0",
     lambda: kb.grouped_gemv(A1, kb.stack_experts([FLAT] * 2), np.array([0, 2, 1], np.int32))),
    ("grouped_gemv", "more than 4 tokens for one expert", ValueError, "up to 4 tokens",
     lambda: kb.grouped_gemv(np.ones((5, K), np.float16), kb.stack_experts([FLAT] * 2), np.array([0, 5, 5], np.int32))),
    ("grouped_gemv", "experts in the code layout (`mma_gemv.grouped_gemv` reads them)", ValueError,
     "mma_gemv.grouped_gemv",
     lambda: kb.grouped_gemv(A1, kb.stack_experts([ref.to_codes(FLAT)] * 2), np.array([0, 1, 1], np.int32))),
    ("mma_gemv.grouped_gemv", "more than 8 rows for one expert in host offsets (device offsets: those rows come "
     "out NaN)", ValueError, "up to 8 tokens",
     lambda: kb.mma_gemv.grouped_gemv(np.ones((9, K), np.float16), kb.stack_experts([ref.to_codes(FLAT)] * 2),
                                      np.array([0, 9, 9], np.int32))),
    ("mma_gemv.grouped_gemv", "experts not in the code or fragment layout", ValueError, "code-layout experts",
     lambda: kb.mma_gemv.grouped_gemv(A1, kb.stack_experts([FLAT] * 2), np.array([0, 1, 1], np.int32))),
    ("pair_gemv.grouped_gemv", "experts not in the code or fragment layout",
     ValueError, "code- or fragment-layout experts",
     lambda: kb.pair_gemv.grouped_gemv(A1, kb.stack_experts([FLAT] * 2), np.array([0, 1, 1], np.int32))),
    ("pair_gemv.grouped_gemv", "`silu_pairs=True` with an odd N", ValueError, "silu_pairs",
     lambda: kb.pair_gemv.plan_grouped(A1, kb.stack_experts([ref.to_codes(ref.quantize(W[:37], k=4))] * 2),
                                       np.array([0, 1, 1], np.int32), silu_pairs=True)),
    ("KbitExpertsLinear", "experts not `KbitExperts` (e.g. one `KbitWeight`)", TypeError, "KbitExperts",
     lambda: kb.KbitExpertsLinear(FLAT)),
    ("KbitExpertsLinear", "`codes` not in the code or fragment layout, or beside code-layout experts", ValueError,
     "code or fragment layout", lambda: kb.KbitExpertsLinear(kb.stack_experts([TILED] * 2), kb.stack_experts([FLAT] * 2))),
    ("KbitExpertsLinear", "more than 4 rows for one expert with only flat experts (stack tiled ones)", ValueError,
     "flat experts serve at most 4 rows",
     lambda: kb.KbitExpertsLinear(kb.stack_experts([FLAT] * 2))(np.ones((5, K), np.float16), np.array([0, 5, 5], np.int32))),
    ("KbitExpertsLinear", "`kernel` reading a copy the layer does not keep", ValueError, "does not keep",
     lambda: kb.KbitExpertsLinear(kb.stack_experts([ref.to_codes(FLAT)] * 2))(A1, np.array([0, 1, 1], np.int32),
                                                                              kernel="grouped_gemm")),
    ("KbitExpertsLinear", "`silu_pairs=True` where the routing runs a kernel other than the pair or tensor-core gemv",
     ValueError, "epilogue",
     lambda: kb.KbitExpertsLinear(kb.stack_experts([FLAT] * 2))(A1, np.array([0, 1, 1], np.int32), silu_pairs=True)),
    ("stack_experts", "experts of different shape, k, layout, absmax format or codebook", ValueError, "every expert",
     lambda: kb.stack_experts([FLAT, ref.quantize(W, k=2)])),
    ("dequantize", "`out` of the wrong shape", ValueError, "shape",
     lambda: kb.dequantize(FLAT, out=cuda.device_array((N, K + 32), np.float16))),
    ("dequantize", "a weight of 2**32 or more elements (the kernel's index math is 32-bit)", ValueError,
     "fewer than 2\\*\\*32", lambda: kb.dequantize(_huge_weight())),
    ("uniform.quantize", "`bits` outside 1, 2, 3, 4, 8 or `group_size` outside 32, 64, 128, None", ValueError,
     "bits must be one of", lambda: kb.uniform.quantize(W, bits=5)),
    ("bitnet.quantize", "N not a multiple of 16 or K not a multiple of 32", ValueError, "BitNet needs",
     lambda: kb.bitnet.quantize(W[:8])),
    ("sbvr.encode", "K not a multiple of 128", ValueError, "K % 128", lambda: kb.sbvr.encode(W, lines=4)),
    ("calibrate.quantize_gptq", "a `hessian` that is not a finite K x K matrix", ValueError, "hessian",
     lambda: kb.calibrate.quantize_gptq(W, np.eye(K + 32))),
    ("calibrate.quantize_gptq", "`damp` <= 0", ValueError, "damp", lambda: kb.calibrate.quantize_gptq(W, np.eye(K), damp=0)),
    ("calibrate.asymmetric_target", "`X` and `X_float` of different shapes, or of other K than W", ValueError,
     "one shape", lambda: kb.calibrate.asymmetric_target(W, np.ones((3, K)), np.ones((3, K + 32)))),
    ("calibrate.asymmetric_target", "`damp` <= 0", ValueError, "damp",
     lambda: kb.calibrate.asymmetric_target(W, np.ones((3, K)), np.ones((3, K)), damp=0)),
    ("pair_gemv.plan", "`silu_pairs=True` with an odd N or an odd `cols`", ValueError, "silu_pairs needs",
     lambda: kb.pair_gemv.plan(A1, ref.to_codes(FLAT), cols=1, silu_pairs=True)),
]


@pytest.mark.parametrize("entry, what, exc, match, call", ROWS, ids=[f"{r[0]}: {r[1]}" for r in ROWS])
def test_refusal(entry, what, exc, match, call):
    with pytest.raises(exc, match=match):
        call()


def test_readme_table_lists_every_refusal():
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for entry, what, exc, _, _ in ROWS:
        row = f"| `{entry}` | {what} | `{exc.__name__}` |"
        assert row in readme, f"README lacks the row {row}"
