"""Test modes.

* A machine with a CUDA GPU: the kernels run on it (simulator off).
* No GPU: Numba's CUDA simulator is switched on here, before numba is first imported (it runs one Python thread
  per CUDA thread), with Python's own 5 ms thread switch interval (see below).
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

# The simulated threads wait at their barriers (kbit_numba._sim: no manager polls), so a thread should run until it
# blocks: a 0.1 ms interval (set here until 2026-12-04, from when the stock block manager polled) made the suite about
# 1.4x slower on 2 cores (1,666 s against 1,151 s, which also had one test 32 s shorter; tests/README.md).
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.setswitchinterval(5e-3)

from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# On a GPU a failing property is not shrunk: each shrink step may compile a new kernel specialisation,
# and shrinking ran the suite past 7 minutes. The failing example is printed as drawn.
_GPU = not PTX_ONLY and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1"
settings.register_profile(
    "default", deadline=None, derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=tuple(p for p in Phase if p != Phase.shrink) if _GPU else tuple(Phase))
settings.load_profile("default")
if _GPU:     # the run's kernel variants (helpers.variants): one seed for every xdist worker (they inherit it)
    import random
    os.environ.setdefault("KBIT_FUZZ_SEED", str(random.randrange(1 << 16)))

from numba import cuda  # noqa: E402

if PTX_ONLY and not cuda.is_available():
    import numba.cuda.dispatcher as _dispatcher

    class _Sm90:
        compute_capability = (9, 0)

    _dispatcher.get_current_device = lambda: _Sm90()

import kbit_numba  # noqa: E402,F401  (installs the simulator's warp primitives)


def pytest_runtest_setup(item):
    """On the GPU: tell ``helpers.variants`` which test (kernel variant) of its property this is (the index of its
    ``gpu_split`` parameter)."""
    if _GPU:
        import helpers
        indices = getattr(getattr(item, "callspec", None), "indices", {})
        helpers.VARIANT_PART[0] = next((i for name, i in indices.items() if name.endswith("_split")), 0)


def pytest_report_header(config):
    if not _GPU:
        return None
    from helpers import FUZZ_PARTS, FUZZ_SEED
    if os.environ.get("KBIT_FUZZ"):
        return (f"KBIT_FUZZ={os.environ['KBIT_FUZZ']}: kernel variants of KBIT_FUZZ_SEED={FUZZ_SEED} (the defaults and "
                f"{FUZZ_PARTS - 1} one-offs a property, a test each; helpers.variants)")
    return f"kernel variants of KBIT_FUZZ_SEED={FUZZ_SEED} (one a test; helpers.variants)"


def pytest_configure(config):
    config.addinivalue_line("markers", "fuzz: a hypothesis property (every one is marked; KBIT_FUZZ=N sets its "
                                       "examples: tests/README.md)")


def pytest_collection_modifyitems(config, items):
    """``-m fuzz`` selects every hypothesis property. With ``KBIT_FUZZ=N`` each kernel family
    (``helpers.FUZZ_FAMILIES``) runs N examples, shared equally among its collected properties and, for a property
    split into several tests (``helpers.gpu_split``), among those.

    Under the simulator the test that waits for the PTX children runs last: the simulator tests after it in file
    order (test_readme.py ... test_uniform.py) then run while the children still compile, instead of after a wait
    that leaves the simulator's core idle (CI's log of 2026-12-02: a 519 s wait)."""
    import math
    import pytest
    items.sort(key=lambda item: getattr(item, "originalname", None) == "test_ptx_in_child_process")  # (stable)
    props = {}
    for item in items:
        if hasattr(getattr(item, "obj", None), "hypothesis"):
            item.add_marker(pytest.mark.fuzz)
            props.setdefault(_property_name(item), []).append(item)
    fuzz = int(os.environ.get("KBIT_FUZZ", "0") or 0)
    if not fuzz:
        return
    from helpers import FUZZ_FAMILIES
    family = {p: f for f, ps in FUZZ_FAMILIES.items() for p in ps}
    unknown = sorted(set(props) - set(family))
    if unknown:
        raise pytest.UsageError(f"properties in no helpers.FUZZ_FAMILIES family: {unknown}")
    in_family = {}
    for p in props:
        in_family[family[p]] = in_family.get(family[p], 0) + 1
    for p, its in props.items():
        if family[p].endswith("(host)"):        # (NumPy-only properties keep their examples: no kernel to fuzz)
            continue
        fn = its[0].obj
        n = math.ceil(fuzz / in_family[family[p]] / len(its))
        fn._hypothesis_internal_use_settings = settings(fn._hypothesis_internal_use_settings, max_examples=n)


def _property_name(item):
    """``file.py::function`` of a test item (its parameters dropped)."""
    return f"{os.path.basename(str(item.fspath))}::{item.originalname}"


def pytest_runtest_logreport(report):
    """``KBIT_FAILURE_LOG=path``: each failing test's report (for a property, its falsifying example) is appended
    to ``path`` the moment it fails, so that a run stopped at a time limit still shows why (pytest prints
    tracebacks only at the end; under xdist this runs in the controller)."""
    path = os.environ.get("KBIT_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def _count_examples(path):
    """``KBIT_FUZZ_COUNTS=path``: every hypothesis example this process runs is appended to ``path.<pid>`` as it
    ends (hypothesis' observability callback): one JSON line of its property, status (passed/failed) and seconds,
    so a run stopped at a time limit still counts. ``benchmarks/fuzz_counts.py`` sums them per kernel family."""
    import json
    from hypothesis.internal.observability import add_observability_callback

    out = open(f"{path}.{os.getpid()}", "a", buffering=1)

    def seen(obs, thread_id):
        if obs.type == "test_case" and obs.status in ("passed", "failed"):
            out.write(json.dumps({"property": obs.property, "status": obs.status,
                                  "seconds": round(sum(obs.timing.values()), 4)}) + "\n")

    add_observability_callback(seen, all_threads=True)


if os.environ.get("KBIT_FUZZ_COUNTS"):
    _count_examples(os.environ["KBIT_FUZZ_COUNTS"])


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


def _log_compiles(path):
    """``KBIT_COMPILE_LOG=path`` (a GPU run): every kernel specialisation this process compiles (not found in memory
    or in the on-disk cache) is appended to ``path.<pid>`` as one tab-separated line: seconds, the running test,
    the kernel, a hash of its cache key (the same specialisation compiled by two workers has the same one).
    ``benchmarks/compile_log.py`` sums them per test: where a cold suite's time goes."""
    import hashlib
    import time
    from numba.core import sigutils
    from kbit_numba import _cache
    from numba.cuda.dispatcher import CUDADispatcher

    out = open(f"{path}.{os.getpid()}", "a", buffering=1)
    compile_ = CUDADispatcher.compile

    def compile(self, sig):
        known = self.specialized or sigutils.normalize_signature(sig)[0] in self.overloads
        t0 = time.perf_counter()
        kernel = compile_(self, sig)
        if not known and not self._cache_hits.get(sig):
            test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" ", 1)[0]
            key = _cache.kernel_key(self.py_func, self.targetoptions)      # (the same kernel in two workers:
            key = hashlib.sha256(f"{key}|{sig}".encode()).hexdigest()[:12] if key else "-"   # the same key)
            out.write(f"{time.perf_counter() - t0:.2f}\t{test}\t{self.py_func.__qualname__}\t{key}\n")
        return kernel

    CUDADispatcher.compile = compile


if os.environ.get("KBIT_COMPILE_LOG") and _GPU:
    _log_compiles(os.environ["KBIT_COMPILE_LOG"])
