"""Quantized checkpoints through kvforge's loaders: every format's tensors decode to the
reference dequantization, and unsupported configs or corrupt / mismatched tensors are
refused with a message naming the tensor (fixtures: test_quant_fixtures.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_quant_fixtures import AWQ_ORDER, STORIES, build_awq, build_fp8, build_gptq, dequant


# =============================================================================================
# Loading: every format's tensors decode to the reference dequantization
# =============================================================================================

def _engine(path, **kw):
    from helpers import make_engine
    return make_engine(model=str(path), device="cpu", kv_cache_memory_bytes=1 << 20, **kw)


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    return build_awq(tmp_path_factory.mktemp("awq"))


@pytest.fixture(scope="module")
def gptq8_dir(tmp_path_factory):
    return build_gptq(tmp_path_factory.mktemp("gptq8"), bits=8, group_size=4, sym=False, desc_act=True)


def _fp32_weight(hf_name: str) -> torch.Tensor:
    return load_file(str(STORIES / "model.safetensors"))[hf_name].float()


def test_awq_layer_decodes_to_reference(awq_dir):
    """The loaded fused q|k|v layer computes x @ dequant(W)^T for the checkpoint's own tensors."""
    eng = _engine(awq_dir)
    layer = eng.runner.model.get_submodule("model.layers.1.self_attn.qkv_proj")
    st = load_file(str(awq_dir / "model.safetensors"))
    parts = []
    for p in ("q_proj", "k_proj", "v_proj"):
        mod = f"model.layers.1.self_attn.{p}"
        # decode the spec way: column j is nibble AWQ_ORDER.index(j % 8) of word j // 8
        qw, qz, s = st[f"{mod}.qweight"], st[f"{mod}.qzeros"], st[f"{mod}.scales"]
        k, n = qw.shape[0], qw.shape[1] * 8
        cols = torch.arange(n)
        shift = torch.tensor([4 * AWQ_ORDER.index(j % 8) for j in range(n)])
        q = (qw[:, cols // 8] >> shift) & 15
        z = (qz[:, cols // 8] >> shift) & 15
        gr = torch.arange(k) // 32
        parts.append(dequant(q, s, z, gr))
    w = torch.cat(parts, 1)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), x @ w, rtol=1e-5, atol=1e-5)
    # and the dequantized weight is a close approximation of the fp32 weight (4-bit, group 32)
    ref = torch.cat([_fp32_weight(f"model.layers.1.self_attn.{p}.weight").t() for p in ("q_proj", "k_proj",
                                                                                        "v_proj")], 1)
    assert (w - ref).abs().max() / ref.abs().max() < 0.1
    assert type(eng.runner.model.get_submodule("model.layers.1.mlp.gate_up_proj").method).__name__ == \
        "UnquantizedLinearMethod"


def test_gptq_act_order_layer_decodes_to_reference(gptq8_dir):
    eng = _engine(gptq8_dir)
    for prefix, parts in [("model.layers.2.mlp.gate_up_proj", ("gate_proj", "up_proj")),
                          ("model.layers.2.mlp.down_proj", ("down_proj",))]:
        layer = eng.runner.model.get_submodule(prefix)
        st = load_file(str(gptq8_dir / "model.safetensors"))
        ws = []
        for p in parts:
            mod = f"model.layers.2.mlp.{p}"
            qw, qz, s, g = (st[f"{mod}.{t}"] for t in ("qweight", "qzeros", "scales", "g_idx"))
            k, n = qw.shape[0] * 4, qw.shape[1]
            rows, cols = torch.arange(k), torch.arange(n)
            q = (qw[rows // 4] >> (8 * (rows % 4))[:, None]) & 255
            z = ((qz[:, cols // 4] >> (8 * (cols % 4))) & 255) + 1  # v1: stored zero + 1
            ws.append(dequant(q, s, z, g.long()))
        w = torch.cat(ws, 1)
        x = torch.randn(3, w.shape[0])
        torch.testing.assert_close(layer(x), x @ w, rtol=1e-5, atol=1e-5)
        assert layer.g_idx_ref is not None  # act-order was honoured


# =============================================================================================
# Refusals: unsupported configs, corrupt or mismatched tensors
# =============================================================================================

def _rewrite(src: Path, dst: Path, edit_tensors=None, edit_qc=None) -> Path:
    shutil.copytree(src, dst)
    if edit_tensors:
        st = load_file(str(dst / "model.safetensors"))
        edit_tensors(st)
        save_file(st, str(dst / "model.safetensors"))
    if edit_qc:
        cfg = json.loads((dst / "config.json").read_text())
        edit_qc(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("edit,needle", [
    (lambda qc: qc.update(version="gemv"), "version 'gemv'"),
    (lambda qc: qc.update(bits=3), "3-bit"),
    (lambda qc: qc.update(zero_point=False), "zero_point"),
])
def test_awq_unsupported_config_refused(awq_dir, tmp_path, edit, needle):
    d = _rewrite(awq_dir, tmp_path / "bad", edit_qc=edit)
    with pytest.raises(ValueError, match=needle):
        _engine(d)


@pytest.mark.parametrize("edit,needle", [
    (lambda qc: qc.update(bits=3), "3-bit"),
    (lambda qc: qc.update(checkpoint_format="marlin"), "marlin"),
    (lambda qc: qc.update(lm_head=True), "lm_head"),
])
def test_gptq_unsupported_config_refused(gptq8_dir, tmp_path, edit, needle):
    d = _rewrite(gptq8_dir, tmp_path / "bad", edit_qc=edit)
    with pytest.raises(ValueError, match=needle):
        _engine(d)


def test_awq_mlp_not_skipped_refused_naming_layer(awq_dir, tmp_path):
    d = _rewrite(awq_dir, tmp_path / "bad", edit_qc=lambda qc: qc.update(modules_to_not_convert=[]))
    with pytest.raises(ValueError, match=r"gate_up_proj.*multiples of 8.*modules_to_not_convert"):
        _engine(d)


def _bad(st, name, fn):
    st[name] = fn(st[name])


@pytest.mark.parametrize("tensor,fn,needle", [
    ("model.layers.0.self_attn.k_proj.qweight", lambda t: t[:, :2].contiguous(),
     r"k_proj\.qweight' has shape \(64, 2\), expected \(64, 4\)"),
    ("model.layers.3.self_attn.o_proj.qweight", lambda t: t.to(torch.float16),
     r"o_proj\.qweight' has dtype float16, expected int32"),
    ("model.layers.0.self_attn.v_proj.scales", lambda t: t.to(torch.int32),
     r"v_proj\.scales' has dtype int32"),
    ("model.layers.4.self_attn.q_proj.qzeros", lambda t: t[:1].contiguous(), r"q_proj\.qzeros' has shape"),
])
def test_awq_corrupt_tensor_named(awq_dir, tmp_path, tensor, fn, needle):
    d = _rewrite(awq_dir, tmp_path / "bad", edit_tensors=lambda st: _bad(st, tensor, fn))
    with pytest.raises(ValueError, match=needle):
        _engine(d)


def test_missing_scales_named(awq_dir, tmp_path):
    d = _rewrite(awq_dir, tmp_path / "bad", edit_tensors=lambda st: st.pop("model.layers.2.self_attn.k_proj.scales"))
    with pytest.raises(ValueError, match=r"missing tensors for: .*model\.layers\.2\.self_attn\.qkv_proj\.scales#1"):
        _engine(d)


def test_gptq_corrupt_tensors_named(gptq8_dir, tmp_path):
    d = _rewrite(gptq8_dir, tmp_path / "bad1", edit_tensors=lambda st: _bad(
        st, "model.layers.1.mlp.down_proj.g_idx", lambda t: t[:-1].contiguous()))
    with pytest.raises(ValueError, match=r"down_proj\.g_idx' has shape \(171,\), expected \(172,\)"):
        _engine(d)
    d = _rewrite(gptq8_dir, tmp_path / "bad2", edit_tensors=lambda st: _bad(
        st, "model.layers.1.mlp.up_proj.qweight", lambda t: t.t().contiguous()))
    with pytest.raises(ValueError, match=r"up_proj\.qweight' has shape \(172, 16\), expected \(16, 172\)"):
        _engine(d)
    d = _rewrite(gptq8_dir, tmp_path / "bad3", edit_tensors=lambda st: _bad(
        st, "model.layers.0.self_attn.q_proj.g_idx", lambda t: t + 1000))
    with pytest.raises(ValueError, match=r"g_idx: group index out of range"):
        _engine(d)


def test_fp8_corrupt_tensors_named(tmp_path):
    src = build_fp8(tmp_path / "fp8", per_channel=True, static=False)
    d = _rewrite(src, tmp_path / "bad1", edit_tensors=lambda st: _bad(
        st, "model.layers.0.mlp.up_proj.weight", lambda t: t.float()))
    with pytest.raises(ValueError, match=r"up_proj\.weight' has dtype float32, expected float8_e4m3fn"):
        _engine(d)
    d = _rewrite(src, tmp_path / "bad2", edit_tensors=lambda st: _bad(
        st, "model.layers.0.self_attn.k_proj.weight_scale", lambda t: t[:3].contiguous()))
    with pytest.raises(ValueError, match=r"k_proj\.weight_scale' has shape \(3, 1\), expected a per-tensor"):
        _engine(d)
    d = _rewrite(src, tmp_path / "bad3", edit_qc=lambda qc: qc.update(weight_block_size=[128, 128]))
    with pytest.raises(ValueError, match="block-wise"):
        _engine(d)
    d = _rewrite(src, tmp_path / "bad4", edit_tensors=lambda st: st.pop("model.layers.3.mlp.down_proj.weight_scale"))
    with pytest.raises(ValueError, match=r"missing tensors for: model\.layers\.3\.mlp\.down_proj\.weight_scale"):
        _engine(d)


def test_method_mismatch_refused(awq_dir):
    with pytest.raises(ValueError, match="quantized with 'awq'"):
        _engine(awq_dir, quantization="fp8")
    with pytest.raises(ValueError, match="cannot be applied online"):
        _engine(STORIES, quantization="gptq")
    with pytest.raises(ValueError, match="already quantized with 'awq'"):
        _engine(awq_dir, quantization="int8")


def test_settings_are_validated():
    with pytest.raises(ValueError, match="quantization.settings.nope"):
        _engine(STORIES, quantization="fp8", **{"quantization.settings": {"nope": 1}})
    with pytest.raises(ValueError, match="quantization.settings.weight_strategy"):
        _engine(STORIES, quantization="fp8", **{"quantization.settings": {"weight_strategy": "block"}})


def test_device_refusals(monkeypatch):
    """FP8 on a GPU without float8 tensor cores / a torch without float8 is refused with reasons."""
    from kvforge_plugins.quant import common, fp8
    cfg = fp8.FP8Config(None, fp8.FP8Settings())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    reasons = cfg.validate(torch.float16, torch.device("cuda"))
    assert reasons and "8.9" in reasons[0] and "A100" in reasons[0]
    assert cfg.validate(torch.float16, torch.device("cpu")) == []
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert "float8" in common.float8_reasons()[0]
    with pytest.raises(ValueError, match="float8"):
        fp8.FP8Config(None, fp8.FP8Settings())


def test_fp8_fast_accum_refused_by_cublas_falls_back_to_fp32_accumulation(monkeypatch):
    """cuBLAS has no fast-accumulation algorithm for some shapes (row-wise scales + bias at
    M <= 16, K = 14336 on torch 2.11 / H200): that shape retries with fp32 accumulation, is
    remembered, and never reaches the Triton fallback or an error."""
    from kvforge_plugins.quant import w8a8
    from kvforge_plugins.quant.kernels.scaled_mm import quantize_act_ref, scaled_mm_ref
    calls = []

    def fake_torch_mm(qa, sa, qw, ws, out_dtype, bias=None, use_fast_accum=False):
        calls.append(use_fast_accum)
        if use_fast_accum:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return scaled_mm_ref(qa, sa, qw, ws, out_dtype, bias)

    def no_triton(*a, **k):
        raise AssertionError("fell back to Triton")

    monkeypatch.setattr(w8a8, "quantize_act", quantize_act_ref)
    monkeypatch.setattr(w8a8, "scaled_mm_torch", fake_torch_mm)
    monkeypatch.setattr(w8a8, "scaled_mm_triton", no_triton)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    method = w8a8.W8A8LinearMethod(torch.float8_e4m3fn, False, False, w8a8.W8A8Settings(backend="torch"))
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(48, 64, generator=gen), requires_grad=False)
    method.process_weights_after_loading(layer)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(3, 64, generator=gen)
    want = scaled_mm_ref(*quantize_act_ref(x, torch.float8_e4m3fn), layer.weight, layer.weight_scale, x.dtype, bias)
    for _ in range(2):
        assert torch.equal(method._gpu(x, None, layer, bias), want)
    assert calls == [True, False, False]  # refused once, then fp32 accumulation straight away
