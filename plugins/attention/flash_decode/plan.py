"""Per-step split plan for split-KV decode (computed on the CPU, once per step)."""
from __future__ import annotations

#: Fewest tokens worth a split of their own: below this a program's fixed costs (its
#: start-up latency, the combine of its warps, the merge of its partial row) outweigh
#: its streaming. A fd_partial program walks 16 tokens per stage at bf16 head_dim 128.
MIN_PARTITION_TOKENS = 256

#: A split partition is a multiple of this: a multiple of every block size (8/16/32) and of
#: the tokens a fd_partial program walks per stage (at most 256, for head_dim 8), so only
#: the last stage of a request's last split is partly masked.
PARTITION_ALIGN = 256


def plan_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, block_size: int, num_sms: int,
                waves: int = 8) -> tuple[int, int]:
    """Choose (num_splits, partition_tokens) so that about ``waves`` x ``num_sms``
    programs run, without splitting below :data:`MIN_PARTITION_TOKENS`.

    One program serves one (row, KV head, split) and streams one contiguous range of
    ``partition_tokens`` keys; 2-3 programs are resident per SM (bf16 head_dim 128 GQA 4:
    3), so 8 waves of SMs are ~3 rounds of programs, enough to hide the programs' start
    and end. A large batch fills the GPU with one split, while batch 1 at a long context
    needs many. ``partition_tokens`` covers ``max_seq_len`` in ``num_splits`` pieces; it is
    a multiple of ``block_size`` always, and of :data:`PARTITION_ALIGN` when split.
    """
    seq = max(1, max_seq_len)
    programs = max(1, num_rows * num_kv_heads)
    want = -(-waves * num_sms // programs)
    cap = max(1, -(-seq // MIN_PARTITION_TOKENS))
    splits = max(1, min(want, cap))
    if splits == 1:
        return 1, -(-seq // block_size) * block_size
    align = max(PARTITION_ALIGN, block_size)  # both powers of two: a multiple of each
    part = -(-seq // splits)
    part = -(-part // align) * align
    splits = -(-seq // part)
    return splits, part
