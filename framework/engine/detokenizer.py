"""Incremental (streaming) detokenization with stop-string detection.

Algorithm: the "prefix_offset / read_offset" scheme used by Hugging Face TGI and vLLM.
Two offsets into the token ids delimit a small sliding window:

* ``ids[prefix_offset:read_offset]`` are tokens whose text has already been emitted;
  they are decoded again only as *context*, so that tokenizer decoders that look at
  neighbouring tokens (SentencePiece's leading-space "▁" stripping, byte fallback,
  merged byte-level pieces) see the same surroundings they would in a full decode.
* ``ids[read_offset:]`` are tokens whose text has not been emitted yet.

After each new token, ``decode(ids[prefix_offset:])`` minus ``decode(ids[prefix_offset:read_offset])``
is the new text. If that text ends with U+FFFD (an incomplete multi-byte UTF-8 character
assembled from byte-fallback tokens) or is empty, nothing is emitted and the offsets stay,
so the window grows until the character completes. Otherwise the text is emitted and the
window slides: ``prefix_offset <- read_offset``, ``read_offset <- len(ids)``. Each step
decodes only the window, so the work per token does not grow with the output length.

The window starts over the last few prompt tokens, so the first generated token is decoded
in context: the output equals ``decode(prompt + gen)`` minus ``decode(prompt)``.
"""
from __future__ import annotations

import weakref
from typing import Any

from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.stop_matcher import stop_matcher

#: Number of prompt tokens decoded as context for the first generated token.
PREFIX_WINDOW = 5
#: Drop already-emitted ids from the front of the id buffer once this many pile up.
_TRIM_AT = 256
_REPLACEMENT_CHAR = "\ufffd"

# tokenizer -> (anchor ids, anchor text, {token id: text}) for decoded_token().
_TOKEN_TEXT_CACHE: "weakref.WeakKeyDictionary[Any, tuple[list[int], str, dict[int, str]]]" = (
    weakref.WeakKeyDictionary())


def _token_text_cache(tokenizer: Any) -> tuple[list[int], str, dict[int, str]]:
    try:
        return _TOKEN_TEXT_CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    anchor_ids: list[int] = []
    anchor_text = ""
    try:
        anchor_ids = list(tokenizer.encode("a", add_special_tokens=False))[-1:]
        anchor_text = tokenizer.decode(anchor_ids, skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
    except Exception:  # noqa: BLE001 - an anchor is only a nicety
        anchor_ids, anchor_text = [], ""
    entry = (anchor_ids, anchor_text, {})
    try:
        _TOKEN_TEXT_CACHE[tokenizer] = entry
    except TypeError:  # unhashable / not weak-referenceable tokenizer: no caching
        pass
    return entry


def decode_single_token(tokenizer: Any, token_id: int) -> str:
    """Text of one token on its own, e.g. for ``Logprob.decoded_token``.

    The token is decoded after a fixed one-token anchor (the tokenization of ``"a"``)
    and the anchor's text is removed, so a SentencePiece word-start token such as
    ``"▁the"`` comes out as ``" the"`` instead of losing its space to the decoder's
    leading-space strip. Special tokens are kept (``"</s>"``). A byte-fallback token
    that is only part of a UTF-8 character yields ``"\\ufffd"``. Results are cached
    per tokenizer.
    """
    anchor_ids, anchor_text, cache = _token_text_cache(tokenizer)
    text = cache.get(token_id)
    if text is not None:
        return text
    kw = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
    text = None
    if anchor_ids:
        both = tokenizer.decode(anchor_ids + [token_id], **kw)
        if both.startswith(anchor_text):
            text = both[len(anchor_text):]
    if text is None:
        text = tokenizer.decode([token_id], **kw)
    cache[token_id] = text
    return text


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text, one token at a time.

    Args:
        tokenizer: a Hugging Face tokenizer (fast or slow).
        prompt_token_ids: the request's prompt; its last ``PREFIX_WINDOW`` ids are the
            decoding context of the first generated token.
        params: the request's :class:`SamplingParams` (``detokenize``, ``stop``,
            ``include_stop_str_in_output``, ``skip_special_tokens``,
            ``spaces_between_special_tokens`` are used).

    Attributes:
        stop_reason: the stop string that ended the text, or None.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.enabled = bool(params.detokenize)
        self.stop_reason: str | None = None
        self._decode_kwargs = dict(skip_special_tokens=params.skip_special_tokens,
                                   spaces_between_special_tokens=params.spaces_between_special_tokens)
        # Only the prompt tail is kept; generated ids before prefix_offset are trimmed away.
        self._ids: list[int] = list(prompt_token_ids[-PREFIX_WINDOW:]) if PREFIX_WINDOW else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), lazily

        self._stops: list[str] = list(params.stop or [])
        self._matcher = stop_matcher(tuple(self._stops))
        self._max_stop_len = self._matcher.max_len
        # Without include_stop_str_in_output a stop match removes text that began in
        # earlier tokens, so get_delta() must hold back a possible stop-string prefix.
        self._hold_back_stops = bool(self._stops) and not params.include_stop_str_in_output

        self._chunks: list[str] = []     # output text, in pieces (joined lazily)
        self._num_chars = 0
        self._tail = ""                  # last max_stop_len - 1 chars of the output text
        # vLLM's rule: the text of the first min_tokens tokens is never searched for stop strings
        self._unchecked_tokens = params.min_tokens
        self._undelivered: list[str] = []  # pieces not yet returned by get_delta()
        self._delivered_chars = 0

    # ------------------------------------------------------------------ decoding

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, **self._decode_kwargs)

    def _step(self, token_id: int) -> str:
        """Append one id; return the newly stable text (possibly empty)."""
        ids = self._ids
        ids.append(token_id)
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        prefix_text = self._prefix_text
        full = self._decode(ids[self._prefix_offset:])
        if len(full) <= len(prefix_text) or full.endswith(_REPLACEMENT_CHAR):
            return ""  # no text yet, or an unfinished UTF-8 character: wait for more ids
        new_text = full[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        self._prefix_text = None
        if self._prefix_offset >= _TRIM_AT:
            del ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new_text

    # ------------------------------------------------------------------ public API

    def update(self, new_token_ids: list[int]) -> tuple[str | None, int]:
        """Feed newly generated token ids (one or more), in order.

        Tokens are processed one at a time. After each, only the part of the text that
        can hold a new stop-string match is searched: the new text plus the
        ``max_stop_len - 1`` characters before it. On a match, processing stops at the
        token that completed it; the text is cut at the start of the (earliest-starting)
        stop string, or just after its end when ``params.include_stop_str_in_output``.

        Returns:
            ``(stop_string or None, consumed)`` where ``consumed`` is how many of
            ``new_token_ids`` were used (all of them unless a stop string matched), so
            the caller can truncate its token ids at the same place. After a stop
            string has matched, further calls consume nothing and return ``(None, 0)``.
            With ``params.detokenize`` False nothing is decoded and all ids count as consumed.
        """
        if self.stop_reason is not None:
            return None, 0
        if not self.enabled:
            return None, len(new_token_ids)
        for i, token_id in enumerate(new_token_ids):
            piece = self._step(int(token_id))
            if self._unchecked_tokens > 0:  # (within min_tokens: no match, and none may start here)
                self._unchecked_tokens -= 1
                if piece:
                    self._append(piece)
                continue
            if not piece:
                continue
            prev_tail = self._tail
            self._append(piece)
            if not self._stops:
                continue
            window = prev_tail + piece
            keep = self._max_stop_len - 1
            self._tail = window[-keep:] if keep > 0 else ""
            match = self._find_stop(window)
            if match is not None:
                stop, start = match
                window_start = self._num_chars - len(window)
                cut = window_start + start
                if self.params.include_stop_str_in_output:
                    cut += len(stop)
                self._truncate(cut)
                self.stop_reason = stop
                return stop, i + 1
        return None, len(new_token_ids)

    def flush(self) -> None:
        """At the sequence's end: emit the text of ids still held back because it ended in an
        unfinished UTF-8 character (U+FFFD), so the final text is the full decode of the
        output (as ``tokenizer.decode`` gives it, replacement characters included) rather than
        losing the last tokens. No-op once a stop string matched or when nothing is held."""
        if not self.enabled or self.stop_reason is not None or self._read_offset >= len(self._ids):
            return
        prefix = self._prefix_text
        if prefix is None:
            prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset, self._read_offset, self._prefix_text = self._read_offset, len(self._ids), None
        if len(full) > len(prefix):
            self._append(full[len(prefix):])

    def _append(self, piece: str) -> None:
        self._chunks.append(piece)
        self._undelivered.append(piece)
        self._num_chars += len(piece)

    def _find_stop(self, window: str) -> tuple[str, int] | None:
        return self._matcher.find(window)

    def _truncate(self, num_chars: int) -> None:
        text = self.output_text[:num_chars]
        self._chunks = [text] if text else []
        self._num_chars = len(text)
        self._delivered_chars = min(self._delivered_chars, len(text))
        rest = text[self._delivered_chars:]
        self._undelivered = [rest] if rest else []
        keep = self._max_stop_len - 1
        self._tail = text[-keep:] if keep > 0 else ""

    @property
    def output_text(self) -> str:
        """All generated text so far. Never ends inside an incomplete UTF-8 character."""
        chunks = self._chunks
        if not chunks:
            return ""
        if len(chunks) > 1:
            chunks[:] = ["".join(chunks)]
        return chunks[0]

    def get_delta(self, finished: bool = False) -> str:
        """Text added since the previous ``get_delta()`` call, for streaming.

        While stop strings are set (and not included in the output), the longest end of
        the text that could still grow into a stop string is held back, because a later
        match would remove it; pass ``finished=True`` on the request's last call to
        release it. After a stop string matched, everything left is returned. The
        concatenation of all deltas (the last one with ``finished=True``) is ``output_text``.
        """
        if not self._undelivered:
            return ""
        pending = "".join(self._undelivered)
        hold = 0
        if self._hold_back_stops and not finished and self.stop_reason is None:
            hold = min(self._held_back_len(), len(pending))
        delta = pending[:len(pending) - hold]
        rest = pending[len(pending) - hold:]
        self._undelivered = [rest] if rest else []
        self._delivered_chars += len(delta)
        return delta

    def visible_text(self, finished: bool) -> str:
        """``output_text`` without the end that could still grow into a stop string (while
        the sequence runs), so the cumulative text a caller sees never shrinks when a later
        token completes a stop string (vLLM holds back the same characters)."""
        text = self.output_text
        if self._hold_back_stops and not finished and self.stop_reason is None:
            hold = self._held_back_len()
            if hold:
                return text[:len(text) - hold]
        return text

    def _held_back_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return self._matcher.held_back_len(self._tail)

    def decoded_token(self, token_id: int) -> str:
        """Text of one token, for ``Logprob.decoded_token`` (see :func:`decode_single_token`)."""
        return decode_single_token(self.tokenizer, token_id)
