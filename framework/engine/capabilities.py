"""Capability declarations and the build-time compatibility check.

A plugin declares what it supports as keyword arguments of its ``register``
call (``register("paged", make_paged, PagedSettings, prefix_caching=True)``);
they land in :attr:`kvforge.plugin_manager.PluginSpec.capabilities`.
:func:`check_capabilities` runs once per engine build, after names and
settings are resolved and before the model is built or any weight is read,
and refuses an incompatible combination with a message naming both plugins.

Rule: a check refuses only on a *declared* conflict. A missing key means "not
declared": no restriction for lists (``dtypes``, ``block_sizes``, ``devices``)
and for opt-out flags (``rollback``, ``spec_decode``, ``priorities`` refuse only
when declared False), and "no" for the features another plugin may require
(``prefix_caching``, ``eviction_hints``). Known keys must have the documented
type (a typo'd value fails the build, naming the plugin); unknown keys are
allowed (free-form) but, as they are likely typos, logged once per plugin, listed by
``kvforge plugins`` and failed by the conformance suites (:func:`unknown_capabilities`).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvforge.layers.kv_cache_dtype import CAPABILITY_NAMES
from kvforge.plugin_manager import describe_plugin as describe

if TYPE_CHECKING:
    import torch

    from kvforge.config import EngineConfig
    from kvforge.plugin_manager import PluginSpec, Registry

log = logging.getLogger("kvforge")

_DTYPE_NAMES = ("float32", "float16", "bfloat16")
_DEVICE_TYPES = ("cpu", "cuda")
_KV_DTYPE_NAMES = tuple(CAPABILITY_NAMES.values())  # ("fp8_e4m3", "fp8_e5m2")

#: kind -> capability key -> (type check name, meaning). Documented in docs/plugins.md.
KNOWN_CAPABILITIES: dict[str, dict[str, tuple[str, str]]] = {
    "attention": {
        "priority": ("int", "order among `attention.backend: auto` candidates; higher wins"),
        "dtypes": ("dtypes", "model dtypes it computes in; the configured dtype must be listed"),
        "block_sizes": ("ints", "KV block sizes (tokens) it supports; cache.block_size must be listed"),
        "devices": ("devices", "device types it runs on ('cpu', 'cuda'); the engine's device must be listed"),
        "cuda_graphs": ("bool", "pure-decode steps can be captured in CUDA graphs"),
        "mixed_cuda_graphs": ("bool", "small mixed prefill/decode steps can be captured in CUDA graphs "
                                      "(implements graph_metadata / update_graph_metadata)"),
        "spec_decode": ("bool", "False: cannot verify draft tokens (multi-token decode rows); refuses drafters"),
        "kv_cache_dtypes": ("kv_dtypes", "FP8 KV caches it reads and writes with per-layer scales ('fp8_e4m3', "
                                         "'fp8_e5m2'); undeclared: none, cache.kv_cache_dtype must be auto"),
    },
    "kv_allocator": {
        "prefix_caching": ("bool", "implements get_computed_tokens (automatic prefix caching)"),
        "block_sizes": ("ints", "block sizes it supports; cache.block_size must be listed"),
        "rollback": ("bool", "False: cannot return rejected draft slots (free_tail) or caches lookahead "
                             "blocks; refuses drafters"),
        "eviction_hints": ("strs", "per-request eviction hints it honours; request_choices.eviction_hints "
                                   "must be a subset"),
    },
    "scheduler": {
        "requires_prefix_caching": ("bool", "needs an allocator declaring prefix_caching=True and "
                                            "cache.enable_prefix_caching: true"),
        "priorities": ("bool", "False: ignores request priority; refuses request_choices.priorities"),
        "spec_decode": ("bool", "False: cannot schedule draft tokens; refuses drafters"),
        "chunked_prefill": ("bool", "splits prompts across steps (informational)"),
    },
    "quantizer": {
        "dtypes": ("dtypes", "activation dtypes it supports; the configured dtype must be listed"),
        "devices": ("devices", "device types it runs on"),
    },
    "drafter": {
        "needs_hidden_states": ("bool", "propose() receives the target's last hidden states"),
        "max_speculative_tokens": ("int", "largest speculative.num_speculative_tokens it supports"),
        "dtypes": ("dtypes", "model dtypes it supports"),
        "devices": ("devices", "device types it runs on"),
    },
    "model": {},
}

_warned: set[tuple[str, str]] = set()  # (kind, name) of plugins whose unknown keys were logged


def ignores_priority(spec: "PluginSpec") -> bool:
    """A scheduler that declares ``priorities=False`` (it ignores request priority; undeclared:
    no restriction, see the module docstring)."""
    return spec.capabilities.get("priorities") is False


def _type_ok(kind: str, value: Any) -> bool:
    def seq(items_ok) -> bool:
        return isinstance(value, (list, tuple, set, frozenset)) and all(items_ok(v) for v in value)

    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "ints":
        return seq(lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0)
    if kind == "strs":
        return seq(lambda v: isinstance(v, str))
    if kind == "dtypes":
        return seq(lambda v: v in _DTYPE_NAMES)
    if kind == "devices":
        return seq(lambda v: v in _DEVICE_TYPES)
    if kind == "kv_dtypes":
        return seq(lambda v: v in _KV_DTYPE_NAMES)
    return True


def unknown_capabilities(spec: "PluginSpec") -> list[str]:
    """One message per capability key of ``spec`` that its kind does not know (likely a typo),
    with the closest known key when there is one; shown by ``kvforge plugins``, failed by
    the conformance suites, logged once at engine build."""
    import difflib
    known = KNOWN_CAPABILITIES.get(spec.kind, {})
    out = []
    for key in spec.capabilities:
        if key not in known:
            near = difflib.get_close_matches(key, list(known), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            out.append(f"{describe(spec)} declares unknown capability {key!r} ({hint}known for {spec.kind}: "
                       f"{', '.join(sorted(known)) or 'none'})")
    return out


def validate_declarations(spec: "PluginSpec") -> None:
    """Check the types of ``spec``'s known capability keys; log unknown keys once.

    Raises:
        ValueError: naming the plugin and the key.
    """
    known = KNOWN_CAPABILITIES.get(spec.kind, {})
    if (spec.kind, spec.name) not in _warned:
        _warned.add((spec.kind, spec.name))
        for msg in unknown_capabilities(spec):
            log.warning("%s", msg)
    for key, value in spec.capabilities.items():
        if key not in known:
            continue
        kind, meaning = known[key]
        if not _type_ok(kind, value):
            allowed = {"dtypes": f" from {_DTYPE_NAMES}", "devices": f" from {_DEVICE_TYPES}",
                       "kv_dtypes": f" from {_KV_DTYPE_NAMES}"}.get(kind, "")
            raise ValueError(f"{describe(spec)} declares capability {key}={value!r}, which must be of type "
                             f"{kind}{allowed} ({meaning})")


def _listed(spec: "PluginSpec", key: str, value: Any, what: str) -> None:
    declared = spec.capabilities.get(key)
    if declared is not None and value not in declared:
        raise ValueError(f"{describe(spec)} does not support {what} {value!r} (it declares {key}="
                         f"{tuple(declared)!r})")


def resolve_specs(config: "EngineConfig", registry: "Registry", hf_config, dtype: "torch.dtype",
                  device: "torch.device") -> dict[str, "PluginSpec"]:
    """The spec of every plugin the config selects, resolved without building anything
    (``attention.backend: auto`` is resolved by the backends' ``validate``, as the builder does)."""
    from kvforge.engine.builder import choose_attention
    from kvforge.engine.resolve import checkpoint_quant_config, resolve_quant_method
    from kvforge.interfaces import AttentionRequirements
    specs = {"scheduler": registry.get("scheduler", config.scheduler.name),
             "kv_allocator": registry.get("kv_allocator", config.cache.allocator)}
    if config.speculative.method is not None:
        specs["drafter"] = registry.get("drafter", config.speculative.method)
    qname = resolve_quant_method(config.quantization.method, checkpoint_quant_config(hf_config))
    specs["quantizer"] = registry.get("quantizer", qname)
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    from kvforge.layers.kv_cache_dtype import resolve_kv_cache_dtype
    req = AttentionRequirements(dtype, head_dim, num_heads, num_kv_heads, config.cache.block_size,
                                resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype),
                                getattr(hf_config, "sliding_window", None))
    specs["attention"], _ = choose_attention(registry, config.attention.backend, req, device,
                                             config.attention.settings)
    return specs


def check_combination(config: "EngineConfig", specs: dict[str, "PluginSpec"], dtype_name: str,
                      device_type: str, registry: "Registry | None" = None) -> None:
    """The compatibility rules over resolved specs (kind -> spec).

    Raises:
        ValueError: the first conflict, naming both plugins (or the plugin and the config field).
    """
    for spec in specs.values():
        validate_declarations(spec)
    bs = config.cache.block_size
    attn, alloc, sched = specs.get("attention"), specs["kv_allocator"], specs["scheduler"]
    quant, drafter = specs.get("quantizer"), specs.get("drafter")
    if attn is not None:
        _listed(attn, "dtypes", dtype_name, "model dtype")
        _listed(attn, "block_sizes", bs, "cache.block_size")
        _listed(attn, "devices", device_type, "device")
    _listed(alloc, "block_sizes", bs, "cache.block_size")
    if quant is not None:
        _listed(quant, "dtypes", dtype_name, "model dtype")
        _listed(quant, "devices", device_type, "device")
    if sched.capabilities.get("requires_prefix_caching"):
        if alloc.capabilities.get("prefix_caching") is not True:
            raise ValueError(f"incompatible plugins: {describe(sched)} requires prefix caching, but "
                             f"{describe(alloc)} does not declare prefix_caching=True; choose another "
                             f"cache.allocator or scheduler.name")
        if not config.cache.enable_prefix_caching:
            raise ValueError(f"{describe(sched)} requires prefix caching: set cache.enable_prefix_caching: true "
                             f"(flag --enable-prefix-caching true)")
    drafters = [drafter] if drafter is not None else []
    rc = getattr(config, "request_choices", None)
    for name in (rc.drafters if rc is not None and registry is not None else ()):
        if name != "none" and all(d.name != name for d in drafters):
            try:
                drafters.append(registry.get("drafter", name))
            except ValueError as e:
                raise ValueError(f"request_choices.drafters: {e}") from None
    for drafter in drafters:
        validate_declarations(drafter)
        _listed(drafter, "dtypes", dtype_name, "model dtype")
        _listed(drafter, "devices", device_type, "device")
        for other, key, what in ((alloc, "rollback", "cannot roll back rejected draft slots"),
                                 (sched, "spec_decode", "cannot schedule draft tokens"),
                                 (attn, "spec_decode", "cannot verify draft tokens")):
            if other is not None and other.capabilities.get(key) is False:
                raise ValueError(f"incompatible plugins: {describe(drafter)} needs speculative decoding support, "
                                 f"but {describe(other)} {what} (it declares {key}=False)")
        cap = drafter.capabilities.get("max_speculative_tokens")
        if cap is not None and config.speculative.num_speculative_tokens > cap:
            raise ValueError(f"speculative.num_speculative_tokens {config.speculative.num_speculative_tokens} "
                             f"exceeds the {cap} that {describe(drafter)} supports (max_speculative_tokens)")
    if rc is not None:
        honoured = alloc.capabilities.get("eviction_hints") or ()
        missing = [h for h in rc.eviction_hints if h not in honoured]
        if missing:
            raise ValueError(f"request_choices.eviction_hints {missing} are not honoured by {describe(alloc)} "
                             f"(it declares eviction_hints={tuple(honoured)!r})")
        if rc.priorities is not None and ignores_priority(sched):
            raise ValueError(f"request_choices.priorities is set, but {describe(sched)} ignores request priority "
                             f"(it declares priorities=False)")


def check_capabilities(config: "EngineConfig", registry: "Registry", hf_config, dtype: "torch.dtype",
                       device: "torch.device") -> dict[str, "PluginSpec"]:
    """Resolve the selected plugins and refuse incompatible combinations; called once by
    :func:`kvforge.engine.builder.build_engine_parts` before the model is built.

    Returns: kind -> the resolved spec.

    Raises:
        ValueError: a declared conflict, naming both plugins (see the module docstring).
    """
    specs = resolve_specs(config, registry, hf_config, dtype, device)
    check_combination(config, specs, str(dtype).removeprefix("torch."), device.type, registry)
    return specs
