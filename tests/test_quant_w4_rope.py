"""RoPE folded into the int4 mma GEMM's epilogue (the kernel's ``ROPE``): a q|k|v weight
repacked with each q and k head's halves interleaved 8 by 8 (``w4_mma.interleave_heads``), so
a lane holds dims d and d + D/2 of one head and rotates them before the store.

Reference: the dequantized weight's GEMM in fp64 (rounded to the model dtype, as the unfused
layer's qkv output), then ``kvforge.layers.rotary.RotaryEmbedding``'s torch path; fresh random
data each run, bounds of tests/test_quant_w4_mma.py (bf16 1e-2, fp16 2e-3 of max |ref|). On
the CPU through the kernel emulation (tests/w4_mma_emulate.py) and a whole AWQ q|k|v layer
(forward in head order on every path; the fused path with the norm); on a GPU the real kernel.
"""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvforge.layers.rotary import RotaryEmbedding
from kvforge_plugins.quant.kernels import w4_mma
from test_quant_w4_gate_up import _err, load_awq_shards
from test_quant_w4_mma import BOUND, _quant, cuda, gen  # noqa: F401  (gen: the fresh-seed fixture)
from test_quant_w4_prenorm import _norm, _ref


def test_interleave_heads_worked_by_hand():
    # 2 rotated heads of 16 then 8 v rows: each head's dims 0..7 | 8..15 stay (8 by 8 = the halves)
    t = torch.arange(40)
    assert torch.equal(w4_mma.interleave_heads(t, 2, 16), t)
    # head_dim 32: halves 0..15 and 16..31 interleave 8 by 8 -> 0..7, 16..23, 8..15, 24..31
    got = w4_mma.interleave_heads(torch.arange(72), 2, 32)
    head = [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert got.tolist() == head + [32 + i for i in head] + list(range(64, 72))
    y = torch.randn(3, 72)
    assert torch.equal(w4_mma.deinterleave_heads(w4_mma.interleave_heads(y, 2, 32), 2, 32), y)
    with pytest.raises(ValueError, match="head_dim 24"):
        w4_mma.interleave_heads(torch.arange(48), 2, 24)


def _rotary(head_dim, max_pos=64):
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=10000.0)
    return RotaryEmbedding(cfg, head_dim, max_pos)


def _roped_ref(y_ref, positions, rotary, heads_q, heads_k, hd, dtype):
    """The unfused layer: qkv rounded to dtype, then the torch rotary (fp32, rounded)."""
    y = y_ref.to(dtype).float()
    t = y.shape[0]
    q, k = y[:, :heads_q * hd].view(t, heads_q, hd), y[:, heads_q * hd:(heads_q + heads_k) * hd].view(t, heads_k, hd)
    q2, k2 = rotary._rotate(q, rotary.cos[positions], rotary.sin[positions]), \
        rotary._rotate(k, rotary.cos[positions], rotary.sin[positions])
    return torch.cat([q2.reshape(t, -1), k2.reshape(t, -1), y[:, (heads_q + heads_k) * hd:]], 1).double()


# (K, q heads, kv heads, head_dim, group, M, config)
CASES = [(256, 4, 2, 64, 64, 1, None), (512, 2, 1, 128, 128, 5, dict(TW=2, WARPS=4, KW=2, S=2)),
         (256, 4, 2, 32, 64, 8, dict(TW=1, WARPS=2, split_k=2, S=1, CPA=3))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_emulated_rope_epilogue(case, dtype, gen, monkeypatch):
    import w4_mma_emulate
    k, hq, hk, hd, group, m, cfg = CASES[case]
    fake = w4_mma_emulate.install(monkeypatch)
    n = (hq + 2 * hk) * hd
    q, s, z, w_ref = _quant(k, n, group, gen)
    il = (lambda t: w4_mma.interleave_heads(t, hq + hk, hd))
    ps, pz = w4_mma.pack_mma_groups(il(s), il(z))
    words = w4_mma.pack_mma(il(q))
    x, res = (torch.randn(m, k, generator=gen).to(dtype) for _ in range(2))
    norm, rotary = _norm(k, dtype, gen), _rotary(hd)
    positions = torch.randint(0, 64, (m,), generator=gen)
    y, r = w4_mma.mma_gemm_rmsnorm(x, res, norm.weight, norm.eps, words, ps, pz, group_size=group, n=n, config=cfg,
                                   rope=(hq + hk, hd, positions, rotary.cos, rotary.sin))
    h_ref, r_ref = _ref(x, res, norm)
    assert torch.equal(r, r_ref) and fake.calls[-1]["cfg"]["ROPE"] == 2
    ref = _roped_ref(h_ref.double() @ w_ref.double(), positions, rotary, hq, hk, hd, dtype)
    err = _err(y, ref)
    # the reference rounds q1 and q2 before rotating, the kernel rotates its fp32 sums and rounds
    # once: 0.5u for each of q1, q2 plus both final roundings reaches ~2u of max |ref| before
    # the GEMM's own error, against BOUND[bf16] = 2.56u (u = 2^-8). Measured over 69 seeds
    # (case 0): bf16 median 3.4e-3, max 6.6e-3; so bf16 gets 1.5x here (fp16 at 4.1u keeps its bound)
    bound = BOUND[dtype] * (1.5 if dtype == torch.bfloat16 else 1)
    assert err <= bound, f"seed {gen.initial_seed()} case {case}: {err}"
    # the layout alone (ROPE 1): head order, no rotation
    y1 = w4_mma.mma_gemm(x, words, ps, pz, group_size=group, n=n, config=cfg, rope_layout=(hq + hk, hd))
    assert fake.calls[-1]["cfg"]["ROPE"] == 1
    assert _err(y1, x.double() @ w_ref.double()) <= BOUND[dtype]


def _rope_bound(m, dtype):
    """Bound on the rotated q|k|v of a layer. Past MAX_FUSED_M (dequantize + matmul, the rotary
    in torch) the weight is rounded to the model dtype and the GEMM's output is rounded before
    the rotation: where the kernel's q1 and q2 round one ulp (up to 2u of max |ref|, u the
    unit roundoff) away from the reference's, q1 cos - q2 sin carries both, plus the rotated
    value's own rounding: up to ~3.8u, while BOUND[bf16] is 2.56u (u = 2^-8). Measured
    (test_emulated_qkv_layer, M = 70) over 110 seeds: bf16 median 6.0e-3, max 7.6e-3 (0.76 of
    1e-2); fp16 median 7.5e-4, max 9.5e-4 (0.48 of 2e-3, 4.1u). So bf16 gets twice the bound
    there; a wrong position, head or half still errs by O(1)."""
    return BOUND[dtype] * (2 if m > w4_mma.MAX_FUSED_M and dtype == torch.bfloat16 else 1)


def _qkv_layer(k, hq, hk, hd, group, dtype, device, gen, **settings):
    """An AWQ q|k|v layer (``QKVParallelLinear``, rope_heads set as the Llama attention does);
    ``settings``: more AWQSettings."""
    from kvforge.layers.parallel_linear import QKVParallelLinear
    from kvforge_plugins.quant.awq import AWQConfig, AWQSettings
    qc = AWQConfig({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
                   AWQSettings(backend="auto" if device == "cuda" else "triton", int4_layout="mma", **settings))
    with torch.device(device):
        layer = QKVParallelLinear(k, hd, hq, hk, False, qc, "model.layers.0.self_attn.qkv_proj", dtype,
                                  parallel=False)
    layer.rope_heads = hq + hk
    return layer, load_awq_shards(layer, k, group, gen, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_qkv_layer(dtype, gen, monkeypatch):
    import w4_mma_emulate
    fake = w4_mma_emulate.install(monkeypatch)
    monkeypatch.setattr(w4_mma, "runtime_blocker", lambda device: None)
    hq, hk, hd, k = 4, 2, 64, 256
    layer, w_ref = _qkv_layer(k, hq, hk, hd, 64, dtype, "cpu", gen)
    assert layer.wna16_rope == (hq + hk, hd)
    norm, rotary = _norm(k, dtype, gen), _rotary(hd)
    # fused at steps of <= fuse_norm_max_tokens (2 by default) tokens
    for m, fused in ((1, True), (2, True), (3, False), (8, False), (9, False), (70, False)):
        x, res = (torch.randn(m, k, generator=gen).to(dtype) for _ in range(2))
        assert _err(layer(x), x.double() @ w_ref.double()) <= BOUND[dtype], f"M={m}: forward not in head order"
        positions = torch.randint(0, 64, (m,), generator=gen)
        before = len(fake.calls)
        y, r = layer.forward_prenorm(x, res, norm, rope=(positions, rotary))
        h_ref, r_ref = _ref(x, res, norm)
        assert torch.equal(r, r_ref)
        ref = _roped_ref(h_ref.double() @ w_ref.double(), positions, rotary, hq, hk, hd, dtype)
        assert _err(y, ref) <= _rope_bound(m, dtype), f"seed {gen.initial_seed()} M={m}"
        if m <= w4_mma.MAX_FUSED_M:
            assert (fake.calls[before]["cfg"].get("ROPE") == 2) == fused


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_tokens", [2, 8])  # fused at M <= max_tokens, norm / GEMM / rotary apart past it
def test_gpu_qkv_layer_rope(dtype, max_tokens, gen):
    if w4_mma.runtime_blocker(torch.device("cuda")):
        pytest.skip(w4_mma.runtime_blocker(torch.device("cuda")))
    hq, hk, hd, k = 8, 2, 128, 1024
    layer, w_ref = _qkv_layer(k, hq, hk, hd, 128, dtype, "cuda", gen, fuse_norm_max_tokens=max_tokens)
    assert layer.wna16_rope == (hq + hk, hd)
    norm, rotary = _norm(k, dtype, gen, "cuda"), _rotary(hd, 4096).cuda()
    w_ref = w_ref.cuda()
    for m in (1, 3, 8, 16, 100):
        x, res = (torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(2))
        positions = torch.randint(0, 4096, (m,), device="cuda")
        with torch.inference_mode():
            y0 = layer(x)
            y, r = layer.forward_prenorm(x, res, norm, rope=(positions, rotary))
        assert _err(y0, x.double() @ w_ref.double()) <= BOUND[dtype], f"seed {gen.initial_seed()} M={m}"
        h_ref, r_ref = norm(x, res)
        assert torch.equal(r, r_ref)
        ref = _roped_ref(h_ref.double() @ w_ref.double(), positions, rotary, hq, hk, hd, dtype)
        assert _err(y, ref) <= _rope_bound(m, dtype), f"seed {gen.initial_seed()} M={m}"


def test_rope_layout_is_checked_before_launch(gen, monkeypatch):
    import w4_mma_emulate
    fake = w4_mma_emulate.install(monkeypatch)
    k, n = 128, 192
    q, s, z, _ = _quant(k, n, 64, gen)
    ps, pz = w4_mma.pack_mma_groups(s, z)
    words, x = w4_mma.pack_mma(q), torch.randn(2, k, generator=gen).half()
    for bad in ((2, 128), (2, 24), (0, 64), (-1, 64)):  # past N, not a multiple of 16, no heads
        with pytest.raises(ValueError, match="rope layout"):
            w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=n, rope_layout=bad)
    with pytest.raises(ValueError, match="exclude each other"):
        w4_mma.mma_gemm(x, words, ps, pz, group_size=64, n=n, rope_layout=(1, 64), silu_and_mul=True)
    assert not fake.calls


def test_norm_rows_too_long_for_shared_memory(gen, monkeypatch):
    # K 8192 at M = 8 needs 131 KB of rows: on a 99 KB GPU the layer runs the norm apart
    import w4_mma_emulate
    fake = w4_mma_emulate.install(monkeypatch, smem_limit=99 * 1024)
    monkeypatch.setattr(w4_mma, "runtime_blocker", lambda device: None)
    assert not w4_mma.norm_fits(8, 8192, 2, torch.device("cpu")) and w4_mma.norm_fits(1, 8192, 2, torch.device("cpu"))
    layer, w_ref = _qkv_layer(8192, 2, 1, 32, 1024, torch.float16, "cpu", gen, fuse_norm_max_tokens=8)
    norm, rotary = _norm(8192, torch.float16, gen), _rotary(32)
    x, res = (torch.randn(8, 8192, generator=gen).half() for _ in range(2))
    positions = torch.randint(0, 64, (8,), generator=gen)
    assert layer.method.apply_add_rmsnorm(layer, x, res, norm.weight, norm.eps, None, False,
                                          (positions, rotary)) is None
    y, r = layer.forward_prenorm(x, res, norm, rope=(positions, rotary))  # the fallback
    h_ref, r_ref = _ref(x, res, norm)
    assert torch.equal(r, r_ref) and not any(c["cfg"].get("NORM") for c in fake.calls)
    ref = _roped_ref(h_ref.double() @ w_ref.double(), positions, rotary, 2, 1, 32, torch.float16)
    assert _err(y, ref) <= BOUND[torch.float16]
    with pytest.raises(ValueError, match="need 131200 bytes of shared memory"):
        w4_mma.mma_gemm_rmsnorm(x, res, norm.weight, norm.eps, layer.qweight, layer.mma_scales, layer.wzeros,
                                group_size=1024, n=layer.wna16_n)


def test_rotary_layout_follows_fuse_norm(gen, monkeypatch):
    # fuse_norm false is the A/B baseline: the q|k|v weight keeps the plain mma layout
    import w4_mma_emulate
    w4_mma_emulate.install(monkeypatch)
    monkeypatch.setattr(w4_mma, "runtime_blocker", lambda device: None)
    from kvforge_plugins.quant import weight_only
    real = weight_only.WNA16LinearMethod.__init__
    monkeypatch.setattr(weight_only.WNA16LinearMethod, "__init__",
                        lambda self, *a, **kw: real(self, *a, **{**kw, "fuse_norm": False}))
    layer, _ = _qkv_layer(256, 4, 2, 64, 64, torch.float16, "cpu", gen)
    assert layer.wna16_layout == "mma" and layer.wna16_rope is None
