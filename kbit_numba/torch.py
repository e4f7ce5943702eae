"""PyTorch drop-in: ``KbitLinear`` (a ``torch.nn.Module``), ``quantize_model`` and the ``kbit_numba::linear`` op.

torch stays optional: ``import kbit_numba`` never imports this module; ``import kbit_numba.torch`` needs torch.

    from kbit_numba.torch import KbitLinear, quantize_model
    layer = KbitLinear.from_linear(linear, k=4)        # any nn.Linear; format="kbit" | "uniform" | "sbvr" | "bitnet"
    y = layer(x)                                        # x [..., K] float16/bfloat16/float32 -> y [..., N], x's dtype
    quantize_model(model, k=4, skip=["lm_head"])        # replaces the model's nn.Linear layers, prints bytes saved

* **The weight** is a kbit_numba container on the GPU in the layout its kernels read (``dispatch.KbitLinear``):
  kbit keeps the code layout where it applies (``layout="auto"``: k = 2, 4 and K a multiple of 64; pair gemv,
  gemm, dequantize + cuBLAS; ``f16_acc``, ``pdl``), else the tiled layout (gemv and gemm), or the one
  ``layout`` names (``"fragments"``: the tensor-core gemv for batched decode); uniform, SBVR and BitNet keep their
  own, and run their
  gemv (M = 1..4) in slices of 4 rows for larger M.
* **forward** calls ``torch.ops.kbit_numba.linear(x, handle)``: a ``torch.library.custom_op`` with a fake
  (meta) implementation, so a model using it traces under ``torch.compile``; the op launches on torch's
  current stream into a tensor torch allocates (no host copies), so it can be captured in a CUDA graph.
  The bias is added by torch after the op.
* **state_dict** holds the format's arrays as tensors (kbit: the bitsandbytes-compatible flat layout, i.e.
  packed bit planes, absmax, codebook) and an extra state with the rest (k, shape, format, layout);
  ``load_state_dict`` restores a layer without re-quantizing (``KbitLinear.empty()`` makes one to load into).
* Under Numba's CUDA simulator (no GPU; the tests) the same module runs on CPU tensors.
"""
from __future__ import annotations

import itertools
import sys
import weakref
from dataclasses import fields

import numpy as np
import torch
from numba import cuda
from torch import nn

from . import bitnet, reference, sbvr, uniform
from .codec import quantize as _kbit_quantize
from .core import MAX_M, device_weight
from .dispatch import KbitLinear as _KbitLinearRuntime
from .formats import (BLOCK, BitnetWeight, KbitCodes, KbitFragments, KbitWeight, SbvrWeight, UniformWeight,
                      fits_fragments)
from .intrinsics import SIMULATOR

FORMATS = {"kbit": KbitWeight, "uniform": UniformWeight, "sbvr": SbvrWeight, "bitnet": BitnetWeight}
_GEMV = {"uniform": uniform.gemv, "sbvr": sbvr.gemv, "bitnet": bitnet.gemv}   # M = 1..4 each
_ACT_SHAPES = {"bitnet": bitnet.act_shapes, "sbvr": sbvr.act_shapes}         # formats quantizing activations
_LAYERS = weakref.WeakValueDictionary()     # handle -> KbitLinear: what the custom op's int argument names
_HANDLES = itertools.count(1)


def _format_of(weight):
    for name, cls in FORMATS.items():
        if isinstance(weight, cls):
            return name
    if isinstance(weight, (KbitCodes, KbitFragments)):
        return "kbit"
    raise TypeError(f"weight must be one of {[c.__name__ for c in FORMATS.values()]}, KbitCodes or KbitFragments, "
                    f"got {type(weight).__name__}")


def quantize_weight(W, format="kbit", k=4, bits=4, group_size=128, lines=1024, parts=1):
    """A float weight [N, K] (torch tensor or NumPy array) in ``format``: kbit (k = 2..5, the GPU quantizer,
    flat layout), uniform (``bits``, ``group_size``), sbvr (``lines``) or bitnet (``parts``)."""
    _check_format(format)
    if isinstance(W, torch.Tensor):
        W = W.detach().float().cpu().numpy()
    W = np.ascontiguousarray(W, np.float32)
    if format == "kbit":
        return _kbit_quantize(W, k=k).to_numpy()
    if format == "uniform":
        return uniform.quantize(W, bits, group_size).to_numpy()
    if format == "sbvr":
        return reference.sbvr_encode(W, lines=lines)
    return reference.bitnet_quantize(W, parts=parts)


def _check_format(format):
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")


def _check_options(format, layout, f16_acc, pdl):
    _check_format(format)
    if format != "kbit" and (layout not in ("auto", "tiled") or f16_acc or pdl):
        raise ValueError(f"layout, f16_acc and pdl apply to format 'kbit', not {format!r}")


class KbitLinear(nn.Module):
    """``y = x @ W^T + b`` with W in a kbit_numba format (see the module docstring).

    ``weight``: a KbitWeight (flat or tiled), KbitCodes, KbitFragments, UniformWeight, SbvrWeight or BitnetWeight, host
    or device; ``bias``: a tensor [N] or None. ``layout``, ``f16_acc``, ``pdl``: kbit only (``dispatch.KbitLinear``)."""

    def __init__(self, weight, bias=None, layout="auto", f16_acc=False, pdl=False):
        super().__init__()
        self.format = _format_of(weight)
        self.out_features, self.in_features = weight.shape
        self.options = dict(layout=layout, f16_acc=bool(f16_acc), pdl=bool(pdl))
        _check_options(self.format, **self.options)
        # the bias lives with the weight (the GPU; CPU tensors under the simulator), whatever the source layer's
        # device: a CPU nn.Linear quantized with from_linear runs on CUDA inputs
        bias_device = "cpu" if SIMULATOR else "cuda"
        self.bias = None if bias is None else nn.Parameter(torch.as_tensor(bias).detach().to(bias_device, copy=True),
                                                           requires_grad=False)
        self.handle = next(_HANDLES)
        _LAYERS[self.handle] = self
        self._set_weight(weight)

    # ---- construction -----------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear, format="kbit", k=4, bits=4, group_size=128, lines=1024, parts=1, layout="auto",
                    f16_acc=False, pdl=False):
        """Quantize an ``nn.Linear`` (its weight is read once; the result lives on the GPU)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        if linear.in_features % BLOCK:
            raise ValueError(f"in_features must be a multiple of {BLOCK}, got {linear.in_features}")
        _check_options(format, layout, f16_acc, pdl)
        w = quantize_weight(linear.weight, format, k, bits, group_size, lines, parts)
        return cls(w, linear.bias, layout, f16_acc, pdl)

    @classmethod
    def empty(cls, in_features, out_features, format="kbit", bias=False, **options):
        """A layer of zero weights in ``format`` to ``load_state_dict`` into (its weight is replaced)."""
        linear = nn.Linear(in_features, out_features, bias=bias)
        with torch.no_grad():
            linear.weight.zero_()
        return cls.from_linear(linear, format, **options)

    def _set_weight(self, weight):
        """Keep ``weight`` on the device in the layout this layer's kernel reads."""
        if self.format == "kbit":
            self.runtime = _KbitLinearRuntime(weight, layout=self.options["layout"], f16_acc=self.options["f16_acc"],
                                              pdl=self.options["pdl"])
            self.weight = self.runtime.weight
        else:
            self.runtime = None
            self.weight = device_weight(weight, FORMATS[self.format], 0)

    # ---- forward ----------------------------------------------------------------------------------
    def forward(self, x):
        y = torch.ops.kbit_numba.linear(x, self.handle)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def run(self, x, silu_pairs=False, rms_eps=None, accumulate_into=None):
        """The op's body: x [..., K] -> [..., N] through the kernels (``linear`` for kbit, the format's gemv in
        slices of 4 rows otherwise), on torch's current stream. ``silu_pairs`` (kbit, where ``runtime.kernel_for`` the
        call's rows is the pair or the tensor-core gemv; a ValueError elsewhere): a gate/up layer whose rows are
        interleaved (gate row j at 2j, up row j at 2j + 1) returns silu(gate) * up, [..., N / 2], from the gemv's
        epilogue: no [..., N] output and no SiLU kernel (``reference.silu_pairs`` is its twin). Two more of the pair
        gemv's (kbit, where the call's rows run it; a ValueError elsewhere), a decode step's residual add and norm
        inside its linears: ``accumulate_into`` (a float16 tensor of the output's shape, the residual stream) adds the
        product into that tensor in place and returns it; ``rms_eps`` scales each output row by
        1 / sqrt(mean(x^2) + rms_eps): an RMSNorm of x whose weight is folded into this layer's
        (``reference.rms_gemv``)."""
        K, N = self.in_features, self.out_features // 2 if silu_pairs else self.out_features
        if x.shape[-1] != K:
            raise ValueError(f"x has {x.shape[-1]} features, the layer {K}")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
        if not SIMULATOR and x.device.type != "cuda":
            raise ValueError(f"x must be a CUDA tensor (the quantized weight lives on the GPU), got {x.device}")
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, K).contiguous()
        M = x2.shape[0]
        if M == 0:
            return x.new_empty(lead + (N,))
        bf16 = x.dtype == torch.bfloat16
        a = x2.view(torch.int16) if bf16 else x2
        out_dtype, out_np = (torch.float16, np.float16) if x.dtype == torch.float16 else (torch.float32, np.float32)
        acc = accumulate_into
        if acc is not None and (acc.dtype != torch.float16 or tuple(acc.shape) != lead + (N,) or not acc.is_contiguous()
                                or acc.device != x.device):
            raise ValueError(f"accumulate_into must be a contiguous float16 tensor of shape {lead + (N,)} on x's "
                             f"device, got {acc.dtype} {tuple(acc.shape)}")
        fused = dict(rms_eps=rms_eps, accumulate=acc is not None)
        if SIMULATOR:                       # CPU tensors: NumPy in, the simulator's device array out
            out = None if acc is None else cuda.to_device(acc.reshape(M, N).numpy())
            y = torch.from_numpy(self._launch(a.numpy(), out, 0, out_np, bf16, silu_pairs, **fused).copy_to_host())
            if acc is not None:
                return acc.copy_(y.reshape(acc.shape))
        else:
            y = torch.empty((M, N), dtype=out_dtype, device=x.device) if acc is None else acc.view(M, N)
            self._launch(a, y, torch.cuda.current_stream(x.device), out_np, bf16, silu_pairs, **fused)
            if acc is not None:
                return acc
        return y.to(x.dtype).reshape(lead + (N,))

    def _launch(self, a, out, stream, out_dtype, bf16, silu_pairs=False, rms_eps=None, accumulate=False):
        if self.format == "kbit":
            return self.runtime(a, out=out, stream=stream, out_dtype=out_dtype, bf16=bf16, silu_pairs=silu_pairs,
                                rms_eps=rms_eps, accumulate=accumulate)
        if rms_eps is not None or accumulate:
            raise ValueError(f"rms_eps and accumulate_into are the kbit pair gemv's, not the {self.format} format's")
        if silu_pairs:
            raise ValueError(f"silu_pairs is the kbit gemvs' epilogue, not the {self.format} format's")
        gemv = _GEMV[self.format]
        if a.shape[0] <= MAX_M:
            return gemv(a, self.weight, out=out, stream=stream, out_dtype=out_dtype, bf16=bf16,
                        **self._act_buffers(a.shape[0]))
        parts = [gemv(a[r:r + MAX_M], self.weight, out=None if out is None else out[r:r + MAX_M], stream=stream,
                      out_dtype=out_dtype, bf16=bf16, **self._act_buffers(a[r:r + MAX_M].shape[0]))
                 for r in range(0, a.shape[0], MAX_M)]
        if out is not None:
            return out
        from numba import cuda                         # (simulator: gather the slices)
        return cuda.to_device(np.concatenate([p.copy_to_host() for p in parts]))

    def _act_buffers(self, M):
        """BitNet's and SBVR's quantized-activation buffers from torch's allocator, as Numba views ({} for the
        other formats, and under the simulator): a Numba allocation inside torch's CUDA-graph capture would
        invalidate it, torch's caching allocator is capture-safe."""
        if SIMULATOR or self.format not in _ACT_SHAPES:
            return {}
        from numba import cuda
        words, d = _ACT_SHAPES[self.format](M, self.in_features)
        words = torch.empty(words, dtype=torch.int32, device="cuda")
        d = torch.empty(d, dtype=torch.float32, device="cuda")
        return dict(act=(cuda.as_cuda_array(words).view(np.uint32), cuda.as_cuda_array(d)))

    # ---- state_dict: the format's arrays as tensors, the rest as extra state -----------------------
    def _host_weight(self):
        """The weight as NumPy arrays in its interchange form (kbit: the flat layout)."""
        w = self.weight.to_numpy()
        return reference.to_flat(w) if self.format == "kbit" else w

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        w = self._host_weight()
        for f in w.ARRAYS:
            destination[prefix + "weight_" + f] = torch.from_numpy(np.ascontiguousarray(getattr(w, f)))

    def get_extra_state(self):
        w = self._host_weight()
        return dict(format=self.format, options=dict(self.options),
                    fields={f.name: getattr(w, f.name) for f in fields(w) if f.name not in w.ARRAYS})

    def set_extra_state(self, state):
        self._pending = state               # (the arrays arrive in _load_from_state_dict, after this)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        ours = {prefix + "weight_" + f for cls in FORMATS.values() for f in cls.ARRAYS}
        unexpected_keys[:] = [key for key in unexpected_keys if key not in ours]     # (the weight's arrays)
        state = getattr(self, "_pending", None) or state_dict.get(prefix + "_extra_state")
        if state is None:
            return
        cls = FORMATS[state["format"]]
        names = [f.name for f in fields(cls) if f.name in cls.ARRAYS]
        keys = [prefix + "weight_" + n for n in names]
        if any(key not in state_dict for key in keys):
            missing_keys.extend(key for key in keys if key not in state_dict)
            return
        arrays = {n: state_dict[key].cpu().numpy().copy() for n, key in zip(names, keys)}
        weight = cls(**arrays, **state["fields"])
        self.format, self.options = state["format"], dict(state["options"])
        self.out_features, self.in_features = weight.shape
        self._set_weight(weight)
        self._pending = None

    def weight_bytes(self):
        """Bytes of the quantized weight on the device."""
        return sum(int(np.prod(getattr(self.weight, f).shape)) * np.dtype(getattr(self.weight, f).dtype).itemsize
                   for f in self.weight.ARRAYS)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}, "
                f"{', '.join(f'{k}={v}' for k, v in self.options.items())}, bias={self.bias is not None}")


# ---- the custom op ---------------------------------------------------------------------------------
@torch.library.custom_op("kbit_numba::linear", mutates_args=())
def _linear_op(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x [..., K] @ W^T of the KbitLinear registered under ``handle`` (no bias)."""
    return _LAYERS[handle].run(x)


@_linear_op.register_fake
def _(x, handle):
    return x.new_empty(tuple(x.shape[:-1]) + (_LAYERS[handle].out_features,))


# ---- whole models ----------------------------------------------------------------------------------
def quantize_model(model, format="kbit", skip=(), progress=True, **options):
    """Replace every ``nn.Linear`` of ``model`` (in place) by a ``KbitLinear`` in ``format``; returns a
    summary dict. ``skip``: names (or name suffixes) of layers to keep; layers whose in_features is not a
    multiple of 32 are kept in their dtype, and the summary says which. ``options``: ``from_linear``'s
    (k, bits, group_size, lines, parts, layout, f16_acc, pdl); with ``layout="fragments"`` a layer that does not
    fill whole fragment tiles (N a multiple of 16, K of 256) takes the code layout instead (which also reads any K
    a multiple of 32 and takes ``f16_acc`` and ``pdl``), and the summary lists it (``not_fragments``). ``progress``:
    a tqdm bar if tqdm is installed, else a line per 10% on stderr."""
    _check_format(format)
    linears = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    summary = dict(replaced=[], skipped=[], kept_not_multiple_of_32=[], not_fragments=[], bytes_before=0,
                   bytes_after=0)
    fragments = format == "kbit" and options.get("layout") == "fragments"
    bar = _progress(len(linears)) if progress else None
    for i, (name, lin) in enumerate(linears):
        before = lin.weight.numel() * lin.weight.element_size()
        if any(name == s or name.endswith("." + s) for s in skip):
            summary["skipped"].append(name)
        elif lin.in_features % BLOCK:
            summary["kept_not_multiple_of_32"].append(name)
        else:
            layer_options = options
            if fragments and not fits_fragments(lin.out_features, lin.in_features):
                layer_options = dict(options, layout="codes")
                summary["not_fragments"].append(name)
            q = KbitLinear.from_linear(lin, format, **layer_options)
            _set_submodule(model, name, q)
            summary["replaced"].append(name)
            summary["bytes_before"] += before
            summary["bytes_after"] += q.weight_bytes()
        if bar:
            bar(i + 1)
    if summary["kept_not_multiple_of_32"]:
        print(f"kbit_numba: kept {len(summary['kept_not_multiple_of_32'])} layers whose in_features is not a "
              f"multiple of 32: {', '.join(summary['kept_not_multiple_of_32'])}", file=sys.stderr)
    if summary["not_fragments"]:
        print(f"kbit_numba: {len(summary['not_fragments'])} layers do not fill whole fragment tiles (N a multiple of "
              f"16, K of 256) and keep the code layout: {', '.join(summary['not_fragments'])}", file=sys.stderr)
    if progress:
        b0, b1 = summary["bytes_before"], summary["bytes_after"]
        print(f"kbit_numba: {len(summary['replaced'])} linear layers -> {format}: {b0 / 2**20:.1f} MiB -> "
              f"{b1 / 2**20:.1f} MiB ({b0 / max(b1, 1):.2f}x smaller)", file=sys.stderr)
    return summary


def _set_submodule(model, name, module):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _progress(total):
    """A callable(done): tqdm's bar when tqdm is importable, else a line on stderr every 10%."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        marks = {max(1, round(total * p / 10)) for p in range(1, 11)}

        def line(done):
            if done in marks:
                print(f"kbit_numba: quantized {done}/{total} linear layers", file=sys.stderr)
        return line
    bar = tqdm(total=total, desc="kbit_numba quantize", unit="layer")

    def update(done):
        bar.update(done - bar.n)
        if done == total:
            bar.close()
    return update


__all__ = ["FORMATS", "KbitLinear", "quantize_model", "quantize_weight"]
