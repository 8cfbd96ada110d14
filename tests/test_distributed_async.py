"""Async scheduling with tensor/pipeline parallelism (CPU, gloo, multiprocessing executor).

The driver sends step N+1 to the workers before it finishes step N on the host
(:mod:`kvforge.engine.overlap`, ``DistributedExecutor.execute_deferred``). Checked against
the synchronous single-process engine on stories260K, with a batch that mixes what can
go wrong when a step is in flight: greedy, seeded random and parallel (n=3) sampling, a
request that stops on EOS, one on a stop string after min_tokens, short and long
``max_tokens``, logprobs and prompt_logprobs, a penalty (forces a synchronous step while
it is live), chunked prefill, preemption, an abort mid-run and a failed sampling step.
"""
from __future__ import annotations

import random

import pytest

from helpers import STORIES_MODEL, STORY_OPENINGS, urandom_seed
from kvforge import SamplingParams
from kvforge.engine.llm_engine import LLMEngine

COMMON = dict(num_gpu_blocks=96, max_num_batched_tokens=32, dtype="float32")


def _requests(rng: random.Random):
    prompts = rng.sample(STORY_OPENINGS, 10)
    seed = rng.randrange(1 << 30)
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),              # ends while others run
        SamplingParams(temperature=0, max_tokens=60),                               # may stop on EOS
        SamplingParams(temperature=0.9, top_p=0.9, seed=seed, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True),
        SamplingParams(n=3, temperature=0.8, seed=seed + 1, max_tokens=20),          # parallel sampling
        SamplingParams(temperature=0, max_tokens=30, min_tokens=8, stop=[" the"]),  # stop string
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),            # done at launch
    ]
    return list(zip(prompts, params))


def _run(engine: LLMEngine, reqs, abort_at: int | None = None, abort_id: str = "r5"):
    for i, (p, sp) in enumerate(reqs):
        engine.add_request(f"r{i}", p, sp)
    outs, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        steps += 1
        if steps == abort_at:
            engine.abort_request(abort_id)
    return outs


def _same(got, ref, tag: str, skip=()):
    assert set(got) == set(ref), tag
    for rid, r in ref.items():
        if rid in skip:
            continue
        g = got[rid]
        assert g.error is None, f"{tag} {rid}: {g.error}"
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in r.outputs], f"{tag} {rid}"
        assert [o.finish_reason for o in g.outputs] == [o.finish_reason for o in r.outputs], f"{tag} {rid}"
        if r.outputs[0].logprobs:
            for a, b in zip(g.outputs[0].logprobs, r.outputs[0].logprobs):
                assert a.keys() == b.keys(), f"{tag} {rid}: logprob tokens differ"
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a), f"{tag} {rid}"
        if r.prompt_logprobs:
            assert len(g.prompt_logprobs) == len(r.prompt_logprobs), f"{tag} {rid}"


def _free(engine, tag: str) -> None:
    a = engine.allocator
    assert a.num_free_blocks == a.num_blocks, f"{tag}: {a.num_blocks - a.num_free_blocks} KV blocks still held"


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                                    dict(tensor_parallel_size=2, sample_on_worker=True)],
                         ids=["tp2", "pp2", "tp2-worker-sampling"])
def test_async_multi_rank_matches_sync_single_process(layout):
    seed = urandom_seed()
    tag = f"[{layout} seed {seed}]"
    reqs = _requests(random.Random(seed))
    ref_engine = LLMEngine.from_kwargs(STORIES_MODEL, **COMMON, async_scheduling=False)
    ref = _run(ref_engine, reqs)
    engine = LLMEngine.from_kwargs(STORIES_MODEL, **COMMON, **layout, async_scheduling=True)
    try:
        got = _run(engine, reqs)
        _same(got, ref, tag)
        assert engine._overlap.num_overlapped_steps > 10, f"{tag}: steps did not overlap"
        on_worker = engine.executor.num_steps_sampled_on_worker
        expect = layout.get("sample_on_worker", engine.executor.device.type == "cuda") and "tensor_parallel_size" in layout
        assert (on_worker > 10) == expect, f"{tag}: {on_worker} steps sampled on workers"
        _free(engine, tag)
        # A penalty makes every step synchronous while it is live; the others still match.
        pen = reqs + [(reqs[0][0], SamplingParams(temperature=0, max_tokens=15, repetition_penalty=1.3))]
        ref2, got2 = _run(ref_engine, pen), _run(engine, pen)
        _same(got2, ref2, tag + " with a penalty")
        _free(engine, tag + " with a penalty")
    finally:
        engine.executor.shutdown()


@pytest.mark.parametrize("on_worker", [False, True], ids=["driver-sampling", "worker-sampling"])
def test_async_tp_abort_while_a_step_is_in_flight(on_worker):
    seed = urandom_seed()
    tag = f"[seed {seed}]"
    reqs = _requests(random.Random(seed))
    ref = _run(LLMEngine.from_kwargs(STORIES_MODEL, **COMMON, async_scheduling=False), reqs)
    engine = LLMEngine.from_kwargs(STORIES_MODEL, **COMMON, tensor_parallel_size=2, async_scheduling=True,
                                   sample_on_worker=on_worker)
    try:
        got = _run(engine, reqs, abort_at=9)
        _same(got, ref, tag, skip={"r5"})
        aborted = got["r5"].outputs[0]
        assert aborted.finish_reason == "abort", tag
        assert -1 not in aborted.token_ids, f"{tag}: a placeholder token leaked into an aborted output"
        assert aborted.token_ids == ref["r5"].outputs[0].token_ids[:len(aborted.token_ids)], tag
        assert (engine.executor.num_steps_sampled_on_worker > 0) == on_worker, tag  # no silent fallback
        _free(engine, tag)
    finally:
        engine.executor.shutdown()


def test_async_tp_sampling_failure_fails_its_requests_and_the_engine_goes_on(monkeypatch):
    """The driver fails to sample a step while the next one waits on the workers for its
    tokens. The failed step's requests end with an error, also ``short``, which had
    already reached max_tokens with that step's token pending; the waiting step still
    runs, so a prompt that it prefills completes normally and the blocks it fills are
    real when the prompt comes again (prefix cache); nothing hangs, no block is held."""
    from kvforge.engine.sampler import Sampler
    seed = urandom_seed()
    rng = random.Random(seed)
    tag = f"[seed {seed}]"
    prompt = {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(70)]}  # 4 full blocks + a part
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(COMMON, enable_prefix_caching=True)
    ref_engine = LLMEngine.from_kwargs(STORIES_MODEL, **kw, async_scheduling=False)
    ref = _run(ref_engine, [(prompt, sp)])
    engine = LLMEngine.from_kwargs(STORIES_MODEL, **kw, tensor_parallel_size=2, async_scheduling=True)
    real = Sampler.sample_async
    calls = [0]

    def flaky(self, *a, **kw):
        calls[0] += 1
        if calls[0] == 3:  # the call that samples short's third (last) token
            raise RuntimeError("injected sampler failure")
        return real(self, *a, **kw)

    try:
        monkeypatch.setattr(Sampler, "sample_async", flaky)
        engine.add_request("short", STORY_OPENINGS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        engine.add_request("long", STORY_OPENINGS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        outs, steps = {}, 0
        while engine.has_unfinished_requests() or steps <= 3:
            if steps == 3:
                engine.add_request("r0", prompt, sp)  # prefilled by the step that waits for the tokens
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
            steps += 1
            assert steps < 200, f"{tag}: requests never finished: {list(engine.outputs.parents)}"
        for rid in ("short", "long"):
            assert outs[rid].outputs[0].finish_reason == "error", (tag, rid, outs[rid])
            assert "injected sampler failure" in outs[rid].error, (tag, rid, outs[rid].error)
            assert -1 not in outs[rid].outputs[0].token_ids, tag
        _same({"r0": outs["r0"]}, ref, tag + " prompt prefilled by the waiting step")
        _free(engine, tag + " after the failure")
        monkeypatch.setattr(Sampler, "sample_async", real)
        again = _run(engine, [(prompt, sp)])
        assert again["r0"].num_cached_tokens >= 64, (tag, again["r0"].num_cached_tokens)  # its blocks were reused
        _same(again, ref, tag + " the same prompt again, from the prefix cache")
        _free(engine, tag + " at the end")
    finally:
        engine.executor.shutdown()


def test_worker_sampling_sees_a_reused_params_object_changed_between_calls():
    """The workers cache params by object; the engine snapshots each request's params, so a
    caller that changes and reuses its SamplingParams gets the new behaviour (a fresh
    user's finding: the worker kept sampling with the object's first values)."""
    from kvforge import LLM
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    single = LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=64)
    tp = LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=64, tensor_parallel_size=2, async_scheduling=True,
             sample_on_worker=True)
    try:
        def both():
            a = single.generate([STORY_OPENINGS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
            b = tp.generate([STORY_OPENINGS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
            assert a == b, (a, b)
            return a
        first = both()
        sp.logit_bias = {first[3]: -100.0}  # a new dict: bans the fourth greedy token
        assert first[3] not in both()
        sp.logit_bias[first[0]] = -100.0    # the same dict, changed in place
        assert first[0] not in both()
        sp.temperature, sp.seed = 1.0, 3
        both()
        assert tp.llm_engine.executor.num_steps_sampled_on_worker > 10
    finally:
        tp.llm_engine.executor.shutdown()


def test_worker_sampling_with_unpicklable_extra_args():
    """extra_args may hold anything (a plugin's callable); only what the sampler reads goes
    to the workers, so such a request is served and the replica stays up (a reviewer's
    finding: pickling the whole params failed the send and killed the replica)."""
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, extra_args={"hook": lambda x: x})
    reqs = [(STORY_OPENINGS[0], sp), (STORY_OPENINGS[1], SamplingParams(temperature=0, max_tokens=8))]
    ref = _run(LLMEngine.from_kwargs(STORIES_MODEL, **COMMON, async_scheduling=False), reqs)
    engine = LLMEngine.from_kwargs(STORIES_MODEL, **COMMON, tensor_parallel_size=2, async_scheduling=True,
                                   sample_on_worker=True)
    try:
        _same(_run(engine, reqs), ref, "[extra_args]")
        assert engine.executor.dead is None and engine.executor.num_steps_sampled_on_worker > 3
    finally:
        engine.executor.shutdown()


def test_worker_sampling_failure_fails_its_requests_and_the_engine_goes_on(monkeypatch):
    """The output worker fails to sample a step (injected on its third sampling call). The
    step's requests end with an error naming it, the step that already used its (zero)
    tokens still runs, every rank stays in step, and the next requests are served
    normally (same tokens as one process); no block is held."""
    from kvforge.distributed.worker_sampling import FAIL_ENV
    seed = urandom_seed()
    tag = f"[seed {seed}]"
    reqs = _requests(random.Random(seed))[:3]
    ref = _run(LLMEngine.from_kwargs(STORIES_MODEL, **COMMON, async_scheduling=False), reqs)
    from kvforge.distributed.mp import START_METHOD_ENV
    monkeypatch.setenv(FAIL_ENV, "3")  # read by the workers when they start...
    monkeypatch.setenv(START_METHOD_ENV, "spawn")  # ...from this environment (a forkserver has an older one)
    engine = LLMEngine.from_kwargs(STORIES_MODEL, **COMMON, tensor_parallel_size=2, async_scheduling=True,
                                   sample_on_worker=True)
    try:
        outs = _run(engine, [(STORY_OPENINGS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
                             (STORY_OPENINGS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])
        for rid in ("r0", "r1"):
            out = outs[rid]
            assert out.outputs[0].finish_reason == "error", (tag, rid, out)
            assert "injected worker sampling failure" in out.error, (tag, rid, out.error)
            assert -1 not in out.outputs[0].token_ids, tag
        _free(engine, tag + " after the failure")
        assert engine.executor.dead is None, tag
        _same(_run(engine, reqs), ref, tag + " after the failure")
        _free(engine, tag + " at the end")
    finally:
        engine.executor.shutdown()


@pytest.mark.parametrize("on_worker", [False, True], ids=["driver-sampling", "worker-sampling"])
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_async_tp_preemption_keeps_outputs(mode, on_worker):
    """Too few KV blocks for the batch: requests are preempted (swapped to CPU or
    recomputed) while steps are in flight; greedy outputs still match one process."""
    kw = dict(COMMON, num_gpu_blocks=14, **{"scheduler.settings.preemption_mode": mode})
    if mode == "swap":
        kw["cache.swap_space_bytes"] = 1 << 22
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    reqs = [(p, sp) for p in STORY_OPENINGS[:6]]
    ref = _run(LLMEngine.from_kwargs(STORIES_MODEL, **kw, async_scheduling=False), reqs)
    engine = LLMEngine.from_kwargs(STORIES_MODEL, **kw, tensor_parallel_size=2, async_scheduling=True,
                                   sample_on_worker=on_worker)
    try:
        got = _run(engine, reqs)
        _same(got, ref, f"[{mode}]")
        assert engine.scheduler.stats()["num_preemptions"] > 0, f"[{mode}]: nothing was preempted"
        assert (engine.executor.num_steps_sampled_on_worker > 0) == on_worker, f"[{mode}]"
        _free(engine, f"[{mode}]")
    finally:
        engine.executor.shutdown()
