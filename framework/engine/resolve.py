"""Resolving names in the config: plugin settings, device, dtype, the quantizer and the
attention backend."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from pydantic import ValidationError

from kvforge.config import boolean_for_number, boolean_for_number_message, validation_message
from kvforge.interfaces import AttentionRequirements
from kvforge.interfaces.quantization import checkpoint_quant_method
from kvforge.plugin_manager import PluginError, PluginSpec, Registry, describe_plugin, validate_backend

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def validate_plugin_settings(spec: PluginSpec, settings: dict[str, Any], field: str) -> Any:
    """Validate ``settings`` with the plugin's own model; errors name ``field``.

    Raises:
        ValueError: settings given to a plugin that takes none, or invalid settings.
    """
    model = spec.settings_model
    if model is None:
        if settings:
            raise ValueError(f"{field}: {spec.kind} {spec.name!r} takes no settings, got {sorted(settings)}")
        return None
    fields = getattr(model, "model_fields", {})
    misread = [f"{field}.{k}: {boolean_for_number_message(v)}" for k, v in settings.items()
               if k in fields and boolean_for_number(fields[k].annotation, v)]
    if misread:
        raise ValueError(f"invalid settings for {spec.kind} {spec.name!r}: {'; '.join(misread)}")
    try:
        return model.model_validate(settings)
    except ValidationError as e:
        msgs = "; ".join(".".join([field, *map(str, err["loc"])]) + f": {validation_message(err)}"
                         for err in e.errors())
        raise ValueError(f"invalid settings for {spec.kind} {spec.name!r}: {msgs}") from None
    except SystemExit as e:  # (a validator of the plugin's calling sys.exit would end the process)
        raise PluginError(f"{describe_plugin(spec)}: its settings model called sys.exit({e.code!r})") from e


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device: 'cuda' requested but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, hf_config) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = _DTYPES.get(d)
    return d if d in _DTYPES.values() else torch.float32


def kv_dtype_reasons(spec: PluginSpec, req: AttentionRequirements) -> list[str]:
    """Why ``spec`` cannot hold an FP8 KV cache (``req.kv_cache_dtype``): it must declare the
    dtype in its ``kv_cache_dtypes`` capability, since a backend unaware of FP8 would write the
    cache without its scales. Empty when the cache holds the model's dtype."""
    from kvforge.layers.kv_cache_dtype import CAPABILITY_NAMES
    name = CAPABILITY_NAMES.get(req.kv_cache_dtype)
    if name is None or name in (spec.capabilities.get("kv_cache_dtypes") or ()):
        return []
    return [f"cache.kv_cache_dtype {name} unsupported (it declares kv_cache_dtypes="
            f"{tuple(spec.capabilities.get('kv_cache_dtypes') or ())!r})"]


def backend_reasons(spec: PluginSpec, req: AttentionRequirements, device: torch.device) -> list[str]:
    """Why attention backend ``spec`` cannot serve ``req`` on ``device`` (empty: it can): an FP8
    cache it does not declare (:func:`kv_dtype_reasons`), else its own ``validate``."""
    return kv_dtype_reasons(spec, req) or validate_backend(spec, req, device)


def choose_attention(registry: Registry, name: str, req: AttentionRequirements, device: torch.device,
                     settings: dict[str, Any] | None = None) -> tuple[PluginSpec, dict[str, list[str]]]:
    """Pick the backend named ``name``, or for ``auto`` the highest-priority one whose
    ``validate`` returns no reasons. Returns (spec, rejected name -> reasons). Each backend's
    ``validate`` sees ``settings`` (``attention.settings``) validated by its own settings model
    in ``req.settings``. A named backend's settings are checked first, so a bad setting is
    reported as such even where the backend cannot run; under ``auto`` a backend whose
    settings model refuses them is rejected with that reason.

    Raises:
        ValueError: invalid settings, the named backend cannot run here, or no backend can
            (reasons listed).
    """
    if name != "auto":
        spec = registry.get("attention", name)
        checked = validate_plugin_settings(spec, settings or {}, "attention.settings")
        reasons = backend_reasons(spec, replace(req, settings=checked), device)
        if reasons:
            raise ValueError(f"attention.backend {name!r} cannot run here: {'; '.join(reasons)}")
        return spec, {}
    rejected: dict[str, list[str]] = {}
    ok: list[PluginSpec] = []
    for n in registry.names("attention"):
        spec = registry.get("attention", n)
        try:
            checked = validate_plugin_settings(spec, settings or {}, "attention.settings")
        except ValueError as e:
            rejected[n] = [str(e)]
            continue
        reasons = backend_reasons(spec, replace(req, settings=checked), device)
        (rejected.__setitem__(n, reasons) if reasons else ok.append(spec))
    if not ok:
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items()) or "none registered"
        raise ValueError(f"attention.backend 'auto': no backend can run here ({detail})")
    ok.sort(key=lambda s: -int(s.capabilities.get("priority", 0)))
    return ok[0], rejected


def checkpoint_quant_config(hf_config) -> dict | None:
    """config.json's ``quantization_config`` as a dict (None when absent or null)."""
    hf_quant = getattr(hf_config, "quantization_config", None)
    if hf_quant is not None and not isinstance(hf_quant, dict):
        hf_quant = hf_quant.to_dict()
    return hf_quant


def resolve_quant_method(quant_method: str, hf_quant: dict | None) -> str:
    """The quantizer name for ``quantization.method`` ``quant_method``: itself, or for ``auto``
    the checkpoint's ``quantization_config.quant_method`` matched ignoring case
    (``checkpoint_quant_method``), else ``unquantized``.

    Raises:
        ValueError: the checkpoint's ``quant_method`` is not a string, naming the field.
    """
    if quant_method != "auto":
        return quant_method
    return checkpoint_quant_method(hf_quant) or "unquantized"
