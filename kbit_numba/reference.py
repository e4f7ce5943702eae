"""Plain NumPy reference of the kbit format and its products: the oracle for every kernel.

Readable first, fast never. Every GPU function has its twin here and a property test comparing them.
"""
from __future__ import annotations

import numpy as np

from .formats import (BITNET_BLOCK_K, BITNET_BLOCK_N, BITNET_ORDER, BLOCK, INT8_ABSMAX_FLOOR, INT8_MAX, LANES,
                      SBVR_ACT_PLANES, SBVR_GROUP, SBVR_PLANES, CODES_K, BitnetWeight, KbitCodes, KbitFragments,
                      KbitWeight, SbvrWeight, UniformWeight, check_codebook, check_fragment_shape, check_k, e4m4_decode,
                      e4m4_encode, fragment_position, padded_k, tiled_absmax_index, tiled_word_index,
                      uniform_elements_per_word)


def bf16_bits_to_float32(bits):
    """bfloat16 stored as int16/uint16 bits -> float32."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x):
    """float32 -> bfloat16 bits (int16), round to nearest even."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16).view(np.int16)


def finite_weights(W, bf16=False):
    """W as float32, refused with a ValueError if it holds NaN or Inf (no quantizer encodes them)."""
    W = as_float32(W, bf16)
    if not np.all(np.isfinite(W)):
        raise ValueError("W contains NaN or Inf")
    return W


def as_float32(W, bf16=False):
    W = np.asarray(W)
    return bf16_bits_to_float32(W) if bf16 else W.astype(np.float32)


def pack_bitplanes(idx, k):
    """idx[..., 32] (values < 2**k) -> uint32[..., k]: word b holds bit b of every index, element j at bit j."""
    idx = np.asarray(idx).astype(np.uint32)
    j = np.arange(BLOCK, dtype=np.uint32)
    return np.stack([(((idx >> b) & 1) << j).sum(axis=-1, dtype=np.uint64).astype(np.uint32)
                     for b in range(k)], axis=-1)


def unpack_bitplanes(words, k):
    """uint32[..., k] -> uint8 indices [..., 32]; the inverse of pack_bitplanes."""
    words = np.asarray(words, dtype=np.uint32)
    j = np.arange(BLOCK, dtype=np.uint32)
    idx = np.zeros(words.shape[:-1] + (BLOCK,), dtype=np.uint32)
    for b in range(k):
        idx |= ((words[..., b, None] >> j) & 1) << b
    return idx.astype(np.uint8)


def nearest_index(x_norm, cb):
    """Index of the nearest codebook entry; ties go to the lower index (as the GPU does)."""
    return np.argmin(np.abs(x_norm[..., None] - cb), axis=-1)


def quantize(W, k=4, codebook=None, absmax_format="e4m4", bf16=False):
    """W[N, K] float -> KbitWeight (flat layout, NumPy arrays)."""
    k = check_k(k)
    cb = check_codebook(codebook, k)
    W = finite_weights(W, bf16)
    if W.ndim != 2 or W.shape[1] % BLOCK:
        raise ValueError(f"W must be 2-D with K a multiple of {BLOCK}, got shape {W.shape}")
    N, K = W.shape
    blocks = W.reshape(-1, BLOCK)
    amax = np.max(np.abs(blocks), axis=1)
    x_norm = blocks / np.maximum(amax, np.float32(1e-8))[:, None]   # true absmax picks the index
    idx = nearest_index(x_norm, cb)
    packed = pack_bitplanes(idx, k).reshape(-1)
    absmax = e4m4_encode(amax) if absmax_format == "e4m4" else amax.astype(np.float32)
    return KbitWeight(packed, absmax, cb, k, (N, K), "flat", absmax_format)


def decoded_absmax(qw):
    a = np.asarray(qw.absmax)
    return e4m4_decode(a) if qw.absmax_format == "e4m4" else a.astype(np.float32)


def pack_codes(idx, k):
    """idx[..., 32] (values < 2**k) -> uint32[..., k]: k-bit fields in element order, element j at bit
    k * (j % (32 // k)) of word j // (32 // k) (the kernel-native code layout, ``KbitCodes``)."""
    per_word = 32 // k
    idx = np.asarray(idx).astype(np.uint64).reshape(idx.shape[:-1] + (k, per_word))
    shifts = (k * np.arange(per_word)).astype(np.uint64)
    return (idx << shifts).sum(axis=-1, dtype=np.uint64).astype(np.uint32)


def unpack_codes(words, k):
    """uint32[..., k] code words -> uint8 indices [..., 32]; the inverse of pack_codes."""
    words = np.asarray(words, dtype=np.uint32)
    shifts = (k * np.arange(32 // k)).astype(np.uint32)
    idx = (words[..., None] >> shifts) & np.uint32((1 << k) - 1)
    return idx.reshape(words.shape[:-1] + (BLOCK,)).astype(np.uint8)


def to_codes(qw):
    """KbitWeight (any layout, k = 2 or 4) -> KbitCodes (NumPy): the same indices re-packed from bit
    planes into k-bit fields."""
    if qw.k not in CODES_K:
        raise ValueError(f"the code layout holds k in {CODES_K}, got k={qw.k}")
    qw = to_flat(qw.to_numpy())
    idx = unpack_bitplanes(np.asarray(qw.packed).reshape(-1, qw.k), qw.k)
    return KbitCodes(pack_codes(idx, qw.k).reshape(-1), np.asarray(qw.absmax), np.asarray(qw.codebook),
                     qw.k, qw.shape, qw.absmax_format)


def from_codes(kc):
    """KbitCodes -> the flat KbitWeight it came from (NumPy), exactly."""
    kc = kc.to_numpy()
    idx = unpack_codes(np.asarray(kc.packed).reshape(-1, kc.k), kc.k)
    return KbitWeight(pack_bitplanes(idx, kc.k).reshape(-1), np.asarray(kc.absmax), np.asarray(kc.codebook),
                      kc.k, kc.shape, "flat", kc.absmax_format)


def fragment_order(N, K, k):
    """perm[i] = the code layout's block index of the fragment layout's block i (``formats.fragment_position``
    inverted)."""
    check_fragment_shape(N, K)
    n_kb = K // BLOCK
    n, kb = np.meshgrid(np.arange(N), np.arange(n_kb), indexing="ij")
    perm = np.empty(N * n_kb, np.int64)
    perm[fragment_position(n, kb, n_kb, k).reshape(-1)] = (n * n_kb + kb).reshape(-1)
    return perm


def to_fragments(w):
    """KbitCodes (or a KbitWeight with k = 2, 4, through ``to_codes``) -> KbitFragments (NumPy): the same blocks
    and absmax values in ``mma_gemv``'s load order."""
    kc = w.to_numpy() if isinstance(w, KbitCodes) else to_codes(w)
    N, K = kc.shape
    perm = fragment_order(N, K, kc.k)
    packed = np.asarray(kc.packed).reshape(-1, kc.k)[perm].reshape(-1)
    return KbitFragments(packed, np.asarray(kc.absmax)[perm], np.asarray(kc.codebook), kc.k, kc.shape,
                         kc.absmax_format)


def from_fragments(kf):
    """KbitFragments -> the KbitCodes it came from (NumPy), exactly."""
    kf = kf.to_numpy()
    N, K = kf.shape
    perm = fragment_order(N, K, kf.k)
    packed = np.empty((N * (K // BLOCK), kf.k), np.uint32)
    packed[perm] = np.asarray(kf.packed).reshape(-1, kf.k)
    absmax = np.empty_like(np.asarray(kf.absmax))
    absmax[perm] = np.asarray(kf.absmax)
    return KbitCodes(packed.reshape(-1), absmax, np.asarray(kf.codebook), kf.k, kf.shape, kf.absmax_format)


def to_flat(qw):
    """Any layout (KbitCodes and KbitFragments too) -> flat layout (NumPy)."""
    if isinstance(qw, KbitFragments):
        return from_codes(from_fragments(qw))
    if isinstance(qw, KbitCodes):
        return from_codes(qw)
    if qw.layout == "flat":
        return qw
    N, K = qw.shape
    kb = K // BLOCK
    n, b, bit = np.meshgrid(np.arange(N), np.arange(kb), np.arange(qw.k), indexing="ij")
    packed = np.asarray(qw.packed)[tiled_word_index(n, b, bit, N, qw.k)].reshape(-1)
    absmax = np.asarray(qw.absmax)[tiled_absmax_index(n[..., 0], b[..., 0], N)].reshape(-1)
    return KbitWeight(packed, absmax, np.asarray(qw.codebook), qw.k, qw.shape, "flat", qw.absmax_format)


def repack_tiled(qw):
    """Flat -> tiled layout (N % 128 == 0; K padded to a multiple of 64 with zero blocks)."""
    if qw.layout == "tiled":
        return qw
    N, K = qw.shape
    if N % 128:
        raise ValueError(f"the tiled layout needs N % 128 == 0, got N={N}")
    k = qw.k
    kb, kb_pad = K // BLOCK, padded_k(K, "tiled") // BLOCK
    packed = np.zeros(N * kb_pad * k, dtype=np.uint32)
    absmax = np.zeros(N * kb_pad, dtype=np.asarray(qw.absmax).dtype)
    n, b, bit = np.meshgrid(np.arange(N), np.arange(kb), np.arange(k), indexing="ij")
    packed[tiled_word_index(n, b, bit, N, k)] = np.asarray(qw.packed).reshape(N, kb, k)
    absmax[tiled_absmax_index(n[..., 0], b[..., 0], N)] = np.asarray(qw.absmax).reshape(N, kb)
    return KbitWeight(packed, absmax, np.asarray(qw.codebook), k, qw.shape, "tiled", qw.absmax_format)


def dequantize(qw):
    """KbitWeight (either layout, NumPy or device arrays) -> float32[N, K]."""
    qw = to_flat(qw.to_numpy())
    N, K = qw.shape
    idx = unpack_bitplanes(np.asarray(qw.packed).reshape(-1, qw.k), qw.k)
    vals = np.asarray(qw.codebook)[idx] * decoded_absmax(qw)[:, None]
    return vals.reshape(N, K).astype(np.float32)


def gemv(A, qw, bf16=False, accumulate=np.float64):
    """C[M, N] = A[M, K] @ dequantize(qw).T, accumulated in float64 (or float32), returned float32."""
    A = as_float32(A, bf16)
    if A.ndim == 1:
        A = A[None, :]
    if A.shape[1] != qw.shape[1]:
        raise ValueError(f"A has K={A.shape[1]}, the weight has K={qw.shape[1]}")
    W = dequantize(qw)
    return (A.astype(accumulate) @ W.astype(accumulate).T).astype(np.float32)


def rms_gemv(A, qw, eps):
    """The pair gemv's ``rms_eps`` twin: C = (A @ dequantize(qw).T) / sqrt(mean(A^2) + eps) per row, in float64: an
    RMSNorm of A (its weight folded into qw) before the projection. Returns float32."""
    A2 = np.atleast_2d(as_float32(A)).astype(np.float64)
    ss = (A2 * A2).sum(axis=1)
    scale = 1.0 / np.sqrt(ss[:, None] / A2.shape[1] + float(eps))
    return (gemv(A2, qw).astype(np.float64) * scale).astype(np.float32)


def silu_pairs(C):
    """The ``silu_pairs`` epilogue's twin: out[:, j] = silu(C[:, 2j]) * C[:, 2j + 1] (float64), for a gate/up layer
    whose weight rows are interleaved (gate row j at 2j, up row j at 2j + 1): the SwiGLU MLP's activation."""
    C = np.asarray(C, np.float64)
    gate, up = C[..., 0::2], C[..., 1::2]
    return gate / (1.0 + np.exp(-gate)) * up


def mma_round(x, bf16=False):
    """float32 values rounded (to nearest even) to the MMA input type, fp16 or bf16, and back to float32."""
    x = np.asarray(x, np.float32)
    if bf16:
        return bf16_bits_to_float32(float32_to_bf16_bits(x))
    return x.astype(np.float16).astype(np.float32)


def gemm_weights(qw, bf16=False):
    """W[N, K] as the tensor-core GEMM multiplies it: the codebook value and the absmax each rounded to the
    MMA type, their product (exact in float32) rounded once more, as one ``mul.rn.f16x2`` (``bf16x2``) does."""
    qw = to_flat(qw.to_numpy())
    N, K = qw.shape
    idx = unpack_bitplanes(np.asarray(qw.packed).reshape(-1, qw.k), qw.k)
    cb = mma_round(np.asarray(qw.codebook), bf16)
    absmax = mma_round(decoded_absmax(qw), bf16)
    return mma_round(cb[idx] * absmax[:, None], bf16).reshape(N, K)


def gemm(A, qw, bf16=False):
    """The tensor-core GEMM's arithmetic, in NumPy: C = A' @ W'^T with W' = :func:`gemm_weights` and A' the
    activations in the MMA type (float32 A rounded to fp16, as the GEMM's conversion step does); products
    summed in float64, returned float32. The kernel differs from it only by its float32 accumulation."""
    A = as_float32(A, bf16)
    if A.ndim == 1:
        A = A[None, :]
    if A.shape[1] != qw.shape[1]:
        raise ValueError(f"A has K={A.shape[1]}, the weight has K={qw.shape[1]}")
    A = A if bf16 else mma_round(A)
    return (A.astype(np.float64) @ gemm_weights(qw, bf16).astype(np.float64).T).astype(np.float32)


def block_error_bound(qw_flat, W):
    """Per-block bound on |W - dequantize|: half the largest codebook gap times the true absmax,
    plus the E4M4 rounding |absmax_true - absmax_decoded| (the codebook's max |v| is 1)."""
    W = np.asarray(W, dtype=np.float32).reshape(-1, BLOCK)
    amax = np.max(np.abs(W), axis=1)
    cb = np.asarray(qw_flat.codebook, dtype=np.float64)
    half_gap = max(np.max(np.diff(cb)) / 2, 1 - cb[-1], cb[0] + 1)
    return half_gap * amax + np.abs(amax - decoded_absmax(qw_flat))


def grouped_gemv(A, experts, offsets, bf16=False):
    """MoE: out[t] = A[t] @ dequantize(expert e)^T for the tokens offsets[e] <= t < offsets[e+1]."""
    A = as_float32(A, bf16)
    offsets = np.asarray(offsets)
    N = experts.expert_shape[0]
    out = np.zeros((A.shape[0], N), np.float32)
    for e in range(experts.n_experts):
        t0, t1 = int(offsets[e]), int(offsets[e + 1])
        if t1 > t0:
            out[t0:t1] = gemv(A[t0:t1], experts.expert(e))
    return out


# =============================================================================================
# Activation quantizers shared by the int8 kernels
# =============================================================================================


def int8_per_token(A, bf16=False):
    """Per-token (row) symmetric int8: s = 127 / max(|x|, 1e-5), q = clip(rint(x * s), -127, 127).
    Returns (q int8 [M, K], d float32 [M]) with x ~ q * d, d = 1 / s (float32 arithmetic, as the GPU)."""
    A = np.atleast_2d(as_float32(A, bf16))
    s = np.float32(INT8_MAX) / np.maximum(np.abs(A).max(axis=1), INT8_ABSMAX_FLOOR)
    q = np.clip(np.rint(A * s[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, (np.float32(1) / s).astype(np.float32)


# =============================================================================================
# GemLite-style uniform n-bit: w = (q - zero) * scale, stride-32 int32 packing
# =============================================================================================
def uniform_pack(q, bits):
    """q uint [N, K] (values < 2**bits) -> uint32 [N, n_chunks*32] in the stride-32 packing of
    UniformWeight (K zero-padded to whole chunks of 32 * epw values)."""
    q = np.asarray(q).astype(np.uint32)
    N, K = q.shape
    epw = uniform_elements_per_word(bits)
    chunk = LANES * epw
    n_chunks = -(-K // chunk)
    qp = np.zeros((N, n_chunks * chunk), np.uint32)
    qp[:, :K] = q
    qp = qp.reshape(N, n_chunks, epw, LANES)            # [n, c, j, t] = q[n, c*32*epw + 32 j + t]
    shifts = (np.arange(epw, dtype=np.uint32) * bits)[None, None, :, None]
    words = np.bitwise_or.reduce(qp << shifts, axis=2)  # [n, c, t]
    return words.reshape(N, n_chunks * LANES).astype(np.uint32)


def uniform_unpack(packed, bits, K):
    """The inverse of uniform_pack: uint8 [N, K]."""
    packed = np.asarray(packed, np.uint32)
    N = packed.shape[0]
    epw = uniform_elements_per_word(bits)
    words = packed.reshape(N, -1, 1, LANES)
    shifts = (np.arange(epw, dtype=np.uint32) * bits)[None, None, :, None]
    q = (words >> shifts) & np.uint32((1 << bits) - 1)  # [n, c, j, t]
    return q.reshape(N, -1)[:, :K].astype(np.uint8)


def _groups(W, group_size):
    """W [N, K] -> [N, K // G, G] (or [1, 1, N*K] for one group over the whole tensor)."""
    N, K = W.shape
    return W.reshape(N, K // group_size, group_size) if group_size else W.reshape(1, 1, -1)


def uniform_quantize(W, bits=4, group_size=128):
    """Min-max round-to-nearest per group: scale = (max - min) / (2**bits - 1), stored as float16 (at most
    65504; 1 where its float16 is 0: max == min, or a range below float16's smallest step, whose weights then
    all dequantize to ~0), zero = -min / scale, stored as float16 (a zero of either sign as +0.0); q = clip(rint(w / scale + zero), 0,
    2**bits - 1) computed with the stored float16 values in float32. Returns a host UniformWeight."""
    W = finite_weights(W)
    if W.ndim != 2:
        raise ValueError(f"W must be 2-D [N, K], got shape {W.shape}")
    uniform_elements_per_word(bits)
    N, K = W.shape
    if K % BLOCK or (group_size and K % group_size):
        raise ValueError(f"K must be a multiple of 32 and of group_size, got K={K}")
    g = _groups(W, group_size)
    mn, mx = g.min(axis=-1), g.max(axis=-1)
    levels = np.float32((1 << bits) - 1)
    s16 = np.minimum((mx - mn) / levels, np.float32(65504)).astype(np.float16)
    s16 = np.where(s16 > 0, s16, np.float16(1))
    # (+ 0: a zero point of -0.0, from mn = +0.0, is stored as +0.0, the sign the GPU quantizer stores too)
    z16 = (np.clip(-mn / s16.astype(np.float32), -65504, 65504) + np.float32(0)).astype(np.float16)
    q = np.clip(np.rint(g / s16.astype(np.float32)[..., None] + z16.astype(np.float32)[..., None]), 0, levels)
    sz = np.stack([s16, z16], axis=-1)
    return UniformWeight(uniform_pack(q.reshape(N, K), bits), sz, bits, (N, K), group_size)


def uniform_dequantize(uw):
    """UniformWeight -> float32 [N, K]: (q - zero) * scale with the float16 scale and zero."""
    uw = uw.to_numpy()
    N, K = uw.shape
    q = _groups(uniform_unpack(uw.packed, uw.bits, K).astype(np.float32), uw.group_size)
    sz = np.asarray(uw.scale_zero).astype(np.float32)
    return ((q - sz[..., 1:2]) * sz[..., 0:1]).reshape(N, K).astype(np.float32)


def uniform_gemv(A, uw, int8=False, bf16=False):
    """C[M, N] = A @ uniform_dequantize(uw).T in float64; with ``int8`` A is first quantized per token
    (int8_per_token), as the int8 kernel sees it."""
    A = np.atleast_2d(as_float32(A, bf16)).astype(np.float64)
    if int8:
        q, d = int8_per_token(A.astype(np.float32))
        A = q.astype(np.float64) * d[:, None].astype(np.float64)
    return (A @ uniform_dequantize(uw).astype(np.float64).T).astype(np.float32)


def uniform_int8_words(q, bits):
    """int8 activations [M, K] -> the int32 words the uniform int8 kernel reads: for chunk c, quad s and
    lane t, word ``(c*QPW + s)*32 + t`` holds bytes ``q[c*32*epw + 32*(4s+i) + t]``, i = 0..3 (QPW =
    ceil(epw/4) quads per word; rows past epw or K are 0). Lane t's 4 bytes are its values 4s..4s+3."""
    q = np.atleast_2d(np.asarray(q, np.int8))
    M, K = q.shape
    epw = uniform_elements_per_word(bits)
    qpw = -(-epw // 4)
    n_chunks = -(-K // (LANES * epw))
    rows = np.zeros((M, n_chunks * LANES * epw), np.int8)
    rows[:, :K] = q
    rows = rows.reshape(M, n_chunks, epw, LANES)
    quads = np.zeros((M, n_chunks, qpw * 4, LANES), np.int8)
    quads[:, :, :epw] = rows
    quads = quads.reshape(M, n_chunks, qpw, 4, LANES).transpose(0, 1, 2, 4, 3)   # [m, c, s, t, i]
    return np.ascontiguousarray(quads).view(np.uint32).reshape(M, n_chunks * qpw * LANES)


# =============================================================================================
# SBVR: bitvector sums with a global coefficient cache
# =============================================================================================
_COMBOS = ((np.arange(16)[:, None] >> np.arange(SBVR_PLANES)[None, :]) & 1).astype(np.float32)  # [16, 4]


def _sbvr_assign(w, c):
    """For groups w [G, 128] and coefficients c [G, 4]: bits [G, 128, 4] of the nearest of the 16
    values sum_s c_s b_s, per weight."""
    vals = c @ _COMBOS.T                                            # [G, 16]
    best = np.argmin(np.abs(w[:, :, None] - vals[:, None, :]), axis=-1)   # [G, 128]
    return _COMBOS[best]


def _sbvr_fit(w, bits):
    """Least-squares coefficients for fixed bits (a small ridge keeps constant planes solvable)."""
    BtB = np.einsum("gks,gkt->gst", bits, bits).astype(np.float64)
    BtB += 1e-6 * (1 + np.trace(BtB, axis1=1, axis2=2))[:, None, None] * np.eye(SBVR_PLANES)
    Btw = np.einsum("gks,gk->gs", bits, w).astype(np.float64)
    return np.linalg.solve(BtB, Btw[..., None])[..., 0].astype(np.float32)


def sbvr_encode(W, lines=1024, iters=4, kmeans_iters=6, seed=0, chunk=4096):
    """W [N, K] -> host SbvrWeight. Per group of 128: start from two's-complement 4-bit coefficients
    (-8d, 4d, 2d, d), then alternate nearest-value bit assignment and least-squares coefficients
    ``iters`` times. The per-group vectors are then clustered (k-means weighted by 1/|c|^2, i.e. in
    relative error) into a cache of ``lines`` float16 rows; each group takes its nearest line and its
    bits are assigned once more against it. Indices are uint8 for <= 256 lines, else uint16."""
    W = finite_weights(W)
    N, K = W.shape
    if K % SBVR_GROUP:
        raise ValueError(f"SBVR needs K % {SBVR_GROUP} == 0, got K={K}")
    G = K // SBVR_GROUP
    w = W.reshape(N, G, SBVR_GROUP).transpose(1, 0, 2).reshape(G * N, SBVR_GROUP)   # group (g, n)
    d = np.maximum(np.abs(w).max(axis=1), 1e-12) / np.float32(7.5)
    c = d[:, None] * np.array([-8, 4, 2, 1], np.float32)[None, :]
    for lo in range(0, len(w), chunk):
        sl = slice(lo, lo + chunk)
        for _ in range(iters):
            c[sl] = _sbvr_fit(w[sl], _sbvr_assign(w[sl], c[sl]))
    rng = np.random.default_rng(seed)
    lines = int(min(lines, len(c)))
    cache = c[rng.choice(len(c), lines, replace=False)]
    wt = 1.0 / np.maximum(np.sum(c * c, axis=1), 1e-30)
    for _ in range(kmeans_iters):
        idx = _nearest_rows(c, cache)
        for j in range(SBVR_PLANES):
            num = np.bincount(idx, weights=wt * c[:, j], minlength=lines)
            den = np.bincount(idx, weights=wt, minlength=lines)
            cache[:, j] = np.where(den > 0, num / np.maximum(den, 1e-300), cache[:, j])
    cache16 = cache.astype(np.float16)
    idx = _nearest_rows(c, cache16.astype(np.float32))
    bits = np.concatenate([_sbvr_assign(w[lo:lo + chunk], cache16.astype(np.float32)[idx[lo:lo + chunk]])
                           for lo in range(0, len(w), chunk)])                     # [G*N, 128, 4]
    bits = bits.reshape(G, N, 4, BLOCK, SBVR_PLANES).astype(np.uint32)            # [g, n, c, j, s]
    words = np.bitwise_or.reduce(bits << np.arange(BLOCK, dtype=np.uint32)[:, None], axis=3)  # [g,n,c,s]
    bvr = words.transpose(0, 2, 1, 3).reshape(K // BLOCK, N, SBVR_PLANES)
    itype = np.uint8 if lines <= 256 else np.uint16
    return SbvrWeight(np.ascontiguousarray(bvr), idx.reshape(G, N).astype(itype), cache16, (N, K))


def _nearest_rows(x, rows):
    """Index of the nearest row of ``rows`` for every row of x (squared distance), in chunks."""
    out = np.empty(len(x), np.int64)
    r2 = np.sum(rows.astype(np.float64) ** 2, axis=1)
    for lo in range(0, len(x), 8192):
        xs = x[lo:lo + 8192].astype(np.float64)
        out[lo:lo + 8192] = np.argmin(r2[None, :] - 2 * xs @ rows.T.astype(np.float64), axis=1)
    return out


def sbvr_dequantize(sw):
    """SbvrWeight -> float32 [N, K]."""
    sw = sw.to_numpy()
    N, K = sw.shape
    bvr = np.asarray(sw.bvr, np.uint32)                                  # [c, n, s]
    bits = (bvr[:, :, :, None] >> np.arange(BLOCK, dtype=np.uint32)) & 1  # [c, n, s, j]
    coeff = np.asarray(sw.coeff_cache).astype(np.float32)[np.asarray(sw.coeff_idx).astype(np.int64)]  # [g,n,s]
    coeff = np.repeat(coeff, SBVR_GROUP // BLOCK, axis=0)                 # [c, n, s]
    w = np.einsum("cnsj,cns->ncj", bits.astype(np.float32), coeff)
    return w.reshape(N, K).astype(np.float32)


def sbvr_quantize_activations(A, bf16=False):
    """7-bit round-to-nearest per group of 128: q = clip(rint(x * 127/max|x|), -127, 127) (q = 0 for
    an all-zero group). Returns (q int8 [M, K], d float32 [M, K/128] with x ~ q*d, planes uint32
    [M, K/32, 8]: plane p holds bit p of the two's-complement byte of each of 32 values, value j at bit j)."""
    A = np.atleast_2d(as_float32(A, bf16))
    M, K = A.shape
    g = A.reshape(M, K // SBVR_GROUP, SBVR_GROUP)
    amax = np.abs(g).max(axis=-1)
    s = np.where(amax > 0, np.float32(INT8_MAX) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(g * s[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8).reshape(M, K)
    d = np.where(s > 0, np.float32(1) / np.where(s > 0, s, 1), 0).astype(np.float32)
    u = q.view(np.uint8).reshape(M, K // BLOCK, BLOCK).astype(np.uint32)
    j = np.arange(BLOCK, dtype=np.uint32)
    planes = np.stack([np.bitwise_or.reduce(((u >> p) & 1) << j, axis=-1) for p in range(SBVR_ACT_PLANES)],
                      axis=-1).astype(np.uint32)
    return q, d, planes


def sbvr_gemv(A, sw, bf16=False):
    """C[M, N] with 7-bit activations as the kernel sees them: sum_g d[m, g] * (q[m, g] . W[n, g])."""
    q, d, _ = sbvr_quantize_activations(A, bf16)
    M, K = q.shape
    Wd = sbvr_dequantize(sw).astype(np.float64)
    deq = (q.astype(np.float64).reshape(M, -1, SBVR_GROUP) * d[..., None]).reshape(M, K)
    return (deq @ Wd.T).astype(np.float32)


# =============================================================================================
# BitNet b1.58 W2A8: ternary weights, int8 activations
# =============================================================================================
def bitnet_pack(wq):
    """Ternary wq int [N, K] -> uint32 [N/16, K/32, 32] (BitnetWeight's block layout)."""
    wq = np.asarray(wq).astype(np.int64)
    N, K = wq.shape
    codes = (wq + 2).astype(np.uint32).reshape(N // BITNET_BLOCK_N, BITNET_BLOCK_N, K // BITNET_BLOCK_K, 2, 16)
    slots = codes[..., list(BITNET_ORDER)]                     # slot p holds value ORDER[p]
    words = np.bitwise_or.reduce(slots << (2 * np.arange(16, dtype=np.uint32)), axis=-1)  # [nb, r, kb, h]
    return np.ascontiguousarray(words.transpose(0, 2, 1, 3).reshape(N // 16, K // 32, 32)).astype(np.uint32)


def bitnet_unpack(packed, shape):
    """The inverse of bitnet_pack: int8 [N, K] in {-1, 0, 1}."""
    N, K = shape
    words = np.asarray(packed, np.uint32).reshape(N // 16, K // 32, 16, 2)            # [nb, kb, r, h]
    slots = (words[..., None] >> (2 * np.arange(16, dtype=np.uint32))) & 3            # [.., p]
    vals = np.empty_like(slots)
    vals[..., list(BITNET_ORDER)] = slots
    return (vals.transpose(0, 2, 1, 3, 4).reshape(N, K).astype(np.int8) - 2).astype(np.int8)


def bitnet_quantize(W, parts=1):
    """Absmean ternary quantisation per part of the columns: s = 1 / max(mean|W_part|, 1e-5),
    w_q = clip(rint(W * s), -1, 1), w_scale = 1 / s. Returns a host BitnetWeight."""
    W = finite_weights(W)
    N, K = W.shape
    if N % BITNET_BLOCK_N or K % BITNET_BLOCK_K:
        raise ValueError(f"BitNet needs N % {BITNET_BLOCK_N} == 0 and K % {BITNET_BLOCK_K} == 0, got {W.shape}")
    if parts < 1 or N % parts:
        raise ValueError(f"parts must divide N={N}, got {parts}")
    Wp = W.reshape(parts, N // parts, K)
    s = np.float32(1) / np.maximum(np.abs(Wp).mean(axis=(1, 2), dtype=np.float64).astype(np.float32),
                                    INT8_ABSMAX_FLOOR)
    wq = np.clip(np.rint(Wp * s[:, None, None]), -1, 1).reshape(N, K)
    return BitnetWeight(bitnet_pack(wq), (np.float32(1) / s).astype(np.float32), (N, K))


def bitnet_dequantize(bw):
    bw = bw.to_numpy()
    N, K = bw.shape
    ws = np.repeat(np.asarray(bw.w_scale, np.float32), N // bw.w_scale.size)
    return (bitnet_unpack(bw.packed, bw.shape).astype(np.float32) * ws[:, None]).astype(np.float32)


def bitnet_gemv(A, bw, bf16=False):
    """C[M, N] = (q @ w_q^T) * d[m] * w_scale[part(n)] with q, d = int8_per_token(A) (exact integer dot)."""
    bw = bw.to_numpy()
    q, d = int8_per_token(A, bf16)
    N = bw.shape[0]
    acc = q.astype(np.int64) @ bitnet_unpack(bw.packed, bw.shape).astype(np.int64).T
    ws = np.repeat(np.asarray(bw.w_scale, np.float64), N // bw.w_scale.size)
    return (acc * d[:, None].astype(np.float64) * ws[None, :]).astype(np.float32)
