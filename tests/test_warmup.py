"""Start-up warm-up forwards (kvforge.engine.warmup): every shape is legal and only the
scratch KV block is written."""
from __future__ import annotations

import os.path

import pytest
import torch

from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.warmup import warm_up, warmup_shapes

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "stories260K")


@pytest.mark.parametrize("budget,max_len", [(2048, 512), (64, 512), (8192, 8192), (40, 128), (3, 64)])
def test_shapes_fit_the_budget_and_the_model_length(budget, max_len):
    shapes = warmup_shapes(budget, max_len)
    assert shapes
    for q, c in shapes:
        assert len(q) == len(c) and sum(q) <= min(budget, max_len)
        assert all(qi >= 1 and ci >= 0 and qi + ci <= max_len for qi, ci in zip(q, c))
    if budget >= 64:
        assert any(sum(q) % 16 for q, _ in shapes) and any(sum(q) % 16 == 0 for q, _ in shapes)


def test_warm_up_writes_only_the_scratch_block():
    engine = LLMEngine.from_kwargs(MODEL, dtype="float32", num_gpu_blocks=20)
    runner = engine.runner
    for cache in runner.kv_caches:
        cache.normal_()
    dim = runner.backend.block_dim
    scratch = engine.allocator.num_blocks
    before = [c.clone() for c in runner.kv_caches]
    warm_up(runner, engine.config.scheduler.max_num_batched_tokens, engine.max_model_len, scratch,
            max_sample_rows=engine.config.scheduler.max_num_seqs)
    changed = False
    for old, new in zip(before, runner.kv_caches):
        keep = torch.arange(scratch, device=old.device)
        assert torch.equal(old.index_select(dim, keep), new.index_select(dim, keep)), "a request block was written"
        changed |= not torch.equal(old, new)
    assert changed, "the warm-up wrote nothing (did it run the model?)"
