"""Row orders of the int4 mma layout (``w4_mma.py``) that let the kernel's epilogue combine
output features a lane holds together: a gate|up pair interleaved 8 by 8 (the SwiGLU epilogue,
``ACT``) and each q/k head's two halves interleaved the same way (the RoPE epilogue, ``ROPE``).
Each has its inverse, for the paths that multiply without the epilogue. Also the K order of
the layout's 64-wide chunks, in which the warpgroup-MMA kernel (``WG``) takes x."""
from __future__ import annotations

import torch


def interleave_gate_up(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Reorder the out features of a gate|up weight (``[gate 0..I) | up 0..I)`` along ``dim``,
    I a multiple of 8) so each 16-row tile of the layout holds gate rows 8T..8T+8 then the up
    rows of the same features: feature 16T + 8h + i <- h * I + 8T + i. A lane's accumulators
    then hold gate and up of one feature, and the kernel's ``ACT`` epilogue writes
    silu(gate) * up without another pass (``mma_gemm(..., silu_and_mul=True)``). Raises
    ValueError unless ``t.shape[dim]`` (2I) is a multiple of 16."""
    dim = dim % t.dim()
    n = _check_gate_up(t.shape[dim])
    s = t.shape
    v = t.reshape(*s[:dim], 2, n // 16, 8, *s[dim + 1:]).transpose(dim, dim + 1)
    return v.reshape(s)


def _check_gate_up(n: int) -> int:
    if n % 16:
        raise ValueError(f"a gate|up pair of {n} features does not interleave 8 by 8 (needs a multiple of 16)")
    return n


def deinterleave_gate_up(y: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_gate_up` on the last dim: y [..., 2I] -> [gate | up]
    (a copy). Raises ValueError unless 2I is a multiple of 16."""
    s = y.shape
    _check_gate_up(s[-1])
    return y.reshape(*s[:-1], s[-1] // 16, 2, 8).transpose(-3, -2).reshape(s)


def silu_and_mul_interleaved(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU of an interleaved gate|up product: y [M, 2I] -> silu(gate) * up [M, I] in
    y's dtype, by ``kvforge.layers.activation.silu_and_mul`` (one fp32 rounding, as the
    unfused layer). For the paths past the fused kernel (M > 64, other dtypes)."""
    from kvforge.layers.activation import silu_and_mul
    return silu_and_mul(deinterleave_gate_up(y))


def interleave_heads(t: torch.Tensor, heads: int, head_dim: int, dim: int = -1) -> torch.Tensor:
    """The rotary layout of a q|k|v weight: along ``dim``, the first ``heads`` heads of
    ``head_dim`` features each get their two halves interleaved 8 by 8 (as
    :func:`interleave_gate_up` does to a gate|up pair), so a lane's fragments hold dims d and
    d + head_dim / 2 of one head and the kernel can rotate them (``ROPE``); the rest (v) stays.
    Raises ValueError unless head_dim is a multiple of 16."""
    if head_dim % 16:
        raise ValueError(f"head_dim {head_dim} does not interleave 8 by 8 (needs a multiple of 16)")
    dim = dim % t.dim()
    rows = heads * head_dim
    qk = t.narrow(dim, 0, rows)
    s = qk.shape
    qk = interleave_gate_up(qk.reshape(*s[:dim], heads, head_dim, *s[dim + 1:]), dim + 1).reshape(s)
    return torch.cat([qk, t.narrow(dim, rows, t.shape[dim] - rows)], dim)


def deinterleave_heads(y: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`interleave_heads` on the last dim (a copy)."""
    rows = heads * head_dim
    qk = deinterleave_gate_up(y[..., :rows].reshape(*y.shape[:-1], heads, head_dim)).reshape(*y.shape[:-1], rows)
    return torch.cat([qk, y[..., rows:]], -1)


def chunk_k_order(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (K a multiple of 64) with each 64-wide chunk of K in the mma layout's K order,
    a contiguous copy: position 16i + 8s + 2t + h of a chunk holds its column 16t + 4i + 2s + h
    (i, t < 4; s, h < 2), the column the layout pairs with MMA K step i, k = 8s + 2t + h
    (``w4_mma.cu``). The ``WG`` kernel reads x's chunks as the warpgroup MMAs' B operand, whose
    K runs in that order, so it copies these rows as they stand. Raises ValueError unless x is
    2-D with K a multiple of 64."""
    if x.dim() != 2 or x.shape[1] % 64:
        raise ValueError(f"chunk_k_order: x {tuple(x.shape)} must be [M, K] with K a multiple of 64")
    m, k = x.shape
    return x.reshape(m, k // 64, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k)


def wg_x_tiles(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the producer warp of ``WG 2`` copies it (w4_wgmma_ws.cuh): chunk-major tiles
    [K / 64, M, 64], a contiguous copy, each row's chunk in :func:`chunk_k_order` with its
    16-byte units (8 elements) 128-byte swizzled: unit u of row r at unit u ^ (r % 8) (the
    ``SWIZZLE_128B`` pattern of the PTX ISA's wgmma matrix descriptors). So a chunk is one
    contiguous M x 128-byte block that lands in shared memory exactly as the warpgroup MMAs
    read it. Raises ValueError unless x is 2-D with K a multiple of 64."""
    y = chunk_k_order(x)
    m, k = y.shape
    units = torch.arange(8, device=x.device)[None, :] ^ (torch.arange(m, device=x.device)[:, None] % 8)  # [M, 8]
    y = y.reshape(m, k // 64, 8, 8).gather(2, units[:, None, :, None].expand(m, k // 64, 8, 8))
    return y.permute(1, 0, 2, 3).contiguous().reshape(k // 64, m, 64)
