"""Tool calling on ``/v1/chat/completions`` (OpenAI's ``tools`` / ``tool_choice``, vLLM's rules).

* ``tool_choice: {"type": "function", "function": {"name": N}}``: the output is constrained
  (structured outputs) to a JSON value of N's ``parameters`` schema and returned as one call
  of N (its ``arguments``).
* ``tool_choice: "required"``: constrained to a non-empty JSON array of
  ``{"name": <a tool>, "parameters": <its schema>}``; each item is a call
  (finish_reason ``tool_calls``).
* ``tool_choice: "auto"`` (the default when tools are given, as vLLM's, once the server runs
  with ``--enable-auto-tool-choice --tool-call-parser P``): generation is free and the answer is
  parsed in the model family's format P (``hermes``, ``llama3_json``, ``mistral``, ``pythonic``;
  :mod:`kvforge.entrypoints.openai.tool_parsers`): each call found becomes one, the rest the content.
* ``"none"``: plain text. ``"auto"``, given or by default, on a server without a parser is refused
  (400), as vLLM does.

Forced calls have no free whitespace (``disable_any_whitespace``): arguments are read by programs, and
free whitespace is where a constrained model can loop until max_tokens. Streamed, a named call's
arguments arrive piece by piece (the first delta carries its id and name, as OpenAI's), so do a
required call's; a Hermes auto call comes whole as soon as its block closes; under the other
parsers content streams until the answer looks like calls, which come when the choice ends
(:mod:`kvforge.entrypoints.openai.tool_stream`).
"""
from __future__ import annotations

import json
from typing import Any

from kvforge.entrypoints.openai.tool_parsers import KEEPS_SPECIAL_TOKENS, as_json, make_call
from kvforge.entrypoints.openai.tool_parsers import PARSERS as _PARSE

#: ``--tool-call-parser`` values.
PARSERS = tuple(_PARSE)


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """The request's ``tools`` and ``tool_choice`` are well formed (called by the protocol).

    Raises:
        ValueError: naming ``tools[i]`` or ``tool_choice``.
    """
    names = []
    for i, t in enumerate(tools or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., "
                             "'parameters': {...}}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ValueError(f"tools[{i}].function.parameters: must be a JSON schema object")
        names.append(fn["name"])
    if tool_choice in (None, "none", "auto"):
        return
    if tool_choice == "required":
        if not names:
            raise ValueError("tool_choice: 'required' needs tools")
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise ValueError("tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', "
                         "'function': {'name': ...}}")
    if fn["name"] not in names:
        raise ValueError(f"tool_choice: function {fn['name'][:80]!r} is not among the tools")


def _schema(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object"}


def mode(req: Any, parser: str | None) -> str | None:
    """How the request's output becomes tool calls: ``named``, ``required``, ``auto`` (parsed)
    or None (plain text)."""
    if not req.tools or req.tool_choice == "none":
        return None
    if req.tool_choice == "required":
        return "required"
    if isinstance(req.tool_choice, dict):
        return "named"
    return "auto" if parser else None  # (the server refuses auto without a parser before this)


def constraint(req: Any) -> dict[str, Any] | None:
    """The structured-outputs fields that force a named or required tool call, else None."""
    if not getattr(req, "tools", None) or getattr(req, "tool_choice", None) in (None, "none", "auto"):
        return None
    fns = [t["function"] for t in req.tools]
    if req.tool_choice == "required":
        items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                  "properties": {"name": {"enum": [f["name"]]}, "parameters": _schema(f)}} for f in fns]
        return {"json": {"type": "array", "minItems": 1, "items": {"anyOf": items}}, "disable_any_whitespace": True}
    name = req.tool_choice["function"]["name"]
    return {"json": _schema(next(f for f in fns if f["name"] == name)), "disable_any_whitespace": True}


def named_call(req: Any, arguments: str) -> dict[str, Any]:
    """The call a named ``tool_choice`` forces, with ``arguments`` (JSON text) and a fresh id."""
    return make_call(req.tool_choice["function"]["name"], arguments)


def adjust_params(params: Any, how: str | None, parser: str | None) -> None:
    """Keep special tokens in the text of an ``auto`` request whose parser's marker is one
    (``mistral``'s ``[TOOL_CALLS]``), as vLLM's Mistral parser does."""
    if how == "auto" and parser in KEEPS_SPECIAL_TOKENS:
        params.skip_special_tokens = False


def extract(how: str, text: str, req: Any, parser: str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of one finished choice's text under mode ``how`` (``auto``: read by
    ``parser``). Text that does not parse (a constrained output cut by max_tokens, a malformed
    call) stays content."""
    if how == "named":
        return None, [named_call(req, text)]
    if how == "required":
        try:
            items = json.loads(text)
            return None, [make_call(item["name"], as_json(item["parameters"])) for item in items]
        except (ValueError, TypeError, KeyError):
            return text, []
    content, found = _PARSE[parser](text)
    return content, [make_call(name, as_json(args)) for name, args in found]


def finish_reason(how: str | None, calls: list, reason: str | None) -> str | None:
    """OpenAI's: ``tool_calls`` when the model chose to call (required, auto); a named call keeps
    the engine's reason (``stop``)."""
    return "tool_calls" if calls and how in ("required", "auto") and reason == "stop" else reason
