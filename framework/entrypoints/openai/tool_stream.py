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

* ``auto`` with ``llama3_json`` / ``pythonic``: the first non-blank characters decide. An answer
  that starts like a call (``{`` / ``[`` or ``<|python_tag|>``) is held and parsed whole when the
  choice ends; any other streams as content at once.
* ``auto`` with ``mistral``: content streams until ``[TOOL_CALLS]`` (a possible prefix of it is
  held); from the marker on the text is held and parsed whole at the end.

Whatever a stream held and its parser then refuses is sent as content, so the streamed content
and calls are the non-streamed ones (up to whitespace at the ends of content around calls).
"""
from __future__ import annotations

import json
import re
from typing import Any

from kvforge.entrypoints.openai.tool_parsers import PARSERS, as_json, make_call, parse_hermes

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


class _Stream:
    """What every stream here offers: ``feed(text)`` and ``finish()`` return (content, tool_calls
    delta items); ``index`` is the number of calls sent - 1."""

    index = -1

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []

    def _whole(self, found: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        """Delta items announcing ``found`` (name, arguments) calls, each whole."""
        items = []
        for name, args in found:
            self.index += 1
            items.append({"index": self.index, **make_call(name, as_json(args))})
        return items


def stream_for(how: str, parser: str) -> _Stream:
    """The stream of a ``required`` answer, or of an ``auto`` one read by ``parser``."""
    if how == "required":
        return RequiredCallStream()
    return HermesStream() if parser == "hermes" else HeldCallStream(parser)


class RequiredCallStream(_Stream):
    """Deltas of a ``required`` answer (see the module docstring)."""

    def __init__(self) -> None:
        self.text = ""  # the whole answer so far
        self.depth, self.in_str, self.esc = 0, False, False
        self.item: list[str] = []  # the current item's text
        self.index = -1  # calls announced so far - 1
        self.header_sent = False
        self.sent_args = 0  # characters of the current item's text already sent as arguments

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """("", tool_calls delta items) for the next piece of the answer."""
        self.text += text
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
        return "", out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """An answer that announced no call (cut short by max_tokens) is content, as unstreamed."""
        return ("" if self.index >= 0 else self.text), []

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
                out.append({"index": self.index, **make_call(json.loads(f'"{m.group(1)}"'), "")})
            elif closing:  # another key order: the item whole
                try:
                    body = json.loads(text)
                    out += self._whole([(body["name"], body.get("parameters", {}))])
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


class HermesStream(_Stream):
    """Content and call deltas of a Hermes ``auto`` answer (see the module docstring)."""

    def __init__(self) -> None:
        self.buf = ""  # text not yet sent: a possible start of <tool_call>, or an open block

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
                calls += self._whole(found)
            else:  # a block that does not parse stays content
                content.append(self.buf[:end + len(_CLOSE)])
            self.buf = self.buf[end + len(_CLOSE):]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """Held text when the answer ends (a tag prefix, an unterminated block): content."""
        rest, self.buf = self.buf, ""
        return rest, []


_CALL_STARTS = {"llama3_json": ("{", "<|python_tag|>"), "pythonic": ("[", "<|python_tag|>")}
_MARKERS = {"mistral": "[TOOL_CALLS]"}


class HeldCallStream(_Stream):
    """Content and call deltas under a parser that reads a whole answer (``llama3_json``,
    ``pythonic``, ``mistral``; see the module docstring): content streams until the answer
    looks like calls, the rest is held and parsed when the choice ends."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.held = ""  # text not sent yet
        self.mode: str | None = None  # "content" or "calls" once the answer's start decides

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool_calls delta items) for the next piece of the answer."""
        self.held += text
        if self.mode == "calls":
            return "", []
        if self.parser in _MARKERS:
            mark = _MARKERS[self.parser]
            at = self.held.find(mark)
            if at >= 0:
                self.mode = "calls"
                return self._send(at), []
            return self._send(len(self.held) - max(
                (k for k in range(1, len(mark)) if self.held.endswith(mark[:k])), default=0)), []
        if self.mode is None:
            head = self.held.lstrip()
            starts = _CALL_STARTS[self.parser]
            if not head or any(s.startswith(head) and len(head) < len(s) for s in starts):
                return "", []  # blank so far, or a prefix of a call's start: wait
            self.mode = "calls" if any(head.startswith(s) for s in starts) else "content"
            if self.mode == "calls":
                return "", []
        return self._send(len(self.held)), []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool_calls delta items) when the answer ends: held text parsed, or content."""
        held, self.held = self.held, ""
        _, found = PARSERS[self.parser](held) if self.mode == "calls" else (None, [])
        if not found:
            return held, []
        return "", self._whole(found)  # (content before a mistral marker was sent already)

    def _send(self, upto: int) -> str:
        out, self.held = self.held[:upto], self.held[upto:]
        return out
