"""bench --model: the decode step's structure on a tiny config (simulator: CPU tensors) and its name errors.
The timings themselves need a GPU (benchmarks/README.md)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="kbit_numba.torch tests need torch (CI installs none)")

from kbit_numba import bench, bench_model, dispatch, reference as ref  # noqa: E402
from helpers import SIM  # noqa: E402

DEVICE = "cpu" if SIM else "cuda"
DEQUANTIZE = {"kbit": ref.dequantize, "uniform": ref.uniform_dequantize, "bitnet": ref.bitnet_dequantize}
# small enough for the simulator; on the GPU wide enough for every format's blocks and groups (K % 128 == 0)
TINY = (dict(hidden=64, intermediate=32, heads=2, kv_heads=1, head_dim=32, layers=2) if SIM else
        dict(hidden=256, intermediate=384, heads=2, kv_heads=1, head_dim=128, layers=2))


def test_projections_are_the_fused_llama_shapes():
    assert bench_model.projections(bench_model.MODELS["llama3-8b"]) == [
        ("qkv", 4096 + 2 * 1024, 4096), ("o", 4096, 4096), ("gate_up", 2 * 14336, 4096), ("down", 4096, 14336)]


# On the simulator each simulated kernel launch takes tens of seconds: there the step runs in fp16 only
# (the structure), and test_torch covers KbitLinear's simulated kernels
@pytest.mark.parametrize("variant", ["kbit k=4"] if SIM else ["kbit k=4", "kbit k=2", "kbit k=4 pdl f16_acc",
                                                              "kbit k=2 pdl frag", "uniform 4-bit g128"])
def test_quantized_step_follows_the_fp16_step(variant):
    """The same random weights through fp16 nn.Linear and through a quantized variant: the two steps' outputs
    agree to the quantization error, and the linear-only pass runs every layer's four projections. The kbit
    variants on the code or fragment layout interleave their gate/up rows and take the SiLU from the pair or
    tensor-core gemv's epilogue at this batch (fuses_silu; the fragment variant's down projection, K = 384, keeps the
    code layout); the fp16 step, on the same interleaved weights, through the SiLU kernel for pairs."""
    if SIM:
        variant = "fp16"
    rng = np.random.default_rng(0)
    base = {name: rng.standard_normal((N, K), dtype=np.float32) * 0.1 for name, N, K in bench_model.projections(TINY)}
    quiet = lambda msg: None  # noqa: E731
    fused = bench_model.fuses_silu(TINY, variant)
    assert fused == (variant in ("kbit k=4", "kbit k=2", "kbit k=4 pdl f16_acc", "kbit k=2 pdl frag"))
    q = bench_model.build_linears(TINY, variant, base, quiet, DEVICE, silu_pairs=fused)
    f = bench_model.build_linears(TINY, "fp16", base, quiet, DEVICE)
    for ql, fl in zip(q, f):     # the fp16 step's weights: the quantized layer's own weights, dequantized
        for qlin, flin, (name, _, _) in zip(ql, fl, bench_model.projections(TINY)):
            w = base[name] if variant == "fp16" else DEQUANTIZE[qlin.format](qlin._host_weight())
            flin.weight.data.copy_(torch.from_numpy(np.asarray(w, np.float32)))
            if variant == "fp16":
                qlin.weight.data.copy_(flin.weight.data)
    assert len(q) == TINY["layers"] and all(len(layer) == 4 for layer in q)
    if variant.endswith("frag"):      # (qkv, o, gate_up fill whole fragment tiles; down's K = 384 does not)
        assert [lin.weight.layout for lin in q[0]] == ["fragments"] * 3 + ["codes"]
    if not SIM:
        assert 0 < bench_model.weight_bytes(q) < bench_model.weight_bytes(f) / 3
    # the step and its linear-only pass take the gate/up through the epilogue exactly for the fused variants
    gate_up, K = q[0][2], bench_model.projections(TINY)[2][2]
    x = torch.zeros(2, K, device=DEVICE, dtype=torch.float16)
    assert bench_model.epilogue_silu(gate_up, x, fused) == (fused and not SIM)
    assert not bench_model.epilogue_silu(f[0][2], x, True)      # (nn.Linear: the SiLU kernel)
    outs = []
    for linears, pdl in ((q, bench_model.uses_pdl(variant)), (f, False)):   # (pdl: the fused kernels too)
        step = bench_model.DecodeStep(TINY, linears, 2, context=64, device=DEVICE, pdl=pdl, silu_pairs=fused)
        with torch.no_grad():
            outs.append(step.step().float().cpu().numpy())
            step.linears_only()
    assert outs[0].shape == (2, TINY["hidden"]) and np.isfinite(outs[0]).all()
    err = np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max()
    # the same weights both ways: only the float16 rounding of activations and sums differs (uniform: 8-bit
    # activations); on the simulator fp16 both ways, the same step twice
    bound = 0 if SIM else 0.05 if variant.startswith("uniform") else 0.02
    assert err <= bound, err


@pytest.mark.skipif(SIM, reason="the norm inside gate/up is a GPU launch's (the CPU step runs the torch twins)")
@pytest.mark.parametrize("in_qkv", [False, True])
@pytest.mark.parametrize("k", bench_model.NORM_IN_GATE_UP_K)
def test_norm_inside_gate_up_follows_the_norm_launch(monkeypatch, in_qkv, k):
    """``NORM_IN_GATE_UP``: the layer's second add + RMSNorm inside its linears (the o gemv adding into the residual
    stream, ``accumulate``; the gate/up gemv scaling by 1 / rms of it, ``rms_eps``), and with ``NORM_IN_QKV`` the first
    one too (the down gemv adding, the QKV gemv scaling), against the step with its ``add_rmsnorm`` launches, same
    weights, batch 1, at every k of ``NORM_IN_GATE_UP_K``: the same residual stream to float16 rounding of the sums (the
    fused scale multiplies float16 block sums of the unnormalised residual), and the fused path ran (batch 1 only:
    ``NORM_IN_GATE_UP_MAX_BATCH``)."""
    monkeypatch.setattr(bench_model, "NORM_IN_QKV", in_qkv)
    rng = np.random.default_rng(1)
    base = {name: rng.standard_normal((N, K), dtype=np.float32) * 0.1 for name, N, K in bench_model.projections(TINY)}
    variant = f"kbit k={k} pdl f16_acc"
    q = bench_model.build_linears(TINY, variant, base, lambda msg: None, DEVICE, silu_pairs=True)
    x = torch.zeros(1, TINY["hidden"], device=DEVICE, dtype=torch.float16)
    assert bench_model.norm_in_gate_up(q[0][1], q[0][2], x, True)
    assert bench_model.norm_in_qkv(q[0][0], q[0][3], x) == in_qkv
    assert not bench_model.norm_in_gate_up(q[0][1], q[0][2], torch.zeros(2, TINY["hidden"], device=DEVICE,
                                                                       dtype=torch.float16), True)
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(bench_model, "NORM_IN_GATE_UP", fused)
        step = bench_model.DecodeStep(TINY, q, 1, context=64, device=DEVICE, pdl=True, silu_pairs=True)
        with torch.no_grad():
            outs.append(step.step().float().cpu().numpy())
            step.linears_only()
    err = np.abs(outs[0] - outs[1]).max() / np.abs(outs[1]).max()
    assert np.isfinite(outs[0]).all() and err <= 0.01, err


TINY_MOE = (dict(hidden=64, heads=2, kv_heads=1, head_dim=32, layers=2, experts=4, expert_intermediate=32, top_k=2)
            if SIM else dict(hidden=256, heads=2, kv_heads=1, head_dim=128, layers=2, experts=8,
                             expert_intermediate=128, top_k=2))


def test_qwen3_moe_shapes_and_routing():
    cfg = bench_model.MODELS["qwen3-30b-a3b"]
    assert bench_model.projections(cfg) == [("qkv", 4096 + 2 * 512, 2048), ("o", 2048, 4096),
                                             ("gate_up", 2 * 768, 2048), ("down", 2048, 768)]
    assert bench_model.layer_params(cfg) == 5120 * 2048 + 2048 * 4096 + 128 * 3 * 768 * 2048
    src, inv, weights, offsets = bench_model.routing(cfg, 16, np.random.default_rng(0))
    T = 16 * 8
    assert offsets[0] == 0 and offsets[-1] == T and np.all(np.diff(offsets) >= 0)
    expert_of_row = np.searchsorted(offsets, np.arange(T), side="right") - 1
    for b in range(16):                    # token b's rows: 8 distinct experts, each row points back at b
        rows = inv[8 * b:8 * b + 8]
        assert np.all(src[rows] == b) and len(set(expert_of_row[rows])) == 8
    np.testing.assert_allclose(weights.sum(1), 1, rtol=1e-6)


def _moe_reference(step, layer, h, W_gu, W_d, pairs=False):
    """sum_j p_j W_d[e_j] (silu(g) * u), (g, u) = W_gu[e_j] h (its halves, or with ``pairs`` its even and odd rows),
    in float64 from the step's own routing."""
    src, inv, weights = (t.cpu().numpy() for t in step.routes[layer])
    offsets = step.offsets[layer]
    top = step.cfg["top_k"]
    expert_of_row = np.searchsorted(offsets, np.arange(len(src)), side="right") - 1
    h = h.double().cpu().numpy()
    y = np.zeros_like(h)
    for b in range(h.shape[0]):
        for j in range(top):
            e = expert_of_row[inv[b * top + j]]
            gu = W_gu[e] @ h[b]
            g, u = (gu[0::2], gu[1::2]) if pairs else np.split(gu, 2)
            y[b] += weights[b, j] * (W_d[e] @ (g / (1 + np.exp(-g)) * u))
    return y


CODES_VARIANTS = ("kbit k=4", "kbit k=2", "kbit k=4 pdl", "kbit k=4 pdl f16_acc", "kbit k=2 pdl f16_acc")   # k = 2, 4


@pytest.mark.parametrize("variant", ["fp16"] if SIM else ["fp16", *CODES_VARIANTS, "kbit k=3"])
@pytest.mark.parametrize("B", [3] if SIM else [3, 40])
def test_moe_layer_is_the_routed_sum_of_its_experts(variant, B):
    """The MoE block of the step (gather by expert, gate_up experts, silu_mul, down experts, weighted sum) against
    a float64 loop over the routing, with the variant's own (dequantized) expert weights. kbit runs, at B = 3, the
    grouped mma gemv (k = 2, 4), the grouped pair gemv (with f16_acc, while an expert has at most PAIR_GROUPED_MAX_ROWS
    rows; float32 sums at k = 2 while there are at most PAIR_GROUPED_F32_MAX_ROWS rows: gate/up on the fragment layout, down
    on the code layout) or grouped_gemv (k = 3), and grouped_gemm at B = 40 (more than 8 rows per expert); the pdl
    variants the PDL builds (of the grouped gemvs and the fused kernels); on the simulator fp16 only. The k = 2, 4 variants
    interleave their gate/up experts' rows (fuses_silu): the grouped gemvs' epilogue computes the SiLU at B = 3,
    the SiLU kernel for pairs at B = 40."""
    rng = np.random.default_rng(2)
    base = {name: rng.standard_normal((N, K), dtype=np.float32) * 0.1 for name, N, K in bench_model.projections(TINY_MOE)}
    for name, N, K in bench_model.projections(TINY_MOE)[2:]:      # the experts: 3 distinct matrices, repeated
        base[name] = [rng.standard_normal((N, K), dtype=np.float32) * 0.1 for _ in range(3)]
    fused = bench_model.fuses_silu(TINY_MOE, variant)
    assert fused == (variant in CODES_VARIANTS)
    linears = bench_model.build_linears(TINY_MOE, variant, base, lambda msg: None, DEVICE, silu_pairs=fused)
    step = bench_model.DecodeStep(TINY_MOE, linears, B, context=64, device=DEVICE,
                                  pdl=bench_model.uses_pdl(variant), silu_pairs=fused)
    if variant == "fp16":
        weights = [[lin.W.float().cpu().numpy() for lin in layer[2:]] for layer in linears]
    else:
        E = TINY_MOE["experts"]
        weights = [[np.stack([ref.dequantize(lin.experts.expert(e)) for e in range(E)]) for lin in layer[2:]]
                   for layer in linears]
        codes = variant in CODES_VARIANTS
        expert_Ks = {K for _, _, K in bench_model.projections(TINY_MOE)[2:]}     # gate/up's and down's
        for runs, offsets in zip(step.expert_runs, step.offsets):
            most = int(np.diff(offsets).max())
            k = bench_model.VARIANTS[variant][1]["k"]
            f32_rows = {dispatch.pair_grouped_f32_max_rows(k, K) for K in expert_Ks}
            assert len(f32_rows) == 1                                           # one rule for both projections
            pair = (most <= dispatch.PAIR_GROUPED_MAX_ROWS if variant.endswith("f16_acc") else
                    int(offsets[-1]) <= f32_rows.pop())
            want = ("pair_gemv" if codes and pair else
                    "mma_gemv" if codes and most <= 8 else "grouped_gemv" if not codes and most <= 4 else
                    "grouped_gemm")
            assert [run.kernel for run in runs] == [want] * 2 and (B == 3) == (want != "grouped_gemm"), (want, most)
            assert runs[0].silu_pairs == (fused and want in ("pair_gemv", "mma_gemv"))
    h = torch.randn(B, TINY_MOE["hidden"], device=DEVICE, dtype=torch.float16)
    for layer in range(TINY_MOE["layers"]):
        with torch.no_grad():
            got = step.moe(h, layer).double().cpu().numpy()
        want = _moe_reference(step, layer, h, *weights[layer], pairs=fused)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= 0.02, err
    with torch.no_grad():
        out = step.step()
        step.linears_only()
    assert out.shape == (B, TINY_MOE["hidden"]) and torch.isfinite(out.float()).all()


def test_moe_model_refuses_formats_without_grouped_kernels():
    base = {name: [np.zeros((N, K), np.float32)] for name, N, K in bench_model.projections(TINY_MOE)}
    with pytest.raises(ValueError, match="grouped MoE kernels for the kbit format only"):
        bench_model.build_experts(TINY_MOE, "uniform 4-bit g128", "gate_up", 64, 64, base, print, DEVICE)


def test_unknown_model_or_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="known models are llama3-8b"):
        bench_model.check_names("gpt5", [])
    with pytest.raises(ValueError, match="known variants are fp16, kbit k=2"):
        bench_model.check_names("llama3-8b", ["nf4"])
    with pytest.raises(SystemExit):
        bench.main(["--model", "gpt5"])


@pytest.mark.skipif(SIM, reason="the fused kernels take CUDA tensors")
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("H", [4096, 1000])       # (1000: a row that is not a multiple of the CTA)
def test_fused_kernels_equal_their_torch_twins(H, pdl, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(1)
    res = torch.randn(3, H, device="cuda", dtype=torch.float16, generator=g)
    y = torch.randn(3, H, device="cuda", dtype=torch.float16, generator=g)
    w = torch.rand(H, device="cuda", dtype=torch.float16, generator=g) + 0.5
    step = bench_model.DecodeStep(TINY, [], 3, context=64, pdl=pdl)
    res2, res3 = res.clone(), res.clone()
    h = step.add_rmsnorm(res, y, w)
    h2 = bench_model.add_rmsnorm_torch(res2, y, w)
    assert torch.equal(res, res2)
    torch.testing.assert_close(h, h2, rtol=2e-3, atol=2e-3)
    # the layer's first norm, which also prefetches a cache (5 CTAs past the rows; the step's default may be off)
    cache = [torch.randn(3, 2, 64, 128, device="cuda", dtype=torch.float16, generator=g) for _ in "kv"]
    kept = [c.clone() for c in cache]
    monkeypatch.setattr(bench_model, "NORM_PREFETCH_CTAS", 5)
    assert torch.equal(step.add_rmsnorm(res3, y, w, prefetch=cache), h) and torch.equal(res3, res)
    assert all(torch.equal(c, d) for c, d in zip(cache, kept))
    gu = torch.randn(3, 2 * 14336, device="cuda", dtype=torch.float16, generator=g) * 4
    torch.testing.assert_close(step.silu_mul(gu), bench_model.silu_mul_torch(gu), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(step.silu_mul(gu, pairs=True), bench_model.silu_mul_torch(gu, pairs=True), rtol=2e-3,
                               atol=2e-3)
    assert torch.equal(bench_model.silu_mul_torch(gu[:, bench_model.interleave_pairs(np.arange(2 * 14336))], pairs=True),
                       bench_model.silu_mul_torch(gu))      # (interleaved columns: the same activation)
    rows = torch.randn(3 * 8, 2048, device="cuda", dtype=torch.float16, generator=g)
    inv = torch.randperm(3 * 8, device="cuda", generator=g)
    weights = torch.rand(3, 8, device="cuda", generator=g)
    torch.testing.assert_close(step.moe_combine(rows, inv, weights), bench_model.moe_combine_torch(rows, inv, weights),
                               rtol=2e-3, atol=2e-3)
    nq, hd = TINY["heads"], TINY["head_dim"]
    qkv = torch.randn(3, (nq + 2 * TINY["kv_heads"]) * hd, device="cuda", dtype=torch.float16, generator=g)
    k, v = (torch.randn(3, TINY["kv_heads"], 64, hd, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    torch.testing.assert_close(step._attention(qkv, (k, v)),
                               bench_model.attention_torch(qkv[:, :nq * hd].reshape(3, nq, hd), k, v),
                               rtol=2e-3, atol=2e-3)
    src = torch.randint(0, 3, (3 * 8,), device="cuda", generator=g)
    out = torch.empty(3 * 8, H, device="cuda", dtype=torch.float16)
    assert torch.equal(step.gather_rows(res, src, out), res.index_select(0, src))


@pytest.mark.skipif(SIM, reason="CUDA graphs need a GPU")
def test_replay_us_times_each_replay_once():
    """The benchmark's graph timing (``_timing.replay_us``, behind ``graph_us``) replays the graph warmup + replays
    times, queued back to back or (``spaced``) one at a time: a graph that adds 1 to a counter counts them; each time
    is a positive number of microseconds, and graph_us's own capture runs fn twice more before it (compile, allocator)."""
    from kbit_numba._timing import replay_us
    x = torch.zeros(1, device="cuda", dtype=torch.float64)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    torch.cuda.synchronize()
    t = replay_us(g, replays=5, warmup=2)
    torch.cuda.synchronize()
    assert x.item() == 7 and 0 < t < 1e6
    assert replay_us(g, replays=2, warmup=1, spaced=True) > 0     # (one at a time, for decode_step_trace.py)
    torch.cuda.synchronize()
    assert x.item() == 10
    y = torch.zeros(1, device="cuda", dtype=torch.float64)
    assert bench_model.graph_us(torch, lambda: y.add_(1), replays=4, warmup=1) > 0
    torch.cuda.synchronize()
    assert y.item() == 2 + 1 + 4
