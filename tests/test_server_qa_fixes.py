"""Fixes from an adversarial QA pass (session 19): request ids that cannot be echoed in a header,
logit_bias keys that look like digits, unbounded stop lists, text that is not valid Unicode, a
huge text prompt refused by its length before it is tokenized, and wrong types in
chat_template_kwargs. Each is a 400 naming the field, and the server stays healthy."""
from __future__ import annotations

import json
import time

import pytest

from test_server_common import CHAT_TEMPLATE, server  # noqa: F401

C, H = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "Once upon a time"}]


def _err(r, param: str) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


@pytest.mark.parametrize("rid", ["abc ", " abc", "a\nb", "a\u0000b", "\U0001F600", " "])
def test_body_request_id_must_fit_a_header(server, rid):
    with server.client() as c:
        err = _err(c.post(C, json={"prompt": "Once", "max_tokens": 2, "request_id": rid}), "request_id")
        assert "X-Request-Id" in err["message"]
        ok = c.post(C, json={"prompt": "Once", "max_tokens": 2, "request_id": "my id-7"})  # inner space: fine
        assert ok.status_code == 200 and ok.headers["X-Request-Id"] == "my id-7"
    server.wait_idle()


@pytest.mark.parametrize("key", ["--5", "\u00b2", "1" * 5000, "5 ", "0x5"])
def test_logit_bias_keys_must_be_ascii_integers(server, key):
    with server.client() as c:
        err = _err(c.post(C, json={"prompt": "x", "max_tokens": 2, "logit_bias": {key: 1}}), "logit_bias")
        assert "token ids" in err["message"]
        assert c.post(C, json={"prompt": "x", "max_tokens": 2, "logit_bias": {"-0": 1, "5": -1}}).status_code == 200


def test_stop_lists_are_bounded(server):
    from kvforge.entrypoints.openai.protocol import MAX_STOP, MAX_STOP_TOKEN_IDS
    with server.client() as c:
        stops = [f"s{i}" for i in range(MAX_STOP + 1)]
        assert f"at most {MAX_STOP}" in _err(c.post(C, json={"prompt": "x", "stop": stops}), "stop")["message"]
        ids = [3] * (MAX_STOP_TOKEN_IDS + 1)
        _err(c.post(C, json={"prompt": "x", "stop_token_ids": ids}), "stop_token_ids")
        ok = c.post(C, json={"prompt": "x", "max_tokens": 2, "stop": stops[:MAX_STOP],
                             "stop_token_ids": ids[:MAX_STOP_TOKEN_IDS]})
        assert ok.status_code == 200, ok.text


def test_text_that_is_not_unicode_is_refused(server):
    # the server's JSON parser already refuses a lone surrogate escape (400, body); offline, the
    # engine names the prompt instead of the fast tokenizer's TypeError
    with server.client() as c:
        r = c.post(C, content='{"prompt": "abc\\ud800", "max_tokens": 2}', headers={"Content-Type": "application/json"})
        assert _err(r, "body")["code"] == "invalid_json"
    from test_server_common import reference_llm
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt: not valid Unicode text"):
        reference_llm().generate(["fine", "abc\ud800"], use_tqdm=False)


def test_huge_text_prompt_is_refused_before_tokenizing(server, monkeypatch):
    calls = []
    ctx = server.app.state.ctx
    real = ctx.tokenizer.encode
    monkeypatch.setattr(ctx.tokenizer, "encode", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    text = "hello world " * 200_000  # 2.4 M characters: more than 4 x max_model_len x the longest token
    with server.client() as c:
        err = _err(c.post(C, json={"prompt": text, "max_tokens": 1}), "prompt")
        assert err["code"] == "context_length_exceeded" and "characters" in err["message"]
        err = _err(c.post(H, json={"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
                   "messages")
        assert err["code"] == "context_length_exceeded"
    assert not any(n > 100_000 for n in calls), calls   # never handed to the tokenizer


def test_chat_template_kwargs_types(server):
    with server.client() as c:
        for kwargs, param in (({"tools": 5}, "chat_template_kwargs.tools"),
                              ({"documents": "abc"}, "chat_template_kwargs.documents"),
                              ({"add_generation_prompt": "yes"}, "chat_template_kwargs.add_generation_prompt")):
            _err(c.post(H, json={"messages": U, "max_tokens": 2, "chat_template_kwargs": kwargs}), param)
        assert c.post(H, json={"messages": U, "max_tokens": 2,
                               "chat_template_kwargs": {"documents": [{"text": "d"}]}}).status_code == 200
    server.wait_idle()


def test_offline_chat_template_kwargs_types():
    from test_server_common import reference_llm
    llm = reference_llm()
    with pytest.raises(ValueError, match="tools: must be a list"):
        llm.chat(U, chat_template=CHAT_TEMPLATE, tools=5)
    with pytest.raises(ValueError, match="chat_template_kwargs: must be a dict"):
        llm.chat(U, chat_template=CHAT_TEMPLATE, chat_template_kwargs=5)


def test_response_names_the_requested_served_model(server, monkeypatch):
    ctx = server.app.state.ctx
    first = ctx.served_model_names[0]
    monkeypatch.setattr(ctx, "served_model_names", [first, "alias"])
    with server.client() as c:
        for asked, named in (("alias", "alias"), (first, first), (None, first)):
            body = {"prompt": "Once", "max_tokens": 2, **({"model": asked} if asked else {})}
            assert c.post(C, json=body).json()["model"] == named
            events = [json.loads(line[6:]) for line in c.post(C, json={**body, "stream": True}).text.splitlines()
                      if line.startswith("data: {")]
            assert events and all(e["model"] == named for e in events)
            assert c.post(H, json={"messages": U, "max_tokens": 2,
                                   **({"model": asked} if asked else {})}).json()["model"] == named
    server.wait_idle()


def test_beam_search_matches_the_offline_llm(server):
    """use_beam_search: n beams, the same sequences as LLM.beam_search; what it cannot do is refused."""
    from kvforge import BeamSearchParams
    from test_server_common import reference_llm
    llm = reference_llm()
    tok = llm.get_tokenizer()
    prompt = "Once upon a time, there was a"
    (ref,) = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5))
    plen = len(tok.encode(prompt))
    with server.client() as c:
        r = c.post(C, json={"prompt": prompt, "max_tokens": 8, "n": 3, "use_beam_search": True, "length_penalty": 0.5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["text"] for ch in body["choices"]] == [
            tok.decode(s.tokens[plen:], skip_special_tokens=True) for s in ref.sequences]
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
        assert body["usage"]["completion_tokens"] == sum(len(s.tokens) - plen for s in ref.sequences)
        h = c.post(H, json={"messages": U, "max_tokens": 4, "n": 2, "use_beam_search": True})
        assert h.status_code == 200 and len(h.json()["choices"]) == 2, h.text
        for body, field in (({"stream": True}, "stream"), ({"logprobs": 0}, "logprobs"),
                            ({"prompt_logprobs": 1}, "prompt_logprobs"), ({"n": 11}, "n")):
            _err(c.post(C, json={"prompt": "Once", "max_tokens": 2, "use_beam_search": True, **body}), field)
        _err(c.post(H, json={"messages": U, "max_tokens": 2, "use_beam_search": True, "logprobs": True}), "logprobs")
        for body in ({"stop": ["girl"]}, {"bad_words": ["there"]}, {"allowed_token_ids": [400]}, {"min_tokens": 2},
                     {"top_p": 0.5}, {"seed": 3}, {"logit_bias": {"5": 1.0}}):  # (not applied: refused, not ignored)
            field = next(iter(body))
            err = _err(c.post(C, json={"prompt": "Once", "max_tokens": 2, "use_beam_search": True, "n": 2, **body}),
                       field)
            assert "not applied by use_beam_search" in err["message"], err
        ok = c.post(C, json={"prompt": "Once", "max_tokens": 3, "use_beam_search": True, "n": 2,
                             "length_penalty": 1e308})  # (an extreme penalty ranks; no overflow)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text
    server.wait_idle()


def test_full_responses_are_built_off_the_event_loop(server, monkeypatch):
    """A large body (n = 128, echo, logprobs) is built off the event loop (on the tokenizer's thread:
    it decodes tokens), so the loop keeps answering other requests; the body is what the client gets."""
    import threading
    from kvforge.entrypoints.openai import serving_chat, serving_completion
    seen = []
    for mod in (serving_completion, serving_chat):
        real = mod._full_response
        monkeypatch.setattr(mod, "_full_response",
                            lambda *a, _real=real, **k: seen.append(threading.current_thread().name) or _real(*a, **k))
    with server.client() as c:
        r = c.post(C, json={"prompt": "Once", "max_tokens": 3, "n": 2, "echo": True, "logprobs": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
        assert r.headers["content-type"] == "application/json"
        r = c.post(H, json={"messages": U, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["content"]
    # off the event loop, on the one thread that uses the server's tokenizer
    assert len(seen) == 2 and all(name.startswith("kvforge-tokenize") for name in seen), seen
    server.wait_idle()


def test_bench_serve_reads_the_api_key_env_and_reports_errors_in_one_line(server, monkeypatch, capsys):
    from kvforge.entrypoints.cli import main
    from test_server_common import KEY, free_port
    flags = ["--num-prompts", "2", "--input-len", "4", "--output-len", "2", "--disable-tqdm"]
    monkeypatch.delenv("KVFORGE_API_KEY", raising=False)
    assert main(["bench", "serve", "--base-url", server.base_url, *flags]) == 1
    err = capsys.readouterr().err
    assert "answered 401" in err and "KVFORGE_API_KEY" in err and "Traceback" not in err, err
    assert main(["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", *flags]) == 1
    err = capsys.readouterr().err
    assert "cannot reach the server" in err and "Traceback" not in err, err
    monkeypatch.setenv("KVFORGE_API_KEY", KEY)
    assert main(["bench", "serve", "--base-url", server.base_url, *flags]) == 0, capsys.readouterr()
    server.wait_idle()


def test_too_many_logprobs_names_the_field_the_client_sent(server):
    over = server.app.state.ctx.max_logprobs + 1
    with server.client() as c:
        for body in ({"prompt": "Once", "max_tokens": 2, "logprobs": over},
                     {"prompt": "Once", "max_tokens": 0, "echo": True, "logprobs": over}):
            assert "exceeds max_logprobs" in _err(c.post(C, json=body), "logprobs")["message"]


def test_unknown_fields_are_logged_briefly(server, caplog):
    import logging
    extra = {f"field_{i:05d}_" + "x" * 100: 1 for i in range(5000)}
    with caplog.at_level(logging.WARNING, logger="kvforge.server"), server.client() as c:
        assert c.post(C, json={"prompt": "Once", "max_tokens": 2, **extra}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "not part of the API" in r.getMessage()]
    assert len(lines) == 1 and "and 4990 more" in lines[0] and len(lines[0]) < 1000, lines


@pytest.mark.parametrize("name", ["", " tiny", "tiny "])
def test_served_model_name_must_be_a_name(name, capsys):
    from kvforge.entrypoints.cli import build_parser
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--served-model-name", name])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--served-model-name" in err and "Traceback" not in err, err
    assert build_parser().parse_args(["serve", "--served-model-name", "a b"]).served_model_name == ["a b"]


def test_bench_serve_with_every_request_refused_prints_no_table(server, monkeypatch, capsys):
    from kvforge.entrypoints.cli import main
    from test_server_common import KEY
    monkeypatch.setenv("KVFORGE_API_KEY", KEY)
    over = server.app.state.ctx.max_model_len + 10
    assert main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "2", "--input-len", str(over),
                 "--output-len", "2", "--disable-tqdm"]) == 1
    out = capsys.readouterr().out
    assert "no request completed (2 failed)" in out and "Serving Benchmark Result" not in out, out
    assert "error: " in out and "context length" in out, out
    server.wait_idle()


@pytest.mark.parametrize("msg", [{"role": "user"}, {"role": "system", "content": None}, {"role": "tool"}])
def test_chat_message_content_is_required_except_for_the_assistant(server, msg):
    """A QA finding: a user message without content ran as an empty turn."""
    with server.client() as c:
        err = _err(c.post(H, json={"messages": [msg], "max_tokens": 2}), "messages[0].content")
        assert f"required for a {msg['role']!r} message" in err["message"]
        ok = c.post(H, json={"messages": U + [{"role": "assistant", "content": None}], "max_tokens": 2,
                             "add_generation_prompt": False, "continue_final_message": True})
        assert ok.status_code == 200, ok.text
