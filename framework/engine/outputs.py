"""Request outputs with vLLM's field names (``RequestOutput``, ``CompletionOutput``)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability (natural log) of one token, its 1-based rank, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per position: token id -> Logprob (the sampled token plus the top ``logprobs``).
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt position; the first entry is None (no logits precede the first token).
PromptLogprobs = list["dict[int, Logprob] | None"]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``finish_reason`` is None while running, then ``"stop"`` (EOS, stop token or
    string), ``"length"`` (max_tokens or max_model_len), ``"abort"`` or ``"error"``.
    ``stop_reason`` is the stop string or token id that matched, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Output of a request so far (``finished`` tells whether it is final).

    ``error`` carries the message when ``finish_reason == "error"`` (kvforge extension).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Fold a later output of the same request into this one, in place (vLLM's method; a
        stream that skips outputs for a slow consumer uses it).

        ``aggregate``: both are DELTA outputs, so text, token ids, logprobs and prompt
        logprobs are appended per completion; otherwise the later completions replace these.
        Status fields (finish and stop reasons, cumulative logprob, ``finished``, ``error``,
        metrics) always come from ``next_output``.
        """
        self.finished = next_output.finished
        self.error = next_output.error
        self.metrics = dict(next_output.metrics)
        self.num_cached_tokens = next_output.num_cached_tokens
        if not aggregate:
            self.outputs = next_output.outputs
            self.prompt_logprobs = next_output.prompt_logprobs
            return
        if next_output.prompt_logprobs:
            self.prompt_logprobs = (self.prompt_logprobs or []) + next_output.prompt_logprobs
        mine = {c.index: c for c in self.outputs}
        for new in next_output.outputs:
            old = mine.get(new.index)
            if old is None:
                self.outputs.append(new)
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason = new.finish_reason
            old.stop_reason = new.stop_reason
