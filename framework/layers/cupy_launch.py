"""Launch helpers for CUDA C++ kernels compiled at run time by NVRTC through CuPy
(``flash_decode`` attention, the ``w4_mma`` int4 GEMM): kernel-argument pointers, and CuPy
views of torch's current stream so that launches are ordered with torch's work and captured
by CUDA graphs (during capture torch's current stream is the capturing one)."""
from __future__ import annotations

import warnings

import numpy as np
import torch


def nvrtc_reasons(device: torch.device, what: str) -> list[str]:
    """Why kernels compiled by NVRTC through CuPy cannot run on ``device`` (empty if they can);
    ``what`` names them in the messages."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"needs a CUDA device ({what} CUDA C++ compiled by NVRTC)")
    try:
        import cupy  # noqa: F401  (only whether it imports)
    except Exception as e:
        reasons.append(f"needs CuPy (pip install kvforge[gpu]): {type(e).__name__}")
    return reasons


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's device address as a kernel argument."""
    return np.uint64(t.data_ptr())


class TorchStreams:
    """CuPy ``ExternalStream`` views of torch's streams, one object per stream handle."""

    def __init__(self, cupy) -> None:
        self.cupy = cupy
        self._views: dict[int, object] = {}

    def current(self, device: torch.device):
        """The view of torch's current stream on ``device`` (use as ``with view: kernel(...)``)."""
        handle = torch.cuda.current_stream(device).cuda_stream
        s = self._views.get(handle)
        if s is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works
                warnings.simplefilter("ignore", DeprecationWarning)
                s = self.cupy.cuda.ExternalStream(handle)
            self._views[handle] = s
        return s
