"""The pre-norm folded into the int4 mma GEMM (``w4_mma.mma_gemm_rmsnorm``, the kernel's
``NORM`` prologue): y = GEMM(RMSNorm(x + residual) * w) and r = x + residual from one kernel.

Reference: ``kvforge.layers.layernorm.RMSNorm`` (its torch path, or the Triton kernel on a
GPU) then the GEMM of the dequantized weight in fp64; fresh random data each run. The residual
out is compared bit for bit (the same fp32 add, rounded once). y to the GEMM bounds of
tests/test_quant_w4_mma.py (bf16 1e-2, fp16 2e-3 of max |ref|): the normalized x may differ
from the reference's in the last bit where the fp32 sums of squares are added in another
order. On the CPU through the kernel emulation (tests/w4_mma_emulate.py: whole normalized rows
in shared memory, split K, KW, the SwiGLU epilogue); the model layers through their fallback
(norm, then GEMM); on a GPU the real kernel, in a layer and a whole model.
"""
from __future__ import annotations

import pytest
import torch

from kvforge.layers.layernorm import RMSNorm
from kvforge_plugins.quant.kernels import w4_mma
from test_quant_w4_gate_up import _err, _gate_up_layer, _swiglu_ref
from test_quant_w4_mma import BOUND, _quant, cuda, gen  # noqa: F401  (gen: the fresh-seed fixture)


def _norm(k, dtype, gen, device="cpu"):
    norm = RMSNorm(k, 1e-5, dtype).to(device)
    norm.weight.data.copy_((1 + 0.3 * torch.randn(k, generator=gen)).to(dtype))
    return norm


def _ref(x, residual, norm):
    """(RMSNorm(x + residual) * w, x + residual) by the torch path, as the model's fallback."""
    r = x + residual
    return norm._norm(r), r


# (K, N, group, M, config): defaults, KW, split K with CPA stages, the SwiGLU epilogue, a
# tuned x-ring config (XR / WG: the prologue's rows take the ring's place, so it runs without),
# and chunk addresses from per-warp bases (CUR)
CASES = [(256, 128, 64, 1, None, False), (512, 192, 128, 5, dict(TW=2, WARPS=4, KW=2, S=2), False),
         (640, 256, 128, 8, dict(TW=1, WARPS=2, split_k=3, S=1, CPA=3), False),
         (512, 2 * 96, 64, 3, dict(TW=1, WARPS=4, KW=4, split_k=2), True),
         (512, 128, 64, 4, dict(TW=1, WARPS=4, CPA=3, XR=1, WG=1, SCALE_A=True), False),
         (512, 192, 128, 2, dict(TW=2, WARPS=4, KW=2, S=2, CUR=1), False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_emulated_prenorm_gemm(case, dtype, gen, monkeypatch):
    import w4_mma_emulate
    k, n, group, m, cfg, act = CASES[case]
    fake = w4_mma_emulate.install(monkeypatch)
    q, s, z, w_ref = _quant(k, n, group, gen)
    il = w4_mma.interleave_gate_up if act else (lambda t: t)
    ps, pz = w4_mma.pack_mma_groups(il(s), il(z))
    x, res = (torch.randn(m, k, generator=gen).to(dtype) for _ in range(2))
    norm = _norm(k, dtype, gen)
    y, r = w4_mma.mma_gemm_rmsnorm(x, res, norm.weight, norm.eps, w4_mma.pack_mma(il(q)), ps, pz, group_size=group,
                                   n=n, config=cfg, silu_and_mul=act)
    h_ref, r_ref = _ref(x, res, norm)
    assert torch.equal(r, r_ref)
    ref = _swiglu_ref(h_ref, w_ref) if act else h_ref.double() @ w_ref.double()
    err = _err(y, ref)
    assert err <= BOUND[dtype], f"seed {gen.initial_seed()} case {case}: {err}"
    call = fake.calls[-1]
    assert call["cfg"]["NORM"] == 1 and call["cfg"]["XS"] == 1 and not call["cfg"].get("XR") \
        and not call["cfg"].get("WG")
    assert call["smem"] >= m * (k + 8) * 2  # whole rows, not the split's slice


def test_prenorm_refuses_bad_operands(gen):
    k, n = 128, 64
    q, s, z, _ = _quant(k, n, 64, gen)
    ps, pz = w4_mma.pack_mma_groups(s, z)
    words = w4_mma.pack_mma(q)
    x = torch.randn(2, k, generator=gen).half()
    w = torch.ones(k, dtype=torch.float16)
    with pytest.raises(ValueError, match="M 9 must be 1..8"):
        w4_mma.mma_gemm_rmsnorm(torch.randn(9, k).half(), torch.randn(9, k).half(), w, 1e-5, words, ps, pz,
                                group_size=64, n=n)
    with pytest.raises(ValueError, match="residual"):
        w4_mma.mma_gemm_rmsnorm(x, x[:1], w, 1e-5, words, ps, pz, group_size=64, n=n)
    with pytest.raises(ValueError, match="norm weight"):
        w4_mma.mma_gemm_rmsnorm(x, x, w.float(), 1e-5, words, ps, pz, group_size=64, n=n)
    with pytest.raises(ValueError, match="eps"):
        w4_mma.mma_gemm_rmsnorm(x, x, w, 0.0, words, ps, pz, group_size=64, n=n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_layer_prenorm(dtype, gen, monkeypatch):
    # FusedLinear.forward_prenorm: the method's fused path for T <= fuse_norm_max_tokens (2 by
    # default, up to 8), the fallback (norm, then the GEMM) past it, the same numbers either way
    import w4_mma_emulate
    fake = w4_mma_emulate.install(monkeypatch)
    monkeypatch.setattr(w4_mma, "runtime_blocker", lambda device: None)
    default = _gate_up_layer(96, 256, 64, dtype, "cpu", gen, backend="triton")
    eight = _gate_up_layer(96, 256, 64, dtype, "cpu", gen, backend="triton", fuse_norm_max_tokens=8)
    norm = _norm(256, dtype, gen)
    for (layer, w_ref), m, fused in ((default, 1, True), (default, 2, True), (default, 3, False),
                                     (default, 8, False), (eight, 8, True), (eight, 9, False)):
        x, res = (torch.randn(m, 256, generator=gen).to(dtype) for _ in range(2))
        before = len(fake.calls)
        act, r = layer.forward_prenorm(x, res, norm, silu_and_mul=True)
        h_ref, r_ref = _ref(x, res, norm)
        assert torch.equal(r, r_ref)
        assert _err(act, _swiglu_ref(h_ref, w_ref)) <= BOUND[dtype], f"seed {gen.initial_seed()} M={m}"
        assert bool(fake.calls[before]["cfg"].get("NORM")) == fused
        y, r2 = layer.forward_prenorm(x, res, norm)  # [gate | up] asked: the norm runs apart
        assert not fake.calls[-1]["cfg"].get("NORM") and torch.equal(r2, r_ref)
        assert _err(y, h_ref.double() @ w_ref.double()) <= BOUND[dtype]


def test_forward_prenorm_fallback_and_errors():
    from kvforge.layers.parallel_linear import QKVParallelLinear
    from kvforge_plugins.quant.unquantized import UnquantizedConfig
    layer = QKVParallelLinear(64, 16, 4, 2, False, UnquantizedConfig(), "qkv", torch.float32, parallel=False)
    layer.weight.data.normal_()
    norm = RMSNorm(64, 1e-6, torch.float32)
    x, res = torch.randn(3, 64), torch.randn(3, 64)
    y, r = layer.forward_prenorm(x, res, norm)
    h, r_ref = norm(x, res)
    assert torch.equal(r, r_ref) and torch.allclose(y, layer(h))
    with pytest.raises(ValueError, match="silu_and_mul needs a gate\\|up layer"):
        layer.forward_prenorm(x, res, norm, silu_and_mul=True)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_prenorm_gemm(dtype, gen):
    if w4_mma.runtime_blocker(torch.device("cuda")):
        pytest.skip(w4_mma.runtime_blocker(torch.device("cuda")))
    for k, n, group, act in ((4096, 1024, 128, False), (512, 2048, 128, True)):
        q, s, z, w_ref = _quant(k, n, group, gen)
        il = w4_mma.interleave_gate_up if act else (lambda t: t)
        ps, pz = (t.cuda() for t in w4_mma.pack_mma_groups(il(s), il(z)))
        words, w_ref = w4_mma.pack_mma(il(q)).cuda(), w_ref.cuda()
        norm = _norm(k, dtype, gen, "cuda")
        for m in (1, 3, 8):
            x, res = (torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(2))
            y, r = w4_mma.mma_gemm_rmsnorm(x, res, norm.weight, norm.eps, words, ps, pz, group_size=group, n=n,
                                           silu_and_mul=act)
            h_ref, r_ref = norm(x, res)  # the Triton kernel the fused path replaces
            assert torch.equal(r, r_ref)
            ref = _swiglu_ref(h_ref, w_ref) if act else h_ref.double() @ w_ref.double()
            assert _err(y, ref) <= BOUND[dtype], f"seed {gen.initial_seed()} K={k} M={m}"


@cuda
def test_gpu_model_prenorm_matches_unfused(tmp_path, gen, monkeypatch):
    # A random fp16 Llama (2 layers, hidden 256) quantized to an AutoAWQ g64 checkpoint, run
    # token by token (one token per step: the fused path's batch) with the norm folded into
    # the qkv and gate|up GEMMs, against the same engine with fuse_norm false. Measured
    # difference: the unfused run's own fp16 noise (the normalized x may differ in its last bit).
    import json
    import shutil

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import make_engine, prompt_logits
    from test_quant_fixtures import AUX_FILES, AWQ_ORDER, PROJ, STORIES, pack_along_cols, rtn_groups
    if w4_mma.runtime_blocker(torch.device("cuda")):
        pytest.skip(w4_mma.runtime_blocker(torch.device("cuda")))
    torch.manual_seed(gen.initial_seed())
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=256,
                      torch_dtype="float16", bos_token_id=1, eos_token_id=2)
    state = LlamaForCausalLM(cfg).half().state_dict()
    tensors, group = {}, 64
    for name, t in state.items():
        mod = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and mod.rsplit(".", 1)[-1] in PROJ:
            wt = t.float().t().contiguous()
            q, s, z = rtn_groups(wt, 4, torch.arange(wt.shape[0]) // group, wt.shape[0] // group, sym=False)
            tensors.update({f"{mod}.qweight": pack_along_cols(q, 4, AWQ_ORDER),
                            f"{mod}.qzeros": pack_along_cols(z, 4, AWQ_ORDER), f"{mod}.scales": s.half()})
        else:
            tensors[name] = t.contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for f in AUX_FILES:  # stories260K's tokenizer: its 512 ids are this model's vocabulary
        if (STORIES / f).exists():
            shutil.copy(STORIES / f, tmp_path / f)
    (tmp_path / "config.json").write_text(json.dumps({
        **cfg.to_dict(), "architectures": ["LlamaForCausalLM"],
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                "version": "gemm"}}))
    calls = []
    real = w4_mma.mma_gemm_rmsnorm
    monkeypatch.setattr(w4_mma, "mma_gemm_rmsnorm", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(3, 512, (24,), generator=gen).tolist()
    logits = {}
    for fuse in (True, False):
        # eager: each step calls the layers' Python (a replayed CUDA graph would not reach the spy)
        engine = make_engine(model=str(tmp_path), device="cuda", dtype="float16", kv_cache_memory_bytes=1 << 24,
                             enforce_eager=True,
                             **{"quantization.settings.int4_layout": "mma",
                                "quantization.settings.fuse_norm": fuse})
        n0 = len(calls)
        logits[fuse] = prompt_logits(engine, [ids], chunks=[[1] * len(ids)])[0]
        assert (len(calls) > n0) == fuse  # two per layer and token where fused, none otherwise
        del engine
    ref = logits[False]
    rel = ((logits[True] - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-2, f"seed {gen.initial_seed()}: fused vs unfused logits differ by {rel:.2e} of max |logit|"


def test_decoder_layer_keeps_an_overridden_forward():
    # a plugin's attention / MLP subclass that replaces forward is called as before (the
    # norm then runs apart), not bypassed by forward_prenorm
    from kvforge_plugins.models.llama import LlamaAttention, LlamaMLP, _keeps_forward

    class MyMLP(LlamaMLP):
        def forward(self, x):
            return x

    class SameMLP(LlamaMLP):
        pass
    assert not _keeps_forward(object.__new__(MyMLP), LlamaMLP)
    assert _keeps_forward(object.__new__(SameMLP), LlamaMLP)
    assert _keeps_forward(object.__new__(LlamaAttention), LlamaAttention)
    assert not _keeps_forward(torch.nn.Identity(), LlamaMLP)
