"""kbit_numba: low-bit weight-quantized inference kernels for NVIDIA GPUs, written in Numba CUDA.

Formats and their NumPy reference live in ``formats`` and ``reference``; what every family shares on the
host (weights on the device, MoE experts, launch geometry) in ``core``; kernels in one module per family
(``codec``, ``scalar_gemv``, ``pair_gemv``, ``mma_gemv``, ``tensor_gemm``; the other seed formats in ``uniform``,
``sbvr``, ``bitnet``), each with a ``Spec`` of its compile-time choices and a public ``plan(...)``
returning a ``launch.Plan`` (``plan.launch()``, ``plan.prepare().run()``); ``dispatch.linear`` picks a
family per shape and M. PTX helpers in ``intrinsics``; shared device helpers in ``device``; calibrated
(GPTQ-style) quantization into kbit bytes in ``calibrate``; the on-disk kernel cache in ``_cache``; the IR
inliner and ``literal_unroll`` without their redundant copies (faster compiles) in ``_inline``.
Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the package installs warp primitives so
that the same kernels run on the CPU.
"""
from numba.core import config as _config

if _config.ENABLE_CUDASIM:
    from . import _sim

    _sim.install()
else:                           # where kernels compile: Numba's inliner and unroller, fewer copies (_inline)
    from . import _inline

    _inline.install()

from . import reference  # noqa: E402
from .formats import (BLOCK, K_BITS, KbitCodes, KbitExperts, KbitFragments, KbitWeight, codebook,  # noqa: E402
                      e4m4_decode, e4m4_encode)
from .core import stack_experts  # noqa: E402
from .launch import Plan, Prepared  # noqa: E402
from .codec import dequantize, quantize, repack_tiled  # noqa: E402
from .tensor_gemm import gemm, grouped_gemm  # noqa: E402
from .dispatch import (KbitExpertsLinear, KbitLinear, Workspace, dequant_matmul, grouped_linear,  # noqa: E402
                       linear)
from . import bitnet, calibrate, mma_gemv, pair_gemv, sbvr, scalar_gemv, tensor_gemm, uniform  # noqa: E402
from .scalar_gemv import gemv, grouped_gemv  # noqa: E402
from .scalar_gemv import prepare as prepare_gemv  # noqa: E402

SIMULATOR = bool(_config.ENABLE_CUDASIM)

__version__ = "0.1.0"

__all__ = ["BLOCK", "K_BITS", "KbitWeight", "KbitCodes", "KbitFragments", "codebook", "e4m4_encode", "e4m4_decode",
           "reference",
           "quantize", "dequantize", "repack_tiled", "gemv", "prepare_gemv", "Plan", "Prepared",
           "grouped_gemv", "stack_experts", "KbitExperts", "gemm", "grouped_gemm", "linear", "KbitLinear",
           "grouped_linear", "KbitExpertsLinear",
           "Workspace", "dequant_matmul", "calibrate", "scalar_gemv", "pair_gemv", "mma_gemv", "tensor_gemm", "uniform",
           "sbvr", "bitnet",
           "SIMULATOR"]
