"""Calibrated quantization into the kbit format (host, NumPy): GPTQ-style error feedback.

``reference.quantize`` (and the GPU ``quantize``) round every weight to its nearest codebook value over its
block's true absmax: bitsandbytes' bytes, no data needed. :func:`quantize_gptq` writes the same format (bit
planes + E4M4 absmax, flat layout; every kbit kernel reads it unchanged) but chooses the values with a layer's
calibration inputs X in mind, so that the layer's outputs X @ W^T move least:

* columns (k) are quantized one at a time, and each one's rounding error, weighted by the inverse of the
  Hessian H = X^T X (plus ``damp`` x its mean diagonal), is pushed onto the columns not yet quantized (GPTQ,
  Frantar et al. 2022);
* ``act_order``: columns in decreasing order of H's diagonal (the inputs with the most energy first), with every
  block's scale fixed from the original weights up front; otherwise in order, each block's scale set when its
  first column is reached;
* ``scale_search``: a block's scale is its absmax times the factor in 0.6 .. 1.0 with the least squared
  rounding error of the block, instead of the absmax itself;
* ``refine``: then rounds of block scales refitted to the output error with the indices held
  (:func:`refit_scales`) and indices chosen again by GPTQ with those scales;
* ``index_sweeps``: then coordinate descent over the indices with the scales held (:func:`refine_indices`).

Calibrating a model layer by layer on the inputs its already-quantized layers give (sequential GPTQ), pass
:func:`asymmetric_target` as ``W``: the layer then aims at the float model's output from those inputs, so the error
the earlier layers left is corrected rather than passed on (GPTAQ's objective).

Measured on all-MiniLM-L6-v2 (``benchmarks/fidelity_minilm.py``, each half of 200 sentences calibrated on the
other half): k = 4 mean embedding cosine 0.9751 (round-to-nearest) -> 0.9913 (both options on) -> 0.9924 with each
layer's own codebook (:func:`fit_codebook`, passed as ``codebook``); with 264 more calibration sentences 0.9936, and
``refine=2`` 0.9938; with 600 calibration sentences, less damping, sequential calibration and the LayerNorms refitted
0.99459, and ``index_sweeps=2`` 0.99464, 4 sweeps 0.99480; with :func:`asymmetric_target` and ``damp=0.3`` 0.99586
(benchmarks/README.md). Test: ``tests/test_calibrate.py``.
"""
from __future__ import annotations

import numpy as np

from .formats import BLOCK, KbitWeight, check_codebook, check_k, e4m4_decode, e4m4_encode
from .reference import finite_weights, nearest_index, pack_bitplanes

SCALE_FACTORS = tuple(np.linspace(0.6, 1.0, 9))   # ``scale_search``'s candidates, times the block's absmax


def _scales(blocks, cb, factors):
    """E4M4 bytes and their float64 values for blocks [n, 32]: absmax x the factor with the least squared error."""
    amax = np.abs(blocks).max(1)
    best, byte = np.full(len(blocks), np.inf), np.zeros(len(blocks), np.uint8)
    for f in factors:
        b_f = e4m4_encode(amax * f)
        s_f = e4m4_decode(b_f).astype(np.float64)
        y = blocks / np.maximum(s_f, 1e-30)[:, None]
        err = ((cb[nearest_index(y, cb)] - y) ** 2 * s_f[:, None] ** 2).sum(1)
        byte = np.where(err < best, b_f, byte)
        best = np.minimum(best, err)
    return byte, e4m4_decode(byte).astype(np.float64)


def fit_codebook(W, k=4, hessian=None, iters=20):
    """A codebook fitted to one layer's weights (Lloyd's algorithm): each weight divided by its block's E4M4 absmax
    (so every value is in [-1, 1]), the 2**k values that minimise the squared error of W, each weight's error
    counted times its block scale squared and, with ``hessian``, times its input's energy H[j, j]. Starts from the
    format's normal-float codebook; returns float32[2**k], sorted, in [-1, 1] (a KbitWeight's ``codebook``)."""
    k = check_k(k)
    cb = check_codebook(None, k).astype(np.float64)
    W = finite_weights(W).astype(np.float64)
    N, K = W.shape
    blocks = W.reshape(-1, BLOCK)
    s = e4m4_decode(e4m4_encode(np.abs(blocks).max(1))).astype(np.float64)
    v = np.clip(blocks / np.maximum(s, 1e-30)[:, None], -1, 1).reshape(-1)
    w = np.repeat(s ** 2, BLOCK)
    if hessian is not None:
        w = w * np.tile(np.maximum(np.diag(np.asarray(hessian, np.float64)), 0), N)
    for _ in range(iters):
        i = nearest_index(v, cb)
        mass = np.bincount(i, weights=w, minlength=cb.size)
        total = np.bincount(i, weights=w * v, minlength=cb.size)
        cb = np.where(mass > 0, total / np.maximum(mass, 1e-300), cb)
        cb = np.clip(np.sort(cb), -1, 1)
    return cb.astype(np.float32)


E4M4_VALUES = e4m4_decode(np.arange(256, dtype=np.uint8)).astype(np.float64)   # every scale a block can have


def asymmetric_target(W, X_float, X, damp=0.1):
    """The weight to quantize for a layer whose calibration inputs X [rows, K] come from the model with its earlier
    layers quantized, X_float [rows, K] from the float model on the same tokens: W* = argmin |X_float W^T - X W*^T|^2
    + lambda |W* - W|^2 = W + W (X_float - X)^T X (X^T X + lambda I)^-1, lambda = ``damp`` x the mean of X^T X's
    diagonal (as :func:`quantize_gptq` damps its Hessian; pass the same ``damp`` and the Hessian X^T X). With
    X = X_float it is W. The ridge pulls toward W, not toward zero: least squares alone would shrink W along the
    inputs' weak directions (on MiniLM that doubled the weight error and lowered the embeddings' cosine to 0.990).
    Returns float64 [N, K]."""
    W = finite_weights(W).astype(np.float64)
    X_float, X = (np.asarray(a, np.float64) for a in (X_float, X))
    if W.ndim != 2 or X.ndim != 2 or X.shape != X_float.shape or X.shape[1] != W.shape[1]:
        raise ValueError(f"W [N, K] with X and X_float [rows, K] of one shape, got {W.shape}, {X.shape}, "
                         f"{X_float.shape}")
    if damp <= 0:
        raise ValueError(f"damp must be > 0, got {damp}")
    H = X.T @ X
    H += damp * np.mean(np.diag(H)) * np.eye(len(H))
    return W + np.linalg.solve(H, (W @ ((X_float - X).T @ X)).T).T


def output_error(W, Q, H):
    """Per row: (w - q)^T H (w - q), the layer's squared output error on the calibration inputs (H = X^T X)."""
    D = W - Q
    return np.einsum("nk,nk->n", D @ H, D)


def refit_scales(W, idx, absmax, cb, H, sweeps=2):
    """Block scales (E4M4 bytes) that lower each row's output error :func:`output_error` with the indices fixed:
    coordinate descent over the blocks, each one's scale moved to the best of the E4M4 values next to the value
    that minimises the error with the other blocks held (a quadratic in it). Returns the new absmax bytes [N, nb]."""
    N, K = W.shape
    absmax = absmax.copy()
    C = cb[idx].astype(np.float64)                          # codebook values, [N, K]
    s = E4M4_VALUES[absmax]                                  # [N, nb]
    R = (W - C * np.repeat(s, BLOCK, axis=1)) @ H            # H (w - q) per row
    for _ in range(sweeps):
        for b in range(K // BLOCK):
            cols = slice(b * BLOCK, (b + 1) * BLOCK)
            Cb = C[:, cols]
            g = np.einsum("nj,nj->n", Cb, R[:, cols])        # -d(error)/d(scale) / 2
            a = np.einsum("nj,jk,nk->n", Cb, H[cols, cols], Cb)
            ok = a > 0
            target = s[:, b] + np.where(ok, g / np.where(ok, a, 1), 0)
            near = e4m4_encode(np.maximum(target, 0).astype(np.float32)).astype(np.int64)
            best_d, best_byte = np.zeros(N), absmax[:, b].astype(np.int64)
            for byte in (near - 1, near, near + 1):
                byte = np.clip(byte, 1, 255)
                d = E4M4_VALUES[byte] - s[:, b]
                gain = 2 * d * g - d * d * a                    # error decrease of moving by d
                better = gain > best_d
                best_d, best_byte = np.where(better, gain, best_d), np.where(better, byte, best_byte)
            delta = E4M4_VALUES[best_byte] - s[:, b]
            moved = delta != 0
            if np.any(moved):
                R[moved] -= (delta[moved, None] * Cb[moved]) @ H[cols, :]
                s[moved, b] = E4M4_VALUES[best_byte[moved]]
                absmax[:, b] = best_byte.astype(np.uint8)
    return absmax


def refine_indices(W, idx, scale, cb, H, sweeps=1):
    """Indices that lower each row's output error :func:`output_error` with the block scales and codebook held:
    coordinate descent, one column at a time, every row's index at that column moved to whichever of the 2**k
    codebook values lowers (w - q)^T H (w - q) most, or kept. GPTQ chooses each index once, in column order, with
    the later columns still free; this revisits them all with every other index known. Returns new indices [N, K]
    (uint8); the error never rises."""
    S = np.repeat(scale, BLOCK, axis=1)                     # each weight's block scale, [N, K]
    idx = idx.copy()
    R = (W - cb[idx] * S) @ H                               # H (w - q) per row
    for _ in range(sweeps):
        for j in range(W.shape[1]):
            i = idx[:, j]
            d = (cb[None, :] - cb[i][:, None]) * S[:, j, None]  # q's change for each candidate value, [N, 2**k]
            gain = 2 * d * R[:, j, None] - d * d * H[j, j]      # the error's decrease
            best = np.argmax(gain, axis=1)
            moved = gain[np.arange(len(i)), best] > 0
            if np.any(moved):
                R[moved] -= d[moved, best[moved], None] * H[j]
                idx[moved, j] = best[moved]
    return idx


def quantize_gptq(W, hessian, k=4, damp=0.1, act_order=True, scale_search=True, codebook=None, refine=0,
                  index_sweeps=0):
    """W[N, K] (K a multiple of 32), hessian[K, K] = X^T X over the layer's calibration inputs X[rows, K] ->
    :class:`KbitWeight` (flat layout, E4M4 absmax, NumPy arrays; ``KbitWeight.to_device()`` for the kernels).
    See the module docstring for ``damp``, ``act_order`` and ``scale_search``. ``refine``: rounds of block scales
    refitted to the output error (:func:`refit_scales`) and the indices chosen again by GPTQ with those scales; the
    round with the least output error is kept. ``index_sweeps``: then sweeps of :func:`refine_indices` over it."""
    k = check_k(k)
    cb = check_codebook(codebook, k).astype(np.float64)
    W = finite_weights(W).astype(np.float64)
    if W.ndim != 2 or W.shape[1] % BLOCK or W.shape[1] == 0:
        raise ValueError(f"W must be 2-D with K a positive multiple of {BLOCK}, got shape {W.shape}")
    N, K = W.shape
    H = np.array(hessian, dtype=np.float64)
    if H.shape != (K, K) or not np.all(np.isfinite(H)):
        raise ValueError(f"hessian must be a finite [K, K] = [{K}, {K}] matrix, got shape {H.shape}")
    if damp <= 0:
        raise ValueError(f"damp must be > 0, got {damp}")
    factors = SCALE_FACTORS if scale_search else (1.0,)
    dead = np.diag(H) == 0                          # inputs never seen: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += damp * np.mean(np.diag(H)) * np.eye(K)
    order = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(K)
    absmax = np.zeros((N, K // BLOCK), np.uint8)
    scale = np.zeros((N, K // BLOCK))
    if act_order:
        b, s = _scales(W.reshape(-1, BLOCK), cb, factors)
        absmax[:], scale[:] = b.reshape(N, -1), s.reshape(N, -1)
    U = np.linalg.cholesky(np.linalg.inv(H[np.ix_(order, order)])).T   # upper Cholesky of H^-1: the feedback

    def gptq_pass(fixed):
        """GPTQ over the columns in ``order``: indices [N, K] (and, unless ``fixed``, the block scales)."""
        Wo = W[:, order].copy()
        idx = np.zeros((N, K), np.uint8)
        for j in range(K):
            col, blk = order[j], order[j] // BLOCK
            if not fixed and j % BLOCK == 0:         # column order: the block's scale from its values now
                absmax[:, blk], scale[:, blk] = _scales(Wo[:, j:j + BLOCK], cb, factors)
            s = scale[:, blk]
            i = nearest_index(Wo[:, j] / np.maximum(s, 1e-30), cb)
            idx[:, col] = i
            err = (Wo[:, j] - cb[i] * s) / U[j, j]
            Wo[:, j + 1:] -= np.outer(err, U[j, j + 1:])
        return idx

    def error(idx):
        return output_error(W, cb[idx] * np.repeat(scale, BLOCK, axis=1), H).sum()

    idx = gptq_pass(act_order)
    best = (error(idx) if refine else 0.0, idx, absmax.copy())
    for _ in range(refine):                          # scales for these indices, then indices for those scales
        absmax[:] = refit_scales(W, idx, absmax, cb, H)
        scale[:] = E4M4_VALUES[absmax]
        for candidate in (idx, gptq_pass(True)):
            e = error(candidate)
            if e < best[0]:
                best = (e, candidate, absmax.copy())
    _, idx, absmax = best
    if index_sweeps:
        idx = refine_indices(W, idx, E4M4_VALUES[absmax], cb, H, index_sweeps)
    packed = pack_bitplanes(idx.reshape(N, K // BLOCK, BLOCK), k).reshape(-1)
    return KbitWeight(packed, absmax.reshape(-1), cb.astype(np.float32), k, (N, K), "flat", "e4m4")
