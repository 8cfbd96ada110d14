"""Sampling parameters, with vLLM's field names and defaults."""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5
LOGIT_BIAS_LIMIT = 1e10  # |bias| accepted by SamplingParams
#: Most sequences one request may ask for (``n``): each becomes a sequence the engine tracks,
#: so an absurd count must fail here, not while the engine builds them.
MAX_N = 4096


def _short(v: Any, limit: int = 80) -> str:
    """``repr(v)``, cut to ``limit`` characters (an error message must not echo a huge value)."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def _finite_number(v: Any) -> bool:
    """A real number (not bool) that is finite as a float (an int past float's range is not)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


class RequestOutputKind(enum.IntEnum):
    """What each :class:`~kvforge.engine.outputs.RequestOutput` of a running request holds
    (vLLM's enum and values).

    CUMULATIVE: everything so far (text, token_ids, logprobs), every step that added tokens.
    DELTA: only what is new since the previous output of that request; ``prompt_logprobs``
        as they are computed; ``cumulative_logprob``, ``finish_reason`` as in CUMULATIVE.
    FINAL_ONLY: one output, when the request has finished (what ``LLM.generate`` uses).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request. Field names and meanings follow vLLM.

    Attributes:
        n: number of independent completions (1 .. ``MAX_N``).
        temperature: softmax temperature (>= 0); below 1e-5 means greedy.
        top_p: nucleus mass in (0, 1] (Holtzman et al. 2020).
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: keep tokens with p >= min_p * p_max, in [0, 1].
        presence_penalty, frequency_penalty: OpenAI-style, in [-2, 2], on generated tokens.
        repetition_penalty: CTRL-style (Keskar et al. 2019), > 0, on prompt and generated tokens.
        seed: per-request RNG seed. The noise of output token j depends only on (seed, j)
            (:mod:`kvforge.engine.position_noise`), so results do not depend on batch mates,
            async scheduling or speculative decoding (seeded drafts are verified by a
            coupling that emits exactly what plain sampling would).
        stop: strings that end generation (not included unless include_stop_str_in_output).
        stop_token_ids: extra token ids that end generation (included in the output;
            duplicates dropped).
        ignore_eos: keep generating after EOS.
        max_tokens: generated tokens cap (None = up to max_model_len).
        min_tokens: EOS and stop_token_ids are masked until this many tokens exist, and the
            text of the first min_tokens tokens is not searched for stop strings (vLLM's rule).
        logprobs: return this many top log-probabilities per generated token (plus the sampled
            one); -1 means the whole vocabulary (needs ``model.max_logprobs`` -1 or >= vocab).
        prompt_logprobs: the same for prompt tokens.
        logit_bias: token id -> additive bias applied to logits (finite, |bias| <= 1e10).
        allowed_token_ids: if set (non-empty), only these tokens can be sampled.
        bad_words: words that must not be generated. Each is encoded as it stands and with
            one leading space; a one-token form is never sampled, and a longer form's last
            token is banned whenever the output ends with the rest of it (vLLM's rule). Text
            that reaches the same word through another tokenization is not caught.
        truncate_prompt_tokens: keep only the last k prompt tokens (k >= 1); -1 means
            ``max_model_len``. Larger than ``max_model_len`` is refused.
        output_kind: :class:`RequestOutputKind` of the engine's outputs for this request.
        structured_outputs: a :class:`~kvforge.engine.structured_outputs.StructuredOutputsParams`
            (or a dict of its fields): the output must match a JSON schema, regex, choice or grammar.
        skip_special_tokens, spaces_between_special_tokens: detokenizer options.

    Raises:
        ValueError: naming the field, for any value out of range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Any = None
    extra_args: dict[str, Any] = field(default_factory=dict)
    #: ``bad_words`` as token-id sequences; set by :meth:`update_from_tokenizer`.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._verify_types()
        # numpy integers pass the checks; Python ints from here on (torch.Generator.manual_seed
        # refuses numpy's, and seed + i must not wrap at 64 bits)
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed",
                     "truncate_prompt_tokens"):
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        # duplicates dropped (first occurrence kept): the list is checked at every step
        self.stop_token_ids = list(dict.fromkeys(int(t) for t in self.stop_token_ids or []))
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(int(t) for t in self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        self.output_kind = RequestOutputKind(self.output_kind)
        from kvforge.engine.structured_outputs import StructuredOutputsParams
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self._verify()

    def _verify_types(self) -> None:
        """Types first, so a wrong type never reaches the sampler (where it would fail the
        whole step's batch). bool is not accepted where a number is meant."""
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"{name}: {msg}, got {_short(getattr(self, name))}")

        def is_int(v: Any) -> bool:  # numpy integers too
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not _finite_number(getattr(self, name)):
                raise bad(name, "must be a finite number")
        for name in ("n", "top_k", "min_tokens"):
            if not is_int(getattr(self, name)):
                raise bad(name, "must be an integer")
        if self.n > MAX_N:  # before any per-sequence work (the engine builds n requests)
            raise bad("n", f"must be <= {MAX_N}")
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
            if getattr(self, name) is not None and not is_int(getattr(self, name)):
                raise bad(name, "must be an integer or None")
        if self.seed is not None and (not is_int(self.seed) or not -2 ** 63 <= self.seed < 2 ** 63):
            raise bad("seed", "must be a 64-bit signed integer or None")
        if self.stop is not None and not isinstance(self.stop, str) and (
                not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) for x in self.stop)):
            raise bad("stop", "must be a string or a list of strings")
        if self.stop_token_ids is not None and (not isinstance(self.stop_token_ids, (list, tuple))
                                                or not all(is_int(t) for t in self.stop_token_ids)):
            raise bad("stop_token_ids", "must be a list of integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be a dict of token id -> bias")
            for k, v in self.logit_bias.items():
                try:
                    ok = int(k) == float(k) and not isinstance(k, bool)
                except (TypeError, ValueError, OverflowError):
                    ok = False
                if not ok or not _finite_number(v):
                    raise bad("logit_bias", "must map integer token ids to finite numbers")
        if self.allowed_token_ids is not None and (not isinstance(self.allowed_token_ids, (list, tuple))
                                                   or not all(is_int(t) for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a list of integers or None")
        if self.bad_words is not None and not isinstance(self.bad_words, str) and (
                not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words)):
            raise bad("bad_words", "must be a string or a list of strings")
        if not (isinstance(self.output_kind, RequestOutputKind) or (
                is_int(self.output_kind) and self.output_kind in tuple(RequestOutputKind))):
            raise bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        if self.extra_args is None:  # vLLM's default
            self.extra_args = {}
        if not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), (bool, numbers.Integral)) or getattr(self, name) not in (0, 1):
                raise bad(name, "must be a bool")

    def _verify(self) -> None:
        def bad(name: str, msg: str) -> ValueError:
            return ValueError(f"{name}: {msg}, got {_short(getattr(self, name))}")

        if self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.stop and not self.detokenize:  # (as vLLM: they are matched in the text)
            raise bad("stop", "stop strings need detokenize=True")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (disabled) or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < -1:
            raise bad("logprobs", "must be >= 0, or -1 for the whole vocabulary")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise bad("prompt_logprobs", "must be >= 0, or -1 for the whole vocabulary")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise bad("truncate_prompt_tokens", "must be >= 1, or -1 for max_model_len")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise bad("allowed_token_ids", "must not be empty (None allows every token)")
        if self.allowed_token_ids is not None and self.structured_outputs is not None:
            raise bad("allowed_token_ids", "cannot be combined with structured_outputs (its grammar decides which "
                                           "tokens may follow)")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise bad("bad_words", "must not contain empty or blank strings")
        # A larger bias overflows float32 logits to inf (then NaN probabilities); OpenAI's API
        # allows [-100, 100], and 1e10 already forces or bans a token.
        if self.logit_bias and not all(abs(v) <= LOGIT_BIAS_LIMIT for v in self.logit_bias.values()):
            raise bad("logit_bias", f"values must be finite and within [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative")

    def verify_vocab(self, vocab_size: int) -> None:
        """Check token ids against the model's vocabulary; raise ValueError naming the field."""
        if self.logit_bias:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"logit_bias: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or () if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name}: ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Encode ``bad_words`` into token-id sequences (:mod:`kvforge.engine.bad_words`).

        Raises:
            ValueError: ``bad_words`` set but no tokenizer, or a word that encodes to nothing.
        """
        if not self.bad_words:
            self._bad_words_token_ids = None
            return
        if tokenizer is None:
            raise ValueError("bad_words: needs the model's tokenizer (it was not loaded)")
        from kvforge.engine.bad_words import encode_bad_words
        self._bad_words_token_ids = encode_bad_words(tokenizer, self.bad_words)

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """``bad_words`` as token-id sequences (empty until :meth:`update_from_tokenizer`)."""
        return self._bad_words_token_ids or []

    @property
    def reads_history(self) -> bool:
        """Whether sampling reads the generated token ids (repetition/frequency/presence
        penalties, bad words of several tokens, structured outputs), so each token must be on
        the host before the next is sampled."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or any(len(seq) > 1 for seq in self.bad_words_token_ids) or self.structured_outputs is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: Any) -> "SamplingParams":
        from dataclasses import replace
        return replace(self, **changes)
