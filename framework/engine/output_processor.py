"""Turns per-step token ids into RequestOutputs: detokenization, stop strings,
logprobs, fan-in of the ``n`` child sequences of one user request, and the request's
``output_kind`` (cumulative, delta or final only)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvforge.engine.detokenizer import IncrementalDetokenizer
from kvforge.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.sampling_params import RequestOutputKind
from kvforge.engine.structured_outputs import advance


def _done(r: Request) -> bool:
    return r.is_finished and not r.num_pending_tokens


@dataclass
class _Child:
    request: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    # what earlier outputs carried (DELTA): characters of text, token ids, logprob entries
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    arrival_time: float
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    prompt_logprobs: list | None = None
    sent_prompt_logprobs: int = 0  # entries of prompt_logprobs earlier outputs carried (DELTA)
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class OutputProcessor:
    """Holds per-request output state; all methods are O(new tokens)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        first = children[0]
        kids = [_Child(c, IncrementalDetokenizer(self.tokenizer, c.prompt_token_ids, c.sampling_params),
                       [] if c.sampling_params.logprobs is not None else None) for c in children]
        p = _Parent(request_id, prompt, first.prompt_token_ids, kids, first.arrival_time,
                    first.sampling_params.output_kind)
        if first.sampling_params.prompt_logprobs is not None:
            p.prompt_logprobs = [None]
        self.parents[request_id] = p
        for c in children:
            self.child_to_parent[c.request_id] = request_id

    def parent_of(self, child_id: str) -> _Parent | None:
        pid = self.child_to_parent.get(child_id)
        return self.parents.get(pid) if pid is not None else None

    def _child(self, req: Request) -> _Child:
        parent = self.parent_of(req.request_id)
        return next(c for c in parent.children if c.request is req)

    def add_prompt_logprobs(self, req: Request, first: int, entries: list[dict[int, Logprob]]) -> None:
        """Record prompt logprobs for prompt positions ``first, first + 1, ...``.

        A position computed again (a preempted request recomputes its prompt) replaces its
        entry, so entries always sit at their own positions."""
        parent = self.parent_of(req.request_id)
        if parent is None or parent.prompt_logprobs is None or req.index != 0:
            return
        plp = parent.prompt_logprobs
        child = self._child(req)
        for pos, e in enumerate(entries, start=first):
            if pos >= len(parent.prompt_token_ids):
                break
            if pos > len(plp):
                raise RuntimeError(f"prompt_logprobs of {req.request_id!r}: position {pos} before {len(plp)}")
            for tid, lp in e.items():
                lp.decoded_token = child.detok.decoded_token(tid)
            if pos == len(plp):
                plp.append(e)
            else:
                plp[pos] = e

    def process_tokens(self, req: Request, num_new: int, logprobs: list[dict[int, Logprob] | None],
                       sampled_logprobs: list[float]) -> str | None:
        """Detokenize ``req``'s last ``num_new`` output tokens.

        Returns the stop string matched, if any; the request's ``output_token_ids``
        are then truncated to end at the token that completed it. A request that the last of
        them ended as EOS or a stop_token_id keeps that token in its ids but not in its text,
        unless ``include_stop_str_in_output`` (vLLM's rule for both; the scheduler has set
        the status already).
        """
        child = self._child(req)
        new = req.output_token_ids[len(req.output_token_ids) - num_new:]
        advance(req, new)  # (a structured output's grammar: before the next step's mask)
        if req.first_token_time is None and new:
            req.first_token_time = time.monotonic()
        token_stop = (bool(new) and req.status is RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str)
                      and not req.sampling_params.include_stop_str_in_output)
        stop, consumed = child.detok.update(new[:-1] if token_stop else new)
        if stop is None:
            consumed = num_new  # (the stop token stays in the ids and logprobs: only its text is left out)
        elif consumed < num_new:
            del req.output_token_ids[len(req.output_token_ids) - (num_new - consumed):]
        for i in range(consumed):
            child.cumulative_logprob += sampled_logprobs[i] if i < len(sampled_logprobs) else 0.0
            if child.logprobs is not None and i < len(logprobs) and logprobs[i] is not None:
                entry = logprobs[i]
                for tid, lp in entry.items():
                    lp.decoded_token = child.detok.decoded_token(tid)
                child.logprobs.append(entry)
        return stop

    def wants_output(self, parent_id: str) -> bool:
        """Whether an output of this request is due now: always, unless its ``output_kind``
        is FINAL_ONLY and it has not finished."""
        p = self.parents[parent_id]
        return p.output_kind != RequestOutputKind.FINAL_ONLY or all(_done(c.request) for c in p.children)

    def make_output(self, parent_id: str, now: float | None = None) -> RequestOutput:
        p = self.parents[parent_id]
        delta = p.output_kind == RequestOutputKind.DELTA
        outs = []
        for c in p.children:
            r = c.request
            # A placeholder (async scheduling) is not a token yet; a sequence whose last
            # token is still on the device is not finished for the caller either.
            known = len(r.output_token_ids) - r.num_pending_tokens
            if _done(r):
                c.detok.flush()  # the text of a trailing unfinished UTF-8 character, as decode() gives it
            text = c.detok.visible_text(_done(r))
            token_ids = r.output_token_ids[:known]
            logprobs = c.logprobs
            if delta:  # (visible text never shrinks; the ids can, when a stop string cuts them)
                text, c.sent_text = text[c.sent_text:], max(c.sent_text, len(text))
                token_ids, c.sent_tokens = token_ids[c.sent_tokens:], max(c.sent_tokens, known)
                if logprobs is not None:
                    logprobs, c.sent_logprobs = logprobs[c.sent_logprobs:], len(logprobs)
            outs.append(CompletionOutput(
                index=r.index, text=text, token_ids=token_ids,
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=list(logprobs) if logprobs is not None else None,
                finish_reason=r.status.finish_reason if _done(r) else None,
                stop_reason=r.stop_reason if _done(r) else None))
        prompt_logprobs = p.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs, p.sent_prompt_logprobs = prompt_logprobs[p.sent_prompt_logprobs:], len(prompt_logprobs)
        finished = all(_done(c.request) for c in p.children)
        errors = [c.request.error for c in p.children if c.request.error]
        first = min((c.request.first_token_time for c in p.children if c.request.first_token_time),
                    default=None)
        metrics = {"arrival_time": p.arrival_time}
        if first is not None:
            metrics["first_token_time"] = first
        if finished:
            metrics["finished_time"] = now or time.monotonic()
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids,
                             list(prompt_logprobs) if prompt_logprobs is not None else None, outs,
                             finished, num_cached_tokens=p.children[0].request.num_cached_tokens,
                             error=errors[0] if errors else None, metrics=metrics)

    def release_if_finished(self, parent_id: str) -> None:
        p = self.parents.get(parent_id)
        if p is not None and all(_done(c.request) for c in p.children):
            for c in p.children:
                self.child_to_parent.pop(c.request.request_id, None)
            del self.parents[parent_id]
