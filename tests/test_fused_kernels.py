"""Fused Triton kernels (RMSNorm+residual, in-place RoPE, SiLU-mul) against the
PyTorch reference path, on random inputs. Runs natively on CUDA, or on the CPU
through Triton's interpreter (fp32 and fp16 only: the interpreter's bf16 is unreliable)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvforge.layers import triton_ops  # noqa: E402
from kvforge.layers.activation import silu_and_mul  # noqa: E402
from kvforge.layers.layernorm import RMSNorm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


# Triton picks interpreter or compiler when a kernel is decorated (module import), so on a
# CPU host the kernel tests run in a child pytest with TRITON_INTERPRET=1 set from the start;
# setting it in this process would leak into every other test module.
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("KVFORGE_TRITON_CPU") == "1"
kernel_test = pytest.mark.skipif(DEV == "cpu" and not INTERPRETING,
                                 reason="runs inside test_kernels_under_triton_interpreter on CPU hosts")


@pytest.mark.skipif(DEV != "cpu" or INTERPRETING, reason="CPU host driver of the interpreter run")
def test_kernels_under_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", KVFORGE_TRITON_CPU="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "19 passed" in proc.stdout.splitlines()[-1], proc.stdout[-500:]  # every kernel case ran


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _fresh_inputs():
    """Fresh random inputs every run (a child pytest would otherwise start from torch's default
    seed each time); the seed is printed, so a failure's output names it."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"torch seed {seed}")


def _ref_norm(x, w, eps, res=None):
    if res is not None:
        x = x + res
    xf = x.float()
    y = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y, x


@kernel_test
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


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_frac", [1.0, 0.5])
def test_rope_qk_inplace(dtype, rotary_frac):
    """q and k rotated in one launch, as views into one fused QKV output (GQA: fewer k heads)."""
    t, hq, hk, d, max_pos = 11, 8, 2, 32, 128
    rd = int(d * rotary_frac)
    inv = 1.0 / (10000 ** (torch.arange(0, rd, 2).float() / rd))
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    cos, sin = freqs.cos().to(DEV), freqs.sin().to(DEV)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV).to(dtype)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
    pos = torch.randint(0, max_pos, (t,), device=DEV)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)

    def ref(x):
        xr = x.float()
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2: rd]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, xr[..., rd:]], -1)

    rq, rk = ref(q), ref(k)
    v = qkv[:, (hq + hk) * d:].clone()
    triton_ops.rope_qk_inplace(q, k, pos, cos, sin)
    assert torch.allclose(q.float(), rq, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.allclose(k.float(), rk, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * d:], v)  # the V part is untouched


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 172, device=DEV).to(dtype)
    g, u = x.float().chunk(2, -1)
    ref = torch.nn.functional.silu(g) * u
    got = silu_and_mul(x)
    assert got.shape == (5, 172)
    assert torch.allclose(got.float(), ref, atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [300, 2048, 5000, 9000])
def test_greedy_sample_one_pass(dtype, v):
    """Argmax and logit - logsumexp per row in one pass, against torch; ties (inside one
    loop block, across blocks and lanes) go to the first column like torch.argmax."""
    from kvforge.engine.greedy_kernel import greedy_sample, greedy_sample_reference
    n = 6
    x = (3 * torch.randn(n, v, device=DEV)).to(dtype)
    top = x.float().max(-1).values
    x[1, v - 1] = top[1] + 1                       # max in the last (partial) block
    cols = torch.randperm(v)[:3].sort().values
    x[2, cols] = (top[2] + 1).to(dtype)              # a three-way tie, possibly across blocks
    x[3, 0] = x[3, v // 2] = (top[3] + 2).to(dtype)  # first column ties a later one
    x[4] = x[4, 7]                                 # a flat row: column 0 wins
    xs = torch.full((n, v + 40), float("nan"), device=DEV).to(dtype)
    xs[:, :v] = x                                  # padded rows: the padding is never read
    tok, lp = greedy_sample(xs[:, :v])
    rtok, rlp = greedy_sample_reference(x)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(tok, rtok), (tok, rtok)
    assert tok[2] == cols[0] and tok[3] == 0 and tok[4] == 0
    assert torch.allclose(lp, rlp, atol=1e-5, rtol=1e-5), (lp, rlp)


@kernel_test
def test_sampler_greedy_fast_path_matches_general_path():
    """A greedy batch without logprobs takes the one-pass kernel; the same batch with
    logprobs requested takes the general path: tokens and sampled logprobs agree."""
    from helpers import sampler_request
    from kvforge.engine.sampler import Sampler
    from kvforge.engine.sampling_params import SamplingParams
    logits = 4 * torch.randn(9, 700, device=DEV)
    fast = Sampler(650)(logits, [sampler_request(str(i), SamplingParams(temperature=0)) for i in range(9)])
    slow = Sampler(650)(logits, [sampler_request(str(i), SamplingParams(temperature=0, logprobs=0))
                                 for i in range(9)])
    assert fast.sampled_token_ids == slow.sampled_token_ids
    assert fast.sampled_token_ids == logits[:, :650].argmax(-1).tolist()
    assert max(abs(a - b) for a, b in zip(fast.sampled_logprobs, slow.sampled_logprobs)) < 1e-5
    assert all(lp is None for lp in fast.logprobs)
