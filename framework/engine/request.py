"""The request: the one object that crosses plugin boundaries (DESIGN.md)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.engine.sampling_params import SamplingParams


#: Stands in for an output token that is sampled on the device but not yet copied back
#: (async scheduling); never fed to the model: the runner substitutes the device value.
PLACEHOLDER_TOKEN_ID = -1


class RequestStatus(enum.Enum):
    """WAITING -> RUNNING <-> PREEMPTED -> one FINISHED_* state."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = frozenset(s for s in RequestStatus if s.name.startswith("FINISHED"))


@dataclass(eq=False)
class Request:
    """One sequence being generated (a request with ``n > 1`` becomes n of these).

    Attributes:
        request_id: unique engine-wide (children of an n>1 request get ``"{parent}#{i}"``).
        parent_id / index: the user's request id and this completion's index.
        prompt_token_ids / output_token_ids: token ids (ints).
        num_computed_tokens: tokens whose KV is in the cache; catches up to ``num_tokens``.
        max_tokens: resolved cap on output tokens.
        eos_token_ids: ids that end generation unless ``ignore_eos``.
        extra_eos_token_ids: those of them that are not the tokenizer's own ``eos_token_id``
            (``generation_config.json``'s further ids). vLLM makes these stop_token_ids, so a
            request that ends on one reports it as ``stop_reason``; the tokenizer's EOS reports None.
        generator: per-request torch.Generator when ``sampling_params.seed`` is set.
        priority: lower value = more important (vLLM convention).
        spec_token_ids: draft tokens proposed for the next step (speculative decoding); not
            part of the sequence until verified. The scheduler reads (and may trim) them.
        spec_stats: per-request speculation counters
            (:class:`kvforge.engine.spec_decode.SpecStats`), None until the first draft.
        num_pending_tokens: under async scheduling, how many of the last output tokens
            are placeholders (``PLACEHOLDER_TOKEN_ID``) for tokens still being sampled on
            the device (0 or 1). Their count is exact, so length limits hold; their values
            are not known yet, so nothing may hash or detokenize them (see
            :attr:`num_known_tokens`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    extra_eos_token_ids: frozenset[int] = frozenset()
    parent_id: str | None = None
    index: int = 0
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    cache_salt: str | None = None
    spec_token_ids: list[int] = field(default_factory=list)
    spec_stats: Any = None
    num_pending_tokens: int = 0
    #: the XGrammar matcher of a request with ``structured_outputs`` (its state: the output so
    #: far), None otherwise (:mod:`kvforge.engine.structured_outputs`)
    grammar: Any = None
    #: ``sampling_params.stop_token_ids`` as a set: check_stop tests every new token against it
    #: (a list may hold up to the vocabulary's size offline)
    stop_token_set: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        self.stop_token_set = frozenset(self.sampling_params.stop_token_ids or ())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids are known on the host (``num_tokens`` minus placeholders)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """Token ids [lo, hi) across prompt and output without building the full list."""
        p = len(self.prompt_token_ids)
        if hi <= p:
            return self.prompt_token_ids[lo:hi]
        if lo >= p:
            return self.output_token_ids[lo - p:hi - p]
        return self.prompt_token_ids[lo:] + self.output_token_ids[:hi - p]

    def token_id_at(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    @property
    def is_finished(self) -> bool:
        return self.status in _FINISHED


def drop_placeholders(request: Request) -> None:
    """Remove the placeholder output tokens of a request that ends before they are known."""
    if request.num_pending_tokens:
        del request.output_token_ids[-request.num_pending_tokens:]
        request.num_pending_tokens = 0


def apply_stop_string(scheduler, request: Request, stop: str) -> None:
    """A stop string completed in ``request``'s text (the detokenizer cut it there): it is
    the stop reason, also when the same token hit max_tokens or a stop id (vLLM's order:
    the output processor's stop string overrides the scheduler's reason). An aborted or
    failed request keeps its reason."""
    if not request.is_finished:
        request.stop_reason = stop
        scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
    elif request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
        request.stop_reason = stop
        request.status = RequestStatus.FINISHED_STOPPED


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """Token-level stop check after a token was appended (stop strings are the
    detokenizer's job). Returns the finished status to apply, or None.

    Order (as in vLLM): min_tokens gates EOS/stop ids; then EOS, stop_token_ids,
    then max_tokens / max_model_len.
    """
    sp = request.sampling_params
    out = request.output_token_ids
    n_out = len(out)  # runs for every request every step: plain lengths, no properties
    last = out[-1]
    if n_out >= sp.min_tokens:
        if not sp.ignore_eos and last in request.eos_token_ids:
            if last in request.extra_eos_token_ids:
                request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if last in request.stop_token_set:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
    if n_out >= request.max_tokens or n_out + len(request.prompt_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
