"""Per-token int8 activation quantizer for the int8 (dp4a) kernels: uniform's int8 path and BitNet W2A8.

``s = 127 / max(|x|, 1e-5)`` per row, ``q = clip(rint(x * s), -127, 127)``, ``d = 1 / s`` (x ~ q * d);
float32 arithmetic, so it equals ``reference.int8_per_token`` bit for bit. One CTA per token: a block
max, then every thread packs words of 4 bytes. Two word layouts:

* ``epw = 0`` (BitNet): natural order, word w = bytes q[4w .. 4w+3].
* ``epw > 0`` (uniform n-bit with epw values per weight word): the lane order of
  ``reference.uniform_int8_words`` — lane t's word holds the activations of 4 of its weight values, so
  one dp4a multiplies 4 decoded weights by one activation word.

Reference twin: ``reference.int8_per_token`` / ``reference.uniform_int8_words``. Tests: test_uniform.py,
test_bitnet.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda

from . import _arrays
from .device import block_max, i32, inlined, jit_kernel, make_loader, u32
from .formats import INT8_ABSMAX_FLOOR, INT8_MAX, LANES
from .launch import NUMBA_TYPES, Spec, Step, launch_step, type_name

THREADS = 256
Q_MAX = np.float32(INT8_MAX)


def words_per_row(K, epw):
    """int32 words per token row in the layout for ``epw`` (0: natural)."""
    if epw == 0:
        return K // 4
    return -(-K // (LANES * epw)) * -(-epw // 4) * LANES


EPW_CHOICES = (0, 4, 8, 10, 16, 32)     # 0: natural order; else the uniform lane order of that many per word


@dataclass(frozen=True)
class Int8ActSpec(Spec):
    """The int8 activation quantizer's choices: the key of :func:`make_int8_kernel`."""
    FAMILY = "int8_act"
    a_type: str
    epw: int = 0

    def normalise(self):
        if self.epw not in EPW_CHOICES:
            raise ValueError(f"epw must be one of {EPW_CHOICES}, got {self.epw!r}")
        return dict(a_type=type_name(self.a_type, "a_type"), epw=int(self.epw))


@lru_cache(maxsize=None)
def make_int8_kernel(spec):
    """Kernel(A[M*K], words[M*W], d[M], K, W) for an :class:`Int8ActSpec`, grid M, THREADS threads."""
    a_src, epw = spec.a_type, spec.epw
    load = make_loader(a_src)
    qpw = -(-epw // 4) if epw else 1

    @inlined
    def q8(A, base, kk, K, s):
        """The int8 byte of x[kk] (0 past K) in the low 8 bits of a uint32."""
        if kk >= K:
            return u32(0)
        v = i32(round(load(A, base + kk) * s))
        return u32(min(max(v, i32(-127)), i32(127))) & u32(0xFF)

    def kernel(A, words, d, K, W):
        scratch = cuda.shared.array(LANES, np.float32)
        m = cuda.blockIdx.x
        base = m * K
        amax = np.float32(0.0)
        for kk in range(cuda.threadIdx.x, K, cuda.blockDim.x):
            amax = max(amax, abs(load(A, base + kk)))
        amax = block_max(amax, scratch)
        s = Q_MAX / max(amax, INT8_ABSMAX_FLOOR)
        if cuda.threadIdx.x == 0:
            d[m] = np.float32(1.0) / s
        for w in range(cuda.threadIdx.x, W, cuda.blockDim.x):
            word = u32(0)
            if epw == 0:
                for i in range(4):
                    word |= q8(A, base, 4 * w + i, K, s) << u32(8 * i)
            else:                                   # word (c*qpw + quad)*32 + t
                t = w % LANES
                quad = (w // LANES) % qpw
                c = w // (LANES * qpw)
                for i in range(4):
                    row = 4 * quad + i
                    if row < epw:
                        word |= q8(A, base, (c * epw + row) * LANES + t, K, s) << u32(8 * i)
            words[m * W + w] = word

    return jit_kernel(kernel)


def int8_step(Ad, a_src, epw, stream=0, words=None, d=None):
    """The quantizer launch for a checked device A: (Step, words, d)."""
    shape = tuple(Ad.shape)
    M, K = (1, shape[0]) if len(shape) == 1 else shape
    if K % 4:
        raise ValueError(f"K must be a multiple of 4, got {K}")
    W = words_per_row(K, epw)
    words = _arrays.output(words, "words", (M, W), np.uint32, stream)
    d = _arrays.output(d, "d", (M,), np.float32, stream)
    step = Step(make_int8_kernel(Int8ActSpec(a_src, epw)), M, THREADS,
                (_arrays.flat_view(Ad), _arrays.flat_view(words), d, i32(K), i32(W)))
    return step, words, d


def quantize_int8(A, epw=0, stream=None, bf16=False, words=None, d=None):
    """Per-token int8 activations of A [M, K] or [K]: (words uint32 [M, W], d float32 [M]).
    ``epw``: 0 for the natural byte order, else the uniform lane order for that many values per word.
    ``words``/``d`` may be preallocated device arrays (decode loops, CUDA graphs)."""
    stream = _arrays.as_stream(stream)
    Ad, a_src = _arrays.float_input(A, "A", bf16, (1, 2), stream)
    step, words, d = int8_step(Ad, a_src, epw, stream, words, d)
    launch_step(step, stream)
    return words, d


def ptx_specs():
    return [Int8ActSpec(a, epw) for epw in EPW_CHOICES for a in ("float16", "float32")
            if a == "float16" or epw in (0, 10)]


def kernel_specializations():
    from numba import types as t
    return [(spec.name, make_int8_kernel(spec), (NUMBA_TYPES[spec.a_type], t.uint32[::1], t.float32[::1], t.int32,
                                                 t.int32)) for spec in ptx_specs()]
