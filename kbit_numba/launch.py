"""How every kernel family is specialised, planned and launched: ``Spec``, ``Plan``, ``Prepared``.

* **Spec**: a family's compile-time choices (k, M, layout, dtypes, tuning knobs) as a frozen, normalised
  dataclass: the one key of the family's ``lru_cache`` kernel factory (``make_*_kernel(spec)``).
* **Plan**: what each family's public ``plan(...)`` returns: the inputs checked and bound to device
  buffers, and the launches (``Step``; a ``HostStep`` for work that is not our kernel, e.g. cuBLAS).
  ``plan.launch()`` runs it through Numba; the family's ``gemv``/``gemm`` is exactly that.
* **Prepared** (``plan.prepare()``): the same launches replayed with one driver call per step.

Why ``Prepared``: a Numba dispatcher call costs tens of microseconds of host time (typing the
arguments, converting each array to its ABI fields), several times a decode-step GEMV. For repeated
launches with the same buffers (a decode loop, a CUDA graph) ``PreparedLaunch`` compiles the kernel for
the arguments' types once, packs the kernel parameters once in Numba's ABI, and each call is a single
``cuLaunchKernel``.

Numba's kernel ABI, per argument (``numba.cuda.dispatcher._Kernel._prepare_args``):
* an array: meminfo (0), parent (0), nitems, itemsize, data pointer, shape[ndim], strides[ndim] — all
  pointer-sized integers;
* an integer / float scalar: its C value.

Buffers are bound by address: write new inputs *into* the bound arrays between calls. Under the
simulator (no driver) a call is an ordinary kernel launch.

**Programmatic dependent launch (PDL, sm_90).** A step with ``pdl=True`` is a kernel built to call
``intrinsics.griddep_wait`` before it reads its activations or writes its output, and
``griddep_launch_dependents`` early. It is launched with ``cuLaunchKernelEx`` and the
programmatic-stream-serialization attribute, so it may start while the kernel before it in the stream is
still running: its weight loads and shared tables overlap that kernel's tail. Stream capture keeps the
relation as a programmatic edge of the CUDA graph. The weights it reads before waiting must not be written
by the kernel just before it.

**Thread block clusters (sm_90).** ``PreparedLaunch(cluster=n)`` launches CTAs in clusters of n along x (with
``cuLaunchKernelEx`` and the cluster-dimension attribute; above 8, the portable limit, the kernel is allowed a
non-portable size first): a cluster's CTAs run at once on one GPC and may write each other's shared memory
(``intrinsics.st_async_x4``, counted on the receiver's ``mbar_*`` barrier; ``cluster_arrive`` / ``cluster_wait`` first,
so that every CTA has started). Under the simulator the attribute is ignored.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
from numba import types

from .intrinsics import SIMULATOR

DEFAULT_SHARED_LIMIT = 48 * 1024   # dynamic shared bytes a kernel may use without cuFuncSetAttribute
_CTYPES = {types.int32: ctypes.c_int32, types.int64: ctypes.c_int64, types.uint32: ctypes.c_uint32,
           types.uint64: ctypes.c_uint64, types.float32: ctypes.c_float, types.float64: ctypes.c_double}


def stream_handle(stream):
    """The raw CUstream handle (int) of a Numba stream, or 0 / an int as given."""
    if stream is None or isinstance(stream, int):
        return stream or 0
    handle = stream.handle
    return int(getattr(handle, "value", handle) or 0)


def _device_ptr(arr):
    return int(arr.__cuda_array_interface__["data"][0])


PORTABLE_CLUSTER = 8               # CTAs a cluster may hold on every sm_90 GPU; more (up to 16) must be allowed
_CLUSTER_OK = set()                # (kernel handle, device) allowed a non-portable cluster size


def _set_attributes(driver, cufunc, pairs):
    """Set the (attribute, value) pairs on a kernel. Numba's handle is a library ``CUkernel``, whose attributes are
    set per device."""
    kernel = driver.CUkernel(int(cufunc.handle))
    for which, value in pairs:
        err, = driver.cuKernelSetAttribute(which, value, kernel, cufunc.device.id)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot set {which} = {value} for {cufunc.name}: {err}")


def _allow_cluster(driver, cufunc):
    """Let the kernel be launched in clusters of more than PORTABLE_CLUSTER CTAs (once per kernel and device)."""
    key = (int(cufunc.handle), cufunc.device.id)
    if key not in _CLUSTER_OK:
        which = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
        _set_attributes(driver, cufunc, ((which, 1),))
        _CLUSTER_OK.add(key)


_OPTED_IN = {}                     # (kernel handle, device) -> dynamic shared bytes it may use


def _allow_shared(driver, cufunc, nbytes):
    """Opt a kernel in to dynamic shared memory above 48 KB, with the largest shared-memory carveout so
    that several such CTAs fit on an SM. Done once per kernel and device, to all the device allows: later plans
    (e.g. inside a CUDA-graph capture, where changing a kernel's attributes can invalidate the capture) make no
    driver call."""
    key = (int(cufunc.handle), cufunc.device.id)
    if key not in _OPTED_IN:
        attr = driver.CUfunction_attribute
        err, dev = driver.cuDeviceGet(cufunc.device.id)
        err2, optin = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)
        if err != driver.CUresult.CUDA_SUCCESS or err2 != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot read the device's shared-memory limit: {err}, {err2}")
        allowed = int(optin) - int(cufunc.attrs.shared)          # less the kernel's static shared memory
        _set_attributes(driver, cufunc, ((attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, allowed),
                                         (attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)))
        _OPTED_IN[key] = allowed
    if nbytes > _OPTED_IN[key]:
        raise ValueError(f"{cufunc.name} asks for {nbytes} bytes of dynamic shared memory; the device allows "
                         f"{_OPTED_IN[key]}")


class PreparedLaunch:
    """``kernel[grid, block, stream](*args)`` with the arguments fixed; call it to launch.

    ``args`` must be device arrays (Numba or CUDA-array-interface objects) and NumPy scalars."""

    def __init__(self, kernel, grid, block, args, stream=0, shared_bytes=0, pdl=False, cluster=1):
        self.kernel, self.grid, self.block, self.args = kernel, grid, block, tuple(args)
        self.stream = stream
        self._shared = shared_bytes
        if SIMULATOR:
            self._launch = self._launch_numba
            return
        from cuda.bindings import driver

        self._driver = driver
        argtypes = tuple(kernel.typeof_pyval(a) for a in self.args)
        compiled = kernel.compile(argtypes)
        cufunc = compiled._codelibrary.get_cufunc()
        self._func = driver.CUfunction(int(cufunc.handle))
        if shared_bytes > DEFAULT_SHARED_LIMIT:
            _allow_shared(driver, cufunc, shared_bytes)
        self._fields = []                       # ctypes values, kept alive with the pointer array
        for ty, val in zip(argtypes, self.args):
            if isinstance(ty, types.Array):
                shape = tuple(val.shape)
                itemsize = np.dtype(val.dtype).itemsize
                strides = tuple(val.strides) if getattr(val, "strides", None) else \
                    tuple(int(np.prod(shape[i + 1:])) * itemsize for i in range(len(shape)))
                vals = [0, 0, int(np.prod(shape)), itemsize, _device_ptr(val), *shape, *strides]
                self._fields += [ctypes.c_int64(int(v)) for v in vals]
            elif ty in _CTYPES:
                self._fields.append(_CTYPES[ty](val))
            else:
                raise TypeError(f"PreparedLaunch cannot pass an argument of type {ty}")
        self._params = (ctypes.c_void_p * len(self._fields))(
            *[ctypes.addressof(f) for f in self._fields])
        self._params_addr = ctypes.addressof(self._params)
        self._grid3 = tuple(grid) + (1,) * (3 - len(grid)) if isinstance(grid, tuple) else (grid, 1, 1)
        self._block3 = tuple(block) + (1,) * (3 - len(block)) if isinstance(block, tuple) else (block, 1, 1)
        self._launch = self._launch_driver
        attrs = []
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            attrs.append(attr)
        if cluster > 1:
            if self._grid3[0] % cluster:
                raise ValueError(f"a grid of {self._grid3[0]} CTAs along x does not split into clusters of {cluster}")
            if cluster > PORTABLE_CLUSTER:
                _allow_cluster(driver, cufunc)
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
            attrs.append(attr)
        if attrs:
            cfg = driver.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self._grid3
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self._block3
            cfg.sharedMemBytes = shared_bytes
            cfg.attrs = attrs
            cfg.numAttrs = len(attrs)
            self._config = cfg
            self._launch = self._launch_ex

    def _launch_numba(self, stream):
        self.kernel[self.grid, self.block, stream, self._shared](*self.args)

    def _launch_driver(self, stream):
        err, = self._driver.cuLaunchKernel(self._func, *self._grid3, *self._block3, self._shared,
                                           stream_handle(stream), self._params_addr, 0)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {err}")

    def _launch_ex(self, stream):
        self._config.hStream = self._driver.CUstream(stream_handle(stream))
        err, = self._driver.cuLaunchKernelEx(self._config, self._func, self._params_addr, 0)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernelEx (programmatic dependent launch or cluster) failed: {err}")

    def __call__(self, stream=None):
        """Launch on ``stream`` (default: the stream given at preparation)."""
        self._launch(self.stream if stream is None else stream)


class Step(NamedTuple):
    """One kernel launch of a plan: ``kernel[grid, block, stream, shared](*args)``. ``args`` are device
    arrays and NumPy scalars (what :class:`PreparedLaunch` can pack). ``pdl``: launch it as a programmatic
    dependent launch (the kernel must be built for it: see the module's docstring)."""
    kernel: object
    grid: object
    block: object
    args: tuple
    shared: int = 0
    pdl: bool = False


class HostStep(NamedTuple):
    """A step that is not one of our kernels (e.g. the cuBLAS call of dequantize + matmul): ``fn(stream)``
    enqueues its work on ``stream``."""
    fn: object


def launch_step(step, stream=0):
    """Launch one step the ordinary (checked) way: Numba's dispatcher, or the driver where the step needs
    more than 48 KB of dynamic shared memory (Numba does not opt a kernel in to that) or is a programmatic
    dependent launch."""
    if isinstance(step, HostStep):
        step.fn(stream)
    elif (step.shared > DEFAULT_SHARED_LIMIT or step.pdl) and not SIMULATOR:
        PreparedLaunch(step.kernel, step.grid, step.block, step.args, stream, step.shared, step.pdl)()
    else:
        step.kernel[step.grid, step.block, stream, step.shared](*step.args)


@dataclass
class Plan:
    """What every family's ``plan(...)`` returns: checked inputs bound to device buffers, and the launches.

    ``A``: the device activations the steps read (for a decode loop, write the next ones into it);
    ``out``: where the result lands; ``workspace``: scratch the steps share (split-K sums), if any;
    ``stream``: the stream the buffers were made on, the default for :meth:`launch` and :meth:`prepare`."""
    steps: list
    A: object
    out: object
    stream: object = 0
    workspace: object = None

    def launch(self, stream=None):
        """Run the steps in order (Numba launches; on ``stream`` if given, else the plan's); returns ``out``."""
        from ._arrays import as_stream
        stream = self.stream if stream is None else as_stream(stream)
        for step in self.steps:
            launch_step(step, stream)
        return self.out

    def prepare(self):
        """The same launches bound once: see :class:`Prepared`."""
        return Prepared(self)


class Prepared:
    """A plan bound once for decode loops and CUDA graphs: each ``run()`` is one driver call per kernel
    step (no argument typing or checking). Write the next activations into ``.A`` (same shape, dtype and
    address) before ``run()``; results land in ``.out``."""

    def __init__(self, plan):
        if isinstance(plan.A, np.ndarray):
            raise TypeError("prepare binds buffers by address: pass A as a device array")
        self.plan, self.A, self.out, self.stream = plan, plan.A, plan.out, plan.stream
        self._launches = [step.fn if isinstance(step, HostStep) else
                          PreparedLaunch(step.kernel, step.grid, step.block, step.args, plan.stream, step.shared,
                                         step.pdl)
                          for step in plan.steps]

    def run(self, stream=None):
        """Launch every step (on ``stream`` if given, else the plan's); returns ``out``."""
        from ._arrays import as_stream
        stream = self.stream if stream is None else as_stream(stream)
        for launch in self._launches:
            launch(stream)
        return self.out


# ------------------------------------------------------------------------------------------------
# Specs: the compile-time choices of a kernel specialisation
# ------------------------------------------------------------------------------------------------
ELEMENT_TYPES = ("float16", "float32", "bfloat16")     # activations (bfloat16 travels as int16 bits)
OUT_TYPES = ("float16", "float32")
NUMBA_TYPES = {"float16": types.float16[::1], "float32": types.float32[::1], "bfloat16": types.int16[::1]}


def type_name(t, name, allowed=ELEMENT_TYPES):
    """'float16' for np.float16, np.dtype('float16') or 'float16' (bfloat16 is a name only)."""
    if isinstance(t, str) and t in allowed:
        return t
    try:
        norm = np.dtype(t).name
    except TypeError:
        norm = None
    if norm not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {t!r}")
    return norm


@dataclass(frozen=True)
class Spec:
    """Base of every family's Spec: a frozen dataclass of the compile-time choices of one kernel
    specialisation, normalised on construction (``normalise``: dtype names as strings, flags as bools,
    defaults filled in), so that equal choices are one key of the family's ``lru_cache`` factory."""
    FAMILY = "kernel"

    def __post_init__(self):
        for f, v in self.normalise().items():
            object.__setattr__(self, f, v)

    def normalise(self):
        """{field: normalised value} for the fields to rewrite; raises ValueError on a bad choice."""
        return {}

    @property
    def name(self):
        """'gemv k=4 M=1 cols=2 ...': the PTX tests' ids and the benchmark's labels."""
        return self.FAMILY + " " + " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
