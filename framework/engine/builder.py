"""Engine construction: run the plugin hooks once, validate plugin settings, pick
backends, build the model, size and allocate the KV cache."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from kvforge.config import EngineConfig
from kvforge.interfaces import (AttentionBackend, AttentionRequirements, KVAllocator, Model, ModelContext,
                                QuantizationConfig, Scheduler, SchedulerContext)
from kvforge.plugin_manager import PluginSpec, Registry

log = logging.getLogger("kvforge")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_DEFAULT_KV_BYTES = 1 << 30


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
    try:
        return model.model_validate(settings)
    except ValidationError as e:
        msgs = "; ".join(f"{field}.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"invalid settings for {spec.kind} {spec.name!r}: {msgs}") from None


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


def choose_attention(registry: Registry, name: str, req: AttentionRequirements,
                     device: torch.device) -> tuple[PluginSpec, dict[str, list[str]]]:
    """Pick the backend named ``name``, or for ``auto`` the highest-priority one whose
    ``validate`` returns no reasons. Returns (spec, rejected name -> reasons).

    Raises:
        ValueError: the named backend cannot run here, or no backend can (reasons listed).
    """
    if name != "auto":
        spec = registry.get("attention", name)
        reasons = spec.factory.validate(req, device)
        if reasons:
            raise ValueError(f"attention.backend {name!r} cannot run here: {'; '.join(reasons)}")
        return spec, {}
    rejected: dict[str, list[str]] = {}
    ok: list[PluginSpec] = []
    for n in registry.names("attention"):
        spec = registry.get("attention", n)
        reasons = spec.factory.validate(req, device)
        (rejected.__setitem__(n, reasons) if reasons else ok.append(spec))
    if not ok:
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items()) or "none registered"
        raise ValueError(f"attention.backend 'auto': no backend can run here ({detail})")
    ok.sort(key=lambda s: -int(s.capabilities.get("priority", 0)))
    return ok[0], rejected


@dataclass
class EngineParts:
    """Everything an LLMEngine runs with."""

    config: EngineConfig
    hf_config: Any
    device: torch.device
    dtype: torch.dtype
    model: Model
    backend: AttentionBackend
    allocator: KVAllocator
    scheduler: Scheduler
    kv_caches: list[torch.Tensor]
    cpu_caches: list[torch.Tensor]
    max_model_len: int
    choices: dict[str, str]


def _kv_block_bytes(hf_config, head_dim: int, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * block_size * num_kv_heads * head_dim * elem


def _num_blocks(cfg: EngineConfig, device: torch.device, block_bytes: int, max_model_len: int) -> int:
    c = cfg.cache
    if c.num_gpu_blocks is not None:
        return c.num_gpu_blocks
    if c.kv_cache_memory_bytes is not None:
        budget = c.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * c.gpu_memory_utilization) - (total - free)
    else:
        budget = _CPU_DEFAULT_KV_BYTES
    n = budget // block_bytes
    # More blocks than every sequence could ever fill is only wasted memory.
    cap = cfg.scheduler.max_num_seqs * (-(-max_model_len // c.block_size)) + 1
    n = min(n, cap)
    if n < 1:
        raise ValueError(f"cache: KV budget of {budget} bytes holds no block of {block_bytes} bytes; "
                         "raise gpu_memory_utilization or kv_cache_memory_bytes")
    return int(n)


def build_engine_parts(config: EngineConfig, registry: Registry) -> EngineParts:
    """Build every engine component from ``config`` (hooks already ran into ``registry``).

    Raises:
        ValueError: unknown plugin names (listing the registered ones), bad plugin
            settings, an unsupported model, or a backend that cannot run here.
    """
    from transformers import AutoConfig

    # Names and settings first: a typo fails before any weight is read.
    sched_spec = registry.get("scheduler", config.scheduler.name)
    alloc_spec = registry.get("kv_allocator", config.cache.allocator)
    sched_settings = validate_plugin_settings(sched_spec, config.scheduler.settings, "scheduler.settings")
    alloc_settings = validate_plugin_settings(alloc_spec, config.cache.settings, "cache.settings")
    if config.speculative.method is not None:
        registry.get("drafter", config.speculative.method)
        raise ValueError("speculative.method: speculative decoding is not wired into this build's engine yet")

    try:
        hf_config = AutoConfig.from_pretrained(config.model.model, local_files_only=True)
    except Exception as e:
        raise ValueError(f"model: cannot read a Hugging Face config from {config.model.model!r}: {e}") from None
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    try:
        model_spec = registry.get("model", arch)
    except ValueError as e:
        raise ValueError(f"model: architecture {arch!r} is not supported ({e})") from None

    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, hf_config)
    max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
    max_model_len = config.model.max_model_len or max_pos
    if max_model_len > max_pos:
        raise ValueError(f"model.max_model_len {max_model_len} exceeds the model's max_position_embeddings {max_pos}")
    if config.scheduler.max_num_batched_tokens is None:
        config.scheduler.max_num_batched_tokens = max(2048, max_model_len)

    hf_quant = getattr(hf_config, "quantization_config", None)
    if hf_quant is not None and not isinstance(hf_quant, dict):
        hf_quant = hf_quant.to_dict()
    qname = config.quantization.method
    if qname == "auto":
        qname = (hf_quant or {}).get("quant_method", "unquantized")
    quant_spec = registry.get("quantizer", qname)
    quant_settings = validate_plugin_settings(quant_spec, config.quantization.settings, "quantization.settings")
    quant_config: QuantizationConfig = quant_spec.factory(hf_quant, quant_settings)
    reasons = quant_config.validate(dtype, device)
    if reasons:
        raise ValueError(f"quantization.method {qname!r} cannot run here: {'; '.join(reasons)}")

    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    req = AttentionRequirements(dtype, head_dim, num_heads, num_kv_heads, config.cache.block_size, dtype,
                                getattr(hf_config, "sliding_window", None))
    attn_spec, rejected = choose_attention(registry, config.attention.backend, req, device)
    attn_settings = validate_plugin_settings(attn_spec, config.attention.settings, "attention.settings")
    backend: AttentionBackend = attn_spec.factory(attn_settings)
    if rejected:
        log.info("attention auto: chose %s; rejected %s", attn_spec.name, rejected)

    from kvforge.engine.weights import load_weights
    torch.manual_seed(config.model.seed)
    with torch.device(device):
        model: Model = model_spec.factory(hf_config, ModelContext(dtype, device, backend, quant_config))
    model.eval()
    load_weights(model, config.model.model, config.model.load_format, config.model.seed)

    block_bytes = _kv_block_bytes(hf_config, head_dim, num_kv_heads, config.cache.block_size, dtype)
    num_blocks = _num_blocks(config, device, block_bytes, max_model_len)
    allocator: KVAllocator = alloc_spec.factory(num_blocks, config.cache.block_size, alloc_settings, config.cache)
    shape = backend.kv_cache_shape(num_blocks, config.cache.block_size, num_kv_heads, head_dim)
    kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(hf_config.num_hidden_layers)]
    num_cpu_blocks = config.cache.swap_space_bytes // block_bytes
    cpu_caches = [torch.zeros(backend.kv_cache_shape(num_cpu_blocks, config.cache.block_size, num_kv_heads, head_dim),
                              dtype=dtype, device="cpu", pin_memory=device.type == "cuda")
                  for _ in range(hf_config.num_hidden_layers)] if num_cpu_blocks else []
    scheduler: Scheduler = sched_spec.factory(config.scheduler, allocator, sched_settings,
                                              SchedulerContext(max_model_len, num_cpu_blocks))
    choices = {"model": arch, "scheduler": sched_spec.name, "kv_allocator": alloc_spec.name,
               "attention": attn_spec.name, "quantizer": quant_spec.name}
    log.info("kvforge engine: %s on %s %s, %d KV blocks of %d tokens", choices, device, dtype, num_blocks,
             config.cache.block_size)
    return EngineParts(config, hf_config, device, dtype, model, backend, allocator, scheduler, kv_caches,
                       cpu_caches, max_model_len, choices)
