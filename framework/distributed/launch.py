"""Engine build for a replica of several ranks: start the workers (they build the model
shards), size the KV cache from what fits on every rank, then build the driver's
allocator and scheduler. Called by ``build_engine_parts`` when
``tensor_parallel_size * pipeline_parallel_size > 1``.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("kvforge.distributed")

#: Seconds allowed for loading the model and capturing CUDA graphs on the workers.
INIT_TIMEOUT_S = 1800.0


def make_executor(config, max_model_len: int, device: torch.device):
    """The executor ``parallel.distributed_executor_backend`` names (default ``mp``)."""
    backend = config.parallel.distributed_executor_backend or "mp"
    if backend == "ray":
        from kvforge.distributed.ray_executor import RayExecutor
        return RayExecutor(config, max_model_len, device)
    from kvforge.distributed.mp import MultiprocExecutor
    return MultiprocExecutor(config, max_model_len, device)


def check_tensor_parallel_shapes(hf_config, tp: int) -> None:
    """Refuse a tensor_parallel_size the model's shapes cannot be cut by (the layers would
    fail anyway, but only inside freshly started workers).

    Raises:
        ValueError: naming ``parallel.tensor_parallel_size`` and the dimension.
    """
    if tp <= 1:
        return
    heads = getattr(hf_config, "num_attention_heads", None)
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    checks = [("num_attention_heads", heads)]
    if not (getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)):
        checks.append(("intermediate_size", getattr(hf_config, "intermediate_size", None)))  # dense MLP is cut
    for name, value in checks:
        if value and value % tp:
            raise ValueError(f"parallel.tensor_parallel_size: {tp} does not divide the model's {name} ({value})")
    if kv and (kv % tp if kv >= tp else tp % kv):
        raise ValueError(f"parallel.tensor_parallel_size: {tp} and the model's {kv} KV heads: one must divide the other")


def build_parallel_parts(config, registry, hf_config, arch: str, device: torch.device, dtype: torch.dtype,
                         max_model_len: int, sched_spec, sched_settings: Any, alloc_spec, alloc_settings: Any):
    """:class:`~kvforge.engine.builder.EngineParts` whose model lives on the workers
    (``model``/``backend`` None, no KV tensors here; ``executor`` set).

    Raises:
        ValueError: bad parallel sizes for this model, or a worker's build error.
        kvforge.distributed.executor_base.WorkerError: a worker failed or died while loading.
    """
    from kvforge.engine.builder import EngineParts
    from kvforge.interfaces import SchedulerContext
    from kvforge.plugin_manager import build_plugin

    par = config.parallel
    if par.pipeline_parallel_size > hf_config.num_hidden_layers:
        raise ValueError(f"parallel.pipeline_parallel_size {par.pipeline_parallel_size} exceeds the model's "
                         f"{hf_config.num_hidden_layers} layers")
    check_tensor_parallel_shapes(hf_config, par.tensor_parallel_size)  # before any worker starts
    executor = make_executor(config, max_model_len, device)
    try:
        infos = executor.load_model(timeout=INIT_TIMEOUT_S)
        num_blocks = config.cache.num_gpu_blocks or min(i["num_blocks"] for i in infos)
        from kvforge.engine.sizing import fit_max_model_len
        max_model_len = fit_max_model_len(config, max_model_len, num_blocks, device)
        block_bytes = max(i["block_bytes"] for i in infos)
        num_cpu_blocks = config.cache.swap_space_bytes // max(block_bytes, 1)
        allocator = build_plugin(alloc_spec, num_blocks, config.cache.block_size, alloc_settings, config.cache)
        executor.init_cache(allocator, num_blocks, num_cpu_blocks, timeout=INIT_TIMEOUT_S)
        # (inside the try: a scheduler factory that raises must not leave the workers running)
        scheduler = build_plugin(sched_spec, config.scheduler, allocator, sched_settings,
                                 SchedulerContext(max_model_len, num_cpu_blocks))
    except BaseException:
        executor.shutdown()
        raise
    choices = {"model": arch, "scheduler": sched_spec.name, "kv_allocator": alloc_spec.name,
               **infos[0]["choices"], "executor": par.distributed_executor_backend or "mp",
               "parallel": f"tp={par.tensor_parallel_size} pp={par.pipeline_parallel_size}"
                           + (" ep" if par.enable_expert_parallel else "")}
    log.info("kvforge engine: %s on %d ranks (%s), %d KV blocks of %d tokens", choices, par.world_size,
             infos[0]["device"], num_blocks, config.cache.block_size)
    parts = EngineParts(config, hf_config, device, dtype, None, None, allocator, scheduler, [], [], max_model_len,
                        choices, False, drafters={})
    parts.executor = executor
    return parts
