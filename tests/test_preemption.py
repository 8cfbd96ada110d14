"""Preemption under KV-cache pressure (fcfs scheduler + paged allocator, stories260K, CPU).

Outputs under pressure must equal the unpressured run token for token, blocks must all
come back, a request that can never fit must fail alone, and every step must respect
max_num_seqs and max_num_batched_tokens. Prompts and lengths are fresh random draws.
"""
from __future__ import annotations

import pytest

from helpers import (assert_no_block_leak, assert_outputs_match, fresh_rng, make_engine, random_story_prompts,
                     run_engine)
from kvforge import SamplingParams

BLOCK = 16


def _registered_schedulers() -> list[str]:
    from kvforge.plugin_manager import load_registry
    return load_registry().names("scheduler")



def _record_schedule(engine) -> list:
    """Wrap ``engine.scheduler.schedule`` so every SchedulerOutput is kept, with a snapshot
    of what it held when returned (the engine mutates it afterwards on errors)."""
    records = []
    orig = engine.scheduler.schedule

    def schedule():
        so = orig()
        records.append({
            "ids": [r.request_id for r in so.scheduled],
            "num_tokens": dict(so.num_scheduled_tokens),
            "total": so.total_num_scheduled_tokens,
            "preempted": [r.request_id for r in so.preempted],
            "finished": [r.request_id for r in so.finished],
            "num_running": len(engine.scheduler.running),
        })
        return so

    engine.scheduler.schedule = schedule
    return records


def _add_all(engine, reqs) -> None:
    for rid, prompt, sp in reqs:
        engine.add_request(rid, prompt, sp)


def _block_accounting(engine, _outs) -> None:
    """Per step: blocks held by live requests + free blocks == all blocks (no leak, no double use)."""
    alloc = engine.allocator
    held = [b for rid in engine._live for b in alloc.get_block_table(rid)]
    assert len(held) == len(set(held)), "a physical block is in two block tables"
    assert len(held) + alloc.num_free_blocks == alloc.num_blocks, (
        f"held {len(held)} + free {alloc.num_free_blocks} != {alloc.num_blocks}")


def _greedy_batch(rng, n=8):
    prompts = random_story_prompts(rng, n)
    reqs = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(80, 120), ignore_eos=rng.random() < 0.75,
                            logprobs=2)  # a recomputed prefill sums in another order: near ties may flip
        reqs.append((f"g{i}", p, sp))
    return reqs


@pytest.mark.parametrize("scheduler", _registered_schedulers())
def test_greedy_outputs_identical_under_preemption(scheduler):
    rng = fresh_rng(f"greedy-preemption[{scheduler}]")
    reqs = _greedy_batch(rng)

    free_eng = make_engine(block_size=BLOCK, num_gpu_blocks=256, scheduler="fcfs")
    _add_all(free_eng, reqs)
    ref = run_engine(free_eng)
    assert free_eng.scheduler.num_preemptions == 0
    assert_no_block_leak(free_eng)

    num_blocks = rng.randint(12, 16)
    eng = make_engine(block_size=BLOCK, num_gpu_blocks=num_blocks, scheduler=scheduler)
    assert eng.allocator.num_blocks == num_blocks
    records = _record_schedule(eng)
    _add_all(eng, reqs)
    got = run_engine(eng, on_step=_block_accounting)

    assert eng.scheduler.num_preemptions > 0, f"no preemption with {num_blocks} blocks: test is not testing"
    assert eng.stats()["num_preemptions"] == eng.scheduler.num_preemptions
    assert any(r["preempted"] for r in records)
    assert set(got) == set(ref) == {rid for rid, _, _ in reqs}
    for rid, prompt, sp in reqs:
        a, b = ref[rid].outputs[0], got[rid].outputs[0]
        assert got[rid].error is None, got[rid].error
        assert_outputs_match([b], [a], f"{rid} ({prompt!r}) under preemption")
        if b.token_ids == a.token_ids:
            assert b.text == a.text
            assert b.finish_reason == a.finish_reason
        assert got[rid].prompt_token_ids == ref[rid].prompt_token_ids
    assert_no_block_leak(eng)
    assert not eng.scheduler.has_unfinished_requests()


def test_seeded_sampling_identical_under_preemption():
    rng = fresh_rng("seeded-preemption")
    reqs = _greedy_batch(rng, n=6)
    seeds = [123, rng.randrange(2**31)]
    # The sampled requests arrive last, so fcfs picks them as preemption victims.
    for j, seed in enumerate(seeds):
        reqs.append((f"s{j}", random_story_prompts(rng, 1)[0],
                     SamplingParams(temperature=0.8, seed=seed, max_tokens=100, ignore_eos=True)))

    alone = make_engine(block_size=BLOCK, num_gpu_blocks=256, scheduler="fcfs")
    _add_all(alone, [r for r in reqs if r[0].startswith("s")])
    ref = run_engine(alone)

    eng = make_engine(block_size=BLOCK, num_gpu_blocks=rng.randint(12, 14), scheduler="fcfs")
    records = _record_schedule(eng)
    _add_all(eng, reqs)
    got = run_engine(eng, on_step=_block_accounting)

    preempted = {rid for r in records for rid in r["preempted"]}
    assert eng.scheduler.num_preemptions > 0
    assert preempted & {"s0", "s1"}, f"the seeded requests were never preempted (preempted: {preempted})"
    for j, seed in enumerate(seeds):
        rid = f"s{j}"
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids, f"seed {seed} diverged"
        assert got[rid].outputs[0].text == ref[rid].outputs[0].text
    assert_no_block_leak(eng)


def test_request_that_can_never_fit_fails_alone_and_does_not_block_queue():
    rng = fresh_rng("never-fit")
    num_blocks = rng.randint(4, 6)
    capacity = num_blocks * BLOCK
    vocab = 512
    huge_prompt = [1] + [rng.randrange(3, vocab) for _ in range(capacity + rng.randint(1, 40))]
    good = [(f"ok{i}", p, SamplingParams(temperature=0.0, max_tokens=rng.randint(10, 30)))
            for i, p in enumerate(random_story_prompts(rng, 3))]

    ref_eng = make_engine(block_size=BLOCK, num_gpu_blocks=64, scheduler="fcfs")
    _add_all(ref_eng, good)
    ref = run_engine(ref_eng)

    eng = make_engine(block_size=BLOCK, num_gpu_blocks=num_blocks, scheduler="fcfs")
    with pytest.raises(ValueError, match="max_model_len"):  # the engine refuses it up front ...
        eng.add_request("huge", {"prompt_token_ids": huge_prompt}, SamplingParams(temperature=0.0, max_tokens=8))
    # ... and the scheduler stays safe when a front end admits one anyway (a third-party
    # allocator may hold fewer tokens than its blocks suggest): the engine's checks are lifted
    eng.max_model_len = 10 ** 6
    eng.scheduler.admission_error = lambda num_prompt_tokens: None
    eng.add_request("huge", {"prompt_token_ids": huge_prompt}, SamplingParams(temperature=0.0, max_tokens=8))
    _add_all(eng, good)  # queued behind the request that can never fit
    got = run_engine(eng, max_steps=500)

    bad = got["huge"]
    assert bad.finished
    assert bad.outputs[0].finish_reason == "error"
    assert bad.outputs[0].token_ids == []
    assert bad.error and "block" in bad.error, bad.error
    for rid, _, _ in good:
        assert got[rid].error is None
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
        assert got[rid].outputs[0].text == ref[rid].outputs[0].text
    assert_no_block_leak(eng)
    assert not eng.has_unfinished_requests()


def test_request_growing_to_the_whole_cache_ends_at_length_others_complete():
    """max_model_len is what the cache holds (4 blocks: 64 tokens), so no request can outgrow
    it: asking for more is refused up front, and one that grows to the whole cache, beside
    others that must be preempted for it, ends with 'length' there while the others complete
    exactly as without pressure. No block leaks."""
    rng = fresh_rng("outgrow")
    num_blocks = 4
    # the others run as long as the long one needs to fill the cache: it must preempt them
    good = [(f"ok{i}", {"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(rng.randint(4, 10))]},
             SamplingParams(temperature=0.0, max_tokens=rng.randint(40, 50), ignore_eos=True)) for i in range(2)]
    ref_eng = make_engine(block_size=BLOCK, num_gpu_blocks=64, scheduler="fcfs")
    _add_all(ref_eng, good)
    ref = run_engine(ref_eng)

    eng = make_engine(block_size=BLOCK, num_gpu_blocks=num_blocks, scheduler="fcfs")
    capacity = num_blocks * BLOCK
    assert eng.max_model_len == capacity
    prompt = {"prompt_token_ids": [1, 403, 407, 261, 378]}
    # more max_tokens than the cache holds: it stops at max_model_len (= capacity), as in vLLM
    eng.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=capacity + 200, ignore_eos=True))
    _add_all(eng, good)
    got = run_engine(eng, max_steps=2000)
    assert got["long"].outputs[0].finish_reason == "length" and got["long"].error is None
    assert len(got["long"].outputs[0].token_ids) == capacity - 5
    for rid, _, _ in good:
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
    assert eng.scheduler.num_preemptions > 0
    assert_no_block_leak(eng)


def _check_budget(records, max_num_seqs, max_batched) -> None:
    assert records
    for i, r in enumerate(records):
        assert len(r["ids"]) <= max_num_seqs, f"step {i}: {len(r['ids'])} requests > max_num_seqs"
        assert r["num_running"] <= max_num_seqs, f"step {i}: {r['num_running']} running > max_num_seqs"
        assert r["total"] <= max_batched, f"step {i}: {r['total']} tokens > max_num_batched_tokens"
        assert len(set(r["ids"])) == len(r["ids"]), f"step {i}: a request scheduled twice"
        assert set(r["num_tokens"]) == set(r["ids"]), f"step {i}: token counts do not match the batch"
        assert all(n >= 1 for n in r["num_tokens"].values()), f"step {i}: zero-token entry"
        assert not set(r["preempted"]) & set(r["ids"]), f"step {i}: a preempted request is scheduled"


def test_token_budget_and_max_num_seqs_respected_every_step():
    rng = fresh_rng("budget")
    max_num_seqs = rng.randint(2, 4)
    max_batched = rng.randint(40, 64)
    reqs = [(f"b{i}", p, SamplingParams(temperature=0.0, max_tokens=rng.randint(20, 40), ignore_eos=True))
            for i, p in enumerate(random_story_prompts(rng, 8))]

    ref_eng = make_engine(block_size=BLOCK, num_gpu_blocks=128, scheduler="fcfs")
    _add_all(ref_eng, reqs)
    ref = run_engine(ref_eng)

    eng = make_engine(block_size=BLOCK, num_gpu_blocks=128, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_batched, scheduler="fcfs")
    records = _record_schedule(eng)
    _add_all(eng, reqs)
    got = run_engine(eng, on_step=_block_accounting)

    _check_budget(records, max_num_seqs, max_batched)
    assert max(len(r["ids"]) for r in records) == max_num_seqs  # the limit was actually reached
    for rid, _, _ in reqs:
        assert got[rid].error is None, got[rid].error
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids
    assert_no_block_leak(eng)


def test_token_budget_respected_under_preemption_and_no_request_lost():
    """Small token budget + KV pressure: limits hold every step, and a preempted request whose
    prompt+output outgrew max_num_batched_tokens must still complete (it was accepted and had
    already been running), with the same tokens as an unpressured run."""
    rng = fresh_rng("budget-pressure")
    max_num_seqs = 4
    max_batched = 48
    reqs = [(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=rng.randint(70, 90), ignore_eos=True))
            for i, p in enumerate(random_story_prompts(rng, 6))]

    ref_eng = make_engine(block_size=BLOCK, num_gpu_blocks=128, scheduler="fcfs")
    _add_all(ref_eng, reqs)
    ref = run_engine(ref_eng)

    eng = make_engine(block_size=BLOCK, num_gpu_blocks=12, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_batched, scheduler="fcfs")
    records = _record_schedule(eng)
    _add_all(eng, reqs)
    got = run_engine(eng, max_steps=3000, on_step=_block_accounting)

    _check_budget(records, max_num_seqs, max_batched)
    assert eng.scheduler.num_preemptions > 0
    assert_no_block_leak(eng)
    errors = {rid: o.error for rid, o in got.items() if o.error}
    assert not errors, f"accepted requests were failed after preemption: {errors}"
    for rid, _, _ in reqs:
        assert got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_survive_preemption_mid_prefill(async_scheduling):
    """A request preempted while its prompt is chunked in recomputes the prompt: its prompt
    logprobs must stay at their own positions (equal to an unpressured run's)."""
    rng = fresh_rng("prompt logprobs under preemption")
    long_prompt = [1] + [rng.randrange(3, 512) for _ in range(89)]
    others = [[1] + [rng.randrange(3, 512) for _ in range(14)] for _ in range(3)]

    def run(engine, with_others):
        if with_others:
            for i, p in enumerate(others):
                engine.add_request(f"o{i}", {"prompt_token_ids": p},
                                   SamplingParams(max_tokens=30, ignore_eos=True, temperature=0))
            for _ in range(2):
                engine.step()
        engine.add_request("b", {"prompt_token_ids": long_prompt},
                           SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
        return run_engine(engine)["b"].prompt_logprobs

    ref = run(make_engine(dtype="float32"), False)
    engine = make_engine(dtype="float32", num_gpu_blocks=9, max_num_batched_tokens=24, max_num_seqs=6,
                         async_scheduling=async_scheduling)
    got = run(engine, True)
    assert engine.scheduler.num_preemptions > 0, "the case did not preempt: make the cache smaller"
    assert got[0] is None and len(got) == len(ref) == len(long_prompt)
    for pos in range(1, len(long_prompt)):
        tok = long_prompt[pos]
        assert list(got[pos]) == [tok], f"position {pos}: entry for {list(got[pos])}, prompt token {tok}"
        assert got[pos][tok].logprob == pytest.approx(ref[pos][tok].logprob, abs=1e-4), f"position {pos}"
    assert_no_block_leak(engine)


def test_num_cached_tokens_counts_prompt_hits_at_admission_only():
    """RequestOutput.num_cached_tokens is the prompt tokens the prefix cache served when the
    request was admitted (vLLM's meaning): a recompute after preemption, whose hits may cover
    generated tokens too, does not change it, so it never exceeds the prompt."""
    rng = fresh_rng("cached-after-preemption")
    base = [1] + [rng.randrange(3, 512) for _ in range(31)]
    prompts = [base + [rng.randrange(3, 512)] for _ in range(6)]
    eng = make_engine(block_size=16, num_gpu_blocks=5, max_num_seqs=3, max_model_len=64, enable_prefix_caching=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"c{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=30,
                                                                         ignore_eos=True))
    done = run_engine(eng, max_steps=2000)
    assert eng.scheduler.stats()["num_preemptions"] > 0, "the case needs preemptions"
    cached = [done[f"c{i}"].num_cached_tokens for i in range(6)]
    assert all(0 <= c <= len(p) for c, p in zip(cached, prompts)), cached
    assert max(cached) >= 16, cached  # later requests hit the shared 32-token prefix
