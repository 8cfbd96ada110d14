"""Zeroed int32 arrival counters for single-launch reductions on the GPU.

A kernel whose programs each write a partial result can finish the reduction in the same
launch: every program counts its arrival (an atomic add), and the last to arrive reduces
and sets its counter back to zero (the threadfence-reduction pattern, CUDA C++
Programming Guide, "Memory Fence Functions"). Such kernels need counters that are zero
at launch; this module keeps one buffer per device for all of them (today W4A16's serial
split-K). Launches on one device must therefore not
run concurrently on several streams.
"""
from __future__ import annotations

import torch

__all__ = ["arrival_counters"]

#: Per device; outgrown buffers stay referenced because captured CUDA graphs may use them.
_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(n: int, device: torch.device) -> torch.Tensor:
    """An int32 tensor of at least ``n`` zeros on ``device`` (at least 4096), the same
    buffer on every call while it is large enough; each kernel using it must leave it zero.
    During CUDA-graph capture a too-small buffer is replaced by a fresh one made inside the
    graph (a memset node: correct, slightly slower)."""
    bufs = _BUFFERS.setdefault(device, [])
    if bufs and bufs[-1].numel() >= n:
        return bufs[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    bufs.append(torch.zeros(max(n, 4096), dtype=torch.int32, device=device))
    return bufs[-1]
