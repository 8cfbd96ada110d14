"""`fp8` quantizer: FP8 E4M3 weights and activations (W8A8).

Number format: Micikevicius et al., "FP8 Formats for Deep Learning" (arXiv:2209.05433),
``torch.float8_e4m3fn`` (no infinities, max 448).

Checkpoints (``quantization_config.quant_method == "fp8"``, the format written by
AutoFP8 / llm-compressor and read by vLLM): per linear layer ``weight`` float8_e4m3fn
[out, in], ``weight_scale`` float32 per-tensor ([] or [1]) or per-channel ([out] or
[out, 1]), and with ``activation_scheme: "static"`` an ``input_scale`` float32 [] / [1].
``activation_scheme: "dynamic"`` (default) quantizes activations per token at run time.
``ignored_layers`` / ``modules_to_not_convert`` list modules kept in the model dtype.
Refused: ``weight_block_size`` (block-wise scales), a ``fmt`` other than e4m3, an invalid
``re:`` regex in the module lists, and at load a ``weight_scale`` / ``input_scale`` that is
not finite and > 0 (naming the tensor).

Online: ``quantization.method: fp8`` on an unquantized (fp32/fp16/bf16) checkpoint
quantizes every linear layer at load time (per-channel weight scales by default,
``settings.weight_strategy: tensor`` for one scale per layer), dynamic activations.

Numerics: ``W = weight * weight_scale`` (see ``w8a8.py``); E4M3 max 448.
GEMM on CUDA: ``torch._scaled_mm`` or the Triton kernel (``kernels/scaled_mm.py``), per
shape from ``kernels/choices.py``; elsewhere the dequantize-then-matmul reference.
"""
from __future__ import annotations

from typing import Literal

import torch

from kvforge import hookimpl
from kvforge.interfaces import LinearMethod, QuantizationConfig
from kvforge.interfaces.quantization import checkpoint_quant_method

from .checks import check_module_patterns
from .common import cuda_capability_reasons, decide_per_shard, float8_reasons, layer_ignored, triton_backend_reasons
from .unquantized import UnquantizedLinearMethod
from .w8a8 import W8A8LinearMethod, W8A8Settings

KVFORGE_HOOK_API = "1"


class FP8Settings(W8A8Settings):
    """Settings of the ``fp8`` quantizer (``quantization.settings``)."""

    #: Online quantization only: one weight scale per output channel or per layer.
    weight_strategy: Literal["channel", "tensor"] = "channel"


class FP8Config(QuantizationConfig):
    """Built from the checkpoint's ``quantization_config`` (None = online quantization)."""

    name = "fp8"
    #: quantization_configs the conformance suite (kvforge.testing.quantizer) runs (None = online).
    conformance_quant_configs = [None, {"quant_method": "fp8", "activation_scheme": "dynamic"},
                                 {"quant_method": "fp8", "activation_scheme": "static"}]

    def __init__(self, hf_quant_config: dict | None = None, settings: FP8Settings | None = None) -> None:
        if float8_reasons():
            raise ValueError(f"quantization method 'fp8': {'; '.join(float8_reasons())}")
        self.settings = settings or FP8Settings()
        cfg = hf_quant_config or {}
        method = checkpoint_quant_method(cfg)
        if method not in (None, "fp8"):
            raise ValueError(f"quantization method 'fp8': the checkpoint is quantized with {method!r}; fp8 loads "
                             "fp8 checkpoints or quantizes an unquantized one online")
        self.from_checkpoint = method == "fp8"
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise ValueError(f"fp8 checkpoint: activation_scheme {scheme!r} is not supported (static or dynamic)")
        if cfg.get("weight_block_size"):
            raise ValueError(f"fp8 checkpoint: block-wise weight scales (weight_block_size="
                             f"{cfg['weight_block_size']}) are not supported; only per-tensor or per-channel")
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 checkpoint: fmt {fmt!r} is not supported (only e4m3)")
        self.static_input = self.from_checkpoint and scheme == "static"
        self.ignored = [p for key in ("ignored_layers", "modules_to_not_convert")
                        for p in check_module_patterns(cfg.get(key), f"quantization_config.{key}")]
        self._method = W8A8LinearMethod(torch.float8_e4m3fn, self.from_checkpoint, self.static_input,
                                        self.settings, self.settings.weight_strategy == "channel")
        self._dense = UnquantizedLinearMethod()

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if decide_per_shard(prefix, lambda n: layer_ignored(n, self.ignored)):
            return self._dense
        return self._method

    def validate(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons = float8_reasons() + triton_backend_reasons(self.settings.backend, device)
        if self.settings.backend != "reference":
            reasons += cuda_capability_reasons(device, (8, 9), "FP8 W8A8 (float8 tensor cores)")
        return reasons


@hookimpl
def kvforge_register_quantizers(register) -> None:
    register("fp8", FP8Config, FP8Settings)
