"""Compile time with and without ``kbit_numba._inline``'s fast path, in one process: every ``--every``-th tensor-core
gemv specialisation (``mma_gemv.ptx_specs``) compiled to PTX for sm_90 both ways, the order alternating (a second
compile reuses the first's device functions), and the two PTX texts compared once the per-compile name counters are
taken out (``tests/test_ptx._without_compile_counters``). No GPU needed; on a GPU machine it compiles the same
way.

    python benchmarks/ab_inline_compile.py --every 6
"""
import argparse
import contextlib
import os
import sys
import time

os.environ.setdefault("KBIT_NUMBA_PTX_ONLY", "1")         # (tests/conftest.py: compile only, no simulator)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import conftest  # noqa: E402,F401  (the PTX-only mode's stand-in device)
import test_ptx  # noqa: E402
from numba import cuda  # noqa: E402

from kbit_numba import _inline, mma_gemv  # noqa: E402


def compile_ptx(kernel, argtypes, stock):
    """(PTX, seconds) of one compile, with Numba's own block copies where ``stock``."""
    with _inline.copying() if stock else contextlib.nullcontext():
        t = time.perf_counter()
        ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=test_ptx.CC)
        return test_ptx._without_compile_counters(ptx), time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=int, default=4, help="compile every N-th specialisation (default 4)")
    args = p.parse_args()
    if not _inline._installed:
        sys.exit("kbit_numba._inline is not installed here (KBIT_NUMBA_FAST_INLINE=0, or another numba-cuda)")
    specs = mma_gemv.ptx_specs()[::args.every]
    total = {False: 0.0, True: 0.0}
    same = 0
    for i, spec in enumerate(specs):
        kernel, argtypes = mma_gemv.make_mma_gemv_kernel(spec), mma_gemv.argtypes(spec)
        ptx = {}
        for stock in ((False, True) if i % 2 else (True, False)):
            ptx[stock], seconds = compile_ptx(kernel, argtypes, stock)
            total[stock] += seconds
        equal = ptx[False] == ptx[True]
        same += equal
        print(f"fast {total[False]:7.1f} s  stock {total[True]:7.1f} s (running sums)  same PTX {equal}  {spec.name}",
              flush=True)
    print(f"{len(specs)} specialisations: fast {total[False]:.1f} s, stock {total[True]:.1f} s "
          f"({100 * (total[False] / total[True] - 1):+.1f}%), same PTX {same}/{len(specs)}")


if __name__ == "__main__":
    main()
