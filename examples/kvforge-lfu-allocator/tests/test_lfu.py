"""The lfu allocator's eviction order differs from paged's LRU; hints; engine end to end."""
from __future__ import annotations

import random

import pytest

from kvforge import SamplingParams
from kvforge.config import CacheConfig
from kvforge.engine.request import Request
from kvforge.plugin_manager import load_registry
from kvforge.testing import default_model_path

BS = 4


def make(name: str, num_blocks: int = 8, **settings):
    spec = load_registry().get("kv_allocator", name)
    model = spec.settings_model.model_validate(settings) if spec.settings_model else None
    return spec.factory(num_blocks, BS, model, CacheConfig(allocator=name, block_size=BS, enable_prefix_caching=True))


def run(alloc, rid: str, tokens: list[int], hint: str | None = None) -> int:
    """Admit, 'compute' and finish one request; returns its cached tokens."""
    extra = {"kvforge": {"eviction_hint": hint}} if hint else {}
    r = Request(rid, list(tokens), SamplingParams(max_tokens=1, extra_args=extra), 1)
    r.num_computed_tokens = alloc.get_computed_tokens(r)
    cached = r.num_computed_tokens
    assert alloc.allocate_slots(r, r.num_tokens - cached) is not None
    alloc.free(r)
    return cached


FREQUENT = [1, 10, 11, 12, 13, 14, 15, 16, 17]   # 2 full blocks + 1 token
RECENT = [1, 20, 21, 22, 23, 24, 25, 26, 27]


def scenario(name: str, **settings) -> tuple[int, int]:
    """FREQUENT is used 4 times, then RECENT once; a cold 6-block prompt forces 2 evictions.
    Returns the cached tokens FREQUENT and RECENT still get afterwards."""
    a = make(name, **settings)
    for i in range(4):
        run(a, f"f{i}", FREQUENT)
    run(a, "r", RECENT)
    run(a, "cold", [1] + list(range(100, 123)))      # 24 tokens = 6 blocks: 4 clean + 2 evictions
    return (a.peek_computed_tokens(Request("pf", FREQUENT, SamplingParams(), 1)) if name == "lfu" else
            a.get_computed_tokens(Request("pf", FREQUENT, SamplingParams(), 1)),
            a.get_computed_tokens(Request("pr", RECENT, SamplingParams(), 1)))


def test_lfu_keeps_the_frequent_prefix_lru_keeps_the_recent_one():
    assert scenario("lfu") == (8, 0)      # the once-used, more recent prefix was evicted
    assert scenario("paged") == (0, 8)    # LRU: the frequent but older prefix was evicted


def test_plain_lfu_setting():
    assert scenario("lfu", dynamic_aging=False) == (8, 0)


def test_eviction_hints():
    a = make("lfu")
    for i in range(4):
        run(a, f"f{i}", FREQUENT, hint="evict_first")   # frequent, but marked disposable
    run(a, "r", RECENT)
    run(a, "cold", [1] + list(range(100, 123)))
    assert a.get_computed_tokens(Request("pf", FREQUENT, SamplingParams(), 1)) == 0
    assert a.get_computed_tokens(Request("pr", RECENT, SamplingParams(), 1)) == 8
    b = make("lfu")
    run(b, "f", FREQUENT)
    run(b, "r", RECENT, hint="retain")
    for i in range(3):
        run(b, f"g{i}", FREQUENT)
    run(b, "cold", [1] + list(range(100, 123)))
    assert b.get_computed_tokens(Request("pr", RECENT, SamplingParams(), 1)) == 8


def test_peek_has_no_side_effects():
    a = make("lfu")
    run(a, "f", FREQUENT)
    before = dict(a.stats())
    assert a.peek_computed_tokens(Request("p", FREQUENT, SamplingParams(), 1)) == 8
    assert a.stats() == before and not a._pending_hits


def test_free_tail_rolls_back_lookahead():
    a = make("lfu")
    r = Request("s", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8), 8)
    assert a.allocate_slots(r, 5, num_lookahead_tokens=7) is not None   # 12 slots = 3 blocks
    a.free_tail(r, 5)                                                    # drafts rejected
    assert len(a.get_block_table("s")) == 2 and a.num_free_blocks == 6
    a.free(r)
    assert a.num_free_blocks == 8


MODEL = default_model_path()


@pytest.mark.skipif(MODEL is None, reason="set KVFORGE_TEST_MODEL to a model directory")
def test_engine_greedy_matches_paged_with_hits():
    from kvforge import LLM
    rng = random.Random(0)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 9))]}
               for _ in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    outs = {}
    for name in ("paged", "lfu"):
        llm = LLM(MODEL, dtype="float32", kv_allocator=name, enable_prefix_caching=True, num_gpu_blocks=12,
                  max_num_seqs=3)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        alloc = llm.llm_engine.allocator
        assert alloc.num_free_blocks == alloc.num_blocks
        assert alloc.stats()["prefix_cache_hits"] > 0
    assert outs["lfu"] == outs["paged"]
