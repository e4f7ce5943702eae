"""Test modes.

* A machine with a CUDA GPU: the kernels run on it (simulator off).
* No GPU: Numba's CUDA simulator is switched on here, before numba is first imported, with a short
  thread switch interval (the simulator runs one Python thread per CUDA thread).
* ``KBIT_NUMBA_PTX_ONLY=1`` (set by tests/test_ptx.py for its child process): no simulator; kernels are
  only compiled to PTX. Without a driver, Numba asks the driver for the current device's compute
  capability when a kernel calls a device function; a stand-in answers sm_90.
"""
import ctypes
import os
import sys

PTX_ONLY = os.environ.get("KBIT_NUMBA_PTX_ONLY") == "1"


def _gpu_present():
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    return False


if PTX_ONLY:
    os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
elif "NUMBA_ENABLE_CUDASIM" not in os.environ and not _gpu_present():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.setswitchinterval(1e-4)

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# On a GPU a failing property is not shrunk: each shrink step may compile a new kernel specialisation,
# and shrinking ran the suite past 7 minutes. The failing example is printed as drawn.
_GPU = not PTX_ONLY and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
settings.register_profile(
    "default", deadline=None, derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=tuple(p for p in Phase if p != Phase.shrink) if _GPU else tuple(Phase))
settings.load_profile("default")

from numba import cuda  # noqa: E402

if PTX_ONLY and not cuda.is_available():
    import numba.cuda.dispatcher as _dispatcher

    class _Sm90:
        compute_capability = (9, 0)

    _dispatcher.get_current_device = lambda: _Sm90()

import kbit_numba  # noqa: E402,F401  (installs the simulator's warp primitives)


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: a hypothesis property (every one is marked; KBIT_FUZZ=N sets its "
                                       "examples: tests/README.md)")


def pytest_collection_modifyitems(config, items):
    """``-m fuzz`` selects every hypothesis property."""
    import pytest
    for item in items:
        if hasattr(getattr(item, "obj", None), "hypothesis"):
            item.add_marker(pytest.mark.fuzz)


def pytest_runtest_logreport(report):
    """``KBIT_FAILURE_LOG=path``: each failing test's report (for a property, its falsifying example) is appended
    to ``path`` the moment it fails, so that a run stopped at a time limit still shows why (pytest prints
    tracebacks only at the end; under xdist this runs in the controller)."""
    path = os.environ.get("KBIT_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def pytest_collection_finish(session):
    """Under the simulator, start the PTX children now if test_ptx.py was collected: they compile on the
    cores the simulator (one Python thread at a time) leaves idle, instead of after it."""
    if PTX_ONLY or os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        return
    if any(os.path.basename(str(item.fspath)) == "test_ptx.py" for item in session.items):
        import test_ptx
        test_ptx.start_children()


def pytest_sessionfinish(session, exitstatus):
    """PTX children still running when the session ends (test_ptx deselected by -x or a failure) are stopped."""
    mod = sys.modules.get("test_ptx")
    for proc, _ in getattr(mod, "_CHILDREN", []):
        if proc.poll() is None:
            proc.kill()
