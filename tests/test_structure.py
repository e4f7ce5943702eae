"""The shape every kernel family shares: Specs (normalised cache keys), Plans (launch steps), the core
(one device_weight, experts), the per-GPU table's parameters, and the refusals of bad user arguments."""
import json

import numpy as np
import pytest
from numba import cuda

import kbit_numba as kb
from kbit_numba import bench, core, dispatch, pair_gemv, scalar_gemv, tensor_gemm
from kbit_numba import reference as ref
from kbit_numba.launch import Plan, Prepared, Step
from helpers import random_weight
from test_gemm import check_close


# ---- Specs ------------------------------------------------------------------------------------------
def test_specs_normalise_so_equal_choices_are_one_key():
    a = scalar_gemv.GemvSpec(4, 1, a_type=np.float16, out_dtype=np.dtype(np.float32), grouped=0)
    b = scalar_gemv.GemvSpec(4, 1, a_type="float16", out_dtype="float32", grouped=False)
    assert a == b and hash(a) == hash(b) and scalar_gemv.make_gemv_kernel(a) is scalar_gemv.make_gemv_kernel(b)
    assert a.cols == scalar_gemv.DEFAULTS["cols"]
    # stages=None is the default ring depth written out: one compilation either way
    mt = tensor_gemm.M_TILES[0]
    assert tensor_gemm.GemmSpec(4, mt) == tensor_gemm.GemmSpec(4, mt, stages=tensor_gemm.STAGES_FOR_MT[mt])
    assert pair_gemv.PairGemvSpec(2, 3, out_dtype=np.float16).name.startswith("pair_gemv k=2 M=3 cols=")


@pytest.mark.parametrize("make, match", [
    (lambda: scalar_gemv.GemvSpec(4, 5), "M = 1..4"),
    (lambda: scalar_gemv.GemvSpec(6, 1), "k must be one of"),
    (lambda: scalar_gemv.GemvSpec(4, 1, cols=3), "cols must be one of"),
    (lambda: scalar_gemv.GemvSpec(4, 1, a_type="int8"), "a_type must be one of"),
    (lambda: scalar_gemv.GemvSpec(4, 1, out_dtype="bfloat16"), "out_dtype must be one of"),
    (lambda: tensor_gemm.GemmSpec(4, 3), "m_tile must be one of"),
    (lambda: tensor_gemm.GemmSpec(4, 1, a_type="float32"), "a_type must be one of"),
    (lambda: pair_gemv.PairGemvSpec(3, 1), "k in"),
    (lambda: pair_gemv.PairGemvSpec(4, 1, a_type="float32", f16_acc=True), "f16_acc needs float16"),
    (lambda: pair_gemv.PairGemvSpec(4, 2, grouped=True), "one row a slot"),
    (lambda: pair_gemv.PairGemvSpec(2, 1, full_batches=True), "full_batches runs whole batches"),
])
def test_specs_refuse_bad_choices(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_ptx_checks_cover_the_shipped_defaults():
    """The PTX test compiles what the plans launch by default (the list is derived from the DEFAULTS)."""
    gemv = set(scalar_gemv.ptx_specs())
    assert all(scalar_gemv.GemvSpec(k, M) in gemv for k in kb.K_BITS for M in (1, 2, 3, 4))
    pair = set(pair_gemv.ptx_specs())
    for k in pair_gemv.CODES_K:
        for M in (1, 2, 3, 4):
            for N, K in ((64, 64), (14336, 4096)):             # small weights (small_cols) and large
                assert pair_gemv.PairGemvSpec(k, M, pair_gemv.default_cols(M, N, K)) in pair
    gemm = set(tensor_gemm.ptx_specs())
    assert all(tensor_gemm.GemmSpec(k, mt) in gemm for k in kb.K_BITS for mt in tensor_gemm.M_TILES)


# ---- Plans ------------------------------------------------------------------------------------------
def test_every_family_plans_the_same_way():
    rng = np.random.default_rng(0)
    qw = ref.quantize(random_weight(rng, 8, 64), k=4)
    A = cuda.to_device(rng.standard_normal((2, 64)).astype(np.float16))
    plans = [scalar_gemv.plan(A, qw, out_dtype=np.float32), pair_gemv.plan(A, ref.to_codes(qw), out_dtype=np.float32),
             dispatch.plan(A, qw, out_dtype=np.float32, kernel="gemv")]
    for p in plans:
        assert isinstance(p, Plan) and p.A is A and all(isinstance(s, Step) for s in p.steps)
        check_close(p.launch().copy_to_host(), A.copy_to_host(), qw)
        prep = p.prepare()
        assert isinstance(prep, Prepared)
        check_close(prep.run().copy_to_host(), A.copy_to_host(), qw)


def test_table_parameters_reach_the_kernel():
    """A table rule may carry launch parameters: they override the family's DEFAULTS for that kernel."""
    table = {"rules": [[4, "gemv", {"cols": 4}], [None, "gemm", {"split": 1}]], "shapes": {}}
    assert dispatch.choose_rule(2, 128, 64, "flat", table, backend=False) == ("gemv", {"cols": 4})
    assert dispatch.choose_rule(9, 128, 64, "flat", table, backend=False) == ("gemv", {})   # a fallback
    rng = np.random.default_rng(1)
    qw = ref.quantize(random_weight(rng, 8, 64), k=4)
    A = rng.standard_normal((1, 64)).astype(np.float16)
    p = dispatch.plan(A, qw, out_dtype=np.float32, table=table)
    want = scalar_gemv.make_gemv_kernel(scalar_gemv.GemvSpec(4, 1, cols=4, out_dtype="float32"))
    assert p.steps[0].kernel is want
    check_close(p.launch().copy_to_host(), A, qw)
    layer = kb.KbitLinear(qw, table=table, layout="tiled")   # (N = 8: kept flat) the layer's path too
    assert layer.plan(A, out_dtype=np.float32).steps[0].kernel is want
    # the code layout's rules (KbitLinear's default for k = 4) carry parameters the same way
    table["codes_rules"] = [[4, "pair_gemv", {"cols": 1}], [None, "gemm"]]
    layer = kb.KbitLinear(qw, table=table)
    assert layer.weight.layout == "codes"
    assert layer.plan(A, out_dtype=np.float32).steps[0].kernel is pair_gemv.make_pair_gemv_kernel(
        pair_gemv.PairGemvSpec(4, 1, cols=1, out_dtype="float32"))


def epilogue_case(rng, N, K, variant):
    """A k = 4 weight, one row of activations and a table whose code-layout rules run the pair gemv with cols = 4 and
    give the build named by ``variant`` (``"k=4 silu"``, ``"k=4 acc"``) cols = 2 in 2-warp CTAs at M = 1."""
    qw = ref.quantize(random_weight(rng, N, K), k=4)
    A = rng.standard_normal((1, K)).astype(np.float16)
    table = {"rules": [[None, "gemv"]], "shapes": {}, "codes_rules": [[4, "pair_gemv", {"cols": 4}], [None, "gemm"]],
             "codes_shapes": {f"{K}x{N}": {variant: [[1, "pair_gemv", {"cols": 2, "cta_warps": 2}]]}}}
    return qw, A, table


def test_silu_knobs_reach_only_the_silu_build():
    """A table's "<variant> silu" per-shape rules (dispatch.silu_knobs) give the pair gemv's SiLU build its own
    launch knobs; the plain build, an explicitly named kernel and a silu rule naming another kernel keep the plain
    rules' knobs."""
    rng, N, K = np.random.default_rng(2), 16, 64
    qw, A, table = epilogue_case(rng, N, K, "k=4 silu")
    layer = kb.KbitLinear(qw, table=table)

    def kernel(cols, silu):
        return pair_gemv.make_pair_gemv_kernel(pair_gemv.PairGemvSpec(4, 1, cols, silu_pairs=silu))
    assert layer.plan(A).steps[0].kernel is kernel(4, False)
    p = layer.plan(A, silu_pairs=True)
    assert p.steps[0].kernel is kernel(2, True) and p.steps[0].block == 2 * 32      # two 1-warp slices (K = 64)
    want = ref.silu_pairs(ref.gemv(A, qw).astype(np.float64))
    np.testing.assert_allclose(p.launch().copy_to_host(), want, rtol=2e-2, atol=2e-3 * np.abs(want).max())
    # past the silu rules' last M the SiLU build takes the plain rules' knobs (the H200 table's gate/up silu rules
    # cover M = 1 only: the B = 2, 3 steps raised StopIteration here until 2026-12-05)
    assert dispatch.silu_knobs(table, N, K, 2, k=4) is None
    A2 = rng.standard_normal((2, K)).astype(np.float16)
    spec2 = pair_gemv.PairGemvSpec(4, 2, 4, silu_pairs=True)
    assert layer.plan(A2, silu_pairs=True).steps[0].kernel is pair_gemv.make_pair_gemv_kernel(spec2)
    named = layer.plan(A, kernel="pair_gemv", silu_pairs=True).steps[0]        # the caller's kernel: no table knobs
    direct = pair_gemv.plan(A, layer.weight, silu_pairs=True).steps[0]
    assert (named.kernel, named.grid, named.block) == (direct.kernel, direct.grid, direct.block)
    default = kb.KbitLinear(qw).plan(A, silu_pairs=True).steps[0]               # the device's own table (None given)
    assert default.kernel is pair_gemv.plan(A, layer.weight, silu_pairs=True).steps[0].kernel
    table["codes_shapes"][f"{K}x{N}"]["k=4 silu"] = [[1, "mma_gemv"]]            # not the pair gemv at M = 1: ignored
    assert kb.KbitLinear(qw, table=table).plan(A, silu_pairs=True).steps[0].kernel is kernel(4, True)


def test_acc_knobs_reach_only_the_residual_add_build():
    """A table's "<variant> acc" per-shape rules (dispatch.epilogue_knobs with ACC) give the pair gemv's residual-add
    build (``accumulate``: out += A W^T, the step's o and down) its own launch knobs; the plain build, the SiLU build
    and an explicitly named kernel keep theirs, and past the acc rules' last M the plain rules' knobs apply."""
    rng, N, K = np.random.default_rng(3), 16, 64
    qw, A, table = epilogue_case(rng, N, K, "k=4 acc")
    layer = kb.KbitLinear(qw, table=table)

    def kernel(cols, M=1, **kw):
        return pair_gemv.make_pair_gemv_kernel(pair_gemv.PairGemvSpec(4, M, cols, **kw))
    assert layer.plan(A).steps[0].kernel is kernel(4)
    assert layer.plan(A, silu_pairs=True).steps[0].kernel is kernel(4, silu_pairs=True)
    residual = rng.standard_normal((1, N)).astype(np.float16)
    out = cuda.to_device(residual.copy())
    p = layer.plan(A, out=out, accumulate=True)
    assert p.steps[0].kernel is kernel(2, accumulate=True) and p.steps[0].block == 2 * 32   # two 1-warp slices
    p.launch()
    want = residual.astype(np.float64) + ref.gemv(A, qw).astype(np.float64)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=2e-2, atol=2e-3 * np.abs(want).max())
    assert dispatch.epilogue_knobs(table, N, K, 2, k=4, epilogue=dispatch.ACC) is None
    assert dispatch.silu_knobs(table, N, K, 1, k=4) is None                     # (an acc rule is not a silu one)
    A2 = rng.standard_normal((2, K)).astype(np.float16)
    out2 = cuda.to_device(np.zeros((2, N), np.float16))
    assert layer.plan(A2, out=out2, accumulate=True).steps[0].kernel is kernel(4, 2, accumulate=True)
    named = layer.plan(A, out=out, kernel="pair_gemv", accumulate=True).steps[0]     # the caller's kernel: no knobs
    direct = pair_gemv.plan(A, layer.weight, out=out, accumulate=True).steps[0]
    assert (named.kernel, named.grid, named.block) == (direct.kernel, direct.grid, direct.block)


def shipped_tables():
    """(path, table) of every per-GPU table in kbit_numba/tuning."""
    import glob
    import os
    for path in sorted(glob.glob(os.path.join(dispatch.TUNING_DIR, "*.json"))):
        with open(path) as f:
            yield path, json.load(f)


def shipped_rules():
    """(table path, where, variant, rule) of every rule of the per-GPU tables' code-layout sections: ``codes_variants``
    and each shape of ``codes_shapes``."""
    for path, table in shipped_tables():
        groups = [("codes_variants", table.get("codes_variants", {}))]
        groups += [(f"codes_shapes {shape}", rules) for shape, rules in table.get("codes_shapes", {}).items()]
        for where, by_variant in groups:
            for variant, rs in by_variant.items():
                for r in rs:
                    yield path, where, variant, r


def test_shipped_epilogue_rules_are_knobs_their_build_takes():
    """The per-GPU tables' hand-written "<variant> silu" and "<variant> acc" rules: a known variant key, M
    thresholds, and knobs the build accepts (cols from COL_CHOICES, even for the SiLU build; cta_warps), so that
    epilogue_knobs never hands the plan a bad knob."""
    variants = {dispatch.codes_variant(k, f, p) + e for k in (2, 4) for f in (False, True) for p in (False, True)
                for e in dispatch.EPILOGUES}
    seen = 0
    for path, where, variant, r in shipped_rules():
        if not variant.endswith(dispatch.EPILOGUES):
            continue
        assert variant in variants, (path, where, variant)
        assert (r[0] is None or r[0] >= 1) and r[1] in dispatch.KERNELS, (path, where, r)
        knobs = r[2] if len(r) > 2 else {}
        assert set(knobs) <= {"cols", "cta_warps"}, (path, where, r)
        assert knobs.get("cols", 2) in pair_gemv.COL_CHOICES, (path, where, r)
        assert knobs.get("cols", 2) % 2 == 0 or not variant.endswith(dispatch.SILU), (path, where, r)
        seen += 1
    assert seen >= 5          # (the H200's gate/up silu rules, the H100's gate/up silu and o, down acc rules)


def test_shipped_rule_lists_cover_every_m():
    """Every rule list of the per-GPU tables but the epilogue builds' (which may stop at any M: epilogue_knobs then
    gives the plain build's knobs) ends with an any-M rule, in increasing M, so that a lookup finds a rule for every
    batch."""
    lists = 0
    for path, table in shipped_tables():
        found = [(key, table[key]) for key in ("rules", "codes_rules", "codes_mm_rules") if key in table]
        found += [(f"{key} {shape}", rs) for key in ("shapes", "codes_mm_shapes", "codes_variants")
                  for shape, rs in table.get(key, {}).items()]
        found += [(f"codes_shapes {shape} {variant}", rs) for shape, by_variant in table.get("codes_shapes", {}).items()
                  for variant, rs in by_variant.items() if not variant.endswith(dispatch.EPILOGUES)]
        for where, rs in found:
            ms = [r[0] for r in rs]
            assert ms and ms[-1] is None and None not in ms[:-1], (path, where, rs)
            assert ms[:-1] == sorted(ms[:-1]), (path, where, rs)
            for M in (1, 2, 3, 4, 16, 64, 600):
                assert dispatch._first_rule(rs, M)[0] in dispatch.KERNELS, (path, where, M)
            lists += 1
    assert lists > 50


def test_shipped_pair_gemv_rules_are_knobs_the_plan_takes():
    """Every per-GPU table's pair gemv rules, per variant and per shape (the tune writes them, people edit them: the
    H200's 4096x6144 k = 2 rule is hand-set): knobs pair_gemv.plan takes, cols from COL_CHOICES, cta_warps a positive
    int, so that a typo fails here rather than in a user's first call on that GPU."""
    seen = 0
    for path, where, variant, r in shipped_rules():
        if r[1] != "pair_gemv" or len(r) < 3:
            continue
        knobs = r[2]
        assert set(knobs) <= {"cols", "cta_warps"}, (path, where, variant, r)
        assert knobs.get("cols", 4) in pair_gemv.COL_CHOICES, (path, where, variant, r)
        w = knobs.get("cta_warps", 1)
        assert isinstance(w, int) and w >= 1, (path, where, variant, r)
        seen += 1
    assert seen >= 200        # (264 in the H100 and H200 tables today)


# ---- the core ---------------------------------------------------------------------------------------
FAMILIES = ("codec", "scalar_gemv", "pair_gemv", "mma_gemv", "tensor_gemm", "uniform", "sbvr", "bitnet")
SHARED = ("_arrays", "core", "formats", "device", "intrinsics", "launch", "act_quant", "reference")


def test_no_kernel_family_imports_another():
    import ast
    import os
    root = os.path.dirname(kb.__file__)
    for fam in FAMILIES:
        tree = ast.parse(open(os.path.join(root, fam + ".py")).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = [node.module] if node.module else [a.name for a in node.names]
                assert all(n.split(".")[0] in SHARED for n in names), f"{fam} imports {names}"


def test_one_device_weight_checks_every_container():
    qw = ref.quantize(np.ones((8, 64), np.float32), k=2)
    with pytest.raises(TypeError, match="weight.packed must have dtype"):
        core.device_weight(kb.KbitWeight(qw.packed.view(np.int32), qw.absmax, qw.codebook, 2, (8, 64)), kb.KbitWeight)
    with pytest.raises(TypeError, match="weight.absmax must have dtype"):
        core.device_weight(kb.KbitWeight(qw.packed, qw.absmax.astype(np.float32), qw.codebook, 2, (8, 64)),
                           kb.KbitWeight)
    with pytest.raises(ValueError, match="codebook must hold 4 values"):
        core.device_weight(kb.KbitWeight(qw.packed, qw.absmax, np.zeros(8, np.float32), 2, (8, 64)), kb.KbitWeight)
    with pytest.raises(TypeError, match="must be a UniformWeight"):
        core.device_weight(qw, kb.formats.UniformWeight)
    uw = ref.uniform_quantize(np.ones((4, 64), np.float32), 4, 64)
    with pytest.raises(TypeError, match="weight.scale_zero must have dtype"):
        kb.uniform.gemv(np.ones((1, 64), np.float16), kb.formats.UniformWeight(
            uw.packed, uw.scale_zero.astype(np.float32), 4, (4, 64), 64))
    w = core.device_weight(kb.KbitWeight(qw.packed, qw.absmax, list(qw.codebook), 2, (8, 64)), kb.KbitWeight)
    assert w.on_device and np.array_equal(w.codebook.copy_to_host(), qw.codebook)


# ---- refusals of bad user arguments ------------------------------------------------------------------
def test_user_arguments_are_refused_with_clear_errors():
    """What tests/test_refusals.py's table rows (m_tile, split, stream, list A for gemv) do not cover."""
    flat = ref.quantize(np.ones((128, 64), np.float32), k=4)
    tiled = ref.repack_tiled(flat)
    with pytest.raises(TypeError, match="A must be a NumPy array or a CUDA array"):   # (was AttributeError)
        kb.linear([[1.0] * 64], flat)
    with pytest.raises(ValueError, match="M = 1..4"):
        kb.gemv(np.ones((0, 64), np.float16), flat)
    out = kb.gemm(np.ones((0, 64), np.float16), tiled)                      # M = 0: an empty result
    assert out.shape == (0, 128)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantizers_refuse_nan_and_inf(bad):
    W = np.ones((16, 128), np.float32)
    W[3, 5] = bad
    for quantize in (lambda: ref.quantize(W, k=4), lambda: kb.quantize(W, k=4),
                     lambda: ref.uniform_quantize(W, 4, 64), lambda: ref.bitnet_quantize(W),
                     lambda: kb.bitnet.quantize(W), lambda: ref.sbvr_encode(W, lines=4, iters=1, kmeans_iters=1)):
        with pytest.raises(ValueError, match="NaN or Inf"):
            quantize()
    with pytest.raises(ValueError, match="NaN or Inf"):          # a device W: flagged by the kernel
        kb.uniform.quantize(cuda.to_device(W), 4, 64)


def test_tune_table_writes_the_winning_parameters():
    """bench --tune --sweep: a swept variant that wins a point goes into the table with its parameters."""
    from kbit_numba.bench import tune_table
    row = lambda kern, M, us, params=None: dict(kernel=kern, shape="64x128", M=M, us=us, params=params)  # noqa
    rows = [row("gemv", 1, 5.0), row("gemv[cols=4,max_registers=None]", 1, 4.0, {"cols": 4, "max_registers": None}),
            row("gemm", 1, 9.0), row("gemv", 8, 30.0), row("gemm", 8, 10.0), row("linear[gemm]", 8, 1.0)]
    table = tune_table(rows, "test")
    assert table["shapes"]["64x128"] == [[1, "gemv", {"cols": 4, "max_registers": None}], [None, "gemm"]]
    kern, params = dispatch.choose_rule(1, 128, 64, "flat", table, backend=False)
    assert (kern, params) == ("gemv", {"cols": 4, "max_registers": None})


def test_tune_table_picks_the_code_layouts_crossover():
    """bench --tune: the code layout's gemm and dequantize + cuBLAS rows give that layout's crossover per shape
    (``codes_mm_shapes``) and for any shape (``codes_mm_rules``); linear follows it only past the gemvs."""
    from kbit_numba.bench import tune_table
    row = lambda kern, M, us, shape="64x128": dict(kernel=kern, shape=shape, M=M, us=us)  # noqa: E731
    rows = [row("gemm", 32, 5.0), row("dequant_matmul", 32, 9.0), row("gemm+codes", 32, 6.0),
            row("dequant_matmul+codes", 32, 4.0), row("gemm+codes", 128, 20.0), row("dequant_matmul+codes", 128, 8.0),
            row("gemm+codes", 32, 3.0, "64x256"), row("dequant_matmul+codes", 32, 4.0, "64x256"),
            row("gemm+codes", 128, 9.0, "64x256"), row("dequant_matmul+codes", 128, 8.0, "64x256"),
            row("linear+codes[gemm]", 32, 1.0)]
    table = tune_table(rows, "test")
    assert table["shapes"]["64x128"] == [[None, "gemm"]]                    # the tiled rows alone
    assert table["codes_mm_shapes"] == {"64x128": [[None, "dequant_matmul"]],
                                        "64x256": [[32, "gemm"], [None, "dequant_matmul"]]}
    assert table["codes_mm_rules"] == [[None, "dequant_matmul"]]           # (64x256's gemm at 32: 0.75x, 64x128's 1.5x)
    choose = lambda M, N: dispatch.choose_rule(M, N, 64, "codes", table, backend="torch", k=4)[0]  # noqa: E731
    assert [choose(M, 256) for M in (1, 16, 32, 33)] == ["pair_gemv", "mma_gemv", "gemm", "dequant_matmul"]
    assert [choose(M, 128) for M in (1, 32)] == ["pair_gemv", "dequant_matmul"]
    assert choose(32, 512) == "dequant_matmul"                                # an untuned shape: the general rules


def test_tune_table_caps_the_tensor_core_gemv_per_shape():
    """bench --tune: the tensor-core gemv's rows on the code layout beside that layout's gemm and dequantize + cuBLAS
    give a per-shape cap (mma_gemv_max_m_shapes): of 2, the measured Ms >= 3 and None, the one whose worst loss past
    the 3% margin is smallest, the largest of a tie. A gemv that loses from some M on is capped at the last M before
    it (the Ms between unmeasured: not kept); one that loses at one M but wins past it by more, or never loses, gets
    None, which the merge into an older table turns into no cap (others kept)."""
    from kbit_numba.bench import merge_mma_caps, mma_gemv_caps, tune_table
    row = lambda kern, M, us, shape="5120x2048", k=4: dict(kernel=kern, shape=shape, M=M, us=us, k=k)  # noqa: E731
    rows = [row("gemm", 16, 10.7), row("gemv", 1, 5.0),                     # (the tiled layout's rows)
            row("mma_gemv+codes", 2, 50.0),                                   # M = 2: the pair gemv's anyway
            row("mma_gemv+codes", 4, 10.0), row("gemm+codes", 4, 11.0),
            row("mma_gemv+codes", 8, 11.6), row("gemm+codes", 8, 11.5),      # 0.9% slower: kept
            row("mma_gemv+codes", 16, 23.4), row("gemm+codes", 16, 13.0), row("dequant_matmul+codes", 16, 15.0),
            row("mma_gemv+codes", 4, 5.0, "2048x4096"), row("gemm+codes", 4, 9.0, "2048x4096"),
            row("mma_gemv+codes", 16, 7.0, "2048x4096"), row("gemm+codes", 16, 10.6, "2048x4096"),
            row("mma_gemv+codes", 3, 9.0, "4096x2048", 2), row("dequant_matmul+codes", 3, 8.0, "4096x2048", 2)]
    # (H100, 5120x2048 k = 2, 2026-12-07: 5% behind at M = 12, up to 15% ahead past it: no cap)
    rows += [row("mma_gemv+codes", M, g, "5120x2048", 2) for M, g in ((8, 8.5), (12, 10.3), (16, 10.8), (32, 13.4))]
    rows += [row("gemm+codes", M, o, "5120x2048", 2) for M, o in ((8, 8.8), (12, 9.8), (16, 11.2), (32, 15.7))]
    table = tune_table(rows, "test")
    caps = table["mma_gemv_max_m_shapes"]
    assert caps == {"5120x2048": {"4": 8, "2": None}, "2048x4096": {"4": None}, "4096x2048": {"2": 2}}
    # ... but with a loss at M = 32 too (8%) a cap: 8 (worst loss the gemm's 3.7% at M = 16), not 16 or 12 (the gemv's
    # 5% at M = 12), nor None (8% at 32)
    late = [r for r in rows if r["k"] == 2 and r["shape"] == "5120x2048" and r["M"] != 32]
    late += [row("mma_gemv+codes", 32, 17.0, "5120x2048", 2), row("gemm+codes", 32, 15.7, "5120x2048", 2)]
    assert mma_gemv_caps(late) == {"5120x2048": {"2": 8}}
    merged = merge_mma_caps({"2048x4096": {"4": 8, "2": 12}, "8192x8192": {"4": 4}}, caps)
    assert merged == {"5120x2048": {"4": 8}, "2048x4096": {"2": 12}, "4096x2048": {"2": 2}, "8192x8192": {"4": 4}}
    table["mma_gemv_max_m_shapes"] = merged
    choose = lambda M, N, K, k=4: dispatch.choose_rule(M, N, K, "codes", table, backend="torch", k=k)[0]  # noqa
    assert [choose(M, 2048, 5120) for M in (8, 9, 16)] == ["mma_gemv", "gemm", "gemm"]
    assert [choose(M, 4096, 2048) for M in (9, 16)] == ["mma_gemv", "mma_gemv"]          # no cap: the k cap (16)
    assert choose(3, 2048, 4096, k=2) == "dequant_matmul"      # capped at 2: past it the rows' crossover (dequant)


def test_tune_table_scores_each_k_and_merge_keeps_what_was_not_measured():
    """bench --tune --k 4,2: a shape's rule at an M is the kernel with the best geometric mean over the k's, not the
    faster time of either (here dequantize + cuBLAS wins k = 2 by 2% and loses k = 4 by 20%: the gemm). merge_tuned
    keeps the shapes the run did not measure, a measured shape's rules past the largest M measured, and the keys
    --tune does not write."""
    from kbit_numba.bench import merge_tuned, tune_table
    row = lambda kern, M, us, k, shape="64x128": dict(kernel=kern, shape=shape, M=M, us=us, k=k)  # noqa: E731
    rows = [row("gemv", 1, 3.0, 4), row("gemm", 1, 5.0, 4), row("gemv", 1, 2.0, 2), row("gemm", 1, 4.0, 2),
            row("gemm", 16, 10.0, 4), row("dequant_matmul", 16, 12.0, 4),
            row("gemm", 16, 9.0, 2), row("dequant_matmul", 16, 8.8, 2),
            row("gemm+codes", 16, 10.5, 4), row("dequant_matmul+codes", 16, 12.0, 4)]
    new = tune_table(rows, "test")
    assert new["shapes"] == {"64x128": [[1, "gemv"], [None, "gemm"]]}
    assert new["rules"] == [[1, "gemv"], [None, "gemm"]]
    old = {"device": "test", "rules": [[2, "gemv"], [64, "gemm"], [None, "dequant_matmul"]],
           "shapes": {"64x128": [[4, "gemv"], [32, "gemm"], [None, "dequant_matmul"]],
                      "64x256": [[1, "gemv"], [None, "gemm"]]},
           "codes_mm_rules": [[32, "gemm"], [None, "dequant_matmul"]], "codes_shapes": {"64x128": "kept"},
           "mma_gemv_max_m_shapes": {"64x256": {"2": 12}}}
    table = merge_tuned(old, new, rows)
    assert table["shapes"] == {"64x128": [[1, "gemv"], [32, "gemm"], [None, "dequant_matmul"]],
                               "64x256": [[1, "gemv"], [None, "gemm"]]}
    assert table["rules"] == [[1, "gemv"], [64, "gemm"], [None, "dequant_matmul"]]
    assert table["codes_mm_shapes"] == {"64x128": [[32, "gemm"], [None, "dequant_matmul"]]}   # (the old general)
    assert table["codes_mm_rules"] == [[32, "gemm"], [None, "dequant_matmul"]]
    assert table["codes_shapes"] == {"64x128": "kept"}
    assert table["mma_gemv_max_m_shapes"] == {"64x256": {"2": 12}}
    assert merge_tuned({}, new, rows)["shapes"] == new["shapes"]            # no table before: this run's rules


def test_tune_codes_table_writes_per_shape_knobs():
    """bench --tune-codes: per variant (k, block sums) and M, the knob set with the best geometric mean over the
    measured shapes becomes the rule for any shape when it beats the default plan by the margin; a shape whose own
    best beats that by the margin gets its own rules; near-ties keep what is there; every measured shape keeps its
    rules through a later tune of other shapes; linear then passes the knobs on."""
    from kbit_numba.bench import CODES_TUNE_MARGIN, tune_codes_table

    def row(M, us, params=None, k=4, f16=False, shape="64x128", pdl=False):
        return dict(kernel="pair_gemv", shape=shape, k=k, M=M, us=us, params=params, f16_acc=f16, pdl=pdl)
    win, c8 = {"cols": 2, "cta_warps": 12}, {"cols": 8}
    tie = 12.0 * (1 - CODES_TUNE_MARGIN / 2)
    rows = [row(1, 10.0), row(1, 9.0, win), row(1, 10.0, c8), row(2, 12.0), row(2, tie, c8),
            row(1, 10.0, shape="64x256"), row(1, 8.2, win, shape="64x256"), row(1, 7.5, c8, shape="64x256"),
            row(2, 12.0, shape="64x256"), row(2, tie, c8, shape="64x256"),
            row(3, 20.0, shape="64x256"), row(3, 15.0, {"cols": 2}, shape="64x256"),   # (M = 3 on one shape only)
            row(1, 5.0, k=2), row(1, 4.99, {"cols": 2}, k=2),                           # a near-tie: no rules
            row(1, 10.0, pdl=True), row(1, 8.0, c8, pdl=True)]                          # as a PDL chain
    rows += [dict(row(1, 1.0, {"cols": 4}), silu=True)]            # the SiLU build's rows: not the table's to read
    tail = [[16, "mma_gemv"], [None, "gemm"]]
    old = {"rules": [[None, "gemm"]], "codes_rules": [[2, "pair_gemv"]] + tail,
           "codes_shapes": {"64x128": {"k=2": [[1, "pair_gemv", {"cols": 1}], [None, "gemm"]]}, "9x9": {"k=4": []}}}
    table = tune_codes_table(rows, old)
    assert table["rules"] == old["rules"]                                                  # the rest is kept
    assert table["codes_variants"] == {"k=4": [[1, "pair_gemv", win], [2, "pair_gemv"]] + tail,
                                       "k=4 pdl": [[1, "pair_gemv", c8], [2, "pair_gemv"]] + tail}
    general = table["codes_variants"]["k=4"]
    assert table["codes_shapes"] == {
        "9x9": {"k=4": []},
        "64x128": {"k=2": [[1, "pair_gemv"], [None, "gemm"]],    # (M = 1: the default now; past it its old rules)
                   "k=4": general, "k=4 pdl": table["codes_variants"]["k=4 pdl"]},
        "64x256": {"k=4": [[1, "pair_gemv", c8], [2, "pair_gemv"], [3, "pair_gemv", {"cols": 2}]] + tail}}
    # a later tune over another shape rewrites the general rules at the Ms it measured (past them the rules stay);
    # the shapes measured before keep theirs
    later = tune_codes_table([row(1, 10.0, shape="64x512"), row(1, 6.0, {"cols": 4}, shape="64x512")], table)
    assert later["codes_variants"]["k=4"] == [[1, "pair_gemv", {"cols": 4}], [2, "pair_gemv"]] + tail
    assert list(later["codes_variants"]) == list(table["codes_variants"])     # (rewritten in place, not moved last)
    assert later["codes_shapes"]["64x128"]["k=4"] == general and "64x512" in later["codes_shapes"]
    assert dispatch.choose_rule(1, 128, 64, "codes", later, backend=False, k=4) == ("pair_gemv", win)
    choose = lambda M, N, **kw: dispatch.choose_rule(M, N, 64, "codes", table, backend=False, **kw)   # noqa: E731
    assert choose(1, 128, k=4) == choose(1, 512, k=4) == ("pair_gemv", win)     # any shape: the variant's rules
    assert choose(1, 256, k=4) == ("pair_gemv", c8) and choose(3, 256, k=4) == ("pair_gemv", {"cols": 2})
    assert choose(2, 128, k=4) == ("pair_gemv", {}) and choose(3, 128, k=4)[0] == "mma_gemv"
    assert choose(1, 128, k=2) == choose(1, 128, k=4, f16_acc=True) == ("pair_gemv", {})   # no rules: codes_rules
    assert choose(1, 128, k=4, pdl=True) == ("pair_gemv", c8)
    # the knobs reach the kernel through KbitLinear (the simulator's plan: 2 warps a CTA by default, 1 slice)
    rng = np.random.default_rng(2)
    qw = ref.quantize(random_weight(rng, 128, 64), k=4)
    A = rng.standard_normal((1, 64)).astype(np.float16)
    layer = kb.KbitLinear(qw, table=table)
    step = layer.plan(A, out_dtype=np.float32).steps[0]
    assert step.kernel is pair_gemv.make_pair_gemv_kernel(pair_gemv.PairGemvSpec(4, 1, cols=2, out_dtype="float32"))
    assert step.block == 12 * 32            # cta_warps = 12 at K = 64 (one K-warp): 12 one-warp slices
    check_close(layer(A, out_dtype=np.float32).copy_to_host(), A, qw)


def test_tune_codes_table_names_the_tensor_core_gemv_where_it_wins():
    """bench --tune-codes times the tensor-core gemv beside the pair gemv's knob sets from M = 2 on: where it is the
    fastest by the margin its rule names it, for one shape or for any; and a tuned variant's rules then decide M = 3
    with float16 sums at k = 4 too, which without tuned rules goes to the pair gemv (PAIR_GEMV_F16_MAX_M)."""
    from kbit_numba.bench import MMA, tune_codes_table

    def row(M, us, params=None, shape="64x128", f16=True, pdl=True, kernel="pair_gemv"):
        return dict(kernel=kernel, shape=shape, k=4, M=M, us=us, params=params, f16_acc=f16, pdl=pdl)
    c2 = {"cols": 2}
    mma, half_margin = MMA + "[pdl]", bench.CODES_TUNE_MARGIN / 2
    rows = [row(1, 10.0), row(1, 9.0, c2), row(2, 12.0), row(2, 11.8, c2), row(2, 15.0, kernel=mma),
            row(3, 15.0), row(3, 16.0, c2), row(3, 14.4, kernel=mma),                    # 64x128: 4% faster at 3
            row(1, 10.0, shape="64x256"), row(1, 9.0, c2, shape="64x256"), row(2, 12.0, shape="64x256"),
            row(2, 12.5, c2, shape="64x256"), row(2, 11.0, kernel=mma, shape="64x256"),  # 64x256: 8% faster at 2
            row(3, 15.0, shape="64x256"), row(3, 16.0, c2, shape="64x256"),
            row(3, 15.0 * (1 - half_margin), kernel=mma, shape="64x256")]                # ... and a near-tie at 3
    tail = [[16, "mma_gemv"], [None, "gemm"]]
    table = tune_codes_table(rows, {"rules": [[None, "gemm"]], "codes_rules": [[2, "pair_gemv"]] + tail})
    variant = "k=4 f16_acc pdl"
    assert table["codes_variants"] == {variant: [[1, "pair_gemv", c2], [2, "pair_gemv"], [3, "pair_gemv"]] + tail}
    assert table["codes_shapes"] == {
        "64x128": {variant: [[1, "pair_gemv", c2], [2, "pair_gemv"], [3, MMA]] + tail},
        "64x256": {variant: [[1, "pair_gemv", c2], [2, MMA], [3, "pair_gemv"]] + tail}}
    choose = lambda M, N, **kw: dispatch.choose_rule(M, N, 64, "codes", table, backend=False, k=4, **kw)  # noqa
    assert choose(3, 128, f16_acc=True, pdl=True) == (MMA, {})          # the tuned rule, not PAIR_GEMV_F16_MAX_M
    assert choose(2, 256, f16_acc=True, pdl=True) == (MMA, {})
    assert choose(3, 256, f16_acc=True, pdl=True)[0] == "pair_gemv"
    assert choose(3, 512, f16_acc=True, pdl=True)[0] == "pair_gemv"     # any shape: the variant's rules
    assert choose(3, 128, f16_acc=True)[0] == "pair_gemv"               # no tuned rules (not PDL): the override
    assert choose(3, 128)[0] == MMA                                     # (float32 sums: codes_rules)
    # a shape's entry keeps its own rules past the Ms a tune measured (a cap of 32, not codes_rules' 16)
    table["codes_shapes"]["64x128"][variant] = [[3, "pair_gemv"], [32, MMA], [None, "gemm"]]
    again = tune_codes_table([r for r in rows if r["shape"] == "64x128"], table)
    assert again["codes_shapes"]["64x128"][variant] == [[1, "pair_gemv", c2], [2, "pair_gemv"], [3, MMA], [32, MMA],
                                                        [None, "gemm"]]


def test_tune_codes_table_keep_general_writes_shape_entries_only():
    """bench --tune-codes --tune-keep-general: the general rules stay as they are, and each tuned shape's entry is
    its fastest candidate where that beats the rules the shape runs now (its entry, else the general rules) by the
    margin at that M, else their choice (the fastest where their choice was not timed); untuned shapes keep theirs."""
    from kbit_numba.bench import CODES_TUNE_MARGIN, MMA, tune_codes_table

    def row(M, us, params=None, shape="64x512", kernel="pair_gemv"):
        return dict(kernel=kernel, shape=shape, k=4, M=M, us=us, params=params, f16_acc=False, pdl=False)
    c2, c8 = {"cols": 2}, {"cols": 8}
    tail = [[16, MMA], [None, "gemm"]]
    general = [[1, "pair_gemv", c2], [2, MMA]] + tail
    old = {"rules": [[None, "gemm"]], "codes_rules": [[2, "pair_gemv"]] + tail, "codes_variants": {"k=4": general},
           "codes_shapes": {"64x128": {"k=4": [[2, "pair_gemv"]] + tail}, "9x9": {"k=4": []}}}
    near = 12.0 * (1 - CODES_TUNE_MARGIN / 2)
    rows = [row(1, 10.0), row(1, 9.0, c2), row(1, 8.0, c8),                  # c8 beats the general c2 by 11%
            row(2, near), row(2, 12.0, kernel=MMA),                          # a near-tie: the general MMA stays
            row(1, 10.0, shape="64x768"), row(1, 11.0, c8, shape="64x768"),  # the general c2 not timed: the fastest
            row(2, 12.0, shape="64x768"), row(2, 10.0, kernel=MMA, shape="64x768"),
            row(1, 10.0, shape="64x128"), row(1, 10.0 * (1 - CODES_TUNE_MARGIN / 2), c2, shape="64x128"),
            row(2, 12.0, shape="64x128"), row(2, 11.0, kernel=MMA, shape="64x128")]   # (judged against its entry)
    table = tune_codes_table(rows, old, keep_general=True)
    assert table["codes_variants"] == {"k=4": general}
    assert table["codes_shapes"] == {"9x9": {"k=4": []},
                                     "64x128": {"k=4": [[1, "pair_gemv"], [2, MMA]] + tail},
                                     "64x512": {"k=4": [[1, "pair_gemv", c8], [2, MMA]] + tail},
                                     "64x768": {"k=4": [[1, "pair_gemv"], [2, MMA]] + tail}}
    assert tune_codes_table(rows, old)["codes_variants"] != {"k=4": general}   # (without it: set from these shapes)
    assert dispatch.choose_rule(1, 256, 64, "codes", table, backend=False, k=4) == ("pair_gemv", c2)


def test_tune_codes_rows_time_the_tensor_core_gemv_from_m1(monkeypatch):
    """codes_tune_rows on the simulator (the timer stubbed: each candidate launched once, then given its turn's
    number): the pair gemv's rows first at each point, then from ``CODES_TUNE_MMA_FROM_M`` (1) the tensor-core gemv's,
    in the variant's PDL form, carrying the variant; none below it (checked with it raised to 2) or beside the SiLU
    build. The weights come from the NumPy quantizer (the same bytes, test_codec.py), which saves the simulated
    quantize kernel's ~26 s."""
    from kbit_numba import _timing, codec
    monkeypatch.setattr(codec, "quantize", lambda W, k: ref.quantize(W, k=k))
    launched = []

    def timer(launch, n):
        launch(0, 0)
        launched.append(n)
        return float(len(launched))
    monkeypatch.setattr(_timing, "graph_time_us", timer)
    monkeypatch.setattr(_timing, "rotation_count", lambda nbytes: 1)
    rows = bench.codes_tune_rows([(256, 32)], [4], {"read_GBps": 1.0}, lambda msg: None, reps=1,
                                 variants=[(True, True)], knob_sets=[{"cols": 2}], ms=[1, 2])
    assert bench.CODES_TUNE_MMA_FROM_M == 1
    assert [(r["kernel"], r["M"]) for r in rows] == [
        ("pair_gemv[f16,pdl]", 1), ("pair_gemv[cols=2,f16,pdl]", 1), ("mma_gemv[pdl]", 1),
        ("pair_gemv[f16,pdl]", 2), ("pair_gemv[cols=2,f16,pdl]", 2), ("mma_gemv[pdl]", 2)]
    assert rows[-1]["f16_acc"] and rows[-1]["pdl"] and rows[-1]["turns_us"] == [float(len(launched))]   # (last)
    monkeypatch.setattr(bench, "CODES_TUNE_MMA_FROM_M", 2)
    later = bench.codes_tune_rows([(256, 32)], [4], {"read_GBps": 1.0}, lambda msg: None, reps=1,
                                  variants=[(True, True)], knob_sets=[], ms=[1, 2])
    assert [(r["kernel"], r["M"]) for r in later] == [("pair_gemv[f16,pdl]", 1), ("pair_gemv[f16,pdl]", 2),
                                                      ("mma_gemv[pdl]", 2)]
    silu = bench.codes_tune_rows([(256, 32)], [4], {"read_GBps": 1.0}, lambda msg: None, reps=1,
                                 variants=[(True, True)], knob_sets=[], ms=[2], silu=True)
    assert [r["kernel"] for r in silu] == ["pair_gemv[f16,pdl,silu]"]


def test_tune_compile_lists_the_kernels_the_tune_prepares(monkeypatch):
    """--tune-compile-workers' processes compile ``codes_tune_kernels``' launches: on the simulator (the timer
    stubbed), that list is the set of kernels ``codes_tune_rows`` prepares over the same arguments, each once, so a
    pre-pass leaves the tune nothing to compile. The weights come from the NumPy quantizer, as above."""
    from kbit_numba import _timing, codec
    monkeypatch.setattr(codec, "quantize", lambda W, k: ref.quantize(W, k=k))
    monkeypatch.setattr(_timing, "graph_time_us", lambda launch, n: 1.0)
    monkeypatch.setattr(_timing, "rotation_count", lambda nbytes: 1)
    prepared, prepare = set(), Plan.prepare

    def record(plan):
        prepared.update(id(step.kernel) for step in plan.steps)
        return prepare(plan)
    monkeypatch.setattr(Plan, "prepare", record)
    args = dict(variants=[(False, True), (True, False)], knob_sets=[{"cols": 2}, {"cols": 2, "cta_warps": 8},
                                                                    {"cols": 4}])
    bench.codes_tune_rows([(256, 32)], [4], {"read_GBps": 1.0}, lambda msg: None, reps=1, **args)
    listed = bench.codes_tune_kernels([(256, 32)], [4], **args)
    assert [id(step.kernel) for step in listed] == list(dict.fromkeys(id(step.kernel) for step in listed))
    assert {id(step.kernel) for step in listed} == prepared and len(prepared) > 4


def test_tune_compile_parts_share_out_the_points(monkeypatch):
    """``--tune-compile-part i/N`` plans (and so compiles: ``core.fit_threads``) only its share of the tune's points:
    over N parts every point once, and every point of one build key (k, f16, pdl, M) in the same part, so a kernel is
    compiled by one process. (The first version had each process plan every point: 16 took as long as one.)"""
    from kbit_numba import _timing, codec
    monkeypatch.setattr(codec, "quantize", lambda W, k: ref.quantize(W, k=k))
    monkeypatch.setattr(_timing, "rotation_count", lambda nbytes: 1)

    def points(part=None):
        return [(K, N, k, f16, pdl, M) for K, N, k, _, _, f16, pdl, M, _, _ in bench._codes_tune_points(
            [(256, 32), (512, 32)], [2, 4], None, [(False, True), (True, False)], [None], [1, 2], False, False,
            lambda nbytes: 1, part)]
    whole = points()
    parts = [points((i, 3)) for i in range(3)]
    assert len(whole) == 16 and sorted(sum(parts, [])) == sorted(whole) and all(parts)
    owner = {}
    for i, share in enumerate(parts):
        for K, N, *key in share:
            assert owner.setdefault(tuple(key), i) == i


def test_tune_compile_workers_run_the_command_in_parts(monkeypatch):
    """_compile_in_workers starts this command once per part, without --tune-compile-workers (either spelling) and
    with --tune-compile-part i/N, and waits for every one."""
    started = []

    class Proc:
        returncode = 0

        def __init__(self, cmd, **kw):
            started.append(cmd[1:])

        def communicate(self):
            return "part 0/2: 3 kernels compiled in 1 s\n", None
    monkeypatch.setattr(bench.subprocess, "Popen", Proc)
    said = []
    bench._compile_in_workers(2, said.append, ["--tune-codes", "t.json", "--tune-compile-workers", "2", "--k", "4"])
    bench._compile_in_workers(2, said.append, ["--tune-compile-workers=2", "--tune-codes", "t.json"])
    head = ["-m", "kbit_numba.bench"]
    assert started == [head + ["--tune-codes", "t.json", "--k", "4", f"--tune-compile-part={i}/2"] for i in (0, 1)] \
        + [head + ["--tune-codes", "t.json", f"--tune-compile-part={i}/2"] for i in (0, 1)]
    assert len(said) == 6 and "3 kernels compiled" in said[0]


def test_tune_codes_main_writes_the_table(monkeypatch, tmp_path, capsys):
    """The --tune-codes path after the timings (which need a GPU): rows printed with their floor and cuBLAS, the
    winners written into the table file, the rows as JSON."""
    rows = [dict(kernel="pair_gemv", shape="64x128", k=4, M=1, us=10.0, params=None),
            dict(kernel="pair_gemv[cols=2]", shape="64x128", k=4, M=1, us=8.0, params={"cols": 2})]
    for r in rows:
        r.update(f16_acc=False, pdl=False, floor_bytes=100, GBps=1.0, pct_ceiling=1.0)
    monkeypatch.setattr(bench, "measure_ceilings", lambda: (1.0, 1.0))
    monkeypatch.setattr(bench, "codes_tune_rows", lambda *a, **kw: [dict(r) for r in rows])
    monkeypatch.setattr(bench, "floor_us", lambda nbytes: 1.0)
    monkeypatch.setattr(bench, "cublas_row", lambda K, N, M: 2.0)
    path, out = tmp_path / "table.json", tmp_path / "rows.json"
    args = type("Args", (), dict(tune_codes=str(path), json=str(out), tune_keep_general=False,
                                 tune_compile_part=None, tune_compile_workers=0))
    assert bench._tune_codes_main(args, "Test GPU", lambda msg: None, [(64, 128)], [4], [(False, False)]) == 0
    table = json.loads(path.read_text())
    assert table["device"] == "Test GPU" and table["rules"] == dispatch.DEFAULT_TABLE["rules"]
    assert table["codes_variants"] == {"k=4": [[1, "pair_gemv", {"cols": 2}]] + dispatch.CODES_RULES}   # (M = 2 on)
    assert [r["cublas_us"] for r in json.loads(out.read_text())["rows"]] == [2.0, 2.0]
    assert "pair_gemv[cols=2]" in capsys.readouterr().out


def test_tune_codes_main_keeps_the_shapes_it_finished(monkeypatch, tmp_path):
    """A tune cut short (here: interrupted while timing its second shape) has already written the first shape's
    entry and rows: the table and the --json rows are written after each shape, not once at the end."""
    def rows_of(shapes, *a, **kw):
        (K, N), = shapes
        if N == 256:
            raise KeyboardInterrupt                 # (as a device call's time limit kills the tune)
        rows = [dict(kernel="pair_gemv", shape=f"{K}x{N}", k=4, M=1, us=10.0, params=None),
                dict(kernel="pair_gemv[cols=2]", shape=f"{K}x{N}", k=4, M=1, us=8.0, params={"cols": 2})]
        for r in rows:
            r.update(f16_acc=False, pdl=False, floor_bytes=100, GBps=1.0, pct_ceiling=1.0)
        return rows
    monkeypatch.setattr(bench, "measure_ceilings", lambda: (1.0, 1.0))
    monkeypatch.setattr(bench, "codes_tune_rows", rows_of)
    monkeypatch.setattr(bench, "floor_us", lambda nbytes: 1.0)
    monkeypatch.setattr(bench, "cublas_row", lambda K, N, M: 2.0)
    path, out = tmp_path / "table.json", tmp_path / "rows.json"
    args = type("Args", (), dict(tune_codes=str(path), json=str(out), tune_keep_general=True,
                                 tune_compile_part=None, tune_compile_workers=0))
    with pytest.raises(KeyboardInterrupt):
        bench._tune_codes_main(args, "Test GPU", lambda msg: None, [(64, 128), (64, 256)], [4], [(False, False)])
    table = json.loads(path.read_text())
    assert table["codes_shapes"] == {"64x128": {"k=4": [[1, "pair_gemv", {"cols": 2}]] + dispatch.CODES_RULES}}
    assert {r["shape"] for r in json.loads(out.read_text())["rows"]} == {"64x128"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json", "table.json"]     # (no .part left)


def test_every_property_is_in_a_fuzz_family():
    """KBIT_FUZZ=N runs N examples per kernel family (conftest.py): each hypothesis property (a function decorated
    with ``@given``) is listed in exactly one ``helpers.FUZZ_FAMILIES`` family, and each listed one exists."""
    import ast
    import glob
    import os
    from helpers import FUZZ_FAMILIES
    here = os.path.dirname(os.path.abspath(__file__))
    found = set()
    for path in glob.glob(os.path.join(here, "test_*.py")):
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and getattr(d.func, "id", None) == "given" for d in node.decorator_list):
                found.add(f"{os.path.basename(path)}::{node.name}")
    listed = [p for ps in FUZZ_FAMILIES.values() for p in ps]
    assert len(listed) == len(set(listed))
    assert found == set(listed)


def test_the_wait_for_the_ptx_children_runs_last():
    """conftest moves the test that waits for the PTX children behind every other test, the rest in file order,
    so the simulator tests run while the children compile (tests/README.md)."""
    import conftest

    class Item:
        def __init__(self, name):
            self.originalname, self.obj = name, None

    items = [Item(n) for n in ("test_a", "test_ptx_in_child_process", "test_b", "test_c")]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.originalname for i in items] == ["test_a", "test_b", "test_c", "test_ptx_in_child_process"]


VARIANT_CHOICES = ((4, 2), (1, 2, 3, 4), ("e4m4", "fp32"))     # (k, M, absmax format): 5 one-offs


def test_fuzz_variants_are_the_defaults_and_one_offs():
    """A GPU fuzz run's kernel variants (helpers.variants): the defaults, then n distinct combinations that each
    change one choice, the same for the same seed, and all one-offs over enough seeds."""
    from helpers import one_off_variants
    choices = VARIANT_CHOICES
    got = one_off_variants(choices, 3, "s1")
    assert got[0] == (4, 1, "e4m4") and len(set(got)) == 4
    for v in got[1:]:
        assert sum(a != b for a, b in zip(v, got[0])) == 1
    assert got == one_off_variants(choices, 3, "s1")
    seen = {v for seed in range(50) for v in one_off_variants(choices, 3, seed)[1:]}
    assert len(seen) == 1 + 3 + 1                       # every one-off: k = 2, M = 2..4, fp32 absmax
    assert len(one_off_variants(choices, 99, "s")) == 6      # more asked than exist: the defaults and all 5


@pytest.mark.parametrize("fuzz", [100, 0])
def test_each_gpu_test_draws_its_variant(monkeypatch, fuzz):
    """On the GPU each test (part) of a property draws exactly its combination: of one_off_variants in a fuzz run,
    of random_variants (the defaults first) in the suite."""
    from hypothesis import find
    import helpers
    monkeypatch.setattr(helpers, "FUZZ", fuzz)
    monkeypatch.setattr(helpers, "SIM", False)
    choices = VARIANT_CHOICES
    table = (helpers.one_off_variants(choices, helpers.FUZZ_PARTS - 1, helpers.FUZZ_SEED) if fuzz
             else helpers.random_variants(choices, helpers.SUITE_VARIANTS - 1, helpers.FUZZ_SEED))
    monkeypatch.setattr(helpers, "VARIANT_PART", [0])
    strategy = helpers.variants(*choices)
    for part in range(len(table)):
        helpers.VARIANT_PART[0] = part
        assert find(strategy, lambda v: True) == table[part]
    assert table[0] == (4, 1, "e4m4")


def test_suite_variants_cover_every_value():
    """The suite's random combinations: the defaults first, the same for the same seed, every value of every choice
    over a few seeds, and only values of the choices."""
    from helpers import random_variants
    choices = VARIANT_CHOICES
    got = random_variants(choices, 15, "s1")
    assert got[0] == (4, 1, "e4m4") and len(got) == 16 and got == random_variants(choices, 15, "s1")
    seen = [set(v[i] for seed in range(5) for v in random_variants(choices, 15, seed)) for i in range(3)]
    assert seen == [set(c) for c in choices]


def test_shapes_take_model_names():
    """``bench --shapes`` (the grid, --tune, --tune-codes): a model name stands for its linear layers' shapes, K x N,
    in step order (of a MoE model: QKV and O; its experts run in the grouped kernels), each shape once."""
    assert bench._parse_shapes("llama3-8b,4096x4096,2048x512") == [(4096, 6144), (4096, 4096), (4096, 28672),
                                                                    (14336, 4096), (2048, 512)]
    assert bench._parse_shapes("qwen3-30b-a3b") == [(2048, 5120), (4096, 2048)]
    with pytest.raises(ValueError, match="model names .*llama3-8b"):
        bench._parse_shapes("llama9")
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "llama9"])
