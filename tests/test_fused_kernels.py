"""Fused Triton kernels (RMSNorm+residual, in-place RoPE, SiLU-mul) against the
PyTorch reference path, on random inputs. Runs natively on CUDA, or on the CPU
through Triton's interpreter (fp32 and fp16 only: the interpreter's bf16 is unreliable)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvforge.layers import triton_ops  # noqa: E402
from kvforge.layers.activation import silu_and_mul  # noqa: E402
from kvforge.layers.layernorm import RMSNorm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.fixture(autouse=True)
def _fused_on_cpu(monkeypatch):
    # Scoped: other test modules must keep the plain PyTorch path on the CPU.
    if DEV == "cpu":
        monkeypatch.setenv("KVFORGE_TRITON_CPU", "1")


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _ref_norm(x, w, eps, res=None):
    if res is not None:
        x = x + res
    xf = x.float()
    y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y, x


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [64, 100])
def test_rmsnorm_residual(dtype, h):
    x = torch.randn(7, h, device=DEV).to(dtype)
    r = torch.randn(7, h, device=DEV).to(dtype)
    w = (1 + 0.3 * torch.randn(h, device=DEV)).to(dtype)
    assert triton_ops.enabled(x)
    y, s = triton_ops.rmsnorm(x, w, 1e-5, r)
    ry, rs = _ref_norm(x, w, 1e-5, r)
    assert torch.allclose(s.float(), rs.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.allclose(y.float(), ry.float(), atol=4 * TOL[dtype], rtol=4 * TOL[dtype])
    y2 = triton_ops.rmsnorm(x, w, 1e-5)
    assert torch.allclose(y2.float(), _ref_norm(x, w, 1e-5)[0].float(), atol=4 * TOL[dtype], rtol=4 * TOL[dtype])
    # the layer routes through the kernel and agrees with it
    norm = RMSNorm(h, 1e-5, dtype).to(DEV)
    norm.weight.data.copy_(w)
    assert torch.equal(norm(x, r)[0], y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_frac", [1.0, 0.5])
def test_rope_inplace(dtype, rotary_frac):
    t, nh, d, max_pos = 9, 4, 32, 64
    rd = int(d * rotary_frac)
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cos, sin = freqs.cos().to(DEV), freqs.sin().to(DEV)
    qkv = torch.randn(t, nh * d * 2, device=DEV).to(dtype)
    x = qkv[:, : nh * d].view(t, nh, d)  # strided view, as in the model
    pos = torch.randint(0, max_pos, (t,), device=DEV)
    xr = x.float()
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2: rd]
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, xr[..., rd:]], -1)
    other = qkv[:, nh * d:].clone()
    triton_ops.rope_inplace(x, pos, cos, sin)
    assert torch.allclose(x.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, nh * d:], other)  # nothing outside the view was touched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 172, device=DEV).to(dtype)
    g, u = x.float().chunk(2, -1)
    ref = torch.nn.functional.silu(g) * u
    got = silu_and_mul(x)
    assert got.shape == (5, 172)
    assert torch.allclose(got.float(), ref, atol=2 * TOL[dtype], rtol=2 * TOL[dtype])
