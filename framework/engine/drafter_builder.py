"""Building a drafter (speculative decoding) with the engine's own model-building code.

A draft-model plugin gets, through :class:`~kvforge.interfaces.DrafterContext`, a
``build_model`` and a ``build_runner`` that make its model, KV allocator, KV tensors,
runner and CUDA graphs exactly as :mod:`kvforge.engine.builder` makes the target's.
"""
from __future__ import annotations

import logging
from typing import Any

from kvforge.config import EngineConfig
from kvforge.engine.builder import ModelStack, build_model_stack, load_hf_config
from kvforge.engine.resolve import _DTYPES, validate_plugin_settings
from kvforge.plugin_manager import PluginSpec, Registry, build_plugin

log = logging.getLogger("kvforge")


def build_drafter(config: EngineConfig, registry: Registry, spec: PluginSpec, settings: Any,
                  target: ModelStack, max_model_len: int) -> Any:
    """Build a drafter (``speculative.method``, or one of ``request_choices.drafters``)
    through its factory ``factory(speculative_config, settings, ctx: DrafterContext)``.

    ``ctx.build_model`` / ``ctx.build_runner`` give a draft model plugin its own model,
    KV allocator (``cache.allocator``, prefix caching off), KV tensors and runner, built
    by the same code as the target's.
    """
    from kvforge.interfaces import DrafterContext

    def build_model(model_dir: str, dtype: str = "auto", num_layers: int | None = None,
                    share_weights: bool = False) -> ModelStack:
        hf = load_hf_config(model_dir, "speculative.settings.model")
        arch = (getattr(hf, "architectures", None) or ["?"])[0]
        try:
            model_spec = registry.get("model", arch)
        except ValueError as e:
            raise ValueError(f"speculative.settings.model: architecture {arch!r} is not supported ({e})") from None
        if hf.vocab_size != target.hf_config.vocab_size:
            raise ValueError(f"speculative.settings.model: the draft's vocab_size {hf.vocab_size} differs from "
                             f"the target's {target.hf_config.vocab_size}; a draft must share the tokenizer")
        dt = target.dtype if dtype == "auto" else _DTYPES[dtype]
        return build_model_stack(registry, hf, model_spec, model_dir, dtype=dt, device=target.device,
                                 block_size=config.cache.block_size, attention=config.attention,
                                 quant_method="auto", quant_settings={}, load_format=config.model.load_format,
                                 seed=config.model.seed, num_layers=num_layers,
                                 share_from=target.model if share_weights else None)

    def build_runner(stack: ModelStack, num_blocks: int):
        from kvforge.engine.model_runner import ModelRunner
        alloc_spec = registry.get("kv_allocator", config.cache.allocator)
        alloc_settings = validate_plugin_settings(alloc_spec, config.cache.settings, "cache.settings")
        cache_cfg = config.cache.model_copy(update={"enable_prefix_caching": False})
        allocator = build_plugin(alloc_spec, num_blocks, config.cache.block_size, alloc_settings, cache_cfg)
        graphs = (stack.device.type == "cuda" and not getattr(config.model, "enforce_eager", False)
                  and bool(stack.attn_spec.capabilities.get("cuda_graphs")))
        # With CUDA graphs, one extra block past the allocator's range is the padded rows' scratch block.
        kv_caches = stack.kv_caches(num_blocks + int(graphs), config.cache.block_size)
        runner = ModelRunner(stack.model, stack.backend, allocator, kv_caches, stack.device)
        if graphs:  # the draft's k - 1 single-token steps are pure decodes: replay graphs
            from kvforge.engine.cuda_graphs import CudaGraphRunner, decode_capture
            # Its first forward per proposal feeds the last accepted tokens (up to k + 1 per
            # request): a mixed step, captured too where the backend allows (run eagerly, an 8B
            # self-draft measured 8.7-9.0 ms TPOT at batch 1 on the H200; captured, 5.8 ms).
            mixed = 0
            if stack.attn_spec.capabilities.get("mixed_cuda_graphs"):
                mixed = min(config.scheduler.max_num_batched_tokens,
                            config.scheduler.max_num_seqs * (1 + config.speculative.num_speculative_tokens))
            try:
                max_batch, sizes = decode_capture(config)
                runner.graphs = CudaGraphRunner(stack.model, stack.backend, kv_caches, max_batch, max_model_len,
                                                config.cache.block_size, scratch_block=num_blocks,
                                                device=stack.device, max_mixed_tokens=mixed, buckets=sizes)
                runner.graphs.capture()
            except Exception:  # a draft without graphs is slower, never wrong
                log.exception("draft model: CUDA graph capture failed; its decode steps run eagerly")
                runner.graphs = None
        return allocator, runner

    ctx = DrafterContext(
        target_model=target.model, target_hf_config=target.hf_config, target_model_dir=config.model.model,
        device=target.device, dtype=target.dtype, vocab_size=target.hf_config.vocab_size,
        max_model_len=max_model_len, max_num_seqs=config.scheduler.max_num_seqs,
        block_size=config.cache.block_size, max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        seed=config.model.seed, load_format=config.model.load_format,
        build_model=build_model, build_runner=build_runner)
    drafter = build_plugin(spec, config.speculative, settings, ctx)
    drafter.num_speculative_tokens = config.speculative.num_speculative_tokens
    return drafter
