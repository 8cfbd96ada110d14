"""One host-to-device copy per step for the step's small index arrays.

A step's inputs (token ids, positions, block table, slot mapping, sequence lengths,
rows to sample) are a handful of small integer arrays. Copying each with a blocking
``tensor.to("cuda")`` costs one driver call and, from pageable memory, one wait for the
GPU to drain the stream, which would serialize the host with the GPU and defeat async
scheduling. :func:`upload` packs them into one pinned buffer (PyTorch's caching host
allocator keeps it alive until the copy has run) and issues a single non-blocking copy;
the device tensors are views into the copied buffer.
"""
from __future__ import annotations

import numpy as np
import torch

_ALIGN = 16  # bytes; keeps every view aligned for its dtype


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Copy numpy arrays to ``device`` with one transfer.

    Args:
        arrays: C-contiguous numpy arrays of any numeric dtype and shape (zero-size allowed).
        device: target device. On the CPU the arrays are wrapped without copying, so the
            caller must not modify them afterwards.

    Returns:
        One tensor per array, same dtype and shape, on ``device``. Issues no host
        synchronization on CUDA.
    """
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    offsets = []
    total = 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    host = torch.empty(max(total, _ALIGN), dtype=torch.uint8, pin_memory=True)
    buf = host.numpy()
    for a, off in zip(arrays, offsets):
        if a.nbytes:
            buf[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)
    out = []
    for a, off in zip(arrays, offsets):
        dtype = torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype
        out.append(dev[off:off + a.nbytes].view(dtype).view(a.shape))
    return out
