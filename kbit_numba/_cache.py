"""An on-disk cache of compiled kernels, so that a second Python process does not compile them again.

Every kernel here is a closure made by a factory (``make_*_kernel(spec)``), and compiling one
specialisation takes 3-10 s. Numba's own ``cache=True`` never hits for them: its key pickles the closure's
cells, and a cell holding a device function pickles with a fresh per-process id, so the key differs in every
process (measured: two processes, two hashes). This cache keys a kernel instead by

* a hash of every ``.py`` file of the package (a kernel's code includes the device functions and intrinsics
  it calls as globals, which no per-function key sees: any edit to the package starts a fresh directory);
* the kernel's qualified name and a stable description of its closure (ints, dtypes, specs, and device
  functions by name and, recursively, their own closures), and its compile options;
* the argument types, the target (``codegen.magic_tuple()``: the compute capability), and the versions of
  Python, NumPy, Numba and numba-cuda.

One file per key (the hash of the key), written to a temporary name and renamed: processes compiling at the
same time (pytest-xdist workers) never see half a file, and no shared index can point one key at another's
data. A kernel whose closure has no stable description (an object whose repr is an address) is not cached.

Where: ``$KBIT_NUMBA_CACHE_DIR``, else ``$NUMBA_CACHE_DIR/kbit_numba``, else ``~/.cache/kbit_numba``
(``$XDG_CACHE_HOME``), each under a directory named by the package hash. ``KBIT_NUMBA_CACHE=0`` turns it off.
Under the simulator nothing is compiled and nothing is cached.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import platform
import types as pytypes
import uuid
from functools import lru_cache
from pathlib import Path

import numpy as np

PACKAGE_DIR = Path(__file__).resolve().parent


def switched_on(name):
    """Whether the package's on-by-default environment switch ``name`` is on: unset, or not 0 / false / no / off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "", "false", "no", "off")


def enabled():
    """Whether kernels are cached (``KBIT_NUMBA_CACHE`` unset or not 0)."""
    return switched_on("KBIT_NUMBA_CACHE")


@lru_cache(maxsize=None)
def package_hash():
    """sha256 over the package's Python sources (paths and contents), computed once per process."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE_DIR)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_dir():
    """The directory of this package version's kernels (not created here)."""
    base = os.environ.get("KBIT_NUMBA_CACHE_DIR")
    if not base:
        numba_dir = os.environ.get("NUMBA_CACHE_DIR")
        if numba_dir:
            base = os.path.join(numba_dir, "kbit_numba")
        else:
            xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            base = os.path.join(xdg, "kbit_numba")
    return Path(base) / package_hash()[:20]


def code_hash(code):
    """sha256 of a code object's bytecode, names and constants (nested code objects likewise). Not
    ``marshal``: its output depends on reference counts."""
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        h.update(code_hash(c).encode() if isinstance(c, pytypes.CodeType) else repr(c).encode())
    return h.hexdigest()[:16]


class Unstable(Exception):
    """A closure value with no description that is the same in every process."""


def describe(value, depth=0):
    """A string that names ``value`` the same way in every process, or :class:`Unstable`."""
    if depth > 8:
        raise Unstable("closures nested too deeply")
    py_func = getattr(value, "py_func", None)
    if py_func is not None:                   # a Numba dispatcher (device function or kernel)
        options = sorted((k, repr(v)) for k, v in getattr(value, "targetoptions", {}).items())
        return f"jit[{describe(py_func, depth + 1)}|{options}]"
    if isinstance(value, pytypes.FunctionType):       # two branches of a factory may define two functions of
        cells = value.__closure__ or ()                # one name: the code itself is part of the key
        values = [c.cell_contents for c in cells] + list(value.__defaults__ or ())
        inner = ",".join(describe(v, depth + 1) for v in values)
        return f"fn[{value.__module__}.{value.__qualname__}:{code_hash(value.__code__)}({inner})]"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(describe(v, depth + 1) for v in value) + ")"
    if isinstance(value, np.ndarray):                   # (repr elides the middle of a large array)
        return f"ndarray[{value.dtype.str}{value.shape}:{hashlib.sha256(value.tobytes()).hexdigest()[:16]}]"
    text = repr(value)
    if " at 0x" in text or "object at" in text:
        raise Unstable(text)
    return f"{type(value).__module__}.{type(value).__qualname__}:{text}"


def kernel_key(py_func, targetoptions):
    """The part of a kernel's key that does not depend on the launch: its code's name, closure and options;
    None when the closure has no stable description."""
    try:
        closure = describe(py_func)
    except (Unstable, ValueError):            # (ValueError: a closure cell not yet filled)
        return None
    options = sorted((k, repr(v)) for k, v in targetoptions.items())
    return f"{closure}|{options}"


class KernelCache:
    """What ``numba.cuda`` asks of a dispatcher's ``_cache`` (``load_overload``, ``save_overload``,
    ``flush``, ``cache_path``), keyed as the module docstring says."""

    def __init__(self, key):
        self._key = key
        self._paths = {}                      # signature -> file, from the load that missed

    @property
    def cache_path(self):
        return str(cache_dir())

    def _path(self, sig, codegen):
        from numba import __version__ as numba_version
        import numba_cuda

        full = "\n".join((self._key, repr(sig), repr(codegen.magic_tuple()), numba_version,
                          numba_cuda.__version__, np.__version__, platform.python_version()))
        return cache_dir() / (hashlib.sha256(full.encode()).hexdigest()[:40] + ".nbk")

    def load_overload(self, sig, target_context):
        from numba.cuda.dispatcher import _Kernel

        target_context.refresh()
        path = self._path(sig, target_context.codegen())
        self._paths[sig] = path
        try:
            payload = pickle.loads(path.read_bytes())
        except Exception:                    # not there, or unreadable (e.g. another Python's pickle): compile
            return None
        return _Kernel._rebuild(**payload)

    def save_overload(self, sig, kernel):
        from numba.cuda.serialize import dumps

        path = self._paths.pop(sig, None)
        if path is None or getattr(kernel, "launch_config_sensitive", False):
            return                            # (a kernel compiled per launch configuration: not keyed here)
        try:
            data = dumps(kernel._reduce_states())
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except (OSError, pickle.PicklingError, RuntimeError, TypeError):
            pass                              # a read-only home, a kernel that cannot pickle: just not cached

    def flush(self):
        pass


def attach(dispatcher):
    """Give a ``cuda.jit`` kernel dispatcher the on-disk cache (when enabled and its closure is stable)."""
    if not enabled() or not hasattr(dispatcher, "_cache"):
        return dispatcher
    key = kernel_key(dispatcher.py_func, dispatcher.targetoptions)
    if key is not None:
        dispatcher._cache = KernelCache(key)
    return dispatcher

