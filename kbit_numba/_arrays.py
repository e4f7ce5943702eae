"""Turning user inputs into checked device arrays, and user streams into Numba streams.

Accepted arrays: NumPy arrays (copied to the device), Numba device arrays, and anything with
``__cuda_array_interface__`` (CuPy, PyTorch; zero-copy). PyTorch bfloat16 cannot cross the CUDA array
interface: pass ``t.view(torch.int16)`` and ``bf16=True``.
"""
from __future__ import annotations

import numpy as np
from numba import cuda

FLOAT_DTYPES = (np.float16, np.float32)


def is_numba_device_array(x):
    """A Numba device array (or the simulator's stand-in for one)."""
    return hasattr(x, "copy_to_host") and hasattr(x, "is_c_contiguous")


def is_device_array(x):
    return is_numba_device_array(x) or hasattr(x, "__cuda_array_interface__")


def check_array(x, name):
    """``x`` itself if it is a NumPy array or a CUDA array; anything else (a list, a scalar, a string) is
    refused with a TypeError before any ``.shape`` is read."""
    if not (isinstance(x, np.ndarray) or is_device_array(x)):
        raise TypeError(f"{name} must be a NumPy array or a CUDA array (device array, CuPy, torch), "
                        f"got {type(x).__name__}")
    return x


def device_array(x, name, dtypes, ndim=None, stream=0):
    """Checked, C-contiguous device array view of ``x`` (NumPy input is copied to the device)."""
    arr = check_array(x, name)
    if not (isinstance(arr, np.ndarray) or is_numba_device_array(arr)):
        arr = cuda.as_cuda_array(arr)
    dtypes = tuple(np.dtype(d) for d in dtypes)
    if arr.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {arr.dtype}")
    if ndim is not None and arr.ndim not in (ndim if isinstance(ndim, tuple) else (ndim,)):
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(arr.shape)}")
    if not _c_contiguous(arr):
        raise ValueError(f"{name} must be C-contiguous (call .contiguous()/np.ascontiguousarray first)")
    if isinstance(arr, np.ndarray):
        return cuda.to_device(arr, stream=stream)
    return arr


def _c_contiguous(arr):
    if isinstance(arr, np.ndarray):
        return arr.flags.c_contiguous
    return arr.is_c_contiguous()


def float_input(x, name, bf16, ndim, stream=0):
    """A float16/float32 array, or bfloat16 bits as int16 when ``bf16`` is set."""
    dtypes = (np.int16, np.uint16) if bf16 else FLOAT_DTYPES
    arr = device_array(x, name, dtypes, ndim, stream)
    return arr, ("bfloat16" if bf16 else str(arr.dtype))


def activations(A, qw, bf16, stream=0):
    """Checked activations for ``A @ W^T`` with W the KbitWeight ``qw``: (device A, element type, M, A's
    shape); A is [M, K] or [K] with W's K."""
    from .formats import KbitCodes, KbitWeight
    if not isinstance(qw, (KbitWeight, KbitCodes)):
        raise TypeError(f"qw must be a KbitWeight or KbitCodes, got {type(qw).__name__}")
    return activations_for(A, qw.shape[1], bf16, stream)


def activations_for(A, K, bf16, stream=0):
    """Checked activations A [M, K] or [K] for a weight with K columns: (device A, element type, M, A's shape)."""
    Ad, a_src = float_input(A, "A", bf16, (1, 2), stream)
    shape = tuple(Ad.shape)
    if shape[-1] != K:
        raise ValueError(f"A has K={shape[-1]}, the weight has K={K}")
    return Ad, a_src, (1 if len(shape) == 1 else shape[0]), shape


def output_dtype(out, dtype, dtype_name="out_dtype"):
    """The output type: a given ``out`` buffer's (which must be a device array), else ``dtype``;
    float16 or float32 either way."""
    name = dtype_name
    if out is not None:
        if isinstance(out, np.ndarray):
            raise TypeError("out must be a device array (results are written on the GPU), got a NumPy array")
        dtype, name = device_array(out, "out", FLOAT_DTYPES).dtype, "out"
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float16), np.dtype(np.float32)):
        raise TypeError(f"{name} must be float16 or float32, got {dtype}")
    return dtype


def output(out, name, shape, dtype, stream=0):
    """Preallocated ``out`` (a device array) checked for shape/dtype, or a new device array."""
    if isinstance(out, np.ndarray):
        raise TypeError(f"{name} must be a device array (results are written on the GPU), got a NumPy array")
    dtype = np.dtype(dtype)
    if out is None:
        return cuda.device_array(shape, dtype=dtype, stream=stream)
    arr = device_array(out, name, (dtype,), len(shape))       # (NumPy is refused just above)
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(arr.shape)}")
    return arr


def flat_view(arr, dtype=None):
    """1-D view of a C-contiguous device array, optionally reinterpreted as ``dtype``."""
    flat = arr.reshape(arr.size) if arr.ndim != 1 else arr
    return flat.view(np.dtype(dtype)) if dtype is not None else flat


def _numba_stream_types():
    from numba.core import config
    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator.api import stream
        return (stream,)
    from numba.cuda.cudadrv.driver import Stream
    return (Stream,)


def as_stream(stream):
    """None/0 -> default stream; a Numba stream as is; a torch/CuPy stream (or a raw handle) is wrapped.
    Anything else is refused with a TypeError."""
    if stream is None or (isinstance(stream, int) and not isinstance(stream, bool) and stream == 0):
        return 0
    if isinstance(stream, _numba_stream_types()):
        return stream
    if isinstance(stream, int) and not isinstance(stream, bool) and stream > 0:
        return cuda.external_stream(stream)
    if hasattr(stream, "cuda_stream"):                       # torch.cuda.Stream
        return cuda.external_stream(stream.cuda_stream)
    if type(stream).__module__.startswith("cupy"):            # cupy.cuda.Stream
        return cuda.external_stream(stream.ptr)
    raise TypeError("stream must be None, a Numba stream, a torch or CuPy stream, or a raw CUstream handle "
                    f"(int), got {type(stream).__name__}")


def check_finite_host(x, name):
    if isinstance(x, np.ndarray) and x.dtype.kind == "f" and not np.all(np.isfinite(x)):
        raise ValueError(f"{name} contains NaN or Inf")


def check_silu_pairs(silu_pairs, N):
    """The gemvs' ``silu_pairs`` epilogue reads a gate/up weight's rows as (gate, up) pairs: N must be even."""
    if silu_pairs and N % 2:
        raise ValueError(f"silu_pairs needs (gate, up) row pairs: an even N, got N={N}")


def check_aligned(arr, nbytes, name):
    """Kernels that use 16-byte loads/stores need the buffer's address aligned (Numba/CuPy/torch
    allocations are; a view into the middle of a buffer may not be)."""
    ptr = arr.__cuda_array_interface__["data"][0] if hasattr(arr, "__cuda_array_interface__") else None
    if ptr is not None and ptr % nbytes:
        raise ValueError(f"{name} must be {nbytes}-byte aligned for 16-byte accesses (address {ptr:#x}); "
                         "pass a fresh or .contiguous() copy")


def to_host(x):
    """A NumPy copy of a host or device array."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    return cuda.as_cuda_array(x).copy_to_host()


def gemv_io(A, shape, out, out_dtype, bf16, stream, name, max_m=4):
    """Checked inputs of an M = 1..max_m GEMV on a weight of ``shape`` (N, K): A [M, K] or [K] and the
    output buffer ([M, N] or [N], float16/float32). Returns (device A, its element type, M, out)."""
    N, K = shape
    Ad, a_src, M, a_shape = activations_for(A, K, bf16, stream)
    if not 1 <= M <= max_m:
        raise ValueError(f"{name} handles M = 1..{max_m} rows, got M={M}")
    out_dtype = output_dtype(out, out_dtype)
    out = output(out, "out", (M, N) if len(a_shape) == 2 else (N,), out_dtype, stream)
    return Ad, a_src, M, out
