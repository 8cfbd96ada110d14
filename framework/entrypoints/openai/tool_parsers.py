"""Parsers of ``tool_choice: "auto"`` answers (``--tool-call-parser``), one per model family's
tool-call format; each returns (content, [(name, arguments)]) of a finished choice's text.

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in
  the text (Nous Research's Hermes function-calling template; Qwen2.5, Hermes); the text
  around them is the content.
* ``llama3_json``: Llama 3.1 / 3.2's JSON-based tool calling (Meta's model card): the answer is
  ``{"name": ..., "parameters": {...}}`` (``arguments`` accepted too), optionally after
  ``<|python_tag|>``, several separated by ``;``. Text that does not start with such an object
  is content.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name": ..., "arguments": ...}``
  (Mistral's v3 tokenizer format); the text before the marker is content. ``[TOOL_CALLS]`` is a
  special token, so requests under this parser keep special tokens in their text
  (:data:`KEEPS_SPECIAL_TOKENS`).

* ``pythonic``: the answer is a Python list of calls with literal arguments,
  ``[get_weather(city="Paris"), get_time()]`` (Llama 3.2 / 4's pythonic format), read with
  :mod:`ast` (nothing is evaluated: arguments must be literals). Anything else is content.

A block or object that does not parse stays content, as vLLM's parsers leave it.
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from typing import Any, Callable

Calls = list[tuple[str, Any]]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_MARK = "[TOOL_CALLS]"


def _named(body: Any, args_keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """(name, arguments) of a parsed call object, or None when it is not one."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        return None
    args = next((body[k] for k in args_keys if k in body), {})
    if isinstance(args, str):  # (some models emit the arguments as a JSON string)
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return body["name"], args


def parse_hermes(text: str) -> tuple[str | None, Calls]:
    calls, kept, last = [], [], 0
    for m in _HERMES.finditer(text):
        try:
            call = _named(json.loads(m.group(1)), ("arguments",))
        except ValueError:
            call = None
        if call is None:
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept).strip()
    return ((content or None) if calls else text), calls


def parse_llama3_json(text: str) -> tuple[str | None, Calls]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _named(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        at = end
        rest = body[at:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):  # something else after the calls: not a tool-call answer
            return text, []
        at = len(body) - len(rest[1:].lstrip())
    return None, calls


def parse_mistral(text: str) -> tuple[str | None, Calls]:
    at = text.find(_MISTRAL_MARK)
    if at < 0:
        return text, []
    try:
        items = json.loads(text[at + len(_MISTRAL_MARK):].strip())
    except ValueError:
        return text, []
    items = items if isinstance(items, list) else [items]
    calls = [_named(item, ("arguments", "parameters")) for item in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return (text[:at].strip() or None), calls


def parse_pythonic(text: str) -> tuple[str | None, Calls]:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].lstrip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                    or any(kw.arg is None for kw in node.keywords):  # (name(k=literal, ...) only)
                return text, []
            calls.append((node.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}))
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return text, []
    return None, calls


def make_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry with a fresh id; ``arguments``: JSON text (see :func:`as_json`)."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def as_json(value: Any) -> str:
    """A parsed arguments value as the JSON text of a call's ``arguments``."""
    return json.dumps(value, ensure_ascii=False)


PARSERS: dict[str, Callable[[str], tuple[str | None, Calls]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral,
    "pythonic": parse_pythonic}
#: parsers whose format marker is a special token: their requests keep special tokens in the text
KEEPS_SPECIAL_TOKENS = frozenset({"mistral"})
