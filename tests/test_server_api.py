"""The OpenAI-compatible server through the official ``openai`` client: completions and
chat, streaming and not, n > 1, logprobs (including -inf), stop strings, seeds, echo,
batches, tokenize/detokenize and /metrics."""
from __future__ import annotations

import json
import math

import httpx

from kvforge import SamplingParams
from test_server_common import MODEL_NAME, reference_llm, server, sse_events  # noqa: F401

PROMPTS = ["Once upon a time", "The cat sat on the", "Lily went to the park and"]


def _stream_text(stream) -> tuple[dict[int, str], dict[int, list[str]], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, list[str]] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            piece = ch.text if hasattr(ch, "text") else (ch.delta.content or "")
            texts[ch.index] = texts.get(ch.index, "") + (piece or "")
            if ch.finish_reason is not None:
                reasons.setdefault(ch.index, []).append(ch.finish_reason)
    return texts, reasons, usage


def test_completion_greedy_equals_offline_llm(server):
    client = server.openai()
    ref = reference_llm().generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    for prompt, r in zip(PROMPTS, ref):
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == r.outputs[0].text, prompt
        assert got.choices[0].finish_reason == r.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(r.prompt_token_ids)
        assert got.usage.completion_tokens == len(r.outputs[0].token_ids)
        stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        texts, reasons, usage = _stream_text(stream)
        assert texts[0] == r.outputs[0].text and reasons[0] == [r.outputs[0].finish_reason]
        assert usage.model_dump() == got.usage.model_dump()


def test_n_seed_streaming_usage(server):
    client = server.openai()
    kw = dict(model=MODEL_NAME, prompt="The dog", max_tokens=12, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]      # seed reproducibility
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert len({c.text for c in a.choices}) > 1                            # n independent samples
    texts, reasons, usage = _stream_text(client.completions.create(**kw, stream=True,
                                                                   stream_options={"include_usage": True}))
    assert {i: texts[i] for i in range(3)} == {c.index: c.text for c in a.choices}
    assert all(len(reasons[i]) == 1 for i in range(3)), reasons          # exactly one finish_reason each
    assert usage.model_dump() == a.usage.model_dump()
    chat_kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story"}],
                   max_completion_tokens=10, n=2, seed=7, temperature=0.8)
    full = client.chat.completions.create(**chat_kw)
    texts, reasons, usage = _stream_text(client.chat.completions.create(**chat_kw, stream=True,
                                                                        stream_options={"include_usage": True}))
    assert texts == {c.index: c.message.content for c in full.choices}
    assert all(len(reasons[i]) == 1 for i in range(2)) and usage.model_dump() == full.usage.model_dump()


def test_chat_template_and_streaming(server):
    client = server.openai()
    msgs = [{"role": "system", "content": "You tell stories."},
            {"role": "user", "content": [{"type": "text", "text": "Once upon a time"}]}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    prompt = "system: You tell stories.\nuser: Once upon a time\nassistant:"
    ref = reference_llm().generate({"prompt_token_ids": server.engine.engine.tokenizer.encode(
        prompt, add_special_tokens=False)}, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert full.choices[0].message.content == ref.outputs[0].text
    assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=16, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


def test_stop_strings_stream_equals_full(server):
    client = server.openai()
    for stop in ([" was"], ["girl", "a l"], "Lily"):
        kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=40, temperature=0, stop=stop)
        full = client.completions.create(**kw).choices[0]
        stops = [stop] if isinstance(stop, str) else stop
        assert full.finish_reason == "stop" and not any(s in full.text for s in stops), full.text
        texts, reasons, _ = _stream_text(client.completions.create(**kw, stream=True))
        assert texts[0] == full.text and reasons[0] == ["stop"]
    full = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=40, temperature=0,
                                     stop=[" was"], extra_body={"include_stop_str_in_output": True})
    assert full.choices[0].text.endswith(" was")


def test_logprobs_completion_chat_and_echo(server):
    client = server.openai()
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) >= 3 and max(t.values()) <= 0 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    e = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4, temperature=0,
                                  echo=True, logprobs=1)
    assert e.choices[0].text.startswith("Once upon a time")
    assert e.choices[0].logprobs.token_logprobs[0] is None                 # first prompt token
    n_prompt = e.usage.prompt_tokens
    assert len(e.choices[0].logprobs.tokens) == n_prompt + e.usage.completion_tokens
    # text_offset indexes the returned text: BOS at 0, each later prompt token where it starts in
    # the echoed prompt, the generated tokens after it; streamed chunks give the same offsets
    el, text = e.choices[0].logprobs, e.choices[0].text
    assert el.text_offset[:n_prompt] == [0, 0, 4, 9, 11] and el.text_offset[n_prompt] == len("Once upon a time")
    assert all(text[o:o + len(t)] == t for t, o in zip(el.tokens[2:], el.text_offset[2:])), (el, text)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4,
                                            temperature=0, echo=True, logprobs=1, stream=True))
    assert [o for ch in chunks for o in ch.choices[0].logprobs.text_offset] == el.text_offset
    c = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               for t in content)
    assert all(isinstance(t.bytes, list) for t in content)


def test_prompt_logprobs_extension(server):
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} with the token itself and the top-k; equal to the offline LLM's; with
    echo + logprobs both trimmed to their own k; refused with stream."""
    ref_llm = reference_llm()
    ref = ref_llm.generate("Once upon a time", SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
                           use_tqdm=False)[0]
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2,
                                            "temperature": 0, "prompt_logprobs": 3, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        plp = choice["prompt_logprobs"]
        assert len(plp) == len(ref.prompt_token_ids) and plp[0] is None
        for tid, got, want in zip(ref.prompt_token_ids[1:], plp[1:], ref.prompt_logprobs[1:]):
            assert str(tid) in got and 3 <= len(got) <= 4, got          # the token + the top 3
            assert {int(t) for t in got} == set(want), (got, want)
            for t, e in got.items():
                assert abs(e["logprob"] - want[int(t)].logprob) < 1e-4 and e["rank"] == want[int(t)].rank
        echo_tops = choice["logprobs"]["top_logprobs"][1:len(ref.prompt_token_ids)]
        assert all(1 <= len(t) <= 2 for t in echo_tops), echo_tops    # echo keeps its own k = 1
        r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "prompt_logprobs": 1})
        body = r.json()
        assert r.status_code == 200 and body["prompt_logprobs"][0] is None, r.text
        assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
        r = c.post("/v1/completions", json={"prompt": "hi", "prompt_logprobs": 1, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        r = c.post("/v1/completions", json={"prompt": "hi", "prompt_logprobs": 25})
        assert r.status_code == 400 and "prompt_logprobs: 25 exceeds max_logprobs" in r.json()["error"]["message"]


def test_logprobs_minus_inf_are_valid_json(server, monkeypatch):
    runner = server.engine.engine.runner
    orig = runner.execute

    def masked(so):
        ex = orig(so)
        ex.logits = ex.logits.clone()
        ex.logits[:, 3:] = -math.inf            # only ids 0..2 stay possible
        return ex

    monkeypatch.setattr(runner, "execute", masked)
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once", "max_tokens": 3,
                                            "temperature": 0, "logprobs": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = json.loads(r.text, parse_constant=lambda s: (_ for _ in ()).throw(ValueError(s)))
        tops = body["choices"][0]["logprobs"]["top_logprobs"]
        assert any(v == -9999.0 for t in tops for v in t.values())
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                                 "logprobs": True, "top_logprobs": 5, "stream": True})
        events = sse_events(r)
        assert events[-1] == "[DONE]" and "-Infinity" not in r.text and "NaN" not in r.text
    monkeypatch.undo()
    server.wait_idle()


def test_batch_prompts_and_token_ids(server):
    client = server.openai()
    r = client.completions.create(model=MODEL_NAME, prompt=["The cat", "The dog"], max_tokens=4, n=2,
                                  temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    ids = server.engine.engine.tokenizer.encode("The cat")
    t = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert t.choices[0].text == r.choices[0].text
    texts, reasons, usage = _stream_text(client.completions.create(
        model=MODEL_NAME, prompt=["The cat", "The dog"], max_tokens=4, n=2, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert texts == {c.index: c.text for c in r.choices} and usage.model_dump() == r.usage.model_dump()
    assert all(len(v) == 1 for v in reasons.values())


def test_extra_sampling_fields(server):
    client = server.openai()
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=0.7,
                                  seed=3, extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2,
                                                      "min_tokens": 8, "ignore_eos": True})
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"


def test_allowed_bad_words_truncate_fields(server):
    """vLLM's extra fields: the same tokens as the offline LLM with the same SamplingParams."""
    client = server.openai()
    llm = reference_llm()
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play"
    ids = llm.get_tokenizer().encode(prompt)
    allowed = sorted(set(ids))
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cases = [({"allowed_token_ids": allowed}, sp.clone(allowed_token_ids=allowed), prompt),
             ({"bad_words": ["Lily", "park"]}, sp.clone(bad_words=["Lily", "park"]), prompt),
             ({"truncate_prompt_tokens": 5}, sp, {"prompt_token_ids": ids[-5:]})]
    for extra, params, ref_prompt in cases:
        ref = llm.generate(ref_prompt, params, use_tqdm=False)[0]
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True, **extra})
        assert got.choices[0].text == ref.outputs[0].text, extra
        assert got.usage.prompt_tokens == len(ref.prompt_token_ids), extra
        chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=10, temperature=0, extra_body={"ignore_eos": True, **extra})
        assert chat.choices[0].finish_reason == "length", extra
    with server.client() as c:
        for body, param in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                            ({"truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens"),
                            ({"allowed_token_ids": []}, "allowed_token_ids"),
                            ({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids"),
                            ({"bad_words": [" "]}, "bad_words")):
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, **body})
            assert r.status_code == 400, (body, r.text)
            assert param in r.json()["error"]["message"], (body, r.text)


def test_tokenize_detokenize_roundtrip(server):
    with server.client() as c:
        r = c.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Once upon a time, a cat."})
        assert r.status_code == 200
        body = r.json()
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
        d = c.post("/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]})
        assert d.status_code == 200 and d.json()["prompt"] == "Once upon a time, a cat."
        m = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert m.status_code == 200 and m.json()["count"] > 0
        bad = c.post("/detokenize", json={"tokens": [1, 99999]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def _series(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))


def test_metrics_series(server):
    server.wait_idle()  # (the counters are server-wide: only this request may move them)
    before = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    server.openai().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    for name in ("kvforge:num_requests_running", "kvforge:num_requests_waiting", "kvforge:kv_cache_usage_perc",
                 "kvforge:prefix_cache_hit_rate", "kvforge:time_to_first_token_seconds_bucket",
                 "kvforge:time_per_output_token_seconds_bucket", "kvforge:inter_token_latency_seconds_bucket",
                 "kvforge:e2e_request_latency_seconds_bucket", "kvforge:prompt_tokens_total",
                 "kvforge:generation_tokens_total", "kvforge:request_success_total", "kvforge:num_preemptions_total"):
        assert name in text, name
    assert _series(text, "kvforge:generation_tokens_total") - _series(before, "kvforge:generation_tokens_total") >= 3
    # three tokens, each in its own step: two gaps between them (a step may bring several with speculation)
    itl = _series(text, "kvforge:inter_token_latency_seconds_count") - _series(
        before, "kvforge:inter_token_latency_seconds_count")
    assert 1 <= itl <= 2, itl
