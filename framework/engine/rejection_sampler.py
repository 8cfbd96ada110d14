"""Verification of draft tokens: lossless speculative sampling.

Algorithm (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Alg. 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", Alg. 2). For one request with drafts ``x_1..x_k``, each drawn
from the drafter's distribution ``q_j``, and the target's distributions ``p_1..p_{k+1}``
scored in one forward:

* for j = 1..k: accept ``x_j`` with probability ``min(1, p_j(x_j) / q_j(x_j))``
  (implemented as ``u * q_j(x_j) < p_j(x_j)`` with ``u ~ U[0, 1)``);
* at the first rejection j, emit a token drawn from ``norm(max(0, p_j - q_j))`` and stop;
* if all k are accepted, emit a bonus token drawn from ``p_{k+1}``.

Every emitted token is then distributed exactly as the target would have sampled it
(Leviathan et al., Theorem 1). A deterministic drafter (n-gram lookup, a greedy
draft) has a one-hot ``q``: accept with probability ``p_j(x_j)``, and on rejection
draw from ``p_j`` with ``x_j`` removed. Greedy requests (temperature < 1e-5) accept
while the draft equals the target's argmax and then emit the target's argmax, which
makes their output identical to non-speculative greedy decoding.

``p`` is the target's *processed* distribution, computed exactly as
:class:`~kvforge.engine.sampler.Sampler` does (logit bias, min_tokens, penalties,
temperature, top-k/top-p/min-p; :mod:`kvforge.engine.sampling_ops`), where position j
sees the request's output plus the drafts before it. Returned log-probabilities are
raw, as the sampler's. Requests with a seed are verified by a coupling instead
(:mod:`kvforge.engine.position_noise`): the token plain sampling would emit at each
position is drawn with that position's noise, drafts are accepted while they equal it,
and the first unequal position emits it; their output is identical to decoding without
speculation, whatever the batch or the drafts.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import torch

from kvforge.engine.outputs import Logprob
from kvforge.engine.position_noise import position_seed
from kvforge.engine.request import Request
from kvforge.engine.sampler import Sampler
from kvforge.engine.sampling_ops import (apply_temperature, apply_top_k_top_p_min_p,
                                         exponential_race_sample)

__all__ = ["SequenceView", "VerifyOutput", "RejectionSampler", "rejection_sample", "process_logits",
           "warp_to_probs"]


class _Concat:
    """Read-only ``base + extra`` list without copying (len and iteration only)."""

    __slots__ = ("base", "extra")

    def __init__(self, base: list[int], extra: Sequence[int]) -> None:
        self.base, self.extra = base, extra

    def __len__(self) -> int:
        return len(self.base) + len(self.extra)

    def __iter__(self):
        return chain(self.base, self.extra)


class SequenceView:
    """A request as seen at one speculative position: its tokens followed by ``extra``
    (the drafts before that position). Quacks like a :class:`Request` for the sampler's
    logits processors (``sampling_params``, ``eos_token_ids``, ``output_token_ids``,
    ``all_token_ids``)."""

    __slots__ = ("request", "extra", "sampling_params", "eos_token_ids")

    def __init__(self, request: Request, extra: Sequence[int] = ()) -> None:
        self.request = request
        self.extra = list(extra)
        self.sampling_params = request.sampling_params
        self.eos_token_ids = request.eos_token_ids

    @property
    def output_token_ids(self):
        return _Concat(self.request.output_token_ids, self.extra) if self.extra else self.request.output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.extra

    @property
    def grammar(self):
        """The request's grammar matcher, seen past the drafts (structured outputs)."""
        m = self.request.grammar
        if m is None or not self.extra:
            return m
        from kvforge.engine.structured_outputs import DraftPosition
        return DraftPosition(m, self.extra)


def process_logits(logits: torch.Tensor, views: Sequence[SequenceView], vocab_size: int) -> torch.Tensor:
    """The sampler's steps 1-4 (bias, min_tokens, penalties) on a float32 copy of
    ``logits[:, :vocab_size]`` (``[R, V]``, one row per view); returns the copy."""
    work = logits[:, :vocab_size].to(torch.float32, copy=True)
    Sampler._apply_logits_processors(work, list(views), work.device, vocab_size)
    return work


def warp_to_probs(work: torch.Tensor, params: Sequence) -> torch.Tensor:
    """The sampler's step 5 without the draw: temperature, top-k, top-p, min-p, softmax.

    Args:
        work: float32 ``[R, V]`` processed logits of non-greedy rows; not modified.
        params: R :class:`SamplingParams`.
    Returns:
        float32 ``[R, V]`` probabilities (rows sum to 1).
    """
    dev = work.device
    vocab = work.shape[1]
    w = apply_temperature(work, torch.tensor([sp.temperature for sp in params], dtype=torch.float32, device=dev))
    ks = [sp.top_k if 0 < sp.top_k < vocab else 0 for sp in params]
    top_k = torch.tensor(ks, dtype=torch.int64, device=dev) if any(ks) else None
    top_p = torch.tensor([sp.top_p for sp in params], dtype=torch.float64, device=dev) \
        if any(sp.top_p < 1.0 for sp in params) else None
    min_p = torch.tensor([sp.min_p for sp in params], dtype=torch.float32, device=dev) \
        if any(sp.min_p > 0.0 for sp in params) else None
    if top_k is not None or top_p is not None or min_p is not None:
        w = apply_top_k_top_p_min_p(w, top_k, top_p, min_p)
    return w.softmax(dim=-1)


def _recovered_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The correction step: ``max(0, p - q)`` (unnormalised; the exponential race
    normalises). ``p``, ``q`` float32 ``[n, V]``."""
    return (p - q).clamp_min_(0.0)


def _uniforms(counts: list[int], generators: Sequence[torch.Generator | None],
              default_generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``sum(counts)`` U[0, 1) draws; request i's ``counts[i]`` come from its own generator if it has one."""
    total = sum(counts)
    shared = sum(c for c, g in zip(counts, generators) if g is None)
    pool = torch.rand(shared, generator=default_generator, device=device) if shared else None
    if shared == total:
        return pool if pool is not None else torch.empty(0, device=device)
    parts, used = [], 0
    for c, g in zip(counts, generators):
        if not c:
            continue
        if g is None:
            parts.append(pool[used:used + c])
            used += c
        else:
            parts.append(torch.rand(c, generator=g, device=device))
    return torch.cat(parts)


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: Sequence[Sequence[int]],
                     draft_probs: Sequence[torch.Tensor | None],
                     generators: Sequence[torch.Generator | None] | None = None,
                     default_generator: torch.Generator | None = None) -> tuple[list[list[int]], list[int]]:
    """Speculative sampling for a batch of non-greedy requests (the module's algorithm).

    Args:
        target_probs: float32 ``[sum_i (1 + k_i), V]``: request i's ``1 + k_i`` rows are
            consecutive, in request order: ``p_1..p_{k_i + 1}``.
        draft_token_ids: request i's ``k_i`` drafts (``k_i`` may be 0: plain sampling).
        draft_probs: request i's ``q`` as float32 ``[k_i, V]`` (row j = the distribution
            draft j was drawn from), or None for a deterministic drafter (one-hot ``q``).
        generators: per request, its generator or None (then ``default_generator``).

    Returns:
        ``(tokens, num_accepted)``: request i's emitted tokens, its accepted drafts followed
        by one recovered or bonus token (``num_accepted[i] + 1`` tokens).
    """
    n = len(draft_token_ids)
    gens = list(generators) if generators is not None else [None] * n
    dev = target_probs.device
    counts = [len(d) for d in draft_token_ids]
    starts, off = [], 0
    for c in counts:
        starts.append(off)
        off += c + 1
    if off != target_probs.shape[0]:
        raise ValueError(f"target_probs has {target_probs.shape[0]} rows, drafts need {off}")
    accepted = [0] * n
    q_reqs = [i for i in range(n) if counts[i] and draft_probs[i] is not None]
    q_start: dict[int, int] = {}  # request -> its first row in q_rows
    q_rows = None
    if sum(counts):
        rows = [s + j for s, c in zip(starts, counts) for j in range(c)]
        flat = [t for d in draft_token_ids for t in d]
        rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
        x = torch.tensor(flat, dtype=torch.int64, device=dev)
        p_x = target_probs[rows_t, x]
        q_x = torch.ones_like(p_x)
        if q_reqs:
            seg, pos, first = [], 0, {}
            for i in range(n):
                first[i] = pos
                pos += counts[i]
            off = 0
            for i in q_reqs:
                q_start[i] = off
                off += counts[i]
                seg.extend(range(first[i], first[i] + counts[i]))
            q_rows = torch.cat([draft_probs[i][:counts[i]] for i in q_reqs]).to(target_probs.dtype)
            seg_t = torch.tensor(seg, dtype=torch.int64, device=dev)
            q_x[seg_t] = q_rows.gather(1, x[seg_t].unsqueeze(1)).squeeze(1)
        u = _uniforms(counts, gens, default_generator, dev)
        ok = (u * q_x < p_x).tolist()
        pos = 0
        for i, c in enumerate(counts):
            a = 0
            while a < c and ok[pos + a]:
                a += 1
            accepted[i] = a
            pos += c
    final_rows = torch.tensor([s + a for s, a in zip(starts, accepted)], dtype=torch.int64, device=dev)
    dist = target_probs.index_select(0, final_rows)
    rejected = [i for i in range(n) if accepted[i] < counts[i]]
    if rejected:
        q_rej = torch.zeros(len(rejected), dist.shape[1], dtype=dist.dtype, device=dev)
        with_q = [(r, i) for r, i in enumerate(rejected) if i in q_start]
        one_hot = [(r, i) for r, i in enumerate(rejected) if i not in q_start]
        if with_q:
            dst = torch.tensor([r for r, _ in with_q], dtype=torch.int64, device=dev)
            src = torch.tensor([q_start[i] + accepted[i] for _, i in with_q], dtype=torch.int64, device=dev)
            q_rej.index_copy_(0, dst, q_rows.index_select(0, src))
        if one_hot:
            r_t = torch.tensor([r for r, _ in one_hot], dtype=torch.int64, device=dev)
            t_t = torch.tensor([draft_token_ids[i][accepted[i]] for _, i in one_hot], dtype=torch.int64, device=dev)
            q_rej[r_t, t_t] = 1.0
        idx = torch.tensor(rejected, dtype=torch.int64, device=dev)
        p_rej = dist.index_select(0, idx)
        rec = _recovered_distribution(p_rej, q_rej)
        # p == q up to rounding leaves no mass: fall back to p (a rejection was then ~impossible).
        empty = rec.sum(dim=-1, keepdim=True) <= 0
        dist.index_copy_(0, idx, torch.where(empty, p_rej, rec))
    final = exponential_race_sample(dist, gens, default_generator).tolist()
    tokens = [list(d[:a]) + [t] for d, a, t in zip(draft_token_ids, accepted, final)]
    return tokens, accepted


def coupled_verify(probs: torch.Tensor, requests: Sequence[Request],
                   draft_token_ids: Sequence[Sequence[int]]) -> list[tuple[list[int], int]]:
    """Verification of seeded requests by position-keyed noise (see the module docstring).

    Args:
        probs: float32 ``[sum_i (1 + k_i), V]`` warped target probabilities, request i's
            rows consecutive (its last token's position, then each draft's).
        requests: seeded requests (``generator`` set), their outputs not yet holding the drafts.
        draft_token_ids: request i's ``k_i`` drafts.
    Returns:
        per request ``(emitted tokens, accepted drafts)``: the accepted drafts plus the
        target's token at the first unequal position (or the bonus position).
    """
    gens, seeds = [], []
    for req, d in zip(requests, draft_token_ids):
        first = len(req.output_token_ids)
        for j in range(len(d) + 1):
            gens.append(req.generator)
            seeds.append(position_seed(req, first + j))
    target = exponential_race_sample(probs, gens, None, seeds).tolist()
    out, pos = [], 0
    for d in draft_token_ids:
        t = target[pos:pos + len(d) + 1]
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        out.append((list(d[:a]) + [t[a]], a))
        pos += len(d) + 1
    return out


@dataclass
class VerifyOutput:
    """Per request (in input order): emitted ``token_ids`` (accepted drafts + one
    recovered/bonus token), ``num_accepted`` drafts, and per emitted token the
    sampler-style ``logprobs`` (None entries unless asked) and raw ``sampled_logprobs``."""

    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[dict[int, Logprob] | None]]
    sampled_logprobs: list[list[float]]


class RejectionSampler:
    """Verifies drafts against the target's logits (see the module docstring).

    Args:
        vocab_size: the tokenizer's vocabulary size (extra logit columns are dropped).
        generator: RNG for requests without a seed, on the logits' device.
    """

    def __init__(self, vocab_size: int, generator: torch.Generator | None = None) -> None:
        self.vocab_size = vocab_size
        self.generator = generator

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 draft_token_ids: Sequence[Sequence[int]],
                 draft_probs: Sequence[torch.Tensor | None]) -> VerifyOutput:
        """Verify every request's drafts.

        Args:
            logits: float32 ``[sum_i (1 + k_i), V']`` raw target logits, ``V' >= vocab_size``;
                request i's rows are consecutive: its last token's position, then each draft's.
            requests: the requests (their token lists do not include the drafts yet).
            draft_token_ids: request i's ``k_i`` drafts.
            draft_probs: request i's ``q`` (float32 ``[k_i, V]``) or None (deterministic drafts).
        """
        n = len(requests)
        counts = [len(d) for d in draft_token_ids]
        starts, off = [], 0
        for c in counts:
            starts.append(off)
            off += c + 1
        if logits.shape[0] != off:
            raise ValueError(f"logits has {logits.shape[0]} rows, the drafts need {off}")
        raw = logits[:, : self.vocab_size]
        if Sampler.needs_logits_processing(requests):
            views = [SequenceView(req, d[:j]) for req, d in zip(requests, draft_token_ids) for j in range(len(d) + 1)]
            work = process_logits(raw, views, self.vocab_size)
        else:  # read-only below
            work = raw.float()
        dev = work.device
        tokens: list[list[int]] = [[] for _ in range(n)]
        accepted = [0] * n

        greedy = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
        if greedy:
            rows = [starts[i] + j for i in greedy for j in range(counts[i] + 1)]
            best = work.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev)).argmax(dim=-1).tolist()
            pos = 0
            for i in greedy:
                d, t = draft_token_ids[i], best[pos:pos + counts[i] + 1]
                a = 0
                while a < counts[i] and d[a] == t[a]:
                    a += 1
                tokens[i], accepted[i] = list(d[:a]) + [t[a]], a
                pos += counts[i] + 1

        seeded = [i for i in range(n) if not requests[i].sampling_params.greedy and requests[i].generator is not None]
        if seeded:
            rows = [starts[i] + j for i in seeded for j in range(counts[i] + 1)]
            sub = work.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev))
            probs = warp_to_probs(sub, [requests[i].sampling_params for i in seeded for _ in range(counts[i] + 1)])
            for i, (t, a) in zip(seeded, coupled_verify(probs, [requests[i] for i in seeded],
                                                        [draft_token_ids[i] for i in seeded])):
                tokens[i], accepted[i] = t, a

        rand = [i for i in range(n) if not requests[i].sampling_params.greedy and requests[i].generator is None]
        if rand:
            rows = [starts[i] + j for i in rand for j in range(counts[i] + 1)]
            sub = work.index_select(0, torch.tensor(rows, dtype=torch.int64, device=dev))
            probs = warp_to_probs(sub, [requests[i].sampling_params for i in rand for _ in range(counts[i] + 1)])
            # (unseeded requests only: all share the engine's generator)
            toks, acc = rejection_sample(probs, [draft_token_ids[i] for i in rand], [draft_probs[i] for i in rand],
                                         None, self.generator)
            for i, t, a in zip(rand, toks, acc):
                tokens[i], accepted[i] = t, a

        # Raw logprobs of every emitted token, as the sampler reports them.
        rows = [starts[i] + j for i in range(n) for j in range(accepted[i] + 1)]
        flat = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64, device=dev)
        params = [requests[i].sampling_params for i in range(n) for _ in range(accepted[i] + 1)]
        sout = Sampler._finish(raw.index_select(0, torch.tensor(rows, dtype=torch.int64, device=raw.device)),
                               flat.to(raw.device), params).result()
        lps, slps, pos = [], [], 0
        for i in range(n):
            m = accepted[i] + 1
            lps.append(sout.logprobs[pos:pos + m])
            slps.append(sout.sampled_logprobs[pos:pos + m])
            pos += m
        return VerifyOutput(tokens, accepted, lps, slps)
