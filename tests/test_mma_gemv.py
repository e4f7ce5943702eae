"""Tensor-core GEMV (swap AB, code layout, M = 1..32; grouped: up to 8 rows an expert) against reference.gemm, on
the simulator (CI) and the GPU."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda

import kbit_numba as kb
from kbit_numba import core, mma_gemv, pair_gemv, reference as ref
from kbit_numba.formats import CODES_K
from helpers import (EXAMPLES, SIM, assert_within, gpu_examples, gpu_split, kbit_weight, Out, out_modes, random_weight,
                     seeds, sizes, weight_kinds, variants)
from test_gemm import check_gemm
from test_gemv import _activations, routed_case

MAX_N = 20 if SIM else 700
# K = 64 * kb2: one warp with idle lanes (K < 256), a partial K-warp, two K-warps on the simulator; up to the
# kernel's 8192 (32 K-warps) on the GPU
KB2 = st.sampled_from([1, 5, 6]) if SIM else st.integers(1, 128)
SPLIT = [(k, a) for k in CODES_K for a in ("float16", "bfloat16")]


@gpu_split("k_split, a_split", SPLIT)
@settings(max_examples=gpu_examples(EXAMPLES * 2, len(SPLIT)))
@given(seeds, variants((4, 2), range(1, 33), ("e4m4", "fp32"), ("float16", "bfloat16"), (np.float16, np.float32)),
       sizes(MAX_N, 20000), KB2, weight_kinds, out_modes)
def test_mma_gemv(k_split, a_split, seed, v, N, kb2, kind, out_mode):
    k, M, fmt, a_dtype, out_dtype = v
    k, a_dtype = k_split or k, a_split or a_dtype
    rng = np.random.default_rng(seed)
    K = 64 * kb2
    qw, pool, rows = kbit_weight(rng, N, K, kind, k, fmt)
    A = _activations(rng, M, K, a_dtype)
    bf16 = a_dtype == "bfloat16"
    o = Out(out_mode, (M, N), out_dtype)
    out = mma_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=out_dtype, bf16=bf16, **o.kwargs).launch()
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    check_gemm(o.host(out), A, pool, bf16, out_dtype, rows)


def check_silu_pairs(got, A, qw, out_dtype=np.float32):
    """The silu_pairs epilogue against reference.silu_pairs of reference.gemm: check_gemm's bound e on the sums,
    carried through silu (|silu'| <= 1.1) and the product, 1.1 e_gate (|up| + e_up) + |silu(gate)| e_up, plus float32
    rounding of the exponential and the two operations."""
    C = ref.gemm(A, qw).astype(np.float64)
    Af = ref.mma_round(ref.as_float32(A).reshape(C.shape[0], -1)).astype(np.float64)
    Wg = np.abs(ref.gemm_weights(qw).astype(np.float64))
    steps = -(-Af.shape[1] // 16) + 2
    e = steps * 2.0 ** -22 * (np.abs(Af) @ Wg.T) + 2.0 ** -34 * (np.abs(Af) @ ((Wg > 0) & (Wg < 2.0 ** -14)).T)
    gate, up, e_gate, e_up = C[:, 0::2], C[:, 1::2], e[:, 0::2], e[:, 1::2]
    want = ref.silu_pairs(C)
    tol = 1.1 * e_gate * (np.abs(up) + e_up) + np.abs(gate / (1 + np.exp(-gate))) * e_up + 1e-6 * np.abs(want) + 1e-30
    assert_within(got, want, tol, out_dtype)


@settings(max_examples=EXAMPLES)
@given(seeds, variants((4, 2), range(1, 33), (np.float16, np.float32)), st.integers(1, MAX_N // 2), KB2)
def test_mma_gemv_silu_pairs(seed, v, half_n, kb2):
    """The ``silu_pairs`` epilogue (gate/up rows interleaved) writes silu(C[:, 2j]) * C[:, 2j + 1] into an [M, N / 2]
    output, one to four token tiles."""
    k, M, out_dtype = v
    rng = np.random.default_rng(seed)
    N, K = 2 * half_n, 64 * kb2
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    A = _activations(rng, M, K, "float16")
    out = mma_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=out_dtype, silu_pairs=True).launch()
    assert out.shape == (M, N // 2) and out.dtype == np.dtype(out_dtype)
    check_silu_pairs(out.copy_to_host(), A, qw, out_dtype)


@pytest.mark.parametrize("k", CODES_K)
def test_mma_gemv_grouped_silu_pairs(k):
    """MoE gate/up experts with interleaved rows: the grouped epilogue's [T, N / 2] output per expert, T >= E (a grid
    slot per expert) and T < E (a slot per row), code and fragment layouts."""
    rng = np.random.default_rng(40 + k)
    N, K = (32, 256) if SIM else (96, 1024)
    flats = [ref.quantize(random_weight(rng, N, K), k=k) for _ in range(4)]
    for experts in (kb.stack_experts([ref.to_codes(w) for w in flats]),
                    kb.stack_experts([mma_gemv.to_fragments(pair_gemv.to_codes(w)) for w in flats])):
        for counts in ([3, 0, 8, 1], [0, 1, 0, 1]):
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            A = _activations(rng, int(offsets[-1]), K, "float16")
            p = mma_gemv.plan_grouped(A, experts, offsets, out_dtype=np.float32, silu_pairs=True)
            got = p.launch().copy_to_host()
            assert got.shape == (int(offsets[-1]), N // 2)
            for e, w in enumerate(flats):
                if counts[e]:
                    rows = slice(offsets[e], offsets[e + 1])
                    check_silu_pairs(got[rows], A[rows], w)


@pytest.mark.parametrize("k", CODES_K)
def test_mma_gemv_two_tiles(k):
    """M = 9..16 takes two n8 token tiles (one decoded A fragment, two MMAs): the first and last M of the second
    tile, with columns past N in the last strip and K past one warp."""
    rng = np.random.default_rng(10 + k)
    N, K = (21, 320) if SIM else (1000, 4096)
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    kc = pair_gemv.to_codes(qw)
    for M in (9, 16):
        A = _activations(rng, M, K, "float16")
        assert mma_gemv.tiles_for(M) == 2 and mma_gemv.tiles_for(M - 8) == 1
        check_gemm(mma_gemv.gemv(A, kc, out_dtype=np.float32).copy_to_host(), A, qw)


# K = 64 * kb2 split over 2..4 CTAs (at most one K-warp of 256 a split on the simulator); on the GPU up to K = 16384,
# past 8192 split by default (a llama3-8b down projection: K = 14336, 4 splits of 14 K-warps)
KB2_SPLIT = st.sampled_from([5, 8, 12]) if SIM else st.one_of(st.integers(5, 128), st.integers(129, 256))


@gpu_split("k_split", CODES_K)
@settings(max_examples=gpu_examples(EXAMPLES, len(CODES_K)))
@given(seeds, variants((4, 2), (1, 9, 16, 4), ("e4m4", "fp32"), (np.float16, np.float32), (False, True)),
       sizes(MAX_N, 20000), KB2_SPLIT, st.sampled_from([None, 2, 3, 4]))
def test_mma_gemv_split_k(k_split, seed, v, N, kb2, split):
    """Split-K: each CTA row sums its share of the K-warps into the float32 workspace by atomic adds, and the finish
    launch writes ``out`` and leaves the workspace zeroed for the next call (also as a PDL launch)."""
    k, M, fmt, out_dtype, pdl = v
    k = k_split or k
    rng = np.random.default_rng(seed)
    K = 64 * kb2
    kw = -(-K // 256)
    split = None if split is None else min(split, kw)
    splits, per = mma_gemv.k_splits(K, split, k, M)
    assert splits * per >= kw > (splits - 1) * per and per <= mma_gemv.MAX_KW
    qw = ref.quantize(random_weight(rng, N, K), k=k, absmax_format=fmt)
    A = _activations(rng, M, K, "float16")
    ws = cuda.to_device(np.zeros(M * N + 3, np.float32))
    p = mma_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=out_dtype, split=split, workspace=ws, pdl=pdl)
    assert len(p.steps) == (1 if splits == 1 else 2)
    if splits > 1:
        assert p.workspace is ws and p.steps[0].grid[1] == splits and p.steps[0].block % (32 * per) == 0
    for _ in range(2):                     # the second call finds the workspace zeroed again
        check_gemm(p.launch().copy_to_host(), A, qw, out_dtype=out_dtype)
        assert not ws.copy_to_host().any()


def test_k_splits_default_rule():
    """By default a CTA holds all of K's warps to K = 4096; past 16 K-warps its registers are capped at 64, so K = 5120
    splits in two (k = 4; k = 2 from its second token tile, M = 9; a grouped launch asks as M = 8), and past 8192 every
    launch splits. An asked split is taken as asked."""
    assert mma_gemv.k_splits(4096, k=4, M=16) == (1, 16)
    assert mma_gemv.k_splits(5120, k=4, M=1) == (2, 10)
    assert mma_gemv.k_splits(5120, k=2, M=8) == (1, 20)
    assert mma_gemv.k_splits(5120, k=2, M=9) == (2, 10)
    assert mma_gemv.k_splits(8192, k=4, M=4) == (2, 16)
    assert mma_gemv.k_splits(8192, k=2, M=8) == (1, 32)
    assert mma_gemv.k_splits(8448, k=2, M=8) == (3, 11)
    assert mma_gemv.k_splits(14336, k=2, M=1) == (4, 14)
    assert mma_gemv.k_splits(5120, 1, k=4, M=16) == (1, 20)
    with pytest.raises(ValueError, match="at most 32"):
        mma_gemv.k_splits(14336, 1)


def test_cta_warps_by_bits_and_tiles(monkeypatch):
    """At K = 2048 (8 K-warps) a CTA aims for DEFAULTS["cta_warps"] (16: two slices where the registers allow), but
    k = 2's two-tile build for CTA_WARPS_BY_K_TILES (8: one slice); an asked cta_warps wins. (The plan alone: nothing
    is launched. On a GPU the registers may cut the slices further, as for k = 4's two tiles: the default plan is then
    compared with one asked for the aim; on the simulator every build fits 1024 threads, so the blocks are exact.
    The busiest-SM rule, which may take fewer slices than the aim, is off here: test_busiest_sm_slices.)"""
    monkeypatch.setattr(mma_gemv, "busiest_sm_slices", lambda N, kw, most, regs, spec: most)
    rng = np.random.default_rng(5)
    K, N = 2048, 4 * mma_gemv.STRIP
    for k, M, cta_warps, aim in ((2, 12, None, 8), (2, 8, None, 16), (4, 12, None, 16), (2, 16, 16, 16)):
        kc = pair_gemv.to_codes(ref.quantize(random_weight(rng, N, K), k=k))
        A = rng.standard_normal((M, K)).astype(np.float16)
        block = mma_gemv.plan(A, kc, cta_warps=cta_warps).steps[0].block
        assert block == mma_gemv.plan(A, kc, cta_warps=aim).steps[0].block, (k, M, cta_warps)
        if SIM:
            assert block == aim * 32, (k, M, cta_warps)


def test_busiest_sm_items_counts_the_grid_stride_loop(monkeypatch):
    """core.busiest_sm_items against a direct count (group g on CTA g % ctas, CTA c on SM c % SMs), and the cases
    the plan's rule decides between on an H100's 132 SMs."""
    monkeypatch.setattr(core, "sm_count", lambda: 132)
    rng = np.random.default_rng(8)
    for _ in range(200):
        groups, ctas, items = int(rng.integers(1, 2000)), int(rng.integers(1, 600)), int(rng.integers(1, 5))
        per_sm = np.zeros(132, np.int64)
        np.add.at(per_sm, (np.arange(groups) % ctas) % 132, items)
        assert core.busiest_sm_items(groups, items, ctas) == per_sm.max(), (groups, ctas, items)
    assert core.busiest_sm_items(160, 2, 132) == 4 and core.busiest_sm_items(320, 1, 264) == 3   # 2048x5120
    assert core.busiest_sm_items(128, 2, 128) == 2 == core.busiest_sm_items(256, 1, 256)         # 2048x4096


def test_busiest_sm_slices(monkeypatch):
    """A plan of one weight without an asked cta_warps takes the slices (up to the aim) whose launch puts the fewest
    strips on the busiest SM, of equals the most. On a 4-SM GPU that holds a 512-thread CTA or two of 256 an SM (an
    H100's 132 scaled down, so the weights stay small): one slice at 10 strips (5 groups of two on 4 CTAs: 4 strips
    on SM 0; 10 strips on 8 CTAs: 3), two at 8 (2 either way), one at 2 (2 against 1). An asked cta_warps and a
    split-K launch keep the aim."""
    monkeypatch.setattr(core, "sm_count", lambda: 4)
    monkeypatch.setattr(mma_gemv, "persistent_grid",
                        lambda work, threads, regs, shared: min(work, 4 * (65536 // (threads * 128))))
    rng = np.random.default_rng(6)
    K = 2048
    for strips, warps in ((10, 8), (8, 16), (2, 8)):
        N = strips * mma_gemv.STRIP
        kc = ref.to_codes(ref.quantize(random_weight(rng, N, K), k=4))      # (NumPy: no simulated repack)
        A = rng.standard_normal((4, K)).astype(np.float16)
        assert mma_gemv.plan(A, kc).steps[0].block == 32 * warps, N
        assert mma_gemv.plan(A, kc, cta_warps=16).steps[0].block == 512, N
        assert mma_gemv.plan(A, kc, split=2).steps[0].block == 128 * min(4, strips), N   # (4 K-warps a share)


@gpu_split("k_split", CODES_K)
@settings(max_examples=gpu_examples(EXAMPLES, len(CODES_K)))
@given(seeds, variants((4, 2), (1, 9, 16), (np.float16, np.float32)), st.integers(1, MAX_N // 2), KB2_SPLIT,
       st.sampled_from([2, 3, None]))
def test_mma_gemv_split_k_silu_pairs(k_split, seed, v, half_n, kb2, split):
    """The SiLU epilogue with K split: the CTAs add plain sums into the workspace and the finishing launch writes
    silu(gate) * up into the [M, N / 2] output, zeroing both sums (as any launch, by default past K = 4096)."""
    k, M, out_dtype = v
    k = k_split or k
    rng = np.random.default_rng(seed)
    N, K = 2 * half_n, 64 * kb2
    split = None if split is None else min(split, -(-K // 256))
    splits, _ = mma_gemv.k_splits(K, split, k, M)
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    A = _activations(rng, M, K, "float16")
    ws = cuda.to_device(np.zeros(M * N, np.float32))
    p = mma_gemv.plan(A, pair_gemv.to_codes(qw), out_dtype=out_dtype, silu_pairs=True, split=split, workspace=ws)
    assert len(p.steps) == (1 if splits == 1 else 2)
    for _ in range(2):                     # the second call finds the workspace zeroed again
        out = p.launch()
        assert out.shape == (M, N // 2) and out.dtype == np.dtype(out_dtype)
        check_silu_pairs(out.copy_to_host(), A, qw, out_dtype)
        assert not ws.copy_to_host().any()


@pytest.mark.parametrize("k, layout, long_batches, batches", [
    (4, "fragments", (), (3, 3)), (2, "codes", (), (3, 3)), (4, "codes", None, (1, 1)),
    (4, "codes", (4,), (4, 3)), (2, "fragments", mma_gemv.LONG_BATCHES, (8, 3))])
def test_mma_gemv_batches_of_strips(monkeypatch, k, layout, long_batches, batches):
    """A CTA sums its partial tiles once per batch of strips (``MmaGemvSpec.batch``): three, 1 where they do not fit
    in shared memory, or, with one token tile, a longer batch (:func:`mma_gemv.long_batch`) where it means fewer
    barriers for the CTA that walks the most strips (its strips then counted at run time). Seven strips of one warp a
    CTA (with codes the last one partial: N = 100): one CTA walks them (M = 4) in batches of 3, 3, 1, of 4 and 3 (the
    count starts again), or in one of 8; two CTAs walk 4 and 3 (M = 12, two token tiles: always 3) in 3 + 1 and 3.
    batch = 1 is forced by a shared-memory limit of 0 (``long_batches`` None), batch = 3 by no longer batches (())."""
    if long_batches is None:
        monkeypatch.setattr(mma_gemv, "SHARED_PER_CTA", 0)
    else:
        monkeypatch.setattr(mma_gemv, "LONG_BATCHES", long_batches)
    rng = np.random.default_rng(20 + k)
    N, K = (100, 256) if layout == "codes" else (112, 256)
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    w = pair_gemv.to_codes(qw)
    w = mma_gemv.to_fragments(w) if layout == "fragments" else w
    for (ctas, M), batch in zip(((1, 4), (2, 12)), batches):
        monkeypatch.setattr(mma_gemv, "persistent_grid", lambda work, *args, ctas=ctas: min(work, ctas))
        A = _activations(rng, M, K, "float16")
        p = mma_gemv.plan(A, w, out_dtype=np.float32, cta_warps=1)      # one warp a CTA: a group a strip
        step = p.steps[0]
        assert step.grid == ctas and step.block == 32 and step.kernel is mma_gemv.make_mma_gemv_kernel(
            mma_gemv.MmaGemvSpec(k, a_type="float16", out_dtype="float32", tiles=mma_gemv.tiles_for(M),
                                 fragments=layout == "fragments", batch=batch)), (ctas, M, batch)
        assert step.shared == mma_gemv.TABLE_BYTES + mma_gemv.part_bytes(1, 1, mma_gemv.tiles_for(M), batch)
        check_gemm(p.launch().copy_to_host(), A, qw)


@pytest.mark.parametrize("k, layout, long_batches, batch", [(4, "codes", (4,), 4), (2, "fragments", None, 8)])
def test_split_k_long_batches(monkeypatch, k, layout, long_batches, batch):
    """A launch split in K counts its strips in a long batch too: 7 strips of one K-warp a share (K = 512 in two
    shares), one CTA a share (two resident), so each CTA walks all 7: batches of 4 + 3, or one of 8. The shares' sums
    meet in the workspace and the finishing launch writes them."""
    if long_batches is not None:
        monkeypatch.setattr(mma_gemv, "LONG_BATCHES", long_batches)
    monkeypatch.setattr(mma_gemv, "persistent_grid", lambda work, *args: min(work, 2))
    rng = np.random.default_rng(30 + k)
    N, K, M = (100, 512, 4) if layout == "codes" else (112, 512, 4)
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    w = pair_gemv.to_codes(qw)
    w = mma_gemv.to_fragments(w) if layout == "fragments" else w
    A = _activations(rng, M, K, "float16")
    p = mma_gemv.plan(A, w, out_dtype=np.float32, cta_warps=1, split=2)
    step = p.steps[0]
    assert step.grid == (1, 2) and step.kernel is mma_gemv.make_mma_gemv_kernel(mma_gemv.MmaGemvSpec(
        k, a_type="float16", out_dtype="float32", fragments=layout == "fragments", split_k=True, batch=batch))
    check_gemm(p.launch().copy_to_host(), A, qw)


def test_long_batch_rule(monkeypatch):
    """The batch for an H100's launches: 4096x14336 (7 strips on the busiest CTA of 132) takes 8 with one token tile (1
    barrier); two token tiles keep 3 (4 fits, but ran 3-6% slower: benchmarks/README.md, "Eighty-seventh session");
    2048x5120 (3 strips or fewer) keeps 3; a batch that would leave fewer CTAs an SM is not taken (K = 2048, 256
    threads: two CTAs an SM by registers, one by the shared memory of 6 strips)."""
    monkeypatch.setattr(core, "sm_count", lambda: 132)
    spec1, spec2 = mma_gemv.MmaGemvSpec(4), mma_gemv.MmaGemvSpec(4, tiles=2)
    assert mma_gemv.long_batch(896, 132, 1, 16, 128, spec1) == 8
    assert mma_gemv.long_batch(896, 132, 1, 16, 128, spec2) == 3
    assert mma_gemv.long_batch(320, 264, 1, 8, 120, spec1) == 3
    assert mma_gemv.long_batch(1200, 264, 1, 8, 120, spec1) == 3     # (5 strips: 6 would halve the CTAs an SM)
    assert mma_gemv.long_batch(896, 132, 1, 16, 128, mma_gemv.MmaGemvSpec(4, batch=1)) == 1
    assert mma_gemv.long_batch(256, 33, 1, 14, 128, spec1, rows=4) == 8     # 14336x4096 in 4 shares: 8 strips a CTA


def test_split_and_grouped_grids_fit_the_resident_ctas(monkeypatch):
    """A grid of rows (K's shares, a grouped launch's slots) shares the resident CTAs rounded down, never more: with 5
    resident, 2 shares of 4 column groups take 2 x 2 CTAs and 3 slots 1 x 3 (rounding up, 3 x 2 and 2 x 3, put a CTA in
    a second wave: 14336x4096 at M = 24 took 1.5x the time). The sums stay right."""
    monkeypatch.setattr(mma_gemv, "persistent_grid", lambda work, *args: min(work, 5))
    rng = np.random.default_rng(50)
    N, K = 64, 512
    flats = [ref.quantize(random_weight(rng, N, K), k=4) for _ in range(4)]
    A = _activations(rng, 3, K, "float16")
    p = mma_gemv.plan(A, ref.to_codes(flats[0]), out_dtype=np.float32, cta_warps=1, split=2)
    assert p.steps[0].grid == (2, 2)
    check_gemm(p.launch().copy_to_host(), A, flats[0])
    offsets = np.array([0, 1, 2, 3, 3], np.int32)                 # T = 3 rows of 3 experts: a slot a row
    p = mma_gemv.plan_grouped(A, kb.stack_experts([ref.to_codes(w) for w in flats]), offsets, out_dtype=np.float32,
                              cta_warps=1)
    assert p.steps[0].grid == (1, 3)
    got = p.launch().copy_to_host()
    for e in range(3):
        check_gemm(got[e:e + 1], A[e:e + 1], flats[e])


def test_grouped_grid_takes_more_ctas_where_slots_are_empty(monkeypatch):
    """Where most of a grouped launch's slots have no rows, their CTAs return at once and the active experts take more
    CTAs each (``core.slot_share``): with 5 resident, 8 slots of which 2 have rows (4 each, the offsets on the host)
    and 4 column groups, 2 CTAs a slot (one round of halves) instead of 1 (one round of wholes while 3 CTAs idle).
    The sums stay right."""
    monkeypatch.setattr(mma_gemv, "persistent_grid", lambda work, *args: min(work, 5))
    rng = np.random.default_rng(51)
    N, K = 64, 512
    flats = [ref.quantize(random_weight(rng, N, K), k=4) for _ in range(8)]
    A = _activations(rng, 8, K, "float16")
    offsets = np.array([0, 4, 4, 4, 4, 4, 8, 8, 8], np.int32)     # experts 0 and 5: rows 0-3 and 4-7
    p = mma_gemv.plan_grouped(A, kb.stack_experts([ref.to_codes(w) for w in flats]), offsets, out_dtype=np.float32,
                              cta_warps=1)
    assert p.steps[0].grid == (2, 8)
    got = p.launch().copy_to_host()
    check_gemm(got[:4], A[:4], flats[0])
    check_gemm(got[4:], A[4:], flats[5])


def test_slot_share_at_the_measured_points():
    """``core.slot_share`` at the qwen3-30b-a3b expert launches it was fitted to (48 column groups, 132 resident
    16-warp CTAs, E = 128, the routing's expected active experts): 3 CTAs a slot at B = 16 (measured best of 1, 2, 3,
    4, 6), row_share's 4 at B = 4 (6, 8, 12 took longer) and 16 at B = 1; never fewer than row_share's nor more than
    the column groups."""
    def x(T, n_groups=48, resident=132):
        return core.slot_share(n_groups, min(128, T), resident, core.expected_active(128, T))
    assert (x(128), x(32), x(8)) == (3, 4, 16)
    assert 80 < core.expected_active(128, 128) < 84 and 27 < core.expected_active(128, 32) < 31
    for n_groups in (1, 2, 7, 48):
        for rows in (1, 3, 8, 128, 400):
            for active in (0, 1, rows / 2, rows):
                got = core.slot_share(n_groups, rows, 132, active)
                assert core.row_share(n_groups, rows, 132) <= got <= n_groups


@pytest.mark.parametrize("k", CODES_K)
def test_fragment_layout_round_trip_and_load_order(k):
    """reference.to_fragments / from_fragments are exact inverses (and to_flat reads the result), and the layout
    is what mma_gemv's loads assume: in a tile, the 16-byte piece i of lane l = 4g + t sits at position 32i + l
    (k = 4: block t + 4(i % 2) of column 8(i // 2) + g) or 2(32i + l) (k = 2: blocks 2t, 2t + 1 of column
    8i + g), so one load instruction of a warp reads 512 contiguous bytes."""
    rng = np.random.default_rng(20 + k)
    N, K = 48, 768
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    kc = ref.to_codes(qw)
    kf = ref.to_fragments(kc)
    assert isinstance(kf, kb.KbitFragments) and kf.nbytes == kc.nbytes
    back = ref.from_fragments(kf)
    assert np.array_equal(back.packed, kc.packed) and np.array_equal(back.absmax, kc.absmax)
    assert np.array_equal(ref.to_flat(kf).packed, qw.packed)
    blocks = np.asarray(kc.packed).reshape(N, K // 32, k)
    frag = np.asarray(kf.packed).reshape(-1, k)
    n_kb = K // 32
    for strip, chunk in ((0, 0), (2, 1), (1, 2)):
        tile = (strip * (n_kb // 8) + chunk) * 128
        for i in range(4 if k == 4 else 2):
            for lane in range(32):
                g, t = divmod(lane, 4)
                if k == 4:
                    col, blks, pos = 8 * (i // 2) + g, [t + 4 * (i % 2)], [32 * i + lane]
                else:
                    col, blks, pos = 8 * i + g, [2 * t, 2 * t + 1], [2 * (32 * i + lane), 2 * (32 * i + lane) + 1]
                for b, q in zip(blks, pos):
                    assert np.array_equal(frag[tile + q], blocks[16 * strip + col, 8 * chunk + b])
    with pytest.raises(ValueError, match="N a multiple of 16 and K of 256"):
        ref.to_fragments(ref.quantize(random_weight(rng, 40, 256), k=k))
    with pytest.raises(ValueError, match="N a multiple of 16 and K of 256"):
        ref.to_fragments(ref.quantize(random_weight(rng, 16, 320), k=k))


@gpu_split("k_split", CODES_K)
@settings(max_examples=gpu_examples(EXAMPLES, len(CODES_K)))
@given(seeds, variants((4, 2), range(1, 17), ("e4m4", "fp32")), st.integers(1, 2 if SIM else 40),
       st.integers(1, 2 if SIM else 32))
def test_mma_gemv_fragments(k_split, seed, v, n16, kb8):
    """The kernel on the fragment layout (to_fragments on the device, equal to the reference's) gives exactly
    the code layout's output, which matches reference.gemm."""
    k, M, fmt = v
    k = k_split or k
    rng = np.random.default_rng(seed)
    N, K = 16 * n16, 256 * kb8
    qw = ref.quantize(random_weight(rng, N, K), k=k, absmax_format=fmt)
    kc = pair_gemv.to_codes(qw)
    kf = mma_gemv.to_fragments(kc)
    want = ref.to_fragments(qw)
    assert np.array_equal(kf.packed.copy_to_host(), want.packed)
    assert np.array_equal(kf.absmax.copy_to_host(), want.absmax)
    A = _activations(rng, M, K, "float16")
    got = mma_gemv.gemv(A, kf, out_dtype=np.float32).copy_to_host()
    assert np.array_equal(got, mma_gemv.gemv(A, kc, out_dtype=np.float32).copy_to_host())
    check_gemm(got, A, qw)


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


@gpu_split("k_split", CODES_K)
@settings(max_examples=gpu_examples(EXAMPLES if SIM else max(4, EXAMPLES // 2), len(CODES_K)))
@given(seeds, variants((4, 2), (np.float16, np.float32)), st.lists(st.integers(0, 8), min_size=1, max_size=5),
       st.integers(1, 40), st.sampled_from([1, 5]), out_modes)
def test_mma_gemv_grouped(k_split, seed, v, counts, N, kb2, out_mode):
    """MoE experts (0..8 rows each, empty experts included; T < E draws take one grid slot per row, T >= E one
    per expert) against reference.gemm per expert."""
    k, out_dtype = v
    k = k_split or k
    rng = np.random.default_rng(seed)
    K = 64 * kb2
    flats, experts, offsets, A = routed_case(rng, counts, N, K, k, ref.to_codes)
    T = int(offsets[-1])
    o = Out(out_mode, (T, N), out_dtype)
    got = mma_gemv.grouped_gemv(A, experts, cuda.to_device(offsets), out_dtype=out_dtype, max_tokens=8, **o.kwargs)
    assert got.shape == (T, N)
    got = o.host(got)
    for e, w in enumerate(flats):
        if counts[e]:
            rows = slice(offsets[e], offsets[e + 1])
            check_gemm(got[rows], A[rows], w, out_dtype=out_dtype)


@pytest.mark.parametrize("k", CODES_K)
def test_mma_gemv_grouped_fragments(k):
    """MoE experts in the fragment layout (stack_experts of to_fragments weights) give exactly the code layout's
    output: T >= E (a grid slot per expert) and T < E (a slot per row)."""
    rng = np.random.default_rng(30 + k)
    N, K = (32, 256) if SIM else (96, 1024)
    flats = [ref.quantize(random_weight(rng, N, K), k=k) for _ in range(4)]
    codes = kb.stack_experts([ref.to_codes(w) for w in flats])
    frags = kb.stack_experts([mma_gemv.to_fragments(pair_gemv.to_codes(w)) for w in flats])
    assert frags.layout == "fragments" and isinstance(frags.expert(1), kb.KbitFragments)
    for counts in ([3, 0, 8, 1], [0, 1, 0, 1]):
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        A = _activations(rng, int(offsets[-1]), K, "float16")
        got = mma_gemv.grouped_gemv(A, frags, offsets, out_dtype=np.float32).copy_to_host()
        assert np.array_equal(got, mma_gemv.grouped_gemv(A, codes, offsets, out_dtype=np.float32).copy_to_host())
        for e, w in enumerate(flats):
            rows = slice(offsets[e], offsets[e + 1])
            if counts[e]:
                check_gemm(got[rows], A[rows], w)


@pytest.mark.parametrize("k, silu", [(4, False), (2, True)])
def test_mma_gemv_grouped_split_k(k, silu):
    """MoE experts with K split (grid z: the shares; y: the slots) into a float32 workspace, then the finishing
    launch (with the SiLU epilogue): T >= E and T < E, an empty expert, a row past an expert's 8 (device offsets: NaN,
    its neighbours right), the workspace left zeroed for the next call."""
    rng = np.random.default_rng(40 + k)
    N, K = (24, 512) if SIM else (96, 5120)
    flats = [ref.quantize(random_weight(rng, N, K), k=k) for _ in range(4)]
    experts = kb.stack_experts([ref.to_codes(w) for w in flats])
    for counts in ([3, 0, 8, 1], [0, 1, 0, 1], [9, 1, 0, 0]):
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        T = int(offsets[-1])
        A = _activations(rng, T, K, "float16")
        ws = cuda.to_device(np.zeros(T * N, np.float32))
        p = mma_gemv.plan_grouped(A, experts, cuda.to_device(offsets), out_dtype=np.float32, silu_pairs=silu,
                                  split=2, workspace=ws)
        assert len(p.steps) == 2 and p.steps[0].grid[1:] == (min(4, T), 2) and p.workspace is ws
        for _ in range(2):
            got = p.launch().copy_to_host()
            assert got.shape == (T, N // 2 if silu else N) and not ws.copy_to_host().any()
            for e, w in enumerate(flats):
                rows = np.arange(offsets[e], min(offsets[e + 1], offsets[e] + 8))
                if len(rows):
                    (check_silu_pairs if silu else check_gemm)(got[rows], A[rows], w)
            if counts[0] == 9:
                assert np.all(np.isnan(got[8])) and not np.isnan(got[9]).any()


def test_mma_gemv_grouped_fewer_rows_than_experts():
    """T = 4 rows over E = 7 experts, 3 of them active (a decode step's shape): one grid slot per row."""
    rng = np.random.default_rng(8)
    flats = [ref.quantize(random_weight(rng, 24, 128), k=2) for _ in range(7)]
    experts = kb.stack_experts([ref.to_codes(w) for w in flats])
    offsets = np.array([0, 0, 2, 2, 3, 3, 4, 4], np.int32)
    A = _activations(rng, 4, 128, "float16")
    got = mma_gemv.grouped_gemv(A, experts, offsets, out_dtype=np.float32).copy_to_host()
    for e, rows in ((1, slice(0, 2)), (3, slice(2, 3)), (5, slice(3, 4))):
        check_gemm(got[rows], A[rows], flats[e])


@pytest.mark.skipif(SIM, reason="a programmatic dependent launch needs the GPU (the simulator runs launches in order)")
def test_mma_gemv_grouped_pdl_reads_routing_after_the_wait():
    """A PDL grouped launch right after a kernel that lets it start at once, then sleeps, then writes the
    routing (offsets) and the rows: the grouped kernel must see the new ones (it may fill its tables early,
    but read offsets, activations and the weights they select only after ``griddep_wait``)."""
    from kbit_numba.intrinsics import griddep_launch_dependents
    from kbit_numba.launch import PreparedLaunch

    @cuda.jit
    def late_router(offs_src, offs, a_src, a):
        griddep_launch_dependents()
        for _ in range(200):                       # ~200 us: the dependent kernel is surely running by now
            cuda.nanosleep(1000)
        i = cuda.grid(1)
        if i < offs.shape[0]:
            offs[i] = offs_src[i]
        if i < a.shape[0]:
            a[i] = a_src[i]

    rng = np.random.default_rng(9)
    flats = [ref.quantize(random_weight(rng, 40, 128), k=4) for _ in range(4)]
    experts = kb.stack_experts([ref.to_codes(w) for w in flats])
    routed = np.array([0, 2, 2, 5, 5], np.int32)               # experts 0 and 2
    A_new = _activations(rng, 5, 128, "float16")
    stale = np.array([0, 0, 0, 0, 5], np.int32)                # every row to expert 3, and zero rows
    offs, A = cuda.to_device(stale), cuda.to_device(np.zeros_like(A_new))
    step = mma_gemv.plan_grouped(A, experts, offs, out_dtype=np.float32, max_tokens=8, pdl=True).prepare()
    words = [cuda.to_device(x) for x in (routed, A_new.reshape(-1).view(np.uint32))]
    a_words = A.reshape(-1).view(np.uint32)
    stream = cuda.stream()
    router = PreparedLaunch(late_router, 1, 512, (words[0], offs, words[1], a_words), stream)
    for _ in range(2):
        offs.copy_to_device(stale, stream=stream)
        A.copy_to_device(np.zeros_like(A_new), stream=stream)
        router()
        got = step.run(stream).copy_to_host(stream=stream)
        stream.synchronize()
        check_gemm(got[0:2], A_new[0:2], flats[0])
        check_gemm(got[2:5], A_new[2:5], flats[2])


def test_mma_gemv_grouped_refuses_and_marks_extra_rows():
    rng = np.random.default_rng(7)
    flats = [ref.quantize(random_weight(rng, 20, 64), k=4) for _ in range(2)]
    experts = kb.stack_experts([ref.to_codes(w) for w in flats])
    A = _activations(rng, 10, 64, "float16")
    offsets = np.array([0, 9, 10], np.int32)
    with pytest.raises(ValueError, match="up to 8 tokens per expert"):       # host offsets: seen and refused
        mma_gemv.grouped_gemv(A, experts, offsets)
    got = mma_gemv.grouped_gemv(A, experts, cuda.to_device(offsets), out_dtype=np.float32).copy_to_host()
    assert np.all(np.isnan(got[8]))                   # device offsets: the expert's 9th row (8) comes out NaN
    check_gemm(got[:8], A[:8], flats[0])
    check_gemm(got[9:], A[9:], flats[1])
    got = mma_gemv.plan_grouped(A, experts, cuda.to_device(offsets), out_dtype=np.float32,    # (the same in the
                                silu_pairs=True).launch().copy_to_host()                     # epilogue's output)
    assert got.shape == (10, 10) and np.all(np.isnan(got[8])) and not np.isnan(got[[7, 9]]).any()
    with pytest.raises(ValueError, match="code-layout experts"):
        mma_gemv.grouped_gemv(A, kb.stack_experts(flats), offsets)
    with pytest.raises(ValueError, match="code-layout experts: mma_gemv.grouped_gemv"):
        kb.grouped_gemv(A, experts, offsets)


@pytest.mark.parametrize("k, M, K", [(4, 25, 2304)] if SIM else
                         [(k, M, K) for k in CODES_K for M, K in ((17, 2048), (24, 4096), (32, 2304), (32, 14336))])
def test_mma_gemv_wide_tiles_split_k(k, M, K):
    """Three and four token tiles (M = 17..32) hold at most ``WIDE_KW`` K-warps a CTA: past them K splits (2304: 9
    K-warps, two splits of 5; 4096: two of 8; 14336: seven of 8), the sums by atomics into the workspace, which the
    finishing launch leaves zeroed."""
    rng = np.random.default_rng(70 + M + k)
    flat = ref.quantize(random_weight(rng, 24, K), k=k)
    A = _activations(rng, M, K, "float16")
    kw = -(-K // 256)
    splits, per = mma_gemv.k_splits(K, None, k, M)
    assert per <= mma_gemv.WIDE_KW and splits == -(-kw // mma_gemv.WIDE_KW)
    p = mma_gemv.plan(A, pair_gemv.to_codes(flat), out_dtype=np.float32)
    assert len(p.steps) == (2 if splits > 1 else 1)
    check_gemm(p.launch().copy_to_host(), A, flat, out_dtype=np.float32)
    if splits > 1:
        assert not p.workspace.copy_to_host().any()


def test_mma_gemv_refuses():
    rng = np.random.default_rng(6)
    kc = ref.to_codes(ref.quantize(random_weight(rng, 4, 64), k=4))
    with pytest.raises(ValueError, match="M = 1..32"):
        mma_gemv.gemv(np.zeros((33, 64), np.float16), kc)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        mma_gemv.gemv(np.zeros((1, 64), np.float32), kc)
    with pytest.raises(ValueError, match="multiple of 64"):
        mma_gemv.gemv(np.zeros((1, 96), np.float16), ref.to_codes(ref.quantize(random_weight(rng, 4, 96), k=4)))
    long_k = ref.to_codes(ref.quantize(random_weight(rng, 2, 8256), k=2))       # past 8192: split-K
    with pytest.raises(ValueError, match="leaves 33 K-warps a CTA"):
        mma_gemv.plan(np.zeros((1, 8256), np.float16), long_k, split=1)
    for bad in (0, 34, 2.0, True):
        with pytest.raises(ValueError, match="split must be an integer from 1 to"):
            mma_gemv.plan(np.zeros((1, 8256), np.float16), long_k, split=bad)
    with pytest.raises(ValueError, match="workspace must hold"):
        mma_gemv.plan(np.zeros((2, 8256), np.float16), long_k, workspace=cuda.to_device(np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match="leaves 33 K-warps a CTA"):        # (the grouped launch splits as the plain)
        mma_gemv.plan_grouped(np.zeros((1, 8256), np.float16), kb.stack_experts([long_k]), np.array([0, 1], np.int32),
                              split=1)
    assert len(mma_gemv.plan_grouped(np.zeros((1, 8256), np.float16), kb.stack_experts([long_k]),
                                     np.array([0, 1], np.int32)).steps) == 2      # past 8192: split by default
    with pytest.raises(TypeError, match="code layout"):     # a KbitWeight: convert it once with to_codes
        mma_gemv.gemv(np.zeros((1, 64), np.float16), ref.quantize(random_weight(rng, 4, 64), k=4))
