"""`compressed-tensors` quantizer: checkpoints written by llm-compressor / the
``compressed-tensors`` library (``quantization_config.quant_method == "compressed-tensors"``).

Supported schemes (per ``config_groups`` entry; ``targets`` ``"Linear"``, exact module
names or ``re:`` regexes; ``ignore`` keeps modules unquantized):

* ``int-quantized`` / ``float-quantized`` W8A8: 8-bit int or FP8 E4M3 symmetric weights
  (``weight`` [out, in], ``weight_scale`` [out, 1] per channel or [1] per tensor) with
  8-bit activations of the same type, dynamic per token or static per tensor
  (``input_scale`` [1]) -> the W8A8 method of the ``int8`` / ``fp8`` quantizers;
* ``pack-quantized`` W4A16 / W8A16: int weights packed 32/b per int32 along the input dim
  (``weight_packed`` [out, in*b/32]), ``weight_scale`` [out, groups], asymmetric
  ``weight_zero_point`` int32 [out*b/32, groups] packed along out, ``weight_shape`` [2];
  values and zero points are stored offset by 2**(b-1) (signed -> unsigned) -> the
  weight-only Triton GEMM (GPTQ layout after a transpose at load).

Refused with a message: other formats (sparse, nvfp4, mxfp4, naive float weights), group
act-order (``actorder: group``), asymmetric activations or W8A8 weights, a KV-cache
scheme, a status other than ``compressed``, an invalid ``re:`` regex in ``ignore`` /
``targets``; at load, non-finite scales (W8A8 scales also <= 0), naming the tensor.
"""
from __future__ import annotations

import re

import torch

from kvforge import hookimpl
from kvforge.interfaces import LinearMethod, QuantizationConfig
from kvforge.interfaces.quantization import checkpoint_quant_method

from .checks import check_module_patterns, int_field
from .common import cuda_capability_reasons, decide_per_shard, float8_reasons, layer_ignored, triton_backend_reasons
from .unquantized import UnquantizedLinearMethod
from .w8a8 import W8A8LinearMethod, W8A8Settings
from .weight_only import WNA16LinearMethod

KVFORGE_HOOK_API = "1"
_FORMATS = ("int-quantized", "float-quantized", "pack-quantized")


class CompressedTensorsSettings(W8A8Settings):
    """``backend`` applies to every scheme (``torch`` means ``auto`` for weight-only layers)."""


def _targets(name: str, targets: list[str]) -> bool:
    for t in targets:
        if t == "Linear" or t == name or (t.startswith("re:") and re.match(t[3:], name)):
            return True
    return False


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    @staticmethod
    def _group(fmt: str, w: dict, a: dict | None) -> dict:
        return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": a}}}

    #: quantization_configs the conformance suite (kvforge.testing.quantizer) runs.
    conformance_quant_configs = [
        _group("int-quantized", {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
               {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}),
        _group("float-quantized", {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
               {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}),
        _group("pack-quantized", {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                                  "symmetric": False}, None),
        _group("pack-quantized", {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}, None)]

    def __init__(self, hf_quant_config: dict | None = None, settings: CompressedTensorsSettings | None = None) -> None:
        cfg = hf_quant_config or {}
        if checkpoint_quant_method(cfg) != "compressed-tensors":
            raise ValueError("quantization method 'compressed-tensors' needs a checkpoint with quant_method "
                             f"'compressed-tensors'; this one has {cfg.get('quant_method')!r}")
        self.settings = settings or CompressedTensorsSettings()
        status = cfg.get("quantization_status", "compressed")
        if status != "compressed":
            raise ValueError(f"compressed-tensors: quantization_status {status!r} is not supported (compressed)")
        if cfg.get("kv_cache_scheme"):
            raise ValueError("compressed-tensors: a kv_cache_scheme (quantized KV cache) is not supported")
        if cfg.get("sparsity_config"):
            raise ValueError("compressed-tensors: sparse checkpoints (sparsity_config) are not supported")
        self.ignore = check_module_patterns(cfg.get("ignore"), "quantization_config.ignore")
        self.groups: list[tuple[list[str], LinearMethod, bool]] = []
        self.group_names: list[str] = []
        for gname, group in (cfg.get("config_groups") or {}).items():
            self.group_names.append(gname)
            targets = check_module_patterns(group.get("targets"),
                                            f"quantization_config.config_groups[{gname!r}].targets")
            self.groups.append((targets, *self._method(gname, group, cfg.get("format"))))
        if not self.groups:
            raise ValueError("compressed-tensors: config_groups is empty")
        self._dense = UnquantizedLinearMethod()

    def _method(self, gname: str, group: dict, default_fmt: str | None) -> tuple[LinearMethod, bool]:
        fmt = group.get("format") or default_fmt
        w, a = group.get("weights") or {}, group.get("input_activations")
        where = f"compressed-tensors config_groups[{gname!r}]"
        if fmt not in _FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported ({', '.join(_FORMATS)})")
        if group.get("output_activations"):
            raise ValueError(f"{where}: output activation quantization is not supported")
        if w.get("actorder") == "group":
            raise ValueError(f"{where}: group act-order (weight_g_idx) is not supported")
        bits, wtype, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        if fmt == "pack-quantized":
            if a is not None:
                raise ValueError(f"{where}: pack-quantized with quantized activations (e.g. W4A8) is not supported")
            if wtype != "int" or bits not in (4, 8) or strategy not in ("group", "channel"):
                raise ValueError(f"{where}: pack-quantized weights must be int4/int8 per group or channel, got "
                                 f"{wtype} {bits}-bit {strategy}")
            gs = int_field(w.get("group_size"), f"{where}.weights.group_size") if strategy == "group" else -1
            if strategy == "group" and gs <= 0:
                raise ValueError(f"{where}: weights.group_size {gs} is not supported (a positive group size)")
            sym = bool(w.get("symmetric", True))
            return WNA16LinearMethod("ct", bits, gs, 0, "reference" if self.settings.backend == "reference" else
                                     "triton" if self.settings.backend == "triton" else "auto",
                                     "add it to quantization_config.ignore", symmetric=sym), False
        qdtype = torch.int8 if wtype == "int" else getattr(torch, "float8_e4m3fn", None)
        if bits != 8 or qdtype is None or strategy not in ("channel", "tensor") or not w.get("symmetric", True):
            raise ValueError(f"{where}: {fmt} weights must be symmetric 8-bit per channel or per tensor, got "
                             f"{'symmetric' if w.get('symmetric', True) else 'asymmetric'} {bits}-bit {strategy}")
        if a is None:
            raise ValueError(f"{where}: weight-only {fmt} (W8A16 unpacked) is not supported; use pack-quantized")
        if a.get("num_bits") != 8 or a.get("type", "int") != wtype or not a.get("symmetric", True):
            raise ValueError(f"{where}: activations must be symmetric 8-bit {wtype} like the weights")
        dynamic = bool(a.get("dynamic", False))
        if dynamic and a.get("strategy") != "token" or not dynamic and a.get("strategy") != "tensor":
            raise ValueError(f"{where}: activations must be dynamic per token or static per tensor, got "
                             f"{'dynamic' if dynamic else 'static'} {a.get('strategy')}")
        return W8A8LinearMethod(qdtype, True, not dynamic, self.settings), qdtype != torch.int8

    def get_linear_method(self, prefix: str) -> LinearMethod:
        def pick(name: str):
            if layer_ignored(name, self.ignore):
                return None
            for i, (targets, _, _) in enumerate(self.groups):
                if _targets(name, targets):
                    return i
            return None
        i = decide_per_shard(prefix, pick, lambda r: "not quantized (ignored or no group targets it)" if r is None
                             else f"config_groups[{self.group_names[r]!r}]")
        return self._dense if i is None else self.groups[i][1]

    def validate(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        if self.settings.backend == "reference":
            return []
        reasons = triton_backend_reasons(self.settings.backend, device)
        if any(fp8 for _, _, fp8 in self.groups):
            reasons += float8_reasons() + cuda_capability_reasons(device, (8, 9), "FP8 W8A8")
        return reasons


@hookimpl
def kvforge_register_quantizers(register) -> None:
    register("compressed-tensors", CompressedTensorsConfig, CompressedTensorsSettings)
