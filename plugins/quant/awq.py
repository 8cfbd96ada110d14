"""`awq` quantizer: AutoAWQ "GEMM" checkpoints (4-bit weights, fp16 scales, W4A16).

Algorithm: Lin et al., "AWQ: Activation-aware Weight Quantization" (arXiv:2306.00978);
format: the AutoAWQ package (``awq/modules/linear/gemm.py``), as read by vLLM and transformers.

Format (AutoAWQ ``WQLinear_GEMM``; the same tensors vLLM and transformers load), per
linear layer with K in and N out features and group size g:

* ``qweight`` int32 [K, N/8]: 8 unsigned 4-bit values per word, packed along the output
  dim; nibble i (bits 4i..4i+3) of word c holds column ``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``;
* ``qzeros`` int32 [K/g, N/8]: zero points, packed the same way;
* ``scales`` fp16 [K/g, N].

``W^T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]``. ``quantization_config``:
``quant_method: awq``, ``bits`` (or ``w_bit``) 4, ``group_size`` (or ``q_group_size``),
``zero_point: true``, ``version: gemm``; ``modules_to_not_convert`` lists substrings of
module names kept unquantized (AutoAWQ's rule). Refused at load: other versions
(``gemv``/``gemv_fast``/``marlin``/``exllama`` pack differently), bits != 4,
``zero_point: false``. Layers whose dims the format cannot hold (N % 8, K % g) must be in
``modules_to_not_convert``, as AutoAWQ itself requires.
"""
from __future__ import annotations

import torch

from kvforge import hookimpl
from kvforge.interfaces import LinearMethod, QuantizationConfig

from .checks import bool_field, int_field
from .common import (WeightOnlySettings, decide_per_shard, matches_any, require_checkpoint_method,
                     triton_backend_reasons)
from .unquantized import UnquantizedLinearMethod
from .weight_only import WNA16LinearMethod

KVFORGE_HOOK_API = "1"


class AWQSettings(WeightOnlySettings):
    """``backend``: ``auto`` (Triton W4A16 on CUDA, dequantize+matmul elsewhere), ``triton``,
    ``reference``; ``int4_layout``: see :class:`WeightOnlySettings`."""


def _int_option(cfg: dict, keys: tuple[str, ...]) -> int:
    """The first of ``keys`` (AutoAWQ's name, then its older alias) present in ``cfg``, as an int.

    Raises:
        ValueError: not an integer (``checks.int_field``), or none of ``keys`` present (a guessed
            bit width or group size would fail later, pointing at the wrong cause; vLLM requires
            them too), naming the field.
    """
    for key in keys:
        if key in cfg:
            return int_field(cfg[key], f"quantization_config.{key}")
    raise ValueError(f"quantization_config.{keys[0]}: missing (also read as {', '.join(keys[1:])}); an AWQ "
                     "checkpoint's config states it")


class AWQConfig(QuantizationConfig):
    """AutoAWQ GEMM checkpoint config (``hf_quant_config`` = config.json ``quantization_config``)."""

    name = "awq"
    #: quantization_configs the conformance suite (kvforge.testing.quantizer) runs.
    #: Group 64: fp16/bf16 layers take the pairs layout on the Triton path; group 32 keeps the
    #: checkpoint's packing.
    conformance_quant_configs = [{"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True,
                                  "version": "gemm"} for gs in (32, 64)]

    def __init__(self, hf_quant_config: dict | None = None, settings: AWQSettings | None = None) -> None:
        cfg = hf_quant_config or {}
        require_checkpoint_method(cfg, "awq", "an AutoAWQ checkpoint")
        self.settings = settings or AWQSettings()
        self.bits = _int_option(cfg, ("bits", "w_bit"))
        self.group_size = _int_option(cfg, ("group_size", "q_group_size"))
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"awq: version {version!r} is not supported; kvforge loads AutoAWQ 'gemm' checkpoints "
                             "('gemv'/'gemv_fast'/'marlin'/'exllama' pack weights differently)")
        if self.bits != 4:
            raise ValueError(f"awq: {self.bits}-bit weights are not supported; AutoAWQ GEMM checkpoints are 4-bit")
        if not bool_field(cfg.get("zero_point", True), "quantization_config.zero_point"):
            raise ValueError("awq: zero_point false (symmetric AWQ) is not supported; AutoAWQ GEMM checkpoints "
                             "carry zero points")
        if self.group_size <= 0:
            raise ValueError(f"awq: group_size {self.group_size} is not supported (needs a positive group size)")
        self.skip = list(cfg.get("modules_to_not_convert") or [])
        self._method = WNA16LinearMethod("awq", 4, self.group_size, 0, self.settings.backend,
                                         "list it in quantization_config.modules_to_not_convert",
                                         int4_layout=self.settings.int4_layout, fuse_norm=self.settings.fuse_norm,
                                         fuse_norm_max_tokens=self.settings.fuse_norm_max_tokens)
        self._dense = UnquantizedLinearMethod()

    def get_linear_method(self, prefix: str) -> LinearMethod:
        if decide_per_shard(prefix, lambda n: matches_any(n, self.skip)):
            return self._dense
        return self._method

    def validate(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        return triton_backend_reasons(self.settings.backend, device)


@hookimpl
def kvforge_register_quantizers(register) -> None:
    register("awq", AWQConfig, AWQSettings)
