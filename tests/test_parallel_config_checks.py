"""Parallel settings that the layout would make no-ops are refused, naming the field: a Ray
address without the Ray executor, micro-batches without pipeline stages, expert parallelism
without tensor-parallel ranks or on a model with no expert layers (there it would only have
turned CUDA graphs off)."""
from __future__ import annotations

import pytest

from helpers import STORIES_MODEL
from kvforge import LLM
from kvforge.config import EngineConfig


@pytest.mark.parametrize("kw, field", [
    (dict(ray_address="auto"), "ray_address"),
    (dict(ray_address="auto", distributed_executor_backend="mp"), "ray_address"),
    (dict(pipeline_micro_batches=2), "pipeline_micro_batches"),
    (dict(pipeline_micro_batches=2, tensor_parallel_size=2), "pipeline_micro_batches"),
    (dict(enable_expert_parallel=True), "enable_expert_parallel"),
    (dict(enable_expert_parallel=True, pipeline_parallel_size=2), "enable_expert_parallel"),
])
def test_no_op_settings_are_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, **kw})
    with pytest.raises(ValueError, match=field):  # (the offline API's one-line form)
        LLM(model=STORIES_MODEL, **kw)


def test_used_settings_pass():
    for kw in (dict(ray_address="auto", distributed_executor_backend="ray"),
               dict(pipeline_micro_batches=3, pipeline_parallel_size=2),
               dict(enable_expert_parallel=True, tensor_parallel_size=2)):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, **kw})


def test_expert_parallel_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="enable_expert_parallel: model 'LlamaForCausalLM'.*no layer that splits"):
        LLM(model=STORIES_MODEL, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
            num_gpu_blocks=32)
