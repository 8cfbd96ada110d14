"""Vectorized construction of a step's positions and AttentionInputs (shared by the
in-process model runner and the distributed workers)."""
from __future__ import annotations

import numpy as np
import torch

from kvforge.interfaces import AttentionInputs


def build_attention_inputs(qlens: np.ndarray, ctx: np.ndarray, flat_tables: np.ndarray, table_lens: np.ndarray,
                           block_size: int, device: torch.device) -> tuple[torch.Tensor, AttentionInputs, list[int]]:
    """Positions and attention inputs for B requests, with no per-request Python work.

    Args:
        qlens: int64 [B] new tokens per request; ctx: int64 [B] tokens already cached.
        flat_tables: int32 [sum(table_lens)] every request's block table, concatenated.
        table_lens: int64 [B] block-table length of each request.
    Returns:
        positions int64 [T] on ``device``, the AttentionInputs, and query_start_loc as a list.
    """
    b = qlens.shape[0]
    qsl = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    total = int(qsl[-1])
    row = np.repeat(np.arange(b), qlens)
    pos = ctx[row] + (np.arange(total) - qsl[:-1][row])
    tstart = np.zeros(b, dtype=np.int64)
    np.cumsum(table_lens[:-1], out=tstart[1:])
    trow = np.repeat(np.arange(b), table_lens)
    table = np.zeros((b, max(int(table_lens.max()), 1)), dtype=np.int32)
    table[trow, np.arange(flat_tables.shape[0]) - tstart[trow]] = flat_tables
    slots = table[row, pos // block_size].astype(np.int64) * block_size + pos % block_size
    seq = ctx + qlens
    inputs = AttentionInputs(
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        context_lens=torch.from_numpy(ctx.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq.astype(np.int32)).to(device),
        block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        max_query_len=int(qlens.max()),
        max_seq_len=int(seq.max()),
        query_lens_cpu=qlens.tolist(),
        context_lens_cpu=ctx.tolist(),
        block_size=block_size,
    )
    return torch.from_numpy(pos).to(device), inputs, qsl.tolist()
