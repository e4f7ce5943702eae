"""kbit_numba.torch: the nn.Module drop-in, quantize_model, state_dict and the custom op. On CPU torch with the
simulator (module logic, shapes, errors, save/load; tiny layers) and on the GPU (numerics at real sizes,
torch.compile, CUDA-graph capture). CI installs no torch: there the module is skipped."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="kbit_numba.torch tests need torch (CI installs none)")
from torch import nn  # noqa: E402

import kbit_numba as kb  # noqa: E402
from kbit_numba import reference as ref  # noqa: E402
from kbit_numba.torch import FORMATS, KbitLinear, quantize_model  # noqa: E402
from helpers import SIM  # noqa: E402

DEVICE = "cpu" if SIM else "cuda"
gpu_only = pytest.mark.skipif(SIM, reason="CUDA graphs need a GPU")

# (format, options, in_features, out_features) small enough for the simulator; the reference gemv of each
REFS = {"kbit": ref.gemv, "uniform": ref.uniform_gemv, "sbvr": ref.sbvr_gemv, "bitnet": ref.bitnet_gemv}
CASES = [("kbit", dict(k=4), 64, 8), ("kbit", dict(k=2, layout="codes"), 64, 8),
         ("uniform", dict(bits=3, group_size=32), 64, 8), ("sbvr", dict(lines=16), 128, 8),
         ("bitnet", dict(parts=1), 64, 16)]
if not SIM:
    CASES += [("kbit", dict(k=5), 1056, 384), ("kbit", dict(k=4, layout="codes", f16_acc=True, pdl=True), 2048, 512),
              ("kbit", dict(k=2, layout="fragments", pdl=True), 2048, 512)]


def _linear(K, N, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.exp(torch.empty(N, 1).uniform_(-2, 1)))
    return lin


def _want(layer, x, lin):
    """The format's NumPy twin on the layer's own (quantized) weight, plus the bias, in float64."""
    A = x.detach().float().cpu().numpy().reshape(-1, layer.in_features)
    w = layer._host_weight()
    y = REFS[layer.format](A, w) if layer.format != "kbit" else ref.gemv(A, w)
    return y + (0 if lin.bias is None else lin.bias.detach().double().cpu().numpy())


# activation dtypes and leading dims. On the simulator every case runs all three; on the GPU, where each (case, dtype)
# compiles kernels of its own (7-15 s each) and the kernels' dtypes are fuzzed in their own tests, case i runs
# dtype i % 3 (every dtype meets several formats).
LEADS = ((torch.float32, (2, 3)), (torch.float16, (5,)), (torch.bfloat16, (1, 1)))
FORWARD = [case + ((LEADS if SIM else (LEADS[i % len(LEADS)],)),) for i, case in enumerate(CASES)]


@pytest.mark.parametrize("fmt, opts, K, N, leads", FORWARD, ids=lambda v: "-".join(
    str(d).replace("torch.", "") for d, _ in v) if isinstance(v, tuple) and isinstance(v[0], tuple) else None)
def test_forward_matches_the_reference(fmt, opts, K, N, leads):
    lin = _linear(K, N).to(DEVICE)
    layer = KbitLinear.from_linear(lin, fmt, **opts)
    assert layer.format == fmt and (layer.out_features, layer.in_features) == (N, K)
    for dtype, lead in leads:
        x = torch.randn(*lead, K, device=DEVICE).to(dtype)
        y = layer(x)
        assert y.shape == lead + (N,) and y.dtype == dtype and y.device == x.device
        want = _want(layer, x, lin)
        got = y.float().cpu().numpy().reshape(want.shape)
        scale = np.abs(want).max() + 1
        tol = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
        if fmt in ("uniform", "sbvr", "bitnet"):       # activations quantized (int8 / 7-bit planes) or fp16 math
            tol *= 10
        assert np.abs(got - want).max() <= tol * scale, (fmt, dtype, np.abs(got - want).max(), scale)


def test_state_dict_holds_the_bitsandbytes_bytes_and_loads_without_requantizing():
    lin = _linear(64, 128, seed=1)
    qw = ref.quantize(lin.weight.detach().numpy(), k=3)
    layer = KbitLinear(ref.repack_tiled(qw), lin.bias)  # N = 128: kept tiled on the device, saved flat
    assert layer.weight.layout == "tiled"
    sd = layer.state_dict()
    flat = ref.to_flat(layer.weight.to_numpy())
    assert np.array_equal(sd["weight_packed"].numpy(), flat.packed)
    assert np.array_equal(sd["weight_absmax"].numpy(), flat.absmax)
    assert np.array_equal(sd["weight_codebook"].numpy(), flat.codebook)
    assert sd["_extra_state"]["fields"] == dict(k=3, shape=(128, 64), layout="flat", absmax_format="e4m4")
    assert np.array_equal(flat.packed, qw.packed)        # (the bytes bitsandbytes' flat layout holds)

    def same(a, b):
        sa, sb = a.state_dict(), b.state_dict()
        return sa.keys() == sb.keys() and all(
            sa[key] == sb[key] if key.endswith("_extra_state") else torch.equal(sa[key].cpu(), sb[key].cpu())
            for key in sa)

    fresh = KbitLinear.empty(64, 128, bias=True, k=2)    # (another k: the checkpoint's replaces it)
    assert fresh.load_state_dict(sd).missing_keys == [] and fresh.weight.layout == "tiled" and same(fresh, layer)
    # a checkpoint of a quantized model loads into another quantized model (torch.save round trip)
    import io
    buf = io.BytesIO()
    torch.save(nn.Sequential(layer).state_dict(), buf)
    buf.seek(0)
    other = nn.Sequential(KbitLinear.empty(64, 128, bias=True))
    other.load_state_dict(torch.load(buf, weights_only=False))
    assert same(other[0], layer)
    if not SIM:                                          # (the simulator is slow at 128 columns)
        x = torch.randn(3, 64, device=DEVICE)
        assert torch.equal(fresh.cuda()(x), layer.cuda()(x))


def test_state_dict_of_the_other_formats_round_trips():
    for fmt, opts, K, N in CASES[2:5]:
        layer = KbitLinear.from_linear(_linear(K, N, bias=False).to(DEVICE), fmt, **opts)
        fresh = KbitLinear.empty(K, N, format=fmt, **opts)
        fresh.load_state_dict(layer.state_dict())
        x = torch.randn(2, K, device=DEVICE)
        assert torch.equal(fresh(x), layer(x)), fmt


def test_quantize_model_replaces_linears_keeps_odd_ones_and_reports_bytes(capsys):
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 48), nn.Linear(48, 8), nn.Linear(8, 8))
    model.to(DEVICE)
    summary = quantize_model(model, k=4, skip=["2"], progress=True)
    assert summary["replaced"] == ["0"] and summary["skipped"] == ["2"]
    assert summary["kept_not_multiple_of_32"] == ["3", "4"]
    assert isinstance(model[0], KbitLinear) and isinstance(model[2], nn.Linear) and isinstance(model[3], nn.Linear)
    assert summary["bytes_before"] == 64 * 32 * 4
    assert summary["bytes_after"] == 64 * 32 // 32 * (4 * 4 + 1) + 16 * 4     # planes + E4M4 absmax + codebook
    err = capsys.readouterr().err
    assert "not a multiple of 32: 3, 4" in err and "MiB" in err
    y = model(torch.randn(2, 64, device=DEVICE))
    assert y.shape == (2, 8)


def test_quantize_model_fragments_where_whole_tiles_fit(capsys):
    """layout="fragments" for a whole model (with pdl): the layers that fill whole fragment tiles take it, the others
    the code layout (K = 32 too, which "auto" would keep flat and refuse pdl for), and the summary and stderr say which."""
    model = nn.Sequential(nn.Linear(256, 32), nn.Linear(32, 48), nn.Linear(64, 16)).to(DEVICE)
    summary = quantize_model(model, k=4, layout="fragments", pdl=True, progress=False)
    assert summary["replaced"] == ["0", "1", "2"] and summary["not_fragments"] == ["1", "2"]
    assert [m.weight.layout for m in model] == ["fragments", "codes", "codes"]
    assert "keep the code layout: 1, 2" in capsys.readouterr().err
    y = model[0](torch.randn(3, 256, device=DEVICE).half())
    assert y.shape == (3, 32)


@pytest.mark.parametrize("f16_acc", [False, True])
def test_run_silu_pairs_is_the_gated_activation_of_interleaved_rows(f16_acc):
    """``run(x, silu_pairs=True)`` on a gate/up layer with interleaved rows: silu(y[:, 2j]) * y[:, 2j + 1] of its own
    product (reference.silu_pairs), [M, N / 2], from the pair gemv's epilogue (M = 2) and on the GPU the tensor-core
    gemv's (M = 8); refused where another kernel runs (M = 64: the gemm). (N = 16 on the simulator: BitNet's
    refusal below needs N % 16 == 0 to reach the silu_pairs check.)"""
    K, N = (64, 16) if SIM else (2048, 768)
    lin = _linear(K, N, bias=False)
    layer = KbitLinear.from_linear(lin, k=4, layout="codes", f16_acc=f16_acc)
    for M, kernel in ((2, "pair_gemv"),) if SIM else ((2, "pair_gemv"), (8, "mma_gemv")):
        x = torch.randn(M, K, device=DEVICE).half()
        assert layer.runtime.kernel_for(M) == kernel
        y = layer.run(x, silu_pairs=True)
        assert y.shape == (M, N // 2) and y.dtype == torch.float16
        want = ref.silu_pairs(_want(layer, x, lin))
        assert np.abs(y.float().cpu().numpy() - want).max() <= 1e-2 * (np.abs(want).max() + 1), kernel
    with pytest.raises(ValueError, match="silu_pairs is the kbit gemvs' epilogue"):
        KbitLinear.from_linear(lin, "bitnet").run(x.float(), silu_pairs=True)
    if not SIM:
        kernel = layer.runtime.kernel_for(64)
        with pytest.raises(ValueError, match=f"this call runs '{kernel}'"):
            layer.run(torch.randn(64, K, device=DEVICE).half(), silu_pairs=True)


def test_run_residual_add_and_norm_across_two_layers():
    """A decode step's add + RMSNorm inside two layers, as ``bench_model.NORM_IN_GATE_UP`` runs them:
    ``o.run(att, accumulate_into=res)`` adds o's product into res in place; ``up.run(res, rms_eps=eps)`` is up's
    product of rmsnorm(res) (reference.rms_gemv); refused by another format."""
    K, N = (64, 16) if SIM else (2048, 768)
    o = KbitLinear.from_linear(_linear(K, K, bias=False), k=4, layout="codes", f16_acc=True)
    up_lin = _linear(K, N, bias=False)
    up = KbitLinear.from_linear(up_lin, k=4, layout="codes", f16_acc=True)
    M, eps = 2, 1e-6
    att = torch.randn(M, K, device=DEVICE).half()
    res = torch.randn(M, K, device=DEVICE).half()
    res0 = res.double().cpu().numpy()
    assert o.run(att, accumulate_into=res) is res
    x = res.double().cpu().numpy()
    want = _want(o, att, o)
    assert np.abs(x - res0 - want).max() <= 1e-2 * (np.abs(want).max() + 1)
    y = up.run(res, rms_eps=eps)
    want = ref.rms_gemv(res.float().cpu().numpy(), up._host_weight(), eps)
    assert y.shape == (M, N) and np.abs(y.float().cpu().numpy() - want).max() <= 1e-2 * (np.abs(want).max() + 1)
    with pytest.raises(ValueError, match="not the bitnet format's"):
        KbitLinear.from_linear(up_lin, "bitnet").run(res.float(), rms_eps=eps)


def test_errors_name_what_is_known():
    lin = _linear(64, 8)
    with pytest.raises(ValueError, match="format must be one of .*kbit.*uniform.*sbvr.*bitnet"):
        KbitLinear.from_linear(lin, "nf4")
    with pytest.raises(ValueError, match="format must be one of"):
        quantize_model(nn.Sequential(lin), format="gptq")
    with pytest.raises(ValueError, match="multiple of 32"):
        KbitLinear.from_linear(nn.Linear(48, 8))
    with pytest.raises(TypeError, match="nn.Linear"):
        KbitLinear.from_linear(nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match="apply to format 'kbit'"):
        KbitLinear.from_linear(lin, "bitnet", layout="codes")
    layer = KbitLinear.from_linear(lin)
    with pytest.raises(ValueError, match="x has 32 features"):
        layer(torch.randn(2, 32, device=DEVICE))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        layer(torch.ones(2, 64, dtype=torch.int32, device=DEVICE))
    if not SIM:
        with pytest.raises(ValueError, match="CUDA tensor"):
            layer(torch.randn(2, 64))
    assert layer(torch.randn(0, 64, device=DEVICE)).shape == (0, 8)
    assert set(FORMATS) == {"kbit", "uniform", "sbvr", "bitnet"}


def test_the_custom_op_has_a_fake_implementation():
    layer = KbitLinear.from_linear(_linear(64, 8).to(DEVICE))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        y = torch.ops.kbit_numba.linear(torch.empty(3, 5, 64, dtype=torch.float16, device=DEVICE), layer.handle)
    assert y.shape == (3, 5, 8) and y.dtype == torch.float16


@gpu_only
@pytest.mark.parametrize("fmt, opts", [("kbit", dict(k=4)), ("bitnet", {}), ("uniform", dict(bits=4)),
                                       ("sbvr", dict(lines=256))])
def test_compiled_and_graph_captured_model_matches_eager(fmt, opts):
    """torch.compile and CUDA-graph capture of every format (BitNet and SBVR quantize activations into scratch
    buffers: a Numba allocation inside the capture invalidated it, found by bench --model)."""
    model = nn.Sequential(nn.Linear(1024, 2048), nn.SiLU(), nn.Linear(2048, 512)).half().cuda()
    quantize_model(model, format=fmt, progress=False, **opts)
    x = torch.randn(4, 1024, device="cuda", dtype=torch.float16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)
    # compiled SiLU rounds differently from eager's in the last float16 bit; BitNet and SBVR quantize the next
    # layer's activations (int8 / 7 bits), where such a bit can move a value by one quantization step
    tol = 1e-2 if fmt in ("bitnet", "sbvr") else 1e-3
    assert torch.allclose(compiled(x), eager, rtol=tol, atol=tol)
    static_x = x.clone()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        model(static_x)                                  # warm up (compile kernels) outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with kb_defer_cleanup(), torch.cuda.graph(g):
        static_y = model(static_x)
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.allclose(static_y, model(static_x), rtol=1e-3, atol=1e-3)


def kb_defer_cleanup():
    from numba import cuda
    return cuda.defer_cleanup()


def test_kbit_numba_imports_without_torch():
    """The package never imports kbit_numba.torch (nor torch) by itself."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None; import kbit_numba; "
            "assert 'kbit_numba.torch' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__('os').environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert out.stdout.strip() == "ok", out.stderr
    assert kb.SIMULATOR in (True, False)
