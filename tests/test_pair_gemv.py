"""Pair-table GEMV and the kernel-native code layout against the reference, on the simulator (CI) and the GPU."""
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda

import kbit_numba as kb
from kbit_numba import device, pair_gemv, reference as ref
from kbit_numba.core import k_warps
from kbit_numba.formats import CODES_K, KbitCodes
from helpers import (EXAMPLES, SIM, assert_within, gpu_examples, gpu_split, kbit_weight, Out, out_modes, pick,
                     random_weight, seeds, sizes, weight_kinds, variants)
from test_gemv import _activations, check_close, routed_case

MAX_N = 12 if SIM else 700
# K = 32 * kb: past 1024 (two K-warps) on the simulator too, up to several warps on the GPU
KBS = st.sampled_from([1, 3, 33]) if SIM else sizes(140, 512)      # (the fuzz run: K up to 16384)
# On the GPU the properties below run once per (k, absmax format): 4 tests that xdist spreads over cores.
SPLIT = [(k, fmt) for k in CODES_K for fmt in ("e4m4", "fp32")]


@settings(max_examples=EXAMPLES * 2)
@given(seeds, st.sampled_from([2, 3, 4, 5]), st.integers(1, 40), st.integers(1, 8))
def test_codes_round_trip(seed, k, N, kbn):
    """to_codes / from_codes are exact inverses, the GPU re-pack matches the twin, and k = 3, 5 are refused."""
    rng = np.random.default_rng(seed)
    qw = ref.quantize(random_weight(rng, N, 32 * kbn), k=k)
    if k not in CODES_K:
        with pytest.raises(ValueError, match="code layout"):
            ref.to_codes(qw)
        return
    kc = ref.to_codes(qw)
    assert np.array_equal(ref.from_codes(kc).packed, qw.packed)
    assert np.array_equal(ref.dequantize(kc), ref.dequantize(qw))
    assert np.array_equal(pair_gemv.to_codes(qw).packed.copy_to_host(), kc.packed)


def test_codes_field_order():
    """Element j of a block is the k-bit field at bit k*(j % (32//k)) of word j // (32//k)."""
    idx = np.arange(32) % 16
    words = ref.pack_codes(idx[None], 4)[0]
    assert words[0] == 0x76543210 and words[1] == 0xFEDCBA98 and words[2] == 0x76543210
    idx2 = np.arange(32) % 4
    assert ref.pack_codes(idx2[None], 2)[0][0] == 0xE4E4E4E4


# (the widest property: on the GPU one test per k, absmax format and activation type, so that its compiles
# spread over the suite's workers)
SPLIT3 = [(k, fmt, a) for k, fmt in SPLIT for a in ("float16", "float32", "bfloat16")]


@gpu_split("k_split, fmt_split, a_split", SPLIT3)
@settings(max_examples=gpu_examples(EXAMPLES * 2, len(SPLIT3)))
@given(seeds, variants((4, 2), (1, 2, 3, 4), ("e4m4", "fp32"), ("float16", "float32", "bfloat16"), (np.float16, np.float32),
                (4, 1, 2, 8)), sizes(MAX_N, 20000), KBS, weight_kinds, out_modes)
def test_pair_gemv(k_split, fmt_split, a_split, seed, v, N, kbn, kind, out_mode):
    k, M, fmt, a_dtype, out_dtype, cols = v
    k, fmt, a_dtype = k_split or k, fmt_split or fmt, a_split or a_dtype
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    qw, pool, rows = kbit_weight(rng, N, K, kind, k, fmt)
    kc = pair_gemv.to_codes(qw)
    A = _activations(rng, M, K, a_dtype)
    bf16 = a_dtype == "bfloat16"
    o = Out(out_mode, (M, N), out_dtype)
    out = pair_gemv.plan(A, kc, out_dtype=out_dtype, bf16=bf16, cols=cols, **o.kwargs).launch()
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    check_close(o.host(out), A, pool, bf16, out_dtype, rows)


@pytest.mark.skipif(SIM, reason="the simulator has no register limit (and K = 14336 is slow there)")
@pytest.mark.parametrize("k", CODES_K)
def test_pair_gemv_long_k_at_m4_caps_registers(k):
    """M = 4 at K = 14336 (a llama3-8b down projection): the kernel's registers do not fit the 448 threads a
    CTA needs, so the plan compiles it with a register cap (found by bench --model)."""
    rng = np.random.default_rng(k)
    qw = ref.quantize(random_weight(rng, 40, 14336), k=k)
    A = _activations(rng, 4, 14336, "float16")
    out = pair_gemv.plan(A, pair_gemv.to_codes(qw)).launch()
    check_close(out.copy_to_host(), A, qw, False, np.float16)


def check_close_f16_acc(got, A, qw, out_dtype, rows=None):
    """f16_acc: a lane sums its block's 32 products in float16 (16 fma.rn.f16x2 steps of two halves, each
    rounding once to u = 2**-11 of the partial sum, whose size is at most sum |a c|), after rounding
    each codebook value to float16 (u |c| more); the two halves, the absmax scale and the blocks are
    summed in float32. So |error| <= (17u + 1e-5) * sum_j |a_j w_j|, plus, for float16 subnormal partial
    sums (absolute spacing 2**-24), 17 * 2**-24 * the block's absmax, summed over blocks."""
    want = ref.gemv(A, qw)
    Af = np.abs(ref.as_float32(A).reshape(want.shape[0], -1).astype(np.float64))
    u = 2.0 ** -11
    scale = Af @ np.abs(ref.dequantize(qw).astype(np.float64)).T
    tiny = 17 * 2.0 ** -24 * ref.decoded_absmax(qw).reshape(qw.shape[0], -1).astype(np.float64).sum(axis=1)
    if rows is not None:
        want, scale, tiny = pick(rows, want, scale, tiny)
    assert_within(got, want, (17 * u + 1e-5) * scale + tiny[None, :] + 1e-30, out_dtype)


@gpu_split("k_split, fmt_split", SPLIT)     # (cols' other values: test_pair_gemv)
@settings(max_examples=gpu_examples(EXAMPLES, len(SPLIT)))
@given(seeds, variants((4, 2), (1, 2, 3, 4), ("e4m4", "fp32"), (np.float16, np.float32), (4, 2)), sizes(MAX_N, 20000), KBS,
       st.sampled_from([1.0, 1e-3, 300.0]))
def test_pair_gemv_f16_acc(k_split, fmt_split, seed, v, N, kbn, a_scale):
    """The float16-accumulating variant within its stated bound, small and large activations too."""
    k, M, fmt, out_dtype, cols = v
    k, fmt = k_split or k, fmt_split or fmt
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    out_dtype = np.float32 if a_scale > 1 else out_dtype     # (large sums would overflow a float16 output)
    qw, pool, rows = kbit_weight(rng, N, K, "normal", k, fmt)
    A = (_activations(rng, M, K, "float32") * a_scale).astype(np.float16)
    out = pair_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=out_dtype, cols=cols, f16_acc=True).launch()
    check_close_f16_acc(out.copy_to_host(), A, pool, out_dtype, rows)


def gemv_bound(A, qw, f16_acc):
    """The bound on |C - reference| that check_close (float32 sums) or check_close_f16_acc (float16 block sums) holds
    a pair gemv to, per output."""
    Af = np.abs(ref.as_float32(A).reshape(A.shape[0], -1).astype(np.float64))
    scale = Af @ np.abs(ref.dequantize(qw).astype(np.float64)).T
    if not f16_acc:
        return 1e-5 * scale + 1e-30
    tiny = 17 * 2.0 ** -24 * ref.decoded_absmax(qw).reshape(qw.shape[0], -1).astype(np.float64).sum(axis=1)
    return (17 * 2.0 ** -11 + 1e-5) * scale + tiny[None, :] + 1e-30


@settings(max_examples=EXAMPLES)
@given(seeds, variants((4, 2), (1, 2, 3, 4), (True, False), (np.float16, np.float32), (4, 2, 8)),
       st.integers(1, MAX_N // 2), KBS)
def test_pair_gemv_silu_pairs(seed, v, half_n, kbn):
    """The ``silu_pairs`` epilogue writes silu(C[:, 2j]) * C[:, 2j + 1] of the product C into an [M, N / 2] output
    (reference.silu_pairs). Its error: the sums' bound e carried through silu (|silu'| <= 1.1) and the product,
    1.1 e_gate (|up| + e_up) + |silu(gate)| e_up, plus float32 rounding of the exponential and the two operations."""
    k, M, f16_acc, out_dtype, cols = v
    rng = np.random.default_rng(seed)
    N, K = 2 * half_n, 32 * kbn
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    A = _activations(rng, M, K, "float16")
    out = pair_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=out_dtype, cols=cols, f16_acc=f16_acc,
                         silu_pairs=True).launch()
    assert out.shape == (M, N // 2) and out.dtype == np.dtype(out_dtype)
    check_silu_pairs(out.copy_to_host(), A, qw, f16_acc, out_dtype)


def check_silu_pairs(got, A, qw, f16_acc, out_dtype, rtol=0.0):
    """``got`` against reference.silu_pairs of the product, within the bound of test_pair_gemv_silu_pairs; ``rtol``:
    a relative error of both products (a norm's scale, ``rms_eps``), through silu(gate) * up to first order."""
    C = ref.gemv(A, qw).astype(np.float64)
    e = gemv_bound(A, qw, f16_acc)
    gate, up, e_gate, e_up = C[:, 0::2], C[:, 1::2], e[:, 0::2], e[:, 1::2]
    want = ref.silu_pairs(C)
    sig = 1 / (1 + np.exp(-gate))
    tol = 1.1 * e_gate * (np.abs(up) + e_up) + np.abs(gate * sig) * e_up + 1e-6 * np.abs(want) + 1e-30
    tol += 1.1 * rtol * (np.abs(sig * (1 + gate * (1 - sig)) * gate * up) + np.abs(want))   # (d silu / d gate = ...)
    assert_within(got, want, tol, out_dtype)


def test_pair_gemv_vector_input_out_buffer_and_prepare():
    rng = np.random.default_rng(3)
    qw = ref.quantize(random_weight(rng, 9, 64), k=4)
    kc = ref.to_codes(qw)                                 # host KbitCodes are copied over
    a = _activations(rng, 1, 64, "float16", one_d=True)
    out = cuda.device_array(9, np.float32)
    assert pair_gemv.gemv(cuda.to_device(a), kc, out=out, stream=cuda.stream()) is out
    check_close(out.copy_to_host()[None], a[None], qw)
    A = cuda.to_device(_activations(rng, 2, 64, "float16"))
    step = pair_gemv.prepare(A, pair_gemv.to_codes(qw))
    check_close(step.run().copy_to_host(), A.copy_to_host(), qw, out_dtype=np.float16)


@pytest.mark.parametrize("f16_acc", [False, True])
def test_pair_gemv_pdl_chain_waits_for_the_previous_layer(f16_acc):
    """Programmatic dependent launch: a chain of layers, each reading the previous one's output as its
    activations, launched back to back on one stream. Each layer starts before the previous one ends and must
    wait (griddep_wait) before reading it; a layer that read early would see the last run's values, so the
    chain runs twice with different inputs and the second run's every layer is checked against its input."""
    rng = np.random.default_rng(5)
    D, LAYERS = (64, 3) if SIM else (2048, 6)
    qws = [ref.quantize((rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32), k=4) for _ in range(LAYERS)]
    stream = cuda.stream()
    outs = [cuda.to_device(np.zeros((1, D), np.float16), stream=stream)]
    steps = []
    for qw in qws:
        steps.append(pair_gemv.prepare(outs[-1], pair_gemv.to_codes(qw, stream), stream=stream, f16_acc=f16_acc,
                                       pdl=True))
        outs.append(steps[-1].out)
    for run in range(2):
        outs[0].copy_to_device(rng.standard_normal((1, D)).astype(np.float16), stream=stream)
        for step in steps:
            step.run()
        stream.synchronize()
    got = [o.copy_to_host() for o in outs]
    for i, qw in enumerate(qws):
        if f16_acc:
            check_close_f16_acc(got[i + 1], got[i], qw, np.float16)
        else:
            check_close(got[i + 1], got[i], qw, out_dtype=np.float16)


def test_pair_gemv_refuses():
    rng = np.random.default_rng(4)
    qw = ref.quantize(random_weight(rng, 4, 64), k=4)
    with pytest.raises(ValueError, match="M = 1..4"):
        pair_gemv.gemv(np.zeros((5, 64), np.float16), qw)
    with pytest.raises(ValueError, match="K=32"):
        pair_gemv.gemv(np.zeros((1, 32), np.float16), qw)
    with pytest.raises(ValueError, match="code layout"):
        pair_gemv.to_codes(ref.quantize(random_weight(rng, 4, 64), k=3))
    with pytest.raises(ValueError, match="cols must be one of"):
        pair_gemv.plan(np.zeros((1, 64), np.float16), qw, cols=3)
    with pytest.raises(ValueError, match="f16_acc needs float16 activations"):
        pair_gemv.plan(np.zeros((1, 64), np.float32), qw, f16_acc=True)
    with pytest.raises(ValueError, match="silu_pairs needs an even cols"):
        pair_gemv.plan(np.zeros((1, 64), np.float16), qw, cols=1, silu_pairs=True)
    with pytest.raises(ValueError, match="even N"):
        pair_gemv.plan(np.zeros((1, 64), np.float16), ref.quantize(random_weight(rng, 5, 64), k=4), silu_pairs=True)
    with pytest.raises(ValueError, match="code layout"):
        KbitCodes(np.zeros(10, np.uint32), np.zeros(2, np.uint8), np.zeros(32, np.float32), 5, (2, 32))


@pytest.mark.parametrize("k, cols, N, ctas, whole, cap", [(4, 8, 55, 1, True, None), (4, 8, 55, 4, False, None),
                                                        (2, 1, 7, 2, True, None), (2, 1, 7, 1, True, None),
                                                        (2, 1, 7, 4, False, None), (2, 1, 7, 4, False, 64)])
def test_pair_gemv_batches_of_groups(monkeypatch, k, cols, N, ctas, whole, cap):
    """At M = 1 with float16 sums a slice sums its partials once per batch of three column groups
    (``PairGemvSpec.batch``). One slice of one K-warp walks seven groups: one CTA in batches of 3, 3, 1 (the last
    group partial), two CTAs in 3 + 1 and 3, four CTAs in 2, 2, 2, 1. Where a CTA runs a whole batch (at the k of
    ``pair_gemv.PAIR_FULL_BATCHES_K``, 2 and 4) plan builds ``full_batches``: whole batches run a loop of their own
    with no branch inside and the last, partial one the loop that may stop after any group: one CTA runs two whole
    batches and then one group, two CTAs one whole batch each and then one group; four CTAs run none, so the build is
    the plain one.
    ``cap``: plan's ``max_registers`` (an experiment's knob for the knob sweep) builds the capped kernel, with the
    same results. On the simulator it fails when a batch sums only its last group."""
    monkeypatch.setattr(pair_gemv, "persistent_grid", lambda work, *args: min(work, ctas))
    rng = np.random.default_rng(30 + k)
    qw = ref.quantize(random_weight(rng, N, 128), k=k)
    A = _activations(rng, 1, 128, "float16")
    p = pair_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=np.float32, cols=cols, cta_warps=1, f16_acc=True,
                       max_registers=cap)
    spec = pair_gemv.PairGemvSpec(k, 1, cols, out_dtype="float32", f16_acc=True, full_batches=whole,
                                  max_registers=cap)
    assert spec.batch == pair_gemv.BATCH and p.steps[0].kernel is pair_gemv.make_pair_gemv_kernel(spec)
    assert p.steps[0].grid == ctas and p.steps[0].block == 32 and -(-N // cols) == 7
    check_close_f16_acc(p.launch().copy_to_host(), A, qw, np.float32)


@pytest.mark.parametrize("silu", [False, True])
def test_pair_gemv_whole_batches_of_slices(monkeypatch, silu):
    """Whole batches (``full_batches``) in a CTA of two slices of two K-warps: eight column groups of four columns (N =
    30, the last group partial) in one CTA, so each slice runs two whole batches (groups 0-2, 3-5), summed by its warp
    0 and then its warp 1 (the rotation), and then the last two groups in the other loop. Here the partials' addresses
    take a slice, a warp, a group of the batch and a buffer half other than the first, which one slice of one warp
    (test_pair_gemv_batches_of_groups) cannot tell apart. Each K-warp holds 32 blocks, so one warp's partial left out
    is far outside the bound."""
    monkeypatch.setattr(pair_gemv, "persistent_grid", lambda work, *args: min(work, 1))
    rng = np.random.default_rng(63)
    N, K = 30, 2048                                    # two K-warps, each with a whole warp's blocks
    qw = ref.quantize(random_weight(rng, N, K), k=4)
    A = _activations(rng, 1, K, "float16")
    p = pair_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=np.float32, cols=2, cta_warps=4, f16_acc=True,
                       silu_pairs=silu)
    spec = pair_gemv.PairGemvSpec(4, 1, 2, out_dtype="float32", f16_acc=True, silu_pairs=silu, full_batches=True)
    assert p.steps[0].kernel is pair_gemv.make_pair_gemv_kernel(spec)
    assert p.steps[0].grid == 1 and p.steps[0].block == 2 * k_warps(K) * 32 and -(-N // 4) == 8
    got = p.launch().copy_to_host()
    if silu:
        check_silu_pairs(got, A, qw, True, np.float32)
    else:
        check_close_f16_acc(got, A, qw, np.float32)


def rms_scaled(A, eps):
    """A's rows scaled by 1 / sqrt(mean(A^2) + eps), in float64: what ``rms_eps`` multiplies by W^T."""
    A64 = np.atleast_2d(A).astype(np.float64)
    return A64 / np.sqrt((A64 ** 2).mean(axis=1, keepdims=True) + eps)


# the scale's relative error: the float32 sum of K squares (at most K float32 roundings, 2^-24 each, of a sum of
# positive terms: ~1e-4 at K = 2048, half of it through the square root), rsqrt.approx and the fast division
RMS_SCALE_RTOL = 1e-4


@pytest.mark.parametrize("k, M, f16_acc, silu, ctas", [(4, 1, True, True, 1), (4, 1, True, False, 2),
                                                    (2, 1, True, True, 4), (4, 3, False, False, 2),
                                                    (2, 2, False, True, 1)])
def test_pair_gemv_rms_eps(monkeypatch, k, M, f16_acc, silu, ctas):
    """``rms_eps``: an RMSNorm of A before the product (its weight folded into the weight), applied in the epilogue:
    each output row scaled by 1 / sqrt(mean(A^2) + eps) (reference.rms_gemv; with the SiLU epilogue, before the SiLU),
    the squares summed by the kernel from the activations each slice loads. Two slices of two K-warps, eight groups of
    four columns; the grid (``ctas``) at M = 1 with float16 sums runs whole batches (1 and 2 CTAs) and the other loop
    (4 CTAs). Rows of different sizes (a row's squares in another row's word, or a K-warp's left out, is a scale off
    by far more than the bound). The scaled product is the plain product of the scaled A, so the bound is the plain
    one at those activations plus the scale's rounding (``RMS_SCALE_RTOL``)."""
    monkeypatch.setattr(pair_gemv, "persistent_grid", lambda work, *args: min(work, ctas))
    rng = np.random.default_rng(64 + k + M)
    N, K, eps = 30, 2048, 1e-6
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    A = (_activations(rng, M, K, "float32") * 3.0 * np.arange(1, M + 1)[:, None]).astype(np.float16)
    p = pair_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=np.float32, cols=2, cta_warps=4, f16_acc=f16_acc,
                       silu_pairs=silu, rms_eps=eps)
    assert p.steps[0].grid == ctas
    got = p.launch().copy_to_host()
    scaled = rms_scaled(A, eps)
    if silu:
        check_silu_pairs(got, scaled, qw, f16_acc, np.float32, rtol=RMS_SCALE_RTOL)
    else:
        want = ref.rms_gemv(A, qw, eps)
        assert_within(got, want, gemv_bound(scaled, qw, f16_acc) + RMS_SCALE_RTOL * np.abs(want), np.float32)


@pytest.mark.parametrize("k, M, f16_acc, pdl, ctas, whole", [(4, 1, True, True, 1, True), (4, 1, True, False, 8, True),
                                                             (2, 1, True, True, 2, True), (4, 1, True, True, 2, False),
                                                             (2, 2, False, False, 2, True),
                                                             (4, 3, True, False, 3, True)])
def test_pair_gemv_accumulate(monkeypatch, k, M, f16_acc, pdl, ctas, whole):
    """``accumulate``: out += A W^T in place, each element rounded to float16 once more after the float16 sum (a decode
    step's residual add in the launch that produces the delta). 15 groups of four columns: at M = 1 with float16 sums
    whole batches (1 and 2 CTAs: the summing warp rotates) and batches of three groups (8 CTAs: one partial batch a
    CTA; 2 CTAs without the whole-batch loop, ``whole`` False: several batches a CTA); batches of one group at M = 2
    and 3 (rows summed apart). A residual read for the wrong column, or an element written twice, is far outside the
    float32 sum's bound."""
    monkeypatch.setattr(pair_gemv, "persistent_grid", lambda work, *args: min(work, ctas))
    if not whole:
        monkeypatch.setattr(pair_gemv, "PAIR_FULL_BATCHES_K", ())
    rng = np.random.default_rng(66 + k + M)
    N, K = 60, 2048
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    A = _activations(rng, M, K, "float16")
    res = (rng.standard_normal((M, N)) * 4).astype(np.float16)
    out = cuda.to_device(res)
    p = pair_gemv.plan(A, pair_gemv.to_codes(qw), out=out, f16_acc=f16_acc, pdl=pdl, accumulate=True,
                       cols=2, cta_warps=4 if M < 3 else 8)
    assert p.steps[0].grid == ctas
    assert p.launch() is out
    x = out.copy_to_host().astype(np.float64)
    want = ref.gemv(A, qw).astype(np.float64)
    ulp = np.abs(res.astype(np.float64)) + np.abs(want) + 1e-30   # (two float16 roundings of what is added)
    assert_within(x - res.astype(np.float64), want, gemv_bound(A, qw, f16_acc) + 2.0 ** -10 * ulp, np.float32)


@settings(max_examples=max(EXAMPLES // 2, 3))       # (each example compiles two builds; the cases above cover grids)
@given(seeds, st.sampled_from(CODES_K), st.integers(1, 3), st.sampled_from([2, 4, 8]), st.booleans(),
       st.integers(1, MAX_N), KBS, st.booleans())
def test_pair_gemv_residual_and_norm_property(seed, k, M, cols, f16_acc, n, kbn, silu):
    """The two launches of a decode step's add + norm at any shape: ``accumulate`` (an o projection [H, 64] adding
    into a residual [M, H]) and then ``rms_eps`` on that residual (an up projection [N, H], SiLU pairs or not; H any
    multiple of 32, so the last K-warp may have idle lanes): the residual add within its bound, and the normed product
    within the plain product's bound at the normed activations."""
    rng = np.random.default_rng(seed)
    H, N, eps = 32 * kbn, 2 * n if silu else n, 1e-6
    o_qw = ref.quantize(random_weight(rng, H, 64), k=k)
    up_qw = ref.quantize(random_weight(rng, N, H), k=k)
    att = _activations(rng, M, 64, "float16")
    res = (rng.standard_normal((M, H)) * 2).astype(np.float16)
    out = cuda.to_device(res)
    pair_gemv.plan(att, pair_gemv.to_codes(o_qw), out=out, f16_acc=f16_acc, accumulate=True, cols=cols).launch()
    x = out.copy_to_host()
    want = ref.gemv(att, o_qw).astype(np.float64)
    ulp = np.abs(res.astype(np.float64)) + np.abs(want) + 1e-30
    assert_within(x.astype(np.float64) - res, want, gemv_bound(att, o_qw, f16_acc) + 2.0 ** -10 * ulp, np.float32)
    got = pair_gemv.plan(out, pair_gemv.to_codes(up_qw), out_dtype=np.float32, f16_acc=f16_acc, silu_pairs=silu,
                         rms_eps=eps, cols=cols).launch().copy_to_host()
    scaled = rms_scaled(x, eps)
    if silu:
        check_silu_pairs(got, scaled, up_qw, f16_acc, np.float32, rtol=RMS_SCALE_RTOL)
    else:
        want = ref.rms_gemv(x, up_qw, eps)
        assert_within(got, want, gemv_bound(scaled, up_qw, f16_acc) + RMS_SCALE_RTOL * np.abs(want), np.float32)


def test_pair_gemv_rms_and_accumulate_refuse():
    rng = np.random.default_rng(65)
    qw = pair_gemv.to_codes(ref.quantize(random_weight(rng, 8, 64), k=4))
    A = _activations(rng, 1, 64, "float16")
    with pytest.raises(ValueError, match="float16 output"):
        pair_gemv.plan(A, qw, out=cuda.to_device(np.zeros((1, 8), np.float32)), accumulate=True)
    with pytest.raises(ValueError, match="pass the float16 out"):
        pair_gemv.plan(A, qw, accumulate=True)
    with pytest.raises(ValueError, match="rms_eps"):
        pair_gemv.plan(A, qw, rms_eps=2.0)
    with pytest.raises(ValueError, match="not both"):
        pair_gemv.plan(A, qw, out=cuda.to_device(np.zeros((1, 8), np.float16)), rms_eps=1e-6, accumulate=True)
    with pytest.raises(ValueError, match="grouped"):
        pair_gemv.PairGemvSpec(4, 1, grouped=True, rms_eps=1e-6).normalise()


@pytest.mark.parametrize("k, cols, slices, M, f16_acc", [(4, 2, 2, 1, True), (2, 8, 2, 2, False), (2, 4, 3, 2, True),
                                                          (4, 2, 4, 3, False)])
def test_pair_gemv_tuned_knobs(k, cols, slices, M, f16_acc):
    """The launch knobs that ``bench --tune-codes`` writes into a table (cols, cta_warps; dispatch.codes_rules) make
    CTAs of fewer slices than the default plan's, each of several K-warps (8-warp CTAs at K = 4096 on the H100): the
    results do not depend on them."""
    rng = np.random.default_rng(50 + slices)
    K, N = (1056, 40) if SIM else (2048, 1000)        # two K-warps a slice
    kw = k_warps(K)
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    A = _activations(rng, M, K, "float16")
    p = pair_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=np.float32, cols=cols, cta_warps=slices * kw,
                       f16_acc=f16_acc)
    assert p.steps[0].block == slices * kw * 32
    got = p.launch().copy_to_host()
    if f16_acc:
        check_close_f16_acc(got, A, qw, np.float32)
    else:
        check_close(got, A, qw)


@gpu_split("k_split", CODES_K)
@settings(max_examples=gpu_examples(EXAMPLES, len(CODES_K)))
@given(seeds, variants((4, 2), (False, True), (np.float16, np.float32)),
       st.lists(st.integers(0, 3 if SIM else 9), min_size=1, max_size=4 if SIM else 9),
       st.integers(1, 16 if SIM else 300), st.sampled_from([1, 3]) if SIM else sizes(140, 512), out_modes)
def test_pair_gemv_grouped_property(k_split, seed, v, counts, N, kbn, out_mode):
    """MoE experts through ``grouped_gemv`` (any rows an expert, empty experts included; float32 or float16 block
    sums; on the GPU up to 81 rows, past GROUPED_MANY_ROWS) against the reference per expert, within the plain
    kernel's bounds (check_close, check_close_f16_acc)."""
    k, f16_acc, out_dtype = v
    k = k_split or k
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    flats, experts, offsets, A = routed_case(rng, counts, N, K, k, ref.to_codes)
    T = int(offsets[-1])
    o = Out(out_mode, (T, N), out_dtype)
    got = pair_gemv.grouped_gemv(A, experts, cuda.to_device(offsets), out_dtype=out_dtype, f16_acc=f16_acc,
                                 **o.kwargs)
    assert got.shape == (T, N)
    got = o.host(got)
    for e, w in enumerate(flats):
        rows = slice(offsets[e], offsets[e + 1])
        if counts[e] and f16_acc:
            check_close_f16_acc(got[rows], A[rows], w, out_dtype)
        elif counts[e]:
            check_close(got[rows], A[rows], w, out_dtype=out_dtype)


@pytest.mark.parametrize("k, f16_acc, pdl, silu_pairs", [(4, False, False, False), (2, True, True, False),
                                                        (4, True, True, True)])
def test_pair_gemv_grouped(k, f16_acc, pdl, silu_pairs):
    """MoE experts, one token row a grid slot (``grouped_gemv``): each row equals the plain kernel's M = 1 result on
    its expert's weight bit for bit (the same sums in the same order), whatever the routing: rows spread over the
    experts, empty experts among them (the first and last too), several rows of one expert, T < E and T > E; on the
    GPU also T >= GROUPED_MANY_ROWS (the many-rows knobs)."""
    rng = np.random.default_rng(60 + k)
    N, K = (24, 1056) if SIM else (700, 2048)        # two K-warps a slice
    flats = [ref.quantize(random_weight(rng, N, K), k=k) for _ in range(4)]
    codes = [pair_gemv.to_codes(w) for w in flats]
    experts = kb.stack_experts(codes)
    for counts in [[0, 2, 0, 1], [1, 0, 3, 0]] if SIM else [[0, 2, 0, 1], [3, 1, 5, 0], [40, 0, 30, 2]]:
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        A = _activations(rng, int(offsets[-1]), K, "float16")
        p = pair_gemv.plan_grouped(A, experts, cuda.to_device(offsets), out_dtype=np.float32, f16_acc=f16_acc,
                                   pdl=pdl and not SIM, silu_pairs=silu_pairs)
        assert p.steps[0].grid[1] == offsets[-1]
        got = p.launch().copy_to_host()
        assert got.shape == (offsets[-1], N // 2 if silu_pairs else N)
        for e in range(len(counts)):
            for t in range(offsets[e], offsets[e + 1]):
                want = pair_gemv.plan(A[t:t + 1], codes[e], out_dtype=np.float32, f16_acc=f16_acc,
                                      silu_pairs=silu_pairs).launch().copy_to_host()
                assert np.array_equal(got[t:t + 1], want), (counts, e, t)
    if not f16_acc:                                     # a register cap changes no sum (the last routing again)
        capped = pair_gemv.plan_grouped(A, experts, cuda.to_device(offsets), out_dtype=np.float32, pdl=pdl and not SIM,
                                        silu_pairs=silu_pairs, max_registers=128)
        assert capped.steps[0].kernel is not p.steps[0].kernel     # (its own build)
        assert np.array_equal(capped.launch().copy_to_host(), got)
    if not silu_pairs and f16_acc:                      # and row 0 (expert 0) against the reference
        check_close_f16_acc(got[:1], A[:1], flats[0], np.float32)
    elif not silu_pairs:
        check_close(got[:1], A[:1], flats[0])
    with pytest.raises(ValueError, match="code- or fragment-layout experts"):
        pair_gemv.plan_grouped(A, kb.stack_experts(flats), offsets)
    with pytest.raises(ValueError, match="E\\+1"):
        pair_gemv.plan_grouped(A, experts, offsets[:-1])


def test_pair_gemv_grouped_grid_fits_the_resident_ctas(monkeypatch):
    """The grouped pair gemv shares the resident CTAs among its slots rounded down (``core.row_share``): with 5
    resident, 3 slots of 4 column groups take 1 x 3 CTAs (rounding up, 2 x 3, put a CTA in a second wave: on
    qwen3-30b-a3b's experts at 4 tokens, 9 x 32 CTAs where 8 x 32 fit took 1.3-1.5x the time). The rows stay right."""
    monkeypatch.setattr(pair_gemv, "persistent_grid", lambda work, *args: min(work, 5))
    rng = np.random.default_rng(61)
    N, K = 8, 256
    flats = [ref.quantize(random_weight(rng, N, K), k=4) for _ in range(3)]
    A = _activations(rng, 3, K, "float16")
    p = pair_gemv.plan_grouped(A, kb.stack_experts([pair_gemv.to_codes(w) for w in flats]),
                               np.array([0, 1, 2, 3], np.int32), out_dtype=np.float32, cols=2, cta_warps=1)
    assert p.steps[0].grid == (1, 3)
    got = p.launch().copy_to_host()
    for e in range(3):
        check_close(got[e:e + 1], A[e:e + 1], flats[e])


@pytest.mark.parametrize("k, M, f16_acc, cols", [(4, 1, True, 4), (4, 3, False, 2), (4, 1, False, 8), (4, 2, True, 1),
                                                 (2, 1, False, 8), (2, 2, True, 4)])
def test_pair_gemv_reads_the_fragment_layout(k, M, f16_acc, cols):
    """On the fragment layout (``KbitFragments``: the code layout's blocks permuted for the tensor-core gemv) the
    pair gemv finds each block where ``formats.fragment_position`` put it: its result equals the code layout's bit for
    bit (the same sums in the same order), plain and grouped, with two K-warps (the second's last lanes past the
    weight's blocks) and a grid whose last group runs past N."""
    rng = np.random.default_rng(80 + k + M)
    N, K = (48, 1280) if SIM else (720, 4352)          # 3 / 45 strips of 16 columns; n_kb 40 / 136: 2 / 5 K-warps
    flats = [ref.quantize(random_weight(rng, N, K), k=k) for _ in range(3)]
    codes = [ref.to_codes(w) for w in flats]
    frags = [ref.to_fragments(c) for c in codes]
    A = _activations(rng, M, K, "float16")
    plans = [pair_gemv.plan(A, w, out_dtype=np.float32, f16_acc=f16_acc, cols=cols) for w in (codes[0], frags[0])]
    assert plans[1].steps[0].kernel is not plans[0].steps[0].kernel        # (its own build: fragments=True)
    assert np.array_equal(plans[1].launch().copy_to_host(), plans[0].launch().copy_to_host())
    if M == 1:                                          # grouped: 3 experts, rows 0, 2, 1 of them (empty expert 1)
        offsets = np.array([0, 1, 1, 3], np.int32)
        A3 = _activations(rng, 3, K, "float16")
        run = [pair_gemv.grouped_gemv(A3, kb.stack_experts(ws), cuda.to_device(offsets), out_dtype=np.float32,
                                      f16_acc=f16_acc).copy_to_host() for ws in (codes, frags)]
        assert np.array_equal(run[1], run[0])
        if f16_acc:                                     # (and expert 2's rows against the reference)
            check_close_f16_acc(run[1][1:], A3[1:], flats[2], np.float32)
        else:
            check_close(run[1][1:], A3[1:], flats[2], out_dtype=np.float32)


def test_whole_rounds_picks_the_slices_with_the_least_work_on_the_busiest_sm(monkeypatch):
    """The plan's slice count on an H100's 132 SMs (registers as the H100 build has them: 72 at M = 1, cols = 2; 94 at
    cols = 4): 2048x5120 M = 1 has 320 groups of 16 columns at the default 8 slices (three rounds for 2.4); 10 slices
    make two whole rounds. 4096x14336 keeps its 4 (5 would take 6 rounds of 20 columns: more than 7 of 16)."""
    monkeypatch.setattr(pair_gemv, "sm_count", lambda: 132)
    monkeypatch.setattr(pair_gemv, "persistent_grid", lambda work, threads, regs, shared: min(
        work, 132 * max(1, min(65536 // (threads * -(-regs // 8) * 8), (228 * 1024) // (shared + 1024)))))

    def pick(K, N, M, regs):
        kw = k_warps(K)
        spec = pair_gemv.PairGemvSpec(4, M, pair_gemv.default_cols(M, N, K))
        most = min(65536 // (-(-regs // 8) * 8) // (kw * 32), -(-N // spec.cols), pair_gemv.MAX_SLICES)
        return pair_gemv.whole_rounds(max(1, min(16 // kw, most)), most, N, spec, kw, regs)

    assert pick(2048, 5120, 1, 72) == 10
    assert pick(5120, 2048, 1, 72) == 4                   # 342 groups of 6 (3 rounds) -> 256 of 8 (2 rounds)
    assert pick(4096, 14336, 1, 94) == 4
    assert pick(4096, 4096, 1, 94) == 4                   # 256 groups, two whole rounds already
    assert pick(2048, 512, 1, 72) == 8                    # never fewer slices than the default


@lru_cache(maxsize=None)
def _reduce_scatter_kernel(V):
    """A one-warp kernel around ``make_warp_reduce_scatter(V)``: made once per V (each is a compile)."""
    rs = device.make_warp_reduce_scatter(V)

    @cuda.jit
    def kern(acc_in, total, v_idx, owner):
        lane = cuda.threadIdx.x
        a = cuda.local.array(V, np.float32)
        for j in range(V):
            a[j] = acc_in[lane, j]
        r, v, o = rs(a, lane)
        total[lane] = r
        v_idx[lane] = v
        owner[lane] = 1 if o else 0
    return kern


@settings(max_examples=EXAMPLES)
@given(seeds, st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_warp_reduce_scatter(seed, V):
    """The warp reduce-scatter against its twin: which lane ends with which value's sum."""
    acc = np.random.default_rng(seed).standard_normal((32, V)).astype(np.float32)
    kern = _reduce_scatter_kernel(V)
    total = cuda.device_array(32, np.float32)
    v_idx = cuda.device_array(32, np.int32)
    owner = cuda.device_array(32, np.int32)
    kern[1, 32](cuda.to_device(acc), total, v_idx, owner)
    want_total, want_idx, want_owner = device.py_warp_reduce_scatter(acc)
    assert np.array_equal(v_idx.copy_to_host(), want_idx)
    assert np.array_equal(owner.copy_to_host().astype(bool), want_owner)
    np.testing.assert_allclose(total.copy_to_host(), want_total, rtol=1e-5, atol=1e-5)
