"""`gptq` quantizer: GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), 4- or 8-bit weights,
symmetric or asymmetric, with or without act-order (``desc_act`` + ``g_idx``).

Algorithm: Frantar et al., "GPTQ" (arXiv:2210.17323); format: AutoGPTQ / GPTQModel
``QuantLinear`` (the "v1" and "v2" checkpoint formats), as read by vLLM and transformers.

Format, per linear layer with K in, N out features, b bits, pf = 32 / b, group size g
(g = K when ``group_size`` is -1), G = ceil(K / g):

* ``qweight`` int32 [K/pf, N]: packed along the input dim; field i (bits b*i..b*i+b-1)
  of word r holds row ``pf*r + i`` (unsigned b-bit values);
* ``qzeros`` int32 [G, N/pf]: zero points packed along the output dim, field i of word c
  holds column ``pf*c + i``;
* ``scales`` fp16 [G, N];
* ``g_idx`` int32 [K]: group of each input row (``k // g`` unless act-order).

``W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``.

Zero points: in the original ("v1", ``checkpoint_format``/``format`` ``"gptq"``, the
default) format the packer stores ``z - 1`` (a quirk of the first GPTQ CUDA kernel that
every later reader reproduces), so kvforge adds 1 back: symmetric 4-bit layers store 7
(``0x77777777``) for the true zero point 8, 8-bit store 127 for 128. ``"gptq_v2"``
(GPTQModel) stores the true ``z``. ``sym`` only tells how the zeros were chosen; the
stored zeros are always used. A non-trivial ``g_idx`` is honoured even under ``desc_act:
false`` (where vLLM ignores it), with a warning: see ``act_order.py``.

Layers left unquantized: GPTQModel ``dynamic`` keys ``"-:<regex>"`` (negative match; a
positive regex key overrides ``bits``/``group_size``/``desc_act``/``sym`` for matching
modules) and transformers' ``modules_in_block_to_quantize``. Refused: bits other than 4/8,
``lm_head: true``, formats other than gptq / gptq_v2 (e.g. marlin, bitblas), a pack dtype
other than int32; fields of the wrong type or an invalid ``dynamic`` regex, naming the field.
"""
from __future__ import annotations

import logging
import re

import torch

from kvforge import hookimpl
from kvforge.interfaces import LinearMethod, QuantizationConfig

from .checks import bool_field, compile_regex, int_field
from .common import WeightOnlySettings, decide_per_shard, require_checkpoint_method, triton_backend_reasons
from .unquantized import UnquantizedLinearMethod
from .weight_only import WNA16LinearMethod

log = logging.getLogger("kvforge.quant")

KVFORGE_HOOK_API = "1"
_OVERRIDABLE = ("bits", "group_size", "desc_act", "sym")


class GPTQSettings(WeightOnlySettings):
    """``backend``: ``auto`` (Triton on CUDA, dequantize+matmul elsewhere), ``triton``, ``reference``;
    ``int4_layout``: see :class:`WeightOnlySettings`."""


def _read_overrides(src: dict, where: str) -> dict:
    """The :data:`_OVERRIDABLE` fields config section ``where`` (``quantization_config``, or
    ``quantization_config.dynamic['+:.*q_proj']``) sets in ``src``, checked; a null bool is unset.

    Raises:
        ValueError: a field of the wrong type (``bits: "eight"``, ``group_size: 32.7``,
            ``desc_act: "false"``), naming it (``checks.int_field`` / ``bool_field``).
    """
    out = {}
    for key in ("bits", "group_size"):
        if key in src:
            out[key] = int_field(src[key], f"{where}.{key}")
    for key in ("desc_act", "sym"):
        if src.get(key) is not None:
            out[key] = bool_field(src[key], f"{where}.{key}")
    return out


def _read_dynamic(dynamic, base: dict) -> list[tuple[bool, re.Pattern, dict]]:
    """GPTQModel's ``dynamic``: ``{"-:<regex>": {}}`` keeps matching modules unquantized,
    ``"+:<regex>"`` (or a bare regex) overrides :data:`_OVERRIDABLE` fields for them.
    Returns (skip, compiled regex, checked overrides) per key, in order.

    Raises:
        ValueError: not a dict of dicts, an invalid regex, an override of another field or a
            bad value, naming ``quantization_config.dynamic[key]``.
    """
    if not isinstance(dynamic, dict):
        raise ValueError(f"quantization_config.dynamic: expected a dict of regex -> overrides, got {dynamic!r}")
    rules = []
    for key, over in dynamic.items():
        where = f"quantization_config.dynamic[{key!r}]"
        skip = key.startswith("-:")
        regex = compile_regex(key[2:] if key.startswith(("-:", "+:")) else key, where)
        if not isinstance(over, dict):
            raise ValueError(f"{where}: expected a dict of overrides, got {over!r}")
        checked = {}
        if not skip:
            unknown = set(over) - set(_OVERRIDABLE)
            if unknown:
                raise ValueError(f"gptq: dynamic[{key!r}] overrides {sorted(unknown)}; supported: {_OVERRIDABLE}")
            checked = _read_overrides(over, where)
            _check_params({**base, **checked}, f" dynamic[{key!r}]")
        rules.append((skip, regex, checked))
    return rules


def _check_params(p: dict, where: str) -> None:
    """Raise ValueError for bits or a group size this loader cannot hold (``where``: the dynamic key)."""
    if p["bits"] not in (4, 8):
        raise ValueError(f"gptq{where}: {p['bits']}-bit weights are not supported (4 or 8; 2/3-bit words "
                         "straddle int32 boundaries)")
    if p["group_size"] != -1 and p["group_size"] <= 0:
        raise ValueError(f"gptq{where}: group_size {p['group_size']} is not supported (-1 or positive)")


class GPTQConfig(QuantizationConfig):
    """GPTQ checkpoint config (``hf_quant_config`` = config.json ``quantization_config``)."""

    name = "gptq"
    #: quantization_configs the conformance suite (kvforge.testing.quantizer) runs.
    conformance_quant_configs = [
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
        {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True, "sym": False,
         "checkpoint_format": "gptq_v2"},
        {"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True, "sym": False}]

    def __init__(self, hf_quant_config: dict | None = None, settings: GPTQSettings | None = None) -> None:
        cfg = hf_quant_config or {}
        require_checkpoint_method(cfg, "gptq", "a GPTQ checkpoint")
        self.settings = settings or GPTQSettings()
        given = _read_overrides(cfg, "quantization_config")
        for key in ("bits", "group_size"):  # (as vLLM: a guess would fail later, naming the wrong cause)
            if key not in given:
                raise ValueError(f"quantization_config.{key}: missing; a GPTQ checkpoint's config states it")
        for key, default in (("desc_act", False), ("sym", True)):
            if key not in given:
                log.warning("gptq: quantization_config.%s missing; assuming %s", key, str(default).lower())
        self.base = {"desc_act": False, "sym": True, **given}
        _check_params(self.base, "")
        fmt = cfg.get("checkpoint_format") or cfg.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint format {fmt!r} is not supported (gptq or gptq_v2)")
        self.zero_offset = 1 if fmt == "gptq" else 0
        if cfg.get("lm_head") is not None and bool_field(cfg["lm_head"], "quantization_config.lm_head"):
            raise ValueError("gptq: a quantized lm_head (lm_head: true) is not supported")
        pack = cfg.get("pack_dtype", "int32")
        if str(pack).replace("torch.", "") != "int32":
            raise ValueError(f"gptq: pack_dtype {pack!r} is not supported (int32)")
        self.dynamic = _read_dynamic(cfg.get("dynamic") or {}, self.base)
        blocks = cfg.get("modules_in_block_to_quantize")
        self.in_block: list[str] | None = None
        if blocks:
            self.in_block = [m for b in blocks for m in (b if isinstance(b, list) else [b])]
        self._methods: dict[tuple, LinearMethod] = {}
        self._dense = UnquantizedLinearMethod()

    def params_for(self, name: str) -> dict | None:
        """Effective parameters of HF module ``name``, or None to keep it unquantized."""
        if self.in_block is not None and ".layers." in name and not any(
                name == m or name.endswith("." + m) for m in self.in_block):
            return None
        params = dict(self.base)
        for skip, regex, over in self.dynamic:
            if regex.match(name):
                if skip:
                    return None
                params.update(over)
        return params

    def get_linear_method(self, prefix: str) -> LinearMethod:
        params = decide_per_shard(prefix, self.params_for)
        if params is None:
            return self._dense
        key = tuple(params[k] for k in _OVERRIDABLE)
        if key not in self._methods:
            self._methods[key] = WNA16LinearMethod(
                "gptq", params["bits"], params["group_size"], self.zero_offset, self.settings.backend,
                "exclude it with a quantization_config.dynamic '-:<regex>' entry", desc_act=params["desc_act"],
                int4_layout=self.settings.int4_layout, fuse_norm=self.settings.fuse_norm,
                fuse_norm_max_tokens=self.settings.fuse_norm_max_tokens)
        return self._methods[key]

    def validate(self, dtype: torch.dtype, device: torch.device) -> list[str]:
        return triton_backend_reasons(self.settings.backend, device)


@hookimpl
def kvforge_register_quantizers(register) -> None:
    register("gptq", GPTQConfig, GPTQSettings)
