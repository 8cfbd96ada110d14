"""FP8 KV cache: names, dtypes and the reference quantization.

``cache.kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``) picks what the paged cache stores:
``auto`` (the model's dtype), ``fp8`` / ``fp8_e4m3`` (OCP FP8 E4M3, ``torch.float8_e4m3fn``:
max 448, 3 mantissa bits) or ``fp8_e5m2`` (E5M2, ``torch.float8_e5m2``: max 57344, 2 mantissa
bits). FP8 halves the cache's bytes against bf16, so a block holds the same tokens in half the
memory and a decode step reads half the KV (the format: Micikevicius et al. 2022, "FP8 Formats
for Deep Learning", arXiv:2209.05433).

Each attention layer has one per-tensor scale for K and one for V (float32, the layer's
``AttentionLayer.kv_scale`` [2]): the cache stores ``clamp(x / scale)`` rounded to nearest
even, and readers compute with ``stored * scale``. Scales come from the checkpoint
(``self_attn.k_scale`` / ``v_scale``, as llm-compressor and vLLM name them), from the first
step's K and V (``cache.calculate_kv_scales``), or are 1.0.
"""
from __future__ import annotations

import torch

#: config name -> stored dtype ("auto" is the model's dtype)
FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_NAMES = ("auto", *FP8_KV_DTYPES)
#: largest finite magnitude of each FP8 format (saturation bound)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
#: capability value naming each FP8 cache dtype (``register(..., kv_cache_dtypes=(...))``)
CAPABILITY_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache stores for ``cache.kv_cache_dtype`` ``name``.

    Raises:
        ValueError: naming ``cache.kv_cache_dtype`` for an unknown name.
    """
    if name == "auto":
        return model_dtype
    if name not in FP8_KV_DTYPES:
        raise ValueError(f"cache.kv_cache_dtype: {name!r} is not one of {', '.join(KV_CACHE_DTYPE_NAMES)}")
    return FP8_KV_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    """True for the FP8 cache dtypes."""
    return dtype in FP8_MAX


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def unit_kv_scale(device: torch.device) -> torch.Tensor:
    """float32 [2] ones on ``device``: the K/V scales of a layer that passes none (a model
    without :class:`~kvforge.layers.attention.PagedAttention`). One tensor per device, so an
    FP8 cache does not cost an allocation per layer per call; one made during CUDA-graph
    capture belongs to the graph's pool and is not kept."""
    device = torch.device(device)
    t = _UNIT_SCALES.get(device)
    if t is None:
        t = torch.ones(2, dtype=torch.float32, device=device)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _UNIT_SCALES[device] = t
    return t


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` saturated to the format's range and rounded to nearest even in ``dtype``.

    Args:
        x: any float tensor (K or V rows); scale: float32 scalar tensor (0-d or [1]) > 0.
    Returns:
        ``x``'s shape in ``dtype`` (``x.to(dtype)`` unchanged for a non-FP8 ``dtype``).
    """
    if not is_fp8(dtype):
        return x.to(dtype)
    lim = FP8_MAX[dtype]
    # torch's cast does not saturate every format (E5M2: 1e6 -> inf), hence the clamp.
    return (x.float() / scale.float().reshape(())).clamp(-lim, lim).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The values an FP8 cache holds, in float32 (``x * scale``); other dtypes are returned as is."""
    if not is_fp8(x.dtype):
        return x
    return x.float() * (1.0 if scale is None else scale.float().reshape(()))


def warn_default_kv_scales(model: torch.nn.Module, name: str) -> None:
    """Log a warning when no layer of ``model`` got a K/V scale from its checkpoint (all 1.0):
    values past the format's range then saturate (vLLM warns the same way)."""
    import logging

    from kvforge.layers.attention import PagedAttention
    scales = [m.kv_scale for m in model.modules() if isinstance(m, PagedAttention)]
    if scales and all(bool((s == 1.0).all()) for s in scales):
        logging.getLogger("kvforge").warning(
            "cache.kv_cache_dtype %s: the checkpoint has no K/V scales (self_attn.k_scale / v_scale), so every "
            "layer uses 1.0; K and V values beyond the format's range (%g) saturate", name,
            FP8_MAX[FP8_KV_DTYPES[name]])
