"""`ngram` drafter: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's
``ngram`` method).

For each request, the last n tokens of its context (prompt + output) are looked up
among its earlier tokens, for n from ``prompt_lookup_max`` down to
``prompt_lookup_min``; at the longest n that matches, the tokens that followed the
most recent earlier occurrence are proposed (k of them; a continuation that reaches
the end of the context wraps around as an overlapping copy, so a loop of period p is
predicted for all k tokens). Drafts are deterministic (the rejection sampler treats q as one-hot) and
cost no model forward, so they pay off on copy-heavy outputs (code edits, quoting,
summaries, repetitive text).

Lookup is O(1) per step: each request keeps, for every n, a hash map from n-gram to
the end of its latest occurrence, updated with the tokens added since the last step.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvforge import hookimpl
from kvforge.interfaces import Drafter, DraftProposal

KVFORGE_HOOK_API = "1"


class NgramSettings(BaseModel):
    """``speculative.settings`` of the ``ngram`` drafter (vLLM's names)."""

    model_config = ConfigDict(extra="forbid")
    prompt_lookup_min: int = Field(1, ge=1, description="Shortest n-gram that may match.")
    prompt_lookup_max: int = Field(4, ge=1, description="Longest n-gram tried first.")

    @model_validator(mode="after")
    def _order(self) -> "NgramSettings":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        return self


class _Index:
    """n -> {n-gram: end (exclusive) of its latest occurrence}, for n-grams ending before ``upto``."""

    __slots__ = ("maps", "upto")

    def __init__(self, sizes: range) -> None:
        self.maps = {n: {} for n in sizes}
        self.upto = 0


class NgramDrafter(Drafter):
    """Prompt-lookup drafter (see the module docstring)."""

    relative_cost = 0.0

    def __init__(self, num_speculative_tokens: int, settings: NgramSettings | None = None) -> None:
        settings = settings or NgramSettings()
        self.num_speculative_tokens = num_speculative_tokens
        self.sizes = range(settings.prompt_lookup_min, settings.prompt_lookup_max + 1)
        self._index: dict[str, _Index] = {}

    def _update(self, idx: _Index, req) -> None:
        """Index the n-grams ending at positions ``idx.upto + 1 .. num_tokens - 1``."""
        end = req.num_tokens - 1  # the suffix itself (ending at num_tokens) is the query, not a match
        if end <= idx.upto:
            return
        lo = max(0, idx.upto + 1 - self.sizes.stop + 1)
        toks = req.token_slice(lo, end)
        for e in range(max(idx.upto + 1, 1), end + 1):  # n-grams toks[e - n : e]
            for n in self.sizes:
                if e - n < lo:
                    break
                idx.maps[n][tuple(toks[e - n - lo:e - lo])] = e
        idx.upto = end

    def propose(self, requests, num_tokens, hidden_states=None) -> DraftProposal:
        out: dict[str, list[int]] = {}
        for req, k in zip(requests, num_tokens):
            idx = self._index.get(req.request_id)
            if idx is None:
                idx = self._index[req.request_id] = _Index(self.sizes)
            self._update(idx, req)
            total = req.num_tokens
            tail = req.token_slice(max(0, total - self.sizes.stop + 1), total)
            for n in reversed(self.sizes):
                if n > len(tail):
                    continue
                e = idx.maps[n].get(tuple(tail[len(tail) - n:]))
                if e is not None:
                    cont = req.token_slice(e, min(e + k, total))
                    # A match that runs into the suffix repeats with period total - e
                    # (an overlapping copy, as in LZ77): keep copying.
                    while len(cont) < k:
                        cont.append(cont[len(cont) - (total - e)])
                    out[req.request_id] = cont
                    break
        return DraftProposal(out)

    def free(self, request) -> None:
        self._index.pop(request.request_id, None)


def make_ngram(speculative_config, settings: NgramSettings, ctx) -> NgramDrafter:
    return NgramDrafter(speculative_config.num_speculative_tokens, settings)


@hookimpl
def kvforge_register_drafters(register) -> None:
    register("ngram", make_ngram, NgramSettings)
