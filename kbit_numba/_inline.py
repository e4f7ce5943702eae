"""Faster compiles of the kernels that use Numba's IR inliner (``inline="always"``) or ``literal_unroll``,
numba-cuda 0.30.x only.

``mma_gemv`` builds its kernel from device functions that Numba inlines into the kernel's IR
(``mma_gemv.ir_inlined``: the kernel runs 0.5-3.4% faster than with NVVM's inlining). For every call site
numba-cuda's ``InlineWorker.inline_function`` builds the callee's IR afresh (``run_untyped_passes``), then
``inline_ir`` deep-copies it twice, block by block: once to mutate and once to hand back an unmutated
original. Each block's deep copy also copies the function's whole variable scope, so the copies grow as
blocks x variables: about half of a tensor-core gemv's compile time (local profile, numba-cuda 0.30.4:
14 of 28 s, 10 of them in ``copy.deepcopy``). Neither copy is needed on this path: the IR is fresh, and the
one caller of ``inline_function`` (the ``InlineInlinables`` pass) drops the original it returns.
(numba-cuda's issue 688 and pull request 689 describe the same cost.)

:func:`install` wraps ``inline_function`` so that, while it runs ``inline_ir`` on the fresh IR, the copies
return the blocks themselves. ``inline_ir`` called directly (the typed inliner of ``@overload``\\ s, whose IR
is cached and must be copied) still deep-copies.

``literal_unroll`` (``scalar_gemv``'s column and row loops, one of ``pair_gemv``'s) has the same cost in
``MixedContainerUnroller.inject_loop_body``: per version of a loop body it deep-copies the body's blocks (once,
as a dict) and then, on their way into the switch table, each of those fresh copies again, one by one, the
function's variable scope with each. The second copies are of blocks nothing else holds, so :func:`install`
hands them over as they are (the first copy, one per version, stays): the scalar gemv's 52 PTX checks compile
in 315 s instead of 406 (local, one process; its ``cols = 8`` builds 14.5-16.5 s instead of 19-21).

The PTX does not change (``tests/test_ptx.py`` compiles a tensor-core gemv and a scalar gemv both ways and
compares). Installed on import where kernels are compiled (not under the simulator), only for the numba-cuda
versions it was checked against; ``KBIT_NUMBA_FAST_INLINE=0`` leaves Numba as it is.
"""
from __future__ import annotations

import copy
import types
from contextlib import contextmanager

from ._cache import switched_on

CHECKED_VERSIONS = ("0.30.",)     # numba-cuda versions whose inline_ir / inline_function this was checked against
_fresh = [False]                  # True while inline_ir runs on the IR inline_function has just built
_installed = []                   # the original inline_function, once install() has replaced it


def enabled():
    """Whether :func:`install` may patch (``KBIT_NUMBA_FAST_INLINE`` unset or not 0)."""
    return switched_on("KBIT_NUMBA_FAST_INLINE")


def supported(version):
    """Whether this numba-cuda version is one the patch was checked against."""
    return version.startswith(CHECKED_VERSIONS)


def _deepcopy(value, memo=None):
    """``inline_closurecall``'s ``copy.deepcopy`` (its only use: ``inline_ir``'s block copies)."""
    return value if _fresh[0] else copy.deepcopy(value, memo)


def _unroll_deepcopy(value, memo=None):
    """``untyped_passes``' ``deepcopy`` (its only use: ``inject_loop_body``): a block is one of the loop body's fresh
    copies on its way into the switch table, handed over as it is; the body's blocks (a dict) are still copied."""
    from numba.cuda.core import ir
    return value if isinstance(value, ir.Block) else copy.deepcopy(value, memo)


def install():
    """Patch numba-cuda's inliner and unroller (see the module docstring); True if they are patched after the call."""
    if _installed:
        return True
    if not enabled():
        return False
    import numba_cuda
    if not supported(numba_cuda.__version__):
        return False
    from numba.cuda.core import inline_closurecall as icc

    worker = icc.InlineWorker
    original = worker.inline_function

    def inline_function(self, caller_ir, block, i, function, arg_typs=None):
        callee_ir = self.run_untyped_passes(function)          # (fresh: nobody else holds it)
        _fresh[0] = True
        try:
            return self.inline_ir(caller_ir, block, i, callee_ir, function.__code__.co_freevars, arg_typs=arg_typs)
        finally:
            _fresh[0] = False

    icc.copy = types.SimpleNamespace(deepcopy=_deepcopy)
    worker.inline_function = inline_function
    from numba.cuda.core import untyped_passes
    untyped_passes.deepcopy = _unroll_deepcopy
    _installed.append(original)
    return True


@contextmanager
def copying():
    """Numba's own ``inline_function`` and unroller, and so their block copies, inside (to compare the two)."""
    if not _installed:
        yield
        return
    from numba.cuda.core import inline_closurecall as icc
    from numba.cuda.core import untyped_passes
    patched, icc.InlineWorker.inline_function = icc.InlineWorker.inline_function, _installed[0]
    untyped_passes.deepcopy = copy.deepcopy
    try:
        yield
    finally:
        icc.InlineWorker.inline_function = patched
        untyped_passes.deepcopy = _unroll_deepcopy
