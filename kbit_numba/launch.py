"""A prepared kernel launch: Numba's argument marshalling done once, then one ``cuLaunchKernel`` per call.

A Numba dispatcher call costs tens of microseconds of host time (typing the arguments, converting each
array to its ABI fields), several times a decode-step GEMV. For repeated launches with the same buffers
(a decode loop, a CUDA graph) ``PreparedLaunch`` compiles the kernel for the arguments' types once,
packs the kernel parameters once in Numba's ABI, and each call is a single driver launch.

Numba's kernel ABI, per argument (``numba.cuda.dispatcher._Kernel._prepare_args``):
* an array: meminfo (0), parent (0), nitems, itemsize, data pointer, shape[ndim], strides[ndim] — all
  pointer-sized integers;
* an integer / float scalar: its C value.

Buffers are bound by address: write new inputs *into* the bound arrays between calls. Under the
simulator (no driver) a call is an ordinary kernel launch.
"""
from __future__ import annotations

import ctypes

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


_OPTED_IN = {}                     # (kernel handle, device) -> dynamic shared bytes it may use


def _allow_shared(driver, cufunc, nbytes):
    """Opt a kernel in to dynamic shared memory above 48 KB, with the largest shared-memory carveout so
    that several such CTAs fit on an SM. Numba's handle is a library ``CUkernel``, whose attributes are
    set per device. Done once per kernel, to all the device allows: later plans (e.g. inside a CUDA-graph
    capture, where changing a kernel's attributes can invalidate the capture) make no driver call."""
    key = (int(cufunc.handle), cufunc.device.id)
    if key not in _OPTED_IN:
        attr = driver.CUfunction_attribute
        err, dev = driver.cuDeviceGet(cufunc.device.id)
        err2, optin = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)
        if err != driver.CUresult.CUDA_SUCCESS or err2 != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot read the device's shared-memory limit: {err}, {err2}")
        allowed = int(optin) - int(cufunc.attrs.shared)          # less the kernel's static shared memory
        kernel = driver.CUkernel(int(cufunc.handle))
        for which, value in ((attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, allowed),
                             (attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)):
            err, = driver.cuKernelSetAttribute(which, value, kernel, cufunc.device.id)
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cannot set {which} = {value} for {cufunc.name}: {err}")
        _OPTED_IN[key] = allowed
    if nbytes > _OPTED_IN[key]:
        raise ValueError(f"{cufunc.name} asks for {nbytes} bytes of dynamic shared memory; the device allows "
                         f"{_OPTED_IN[key]}")


class PreparedLaunch:
    """``kernel[grid, block, stream](*args)`` with the arguments fixed; call it to launch.

    ``args`` must be device arrays (Numba or CUDA-array-interface objects) and NumPy scalars."""

    def __init__(self, kernel, grid, block, args, stream=0, shared_bytes=0):
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

    def _launch_numba(self, stream):
        self.kernel[self.grid, self.block, stream, self._shared](*self.args)

    def _launch_driver(self, stream):
        err, = self._driver.cuLaunchKernel(self._func, *self._grid3, *self._block3, self._shared,
                                           stream_handle(stream), self._params_addr, 0)
        if err != self._driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {err}")

    def __call__(self, stream=None):
        """Launch on ``stream`` (default: the stream given at preparation)."""
        self._launch(self.stream if stream is None else stream)


def run_steps(steps, stream=0):
    """Launch a list of (kernel, grid, block, args) steps in order on ``stream`` (Numba launches)."""
    for kern, grid, block, args in steps:
        kern[grid, block, stream](*args)


class PreparedSteps:
    """Several kernel launches (e.g. activation quantizer + GEMV) bound to their buffers; ``run()`` is one
    driver launch per step. Write new activations into ``A`` between runs; results land in ``out``."""

    def __init__(self, steps, stream, A, out):
        self._launches = [PreparedLaunch(k, g, b, a, stream) for k, g, b, a in steps]
        self.A, self.out = A, out

    def run(self, stream=None):
        for launch in self._launches:
            launch(stream)
        return self.out


def run_plan(plan, A, weight, out, stream, *options):
    """What a format's ``gemv`` does: ``plan(A, weight, out, stream, *options)`` -> (steps, A, out), the
    steps launched on ``stream``; returns out."""
    from ._arrays import as_stream
    stream = as_stream(stream)
    steps, _, out = plan(A, weight, out, stream, *options)
    run_steps(steps, stream)
    return out


def prepare_plan(plan, A, weight, out, stream, *options):
    """What a format's ``prepare`` does: the same plan bound once into a :class:`PreparedSteps`."""
    from ._arrays import as_stream
    if isinstance(A, np.ndarray):
        raise TypeError("prepare binds buffers by address: pass A as a device array")
    stream = as_stream(stream)
    steps, Ad, out = plan(A, weight, out, stream, *options)
    return PreparedSteps(steps, stream, Ad, out)
