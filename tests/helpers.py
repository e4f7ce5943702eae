"""Shared test helpers: mode flags, example sizes and random weights."""
import os

import numpy as np
import pytest
from hypothesis import strategies as st

import kbit_numba

SIM = kbit_numba.SIMULATOR
PTX_ONLY = os.environ.get("KBIT_NUMBA_PTX_ONLY") == "1"
# The simulator runs one Python thread per CUDA thread: keep its problems to a few blocks.
# On the GPU every new specialisation costs seconds of compilation: examples stay modest there too.
EXAMPLES = 6 if SIM else 12
MAX_N = 8 if SIM else 300
MAX_KB = 4 if SIM else 40        # K = 32 * kb
# Tiled layouts have 128 columns a tile: on the simulator one tile and up to three blocks (an odd K still
# pads to a whole K tile of two blocks), two tiles on the GPU.
MAX_TILES = 1 if SIM else 2
MAX_KB_TILED = 3 if SIM else MAX_KB


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


def assert_within(got, want, tol, out_dtype=np.float32):
    """|got - want| <= tol everywhere (plus one float16 rounding of the result for a float16 output)."""
    if out_dtype == np.float16:
        tol = tol + np.abs(want) * 2.0 ** -11 + 6e-8
    got = np.asarray(got, np.float64).reshape(want.shape)
    assert np.all(np.isfinite(got))
    err = np.abs(got - want)
    assert np.all(err <= tol), f"max error {err.max()} (tolerance there {tol.flat[err.argmax()]})"
