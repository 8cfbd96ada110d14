"""Speculative decoding orchestration: proposals, verification, the adaptive rule, metrics.

One engine step with speculation (DESIGN.md, core loop):

1. the scheduler gives each speculating decode ``1 + len(request.spec_token_ids)``
   tokens, the drafts in lookahead slots (trimmed to the token budget / free blocks);
2. the target scores all of them in one flattened forward;
3. :meth:`SpeculativeDecoder.sample` verifies the drafts with the
   :class:`~kvforge.engine.rejection_sampler.RejectionSampler` (and samples the
   other requests with the ordinary sampler);
4. ``scheduler.update`` appends the emitted tokens (stopping at EOS / stop ids /
   max_tokens token by token) and rolls back the rejected drafts' KV slots;
5. :meth:`SpeculativeDecoder.propose` asks the drafter for the next drafts of every
   running decode that may speculate.

Per request (:mod:`kvforge.engine.request_choices`):
``SamplingParams(extra_args={"kvforge": {"drafter": "none"}})`` opts out of speculation;
``{"drafter": "ngram"}`` picks another drafter the operator allows in
``request_choices.drafters`` (built with default settings next to ``speculative.method``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from kvforge.engine.rejection_sampler import RejectionSampler
from kvforge.engine.spec_adaptive import AdaptiveSpeculation, StepCostMeter
from kvforge.engine.request import Request, RequestStatus
from kvforge.interfaces import DraftProposal, Drafter

log = logging.getLogger("kvforge")

__all__ = ["chosen_drafter", "SpecStats", "AdaptiveSpeculation", "SpeculativeDecoder"]


def chosen_drafter(request: Request, default: str | None) -> str | None:
    """The drafter ``request`` speculates with: its per-request choice
    ``extra_args={"kvforge": {"drafter": NAME}}`` (validated when it was added,
    :mod:`kvforge.engine.request_choices`), else ``default`` (``speculative.method``).
    None (the choice ``"none"``) = no speculation."""
    from kvforge.engine.request_choices import NO_DRAFTER, get_choice
    name = get_choice(request, "drafter", default)
    return None if name == NO_DRAFTER else name


@dataclass
class SpecStats:
    """Speculation counters (one request's, or the engine's).

    Attributes:
        num_drafts: verification rounds (steps in which drafts were verified).
        num_draft_tokens / num_accepted_tokens: drafts verified / accepted.
        drafted_per_position[j]: rounds that verified at least j + 1 drafts.
        accepted_per_position[j]: rounds whose draft j (0-based) was accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        grow = num_draft_tokens - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for j in range(num_draft_tokens):
            self.drafted_per_position[j] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    def metrics(self, prefix: str = "spec_") -> dict[str, float]:
        """``acceptance_rate`` = accepted / draft tokens; ``mean_accepted_length`` = tokens
        emitted per verification round (accepted drafts + the one target token);
        ``acceptance_rate_pos_j`` = accepted / verified drafts at position j."""
        out = {f"{prefix}num_drafts": float(self.num_drafts),
               f"{prefix}num_draft_tokens": float(self.num_draft_tokens),
               f"{prefix}num_accepted_tokens": float(self.num_accepted_tokens),
               f"{prefix}acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
               if self.num_draft_tokens else 0.0,
               f"{prefix}mean_accepted_length": 1.0 + self.num_accepted_tokens / self.num_drafts
               if self.num_drafts else 0.0}
        for j, (d, a) in enumerate(zip(self.drafted_per_position, self.accepted_per_position)):
            out[f"{prefix}acceptance_rate_pos_{j}"] = a / d if d else 0.0
        return out


class SpeculativeDecoder:
    """Engine-side speculation: owns the drafters, the rejection sampler, the adaptive
    rule (one per drafter) and the metrics. Used by :class:`~kvforge.engine.llm_engine.LLMEngine`.

    Args:
        drafters: name -> built drafter (``num_speculative_tokens`` = k each).
        default: the drafter of requests that choose none (``speculative.method``; may be None).
        config: the ``speculative`` config section.
        vocab_size: target vocabulary (drafts outside it are cut off).
        generator: RNG for unseeded requests (the sampler's).
        max_model_len: drafts never reach past it.
        needs_hidden_states: the names of the drafters that get the target's hidden states.
    """

    def __init__(self, drafters: dict[str, Drafter], default: str | None, config, vocab_size: int,
                 generator: torch.Generator | None, max_model_len: int,
                 needs_hidden_states: Iterable[str] = ()) -> None:
        self.drafters = dict(drafters)
        self.default = default
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.needs_hidden = set(needs_hidden_states) & set(self.drafters)
        self.rejection_sampler = RejectionSampler(vocab_size, generator)
        self.meter = StepCostMeter() if config.adaptive and config.measure_step_cost else None
        self.adaptive = {name: AdaptiveSpeculation(d.num_speculative_tokens, config,
                                                   getattr(d, "relative_cost", 0.0), self.meter)
                         for name, d in self.drafters.items()}
        self.totals = SpecStats()
        self.last_k: dict[str, int] = {name: 0 for name in self.drafters}
        self._probs: dict[str, torch.Tensor] = {}
        self._hidden: dict[str, torch.Tensor] = {}
        self._drafted_by: dict[str, str] = {}
        self._warned = False

    # -- verification -------------------------------------------------------------------
    def sample(self, ex, so, sampler) -> dict[str, tuple[list[int], list, list[float]]]:
        """Sample every request of ``ex.sample_requests``: verify the drafts of those in
        ``so.spec_token_ids``, plain-sample the others. Returns request_id ->
        (tokens, per-token logprobs dicts or None, per-token raw logprobs)."""
        reqs = ex.sample_requests
        drafts = [so.spec_token_ids.get(r.request_id, []) for r in reqs]
        row_of, off = [], 0
        for d in drafts:
            row_of.append(off)
            off += 1 + len(d)
        spec = [i for i, d in enumerate(drafts) if d]
        plain = [i for i, d in enumerate(drafts) if not d]
        out: dict[str, tuple[list[int], list, list[float]]] = {}
        final_row: dict[str, int] = {}
        dev = ex.logits.device
        if plain:
            if not spec:
                logits = ex.logits
            else:
                logits = ex.logits.index_select(0, torch.tensor([row_of[i] for i in plain], device=dev))
            sout = sampler(logits, [reqs[i] for i in plain])
            for j, i in enumerate(plain):
                rid = reqs[i].request_id
                out[rid] = ([sout.sampled_token_ids[j]], [sout.logprobs[j]], [sout.sampled_logprobs[j]])
                final_row[rid] = row_of[i]
        if spec:
            rows = [row_of[i] + j for i in spec for j in range(1 + len(drafts[i]))]
            logits = ex.logits.index_select(0, torch.tensor(rows, device=dev))
            probs = []
            for i in spec:
                q = self._probs.get(reqs[i].request_id)
                probs.append(q[:len(drafts[i])] if q is not None else None)
            vout = self.rejection_sampler(logits, [reqs[i] for i in spec], [drafts[i] for i in spec], probs)
            observed: dict[str, list[int]] = {}
            for j, i in enumerate(spec):
                req, a, k = reqs[i], vout.num_accepted[j], len(drafts[i])
                out[req.request_id] = (vout.token_ids[j], vout.logprobs[j], vout.sampled_logprobs[j])
                final_row[req.request_id] = row_of[i] + a
                if req.spec_stats is None:
                    req.spec_stats = SpecStats()
                req.spec_stats.record(k, a)
                self.totals.record(k, a)
                acc = observed.setdefault(self._drafted_by.get(req.request_id, ""), [0, 0])
                acc[0] += a + (1 if a < k else 0)  # drafts tried: up to and including the first rejection
                acc[1] += a
            for name, (tried, accepted) in observed.items():
                if name in self.adaptive:
                    self.adaptive[name].observe(tried, accepted)
        for r in reqs:
            self._probs.pop(r.request_id, None)
        if self.needs_hidden and ex.hidden_states is not None:
            for r in reqs:
                self._hidden[r.request_id] = ex.hidden_states[final_row[r.request_id]]
        return out

    # -- proposals ----------------------------------------------------------------------
    def plan(self, requests: Iterable[Request], free_blocks: int | None = None) -> dict[str, list[Request]]:
        """Choose this step's k' per drafter (the adaptive rule, once per step) and return
        the running decodes that will get drafts, by drafter name (empty: none this step).

        ``free_blocks``: the target allocator's free KV blocks; at or below one per running
        request no drafts are made (the scheduler would drop them rather than preempt).
        Reads only lengths, so it is valid while a token is still on the device (async
        scheduling); :meth:`propose` then needs the real ids.
        """
        if self.meter is not None:
            self.meter.tick()
        requests = list(requests)
        running = [r for r in requests if r.status == RequestStatus.RUNNING]
        k_now = {name: a.choose(len(running)) if running else 0 for name, a in self.adaptive.items()}
        if free_blocks is not None and free_blocks <= len(running):
            k_now = dict.fromkeys(k_now, 0)
        self.last_k = k_now
        for r in running:
            if r.spec_token_ids:
                r.spec_token_ids = []
                self._probs.pop(r.request_id, None)
        groups: dict[str, list[Request]] = {}
        if any(k_now.values()):
            for r in running:
                if r.num_tokens - r.num_computed_tokens != 1:
                    continue
                name = chosen_drafter(r, self.default)
                if name is not None and k_now.get(name, 0) >= 1:
                    groups.setdefault(name, []).append(r)
        if self.meter is not None:
            # a pure-decode step: every live request runs and has one token to compute
            clean = bool(running) and len(running) == len(requests) and \
                all(r.num_tokens - r.num_computed_tokens <= 1 for r in running)
            k_step = max((k_now[name] for name in groups), default=0)
            self.meter.label(len(running), k_step, clean)
        return groups

    def propose(self, groups: dict[str, list[Request]]) -> None:
        """Set ``spec_token_ids`` of the requests :meth:`plan` chose (their ids must be known)."""
        for name, cands in groups.items():
            k = self.last_k[name]
            nums, keep = [], []
            for r in cands:
                if r.status != RequestStatus.RUNNING:  # ended while its last token was in flight
                    continue
                # Never draft past max_tokens or max_model_len: k drafts emit up to k + 1 tokens.
                n = min(k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1)
                if n >= 1 and (name not in self.needs_hidden or r.request_id in self._hidden):
                    keep.append(r)
                    nums.append(n)
            if keep:
                self._propose_with(name, keep, nums)

    def _propose_with(self, name: str, cands: list[Request], nums: list[int]) -> None:
        drafter = self.drafters[name]
        try:
            if name in self.needs_hidden:
                hidden = torch.stack([self._hidden[r.request_id] for r in cands])
                prop = drafter.propose(cands, nums, hidden)
            else:
                prop = drafter.propose(cands, nums)
        except Exception:  # a failing drafter costs speed, never requests
            log.exception("drafter %r: propose failed; this step runs without its drafts", name)
            return
        if not isinstance(prop, DraftProposal):
            prop = DraftProposal(dict(prop))
        empty = 0
        for r, n in zip(cands, nums):
            toks = list(prop.token_ids.get(r.request_id, ()))[:n]
            bad = next((j for j, t in enumerate(toks) if not (isinstance(t, int) and 0 <= t < self.vocab_size)),
                       None)
            if bad is not None:
                if not self._warned:
                    log.warning("drafter %r proposed token %r outside the vocabulary; drafts cut there",
                                name, toks[bad])
                    self._warned = True
                toks = toks[:bad]
            r.spec_token_ids = toks
            empty += not toks
            self._drafted_by[r.request_id] = name
            q = prop.probs.get(r.request_id)
            if toks and q is not None:
                self._probs[r.request_id] = q[:len(toks)]
        # No draft (e.g. no n-gram match) yields one token per step, as a rejection of the
        # first draft does: the adaptive rule counts it so, and turns off a drafter that
        # rarely proposes (a speculating step runs synchronously, so it is not free).
        if empty:
            self.adaptive[name].observe(empty, 0)

    # -- bookkeeping --------------------------------------------------------------------
    def forget_hidden(self, requests: Iterable[Request]) -> None:
        """Drop stored target hidden states of ``requests`` (a step ran without recording
        them); such a request gets drafts again after its next synchronous step."""
        if self._hidden:
            for r in requests:
                self._hidden.pop(r.request_id, None)

    def free(self, request: Request) -> None:
        """Forget ``request`` (finished, aborted or preempted): drafter state, stored q and hidden."""
        request.spec_token_ids = []
        self._probs.pop(request.request_id, None)
        self._hidden.pop(request.request_id, None)
        self._drafted_by.pop(request.request_id, None)
        for name, d in self.drafters.items():
            try:
                d.free(request)
            except Exception:
                log.exception("drafter %r: free failed for %s", name, request.request_id)

    def stats(self) -> dict[str, float]:
        out = self.totals.metrics()
        main = self.default if self.default in self.adaptive else next(iter(self.adaptive))
        out["spec_k"] = float(self.last_k.get(main, 0))
        out["spec_acceptance_estimate"] = self.adaptive[main].acceptance
        for d in self.drafters.values():
            out.update(d.stats())
        return out

    @staticmethod
    def request_metrics(requests: Iterable[Request]) -> dict[str, Any]:
        """Speculation metrics of a user request (summed over its ``n`` sequences)."""
        total = SpecStats()
        seen = False
        for r in requests:
            s = r.spec_stats
            if s is None:
                continue
            seen = True
            total.num_drafts += s.num_drafts
            total.num_draft_tokens += s.num_draft_tokens
            total.num_accepted_tokens += s.num_accepted_tokens
            for j, (d, a) in enumerate(zip(s.drafted_per_position, s.accepted_per_position)):
                if j >= len(total.drafted_per_position):
                    total.drafted_per_position.append(0)
                    total.accepted_per_position.append(0)
                total.drafted_per_position[j] += d
                total.accepted_per_position[j] += a
        return total.metrics() if seen else {}
