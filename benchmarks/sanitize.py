"""Small launches of every kernel family for compute-sanitizer (memcheck / racecheck) on the device:

    compute-sanitizer --tool memcheck python benchmarks/sanitize.py \
        [codec,gemv,pair,mma,pdl,grouped,grouped_pair,gemm,formats,attention,norm]

(default: every family; name some to check only those). ``pdl``: a chain of pair gemvs launched as
programmatic dependent launches, each reading the previous one's output. ``mma``: the tensor-core gemv (also
several batches of strips a CTA, on both layouts, as a PDL chain, and split-K, with the SiLU epilogue too);
``grouped`` includes fragment-layout experts and split-K;
``grouped_pair``: the grouped pair gemv (a token row a grid slot) at each of its default knob sets;
``attention``: ``bench_model``'s ``decode_attention`` (the decode step's attention stand-in);
``batches``: only ``pair``'s launches of many column groups a CTA (its batches of three);
``long``: only ``mma``'s counted batches (``mma_gemv.long_batch``: 6 + 3 strips a CTA, whole and split in K);
``pair`` also chains the two launches of a decode step's add + norm (``accumulate``, then ``rms_eps``, which sums
the squares in shared memory);
``norm``: ``bench_model``'s ``add_rmsnorm`` at each of its thread counts (``norm_threads``: 256..512), and its
prefetch build (CTAs past the rows asking the L2 for a cache's lines).
"""
import sys

import numpy as np
from numba import cuda

import kbit_numba as kb
from kbit_numba.core import sm_count
from kbit_numba.pair_gemv import to_codes

families = (sys.argv[1].split(",") if len(sys.argv) > 1
            else ["codec", "gemv", "pair", "mma", "pdl", "grouped", "grouped_pair", "gemm", "formats", "attention",
                  "norm"])
rng = np.random.default_rng(0)
for k in (2, 3, 4, 5):
    for layout in ("flat", "tiled"):
        W = rng.standard_normal((128, 96)).astype(np.float16)
        qw = kb.quantize(W, k=k, layout=layout)
        if "codec" in families:
            for dt in (np.float16, np.float32):
                kb.dequantize(qw, dtype=dt).copy_to_host()
            if layout == "flat":
                kb.repack_tiled(qw)
                if k in (2, 4):              # the code layout's dequantize (KbitLinear's default at large M)
                    kb.dequantize(to_codes(qw)).copy_to_host()
                    # ... and the fragment layout's (KbitLinear(layout="fragments")): 3 strips x 2 tiles of 256
                    frag = kb.mma_gemv.to_fragments(to_codes(kb.quantize(
                        rng.standard_normal((48, 512)).astype(np.float16), k=k)))
                    kb.dequantize(frag, dtype=np.float32).copy_to_host()
        if "gemv" in families:
            for M in (1, 2, 3, 4):
                kb.gemv(rng.standard_normal((M, 96)).astype(np.float16), qw).copy_to_host()
        if "gemm" in families and layout == "tiled":     # K = 96: a half-empty last K tile
            for M, split in ((5, 1), (20, 2), (40, None), (70, 2)):
                kb.gemm(rng.standard_normal((M, 96)).astype(np.float16), qw, split=split).copy_to_host()
            kb.gemm(kb.reference.float32_to_bf16_bits(rng.standard_normal((9, 96)).astype(np.float32)), qw,
                    bf16=True).copy_to_host()
if "gemm" in families:     # grouped: an expert with two row tiles, an empty one, split-K
    tiled = kb.stack_experts([kb.reference.repack_tiled(kb.reference.quantize(
        rng.standard_normal((128, 96)).astype(np.float32), k=3)) for _ in range(3)])
    for split in (1, 2):
        kb.grouped_gemm(rng.standard_normal((21, 96)).astype(np.float16), tiled, np.array([0, 18, 18, 21], np.int32),
                        split=split, m_tile=1).copy_to_host()
if "gemm" in families:     # the code layout: N = 200 (a partial column tile, the absmax array ending mid-word)
    from kbit_numba import pair_gemv
    for k in pair_gemv.CODES_K:
        for fmt in ("e4m4", "fp32"):
            flat = kb.quantize(rng.standard_normal((201, 192)).astype(np.float16), k=k, absmax_format=fmt)
            kc = pair_gemv.to_codes(flat)
            for M, split in ((5, 1), (20, 2), (40, None)):
                kb.gemm(rng.standard_normal((M, 192)).astype(np.float16), kc, split=split).copy_to_host()
            kb.dequantize(kc).copy_to_host()
        # E4M4 absmax chunks of 2, 4 and 8 K tiles (tensor_gemm.absmax_chunk; the last column's chunk ends the array)
        for K, split in ((640, 5), (768, 3), (1536, 2)):
            kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((201, K)).astype(np.float16), k=k))
            kb.gemm(rng.standard_normal((5, K)).astype(np.float16), kc, split=split).copy_to_host()
if "pair" in families:     # N = 37 (a partial column group), K = 1056 (two K-warps, the second nearly idle)
    from kbit_numba import pair_gemv
    for k in pair_gemv.CODES_K:            # (each specialisation compiles slowly under the sanitizer: few)
        for fmt in ("e4m4", "fp32"):
            kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((37, 1056)).astype(np.float16), k=k,
                                                absmax_format=fmt))
            for M in ((1, 4) if fmt == "e4m4" else (3,)):
                for cols in ((1, 8) if M == 1 else (4,)):
                    for f16_acc in ((False, True) if fmt == "e4m4" else (False,)):
                        pair_gemv.plan(rng.standard_normal((M, 1056)).astype(np.float16), kc, cols=cols,
                                       f16_acc=f16_acc).launch().copy_to_host()
if "pair" in families or "batches" in families:
    # M = 1 with f16_acc sums once per three column groups (PairGemvSpec.batch): one slice a CTA (cta_warps = KW)
    # and 2 to 28 groups a CTA, the last one partial (at the k of PAIR_FULL_BATCHES_K, 2 and 4, plan builds whole
    # batches' own loop here, where CTAs run whole batches: PairGemvSpec.full_batches), also as k = 2's SiLU build's
    # PDL launch
    from kbit_numba import pair_gemv
    for k in pair_gemv.CODES_K:
        kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((28 * sm_count() - 3, 1056)).astype(np.float16), k=k))
        for cols in (1, 4):
            pair_gemv.plan(rng.standard_normal((1, 1056)).astype(np.float16), kc, cols=cols, f16_acc=True,
                           cta_warps=2).launch().copy_to_host()
    ks = pair_gemv.to_codes(kb.quantize(rng.standard_normal((2 * (28 * sm_count() - 3), 1056)).astype(np.float16), k=2))
    pair_gemv.plan(rng.standard_normal((1, 1056)).astype(np.float16), ks, cols=2, cta_warps=2, f16_acc=True, pdl=True,
                   silu_pairs=True).launch().copy_to_host()
if "pair" in families:
    # the PDL builds (at k = 4 the tables' barrier comes before griddep_wait, and none after the activation loads)
    for f16_acc in (False, True):
        pair_gemv.plan(rng.standard_normal((1, 1056)).astype(np.float16), kc, f16_acc=f16_acc,
                       pdl=True).launch().copy_to_host()
    # the SiLU build with the knobs the H200 table gives llama3-8b's gate/up (cols = 2, 8-warp CTAs: here 4 slices of
    # 2 K-warps), float16 sums, as a PDL launch; N = 2 x 37 interleaved rows (a partial column group)
    ks = pair_gemv.to_codes(kb.quantize(rng.standard_normal((74, 1056)).astype(np.float16), k=4))
    pair_gemv.plan(rng.standard_normal((1, 1056)).astype(np.float16), ks, cols=2, cta_warps=8, f16_acc=True, pdl=True,
                   silu_pairs=True).launch().copy_to_host()
    # the fragment layout (N = 80: 5 strips of 16 columns; K = 1280: the second K-warp's last lanes idle)
    for k in pair_gemv.CODES_K:
        kf = kb.reference.to_fragments(kb.quantize(rng.standard_normal((80, 1280)).astype(np.float16), k=k))
        for M, cols in ((1, 8), (4, 2)):
            pair_gemv.plan(rng.standard_normal((M, 1280)).astype(np.float16), kf, cols=cols).launch().copy_to_host()
    # the silu_pairs epilogue (an [M, N / 2] output): batch 3 with PDL at M = 1, one group a barrier at M = 3
    kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((2 * 37, 1056)).astype(np.float16), k=4))
    for M, f16_acc, pdl in ((1, True, True), (3, False, False)):
        pair_gemv.plan(rng.standard_normal((M, 1056)).astype(np.float16), kc, f16_acc=f16_acc, pdl=pdl,
                       silu_pairs=True).launch().copy_to_host()
    # a decode step's add + norm over two launches: the o-like gemv adding into a residual [M, 4096] (accumulate:
    # whole batches in one-slice CTAs, batches of three at the default knobs, one group a barrier at M = 3), then the
    # SiLU gate/up-like gemv scaled by 1 / rms of it (rms_eps: each slice's shared sums of squares) as a PDL launch,
    # at the same CTA shapes, and the plain rms_eps build (a QKV-like launch)
    ko = pair_gemv.to_codes(kb.quantize(rng.standard_normal((4096, 1056)).astype(np.float16), k=4))
    ku = pair_gemv.to_codes(kb.quantize(rng.standard_normal((74, 4096)).astype(np.float16), k=4))
    for M, cta_warps in ((1, 2), (1, None), (3, None)):
        res = cuda.to_device(rng.standard_normal((M, 4096)).astype(np.float16))
        pair_gemv.plan(rng.standard_normal((M, 1056)).astype(np.float16), ko, out=res, cta_warps=cta_warps,
                       f16_acc=M == 1, accumulate=True).launch()
        pair_gemv.plan(res, ku, f16_acc=M == 1, pdl=True, silu_pairs=True, rms_eps=1e-6, cta_warps=cta_warps
                       ).launch().copy_to_host()
        pair_gemv.plan(res, ku, f16_acc=M == 1, pdl=True, rms_eps=1e-6, cta_warps=cta_warps).launch().copy_to_host()
if "mma" in families:      # N = 37 (a partial strip), K = 1088 (5 K-warps, the last one with idle lanes)

    from kbit_numba import mma_gemv, pair_gemv
    for k in pair_gemv.CODES_K:
        for fmt in ("e4m4", "fp32"):
            kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((37, 1088)).astype(np.float16), k=k,
                                                absmax_format=fmt))
            for M in ((1, 8, 12, 16, 20, 32) if fmt == "e4m4" else (5,)):   # 12, 16: two token tiles; 20, 32:
                mma_gemv.gemv(rng.standard_normal((M, 1088)).astype(np.float16), kc).copy_to_host()   # three, four
    # three and four token tiles past WIDE_KW K-warps: K = 2368 (10 K-warps, the last with idle lanes: 2 splits of 5)
    for k in pair_gemv.CODES_K:
        kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((37, 2368)).astype(np.float16), k=k))
        for M in (17, 29):
            mma_gemv.gemv(rng.standard_normal((M, 2368)).astype(np.float16), kc).copy_to_host()
    # one slice a CTA (cta_warps = KW) and ~7 strips a CTA: batches of 3, 3 and 1 strips (BATCH) on every SM, in the
    # code layout (a partial last strip) and the fragment layout
    N = 16 * 7 * sm_count()
    for k in pair_gemv.CODES_K:
        kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((N - 11, 1088)).astype(np.float16), k=k))
        kf = mma_gemv.to_fragments(pair_gemv.to_codes(kb.quantize(rng.standard_normal((N, 1024)).astype(np.float16),
                                                                   k=k)))
        for M in (4, 16):
            mma_gemv.plan(rng.standard_normal((M, 1088)).astype(np.float16), kc, cta_warps=5).launch().copy_to_host()
            mma_gemv.plan(rng.standard_normal((M, 1024)).astype(np.float16), kf, cta_warps=4).launch().copy_to_host()
    kc = pair_gemv.to_codes(kb.quantize((rng.standard_normal((1088, 1088)) / 32).astype(np.float16), k=4))
    cuda.synchronize()
    first = mma_gemv.prepare(cuda.to_device(rng.standard_normal((6, 1088)).astype(np.float16)), kc, pdl=True)
    second = mma_gemv.prepare(first.out, kc, pdl=True)
    first.run()
    second.run().copy_to_host()
    # the silu_pairs epilogue (an [M, N / 2] output): one and two token tiles, a partial last strip (N = 74)
    kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((74, 1088)).astype(np.float16), k=4))
    for M in (3, 12):
        mma_gemv.plan(rng.standard_normal((M, 1088)).astype(np.float16), kc, silu_pairs=True).launch().copy_to_host()
        # ... with K split: the finishing launch applies it (core.finish_step(silu_row=N))
        mma_gemv.plan(rng.standard_normal((M, 1088)).astype(np.float16), kc, silu_pairs=True,
                      split=2).launch().copy_to_host()
    # the default split past 16 K-warps: K = 5120 (20 K-warps: 2 splits of 10), k = 4 one tile, k = 2 two tiles
    for k, M in ((4, 3), (2, 9)):
        kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((37, 5120)).astype(np.float16), k=k))
        mma_gemv.plan(rng.standard_normal((M, 5120)).astype(np.float16), kc).launch().copy_to_host()
    # split-K: K = 8256 (33 K-warps: 3 splits of 11, the last warp with idle lanes), a partial strip, both k, one and
    # two tiles, a PDL launch; and a forced split of K = 1088 (5 K-warps: 3 splits of 2, the last warp past K)
    for k in pair_gemv.CODES_K:
        kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((37, 8256)).astype(np.float16), k=k))
        for M, pdl in ((4, True), (16, False)):
            mma_gemv.plan(rng.standard_normal((M, 8256)).astype(np.float16), kc, pdl=pdl).launch().copy_to_host()
        kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((37, 1088)).astype(np.float16), k=k))
        mma_gemv.plan(rng.standard_normal((8, 1088)).astype(np.float16), kc, split=3).launch().copy_to_host()
if "mma" in families or "long" in families:
    # counted batches (mma_gemv.long_batch) that start again: a launch held to two CTAs (the plan's grid function
    # replaced for it) over 18 strips of one K-warp, 9 a CTA: batches of 6 + 3; plain, and PDL with the SiLU epilogue
    from kbit_numba import mma_gemv, pair_gemv
    resident = mma_gemv.persistent_grid
    mma_gemv.persistent_grid = lambda work, *args: min(work, 2)
    for k in pair_gemv.CODES_K:
        kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((18 * 16, 256)).astype(np.float16), k=k))
        for pdl in (False, True):
            p = mma_gemv.plan(rng.standard_normal((4, 256)).astype(np.float16), kc, cta_warps=1, pdl=pdl,
                              silu_pairs=pdl)
            assert p.steps[0].grid == 2 and p.steps[0].kernel is mma_gemv.make_mma_gemv_kernel(
                mma_gemv.MmaGemvSpec(k, pdl=pdl, silu_pairs=pdl, batch=6)), "not the counted launch meant"
            p.launch().copy_to_host()
        # split in K (two shares of K = 512, one CTA a share) over 9 strips: batches of 6 + 3, the shares' sums
        # added in the workspace, then the finishing launch; PDL
        kc = pair_gemv.to_codes(kb.quantize(rng.standard_normal((9 * 16, 512)).astype(np.float16), k=k))
        p = mma_gemv.plan(rng.standard_normal((4, 512)).astype(np.float16), kc, cta_warps=1, pdl=True, split=2)
        assert p.steps[0].grid == (1, 2) and p.steps[0].kernel is mma_gemv.make_mma_gemv_kernel(mma_gemv.MmaGemvSpec(
            k, pdl=True, out_dtype="float32", split_k=True, batch=6)), "not the counted split launch meant"
        p.launch().copy_to_host()
    mma_gemv.persistent_grid = resident
if "pdl" in families:      # N = K = 1056: a partial column group, two K-warps; float32 and float16 block sums

    from kbit_numba import pair_gemv
    for f16_acc in (False, True):
        outs = [cuda.to_device(rng.standard_normal((1, 1056)).astype(np.float16))]
        steps = []
        for _ in range(3):
            kc = pair_gemv.to_codes(kb.quantize((rng.standard_normal((1056, 1056)) / 32).astype(np.float16), k=4))
            cuda.synchronize()
            steps.append(pair_gemv.prepare(outs[-1], kc, f16_acc=f16_acc, pdl=True))
            outs.append(steps[-1].out)
        for step in steps:
            step.run()
        outs[-1].copy_to_host()
if "grouped" in families:
    experts = kb.stack_experts([kb.reference.quantize(rng.standard_normal((128, 64)).astype(np.float32), k=4)
                                for _ in range(3)])
    kb.grouped_gemv(rng.standard_normal((5, 64)).astype(np.float16), experts,
                    np.array([0, 2, 2, 5], np.int32)).copy_to_host()
    # T < E (slots per row), an empty expert first; then the tensor-core gemv on code-layout experts with a
    # partial strip (N = 37), K = 1088 (the last K-warp with idle lanes), T < E and T >= E, and a 9-row expert
    kb.grouped_gemv(rng.standard_normal((2, 64)).astype(np.float16), experts,
                    cuda.to_device(np.array([0, 0, 1, 2], np.int32))).copy_to_host()
    from kbit_numba import mma_gemv
    cexperts = kb.stack_experts([kb.reference.to_codes(kb.reference.quantize(
        rng.standard_normal((37, 1088)).astype(np.float32), k=k)) for k in (4, 4, 4, 4)])
    sexperts = kb.stack_experts([kb.reference.to_codes(kb.reference.quantize(
        rng.standard_normal((74, 1088)).astype(np.float32), k=4)) for _ in range(4)])
    for offsets in ([0, 0, 2, 2, 3], [0, 3, 3, 8, 12], [0, 9, 9, 10, 10]):
        T = offsets[-1]
        for silu_pairs in (False, True):      # (the epilogue: gate/up experts with interleaved rows, out [T, N / 2])
            A = rng.standard_normal((T, 1088)).astype(np.float16)
            e = cexperts if not silu_pairs else sexperts
            mma_gemv.plan_grouped(A, e, cuda.to_device(np.array(offsets, np.int32)),
                                  silu_pairs=silu_pairs).launch().copy_to_host()
            # ... with K split in 3 (5 K-warps: shares of 2, the last warp past K; grid z the shares)
            mma_gemv.plan_grouped(A, e, cuda.to_device(np.array(offsets, np.int32)), silu_pairs=silu_pairs,
                                  split=3).launch().copy_to_host()
    fexperts = kb.stack_experts([mma_gemv.to_fragments(kb.reference.to_codes(kb.reference.quantize(
        rng.standard_normal((48, 1024)).astype(np.float32), k=4))) for _ in range(4)])
    for offsets in ([0, 0, 2, 2, 3], [0, 3, 3, 8, 12]):
        mma_gemv.grouped_gemv(rng.standard_normal((offsets[-1], 1024)).astype(np.float16), fexperts,
                              cuda.to_device(np.array(offsets, np.int32))).copy_to_host()
    # more CTAs a slot than row_share gives (core.slot_share): 128 experts of 768x2048, 16 tokens top-8 (about 81
    # slots with rows), one 16-warp CTA an SM; each slot's column groups shared by grid.x > 1 CTAs
    sel = kb.stack_experts([kb.reference.to_codes(kb.reference.quantize(
        rng.standard_normal((768, 2048)).astype(np.float32), k=4))] * 128)
    counts = np.bincount(np.stack([rng.choice(128, 8, replace=False) for _ in range(16)]).reshape(-1), minlength=128)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    plan = mma_gemv.plan_grouped(rng.standard_normal((offsets[-1], 2048)).astype(np.float16), sel, offsets)
    print("slot_share grid", plan.steps[0].grid, "for", int((counts > 0).sum()), "slots with rows of 128", flush=True)
    plan.launch().copy_to_host()
    # the PDL build (tables before the wait, offsets after it), T < E and T >= E, after a PDL mma gemv
    for offsets in ([0, 0, 2, 2, 3], [0, 3, 3, 8, 12]):
        T = offsets[-1]
        A = cuda.to_device(rng.standard_normal((T, 1088)).astype(np.float16))
        first = mma_gemv.prepare(A, cexperts.expert(0), pdl=True) if T <= 8 else None
        grouped = mma_gemv.plan_grouped(A, cexperts, cuda.to_device(np.array(offsets, np.int32)), max_tokens=8,
                                        pdl=True).prepare()
        if first:
            first.run()
        grouped.run()
        grouped.out.copy_to_host()
if "grouped_pair" in families:  # N = 37 (a partial column group), K = 1088 / 512 (two K-warps / one)
    from kbit_numba import pair_gemv
    for N, K, k, f16_acc, pdl, silu_pairs, offsets in (
            (37, 1088, 4, False, False, False, [0, 0, 2, 2, 3]),     # empty experts first and last
            (74, 1088, 2, True, True, True, [0, 3, 3, 8, 12]),      # the SiLU epilogue after the wait
            (37, 512, 4, False, True, False, [0, 1, 2, 2, 5]),      # float32 sums, one K-warp: 8 columns, 4 warps
            (37, 1088, 4, True, False, False, [0, 30, 30, 64, 70])):    # many rows: 8 columns, 16 warps
        experts = kb.stack_experts([kb.reference.to_codes(kb.reference.quantize(
            rng.standard_normal((N, K)).astype(np.float32), k=k)) for _ in range(4)])
        A = rng.standard_normal((offsets[-1], K)).astype(np.float16)
        pair_gemv.plan_grouped(A, experts, cuda.to_device(np.array(offsets, np.int32)), f16_acc=f16_acc, pdl=pdl,
                               silu_pairs=silu_pairs).launch().copy_to_host()
    # the fragment layout: N = 48 (3 strips), K = 1280 (two K-warps, the second's last 24 lanes past the blocks)
    for k in pair_gemv.CODES_K:
        experts = kb.stack_experts([kb.reference.to_fragments(kb.reference.quantize(
            rng.standard_normal((48, 1280)).astype(np.float32), k=k)) for _ in range(3)])
        pair_gemv.plan_grouped(rng.standard_normal((4, 1280)).astype(np.float16), experts,
                               cuda.to_device(np.array([0, 2, 2, 4], np.int32)), pdl=True).launch().copy_to_host()
if "formats" in families:  # uniform (every width, fp16/int8, 3-bit padding), SBVR, BitNet; M = 1..4
    for bits in (1, 2, 3, 4, 8):
        for G in (32, 128, None):
            K = 640 if G != 32 else 352
            uw = kb.uniform.quantize(rng.standard_normal((37, K)).astype(np.float16), bits, G)
            for M in (1, 4):
                for int8 in (False, True):
                    kb.uniform.gemv(rng.standard_normal((M, K)).astype(np.float16), uw, int8=int8).copy_to_host()
    sw = kb.sbvr.encode(rng.standard_normal((45, 256)), lines=300)
    bw = kb.bitnet.quantize(rng.standard_normal((48, 96)), parts=3)
    for M in (1, 2, 3, 4):
        kb.sbvr.gemv(rng.standard_normal((M, 256)).astype(np.float16), sw).copy_to_host()
        kb.bitnet.gemv(rng.standard_normal((M, 96)).astype(np.float32), bw).copy_to_host()
if "attention" in families:  # bench_model's decode_attention: 2-16 slices a head, every build, each launched twice
    from kbit_numba import bench_model      # (the second launch finds the counts the first one's last CTAs reset)
    from kbit_numba.launch import PreparedLaunch
    for G, NKV, S, W, B in ((2, 1, 32, 1, 1), (4, 2, 128, 2, 2), (8, 1, 256, 8, 1), (4, 2, 1024, 4, 1),
                            (4, 8, 1024, 8, 1)):        # (the last: llama3-8b's batch-1 grid, 64 CTAs of 8 warps)
        qkv = rng.standard_normal((B, (G + 2) * NKV * 128)).astype(np.float16)
        kv = [cuda.to_device(rng.standard_normal(B * NKV * S * 128).astype(np.float16).view(np.uint32)) for _ in "kv"]
        slices = B * NKV * S // (bench_model.ATT_TILE * W)
        count = cuda.to_device(np.zeros(B * NKV, np.int32))
        for pdl in (False, True):
            for cluster in {1, bench_model.att_cluster(S // (bench_model.ATT_TILE * W))}:   # (the count, the cluster)
                kernel = bench_model._kernel("decode_attention", (G, NKV, 128, S, W), pdl=pdl, cluster=cluster > 1)
                for _ in range(2):
                    PreparedLaunch(kernel, slices, 32 * W, (
                        cuda.to_device(qkv.reshape(-1).view(np.uint32)), *kv,
                        cuda.device_array((B, G * NKV * 128), np.float16),
                        cuda.device_array(slices * G * 128, np.float32), cuda.device_array(slices * G * 2, np.float32),
                        count), pdl=pdl, cluster=cluster)()
        cuda.synchronize()
if "norm" in families:   # add_rmsnorm: rows of 1000 (125 chunks, 256 threads), 2048, 4096 (512 threads of one chunk)
    from kbit_numba import bench_model          # and 5120 (512 threads, a second pass over the last chunks)
    from kbit_numba.launch import PreparedLaunch
    for H, B in ((1000, 3), (2048, 2), (4096, 1), (4096, 3), (5120, 2)):
        for pdl in (False, True):
            words = [cuda.to_device(a.reshape(-1).view(np.uint32)) for a in
                     (*(rng.standard_normal((B, H)).astype(np.float16) for _ in "ry"),
                      rng.random(H).astype(np.float16), np.zeros((B, H), np.float16))]
            PreparedLaunch(bench_model._kernel("add_rmsnorm", H, pdl), B, bench_model.norm_threads(H),
                           (*words, 1e-6), pdl=pdl)()
            # the prefetch build: 3 CTAs past the rows over a 1000-line cache (not a multiple of their threads)
            kv = [cuda.to_device(rng.integers(0, 2**32, 1000 * bench_model.LINE_WORDS, dtype=np.uint32)) for _ in "kv"]
            PreparedLaunch(bench_model._kernel("add_rmsnorm", H, pdl, prefetch=True), B + 3,
                           bench_model.norm_threads(H), (*words, 1e-6, *kv), pdl=pdl)()
    cuda.synchronize()
print("sanitize workload done:", ",".join(families))
