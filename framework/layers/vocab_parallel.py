"""Vocabulary-parallel embedding and LM head (Megatron-LM, Shoeybi et al. 2019, sec. 3).

The vocabulary is cut into ``tp`` contiguous ranges of ``ceil(V / tp)`` rows (the last
one padded with zero rows). The embedding looks up the ids of its range, zeroes the
others, and all-reduces; the LM head computes the logits of its range and all-gathers
them. With one rank both are a plain ``[V, H]`` table and ``F.embedding`` / ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.distributed import parallel_state as ps
from kvforge.distributed.communication import tp_all_gather, tp_all_reduce


class VocabParallelEmbedding(torch.nn.Module):
    """``ids`` int64 [T] -> [T, embedding_dim]; ``weight`` holds this rank's vocabulary rows.

    ``weight.weight_loader(param, tensor)`` takes the whole checkpoint table ``[V, H]``
    and keeps this rank's rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, *, parallel: bool = True) -> None:
        super().__init__()
        tp, rank = (ps.get_tp_size(), ps.get_tp_rank()) if parallel else (1, 0)
        self.tp_size = tp
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.rows_per_rank = -(-num_embeddings // tp)
        self.vocab_start = min(rank * self.rows_per_rank, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        rows = self.rows_per_rank if tp > 1 else num_embeddings
        self.weight = torch.nn.Parameter(torch.zeros(rows, embedding_dim, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {(self.num_embeddings, self.embedding_dim)}")
        n = self.vocab_end - self.vocab_start
        param.data[:n].copy_(tensor[self.vocab_start:self.vocab_end])
        param.data[n:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = F.embedding((ids - self.vocab_start) * inside, self.weight)
        out = out * inside.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection ``[V, H]``, vocabulary-split like the embedding (never looked up)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - a head is not an embedding
        raise RuntimeError("ParallelLMHead is an output projection; use vocab_parallel_logits")


def vocab_parallel_logits(hidden: torch.Tensor, head: VocabParallelEmbedding) -> torch.Tensor:
    """``hidden`` [N, H] -> float32 logits [N, V] over the whole vocabulary (every rank gets them)."""
    logits = F.linear(hidden, head.weight)
    if head.tp_size > 1:
        logits = tp_all_gather(logits, dim=-1)[:, :head.num_embeddings]
    return logits.float()
