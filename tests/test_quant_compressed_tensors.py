"""Checkpoints written by the ``compressed-tensors`` library itself (the independent
reference for its formats), loaded by kvforge's ``compressed-tensors`` quantizer.

The library quantizes the Hugging Face stories260K model (``apply_quantization_config``,
scales set by round-to-nearest min/max since llm-compressor's observers are not part of
it), compresses it (``ModelCompressor.compress_model``) and saves it (``save_pretrained`` +
``update_config``). Checks:

* every quantized kvforge layer dequantizes to exactly the weights the library's own
  ``decompress_model`` produces (max abs difference <= 1e-6: both compute q * s in fp32);
* end to end, logits ``max|q - fp32| / max|fp32|`` within the bounds of the matching
  formats of test_quant_e2e.py (measured on this prompt in brackets): W8A8 INT8 0.05
  [0.028], FP8 dynamic / static 0.15 [0.071 / 0.076], W4A16 group 32 asym 0.25 [0.165],
  W8A16 per-channel 0.03 [0.019]; the method is chosen from config.json alone.

Skipped where compressed-tensors is not installed.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers import make_engine, prompt_logits
from test_quant_fixtures import AUX_FILES, STORIES, calibrate_input_amax

ct = pytest.importorskip("compressed_tensors")

IDS = [[1, 291, 400, 428, 352, 303, 267, 265, 370, 259, 276, 411, 426, 346, 286, 393, 269]]  # "The dog ran to the big tree. He was happy and"


def _schemes():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme
    return {
        "int8_w8a8": (preset_name_to_scheme("W8A8", ["Linear"]), ["lm_head"], 0.05),
        "fp8_dynamic": (preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]), ["lm_head"], 0.15),
        "fp8_static": (preset_name_to_scheme("FP8", ["Linear"]), ["lm_head"], 0.15),
        "w4a16_g32_asym": (QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=32, symmetric=False)), ["lm_head", "re:.*mlp.*"], 0.25),
        "w8a16_channel_sym": (QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=8, type="int", strategy="channel", symmetric=True)), ["lm_head"], 0.03),
    }


def _set_scales(module: torch.nn.Module, args, amax_in: float | None) -> None:
    """Round-to-nearest min/max scales (what an observer would compute) on one module."""
    w = module.weight.float()
    n, k = w.shape
    if args.type == "float":
        qmax, levels = 448.0, None
    else:
        qmax, levels = 2 ** (args.num_bits - 1) - 1, 2 ** args.num_bits - 1
    if args.strategy == "group":
        wg = w.view(n, k // args.group_size, args.group_size)
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True).clamp(max=0), w.amax(1, keepdim=True).clamp(min=0)
    else:
        lo, hi = w.amin().clamp(max=0).reshape(1), w.amax().clamp(min=0).reshape(1)
    if args.symmetric:
        scale = torch.maximum(-lo, hi) / qmax
    else:
        scale = (hi - lo) / levels
        zp = torch.round(-lo / scale) - 2 ** (args.num_bits - 1)
        module.weight_zero_point.data = zp.clamp(-2 ** (args.num_bits - 1), qmax).to(module.weight_zero_point.dtype)
    module.weight_scale.data = scale.float().reshape(module.weight_scale.shape)
    if amax_in is not None and hasattr(module, "input_scale"):
        module.input_scale.data = torch.tensor(amax_in / 448.0).reshape(module.input_scale.shape)


def build_ct(out: Path, case: str):
    """Returns (checkpoint dir, {hf module name: the library's decompressed weight})."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM
    scheme, ignore, _ = _schemes()[case]
    amax = calibrate_input_amax() if case == "fp8_static" else {}
    model = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore))
    quantized = []
    for name, m in model.named_modules():
        if hasattr(m, "weight_scale"):
            _set_scales(m, scheme.weights, amax.get(name))
            quantized.append(name)
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    model.save_pretrained(str(out))
    comp.update_config(str(out))
    for f in AUX_FILES:
        if (STORIES / f).exists():
            shutil.copy(STORIES / f, out / f)
    comp.decompress_model(model)
    return out, {n: model.get_submodule(n).weight.detach().float().clone() for n in quantized}


def _kv_weight(layer, n_rows_per_shard: list[int]) -> torch.Tensor:
    """kvforge layer's dequantized weight [N, K] (fp32)."""
    m = layer.method
    if hasattr(m, "dequantized"):
        return m.dequantized(layer, torch.float32).t()
    s = layer.weight_scale.float()
    return layer.weight.float() * (s.view(-1, 1) if s.numel() > 1 else s)


@pytest.fixture(scope="module")
def fp32_logits():
    return prompt_logits(make_engine(model=str(STORIES), device="cpu", kv_cache_memory_bytes=1 << 20), IDS)[0]


@pytest.mark.parametrize("case", list(_schemes()))
def test_library_checkpoint_loads_exactly(case, tmp_path, fp32_logits):
    d, lib_weights = build_ct(tmp_path / case, case)
    eng = make_engine(model=str(d), device="cpu", kv_cache_memory_bytes=1 << 20)
    assert eng.config.quantization.method == "auto"
    model = eng.runner.model
    checked = 0
    for i in range(5):
        for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn.o_proj", ("o_proj",)),
                             ("mlp.gate_up_proj", ("gate_proj", "up_proj")), ("mlp.down_proj", ("down_proj",))):
            names = [f"model.layers.{i}.{fused.split('.')[0]}.{p}" for p in parts]
            layer = model.get_submodule(f"model.layers.{i}.{fused}")
            if names[0] not in lib_weights:
                assert type(layer.method).__name__ == "UnquantizedLinearMethod"
                continue
            want = torch.cat([lib_weights[n] for n in names])
            got = _kv_weight(layer, [w.shape[0] for w in (lib_weights[n] for n in names)])
            assert (got - want).abs().max().item() <= 1e-6, f"{case} {fused} layer {i}"
            checked += 1
    assert checked >= 10
    rel = ((prompt_logits(eng, IDS)[0] - fp32_logits).abs().max() / fp32_logits.abs().max()).item()
    bound = _schemes()[case][2]
    print(f"{case}: logits rel {rel:.4f} (bound {bound})")
    assert 1e-5 < rel <= bound, f"{case}: logits rel {rel:.4f} > {bound}"


def test_unsupported_scheme_refused(tmp_path):
    import json
    d, _ = build_ct(tmp_path / "w", "int8_w8a8")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="kv_cache_scheme"):
        make_engine(model=str(d), device="cpu", kv_cache_memory_bytes=1 << 20)
