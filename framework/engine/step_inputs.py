"""Vectorized construction of a step's positions and AttentionInputs (shared by the
in-process model runner and the distributed workers)."""
from __future__ import annotations

import numpy as np
import torch

from kvforge.engine.host_staging import upload
from kvforge.interfaces import AttentionInputs


def build_attention_inputs(qlens: np.ndarray, ctx: np.ndarray, flat_tables: np.ndarray, table_lens: np.ndarray,
                           block_size: int, device: torch.device, extra: tuple[np.ndarray, ...] = ()
                           ) -> tuple[torch.Tensor, AttentionInputs, list[int], list[torch.Tensor]]:
    """Positions and attention inputs for B requests, with no per-request Python work.

    Args:
        qlens: int64 [B] new tokens per request; ctx: int64 [B] tokens already cached.
        flat_tables: int32 [sum(table_lens)] every request's block table, concatenated.
        table_lens: int64 [B] block-table length of each request.
        extra: more arrays (e.g. the token ids) to upload in the same host-to-device copy.
    Returns:
        positions int64 [T] on ``device``, the AttentionInputs, query_start_loc as a list,
        and the ``extra`` arrays as device tensors. Nothing synchronizes with the device.
    """
    b = qlens.shape[0]
    qsl = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(qlens, out=qsl[1:])
    total = int(qsl[-1])
    if total == b:  # every request computes one token (pure decode): row i is request i
        row = np.arange(b)
        pos = ctx.copy()
    else:
        row = np.repeat(np.arange(b), qlens)
        pos = ctx[row] + (np.arange(total) - qsl[:-1][row])
    width = max(int(table_lens.max()), 1)
    table = np.zeros((b, width), dtype=np.int32)
    # a row-major boolean mask visits the entries in the concatenated order of flat_tables
    table[np.arange(width) < table_lens[:, None]] = flat_tables
    slots = table[row, pos // block_size].astype(np.int64) * block_size + pos % block_size
    pos_t, inputs, extra_t = pack_attention_inputs(pos, qsl, ctx, ctx + qlens, table, slots, int(qlens.max()),
                                                   qlens.tolist(), ctx.tolist(), block_size, device, extra)
    return pos_t, inputs, qsl.tolist(), extra_t


def pack_attention_inputs(pos: np.ndarray, qsl: np.ndarray, ctx: np.ndarray, seq: np.ndarray, table: np.ndarray,
                          slots: np.ndarray, max_query_len: int, query_lens: list[int], context_lens: list[int],
                          block_size: int, device: torch.device, extra: tuple[np.ndarray, ...] = ()
                          ) -> tuple[torch.Tensor, AttentionInputs, list[torch.Tensor]]:
    """Upload a step's index arrays in one copy and wrap them as AttentionInputs.

    Args:
        pos: int64 [T]; qsl: int64 [B + 1]; ctx, seq: int64 [B] (tokens); table: int32 [B, W];
        slots: int64 [T]; query_lens / context_lens: the same lengths as Python lists.
    Returns:
        positions on ``device``, the AttentionInputs and the ``extra`` arrays as tensors.
    """
    pos_t, qsl_t, ctx_t, seq_t, table_t, slots_t, *extra_t = upload(
        [pos, qsl.astype(np.int32), ctx.astype(np.int32), seq.astype(np.int32), table, slots, *extra], device)
    inputs = AttentionInputs(
        query_start_loc=qsl_t,
        context_lens=ctx_t,
        seq_lens=seq_t,
        block_table=table_t,
        slot_mapping=slots_t,
        max_query_len=max_query_len,
        max_seq_len=int(seq.max()),
        query_lens_cpu=query_lens,
        context_lens_cpu=context_lens,
        block_size=block_size,
    )
    return pos_t, inputs, extra_t
