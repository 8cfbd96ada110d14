"""The server under bad input, disconnects, duplicate ids, concurrency and engine failures."""
from __future__ import annotations

import asyncio
import json
import re
import threading

import httpx
import pytest

from helpers import fresh_rng, random_story_prompts
from kvforge import SamplingParams
from test_server_common import KEY, MODEL_NAME, reference_llm, server, sse_events  # noqa: F401

C, H, T, D = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
U = [{"role": "user", "content": "hi"}]
LONG_IDS = [1] + [400] * 299  # 300 tokens > max_model_len 256

# (path, body (dict or raw str), field the error must name)
BAD = [
    (C, "{bad", "body"), (C, "[1, 2]", "body"), (C, "", "body"), (C, {}, "prompt"),
    (C, {"prompt": 5}, "prompt"), (C, {"prompt": []}, "prompt"), (C, {"prompt": [1, "a"]}, "prompt"),
    (C, {"prompt": [[1], []]}, "prompt"), (C, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "10"}, "max_tokens"), (C, {"prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    (C, {"prompt": "hi", "temperature": -1}, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, "top_p"), (C, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "hi", "n": 0}, "n"), (C, {"prompt": "hi", "n": 1.5}, "n"),
    (C, {"prompt": "hi", "logprobs": 100}, "logprobs"), (C, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    (C, {"prompt": "hi", "presence_penalty": 5}, "presence_penalty"),
    (C, {"prompt": "hi", "frequency_penalty": "x"}, "frequency_penalty"),
    (C, {"prompt": "hi", "stop": 5}, "stop"), (C, {"prompt": "hi", "stop": [""]}, "stop"),
    (C, {"prompt": "hi", "seed": "abc"}, "seed"), (C, {"prompt": "hi", "stream": "yes"}, "stream"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    (C, {"prompt": "hi", "model": "gpt-4"}, "model"), (C, {"prompt": LONG_IDS}, "prompt"),
    (C, {"prompt": [99999]}, "prompt"), (C, {"prompt": "hi", "top_k": -5}, "top_k"),
    (C, {"prompt": "hi", "min_p": 2}, "min_p"), (C, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "hi", "max_tokens": 5, "min_tokens": 10}, "min_tokens"),
    (C, {"prompt": "hi", "best_of": 3}, "best_of"), (C, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    (C, {"prompt": "hi", "stop_token_ids": [70000]}, "stop_token_ids"),
    (C, {"prompt": "hi", "ignore_eos": "true"}, "ignore_eos"), (C, {"prompt": "hi", "echo": 1}, "echo"),
    (H, {}, "messages"), (H, {"messages": []}, "messages"),
    (H, {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (H, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (H, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    (H, {"messages": "hello"}, "messages"), (H, {"messages": U, "top_logprobs": 2}, "top_logprobs"),
    (H, {"messages": U, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (H, {"messages": U, "max_completion_tokens": 0}, "max_completion_tokens"),
    (H, {"messages": U, "max_completion_tokens": 10000}, "max_completion_tokens"),
    (H, {"messages": U, "response_format": {"type": "xml"}}, "response_format.type"),
    (H, {"messages": U, "tool_choice": "required"}, "tool_choice"), (H, {"messages": U, "logprobs": "yes"}, "logprobs"),
    (H, {"messages": U, "model": "other"}, "model"), (T, {}, "prompt"), (D, {"tokens": "abc"}, "tokens"),
    (D, {}, "tokens"),
    (C, {"prompt": ""}, "prompt"), (C, {"prompt": ["hi", ""]}, "prompt[1]"),
    (C, {"prompt": "hi", "kvforge": {"drafter": "bogus"}}, "kvforge.drafter"),
    (C, {"prompt": "hi", "kvforge": {"nope": 1}}, "kvforge"), (C, {"prompt": "hi", "kvforge": 5}, "kvforge"),
    (C, {"prompt": "hi", "model": 5}, "model"), (H, {"messages": U, "model": ["a"]}, "model"),
    (C, '{"prompt": "hi", "temperature": NaN}', "temperature"), (C, '{"prompt": "hi", "top_p": Infinity}', "top_p"),
    (C, {"prompt": "hi", "logprobs": True}, "logprobs"),
]


def _good_loop(base_url: str, stop: threading.Event, results: list) -> None:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        while not stop.is_set():
            r = c.post(C, json=body)
            results.append((r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text))


def test_bad_requests_name_the_field(server):
    assert len(BAD) >= 30
    stop, results = threading.Event(), []
    t = threading.Thread(target=_good_loop, args=(server.base_url, stop, results))
    t.start()
    try:
        with server.client() as c:
            for path, body, field in BAD:
                r = (c.post(path, content=body, headers={"Content-Type": "application/json"})
                     if isinstance(body, str) else c.post(path, json=body))
                assert 400 <= r.status_code < 500, (path, body, r.status_code, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}
                assert field in err["message"], (body, err)
                assert err["param"] is None or err["param"] == field or field.startswith(err["param"]), (body, err)
                if isinstance(body, dict) and field == "model" and isinstance(body.get("model"), str):
                    assert r.status_code == 404 and err["code"] == "model_not_found", (body, r.status_code)
            r = c.post(C, json={"prompt": "hi", "max_tokens": 2}, headers={"X-Request-Id": "x" * 300})
            assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
            assert c.get("/v1/nope").status_code == 404 and "error" in c.get("/v1/nope").json()
            assert c.get(C).status_code == 405
            r = c.post(C, json={"prompt": "hi", "max_tokens": 2, "unknown_field": {"x": 1}})
            assert r.status_code == 200                     # unknown fields are ignored, like OpenAI's
            r = c.post(C, json={"prompt": "hi", "max_tokens": 2, "kvforge": {"drafter": "none"}})
            assert r.status_code == 200, r.text             # the per-request opt-out of speculation
    finally:
        stop.set()
        t.join(60)
    assert results and all(code == 200 for code, _ in results), results[:3]
    assert len({text for _, text in results}) == 1          # greedy answers stayed correct
    server.wait_idle()


def test_limits_come_from_the_engine_and_floats_must_be_finite(server):
    """logprobs / top_logprobs are capped by the engine's model.max_logprobs (20 here), not by a
    constant of the schema, and the chat error names top_logprobs; NaN / inf / 1e400 are
    refused as not finite (not as out of range)."""
    with server.client() as c:
        for path, body, field in ((C, {"prompt": "hi", "max_tokens": 1, "logprobs": 25}, "logprobs"),
                                  (H, {"messages": U, "max_tokens": 1, "logprobs": True, "top_logprobs": 25},
                                   "top_logprobs")):
            r = c.post(path, json=body)
            err = r.json()["error"]
            assert r.status_code == 400 and err["message"].startswith(f"{field}: 25 exceeds max_logprobs (20)"), err
        for raw in ('{"prompt": "hi", "temperature": NaN}', '{"prompt": "hi", "temperature": 1e400}'):
            r = c.post(C, content=raw, headers={"Content-Type": "application/json"})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "temperature" and "finite" in err["message"], err
        r = c.post(C, json={"prompt": "hi", "max_tokens": 1, "logprobs": 20})
        assert r.status_code == 200, r.text
        r = c.post(C, json={"prompt": "hi", "max_tokens": 2, "temperature": 3.5})  # vLLM takes any T >= 0
        assert r.status_code == 200, r.text


def _slow_down(server, monkeypatch, delay: float = 0.01) -> None:
    """Make every engine step take >= ``delay`` seconds, so a long request is surely still
    running while the test acts on it."""
    import time
    runner = server.engine.engine.runner
    orig = runner.execute

    def slow(so):
        time.sleep(delay)
        return orig(so)

    monkeypatch.setattr(runner, "execute", slow)


def _abort_count(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    m = re.search(r'kvforge:request_success_total\{finished_reason="abort"[^}]*\} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, monkeypatch):
    _slow_down(server, monkeypatch)
    before = _abort_count(server)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with server.client() as c:
        with c.stream("POST", C, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [ln for ln, _ in zip(lines, range(6)) if ln.startswith("data:")]
            assert got
        # the connection closed mid-stream
    server.wait_idle(10)
    assert _abort_count(server) == before + 1
    # a non-streaming client that gives up (read timeout) is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}{C}", headers=server.headers(), timeout=httpx.Timeout(30, read=0.3),
                   json={**body, "stream": False})
    server.wait_idle(10)
    assert _abort_count(server) == before + 2


def test_duplicate_in_flight_request_id_rejected(server, monkeypatch):
    _slow_down(server, monkeypatch)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with server.client() as c:
        with c.stream("POST", C, json=body, headers={"X-Request-Id": "dup-1"}) as r:
            assert r.status_code == 200 and r.headers["X-Request-Id"] == "dup-1"
            lines = r.iter_lines()  # keep the iterator: dropping it closes the connection
            next(lines)
            dup = c.post(C, json={**body, "stream": False, "max_tokens": 2}, headers={"X-Request-Id": "dup-1"})
            assert dup.status_code == 400 and "already in flight" in dup.json()["error"]["message"]
            assert dup.json()["error"]["param"] == "request_id"
            dup = c.post(H, json={"messages": U, "max_tokens": 2, "request_id": "dup-1"})
            assert dup.status_code == 400
        server.wait_idle(10)
        again = c.post(C, json={**body, "stream": False, "max_tokens": 2}, headers={"X-Request-Id": "dup-1"})
        assert again.status_code == 200 and again.json()["id"] == "dup-1"


def test_concurrent_streaming_clients_match_offline(server):
    prompts = random_story_prompts(fresh_rng("concurrent"), 64)
    ref = reference_llm().generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        text, done = "", False
        async with client.stream("POST", C, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert done
        return text

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), timeout=120,
                                     limits=limits) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(main())
    assert got == [r.outputs[0].text for r in ref]
    server.wait_idle(10)


def test_engine_failure_is_500_for_that_request_only(server, monkeypatch):
    runner = server.engine.engine.runner
    orig = runner.execute
    marker = [1, 500, 501, 502, 503]

    def flaky(so):
        if any(r.prompt_token_ids[:5] == marker for r in so.scheduled):
            raise RuntimeError("injected model failure")
        return orig(so)

    monkeypatch.setattr(runner, "execute", flaky)
    with server.client() as c:
        r = c.post(C, json={"model": MODEL_NAME, "prompt": marker, "max_tokens": 4})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "server_error" and "injected model failure" in err["message"]
        r = c.post(C, json={"model": MODEL_NAME, "prompt": marker, "max_tokens": 4, "stream": True})
        events = sse_events(r)
        assert "error" in events[0] and events[-1] == "[DONE]"
        ok = c.post(C, json={"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert c.get("/health").status_code == 200
    server.wait_idle()


def test_ignored_fields_are_named():
    """The server logs the top-level fields a request body carries that the API has no use for
    (the schema ignores them); aliases and known fields are not reported."""
    from kvforge.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ignored_fields
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2, "foo_bar": 1, "another": {"x": 1}})
    assert ignored_fields(CompletionRequest.model_validate_json(body)) == ["another", "foo_bar"]
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3})
    assert ignored_fields(ChatCompletionRequest.model_validate_json(chat)) == []
