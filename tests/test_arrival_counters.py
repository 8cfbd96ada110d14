"""The shared zeroed arrival-counter buffer of single-launch GPU reductions (CPU tensors here)."""
import random

import torch

from kvforge.layers.arrival_counters import arrival_counters


def test_one_zeroed_buffer_per_device_grown_when_too_small():
    dev = torch.device("cpu")
    n = random.randrange(1, 4096)
    a = arrival_counters(n, dev)
    assert a.dtype == torch.int32 and a.numel() >= n and not a.any()
    assert arrival_counters(random.randrange(1, a.numel() + 1), dev) is a  # reused while large enough
    big = arrival_counters(a.numel() + random.randrange(1, 5000), dev)
    assert big is not a and big.numel() > a.numel() and not big.any()
    assert arrival_counters(n, dev) is big
