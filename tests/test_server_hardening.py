"""Server fixes from a user's report: request-level chat templates are refused unless trusted,
rendering runs beside (not ahead of) other requests' work, a broken --chat-template stops
start-up, template failures are blamed on the right side, --port is range-checked, echo with
max_tokens 0 scores the prompt, and an explicit tool_choice "auto" is refused."""
from __future__ import annotations

import threading
import time

import pytest

from helpers import STORIES_MODEL
from test_server_common import CHAT_TEMPLATE, sse_events, server  # noqa: F401

C, H = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "Once upon a time"}]

def _err(r, status: int, param: str | None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["param"] == param, err
    return err


@pytest.fixture
def trusted(server, monkeypatch):
    """The shared server as if started with --trust-request-chat-template."""
    monkeypatch.setattr(server.app.state.ctx, "trust_request_chat_template", True)
    return server


# -- 1. request-level chat templates ----------------------------------------------------------------
def test_request_chat_template_refused_unless_trusted(server):
    with server.client() as c:
        for body in ({"messages": U, "max_tokens": 2, "chat_template": "{{ 'x' }}"},
                     {"messages": U, "max_tokens": 2, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}):
            err = _err(c.post(H, json=body), 400, "chat_template")
            assert err["code"] == "untrusted_chat_template" and "--trust-request-chat-template" in err["message"]
        assert c.post(H, json={"messages": U, "max_tokens": 2}).status_code == 200   # the server's template is fine
    from kvforge.entrypoints.cli import build_parser
    from kvforge.entrypoints.openai.api_server import build_app
    assert build_parser().parse_args(["serve", "--trust-request-chat-template"]).trust_request_chat_template
    assert not build_parser().parse_args(["serve"]).trust_request_chat_template
    assert build_app(server.engine, trust_request_chat_template=True).state.ctx.trust_request_chat_template


def test_trusted_request_chat_template_is_used(trusted):
    tok = trusted.engine.engine.tokenizer
    with trusted.client() as c:
        r = c.post(H, json={"messages": U, "max_tokens": 2, "chat_template": "Q: {{ messages[0]['content'] }}\nA:"})
        assert r.status_code == 200, r.text
        expected = tok.encode("Q: Once upon a time\nA:", add_special_tokens=False)
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
        for template in ("{% for m in messages %}", "{{ messages[0]['content'] + 1 }}"):   # syntax / runtime
            r = c.post(H, json={"messages": U, "max_tokens": 2, "chat_template": template})
            err = _err(r, 400, "chat_template")
            assert err["message"].startswith("chat_template: the request's chat template failed"), err
        r = c.post(H, json={"messages": U, "max_tokens": 2, "chat_template_kwargs": {"tokenize": True}})
        _err(r, 400, "chat_template_kwargs")


def test_slow_template_render_does_not_stall_other_requests(trusted, monkeypatch):
    """A render used to share the one tokenizer thread, so every other request waited for a slow
    one. Here a render is held (blocked on an event, not busy: no GIL contention, so the result
    does not depend on the machine's speed) while a completion runs: it must finish meanwhile."""
    from kvforge.entrypoints.openai import chat_utils
    started, release = threading.Event(), threading.Event()
    real = chat_utils.render_chat

    def held(*args, **kwargs):
        started.set()
        release.wait(120)
        return real(*args, **kwargs)

    monkeypatch.setattr(chat_utils, "render_chat", held)
    slow: dict = {}

    def post_slow() -> None:
        with trusted.client(timeout=300) as c:
            r = c.post(H, json={"messages": U, "max_tokens": 1, "chat_template": "{{ 'x' }}"})
        slow["status"] = r.status_code

    th = threading.Thread(target=post_slow)
    th.start()
    try:
        assert started.wait(60), "the chat request never reached its render"
        with trusted.client(timeout=60) as c, c.stream("POST", C, json={"prompt": "Once upon a time", "max_tokens": 4,
                                                                        "ignore_eos": True, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]  # (the render is still held)
    finally:
        release.set()
        th.join(300)
    assert lines[-1] == "data: [DONE]"
    assert slow["status"] == 200, slow


def test_huge_prompt_does_not_stall_streaming(server):
    """A 2 MB chat prompt is rendered and tokenized off the event loop: a running stream keeps
    flowing, and the prompt gets its 400 for the context length."""
    gaps: list[float] = []

    def stream() -> None:
        with server.client() as c, c.stream("POST", C, json={"prompt": "Once upon a time", "max_tokens": 120,
                                                              "ignore_eos": True, "stream": True}) as r:
            last = None
            for line in r.iter_lines():
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now

    th = threading.Thread(target=stream)
    th.start()
    try:
        time.sleep(0.1)
        with server.client(timeout=120) as c:
            r = c.post(H, json={"messages": [{"role": "user", "content": "Once upon a time " * 120_000}],
                                "max_tokens": 2})
    finally:
        th.join(120)
    assert _err(r, 400, "messages")["code"] == "context_length_exceeded"
    assert gaps and max(gaps) < 1.0, max(gaps)


# -- 2. broken templates: refused at start-up, blamed on the right side at render time ---------------------
def test_bad_chat_template_file_stops_startup(tmp_path, capsys, monkeypatch):
    import kvforge.engine.executor as executor
    from kvforge.entrypoints.cli import main

    def no_engine(*_a, **_k):
        raise AssertionError("the engine was built before --chat-template was checked")

    monkeypatch.setattr(executor, "create_engine", no_engine)
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }\n")
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    for path, what in ((bad, "Jinja syntax error at line 1"), (empty, "empty"),
                       (tmp_path / "missing.jinja", "cannot read")):
        rc = main(["serve", "--model", STORIES_MODEL, "--port", "0", "--chat-template", str(path)])
        err = capsys.readouterr().err
        assert rc == 2 and f"--chat-template {path}" in err and what in err and "Traceback" not in err, err
    from kvforge.entrypoints.openai.api_server import build_app
    with pytest.raises(ValueError, match="chat_template: Jinja syntax error"):
        build_app(object(), chat_template="{{ x ")  # type: ignore[arg-type] - refused before the engine is read


def test_template_failures_blame_the_right_side(server, monkeypatch):
    ctx = server.app.state.ctx
    with server.client() as c:
        monkeypatch.setattr(ctx, "chat_template", "{{ messages[0]['content'] + 1 }}")   # the operator's bug
        err = _err(c.post(H, json={"messages": U, "max_tokens": 2}), 500, None)
        assert err["code"] == "chat_template_error" and err["type"] == "server_error", err
        monkeypatch.setattr(ctx, "chat_template", "{% if messages[0]['role'] != 'system' %}"
                            "{{ raise_exception('a system message must come first') }}{% endif %}x")
        err = _err(c.post(H, json={"messages": U, "max_tokens": 2}), 400, "messages")   # the template refuses it
        assert "a system message must come first" in err["message"], err
        monkeypatch.setattr(ctx, "chat_template", CHAT_TEMPLATE)
        r = c.post(H, json={"messages": U, "max_tokens": 2})
        assert r.status_code == 200, r.text
    server.wait_idle()


def test_add_special_tokens_does_not_double_the_templates_bos(server, monkeypatch):
    monkeypatch.setattr(server.app.state.ctx, "chat_template", "{{ bos_token }}" + CHAT_TEMPLATE)
    with server.client() as c:
        counts = [c.post(H, json={"messages": U, "max_tokens": 1, "add_special_tokens": flag}).json()["usage"]
                  ["prompt_tokens"] for flag in (False, True)]
        assert counts[0] == counts[1], counts


# -- 3. --port ------------------------------------------------------------------------------------
@pytest.mark.parametrize("port, why", [("99999", "must be in 0..65535, got 99999"), ("-1", "got -1"),
                                       ("http", "expected an integer in 0..65535")])
def test_port_out_of_range_is_a_usage_error(port, why, capsys):
    from kvforge.entrypoints.cli import build_parser
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--port", port])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --port" in err and why in err and "Traceback" not in err, err
    assert build_parser().parse_args(["serve", "--port", "65535"]).port == 65535


@pytest.mark.parametrize("value", ["-5", "nan", "inf", "soon"])
def test_drain_timeout_must_be_seconds(value, capsys):
    from kvforge.entrypoints.cli import build_parser
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--drain-timeout", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --drain-timeout" in err and "Traceback" not in err, err
    assert build_parser().parse_args(["serve", "--drain-timeout", "0"]).drain_timeout == 0.0


# -- 4. echo + max_tokens 0 -----------------------------------------------------------------------------
def test_echo_with_max_tokens_0_returns_the_scored_prompt(server):
    prompt = "Once upon a time"
    with server.client() as c:
        r = c.post(C, json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        (choice,) = body["choices"]
        n = body["usage"]["prompt_tokens"]
        assert choice["text"] == prompt and choice["finish_reason"] == "length" and choice["stop_reason"] is None
        assert body["usage"]["completion_tokens"] == 0 and body["usage"]["total_tokens"] == n
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n and lp["token_logprobs"][0] is None
        # the same prompt log-probabilities as an echo that generates one token
        ref = c.post(C, json={"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1}).json()
        assert ref["choices"][0]["logprobs"]["token_logprobs"][:n] == lp["token_logprobs"]
        assert ref["choices"][0]["logprobs"]["text_offset"][:n] == lp["text_offset"]
        r = c.post(C, json={"prompt": [prompt, "The cat"], "max_tokens": 0, "echo": True, "n": 2})
        texts = [ch["text"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])]
        assert r.status_code == 200 and texts == [prompt, prompt, "The cat", "The cat"], r.text
        assert all(ch["logprobs"] is None for ch in r.json()["choices"]) and r.json()["usage"]["completion_tokens"] == 0
        ids = server.engine.engine.tokenizer.encode(prompt)
        r = c.post(C, json={"prompt": ids, "max_tokens": 0, "echo": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == server.engine.engine.tokenizer.decode(ids)
        r = c.post(C, json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True,
                            "stream_options": {"include_usage": True}})
        events = sse_events(r)
        chunks = [e for e in events[:-1] if e["choices"]]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == prompt
        assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]] == ["length"]
        assert sum(len(ch["choices"][0]["logprobs"]["tokens"]) for ch in chunks) == n
        assert events[-2]["usage"]["completion_tokens"] == 0 and events[-1] == "[DONE]"
        _err(c.post(C, json={"prompt": prompt, "max_tokens": 0}), 400, "max_tokens")          # needs echo
        _err(c.post(C, json={"prompt": prompt, "max_tokens": 0, "echo": True, "min_tokens": 2}), 400, "min_tokens")
    server.wait_idle()


# -- 5. tool_choice --------------------------------------------------------------------------------------
def test_tool_choice_auto_is_refused_without_a_tool_parser(server):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with server.client() as c:
        # tools alone mean tool_choice 'auto' (OpenAI's and vLLM's default): refused the same way
        for body in ({"tools": tools, "tool_choice": "auto"}, {"tool_choice": "auto"}, {"tools": tools}):
            err = _err(c.post(H, json={"messages": U, "max_tokens": 2, **body}), 400, "tool_choice")
            assert "'auto'" in err["message"] and "parser" in err["message"], err
        for body in ({"tools": tools, "tool_choice": "none"}, {}):
            r = c.post(H, json={"messages": U, "max_tokens": 2, **body})
            assert r.status_code == 200, r.text
