"""Device helpers shared by every kernel family: element loaders, E4M4, warp reductions, tiled indices.

All are ``cuda.jit(device=True)`` functions that NVVM inlines; under the simulator they run as Python.
Integer math is kept in explicit uint32/int32 and float constants in float32 so that Numba emits
32-bit instructions (it widens plain Python ints and floats to 64 bits).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cuda

from .formats import E4M4_BIAS, TILE_N
from .intrinsics import SIMULATOR, f16_bits_to_f32, f32_as_u32, u32_as_f32

# Numba types plain Python ints as int64 and widens every integer sum to 64 bits: kernels write their
# 32-bit integer math explicitly, through these two names.
u32 = np.uint32
i32 = np.int32
FULL_MASK = 0xFFFFFFFF
WARP = 32
F32_MAX = np.float32(3.4028235e38)
_E4M4_SUB_SCALE = np.float32(2.0 ** (1 - E4M4_BIAS) / 16)   # value of one mantissa step, e = 0
_E4M4_EXP_OFFSET = u32(127 - E4M4_BIAS)               # E4M4 exponent -> float32 exponent


def jit_kernel(fn, max_registers=None):
    """``cuda.jit`` a kernel, with a register cap where one is asked for (the simulator rejects the
    keyword, and has no registers to cap)."""
    if max_registers and not SIMULATOR:
        return cuda.jit(fn, max_registers=max_registers)
    return cuda.jit(fn)


@lru_cache(maxsize=None)
def make_loader(src):
    """Device function ``load(arr, i) -> float32`` for 'float16', 'float32' or 'bfloat16' (int16 bits)."""
    if src == "bfloat16":
        @cuda.jit(device=True, inline=True)
        def load(arr, i):
            return u32_as_f32((u32(arr[i]) & u32(0xFFFF)) << u32(16))
    elif src in ("float16", "float32"):
        @cuda.jit(device=True, inline=True)
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
        @cuda.jit(device=True, inline=True)
        def unpack(word, e):
            return u32_as_f32(word)
        return unpack, 1
    if src == "float16":
        @cuda.jit(device=True, inline=True)
        def unpack(word, e):
            return f16_bits_to_f32(word >> u32(16 * e))
        return unpack, 2
    if src == "bfloat16":
        @cuda.jit(device=True, inline=True)
        def unpack(word, e):
            return u32_as_f32(word << u32(16) if e == 0 else word & u32(0xFFFF0000))
        return unpack, 2
    raise ValueError(f"unknown element type {src!r}")


@cuda.jit(device=True, inline=True)
def f32_to_bf16_bits(v):
    """float32 -> bfloat16 bits in the low half of a uint32, rounded to nearest even (finite values).
    Twin: ``reference.float32_to_bf16_bits``."""
    u = f32_as_u32(v)
    return (u + u32(0x7FFF) + ((u >> u32(16)) & u32(1))) >> u32(16)


@cuda.jit(device=True, inline=True)
def e4m4_decode(byte):
    """uint8 E4M4 -> float32: built from bits for e > 0, m * 2**-14 for e = 0."""
    b = u32(byte)
    e = b >> u32(4)
    m = b & u32(15)
    normal = u32_as_f32(((e + _E4M4_EXP_OFFSET) << u32(23)) | (m << u32(19)))
    return normal if e != u32(0) else np.float32(m) * _E4M4_SUB_SCALE


@cuda.jit(device=True, inline=True)
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


@cuda.jit(device=True, inline=True)
def warp_max(v):
    """Max over the 32 lanes (butterfly: every lane ends with the result)."""
    for off in (16, 8, 4, 2, 1):
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, off))
    return v


@cuda.jit(device=True, inline=True)
def tiled_block(n, kb_all, N):
    """Tiled layout: index of the (column, block) slot, i.e. tile*256 + col*2 + kb.
    Word offset = slot * k + bit; absmax offset = slot (formats.tiled_word_index)."""
    n_tiles = N // i32(TILE_N)
    tile = (kb_all >> i32(1)) * n_tiles + n // i32(TILE_N)
    return tile * i32(2 * TILE_N) + (n % i32(TILE_N)) * i32(2) + (kb_all & i32(1))


@cuda.jit(device=True, inline=True)
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

    @cuda.jit(device=True, inline=True)
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


@cuda.jit(device=True, inline=True)
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

    @cuda.jit(device=True, inline="always")
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
