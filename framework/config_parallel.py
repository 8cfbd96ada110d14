"""The ``parallel`` section of the engine config (:mod:`kvforge.config`)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kvforge.config_base import _Section


class ParallelConfig(_Section):
    """Distributed inference (docs/distributed.md).

    One engine replica runs on ``tensor_parallel_size * pipeline_parallel_size`` ranks
    (its world); ``data_parallel_size`` replicas run side by side behind one front end.
    ``distributed_executor_backend``: ``mp`` (one worker process per rank, one node) or
    ``ray`` (actors in a placement group per replica, any number of nodes); None picks
    ``mp``. With ``enable_expert_parallel`` the MoE experts are split across the
    tensor-parallel ranks (whole experts per rank, tokens routed with all-to-all)
    instead of splitting every expert's intermediate dimension.
    """

    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    data_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: Literal["mp", "ray"] | None = None
    enable_expert_parallel: bool = Field(False, description="Shard MoE experts across the tensor-parallel ranks.")
    pipeline_micro_batches: int | None = Field(
        None, ge=1, description="Micro-batches a step is split into across pipeline stages (default: "
                                "pipeline_parallel_size).")
    worker_timeout_s: float = Field(
        300.0, gt=0, description="Seconds one step (or one collective) may take before the workers are "
                                 "declared hung and the engine fails.")
    ray_address: str | None = Field(None, description="Ray cluster to join (default: RAY_ADDRESS, a running "
                                                      "local cluster, or a new local one).")
    all_reduce: Literal["auto", "nccl", "symm_mem"] = Field(
        "nccl", description="Tensor-parallel all-reduces of at most 1 MiB on CUDA: 'symm_mem' through torch's "
                            "symmetric memory (NVLink peer reads; 1.6-1.8x faster than NCCL at decode sizes on "
                            "two H200s, measured alone), 'auto' symm_mem when it initialises, else NCCL; "
                            "'nccl' (default until measured inside the engine) always NCCL.")
    sample_on_worker: bool | None = Field(
        None, description="With the mp executor, async scheduling and one pipeline stage, sample on the output "
                          "worker and keep the sampled tokens on the GPUs for the next step (the driver gets token "
                          "ids, not logits); steps with penalties or prompt logprobs still sample on the driver. "
                          "None: on for CUDA.")

    @property
    def world_size(self) -> int:
        """Ranks of one replica (tensor x pipeline)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @model_validator(mode="after")
    def _check_used(self) -> "ParallelConfig":
        # a setting that the layout makes a no-op is refused: the operator meant something else
        if self.ray_address is not None and self.distributed_executor_backend != "ray":
            raise ValueError("ray_address: only used with distributed_executor_backend 'ray' (set that too, or "
                             "drop ray_address)")
        if self.pipeline_micro_batches is not None and self.pipeline_parallel_size == 1:
            raise ValueError("pipeline_micro_batches: only used with pipeline_parallel_size > 1")
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("enable_expert_parallel: needs tensor_parallel_size > 1 (the experts are split "
                             "across the tensor-parallel ranks)")
        return self
