"""One-pass greedy sampling: argmax and its raw log-probability per row (Triton, GPU).

A step where every request is greedy, asks for no logprobs and has no logits
processors needs, per row, only the argmax token and ``logit[argmax] - logsumexp(row)``
(for ``cumulative_logprob``). PyTorch takes about six passes over the float32
``[N, V]`` logits for that (argmax, then logsumexp's max, subtract, exp, sum); at batch
256 and a 128k vocabulary each pass moves 131 MB. This kernel reads the logits once:
per lane a running max, its first column and a sum of ``exp(x - max)`` rescaled when the
max grows (the online softmax of Milakov & Gimelshein 2018), reduced across lanes at the
end. Then ``logprob = max - (max + log(sum)) = -log(sum)``.

One program per row leaves most of the GPU idle at small batch (a 128k row read by one
SM takes ~70 us on an H200; 64 rows ~120 us), so the vocabulary is also split across
programs: each writes its chunk's (max, first column, rescaled sum) and a second kernel
merges a row's chunks by log-sum-exp, as split-KV decode merges attention partials.

Ties go to the first column, as ``torch.argmax`` documents. NaN logits are not handled
(torch would return the NaN's column); the engine's logits are finite.
"""
from __future__ import annotations

import torch

from kvforge.layers.triton_ops import enabled, triton

__all__ = ["greedy_sample", "greedy_sample_reference"]

_BLOCK = 2048  # columns per loop iteration (fp32: 8 KB per row per iteration)
_TARGET_PROGRAMS = 1024  # enough programs to fill an H200's 132 SMs several times over


def num_splits(n: int, v: int) -> int:
    """Vocabulary chunks per row: enough programs in all, each chunk at least one BLOCK."""
    return max(1, min(-(-_TARGET_PROGRAMS // max(n, 1)), -(-v // _BLOCK)))


def greedy_sample_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch version: (argmax int64 ``[N]``, raw logprob of it float32 ``[N]``)."""
    x = logits.to(torch.float32)
    tokens = x.argmax(dim=-1)
    return tokens, x.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(x, dim=-1)


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax per row and its raw log-probability.

    Args:
        logits: ``[N, V]`` float32/bf16/fp16 (unit column stride), not modified.

    Returns:
        ``(tokens, logprobs)``: int64 ``[N]`` (first column of the row max) and float32 ``[N]``
        (``logit[token] - logsumexp(row)``), on ``logits.device``. The Triton kernel runs on
        CUDA (or under ``TRITON_INTERPRET=1`` with ``KVFORGE_TRITON_CPU=1``), else
        :func:`greedy_sample_reference`.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, v = logits.shape
    if not enabled(logits) or n == 0 or v == 0 or logits.stride(1) != 1:
        return greedy_sample_reference(logits)
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    block = min(_BLOCK, triton.next_power_of_2(v))
    splits = num_splits(n, v)
    if splits == 1:
        _greedy_kernel[(n,)](logits, logits.stride(0), v, tokens, logprobs, BLOCK=block)
        return tokens, logprobs
    chunk = -(-v // (splits * block)) * block  # whole BLOCKs per chunk
    splits = -(-v // chunk)
    part_m = torch.empty(n, splits, dtype=torch.float32, device=logits.device)
    part_s = torch.empty_like(part_m)
    part_i = torch.empty(n, splits, dtype=torch.int32, device=logits.device)
    _greedy_partial_kernel[(n, splits)](logits, logits.stride(0), v, chunk, part_m, part_s, part_i, splits,
                                        BLOCK=block)
    # SBLOCK from the vocabulary alone (the most chunks a row can have): one compiled
    # variant per model whatever the batch, so no step compiles mid-serving.
    _greedy_merge_kernel[(n,)](part_m, part_s, part_i, splits, v, tokens, logprobs,
                               SBLOCK=triton.next_power_of_2(-(-v // block)))
    return tokens, logprobs


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _scan(base, lo, hi, BLOCK: tl.constexpr):
        """Over columns [lo, hi) of the row at ``base``: (max, its first column, sum of
        exp(x - max)), each lane keeping a running max rescaled as it grows."""
        cols = tl.arange(0, BLOCK)
        # -FLT_MAX, not -inf: exp(m_old - m_new) never sees -inf - -inf (NaN); masked
        # columns load -inf and add exp(-inf) = 0.
        m = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        idx = tl.zeros([BLOCK], tl.int32)
        for start in range(lo, hi, BLOCK):
            c = start + cols
            x = tl.load(base + c, mask=c < hi, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, x)
            s = s * tl.exp(m - new_m) + tl.exp(x - new_m)
            idx = tl.where(x > m, c, idx)  # strict: a lane keeps its first column of a tie
            m = new_m
        cmax = tl.max(m, axis=0)
        first = tl.min(tl.where(m == cmax, idx, hi), axis=0)  # first column over lanes
        return cmax, first, tl.sum(s * tl.exp(m - cmax), axis=0)

    @triton.jit
    def _greedy_kernel(x_ptr, row_stride, V, tok_ptr, lp_ptr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        _, first, total = _scan(x_ptr + row.to(tl.int64) * row_stride, 0, V, BLOCK)
        tl.store(tok_ptr + row, first.to(tl.int64))
        tl.store(lp_ptr + row, -tl.log(total))

    @triton.jit(do_not_specialize=["CHUNK", "S"])  # they change with the batch size
    def _greedy_partial_kernel(x_ptr, row_stride, V, CHUNK, m_ptr, s_ptr, i_ptr, S, BLOCK: tl.constexpr):
        """Program (row, split): max, first column of it and sum(exp(x - max)) over the
        columns [split * CHUNK, (split + 1) * CHUNK) of the row."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        lo = split * CHUNK
        cmax, first, total = _scan(x_ptr + row.to(tl.int64) * row_stride, lo, tl.minimum(lo + CHUNK, V), BLOCK)
        out = row * S + split
        tl.store(m_ptr + out, cmax)
        tl.store(s_ptr + out, total)
        tl.store(i_ptr + out, first)

    @triton.jit(do_not_specialize=["S"])
    def _greedy_merge_kernel(m_ptr, s_ptr, i_ptr, S, V, tok_ptr, lp_ptr, SBLOCK: tl.constexpr):
        """Merge a row's S chunk partials: the largest max (first column on ties, chunks
        being in column order) and -log of the rescaled sum."""
        row = tl.program_id(0)
        k = tl.arange(0, SBLOCK)
        ok = k < S
        m = tl.load(m_ptr + row * S + k, mask=ok, other=-3.4028234663852886e38)
        s = tl.load(s_ptr + row * S + k, mask=ok, other=0.0)
        i = tl.load(i_ptr + row * S + k, mask=ok, other=V)
        row_max = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - row_max), axis=0)
        tl.store(tok_ptr + row, tl.min(tl.where(m == row_max, i, V), axis=0).to(tl.int64))
        tl.store(lp_ptr + row, -tl.log(total))
