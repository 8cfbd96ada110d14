"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvforge.layers import triton_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Shazeer 2020): x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    if triton_ops.enabled(x):
        return triton_ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
