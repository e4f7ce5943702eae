"""GPU quantize, dequantize and flat->tiled repack of the kbit format.

quantize:   one warp per 32-element block. Lane j holds element j; the absmax is a warp max; each lane
            picks its nearest codebook entry; bit plane b is one ``ballot_sync`` and lane b stores it.
dequantize: a thread writes 8 consecutive outputs (a quarter block) in each of ``chunks`` chunks, so a
            warp writes 512 contiguous bytes of float16 with one 16-byte store per thread and chunk. Every
            chunk's weight loads are issued before the first decode (bytes in flight hide DRAM latency).
            Flat and tiled layouts: the thread's 8 bits of each bit plane are spread into 8 index bytes by
            one multiply per 4 bits (``spread_nibble``), ~1 instruction per output and plane instead of ~3
            for a bit-by-bit gather. The codebook sits in shared memory (at most 32 float32 words in
            distinct banks: any lookup pattern is conflict-free). The code and fragment layouts (k = 2, 4)
            hold a block's indices as k-bit fields: a thread's 8 outputs are 8k bits of one word; the
            fragment layout only moves whole blocks (``formats.fragment_position`` gives a block's slot).
repack:     one thread per (block, bit-plane) word.

Reference twins: ``reference.quantize``, ``reference.dequantize``, ``reference.repack_tiled``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .core import device_weight
from .launch import ELEMENT_TYPES, NUMBA_TYPES, OUT_TYPES, Plan, Spec, Step, type_name
from .device import (F32_MAX, FULL_MASK, WARP, e4m4_decode, e4m4_encode, f32_to_bf16_bits, i32, inlined, jit_kernel,
                     make_loader, tiled_block, u32, warp_max)
from .formats import (ABSMAX_FORMATS, BLOCK, CODE_LAYOUTS, CODES_K, K_BITS, LAYOUTS, MAX_CODES, TILE_N, KbitCodes,
                      KbitFragments, KbitWeight, check_codebook, check_k, fragment_position, padded_k)
from .intrinsics import f16x2_as_u32, f32_as_u32, ldg64_stream, ldg128_stream, lds_f32, prmt, shared_addr, stg128

QUANT_THREADS = 256          # 8 warps = 8 blocks per CTA
DEQUANT_THREADS = 256        # 64 blocks per CTA and chunk
ELEMS_PER_THREAD = 8         # dequantize: 8 outputs = 16 bytes of float16 per thread and chunk
THREADS_PER_BLOCK = BLOCK // ELEMS_PER_THREAD
DEQUANT_CHUNKS = 4           # chunks a thread: 4 x (k words + absmax) of loads in flight before the first decode
SPREAD = u32(0x00204081)     # nibble * SPREAD puts bit i on bit 8i (+7i overlaps no other partial product: no carry)
BYTE_LSB = u32(0x01010101)   # bit 0 of each byte
LOW_BYTE = u32(0x4440)       # prmt selector + j: byte j of a word, zero-extended
DEQUANT_MAX_OUTPUTS = 2**32  # the dequantizer's index math is 32-bit: N * K below this


# ------------------------------------------------------------------------------------------------
# Specs: the codec's three kernels and their compile-time choices
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _BlocksSpec(Spec):
    """What the quantizer and the dequantizer both specialise on: k, layout, absmax format, and one element
    type, ``dtype`` (W's for the quantizer, the output's for the dequantizer; ``DTYPES`` lists the allowed)."""
    k: int
    layout: str = "flat"
    absmax_format: str = "e4m4"
    dtype: str = "float16"
    DTYPES = ELEMENT_TYPES

    def normalise(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.absmax_format not in ABSMAX_FORMATS:
            raise ValueError(f"absmax_format must be one of {ABSMAX_FORMATS}, got {self.absmax_format!r}")
        return dict(k=check_k(self.k), dtype=type_name(self.dtype, "dtype", self.DTYPES))


class QuantizeSpec(_BlocksSpec):
    """The quantizer's choices (``dtype``: W's element type, bfloat16 as int16 bits): the key of
    :func:`make_quantize_kernel`."""
    FAMILY = "quantize"


@dataclass(frozen=True)
class DequantizeSpec(_BlocksSpec):
    """The dequantizer's choices (``dtype``: the output type, bfloat16 written as int16 bits; ``chunks``: 8-output
    chunks a thread): the key of :func:`make_dequantize_kernel`. It also reads the code and fragment layouts
    (``KbitCodes``, ``KbitFragments``; k = 2, 4)."""
    FAMILY = "dequantize"
    DTYPES = OUT_TYPES + ("bfloat16",)
    chunks: int = DEQUANT_CHUNKS

    def normalise(self):
        if int(self.chunks) < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")
        if self.layout in CODE_LAYOUTS:
            if self.k not in CODES_K:
                raise ValueError(f"the {self.layout} layout holds k in {CODES_K}, got k={self.k}")
            return dict(replace(self, layout="flat").normalise(), layout=self.layout, chunks=int(self.chunks))
        return dict(super().normalise(), chunks=int(self.chunks))


@dataclass(frozen=True)
class RepackSpec(Spec):
    """The flat -> tiled repack's choices: the key of :func:`make_repack_kernel`."""
    FAMILY = "repack"
    k: int
    absmax_format: str = "e4m4"

    def normalise(self):
        if self.absmax_format not in ABSMAX_FORMATS:
            raise ValueError(f"absmax_format must be one of {ABSMAX_FORMATS}, got {self.absmax_format!r}")
        return dict(k=check_k(self.k))


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def make_quantize_kernel(spec):
    """Kernel(W[N*K], packed u32, absmax, codebook f32[2**k], N, K, n_kb, err i32[1]) for a
    :class:`QuantizeSpec`.

    n_kb = blocks per stored row (tiled: K padded to 64, the padding blocks are zeros)."""
    k, layout, absmax_format, src = spec.k, spec.layout, spec.absmax_format, spec.dtype
    n_codes = 1 << k
    tiled = layout == "tiled"
    e4m4 = absmax_format == "e4m4"
    load = make_loader(src)

    def quantize_kernel(W, packed, absmax, cb, N, K, n_kb, err):
        gwarp = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) // WARP
        lane = cuda.laneid
        if gwarp < N * n_kb:                       # warp-uniform: whole warps skip together
            n = gwarp // n_kb
            kb = gwarp - n * n_kb
            kk = kb * BLOCK + lane
            x = np.float32(0.0)
            if kk < K:
                x = load(W, n * K + kk)
            if not abs(x) <= F32_MAX:              # NaN or Inf: flag it, quantize the block anyway
                err[0] = 1
                x = np.float32(0.0)
            amax = warp_max(abs(x))
            xn = x / max(amax, np.float32(1e-8))   # the true absmax picks the index
            best = u32(0)
            best_d = abs(xn - cb[0])
            for i in range(1, n_codes):            # ties keep the lower index, as reference does
                d = abs(xn - cb[i])
                if d < best_d:
                    best = u32(i)
                    best_d = d
            if kb * BLOCK >= K:                    # tiled padding block: all-zero words
                best = u32(0)
            slot = tiled_block(n, kb, N) if tiled else gwarp
            for b in range(k):
                word = cuda.ballot_sync(FULL_MASK, (best >> u32(b)) & u32(1))
                if lane == b:
                    packed[slot * k + b] = word
            if lane == 0:
                absmax[slot] = e4m4_encode(amax) if e4m4 else amax

    return jit_kernel(quantize_kernel)


@inlined
def spread_nibble(x, b):
    """Bits 0..3 of x on bit b + 2 of bytes 0..3 (one multiply, one mask). OR-ed over a block's k planes, byte j
    becomes 4 x the index of output j: a byte offset into the shared float32 codebook. Twin:
    ``reference.unpack_bitplanes`` (tests/test_codec.py checks the dequantizer against the reference for every k)."""
    return (x * (SPREAD << u32(b + 2))) & (BYTE_LSB << u32(b + 2))


@lru_cache(maxsize=None)
def make_dequantize_kernel(spec):
    """Kernel(packed u32, absmax, codebook f32[2**k], out u32 view, N, K) for a :class:`DequantizeSpec`.
    Chunk q of the row-major [N, K] result is outputs 8q .. 8q+7; CTA c's thread t writes chunks
    (c * chunks + i) * DEQUANT_THREADS + t, i < chunks, so each chunk of a warp is 512 contiguous bytes."""
    k, layout, absmax_format, out_dtype, chunks = spec.k, spec.layout, spec.absmax_format, spec.dtype, spec.chunks
    n_codes = 1 << k
    tiled = layout == "tiled"
    codes = layout in CODE_LAYOUTS      # a thread's 8 elements: 8k bits of one word, at bit 8k * (g % 4) % 32
    fragments = layout == "fragments"   # the code layout's blocks in the tensor-core gemv's load order
    position = cuda.jit(device=True)(fragment_position)
    e4m4 = absmax_format == "e4m4"
    am_type = np.uint8 if e4m4 else np.float32
    f16, bf16 = out_dtype == "float16", out_dtype == "bfloat16"      # (else float32)
    n_words = 1 if codes else k         # words a chunk loads
    vector = 0 if codes else {4: 4, 2: 2}.get(k, 0)     # the planes as one 16- or 8-byte load (k = 3, 5: k loads)

    def dequantize_kernel(packed, absmax, cb, out, N, K):
        cb_sh = cuda.shared.array(MAX_CODES, np.float32)
        tid = cuda.threadIdx.x
        part = u32(tid % THREADS_PER_BLOCK)      # which quarter of its block: the same in every chunk
        # 32-bit index math (u32 wraps let LLVM narrow Numba's 64-bit arithmetic); N * K < 2**32 outputs
        first = u32(u32(cuda.blockIdx.x) * u32(chunks * DEQUANT_THREADS) + u32(tid))
        n_chunks = u32(u32(N) * u32(K // ELEMS_PER_THREAD))
        words = cuda.local.array((chunks, n_words), np.uint32)
        raw = cuda.local.array(chunks, am_type)
        # 1. every chunk's loads, before the codebook's barrier and before any decode
        for c in range(chunks):
            q = u32(first + u32(c * DEQUANT_THREADS))
            if q < n_chunks:
                blk = q >> u32(2)                # THREADS_PER_BLOCK = 4 chunks a block
                if tiled or fragments:
                    kbr = u32(K // BLOCK)
                    n = u32(blk // kbr)
                    if tiled:
                        slot = u32(tiled_block(i32(n), i32(blk - n * kbr), N))
                    else:
                        slot = u32(position(n, u32(blk - n * kbr), kbr, k))
                else:
                    slot = blk
                raw[c] = absmax[slot]
                if codes:
                    words[c, 0] = packed[u32(slot * u32(k) + (part * u32(ELEMS_PER_THREAD * k)) // u32(32))]
                elif vector == 4:
                    words[c, 0], words[c, 1], words[c, 2], words[c, 3] = ldg128_stream(packed, u32(slot * u32(4)))
                elif vector == 2:
                    words[c, 0], words[c, 1] = ldg64_stream(packed, u32(slot * u32(2)))
                else:
                    for b in range(k):
                        words[c, b] = packed[u32(slot * u32(k) + u32(b))]
        if tid < n_codes:
            cb_sh[tid] = cb[tid]
        cuda.syncthreads()
        base = shared_addr(cb_sh)
        # 2. decode and store, chunk by chunk. lo / hi: 4 x the indices of 4 outputs each, one a byte
        for c in range(chunks):
            q = u32(first + u32(c * DEQUANT_THREADS))
            if q < n_chunks:
                scale = e4m4_decode(raw[c]) if e4m4 else raw[c]
                if codes and k == 4:             # the thread's word: output j in bits 4j .. 4j+3
                    x = words[c, 0]
                    lo = (x << u32(2)) & u32(0x3C3C3C3C)         # outputs 0, 2, 4, 6
                    hi = (x >> u32(2)) & u32(0x3C3C3C3C)         # outputs 1, 3, 5, 7
                    lo, hi = prmt(lo, hi, u32(0x5140)), prmt(lo, hi, u32(0x7362))   # outputs 0..3, 4..7
                elif codes:                       # k = 2: output j in bits 2j, 2j+1 of the word's half
                    x = (words[c, 0] >> ((part & u32(1)) * u32(16))) & u32(0xFFFF)
                    x = (x | (x << u32(8))) & u32(0x00FF00FF)     # outputs 0..3 in byte 0, 4..7 in byte 2
                    x = (x | (x << u32(4))) & u32(0x0F0F0F0F)     # outputs 2m, 2m+1 in byte m
                    lo = (x << u32(2)) & u32(0x0C0C0C0C)          # outputs 0, 2, 4, 6
                    hi = x & u32(0x0C0C0C0C)                      # outputs 1, 3, 5, 7
                    lo, hi = prmt(lo, hi, u32(0x5140)), prmt(lo, hi, u32(0x7362))   # outputs 0..3, 4..7
                else:                             # flat / tiled: output j's bit b is bit 8 * part + j of plane b
                    lo = u32(0)
                    hi = u32(0)
                    for b in range(k):
                        x = prmt(words[c, b], u32(0), LOW_BYTE + part)
                        lo |= spread_nibble(x & u32(15), b)       # outputs 0..3
                        hi |= spread_nibble(x >> u32(4), b)       # outputs 4..7
                vals = cuda.local.array(ELEMS_PER_THREAD, np.float32)
                for j in range(4):               # byte j of lo / hi: 4 x the index of output j / 4 + j
                    vals[j] = lds_f32(cb_sh, base + prmt(lo, u32(0), LOW_BYTE + u32(j))) * scale
                    vals[4 + j] = lds_f32(cb_sh, base + prmt(hi, u32(0), LOW_BYTE + u32(j))) * scale
                if f16:
                    stg128(out, u32(q * u32(4)),
                           f16x2_as_u32(np.float16(vals[0]), np.float16(vals[1])),
                           f16x2_as_u32(np.float16(vals[2]), np.float16(vals[3])),
                           f16x2_as_u32(np.float16(vals[4]), np.float16(vals[5])),
                           f16x2_as_u32(np.float16(vals[6]), np.float16(vals[7])))
                elif bf16:                       # each value rounded to nearest even, two a word
                    stg128(out, u32(q * u32(4)),
                           f32_to_bf16_bits(vals[0]) | (f32_to_bf16_bits(vals[1]) << u32(16)),
                           f32_to_bf16_bits(vals[2]) | (f32_to_bf16_bits(vals[3]) << u32(16)),
                           f32_to_bf16_bits(vals[4]) | (f32_to_bf16_bits(vals[5]) << u32(16)),
                           f32_to_bf16_bits(vals[6]) | (f32_to_bf16_bits(vals[7]) << u32(16)))
                else:
                    stg128(out, u32(q * u32(8)), f32_as_u32(vals[0]), f32_as_u32(vals[1]),
                           f32_as_u32(vals[2]), f32_as_u32(vals[3]))
                    stg128(out, u32(q * u32(8) + u32(4)), f32_as_u32(vals[4]), f32_as_u32(vals[5]),
                           f32_as_u32(vals[6]), f32_as_u32(vals[7]))

    return jit_kernel(dequantize_kernel)


@lru_cache(maxsize=None)
def make_repack_kernel(spec):
    """Kernel(flat packed, flat absmax, tiled packed, tiled absmax, N, K, n_kb_tiled) for a
    :class:`RepackSpec`: one thread per tiled word; padding blocks (K rounded up to 64) get zero words and
    zero absmax."""
    k = spec.k
    zero = (np.uint8 if spec.absmax_format == "e4m4" else np.float32)(0)

    def repack_kernel(fpacked, fabsmax, tpacked, tabsmax, N, K, n_kb):
        g = cuda.grid(1)
        if g < N * n_kb * k:
            blk = g // k
            bit = g - blk * k
            n = blk // n_kb
            kb = blk - n * n_kb
            slot = tiled_block(n, kb, N)
            kbr = K // BLOCK
            inside = kb < kbr
            src = n * kbr + kb
            tpacked[slot * k + bit] = fpacked[src * k + bit] if inside else u32(0)
            if bit == 0:
                tabsmax[slot] = fabsmax[src] if inside else zero

    return jit_kernel(repack_kernel)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
def _grid(n_threads, tpb):
    return max(1, -(-n_threads // tpb))


def quantize(W, k=4, codebook=None, absmax_format="e4m4", layout="flat", bf16=False, stream=None):
    """Quantize W[N, K] (float16/float32, or bfloat16 bits as int16 with ``bf16=True``) on the GPU.

    Returns a KbitWeight whose arrays are device arrays. Bit-for-bit equal to ``reference.quantize``
    (then ``reference.repack_tiled`` for ``layout='tiled'``)."""
    k = check_k(k)
    cb = check_codebook(codebook, k)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if absmax_format not in ABSMAX_FORMATS:
        raise ValueError(f"absmax_format must be one of {ABSMAX_FORMATS}, got {absmax_format!r}")
    _arrays.check_finite_host(W, "W")
    stream = _arrays.as_stream(stream)
    Wd, src = _arrays.float_input(W, "W", bf16, 2, stream)
    N, K = Wd.shape
    if K % BLOCK or K == 0 or N == 0:
        raise ValueError(f"W must have N > 0 and K a positive multiple of {BLOCK}, got shape {(N, K)}")
    if layout == "tiled" and N % TILE_N:
        raise ValueError(f"layout='tiled' needs N % {TILE_N} == 0, got N={N}")
    n_kb = padded_k(K, layout) // BLOCK
    packed = cuda.device_array(N * n_kb * k, dtype=np.uint32, stream=stream)
    absmax = cuda.device_array(N * n_kb, dtype=np.uint8 if absmax_format == "e4m4" else np.float32,
                               stream=stream)
    cb_d = cuda.to_device(cb, stream=stream)
    err = cuda.to_device(np.zeros(1, np.int32), stream=stream)
    kern = make_quantize_kernel(QuantizeSpec(k, layout, absmax_format, src))
    kern[_grid(N * n_kb * WARP, QUANT_THREADS), QUANT_THREADS, stream](
        _arrays.flat_view(Wd), packed, absmax, cb_d, i32(N), i32(K), i32(n_kb), err)
    if err.copy_to_host(stream=stream)[0]:
        raise ValueError("W contains NaN or Inf")
    return KbitWeight(packed, absmax, cb_d, k, (N, K), layout, absmax_format)


def plan_dequantize(qw, dtype=np.float16, out=None, stream=None, chunks=DEQUANT_CHUNKS):
    """Checked inputs of :func:`dequantize` bound into a :class:`launch.Plan` (one launch; ``A`` is None).
    ``chunks``: 8-output chunks a thread (:class:`DequantizeSpec`; a benchmark knob)."""
    bits = isinstance(dtype, str) and dtype == "bfloat16"
    if out is not None and not isinstance(out, np.ndarray) and getattr(out, "dtype", None) == np.int16:
        bits = True                                          # an int16 out: bfloat16 bits
    dtype = np.dtype(np.int16) if bits else _arrays.output_dtype(out, dtype, "dtype")   # a given out decides
    if isinstance(qw, (KbitWeight, KbitCodes, KbitFragments)) and qw.shape[0] * qw.shape[1] >= DEQUANT_MAX_OUTPUTS:
        raise ValueError(f"dequantize handles fewer than 2**32 outputs (32-bit index math), got N x K = "
                         f"{qw.shape[0]} x {qw.shape[1]}: dequantize it in slices of rows")
    stream = _arrays.as_stream(stream)
    qw = device_weight(qw, type(qw) if isinstance(qw, (KbitCodes, KbitFragments)) else KbitWeight, stream)
    N, K = qw.shape
    out = _arrays.output(out, "out", (N, K), dtype, stream)
    _arrays.check_aligned(out, 16, "out")
    spec = DequantizeSpec(qw.k, qw.layout, qw.absmax_format, "bfloat16" if bits else dtype, chunks)
    kern = make_dequantize_kernel(spec)
    n_chunks = N * K // ELEMS_PER_THREAD
    return Plan([Step(kern, _grid(n_chunks, DEQUANT_THREADS * spec.chunks), DEQUANT_THREADS,
                      (qw.packed, qw.absmax, qw.codebook, _arrays.flat_view(out, np.uint32), i32(N),
                       i32(K)))], None, out, stream)


def dequantize(qw, dtype=np.float16, out=None, stream=None):
    """KbitWeight (flat or tiled, E4M4 or fp32 absmax), KbitCodes or KbitFragments -> device array [N, K] of
    float16/float32 (``dtype``; a preallocated ``out`` device array decides the type itself), or of bfloat16 bits as
    int16 (``dtype="bfloat16"``, or an int16 ``out``): each value rounded once, to nearest even."""
    return plan_dequantize(qw, dtype, out, stream).launch()


def repack_tiled(qw, stream=None):
    """Flat -> tiled layout on the device (N % 128 == 0; K padded to a multiple of 64 with zero blocks)."""
    stream = _arrays.as_stream(stream)
    qw = device_weight(qw, KbitWeight, stream)
    if qw.layout == "tiled":
        return qw
    N, K = qw.shape
    if N % TILE_N:
        raise ValueError(f"the tiled layout needs N % {TILE_N} == 0, got N={N}")
    n_kb = padded_k(K, "tiled") // BLOCK
    packed = cuda.device_array(N * n_kb * qw.k, dtype=np.uint32, stream=stream)
    absmax = cuda.device_array(N * n_kb, dtype=qw.absmax.dtype, stream=stream)
    kern = make_repack_kernel(RepackSpec(qw.k, qw.absmax_format))
    kern[_grid(N * n_kb * qw.k, 256), 256, stream](
        qw.packed, qw.absmax, packed, absmax, i32(N), i32(K), i32(n_kb))
    return KbitWeight(packed, absmax, qw.codebook, qw.k, qw.shape, "tiled", qw.absmax_format)


def ptx_specs():
    """Every quantize, dequantize and repack specialisation (the codec has no tuning knobs: all of them)."""
    specs = []
    for k in K_BITS:
        for layout in LAYOUTS:
            for fmt in ABSMAX_FORMATS:
                specs += [QuantizeSpec(k, layout, fmt, w) for w in ELEMENT_TYPES]
                specs += [DequantizeSpec(k, layout, fmt, od) for od in DequantizeSpec.DTYPES]
        specs += [RepackSpec(k, fmt) for fmt in ABSMAX_FORMATS]
    specs += [DequantizeSpec(k, layout, fmt, od) for layout in CODE_LAYOUTS for k in CODES_K for fmt in ABSMAX_FORMATS
              for od in DequantizeSpec.DTYPES]
    return specs


def argtypes(spec):
    from numba import types as t
    u32, i32 = t.uint32[::1], t.int32
    am = t.uint8[::1] if spec.absmax_format == "e4m4" else t.float32[::1]
    if isinstance(spec, QuantizeSpec):
        return (NUMBA_TYPES[spec.dtype], u32, am, t.float32[::1], i32, i32, i32, t.int32[::1])
    if isinstance(spec, DequantizeSpec):
        return (u32, am, t.float32[::1], u32, i32, i32)
    return (u32, am, u32, am, i32, i32, i32)


def kernel_specializations():
    """(name, kernel, argument types) for every specialisation, for the PTX checks."""
    make = {QuantizeSpec: make_quantize_kernel, DequantizeSpec: make_dequantize_kernel,
            RepackSpec: make_repack_kernel}
    return [(spec.name, make[type(spec)](spec), argtypes(spec)) for spec in ptx_specs()]
