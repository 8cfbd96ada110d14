"""RMSNorm (Zhang & Sennrich 2019) as Llama uses it: normalize in float32, scale in model dtype."""
from __future__ import annotations

import torch

from kvforge.layers import triton_ops


class RMSNorm(torch.nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight``; x [T, H] any float dtype -> same dtype.

    With ``residual`` given, computes ``r = x + residual`` first and returns
    ``(norm(r), r)`` (the fused add+norm pattern of pre-norm transformers).
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if triton_ops.enabled(x):
            return triton_ops.rmsnorm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
