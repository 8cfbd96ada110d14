"""Fused Triton kernels for the memory-bound glue between GEMMs (GPU only).

Each replaces several PyTorch ops that would each read and write the whole
activation: RMSNorm with residual add (1 read of x and r, 1 write of each
instead of ~6 passes), rotary embedding applied in place on the q/k views of the
fused qkv output, and SiLU-and-mul. The layers call them when the tensor is on
CUDA (or when ``KVFORGE_TRITON_CPU=1`` with ``TRITON_INTERPRET=1``, for tests).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # triton is optional off Linux
    triton = None


def enabled(x: torch.Tensor) -> bool:
    """Use the fused kernels for ``x``?"""
    if triton is None:
        return False
    if x.is_cuda:
        return os.environ.get("KVFORGE_DISABLE_FUSED_KERNELS") != "1"
    return os.environ.get("KVFORGE_TRITON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, rout_ptr, H, x_stride, r_stride, eps,
                        HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + row * r_stride + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # residual sum rounds to the model dtype, as in HF
            tl.store(rout_ptr + row * H + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / H
        y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(out_ptr + row * H + cols, (y.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _rotate_heads(x_ptr, t, stride_t, stride_h, num_heads, c, s,
                      HALF: tl.constexpr, BLOCK_H: tl.constexpr, d):
        """Rotate-half RoPE, in place, on the first 2*HALF dims of token t's heads."""
        h = tl.arange(0, BLOCK_H)[:, None]
        mask = (h < num_heads) & (d < HALF)
        base = x_ptr + t * stride_t + h * stride_h
        x1 = tl.load(base + d, mask=mask, other=0.0)
        x2 = tl.load(base + HALF + d, mask=mask, other=0.0)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base + d, (x1f * c - x2f * s).to(x1.dtype), mask=mask)
        tl.store(base + HALF + d, (x2f * c + x1f * s).to(x1.dtype), mask=mask)

    @triton.jit
    def _rope_qk_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr, q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                        num_q_heads, num_k_heads, cs_stride,
                        HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        # One program per token rotates its q and k heads: one launch per layer instead of
        # two (a batch-1 decode step is launch-bound on these small kernels).
        t = tl.program_id(0)
        pos = tl.load(pos_ptr + t)
        d = tl.arange(0, BLOCK_D)[None, :]
        c = tl.load(cos_ptr + pos * cs_stride + d, mask=d < HALF, other=0.0)
        s = tl.load(sin_ptr + pos * cs_stride + d, mask=d < HALF, other=0.0)
        _rotate_heads(q_ptr, t, q_stride_t, q_stride_h, num_q_heads, c, s, HALF, BLOCK_HQ, d)
        _rotate_heads(k_ptr, t, k_stride_t, k_stride_h, num_k_heads, c, s, HALF, BLOCK_HK, d)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, inter, x_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fused (residual add +) RMSNorm. x, residual [T, H] -> y [T, H] (and x + residual)."""
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    rout = torch.empty_like(out) if residual is not None else out
    if t:
        _rmsnorm_kernel[(t,)](x, residual if residual is not None else x, weight, out, rout, h, x.stride(0),
                              residual.stride(0) if residual is not None else 0, eps,
                              HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(h))
    return (out, rout) if residual is not None else out


def rope_qk_inplace(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> None:
    """Rotate-half RoPE (Su et al. 2021, HF Llama layout) in place on q [T, Hq, D] and
    k [T, Hkv, D] (same T and D, unit stride in D; strided views of a fused QKV output are
    fine) in one kernel launch. cos/sin: float32 [max_pos, rotary_dim/2]; positions int64
    [T]; only the first rotary_dim dims are rotated."""
    t, hq, _ = q.shape
    hk = k.shape[1]
    half = cos.shape[1]
    if t:
        _rope_qk_kernel[(t,)](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                              hq, hk, cos.stride(0), HALF=half, BLOCK_HQ=triton.next_power_of_2(hq),
                              BLOCK_HK=triton.next_power_of_2(hk), BLOCK_D=triton.next_power_of_2(half))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I] (SwiGLU, Shazeer 2020)."""
    t, two_i = x.shape
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(inter, block))](x, out, inter, x.stride(0), BLOCK=block)
    return out
