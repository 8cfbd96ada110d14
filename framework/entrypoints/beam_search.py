"""Beam search for the offline API (``LLM.beam_search``), with vLLM's parameter and output names.

Algorithm (Graves 2012 / the form Hugging Face ``generate(num_beams=...)`` runs): every prompt
keeps ``beam_width`` live beams. Each step asks the engine for one token of every live beam with
its ``2 * beam_width`` most likely continuations (raw log-probabilities); every beam's candidates
are scored ``beam.cum_logprob + logprob``, a candidate ending in EOS joins the prompt's finished
hypotheses, and the ``beam_width`` best of the others live on. When the live beams reach
``max_tokens`` (or ``max_model_len``) they finish too, and the ``beam_width`` best hypotheses by
``cum_logprob / num_generated ** length_penalty`` are returned. ``2 * beam_width`` candidates per
beam guarantee ``beam_width`` non-EOS ones whenever the vocabulary has them.

The engine sees each step as ordinary one-token requests whose prompt is the beam so far, so
beams sharing a prefix reuse its KV blocks when prefix caching is on (vLLM's design); without it
every step recomputes the beams' prompts. The search itself (:func:`search`) takes the step as a
function, so it is tested on its own against a search worked by hand.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvforge.engine.outputs import Logprob


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``.

    Attributes:
        beam_width: live beams per prompt and sequences returned (>= 1).
        max_tokens: most generated tokens per sequence (>= 1).
        ignore_eos: keep extending beams that would end in EOS (then every beam runs
            ``max_tokens``).
        temperature: of the one-token requests; it only changes the sampled token, which joins
            the candidates (vLLM's behaviour); 0 means greedy (the usual beam search).
        length_penalty: exponent of the generated length dividing the final score (> 0 favours
            longer sequences, as Hugging Face's).
        include_stop_str_in_output: keep the EOS token's text in ``text``.

    Raises:
        ValueError: naming the field, for a value out of range.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")
            setattr(self, name, int(v))
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                raise ValueError(f"{name}: must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")


@dataclass
class BeamSearchSequence:
    """One returned hypothesis. ``tokens`` holds the prompt and the generated tokens (vLLM's
    layout); ``logprobs`` one entry per generated token (the candidates the engine returned at
    that step); ``text`` is ``tokens`` decoded."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


#: One step: the beams' token lists -> per beam, candidate token id -> Logprob.
StepFn = Callable[[list[list[int]]], list[dict[int, Logprob]]]


def score(seq: BeamSearchSequence, prompt_len: int, length_penalty: float) -> float:
    """``cum_logprob / num_generated ** length_penalty`` (EOS counts as generated)."""
    return seq.cum_logprob / max(1, len(seq.tokens) - prompt_len) ** length_penalty


def search(prompts: Sequence[list[int]], params: BeamSearchParams, step: StepFn, eos_token_ids: set[int],
           max_new_tokens: Sequence[int], stop_ids: set[int] = frozenset()) -> list[list[BeamSearchSequence]]:
    """Run beam search for every prompt at once; per prompt, the best ``beam_width`` sequences.

    Args:
        prompts: token ids per prompt.
        step: one engine step over all live beams (see :data:`StepFn`).
        eos_token_ids: tokens that end a beam (unless ``params.ignore_eos``).
        max_new_tokens: per prompt, the most tokens it may generate (``max_tokens`` capped by
            the room ``max_model_len`` leaves).
        stop_ids: the EOS ids that are stop tokens (reported as ``stop_reason``), not the
            tokenizer's own EOS.
    """
    steps = search_steps(prompts, params, eos_token_ids, max_new_tokens, stop_ids)
    try:
        beams = next(steps)
        while True:
            beams = steps.send(step(beams))
    except StopIteration as done:
        return done.value


def search_steps(prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_ids: set[int],
                 max_new_tokens: Sequence[int], stop_ids: set[int] = frozenset()
                 ) -> Generator[list[list[int]], list[dict[int, Logprob]], list[list[BeamSearchSequence]]]:
    """:func:`search` as a generator, for callers whose step is asynchronous (the server): it
    yields each step's beams (token lists), takes their candidates through ``send`` and
    returns the result (``StopIteration.value``)."""
    width = params.beam_width
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for t in range(max(max_new_tokens, default=0)):
        owners = [(i, b) for i, beams in enumerate(live) if t < max_new_tokens[i] for b in beams]
        if not owners:
            break
        cands = yield [b.tokens for _, b in owners]
        pool: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), entry in zip(owners, cands):
            for tok, lp in entry.items():
                child = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [entry],
                                           beam.cum_logprob + lp.logprob)
                if tok in eos_token_ids and not params.ignore_eos:
                    child.finish_reason, child.stop_reason = "stop", tok if tok in stop_ids else None
                    done[i].append(child)
                else:
                    pool[i].append(child)
        for i in {i for i, _ in owners}:
            pool[i].sort(key=lambda s: s.cum_logprob, reverse=True)
            live[i] = pool[i][:width]
    for i, beams in enumerate(live):
        for b in beams:
            b.finish_reason = "length"
        plen = len(prompts[i])
        done[i] = sorted(done[i] + beams, key=lambda s: score(s, plen, params.length_penalty), reverse=True)[:width]
    return done


def generated_text(tokenizer: Any, seq: BeamSearchSequence, prompt_len: int, include_stop_str: bool) -> str:
    """The text of ``seq``'s generated tokens; a final EOS is left out unless ``include_stop_str``."""
    ids = seq.tokens[prompt_len:]
    if seq.finish_reason == "stop" and not include_stop_str:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=not include_stop_str)
