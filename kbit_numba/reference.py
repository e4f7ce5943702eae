"""Plain NumPy reference of the kbit format and its products: the oracle for every kernel.

Readable first, fast never. Every GPU function has its twin here and a property test comparing them.
"""
from __future__ import annotations

import numpy as np

from .formats import (BLOCK, KbitWeight, check_codebook, check_k, e4m4_decode, e4m4_encode,
                      padded_k, tiled_absmax_index, tiled_word_index)


def bf16_bits_to_float32(bits):
    """bfloat16 stored as int16/uint16 bits -> float32."""
    return (np.asarray(bits).view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16_bits(x):
    """float32 -> bfloat16 bits (int16), round to nearest even."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16).view(np.int16)


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
    W = as_float32(W, bf16)
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


def to_flat(qw):
    """Any layout -> flat layout (NumPy)."""
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
