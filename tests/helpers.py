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
EXAMPLES = 6 if SIM else 12
# The fuzz run (tests/README.md): KBIT_FUZZ=N sets N examples per property (the properties that draw more
# or fewer than EXAMPLES scale with it), and on the GPU lets the shape strategies reach large sizes.
FUZZ = int(os.environ.get("KBIT_FUZZ", "0") or 0)
if FUZZ:
    EXAMPLES = FUZZ
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


def gpu_split(names, values):
    """On the GPU, one test per value of ``names`` (a parameter the property would otherwise draw), each with
    ``gpu_examples`` draws: every draw there may compile a kernel specialisation (seconds), and pytest-xdist
    runs the split tests on separate cores. On the simulator one test draws it (the values are ``None``)."""
    if SIM:
        values = [None if "," not in names else (None,) * len(names.split(","))]
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
