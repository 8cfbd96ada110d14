"""Executors: where the model runs.

The engine (scheduler, KV allocator, sampler) always lives in the caller's process and
talks to ``executor.runner``, which has the :class:`~kvforge.engine.model_runner.ModelRunner`
surface the step loop uses (``execute(scheduler_output) -> ExecuteOutput`` and
``swap(pairs, to_cpu)``):

* :class:`UniProcExecutor` — one rank: the model, KV caches (and CUDA graphs) in this
  process; ``runner`` is the real ``ModelRunner``.
* ``MultiprocExecutor`` (:mod:`kvforge.distributed.mp`) — one worker process per rank on
  this node; ``runner`` is a proxy that sends each step to the workers.
* ``RayExecutor`` (:mod:`kvforge.distributed.ray_executor`) — one Ray actor per rank, in a
  placement group (any number of nodes).

The distributed executors are built by ``build_engine_parts`` when
``tensor_parallel_size * pipeline_parallel_size > 1`` (the workers must exist before the
KV cache can be sized) and handed over in ``EngineParts.executor``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Executor(ABC):
    """Runs the model for an engine.

    Attributes:
        runner: has ``execute(SchedulerOutput) -> ExecuteOutput`` and ``swap(pairs, to_cpu)``.
    """

    runner: Any

    def execute_model(self, scheduler_output) -> Any:
        """One forward over the step's scheduled tokens (see ``ModelRunner.execute``)."""
        return self.runner.execute(scheduler_output)

    def check_health(self) -> None:
        """Raise if the executor cannot run another step (e.g. a worker died)."""

    def start_profile(self, out_dir: str) -> None:
        """Start torch.profiler in every process of the model (the workers, if any);
        the driver's own profiler is the engine's (:meth:`LLMEngine.start_profile`)."""

    def stop_profile(self) -> list[str]:
        """Stop the workers' profilers; returns the trace files written."""
        return []

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and devices (idempotent)."""


class UniProcExecutor(Executor):
    """The model in this process (``tensor_parallel_size * pipeline_parallel_size == 1``)."""

    def __init__(self, parts) -> None:
        from kvforge.engine.model_runner import ModelRunner
        cfg = parts.config
        self.runner = ModelRunner(parts.model, parts.backend, parts.allocator, parts.kv_caches, parts.device,
                                  parts.cpu_caches)
        if parts.device.type == "cuda":  # compile every prefill/extend kernel variant now, not mid-serving
            from kvforge.engine.warmup import warm_up
            warm_up(self.runner, cfg.scheduler.max_num_batched_tokens, parts.max_model_len,
                    scratch_block=parts.allocator.num_blocks,
                    max_sample_rows=cfg.scheduler.max_num_seqs * (1 + cfg.speculative.num_speculative_tokens))
        if parts.use_cuda_graphs:
            from kvforge.engine.cuda_graphs import CudaGraphRunner, decode_capture
            max_batch, sizes = decode_capture(cfg)
            self.runner.graphs = CudaGraphRunner(
                parts.model, parts.backend, parts.kv_caches, max_batch,
                parts.max_model_len, cfg.cache.block_size, scratch_block=parts.allocator.num_blocks,
                device=parts.device, buckets=sizes,
                max_mixed_tokens=cfg.scheduler.max_num_batched_tokens
                if parts.attn_capabilities.get("mixed_cuda_graphs") else 0)
            self.runner.graphs.capture()
        if cfg.cache.calculate_kv_scales:  # after the warm-up and capture forwards, which see no real K/V
            self.runner.arm_kv_scale_calibration()

    def shutdown(self) -> None:
        pass


def create_executor(parts) -> Executor:
    """The executor ``build_engine_parts`` made (workers), or an in-process one."""
    executor = getattr(parts, "executor", None)
    return executor if executor is not None else UniProcExecutor(parts)


def create_engine(config, registry=None):
    """An engine for ``config``: an :class:`~kvforge.engine.llm_engine.LLMEngine`, or with
    ``parallel.data_parallel_size > 1`` a :class:`~kvforge.distributed.data_parallel.DataParallelEngine`
    (same API; each replica builds its own plugins from entry points, so ``registry`` is
    used only by a single engine)."""
    if config.parallel.data_parallel_size > 1:
        from kvforge.distributed.data_parallel import DataParallelEngine
        return DataParallelEngine(config)
    from kvforge.engine.llm_engine import LLMEngine
    return LLMEngine(config, registry)
