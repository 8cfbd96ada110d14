"""Turns one step's logits into next tokens (and log-probabilities), vLLM V1 semantics.

Per row, on float32 logits (copied only when step 1-4 apply), in this order:

1. ``allowed_token_ids`` and a structured output's grammar: every other token is set to -inf;
   then ``logit_bias`` (additive);
2. ``min_tokens``: while fewer tokens than ``min_tokens`` were generated, EOS (unless
   ``ignore_eos``) and ``stop_token_ids`` are set to -inf; so are the tokens ``bad_words``
   bans (:mod:`kvforge.engine.bad_words`). Where these bans would leave a constrained row
   (grammar, ``allowed_token_ids``) no token at all, they yield for that step: the grammar's
   EOS ends the output even before min_tokens;
3. repetition penalty over prompt + output tokens (CTRL / Hugging Face style);
4. frequency and presence penalties over output tokens (OpenAI formula);
5. greedy rows (temperature < 1e-5) take the argmax; the others are divided by the
   temperature, filtered by top-k, top-p, min-p (Hugging Face's warper order and keep rules)
   and sampled with the exponential race (Gumbel-max) trick.

A step whose rows are all greedy, with no logprobs asked and nothing for steps 1-4, takes
one pass over the logits instead (:mod:`kvforge.engine.greedy_kernel`).

Returned log-probabilities are those of the raw incoming logits (vLLM V1's default
``raw_logprobs``), not of the processed distribution. The tensor kernels are in
:mod:`kvforge.engine.sampling_ops`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvforge.engine.bad_words import banned_tokens
from kvforge.engine.greedy_kernel import greedy_sample
from kvforge.engine.outputs import Logprob
from kvforge.engine.position_noise import position_seed
from kvforge.engine.request import Request
from kvforge.engine.sampling_ops import (
    apply_allowed_tokens,
    apply_frequency_presence_penalties,
    apply_logit_bias,
    apply_repetition_penalty,
    apply_temperature,
    apply_token_bitmask,
    apply_token_mask,
    apply_token_mask_unless_empty,
    apply_top_k_top_p_min_p,
    exponential_race_sample,
    logprobs_with_ranks,
    long_tensor,
    pad_token_lists,
)

__all__ = ["SamplerOutput", "PendingSamplerOutput", "Sampler", "compute_prompt_logprobs"]

_PROMPT_CHUNK = 512  # prompt positions per log-softmax chunk


@dataclass
class SamplerOutput:
    """What the sampler returns for a batch of N requests.

    Attributes:
        sampled_token_ids: one token id per row.
        logprobs: per row, None if that request's ``sampling_params.logprobs`` is None, else
            token id -> :class:`Logprob` for the sampled token plus the top-``logprobs`` tokens
            (raw log-softmax, 1-based rank).
        sampled_logprobs: raw log-probability of each sampled token (for cumulative_logprob).
    """

    sampled_token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    sampled_logprobs: list[float]


def _float(values: list[float], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _build_dict(token_id: int, token_lp: float, token_rank: int, top_ids: list[int],
                top_lps: list[float], top_ranks: list[int]) -> dict[int, Logprob]:
    """Sampled/target token first, then the top tokens in descending order."""
    out = {token_id: Logprob(token_lp, token_rank)}
    for tid, lp, rank in zip(top_ids, top_lps, top_ranks):
        if tid not in out:
            out[tid] = Logprob(lp, rank)
    return out


class Sampler:
    """Samples one token per request from a batch of logits (vLLM V1-compatible semantics).

    Args:
        vocab_size: the tokenizer's vocabulary size; logits columns beyond it (a padded
            lm_head) are dropped before anything else.
        generator: RNG for requests without a seed; must live on the logits' device.
            None uses torch's global RNG for that device.
    """

    def __init__(self, vocab_size: int, generator: torch.Generator | None = None):
        self.vocab_size = vocab_size
        self.generator = generator

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample the next token of every request.

        Args:
            logits: float32 ``[N, V]`` (N = len(requests)), on CPU or CUDA; row i belongs to
                ``requests[i]``. ``V >= vocab_size``; extra columns are ignored. Not modified.
            requests: the requests; their ``generator`` (if any) must be on ``logits.device``.

        Returns:
            :class:`SamplerOutput` with plain Python values.
        """
        return self.sample_async(logits, requests).result()

    def sample_async(self, logits: torch.Tensor, requests: list[Request],
                     num_generated: list[int] | None = None) -> "PendingSamplerOutput":
        """As :meth:`__call__`, but return before the results reach the host: the sampled
        tokens stay on the device (``.token_ids``, int64 ``[N]``) for the next step's inputs,
        and their copy to pinned host memory is already queued. ``.result()`` waits for it.
        Issues no host synchronization on CUDA when no request asks for penalties or
        logit_bias (those upload small index tensors) — neither does it otherwise in
        practice, since those uploads are non-blocking.

        ``num_generated``: per request, how many output tokens precede the one sampled
        now (``min_tokens``, seeded noise); default ``len(output_token_ids)``. A caller that
        samples after the step's placeholder tokens were appended passes the counts from
        before."""
        n = len(requests)
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [len(requests)={n}, V], got {tuple(logits.shape)}")
        if n == 0:
            return PendingSamplerOutput.empty(logits.device)
        raw = logits[:, : self.vocab_size]
        params = [r.sampling_params for r in requests]
        greedy_rows = [i for i, sp in enumerate(params) if sp.greedy]
        random_rows = [i for i, sp in enumerate(params) if not sp.greedy]
        process = self.needs_logits_processing(requests, num_generated)
        if not random_rows and not process and all(sp.logprobs is None for sp in params):
            tokens, sampled_lp = greedy_sample(raw)  # one pass over the logits on the GPU
            return PendingSamplerOutput(tokens, [sampled_lp], params, [])
        # A copy only when the processors write into it (temperature makes its own).
        work = raw.to(torch.float32, copy=process)
        device = work.device
        vocab = work.shape[1]
        if process:
            self._apply_logits_processors(work, requests, device, vocab, num_generated)
        if not random_rows:
            tokens = work.argmax(dim=-1)
        else:
            tokens = torch.empty(n, dtype=torch.int64, device=device)
            if greedy_rows:
                g_idx = long_tensor(greedy_rows, device)
                tokens.index_copy_(0, g_idx, work.index_select(0, g_idx).argmax(dim=-1))
            r_idx = None if len(random_rows) == n else long_tensor(random_rows, device)
            sub = work if r_idx is None else work.index_select(0, r_idx)
            sampled = self._sample(sub, [requests[i] for i in random_rows], device,
                                   [len(requests[i].output_token_ids) if num_generated is None else num_generated[i]
                                    for i in random_rows])
            if r_idx is None:
                tokens = sampled
            else:
                tokens.index_copy_(0, r_idx, sampled)

        return self._finish(raw, tokens, params)

    # --- logits processing -------------------------------------------------------------

    @staticmethod
    def needs_logits_processing(requests, num_generated: list[int] | None = None) -> bool:
        """Whether :meth:`_apply_logits_processors` would change anything for ``requests``
        (allowed tokens, a grammar, a logit bias, bad words, an unmet min_tokens, penalties);
        callers that build per-position views for it (speculative verification, drafting) skip
        that work when not."""
        for i, r in enumerate(requests):
            sp = r.sampling_params
            done = len(r.output_token_ids) if num_generated is None else num_generated[i]
            if (sp.logit_bias or sp.reads_history or done < sp.min_tokens or sp.allowed_token_ids
                    or sp.bad_words_token_ids or getattr(r, "grammar", None) is not None):
                return True
        return False

    @staticmethod
    def _apply_logits_processors(work: torch.Tensor, requests: list[Request], device: torch.device,
                                 vocab: int, num_generated: list[int] | None = None) -> None:
        """Steps 1-4 (allowed tokens, bias, min_tokens and bad words, repetition,
        frequency/presence), in place on ``work``; ``num_generated`` as in :meth:`sample_async`."""
        bias_r: list[int] = []
        bias_c: list[int] = []
        bias_v: list[float] = []
        mask_r: list[int] = []
        mask_c: list[int] = []
        allow_rows: list[int] = []
        keep_r: list[int] = []
        keep_c: list[int] = []
        rep_rows: list[int] = []
        fp_rows: list[int] = []
        grammar_rows: list[int] = []
        soft_rows: list[int] = []
        soft_r: list[int] = []
        soft_c: list[int] = []
        for i, req in enumerate(requests):
            sp = req.sampling_params
            if getattr(req, "grammar", None) is not None:
                grammar_rows.append(i)
            if sp.allowed_token_ids:
                keep_r.extend([len(allow_rows)] * len(sp.allowed_token_ids))
                keep_c.extend(sp.allowed_token_ids)
                allow_rows.append(i)
            if sp.logit_bias:
                for tok, val in sp.logit_bias.items():
                    if 0 <= tok < vocab:
                        bias_r.append(i)
                        bias_c.append(tok)
                        bias_v.append(val)
            if (len(req.output_token_ids) if num_generated is None else num_generated[i]) < sp.min_tokens:
                banned = set(sp.stop_token_ids)
                if not sp.ignore_eos:
                    banned.update(req.eos_token_ids)
            else:
                banned = set()
            if sp.bad_words_token_ids:
                # single-token words read no history (such rows may sample on a worker, where
                # the ids are placeholders); longer ones make the request sync (reads_history)
                history = req.output_token_ids if sp.reads_history else ()
                if num_generated is not None and num_generated[i] < len(history):
                    history = list(history)[:num_generated[i]]
                banned |= banned_tokens(sp.bad_words_token_ids, history)
            banned = [t for t in banned if 0 <= t < vocab]
            if banned and (sp.allowed_token_ids or getattr(req, "grammar", None) is not None):
                soft_rows.append(i)  # (these bans can meet a constraint that allows nothing else)
                soft_r.extend([len(soft_rows) - 1] * len(banned))
                soft_c.extend(banned)
            else:
                mask_r.extend([i] * len(banned))
                mask_c.extend(banned)
            if sp.repetition_penalty != 1.0:
                rep_rows.append(i)
            if sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
                fp_rows.append(i)

        if grammar_rows:
            from kvforge.engine.structured_outputs import fill_bitmask
            mask = fill_bitmask([requests[i].grammar for i in grammar_rows], vocab)
            apply_token_bitmask(work, long_tensor(grammar_rows, device), mask)
        if allow_rows:
            apply_allowed_tokens(work, long_tensor(allow_rows, device), long_tensor(keep_r, device),
                                 long_tensor(keep_c, device))
        if bias_r:
            apply_logit_bias(work, long_tensor(bias_r, device), long_tensor(bias_c, device), _float(bias_v, device))
        if mask_r:
            apply_token_mask(work, long_tensor(mask_r, device), long_tensor(mask_c, device))
        if soft_rows:
            apply_token_mask_unless_empty(work, long_tensor(soft_rows, device), long_tensor(soft_r, device),
                                          long_tensor(soft_c, device))
        if rep_rows:
            ids = pad_token_lists([requests[i].all_token_ids for i in rep_rows], vocab, device)
            pen = _float([requests[i].sampling_params.repetition_penalty for i in rep_rows], device)
            apply_repetition_penalty(work, long_tensor(rep_rows, device), ids, pen)
        if fp_rows:
            ids = pad_token_lists([list(requests[i].output_token_ids) for i in fp_rows], vocab, device)
            freq = _float([requests[i].sampling_params.frequency_penalty for i in fp_rows], device)
            pres = _float([requests[i].sampling_params.presence_penalty for i in fp_rows], device)
            apply_frequency_presence_penalties(work, long_tensor(fp_rows, device), ids, freq, pres)

    def _sample(self, work: torch.Tensor, requests: list[Request], device: torch.device,
                num_generated: list[int]) -> torch.Tensor:
        """Step 5 for non-greedy rows: temperature, top-k/top-p/min-p, exponential race.

        ``work`` is float32 ``[R, V]`` (the non-greedy rows); returns int64 ``[R]``.
        """
        params = [r.sampling_params for r in requests]
        vocab = work.shape[1]
        work = apply_temperature(work, _float([sp.temperature for sp in params], device))
        ks = [sp.top_k if 0 < sp.top_k < vocab else 0 for sp in params]
        top_k = long_tensor(ks, device) if any(ks) else None
        top_p = _float([sp.top_p for sp in params], device, torch.float64) \
            if any(sp.top_p < 1.0 for sp in params) else None
        min_p = _float([sp.min_p for sp in params], device) if any(sp.min_p > 0.0 for sp in params) else None
        if top_k is not None or top_p is not None or min_p is not None:
            work = apply_top_k_top_p_min_p(work, top_k, top_p, min_p)
        probs = work.softmax(dim=-1)
        # a seeded request's noise is keyed by the position of the token being sampled
        seeds = [position_seed(r, n) if r.generator is not None else None for r, n in zip(requests, num_generated)]
        return exponential_race_sample(probs, [r.generator for r in requests], self.generator, seeds)

    # --- outputs -----------------------------------------------------------------------

    @staticmethod
    def _finish(raw: torch.Tensor, tokens: torch.Tensor, params: list) -> "PendingSamplerOutput":
        """Raw logprobs of the sampled tokens (+ top-k where asked), on the device, with
        their one copy to the host queued."""
        raw = raw.to(torch.float32)
        device = raw.device
        lp_rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        sampled_lp = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(raw, dim=-1)
        if not lp_rows:
            return PendingSamplerOutput(tokens, [sampled_lp], params, [])
        idx = long_tensor(lp_rows, device)
        num_top = max(params[i].logprobs for i in lp_rows)
        tok_lp, tok_rank, top_ids, top_lp, top_rank = logprobs_with_ranks(
            raw.index_select(0, idx), tokens.index_select(0, idx), num_top)
        # Keep the sampled logprob identical to the one in the returned dict.
        sampled_lp = sampled_lp.index_copy(0, idx, tok_lp)
        return PendingSamplerOutput(tokens, [sampled_lp, tok_rank, top_ids, top_lp, top_rank], params, lp_rows)


class PendingSamplerOutput:
    """A :class:`SamplerOutput` still on its way to the host.

    Attributes:
        token_ids: int64 ``[N]`` sampled tokens on the sampling device (feed the next step).
    """

    def __init__(self, token_ids: torch.Tensor, tensors: list[torch.Tensor], params: list, lp_rows: list[int]):
        self.token_ids = token_ids
        self._params = params
        self._lp_rows = lp_rows
        self._event = None
        all_t = [token_ids, *tensors]
        if token_ids.device.type == "cuda":
            # Queue the copies now (non-blocking into pinned memory) so they overlap later work.
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in all_t]
            for h, t in zip(self._host, all_t):
                h.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = all_t
        self._result: SamplerOutput | None = None

    @classmethod
    def empty(cls, device: torch.device) -> "PendingSamplerOutput":
        return cls(torch.empty(0, dtype=torch.int64, device=device), [torch.empty(0, device=device)], [], [])

    def result(self) -> SamplerOutput:
        """Wait for the copy (if still running) and build the Python values (idempotent)."""
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
        tok_list = self._host[0].tolist()
        lp_list = self._host[1].tolist()
        out: list[dict[int, Logprob] | None] = [None] * len(self._params)
        if self._lp_rows:
            tok_rank_l, top_ids_l, top_lp_l, top_rank_l = (t.tolist() for t in self._host[2:6])
            for j, i in enumerate(self._lp_rows):
                k = self._params[i].logprobs
                out[i] = _build_dict(tok_list[i], lp_list[i], tok_rank_l[j],
                                     top_ids_l[j][:k], top_lp_l[j][:k], top_rank_l[j][:k])
        self._result = SamplerOutput(tok_list, out, lp_list)
        return self._result


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: list[int], num_logprobs: int
                            ) -> list[dict[int, Logprob]]:
    """Log-probabilities of prompt tokens (vLLM ``prompt_logprobs``), from raw logits.

    Args:
        logits: float32 ``[P, V]``; row i is the model's prediction for ``target_ids[i]``.
        target_ids: P token ids.
        num_logprobs: how many top tokens to add per position (0 = the target only).

    Returns:
        P dicts token id -> :class:`Logprob`, each holding the target token (first) plus the
        top ``num_logprobs`` tokens, with raw log-softmax values and 1-based ranks.
    """
    if logits.shape[0] != len(target_ids):
        raise ValueError(f"logits has {logits.shape[0]} rows but {len(target_ids)} target ids")
    if not target_ids:
        return []
    targets = long_tensor(list(target_ids), logits.device)
    out: list[dict[int, Logprob]] = []
    # Chunk over positions so long prompts do not materialise a second full [P, V] tensor.
    for start in range(0, len(target_ids), _PROMPT_CHUNK):
        end = min(start + _PROMPT_CHUNK, len(target_ids))
        tok_lp, tok_rank, top_ids, top_lp, top_rank = logprobs_with_ranks(
            logits[start:end].to(torch.float32), targets[start:end], num_logprobs)
        tok_lp_l, tok_rank_l = tok_lp.tolist(), tok_rank.tolist()
        top_ids_l, top_lp_l, top_rank_l = top_ids.tolist(), top_lp.tolist(), top_rank.tolist()
        out.extend(_build_dict(int(target_ids[start + j]), tok_lp_l[j], tok_rank_l[j],
                               top_ids_l[j], top_lp_l[j], top_rank_l[j]) for j in range(end - start))
    return out
