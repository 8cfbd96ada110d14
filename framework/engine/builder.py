"""Engine construction: run the plugin hooks once, validate plugin settings, pick
backends, build the model, size (``sizing.py``) and allocate the KV cache."""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.config import EngineConfig
from kvforge.engine.capabilities import check_capabilities
from kvforge.engine.resolve import (checkpoint_quant_config, choose_attention, resolve_device, resolve_dtype,
                                    resolve_quant_method, validate_plugin_settings)
from kvforge.engine.sizing import (default_max_num_batched_tokens, default_max_num_seqs, fit_max_model_len, format_bytes,
                                   kv_block_bytes, model_weight_bytes, num_kv_blocks)
from kvforge.interfaces import (AttentionBackend, AttentionRequirements, KVAllocator, Model, ModelContext,
                                QuantizationConfig, Scheduler, SchedulerContext)
from kvforge.layers.kv_cache_dtype import is_fp8, resolve_kv_cache_dtype, warn_default_kv_scales
from kvforge.plugin_manager import PluginSpec, Registry, build_plugin

log = logging.getLogger("kvforge")


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
    use_cuda_graphs: bool = False
    drafters: Any = None  # name -> kvforge.interfaces.Drafter (speculative.method, request_choices.drafters)
    attn_capabilities: dict = field(default_factory=dict)  # the attention plugin's declared capabilities
    weight_bytes: int = 0  # the loaded weights (sizing.model_weight_bytes); 0 when workers hold them


def load_hf_config(path: str, field: str = "model.model"):
    """The Hugging Face config of the checkpoint folder ``path`` (``field``: the config field that
    named it, for errors).

    Raises:
        ValueError: naming ``field`` when ``path`` is not a folder or holds no readable config.json.
    """
    import os

    from transformers import AutoConfig
    if not os.path.isdir(path):
        raise ValueError(f"{field}: {path!r} is not a directory (a Hugging Face-layout "
                         "checkpoint folder with config.json is expected)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{field}: no config.json in {path!r} (a Hugging Face-layout checkpoint folder is "
                         "expected)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ValueError(f"{field}: cannot read a Hugging Face config from {path!r}: {e}{_config_hint(path)}") from None


def _config_hint(path: str) -> str:
    """Why transformers could not read ``path``/config.json, where a field's type explains it
    (a ``quantization_config`` that is not an object fails deep inside transformers)."""
    import json
    import os
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return ""
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is not None and not isinstance(qc, dict):
        return f" (config.json quantization_config: expected an object, got {type(qc).__name__} {qc!r:.60})"
    return ""


@dataclass
class ModelStack:
    """A model with the attention backend and quantizer it was built with, and its KV geometry."""

    hf_config: Any
    model: Model
    backend: AttentionBackend
    attn_spec: PluginSpec
    quant_spec: PluginSpec
    dtype: torch.dtype
    device: torch.device
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype  # what the KV cache stores (cache.kv_cache_dtype resolved)

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes of K and V cache of all layers for one block of ``block_size`` tokens."""
        return kv_block_bytes(self.hf_config, self.head_dim, self.num_kv_heads, block_size, self.kv_dtype)

    def kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One zeroed cache tensor per layer, in the backend's layout."""
        shape = self.backend.kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                for _ in range(self.hf_config.num_hidden_layers)]


def _truncate_layers(hf_config, num_layers: int):
    """A copy of ``hf_config`` keeping only the first ``num_layers`` decoder layers."""
    import copy
    total = hf_config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers: must be in [1, {total}] (the model's layers), got {num_layers}")
    cfg = copy.deepcopy(hf_config)
    cfg.num_hidden_layers = num_layers
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:num_layers]
    return cfg


def _share_parameters(model: torch.nn.Module, source: torch.nn.Module) -> None:
    """Make every parameter of ``model`` the same tensor as ``source``'s parameter of the same name.

    Raises:
        ValueError: a parameter is missing from ``source`` or differs in shape or dtype.
    """
    theirs = dict(source.named_parameters())
    for name, mine in list(model.named_parameters()):
        other = theirs.get(name)
        if other is None or other.shape != mine.shape or other.dtype != mine.dtype:
            raise ValueError(f"cannot share weight {name!r} with the target model (missing or different "
                             "shape/dtype); set share_weights false")
        owner_path, _, pname = name.rpartition(".")
        setattr(model.get_submodule(owner_path) if owner_path else model, pname, other)


@contextlib.contextmanager
def _quiet():
    """No log record at WARNING or below in this process meanwhile (errors still raise; a level
    disabled already stays disabled)."""
    before = logging.root.manager.disable
    logging.disable(max(before, logging.WARNING))
    try:
        yield
    finally:
        logging.disable(before)


def build_quant_config(registry: Registry, hf_config, quant_method: str, quant_settings, dtype: torch.dtype,
                       device: torch.device, repeat: bool = False) -> tuple[PluginSpec, QuantizationConfig]:
    """(spec, config) of the quantizer a model is built with (``quant_method`` "auto": the checkpoint's
    ``quantization_config.quant_method``, else unquantized), checked against the checkpoint,
    ``dtype`` and ``device``; reads no weights. ``repeat``: the driver built this same config
    already and logged what its construction warns of (a tensor / pipeline parallel worker), so
    the construction logs nothing at WARNING or below; ``validate`` on this rank's device still does.

    Raises:
        ValueError: an unknown method, bad settings, a checkpoint of another format, or a
            quantizer that cannot run here (its ``validate`` reasons).
        PluginError: a factory that cannot be called as its hook spec says (see ``build_plugin``).
    """
    hf_quant = checkpoint_quant_config(hf_config)
    qname = resolve_quant_method(quant_method, hf_quant)
    quant_spec = registry.get("quantizer", qname)
    quant_settings = validate_plugin_settings(quant_spec, quant_settings, "quantization.settings")
    with _quiet() if repeat else contextlib.nullcontext():
        quant_config: QuantizationConfig = build_plugin(quant_spec, hf_quant, quant_settings)
    reasons = quant_config.validate(dtype, device)
    if reasons:
        raise ValueError(f"quantization.method {qname!r} cannot run here: {'; '.join(reasons)}")
    return quant_spec, quant_config


def build_model_stack(registry: Registry, hf_config, model_spec: PluginSpec, model_dir: str, *,
                      dtype: torch.dtype, device: torch.device, block_size: int, attention,
                      quant_method: str, quant_settings: dict[str, Any], load_format: str, seed: int,
                      kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False,
                      num_layers: int | None = None, share_from: Model | None = None,
                      quant_config_checked: bool = False) -> ModelStack:
    """Pick the quantizer and attention backend for ``hf_config``, build the model on
    ``device`` and fill its weights (used for the target and for draft models).

    Args:
        attention: the :class:`~kvforge.config.AttentionConfig` section (backend name or ``auto``).
        quant_method: a quantizer name or ``auto`` (the checkpoint's ``quantization_config``).
        kv_cache_dtype: ``cache.kv_cache_dtype`` (``auto``: the model's dtype, or an FP8 name).
        calculate_kv_scales: the scales will come from the first step (no warning about 1.0).
        num_layers: keep only the first N decoder layers (a truncated draft); checkpoint
            tensors of later layers are skipped.
        share_from: reuse this model's parameters by name instead of loading weights.
        quant_config_checked: the driver already built this quantizer config and logged its
            construction's warnings (tensor / pipeline parallel workers): its rebuild here logs
            none at WARNING or below, so each prints once, not once per rank
            (``build_quant_config``'s ``repeat``).

    Raises:
        ValueError: unknown or unusable quantizer/backend, bad settings, bad checkpoint.
        PluginError: a quantizer, attention or model factory that cannot be called with its hook
            spec's arguments or returns no instance of its interface (naming the plugin).
    """
    if num_layers is not None:
        hf_config = _truncate_layers(hf_config, num_layers)
    quant_spec, quant_config = build_quant_config(registry, hf_config, quant_method, quant_settings, dtype, device,
                                                  repeat=quant_config_checked)

    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype)
    req = AttentionRequirements(dtype, head_dim, num_heads, num_kv_heads, block_size, kv_dtype,
                                getattr(hf_config, "sliding_window", None))
    attn_spec, rejected = choose_attention(registry, attention.backend, req, device, attention.settings)
    attn_settings = validate_plugin_settings(attn_spec, attention.settings, "attention.settings")
    backend: AttentionBackend = build_plugin(attn_spec, attn_settings)
    if rejected:
        log.info("attention auto: chose %s; rejected %s", attn_spec.name, rejected)

    from kvforge.engine.weights import iter_safetensors, load_weights
    torch.manual_seed(seed)
    with torch.device(device):
        model: Model = build_plugin(model_spec, hf_config, ModelContext(dtype, device, backend, quant_config))
    model.eval()
    if share_from is not None:
        _share_parameters(model, share_from)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the unshared copies are gone; let the KV budget see that memory
    elif num_layers is not None and load_format != "dummy":
        keep = num_layers

        def layer_of(name: str) -> int | None:
            parts = name.split(".")
            for i, p in enumerate(parts[:-1]):
                if p == "layers" and parts[i + 1].isdigit():
                    return int(parts[i + 1])
            return None

        weights = ((n, t) for n, t in iter_safetensors(model_dir) if (layer_of(n) or 0) < keep)
        loaded = model.load_weights(weights)
        missing = sorted(model.expected_weights() - loaded) if hasattr(model, "expected_weights") else []
        if missing:
            raise ValueError(f"checkpoint {model_dir} is missing tensors for: {', '.join(missing[:8])}")
        for m in model.modules():
            if hasattr(m, "method"):
                m.method.process_weights_after_loading(m)
    else:
        load_weights(model, model_dir, load_format, seed)
    if is_fp8(kv_dtype) and not calculate_kv_scales:
        warn_default_kv_scales(model, kv_cache_dtype)
    return ModelStack(hf_config, model, backend, attn_spec, quant_spec, dtype, device, num_kv_heads, head_dim,
                      kv_dtype)


def build_engine_parts(config: EngineConfig, registry: Registry) -> EngineParts:
    """Build every engine component from ``config`` (hooks already ran into ``registry``).

    Raises:
        ValueError: unknown plugin names (listing the registered ones), bad plugin
            settings, an unsupported model, or a backend that cannot run here.
        PluginError: a plugin factory (quantizer, attention, model, KV allocator, scheduler)
            that cannot be called with its hook spec's arguments or returns no instance of its
            interface in ``kvforge.interfaces``; the message names the plugin, its distribution,
            the kind and what was expected.
    """
    # Names and settings first: a typo fails before any weight is read.
    sched_spec = registry.get("scheduler", config.scheduler.name)
    alloc_spec = registry.get("kv_allocator", config.cache.allocator)
    sched_settings = validate_plugin_settings(sched_spec, config.scheduler.settings, "scheduler.settings")
    alloc_settings = validate_plugin_settings(alloc_spec, config.cache.settings, "cache.settings")
    # Drafters: speculative.method (with its settings) and those a request may choose
    # (request_choices.drafters, default settings); all share num_speculative_tokens.
    drafter_specs: dict[str, tuple[PluginSpec, Any]] = {}
    if config.speculative.method is not None:
        spec = registry.get("drafter", config.speculative.method)
        drafter_specs[spec.name] = (spec, validate_plugin_settings(spec, config.speculative.settings,
                                                                   "speculative.settings"))
    for name in getattr(getattr(config, "request_choices", None), "drafters", None) or ():
        if name != "none" and name not in drafter_specs:
            spec = registry.get("drafter", name)
            drafter_specs[name] = (spec, validate_plugin_settings(spec, {}, f"request_choices.drafters ({name})"))
    if drafter_specs and config.speculative.num_speculative_tokens < 1:
        raise ValueError("speculative.num_speculative_tokens: must be >= 1 when a drafter is configured "
                         "(speculative.method or request_choices.drafters)")

    hf_config = load_hf_config(config.model.model)
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
        config.scheduler.max_num_batched_tokens = default_max_num_batched_tokens(max_model_len)
    if config.scheduler.max_num_seqs is None:
        config.scheduler.max_num_seqs = default_max_num_seqs(device)

    check_capabilities(config, registry, hf_config, dtype, device)  # before any weight is read
    if config.scheduler.async_scheduling is None:
        config.scheduler.async_scheduling = device.type == "cuda"
    if config.parallel.all_reduce == "symm_mem" and device.type != "cuda":
        raise ValueError(f"parallel.all_reduce: 'symm_mem' needs CUDA GPUs (model.device resolves to "
                         f"{device.type}); use 'nccl' or 'auto'")
    from kvforge.distributed.symm_mem_allreduce import DTYPES as SYMM_MEM_DTYPES
    if config.parallel.all_reduce == "symm_mem" and dtype not in SYMM_MEM_DTYPES:
        raise ValueError(f"parallel.all_reduce: 'symm_mem' needs bfloat16 or float32 activations (model.dtype "
                         f"resolves to {dtype}); use 'nccl' or 'auto'")
    if config.parallel.data_parallel_size > 1:
        raise ValueError("parallel.data_parallel_size > 1 runs several engines: build it with "
                         "kvforge.engine.executor.create_engine (as LLM and `kvforge serve` do)")
    if config.parallel.world_size > 1:  # several ranks: the workers build the model (kvforge.distributed)
        if drafter_specs:
            raise ValueError("speculative decoding (speculative.method, request_choices.drafters) runs on a "
                             "single rank only; set tensor/pipeline_parallel_size to 1 to use it")
        # the quantizer's config checks (bits, group size, format, method against the checkpoint)
        # read no weights: run them here, so a bad config fails before any worker starts
        build_quant_config(registry, hf_config, config.quantization.method, config.quantization.settings, dtype,
                           device)
        from kvforge.distributed.launch import build_parallel_parts
        return build_parallel_parts(config, registry, hf_config, arch, device, dtype, max_model_len,
                                    sched_spec, sched_settings, alloc_spec, alloc_settings)
    stack = build_model_stack(registry, hf_config, model_spec, config.model.model, dtype=dtype, device=device,
                              block_size=config.cache.block_size, attention=config.attention,
                              quant_method=config.quantization.method,
                              quant_settings=config.quantization.settings,
                              load_format=config.model.load_format, seed=config.model.seed,
                              kv_cache_dtype=config.cache.kv_cache_dtype,
                              calculate_kv_scales=config.cache.calculate_kv_scales)
    model, backend, attn_spec, quant_spec = stack.model, stack.backend, stack.attn_spec, stack.quant_spec
    num_kv_heads, head_dim = stack.num_kv_heads, stack.head_dim
    from kvforge.engine.drafter_builder import build_drafter
    drafters = {name: build_drafter(config, registry, spec, settings, stack, max_model_len)
                for name, (spec, settings) in drafter_specs.items()}

    block_bytes = stack.kv_block_bytes(config.cache.block_size)
    draft_block_bytes = sum(d.kv_cache_block_bytes(config.cache.block_size) for d in drafters.values())
    num_blocks = num_kv_blocks(config, device, block_bytes + draft_block_bytes, max_model_len)
    max_model_len = fit_max_model_len(config, max_model_len, num_blocks, device, draft_block_bytes,
                                      block_bytes + draft_block_bytes)
    allocator: KVAllocator = build_plugin(alloc_spec, num_blocks, config.cache.block_size, alloc_settings,
                                          config.cache)
    # One extra block past the allocator's range: the scratch block padded CUDA-graph rows write to.
    shape = backend.kv_cache_shape(num_blocks + 1, config.cache.block_size, num_kv_heads, head_dim)
    kv_caches = [torch.zeros(shape, dtype=stack.kv_dtype, device=device) for _ in range(hf_config.num_hidden_layers)]
    num_cpu_blocks = config.cache.swap_space_bytes // block_bytes
    cpu_caches = [torch.zeros(backend.kv_cache_shape(num_cpu_blocks, config.cache.block_size, num_kv_heads, head_dim),
                              dtype=stack.kv_dtype, device="cpu", pin_memory=device.type == "cuda")
                  for _ in range(hf_config.num_hidden_layers)] if num_cpu_blocks else []
    scheduler: Scheduler = build_plugin(sched_spec, config.scheduler, allocator, sched_settings,
                                        SchedulerContext(max_model_len, num_cpu_blocks))
    for d in drafters.values():
        d.init_kv_cache(num_blocks)  # same block count: a draft never holds more tokens than the target
    use_graphs = (device.type == "cuda" and not config.model.enforce_eager
                  and bool(attn_spec.capabilities.get("cuda_graphs")))
    choices = {"model": arch, "scheduler": sched_spec.name, "kv_allocator": alloc_spec.name,
               "attention": attn_spec.name, "quantizer": quant_spec.name}
    if config.speculative.method is not None:
        choices["drafter"] = config.speculative.method
    weight_bytes = model_weight_bytes(model)
    log.info("kvforge engine: %s on %s %s, weights %s, %d KV blocks of %d tokens (%s)", choices, device, dtype,
             format_bytes(weight_bytes), num_blocks, config.cache.block_size, stack.kv_dtype)
    return EngineParts(config, hf_config, device, dtype, model, backend, allocator, scheduler, kv_caches,
                       cpu_caches, max_model_len, choices, use_graphs, drafters=drafters,
                       attn_capabilities=dict(attn_spec.capabilities), weight_bytes=weight_bytes)
