"""flash_decode's split plan and the CPU emulation of its CUDA kernels (no GPU needed)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvforge_plugins.attention.flash_decode import emulate
from kvforge_plugins.attention.flash_decode.plan import FILL, MIN_PARTITION_TOKENS, plan_splits


def test_plan_covers_every_key_in_block_aligned_partitions():
    rng = random.Random()
    for _ in range(2000):
        rows, hkv = rng.randrange(1, 300), rng.choice([1, 2, 4, 8])
        seq, bs, sms = rng.randrange(1, 140000), rng.choice([8, 16, 32]), rng.choice([1, 78, 132])
        splits, part = plan_splits(rows, hkv, seq, bs, sms, resident=rng.choice([2, 3]))
        assert part % bs == 0 and splits >= 1
        assert (splits - 1) * part < seq <= splits * part, (rows, hkv, seq, bs, sms, splits, part)
        if splits > 1 and rows * hkv < FILL * sms:  # small grid: one round, splits worth their keys
            assert rows * hkv * splits <= FILL * sms
            assert part >= MIN_PARTITION_TOKENS


@pytest.mark.parametrize("rows, seq, want", [(1, 32768, 33), (8, 8192, 4), (2, 16384, 16), (4, 4096, 8),
                                             (64, 4096, 3), (256, 1024, 1)])
def test_plan_matches_the_h200_sweep(rows, seq, want):
    """The splits that were fastest (or within 1.5% of it) in the H200 sweep (BENCHMARKS.md)."""
    assert plan_splits(rows, 8, seq, 16, 132)[0] == want


def test_emulated_kernels_match_softmax_attention():
    """The numpy mirror of kernels.cu (thread-level indexing, poisoned memory) on its fixed
    edge cases plus fresh random shapes, against float64 attention."""
    with np.errstate(over="ignore", invalid="ignore"):
        emulate.main(n=6, seed=random.randrange(1 << 30))
