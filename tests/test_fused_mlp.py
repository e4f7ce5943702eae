"""The fused MLP (gate/up, SiLU and down in one launch) and the K-major layout against the reference, on the simulator
(CI) and the GPU."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda

from kbit_numba import fused_mlp, intrinsics as I, pair_gemv, reference as ref
from kbit_numba.formats import BLOCK, CODES_K, KbitKMajor
from helpers import EXAMPLES, SIM, assert_within, random_weight, seeds
from test_gemv import _activations
from test_pair_gemv import RMS_SCALE_RTOL, check_silu_pairs, rms_scaled


@settings(max_examples=EXAMPLES * 2)
@given(seeds, st.sampled_from(CODES_K), st.integers(1, 12), st.integers(1, 6))
def test_kmajor_round_trip(seed, k, n4, kbn):
    """to_kmajor / from_kmajor are exact inverses; word w of row n sits at w * N + n, block kb's absmax at kb * N + n;
    N not a multiple of 4 is refused."""
    rng = np.random.default_rng(seed)
    N, K = 4 * n4, BLOCK * kbn
    kc = ref.to_codes(ref.quantize(random_weight(rng, N, K), k=k))
    km = ref.to_kmajor(kc)
    back = ref.from_kmajor(km)
    assert np.array_equal(back.packed, kc.packed) and np.array_equal(back.absmax, kc.absmax)
    n, w = rng.integers(N), rng.integers(K * k // 32)
    assert km.packed[w * N + n] == kc.packed.reshape(N, -1)[n, w]
    assert km.absmax[(w // k) * N + n] == kc.absmax.reshape(N, -1)[n, w // k]
    assert np.array_equal(ref.dequantize(km), ref.dequantize(kc))
    if N > 4:
        with pytest.raises(ValueError, match="multiple of 4"):
            KbitKMajor(km.packed[:-K * k // 32], km.absmax[:-K // 32], km.codebook, k, (N - 1, K))


def down_bound(h, down, k):
    """The down phase's error bound per output: a word's 32 / k products are summed by f16x2 FMAs, each half-lane a
    chain of n = 16 / k terms whose table values are float16-rounded, so at most (n + 2) float16 roundings (2^-11) of
    the sum of |terms|, plus subnormal products (2^-25 absolute each, times the absmax); the float32 scaling and
    sums across words and CTAs add 1e-5 relative."""
    Wd = np.abs(ref.dequantize(down).astype(np.float64))
    scale = np.abs(np.asarray(h, np.float64)).reshape(1, -1) @ Wd.T
    n = 16 // k
    absmax = ref.decoded_absmax(down).reshape(down.shape[0], -1).astype(np.float64)
    tiny = (n + 1) * 2.0 ** -24 * absmax.sum(axis=1) * k       # (k words a block, each its own chains)
    return ((n + 2) * 2.0 ** -11 + 1e-5) * scale + tiny[None, :] + 1e-30


def other_codebook(k):
    """Down's codebook in the tests: uniform, unlike gate/up's default one (a lookup in the wrong table shows)."""
    return np.linspace(-1.0, 1.0, 1 << k, dtype=np.float32)


def run_fused(monkeypatch, rng, k, H, inter, n_out, ctas, cta_warps, eps=0.0, acc0=None, loads=None):
    """One launch on random weights; returns (got acc, kernel's h, x, gate/up, down)."""
    monkeypatch.setattr(pair_gemv, "persistent_grid", lambda work, *args: min(work, ctas))
    gu = ref.to_codes(ref.quantize(random_weight(rng, 2 * inter, H), k=k))
    dn = ref.to_kmajor(ref.quantize(random_weight(rng, n_out, inter), k=k, codebook=other_codebook(k)))
    x = _activations(rng, 1, H, "float16")
    h = cuda.device_array((1, inter), np.float16)
    acc = cuda.to_device(np.zeros((1, n_out), np.float32) if acc0 is None else acc0)
    p = fused_mlp.plan(x, gu, dn, acc=acc, h=h, rms_eps=eps or None, cta_warps=cta_warps, down_loads=loads)
    assert p.steps[0].grid <= ctas and p.out is acc
    return p.launch().copy_to_host(), h.copy_to_host(), x, gu, dn


# (k, H, intermediate, down's rows, CTAs, warps a CTA, loads a lane an item (None: the plan's)): one and two words a
# group (k = 4 with 4 and 8 slices), k = 2's 8 columns; several groups a CTA, and more items a CTA than its loads run
# ahead (10 words at k = 4, 5 at k = 2); at 128 threads one pass of 2 loads (516 rows: the second load partly past N),
# two passes of 2 loads (1028, k = 4 and 2), and two and three passes of 1 load (516, 1028), in one round of loads and
# across rounds
CASES = [(4, 64, 32, 64, 1, 4, None), (4, 64, 64, 64, 3, 8, None), (2, 64, 64, 32, 2, 4, None),
         (4, 32, 32, 516, 2, 4, None), (4, 32, 160, 64, 2, 4, None), (2, 32, 160, 32, 2, 4, None),
         (4, 32, 160, 1028, 2, 4, None), (2, 32, 64, 1028, 2, 4, None), (4, 32, 32, 516, 2, 4, 1),
         (2, 32, 160, 1028, 2, 4, 1)]


@pytest.mark.parametrize("k, H, inter, n_out, ctas, warps, loads", CASES)
def test_fused_mlp(monkeypatch, k, H, inter, n_out, ctas, warps, loads):
    """acc += down(h), h = silu(gate(x)) * up(x): the kernel's h (float16, as the separate launches write it) within
    the SiLU epilogue's bound of reference.silu_pairs, and acc within :func:`down_bound` of down(h) for that h, added
    into what acc held."""
    rng = np.random.default_rng(7 * k + H + n_out)
    acc0 = rng.standard_normal((1, n_out)).astype(np.float32)
    got, h, x, gu, dn = run_fused(monkeypatch, rng, k, H, inter, n_out, ctas, warps, acc0=acc0, loads=loads)
    check_silu_pairs(h, x, gu, True, np.float16)
    want = acc0.astype(np.float64) + ref.gemv(h.astype(np.float32), dn).astype(np.float64)
    assert_within(got, want, down_bound(h, dn, k) + 1e-6 * np.abs(acc0), np.float32)


def test_fused_mlp_rms_eps(monkeypatch):
    """``rms_eps``: x RMS-normalised before gate/up (the pair gemv's epilogue scale), down unchanged."""
    rng = np.random.default_rng(11)
    got, h, x, gu, dn = run_fused(monkeypatch, rng, 4, 64, 32, 64, 2, 4, eps=1e-6)
    check_silu_pairs(h, rms_scaled(x, 1e-6), gu, True, np.float16, rtol=RMS_SCALE_RTOL)
    assert_within(got, ref.gemv(h.astype(np.float32), dn), down_bound(h, dn, 4), np.float32)
    want, _ = ref.fused_mlp(x, gu, dn, rms_eps=1e-6)            # (the twin, through its own float16 h)
    assert np.allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max())


@settings(max_examples=EXAMPLES if SIM else 2 * EXAMPLES, deadline=None)
@given(seeds, st.sampled_from(CODES_K), st.integers(1, 2 if SIM else 64), st.integers(1, 2 if SIM else 8),
       st.integers(1, 4 if SIM else 300))
def test_fused_mlp_property(seed, k, kbh, units, rows4):
    """Random shapes (H = 32 kbh, the intermediate size a multiple of 32, down's N = 4 rows4) with the plan's own grid
    and CTA size (on the simulator 4 warps a CTA): the same checks as :func:`test_fused_mlp`. Gate/up's weights are
    scaled by sqrt(32 / H), so that gate and up stay as large as at H = 32 whatever H: unscaled, at H = 1472 some h
    passed float16's range (|h| up to 7.8e4 on the GPU's first run), where both the fused launch and the two launches
    it replaces give infinities (h is float16 in both)."""
    rng = np.random.default_rng(seed)
    H, n_out = BLOCK * kbh, 4 * rows4
    inter = BLOCK * units * (1 if SIM else 4)          # (down's K: whole blocks)
    gu = ref.to_codes(ref.quantize(random_weight(rng, 2 * inter, H, scale=(BLOCK / H) ** 0.5), k=k))
    dn = ref.to_kmajor(ref.quantize(random_weight(rng, n_out, inter), k=k, codebook=other_codebook(k)))
    x = _activations(rng, 1, H, "float16")
    h = cuda.device_array((1, inter), np.float16)
    got = fused_mlp.plan(x, gu, dn, h=h, cta_warps=4 if SIM else None).launch().copy_to_host()
    h = h.copy_to_host()
    assert np.all(np.isfinite(h)), "the drawn weights took h past float16's range (the test's inputs, not the kernel)"
    check_silu_pairs(h, x, gu, True, np.float16)
    assert_within(got, ref.gemv(h.astype(np.float32), dn), down_bound(h, dn, k), np.float32)


def test_fused_mlp_prepare_accumulates_each_run():
    """``prepare``: one bound launch whose every ``run()`` adds down(h) into the same ``acc`` (a decode loop zeroes it
    between steps; here two runs give twice the sums), with x rewritten in place between runs; ``mlp`` allocates a
    zeroed acc."""
    rng = np.random.default_rng(13)
    gu = ref.to_codes(ref.quantize(random_weight(rng, 64, 32), k=4))
    dn = ref.to_kmajor(ref.quantize(random_weight(rng, 8, 32), k=4, codebook=other_codebook(4)))
    x = cuda.to_device(_activations(rng, 1, 32, "float16"))
    h = cuda.device_array((1, 32), np.float16)
    step = fused_mlp.prepare(x, gu, dn, h=h)
    once = step.run().copy_to_host()
    twice = step.run().copy_to_host()
    want = ref.gemv(h.copy_to_host().astype(np.float32), dn)
    assert_within(once, want, down_bound(h.copy_to_host(), dn, 4), np.float32)
    assert np.allclose(twice, 2 * once, rtol=1e-5, atol=1e-6)
    x.copy_to_device(np.zeros((1, 32), np.float16))        # silu(0) * 0 = 0: the sums stay
    assert np.allclose(step.run().copy_to_host(), twice, rtol=0, atol=0)
    alone = fused_mlp.mlp(x.copy_to_host()[0], gu, dn).copy_to_host()
    assert alone.shape == (8,) and not alone.any()


def test_fused_mlp_refusals():
    rng = np.random.default_rng(5)
    gu4 = ref.to_codes(ref.quantize(random_weight(rng, 64, 64), k=4))
    dn4 = ref.to_kmajor(ref.quantize(random_weight(rng, 64, 32), k=4))
    dn2 = ref.to_kmajor(ref.quantize(random_weight(rng, 64, 32), k=2))
    x = np.zeros((1, 64), np.float16)
    with pytest.raises(ValueError, match="one k"):
        fused_mlp.plan(x, gu4, dn2)
    with pytest.raises(ValueError, match="N / 2"):
        fused_mlp.plan(x, gu4, ref.to_kmajor(ref.quantize(random_weight(rng, 64, 64), k=4)))
    with pytest.raises(ValueError, match="float16 activations"):
        fused_mlp.plan(x.astype(np.float32), gu4, dn4)
    with pytest.raises(ValueError, match="1 rows|M = 1"):
        fused_mlp.plan(np.zeros((2, 64), np.float16), gu4, dn4)
    with pytest.raises(ValueError, match="E4M4"):
        fused_mlp.plan(x, gu4, ref.to_kmajor(ref.quantize(random_weight(rng, 64, 32), k=4, absmax_format="fp32")))
    with pytest.raises(ValueError, match="no CTA"):     # K = 16384: 16 K-warps, at most 2 slices of 4 columns a CTA
        wide = ref.to_codes(ref.quantize(random_weight(rng, 64, 16384), k=4))
        fused_mlp.plan(np.zeros(16384, np.float16), wide, dn4)
    with pytest.raises(TypeError, match="down weight"):
        fused_mlp.plan(x, gu4, np.zeros(4))


@cuda.jit
def _red_kernel(acc, vals):
    """Every thread adds its four values into acc[4 (t % n) ..] (n = acc.size / 4): many threads a word."""
    t = cuda.grid(1)
    if t < vals.shape[0]:
        j = 4 * (t % (acc.size // 4))
        I.red_v4_f32(acc, j, vals[t, 0], vals[t, 1], vals[t, 2], vals[t, 3])


def test_red_v4_f32():
    """red_v4_f32 (on the GPU the PTX reduction, on the simulator its twin): 256 threads' four values summed into 8
    words, each word from 64 threads, against the float64 sum (small integers: exact in float32 in any order)."""
    rng = np.random.default_rng(1)
    vals = rng.integers(-50, 50, (256, 4)).astype(np.float32)
    acc = cuda.to_device(np.zeros(8, np.float32))
    _red_kernel[2, 128](acc, vals)
    want = np.zeros(8)
    for t in range(256):
        want[4 * (t % 2):4 * (t % 2) + 4] += vals[t]
    assert np.array_equal(acc.copy_to_host(), want.astype(np.float32))


def test_the_per_layer_ab_script_checks_its_paths():
    """``benchmarks/fused_mlp_ab.py --check``: the script's two paths (the step's two launches through ``linear``'s
    runtime, and the fused launch) at a small shape agree with down of the fused launch's own h, so that its timings
    compare the same product."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "fused_mlp_ab.py")
    spec = importlib.util.spec_from_file_location("fused_mlp_ab", path)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    ab.check(4)
