"""Structured outputs (vLLM's ``SamplingParams.structured_outputs``): generation constrained to a
JSON schema, any JSON object, a regular expression, one of a list of strings, or an EBNF grammar.

The grammar work is XGrammar's (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured
Generation Engine for Large Language Models", arXiv:2411.15100; the ``xgrammar`` package): a
request's constraint is compiled once against the model's tokenizer into a pushdown automaton,
and a per-sequence ``GrammarMatcher`` gives, before each sampled token, the bitmask of tokens
that keep the output a prefix of the language (EOS only where the output is complete). kvforge
owns the rest: the sampler sets the other tokens' logits to -inf
(:func:`kvforge.engine.sampling_ops.apply_token_bitmask`), and the output processor feeds each
kept token back to the matcher (:func:`advance`).

Constrained requests sample with their tokens on the host (``SamplingParams.reads_history``:
the next mask needs the last token). They speculate like any request: each draft position is
masked by the matcher advanced over the drafts before it (:class:`DraftPosition`), so the
rejection sampler refuses a draft the grammar refuses and samples its replacement within it.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, fields, replace
from typing import Any

log = logging.getLogger("kvforge")

#: Longest run of free whitespace allowed in JSON (XGrammar's ``max_whitespace_cnt``): enough for
#: any indentation, and it keeps a model from looping on whitespace (a known failure of
#: unbounded JSON whitespace) until max_tokens.
MAX_WHITESPACE = 32
#: Which field says what (vLLM's names); exactly one of them is set.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's ``StructuredOutputsParams``: set exactly one of

    Attributes:
        json: a JSON schema (dict or JSON text); the output is a JSON value it accepts.
        regex: the output fully matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this EBNF grammar (XGrammar's GBNF dialect,
            start symbol ``root``).
        json_object: True: the output is any JSON object (``response_format: json_object``).
        disable_any_whitespace: JSON with no whitespace but XGrammar's fixed separators
            (``", "`` and ``": "``, as vLLM's); otherwise a free whitespace run is at most
            :data:`MAX_WHITESPACE` characters.

    Raises:
        ValueError: naming ``structured_outputs.<field>``: none or several set, wrong types.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(KINDS)}"
                             + (f" (got {', '.join(given)})" if given else ""))
        checks = {"json": lambda v: isinstance(v, (str, dict)), "regex": lambda v: isinstance(v, str) and v,
                  "choice": lambda v: isinstance(v, (list, tuple)) and v and all(isinstance(c, str) for c in v),
                  "grammar": lambda v: isinstance(v, str) and v.strip(), "json_object": lambda v: v is True}
        what = {"json": "a JSON schema (dict or string)", "regex": "a non-empty string",
                "choice": "a non-empty list of strings", "grammar": "a non-empty string", "json_object": "True"}
        kind = given[0]
        if not checks[kind](getattr(self, kind)):
            raise ValueError(f"structured_outputs.{kind}: must be {what[kind]}, got {getattr(self, kind)!r:.80}")
        if self.choice is not None:
            self.choice = list(self.choice)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace: must be a bool")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputsParams | None":
        """``value`` as params: None, an instance (copied, so checked again: it may have been
        changed since it was built), or a dict of its fields (an unknown key is named)."""
        if value is None:
            return None
        if isinstance(value, cls):
            return replace(value)
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(map(str, set(value) - known))
            if unknown:
                raise ValueError(f"structured_outputs: unknown field(s) {unknown}; known: {', '.join(sorted(known))}")
            return cls(**value)
        raise ValueError(f"structured_outputs: expected StructuredOutputsParams or a dict, got {type(value).__name__}")


class GrammarCompiler:
    """Compiles constraints for one tokenizer (built on first use: XGrammar reads the whole
    vocabulary once). Compiled grammars are cached by XGrammar, so a repeated schema is free;
    compiling is thread-safe (``AsyncLLMEngine`` compiles off the engine thread first).

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (logits columns; may exceed the tokenizer's).
        eos_token_ids: the ids that end a sequence; a grammar allows them where it is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Any) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()  # (the server compiles off the engine thread too)

    def _xgr(self):
        try:
            import xgrammar
        except ImportError:
            raise ValueError("structured_outputs: needs the xgrammar package (pip install xgrammar, or kvforge's "
                             "'structured' extra)") from None
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=self.eos)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return xgrammar

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled constraint (one per request; :meth:`matcher` per sequence).

        Raises:
            ValueError: naming ``structured_outputs.<field>`` for a constraint XGrammar cannot compile.
        """
        self._xgr()
        kind = params.kind
        ws = not params.disable_any_whitespace
        try:
            if kind in ("json", "json_object"):
                schema = ('{"type": "object"}' if kind == "json_object" else
                          params.json if isinstance(params.json, str) else json.dumps(params.json))
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=ws,
                                                              max_whitespace_cnt=MAX_WHITESPACE if ws else None)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(params.regex)
            elif kind == "choice":  # (JSON string literals are valid GBNF literals)
                alternatives = " | ".join(json.dumps(c) for c in params.choice)
                compiled = self._compiler.compile_grammar("root ::= " + alternatives)
            else:
                compiled = self._compiler.compile_grammar(params.grammar)
        except Exception as e:  # noqa: BLE001 - XGrammar raises RuntimeError / ValueError with its parser's text
            raise ValueError(f"structured_outputs.{'json' if kind == 'json_object' else kind}: cannot be compiled: "
                             f"{str(e).strip()[:300]}") from None
        return compiled

    def matcher(self, compiled: Any) -> Any:
        """A fresh ``GrammarMatcher`` (one sequence's state) over a :meth:`compile` result."""
        return self._xgr().GrammarMatcher(compiled)


class DraftPosition:
    """A constrained sequence seen ``len(extra)`` draft tokens ahead (speculative verification
    and drafting score several positions of one sequence in one pass): its mask is the
    matcher's after those tokens."""

    __slots__ = ("matcher", "extra")

    def __init__(self, matcher: Any, extra: list[int]) -> None:
        self.matcher, self.extra = matcher, extra


def fill_bitmask(matchers: list[Any], vocab_size: int) -> Any:
    """int32 ``[len(matchers), ceil(vocab_size / 32)]`` (CPU): row i's bit j of word w allows
    token ``32 * w + j`` (XGrammar's layout). An item may be a :class:`DraftPosition`: its
    drafts are accepted, the mask filled, and the drafts rolled back; a position behind a draft
    the grammar refuses gets every token (it cannot be reached: that draft's own mask rejects it)."""
    import xgrammar
    mask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        extra: Any = ()
        if isinstance(m, DraftPosition):
            m, extra = m.matcher, m.extra
        accepted = 0
        for t in extra:
            if m.is_terminated() or not m.accept_token(int(t)):
                break
            accepted += 1
        if accepted < len(extra):
            mask[i] = -1
        elif m.is_terminated():  # complete and past its EOS (ignore_eos): only stop tokens may follow
            mask[i] = 0
            for t in m.stop_token_ids:
                mask[i, t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)
        else:
            m.fill_next_token_bitmask(mask, i)
        if accepted:
            m.rollback(accepted)
    return mask


def advance(request: Any, new_token_ids: list[int]) -> None:
    """Feed ``request``'s newly kept tokens to its matcher (no-op without one). A token the
    grammar refuses cannot have been sampled (it was masked); if one is, the matcher stops
    constraining and the request keeps running rather than failing every later step."""
    m = getattr(request, "grammar", None)
    if m is None:
        return
    for tok in new_token_ids:
        if m.is_terminated():
            return
        if not m.accept_token(int(tok)):
            log.warning("structured_outputs: %s generated token %d outside its grammar (was every allowed token "
                        "masked, e.g. EOS by min_tokens?); it runs unconstrained from here", request.request_id, tok)
            request.grammar = None
            return
