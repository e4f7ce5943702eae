"""The kbit blockwise codebook format: constants, codebooks, E4M4 absmax, the weight container.

Layout facts (byte-compatible with bitsandbytes' kbit format):

* ``W[N, K]`` (nn.Linear layout) is cut into blocks of ``BLOCK = 32`` consecutive elements of the
  row-major matrix; K must be a multiple of 32, so a block never crosses a row.
* Each element is replaced by the index of the nearest codebook entry (2**k entries, k = 2..5) after
  dividing by the block's absmax.
* A block's indices are stored as k uint32 *bit planes*: word b holds bit b of all 32 indices,
  element j at bit j.
* A block's absmax is one E4M4 byte (``e4m4_encode``) or a float32 (``absmax_format='fp32'``).
* ``layout='flat'``: block ``blk = n*(K//32) + kb`` owns words ``blk*k .. blk*k+k-1`` and absmax
  ``blk``. ``layout='tiled'``: see :func:`tiled_word_index`; the tensor-core and grouped kernels read it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

BLOCK = 32                 # elements per quantization block (one warp, one bit per lane)
K_BITS = (2, 3, 4, 5)      # supported bit widths
MAX_CODES = 1 << max(K_BITS)   # the largest codebook: 32 entries
E4M4_BIAS = 11             # exponent bias of the absmax byte
E4M4_MAX = 31.0            # largest encodable absmax: 2**(15-11) * (1 + 15/16)
TILE_K = 64                # tiled layout: K elements per tile (two blocks)
TILE_N = 128               # tiled layout: columns per tile
LAYOUTS = ("flat", "tiled")
CODE_LAYOUTS = ("codes", "fragments")   # the k-bit-field layouts (KbitCodes, KbitFragments; k = 2, 4)
ABSMAX_FORMATS = ("e4m4", "fp32")


def check_k(k):
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or int(k) not in K_BITS:
        raise ValueError(f"k must be one of {K_BITS}, got {k!r}")
    return int(k)


# --------------------------------------------------------------------------------------------
# Codebooks
# --------------------------------------------------------------------------------------------
def _norm_ppf(p: float) -> float:
    """Inverse standard-normal CDF to float64 precision (Acklam's rational start + Halley steps)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771972e01, -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
         -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00,
         3.754408661907416e00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        x = (((((c[0]*q + c[1])*q + c[2])*q + c[3])*q + c[4])*q + c[5]) / \
            ((((d[0]*q + d[1])*q + d[2])*q + d[3])*q + 1)
    elif p > 1 - 0.02425:
        return -_norm_ppf(1 - p)
    else:
        q = p - 0.5
        r = q * q
        x = (((((a[0]*r + a[1])*r + a[2])*r + a[3])*r + a[4])*r + a[5])*q / \
            (((((b[0]*r + b[1])*r + b[2])*r + b[3])*r + b[4])*r + 1)
    for _ in range(2):  # Halley refinement on Phi(x) - p
        e = 0.5 * math.erfc(-x / math.sqrt(2)) - p
        u = e * math.sqrt(2 * math.pi) * math.exp(x * x / 2)
        x = x - u / (1 + x * u / 2)
    return x


@lru_cache(maxsize=None)
def _codebook(k):
    n = 1 << k
    v = np.array([_norm_ppf(p) for p in np.linspace(0.5 / n, 1 - 0.5 / n, n)], dtype=np.float64)
    v /= np.max(np.abs(v))
    out = v.astype(np.float32)
    out.flags.writeable = False
    return out


def codebook(k):
    """The 2**k normal-float codebook: sorted, symmetric, no zero, max |v| = 1 (float32 copy)."""
    return _codebook(check_k(k)).copy()


def check_codebook(cb, k):
    """Validate a user codebook: 2**k sorted float32-representable values in [-1, 1]."""
    k = check_k(k)
    if cb is None:
        return codebook(k)
    cb = np.asarray(cb)
    if cb.ndim != 1 or cb.shape[0] != (1 << k):
        raise ValueError(f"codebook for k={k} must have shape ({1 << k},), got {cb.shape}")
    if not np.issubdtype(cb.dtype, np.floating):
        raise TypeError(f"codebook must be floating point, got {cb.dtype}")
    cb = cb.astype(np.float32)
    if not np.all(np.isfinite(cb)) or np.any(np.abs(cb) > 1):
        raise ValueError("codebook values must be finite and within [-1, 1]")
    if np.any(np.diff(cb) < 0):
        raise ValueError("codebook must be sorted ascending")
    return cb


# --------------------------------------------------------------------------------------------
# E4M4 absmax bytes
# --------------------------------------------------------------------------------------------
def e4m4_encode(absmax):
    """float -> uint8 E4M4 (bias 11). Normal: 2**(e-11) * (1 + m/16); e = 0: 2**-10 * m/16.

    Exponent from the float32 bits (exact), mantissa rounded half-to-even and clamped to 15
    (no carry into the exponent), exponent clamped to 0..15: the bitsandbytes encoder's rule.
    """
    v = np.abs(np.asarray(absmax, dtype=np.float32))
    bits = v.view(np.uint32).astype(np.int64)
    e = ((bits >> 23) & 0xFF) - 127                   # floor(log2 v) for normal float32
    frac = bits & 0x7FFFFF
    m = frac >> 19                                    # top 4 mantissa bits ...
    rem = frac & 0x7FFFF
    m = m + ((rem > 0x40000) | ((rem == 0x40000) & ((m & 1) == 1)))   # ... rounded half-even
    m = np.minimum(m, 15)
    eb = np.clip(e + E4M4_BIAS, 0, 15)
    # subnormal byte: m = rint(v * 2**14) (exact scaling, then round half-even), clamped
    m_sub = np.minimum(np.rint(v.astype(np.float64) * 2.0 ** 14), 15).astype(np.int64)
    m = np.where(eb == 0, m_sub, np.where(e + E4M4_BIAS > 15, 15, m))
    byte = (eb << 4) | m
    byte = np.where((bits >> 23) == 0, 0, byte)       # zero and float32 subnormals -> 0
    return byte.astype(np.uint8)


def e4m4_decode(byte):
    """uint8 E4M4 -> float32."""
    b = np.asarray(byte).astype(np.uint8).astype(np.int64)
    e = b >> 4
    m = (b & 15).astype(np.float64)
    val = np.where(e > 0, np.ldexp(1.0 + m / 16.0, e - E4M4_BIAS), np.ldexp(m / 16.0, 1 - E4M4_BIAS))
    return val.astype(np.float32)


# --------------------------------------------------------------------------------------------
# Layout index maps
# --------------------------------------------------------------------------------------------
def padded_k(K, layout):
    return -(-K // TILE_K) * TILE_K if layout == "tiled" else K


def block_bytes(k, absmax_format="e4m4"):
    """Bytes of one 32-element block: k bit-plane words and its absmax (an E4M4 byte or a float32)."""
    return 4 * k + (1 if absmax_format == "e4m4" else 4)


def kbit_nbytes(N, K, k, absmax_format="e4m4"):
    """Bytes of an N x K kbit weight in the flat (or code, or fragment) layout: what a kernel reads to use every
    weight once (``KbitWeight.nbytes`` without a weight; K a multiple of 32; the tiled layout pads K to whole tiles,
    ``padded_k``)."""
    return N * K // BLOCK * block_bytes(k, absmax_format)


def tiled_word_index(n, kb_all, bit, N, k):
    """Word offset of (column n, k-block kb_all, plane bit) in the tiled layout."""
    n_tiles = N // TILE_N
    tile = (kb_all // 2) * n_tiles + n // TILE_N
    return tile * (TILE_N * 2 * k) + ((n % TILE_N) * 2 + kb_all % 2) * k + bit


def tiled_absmax_index(n, kb_all, N):
    n_tiles = N // TILE_N
    tile = (kb_all // 2) * n_tiles + n // TILE_N
    return tile * (TILE_N * 2) + (n % TILE_N) * 2 + kb_all % 2


# --------------------------------------------------------------------------------------------
# The weight containers
# --------------------------------------------------------------------------------------------
class _HostDevice:
    """``on_device`` / ``to_numpy()`` (a copy whose arrays are NumPy arrays) / ``to_device()`` for a
    frozen dataclass whose ``ARRAYS`` fields are arrays."""
    ARRAYS = ()

    def dtypes(self):
        """{array field: the element types the kernels accept for it} (``core.device_weight`` checks)."""
        raise NotImplementedError

    @property
    def on_device(self):
        return not isinstance(getattr(self, self.ARRAYS[0]), np.ndarray)

    def to_numpy(self):
        def host(a):
            return np.array(a.copy_to_host() if hasattr(a, "copy_to_host") else a)
        return replace(self, **{f: host(getattr(self, f)) for f in self.ARRAYS})

    def to_device(self, stream=0):
        from numba import cuda
        return replace(self, **{f: (cuda.to_device(np.ascontiguousarray(getattr(self, f)), stream=stream)
                                    if isinstance(getattr(self, f), np.ndarray) else getattr(self, f))
                                for f in self.ARRAYS})


@dataclass(frozen=True)
class KbitWeight(_HostDevice):
    """A kbit-quantized weight W[N, K].

    packed:  uint32 bit-plane words, ``n_blocks * k`` of them (tiled: K padded to 64).
    absmax:  uint8 E4M4 bytes or float32, one per block.
    codebook: float32[2**k].
    Arrays are NumPy arrays (reference) or device arrays (GPU functions).
    """
    packed: object
    absmax: object
    codebook: object
    k: int
    shape: tuple
    layout: str = "flat"
    absmax_format: str = "e4m4"
    ARRAYS = ("packed", "absmax", "codebook")

    def __post_init__(self):
        check_k(self.k)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "tiled" and self.shape[0] % TILE_N:
            raise ValueError(f"the tiled layout needs N % {TILE_N} == 0, got N={self.shape[0]}")
        _check_blocks(self)

    def dtypes(self):
        absmax = np.uint8 if self.absmax_format == "e4m4" else np.float32
        return {"packed": (np.uint32,), "absmax": (absmax,), "codebook": (np.float32,)}

    @property
    def N(self):
        return self.shape[0]

    @property
    def K(self):
        return self.shape[1]

    @property
    def n_kblocks(self):
        """Blocks per row, counting the tiled layout's zero padding."""
        return padded_k(self.K, self.layout) // BLOCK

    @property
    def n_blocks(self):
        return self.N * self.n_kblocks

    @property
    def nbytes(self):
        """Bytes a kernel must read to use every weight once."""
        return self.n_blocks * block_bytes(self.k, self.absmax_format)


CODES_K = (2, 4)           # bit widths of the kernel-native code layout: a byte holds whole codes


@dataclass(frozen=True)
class _CodeBlocks(_HostDevice):
    """The fields and sizes of the kernel-native layouts whose blocks hold k-bit fields in element order
    (k = 2, 4): ``KbitCodes`` and ``KbitFragments``, which differ only in the order of the blocks."""
    packed: object
    absmax: object
    codebook: object
    k: int
    shape: tuple
    absmax_format: str = "e4m4"
    ARRAYS = ("packed", "absmax", "codebook")
    NAME = None                                 # the layout's name in messages

    def __post_init__(self):
        if self.k not in CODES_K:
            raise ValueError(f"the {self.NAME} layout holds k in {CODES_K}, got k={self.k}")
        _check_blocks(self)

    dtypes = KbitWeight.dtypes
    N = KbitWeight.N
    K = KbitWeight.K

    @property
    def n_kblocks(self):
        return self.K // BLOCK

    n_blocks = KbitWeight.n_blocks
    nbytes = KbitWeight.nbytes


@dataclass(frozen=True)
class KbitCodes(_CodeBlocks):
    """A kbit weight W[N, K] in the kernel-native *code* layout (``pair_gemv`` reads it).

    The same blocks, absmax and codebook as the flat layout, but each block's k words hold the 32
    indices as k-bit fields in element order instead of bit planes: element j of a block sits at bits
    ``k * (j % (32 // k))`` of word ``j // (32 // k)``. So byte c of word w is a whole group of
    ``8 // k`` consecutive elements (a pair at k = 4, a quad at k = 2): one byte indexes a table of
    pre-combined codebook values with no bit-plane transpose in the kernel. Only k = 2 and 4 (where 8 is
    a multiple of k). Made from a KbitWeight by ``reference.to_codes`` / ``pair_gemv.to_codes`` and back
    by ``reference.from_codes``, exactly.
    """
    NAME = "code"
    layout = "codes"


FRAGMENT_N = 16           # columns of a fragment tile: the rows of mma_gemv's A operand (m16), one strip
FRAGMENT_KB = 8           # blocks of a fragment tile: the 256 k one warp of mma_gemv takes of a strip
FRAGMENT_BLOCKS = FRAGMENT_N * FRAGMENT_KB


def fragment_position(n, kb, n_kb, k):
    """Where block kb of column n sits in the fragment layout (``KbitFragments``) of a weight with n_kb blocks a
    row: tiles of 16 columns x 8 blocks, strip-major (a strip's tiles back to back), and inside a tile the order
    in which ``mma_gemv``'s lanes load them. Lane l = 4g + t's 16-byte load i of a tile holds, at k = 4, block
    t + 4(i % 2) of column 8(i // 2) + g, at k = 2 blocks 2t, 2t + 1 of column 8i + g; so piece i of lane l is
    at position 32i + l (k = 4) or 2(32i + l) (k = 2): each load instruction of a warp reads 512 contiguous
    bytes. Works on NumPy integer arrays and on scalars."""
    r, j = n % FRAGMENT_N, kb % FRAGMENT_KB
    tile = (n // FRAGMENT_N) * (n_kb // FRAGMENT_KB) + kb // FRAGMENT_KB
    if k == 4:
        inside = 64 * (r // 8) + 32 * (j // 4) + 4 * (r % 8) + j % 4
    else:
        inside = FRAGMENT_KB * r + j
    return tile * FRAGMENT_BLOCKS + inside


def fits_fragments(N, K):
    """Whether a weight of this shape fills whole fragment tiles (the layout has no padding)."""
    return N % FRAGMENT_N == 0 and K % (FRAGMENT_KB * BLOCK) == 0


def check_fragment_shape(N, K):
    """The fragment layout has no padding: whole tiles only."""
    if not fits_fragments(N, K):
        raise ValueError(f"the fragment layout needs N a multiple of {FRAGMENT_N} and K of {FRAGMENT_KB * BLOCK}, "
                         f"got N={N}, K={K}")


@dataclass(frozen=True)
class KbitFragments(_CodeBlocks):
    """A kbit weight W[N, K] in the *fragment* layout (``mma_gemv`` reads it, with a 16-byte load per lane
    and 512 contiguous bytes per load instruction; ``mma_gemv.to_fragments`` makes it).

    The code layout's blocks (``KbitCodes``: each block's k words hold its 32 indices as k-bit fields) and
    absmax values, permuted block by block by :func:`fragment_position`; the same bytes. N a multiple of 16
    and K of 256 (no padding). ``reference.to_fragments`` / ``reference.from_fragments`` convert exactly.
    The pair gemv reads it too, 2-25% slower than the code layout (its lanes read one column at a time, so a warp's load
    meets 8 runs of 64 bytes instead of one of 512): it suits batched decode (M >= 3).
    """
    NAME = "fragment"
    layout = "fragments"

    def __post_init__(self):
        check_fragment_shape(*self.shape)
        super().__post_init__()


def _size(a):
    return int(np.prod(a.shape))


def _check_blocks(w):
    """What every kbit weight container checks: the absmax format, K a multiple of 32, and k words and
    one absmax per block."""
    if w.absmax_format not in ABSMAX_FORMATS:
        raise ValueError(f"absmax_format must be one of {ABSMAX_FORMATS}, got {w.absmax_format!r}")
    if w.K % BLOCK:
        raise ValueError(f"K must be a multiple of {BLOCK}, got {w.K}")
    want = w.n_blocks * w.k
    if _size(w.packed) != want:
        raise ValueError(f"packed must hold {want} uint32 words, got {_size(w.packed)}")
    if _size(w.absmax) != w.n_blocks:
        raise ValueError(f"absmax must hold {w.n_blocks} values, got {_size(w.absmax)}")


@dataclass(frozen=True)
class KbitExperts(_HostDevice):
    """E kbit weights of one shape, k, layout, absmax format and codebook, stored back to back (the MoE
    kernels' input): expert e's words are packed[e*words : (e+1)*words] (its own flat, tiled or code
    layout), its absmax values absmax[e*blocks : (e+1)*blocks]. Build with ``core.stack_experts``."""
    packed: object
    absmax: object
    codebook: object
    k: int
    expert_shape: tuple
    n_experts: int
    layout: str = "flat"
    absmax_format: str = "e4m4"
    ARRAYS = ("packed", "absmax", "codebook")
    dtypes = KbitWeight.dtypes

    def expert(self, e):
        """Expert e as a KbitWeight (KbitCodes, KbitFragments for those layouts; views, no copy)."""
        N, K = self.expert_shape
        b = N * padded_k(K, self.layout) // BLOCK
        w = b * self.k
        packed, absmax = self.packed[e * w:(e + 1) * w], self.absmax[e * b:(e + 1) * b]
        if self.layout in ("codes", "fragments"):
            cls = KbitCodes if self.layout == "codes" else KbitFragments
            return cls(packed, absmax, self.codebook, self.k, self.expert_shape, self.absmax_format)
        return KbitWeight(packed, absmax, self.codebook, self.k, self.expert_shape, self.layout, self.absmax_format)


# --------------------------------------------------------------------------------------------
# The other seed systems (issue 5): GemLite-style uniform n-bit, SBVR, BitNet W2A8
# --------------------------------------------------------------------------------------------
UNIFORM_BITS = (1, 2, 3, 4, 8)
UNIFORM_GROUPS = (32, 64, 128, None)   # None: one scale and zero for the whole tensor
LANES = 32                             # uniform: word t of a 32-word chunk is read by lane t
SBVR_GROUP = 128                       # SBVR: weights (and activations) per coefficient group
SBVR_PLANES = 4                        # SBVR: bit planes (coefficients) per weight group
SBVR_ACT_PLANES = 8                    # SBVR: two's-complement planes of a 7-bit activation
BITNET_BLOCK_N = 16                    # BitNet: a packed block is 16 columns ...
BITNET_BLOCK_K = 32                    # ... x 32 K elements = 32 words of 16 two-bit codes
BITNET_ORDER = (0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)   # element at 2-bit slot p
INT8_MAX = 127                         # int8 activations: q in [-127, 127]
INT8_ABSMAX_FLOOR = np.float32(1e-5)   # BitNet's clamp: an all-zero row gets scale 127 / 1e-5


def uniform_elements_per_word(bits):
    """Values per int32 word: 32 // bits (3 bits: 10 values, bits 30-31 unused)."""
    if bits not in UNIFORM_BITS:
        raise ValueError(f"bits must be one of {UNIFORM_BITS}, got {bits!r}")
    return 32 // bits


@dataclass(frozen=True)
class UniformWeight(_HostDevice):
    """GemLite-style uniform ``bits``-bit weight W[N, K]: ``w = (q - zero) * scale``.

    packed: uint32 [N, n_chunks * 32]. Column n's K values are cut into chunks of ``32 * epw`` (epw =
        32 // bits values per word); word t of chunk c holds ``q[n, c*32*epw + 32*j + t]`` at bits
        ``bits*j ..`` (j = 0..epw-1, LSB first): lane t of a warp reads word t and the warp's 32 loads
        are one 128-byte line (GemLite's "stride 32" packing). K is zero-padded to whole chunks.
    scale_zero: float16 [N, K // group_size, 2] (scale, zero) per group of ``group_size`` consecutive
        K values, or [1, 1, 2] for one pair for the whole tensor (``group_size=None``).
    """
    packed: object
    scale_zero: object
    bits: int
    shape: tuple
    group_size: object = 128
    ARRAYS = ("packed", "scale_zero")

    def __post_init__(self):
        uniform_elements_per_word(self.bits)
        if self.group_size not in UNIFORM_GROUPS:
            raise ValueError(f"group_size must be one of {UNIFORM_GROUPS}, got {self.group_size!r}")
        N, K = self.shape
        if K % BLOCK or (self.group_size and K % self.group_size):
            raise ValueError(f"K must be a multiple of 32 and of the group size, got K={K}")
        if tuple(self.packed.shape) != (N, self.n_chunks * LANES):
            raise ValueError(f"packed must have shape {(N, self.n_chunks * LANES)}, got {self.packed.shape}")
        want = (N, K // self.group_size, 2) if self.group_size else (1, 1, 2)
        if tuple(self.scale_zero.shape) != want:
            raise ValueError(f"scale_zero must have shape {want}, got {tuple(self.scale_zero.shape)}")

    def dtypes(self):
        return {"packed": (np.uint32,), "scale_zero": (np.float16,)}

    @property
    def epw(self):
        return uniform_elements_per_word(self.bits)

    @property
    def n_chunks(self):
        return -(-self.shape[1] // (LANES * self.epw))

    @property
    def nbytes(self):
        return _size(self.packed) * 4 + _size(self.scale_zero) * 2


@dataclass(frozen=True)
class SbvrWeight(_HostDevice):
    """SBVR weight W[N, K] (bitvector sums): in each group of 128 K values of a column,
    ``w = sum_s coeff[s] * bit_s`` over 4 bit planes.

    bvr: uint32 [K // 32, N, 4]: plane s of the 32 values ``32c .. 32c+31`` of column n, value j at bit j
        (a column's 4 planes are 16 contiguous bytes).
    coeff_idx: uint8 or uint16 [K // 128, N]: the row of ``coeff_cache`` that group uses.
    coeff_cache: float16 [lines, 4]: the global coefficient vectors.
    """
    bvr: object
    coeff_idx: object
    coeff_cache: object
    shape: tuple
    ARRAYS = ("bvr", "coeff_idx", "coeff_cache")

    def __post_init__(self):
        N, K = self.shape
        if K % SBVR_GROUP:
            raise ValueError(f"SBVR needs K % {SBVR_GROUP} == 0, got K={K}")
        if tuple(self.bvr.shape) != (K // BLOCK, N, SBVR_PLANES):
            raise ValueError(f"bvr must have shape {(K // BLOCK, N, SBVR_PLANES)}, got {self.bvr.shape}")
        if tuple(self.coeff_idx.shape) != (K // SBVR_GROUP, N):
            raise ValueError(f"coeff_idx must have shape {(K // SBVR_GROUP, N)}, got {self.coeff_idx.shape}")
        if self.coeff_cache.ndim != 2 or self.coeff_cache.shape[1] != SBVR_PLANES:
            raise ValueError(f"coeff_cache must be [lines, {SBVR_PLANES}], got {self.coeff_cache.shape}")

    def dtypes(self):
        return {"bvr": (np.uint32,), "coeff_idx": (np.uint8, np.uint16), "coeff_cache": (np.float16,)}

    @property
    def nbytes(self):
        return _size(self.bvr) * 4 + _size(self.coeff_idx) * np.dtype(self.coeff_idx.dtype).itemsize


@dataclass(frozen=True)
class BitnetWeight(_HostDevice):
    """BitNet b1.58 ternary weight W[N, K] ~ w_q * w_scale[part of n], w_q in {-1, 0, 1}.

    packed: uint32 [N // 16, K // 32, 32]: block (nb, kb) is 16 columns x 32 K values; its word
        ``2*r + h`` holds column ``16*nb + r``, values ``32*kb + 16*h .. +15`` as 2-bit codes ``w + 2``,
        value ``BITNET_ORDER[p]`` at bits ``2p``: one shift and mask by 0x03030303 then puts 4
        consecutive values in 4 bytes, ready for dp4a.
    w_scale: float32 [parts]: part i covers columns ``i*N/parts .. (i+1)*N/parts - 1``.
    """
    packed: object
    w_scale: object
    shape: tuple
    ARRAYS = ("packed", "w_scale")

    def __post_init__(self):
        N, K = self.shape
        if N % BITNET_BLOCK_N or K % BITNET_BLOCK_K:
            raise ValueError(f"BitNet needs N % {BITNET_BLOCK_N} == 0 and K % {BITNET_BLOCK_K} == 0, "
                             f"got {self.shape}")
        want = (N // BITNET_BLOCK_N, K // BITNET_BLOCK_K, 32)
        if tuple(self.packed.shape) != want:
            raise ValueError(f"packed must have shape {want}, got {tuple(self.packed.shape)}")
        parts = _size(self.w_scale)
        if parts < 1 or N % parts or (N // parts) % BITNET_BLOCK_N:
            raise ValueError(f"w_scale must hold P parts with N/P a multiple of 16, got {parts} for N={N}")

    def dtypes(self):
        return {"packed": (np.uint32,), "w_scale": (np.float32,)}

    @property
    def nbytes(self):
        return _size(self.packed) * 4
