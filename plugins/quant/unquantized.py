"""`unquantized` quantizer: dense weights in the model dtype, GEMM via torch (cuBLAS / oneDNN)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge import hookimpl
from kvforge.interfaces import LinearMethod, QuantizationConfig

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


class UnquantizedLinearMethod(LinearMethod):
    """Weight ``[sum(output_sizes), input_size]`` in the model dtype; ``y = x W^T + b``."""

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


class UnquantizedConfig(QuantizationConfig):
    name = "unquantized"

    def __init__(self, hf_quant_config=None, settings=None) -> None:
        self._method = UnquantizedLinearMethod()

    def get_linear_method(self, prefix: str) -> LinearMethod:
        return self._method


@hookimpl
def kvforge_register_quantizers(register) -> None:
    register("unquantized", UnquantizedConfig)
