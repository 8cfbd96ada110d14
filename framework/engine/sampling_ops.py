"""Batched tensor operations used by :class:`kvforge.engine.sampler.Sampler`.

Every function works on a whole batch ``[N, V]`` of float32 logits with per-row
parameters given as 1-D tensors, on whatever device the logits live on. None of
them synchronises with the device; the caller decides which ones to run from the
Python-side sampling parameters.

Sources of the algorithms:

* repetition penalty: Keskar et al. 2019, "CTRL" (arXiv:1909.05858), sec. 4.1, in the
  form used by Hugging Face ``RepetitionPenaltyLogitsProcessor`` (positive logits are
  divided by the penalty, negative ones multiplied).
* frequency / presence penalty: OpenAI API documentation, "Parameter details":
  ``mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence``.
* top-k: Fan et al. 2018 (arXiv:1805.04833); top-p (nucleus): Holtzman et al. 2020
  (arXiv:1904.09751); min-p: Nguyen et al. 2024 (arXiv:2407.01082). Which tokens are kept
  follows Hugging Face's ``TopKLogitsWarper``, ``TopPLogitsWarper`` and ``MinPLogitsWarper``.
* sampling: the "exponential race" form of the Gumbel-max trick: if ``E_i ~ Exp(1)``
  independently, ``argmax_i p_i / E_i`` is distributed as ``Categorical(p)`` (the minimum of
  independent exponentials with rates ``p_i`` lands on ``i`` with probability ``p_i``).
"""
from __future__ import annotations

import torch

__all__ = [
    "pad_token_lists",
    "apply_logit_bias",
    "apply_token_mask",
    "apply_allowed_tokens",
    "apply_token_mask_unless_empty",
    "apply_token_bitmask",
    "apply_repetition_penalty",
    "apply_frequency_presence_penalties",
    "apply_temperature",
    "apply_top_k_top_p_min_p",
    "exponential_race_sample",
    "logprobs_with_ranks",
]

_NEG_INF = float("-inf")


def long_tensor(values, device: torch.device) -> torch.Tensor:
    """int64 tensor on ``device`` from host values, uploaded without waiting for the stream (a
    plain ``torch.tensor(..., device=cuda)`` is a blocking copy)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def pad_token_lists(token_lists: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Pack ragged token-id lists into one int64 tensor ``[len(token_lists), max_len]``.

    Short rows are filled with ``pad`` (callers pass the vocab size so padded entries land
    in a throw-away extra column). ``max_len`` is at least 1 so the result is never empty.
    """
    width = max(1, max((len(t) for t in token_lists), default=0))
    rows = [t + [pad] * (width - len(t)) for t in token_lists]
    return long_tensor(rows, device)


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                     values: torch.Tensor) -> None:
    """Add ``values[j]`` to ``logits[rows[j], cols[j]]`` in place (OpenAI ``logit_bias``).

    Args:
        logits: float32 ``[N, V]``, modified in place.
        rows, cols: int64 ``[M]`` coordinates; repeated pairs accumulate.
        values: float32 ``[M]`` additive biases.
    """
    logits.index_put_((rows, cols), values, accumulate=True)


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """Set ``logits[rows[j], cols[j]] = -inf`` in place (used for ``min_tokens``).

    Args:
        logits: float32 ``[N, V]``, modified in place.
        rows, cols: int64 ``[M]`` coordinates.
    """
    # torch.full is a fill on the device; torch.tensor(value, device=cuda) would wait for the stream
    logits.index_put_((rows, cols), torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device))


def apply_token_mask_unless_empty(logits: torch.Tensor, rows: torch.Tensor, local_rows: torch.Tensor,
                                  cols: torch.Tensor) -> None:
    """As :func:`apply_token_mask` for ``logits[rows[local_rows[j]], cols[j]]``, but a row whose
    every entry would be -inf is left as it was: a ban (min_tokens, bad words) yields to a
    hard constraint (a grammar, ``allowed_token_ids``) that allows nothing else. On the device,
    no synchronization.

    Args:
        logits: float32 ``[N, V]``, modified in place.
        rows: int64 ``[R]`` distinct rows; local_rows, cols: int64 ``[M]``.
    """
    sub = logits.index_select(0, rows)
    banned = sub.clone()
    banned.index_put_((local_rows, cols), torch.full((), _NEG_INF, dtype=logits.dtype, device=logits.device))
    empty = torch.isneginf(banned).all(dim=-1, keepdim=True)
    logits.index_copy_(0, rows, torch.where(empty, sub, banned))


def apply_allowed_tokens(logits: torch.Tensor, rows: torch.Tensor, keep_rows: torch.Tensor,
                         keep_cols: torch.Tensor) -> None:
    """Set every entry of ``logits[rows]`` to -inf except the allowed ones, in place
    (``allowed_token_ids``).

    Args:
        logits: float32 ``[N, V]``, modified in place.
        rows: int64 ``[R]`` the rows restricted (distinct).
        keep_rows, keep_cols: int64 ``[M]``: ``logits[rows[keep_rows[j]], keep_cols[j]]`` stays.
    """
    banned = torch.ones(rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
    banned.index_put_((keep_rows, keep_cols), torch.zeros((), dtype=torch.bool, device=logits.device))
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(banned, _NEG_INF))


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set ``logits[rows[i], t] = -inf`` for every token t that row i's bitmask does not allow,
    in place (structured outputs).

    Args:
        logits: float32 ``[N, V]``, modified in place.
        rows: int64 ``[R]`` distinct rows.
        bitmask: int32 ``[R, W]`` with ``32 * W >= V``: bit j of word w allows token ``32 * w + j``
            (XGrammar's layout); on any device (moved to the logits').
    """
    v = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :v]
    logits.index_copy_(0, rows, logits.index_select(0, rows).masked_fill_(~allowed, _NEG_INF))


def _seen_mask(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[R, V]``: which ids occur in each row of ``token_ids`` (int64 ``[R, L]``, pad = V)."""
    seen = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=token_ids.device)
    seen.scatter_(1, token_ids, True)
    return seen[:, :vocab_size]


def apply_repetition_penalty(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                             penalty: torch.Tensor) -> None:
    """CTRL repetition penalty, in place, on the selected rows.

    Each distinct token in a row's context is penalised once: a positive logit is divided
    by the penalty, a non-positive one multiplied (Hugging Face
    ``RepetitionPenaltyLogitsProcessor``; Keskar et al. 2019).

    Args:
        logits: float32 ``[N, V]``, modified in place.
        rows: int64 ``[R]`` rows to penalise.
        token_ids: int64 ``[R, L]`` prompt + output ids of those rows, padded with ``V``.
        penalty: float32 ``[R]`` penalties (> 0; 1 = no effect).
    """
    vocab_size = logits.shape[1]
    sub = logits.index_select(0, rows)
    p = penalty.to(sub.dtype).unsqueeze(1)
    penalised = torch.where(sub < 0, sub * p, sub / p)
    sub = torch.where(_seen_mask(token_ids, vocab_size), penalised, sub)
    logits.index_copy_(0, rows, sub)


def apply_frequency_presence_penalties(logits: torch.Tensor, rows: torch.Tensor, output_ids: torch.Tensor,
                                       frequency: torch.Tensor, presence: torch.Tensor) -> None:
    """OpenAI frequency and presence penalties over generated tokens, in place.

    ``logit[j] -= frequency * count[j] + presence * (count[j] > 0)``, where ``count[j]`` is how
    often token ``j`` occurs among the row's generated tokens (OpenAI API docs).

    Args:
        logits: float32 ``[N, V]``, modified in place.
        rows: int64 ``[R]`` rows to penalise.
        output_ids: int64 ``[R, L]`` generated ids of those rows, padded with ``V``.
        frequency, presence: float32 ``[R]`` penalties.
    """
    vocab_size = logits.shape[1]
    counts = torch.zeros(output_ids.shape[0], vocab_size + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab_size]
    delta = frequency.to(logits.dtype).unsqueeze(1) * counts \
        + presence.to(logits.dtype).unsqueeze(1) * (counts > 0).to(logits.dtype)
    logits.index_copy_(0, rows, logits.index_select(0, rows) - delta)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Return ``logits / temperature[:, None]`` (float32 ``[N, V]``; temperature float32 ``[N]``, > 0)."""
    return logits / temperature.to(logits.dtype).unsqueeze(1)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor | None = None,
                            top_p: torch.Tensor | None = None,
                            min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Mask (set to -inf) the tokens removed by top-k, then top-p, then min-p; per row.

    Keeps exactly the tokens Hugging Face ``TopKLogitsWarper(k)``, ``TopPLogitsWarper(p)`` and
    ``MinPLogitsWarper(m)`` (``min_tokens_to_keep=1``), applied in that order, keep:

    * top-k keeps tokens whose logit is >= the k-th largest (ties at the boundary kept);
    * top-p sorts ascending, removes tokens whose cumulative probability is <= 1 - p, and
      always keeps the most likely token;
    * min-p removes tokens with probability < m * max probability (after top-k/top-p).

    Args:
        logits: float32 ``[N, V]`` (already divided by the temperature); not modified.
        top_k: int64 ``[N]``; values <= 0 or >= V disable top-k for the row. None: all off.
        top_p: float64 ``[N]`` in (0, 1]; 1 disables. float64 so that ``1 - p`` rounds to
            float32 exactly as HF's Python-float threshold does. None: all off.
        min_p: ``[N]`` in [0, 1]; 0 disables. None: all off.

    Returns:
        float32 ``[N, V]``: the kept logits unchanged, the rest -inf.
    """
    vocab_size = logits.shape[1]
    if top_k is not None or top_p is not None:
        # One ascending sort serves both filters. Masking top-k in sorted order yields the same
        # row HF's top-p sees (it sorts the top-k-masked scores), so softmax/cumsum agree bit for bit.
        sorted_vals, sorted_idx = logits.sort(dim=-1)
        if top_k is not None:
            k = torch.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k).to(torch.int64)
            kth_largest = sorted_vals.gather(1, (vocab_size - k).unsqueeze(1))
            sorted_vals = sorted_vals.masked_fill(sorted_vals < kth_largest, _NEG_INF)
        if top_p is not None:
            cum = sorted_vals.softmax(dim=-1).cumsum(dim=-1)
            threshold = (1.0 - top_p.to(torch.float64)).to(cum.dtype).unsqueeze(1)
            remove = cum <= threshold
            remove[:, -1] = False
            remove &= (top_p < 1.0).unsqueeze(1)
            sorted_vals = sorted_vals.masked_fill(remove, _NEG_INF)
        logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_vals)
    if min_p is not None:
        # Probabilities in the original order, as HF computes them.
        probs = logits.softmax(dim=-1)
        cutoff = min_p.to(probs.dtype).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < cutoff, _NEG_INF)
    return logits


def exponential_race_sample(probs: torch.Tensor, generators: list[torch.Generator | None],
                            default_generator: torch.Generator | None = None,
                            seeds: list[int | None] | None = None) -> torch.Tensor:
    """Sample one token per row as ``argmax(probs / E)`` with ``E ~ Exp(1)`` (Gumbel-max trick).

    Rows whose generator is not None draw their own full ``[V]`` noise row from it, so their
    result depends only on that generator (not on batch mates). All other rows share one
    ``[n, V]`` draw from ``default_generator`` (None = torch's global RNG).

    Args:
        probs: float32 ``[N, V]`` probabilities (rows need not be normalised; zeros never win).
        generators: length N, each None or a generator on ``probs.device``.
        default_generator: generator on ``probs.device`` for the other rows.
        seeds: per row None, or a seed its generator is re-seeded with just before its draw
            (position-keyed noise, :mod:`kvforge.engine.position_noise`; one generator may
            then serve several rows).

    Returns:
        int64 ``[N]`` sampled token ids.
    """
    n, vocab_size = probs.shape
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(generators) if g is None]
    if len(shared) == n:
        noise.exponential_(generator=default_generator)
    else:
        if shared:
            draw = torch.empty(len(shared), vocab_size, dtype=probs.dtype, device=probs.device)
            draw.exponential_(generator=default_generator)
            idx = long_tensor(shared, probs.device)
            noise.index_copy_(0, idx, draw)
        for i, g in enumerate(generators):
            if g is not None:
                if seeds is not None and seeds[i] is not None:
                    g.manual_seed(seeds[i])
                noise[i].exponential_(generator=g)
    # Exp(1) draws of exactly 0 would give 0/0 on masked tokens; clamp to the smallest normal.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def logprobs_with_ranks(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax of ``logits`` at ``token_ids`` plus the ``num_top`` most likely tokens, with ranks.

    Rank is ``1 + #tokens whose logprob is strictly greater`` (ties share a rank). The ranks of
    the top tokens come from comparing the top values among themselves, which is exact because
    every value greater than a top value is itself among the top values.

    Args:
        logits: float32 ``[M, V]`` raw logits.
        token_ids: int64 ``[M]`` one chosen token per row.
        num_top: how many top tokens per row (clamped to V; may be 0).

    Returns:
        ``(token_logprob [M] f32, token_rank [M] i64, top_ids [M, K] i64, top_logprobs [M, K] f32,
        top_ranks [M, K] i64)`` with ``K = min(num_top, V)``.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))
    token_rank = (logprobs > token_lp).sum(dim=-1) + 1
    k = min(num_top, logprobs.shape[1])
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    top_ranks = (top_lp.unsqueeze(1) > top_lp.unsqueeze(2)).sum(dim=-1) + 1
    return token_lp.squeeze(1), token_rank, top_ids, top_lp, top_ranks
