"""Per-step split plan for split-KV decode (computed on the CPU, once per step)."""
from __future__ import annotations

#: Fewest tokens worth a split of their own: below this the merge costs more than it saves.
MIN_PARTITION_TOKENS = 256


def plan_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, block_size: int, num_sms: int,
                waves: int = 8) -> tuple[int, int]:
    """Choose (num_splits, partition_tokens) so that about ``waves`` x ``num_sms``
    programs run, without splitting below :data:`MIN_PARTITION_TOKENS`.

    One program serves one (row, KV head, split); a large batch fills the GPU with
    one split, while batch 1 at a long context needs many. ``partition_tokens`` is a
    multiple of ``block_size`` covering ``max_seq_len`` in ``num_splits`` pieces.
    """
    programs = max(1, num_rows * num_kv_heads)
    want = -(-waves * num_sms // programs)
    cap = max(1, -(-max_seq_len // MIN_PARTITION_TOKENS))
    splits = max(1, min(want, cap))
    part = -(-max_seq_len // splits)
    part = -(-part // block_size) * block_size
    splits = -(-max_seq_len // part)
    return splits, part
