"""Shared test helpers: mode flags, example sizes and random weights."""
import os

import numpy as np
import pytest
from hypothesis import Phase, strategies as st

import kbit_numba

SIM = kbit_numba.SIMULATOR
PTX_ONLY = os.environ.get("KBIT_NUMBA_PTX_ONLY") == "1"
# The simulator runs one Python thread per CUDA thread: keep its problems to a few blocks.
# On the GPU every new specialisation costs seconds of compilation: examples stay modest there too.
EXAMPLES = 10 if SIM else 12
# The fuzz run (tests/README.md): KBIT_FUZZ=N runs N examples per kernel family (FUZZ_FAMILIES; conftest.py shares
# them among the family's properties), and on the GPU lets the shape strategies reach large sizes.
FUZZ = int(os.environ.get("KBIT_FUZZ", "0") or 0)
# Kernel families and the hypothesis properties (file::function) that exercise them: KBIT_FUZZ=N runs N examples
# per family (conftest.py); every property is in one (test_structure.py checks).
FUZZ_FAMILIES = {
    "quantize/dequantize/repack": [
        "test_codec.py::test_quantize_flat_bit_exact", "test_codec.py::test_quantize_tiled_bit_exact",
        "test_codec.py::test_dequantize_error_bound", "test_codec.py::test_dequantize_code_layout",
        "test_pair_gemv.py::test_codes_round_trip", "test_formats.py::test_tiled_round_trip",
        "test_formats.py::test_bitplanes_round_trip", "test_formats.py::test_reference_error_bound",
        "test_formats.py::test_e4m4_relative_error_normal_range",
        "test_formats.py::test_e4m4_absolute_error_subnormal_range",
        "test_formats.py::test_kbit_nbytes_is_a_weights_nbytes"],
    "gemv (scalar, pair, tensor-core)": [
        "test_gemv.py::test_gemv_flat", "test_gemv.py::test_gemv_tiled", "test_pair_gemv.py::test_pair_gemv",
        "test_pair_gemv.py::test_pair_gemv_f16_acc", "test_pair_gemv.py::test_pair_gemv_silu_pairs",
        "test_pair_gemv.py::test_pair_gemv_residual_and_norm_property", "test_pair_gemv.py::test_warp_reduce_scatter",
        "test_mma_gemv.py::test_mma_gemv", "test_mma_gemv.py::test_mma_gemv_fragments",
        "test_mma_gemv.py::test_mma_gemv_silu_pairs", "test_mma_gemv.py::test_mma_gemv_split_k",
        "test_mma_gemv.py::test_mma_gemv_split_k_silu_pairs"],
    "gemm": ["test_gemm.py::test_gemm", "test_gemm.py::test_gemm_other_activation_types",
             "test_gemm.py::test_gemm_code_layout"],
    "grouped_gemv": ["test_gemv.py::test_grouped_gemv", "test_mma_gemv.py::test_mma_gemv_grouped",
                     "test_pair_gemv.py::test_pair_gemv_grouped_property"],
    "grouped_gemm": ["test_gemm.py::test_grouped_gemm"],
    "linear / KbitLinear": ["test_linear.py::test_kbit_linear_any_shape"],
    "uniform": ["test_uniform.py::test_uniform_gemv", "test_uniform.py::test_gpu_quantizer_equals_reference",
                "test_uniform.py::test_pack_roundtrip_and_quantizer_error"],
    "int8 activation quantizer": ["test_uniform.py::test_int8_activation_quantizer"],
    "sbvr": ["test_sbvr.py::test_sbvr_gemv", "test_sbvr.py::test_activation_planes_equal_reference"],
    "bitnet": ["test_bitnet.py::test_bitnet_gemv"],
    "calibrate (host)": ["test_calibrate.py::test_gptq_property_diagonal_hessian_is_round_to_nearest"],
}
MAX_N = 8 if SIM else 300
MAX_KB = 4 if SIM else 40        # K = 32 * kb
# Tiled layouts have 128 columns a tile: on the simulator one tile and up to three blocks (an odd K still
# pads to a whole K tile of two blocks), two tiles on the GPU.
MAX_TILES = 1 if SIM else 2
MAX_KB_TILED = 3 if SIM else MAX_KB


# The slowest properties on the simulator (a 128-column tile of simulated warps costs ~40-60 s an example) run
# only their @example cases there, chosen to cover what the draws would (both absmax formats, a padded K, the
# smallest and largest k); on the GPU they draw as every property does. (settings(**SIM_EXPLICIT_ONLY))
SIM_EXPLICIT_ONLY = dict(phases=(Phase.explicit,)) if SIM else {}


def benchmark_script(name):
    """benchmarks/NAME.py loaded as a module (the scripts are not a package), for tests of their GPU-free pieces."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_split(names, values):
    """On the GPU, one test per value of ``names`` (a parameter the property would otherwise draw), each with
    ``gpu_examples`` draws: every draw there may compile a kernel specialisation (seconds), and pytest-xdist
    runs the split tests on separate cores. On the simulator one test draws it (the values are ``None``); in a GPU
    fuzz run FUZZ_PARTS tests draw it, one per kernel variant (:func:`variants`)."""
    n = len(names.split(","))
    if SIM or FUZZ:
        none = None if n == 1 else (None,) * n
        parts = 1 if SIM else FUZZ_PARTS
        return pytest.mark.parametrize(names, [none] * parts, ids=[f"part{i}" for i in range(parts)])
    return pytest.mark.parametrize(names, values)


def gpu_examples(n, parts):
    """Examples per split test: ``n`` on the simulator, ``n / parts`` (rounded up) on the GPU."""
    return n if SIM else -(-n // parts)


def random_weight(rng, N, K, scale=1.0, dtype=np.float32):
    """Normal weights with per-row magnitudes spread over decades (exercises E4M4's range)."""
    W = rng.standard_normal((N, K)) * scale * np.exp(rng.uniform(-4, 1.5, size=(N, 1)))
    return W.astype(dtype)


seeds = st.integers(0, 2**32 - 1)
ks = st.sampled_from([2, 3, 4, 5])


def sizes(default_max, fuzz_max):
    """1..default_max; in a GPU fuzz run one draw in eight from up to ``fuzz_max`` (the references' NumPy
    time grows with the size, so large draws stay a minority)."""
    small = st.integers(1, default_max)
    if not FUZZ or SIM:
        return small
    return st.one_of(*[small] * 7, st.integers(1, fuzz_max))


# Kernel variants on the GPU. Every drawn combination of a kernel's compile-time choices (k, M, types, tuning) is a
# specialisation to compile: 7-15 s each with 16 compiles at once, 93% of a cold GPU suite's time
# (benchmarks/compile_log.py), against ~20 ms for an example that reuses one. So on the GPU each test of a property
# (``gpu_split`` makes several) draws ONE combination, ``VARIANT_PART`` of a table picked by the run's seed
# (``KBIT_FUZZ_SEED``, printed in the header: the same seed draws the same variants again):
# * the suite: the defaults (the first value of each choice) for the first test, random combinations for the others;
# * a fuzz run (KBIT_FUZZ): FUZZ_PARTS tests a property, the defaults and FUZZ_PARTS - 1 combinations that change
#   one choice each.
# Every value of every choice is drawn over runs; shapes and data in every run. The simulator (CI), which compiles
# nothing, draws every combination, and CI's PTX check compiles every specialisation.
FUZZ_PARTS = int(os.environ.get("KBIT_FUZZ_VARIANTS", "3")) + 1
FUZZ_SEED = os.environ.get("KBIT_FUZZ_SEED") or "0"     # (conftest.py sets it at random on the GPU unless given)
VARIANT_PART = [0]                # the running test's index among its property's tests (set by conftest.py)
SUITE_VARIANTS = 16               # table size for the suite (more than any property's tests)


def one_off_variants(choices, n, seed):
    """The defaults (first values) of ``choices`` and ``n`` combinations, picked by ``seed``, that change one
    choice each."""
    import random
    default = tuple(c[0] for c in choices)
    one_offs = [default[:i] + (v,) + default[i + 1:] for i, c in enumerate(choices) for v in c[1:]]
    return [default] + random.Random(f"{seed}:{choices!r}").sample(one_offs, min(n, len(one_offs)))


def random_variants(choices, n, seed):
    """The defaults of ``choices`` and ``n`` combinations drawn at random (each choice uniformly), picked by ``seed``."""
    import random
    rnd = random.Random(f"{seed}:{choices!r}")
    return [tuple(c[0] for c in choices)] + [tuple(rnd.choice(c) for c in choices) for _ in range(n)]


def variants(*choices):
    """A tuple: one value of each of ``choices`` (sequences; the first value of each is the kernel's default). On the
    simulator every combination may be drawn; on the GPU the running test's combination (see above)."""
    choices = tuple(tuple(c) for c in choices)
    if SIM:
        return st.tuples(*(st.sampled_from(c) for c in choices))
    table = (one_off_variants(choices, FUZZ_PARTS - 1, FUZZ_SEED) if FUZZ
             else random_variants(choices, SUITE_VARIANTS - 1, FUZZ_SEED))
    return st.builds(lambda: table[VARIANT_PART[0] % len(table)])


def sim_example(**kwargs):
    """``hypothesis.example`` on the simulator only: there a slow property runs just its explicit cases
    (SIM_EXPLICIT_ONLY), chosen to cover what draws would; on the GPU the draws do, and an explicit case would
    compile kernel variants of its own in every test of the property."""
    from hypothesis import example
    return example(**kwargs) if SIM else (lambda f: f)


# Weights that stress the format: blocks of zeros, one huge element per block (the rest round to the
# codebook's zero), block maxima at and past the E4M4 range's ends (31 saturates; 2**-14 is its smallest
# step), and float16-subnormal magnitudes.
WEIGHT_KINDS = ("normal", "zero_blocks", "one_huge", "e4m4_edges", "subnormal")
weight_kinds = st.sampled_from(WEIGHT_KINDS)
E4M4_EDGES = (31.0, 40.0, 2.0 ** -14, 2.0 ** -10, 0.96875 * 2.0 ** -10)


def adversarial_weight(rng, N, K, kind, dtype=np.float32):
    """A [N, K] weight of one of ``WEIGHT_KINDS`` (K a multiple of 32)."""
    W = random_weight(rng, N, K)
    blocks = W.reshape(N, K // 32, 32)
    if kind == "zero_blocks":
        blocks[rng.random(blocks.shape[:2]) < 0.3] = 0
    elif kind == "one_huge":
        i = rng.integers(0, 32, size=blocks.shape[:2])
        np.put_along_axis(blocks, i[..., None], 1e3 * np.sign(rng.standard_normal(blocks.shape[:2]))[..., None], 2)
    elif kind == "e4m4_edges":
        peak = np.abs(blocks).max(axis=2, keepdims=True)
        target = rng.choice(E4M4_EDGES, size=peak.shape)
        blocks *= np.where(peak > 0, target / np.maximum(peak, 1e-30), 0)
    elif kind == "subnormal":
        blocks *= 2.0 ** -20
    elif kind != "normal":
        raise ValueError(f"unknown weight kind {kind!r}")
    return W.astype(dtype)


# Large weights are drawn as rows of a pool (kbit_weight): the NumPy reference quantizer takes ~0.3 us an
# element, so a 20000 x 16384 draw would spend ~100 s in it; a pool of POOL_ROWS distinct rows costs K/32 blocks
# of reference work each, and every output column is still checked exactly against its own row's reference.
POOL_ABOVE = 1 << 16          # elements; smaller weights are drawn whole
POOL_ROWS = 16


def weight_rows(rng, N, K, kind="normal", dtype=np.float32):
    """(pool [P, K], rows [N]): the weight ``pool[rows]``, one of ``WEIGHT_KINDS``. Up to POOL_ABOVE elements the
    pool is the weight itself (rows = arange(N)); past it, POOL_ROWS adversarial rows drawn at random per row."""
    if N * K <= POOL_ABOVE or N <= POOL_ROWS:
        return adversarial_weight(rng, N, K, kind, dtype), np.arange(N)
    return adversarial_weight(rng, POOL_ROWS, K, kind, dtype), rng.integers(0, POOL_ROWS, size=N)


def take_rows(qw, rows):
    """The flat KbitWeight whose row n is ``qw``'s row ``rows[n]`` (flat blocks are stored row after row)."""
    import dataclasses
    n = qw.shape[0]
    return dataclasses.replace(qw, packed=np.ascontiguousarray(qw.packed.reshape(n, -1)[rows]).ravel(),
                               absmax=np.ascontiguousarray(qw.absmax.reshape(n, -1)[rows]).ravel(),
                               shape=(len(rows), qw.shape[1]))


def kbit_weight(rng, N, K, kind="normal", k=4, fmt="e4m4"):
    """(qw, pool, rows): a flat reference-quantized KbitWeight [N, K] whose row n is the quantized ``pool``'s row
    ``rows[n]`` (weight_rows). Check a kernel against the reference over ``pool`` and pick the columns ``rows``:
    exact per column, at the cost of POOL_ROWS rows."""
    from kbit_numba import reference as ref
    W, rows = weight_rows(rng, N, K, kind)
    pool = ref.quantize(W, k=k, absmax_format=fmt)
    return (pool if len(rows) == W.shape[0] else take_rows(pool, rows)), pool, rows


def pick(rows, *arrays):
    """Each [M, P] array's columns ``rows`` (a reference computed over a pool, spread to the N outputs)."""
    return tuple(a[..., rows] for a in arrays) if len(arrays) > 1 else arrays[0][..., rows]


F16_OVERFLOW = 65520.0     # float32 values from here on round to float16 infinity


def assert_within(got, want, tol, out_dtype=np.float32):
    """|got - want| <= tol everywhere (plus one float16 rounding of the result for a float16 output). A float16
    output overflows to infinity, of the sign of ``want``, where every value within tol of ``want`` reaches
    F16_OVERFLOW, and may do so where some does (the GPU fuzz run draws sums past the float16 range)."""
    got = np.asarray(got, np.float64).reshape(want.shape)
    tol = np.broadcast_to(tol, want.shape)
    if out_dtype == np.float16:
        tol = tol + np.abs(want) * 2.0 ** -11 + 6e-8
        inf = np.isinf(got)
        may = (np.abs(want) + tol >= F16_OVERFLOW) & (np.sign(got) == np.sign(want))
        must = np.abs(want) - tol >= F16_OVERFLOW
        assert np.all(~inf | may), "a float16 output overflowed where the reference does not reach the range's end"
        assert np.all(inf | ~must), "a float16 output is finite where the reference overflows"
        got, want, tol = got[~inf], want[~inf], tol[~inf]
    assert np.all(np.isfinite(got))
    err = np.abs(got - want)
    if err.size:
        assert np.all(err <= tol), f"max error {err.max()} (tolerance there {tol.flat[err.argmax()]})"


# Where an entry writes: a fresh output, a preallocated output that is a view at an offset into a larger device
# array (16-byte aligned: kernels may store 16 bytes at a time), and/or a non-default stream.
OUT_MODES = ("new", "view", "stream", "view_stream")
out_modes = st.sampled_from(OUT_MODES)
GUARD = 8                   # elements either side of an output view; they must be left as SENTINEL
SENTINEL = 1234.0           # (exact in float16 and float32)


class Out:
    """``Out(mode, shape, dtype)``: ``**o.kwargs`` for an entry's ``out`` and ``stream``; ``o.host(result)`` waits
    on the stream, checks that the entry returned the view it was given and wrote nothing outside it, and
    returns the result on the host."""

    def __init__(self, mode, shape, dtype):
        from numba import cuda
        self.stream = cuda.stream() if "stream" in mode else None
        self.buf = self.view = None
        self.kwargs = {"stream": self.stream}
        size = int(np.prod(shape))
        if "view" in mode and size:                     # (an empty output stays the entry's own)
            self.buf = cuda.to_device(np.full(size + 2 * GUARD, SENTINEL, dtype))
            self.view = self.buf[GUARD:GUARD + size].reshape(shape)
            self.kwargs["out"] = self.view

    def host(self, result):
        if self.stream is not None:
            self.stream.synchronize()
        if self.view is not None:
            assert result is self.view, "the entry did not return the out view it was given"
            buf = self.buf.copy_to_host()
            assert np.all(buf[:GUARD] == SENTINEL) and np.all(buf[-GUARD:] == SENTINEL), "wrote outside out"
        return result.copy_to_host()
