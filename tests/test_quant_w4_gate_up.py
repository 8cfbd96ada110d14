"""The fused SwiGLU of the mma int4 layout: a gate|up pair packed with its rows interleaved
(``w4_mma.interleave_gate_up``) so the kernel's ``ACT`` epilogue writes silu(gate) * up.

On the CPU: the interleave worked by hand, the kernel's index arithmetic and epilogue
through the emulation (tests/w4_mma_emulate.py: fused path, KW, split K, and the dequantize
path past M = 64), and an AWQ gate|up layer repacked this way, whose ``forward`` must still
give [gate | up] in checkpoint order. On a GPU: the same layer with the real kernel. The
reference is silu(x @ Wg) * (x @ Wu) in fp64 from the dequantized weights; fresh random data
each run. Bounds as tests/test_quant_w4_mma.py (bf16 1e-2, fp16 2e-3 of max |ref|), widened
for the SwiGLU by ``_act_bound`` where its arithmetic rounds more.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvforge_plugins.quant.kernels import w4_mma
from test_quant_w4_mma import BOUND, _quant, cuda, gen  # noqa: F401  (gen: the fresh-seed fixture)


def _swiglu_ref(x, w_ref):
    """silu(x @ Wg) * (x @ Wu) in fp64; w_ref [K, 2I] = [gate | up] in checkpoint order."""
    y = x.double() @ w_ref.double()
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def _err(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def _act_bound(m, dtype):
    """Bound on silu(gate) * up: a product of two GEMM outputs, so it carries the relative
    error of both plus its own rounding (u below: the unit roundoff, bf16 2^-8, fp16 2^-11;
    BOUND is 2.56u for bf16, 4.1u for fp16).

    Past MAX_FUSED_M (dequantize + matmul, activation in torch; the reference backend always)
    the weight is rounded to the model dtype and gate and up are rounded before silu * up:
    three roundings reach 3u of max |ref| by themselves. Measured: bf16 over 200 seeds, median
    5.3e-3, max 1.08e-2 (110 more seeds of test_emulated_gate_up_layer at M = 70: max 1.22e-2);
    fp16 (test_emulated_gate_up_layer, M = 70) over 110 seeds, median 6.6e-4, max 1.44e-3
    (2.95u, 0.72 of 2e-3). So both dtypes get twice the bound there.

    The fused epilogue rounds once, but with SCALE_A the scaled weight is rounded to the
    operand dtype (as past MAX_FUSED_M): bf16 case 4 of CASES over 54 seeds, median 3.9e-3,
    max 7.4e-3 (1.9u, 0.74 of 1e-2; fp16: 0.48 of its bound). So bf16 gets 1.5 times the
    bound there. A misplaced gate or up row, or a missing silu, still errs by O(1)."""
    if m > w4_mma.MAX_FUSED_M:
        return 2 * BOUND[dtype]
    return BOUND[dtype] * (1.5 if dtype == torch.bfloat16 else 1)


def test_interleave_worked_by_hand():
    # I = 16: features 0..15 are gate, 16..31 up; tile T holds gate 8T..8T+8 then up 8T..8T+8
    got = w4_mma.interleave_gate_up(torch.arange(32))
    want = [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert got.tolist() == want
    t = torch.randn(3, 64, 5)
    assert torch.equal(w4_mma.deinterleave_gate_up(w4_mma.interleave_gate_up(t.transpose(1, 2))),
                       t.transpose(1, 2))
    y = torch.randn(2, 32, dtype=torch.float64)
    act = w4_mma.silu_and_mul_interleaved(w4_mma.interleave_gate_up(y))
    assert torch.allclose(act, F.silu(y[:, :16]) * y[:, 16:])


# (K, I, group, M, config): defaults, KW with idle warps, split K (activation after the sum),
# and M = 70 (dequantize + cuBLAS path, activation in torch)
CASES = [(256, 96, 64, 1, None), (512, 64, 128, 5, dict(TW=2, WARPS=4, KW=2, S=2)),
         (640, 160, 128, 9, dict(TW=1, WARPS=2, split_k=3, S=1, CPA=3)), (256, 64, 128, 70, None),
         (768, 320, 256, 40, dict(NB=8, TW=1, WARPS=8, CPA=4, XR=1, WG=2, SCALE_A=True))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_emulated_fused_swiglu(case, dtype, gen, monkeypatch):
    import w4_mma_emulate
    k, inter, group, m, cfg = CASES[case]
    fake = w4_mma_emulate.install(monkeypatch)
    q, s, z, w_ref = _quant(k, 2 * inter, group, gen)
    il = w4_mma.interleave_gate_up
    ps, pz = w4_mma.pack_mma_groups(il(s), il(z))
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = w4_mma.mma_gemm(x, w4_mma.pack_mma(il(q)), ps, pz, group_size=group, n=2 * inter, config=cfg,
                        silu_and_mul=True)
    assert y.shape == (m, inter) and y.dtype == dtype
    err = _err(y, _swiglu_ref(x, w_ref))
    assert err <= _act_bound(m, dtype), f"seed {gen.initial_seed()} case {case}: {err}"
    if m <= w4_mma.MAX_FUSED_M:
        assert fake.calls[-1]["cfg"]["ACT"] == 1


def _gate_up_layer(inter, k, group, dtype, device, gen, backend, **settings):
    """An AWQ gate|up layer (``MergedColumnParallelLinear``) loaded shard by shard; ``settings``:
    more AWQSettings."""
    from kvforge.layers.parallel_linear import MergedColumnParallelLinear
    from kvforge_plugins.quant.awq import AWQConfig, AWQSettings
    qc = AWQConfig({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"},
                   AWQSettings(backend=backend, int4_layout="mma", **settings))
    with torch.device(device):
        layer = MergedColumnParallelLinear(k, [inter, inter], False, qc, "model.layers.0.mlp.gate_up_proj", dtype,
                                           parallel=False)
    return layer, load_awq_shards(layer, k, group, gen, device)


def load_awq_shards(layer, k, group, gen, device):
    """Random 4-bit weights for ``layer`` (its ``output_sizes``), loaded shard by shard in
    AutoAWQ's GEMM format, then processed; returns the dequantized W_ref [K, N] (fp16 scales)."""
    from kvforge_plugins.quant.common import pack_rows
    q, s, z, _ = _quant(k, sum(layer.output_sizes), group, gen)
    c0 = 0
    for i, size in enumerate(layer.output_sizes):
        order = torch.arange(size).view(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)  # AutoAWQ's nibble order
        cols = slice(c0, c0 + size)
        layer.load("qweight", pack_rows(q[:, cols][:, order].t().contiguous(), 4).t().contiguous().to(device), i)
        layer.load("qzeros", pack_rows(z[:, cols][:, order].t().contiguous(), 4).t().contiguous().to(device), i)
        layer.load("scales", s[:, cols].half().to(device), i)
        c0 += size
    layer.method.process_weights_after_loading(layer)
    return (q - z[torch.arange(k) // group]).float() * s.half().float()[torch.arange(k) // group]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_gate_up_layer(dtype, gen, monkeypatch):
    import w4_mma_emulate
    w4_mma_emulate.install(monkeypatch)
    monkeypatch.setattr(w4_mma, "runtime_blocker", lambda device: None)  # the emulated kernel runs on the CPU
    layer, w_ref = _gate_up_layer(96, 256, 64, dtype, "cpu", gen, backend="triton")
    assert layer.wna16_layout == "mma" and layer.wna16_gated
    for m in (1, 3, 70):
        x = torch.randn(m, 256, generator=gen).to(dtype)
        y = layer(x)  # forward: [gate | up] in checkpoint order, whatever the layout
        ref = x.double() @ w_ref.double()
        assert _err(y, ref) <= BOUND[dtype], f"seed {gen.initial_seed()} M={m}"
        act = layer.silu_and_mul(x)
        assert act.shape == (m, 96)
        assert _err(act, _swiglu_ref(x, w_ref)) <= _act_bound(m, dtype), f"seed {gen.initial_seed()} M={m}"


def test_reference_backend_keeps_checkpoint_order(gen):
    # no kernel: nothing is repacked, silu_and_mul is forward + the activation
    layer, w_ref = _gate_up_layer(64, 128, 64, torch.float16, "cpu", gen, backend="reference")
    assert not layer.wna16_gated
    x = torch.randn(4, 128, generator=gen).half()
    # dequantize + matmul + activation in torch, as past MAX_FUSED_M (see _act_bound): 110
    # seeds, median 6.0e-4, max 1.43e-3 (0.72 of 2e-3)
    assert _err(layer.silu_and_mul(x), _swiglu_ref(x, w_ref)) <= 2 * BOUND[torch.float16]


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fused_swiglu_cases(dtype, gen):
    """The emulated cases' configs on the GPU (WG 2's producer warp with the SwiGLU epilogue among them)."""
    if w4_mma.runtime_blocker(torch.device("cuda")):
        pytest.skip(w4_mma.runtime_blocker(torch.device("cuda")))
    for k, inter, group, m, cfg in CASES:
        q, s, z, w_ref = _quant(k, 2 * inter, group, gen)
        il = w4_mma.interleave_gate_up
        ps, pz = w4_mma.pack_mma_groups(il(s), il(z))
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        y = w4_mma.mma_gemm(x, w4_mma.pack_mma(il(q)).cuda(), ps.cuda(), pz.cuda(), group_size=group, n=2 * inter,
                            config=cfg, silu_and_mul=True)
        err = _err(y.cpu(), _swiglu_ref(x.cpu(), w_ref))
        assert err <= BOUND[dtype], f"seed {gen.initial_seed()} {cfg}: {err}"


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gate_up_layer(dtype, gen):
    if w4_mma.runtime_blocker(torch.device("cuda")):
        pytest.skip(w4_mma.runtime_blocker(torch.device("cuda")))
    layer, w_ref = _gate_up_layer(1024, 512, 128, dtype, "cuda", gen, backend="auto")
    assert layer.wna16_gated
    w_ref = w_ref.cuda()
    for m in (1, 7, 16, 64, 100):
        x = torch.randn(m, 512, device="cuda", dtype=dtype)
        with torch.inference_mode():
            y, act = layer(x), layer.silu_and_mul(x)
        assert _err(y, x.double() @ w_ref.double()) <= BOUND[dtype], f"seed {gen.initial_seed()} M={m}"
        assert _err(act, _swiglu_ref(x, w_ref)) <= _act_bound(m, dtype), f"seed {gen.initial_seed()} M={m}"


@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float32])
def test_emulated_gptq_gate_up_layer(desc_act, x_dtype, monkeypatch):
    # GPTQ act-order permutes the weight's K rows at load: x must be gathered the same way on
    # the fused path too; an fp32 x takes the dequantize path. Weights from the quantizer's
    # own conformance fixture (make_test_weights), random g_idx with desc_act.
    import w4_mma_emulate
    from kvforge.layers.parallel_linear import MergedColumnParallelLinear
    from kvforge_plugins.quant.gptq import GPTQConfig, GPTQSettings
    w4_mma_emulate.install(monkeypatch)
    monkeypatch.setattr(w4_mma, "runtime_blocker", lambda device: None)
    k, inter = 256, 64
    qc = GPTQConfig({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": desc_act, "sym": False},
                    GPTQSettings(backend="triton", int4_layout="mma"))
    layer = MergedColumnParallelLinear(k, [inter, inter], False, qc, "model.layers.0.mlp.gate_up_proj",
                                       torch.float16, parallel=False)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)
    tensors = layer.method.make_test_weights(k, [inter, inter], torch.float16, gen)
    for name, shards in tensors.items():
        for i, t in enumerate(shards):
            layer.load(name, t, i)
    layer.method.process_weights_after_loading(layer)
    assert layer.wna16_gated and (layer.perm is not None) == desc_act
    w_ref = layer.method.dequantize_test_weights(tensors, k, [inter, inter]).float().t()  # [K, 2I]
    for m in (3, 70):
        x = torch.randn(m, k, generator=gen).to(x_dtype)
        bound = BOUND[torch.float16]
        assert _err(layer(x), x.double() @ w_ref.double()) <= bound, f"seed {gen.initial_seed()} M={m}"
        # M = 70 with fp16 x: the dequantize path's SwiGLU (gate and up rounded first), as above
        # (110 seeds: median 6.4e-4, max 1.2e-3, 0.60 of 2e-3)
        assert _err(layer.silu_and_mul(x), _swiglu_ref(x, w_ref)) <= _act_bound(m, torch.float16), \
            f"seed {gen.initial_seed()} M={m}"


def test_kw_is_cut_to_the_groups_there_are(gen, monkeypatch):
    # the tuned table is keyed by shape, not group size: a KW = 8 entry meeting a per-channel
    # (one group) weight would leave 7 of 8 warps idle; mma_gemm runs it as KW = 1
    import w4_mma_emulate
    fake = w4_mma_emulate.install(monkeypatch)
    k, n = 256, 128
    q, s, z, w_ref = _quant(k, n, k, gen)
    ps, pz = w4_mma.pack_mma_groups(s, z)
    x = torch.randn(2, k, generator=gen).half()
    y = w4_mma.mma_gemm(x, w4_mma.pack_mma(q), ps, pz, group_size=k, n=n, config=dict(TW=1, WARPS=8, KW=8))
    assert fake.calls[-1]["cfg"]["KW"] == 1
    assert _err(y, x.double() @ w_ref.double()) <= BOUND[torch.float16]
    assert w4_mma.fit_kw(dict(WARPS=8, KW=8), 4 * 64, 64)["KW"] == 4  # 4 groups: KW 4 still divides 8
    assert w4_mma.fit_kw(dict(WARPS=6, KW=6), 5 * 64, 64)["KW"] == 3
    with pytest.raises(ValueError, match="multiple of 16"):
        w4_mma.interleave_gate_up(torch.zeros(24))
    with pytest.raises(ValueError, match=r"\['KW'\] must be integers"):
        w4_mma.mma_gemm(x, w4_mma.pack_mma(q), ps, pz, group_size=k, n=n, config=dict(KW=None))
