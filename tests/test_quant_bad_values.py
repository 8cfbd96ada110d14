"""Quantized checkpoints with corrupt numbers or bad config values are refused at load with a
message naming the checkpoint tensor or the config field; a GPTQ act-order ``g_idx`` is
honoured even under ``desc_act: false``; ``quant_method`` matches ignoring case; quantized
tensors under a config without a method say so (fixtures: test_quant_fixtures.py).

Where values matter (which tensor, which entries, how many) they are drawn fresh each run;
each such test prints its seed (pytest shows it on failure)."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from helpers import urandom_seed
from test_quant_fixtures import build_awq, build_fp8, build_gptq, dequant
from test_quant_formats import _engine, _rewrite

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory):
    return build_awq(tmp_path_factory.mktemp("awq"))


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    """4-bit act-order GPTQ (the MLP left unquantized: 172 is not a multiple of 8)."""
    return build_gptq(tmp_path_factory.mktemp("gptq"), 4, 32, True, True, skip_regex=".*mlp.*",
                      seed=urandom_seed() % 2 ** 31)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return build_fp8(tmp_path_factory.mktemp("fp8"), per_channel=True, static=True)


def _corrupt(src, dst, name: str, value: float, gen: torch.Generator) -> int:
    """Copy checkpoint ``src`` to ``dst`` with 1..5 random entries of tensor ``name`` (all of a
    smaller one) set to ``value``; returns how many."""
    count = []

    def edit(st):
        t = st[name].clone()
        flat = t.reshape(-1)
        count.append(int(torch.randint(1, min(5, flat.numel()) + 1, (1,), generator=gen)))
        flat[torch.randperm(flat.numel(), generator=gen)[:count[0]]] = value
        st[name] = t
    _rewrite(src, dst, edit_tensors=edit)
    return count[0]


def _pick(gen: torch.Generator, options):
    return options[int(torch.randint(len(options), (1,), generator=gen))]


# =============================================================================================
# 1. Scale values
# =============================================================================================

@pytest.mark.parametrize("fmt", ["awq", "gptq"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weight_only_scales_named(fmt, value, awq_dir, gptq_dir, tmp_path):
    seed = urandom_seed()
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    name = f"model.layers.{int(torch.randint(5, (1,), generator=gen))}.self_attn.{_pick(gen, ATTN)}.scales"
    d = tmp_path / "bad"
    count = _corrupt(awq_dir if fmt == "awq" else gptq_dir, d, name, value, gen)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{name}' has {count} non-finite values")):
        _engine(d)


def test_zero_and_negative_weight_only_scales_load(gptq_dir, tmp_path):
    """AWQ/GPTQ scales are only refused when non-finite: a zero scale (an all-zero group) and a
    negative one (some exporters' symmetric scales) dequantize by the formula like any other."""
    seed = urandom_seed()
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    name = f"model.layers.{int(torch.randint(5, (1,), generator=gen))}.self_attn.o_proj.scales"

    def edit(st):
        s = st[name].clone()
        s[0, int(torch.randint(s.shape[1], (1,), generator=gen))] = 0.0
        s[-1] = -s[-1]
        st[name] = s
    d = _rewrite(gptq_dir, tmp_path / "ok", edit_tensors=edit)
    layer = _engine(d).runner.model.get_submodule(name.rsplit(".", 2)[0] + ".o_proj")
    assert layer.scales.float().min() < 0 and (layer.scales == 0).any(), seed


@pytest.mark.parametrize("tensor,value,needle", [
    ("input_scale", float("nan"), "non-finite values"),
    ("input_scale", 0.0, "values <= 0"),
    ("weight_scale", -0.5, "values <= 0"),
    ("weight_scale", float("inf"), "non-finite values"),
])
def test_bad_fp8_scales_named(fp8_dir, tmp_path, tensor, value, needle):
    seed = urandom_seed()
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    proj = _pick(gen, ATTN + ("gate_proj", "up_proj", "down_proj"))
    part = "self_attn" if proj in ATTN else "mlp"
    name = f"model.layers.{int(torch.randint(5, (1,), generator=gen))}.{part}.{proj}.{tensor}"
    count = _corrupt(fp8_dir, tmp_path / "bad", name, value, gen)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{name}' has {count} {needle}")):
        _engine(tmp_path / "bad")


@pytest.mark.parametrize("case,tensor,value,needle", [
    ("int8_w8a8", "weight_scale", float("nan"), "non-finite values"),
    ("int8_w8a8", "weight_scale", 0.0, "values <= 0"),
    ("w4a16_g32_asym", "weight_scale", float("inf"), "non-finite values"),
])
def test_bad_compressed_tensors_scales_named(tmp_path, case, tensor, value, needle):
    """Checkpoints written by the compressed-tensors library (its W8A8 INT8 and W4A16 schemes)."""
    pytest.importorskip("compressed_tensors")
    from test_quant_compressed_tensors import build_ct
    seed = urandom_seed()
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    src, _ = build_ct(tmp_path / case, case)
    name = f"model.layers.{int(torch.randint(5, (1,), generator=gen))}.self_attn.{_pick(gen, ATTN)}.{tensor}"
    count = _corrupt(src, tmp_path / "bad", name, value, gen)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{name}' has {count} {needle}")):
        _engine(tmp_path / "bad")


def test_refused_scales_leave_the_parameter_untouched():
    """The value check runs before the copy: a refused tensor changes nothing."""
    from kvforge_plugins.quant.common import FLOAT_DTYPES, add_param
    from kvforge_plugins.quant.w8a8 import W8A8LinearMethod, W8A8Settings
    layer = torch.nn.Module()
    layer.prefix = "model.layers.0.self_attn.o_proj"
    p = add_param(layer, "scales", (2, 8), torch.float32, dim=1, shard_sizes=[8], allowed=FLOAT_DTYPES,
                  scale_values="finite")
    bad = torch.rand(2, 8) + 0.5
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match=r"o_proj\.scales' has 1 non-finite values"):
        p.weight_loader(p, bad, None)
    assert not p.any() and not p.loaded_shards
    W8A8LinearMethod(torch.float8_e4m3fn, True, True, W8A8Settings()).create_weights(layer, 8, [8], torch.float32)
    for pname, t in (("weight_scale", -torch.rand(8)), ("input_scale", torch.tensor(0.0))):
        param = getattr(layer, pname)
        with pytest.raises(ValueError, match="values <= 0"):
            param.weight_loader(param, t, None)
        assert bool((param == 1).all()) and not param.loaded_shards


# =============================================================================================
# 2. GPTQ act-order g_idx under desc_act: false
# =============================================================================================

def test_gptq_act_order_g_idx_honoured_when_desc_act_false(gptq_dir, tmp_path, caplog):
    d = _rewrite(gptq_dir, tmp_path / "noact", edit_qc=lambda qc: qc.update(desc_act=False))
    with caplog.at_level("WARNING", logger="kvforge.quant"):
        eng = _engine(d)
    assert any("desc_act is false" in r.message and "g_idx" in r.message for r in caplog.records)
    st = load_file(str(d / "model.safetensors"))
    for i in range(5):
        parts = []
        for p in ("q_proj", "k_proj", "v_proj"):
            mod = f"model.layers.{i}.self_attn.{p}"
            qw, qz, s, g = (st[f"{mod}.{t}"] for t in ("qweight", "qzeros", "scales", "g_idx"))
            assert not torch.equal(g.long(), torch.arange(g.numel()) // 32)  # a real permutation
            k, n = qw.shape[0] * 8, qw.shape[1]
            rows, cols = torch.arange(k), torch.arange(n)
            q = (qw[rows // 8] >> (4 * (rows % 8))[:, None]) & 15
            z = ((qz[:, cols // 8] >> (4 * (cols % 8))) & 15) + 1  # v1: stored zero + 1
            parts.append(dequant(q, s, z, g.long()))
        w = torch.cat(parts, 1)
        x = torch.randn(3, w.shape[0])
        layer = eng.runner.model.get_submodule(f"model.layers.{i}.self_attn.qkv_proj")
        torch.testing.assert_close(layer(x), x @ w, rtol=1e-5, atol=1e-5)


# =============================================================================================
# 3. Config fields
# =============================================================================================

@pytest.mark.parametrize("fmt,edit,needle", [
    ("awq", {"bits": None}, r"quantization_config\.bits: expected an integer, got None"),
    ("awq", {"group_size": "abc"}, r"quantization_config\.group_size: expected an integer, got 'abc'"),
    ("awq", {"group_size": 32.7}, r"quantization_config\.group_size: expected an integer, got 32\.7"),
    ("awq", {"zero_point": "false"}, r"quantization_config\.zero_point: expected true or false"),
    ("gptq", {"bits": "eight"}, r"quantization_config\.bits: expected an integer, got 'eight'"),
    ("gptq", {"desc_act": "false"}, r"quantization_config\.desc_act: expected true or false, got 'false'"),
    ("gptq", {"dynamic": {"-:.*mlp(": {}}},
     r"quantization_config\.dynamic\['-:\.\*mlp\('\]: invalid regular expression '\.\*mlp\(': missing \)"),
    ("gptq", {"dynamic": {"-:.*mlp.*": {}, "+:.*o_proj": {"group_size": "x"}}},
     r"quantization_config\.dynamic\['\+:\.\*o_proj'\]\.group_size: expected an integer, got 'x'"),
    ("fp8", {"ignored_layers": ["lm_head", "re:.*mlp["]},
     r"quantization_config\.ignored_layers\[1\]: invalid regular expression"),
])
def test_bad_config_fields_named(fmt, edit, needle, awq_dir, gptq_dir, fp8_dir, tmp_path):
    src = {"awq": awq_dir, "gptq": gptq_dir, "fp8": fp8_dir}[fmt]
    d = _rewrite(src, tmp_path / "bad", edit_qc=lambda qc: qc.update(edit))
    with pytest.raises(ValueError, match=needle):
        _engine(d)


@pytest.mark.parametrize("fmt,keys,needle", [
    ("awq", ("bits", "w_bit"), r"quantization_config\.bits: missing \(also read as w_bit\)"),
    ("awq", ("group_size", "q_group_size"), r"quantization_config\.group_size: missing \(also read as q_group_size\)"),
    ("gptq", ("bits",), r"quantization_config\.bits: missing"),
    ("gptq", ("group_size",), r"quantization_config\.group_size: missing"),
])
def test_missing_bits_or_group_size_named(fmt, keys, needle, awq_dir, gptq_dir, tmp_path):
    """A checkpoint config without its bit width or group size is refused, naming the field (as
    vLLM does): a guessed 4 / 128 failed later, pointing at the wrong cause."""
    d = _rewrite(awq_dir if fmt == "awq" else gptq_dir, tmp_path / "bad",
                 edit_qc=lambda qc: [qc.pop(k, None) for k in keys])
    with pytest.raises(ValueError, match=needle):
        _engine(d)


def test_missing_gptq_desc_act_and_sym_assumed_with_a_warning(gptq_dir, tmp_path, caplog):
    # the act-order fixture: without desc_act its g_idx is still honoured (section 2)
    d = _rewrite(gptq_dir, tmp_path / "ok", edit_qc=lambda qc: [qc.pop(k) for k in ("desc_act", "sym")])
    with caplog.at_level("WARNING"):
        _engine(d)
    assert "quantization_config.desc_act missing; assuming false" in caplog.text
    assert "quantization_config.sym missing; assuming true" in caplog.text


def test_integral_float_group_size_accepted(awq_dir, tmp_path):
    d = _rewrite(awq_dir, tmp_path / "ok", edit_qc=lambda qc: qc.update(group_size=32.0))
    assert _engine(d).runner.model.get_submodule("model.layers.0.self_attn.qkv_proj").wna16_group == 32


# =============================================================================================
# 4. quant_method case, 5. quantized tensors without a method
# =============================================================================================

@pytest.mark.parametrize("fmt,method", [("awq", "AWQ"), ("gptq", "Gptq"), ("fp8", "FP8")])
def test_quant_method_matches_ignoring_case(fmt, method, awq_dir, gptq_dir, fp8_dir, tmp_path):
    src = {"awq": awq_dir, "gptq": gptq_dir, "fp8": fp8_dir}[fmt]
    d = _rewrite(src, tmp_path / "upper", edit_qc=lambda qc: qc.update(quant_method=method))
    layer = _engine(d).runner.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert type(layer.method).__name__ != "UnquantizedLinearMethod"


def _set_quant_config(d, value) -> None:
    cfg = json.loads((d / "config.json").read_text())
    if value is ...:
        del cfg["quantization_config"]["quant_method"]
    else:
        cfg["quantization_config"] = value
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("value", [{}, None, ...], ids=["empty", "null", "no-quant_method"])
def test_quantized_tensors_without_a_method_explained(awq_dir, tmp_path, value):
    d = _rewrite(awq_dir, tmp_path / "nomethod")
    _set_quant_config(d, value)
    with pytest.raises(ValueError, match=r"no parameter 'qweight' .*holds quantized tensors.*"
                                         r"quantization_config\.quant_method is missing"):
        _engine(d)


def test_unquantized_method_on_a_quantized_checkpoint_explained(awq_dir):
    with pytest.raises(ValueError, match=r"quantized with 'awq' \(quantization_config\.quant_method\).*use 'auto'"):
        _engine(awq_dir, quantization="unquantized")


def test_row_parallel_slice_of_a_trivial_g_idx_is_not_act_order():
    """Tensor parallelism hands rank r rows [r*k, (r+1)*k) of the checkpoint's g_idx (and the
    matching groups of scales): under desc_act false that slice of the trivial g_idx must not
    be taken for an act-order permutation."""
    from kvforge_plugins.quant.act_order import apply_act_order
    from kvforge_plugins.quant.common import add_param
    k, gs, rank = 64, 16, 1
    layer = torch.nn.Module()
    layer.prefix = "model.layers.0.mlp.down_proj"
    layer.wna16_k, layer.wna16_group, layer.wna16_kernel = k, gs, False
    layer.scales = torch.nn.Parameter(torch.ones(k // gs, 8), requires_grad=False)
    g = add_param(layer, "g_idx", (1, k), torch.int32, dim=None, shard_sizes=[8], allowed=(torch.int32,))
    g.data.copy_((torch.arange(rank * k, (rank + 1) * k) // gs).view(1, k))
    layer.g_idx_ref = None
    assert apply_act_order(layer, False, 4) is None and layer.g_idx_ref is None and not hasattr(layer, "g_idx")


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_refused_by_online_quantization(method, value, tmp_path):
    """Online FP8 / INT8 quantization computes each row's scale from max|w|: a NaN / Inf weight
    would make the scale non-finite and every output token garbage, so the load refuses it,
    naming the tensor (the fused q|k|v or gate|up shard) and the row."""
    from test_quant_fixtures import STORIES
    seed = urandom_seed()
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed % 2 ** 63)
    proj = _pick(gen, ATTN + ("gate_proj", "up_proj", "down_proj"))
    name = f"model.layers.{int(torch.randint(5, (1,), generator=gen))}.{'self_attn' if proj in ATTN else 'mlp'}" \
           f".{proj}.weight"
    row = []

    def edit(st):
        t = st[name].clone()
        row.append(int(torch.randint(t.shape[0], (1,), generator=gen)))
        t[row[0], int(torch.randint(t.shape[1], (1,), generator=gen))] = value
        st[name] = t
    from test_quant_formats import _rewrite as rewrite
    d = rewrite(STORIES, tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(ValueError, match=re.escape(f"checkpoint tensor '{name}' has non-finite values (first in "
                                                   f"row {row[0]};")):
        _engine(d, quantization=method)


@pytest.mark.parametrize("value", ["awq", ["awq"], 4])
def test_quantization_config_of_the_wrong_type_named(value, tmp_path):
    from test_quant_fixtures import STORIES
    d = _rewrite(STORIES, tmp_path / "bad")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config: expected an object, got "):
        _engine(d)


def test_static_activation_scales_under_a_dynamic_scheme_explained(fp8_dir, tmp_path):
    # the fixture is static (input_scale tensors): a config saying dynamic disagrees with them
    d = _rewrite(fp8_dir, tmp_path / "bad", edit_qc=lambda qc: qc.update(activation_scheme="dynamic"))
    with pytest.raises(ValueError, match=r"no parameter 'input_scale' .*activation_scheme"):
        _engine(d)


def test_fused_shards_quantized_differently_explained(tmp_path):
    """compressed-tensors: gate_proj alone on the ignore list splits the fused gate|up layer; the
    error says what each shard got in the config's words."""
    pytest.importorskip("compressed_tensors")
    from test_quant_compressed_tensors import build_ct
    src, _ = build_ct(tmp_path / "ct", "int8_w8a8")
    d = _rewrite(src, tmp_path / "bad", edit_qc=lambda qc: qc.update(ignore=[*qc.get("ignore", []),
                                                                              "model.layers.0.mlp.gate_proj"]))
    with pytest.raises(ValueError, match=re.escape("model.layers.0.mlp.gate_proj: not quantized (ignored or no group "
                                                   "targets it), model.layers.0.mlp.up_proj: config_groups[")):
        _engine(d)
