"""Async scheduling (kvforge.engine.overlap): the same outputs as the synchronous loop,
placeholders never leak into outputs or prefix-cache hashes, and no block leaks."""
from __future__ import annotations

import os.path
import random

import pytest

from kvforge import LLM, SamplingParams
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.request import PLACEHOLDER_TOKEN_ID, Request
from kvforge_plugins.kv_cache.paged import PagedAllocator

MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "stories260K")


def _params(rng: random.Random) -> list[SamplingParams]:
    """One of every kind of request the overlap path treats differently."""
    seed = rng.randrange(1 << 20)
    return [
        SamplingParams(temperature=0, max_tokens=rng.randrange(20, 60)),
        SamplingParams(temperature=0, max_tokens=1),                     # ends at its first token
        SamplingParams(temperature=0, max_tokens=130),                   # long: EOS or length (fits 12 blocks)
        SamplingParams(temperature=0.8, seed=seed, max_tokens=30, logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, stop=["."]),        # stop string
        SamplingParams(temperature=0.9, seed=seed + 1, n=2, max_tokens=20),
        SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=8, stop_token_ids=[13]),
        SamplingParams(temperature=0, max_tokens=30, include_stop_str_in_output=True, stop=["the"]),
    ]


def _prompts(rng: random.Random, n: int) -> list[dict]:
    shared = [1] + [rng.randrange(3, 512) for _ in range(31)]
    return [{"prompt_token_ids": (shared if i % 2 else [1]) + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 30))]}
            for i in range(n)]


def _summary(outs):
    """Exact fields, and the logprobs apart: a recomputed (preempted) position's logprob
    comes from a prefill instead of a decode, equal only to float32 rounding."""
    exact = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
               None if c.logprobs is None else [sorted(d) for d in c.logprobs]) for c in o.outputs]
             + [o.prompt_logprobs is not None and len(o.prompt_logprobs)] for o in outs]
    lps = [v.logprob for o in outs for c in o.outputs for d in (c.logprobs or []) for v in d.values()]
    return exact, lps


def _generate(prompts, params, **kw):
    llm = LLM(MODEL, dtype="float32", **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    e = llm.llm_engine
    assert not e.has_unfinished_requests()
    assert e.allocator.num_free_blocks == e.allocator.num_blocks, "KV blocks leaked"
    return _summary(outs), e


@pytest.mark.parametrize("kw", [dict(), dict(enable_prefix_caching=True, max_num_batched_tokens=24),
                                dict(num_gpu_blocks=12, max_num_seqs=6)],
                         ids=["plain", "prefix+chunked", "preemption"])
def test_outputs_identical_to_synchronous_loop(kw):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    params = _params(rng)
    prompts = _prompts(rng, len(params) + 1)
    # A stop id the greedy text is sure to reach mid-sequence (EOS alone is left to chance).
    probe = LLM(MODEL, dtype="float32").generate(prompts[-1], SamplingParams(temperature=0, max_tokens=12),
                                                 use_tqdm=False)[0].outputs[0].token_ids
    params.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[probe[9]]))
    (ref, ref_lps), _ = _generate(prompts, params, async_scheduling=False, **kw)
    assert ref[-1][0][2] == "stop" and len(ref[-1][0][0]) <= 10
    (got, got_lps), engine = _generate(prompts, params, async_scheduling=True, **kw)
    assert got == ref, f"seed {seed}"
    assert got_lps == pytest.approx(ref_lps, abs=1e-4), f"seed {seed}"
    assert engine._overlap.num_overlapped_steps > 0
    if "num_gpu_blocks" in kw:
        assert engine.scheduler.num_preemptions > 0


def test_penalties_fall_back_to_waiting_for_tokens():
    params = [SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=30, frequency_penalty=0.5, presence_penalty=0.3)]
    prompts = ["Once upon a time", "The little dog"]
    (ref, _), _ = _generate(prompts, params, async_scheduling=False)
    (got, _), engine = _generate(prompts, params, async_scheduling=True)
    assert got == ref
    assert engine._overlap.num_overlapped_steps == 0


def test_streamed_outputs_never_show_a_placeholder_and_abort_is_clean():
    engine = LLMEngine.from_kwargs(MODEL, dtype="float32", async_scheduling=True, enable_prefix_caching=True)
    engine.add_request("a", "Once upon a time", SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("b", "The little dog", SamplingParams(temperature=0, max_tokens=50, n=2))
    seen: dict[str, list] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                assert PLACEHOLDER_TOKEN_ID not in c.token_ids
                prev = seen.get((out.request_id, c.index), [])
                assert c.token_ids[:len(prev)] == prev, "a streamed token changed"
                seen[(out.request_id, c.index)] = list(c.token_ids)
                assert (c.finish_reason is not None) == out.finished or out.request_id == "b"
        steps += 1
        if steps == 5:
            engine.abort_request("b")
    assert len(seen[("a", 0)]) == 50
    assert 0 < len(seen[("b", 0)]) < 50
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_allocator_does_not_hash_a_placeholder():
    alloc = PagedAllocator(8, 4, enable_prefix_caching=True)
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=8), 8)
    req.num_computed_tokens = 0
    alloc.allocate_slots(req, 3)
    req.num_computed_tokens = 3
    req.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
    req.num_pending_tokens = 1
    alloc.allocate_slots(req, 1)  # the decode of the placeholder fills block 0
    assert alloc.num_cached_blocks == 0, "a block holding a placeholder was registered"
    req.output_token_ids[-1] = 9
    req.num_pending_tokens = 0
    req.num_computed_tokens = 4
    req.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
    req.num_pending_tokens = 1
    alloc.allocate_slots(req, 1)
    assert alloc.num_cached_blocks == 1
    other = Request("o", [5, 6, 7, 9, 1], SamplingParams(max_tokens=8), 8)
    assert alloc.get_computed_tokens(other) == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_finished_request_blocks_are_cached_for_the_next_turn(async_scheduling):
    """Multi-turn: the next prompt = the last prompt + its answer. Every full block of the
    first turn is reusable, also the one its last computed token completed while that token
    was still on the device (async scheduling registers it when the request is freed)."""
    rng = random.Random()
    bs = 16
    llm = LLM(MODEL, dtype="float32", enable_prefix_caching=True, block_size=bs, async_scheduling=async_scheduling)
    e = llm.llm_engine
    first = [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(20, 40))]
    n_out = 2 * bs + (-(len(first) - 1)) % bs  # the last computed token completes a block
    out = llm.generate({"prompt_token_ids": first}, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    computed = len(first) + len(out) - 1  # the last sampled token never had its KV computed
    before = e.allocator.stats()["prefix_cache_hits"]
    llm.generate({"prompt_token_ids": first + out + [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=2),
                 use_tqdm=False)
    hits = e.allocator.stats()["prefix_cache_hits"] - before
    assert computed % bs == 0
    assert hits == computed, (hits, computed)
    assert e.allocator.num_free_blocks == e.allocator.num_blocks
