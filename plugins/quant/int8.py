"""`int8` quantizer: INT8 W8A8 with per-channel weights and dynamic per-token activations.

Scheme: the per-channel / per-token absmax W8A8 of ZeroQuant (Yao et al., arXiv:2206.01861)
and vLLM / llm-compressor's "W8A8-INT8" (without SmoothQuant's calibration).

``quantization.method: int8`` on an unquantized (fp32/fp16/bf16) checkpoint quantizes
every linear layer at load time: symmetric per-output-channel weights
``weight = round(W / s)``, ``s[n] = max_k |W[n, k]| / 127``, int8 [out, in] with fp32
scales [out]; activations are quantized per token at run time (``scale[m] =
max|x[m]| / 127``, see ``kernels/scaled_mm.py``). Pre-quantized INT8 W8A8 checkpoints
(llm-compressor "int-quantized") load through the ``compressed-tensors`` quantizer, which
runs the same linear method.

GEMM on CUDA: the Triton INT8 kernel (int32 accumulation, scales fused in the epilogue) or
``torch._int_mm`` per shape (``kernels/choices.py``); elsewhere the reference
(quantize activations, dequantize both operands, fp32 matmul).
"""
from __future__ import annotations

import torch

from kvforge import hookimpl
from kvforge.interfaces import LinearMethod, QuantizationConfig
from kvforge.interfaces.quantization import checkpoint_quant_method

from .checks import check_module_patterns
from .common import cuda_capability_reasons, decide_per_shard, layer_ignored, triton_backend_reasons
from .unquantized import UnquantizedLinearMethod
from .w8a8 import W8A8LinearMethod, W8A8Settings

KVFORGE_HOOK_API = "1"


class Int8Settings(W8A8Settings):
    """Settings of the ``int8`` quantizer: ``backend``, and module names (or ``re:`` regexes)
    to keep unquantized."""

    ignore: list[str] = []


class Int8Config(QuantizationConfig):
    """Online INT8 W8A8 (the checkpoint must be unquantized)."""

    name = "int8"

    def __init__(self, hf_quant_config: dict | None = None, settings: Int8Settings | None = None) -> None:
        self.settings = settings or Int8Settings()
        method = checkpoint_quant_method(hf_quant_config)
        if method is not None:
            raise ValueError(f"quantization method 'int8' quantizes an unquantized checkpoint online; this checkpoint "
                             f"is already quantized with {method!r} (use quantization.method 'auto')")
        check_module_patterns(self.settings.ignore, "quantization.settings.ignore")
        self._method = W8A8LinearMethod(torch.int8, False, False, self.settings)
        self._dense = UnquantizedLinearMethod()

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if decide_per_shard(prefix, lambda n: layer_ignored(n, self.settings.ignore)):
            return self._dense
        return self._method

    def validate(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        if self.settings.backend == "reference":
            return []
        return (triton_backend_reasons(self.settings.backend, device)
                + cuda_capability_reasons(device, (8, 0), "INT8 W8A8 (int8 tensor-core tl.dot)"))


@hookimpl
def kvforge_register_quantizers(register) -> None:
    register("int8", Int8Config, Int8Settings)
