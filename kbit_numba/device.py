"""Device helpers shared by every kernel family: element loaders, E4M4, warp reductions, tiled indices, and the
group table of the code-layout gemvs (``pair_gemv``, ``mma_gemv``).

All are ``cuda.jit(device=True)`` functions that NVVM inlines; under the simulator they run as Python.
Integer math is kept in explicit uint32/int32 and float constants in float32 so that Numba emits
32-bit instructions (it widens plain Python ints and floats to 64 bits).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from numba import cuda
from numba.cuda import libdevice

from . import _cache
from .formats import E4M4_BIAS, TILE_N
from .intrinsics import (SIMULATOR, cp_async4, cp_async_commit, cp_async_wait, f16_bits_to_f32, f16x2_as_u32,
                         f32_as_u32, shared_addr, sts128, u32_as_f32)

# Numba types plain Python ints as int64 and widens every integer sum to 64 bits: kernels write their
# 32-bit integer math explicitly, through these two names.
u32 = np.uint32
i32 = np.int32
FULL_MASK = 0xFFFFFFFF
WARP = 32
F32_MAX = np.float32(3.4028235e38)
_E4M4_SUB_SCALE = np.float32(2.0 ** (1 - E4M4_BIAS) / 16)   # value of one mantissa step, e = 0
_E4M4_EXP_OFFSET = u32(127 - E4M4_BIAS)               # E4M4 exponent -> float32 exponent


def inlined(fn):
    """A device function that NVVM inlines into its callers (``forceinline``). Numba's own ``inline="always"``
    inlines at the Numba-IR level instead: the caller's IR grows before it is typed and unrolled, and a pair
    gemv's compile took 3-4x as long (benchmarks/README.md). The simulator takes no such option."""
    return cuda.jit(device=True)(fn) if SIMULATOR else cuda.jit(device=True, forceinline=True)(fn)


def jit_kernel(fn, max_registers=None):
    """``cuda.jit`` a kernel, with a register cap where one is asked for (the simulator rejects the
    keyword, and has no registers to cap), and the on-disk kernel cache (``_cache``) on the GPU."""
    if SIMULATOR:
        return cuda.jit(fn)
    return _cache.attach(cuda.jit(fn, max_registers=max_registers) if max_registers else cuda.jit(fn))


@lru_cache(maxsize=None)
def make_loader(src):
    """Device function ``load(arr, i) -> float32`` for 'float16', 'float32' or 'bfloat16' (int16 bits)."""
    if src == "bfloat16":
        @inlined
        def load(arr, i):
            return u32_as_f32((u32(arr[i]) & u32(0xFFFF)) << u32(16))
    elif src in ("float16", "float32"):
        @inlined
        def load(arr, i):
            return np.float32(arr[i])
    else:
        raise ValueError(f"unknown element type {src!r}")
    return load


@lru_cache(maxsize=None)
def make_word_unpacker(src):
    """(unpack(word, e) -> float32 element e of a uint32 word, elements per word) for arrays read as
    uint32 words: two float16 or bfloat16 values (element 0 in the low half) or one float32."""
    if src == "float32":
        @inlined
        def unpack(word, e):
            return u32_as_f32(word)
        return unpack, 1
    if src == "float16":
        @inlined
        def unpack(word, e):
            return f16_bits_to_f32(word >> u32(16 * e))
        return unpack, 2
    if src == "bfloat16":
        @inlined
        def unpack(word, e):
            return u32_as_f32(word << u32(16) if e == 0 else word & u32(0xFFFF0000))
        return unpack, 2
    raise ValueError(f"unknown element type {src!r}")


@inlined
def f32_to_bf16_bits(v):
    """float32 -> bfloat16 bits in the low half of a uint32, rounded to nearest even (finite values).
    Twin: ``reference.float32_to_bf16_bits``."""
    u = f32_as_u32(v)
    return (u + u32(0x7FFF) + ((u >> u32(16)) & u32(1))) >> u32(16)


@inlined
def e4m4_decode(byte):
    """uint8 E4M4 -> float32: built from bits for e > 0, m * 2**-14 for e = 0."""
    b = u32(byte)
    e = b >> u32(4)
    m = b & u32(15)
    normal = u32_as_f32(((e + _E4M4_EXP_OFFSET) << u32(23)) | (m << u32(19)))
    return normal if e != u32(0) else np.float32(m) * _E4M4_SUB_SCALE


@inlined
def e4m4_encode(v):
    """float32 >= 0 -> uint8 E4M4, the same rule as formats.e4m4_encode (half-even, clamped)."""
    bits = f32_as_u32(v)
    ex = i32((bits >> u32(23)) & u32(0xFF))
    if ex == 0:
        return np.uint8(0)
    eb = ex - i32(127 - E4M4_BIAS)
    if eb > 15:
        return np.uint8(0xFF)
    if eb <= 0:   # subnormal byte: m = rint(v * 2**14); the scaling is exact
        t = v * np.float32(16384.0)
        fl = u32(t)
        d = t - np.float32(fl)
        if d > np.float32(0.5) or (d == np.float32(0.5) and (fl & u32(1)) != u32(0)):
            fl += u32(1)
        return np.uint8(min(fl, u32(15)))
    frac = bits & u32(0x7FFFFF)
    m = frac >> u32(19)
    rem = frac & u32(0x7FFFF)
    if rem > u32(0x40000) or (rem == u32(0x40000) and (m & u32(1)) != u32(0)):
        m += u32(1)
    m = min(m, u32(15))
    return np.uint8((u32(eb) << u32(4)) | m)


@inlined
def warp_max(v):
    """Max over the 32 lanes (butterfly: every lane ends with the result)."""
    for off in (16, 8, 4, 2, 1):
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
    return v


@inlined
def tiled_block(n, kb_all, N):
    """Tiled layout: index of the (column, block) slot, i.e. tile*256 + col*2 + kb.
    Word offset = slot * k + bit; absmax offset = slot (formats.tiled_word_index)."""
    n_tiles = N // i32(TILE_N)
    tile = (kb_all >> i32(1)) * n_tiles + n // i32(TILE_N)
    return tile * i32(2 * TILE_N) + (n % i32(TILE_N)) * i32(2) + (kb_all & i32(1))


@inlined
def slot_expert(offsets):
    """The expert a CTA of a grouped (MoE) launch runs, or -1: blockIdx.y is a slot. With gridDim.y = E slots,
    slot e is expert e. With fewer (T < E rows: a decode step, where most experts have no row) slot y is row
    y, and runs the expert whose first row it is; -1 if y is not a first row (the CTA then exits). Every
    thread must call it (the fewer-slots case meets two barriers); offsets: int32 [E + 1], rising."""
    expert = i32(cuda.blockIdx.y)
    n_experts = i32(offsets.shape[0] - 1)
    if i32(cuda.gridDim.y) < n_experts:
        found = cuda.shared.array(1, np.int32)
        if cuda.threadIdx.x == 0:
            found[0] = -1
        cuda.syncthreads()
        e = i32(cuda.threadIdx.x)          # E <= a few hundred: one or a few loads a thread, in parallel
        while e < n_experts:
            if offsets[e] == expert and offsets[e + 1] > expert:
                found[0] = e
            e += i32(cuda.blockDim.x)
        cuda.syncthreads()
        expert = found[0]
    return expert


@inlined
def block_max(v, scratch):
    """Max of ``v`` over the CTA (every thread must call it; ``scratch`` is a float32 shared array of at
    least 32 slots). Every thread gets the result."""
    lane = cuda.threadIdx.x % WARP
    warp = cuda.threadIdx.x // WARP
    v = warp_max(v)
    cuda.syncthreads()                       # scratch may still be read by a previous call
    if lane == 0:
        scratch[warp] = v
    cuda.syncthreads()
    v = scratch[0]
    for w in range(1, cuda.blockDim.x // WARP):
        v = max(v, scratch[w])
    return v


@lru_cache(maxsize=None)
def make_cta_sum(M):
    """Device function ``cta_sum(acc, part)``: sums acc[0..M-1] of each lane position over the warps of
    the CTA (the "K split across warps" reduction of the lane-per-column kernels); afterwards acc of
    warp 0's lanes holds the totals. ``part`` is a shared array [n_warps, 32, M] of acc's dtype."""

    @inlined
    def cta_sum(acc, part):
        lane = cuda.threadIdx.x % WARP
        warp = cuda.threadIdx.x // WARP
        for m in range(M):
            part[warp, lane, m] = acc[m]
        cuda.syncthreads()
        if warp == 0:
            for w in range(1, cuda.blockDim.x // WARP):
                for m in range(M):
                    acc[m] += part[w, lane, m]

    return cta_sum


_I2F_MAGIC = i32(0x4B400000)          # the float 1.5 * 2**23: its low 22 mantissa bits are free
_I2F_MAGIC_F = np.float32(12582912.0)


@inlined
def small_int_to_f32(x):
    """float32(x) for an int32 |x| < 2**22, exactly, with an integer add and a float subtract: both
    full-rate, where the I2F conversion runs at a quarter of the FMA rate on sm_80/sm_90."""
    return u32_as_f32(u32(x + _I2F_MAGIC)) - _I2F_MAGIC_F


@lru_cache(maxsize=None)
def make_warp_reduce_scatter(V):
    """Device function ``reduce_scatter(acc, lane) -> (total, v_idx, owner)`` for V = 1, 2, 4, ..., 32.

    Every lane holds V float32 partial sums ``acc[0..V-1]``; afterwards ``total`` is the warp's sum of
    value ``v_idx`` (a butterfly that halves the values each step: 31 shuffles for V = 32 instead of
    5 per value), and exactly one lane per value has ``owner`` set. Lane l holds value
    ``v_idx = l >> (5 - log2 V)``: step s keeps the upper or lower half of the remaining values by lane
    bit 4 - s, so the lane's top bits spell the index. ``acc`` is clobbered. Twin: ``py_warp_reduce_scatter``."""
    V_LOG = V.bit_length() - 1
    assert 1 << V_LOG == V and V <= WARP

    @inlined
    def reduce_scatter(acc, lane):
        half = V
        for step in range(V_LOG):
            half //= 2
            off = WARP >> (step + 1)
            upper = (lane & off) != 0
            for j in range(half):
                send = acc[j] if upper else acc[j + half]
                keep = acc[j + half] if upper else acc[j]
                acc[j] = keep + cuda.shfl_xor_sync(FULL_MASK, send, off)
        r = acc[0]
        off = WARP >> (V_LOG + 1)
        while off > 0:                                   # lanes sharing a value finish the sum
            r += cuda.shfl_xor_sync(FULL_MASK, r, off)
            off //= 2
        return r, lane >> (5 - V_LOG), lane % (WARP >> V_LOG) == 0

    return reduce_scatter


def py_warp_reduce_scatter(acc):
    """Twin of ``make_warp_reduce_scatter``: acc [32, V] (lane, value) -> (total[32], v_idx[32], owner[32])."""
    acc = np.asarray(acc, np.float64)
    V_LOG = acc.shape[1].bit_length() - 1
    lanes = np.arange(WARP)
    v_idx = lanes >> (5 - V_LOG)
    return acc.sum(axis=0)[v_idx], v_idx, lanes % (WARP >> V_LOG) == 0


@inlined
def silu_mul(gate, up):
    """silu(gate) * up in float32: the gemvs' ``silu_pairs`` epilogues (twin: ``reference.silu_pairs``)."""
    return gate / (np.float32(1.0) + math.exp(-gate)) * up


@inlined
def rsqrt_mean(ss, n, eps):
    """1 / sqrt(ss / n + eps) in float32 (an RMSNorm's scale from its sum of squares ss over n values), by the
    approximate division and rsqrt.approx (~2 ulp each): the IEEE ones call slow paths, which in the pair gemv's
    SiLU build cost 16 registers. The simulator computes it in float64, rounded once."""
    if SIMULATOR:
        return np.float32(1.0 / math.sqrt(float(ss) / float(n) + float(eps)))
    return libdevice.rsqrtf(libdevice.fast_fdividef(ss, n) + eps)


@lru_cache(maxsize=None)
def make_silu_pair_out(stride, partner, f16_out):
    """Device function ``silu_pair_out(smem, p, kw, out, row, n, N, scale)``: the pair gemv's ``silu_pairs`` epilogue.
    Column n (even) is gate j = n / 2 of a gate/up weight whose rows are interleaved, and n + 1 is up j: write
    silu(scale * gate) * (scale * up) to out[row, j] of an [M, N / 2] output (float16 if ``f16_out``) from the float32
    partial sums, once an element: no SiLU kernel and no [M, N] round trip through memory (``scale``: 1, or the row's
    1 / rms of the pair gemv's ``rms_eps``). Column n's kw partial sums are smem[p], smem[p + stride], ...;
    column n + 1's sit ``partner`` floats after each. The odd column's thread writes nothing. (The tensor-core gemv
    sums its fragment-order tiles its own way, with the same ``silu_mul``.) Twin: ``reference.silu_pairs``."""

    @inlined
    def silu_pair_out(smem, p, kw, out, row, n, N, scale):
        if n % u32(2) == u32(0) and n < u32(N):
            gate, up = np.float32(0.0), np.float32(0.0)
            p_end = u32(p + kw * u32(stride))
            while p < p_end:
                gate += smem[p]
                up += smem[u32(p + u32(partner))]
                p = u32(p + u32(stride))
            y = silu_mul(gate * scale, up * scale)
            out[u32(row * u32(u32(N) // u32(2)) + n // u32(2))] = np.float16(y) if f16_out else y

    return silu_pair_out


# ---- the group table of the code-layout gemvs (pair_gemv, mma_gemv): 64 KB at the start of the dynamic shared
#      array, one 256-byte row per code byte, so that one prmt makes a lookup's address
CODES = 256                       # table entries: one per code byte
ROW_BYTES = 256                   # one table row per code, so a code byte shifted by 8 is its row address
TABLE_BYTES = CODES * ROW_BYTES   # 64 KB of dynamic shared memory
TABLE_FLOATS = TABLE_BYTES // 4
CHUNK_BYTES = 16                  # the fill writes the table 16 bytes (one st.shared.v4) at a time
PHASE_BYTES = 128                 # what the 32 shared-memory banks serve at once (a request is split into phases)
ABSMAX_CODES = 256                # E4M4 bytes, decoded once per CTA into shared memory after the table
CODEBOOK = TABLE_FLOATS + ABSMAX_CODES   # float offset of the codebook (<= 16 values, staged for the fill)
# prmt selector for code byte t of a word: result byte 0 <- the lane's copy offset (byte 4 of {b, a}),
# byte 1 <- byte t of the code word, bytes 2, 3 <- byte 5 (zero: the offset is < 256).
PRMT_ROW = 0x5504


@inlined
def stage_codebook(smem, cb, tid, word0, count):
    """Copy the codebook's ``count`` float32 values (``len(cb)``, or 2^k where the kernel knows k) to float offset
    ``word0`` of the shared array ``smem`` by ``cp.async``, threads 0..count-1 one value each, as a commit group of
    its own. The gemvs stage it at ``CODEBOOK`` for a ``make_table_fill(..., staged=True)`` fill, which waits for it;
    the tensor-core gemm into its own array before its first K tiles' copies. Issued before a kernel's first weight
    loads, the one global read is not queued behind them, and as a copy into shared memory it holds no register
    that a later instruction waits on (a plain load and store there made every warp of mma_gemv's PDL build wait
    for the codebook before its first weight load; in the gemm a plain load after the tiles' copies took ~10% of
    its stall samples: benchmarks/README.md, "Forty-fifth session")."""
    if tid < count:
        cp_async4(smem, u32(shared_addr(smem) + u32(4) * u32(word0 + tid)), cb, tid, u32(4))
    cp_async_commit()


@lru_cache(maxsize=None)
def make_table_fill(k, entry_type, staged=False):
    """(fill, ENTRY, COPIES): ``fill(smem, cb, tid)`` builds the group table at the start of the dynamic shared
    array ``smem`` (all threads of the CTA call it; it stages the codebook ``cb`` at float offset ``CODEBOOK`` and
    meets them at one barrier; ``staged``: the kernel copied it there earlier with :func:`stage_codebook`, and
    the fill only waits for that copy). Entry (code, copy) holds the G = 8 // k codebook values of code byte
    ``code`` (element e from bits k*e) as float32 words (``entry_type`` 'float32') or packed pairs of 'float16' or
    'bfloat16' (low half first); ENTRY is its size in bytes, COPIES the copies in a 256-byte row, which fill
    its first 128 bytes (lane l reads copy l % COPIES at row offset (l % COPIES) * ENTRY; why 128: at COPIES
    below). Each thread writes one 16-byte chunk of a row at a time (one ``st.shared.v4``); a chunk's 4 words
    are 4 // (ENTRY / 4) copies of the entry. The codebook is read from shared memory: 16384 global reads would
    serialise the fill."""
    G = 8 // k
    packed = entry_type != "float32"
    ENTRY = (2 if packed else 4) * G
    # Shared memory serves a warp's request 128 bytes (32 banks x 4 bytes) at a time: the lanes of one such phase must
    # read different banks, so different copies, while lanes of different phases may share one. An 8-byte load
    # (f16 quads, f32 pairs) is served in two phases of 16 lanes, a 16-byte load (f32 quads) in four of 8.
    COPIES = min(WARP, PHASE_BYTES // ENTRY)       # 32 for 4-byte entries, 16 for 8-byte, 8 for 16-byte
    USED_CHUNKS = COPIES * ENTRY // CHUNK_BYTES    # chunks of a row the copies fill: 8, the first half
    WORDS_PER_ENTRY = ENTRY // 4
    CODE_MASK = (1 << k) - 1
    N_CODES = 1 << k
    bf16 = entry_type == "bfloat16"

    @inlined
    def fill(smem, cb, tid):
        if staged:
            cp_async_wait(0)                    # the codebook, staged by stage_codebook
        elif tid < u32(N_CODES):
            smem[u32(CODEBOOK) + tid] = cb[tid]
        cuda.syncthreads()
        table = shared_addr(smem)
        chunk = u32(tid)
        while chunk < u32(CODES * USED_CHUNKS):
            code = chunk // u32(USED_CHUNKS)
            vals = cuda.local.array(4, np.uint32)
            for wd in range(4):                     # word wd of the chunk: word wd % WORDS_PER_ENTRY of an entry
                e = (wd % WORDS_PER_ENTRY) * (2 if packed else 1)      # its (first) element
                v0 = smem[u32(CODEBOOK) + ((code >> u32(k * e)) & u32(CODE_MASK))]
                if packed:
                    v1 = smem[u32(CODEBOOK) + ((code >> u32(k * (e + 1))) & u32(CODE_MASK))]
                    if bf16:
                        vals[wd] = f32_to_bf16_bits(v0) | (f32_to_bf16_bits(v1) << u32(16))
                    else:
                        vals[wd] = f16x2_as_u32(np.float16(v0), np.float16(v1))
                else:
                    vals[wd] = f32_as_u32(v0)
            dst = code * u32(ROW_BYTES) + (chunk - code * u32(USED_CHUNKS)) * u32(CHUNK_BYTES)
            sts128(smem, table + dst, vals[0], vals[1], vals[2], vals[3])
            chunk = u32(chunk + u32(cuda.blockDim.x))   # (stays 32-bit)

    return fill, ENTRY, COPIES
