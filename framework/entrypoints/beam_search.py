"""Beam search for the offline API (``LLM.beam_search``), with vLLM's parameter and output names.

Algorithm: beam search as Hugging Face ``generate(num_beams=W, early_stopping=False)`` runs it,
so that it returns the same sequences. Every prompt keeps W live beams. Each step asks the
engine for one token of every live beam with its K most likely continuations (raw
log-probabilities), K = max(2, 1 + number of EOS ids) * W (Hugging Face's ``beams_to_keep``:
enough for W non-EOS candidates). Over all of a prompt's beams the candidates are ranked by
``cum_logprob``; of the best K, an EOS candidate ranked among the first W becomes a finished
hypothesis scored ``cum_logprob / num_generated ** length_penalty`` (the EOS counted), the
others are dropped, and the W best non-EOS candidates live on. A prompt stops early once it
has W finished hypotheses and its best live beam, scored at its current length, cannot beat
the worst of them. At ``max_tokens`` (or ``max_model_len``) the live beams finish too, and
the W best hypotheses by score are returned.

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


def candidates_per_beam(params: BeamSearchParams, num_eos: int) -> int:
    """K, the log-probabilities each beam asks for: max(2, 1 + EOS ids) * beam_width (EOS ids
    count only without ``ignore_eos``)."""
    return max(2, 1 + (0 if params.ignore_eos else num_eos)) * params.beam_width


def length_score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """``cum_logprob / num_generated ** length_penalty``, computed in the log domain so that no
    penalty overflows (an extreme one gives -0.0 or -inf, which still rank)."""
    if cum_logprob >= 0:
        return 0.0
    e = math.log(-cum_logprob) - length_penalty * math.log(max(1, num_generated))
    return -math.exp(e) if e < 709 else -math.inf


def score(seq: BeamSearchSequence, prompt_len: int, length_penalty: float) -> float:
    """:func:`length_score` of a sequence (EOS counts as generated)."""
    return length_score(seq.cum_logprob, len(seq.tokens) - prompt_len, length_penalty)


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
    width, lp = params.beam_width, params.length_penalty
    keep = candidates_per_beam(params, len(eos_token_ids))
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for t in range(max(max_new_tokens, default=0)):
        owners = [(i, b) for i, beams in enumerate(live) if t < max_new_tokens[i] for b in beams]
        if not owners:
            break
        cands = yield [b.tokens for _, b in owners]
        pool: dict[int, list[tuple[float, BeamSearchSequence, int, dict]]] = {}
        for (i, beam), entry in zip(owners, cands):
            pool.setdefault(i, []).extend((beam.cum_logprob + lp_.logprob, beam, tok, entry)
                                          for tok, lp_ in entry.items())
        for i, ranked in pool.items():
            ranked.sort(key=lambda c: c[0], reverse=True)  # (stable: ties keep the beams' order)
            running = []
            for rank, (cum, beam, tok, entry) in enumerate(ranked[:keep]):
                child = BeamSearchSequence(beam.tokens + [tok], beam.logprobs + [entry], cum)
                if tok in eos_token_ids and not params.ignore_eos:
                    if rank < width:
                        child.finish_reason, child.stop_reason = "stop", tok if tok in stop_ids else None
                        done[i].append(child)
                elif len(running) < width:
                    running.append(child)
            live[i] = running
            if len(done[i]) >= width and running:  # Hugging Face's early stop (early_stopping=False)
                worst = sorted(score(s, len(prompts[i]), lp) for s in done[i])[-width]
                if not length_score(running[0].cum_logprob, t + 1, lp) > worst:
                    live[i] = []
    for i, beams in enumerate(live):
        for b in beams:
            b.finish_reason = "length"
        plen = len(prompts[i])
        done[i] = sorted(done[i] + beams, key=lambda s: score(s, plen, lp), reverse=True)[:width]
    return done


def generated_text(tokenizer: Any, seq: BeamSearchSequence, prompt_len: int, include_stop_str: bool) -> str:
    """The text of ``seq``'s generated tokens; a final EOS is left out unless ``include_stop_str``."""
    ids = seq.tokens[prompt_len:]
    if seq.finish_reason == "stop" and not include_stop_str:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=not include_stop_str)


def run_offline(llm: Any, prompts: Any, params: BeamSearchParams, use_tqdm: bool) -> list[BeamSearchOutput]:
    """``LLM.beam_search``: validate everything, then run :func:`search` with steps of
    ``llm.generate`` (one-token requests; its lock, abort-on-interrupt and validation)."""
    from tqdm.auto import trange

    from kvforge.engine.sampling_params import SamplingParams
    from kvforge.engine.tokenizer import eos_token_ids, extra_eos_token_ids
    if not isinstance(params, BeamSearchParams):
        raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    eos = eos_token_ids(tok, engine.config.model.model)  # (as the engine's own set)
    stop_ids = set(extra_eos_token_ids(tok, eos))
    k = candidates_per_beam(params, len(eos))
    cap = engine.config.model.max_logprobs
    if 0 <= cap < k:
        raise ValueError(f"beam_width: {params.beam_width} needs {k} log-probabilities per step, over "
                         f"model.max_logprobs ({cap}); raise it or narrow the beam")
    prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
    ids = []
    for i, p in enumerate(prompts):
        try:
            engine.prepare_request(f"beam-check-{i}", p, SamplingParams(max_tokens=1))  # (queues nothing)
        except ValueError as e:
            raise ValueError(f"prompts[{i}]: {e}" if len(prompts) > 1 else str(e)) from None
        given = p.get("prompt_token_ids") if isinstance(p, dict) else None
        ids.append(list(given) if given is not None else tok.encode(p["prompt"] if isinstance(p, dict) else p))
    if not ids:
        return []
    room = [min(params.max_tokens, engine.max_model_len - len(t)) for t in ids]
    step_params = SamplingParams(max_tokens=1, logprobs=k, temperature=params.temperature, detokenize=False)
    bar = trange(max(room), desc="Beam search steps", disable=not use_tqdm, dynamic_ncols=True)

    def step(beams: list[list[int]]) -> list[dict]:
        outs = llm.generate([{"prompt_token_ids": b} for b in beams], step_params, use_tqdm=False)
        bar.update(1)
        return [o.outputs[0].logprobs[0] for o in outs]

    try:
        found = search(ids, params, step, set(eos), room, stop_ids)
    finally:
        bar.close()
    for seqs in found:
        for s in seqs:
            shown = s.tokens if params.include_stop_str_in_output or s.finish_reason != "stop" else s.tokens[:-1]
            s.text = tok.decode(shown, skip_special_tokens=not params.include_stop_str_in_output)
    return [BeamSearchOutput(seqs) for seqs in found]
