"""``scheduler.max_num_seqs`` left unset: the engine resolves it from the device (512 on a CUDA GPU
of >= 70 GiB, else 256), and the simulator from the engine its cost model was measured on."""
from __future__ import annotations

import random

import pytest
import torch

from helpers import STORIES_MODEL
from kvforge.bench.cost_model import CostModel
from kvforge.bench.sim import sim_scheduler_defaults
from kvforge.config import EngineConfig
from kvforge.engine import sizing

GIB = 2**30


@pytest.mark.parametrize("device,gib,want", [
    ("cuda", 141, 512), ("cuda", 80, 512), ("cuda", 70, 512),   # H200, H100 / A100 80GB
    ("cuda", 69.9, 256), ("cuda", 24, 256), ("cpu", 1024, 256),  # smaller GPUs; the CPU whatever its memory
])
def test_default_max_num_seqs_follows_the_device(monkeypatch, device, gib, want):
    monkeypatch.setattr(sizing, "device_memory_bytes", lambda d: int(gib * GIB))
    assert sizing.default_max_num_seqs(torch.device(device)) == want


def test_the_engine_resolves_an_unset_max_num_seqs_and_keeps_a_set_one():
    from kvforge.entrypoints.llm import LLM
    llm = LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=64)
    assert EngineConfig.from_sources(None, {"model": STORIES_MODEL}).scheduler.max_num_seqs is None
    assert llm.llm_engine.config.scheduler.max_num_seqs == 256  # this CPU
    assert llm.llm_engine.scheduler.max_num_seqs == 256
    n = random.randint(1, 300)
    assert LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=64,
               max_num_seqs=n).llm_engine.config.scheduler.max_num_seqs == n


def test_the_simulator_takes_max_num_seqs_from_the_cost_models_engine():
    seqs = random.randint(2, 1000)
    cost = CostModel({"const": 1e-3}, meta={"engine": {"max_num_seqs": seqs}})
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL})
    sim_scheduler_defaults(cfg, 512, cost)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (seqs, 2048)
    for cost in (CostModel({"const": 1e-3}), None):  # no engine facts: the builder's 256
        cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "max_num_batched_tokens": 100})
        sim_scheduler_defaults(cfg, 4096, cost)
        assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (256, 100)
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "max_num_seqs": 3})
    sim_scheduler_defaults(cfg, 4096, CostModel({"const": 1e-3}, meta={"engine": {"max_num_seqs": seqs}}))
    assert cfg.scheduler.max_num_seqs == 3 and cfg.scheduler.max_num_batched_tokens == 4096
