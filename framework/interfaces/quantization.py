"""Quantization interface: a config chooses a :class:`LinearMethod` per linear layer."""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from kvforge.hookspecs import KVFORGE_HOOK_API


class LinearMethod(ABC):
    """Owns a linear layer's weight format: creates its parameters, runs the GEMM,
    and converts the loaded tensors once after loading (repacking, transposes)."""

    @abstractmethod
    def create_weights(self, layer: torch.nn.Module, input_size: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        """Register parameters on ``layer``. ``output_sizes`` lists the fused
        outputs (e.g. [q, k, v]); each parameter gets ``weight_loader(param,
        tensor, shard_index)`` and attribute ``output_dim`` (the dimension that
        ``output_sizes`` split), ``packed_factor`` if packed along it. A floating
        parameter is handed the checkpoint tensor cast to its dtype, unless it sets
        ``load_raw = True`` (its loader then checks and converts the dtype itself)."""

    @abstractmethod
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x`` [T, input_size] (activation dtype) -> [T, sum(output_sizes)]."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Called once after every checkpoint tensor was loaded."""

    def unknown_param_hint(self, param_name: str) -> str:
        """Optional: text appended to the load error for a checkpoint tensor ``*.{param_name}``
        this format has no parameter for (e.g. why a quantized tensor reached a dense layer);
        "" for none."""
        return ""

    def apply_silu_and_mul(self, layer: torch.nn.Module, x: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor | None:
        """Optional fused SwiGLU for a gate|up layer (``layer.gate_up`` True: two equal
        projections): ``x`` [T, input_size] -> silu(gate) * up [T, output_size / 2], or None
        where this method has no fused path (the layer then runs :meth:`apply` and
        ``kvforge.layers.activation.silu_and_mul``). Whatever the weight layout,
        :meth:`apply` must still return [gate | up] in checkpoint order."""
        return None

    def apply_add_rmsnorm(self, layer: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor,
                          norm_weight: torch.Tensor, eps: float, bias: torch.Tensor | None,
                          silu_and_mul: bool = False, rope: tuple | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Optional: a pre-norm block's add + RMSNorm folded into this layer's GEMM. With
        r = x + residual (rounded to x's dtype), returns (y, r) where y is :meth:`apply`
        (``silu_and_mul``: :meth:`apply_silu_and_mul`) of RMSNorm(r) * norm_weight; x,
        residual [T, input_size], norm_weight [input_size], all in the activation dtype.
        ``rope`` (positions int64 [T], a ``kvforge.layers.rotary.RotaryEmbedding``), for a
        q|k|v layer (``layer.head_dim``): y's q and k heads must come back rotated. None where
        this method has no such path for these operands (the layer then runs
        ``kvforge.layers.layernorm.RMSNorm``, the GEMM and the rotation separately)."""
        return None


def checkpoint_quant_method(hf_quant_config: dict | None) -> str | None:
    """config.json's ``quantization_config.quant_method`` lowercased; None when the section or
    the key is absent or null. Quantizer names are lower case, as Hugging Face configs write
    them, but some exporters do not (``"AWQ"``), so the builder and the quantizers match the
    method ignoring case through this one function.

    Raises:
        ValueError: ``quant_method`` is not a string, naming the field.
    """
    method = (hf_quant_config or {}).get("quant_method")
    if method is None:
        return None
    if not isinstance(method, str):
        raise ValueError(f"quantization_config.quant_method: expected a string, got {method!r}")
    return method.lower()


class QuantizationConfig(ABC):
    """Built by a quantizer factory from the checkpoint's ``quantization_config``."""

    KVFORGE_HOOK_API = KVFORGE_HOOK_API
    name: str

    @abstractmethod
    def get_linear_method(self, prefix: str) -> LinearMethod:
        """Method for the linear layer with checkpoint prefix ``prefix`` (e.g.
        ``model.layers.0.self_attn.qkv_proj``)."""

    def validate(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        """Reasons this method cannot run with this activation dtype on this device."""
        return []
