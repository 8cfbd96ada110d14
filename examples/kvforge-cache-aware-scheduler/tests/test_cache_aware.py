"""Behaviour of the cache_aware scheduler on the stories260K model (kvforge's test model;
set KVFORGE_TEST_MODEL to point elsewhere)."""
from __future__ import annotations

import random

import pytest

from kvforge import SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.testing import default_model_path

MODEL = default_model_path()
pytestmark = pytest.mark.skipif(MODEL is None, reason="set KVFORGE_TEST_MODEL to a model directory")
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def engine(**kw) -> LLMEngine:
    opts = {"model": MODEL, "dtype": "float32", "enable_prefix_caching": True, "num_gpu_blocks": 64}
    opts.update(kw)
    return LLMEngine(EngineConfig.from_sources(None, opts))


def drain(eng) -> list[str]:
    order = []
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step() if o.finished]
    return order


def test_registered_with_capabilities():
    from kvforge.plugin_manager import load_registry
    spec = load_registry().get("scheduler", "cache_aware")
    assert spec.distribution == "kvforge-cache-aware-scheduler"
    assert spec.capabilities["requires_prefix_caching"] is True


@pytest.mark.parametrize("scheduler, first", [("cache_aware", "warm"), ("fcfs", "cold")])
def test_cached_prefix_is_admitted_first(scheduler, first):
    rng = random.Random(0)
    shared = [1] + [rng.randrange(3, 512) for _ in range(47)]            # 3 blocks of 16
    eng = engine(scheduler=scheduler, max_num_seqs=1)
    eng.add_request("seed", {"prompt_token_ids": shared}, GREEDY)
    drain(eng)
    eng.add_request("cold", {"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(40)]}, GREEDY)
    eng.add_request("warm", {"prompt_token_ids": shared + [5, 6, 7]}, GREEDY)  # arrives second
    order = drain(eng)
    assert order[0] == first, order
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks


def test_probe_has_no_side_effects():
    from kvforge_cache_aware.peek import peek_computed_tokens
    from kvforge.engine.request import Request
    rng = random.Random(1)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    eng = engine(scheduler="cache_aware")
    eng.add_request("seed", {"prompt_token_ids": shared}, GREEDY)
    drain(eng)
    alloc = eng.allocator
    before = (dict(alloc.stats()), dict(alloc._pending_hits), dict(alloc._req_hashes))
    probe = Request("probe", shared + [9], GREEDY, 8)
    assert peek_computed_tokens(alloc, probe) == 32
    assert (dict(alloc.stats()), dict(alloc._pending_hits), dict(alloc._req_hashes)) == before
    assert alloc.get_computed_tokens(probe) == 32  # agrees with the allocator's own answer


@pytest.mark.parametrize("max_wait_steps, order", [(64, ["cold", "warm", "cold2"]), (1, ["cold", "cold2", "warm"])])
def test_overdue_request_goes_first(max_wait_steps, order):
    rng = random.Random(2)
    shared = [1] + [rng.randrange(3, 512) for _ in range(47)]
    eng = engine(scheduler="cache_aware", max_num_seqs=1, **{"scheduler.settings": {"max_wait_steps": max_wait_steps}})
    eng.add_request("seed", {"prompt_token_ids": shared}, GREEDY)
    drain(eng)
    eng.add_request("cold", {"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(40)]}, GREEDY)
    eng.step()  # "cold" runs alone (max_num_seqs=1); the next two wait behind it
    eng.add_request("cold2", {"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(40)]}, GREEDY)
    eng.add_request("warm", {"prompt_token_ids": shared + [5]}, GREEDY)
    assert drain(eng) == order


def test_refused_without_prefix_caching():
    with pytest.raises(ValueError, match="cache_aware.*enable_prefix_caching"):
        engine(scheduler="cache_aware", enable_prefix_caching=False)
