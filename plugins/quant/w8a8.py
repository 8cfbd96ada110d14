"""W8A8 linear method shared by the ``fp8`` and ``int8`` quantizers.

Parameters of one (possibly fused) layer, N = sum(output_sizes), K = input_size:

* ``weight`` [N, K]: float8_e4m3fn or int8 from a quantized checkpoint (shards stacked
  along rows), or the model dtype for online quantization (quantized once in
  :meth:`W8A8LinearMethod.process_weights_after_loading`);
* ``weight_scale`` fp32 [N]: the checkpoint's per-tensor scale (shape [] or [1]) or
  per-channel scales ([N_i] or [N_i, 1]) of each shard. Fused q|k|v (or gate|up) with a
  different per-tensor scale per shard are kept exact as per-channel scales (each row
  gets its shard's scale) instead of requantizing to the largest scale; if every row
  ends up with the same scale the GEMM uses the per-tensor path.
* ``input_scale`` fp32 [num_shards] (static activation scheme only): one per-tensor
  scale per shard; the shards share their input, so the largest is used (as vLLM does).

Dequantized weight: ``W[n, k] = weight[n, k] * weight_scale[n]``.
"""
from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import Field

from .checks import refuse_bad_scales
from .common import QuantSettings, add_param, tensor_name, use_kernels
from .kernels import HAS_TRITON
from .kernels.choices import choose
from .kernels.scaled_mm import qmax_of, quantize_act, quantize_act_ref, scaled_mm_ref, scaled_mm_torch, scaled_mm_triton
from kvforge.interfaces import LinearMethod

log = logging.getLogger("kvforge.quant")


class W8A8Settings(QuantSettings):
    """``backend``: ``auto`` (per-shape table, see ``kernels/choices.py``), ``triton``,
    ``torch`` (cuBLAS ``_scaled_mm`` / ``_int_mm``) or ``reference`` (dequantize + matmul)."""

    backend: Literal["auto", "triton", "torch", "reference"] = Field(
        "auto", description="GEMM: auto (per shape, measured table), triton, torch (cuBLAS) or reference")
    #: FP8 ``torch._scaled_mm(use_fast_accum=...)``: on Hopper the tensor cores keep the running
    #: sum in their own reduced-precision accumulator instead of promoting it to fp32 (fp32
    #: takes 1-17% longer at M >= 512, measured in BENCHMARKS.md; relative error ~1e-2 at K = 14336
    #: vs ~2.5e-3). On by default, as in vLLM, whose CUTLASS FP8 kernels for sm90 use the
    #: ``FP8FastAccum`` schedules; ``false`` for fp32 accumulation.
    fast_accum: bool = Field(True, description="FP8 only (int8 ignores it): on cuBLAS, Hopper's fast accumulation "
                                              "(as vLLM); false = fp32 accumulation, 1-17% slower at prefill sizes")


def _load_weight_scale(param: torch.nn.Parameter, t: torch.Tensor, shard: int | None) -> None:
    """Per-tensor ([] / [1]) or per-channel ([n] / [n, 1]) scale of one shard -> its rows.

    Raises:
        ValueError: naming the checkpoint tensor, before anything is copied: not a float
            tensor, a wrong shape, or a value that is not finite and > 0 (the symmetric
            8-bit formats' scales are amax / qmax, which AutoFP8 and llm-compressor clamp
            above 0).
    """
    lo, hi = (0, param.shape[0]) if shard is None else param.shard_offsets[shard:shard + 2]
    n = hi - lo
    name = tensor_name(param, shard)
    if not t.is_floating_point() or t.dtype not in param.allowed_dtypes:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {t.dtype}, expected a float scale")
    if t.numel() != 1 and tuple(t.shape) not in ((n,), (n, 1)):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected a per-tensor "
                         f"scale ([] or [1]) or per-channel scales ([{n}] or [{n}, 1])")
    refuse_bad_scales(t, name, positive=True)
    param.data[lo:hi] = t.float().reshape(()) if t.numel() == 1 else t.float().reshape(n)
    param.loaded_shards.add(shard)


def _load_input_scale(param: torch.nn.Parameter, t: torch.Tensor, shard: int | None) -> None:
    """Static per-tensor activation scale ([] / [1]) of one shard.

    Raises:
        ValueError: naming the checkpoint tensor: not one float value, or not finite and
            > 0 (activations are divided by it: 0 or NaN would make every output NaN).
    """
    name = tensor_name(param, shard)
    if not t.is_floating_point():
        raise ValueError(f"checkpoint tensor {name!r} has dtype {t.dtype}, expected a float scale")
    if t.numel() != 1:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected a per-tensor "
                         "activation scale ([] or [1])")
    refuse_bad_scales(t, name, positive=True)
    param.data[shard or 0] = t.float().reshape(())
    param.loaded_shards.add(shard)


def quantize_weight(w: torch.Tensor, qdtype: torch.dtype, per_channel: bool, param: torch.nn.Parameter | None = None,
                    shard_starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest weight quantization. ``w`` [N, K] float -> (q [N, K] ``qdtype``,
    scale fp32 [N] or [1]); ``scale = max|w| / QMAX`` per row or per tensor.

    Raises:
        ValueError: ``w`` holds NaN or Inf (its scale would too, and so every product with it),
            naming the checkpoint tensor (``param``'s shard holding the first bad row) and the row
            in it (``shard_starts``: each shard's first checkpoint row on this tensor-parallel rank).
    """
    qmax = qmax_of(qdtype)
    wf = w.float()
    amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax().reshape(1)
    if not bool(torch.isfinite(amax).all()):  # (one check of N maxima, not of the weight)
        rows = (~torch.isfinite(wf).all(dim=1)).nonzero().flatten()
        row, name = int(rows[0]), "weight"
        if param is not None:  # the fused shard holding the row, and the row within it
            shard = max(i for i, off in enumerate(param.shard_offsets[:-1]) if off <= row)
            row = row - param.shard_offsets[shard] + (shard_starts[shard] if shard_starts else 0)
            name = param.tensor_names[shard]
        raise ValueError(f"checkpoint tensor {name!r} has non-finite values (first in row {row}; {rows.numel()} "
                         "rows of the layer); it cannot be quantized online (a corrupt checkpoint?)")
    scale = amax.clamp_min(1e-12) / qmax
    y = (wf / (scale[:, None] if per_channel else scale)).clamp(-qmax, qmax)
    if qdtype == torch.int8:
        y = torch.round(y)
    return y.to(qdtype), scale


class W8A8LinearMethod(LinearMethod):
    """``y = dequant(quant(x)) @ dequant(W)^T`` with int8/FP8 operands.

    Args:
        qdtype: torch.float8_e4m3fn or torch.int8.
        from_checkpoint: weights are stored quantized; else quantized online from floats.
        static_input: the checkpoint carries ``input_scale`` (static per-tensor activations);
            otherwise activations are quantized per token at run time.
        online_per_channel: online quantization granularity (per output row vs per tensor).
    """

    def __init__(self, qdtype: torch.dtype, from_checkpoint: bool, static_input: bool, settings: W8A8Settings,
                 online_per_channel: bool = True) -> None:
        self.qdtype = qdtype
        self.from_checkpoint = from_checkpoint
        self.static_input = static_input
        self.settings = settings
        self.online_per_channel = online_per_channel
        self.kind = "int8" if qdtype == torch.int8 else "fp8"
        self._torch_failed: set[tuple] = set()
        self._no_fast_accum: set[tuple] = set()  # shapes cuBLASLt has no fast-accumulation algorithm for

    def unknown_param_hint(self, param_name: str) -> str:
        if param_name == "input_scale" and self.from_checkpoint and not self.static_input:
            return (" (the checkpoint's config quantizes activations dynamically, per token, which needs no "
                    "input_scale: its activation scheme (fp8: activation_scheme; compressed-tensors: "
                    "input_activations.dynamic) disagrees with its tensors)")
        return ""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        n = sum(output_sizes)
        if not self.from_checkpoint:
            add_param(layer, "weight", (n, input_size), params_dtype, dim=0, shard_sizes=output_sizes,
                      allowed=(torch.float16, torch.bfloat16, torch.float32), what="unquantized weight [out, in]",
                      input_dim=1)
            return
        add_param(layer, "weight", (n, input_size), self.qdtype, dim=0, shard_sizes=output_sizes,
                  allowed=(self.qdtype,), what=f"{self.kind} weight [out, in]", input_dim=1)
        ws = add_param(layer, "weight_scale", (n,), torch.float32, dim=0, shard_sizes=output_sizes,
                       allowed=(torch.float32, torch.float16, torch.bfloat16), loader=_load_weight_scale)
        ws.data.fill_(1.0)
        if self.static_input:
            ins = add_param(layer, "input_scale", (len(output_sizes),), torch.float32, dim=None,
                            shard_sizes=output_sizes, allowed=(torch.float32, torch.float16, torch.bfloat16),
                            loader=_load_input_scale)
            ins.data.fill_(1.0)

    def process_weights_after_loading(self, layer):
        if not self.from_checkpoint:
            q, s = quantize_weight(layer.weight.data, self.qdtype, self.online_per_channel, layer.weight,
                                   [start for start, _ in getattr(layer, "shard_slices", ())])
            layer.weight = torch.nn.Parameter(q, requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(s, requires_grad=False)
            return
        s = layer.weight_scale.data
        if s.numel() > 1 and bool((s == s[0]).all()):
            layer.weight_scale = torch.nn.Parameter(s[:1].clone(), requires_grad=False)
        if self.static_input:
            layer.input_scale = torch.nn.Parameter(layer.input_scale.data.max().reshape(1), requires_grad=False)

    # -- conformance protocol (kvforge.testing.quantizer) -----------------------------------
    @property
    def test_rtol(self):
        from .conformance import W8A8_RTOL
        return W8A8_RTOL[self.kind]

    def make_test_weights(self, input_size, output_sizes, params_dtype, generator):
        from .conformance import w8a8_test_weights
        return w8a8_test_weights(self, input_size, list(output_sizes), params_dtype, generator)

    def dequantize_test_weights(self, tensors, input_size, output_sizes):
        from .conformance import STASH
        return STASH.get(tensors)

    def apply(self, layer, x, bias):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        in_scale = layer.input_scale if self.static_input else None
        if not use_kernels(x2, self.settings.backend) or not HAS_TRITON:
            qa, sa = quantize_act_ref(x2, self.qdtype, in_scale)
            y = scaled_mm_ref(qa, sa, layer.weight, layer.weight_scale, x.dtype, bias)
        else:
            y = self._gpu(x2, in_scale, layer, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _gpu(self, x2, in_scale, layer, bias):
        qa, sa = quantize_act(x2, self.qdtype, in_scale)
        m, n, k = x2.shape[0], layer.weight.shape[0], x2.shape[1]
        backend = self.settings.backend
        choice = choose(self.kind, m, n, k, x2.device) if backend == "auto" else backend
        key = (m if m <= 16 else -1, n, k, x2.dtype)
        if choice == "torch" and key not in self._torch_failed:
            fast_first = self.settings.fast_accum and key not in self._no_fast_accum
            for fast in ((True, False) if fast_first else (False,)):
                try:
                    return scaled_mm_torch(qa, sa, layer.weight, layer.weight_scale, x2.dtype, bias,
                                           use_fast_accum=fast)
                except RuntimeError as e:
                    # fast: cuBLAS may have no such algorithm for the shape (row-wise scales + bias at
                    # M <= 16, K = 14336 on torch 2.11 / H200); fp32: e.g. row-wise scaling with fp16 output
                    err = e
                    if fast:
                        self._no_fast_accum.add(key)
            if backend == "torch":
                raise err
            self._torch_failed.add(key)
            log.info("%s: torch GEMM refused %s (%s); using Triton", self.kind, key, err)
        return scaled_mm_triton(qa, sa, layer.weight, layer.weight_scale, x2.dtype, bias)
