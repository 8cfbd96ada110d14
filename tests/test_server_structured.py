"""Structured outputs through the OpenAI server: ``response_format`` (json_object, json_schema),
vLLM's ``structured_outputs`` object and its ``guided_*`` fields, on completions and chat,
streamed and not; conflicting or malformed constraints are a 400 naming the field."""
from __future__ import annotations

import json
import re

import pytest

from test_server_common import MODEL_NAME, server, sse_events  # noqa: F401

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"enum": ["Lily", "Tom"]}, "age": {"type": "integer", "minimum": 1, "maximum": 9}}}
U = [{"role": "user", "content": "Tell me about a girl."}]


def test_constraints_through_the_api(server):
    client = server.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=U, max_tokens=200, temperature=0,
                                          response_format=fmt)
    v = json.loads(chat.choices[0].message.content)
    assert v["name"] in ("Lily", "Tom") and 1 <= v["age"] <= 9
    cmpl = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=20, temperature=1.0, seed=2,
                                     extra_body={"guided_choice": ["yes", "no"]})
    assert cmpl.choices[0].text in ("yes", "no")
    cmpl = client.completions.create(model=MODEL_NAME, prompt="Once", max_tokens=20, temperature=1.0, n=2, seed=3,
                                     extra_body={"structured_outputs": {"regex": "[a-z]{2}[0-9]"}})
    assert all(re.fullmatch("[a-z]{2}[0-9]", c.text) for c in cmpl.choices)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=U, max_tokens=20, temperature=0, stream=True,
                                            extra_body={"guided_regex": "(cat|dog)s?"})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert re.fullmatch("(cat|dog)s?", text), text
    obj = client.chat.completions.create(model=MODEL_NAME, messages=U, max_tokens=30, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.lstrip().startswith("{")


def test_bad_constraints_are_400(server):
    with server.client() as c:
        for body, needle in (({"guided_regex": "a", "guided_choice": ["b"]}, "only one output constraint"),
                             ({"guided_regex": "([a-z"}, "structured_outputs.regex: cannot be compiled"),
                             ({"response_format": {"type": "json_schema"}},
                              "response_format: type 'json_schema' needs json_schema.schema"),
                             ({"structured_outputs": {"regexp": "a"}}, "unknown field"),
                             ({"guided_choice": ["a"], "use_beam_search": True, "n": 2}, "use_beam_search")):
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once", "max_tokens": 4, **body})
            assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
            assert "response_format: response_format" not in r.text
        # prompt_logprobs -1 (the whole vocabulary) reaches the engine's max_logprobs check
        r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once", "max_tokens": 2,
                                            "prompt_logprobs": -1})
        assert r.status_code == 400 and "prompt_logprobs: -1 (the whole vocabulary" in r.text, r.text
    server.wait_idle()
