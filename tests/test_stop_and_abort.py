"""Stop reasons and aborts that must not depend on async scheduling (issue 2 semantics,
vLLM's order): a stop string completed by the token that also hits max_tokens or a stop id
is the reason; an abort arriving after a sequence already finished does not cut it."""
from __future__ import annotations

import pytest

from helpers import STORIES_MODEL, make_engine, run_engine
from kvforge import LLM, SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def greedy_three():
    out = LLM(STORIES_MODEL, dtype="float32").generate(PROMPT, SamplingParams(temperature=0, max_tokens=3),
                                                       use_tqdm=False)[0].outputs[0]
    assert len(out.text) >= 2
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_string_on_the_last_allowed_token_is_the_reason(greedy_three, async_scheduling):
    llm = LLM(STORIES_MODEL, dtype="float32", async_scheduling=async_scheduling)
    tail = greedy_three.text[-1:]
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3, stop=[tail]), use_tqdm=False)[0].outputs[0]
    assert o.token_ids == greedy_three.token_ids
    assert (o.finish_reason, o.stop_reason) == ("stop", tail)
    assert o.text == greedy_three.text[:-1]
    # The same token also a stop_token_id: as in vLLM, a stop token's text is not detokenized
    # (so the stop string inside it never matches) unless include_stop_str_in_output
    two = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].text
    last = greedy_three.token_ids[-1]
    for include, reason, text in ((False, last, two), (True, tail, greedy_three.text)):
        sp = SamplingParams(temperature=0, max_tokens=9, stop=[tail], stop_token_ids=[last],
                            include_stop_str_in_output=include)
        o = llm.generate(PROMPT, sp, use_tqdm=False)[0].outputs[0]
        assert o.token_ids == greedy_three.token_ids
        assert (o.finish_reason, o.stop_reason, o.text) == ("stop", reason, text), sp


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_token_text_is_left_out_like_vllm(greedy_three, async_scheduling):
    """vLLM keeps a stop_token_id / EOS in token_ids but leaves its text out of ``text``
    (unless include_stop_str_in_output), also where skip_special_tokens=False would show EOS."""
    llm = LLM(STORIES_MODEL, dtype="float32", async_scheduling=async_scheduling)
    two = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].text
    last = greedy_three.token_ids[-1]
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[last], logprobs=1),
                     use_tqdm=False)[0].outputs[0]
    assert (o.token_ids, o.text, o.stop_reason) == (greedy_three.token_ids, two, last)
    assert len(o.logprobs) == 3  # the stop token keeps its logprobs
    o = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=9, stop_token_ids=[last],
                                            include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert o.text == greedy_three.text
    # EOS with skip_special_tokens=False: "Once upon a time" ends on EOS id 1 (<s>) within 400 tokens
    sp = SamplingParams(temperature=0, max_tokens=400, skip_special_tokens=False)
    o = llm.generate("Once upon a time", sp, use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] in (1, 2)
    assert not o.text.endswith(("<s>", "</s>")), o.text[-20:]


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_abort_after_the_last_token_was_sampled_keeps_the_whole_output(max_tokens):
    """Async scheduling: a sequence that reached max_tokens is finished while its last
    token is still on the device; aborting it then changes nothing."""
    ref = make_engine(dtype="float32")
    ref.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens))
    want = run_engine(ref)["a"].outputs[0]
    engine = make_engine(dtype="float32", async_scheduling=True)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens))
    req = engine._live["a"]
    outs = []
    for _ in range(max_tokens + 5):
        outs += engine.step()
        if req.is_finished:
            break
    assert req.is_finished and req.num_pending_tokens == 1, "the case needs the last token in flight"
    engine.abort_request("a")
    outs += run_engine(engine).values()
    final = [o for o in outs if o.finished]
    assert len(final) == 1, "exactly one final output"
    got = final[0].outputs[0]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, "length")
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streamed_text_never_shrinks_across_a_stop_string(async_scheduling):
    """A stop string spanning tokens: every RequestOutput's text extends the previous one
    (the engine holds back a possible stop-string start while the sequence runs)."""
    ref = LLM(STORIES_MODEL, dtype="float32").generate(PROMPT, SamplingParams(temperature=0, max_tokens=12),
                                                       use_tqdm=False)[0].outputs[0].text
    words = ref.split()
    assert len(words) >= 3
    stop = f"{words[1]} {words[2][:1]}"  # spans at least two tokens
    engine = make_engine(dtype="float32", async_scheduling=async_scheduling)
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=12, stop=[stop]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert texts and ref.startswith(texts[-1]) and stop not in texts[-1] and texts[-1] == ref[:ref.index(stop)]
    for a, b in zip(texts, texts[1:]):
        assert b.startswith(a), f"text shrank: {a!r} -> {b!r}"
