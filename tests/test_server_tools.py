"""Tool calling on /v1/chat/completions: a named tool_choice and "required" force the call
through structured outputs, "auto" parses Hermes <tool_call> blocks once the server has a
parser; streamed answers carry the calls when the choice ends; malformed tools and choices
are 400s naming the field."""
from __future__ import annotations

import json

import pytest

from kvforge.entrypoints.openai.tool_calls import check_tools, constraint, extract
from test_server_common import MODEL_NAME, server, sse_events  # noqa: F401

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city"],
                                                           "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
U = [{"role": "user", "content": "What is the weather?"}]


class _Req:
    def __init__(self, tools, tool_choice):
        self.tools, self.tool_choice = tools, tool_choice


def test_hermes_and_required_parsing_by_hand():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n<tool_call>{oops}</tool_call>')
    content, calls = extract("auto", text, _Req([WEATHER, TIME], "auto"))
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert content == "Let me check.\n\n\n<tool_call>{oops}</tool_call>"  # (a malformed block stays text)
    assert extract("auto", "no calls here", _Req([WEATHER], "auto")) == ("no calls here", [])
    content, calls = extract("required", '[{"name": "get_time", "parameters": {"zone": "CET"}}]',
                             _Req([WEATHER, TIME], "required"))
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    assert extract("required", '[{"name": "get_time", "param', _Req([TIME], "required"))[1] == []  # (cut short)
    schema = constraint(_Req([WEATHER, TIME], "required"))["json"]
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    assert constraint(_Req([WEATHER], {"type": "function", "function": {"name": "get_weather"}})) == \
        {"json": WEATHER["function"]["parameters"], "disable_any_whitespace": True}
    for tools, choice, needle in (([{"type": "function"}], None, r"tools\[0\]"), ([WEATHER], "required", None),
                                  ([], "required", "needs tools"),
                                  ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not among"),
                                  ([WEATHER], "sometimes", "expected 'none'")):
        if needle is None:
            check_tools(tools, choice)
            continue
        with pytest.raises(ValueError, match=needle):  # (needles are regexes)
            check_tools(tools, choice)


def test_named_and_required_calls(server, monkeypatch):
    import openai
    from kvforge.entrypoints.openai import tool_calls
    real = tool_calls.constraint

    def one_item(req):  # this tiny model never closes the array itself: cap it at one call
        so = real(req)
        if so is not None and so["json"].get("type") == "array":
            so["json"]["maxItems"] = 1
        return so

    monkeypatch.setattr(tool_calls, "constraint", one_item)
    client = server.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=U, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=60, temperature=0)
    msg = r.choices[0].message
    assert msg.content is None and msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome")
    assert msg.tool_calls[0].id.startswith("chatcmpl-tool-") and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL_NAME, messages=U, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=100, temperature=1.0, seed=5)
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        args = json.loads(call.function.arguments)
        assert (call.function.name, set(args)) in (("get_weather", {"city"}), ("get_time", {"zone"}))
    stream = client.chat.completions.create(model=MODEL_NAME, messages=U, tools=[WEATHER], tool_choice=named,
                                            max_tokens=60, temperature=0, stream=True)
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    streamed = [tc for d in deltas for tc in (d.tool_calls or [])]
    # the arguments arrive in pieces; the first names the call
    assert len(streamed) > 1 and streamed[0].function.name == "get_weather" and streamed[0].id
    assert all(tc.index == 0 and tc.id is None for tc in streamed[1:])
    assert "".join(tc.function.arguments for tc in streamed) == msg.tool_calls[0].function.arguments
    # required, streamed: the call is announced, then its arguments come in pieces; same call as unstreamed
    kw = dict(model=MODEL_NAME, messages=U, tools=[WEATHER, TIME], tool_choice="required", max_tokens=100,
              temperature=1.0, seed=7)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = [ch.choices[0] for ch in client.chat.completions.create(**kw, stream=True) if ch.choices]
    streamed = [tc for ch in chunks for tc in (ch.delta.tool_calls or [])]
    assert streamed[0].id and len(streamed) > 2 and all(tc.id is None for tc in streamed[1:])
    assert streamed[0].function.name == whole.message.tool_calls[0].function.name
    assert json.loads("".join(tc.function.arguments for tc in streamed)) == \
        json.loads(whole.message.tool_calls[0].function.arguments)
    assert chunks[-1].finish_reason == whole.finish_reason == "tool_calls"
    # tools without tool_choice mean 'auto' (OpenAI's and vLLM's default), which a server without a
    # parser refuses as it refuses an explicit 'auto'; 'none' answers as text
    for extra in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError, match="tool_choice: 'auto'"):
            client.chat.completions.create(model=MODEL_NAME, messages=U, tools=[WEATHER], max_tokens=8, **extra)
    r = client.chat.completions.create(model=MODEL_NAME, messages=U, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("parser,forced", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'),
    ("pythonic", '[get_weather(city="Rome")]')])
def test_auto_parses_each_format(server, monkeypatch, parser, forced):
    monkeypatch.setattr(server.app.state.ctx, "tool_call_parser", parser)
    with server.client() as c:
        body = {"model": MODEL_NAME, "messages": U, "tools": [WEATHER], "max_tokens": 150, "temperature": 0,
                "structured_outputs": {"choice": [forced]}}  # (this tiny model never writes one itself)
        r = c.post("/v1/chat/completions", json={**body, "tool_choice": "auto"})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
        assert ch["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
        events = sse_events(c.post("/v1/chat/completions", json={**body, "stream": True}))
        calls = [tc for e in events[:-1] for chc in e["choices"] for tc in chc["delta"].get("tool_calls") or []]
        assert [tc["function"]["name"] for tc in calls] == ["get_weather"]
        assert any(chc["finish_reason"] == "tool_calls" for e in events[:-1] for chc in e["choices"])
    server.wait_idle()


def test_bad_tool_requests_are_400(server):
    with server.client() as c:
        named = {"type": "function", "function": {"name": "get_weather"}}
        for body, needle in (({"tools": [WEATHER], "tool_choice": "auto"}, "--enable-auto-tool-choice"),
                             ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                   "function": {"name": "get_time"}}}, "not among"),
                             ({"tools": [{"name": "x"}]}, "tools[0]"),
                             ({"tools": [WEATHER], "tool_choice": named, "guided_regex": "a"}, "cannot be combined"),
                             ({"tool_choice": "required"}, "needs tools")):
            r = c.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": U, "max_tokens": 4, **body})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
    server.wait_idle()


@pytest.mark.parametrize("flags", [["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]])
def test_tool_flags_go_together(flags, capsys):
    from helpers import STORIES_MODEL
    from kvforge.entrypoints.cli import main
    assert main(["serve", "--model", STORIES_MODEL, *flags]) == 2  # (before the model loads)
    assert "--enable-auto-tool-choice and --tool-call-parser go together" in capsys.readouterr().err


def test_llama3_json_and_mistral_parsing_by_hand():
    """The two other auto formats: calls become tool_calls (arguments as JSON text), and text that
    is not wholly a call stays content, as vLLM's parsers leave it."""
    req = _Req([WEATHER, TIME], "auto")
    for text in ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                 '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}} ; '
                 '{"name": "get_time", "parameters": {"zone": "UTC"}}'):
        content, calls = extract("auto", text, req, "llama3_json")
        assert content is None and calls[0]["function"]["name"] == "get_weather", text
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    for text in ("The weather is fine.", '{"name": "get_weather", "parameters": {}} and more text',
                 '{"city": "Paris"}', '{"name": "get_weather", "parameters": {"city": '):
        assert extract("auto", text, req, "llama3_json") == (text, []), text
    text = 'Checking. [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "CET"}}, ' \
           '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}]'
    content, calls = extract("auto", text, req, "mistral")
    assert content == "Checking." and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}  # (arguments given as a string)
    for text in ("no marker here", '[TOOL_CALLS][{"name": "get_time", "argu', '[TOOL_CALLS][{"zone": "CET"}]'):
        assert extract("auto", text, req, "mistral") == (text, []), text


def test_mistral_parser_keeps_special_tokens():
    from kvforge import SamplingParams
    from kvforge.entrypoints.openai.tool_calls import adjust_params
    for how, parser, keep in (("auto", "mistral", False), ("auto", "hermes", True), ("named", "mistral", True),
                              (None, "mistral", True)):
        sp = SamplingParams()
        adjust_params(sp, how, parser)
        assert sp.skip_special_tokens is keep, (how, parser)


def test_pythonic_parsing_by_hand():
    """Llama 3.2's pythonic calls: literal keyword arguments only, read without evaluating anything."""
    req = _Req([WEATHER, TIME], "auto")
    content, calls = extract("auto", '[get_weather(city="Paris", days=[1, 2]), get_time()]', req, "pythonic")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": [1, 2]}
    assert json.loads(calls[1]["function"]["arguments"]) == {}
    for text in ("It is sunny.", "[get_weather(city=__import__('os').getcwd())]", '[get_weather("Paris")]',
                 "[]", "[get_weather(city='Par", "[1, 2]", "[get_weather(**kw)]", "[a.b(c=1)]"):
        assert extract("auto", text, req, "pythonic") == (text, []), text
