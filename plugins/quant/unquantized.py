"""`unquantized` quantizer: dense weights in the model dtype, GEMM via torch (cuBLAS / oneDNN)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge import hookimpl
from kvforge.interfaces import LinearMethod, QuantizationConfig
from kvforge.interfaces.quantization import checkpoint_quant_method

KVFORGE_HOOK_API = "1"


def _load_rows(param: torch.nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
    """Copy a checkpoint tensor into ``param``, into the rows of output shard ``shard`` if fused."""
    if shard is None:
        if param.shape != loaded.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        param.data.copy_(loaded)
        return
    offsets = param.shard_offsets  # type: ignore[attr-defined]
    lo, hi = offsets[shard], offsets[shard + 1]
    dst = param.data.narrow(0, lo, hi - lo)
    if dst.shape != loaded.shape:
        raise ValueError(f"shape mismatch in shard {shard}: parameter {tuple(dst.shape)} vs "
                         f"checkpoint {tuple(loaded.shape)}")
    dst.copy_(loaded)


#: Checkpoint tensor names of the quantized formats (AWQ, GPTQ, FP8/INT8 W8A8, compressed-tensors).
QUANTIZED_TENSOR_NAMES = frozenset({"qweight", "qzeros", "scales", "g_idx", "weight_scale", "input_scale",
                                    "weight_packed", "weight_zero_point", "weight_shape", "weight_g_idx"})


class UnquantizedLinearMethod(LinearMethod):
    """Weight ``[sum(output_sizes), input_size]`` in the model dtype; ``y = x W^T + b``.

    ``quantized_hint``: why a quantized checkpoint tensor reached this method (appended to
    the layer's "no parameter" error by :meth:`unknown_param_hint`); empty for the layers a
    quantizer keeps unquantized, whose checkpoint tensors are dense.
    """

    def __init__(self, quantized_hint: str = "") -> None:
        self.quantized_hint = quantized_hint

    def unknown_param_hint(self, param_name: str) -> str:
        """Text to append to the error for checkpoint tensor ``*.{param_name}``, which this
        format has no parameter for."""
        return self.quantized_hint if self.quantized_hint and param_name in QUANTIZED_TENSOR_NAMES else ""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        weight = torch.nn.Parameter(torch.empty(sum(output_sizes), input_size, dtype=params_dtype),
                                    requires_grad=False)
        weight.output_dim = 0
        weight.input_dim = 1  # tensor parallelism: row-parallel layers split this dim
        weight.shard_offsets = [0] + list(torch.tensor(output_sizes).cumsum(0).tolist())
        weight.weight_loader = _load_rows
        layer.register_parameter("weight", weight)

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


def _quantized_hint(method: str | None) -> str:
    """What to tell a user whose checkpoint holds quantized tensors (``qweight``...) but loads
    as unquantized: config.json names no method (``{}``, null, no ``quant_method``), or the
    user chose ``unquantized`` over the checkpoint's own method."""
    if method is None:
        return ("; the checkpoint holds quantized tensors, but config.json names no quantization method "
                "(quantization_config.quant_method is missing): restore the quantization_config its "
                "exporter wrote (e.g. quant_method 'awq', 'gptq', 'fp8', 'compressed-tensors')")
    return (f"; the checkpoint is quantized with {method!r} (quantization_config.quant_method), which "
            "quantization.method 'unquantized' cannot load: use 'auto'")


class UnquantizedConfig(QuantizationConfig):
    name = "unquantized"

    def __init__(self, hf_quant_config=None, settings=None) -> None:
        self._method = UnquantizedLinearMethod(_quantized_hint(checkpoint_quant_method(hf_quant_config)))

    def get_linear_method(self, prefix: str) -> LinearMethod:
        return self._method


@hookimpl
def kvforge_register_quantizers(register) -> None:
    register("unquantized", UnquantizedConfig)
