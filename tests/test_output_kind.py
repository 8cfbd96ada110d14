"""SamplingParams.output_kind (vLLM's RequestOutputKind): DELTA outputs concatenate to the
cumulative ones step by step, FINAL_ONLY requests emit once, LLM.generate runs final-only
without touching the caller's params, and an async stream merges deltas a slow consumer
has not read. stories260K on the CPU, fp32; prompts and seeds fresh each run (printed).
"""
from __future__ import annotations

import asyncio

import pytest

from helpers import STORIES_MODEL, fresh_rng, make_engine, random_story_prompts
from kvforge import SamplingParams
from kvforge.engine.sampling_params import RequestOutputKind as Kind


def _requests(rng, kind):
    prompts = random_story_prompts(rng, 4)
    out = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0 if i % 2 else 0.8, seed=rng.randrange(1 << 30),
                            max_tokens=rng.randint(12, 30),
                            n=2 if i == 1 else 1, logprobs=1, prompt_logprobs=1 if i == 0 else None,
                            stop=[" the"] if i == 2 else None, output_kind=kind)
        out.append((f"r{i}", p, sp))
    return out


def _flatten(out):
    return [(c.index, c.text, c.token_ids, [sorted((t, round(lp.logprob, 5)) for t, lp in e.items())
                                           for e in (c.logprobs or [])], c.finish_reason, c.stop_reason)
            for c in sorted(out.outputs, key=lambda c: c.index)]


def _prompt_lps(out):
    if out.prompt_logprobs is None:
        return None
    return [e if e is None else sorted((t, round(lp.logprob, 5)) for t, lp in e.items()) for e in out.prompt_logprobs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_deltas_add_up_to_cumulative_each_step(async_scheduling):
    rng = fresh_rng("delta")
    reqs_c = _requests(rng, Kind.CUMULATIVE)
    reqs_d = [(rid, p, sp.clone(output_kind=Kind.DELTA)) for rid, p, sp in reqs_c]
    kw = dict(dtype="float32", async_scheduling=async_scheduling, max_num_batched_tokens=16)  # chunked prompts
    cum, dlt = make_engine(**kw), make_engine(**kw)
    for (rid, p, sp), (_, _, spd) in zip(reqs_c, reqs_d):
        cum.add_request(rid, p, sp)
        dlt.add_request(rid, p, spd)
    acc: dict = {}
    finished = set()
    while cum.has_unfinished_requests():
        outs_c = {o.request_id: o for o in cum.step()}
        outs_d = {o.request_id: o for o in dlt.step()}
        assert outs_c.keys() == outs_d.keys()
        for rid, d in outs_d.items():
            if rid in acc:
                acc[rid].add(d, aggregate=True)
            else:
                acc[rid] = d
            c = outs_c[rid]
            assert _flatten(acc[rid]) == _flatten(c), rid
            assert _prompt_lps(acc[rid]) == _prompt_lps(c), rid
            assert d.finished == c.finished
            if c.finished:
                finished.add(rid)
    assert not dlt.has_unfinished_requests() and finished == {r[0] for r in reqs_c}


def test_final_only_emits_once():
    rng = fresh_rng("final")
    reqs = _requests(rng, Kind.CUMULATIVE)
    eng = make_engine(dtype="float32")
    final = {"r1", "r3"}
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp.clone(output_kind=Kind.FINAL_ONLY) if rid in final else sp)
    ref = make_engine(dtype="float32")
    for rid, p, sp in reqs:
        ref.add_request(rid, p, sp)
    seen: dict = {}
    want: dict = {}
    ref_count: dict = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.setdefault(o.request_id, []).append(o)
        for o in ref.step():
            ref_count[o.request_id] = ref_count.get(o.request_id, 0) + 1
            if o.finished:
                want[o.request_id] = o
    for rid in final:
        assert len(seen[rid]) == 1 and seen[rid][0].finished
    # the cumulative ones still emit every step (a stop string can end r2 at its first token)
    assert all(len(seen[rid]) == ref_count[rid] for rid in ("r0", "r2"))
    assert sum(ref_count[rid] for rid in final) > len(final)  # so final-only did hold some back
    for rid, outs in seen.items():
        assert _flatten(outs[-1]) == _flatten(want[rid])


def test_llm_generate_is_final_only_and_leaves_params_alone():
    from kvforge import LLM
    rng = fresh_rng("llm")
    llm = LLM(model=STORIES_MODEL, dtype="float32")
    prompts = random_story_prompts(rng, 3)
    delta = SamplingParams(temperature=0, max_tokens=20, output_kind=Kind.DELTA)
    emitted = []
    step = llm.llm_engine.step
    llm.llm_engine.step = lambda: _tap(step, emitted)
    outs = llm.generate(prompts, delta, use_tqdm=False)
    assert delta.output_kind == Kind.DELTA
    assert emitted and all(emitted)  # only final outputs were built
    llm.llm_engine.step = step
    ref = llm.generate(prompts, delta.clone(output_kind=Kind.CUMULATIVE), use_tqdm=False)
    assert [_flatten(o) for o in outs] == [_flatten(o) for o in ref]
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)


def _tap(step, emitted):
    outs = step()
    emitted.extend(o.finished for o in outs)
    return outs


def test_async_stream_merges_unread_deltas():
    from kvforge.engine.async_engine import AsyncLLMEngine
    rng = fresh_rng("async-delta")
    prompt = random_story_prompts(rng, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1, output_kind=Kind.DELTA)

    async def consume(engine, params, slow):
        items = []
        async for out in engine.generate("a", prompt, params):
            items.append(out)
            if slow:
                await asyncio.sleep(0.02)  # the engine runs ahead: unread deltas pile up
        return items

    async def main():
        engine = AsyncLLMEngine(make_engine(dtype="float32"))
        engine.start()
        try:
            fast = await consume(engine, sp.clone(output_kind=Kind.CUMULATIVE), False)
            slow = await consume(engine, sp, True)
        finally:
            await engine.shutdown()
        return fast, slow

    fast, slow = asyncio.run(main())
    assert sum(len(o.outputs[0].token_ids) for o in slow) == 40 and slow[-1].finished
    merged = slow[0]
    for out in slow[1:]:
        merged.add(out, aggregate=True)
    assert _flatten(merged) == _flatten(fast[-1])


def test_stream_put_merges_deltas_deterministically():
    """Three deltas put before the consumer reads arrive as one (cumulative ones: the newest)."""
    from kvforge.engine.async_engine import RequestStream
    from kvforge.engine.outputs import CompletionOutput, RequestOutput

    def out(text, ids, finished=False):
        return RequestOutput("a", "p", [1], None, [CompletionOutput(0, text, ids, finish_reason="stop" if finished
                                                                    else None)], finished)

    async def main(delta):
        stream = RequestStream("a", owner=None, loop=asyncio.get_running_loop(), delta=delta)
        for item in (out("x", [4]), out("y", [5]), out("z", [6], True)):
            stream._put(item)
        return [o async for o in stream]

    (merged,) = asyncio.run(main(True))
    assert (merged.outputs[0].text, merged.outputs[0].token_ids, merged.finished) == ("xyz", [4, 5, 6], True)
    assert merged.outputs[0].finish_reason == "stop"
    (newest,) = asyncio.run(main(False))
    assert newest.outputs[0].text == "z"
