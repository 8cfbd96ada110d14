"""Per-step split plan for split-KV decode (computed on the CPU, once per step).

The rule was fitted to ``benchmarks/bench_flash_decode.py --sweep`` on an H200 (132 SMs,
bf16, head_dim 128, GQA 4, BENCHMARKS.md): the fastest plans ran about two fd_partial
programs per SM when the batch leaves the GPU short of programs (batch 1 x 32k: 32-49
splits, not 128), and, for a grid of more programs than SMs, a split count whose last round
of programs is nearly full.
"""
from __future__ import annotations

#: Fewest tokens worth a split of their own when the grid is small: below this a program's
#: fixed costs (start-up, the combine of its warps, the merge of its partial row) outweigh
#: its streaming.
MIN_PARTITION_TOKENS = 256

#: With a grid of at least ``FILL`` programs per SM, splits must keep this many tokens
#: each: there they only even out the last round of programs.
LARGE_GRID_MIN_PARTITION = 1024

#: Programs per SM the small-grid rule aims at (measured best: 2, whichever of 2 or 3 fit).
FILL = 2

#: Most splits the large-grid rule tries.
MAX_TAIL_SPLITS = 4


def plan_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, block_size: int, num_sms: int,
                resident: int = 3) -> tuple[int, int]:
    """Choose (num_splits, partition_tokens) for ``num_rows`` decode rows.

    One program serves one (row, KV head(-slice), split) and streams one contiguous range of
    ``partition_tokens`` keys; ``resident`` programs fit on one SM at once (fd_partial: 3
    with up to 4 query heads per program, else 2).

    * Fewer programs than ``FILL`` x ``num_sms`` unsplit: split so that at most that many
      run (one round, every SM busy), each at least :data:`MIN_PARTITION_TOKENS`.
    * Otherwise: the split count (1..:data:`MAX_TAIL_SPLITS`, partitions of at least
      :data:`LARGE_GRID_MIN_PARTITION`) whose rounds of ``resident`` x ``num_sms`` programs
      are fullest, the last round included (5% better than fewer splits, or fewer wins).

    ``partition_tokens`` covers ``max_seq_len`` in ``num_splits`` pieces and is a multiple
    of ``block_size`` (the kernel starts every split at a block boundary).
    """
    seq = max(1, max_seq_len)
    programs = max(1, num_rows * num_kv_heads)
    if programs < FILL * num_sms:
        splits = max(1, min(FILL * num_sms // programs, seq // MIN_PARTITION_TOKENS))
    else:
        slots = max(1, resident) * num_sms
        splits, best = 1, 0.0
        for s in range(1, MAX_TAIL_SPLITS + 1):
            if s > 1 and seq < s * LARGE_GRID_MIN_PARTITION:
                break
            rounds = programs * s / slots
            fullness = rounds / -(-rounds // 1)
            if fullness > best * 1.05:
                splits, best = s, fullness
    part = -(-seq // splits)
    part = -(-part // block_size) * block_size
    return -(-seq // part), part
