"""Whole-model decode step: ``python -m kbit_numba.bench --model llama3-8b`` (needs torch and a GPU).

One decode step runs every decoder layer of the model on a batch of B tokens (one new token per sequence)::

    h = rmsnorm(x);  x = x + W_o · attention(W_qkv · h)
    h = rmsnorm(x);  g, u = W_gate_up · h;  x = x + W_down · (silu(g) * u)

or, for a mixture-of-experts model (``qwen3-30b-a3b``), the second line per token t routed to experts e_1..e_top::

    h = rmsnorm(x);  x = x + sum_j p_j W_down[e_j] · silu_mul(W_gate_up[e_j] · h)

* **Linear layers**: QKV fused into one matrix and gate/up into one (as vLLM and TensorRT-LLM run them),
  random weights, each layer's weights in its own buffers (format variants quantize one random matrix per
  projection and copy it into every layer: the same values, separate memory, so no layer reads another's
  weights from the L2). fp16 runs ``nn.Linear`` (cuBLAS); the kbit_numba variants run
  ``kbit_numba.torch.KbitLinear``, the drop-in a user would use.
* **MoE experts** (the router's result taken as given: a fixed random top-k routing per layer, with softmax
  weights): the B * top_k (token, expert) rows are gathered in expert order (``gather_rows``, a Numba kernel;
  ``index_select`` on CPU tensors), run through the layer's gate/up experts and down experts, and summed back per token with their weights (``moe_combine``, a
  fused Numba kernel, as an engine's MoE sum; its torch twin on CPU tensors). kbit
  variants hold every layer's experts as ``KbitExperts`` per projection (see :class:`ExpertsKbit`: with float16 block sums
  the code layout through the grouped pair gemv while no expert has more than 4 rows (float32 sums at k = 2: while the
  step has at most 8 rows, on the fragment layout); the fragment or code layout
  through the tensor-core ``mma_gemv.grouped_gemv`` to 8 rows, else the tiled layout through ``grouped_gemm``; k = 3, 5 the tiled
  ``grouped_gemv`` up to 4 rows);
  fp16 runs one cuBLAS matmul per active expert (``torch.matmul``, as a plain PyTorch MoE does: a baseline
  with one launch per expert, not a fused MoE kernel). The other formats have no grouped kernels: their rows
  report that. All of a layer's experts are in memory (128 at qwen3-30b-a3b: ~58 GB in fp16); a step reads
  only the active ones.
* **Attention stand-in** (a fixed cost, named in the report): the new token's query over a fixed
  ``context``-token fp16 KV cache per layer (GQA); the new token's k and v are not appended, and no rotary
  embedding is applied. On the GPU ``decode_attention``, a fused Numba kernel that splits the cache over CTAs
  (flash decoding, as an engine's decode attention; a ``pdl`` step launches it early, so it loads the cache
  as the QKV projection's CTAs leave; on dense models at batch 1 the norm before that projection has already asked
  the L2 for the layer's cache: ``NORM_PREFETCH_CTAS``) and merges a head's slices in their thread block cluster's
  shared memory where the launch allows (:func:`att_cluster`); ``attention="sdpa"`` runs torch's
  ``scaled_dot_product_attention`` instead (the stand-in before 2026-11-26), as do CPU tensors.
* **RMSNorm, SiLU, residual** (and the MoE sum): small fused Numba kernels, as an inference engine runs them (vLLM's
  ``fused_add_rms_norm`` and ``silu_and_mul``): ``add_rmsnorm`` (residual += y; h = rmsnorm(residual) * w)
  and ``silu_mul`` (silu(g) * u); their torch twins run on CPU tensors (the simulator) and test them on the
  GPU. Not in the step: embedding, final norm, lm_head, sampling.
* **SiLU in the gate/up gemv** (kbit variants on the code layout: :func:`fuses_silu`): the gate/up weight (every
  gate/up expert) is quantized with its rows interleaved (gate row j at 2j, up row j at 2j + 1), and where the
  layer's call runs the pair gemv or the tensor-core gemv (either grouped for experts) its epilogue writes silu(g) * u
  (``KbitLinear.run(x, silu_pairs=True)``, ``ExpertsKbit.bind(silu_pairs=True)``): no SiLU kernel and no [B, 2I]
  output. Batches that run another kernel use ``silu_pairs``, the SiLU kernel for interleaved pairs.
* **Timing**: the whole step is captured in one CUDA graph (``torch.cuda.graph``) and replayed; the step
  time is the median over replays queued back to back (CUDA events between them: ``_timing.replay_us``). The
  linear-only time is a second graph of the same layers' linear calls alone (the gate/up through its SiLU epilogue
  where the step runs it so), so "linear share" = linear-only / step.
"""
from __future__ import annotations

import gc
import math
import time
import traceback

import numpy as np
from numba import cuda, float32, int32, uint32, uint64

from .dispatch import EPILOGUE_GEMVS

# Shapes from the published configs (hidden_size, intermediate_size, heads, kv heads, head_dim, layers).
MODELS = {
    "llama3-8b": dict(hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, layers=32),
    # MoE: every layer's MLP is `experts` experts of `expert_intermediate`, each token routed to `top_k`
    "qwen3-30b-a3b": dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, layers=48, experts=128,
                          expert_intermediate=768, top_k=8),
}
CONTEXT = 1024                  # tokens in the attention stand-in's KV cache
# the attention stand-in's kernel: "numba" decode_attention, "sdpa" torch's SDPA, "auto" decode_attention up to
# ATT_MAX_BATCH rows and SDPA above (where it was faster: 26 vs 33 us a call at batch 16, benchmarks/README.md)
ATTENTIONS = ("auto", "numba", "sdpa")
ATT_MAX_BATCH = 4
BATCHES = (1, 4, 16)
# variant name -> (format, KbitLinear options); "fp16" is nn.Linear (cuBLAS)
VARIANTS = {
    "fp16": None,
    "kbit k=2": ("kbit", dict(k=2)), "kbit k=3": ("kbit", dict(k=3)),
    "kbit k=4": ("kbit", dict(k=4)), "kbit k=5": ("kbit", dict(k=5)),
    "kbit k=4 tiled": ("kbit", dict(k=4, layout="tiled")),
    "kbit k=2 pdl": ("kbit", dict(k=2, pdl=True)),
    "kbit k=2 pdl f16_acc": ("kbit", dict(k=2, pdl=True, f16_acc=True)),
    "kbit k=4 pdl": ("kbit", dict(k=4, pdl=True)),
    "kbit k=4 pdl f16_acc": ("kbit", dict(k=4, pdl=True, f16_acc=True)),
    # the fragment layout (KbitLinear(layout="fragments")): the tensor-core gemv at every B <= 16
    "kbit k=2 pdl frag": ("kbit", dict(k=2, pdl=True, layout="fragments")),
    "kbit k=4 pdl frag": ("kbit", dict(k=4, pdl=True, layout="fragments")),
    "uniform 4-bit g128": ("uniform", dict(bits=4, group_size=128)),
    "bitnet": ("bitnet", dict(parts=1)),
}
_QUANTIZE_KEYS = ("k", "bits", "group_size", "parts")      # the options that change the quantized bytes


def is_moe(cfg):
    return "experts" in cfg


def projections(cfg):
    """(name, N, K) of one decoder layer's linear layers, in the order the step runs them (for a MoE model,
    the shapes of one expert's gate_up and down: every expert has them)."""
    H, hd = cfg["hidden"], cfg["head_dim"]
    I = cfg["expert_intermediate"] if is_moe(cfg) else cfg["intermediate"]
    q, kv = cfg["heads"] * hd, cfg["kv_heads"] * hd
    return [("qkv", q + 2 * kv, H), ("o", H, q), ("gate_up", 2 * I, H), ("down", H, I)]


def dense_shapes(model):
    """The "KxN" shapes of ``model``'s linear layers that run as one weight each (``bench --shapes llama3-8b``):
    every projection of a dense model; of a MoE model, QKV and O (its experts run in the grouped kernels)."""
    check_names(model, [])
    cfg = MODELS[model]
    return [f"{K}x{N}" for name, N, K in projections(cfg) if not is_moe(cfg) or name in ("qkv", "o")]


def layer_params(cfg):
    """Weights of one decoder layer's linear layers (all experts of a MoE layer; no router)."""
    per = [N * K for _, N, K in projections(cfg)]
    return per[0] + per[1] + (cfg["experts"] if is_moe(cfg) else 1) * (per[2] + per[3])


def routing(cfg, B, rng):
    """A router's result taken as given: each of B tokens picks top_k distinct experts with softmax weights.
    Returns (src, inv, weights, offsets): row r of the expert-sorted batch is token src[r]; token b's j-th
    choice is row inv[b * top_k + j]; weights [B, top_k] float32; offsets int32 [E + 1] (expert e's rows are
    offsets[e] .. offsets[e + 1] - 1)."""
    E, top = cfg["experts"], cfg["top_k"]
    experts = np.stack([rng.choice(E, top, replace=False) for _ in range(B)])          # [B, top_k]
    logits = rng.standard_normal((B, top))
    weights = (np.exp(logits) / np.exp(logits).sum(1, keepdims=True)).astype(np.float32)
    order = np.argsort(experts.reshape(-1), kind="stable")                             # pair -> sorted row
    src = (order // top).astype(np.int64)
    inv = np.empty(B * top, np.int64)
    inv[order] = np.arange(B * top)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(experts.reshape(-1), minlength=E))]).astype(np.int32)
    return src, inv, weights, offsets


def uses_pdl(variant):
    """Whether ``variant``'s linears are programmatic dependent launches: then the step's fused kernels are too
    (an engine that uses PDL uses it throughout; a kernel without it would break the chain of early starts)."""
    return bool(VARIANTS[variant] and VARIANTS[variant][1].get("pdl"))


def check_names(model, variants):
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}: known models are {', '.join(MODELS)}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown format variant(s) {unknown}: known variants are {', '.join(VARIANTS)}")


# add_rmsnorm: one CTA of norm_threads(H) per token row. At batch 1 it is load latency, not bandwidth, so a thread
# issues all its 16-byte loads (its ceil(H / 8 / threads) chunks of res, y and w) before it uses one, and
# keeps the row in registers as float16 pairs between the sum of squares and the scaling (loads and stores to
# the same arrays interleaved would wait one by one: the compiler cannot move a load past a store that may
# alias it). The sum is a warp shuffle tree plus one shared word per warp (one barrier). A row takes one 16-byte
# chunk a thread (H / 8 threads) between NORM_THREADS and NORM_MAX_THREADS: few registers, so the CTA fits beside a
# 512-thread gemv CTA on the same SM, which a programmatic launch needs. 512 threads (one chunk each) against 256
# (two) made llama3-8b's B = 1 step 5.5 +- 0.5 us faster at k = 4 over six rounds (H200, benchmarks/README.md,
# "Fifty-sixth session"); rows of 2048 (qwen3) keep 256, one chunk each already.
# silu_mul, gather_rows, moe_combine: one thread per output element, 256 a CTA, a grid over (columns, rows).
NORM_THREADS = 256
NORM_MAX_THREADS = 512
# A register cap for add_rmsnorm's builds (None: none), an A/B knob: since the sixty-third session the k = 4 down gemv
# runs one 28-warp CTA an SM (57,344 registers), beside which only a CTA of <= 8,192 registers fits; the norm's 512
# threads at 32 registers do not, so the layer's first norm, and the QKV gemv's CTAs after it, start only as down's
# CTAs leave (benchmarks/README.md, "Seventieth session": the step's CTAs in time). 256 threads at 32 registers would
# fit; the prefetch build takes 40 there (local ptxas), 32 with this cap and no spills.
NORM_MAX_REGISTERS = None
HALVES_PER_CHUNK = 8            # float16 values in one 16-byte load
# The attention's cache prefetched by the norm before the QKV gemv: that many more CTAs in the layer's first
# add_rmsnorm, which wait for the kernel before (so the lines arrive during the QKV gemv and are not evicted by the
# layer before's weights) and then ask the L2 for the layer's K and V cache, line i by CTA i % CTAs
# (prefetch.global.L2). A CTA of prefetches retires only once its lines have arrived, so the norm ends later, and the
# QKV gemv, which waits for it, with it: spread over 128 CTAs (32 KB an SM at llama3-8b's batch 1, 4 MB) that cost
# is smaller than what the attention gains. Measured on the H200 (benchmarks/README.md, "Fifty-seventh session"):
# llama3-8b batch 1 -13..-24 us a step (k = 4 and 2; 32 CTAs: +25 at k = 2, 8: +31..+101, 256: as 128 at k = 4, -4..-11
# at k = 2); slower at llama3-8b batch 4 (+37..+46 us, a 16 MB cache) and qwen3-30b-a3b batch 1 (+24..+37, MoE), so it
# runs at batches up to NORM_PREFETCH_MAX_BATCH on dense models only. 0 CTAs: never.
NORM_PREFETCH_CTAS = 128
NORM_PREFETCH_MAX_BATCH = 1     # (prefetching before the wait, during the layer before, lost: its lines were partly
                                # evicted by the attention's turn; k = 2 -9 us, k = 4's attention +10)
LINE_WORDS = 32                 # uint32 words in one 128-byte L2 line
SILU_THREADS = 256
# decode_attention (flash decoding): the new token's query of each head over the KV cache, split along the cache
# so that a batch-1 step fills the GPU (8 KV heads alone would be 8 CTAs). One CTA per (row b, KV head, slice of
# warps x 16 tokens) serves the KV head's whole group of query heads, so each cache row is read once; every lane
# issues all its K and V loads first (the cache is no kernel's output, so with PDL before the wait). Both products
# run on the tensor cores: scalar float32 versions (16 lanes a row, shuffle trees) issued ~1300 instructions a warp
# per 4 tokens and took 9-19 us a call, slower than torch's SDPA (benchmarks/README.md). A CTA writes its slice's
# softmax max, sum and weighted V sum (float32); the last CTA of a (b, KV head) to finish, found by an atomic count
# that it resets, merges the slices and writes the float16 output. The cluster build (sm_90) merges them in the
# (b, KV head)'s thread block cluster instead: each CTA stores its slice's sums into the shared memory of the CTA that
# merges them (distributed shared memory, st.async stores that count their bytes on that CTA's mbarrier), and each CTA
# merges from its own shared memory once its bytes have landed, in place of the L2 stores, the fence, the count and the
# L2 loads (7.2 -> 4.8 us a call at batch 1 with a cluster barrier, 4.1 us with the mbarriers; benchmarks/README.md).
ATT_TILE = 16                   # tokens a warp takes: one m16 tile
ATT_HEAD_DIM = 128              # the fragment mapping's head_dim (llama3-8b's and qwen3's)
ATT_WARPS = 8                   # at most: 128-token slices (fewer slices to merge where the batch fills the GPU)
ATT_MIN_CTAS = 64               # fewer warps a CTA (shorter slices) until the step has this many CTAs (128 until
                                # the fifty-sixth session: llama3-8b's B = 1 attention in 128 CTAs of 4 warps; 64 of
                                # 8 made its k = 4 step 9.5 +- 0.7 us faster, benchmarks/README.md),
ATT_MERGE_SLICES = 64           # while slices x query heads a group stay within this (qwen3 at batch 1, 2 warps:
                                # 256, the last CTAs' merge made the call 21 us; 8 warps: 64, 11 us under ncu)
ATT_MAX_CLUSTER = 16            # the slices of a (row, KV head) merge in their thread block cluster's shared memory
                                # (H100: at most 16 CTAs a cluster) instead of through the L2 and a count (sm_90, not
                                # on the simulator, which runs one CTA at a time)
_KERNELS = {}

# The layer's second add + norm inside its linears: the o gemv adds its product into the residual stream in place
# (``pair_gemv`` ``accumulate``), and the gate/up gemv scales its product by 1 / rms(res) in the epilogue (``rms_eps``,
# the squares summed from the activations it loads; the norm's weight folded into gate/up's: ones here); no
# add_rmsnorm launch between them. Where both run the pair gemv with float16 sums (dense models on the GPU:
# :func:`norm_in_gate_up`), at the k and batches where it was measured (H200, llama3-8b B = 1, three rounds each):
# k = 4 16.0 +- 0.9 us a step faster than the norm launch with the squares summed by the o gemv ("Sixty-fifth
# session"), and 8.3 +- 0.5 faster again with them summed by the gate/up gemv that reads them (o -14, the attention
# +16: "Sixty-ninth session", benchmarks/README.md); k = 2 13.0 +- 0.9 faster than the norm launch (norm2's 43 us
# gone, gate/up +33; with the squares in o it had been 48-49 us slower). B > 1 keeps the launch (not yet measured).
# NORM_IN_QKV: where the second norm runs inside, the first one too, inside the QKV gemv (``rms_eps``), the down gemv
# adding its product into the residual stream (``accumulate``): no add_rmsnorm launch in the step at all, and no
# prefetch of the attention's cache, which that launch made (NORM_PREFETCH_CTAS). Measured slower (k = 4: +12.6 us a
# step against the second norm alone, +9.6 with QKV's rule at cols = 2; k = 2: +9.7), so off.
NORM_IN_GATE_UP = True
NORM_IN_GATE_UP_K = (2, 4)
NORM_IN_GATE_UP_MAX_BATCH = 1
NORM_IN_QKV = False
NORM_EPS = 1e-6                 # the RMSNorms' epsilon


def norm_threads(H):
    """add_rmsnorm's threads for rows of H float16 values: one 16-byte chunk a thread, a whole number of warps, within
    NORM_THREADS .. NORM_MAX_THREADS (4096: 512; 2048 and shorter: 256)."""
    return min(NORM_MAX_THREADS, max(NORM_THREADS, -(-H // (HALVES_PER_CHUNK * 32)) * 32))


def _kernel(name, width=0, pdl=False, cluster=False, prefetch=False):
    """A fused elementwise kernel, compiled once per (name, row width, pdl, cluster, prefetch). ``pdl``: built for a
    programmatic dependent launch (sm_90): it lets the next kernel start at once (that kernel's weight loads and
    tables overlap this one) and waits for the kernel before it before reading anything. ``cluster``
    (decode_attention): a (row, KV head)'s slices merge in their cluster's shared memory (launch with
    ``cluster=`` the slices a head: :func:`att_cluster`). ``prefetch`` (add_rmsnorm): two more arguments, the
    attention cache's K and V words, which the CTAs past the rows prefetch into the L2 (``NORM_PREFETCH_CTAS``)."""
    key = (name, width if name in ("add_rmsnorm", "decode_attention") else 0, pdl, cluster, prefetch)
    if key not in _KERNELS:
        from .device import inlined, jit_kernel
        from .intrinsics import (cluster_arrive, cluster_rank, cluster_wait, f16_bits_to_f32, f16x2_as_u32,
                                 griddep_launch_dependents, griddep_wait, ld128, ldg128, lds128, mbar_expect_tx,
                                 mbar_init_cluster, mbar_try_wait, mma_f16, prefetch_l2, prmt, shared_addr, st_async_x2,
                                 st_async_x4, stg128, u32_as_f32)
        PDL, CLUSTER = pdl, cluster
        # what the kernel before writes: with PDL an ordinary load after the wait (an ld.global.nc may be moved above
        # it by ptxas: tests/test_pdl_reads.py); what no kernel writes (norm weights, the cache) keeps ldg128
        load_prev = ld128 if PDL else ldg128

        @inlined
        def pdl_start():
            """The pdl build's prologue: let the next kernel start now, then wait for the one before."""
            if PDL:
                griddep_launch_dependents()
                griddep_wait()

        if name == "add_rmsnorm":
            H = width
            CHUNKS = H // HALVES_PER_CHUNK                      # 16-byte chunks of a row
            THREADS = norm_threads(H)
            CPT = -(-CHUNKS // THREADS)                         # chunks a thread keeps
            WORDS, WARPS, SLOTS = H // 2, THREADS // 32, 4 * CPT

            @inlined
            def norm_row(res, y, w, h, eps, t, b):
                """res[b] += y[b] (float16, in place); h[b] = res[b] / rms(res[b]) * w (float32 sum of squares).
                The arrays are the rows' float16 pairs as flat uint32 words."""
                ww = cuda.local.array(SLOTS, uint32)            # w words
                rw = cuda.local.array(SLOTS, uint32)            # res words, then res + y
                yw = cuda.local.array(SLOTS, uint32)            # y words
                for i in range(CPT):                            # the norm weights are no kernel's output:
                    c = t + i * THREADS                         # loaded before the wait
                    if c < CHUNKS:
                        ww[4 * i], ww[4 * i + 1], ww[4 * i + 2], ww[4 * i + 3] = ldg128(w, 4 * c)
                pdl_start()
                for i in range(CPT):
                    c = t + i * THREADS
                    if c < CHUNKS:
                        rw[4 * i], rw[4 * i + 1], rw[4 * i + 2], rw[4 * i + 3] = load_prev(res, b * WORDS + 4 * c)
                        yw[4 * i], yw[4 * i + 1], yw[4 * i + 2], yw[4 * i + 3] = load_prev(y, b * WORDS + 4 * c)
                acc = float32(0)
                for i in range(CPT):
                    c = t + i * THREADS
                    if c < CHUNKS:
                        for q in range(4):
                            r, a = rw[4 * i + q], yw[4 * i + q]
                            s = f16x2_as_u32(f16_bits_to_f32(r) + f16_bits_to_f32(a),          # (rounded to
                                             f16_bits_to_f32(r >> 16) + f16_bits_to_f32(a >> 16))  # float16: what
                            rw[4 * i + q] = s                                           # the next layer reads)
                            lo, hi = f16_bits_to_f32(s), f16_bits_to_f32(s >> 16)
                            acc += lo * lo + hi * hi
                        stg128(res, b * WORDS + 4 * c, rw[4 * i], rw[4 * i + 1], rw[4 * i + 2], rw[4 * i + 3])
                off = 16
                while off > 0:                                  # the warp's sum
                    acc += cuda.shfl_xor_sync(0xFFFFFFFF, acc, off)
                    off //= 2
                part = cuda.shared.array(WARPS, float32)
                if t % 32 == 0:
                    part[t // 32] = acc
                cuda.syncthreads()
                total = float32(0)
                for i in range(WARPS):
                    total += part[i]
                inv = float32(1) / math.sqrt(total / float32(H) + float32(eps))
                for i in range(CPT):
                    c = t + i * THREADS
                    if c < CHUNKS:
                        o = cuda.local.array(4, uint32)
                        for q in range(4):
                            r, g = rw[4 * i + q], ww[4 * i + q]
                            o[q] = f16x2_as_u32(f16_bits_to_f32(r) * inv * f16_bits_to_f32(g),
                                                f16_bits_to_f32(r >> 16) * inv * f16_bits_to_f32(g >> 16))
                        stg128(h, b * WORDS + 4 * c, o[0], o[1], o[2], o[3])

            if not prefetch:
                def kernel(res, y, w, h, eps):
                    """norm_row of row blockIdx.x."""
                    norm_row(res, y, w, h, eps, cuda.threadIdx.x, cuda.blockIdx.x)
            else:
                def kernel(res, y, w, h, eps, kc, vc):
                    """norm_row of row blockIdx.x; the CTAs past the rows (the grid's rest) ask the L2 for every
                    128-byte line of kc and vc (the attention's cache, read two kernels later), after the wait,
                    so that the lines arrive while the QKV gemv runs, not while the layer before still streams
                    its weights. They touch no output."""
                    t, b, rows = cuda.threadIdx.x, cuda.blockIdx.x, h.size // WORDS
                    if b < rows:
                        norm_row(res, y, w, h, eps, t, b)
                        return
                    pdl_start()
                    ctas, lines = cuda.gridDim.x - rows, kc.size // LINE_WORDS
                    for i in range(b - rows + ctas * t, 2 * lines, ctas * THREADS):  # line i: CTA i % ctas (a
                        if i < lines:                                               # CTA's lines spread over
                            prefetch_l2(kc, i * LINE_WORDS)                         # all of them: an SM issues
                        else:                                                       # its prefetches at its own
                            prefetch_l2(vc, (i - lines) * LINE_WORDS)               # rate, as loads)
            kernel = jit_kernel(kernel, NORM_MAX_REGISTERS)

        elif name == "decode_attention":
            G, NKV, HD, S, WARPS = width        # query heads per KV head, KV heads, head_dim, cache tokens, warps
            THREADS = 32 * WARPS
            CTA_TOKENS = WARPS * ATT_TILE       # a warp: one 16-token tile
            SPLITS = S // CTA_TOKENS            # CTAs (slices) per (b, KV head)
            HW = HD // 2                        # words in one head's row
            QROW = (NKV * G + 2 * NKV) * HW     # words in one row of the fused QKV output
            SCALE = 1.0 / math.sqrt(HD)
            K_LOADS = HD // 32                  # 16-byte loads of a K row a lane makes (2 k16 steps each)
            DIM_TILES = HD // 16                # m16 tiles of O^T's head_dim rows
            DPL = HD // 32                      # output dims a lane merges
            MERGE_CHUNK = min(SPLITS, 64 // DPL)  # slices whose values a lane loads at once (64 values)
            MERGE_VALUES = MERGE_CHUNK * DPL
            CTA_VALUES = G * HD
            VPC = CTA_VALUES // SPLITS          # cluster merge: output values a CTA of the cluster merges
            RECV_BYTES = 4 * SPLITS * (VPC + 2 * G)     # and the bytes it receives: every slice's values and stats
            K_WORDS, V_WORDS, Q_WORDS = 8 * K_LOADS, 32, 4 * K_LOADS    # a lane's registers of K, V and q words
            if (HD != ATT_HEAD_DIM or G > 8 or S % CTA_TOKENS or SPLITS > 32 or SPLITS % MERGE_CHUNK
                    or cluster and (SPLITS > ATT_MAX_CLUSTER or CTA_VALUES % SPLITS or VPC % 4)):
                raise ValueError(f"decode_attention: no build for {width}, cluster={cluster} (attention_plan says why)")

            @inlined
            def slice_value(w_acc, o):
                """Output value o of the slice (w_acc's order): its warps' sums added up."""
                a = float32(0)
                for w in range(WARPS):
                    a += w_acc[w, o]
                return a

            @inlined
            def slice_values4(w_acc, at, o):
                """slice_value of o .. o + 3 (o a multiple of 4), by 16-byte loads: a warp's loads of 4 adjacent values a
                lane take 4 wavefronts a warp, where 4 scalar loads would each meet 4-way bank conflicts."""
                a0, a1, a2, a3 = float32(0), float32(0), float32(0), float32(0)
                for w in range(WARPS):
                    x0, x1, x2, x3 = lds128(w_acc, at + 4 * (w * CTA_VALUES + o))
                    a0, a1, a2, a3 = a0 + u32_as_f32(x0), a1 + u32_as_f32(x1), a2 + u32_as_f32(x2), a3 + u32_as_f32(x3)
                return a0, a1, a2, a3

            @inlined
            def slice_stats(w_m, w_l, h):
                """Head h's max score over the slice and its sum of exp(score - the warp's max), the warps' combined."""
                tot, mx = float32(0), w_m[0, h]
                for w in range(WARPS):
                    tot += w_l[w, h]
                    mx = max(mx, w_m[w, h])
                return mx, tot

            @jit_kernel
            def kernel(qkv, kc, vc, out, part, stats, count):
                """out[b, (kvh G + h) HD + d] = softmax(q . K^T / sqrt(HD)) V for query head kvh G + h. qkv, kc, vc:
                float16 pairs as flat uint32 words of [B, QROW] and [B, NKV, S, HD]; out [B, NKV G HD] float16;
                part, stats: float32 [B NKV SPLITS G HD], [B NKV SPLITS G 2]; count int32 [B NKV], zero (the count
                merge's; the cluster build, launched in clusters of SPLITS CTAs, leaves them untouched).

                Both products on the tensor cores (mma m16n8k16, float32 sums), the cache as the A operand and the
                group's queries (n8: up to 8 heads) as B, so the 16-byte rows feed A with no shared memory:
                  S^T = K Q^T: A row g = token g. A lane loads 16 bytes of its rows at head dims 32 kk + 8 t; words
                    0, 1 are its k16 step 2 kk, words 2, 3 step 2 kk + 1 (a dot product may take the dims in any
                    order, so long as Q's B fragment takes them in the same one).
                  O^T = V^T P^T: A row g = dim 8 g + m of tile m, row g + 8 = dim 64 + 8 g + m; k = token 2 t, 2 t + 1,
                    2 t + 8, 2 t + 9: a lane loads those four tokens' dims 8 g .. and 64 + 8 g .. and pairs two
                    tokens' halves into one register (prmt). P^T's B fragment comes from S's C by 4 shuffles."""
                t = cuda.threadIdx.x
                # the cluster build's receive buffers: every slice's values VPC r .. and its stats, written by the
                # slices' st.async stores, which count their bytes on the mbarrier
                recv_v = cuda.shared.array((SPLITS if CLUSTER else 1, VPC if CLUSTER else 1), float32, alignment=16)
                recv_s = cuda.shared.array((SPLITS if CLUSTER else 1, G if CLUSTER else 1, 2), float32, alignment=16)
                recv_bar = cuda.shared.array(1, uint64)
                if CLUSTER:
                    if t == 0:                              # the barrier completes when RECV_BYTES have landed
                        mbar_init_cluster(shared_addr(recv_bar), 1)
                        mbar_expect_tx(shared_addr(recv_bar), RECV_BYTES)
                    cluster_arrive()                        # (no CTA stores into another before all have started)
                lane, warp = t % 32, t // 32
                g, tq = lane // 4, lane % 4                 # the mma fragments' row group and column pair
                cta = cuda.blockIdx.x
                bh, split = cta // SPLITS, cta % SPLITS     # bh = b * NKV + kvh
                b, kvh = bh // NKV, bh % NKV
                tok0 = bh * S + split * CTA_TOKENS + warp * ATT_TILE
                kw = cuda.local.array(K_WORDS, uint32)  # [row g, g + 8][load kk][4]
                for r in range(2):
                    for kk in range(K_LOADS):
                        i = 4 * (K_LOADS * r + kk)
                        kw[i], kw[i + 1], kw[i + 2], kw[i + 3] = ldg128(kc, (tok0 + g + 8 * r) * HW + 16 * kk + 4 * tq)
                vw = cuda.local.array(V_WORDS, uint32)  # [token 2t, 2t + 1, 2t + 8, 2t + 9][dims 8g, 64 + 8g][4]
                for x in range(4):
                    for hh in range(2):
                        i = 8 * x + 4 * hh
                        vw[i], vw[i + 1], vw[i + 2], vw[i + 3] = ldg128(
                            vc, (tok0 + 2 * tq + x % 2 + 8 * (x // 2)) * HW + HW // 2 * hh + 4 * g)
                w_m = cuda.shared.array((WARPS, 8), float32)        # each warp's max score per head
                w_l = cuda.shared.array((WARPS, 8), float32)        # and its sum of exp(score - the slice's max)
                w_acc = cuda.shared.array((WARPS, CTA_VALUES), float32, alignment=16)  # and its P V, [head, 64 hi + 8 m + g]
                pdl_start()
                qw = cuda.local.array(Q_WORDS, uint32)  # head g's dims 32 kk + 8 t .. (zero: no such head)
                for kk in range(K_LOADS):
                    for j in range(4):
                        qw[4 * kk + j] = uint32(0)
                    if g < G:
                        qw[4 * kk], qw[4 * kk + 1], qw[4 * kk + 2], qw[4 * kk + 3] = load_prev(
                            qkv, b * QROW + (kvh * G + g) * HW + 16 * kk + 4 * tq)
                c0, c1, c2, c3 = float32(0), float32(0), float32(0), float32(0)
                for kk in range(K_LOADS):
                    for hw in range(2):                     # k16 steps 2 kk, 2 kk + 1
                        i, j = 4 * kk + 2 * hw, 4 * (K_LOADS + kk) + 2 * hw
                        c0, c1, c2, c3 = mma_f16(kw[i], kw[j], kw[i + 1], kw[j + 1], qw[i], qw[i + 1], c0, c1, c2, c3)
                # scores of (token g, head 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
                s0, s1, s2, s3 = c0 * float32(SCALE), c1 * float32(SCALE), c2 * float32(SCALE), c3 * float32(SCALE)
                ma, mb = max(s0, s2), max(s1, s3)           # heads 2t, 2t + 1: the warp's max over its 16 tokens
                for off in (4, 8, 16):
                    ma = max(ma, cuda.shfl_xor_sync(0xFFFFFFFF, ma, off))
                    mb = max(mb, cuda.shfl_xor_sync(0xFFFFFFFF, mb, off))
                if g == 0:
                    w_m[warp, 2 * tq], w_m[warp, 2 * tq + 1] = ma, mb
                cuda.syncthreads()
                for w in range(WARPS):                      # the slice's max
                    ma, mb = max(ma, w_m[w, 2 * tq]), max(mb, w_m[w, 2 * tq + 1])
                p0, p1, p2, p3 = math.exp(s0 - ma), math.exp(s1 - mb), math.exp(s2 - ma), math.exp(s3 - mb)
                la, lb = p0 + p2, p1 + p3
                for off in (4, 8, 16):
                    la += cuda.shfl_xor_sync(0xFFFFFFFF, la, off)
                    lb += cuda.shfl_xor_sync(0xFFFFFFFF, lb, off)
                if g == 0:
                    w_l[warp, 2 * tq], w_l[warp, 2 * tq + 1] = la, lb
                # P^T's B fragment: b0 = P[head g][tokens 2t, 2t + 1], b1 = tokens 2t + 8, 2t + 9. Token r's (r < 8)
                # scores of heads 2u, 2u + 1 are (p0, p1) of lane 4 r + u, and token r + 8's its (p2, p3).
                pa, pb = int32(f16x2_as_u32(p0, p1)), int32(f16x2_as_u32(p2, p3))     # (shfl takes signed ints)
                src = 8 * tq + g // 2
                half = uint32(0x7632) if g % 2 else uint32(0x5410)  # (the high halves for an odd head)
                b0 = prmt(cuda.shfl_sync(0xFFFFFFFF, pa, src), cuda.shfl_sync(0xFFFFFFFF, pa, src + 4), half)
                b1 = prmt(cuda.shfl_sync(0xFFFFFFFF, pb, src), cuda.shfl_sync(0xFFFFFFFF, pb, src + 4), half)
                for m in range(DIM_TILES):                  # O^T tile m: dims 8 g + m (rows g), 64 + 8 g + m (g + 8)
                    sel = 0x5410 if m % 2 == 0 else 0x7632
                    i = m // 2
                    d0, d1, d2, d3 = mma_f16(prmt(vw[i], vw[8 + i], sel), prmt(vw[4 + i], vw[12 + i], sel),
                                             prmt(vw[16 + i], vw[24 + i], sel), prmt(vw[20 + i], vw[28 + i], sel),
                                             b0, b1, float32(0), float32(0), float32(0), float32(0))
                    if 2 * tq < G:                          # (head 2t, dims 8g + m and 64 + 8g + m)
                        w_acc[warp, 2 * tq * HD + 8 * m + g] = d0
                        w_acc[warp, 2 * tq * HD + HD // 2 + 8 * m + g] = d2
                    if 2 * tq + 1 < G:
                        w_acc[warp, (2 * tq + 1) * HD + 8 * m + g] = d1
                        w_acc[warp, (2 * tq + 1) * HD + HD // 2 + 8 * m + g] = d3
                cuda.syncthreads()
                if CLUSTER:
                    # The cluster merge: each CTA sends its slice's sums and stats into the shared memory of the CTA
                    # that merges them (CTA r: output values r VPC ..) with st.async stores, which count their bytes
                    # on the receiver's mbarrier, and each CTA merges from its own shared memory once its barrier says
                    # every byte has landed. No global round trip, no count, and no cluster barrier: a CTA waits for
                    # its own data only, and none touches another's memory after its stores.
                    cluster_wait()                          # (every CTA has started: its buffers and barrier exist)
                    v_at, s_at, bar, a_at = shared_addr(recv_v), shared_addr(recv_s), shared_addr(recv_bar), shared_addr(w_acc)
                    for o in range(4 * t, CTA_VALUES, 4 * THREADS):     # 4 of the slice's sums: 16 bytes to CTA r
                        a0, a1, a2, a3 = slice_values4(w_acc, a_at, o)
                        st_async_x4(v_at + 4 * (split * VPC + o % VPC), o // VPC, a0, a1, a2, a3, bar)
                    for i in range(t, SPLITS * G, THREADS):     # head h's max and sum to CTA r
                        r, h = i // G, i % G
                        mx, tot = slice_stats(w_m, w_l, h)
                        st_async_x2(s_at + 8 * (split * G + h), r, mx, tot, bar)
                    if warp == 0:                           # one warp polls the barrier (its first phase), the
                        while not mbar_try_wait(bar, 0):    # others wait in the CTA barrier and issue nothing
                            pass                            # (8 polling warps: qwen3's B = 4 step 7-24 us slower)
                    cuda.syncthreads()
                    r = cluster_rank()
                    for o in range(t, VPC, THREADS):
                        x = r * VPC + o                         # value x of the head's 64 hi + 8 m + g order
                        h = x // HD
                        mx = recv_s[0, h, 0]
                        for sp in range(1, SPLITS):
                            mx = max(mx, recv_s[sp, h, 0])
                        num, den = float32(0), float32(0)
                        for sp in range(SPLITS):
                            e = math.exp(recv_s[sp, h, 0] - mx)
                            num += recv_v[sp, o] * e
                            den += recv_s[sp, h, 1] * e
                        x %= HD                                 # (dim 64 hi + 8 g + m)
                        out[b, (kvh * G + h) * HD + x // 64 * 64 + 8 * (x % 8) + x % 64 // 8] = num / den
                    return
                for o in range(t, CTA_VALUES, THREADS):     # the slice's sums (in w_acc's order: coalesced stores)
                    part[cta * CTA_VALUES + o] = slice_value(w_acc, o)
                for h in range(G):
                    if t == h:
                        mx, tot = slice_stats(w_m, w_l, h)
                        stats[2 * (cta * G + h)], stats[2 * (cta * G + h) + 1] = mx, tot
                # The count: one thread fences and counts for the CTA (the barrier orders the others' writes before
                # its fence; a fence in every thread kept each warp waiting for its own stores to reach the L2).
                cuda.syncthreads()
                done = cuda.shared.array(1, int32)          # slices finished before this one
                if t == 0:
                    cuda.threadfence()                      # (the slice's writes before the count)
                    done[0] = cuda.atomic.add(count, bh, 1)
                    if done[0] == SPLITS - 1:
                        count[bh] = 0                       # (every slice has counted: ready for the next launch)
                        cuda.threadfence()                  # (the other slices' writes before what follows)
                cuda.syncthreads()
                if done[0] != SPLITS - 1:
                    return
                # The last CTA merges the slices: warp w takes heads w, w + WARPS, ..; lane sp holds slice sp's max and
                # sum, lane l dims DPL l .. of the output. Every slice's values are loaded before any is used
                # (MERGE_CHUNK slices at a time): a merge that loads, waits and adds slice by slice is 16-32 L2 round
                # trips in a row.
                for h in range(warp, G, WARPS):
                    base = bh * SPLITS * G + h                  # (slice 0's stats entry; slice sp's is sp G further)
                    mv, lv = float32(-math.inf), float32(0)
                    if lane < SPLITS:
                        mv, lv = stats[2 * (base + lane * G)], stats[2 * (base + lane * G) + 1]
                    pv = cuda.local.array(MERGE_VALUES, float32)
                    for x in range(MERGE_VALUES):               # the first slices' values, loaded with the stats
                        pv[x] = part[(base + x // DPL * G) * HD + DPL * lane + x % DPL]
                    mx = mv
                    for off in (16, 8, 4, 2, 1):
                        mx = max(mx, cuda.shfl_xor_sync(0xFFFFFFFF, mx, off))
                    e = math.exp(mv - mx) if lane < SPLITS else float32(0)
                    tot = lv * e
                    for off in (16, 8, 4, 2, 1):
                        tot += cuda.shfl_xor_sync(0xFFFFFFFF, tot, off)
                    wgt = e / tot                               # slice lane's weight in the output
                    acc = cuda.local.array(DPL, float32)
                    for j in range(DPL):
                        acc[j] = float32(0)
                    for sp0 in range(0, SPLITS, MERGE_CHUNK):
                        if sp0:
                            for x in range(MERGE_VALUES):       # slice sp0 + x // DPL, value DPL lane + x % DPL
                                pv[x] = part[(base + (sp0 + x // DPL) * G) * HD + DPL * lane + x % DPL]
                        for x in range(MERGE_VALUES):
                            acc[x % DPL] += cuda.shfl_sync(0xFFFFFFFF, wgt, sp0 + x // DPL) * pv[x]
                    for j in range(DPL):                        # value x = 64 hi + 8 m + g of w_acc's order
                        x = DPL * lane + j                      # is dim 64 hi + 8 g + m
                        out[b, (kvh * G + h) * HD + x // 64 * 64 + 8 * (x % 8) + x % 64 // 8] = acc[j]

        elif name in ("silu_mul", "silu_pairs"):
            PAIRS = name == "silu_pairs"

            @jit_kernel
            def kernel(gu, out):
                """out[b, j] = silu(gu[b, j]) * gu[b, I + j], I = out.shape[1] (silu_pairs: silu(gu[b, 2j]) *
                gu[b, 2j + 1], a gate/up output with interleaved rows); b = blockIdx.y."""
                pdl_start()
                b, j = cuda.blockIdx.y, cuda.grid(1)
                I = out.shape[1]
                if j < I:
                    g = float32(gu[b, 2 * j if PAIRS else j])
                    out[b, j] = g / (float32(1) + math.exp(-g)) * float32(gu[b, 2 * j + 1 if PAIRS else I + j])

        elif name == "gather_rows":
            @jit_kernel
            def kernel(h, src, rows):
                """rows[r, j] = h[src[r], j]: the routed rows in expert order (torch.index_select's job)."""
                pdl_start()
                r, j = cuda.blockIdx.y, cuda.grid(1)
                if j < rows.shape[1]:
                    rows[r, j] = h[src[r], j]

        elif name == "moe_combine":
            @jit_kernel
            def kernel(rows, inv, weights, out):
                """out[b, j] = sum_t weights[b, t] * rows[inv[b * top + t], j] (a float32 sum), top = weights.shape[1]:
                each token's expert rows summed back with their router weights, one thread per output element."""
                pdl_start()
                b, j = cuda.blockIdx.y, cuda.grid(1)
                top = weights.shape[1]
                if j < out.shape[1]:
                    acc = float32(0)
                    for t in range(top):
                        acc += weights[b, t] * float32(rows[inv[b * top + t], j])
                    out[b, j] = acc
        else:
            raise KeyError(name)
        _KERNELS[key] = kernel
    return _KERNELS[key]


def attention_plan(cfg, context, batch=1):
    """decode_attention's warps a CTA (16 tokens each) for this model, cache length and batch: ATT_WARPS, halved
    while the step would have fewer than ATT_MIN_CTAS CTAs, but not into more than ATT_MERGE_SLICES slices x
    query heads of a group (the last CTA's merge: llama3-8b and qwen3 8 warps at every batch). ValueError where the
    heads or the cache do not fit the kernel (at most 32 slices: the merge keeps a slice a lane)."""
    G, HD = cfg["heads"] // cfg["kv_heads"], cfg["head_dim"]
    if cfg["heads"] % cfg["kv_heads"] or HD != ATT_HEAD_DIM or G > 8:
        raise ValueError(f"decode_attention takes head_dim {ATT_HEAD_DIM} and at most 8 query heads a KV head, got "
                         f"{cfg['heads']}/{cfg['kv_heads']} heads x {HD} (--attention sdpa takes any)")
    warps = ATT_WARPS
    while warps > 1 and (context % (ATT_TILE * warps) or
                         batch * cfg["kv_heads"] * context // (ATT_TILE * warps) < ATT_MIN_CTAS
                         and G * context // (ATT_TILE * warps // 2) <= ATT_MERGE_SLICES):
        warps //= 2
    if context % (ATT_TILE * warps) or context // (ATT_TILE * warps) > 32:
        raise ValueError(f"decode_attention needs a cache of a multiple of {ATT_TILE} tokens, in at most 32 slices of "
                         f"{ATT_TILE * warps}, got {context} (--attention sdpa takes any)")
    return warps


def att_cluster(slices, ctas=1):
    """The cluster size decode_attention is launched with for ``slices`` slices a (row, KV head) and ``ctas`` CTAs
    in all: every slice of a head, where a cluster holds them (sm_90, on the GPU) and the launch has no more CTAs
    than the GPU has SMs; else 1 (the last CTA merges through the L2). Beyond one CTA an SM the clusters were slower
    (llama3-8b batch 4, 256 CTAs: 11.1 -> 12.4 us a call; batch 1 and 2, 128 CTAs: 7.2 -> 5.3 and 8.6 -> 6.9 us;
    benchmarks/README.md): a cluster starts only when all its CTAs fit at once, beside the kernel before it."""
    from .core import sm_count
    from .intrinsics import SIMULATOR
    if (SIMULATOR or slices > ATT_MAX_CLUSTER or ctas > sm_count()
            or cuda.get_current_device().compute_capability < (9, 0)):
        return 1
    return slices


def kernel_specializations():
    """(name, kernel, argument types) for the PTX checks (tests/test_ptx.py): add_rmsnorm at both models' hidden
    sizes (256 and 512 threads; at llama3-8b's also its prefetch build) and decode_attention as the llama3-8b and
    qwen3-30b-a3b steps build it at batch 1, both merges, with and without PDL."""
    from numba import types as t
    sig = (t.uint32[::1],) * 3 + (t.float16[:, ::1], t.float32[::1], t.float32[::1], t.int32[::1])
    specs = [(f"add_rmsnorm H={cfg['hidden']} threads={norm_threads(cfg['hidden'])} pdl={pdl} prefetch={pf}",
              _kernel("add_rmsnorm", cfg["hidden"], pdl, prefetch=pf),
              (t.uint32[::1],) * 4 + (t.float64,) + (t.uint32[::1],) * (2 if pf else 0))
             for cfg in MODELS.values() for pdl in (False, True)
             for pf in ((False, True) if cfg is MODELS["llama3-8b"] else (False,))]
    for model, builds in (("llama3-8b", ((True, True), (True, False), (False, True), (False, False))),
                          ("qwen3-30b-a3b", ((True, True),))):
        cfg = MODELS[model]
        G, warps = cfg["heads"] // cfg["kv_heads"], attention_plan(cfg, CONTEXT)
        width = (G, cfg["kv_heads"], cfg["head_dim"], CONTEXT, warps)
        specs += [(f"decode_attention {model} G={G} warps={warps} pdl={pdl} cluster={cluster}",
                   _kernel("decode_attention", width, pdl, cluster), sig) for pdl, cluster in builds]
    return specs


def attention_kernel(attention, batch):
    """The kernel ``attention`` ("auto", "numba", "sdpa") runs for ``batch`` rows: "numba" or "sdpa"."""
    if attention not in ATTENTIONS:
        raise ValueError(f"unknown attention {attention!r}: known are {', '.join(ATTENTIONS)}")
    return ("numba" if batch <= ATT_MAX_BATCH else "sdpa") if attention == "auto" else attention


def attention_torch(q, k, v):
    """torch's SDPA on decode_attention's inputs (the step's ``attention="sdpa"``, and CPU tensors): q [B, heads,
    head_dim] over the cache k, v [B, kv_heads, context, head_dim] (grouped query heads) -> [B, heads * head_dim]."""
    import torch
    B, nq, hd = q.shape
    o = torch.nn.functional.scaled_dot_product_attention(q.reshape(B, nq, 1, hd), k, v, enable_gqa=True)
    return o.reshape(B, nq * hd)


def attention_numpy(q, k, v):
    """The NumPy twin of ``decode_attention`` (float64): q [B, heads, head_dim], k, v [B, kv_heads, context,
    head_dim] -> [B, heads * head_dim]."""
    B, nq, hd = q.shape
    g = nq // k.shape[1]
    kk, vv = (np.repeat(np.asarray(a, np.float64), g, axis=1) for a in (k, v))     # query head h reads KV head h // g
    s = np.einsum("bhd,bhtd->bht", np.asarray(q, np.float64), kk) / math.sqrt(hd)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bht,bhtd->bhd", p / p.sum(-1, keepdims=True), vv).reshape(B, nq * hd)


def add_rmsnorm_torch(res, y, w, eps=1e-6):
    """The twin of ``add_rmsnorm``: updates ``res`` in place, returns h."""
    res.add_(y)
    r = res.float()
    return (r * (r.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w.float()).to(res.dtype)


def moe_combine_torch(rows, inv, weights):
    """The twin of ``moe_combine``."""
    B, top = weights.shape
    return (rows[inv].view(B, top, -1).float() * weights[:, :, None]).sum(1).to(rows.dtype)


def silu_mul_torch(gu, pairs=False):
    """silu(g) * u of a gate/up output [..., 2I]: g, u its halves, or (``pairs``) its even and odd columns."""
    g, u = (gu.float()[..., 0::2], gu.float()[..., 1::2]) if pairs else gu.float().chunk(2, dim=-1)
    return (g * (1 / (1 + (-g).exp())) * u).to(gu.dtype)


def fuses_silu(cfg, variant):
    """Whether ``variant``'s step takes its SiLU from the gate/up gemv's epilogue (its gate/up rows, or every gate/up
    expert's, interleaved): kbit on the code or fragment layout (k = 2, 4: the pair gemv's and the tensor-core gemv's,
    grouped too). The llama3-8b B = 1 step: k = 4 1871-1886 -> 1850-1869 us, k = 2 1446-1457 -> 1386-1390
    (benchmarks/README.md)."""
    from .formats import CODE_LAYOUTS, CODES_K
    if VARIANTS.get(variant) is None:
        return False
    fmt, opts = VARIANTS[variant]
    return fmt == "kbit" and opts["k"] in CODES_K and opts.get("layout", "codes") in CODE_LAYOUTS


def interleave_pairs(W):
    """A gate/up weight [2I, K] (gate rows, then up rows) with its rows interleaved: gate row j at 2j, up row j at
    2j + 1 (what the pair gemv's ``silu_pairs`` epilogue reads)."""
    I = W.shape[0] // 2
    return np.stack([W[:I], W[I:]], axis=1).reshape(W.shape)


DISTINCT_EXPERTS = 8           # a kbit variant quantizes this many random experts and repeats them over E


class ExpertsFP16:
    """One layer's experts of one projection in float16 ([E, N, K]): one cuBLAS matmul per active expert."""

    def __init__(self, W):
        self.W = W

    def weight_bytes(self):
        return self.W.numel() * self.W.element_size()

    def bind(self, A, out, offsets):
        """A callable that runs the experts on A's rows (sorted by expert, ``offsets`` on the host) into out."""
        import torch
        spans = [(e, int(offsets[e]), int(offsets[e + 1])) for e in range(len(offsets) - 1)
                 if offsets[e + 1] > offsets[e]]
        W = self.W

        def run():
            for e, a, b in spans:
                torch.matmul(A[a:b], W[e].t(), out=out[a:b])
        return run


class ExpertsKbit:
    """One layer's experts of one projection as ``KbitExperts``, run by ``dispatch.KbitExpertsLinear``: the grouped
    kernel its rule picks per routing (``dispatch.choose_grouped``: with ``f16_acc`` the grouped pair gemv while no
    expert has more than 4 rows, with float32 sums at k = 2 while the step has at most 8 rows (and at k = 4 to 32 past
    K = 4096: ``dispatch.pair_grouped_f32_max_rows``), then the tensor-core
    gemv to 8 rows an expert, then the scalar grouped gemv or the grouped gemm on the tiled copy). ``codes``: the
    code- or fragment-layout copy, or None (k = 3, 5); the tiled one is kept for batches past those limits (it
    doubles the experts' memory). ``pdl``: the pair or tensor-core gemv as a programmatic dependent launch (the
    other kernels have no such build)."""

    def __init__(self, experts, codes=None, pdl=False, f16_acc=False):
        from .dispatch import KbitExpertsLinear
        self.experts = experts
        self.layer = KbitExpertsLinear(experts, codes, f16_acc=f16_acc, pdl=pdl)

    def weight_bytes(self):
        """Bytes of one copy (the one a decode step reads)."""
        return sum(getattr(self.experts, f).nbytes for f in self.experts.ARRAYS)

    def bind(self, A, out, offsets, silu_pairs=False):
        """A callable that runs the experts on A's rows into out; ``silu_pairs`` (gate/up rows interleaved): the
        pair or tensor-core gemv's SiLU epilogue into out [T, N / 2], or None where this routing runs another
        kernel."""
        import torch

        from .dispatch import EPILOGUE_GEMVS
        d_offsets = cuda.to_device(offsets)
        most, rows = int(np.diff(offsets).max()), int(offsets[-1])
        kernel = self.layer.kernel_for(most, rows)
        if silu_pairs and kernel not in EPILOGUE_GEMVS:
            return None
        plan = self.layer.plan(A, d_offsets, out=out, kernel=kernel, silu_pairs=silu_pairs, max_tokens=most)
        prepared = plan.prepare()

        def run():
            prepared.run(torch.cuda.current_stream())
        run.kernel, run.silu_pairs = kernel, silu_pairs
        run.buffers = (d_offsets, plan)             # (kept alive with the callable)
        return run


class DecodeStep:
    """One model's decode step for a batch of B tokens with the given per-layer linear modules (for a MoE
    model the last two of a layer are expert sets, :class:`ExpertsFP16` or :class:`ExpertsKbit`). ``pdl``: launch
    the fused kernels as programmatic dependent launches (:func:`uses_pdl`). ``silu_pairs``: the linears' gate/up
    rows are interleaved (:func:`fuses_silu`)."""

    def __init__(self, cfg, linears, B, context=CONTEXT, device="cuda", pdl=False, attention="auto", silu_pairs=False):
        import torch
        self.torch, self.cfg, self.linears, self.B, self.pdl = torch, cfg, linears, B, bool(pdl)
        self.silu_pairs = bool(silu_pairs)          # the gate/up rows interleaved (build_linears(silu_pairs=True))
        self.attention = attention_kernel(attention, B)
        # the layer's first norm prefetches its attention cache (NORM_PREFETCH_CTAS: where it was measured faster)
        self.prefetch_kv = self.attention == "numba" and B <= NORM_PREFETCH_MAX_BATCH and not is_moe(cfg)
        H, hd = cfg["hidden"], cfg["head_dim"]
        dev, f16 = device, torch.float16
        g = torch.Generator(device=dev).manual_seed(0)
        self.x = torch.randn(B, H, device=dev, dtype=f16, generator=g)
        self.norms = [(torch.ones(H, device=dev, dtype=f16), torch.ones(H, device=dev, dtype=f16))
                      for _ in linears]     # (ones: NORM_IN_GATE_UP's fold of norm2's weight into gate/up is exact)
        kv_shape = (B, cfg["kv_heads"], context, hd)
        self.kv = [(torch.randn(kv_shape, device=dev, dtype=f16, generator=g),
                    torch.randn(kv_shape, device=dev, dtype=f16, generator=g)) for _ in linears]
        # the linear-only graph's inputs: one static tensor per projection input width
        self.static = {K: torch.randn(B, K, device=dev, dtype=f16, generator=g) * 0.1
                       for _, _, K in projections(cfg)}
        self.spare = torch.zeros(B, H, device=dev, dtype=f16)     # (the o and down gemvs' residual: NORM_IN_GATE_UP)
        if is_moe(cfg):
            self._bind_experts(torch, dev, f16)
        if self.attention == "numba" and torch.device(dev).type == "cuda":   # decode_attention's slices and counts,
                                                                         # shared by the layers
            G = cfg["heads"] // cfg["kv_heads"]
            self.att_warps = attention_plan(cfg, context, B)
            per_head = context // (ATT_TILE * self.att_warps)
            self.att_slices = B * cfg["kv_heads"] * per_head                                 # (its CTAs)
            self.att_part = torch.empty(self.att_slices * G * hd, device=dev, dtype=torch.float32)
            self.att_stats = torch.empty(self.att_slices * G * 2, device=dev, dtype=torch.float32)
            self.att_count = torch.zeros(B * cfg["kv_heads"], device=dev, dtype=torch.int32)
            self.att_cluster = att_cluster(per_head, self.att_slices)

    def _bind_experts(self, torch, dev, f16):
        """Per layer a fixed routing, and the expert sets bound to static row buffers (shared by the layers):
        rows [T = B * top_k, H] -> gate_up -> silu_mul -> down -> [T, H] (with ``silu_pairs``, where the tensor-core
        gemv runs gate/up, its epilogue writes silu_mul's output)."""
        cfg, B = self.cfg, self.B
        (_, N_gu, H), (_, _, I) = projections(cfg)[2:]
        T = B * cfg["top_k"]
        self.rows = torch.zeros(T, H, device=dev, dtype=f16)
        self.gu = torch.zeros(T, N_gu, device=dev, dtype=f16)
        self.act = torch.zeros(T, I, device=dev, dtype=f16)
        self.down_rows = torch.zeros(T, H, device=dev, dtype=f16)
        rng = np.random.default_rng(1)
        self.routes, self.offsets, self.expert_runs = [], [], []
        for _, _, gate_up, down in self.linears:
            src, inv, weights, offsets = routing(cfg, B, rng)
            self.offsets.append(offsets)
            self.routes.append((torch.from_numpy(src).to(dev), torch.from_numpy(inv).to(dev),
                                torch.from_numpy(weights).to(dev)))
            fused = (gate_up.bind(self.rows, self.act, offsets, silu_pairs=True)
                     if self.silu_pairs and isinstance(gate_up, ExpertsKbit) else None)
            self.expert_runs.append((fused or gate_up.bind(self.rows, self.gu, offsets),
                                     down.bind(self.act, self.down_rows, offsets)))

    def moe(self, h, layer):
        """sum over token b's experts e_j of p_j * down_e(silu_mul(gate_up_e(h[b])))."""
        src, inv, weights = self.routes[layer]
        gate_up, down = self.expert_runs[layer]
        self.gather_rows(h, src, self.rows)
        gate_up()
        if not getattr(gate_up, "silu_pairs", False):          # (else the gate/up epilogue wrote self.act)
            self.silu_mul(self.gu, out=self.act, pairs=self.silu_pairs)
        down()
        return self.moe_combine(self.down_rows, inv, weights)

    def _launch(self, name, grid, block, *args, width=0, cluster=1, prefetch=False):
        """Launch fused kernel ``name`` on torch's current stream (tensors passed as Numba device arrays); with
        ``self.pdl`` as a programmatic dependent launch (``launch.PreparedLaunch``), as the pdl linears are;
        ``cluster``: in clusters of that many CTAs (the kernel's cluster build); ``prefetch``: its prefetch build."""
        from .launch import PreparedLaunch
        kernel = _kernel(name, width, self.pdl, cluster > 1, prefetch)
        args = [cuda.as_cuda_array(a) if hasattr(a, "__cuda_array_interface__") else a for a in args]
        stream = self.torch.cuda.current_stream().cuda_stream
        if self.pdl or cluster > 1:
            PreparedLaunch(kernel, grid, block, args, stream, pdl=self.pdl, cluster=cluster)()
        else:
            kernel[grid, block, cuda.external_stream(stream)](*args)

    def _elementwise(self, name, rows, cols, *args):
        """``_launch`` with one thread per element of a [rows, cols] output: SILU_THREADS a CTA over the columns."""
        self._launch(name, (-(-cols // SILU_THREADS), rows), SILU_THREADS, *args)

    def gather_rows(self, h, src, out):
        """out[r] = h[src[r]] (a fused kernel, so that a pdl step keeps its early starts through it)."""
        if not h.is_cuda:
            return self.torch.index_select(h, 0, src, out=out)
        self._elementwise("gather_rows", *out.shape, h, src, out)
        return out

    def moe_combine(self, rows, inv, weights):
        if not rows.is_cuda:
            return moe_combine_torch(rows, inv, weights)
        out = self.torch.empty(weights.shape[0], rows.shape[1], device=rows.device, dtype=rows.dtype)
        self._elementwise("moe_combine", *out.shape, rows, inv, weights, out)
        return out

    def add_rmsnorm(self, res, y, w, eps=1e-6, prefetch=None):
        """``prefetch``: a layer's (K, V) cache, which NORM_PREFETCH_CTAS more CTAs ask the L2 for."""
        if not res.is_cuda:
            return add_rmsnorm_torch(res, y, w, eps)
        H = res.shape[1]
        if H % HALVES_PER_CHUNK or not all(t.is_contiguous() and t.dtype == self.torch.float16 and t.data_ptr() % 16 == 0
                                           for t in (res, y, w)):
            raise ValueError(f"add_rmsnorm takes contiguous, 16-byte aligned float16 rows of a multiple of "
                             f"{HALVES_PER_CHUNK} values, got {tuple(res.shape)}")
        h = self.torch.empty_like(res)
        words = [cuda.as_cuda_array(t.reshape(-1)).view(np.uint32) for t in (res, y, w, h)]
        if prefetch is None or not NORM_PREFETCH_CTAS:
            self._launch("add_rmsnorm", res.shape[0], norm_threads(H), *words, float(eps), width=H)
        else:
            cache = [cuda.as_cuda_array(t.reshape(-1)).view(np.uint32) for t in prefetch]
            self._launch("add_rmsnorm", res.shape[0] + NORM_PREFETCH_CTAS, norm_threads(H), *words, float(eps),
                         *cache, width=H, prefetch=True)
        return h

    def silu_mul(self, gu, out=None, pairs=False):
        if not gu.is_cuda:
            y = silu_mul_torch(gu, pairs)
            return y if out is None else out.copy_(y)
        if out is None:
            out = self.torch.empty(gu.shape[0], gu.shape[1] // 2, device=gu.device, dtype=gu.dtype)
        self._elementwise("silu_pairs" if pairs else "silu_mul", *out.shape, gu, out)
        return out

    def mlp_activation(self, gate_up, h):
        """silu(g) * u of the layer's gate/up projection: with ``silu_pairs``, from the pair or tensor-core gemv's
        epilogue where this batch runs one (one launch less; benchmarks/README.md), else its output through the SiLU
        kernel."""
        if epilogue_silu(gate_up, h, self.silu_pairs):
            return gate_up.run(h, silu_pairs=True)
        return self.silu_mul(gate_up(h), pairs=self.silu_pairs)

    def _attention(self, qkv, kv):
        """The new tokens' queries (the first heads x head_dim columns of qkv) over the layer's fixed cache."""
        cfg, B = self.cfg, self.B
        nq, nkv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
        if self.attention == "sdpa" or not qkv.is_cuda:
            return attention_torch(qkv[:, :nq * hd].reshape(B, nq, hd), kv[0], kv[1])
        context = kv[0].shape[2]
        out = self.torch.empty(B, nq * hd, device=qkv.device, dtype=qkv.dtype)
        words = [cuda.as_cuda_array(t.reshape(-1)).view(np.uint32) for t in (qkv, kv[0], kv[1])]
        self._launch("decode_attention", self.att_slices, 32 * self.att_warps, *words, out, self.att_part,
                     self.att_stats, self.att_count, width=(nq // nkv, nkv, hd, context, self.att_warps),
                     cluster=self.att_cluster)
        return out

    def step(self):
        """The residual stream after every layer (x is left as it was: each replay computes the same step)."""
        res = self.x.clone()
        moe = is_moe(self.cfg)
        fused = not moe and norm_in_gate_up(*self.linears[0][1:3], res, self.silu_pairs)
        both = fused and norm_in_qkv(self.linears[0][0], self.linears[0][3], res)
        if both:                    # (n1, n2: ones, folded into qkv and gate/up)
            for (qkv, o, gate_up, down), kv in zip(self.linears, self.kv):
                att = self._attention(qkv.run(res, rms_eps=NORM_EPS), kv)               # rmsnorm -> qkv
                o.run(att, accumulate_into=res)                                         # res += o(att)
                down.run(gate_up.run(res, silu_pairs=True, rms_eps=NORM_EPS), accumulate_into=res)   # res += mlp
            return res
        y = self.torch.zeros_like(res)
        for layer, ((qkv, o, gate_up, down), (n1, n2), kv) in enumerate(zip(self.linears, self.norms, self.kv)):
            h = self.add_rmsnorm(res, y, n1, prefetch=kv if self.prefetch_kv else None)    # (layer 0: res += 0)
            att = self._attention(qkv(h), kv)
            if fused:               # (n2: ones, folded into gate/up)
                o.run(att, accumulate_into=res)                                 # res += o(att)
                y = down(gate_up.run(res, silu_pairs=True, rms_eps=NORM_EPS))   # rmsnorm -> gate/up -> SiLU
                continue
            h = self.add_rmsnorm(res, o(att), n2)
            y = self.moe(h, layer) if moe else down(self.mlp_activation(gate_up, h))
        res.add_(y)
        return res

    def linears_only(self):
        """Every linear layer of the step on static inputs (a MoE layer: its experts on the bound row buffers)."""
        for i, layer in enumerate(self.linears):
            if is_moe(self.cfg):
                layer[0](self.static[layer[0].in_features])
                layer[1](self.static[layer[1].in_features])
                for run in self.expert_runs[i]:
                    run()
                continue
            fused = norm_in_gate_up(layer[1], layer[2], self.static[layer[1].in_features], self.silu_pairs)
            both = fused and norm_in_qkv(layer[0], layer[3], self.static[layer[0].in_features])
            for lin, (name, _, K) in zip(layer, projections(self.cfg)):     # (the builds the step runs)
                if (fused and name == "o") or (both and name == "down"):
                    lin.run(self.static[K], accumulate_into=self.spare)
                elif fused and name == "gate_up":
                    lin.run(self.static[K], silu_pairs=True, rms_eps=NORM_EPS)
                elif both and name == "qkv":
                    lin.run(self.static[K], rms_eps=NORM_EPS)
                else:
                    run_linear(lin, name, self.static[K], self.silu_pairs)


def run_linear(lin, name, x, silu_pairs):
    """Projection ``name``'s layer on x as the step runs it: the gate/up through its SiLU epilogue where it has one
    (:func:`epilogue_silu`), every other call plain."""
    if name == "gate_up" and epilogue_silu(lin, x, silu_pairs):
        return lin.run(x, silu_pairs=True)
    return lin(x)


def norm_in_gate_up(o, gate_up, x, silu_pairs):
    """Whether the step runs the layer's second add + norm inside its o and gate/up pair gemvs (``NORM_IN_GATE_UP``):
    both kbit layers at a k of ``NORM_IN_GATE_UP_K`` whose kernel for x's rows (at most ``NORM_IN_GATE_UP_MAX_BATCH``)
    is the pair gemv with float16 sums, gate/up through its SiLU epilogue, float16 rows on the GPU."""
    return bool(NORM_IN_GATE_UP and silu_pairs and _pair_gemvs((o, gate_up), x))


def norm_in_qkv(qkv, down, x):
    """Whether the step, which runs its second add + norm inside its linears (:func:`norm_in_gate_up`), runs the first
    one inside too (``NORM_IN_QKV``): the QKV and down layers on x's rows as :func:`norm_in_gate_up` asks of o and
    gate/up."""
    return bool(NORM_IN_QKV and _pair_gemvs((qkv, down), x))


def _pair_gemvs(layers, x):
    """Whether every one of ``layers`` is a kbit layer at a k of ``NORM_IN_GATE_UP_K`` whose kernel for x's rows (at
    most ``NORM_IN_GATE_UP_MAX_BATCH``, float16 on the GPU) is the pair gemv with float16 sums."""
    runtimes = [getattr(lin, "runtime", None) for lin in layers]
    return bool(x.is_cuda and str(x.dtype) == "torch.float16" and x.shape[0] <= NORM_IN_GATE_UP_MAX_BATCH
                and all(r is not None and r.f16_acc and r.weight.k in NORM_IN_GATE_UP_K
                        and r.kernel_for(x.shape[0]) == "pair_gemv" for r in runtimes))


def epilogue_silu(gate_up, h, silu_pairs):
    """Whether the step runs gate/up layer ``gate_up`` on ``h`` through the SiLU epilogue: ``silu_pairs`` (its rows
    interleaved), a kbit layer on the GPU, and the kernel for h's rows a pair or tensor-core gemv."""
    runtime = getattr(gate_up, "runtime", None)
    return bool(silu_pairs and h.is_cuda and runtime is not None and runtime.kernel_for(h.shape[0]) in EPILOGUE_GEMVS)


def capture_graph(torch, fn, warm_calls=2):
    """A ``torch.cuda.CUDAGraph`` that captured ``fn()`` once, after ``warm_calls`` calls on a side stream (they compile
    the kernels, create handles and settle the allocator, none of which may happen inside a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with cuda.defer_cleanup(), torch.cuda.graph(g):   # (no Numba cuMemFree inside the capture)
        fn()
    return g


def graph_us(torch, fn, replays=20, warmup=3, spaced=False):
    """Median microseconds of one replay of a CUDA graph that captured ``fn()`` once (:func:`capture_graph`;
    ``spaced``: the replays one at a time, for a profiler trace: ``_timing.replay_us``)."""
    from ._timing import replay_us
    g = capture_graph(torch, fn)
    t = replay_us(g, replays, warmup, spaced)
    del g
    return t


def random_weights(cfg, seed=0):
    """The float32 weights :func:`run` quantizes: {projection: [N, K]} (N(0, 0.02)), a MoE model's expert sets as
    ``DISTINCT_EXPERTS`` such arrays each (:func:`build_experts` repeats them over the experts)."""
    rng = np.random.default_rng(seed)
    base = {name: (rng.standard_normal((N, K), dtype=np.float32) * 0.02) for name, N, K in projections(cfg)}
    if is_moe(cfg):
        for name, N, K in projections(cfg)[2:]:
            base[name] = [rng.standard_normal((N, K), dtype=np.float32) * 0.02 for _ in range(DISTINCT_EXPERTS)]
    return base


def decode_step(model, variant, batch=1, context=CONTEXT, attention="auto", base=None, progress=None):
    """The :class:`DecodeStep` that :func:`run` times for one variant and batch (its weights from ``base``, by default
    :func:`random_weights`; the gate/up rows interleaved where :func:`fuses_silu` says, PDL where :func:`uses_pdl`
    does), for the benchmarks scripts that trace or stamp that step (``benchmarks/step_timeline.py``,
    ``decode_step_trace.py``)."""
    cfg = MODELS[model]
    linears, fused = build_step_linears(model, variant, base, progress)
    return DecodeStep(cfg, linears, batch, context, pdl=uses_pdl(variant), attention=attention, silu_pairs=fused)


def build_step_linears(model, variant, base=None, progress=None):
    """(every layer's linears, whether gate/up's rows are interleaved for the SiLU epilogue) of ``variant`` as
    :func:`decode_step` builds them, without a :class:`DecodeStep` (``benchmarks/step_floor.py`` times the linears
    alone)."""
    check_names(model, [variant])
    cfg = MODELS[model]
    fused = fuses_silu(cfg, variant)
    linears = build_linears(cfg, variant, random_weights(cfg) if base is None else base, progress or (lambda *a: None),
                            silu_pairs=fused)
    return linears, fused


def build_experts(cfg, variant, name, N, K, base, progress, device="cuda", silu_pairs=False):
    """Per layer, the expert set of projection ``name`` ([N, K] each). fp16: random [E, N, K] per layer; kbit:
    the ``DISTINCT_EXPERTS`` matrices of ``base[name]`` quantized, repacked to the tiled layout, repeated over
    the E experts and copied into every layer's own buffers. ``silu_pairs``: gate/up matrices with their rows
    interleaved (:func:`interleave_pairs`)."""
    import torch

    from . import reference
    from .bench import _device_copies
    from .core import stack_experts
    from .formats import CODES_K, fits_fragments
    L, E = cfg["layers"], cfg["experts"]
    if VARIANTS[variant] is None:
        return [ExpertsFP16(torch.empty(E, N, K, device=device, dtype=torch.float16).normal_(0, 0.02))
                for _ in range(L)]
    fmt, opts = VARIANTS[variant]
    if fmt != "kbit":
        raise ValueError(f"{variant}: kbit_numba has grouped MoE kernels for the kbit format only")
    progress(f"{variant}: quantizing {E} experts of {name} {N}x{K}")
    flat = [reference.quantize(interleave_pairs(w) if silu_pairs and name == "gate_up" else w, k=opts["k"])
            for w in base[name]]
    tiled = [reference.repack_tiled(w) for w in flat]
    stacked = stack_experts([tiled[e % len(tiled)] for e in range(E)])
    copies = _device_copies(stacked, L)
    if opts["k"] not in CODES_K:
        return [ExpertsKbit(c) for c in copies]
    # the pair gemv's code layout for f16_acc (ExpertsKbit), else the fragment layout where the shape allows (2-12%
    # faster in the tensor-core gemv; the pair gemv reads it too, 6-25% slower at M = 1)
    native = (reference.to_fragments if fits_fragments(N, K) and not opts.get("f16_acc") else reference.to_codes)
    codes = [native(w) for w in flat]
    stacked = stack_experts([codes[e % len(codes)] for e in range(E)])
    return [ExpertsKbit(t, c, opts.get("pdl"), opts.get("f16_acc")) for t, c in zip(copies, _device_copies(stacked, L))]


def build_linears(cfg, variant, base, progress, device="cuda", silu_pairs=False):
    """Per layer, the 4 projection modules of ``variant``; ``base``: projection name -> a random float32
    [N, K] NumPy matrix (quantized once per variant, then copied into every layer's own buffers; for a MoE
    model's expert projections a list of ``DISTINCT_EXPERTS`` matrices: see :func:`build_experts`).
    ``silu_pairs``: the gate/up matrix with its rows interleaved (:func:`interleave_pairs`)."""
    import torch
    from torch import nn

    from .bench import _device_copies
    from .formats import fits_fragments
    from .torch import KbitLinear, quantize_weight
    L = cfg["layers"]
    per_proj = []
    for name, N, K in projections(cfg):
        if is_moe(cfg) and name in ("gate_up", "down"):
            per_proj.append(build_experts(cfg, variant, name, N, K, base, progress, device, silu_pairs))
            continue
        if VARIANTS[variant] is None:
            mods = []
            for _ in range(L):
                lin = nn.Linear(K, N, bias=False, device=device, dtype=torch.float16)
                with torch.no_grad():
                    lin.weight.normal_(0, 0.02)
                mods.append(lin)
        else:
            fmt, opts = VARIANTS[variant]
            qopts = {key: v for key, v in opts.items() if key in _QUANTIZE_KEYS}
            layout_opts = {key: v for key, v in opts.items() if key not in _QUANTIZE_KEYS}
            if layout_opts.get("layout") == "fragments" and not fits_fragments(N, K):
                layout_opts["layout"] = "codes"     # (whole fragment tiles only: the code layout where they do not fit)
            progress(f"{variant}: quantizing {name} {N}x{K}")
            W = interleave_pairs(base[name]) if silu_pairs and name == "gate_up" else base[name]
            w = quantize_weight(W, fmt, **qopts)
            mods = [KbitLinear(c, **layout_opts) for c in _device_copies(w, L)]
        per_proj.append(mods)
    return list(zip(*per_proj))


def weight_bytes(linears):
    total = 0
    for layer in linears:
        for lin in layer:
            total += lin.weight_bytes() if hasattr(lin, "weight_bytes") else lin.weight.numel() * 2
    return total


def run(model="llama3-8b", variants=None, batches=BATCHES, context=CONTEXT, progress=print, attention="auto"):
    """Rows of {variant, batch, step_us, tokens_per_s, linear_us, linear_share, weight_bytes, bits_per_weight}.
    ``attention``: the stand-in's kernel (``ATTENTIONS``); each row names the one it ran."""
    import torch
    variants = list(variants or VARIANTS)
    check_names(model, variants)
    cfg = MODELS[model]
    params = cfg["layers"] * layer_params(cfg)
    base = random_weights(cfg)
    rows = []
    for variant in variants:
        t0 = time.perf_counter()
        try:
            linears, fused = build_step_linears(model, variant, base, progress)
        except ValueError as e:             # a format this model's layers have no kernel for: reported
            rows += [dict(model=model, variant=variant, batch=B, context=context, error=str(e)[:300])
                     for B in batches]
            progress(f"{variant}: {e}")
            continue
        nbytes = weight_bytes(linears)
        progress(f"{variant}: {nbytes / 2**30:.2f} GiB of weights, built in {time.perf_counter() - t0:.0f} s")
        step = None
        for B in batches:
            del step                        # (the previous batch's KV caches)
            step = DecodeStep(cfg, linears, B, context, pdl=uses_pdl(variant), attention=attention, silu_pairs=fused)
            try:
                with torch.no_grad():
                    t_step = graph_us(torch, step.step)
                    t_lin = graph_us(torch, step.linears_only)
            except Exception as e:          # a variant that cannot run this batch: reported, the others go on
                rows.append(dict(model=model, variant=variant, batch=B, context=context, error=repr(e)[:300]))
                progress(f"{variant} B={B}: FAILED {e!r}"[:400])
                traceback.print_exc()
                continue
            rows.append(dict(model=model, variant=variant, batch=B, context=context, attention=step.attention,
                             silu_pairs=fused, step_us=t_step,
                             tokens_per_s=B * 1e6 / t_step, linear_us=t_lin, linear_share=t_lin / t_step,
                             weight_bytes=nbytes, bits_per_weight=8 * nbytes / params))
            progress(f"{variant} B={B}: step {t_step:.0f} us, linear layers alone {t_lin:.0f} us")
        del linears, step
        gc.collect()
        torch.cuda.empty_cache()
    fp16 = {r["batch"]: r["tokens_per_s"] for r in rows if r["variant"] == "fp16" and "error" not in r}
    for r in rows:
        if r["batch"] in fp16 and "error" not in r:
            r["vs_fp16"] = r["tokens_per_s"] / fp16[r["batch"]]
    return rows


def format_rows(rows):
    head = (f"{'variant':<28}{'B':>4}{'bits/w':>8}{'GiB':>7}{'step us':>10}{'tokens/s':>10}{'x fp16':>8}"
            f"{'linear us':>11}{'linear %':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<28}{r['batch']:>4}  failed: {r['error']}")
            continue
        lines.append(f"{r['variant']:<28}{r['batch']:>4}{r['bits_per_weight']:>8.2f}{r['weight_bytes'] / 2**30:>7.2f}"
                     f"{r['step_us']:>10.0f}{r['tokens_per_s']:>10.0f}{r.get('vs_fp16', float('nan')):>8.2f}"
                     f"{r['linear_us']:>11.0f}{100 * r['linear_share']:>9.0f}%")
    return "\n".join(lines)


def plot(rows, path, device):
    """tokens/s against bits per weight, one series per batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for B in sorted({r["batch"] for r in rows}):
        pts = sorted((r["bits_per_weight"], r["tokens_per_s"], r["variant"]) for r in rows
                     if r["batch"] == B and "error" not in r)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=f"batch {B}")
        for bpw, tps, name in pts:
            ax.annotate(name, (bpw, tps), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("bits per weight (linear layers)")
    ax.set_ylabel("tokens/s (decode step, CUDA graph)")
    ax.set_yscale("log")
    ax.set_title(f"{rows[0]['model']} decode step on {device}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
