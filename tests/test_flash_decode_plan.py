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


def test_backend_plans_once_per_step_and_layer_shape():
    """The forward's plan: head slices count as programs, >4 heads per program fit 2 per SM,
    and layers of one shape share the step's plan (made by the first)."""
    import torch

    from kvforge.interfaces import AttentionInputs, AttentionLayer
    from kvforge_plugins.attention.flash_decode import FlashDecodeBackend, FlashDecodeMetadata
    be = FlashDecodeBackend.__new__(FlashDecodeBackend)  # the constructor needs CuPy; plan_for does not
    be._num_sms = 132
    rng = random.Random()
    rows, seq = rng.randrange(1, 40), rng.randrange(2000, 60000)
    i32 = dict(dtype=torch.int32)
    inputs = AttentionInputs(torch.arange(rows + 1, **i32), torch.full((rows,), seq - 1, **i32),
                             torch.full((rows,), seq, **i32), torch.zeros(rows, 1, **i32),
                             torch.zeros(rows, dtype=torch.long), 1, seq, [1] * rows, [seq - 1] * rows, 16)
    md = FlashDecodeMetadata(inputs, torch.zeros(rows, **i32), torch.zeros(rows, **i32), rows, [], None)
    gqa4, gqa12 = AttentionLayer(0, 32, 8, 128, 1.0), AttentionLayer(1, 48, 4, 128, 1.0)
    assert be.plan_for(md, gqa4) == plan_splits(rows, 8, seq, 16, 132, resident=3)
    assert be.plan_for(md, gqa12) == plan_splits(rows, 4 * 2, seq, 16, 132, resident=2)  # 2 slices of 6 heads
    md.plans[(8, 32)] = (7, 4096)  # a later layer of the first shape reuses the step's plan
    assert be.plan_for(md, AttentionLayer(5, 32, 8, 128, 1.0)) == (7, 4096)
