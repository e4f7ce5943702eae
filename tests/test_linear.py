"""linear(): the kernel choice (table rules, fallbacks) and correctness for every M, on the simulator and GPU."""
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from numba import cuda

import kbit_numba as kb
from kbit_numba import dispatch as L
from kbit_numba import reference as ref
from kbit_numba.formats import CODES_K
from helpers import (EXAMPLES, gpu_examples, gpu_split, kbit_weight, Out, out_modes, random_weight, seeds, SIM,
                     sizes, variants)
from test_gemm import check_close
from test_gemv import _activations
from test_pair_gemv import check_close_f16_acc
from test_mma_gemv import check_silu_pairs

TABLE = {"device": "test", "rules": [[4, "gemv"], [64, "gemm"], [None, "dequant_matmul"]],
         "shapes": {"256x128": [[2, "gemv"], [None, "gemm"]]}}


def test_choose_follows_rules_shapes_and_fallbacks():
    ch = lambda M, N=512, K=64, layout="tiled", backend="torch": L.choose(M, N, K, layout, TABLE, backend)  # noqa
    assert [ch(M) for M in (1, 4, 5, 64, 65, 4096)] == ["gemv", "gemv", "gemm", "gemm", "dequant_matmul",
                                                         "dequant_matmul"]
    assert [ch(M, 128, 256) for M in (1, 2, 3, 1000)] == ["gemv", "gemv", "gemm", "gemm"]   # per-shape rules
    assert ch(8, layout="flat") == "dequant_matmul"           # no tiled copy: no gemm
    assert ch(8, layout="flat", backend=False) == "gemv"      # no torch/CuPy either: gemv in slices
    assert ch(100, backend=False) == "gemm"                   # no cuBLAS: the tensor cores serve every M
    # the code layout: the pair gemv at M <= 2, the tensor-core gemv to 8, the gemm (K a multiple of 64), dequantize
    # + cuBLAS ...
    assert ([ch(M, layout="codes") for M in (1, 2, 3, 8, 9, 64, 65)]
            == ["pair_gemv"] * 2 + ["mma_gemv"] * 2 + ["gemm"] * 2 + ["dequant_matmul"])
    # ... at k = 4 the tensor-core gemv to 16 (two token tiles from 9; MMA_GEMV_MAX_M), not at k = 2
    kk = lambda M, k: L.choose(M, 512, 64, "codes", TABLE, "torch", k=k)  # noqa
    assert [kk(M, 4) for M in (8, 9, 16, 17)] == ["mma_gemv"] * 3 + ["gemm"]
    assert [kk(M, 2) for M in (8, 9, 16)] == ["mma_gemv", "gemm", "gemm"]
    # ... unless the GPU's table sets its own cap for that k (mma_gemv_max_m; the H200's: 32)
    capped = dict(TABLE, mma_gemv_max_m={"2": 16, "4": 12})
    kt = lambda M, k: L.choose(M, 512, 64, "codes", capped, "torch", k=k)  # noqa
    assert [kt(M, 2) for M in (8, 9, 16, 17)] == ["mma_gemv"] * 3 + ["gemm"]
    assert [kt(M, 4) for M in (12, 13)] == ["mma_gemv", "gemm"]
    # ... and its cap for one shape and k (mma_gemv_max_m_shapes) before that
    shaped = dict(capped, mma_gemv_max_m_shapes={"64x512": {"2": 8}, "128x512": {"4": 4}})
    ks = lambda M, k, K=64: L.choose(M, 512, K, "codes", shaped, "torch", k=k)  # noqa
    assert [ks(M, 2) for M in (8, 9, 16)] == ["mma_gemv", "gemm", "gemm"]       # 64x512 at k = 2: 8
    assert [ks(M, 4) for M in (12, 13)] == ["mma_gemv", "gemm"]                  # 64x512 at k = 4: the k cap, 12
    assert [ks(M, 4, 128) for M in (4, 5)] == ["mma_gemv", "gemm"]               # 128x512 at k = 4: 4
    assert [ks(M, 2, 128) for M in (16, 17)] == ["mma_gemv", "gemm"]             # 128x512 at k = 2: the k cap, 16
    assert L.mma_gemv_max_m(shaped, 2, 512, 64) == 8 and L.mma_gemv_max_m(shaped, 2) == 16
    # ... on any K (a split K too: no limit past 8192 since the split grid fits the resident CTAs)
    wide = dict(TABLE, mma_gemv_max_m={"2": 32, "4": 32}, mma_gemv_max_m_shapes={"14336x512": {"4": 24}},
                codes_variants={"k=4": [[2, "pair_gemv"], [32, "mma_gemv"], [64, "gemm"], [None, "dequant_matmul"]]})
    assert [L.mma_gemv_max_m(wide, 4, 512, K) for K in (8192, 8448, 14336)] == [32, 32, 24]
    assert [L.choose(M, 512, 14336, "codes", wide, "torch", k=4) for M in (24, 25)] == ["mma_gemv", "gemm"]
    assert ch(100, layout="codes", backend=False) == "gemm"
    assert {ch(M, K=96, layout="codes", backend=False) for M in (1, 5, 100)} == {"pair_gemv"}   # K % 64 != 0
    # K > 8192: the tensor-core gemv splits K (to its M cap; the gemm beyond) ...
    assert [ch(M, K=14336, layout="codes") for M in (2, 3, 4, 8, 16)] == ["pair_gemv"] + ["mma_gemv"] * 3 + ["gemm"]
    # ... and where it does not apply (float32 activations) the pair gemv where its registers fit, else the gemm
    f32 = lambda M, K: L.choose(M, 512, K, "codes", TABLE, "torch", half=False)  # noqa
    assert [f32(M, 14336) for M in (2, 3, 4, 8)] == ["pair_gemv"] + ["gemm"] * 3
    assert [f32(M, 8256) for M in (3, 4)] == ["pair_gemv", "gemm"]
    # ... with float16 block sums (f16_acc) at k = 4 the pair gemv keeps M = 3 (PAIR_GEMV_F16_MAX_M) while
    # M * ceil(K / 1024) <= 56 (K = 14336, 18432; not 19456), the tensor-core gemv M = 4
    f16 = lambda M, K: L.choose(M, 512, K, "codes", TABLE, "torch", f16_acc=True, k=4)  # noqa
    assert [f16(M, 14336) for M in (2, 3, 4, 5)] == ["pair_gemv"] * 2 + ["mma_gemv"] * 2
    assert [f16(3, K) for K in (18432, 19456)] == ["pair_gemv", "gemm"]
    # ... and at k = 4 takes M = 3 from the tensor-core gemv (not at k = 2)
    f16k = lambda M, k: L.choose(M, 512, 4096, "codes", TABLE, "torch", f16_acc=True, k=k)  # noqa
    assert [f16k(M, 4) for M in (2, 3, 4, 8)] == ["pair_gemv", "pair_gemv", "mma_gemv", "mma_gemv"]
    assert [f16k(M, 2) for M in (2, 3, 4)] == ["pair_gemv", "mma_gemv", "mma_gemv"]
    # float32 activations (the tensor-core gemv takes 16-bit ones): the pair gemv to M = 4, then the gemm
    assert [L.choose(M, 512, 64, "codes", TABLE, "torch", half=False) for M in (3, 4, 5)] == ["pair_gemv"] * 2 + ["gemm"]


def test_table_lookup_by_device_name(tmp_path, monkeypatch):
    assert L.device_key(b"NVIDIA H200") == "nvidia_h200"
    assert L.load_table("Some Unknown GPU 9000") is L.DEFAULT_TABLE
    (tmp_path / "my_gpu.json").write_text('{"device": "My GPU", "rules": [[null, "gemm"]], "shapes": {}}')
    monkeypatch.setattr(L, "TUNING_DIR", str(tmp_path))
    L.load_table.cache_clear()
    try:
        assert L.load_table("My GPU")["rules"] == [[None, "gemm"]]
    finally:
        L.load_table.cache_clear()


# (The simulator's scalar GEMV is slow on 128 columns: there M = 1 stands for the gemv route.)
@pytest.mark.parametrize("M", [1, 6, 17] if SIM else [1, 4, 5, 16, 33, 64, 200, 600])
def test_linear_any_m(M):
    rng = np.random.default_rng(M)
    K = 96
    flat = ref.quantize(random_weight(rng, 128, K), k=4)
    layer = kb.KbitLinear(flat)
    assert layer.weight.layout == "tiled"                  # (K % 64 != 0: no code layout)
    A = rng.standard_normal((M, K)).astype(np.float16)
    out = layer(A, out_dtype=np.float32)
    assert out.shape == (M, 128)
    check_close(out.copy_to_host(), A, flat)


LAYOUTS = ("auto", "tiled", "codes", "keep_flat", "fragments")
# M picks the kernel and, for the gemvs, its specialisation: on the GPU it is drawn as a variant (helpers.variants)
# from every route of the dispatch table and both sides of each bound; the simulator draws any M (sizes below).
FUZZ_M = (1, 2, 3, 5, 8, 9, 17, 64, 200, 512) if not SIM else (None,)


@gpu_split("k_split", [2, 3, 4, 5])
@settings(max_examples=gpu_examples(EXAMPLES, 4))
@given(seeds, variants(FUZZ_M, (4, 2, 3, 5), ("e4m4", "fp32"), LAYOUTS, ("float16", "float32", "bfloat16"),
                (np.float16, np.float32)),
       sizes(6 if SIM else 64, 512), sizes(12 if SIM else 700, 20000), sizes(4 if SIM else 70, 512), out_modes)
def test_kbit_linear_any_shape(k_split, seed, v, M, N, kbn, out_mode):
    """KbitLinear as a user builds and calls it, whatever kernel the table picks for the drawn M and shape (the
    gemvs, the tensor-core gemv and gemm, dequantize + cuBLAS): every layout choice, activation and output type,
    into a fresh output or a preallocated view, on the default stream or another."""
    fuzz_m, k, fmt, layout, a_dtype, out_dtype = v
    M, k = fuzz_m or M, k_split or k
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    layout = "auto" if layout in ("codes", "fragments") and k not in CODES_K else layout
    if layout == "fragments":                          # (whole fragment tiles: N a multiple of 16, K of 256)
        N, K = -(-N // 16) * 16, -(-K // 256) * 256
    qw, pool, rows = kbit_weight(rng, N, K, "normal", k, fmt)
    layer = kb.KbitLinear(qw, **({"keep_flat": True} if layout == "keep_flat" else {"layout": layout}))
    A = _activations(rng, M, K, a_dtype)
    bf16 = a_dtype == "bfloat16"
    o = Out(out_mode, (M, N), out_dtype)
    out = layer(A, out_dtype=out_dtype, bf16=bf16, **o.kwargs)
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    check_close(o.host(out), A, pool, bf16, out_dtype, rows)


@pytest.mark.parametrize("layout", ["codes", "tiled"])
def test_dequant_matmul_takes_bfloat16(layout):
    """bfloat16 activations (int16 bits) through dequantize + cuBLAS: the weight dequantized to bfloat16, the product
    within the MMA paths' bfloat16 bound, whether forced or the table's choice at a large M."""
    rng = np.random.default_rng(7)
    flat = ref.quantize(random_weight(rng, 128, 128), k=4)
    A = ref.float32_to_bf16_bits(rng.standard_normal((5, 128)).astype(np.float32))
    layer = kb.KbitLinear(flat, layout=layout)
    got = layer(A, out_dtype=np.float32, bf16=True, kernel="dequant_matmul")
    check_close(got.copy_to_host(), A, flat, bf16=True)
    table = {"device": "test", "rules": [[None, "dequant_matmul"]], "codes_rules": [[None, "dequant_matmul"]]}
    step = L.plan(A, layer.weight, bf16=True, table=table).steps[0]
    assert step.kernel is kb.codec.make_dequantize_kernel(kb.codec.DequantizeSpec(4, layer.weight.layout, "e4m4",
                                                                                  "bfloat16"))
    got = L.linear(A[:3], layer.weight, out_dtype=np.float16, bf16=True, table=table)
    check_close(got.copy_to_host(), A[:3], flat, bf16=True, out_dtype=np.float16)


def test_kernel_for_names_the_bfloat16_fallback(monkeypatch):
    """Where the table picks dequantize + cuBLAS but the cuBLAS call cannot take bfloat16 (CuPy), a bfloat16 call runs
    the gemm, and ``kernel_for(M, bf16=True)`` says so (it named dequant_matmul before 2026-11-27)."""
    rng = np.random.default_rng(8)
    flat = ref.quantize(random_weight(rng, 64, 128), k=4)
    table = {"device": "test", "rules": [[None, "dequant_matmul"]], "codes_rules": [[None, "dequant_matmul"]],
             "codes_mm_rules": [[None, "dequant_matmul"]]}
    layer = kb.KbitLinear(flat, table=table)
    A = ref.float32_to_bf16_bits(rng.standard_normal((40, 128)).astype(np.float32))
    assert layer.kernel_for(40, bf16=True) == "dequant_matmul"     # (torch, or NumPy on the simulator, take it)
    monkeypatch.setattr(L, "bf16_matmul_backend", lambda: False)
    assert layer.kernel_for(40, bf16=True) == "gemm" and layer.kernel_for(40) == "dequant_matmul"
    step = layer.plan(A, bf16=True).steps[0]
    assert step.kernel.py_func.__module__ == "kbit_numba.tensor_gemm"


@pytest.mark.parametrize("M", [1, 6, 17] if SIM else [1, 2, 4, 5, 16, 33, 64, 200, 600])
def test_kbit_linear_auto_keeps_the_code_layout(M):
    """The default KbitLinear on k = 4, K a multiple of 64: the code layout, every M (pair gemv, gemm,
    dequantize + cuBLAS), N not a multiple of 128."""
    rng = np.random.default_rng(M)
    flat = ref.quantize(random_weight(rng, 72 if SIM else 300, 128), k=4)
    layer = kb.KbitLinear(flat)
    assert layer.weight.layout == "codes"
    A = rng.standard_normal((M, 128)).astype(np.float16)
    out = layer(A, out_dtype=np.float32)
    assert out.shape == (M, flat.shape[0])
    check_close(out.copy_to_host(), A, flat)
    assert kb.KbitLinear(ref.quantize(random_weight(rng, 8, 96), k=4)).weight.layout == "flat"   # K % 64
    assert kb.KbitLinear(ref.quantize(random_weight(rng, 128, 128), k=3)).weight.layout == "tiled"   # k = 3


@pytest.mark.parametrize("kernel, layout", [("gemv", "tiled"), ("gemm", "tiled"), ("dequant_matmul", "tiled"),
                                            ("gemm", "codes"), ("mma_gemv", "codes"), ("dequant_matmul", "codes")])
def test_linear_forced_kernels_agree(kernel, layout):
    if kernel == "dequant_matmul" and L.matmul_backend() is None:
        pytest.skip("dequant_matmul needs torch or CuPy")
    rng = np.random.default_rng(3)
    N = 8 if kernel == "gemv" and SIM else 128                   # gemv: 6 rows = slices of 4 and 2
    flat = ref.quantize(random_weight(rng, N, 64), k=3 if layout == "tiled" else 2)
    w = ref.to_codes(flat) if layout == "codes" else flat if N % 128 else ref.repack_tiled(flat)
    A = rng.standard_normal((6, 64)).astype(np.float16)
    out = kb.linear(cuda.to_device(A), w, kernel=kernel, out_dtype=np.float32, workspace=kb.Workspace())
    check_close(out.copy_to_host(), A, flat)


def test_kbit_linear_keep_flat_serves_gemv_from_the_flat_copy():
    rng = np.random.default_rng(6)
    flat = ref.quantize(random_weight(rng, 128, 64), k=4)
    layer = kb.KbitLinear(flat, keep_flat=True)
    assert layer.weight.layout == "tiled" and layer.flat_weight.layout == "flat"
    assert layer._weight_for("gemv") is layer.flat_weight and layer._weight_for("gemm") is layer.weight
    A = rng.standard_normal((1, 64)).astype(np.float16)
    check_close(layer(A, out_dtype=np.float32, kernel="gemv").copy_to_host(), A, flat)


def test_linear_flat_weight_with_n_not_a_tile_multiple():
    rng = np.random.default_rng(4)
    flat = ref.quantize(random_weight(rng, 20, 64), k=3)
    layer = kb.KbitLinear(flat)
    assert layer.weight.layout == "flat"
    A = rng.standard_normal((7, 64)).astype(np.float16)
    check_close(layer(A, out_dtype=np.float32).copy_to_host(), A, flat)


@pytest.mark.parametrize("M", [5] if SIM else [3, 8, 16])
def test_kbit_linear_mid_m_runs_the_tensor_core_gemv(M):
    """M = 3..16 on the code layout: the tensor-core gemv (prepared and as PDL launches too); float32
    activations, which it does not take, go to the pair gemv or the gemm."""
    rng = np.random.default_rng(20 + M)
    flat = ref.quantize(random_weight(rng, 40 if SIM else 600, 128 if SIM else 2048), k=4)
    for pdl in (False, True):
        layer = kb.KbitLinear(flat, pdl=pdl)
        assert layer.kernel_for(M) == "mma_gemv"
        A = rng.standard_normal((M, flat.shape[1])).astype(np.float16)
        prep = layer.prepare(cuda.to_device(A), out_dtype=np.float32)
        assert [step.pdl for step in prep.plan.steps] == [pdl]
        check_close(prep.run().copy_to_host(), A, flat)
    assert layer.kernel_for(M, half=False) == ("pair_gemv" if M <= 4 else "gemm")
    A32 = rng.standard_normal((M, flat.shape[1])).astype(np.float32)
    check_close(layer(A32, out_dtype=np.float32).copy_to_host(), A32, flat)


@pytest.mark.skipif(SIM, reason="K = 14336 is slow on the simulator (the rule itself: test_choose_follows_rules...)")
@pytest.mark.parametrize("M", [3, 4, 8])
def test_kbit_linear_long_k(M):
    """K > 8192 (a llama3-8b down projection): with f16_acc and float16 activations at k = 4 M = 3 the pair gemv
    (2% faster there than the tensor-core gemv, H200); else the tensor-core gemv, splitting K, its sums in the
    layer's workspace (zeroed again: a second call gives the same output)."""
    rng = np.random.default_rng(30 + M)
    flat = ref.quantize(random_weight(rng, 200, 14336), k=4)
    layer = kb.KbitLinear(flat, f16_acc=True)
    assert layer.kernel_for(M) == ("pair_gemv" if M == 3 else "mma_gemv")
    assert layer.kernel_for(M, bf16=True) == "mma_gemv"
    A = rng.standard_normal((M, 14336)).astype(np.float16)
    out = layer(A, out_dtype=np.float32).copy_to_host()
    if M == 3:
        check_close_f16_acc(out, A, flat, np.float32)
    else:
        check_close(out, A, flat)
        check_close(layer(A, out_dtype=np.float32).copy_to_host(), A, flat)   # (atomics: the order of the adds varies)


@pytest.mark.parametrize("M", [8] if SIM else [2, 8])     # (prepared gemv: also tests/test_gemv.py)
def test_prepared_linear_rebinds_inputs(M):
    rng = np.random.default_rng(5)
    flat = ref.quantize(random_weight(rng, 128, 64), k=4)
    layer = kb.KbitLinear(flat)
    A = cuda.to_device(rng.standard_normal((M, 64)).astype(np.float16))
    prep = layer.prepare(A, out_dtype=np.float32, kernel="pair_gemv" if M <= 4 else "gemm")   # (codes layout)
    check_close(prep.run().copy_to_host(), A.copy_to_host(), flat)
    A2 = rng.standard_normal((M, 64)).astype(np.float16)
    A.copy_to_device(A2)
    check_close(prep.run().copy_to_host(), A2, flat)


@pytest.mark.parametrize("M", [1, 6] if SIM else [1, 3, 4, 6, 17])
def test_kbit_linear_codes_layout_runs_the_pair_gemv(M):
    """K not a multiple of 64: the code layout's only reader is the pair gemv (M > 4 in slices of 4 rows)."""
    rng = np.random.default_rng(M)
    flat = ref.quantize(random_weight(rng, 24 if SIM else 1000, 96 if SIM else 1056), k=4)
    pdl = M > 1                                           # (programmatic dependent launches: test_pair_gemv)
    layer = kb.KbitLinear(flat, layout="codes", pdl=pdl)
    assert layer.weight.layout == "codes" and layer.kernel_for(M) == "pair_gemv"
    A = rng.standard_normal((M, flat.shape[1])).astype(np.float16)
    check_close(layer(A, out_dtype=np.float32).copy_to_host(), A, flat)
    Ad = cuda.to_device(A)
    prep = layer.prepare(Ad, out_dtype=np.float32)      # one launch per slice of 4 rows
    assert len(prep.plan.steps) == -(-M // 4) and all(step.pdl == pdl for step in prep.plan.steps)
    check_close(prep.run().copy_to_host(), A, flat)
    A2 = rng.standard_normal(A.shape).astype(np.float16)
    Ad.copy_to_device(A2)
    check_close(prep.run().copy_to_host(), A2, flat)


@pytest.mark.parametrize("M", [2] if SIM else [1, 3, 4, 9])
def test_kbit_linear_codes_f16_acc(M):
    rng = np.random.default_rng(10 + M)
    k = 4 if M == 3 else 2                 # (k = 4, M = 3: the pair gemv, not the tensor-core gemv; dispatch.py)
    flat = ref.quantize(random_weight(rng, 24 if SIM else 1000, 64 if SIM else 2048), k=k)
    layer = kb.KbitLinear(flat, layout="codes", f16_acc=True)
    cap = L.mma_gemv_max_m(L.load_table(), k, *flat.shape)  # (this GPU's table: the H100's and H200's: 32; default 8)
    assert layer.kernel_for(M) == ("pair_gemv" if M <= 2 or M == 3 and k == 4 else "mma_gemv" if M <= cap else "gemm")
    A = rng.standard_normal((M, flat.shape[1])).astype(np.float16)
    check_close_f16_acc(layer(A, out_dtype=np.float32).copy_to_host(), A, flat, np.float32)
    prep = layer.prepare(cuda.to_device(A), out_dtype=np.float32)
    check_close_f16_acc(prep.run().copy_to_host(), A, flat, np.float32)


def test_fragment_layout_rules():
    """The fragment layout (FRAGMENT_RULES, no table): the tensor-core gemv for M = 1..32 of float16/bfloat16
    activations at every k and K, the pair gemv for float32 ones to M = 4 where its registers fit, dequantize + cuBLAS
    beyond (the pair gemv in slices where there is no cuBLAS route)."""
    fr = lambda M, half=True, backend="torch", k=2: L.choose(M, 512, 14336, "fragments", TABLE, backend,  # noqa
                                                           half=half, k=k)
    assert [fr(M) for M in (1, 2, 8, 9, 16, 17, 32, 33, 600)] == ["mma_gemv"] * 7 + ["dequant_matmul"] * 2
    # float32 A: the pair gemv while M rows of K's warps fit its registers (M = 2 at K = 14336, M = 4 at K = 4096)
    assert [fr(M, half=False) for M in (1, 2, 3, 5, 16)] == ["pair_gemv"] * 2 + ["dequant_matmul"] * 3
    assert L.choose(4, 512, 4096, "fragments", TABLE, "torch", half=False) == "pair_gemv"
    # no cuBLAS route: the pair gemv in slices of 4 rows, registers or not
    assert {fr(3, half=False, backend=False), fr(33, backend=False), fr(600, backend=False)} == {"pair_gemv"}
    assert fr(16, k=4) == "mma_gemv"


@pytest.mark.parametrize("k, M, dtype", [(4, 1, np.float16), (2, 3, np.float16), (4, 2, np.float32),
                                         (2, 17, np.float16), (4, 33, np.float16)] if SIM else
                         [(k, M, dt) for k in CODES_K for M, dt in ((1, np.float16), (2, np.float16), (8, np.float16),
                                                                    (16, np.float16), (3, np.float32),
                                                                    (17, np.float16), (64, np.float16))])
def test_kbit_linear_fragment_layout(k, M, dtype):
    """KbitLinear(layout="fragments"): the weight in the fragment layout (its flat bytes back exactly), the rule's
    kernel for M (the gemvs prepared as PDL launches), results against the reference."""
    rng = np.random.default_rng(40 + M)
    N, K = (32, 512) if SIM else (400, 2048)
    flat = ref.quantize(random_weight(rng, N, K), k=k)
    layer = kb.KbitLinear(flat, layout="fragments", pdl=True)
    assert layer.weight.layout == "fragments"
    np.testing.assert_array_equal(ref.to_flat(layer.weight.to_numpy()).packed, flat.packed)
    half = dtype == np.float16
    want = "mma_gemv" if half and M <= 32 else "pair_gemv" if M <= 4 else "dequant_matmul"
    if want == "dequant_matmul" and L.matmul_backend() is None:
        pytest.skip("dequant_matmul needs torch or CuPy")
    assert layer.kernel_for(M, half=half) == want
    A = rng.standard_normal((M, K)).astype(dtype)
    prep = layer.prepare(cuda.to_device(A), out_dtype=np.float32)
    assert all(step.pdl for step in prep.plan.steps) == (want in L.EPILOGUE_GEMVS)
    check_close(prep.run().copy_to_host(), A, flat)
    assert kb.KbitLinear(layer.weight).weight.layout == "fragments"      # ("auto" keeps a KbitFragments as it is)


@pytest.mark.parametrize("M", [2] if SIM else [1, 12])
def test_kbit_linear_fragment_layout_silu_pairs(M):
    """The gate/up epilogue on the fragment layout (interleaved rows; a PDL launch): silu(gate) * up, [M, N / 2]."""
    rng = np.random.default_rng(50 + M)
    flat = ref.quantize(random_weight(rng, 32 if SIM else 512, 256 if SIM else 2048), k=4)
    layer = kb.KbitLinear(flat, layout="fragments", pdl=True)
    A = rng.standard_normal((M, flat.shape[1])).astype(np.float16)
    plan = layer.plan(cuda.to_device(A), out_dtype=np.float32, silu_pairs=True)
    assert [step.pdl for step in plan.steps] == [True]
    check_silu_pairs(plan.launch().copy_to_host(), A, flat)


def test_fragment_layout_refusals():
    flat = ref.quantize(np.ones((32, 256), np.float32), k=4)
    with pytest.raises(ValueError, match="fragment layout needs N a multiple of 16 and K of 256"):
        kb.KbitLinear(ref.quantize(np.ones((24, 256), np.float32), k=4), layout="fragments")
    with pytest.raises(ValueError, match="fragment layout needs N a multiple of 16 and K of 256"):
        kb.KbitLinear(ref.quantize(np.ones((32, 192), np.float32), k=2), layout="fragments")
    with pytest.raises(ValueError, match="layout='fragments' needs a flat KbitWeight with k in"):
        kb.KbitLinear(ref.quantize(np.ones((32, 256), np.float32), k=3), layout="fragments")
    with pytest.raises(ValueError, match="layout='codes' needs a flat KbitWeight"):
        kb.KbitLinear(ref.to_fragments(flat), layout="codes")
    with pytest.raises(ValueError, match="kernel 'gemm' does not read the fragments layout"):
        kb.linear(np.ones((8, 256), np.float16), ref.to_fragments(flat), kernel="gemm")


def test_codes_layout_refusals():
    flat = ref.quantize(np.ones((128, 64), np.float32), k=4)
    A = np.ones((1, 64), np.float16)
    with pytest.raises(ValueError, match="f16_acc and pdl apply to the gemvs that read the code layout"):
        kb.KbitLinear(flat, layout="tiled", pdl=True)
    with pytest.raises(ValueError, match="f16_acc and pdl apply to the gemvs that read the code layout"):
        kb.KbitLinear(ref.quantize(np.ones((128, 64), np.float32), k=5), f16_acc=True)
    with pytest.raises(ValueError, match="does not read the codes layout"):
        kb.linear(A, ref.to_codes(flat), kernel="gemv")
    with pytest.raises(ValueError, match="does not read the flat layout"):
        kb.linear(A, flat, kernel="pair_gemv")
    with pytest.raises(ValueError, match="layout='codes' needs a flat KbitWeight"):
        kb.KbitLinear(ref.repack_tiled(flat), layout="codes")
    with pytest.raises(ValueError, match="layout='codes' needs a flat KbitWeight"):
        kb.KbitLinear(ref.quantize(np.ones((8, 64), np.float32), k=3), layout="codes")
    with pytest.raises(ValueError, match="layout must be one of"):
        kb.KbitLinear(flat, layout="flat")
    for flag in ("f16_acc", "pdl"):                      # (flat k = 4, K = 64: "auto" keeps the code layout)
        with pytest.raises(ValueError, match="f16_acc and pdl apply to the gemvs that read the code layout"):
            kb.KbitLinear(flat, layout="tiled", **{flag: True})
    assert kb.KbitLinear(flat, pdl=True).pdl
    with pytest.raises(ValueError, match="f16_acc applies to the pair gemv"):
        kb.linear(A, flat, f16_acc=True)                  # (was silently ignored)


def test_linear_rejects_bad_input():
    flat = ref.quantize(np.ones((128, 64), np.float32), k=2)
    with pytest.raises(TypeError, match="KbitWeight, KbitCodes or KbitFragments"):
        kb.linear(np.ones((2, 64), np.float16), flat.packed)
    with pytest.raises(ValueError, match="kernel must be one of"):
        kb.linear(np.ones((2, 64), np.float16), flat, kernel="magic")
    with pytest.raises(ValueError, match="K=32"):
        kb.linear(np.ones((8, 32), np.float16), flat)


def test_choose_grouped_follows_the_rule():
    """The grouped kernel per routing (largest expert's rows, all rows), copies kept, activations and block sums."""
    N8 = kb.mma_gemv.N8
    cases = [   # (most, rows, k, K, codes layout, other layout, half, f16_acc) -> kernel
        ((1, 8, 4, 2048, "codes", "tiled", True, True), "pair_gemv"),
        ((L.PAIR_GROUPED_MAX_ROWS, 40, 4, 2048, "codes", "tiled", True, True), "pair_gemv"),
        ((L.PAIR_GROUPED_MAX_ROWS + 1, 40, 4, 2048, "codes", "tiled", True, True), "mma_gemv"),
        ((1, 8, 4, 2048, "fragments", "tiled", True, False), "mma_gemv"),        # float32 sums at k = 4
        ((1, 8, 2, 2048, "fragments", "tiled", True, False), "pair_gemv"),       # ... at k = 2, <= 8 rows
        ((1, 9, 2, 2048, "fragments", "tiled", True, False), "mma_gemv"),
        ((4, 32, 4, 5120, "fragments", "tiled", True, False), "pair_gemv"),      # ... at k = 4 past K = 4096 too,
        ((4, 33, 4, 5120, "fragments", "tiled", True, False), "mma_gemv"),       # <= 32 rows
        ((4, 32, 4, 4096, "codes", "tiled", True, False), "mma_gemv"),
        ((N8, 64, 4, 2048, "codes", "tiled", True, True), "mma_gemv"),
        ((N8 + 1, 64, 4, 2048, "codes", "tiled", True, True), "grouped_gemm"),
        ((2, 16, 4, 2048, "codes", "tiled", False, False), "grouped_gemv"),      # float32 A: no tensor-core gemv
        ((2, 16, 4, 96, "codes", "tiled", True, False), "grouped_gemv"),          # K % 64
        ((2, 16, 4, 2048, None, "tiled", True, False), "grouped_gemv"),
        ((5, 16, 4, 2048, None, "tiled", True, False), "grouped_gemm"),
        ((5, 16, 4, 2048, None, "flat", True, False), None),                      # flat: the scalar gemv's 4 rows
        ((N8 + 1, 64, 4, 2048, "codes", None, True, True), "pair_gemv"),          # code layout alone: any routing
    ]
    for args, want in cases:
        assert L.choose_grouped(*args) == want, (args, want)


def test_kbit_experts_linear_split_k_sums_in_its_workspace():
    """Past K = 4096 the grouped tensor-core gemv splits K at k = 4 (``mma_gemv.k_splits``): ``KbitExpertsLinear``
    gives it the layer's workspace (one buffer for every call, as the grouped gemm's), so a prepared plan allocates
    nothing. On the GPU the result also equals the reference and the workspace is left zeroed."""
    rng = np.random.default_rng(7)
    N, K, counts = 16, 5120, [3, 0, 2]
    flats = [ref.quantize(random_weight(rng, N, K), k=4) for _ in counts]
    layer = kb.KbitExpertsLinear(kb.stack_experts([ref.to_codes(w) for w in flats]))
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    A = _activations(rng, int(offsets[-1]), K, "float16")
    plans = [layer.plan(A, offsets, out_dtype=np.float32, kernel="mma_gemv") for _ in range(2)]
    assert [len(p.steps) for p in plans] == [2, 2]                   # the split launch and the finishing one
    assert plans[0].workspace is plans[1].workspace is layer.workspace.sums(0)
    if not SIM:                                                      # (20 K-warps a CTA: too slow simulated)
        got = plans[0].prepare().run().copy_to_host()
        for e, w in enumerate(flats):
            rows = slice(offsets[e], offsets[e + 1])
            if counts[e]:
                check_close(got[rows], A[rows], w)
        assert not plans[0].workspace.copy_to_host().any()


def test_linear_draws_split_sums_from_its_workspace_only_when_the_plan_splits():
    """``linear`` hands its ``Workspace`` to the tensor-core gemv and the gemm; the plan draws the float32 sums from it
    only when it splits K (``core.split_sums``), so the split decision lives in the plan alone. Host-only (no
    launch)."""
    rng = np.random.default_rng(8)
    codes = ref.to_codes(ref.quantize(random_weight(rng, 16, 5120), k=4))
    ws = kb.Workspace()
    plan = partial(kb.dispatch.plan, qw=codes, workspace=ws)
    whole = plan(_activations(rng, 2, 5120, "float16"), kernel="mma_gemv", params={"split": 1})
    assert whole.workspace is None and ws._sums is None                 # no split: nothing drawn, nothing allocated
    split = plan(_activations(rng, 4, 5120, "float16"), kernel="mma_gemv", params={"split": 2})
    assert len(split.steps) == 2 and split.workspace is ws.sums(0)
    gemm = plan(_activations(rng, 4, 5120, "float16"), kernel="gemm", params={"split": 4})
    assert gemm.workspace is ws.sums(0)


@pytest.mark.parametrize("keep, f16_acc, counts, want", [
    ("both", True, [1, 0, 2], "pair_gemv"),
    ("both", True, [5, 0, 1], "mma_gemv"),
    ("both", False, [9, 0, 1], "grouped_gemm"),
    ("tiled", False, [2, 0, 1], "grouped_gemv"),
    ("codes", False, [9, 0, 1], "pair_gemv"),
])
def test_kbit_experts_linear_runs_the_chosen_kernel(keep, f16_acc, counts, want):
    """``KbitExpertsLinear`` (and ``grouped_linear``) on a routing that each grouped kernel serves: the kernel
    ``kernel_for`` names runs (its plan's first step is that family's build), and every expert's rows equal the
    reference within that kernel's bound; host and device offsets (with ``max_tokens``) choose alike."""
    rng = np.random.default_rng(len(counts) + sum(counts))
    N, K, k = 16 if keep == "codes" and SIM else 128, 64, 4       # (the tiled layout: N a multiple of 128)
    flats = [ref.quantize(random_weight(rng, N, K), k=k) for _ in counts]
    tiled = kb.stack_experts([ref.repack_tiled(w) for w in flats]) if keep != "codes" else None
    codes = kb.stack_experts([ref.to_codes(w) for w in flats]) if keep != "tiled" else None
    layer = kb.KbitExpertsLinear(tiled if tiled is not None else codes, codes if keep == "both" else None,
                                 f16_acc=f16_acc)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    T, most = int(offsets[-1]), max(counts)
    A = _activations(rng, T, K, "float16")
    assert layer.kernel_for(most, T) == want
    plan = layer.plan(A, offsets, out_dtype=np.float32)
    family = {"pair_gemv": "pair_gemv", "mma_gemv": "mma_gemv", "grouped_gemv": "scalar_gemv",
              "grouped_gemm": "tensor_gemm"}[want]
    kernels = [getattr(s, "kernel", None) for s in plan.steps]
    assert any(getattr(kern, "py_func", None).__module__ == f"kbit_numba.{family}" for kern in kernels), want
    on_device = layer.plan(A, cuda.to_device(offsets), out_dtype=np.float32, max_tokens=most)
    assert [getattr(s, "kernel", None) for s in on_device.steps] == kernels
    got = plan.prepare().run().copy_to_host()      # (prepared: the buffers as a CUDA graph would bind them)
    if keep != "both" and not SIM:                # (the same launch again: on the GPU only)
        assert np.array_equal(kb.grouped_linear(A, tiled if tiled is not None else codes, cuda.to_device(offsets),
                                                out_dtype=np.float32).copy_to_host(), got)
    for e, w in enumerate(flats):
        rows = slice(offsets[e], offsets[e + 1])
        if counts[e] and want == "pair_gemv" and f16_acc:
            check_close_f16_acc(got[rows], A[rows], w, np.float32)
        elif counts[e]:
            check_close(got[rows], A[rows], w)

