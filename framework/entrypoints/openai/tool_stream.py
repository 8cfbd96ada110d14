"""Streaming tool calls of ``tool_choice: "required"`` and of the Hermes ``auto`` parser: text
fed piece by piece as it is generated becomes OpenAI ``delta`` parts (content, and
``tool_calls`` items with an ``index``), instead of one delta when the choice ends.

* ``required``: the output is the constrained JSON array ``[{"name": "N", "parameters":
  {...}}, ...]`` (XGrammar writes ``", "`` and ``": "`` and no other whitespace). An item's
  first delta (id, name) goes out once ``{"name": "N", "parameters":`` is complete; its
  arguments follow piece by piece, as the model writes them. (An item written in another key
  order is sent whole when it closes.)
* ``auto`` with ``hermes``: content streams as it comes, except text that may be the start of
  ``<tool_call>`` (held until it is not); each ``<tool_call>...</tool_call>`` block is sent as
  one call when it closes and parses, and as content when it does not, as
  :func:`tool_parsers.parse_hermes` decides. Content keeps its whitespace (the non-streamed
  content around calls is stripped at its ends).

Other parsers' answers are still parsed whole when the choice ends (``llama3_json`` and
``mistral`` answers are a call or not only once complete).
"""
from __future__ import annotations

import json
import re
from typing import Any

from kvforge.entrypoints.openai.tool_parsers import parse_hermes

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


def _new_call(name: str) -> dict[str, Any]:
    from kvforge.entrypoints.openai.tool_calls import _call
    return _call(name, "")


class RequiredCallStream:
    """Deltas of a ``required`` answer (see the module docstring)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc = 0, False, False
        self.item: list[str] = []  # the current item's text
        self.index = -1  # calls announced so far - 1
        self.header_sent = False
        self.sent_args = 0  # characters of the current item's text already sent as arguments

    def feed(self, text: str) -> list[dict[str, Any]]:
        """``tool_calls`` delta items for the next piece of the answer."""
        out: list[dict[str, Any]] = []
        for ch in text:
            if self.depth >= 1 and (self.depth > 1 or ch == "{"):
                self.item.append(ch)
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and self.item:  # an item closed
                    out += self._flush(closing=True)
        out += self._flush(closing=False)
        return out

    def _flush(self, closing: bool) -> list[dict[str, Any]]:
        if not self.item:
            return []
        text = "".join(self.item)
        out = []
        if not self.header_sent:
            m = _HEADER.match(text)
            if m:
                self.index += 1
                self.header_sent = True
                self.sent_args = m.end()
                out.append({"index": self.index, **_new_call(json.loads(f'"{m.group(1)}"'))})
            elif closing:  # another key order: the item whole
                try:
                    body = json.loads(text)
                    self.index += 1
                    call = _new_call(body["name"])
                    call["function"]["arguments"] = json.dumps(body.get("parameters", {}), ensure_ascii=False)
                    out.append({"index": self.index, **call})
                except (ValueError, TypeError, KeyError):
                    pass
        if self.header_sent:
            end = len(text) - 1 if closing else len(text)  # (the item's own closing brace is not an argument)
            if end > self.sent_args:
                out.append({"index": self.index, "function": {"arguments": text[self.sent_args:end]}})
                self.sent_args = end
        if closing:
            self.item, self.header_sent, self.sent_args = [], False, 0
        return out


class HermesStream:
    """Content and call deltas of a Hermes ``auto`` answer (see the module docstring)."""

    def __init__(self) -> None:
        self.buf = ""  # text not yet sent: a possible start of <tool_call>, or an open block
        self.index = -1  # calls sent so far - 1

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool_calls delta items) for the next piece of the answer."""
        self.buf += text
        content, calls = [], []
        while self.buf:
            at = self.buf.find(_OPEN)
            if at < 0:
                keep = max((k for k in range(1, len(_OPEN)) if self.buf.endswith(_OPEN[:k])), default=0)
                content.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                break
            end = self.buf.find(_CLOSE, at)
            if end < 0:  # an open block: wait for its end
                content.append(self.buf[:at])
                self.buf = self.buf[at:]
                break
            _, found = parse_hermes(self.buf[at:end + len(_CLOSE)])
            if found:
                content.append(self.buf[:at])
                for name, args in found:
                    self.index += 1
                    call = _new_call(name)
                    call["function"]["arguments"] = json.dumps(args, ensure_ascii=False)
                    calls.append({"index": self.index, **call})
            else:  # a block that does not parse stays content
                content.append(self.buf[:end + len(_CLOSE)])
            self.buf = self.buf[end + len(_CLOSE):]
        return "".join(content), calls

    def finish(self) -> str:
        """Held text when the answer ends (a tag prefix, an unterminated block): content."""
        rest, self.buf = self.buf, ""
        return rest
