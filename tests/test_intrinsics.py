"""PTX intrinsics against their Python twins, and the simulator's warp primitives against PTX semantics."""
import numpy as np
import pytest
from numba import cuda

from kbit_numba import intrinsics as I
from helpers import PTX_ONLY, SIM

FULL = 0xFFFFFFFF


# ---- the twins themselves, on known values -------------------------------------------------------
def test_twins_known_values():
    assert I.py_dp4a(0x01020304, 0x01010101, 10) == 20
    assert I.py_dp4a(0xFF00FF00, 0x02020202, 0) == -4            # bytes are signed
    assert I.py_lop3(0b1100, 0b1010, 0b0110, 0xEA) == (0b1100 & 0b1010) | 0b0110
    assert I.py_lop3(0b1100, 0b1010, 0b0110, 0x96) == 0b1100 ^ 0b1010 ^ 0b0110
    assert I.py_prmt(0x33221100, 0x77665544, 0x0000_7531) == 0x77553311
    assert I.py_prmt(0x00000080, 0, 0x0008) & 0xFF == 0xFF           # sign replicate
    assert I.py_rotr(0x12345678, 8) == 0x78123456
    assert I.py_rotr(0x80000001, 33) == 0xC0000000                  # the count is taken mod 32
    assert I.py_u32_as_f32(0x3F800000) == 1.0 and I.py_f32_as_u32(np.float32(-2.0)) == 0xC0000000
    assert I.py_f16x2_as_u32(1.0, -2.0) == 0xC0003C00
    assert I.py_hmul2(I.py_f16x2_as_u32(1.5, -2.0), I.py_f16x2_as_u32(2.0, 0.5)) == I.py_f16x2_as_u32(3.0, -1.0)
    assert I.py_bmul2(0x40003FC0, 0x3F004000) == 0x3F804040     # bf16 pairs (1.5, 2) * (2, 0.5) = (3, 1)
    # shared lookups read bits (ld.shared.u32 / .f32), whatever the array's 4-byte type
    base = I.SIM_SHARED_BASE                       # the twins' shared window starts there
    assert I.py_lds_u32(np.array([0.0, 1.0], np.float32), base + 4) == 0x3F800000
    assert I.py_lds_f32(np.array([0, 0x3F800000], np.uint32), base + 4) == 1.0
    staged = np.zeros(8, np.float32)                # cp.async copies bits into any 4-byte shared array
    I.py_cp_async16(staged, base + 16, np.array([9, 0x3F800000, 7, 5, 3], np.uint32), 1, 16)
    assert staged.view(np.uint32)[4:8].tolist() == [0x3F800000, 7, 5, 3] and staged[4] == 1.0
    with pytest.raises(IndexError, match="without its base"):       # an offset with no shared_addr added
        I.py_lds_u32(np.array([0.0, 1.0], np.float32), 4)
    assert I.py_hfma2(I.py_f16x2_as_u32(1.5, -2.0), I.py_f16x2_as_u32(2.0, 0.5),
                      I.py_f16x2_as_u32(0.25, 4.0)) == I.py_f16x2_as_u32(3.25, 3.0)
    # one rounding: 1 + 2**-11 (a tie, a product exact in float64) rounds to even, 1.0
    assert I.py_hfma2(I.py_f16x2_as_u32(2.0 ** -6, 0), I.py_f16x2_as_u32(2.0 ** -5, 0),
                      I.py_f16x2_as_u32(1.0, 0)) == I.py_f16x2_as_u32(1.0, 0)


def test_half_pair_twins_round_as_numpy():
    """The float16 pair twins (``struct``-based, for the simulator's speed) round as NumPy's float16 does, on random
    words and on large ones that overflow to inf (subnormals, infinities, signed zeros included; NaN payloads aside)."""
    rng = np.random.default_rng(3)
    w = rng.integers(0, 1 << 32, size=(3, 3000), dtype=np.uint64).astype(np.uint32)
    w[:, 2000:] = (w[:, 2000:] & 0x83FF83FF) | 0x70007000         # |x| in [2**13, 2**14): products overflow
    h = w.view(np.float16).astype(np.float64).reshape(3, -1, 2)
    with np.errstate(all="ignore"):
        third = h[0] / 3
        want = {"fma": (h[0] * h[1] + h[2]).astype(np.float16), "mul": (h[0] * h[1]).astype(np.float16),
                "pack": third.astype(np.float16)}
    for i in range(w.shape[1]):
        got = {"fma": I.py_hfma2(w[0, i], w[1, i], w[2, i]), "mul": I.py_hmul2(w[0, i], w[1, i]),
               "pack": I.py_f16x2_as_u32(third[i, 0], third[i, 1])}
        for op, value in got.items():
            expect = want[op][i]
            live = ~np.isnan(expect)
            assert np.array_equal(np.array([value], np.uint32).view(np.float16)[live], expect[live]), (op, i)


# ---- PTX versions against the twins on random inputs (GPU) ---------------------------------------
@cuda.jit
def _alu_kernel(a, b, c, out):
    i = cuda.grid(1)
    if i < a.size:
        out[i, 0] = I.dp4a(a[i], b[i], c[i])
        out[i, 1] = I.lop3(a[i], b[i], c[i], 0xEA)
        out[i, 2] = I.lop3(a[i], b[i], c[i], 0x96)
        out[i, 3] = I.lop3(a[i], b[i], c[i], 0x1B)
        out[i, 4] = I.prmt(a[i], b[i], c[i])
        out[i, 5] = I.f32_as_u32(I.u32_as_f32(a[i]))
        out[i, 6] = I.f16x2_as_u32(np.float16(I.u32_as_f32(b[i] & np.uint32(0x3FFFFFFF))), np.float16(-1.5))
        out[i, 7] = I.rotr(b[i], c[i])


@cuda.jit
def _mem_kernel(src, dst, dst_stream):
    """The plain loads into dst, the streaming ones (cache qualifiers: the same values) and the coherent ld128 into
    dst_stream; an L2 prefetch of the line first (a hint: it changes nothing)."""
    i = cuda.grid(1) * 4
    if i < src.size:
        I.prefetch_l2(src, i)
        w0, w1, w2, w3 = I.ldg128(src, i)
        v0, v1 = I.ldg64(src, i + 2)
        I.stg128(dst, i, w3 ^ v1, w2 ^ v0, w1, w0)
        w0, w1, w2, w3 = I.ldg128_stream(src, i)
        v0, v1 = I.ldg64_stream(src, i + 2)
        x0, x1, x2, x3 = I.ld128(src, i)                # the coherent load (word 1 of it)
        I.stg128(dst_stream, i, w3 ^ v1, w2 ^ v0, x1, w0)


@pytest.mark.skipif(SIM or PTX_ONLY, reason="the PTX versions run on a GPU only (the simulator runs the twins)")
def test_ptx_matches_twins():
    rng = np.random.default_rng(0)
    n = 4096
    a, b = (rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    c = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    out = cuda.device_array((n, 8), np.uint32)
    _alu_kernel[n // 128, 128](a.view(np.int32), b, c, out)
    got = out.copy_to_host()
    for i in range(0, n, 7):   # the twins are slow Python: check a spread of rows
        assert got[i, 0] == np.uint32(np.int64(I.py_dp4a(a[i], b[i], c[i])) & 0xFFFFFFFF)
        assert got[i, 1] == I.py_lop3(a[i], b[i], c[i], 0xEA)
        assert got[i, 2] == I.py_lop3(a[i], b[i], c[i], 0x96)
        assert got[i, 3] == I.py_lop3(a[i], b[i], c[i], 0x1B)
        assert got[i, 4] == I.py_prmt(a[i], b[i], c[i])
        assert got[i, 5] == a[i]
        want = I.py_f16x2_as_u32(np.float16(I.py_u32_as_f32(b[i] & 0x3FFFFFFF)), np.float16(-1.5))
        assert got[i, 6] == want
        assert got[i, 7] == I.py_rotr(b[i], c[i])


@cuda.jit
def _float_shared_kernel(h, bf, addr, table, out):
    """The float and shared-lookup intrinsics the ALU kernel does not cover, one row per thread."""
    sh = cuda.shared.array(64, np.uint32)
    t = cuda.threadIdx.x
    if t < 64:
        sh[t] = table[t]
    cuda.syncthreads()
    i = cuda.grid(1)
    if i < h.size - 1:
        out[i, 0] = I.hmul2(h[i], h[i + 1])
        out[i, 1] = I.bmul2(bf[i], bf[i + 1])
        out[i, 2] = I.f32_as_u32(I.f16_bits_to_f32(h[i]))
        base = I.shared_addr(sh)
        out[i, 3] = I.f32_as_u32(I.lds_f32(sh, base + addr[i]))
        out[i, 4] = I.lds_u32(sh, base + addr[i])
        out[i, 5] = I.hfma2(h[i], h[i + 1], h[(i + 2) % h.size])


@pytest.mark.skipif(SIM or PTX_ONLY, reason="the PTX versions run on a GPU only (the simulator runs the twins)")
def test_ptx_matches_twins_float_and_shared():
    """hmul2 / hfma2 / bmul2 / f16_bits_to_f32 / lds_f32 / lds_u32 against their twins, on finite random pairs."""
    from kbit_numba.reference import float32_to_bf16_bits
    rng = np.random.default_rng(2)
    n = 1024
    halves = rng.standard_normal((n, 2)).astype(np.float16)
    h = halves.view(np.uint32).reshape(-1)
    bf = float32_to_bf16_bits(rng.standard_normal((n, 2)).astype(np.float32)).view(np.uint16)
    bf = bf.astype(np.uint32)[:, 0] | (bf.astype(np.uint32)[:, 1] << np.uint32(16))
    addr = (rng.integers(0, 64, n) * 4).astype(np.uint32)
    table = rng.standard_normal(64).astype(np.float32).view(np.uint32)
    out = cuda.device_array((n, 6), np.uint32)
    _float_shared_kernel[n // 64, 64](h, bf, addr, table, out)
    got = out.copy_to_host()
    for i in range(0, n - 1, 5):
        assert got[i, 0] == I.py_hmul2(h[i], h[i + 1]), i
        assert got[i, 1] == I.py_bmul2(bf[i], bf[i + 1]), i
        assert got[i, 2] == I.py_f32_as_u32(I.py_f16_bits_to_f32(h[i])), i
        at = I.SIM_SHARED_BASE + addr[i]
        assert got[i, 3] == I.py_f32_as_u32(I.py_lds_f32(table.view(np.float32), at)), i
        assert got[i, 4] == I.py_lds_u32(table, at), i
        assert got[i, 5] == I.py_hfma2(h[i], h[i + 1], h[(i + 2) % n]), i


def test_vector_loads_and_stores():
    """Runs the active versions: PTX on the GPU, twins on the simulator."""
    src = np.arange(64, dtype=np.uint32) * np.uint32(2654435761)
    dst, dst_stream = cuda.device_array(64, np.uint32), cuda.device_array(64, np.uint32)
    _mem_kernel[1, 16](cuda.to_device(src), dst, dst_stream)
    s = src.reshape(-1, 4)
    want = np.stack([s[:, 3] ^ s[:, 3], s[:, 2] ^ s[:, 2], s[:, 1], s[:, 0]], axis=1).reshape(-1)
    np.testing.assert_array_equal(dst.copy_to_host(), want)
    np.testing.assert_array_equal(dst_stream.copy_to_host(), want)


@cuda.jit
def _shared_vector_kernel(src, src_bytes, dst):
    """src (16 words) -> shared by cp.async -> lds128 / lds64 -> dst; then sts128 over the last 4 words
    and lds128 back; then three cp_async4 copies of src_bytes (4, 3 and 0 bytes read) into words 0..2,
    read back into dst[10..12]; one thread."""
    sh = cuda.shared.array(16, np.uint32, alignment=16)
    base = I.shared_addr(sh)
    for c in range(4):
        I.cp_async16(sh, base + np.uint32(16 * c), src, 4 * c, np.uint32(16))
    I.cp_async_commit()
    I.cp_async_wait(0)
    dst[0], dst[1], dst[2], dst[3] = I.lds128(sh, base + np.uint32(32))
    dst[4], dst[5] = I.lds64(sh, base + np.uint32(8))
    I.sts128(sh, base + np.uint32(48), dst[0] + np.uint32(1), dst[1], dst[4], np.uint32(7))
    dst[6], dst[7], dst[8], dst[9] = I.lds128(sh, base + np.uint32(48))
    cuda.syncthreads()
    I.cp_async4(sh, base, src_bytes, 4, np.uint32(4))
    I.cp_async4(sh, base + np.uint32(4), src_bytes, 8, np.uint32(3))
    I.cp_async4(sh, base + np.uint32(8), src_bytes, 12, np.uint32(0))
    I.cp_async_commit()
    I.cp_async_wait(0)
    dst[10], dst[11] = I.lds64(sh, base)
    dst[12] = I.lds_u32(sh, base + np.uint32(8))


@pytest.mark.skipif(PTX_ONLY, reason="runs a kernel")
def test_shared_vector_loads():
    src = np.arange(16, dtype=np.uint32) * np.uint32(2654435761)
    src_bytes = np.arange(1, 17, dtype=np.uint8) * np.uint8(17)
    dst = cuda.to_device(np.zeros(13, np.uint32))
    _shared_vector_kernel[1, 1](cuda.to_device(src), cuda.to_device(src_bytes), dst)
    stored = [src[8] + np.uint32(1), src[9], src[2], 7]
    partial = np.zeros(4, np.uint8)
    partial[:3] = src_bytes[8:11]
    copied4 = [src_bytes[4:8].view(np.uint32)[0], partial.view(np.uint32)[0], 0]
    np.testing.assert_array_equal(dst.copy_to_host(),
                                  np.concatenate([src[8:12], src[2:4], stored, copied4]).astype(np.uint32))


# ---- named barriers: two groups of warps, each on its own barrier ----------------------------------
GROUP_WARPS = 2
ROUNDS = 3


@cuda.jit
def _named_barrier_kernel(out, zero):
    """Four warps in two groups of GROUP_WARPS; in each round the group's first warp stalls (a long
    dependent chain, kept by ``zero[0]``, 0 at run time, which the compiler cannot fold), then writes; the other
    warp reads what it wrote only after the group's barrier."""
    sh = cuda.shared.array(128, np.uint32)
    t = cuda.threadIdx.x
    warp, lane = t // 32, t % 32
    group = warp // GROUP_WARPS
    total = np.uint32(0)
    for r in range(ROUNDS):
        if warp % GROUP_WARPS == 0:                 # the writer: slow on purpose
            x = np.uint32(t + r)
            for _ in range(2000):
                x = (x * np.uint32(5) + np.uint32(1)) & np.uint32(0xFFFF)
            sh[t] = np.uint32((group + 1) * 1000 + r * 100 + lane) + (x & zero[0])
        I.bar_sync(np.uint32(group), np.uint32(GROUP_WARPS * 32))
        if warp % GROUP_WARPS == 1:
            total += sh[(t - 32) % 128]             # the writer's slot of the same lane
        I.bar_sync(np.uint32(group), np.uint32(GROUP_WARPS * 32))   # (before the next round's write)
    out[t] = total


@pytest.mark.skipif(PTX_ONLY, reason="runs a kernel")
def test_named_barriers():
    """bar_sync(id, n): a group's readers see its writer's stores (PTX on the GPU, the twin here)."""
    out = cuda.device_array(128, np.uint32)
    _named_barrier_kernel[1, 128](out, cuda.to_device(np.zeros(1, np.uint32)))
    got = out.copy_to_host()
    t = np.arange(128)
    group, lane = t // 64, t % 32
    want = np.where(t // 32 % 2 == 1, sum((group + 1) * 1000 + r * 100 + lane for r in range(ROUNDS)), 0)
    np.testing.assert_array_equal(got, want.astype(np.uint32))


# ---- tensor-core path: cp.async -> ldmatrix -> mma, against NumPy (PTX on the GPU, twins here) -------
ROW = 12        # staged row of 16 halves padded to 24 (48 bytes: 16-byte aligned ldmatrix rows)
SH_WORDS = 16 * ROW     # (a shared array shape must be a constant name, not an expression)


@cuda.jit
def _mma_kernel(a, w, c, d, use_bf16):
    """D (16 x 8) = A (16 x 16, row-major halves as words) @ W^T (W: 8 x 16) + C, one warp."""
    sh = cuda.shared.array(SH_WORDS, np.uint32, alignment=16)
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    base = I.shared_addr(sh)
    row, chunk = lane // 2, lane % 2                    # 32 copies of 16 bytes = the whole of A
    I.cp_async16(sh, base + np.uint32(4 * (row * ROW + 4 * chunk)), a, row * 8 + 4 * chunk, np.uint32(16))
    I.cp_async_commit()
    I.cp_async_wait(0)
    cuda.syncwarp()
    a0, a1, a2, a3 = I.ldmatrix_x4(sh, base + np.uint32(4 * ((lane % 16) * ROW + (lane // 16) * 4)))
    b0, b1 = w[g * 8 + t], w[g * 8 + 4 + t]             # B = W^T: column g = row g of W
    if use_bf16:
        r = I.mma_bf16(a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    else:
        r = I.mma_f16(a0, a1, a2, a3, b0, b1, c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])
    d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = r


@pytest.mark.skipif(PTX_ONLY, reason="runs a kernel")
@pytest.mark.parametrize("use_bf16", [False, True])
def test_cp_async_ldmatrix_mma(use_bf16):
    rng = np.random.default_rng(1)
    A = rng.standard_normal((16, 16)).astype(np.float32)
    W = rng.standard_normal((8, 16)).astype(np.float32)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    if use_bf16:
        from kbit_numba.reference import bf16_bits_to_float32, float32_to_bf16_bits
        Ab, Wb = float32_to_bf16_bits(A), float32_to_bf16_bits(W)
        A, W = bf16_bits_to_float32(Ab), bf16_bits_to_float32(Wb)
        a_words, w_words = Ab.view(np.uint32).reshape(-1), Wb.view(np.uint32).reshape(-1)
    else:
        A, W = A.astype(np.float16), W.astype(np.float16)
        a_words, w_words = A.view(np.uint32).reshape(-1), W.view(np.uint32).reshape(-1)
    d = cuda.device_array((16, 8), np.float32)
    _mma_kernel[1, 32](cuda.to_device(a_words), cuda.to_device(w_words), cuda.to_device(C), d, use_bf16)
    want = A.astype(np.float64) @ W.astype(np.float64).T + C
    np.testing.assert_allclose(d.copy_to_host(), want, rtol=1e-5, atol=1e-5)


# ---- warp primitives: the same expectations on the GPU and on the simulator -----------------------
@cuda.jit
def _warp_kernel(x, out):
    t = cuda.threadIdx.x
    v = x[t]
    out[t, 0] = cuda.shfl_sync(FULL, v, 5)
    out[t, 1] = cuda.shfl_xor_sync(FULL, v, 3)
    out[t, 2] = cuda.shfl_down_sync(FULL, v, 4)
    out[t, 3] = cuda.shfl_up_sync(FULL, v, 2)
    out[t, 4] = cuda.ballot_sync(FULL, v & 1)
    s = v
    for off in (16, 8, 4, 2, 1):
        s += cuda.shfl_xor_sync(FULL, s, off)
    out[t, 5] = s
    cuda.syncwarp(FULL)


def test_warp_primitives():
    x = (np.arange(64, dtype=np.int32) * 7919) % 1000
    out = cuda.device_array((64, 6), np.int64)
    _warp_kernel[1, 64](cuda.to_device(x), out)
    got = out.copy_to_host()
    for t in range(64):
        w, lane = t // 32 * 32, t % 32
        assert got[t, 0] == x[w + 5]
        assert got[t, 1] == x[w + (lane ^ 3)]
        assert got[t, 2] == x[w + lane + 4] if lane + 4 < 32 else got[t, 2] == x[t]
        assert got[t, 3] == x[w + lane - 2] if lane >= 2 else got[t, 3] == x[t]
        ballot = sum(1 << j for j in range(32) if x[w + j] & 1)
        assert np.uint32(got[t, 4]) == np.uint32(ballot)
        assert got[t, 5] == x[w:w + 32].sum()


# ---- the simulator's threads: reused from block to block, barriers with early exits, errors ------------------
ROUNDS_XOR = 40


@cuda.jit
def _blocks_kernel(out, live):
    """Threads at or past ``live`` return before the barrier; the others each read a neighbour's store after it,
    then run ROUNDS_XOR dependent shuffles (lanes race ahead of each other between the exchanges)."""
    sh = cuda.shared.array(128, np.int64)
    t = cuda.threadIdx.x
    b = cuda.blockIdx.x
    out[b, t, 0] = b * 1000 + t
    if t >= live:
        return
    sh[t] = b * 1000 + t
    cuda.syncthreads()
    out[b, t, 1] = sh[(t + 1) % live]
    cuda.syncthreads()
    v = np.int64(t)
    if live % 32 == 0:                        # whole warps only: a warp collective needs every lane
        for r in range(ROUNDS_XOR):
            v = (v * 3 + cuda.shfl_xor_sync(FULL, v, r % 32)) % 1000003
    out[b, t, 2] = v


@pytest.mark.skipif(PTX_ONLY, reason="runs kernels")
@pytest.mark.parametrize("shape", [(3, 128, 96), (2, 64, 64), (4, 128, 128), (1, 96, 50)])
def test_threads_from_block_to_block(shape):
    """Each simulated thread sees its own block and thread index, block after block and launch after launch (the
    simulator reuses its threads); a barrier waits for the live threads only; dependent shuffles stay in step."""
    blocks, threads, live = shape
    out = cuda.to_device(np.full((blocks, threads, 3), -1, np.int64))
    _blocks_kernel[blocks, threads](out, live)
    got = out.copy_to_host()
    b, t = np.meshgrid(np.arange(blocks), np.arange(threads), indexing="ij")
    np.testing.assert_array_equal(got[:, :, 0], b * 1000 + t)
    tl = np.arange(live)
    np.testing.assert_array_equal(got[:, :live, 1], np.arange(blocks)[:, None] * 1000 + (tl + 1) % live)
    assert (got[:, live:, 1:] == -1).all()
    v = np.tile(np.arange(live, dtype=np.int64), (blocks, 1))
    if live % 32 == 0:
        lanes = np.arange(live)
        for r in range(ROUNDS_XOR):
            v = (v * 3 + v[:, (lanes // 32) * 32 + (lanes % 32 ^ r % 32)]) % 1000003
    np.testing.assert_array_equal(got[:, :live, 2], v)


@cuda.jit
def _failing_kernel(out, bad):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    out[t + (1000 if t == bad else 0)] = t      # thread ``bad`` indexes past the array (the simulator checks)
    cuda.syncthreads()


@cuda.jit
def _early_lane_kernel(out):
    t = cuda.threadIdx.x
    if t == 3:
        return                                  # lane 3 never reaches the shuffle
    out[t] = cuda.shfl_sync(FULL, t, 0)


@pytest.mark.skipif(not SIM, reason="the simulator's own error paths")
def test_simulator_errors_and_recovery(monkeypatch):
    """A thread's error aborts its block (threads parked at the barrier included) and is raised by the launch; a
    lane that skips a warp collective fails the others after the timeout; the next launch runs normally."""
    from kbit_numba import _sim
    out = cuda.to_device(np.zeros(64, np.int64))
    with pytest.raises(IndexError, match="tid=\\[5, 0, 0\\]"):
        _failing_kernel[2, 64](out, 5)
    monkeypatch.setattr(_sim, "_TIMEOUT_S", 0.3)
    with pytest.raises(RuntimeError, match="not every lane of the warp arrived"):
        _early_lane_kernel[1, 32](out)
    _failing_kernel[2, 64](out, -1)
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(64))
