"""Streamed tool calls (kvforge.entrypoints.openai.tool_stream) against the non-streamed parse of the
same text: fresh random calls and answers, cut at random points, must give the same calls (names,
argument values) and content; a required call's arguments arrive before its item closes."""
from __future__ import annotations

import json

from helpers import fresh_rng
from kvforge.entrypoints.openai.tool_parsers import PARSERS, parse_hermes
from kvforge.entrypoints.openai.tool_stream import HermesStream, RequiredCallStream, stream_for

NAMES = ["get_weather", "get_time", "search", 'n\u00e4me "q" \\ }']
WORDS = ["Sure", "the", "{", "}", "[", "]", '"', "\\", "é", "<tool", "<tool_c", "</tool_call>", "call>", ",", " ", "\n"]


def _value(rng, depth=0):
    kind = rng.choice(["str", "num", "bool", "null"] + (["list", "obj"] if depth < 3 else []))
    if kind == "str":
        return "".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
    if kind == "num":
        return rng.choice([rng.randint(-99, 99), rng.random() * 100])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}{rng.choice(WORDS)}": _value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def _pieces(rng, text):
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _collect(items, calls):
    for it in items:
        if "id" in it:
            assert it["index"] == len(calls), "calls must be announced in order"
            calls.append([it["function"]["name"], it["function"]["arguments"]])
        else:
            calls[it["index"]][1] += it["function"]["arguments"]


def test_required_stream_matches_the_parsed_array():
    rng = fresh_rng()
    early = False
    for _ in range(200):
        items = [{"name": rng.choice(NAMES), "parameters": _value(rng)}
                 for _ in range(rng.randint(1, 3))]
        swapped = rng.random() < 0.2  # another key order: the item comes whole
        if swapped:
            items[0] = {"parameters": items[0]["parameters"], "name": items[0]["name"]}
        text = json.dumps(items, separators=rng.choice([(",", ":"), (", ", ": ")]), ensure_ascii=False)
        st, calls = RequiredCallStream(), []
        for piece in _pieces(rng, text):
            before = len(calls)
            content, out = st.feed(piece)
            assert content == ""
            _collect(out, calls)
            early |= any("id" not in it for it in out) and len(calls) == before  # arguments before the item closes
        assert st.finish() == ("", [])
        assert [(n, json.loads(a)) for n, a in calls] == [(i["name"], i["parameters"]) for i in items], text
    assert early, "no arguments were ever streamed piecewise"
    cut = RequiredCallStream()  # cut short before any call was announced: the text is content
    assert cut.feed('[{"name":"get_ti') == ("", []) and cut.finish() == ('[{"name":"get_ti', [])


def test_hermes_stream_matches_the_parsed_answer():
    rng = fresh_rng()
    for _ in range(300):
        parts = []
        for _ in range(rng.randint(0, 4)):
            r = rng.random()
            if r < 0.4:
                parts.append("".join(rng.choice(WORDS + ["text", "more"]) for _ in range(rng.randint(1, 5))))
            elif r < 0.8:
                body = json.dumps({"name": rng.choice(NAMES), "arguments": _value(rng)}, ensure_ascii=False,
                                  indent=rng.choice([None, 2]))
                parts.append(f"<tool_call>{rng.choice(['', chr(10), ' '])}{body}{rng.choice(['', chr(10)])}</tool_call>")
            else:
                parts.append(rng.choice(["<tool_call>{oops}</tool_call>", "<tool_call>", "<tool_", "</tool_call>"]))
        text = rng.choice(["", " ", "\n"]).join(parts)
        want_content, want_calls = parse_hermes(text)
        st, content, calls = HermesStream(), "", []
        for piece in _pieces(rng, text) if text else []:
            c, items = st.feed(piece)
            content += c
            _collect(items, calls)
        more, last = st.finish()
        content += more
        assert last == []
        assert [(n, json.loads(a)) for n, a in calls] == want_calls, text
        assert content.strip() == (want_content or "").strip(), text


def _answer(rng, parser):
    """A random answer in ``parser``'s format: calls, plain text, or something in between."""
    calls = [(rng.choice(NAMES[:3]), {f"a{i}": _value(rng) for i in range(rng.randint(0, 2))})
             for _ in range(rng.randint(1, 2))]
    text = "".join(rng.choice(WORDS + ["text", "[", "{", "<|python_tag|>", "[TOOL_CALLS]"])
                   for _ in range(rng.randint(0, 4)))
    if parser == "llama3_json":
        body = " ; ".join(json.dumps({"name": n, rng.choice(["parameters", "arguments"]): a}) for n, a in calls)
        opts = [body, "<|python_tag|>" + body, text, body + " trailing"]
    elif parser == "pythonic":
        body = "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls) + "]"
        opts = [body, "<|python_tag|>" + body, text, body[:-1]]
    else:
        body = "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])
        opts = [text + " " + body, body, text, text + body[:-2]]
    return rng.choice(["", " ", "\n"]) + rng.choice(opts)


def test_held_streams_match_the_parsed_answer():
    """llama3_json / pythonic / mistral: plain answers stream as content before the end, calls
    come at the end, and both equal the whole-text parse."""
    rng = fresh_rng()
    early_content = {"llama3_json": 0, "pythonic": 0, "mistral": 0}
    for _ in range(300):
        parser = rng.choice(["llama3_json", "pythonic", "mistral"])
        text = _answer(rng, parser)
        want_content, want_calls = PARSERS[parser](text)
        st, content, calls = stream_for("auto", parser), "", []
        for piece in _pieces(rng, text) if text else []:
            c, items = st.feed(piece)
            content += c
            assert items == [], "these formats announce calls only when the answer ends"
        early_content[parser] += bool(content) and not want_calls
        more, last = st.finish()
        content += more
        _collect(last, calls)
        assert [(n, json.loads(a)) for n, a in calls] == [(n, a) for n, a in want_calls], (parser, text)
        assert content.strip() == (want_content or "").strip(), (parser, text)
    assert all(early_content.values()), f"plain answers never streamed before the end: {early_content}"
