"""Faster compiles of the kernels that use Numba's IR inliner (``inline="always"``), numba-cuda 0.30.x only.

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
is cached and must be copied) still deep-copies. The PTX does not change (``tests/test_ptx.py`` compiles a
tensor-core gemv both ways and compares). Installed on import where kernels are compiled (not under the
simulator), only for the numba-cuda versions it was checked against; ``KBIT_NUMBA_FAST_INLINE=0`` leaves
Numba as it is.
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


def install():
    """Patch numba-cuda's inliner (see the module docstring); True if it is patched after the call."""
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
    _installed.append(original)
    return True


@contextmanager
def copying():
    """Numba's own ``inline_function``, and so its block copies, inside (to compare the two)."""
    if not _installed:
        yield
        return
    from numba.cuda.core import inline_closurecall as icc
    patched, icc.InlineWorker.inline_function = icc.InlineWorker.inline_function, _installed[0]
    try:
        yield
    finally:
        icc.InlineWorker.inline_function = patched
