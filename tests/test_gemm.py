"""Tensor-core GEMM (any M, tiled weights) against reference.gemv, on the simulator (CI) and the GPU."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda

import kbit_numba as kb
from kbit_numba import tensor_gemm as G
from kbit_numba import reference as ref
from helpers import (assert_within, EXAMPLES, gpu_examples, gpu_split, kbit_weight, Out, out_modes, pick,
                     random_weight, seeds, SIM, SIM_EXPLICIT_ONLY, sim_example, sizes, variants, weight_kinds)

# The simulator runs 128 Python threads per CTA and meets them at every ldmatrix/mma: keep it to a few
# CTAs (the split-K test covers every m-tile size there). The GPU goes past 16 and 32 rows (every m-tile
# size), several CTA rows and column tiles, and long K.
MAX_M = 24 if SIM else 200
MAX_NT = 1 if SIM else 3              # column tiles of 128
MAX_KB = 3 if SIM else 70             # K = 32 * kb (odd multiples of 32: a half-empty last K tile)
# The row tiling is a kernel choice the plan derives from M (tensor_gemm.m_tile_for): the properties draw it as a
# variant (helpers.variants) and place M inside its range, so that a GPU test compiles the tiling it drew, not
# every one its M values reach. (The simulator's MAX_M reaches two.)
ROW_TILES = tuple(mt for mt in G.M_TILES if G.MMA_M * mt // 2 < MAX_M)


def row_range(m_tile, top=MAX_M):
    """(lo, hi): the row counts M <= top with m_tile_for(M) == m_tile."""
    i = G.M_TILES.index(m_tile)
    lo = 1 if i == 0 else G.MMA_M * G.M_TILES[i - 1] + 1
    return lo, (top if i == len(G.M_TILES) - 1 else min(top, G.MMA_M * m_tile))


def rows_for(m_tile, m, top=MAX_M):
    """A row count in ``m_tile``'s range (row_range), from any drawn m >= 1."""
    lo, hi = row_range(m_tile, top)
    return lo + (m - 1) % (hi - lo + 1)


def check_close(got, A, qw_flat, bf16=False, out_dtype=np.float32, rows=None):
    """The MMA path rounds each weight to the input type (codebook value, absmax and their product:
    3 roundings of u = 2**-11 for fp16, 2**-8 for bf16; E4M4 absmax values are exact) and, for float32 A,
    A to fp16 (one more). Accumulation is float32. Tolerance: (4u + 1e-5) * sum_j |a_j w_j|, plus
    2**-24 * sum_j |a_j| for fp16 subnormal weights, plus one rounding of a float16 output."""
    want = ref.gemv(A, qw_flat, bf16=bf16)
    Af = ref.as_float32(A, bf16).reshape(want.shape[0], -1).astype(np.float64)
    u = 2.0 ** -8 if bf16 else 2.0 ** -11
    scale = np.abs(Af) @ np.abs(ref.dequantize(qw_flat).astype(np.float64)).T
    if rows is not None:                  # (qw_flat a pool: helpers.kbit_weight)
        want, scale = pick(rows, want, scale)
    tol = (4 * u + 1e-5) * scale + 2.0 ** -24 * np.abs(Af).sum(axis=1, keepdims=True) + 1e-30
    assert_within(got, want, tol, out_dtype)


def check_gemm(got, A, qw_flat, bf16=False, out_dtype=np.float32, rows=None):
    """Against ``reference.gemm``, which rounds the weights (codebook value, absmax, their product) and the
    activations as the kernel does: what is left is the kernel's float32 accumulation. Bound: each MMA
    k-step of 16 products, and each split-K partial, adds at most 4 float32 units (2**-22) of
    sum_j |a_j w_j| (tensor-core float32 sums need not round to nearest), plus one rounding of a float16
    output. (The derived 4u = 2**-9 slack of ``check_close`` is not needed: this bound is ~100x tighter.)
    A product with a float16-subnormal weight (|w| < 2**-14) is summed to 2**-34 absolute: the H100's
    tensor cores summed 32 such products (an fp32-absmax draw whose weights were all subnormal) up to 4.1e-12
    (~2**-38) away from the exact sum, ~1e-5 of it (the GPU fuzz run, 2026-11-24): 2**-34 per product keeps a
    wide margin. (E4M4 absmax never came near: its smallest absmax keeps most weights normal.)"""
    want = ref.gemm(A, qw_flat, bf16)
    Af = ref.as_float32(A, bf16).reshape(want.shape[0], -1)
    Af = (Af if bf16 else ref.mma_round(Af)).astype(np.float64)
    Wg = np.abs(ref.gemm_weights(qw_flat, bf16).astype(np.float64))
    scale = np.abs(Af) @ Wg.T
    sub = np.abs(Af) @ ((Wg > 0) & (Wg < 2.0 ** -14)).T
    if rows is not None:                  # (qw_flat a pool: helpers.kbit_weight)
        want, scale, sub = pick(rows, want, scale, sub)
    steps = -(-Af.shape[1] // 16) + 2
    assert_within(got, want, steps * 2.0 ** -22 * scale + 2.0 ** -34 * sub + 1e-30, out_dtype)


def _weights(rng, k, n_tiles, K, fmt="e4m4"):
    flat = ref.quantize(random_weight(rng, 128 * n_tiles, K), k=k, absmax_format=fmt)
    return flat, ref.repack_tiled(flat)


@gpu_split("k_split", [2, 3, 4, 5])
@settings(max_examples=EXAMPLES if SIM else gpu_examples(EXAMPLES * 2, 4))
@given(seeds, variants((4, 2, 3, 5), ("e4m4", "fp32"), (np.float16, np.float32), (None, 1, 2), ROW_TILES),
       st.integers(1, MAX_M), sizes(MAX_NT, 156), sizes(MAX_KB, 512), weight_kinds, out_modes)
def test_gemm(k_split, seed, v, M, n_tiles, kbn, kind, out_mode):
    k, fmt, out_dtype, split, m_tile = v
    k, M = k_split or k, rows_for(m_tile, M)
    rng = np.random.default_rng(seed)
    K, N = 32 * kbn, 128 * n_tiles
    flat, pool, rows = kbit_weight(rng, N, K, kind, k, fmt)
    A = rng.standard_normal((M, K)).astype(np.float16)
    o = Out(out_mode, (M, N), out_dtype)
    out = kb.gemm(A, ref.repack_tiled(flat), out_dtype=out_dtype, split=split, **o.kwargs)
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    check_gemm(o.host(out), A, pool, out_dtype=out_dtype, rows=rows)


@gpu_split("a_split", ["float32", "bfloat16"])
@settings(max_examples=EXAMPLES if SIM else gpu_examples(EXAMPLES, 2))
@given(seeds, variants((4, 2, 3, 5), ("float32", "bfloat16"), ROW_TILES), st.integers(1, MAX_M), st.integers(1, MAX_KB))
def test_gemm_other_activation_types(a_split, seed, v, M, kbn):
    """float32 A (converted to fp16 first) and bfloat16 A (bf16 MMAs)."""
    k, a_dtype, m_tile = v
    a_dtype, M = a_split or a_dtype, rows_for(m_tile, M)
    rng = np.random.default_rng(seed)
    K = 32 * kbn
    flat, tiled = _weights(rng, k, 1, K)
    A = rng.standard_normal((M, K)).astype(np.float32)
    bf16 = a_dtype == "bfloat16"
    if bf16:
        A = ref.float32_to_bf16_bits(A)
    out = kb.gemm(A, tiled, out_dtype=np.float32, bf16=bf16)
    check_gemm(out.copy_to_host(), A, flat, bf16=bf16)


@pytest.mark.parametrize("m_tile", [1, 2, 4])
def test_gemm_split_k_workspace_is_left_zeroed(m_tile):
    rng = np.random.default_rng(11)
    flat, tiled = _weights(rng, 4, 1, 128)                    # 2 K tiles, split 2 ways
    A = rng.standard_normal((20, 128)).astype(np.float16)
    ws = G.new_workspace(20, 128)
    for _ in range(2):                                         # the second call reuses the workspace
        out = kb.gemm(cuda.to_device(A), tiled, workspace=ws, split=2, m_tile=m_tile, out_dtype=np.float32)
        check_gemm(out.copy_to_host(), A, flat)
    assert not np.any(ws.copy_to_host())


def test_gemm_vector_input_and_out_buffer():
    rng = np.random.default_rng(12)
    flat, tiled = _weights(rng, 3, 1, 96)
    a = rng.standard_normal(96).astype(np.float16)
    out = cuda.device_array(128, np.float16)
    res = kb.gemm(a, tiled, out=out, stream=cuda.stream())
    assert res is out
    check_gemm(out.copy_to_host()[None], a[None], flat, out_dtype=np.float16)


def test_gemm_rejects_bad_input():
    flat = ref.quantize(np.ones((128, 128), np.float32), k=2)
    with pytest.raises(ValueError, match="repack_tiled"):
        kb.gemm(np.ones((8, 128), np.float16), flat)
    tiled = ref.repack_tiled(flat)
    with pytest.raises(ValueError, match="K=32"):
        kb.gemm(np.ones((8, 32), np.float16), tiled)
    with pytest.raises(TypeError, match="dtype"):
        kb.gemm(np.ones((8, 128), np.int8), tiled)
    with pytest.raises(ValueError, match="workspace"):
        kb.gemm(np.ones((8, 128), np.float16), tiled, split=2, workspace=cuda.device_array(10, np.float32))


def test_gemm_several_column_and_row_tiles():
    """What the simulator's small draws miss: two column tiles, two row tiles (M = 17 at m_tile 1, the
    second nearly empty) and two K tiles per CTA (the ring is refilled; K = 96: the last tile half empty)."""
    rng = np.random.default_rng(13)
    flat, tiled = _weights(rng, 4, 2, 96)
    A = rng.standard_normal((17, 96)).astype(np.float16)
    p = G.plan(A, tiled, out_dtype=np.float32, split=1, m_tile=1)
    assert p.steps[0].grid == (2, 2, 1)
    check_gemm(p.launch().copy_to_host(), A, flat)


# The code layout (KbitCodes, k = 2, 4): K a multiple of 64, any N (the last column tile partial, odd N).
MAX_N_CODES = 140 if SIM else 600


@gpu_split("k_split", [2, 4])
@settings(max_examples=EXAMPLES if SIM else gpu_examples(EXAMPLES * 2, 2))
@given(seeds, variants((4, 2), ("e4m4", "fp32"), ("float16", "float32", "bfloat16"), (np.float16, np.float32), (None, 1, 2),
                ROW_TILES), st.integers(1, MAX_M), st.integers(1, MAX_N_CODES), st.integers(1, MAX_KB // 2 + 1))
def test_gemm_code_layout(k_split, seed, v, M, N, k64):
    k, fmt, a_type, out_dtype, split, m_tile = v
    k, M = k_split or k, rows_for(m_tile, M)
    rng = np.random.default_rng(seed)
    K = 64 * k64
    flat = ref.quantize(random_weight(rng, N, K), k=k, absmax_format=fmt)
    A = rng.standard_normal((M, K)).astype(np.float32)
    bf16 = a_type == "bfloat16"
    A = ref.float32_to_bf16_bits(A) if bf16 else A.astype(a_type)
    out = kb.gemm(A, ref.to_codes(flat), out_dtype=out_dtype, split=split, bf16=bf16)
    assert out.shape == (M, N) and out.dtype == np.dtype(out_dtype)
    check_gemm(out.copy_to_host(), A, flat, bf16=bf16, out_dtype=out_dtype)


def test_gemm_code_layout_partial_column_tile_and_absmax_tail():
    """N = 131, K = 192: a second column tile of 3 columns, and 131 * 6 E4M4 bytes end inside a word (that
    word is loaded, not copied by cp.async, which would read past the array)."""
    rng = np.random.default_rng(14)
    flat = ref.quantize(random_weight(rng, 131, 192), k=4)
    A = rng.standard_normal((3, 192)).astype(np.float16)
    p = G.plan(A, ref.to_codes(flat), out_dtype=np.float32, split=1)
    assert p.steps[0].grid == (2, 1, 1)
    check_gemm(p.launch().copy_to_host(), A, flat)


def test_absmax_chunk_keeps_the_splits():
    """The code layout's absmax chunk (C K tiles, a split starting at one): the largest C that K's alignment allows
    and that keeps >= 3/4 of the splits, the split rounded to the nearest multiple of C; none for one-tile splits."""
    assert G.absmax_chunk(4096, 22, 2) == (8, 24)          # 4096x14336: 3 splits either way
    assert G.absmax_chunk(2048, 4, 2) == (4, 4)            # 8 splits; C = 8 would leave 4
    assert G.absmax_chunk(5120, 5, 2) == (4, 4)            # 16 -> 20 splits; C = 8 would leave 10
    assert G.absmax_chunk(2048, 1, 2) == (0, 1)            # 2048x512: 32 splits of one tile
    assert G.absmax_chunk(1536, 12, 2) == (8, 16)          # K % 512 == 0: 2 splits of 16 + 8
    assert G.absmax_chunk(768, 4, 2) == (4, 4)             # K % 512 != 0: no C = 8
    assert G.absmax_chunk(640, 2, 2) == (2, 2)             # K % 256 != 0: C = 2 at most
    assert G.absmax_chunk(640, 2, 4) == (0, 2)             # 4 stages: a chunk must span >= 3 tiles


@pytest.mark.parametrize("k, K, split, chunk", [(2, 1536, 2, 8), (4, 768, 3, 4), (2, 640, 5, 2)] if SIM else
                         [(4, 1536, 1, 8), (2, 1536, 2, 8), (4, 1536, 3, 8), (4, 768, 1, 4), (2, 768, 3, 4),
                          (4, 640, 5, 2), (2, 640, 1, 2)])
def test_gemm_code_layout_absmax_chunks(k, K, split, chunk):
    """E4M4: the absmax comes in chunks of C K tiles (16 bytes a column at C = 8, else C / 2 4-byte copies) through
    a ring of two. K = 1536: three chunks of 8 (the ring wraps), split 2 (16 + 8 tiles) and 3 (8 each); K = 768:
    chunks of 4 (split 3: one a split; split 1: the ring wraps); K = 640: chunks of 2."""
    rng = np.random.default_rng(15 + k + K)
    flat = ref.quantize(random_weight(rng, 72, K), k=k)
    A = rng.standard_normal((3, K)).astype(np.float16)
    p = G.plan(A, ref.to_codes(flat), out_dtype=np.float32, split=split)
    assert p.steps[0].grid[2] == split
    assert G.absmax_chunk(K, -(-K // 64 // split), 2)[0] == chunk
    assert p.steps[0].args[2].dtype == np.uint32          # the chunked path reads the absmax as words
    check_gemm(p.launch().copy_to_host(), A, flat)


def test_gemm_code_layout_refuses_k_not_a_multiple_of_64():
    codes = ref.to_codes(ref.quantize(np.ones((8, 96), np.float32), k=4))
    with pytest.raises(ValueError, match="multiple of 64"):
        kb.gemm(np.ones((8, 96), np.float16), codes)


def test_fragment_index_math_matches_the_ptx_layout():
    """The GEMM's fragment index functions (the kernel's device functions, run here in Python) against the
    m16n8k16 fragment layout the mma twin implements (intrinsics._fragment_maps, from the PTX ISA)."""
    from kbit_numba.intrinsics import _fragment_maps
    a_row, a_col, b_row, b_col, c_row, c_col = _fragment_maps()
    for lane in np.arange(32, dtype=np.int32):
        g, k0 = G.py_b_fragment(lane)
        assert list(b_col[lane]) == [g] * 4 and list(b_row[lane]) == [k0, k0 + 1, k0 + 8, k0 + 9]
        r, c = G.py_c_fragment(lane)
        assert list(c_row[lane]) == [r, r, r + 8, r + 8] and list(c_col[lane]) == [c, c + 1, c, c + 1]
    # ldmatrix.x4: matrix i's 8 row addresses come from lanes 8i .. 8i+7, and lane (g, t) receives halves
    # 2t, 2t+1 of row g of matrix i as its register i (values 2i, 2i+1 of the A fragment).
    for mt in G.M_TILES:
        for blk in range(2):
            for s in range(2):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for i in range(4):
                        w = int(G.py_a_fragment_word(np.int32(8 * i + g), mt - 1, blk, s))
                        row, col = w // G.ROW_WORDS, 2 * (w % G.ROW_WORDS) + 2 * t
                        for h in range(2):
                            assert row == 16 * (mt - 1) + a_row[lane, 2 * i + h]
                            assert col + h == 32 * blk + 16 * s + a_col[lane, 2 * i + h]


# ---- grouped expert GEMM (MoE, any number of tokens per expert) ---------------------------------------
def _tiled_experts(rng, E, K, k, N=128):
    """E tiled experts [N, K] on the device and each one's (pool, rows) for its reference (helpers.kbit_weight)."""
    drawn = [kbit_weight(rng, N, K, "normal", k) for _ in range(E)]
    return kb.stack_experts([ref.repack_tiled(qw) for qw, _, _ in drawn]), [(p, r) for _, p, r in drawn]


def test_rows_for_lands_in_the_drawn_row_tiling():
    """The properties' row counts (rows_for) are ones for which the plan picks the drawn tiling."""
    for top in (MAX_M, 24, 70, 200):
        for mt in (mt for mt in G.M_TILES if row_range(mt, top)[0] <= top):
            got = {rows_for(mt, m, top) for m in range(1, 300)}
            assert {G.m_tile_for(M) for M in got} == {mt} and max(got) <= top
            assert got == set(range(row_range(mt, top)[0], row_range(mt, top)[1] + 1))


GROUPED_MAX_TOKENS = 70


@gpu_split("k_split", [2, 3, 4, 5])
@settings(max_examples=gpu_examples(EXAMPLES if SIM else max(4, EXAMPLES // 2), 4), **SIM_EXPLICIT_ONLY)
@given(seeds, variants((4, 2, 3, 5), (None, 1, 2), (np.float16, np.float32), G.M_TILES),
       st.lists(st.integers(0, GROUPED_MAX_TOKENS), min_size=1, max_size=8), st.integers(1, MAX_NT),
       st.integers(1, 4 if SIM else MAX_KB), st.booleans(), out_modes)
@sim_example(seed=0, v=(4, 1, np.float32, 2), counts=[5, 0, 18], n_tiles=1, kbn=4, on_device=False,  # v: k, split,
             out_mode="new")                                                                        # out, m_tile
@sim_example(seed=1, v=(3, 2, np.float16, 1), counts=[0, 3, 1, 0], n_tiles=1, kbn=3, on_device=True,
             out_mode="view_stream")
def test_grouped_gemm(k_split, seed, v, counts, n_tiles, kbn, on_device, out_mode):
    """Experts with 0..70 tokens (several row tiles for some, empty experts) in one launch; the offsets on the
    host or the device; split-K or not; a fresh output or a view, another stream. (The simulator runs the
    two examples: 128 simulated threads a CTA.) The largest expert's count, from which the plan picks the row
    tiling, is placed in the drawn tiling's range (row_range)."""
    k, split, out_dtype, m_tile = v
    k = k_split or k
    if max(counts) > 0:
        top, (lo, hi) = counts.index(max(counts)), row_range(m_tile, GROUPED_MAX_TOKENS)
        counts = [lo + c % (hi - lo + 1) if i == top else min(c, hi) for i, c in enumerate(counts)]
    rng = np.random.default_rng(seed)
    K, N = 32 * kbn, 128 * n_tiles
    experts, refs = _tiled_experts(rng, len(counts), K, k, N)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    A = rng.standard_normal((offsets[-1], K)).astype(np.float16)
    o = Out(out_mode, (int(offsets[-1]), N), out_dtype)
    got = o.host(kb.grouped_gemm(A, experts, cuda.to_device(offsets) if on_device else offsets, split=split,
                                 out_dtype=out_dtype, **o.kwargs))
    for e in range(len(counts)):
        t0, t1 = offsets[e], offsets[e + 1]
        if t1 > t0:
            check_gemm(got[t0:t1], A[t0:t1], refs[e][0], out_dtype=out_dtype, rows=refs[e][1])


def test_grouped_gemm_rejects_flat_experts():
    experts = kb.stack_experts([ref.quantize(np.ones((128, 64), np.float32), k=2)] * 2)
    with pytest.raises(ValueError, match="tiled"):
        kb.grouped_gemm(np.ones((3, 64), np.float16), experts, np.array([0, 1, 3], np.int32))
