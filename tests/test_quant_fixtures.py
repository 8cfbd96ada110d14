"""Quantized checkpoint fixtures: spec packers (checked by hand and against the
compressed-tensors library) and builders that write stories260K in each real format.

Packers here are written from the formats' specifications as plain loops (one int32
word at a time), independent of the plugins' vectorized unpackers, and are checked
against small examples worked by hand. Where the ``compressed-tensors`` library is
installed they are also cross-checked against it (its ``pack_to_int32`` for the
GPTQ / plain layouts and its AutoAWQ converter's unpacker for the AWQ order).

The builders (used by test_quant_formats.py, test_quant_e2e.py, test_quant_kernels.py)
quantize stories260K with round-to-nearest into each format and write a complete
checkpoint directory (safetensors + config.json with ``quantization_config`` + tokenizer).

Group sizes for stories260K (hidden 64, intermediate 172 = 4 * 43):
* AWQ (4-bit, packed along N): group 32 on q/k/v/o (in 64); the MLP cannot be stored
  (gate/up have 172 outputs, not a multiple of 8; down has 172 inputs, not a multiple of
  32) so it is listed in ``modules_to_not_convert: ["mlp"]``, as AutoAWQ requires.
* GPTQ 4-bit: group 32 on attention, MLP excluded with ``dynamic: {"-:.*mlp.*": {}}``
  (172 is not a multiple of 8); GPTQ 8-bit (4 values per word): group 4 everywhere
  (172 = 4 * 43), MLP included.
* FP8 / INT8: no packing, every linear layer quantized.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

STORIES = Path("/work/shared/models/stories260K")
AUX_FILES = ["tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
             "generation_config.json"]
PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


# =============================================================================================
# Spec packers (loops, one word at a time)
# =============================================================================================

def to_int32(word: int) -> int:
    """Unsigned 32-bit pattern -> the int32 with the same bits."""
    assert 0 <= word < 2 ** 32
    return word - 2 ** 32 if word >= 2 ** 31 else word


def pack_word(values: list[int], bits: int, order: list[int] | None = None) -> int:
    """Field i (bits [i*bits, (i+1)*bits)) holds ``values[order[i]]`` (``values[i]`` by default)."""
    n = 32 // bits
    assert len(values) == n
    word = 0
    for i in range(n):
        v = int(values[order[i] if order else i])
        assert 0 <= v < 2 ** bits, v
        word |= v << (bits * i)
    return to_int32(word)


def pack_along_cols(q: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] unsigned ints -> [R, C*bits/32] int32, consecutive columns in one word."""
    n = 32 // bits
    rows, cols = q.shape
    assert cols % n == 0
    out = torch.zeros(rows, cols // n, dtype=torch.int32)
    ql = q.tolist()
    for r in range(rows):
        for c in range(cols // n):
            out[r, c] = pack_word(ql[r][c * n:(c + 1) * n], bits, order)
    return out


def pack_along_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned ints -> [R*bits/32, C] int32, consecutive rows in one word (GPTQ qweight)."""
    return pack_along_cols(q.t().contiguous(), bits).t().contiguous()


def test_hand_worked_words():
    # AWQ: columns 0..7 hold values 0..7; nibble i holds column AWQ_ORDER[i], so from the
    # lowest nibble up the word reads 0,2,4,6,1,3,5,7 -> hex 0x75316420.
    assert pack_word(list(range(8)), 4, AWQ_ORDER) == 0x75316420
    # Plain order (GPTQ, compressed-tensors): nibbles 0..7 from the lowest -> 0x76543210.
    assert pack_word(list(range(8)), 4) == 0x76543210
    # GPTQ v1 symmetric 4-bit zero points: true zero 8 stored as 7 in every nibble.
    assert pack_word([7] * 8, 4) == 0x77777777
    # 8-bit: bytes 1,2,3,4 from the lowest -> 0x04030201; 0xFF in the top byte is negative.
    assert pack_word([1, 2, 3, 4], 8) == 0x04030201
    assert pack_word([0, 0, 0, 255], 8) == to_int32(0xFF000000) == -16777216
    # All-ones nibbles: the int32 -1.
    assert pack_word([15] * 8, 4) == -1


def test_pack_layouts_by_hand():
    q = torch.arange(16).reshape(2, 8) % 16  # row 0: 0..7, row 1: 8..15
    assert pack_along_cols(q, 4).tolist() == [[0x76543210], [to_int32(0xFEDCBA98)]]
    qt = q.t().contiguous()  # [8, 2]: rows packed into one word per column
    assert pack_along_rows(qt, 4).tolist() == [[0x76543210, to_int32(0xFEDCBA98)]]


def test_plugin_unpackers_invert_spec_packers():
    from kvforge_plugins.quant.common import pack_rows, unpack_cols, unpack_rows
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        q = torch.randint(0, 2 ** bits, (16, 24), generator=g)
        assert torch.equal(unpack_cols(pack_along_cols(q, bits), bits), q)
        assert torch.equal(unpack_rows(pack_along_rows(q, bits), bits), q)
        assert torch.equal(pack_rows(q, bits), pack_along_rows(q, bits))
    q = torch.randint(0, 16, (16, 24), generator=g)
    assert torch.equal(unpack_cols(pack_along_cols(q, 4, AWQ_ORDER), 4, awq_order=True), q)


def test_spec_packers_match_compressed_tensors():
    """Independent library check (skipped where compressed-tensors is not installed)."""
    ct = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    conv = pytest.importorskip("compressed_tensors.entrypoints.convert.converters.autoawq")
    g = torch.Generator().manual_seed(1)
    for bits in (4, 8):
        q = torch.randint(0, 2 ** bits, (16, 24), generator=g)
        signed = (q - 2 ** (bits - 1)).to(torch.int8)  # compressed-tensors packs signed values + offset
        assert torch.equal(ct.pack_to_int32(signed, bits, packed_dim=1), pack_along_cols(q, bits))
        assert torch.equal(ct.pack_to_int32(signed, bits, packed_dim=0), pack_along_rows(q, bits))
    # AWQ: the library's AutoAWQ converter unpacks our AWQ-order words back to the values.
    q = torch.randint(0, 16, (8, 16), generator=g)
    z = torch.randint(0, 16, (2, 16), generator=g)
    c = conv.AutoAWQConverter(group_size=4)
    w, _, zp = c._convert_gemm_module(pack_along_cols(q, 4, AWQ_ORDER), torch.ones(2, 16, dtype=torch.float16),
                                      pack_along_cols(z, 4, AWQ_ORDER))
    assert torch.equal(w.t().to(torch.int64) + 8, q)  # converter returns signed [N, K]
    assert torch.equal(zp.t().to(torch.int64) + 8, z)


# =============================================================================================
# Round-to-nearest quantizers for the fixtures
# =============================================================================================

def rtn_groups(wt: torch.Tensor, bits: int, group_of_row: torch.Tensor, groups: int, sym: bool,
               min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize W^T ``wt`` [K, N] (fp32) per (group, column).

    Returns q [K, N] in [0, 2**bits), scales [G, N] fp16, zeros [G, N] ints. ``sym``: GPTQ's
    symmetric rule (zero = 2**(bits-1), scale = 2*max|w| / maxq); else min/max asymmetric
    with zero = round(-min/scale) clamped to [min_zero, maxq].
    """
    maxq = 2 ** bits - 1
    k, n = wt.shape
    scales = torch.zeros(groups, n, dtype=torch.float16)
    zeros = torch.zeros(groups, n, dtype=torch.int64)
    q = torch.zeros(k, n, dtype=torch.int64)
    for gi in range(groups):
        rows = (group_of_row == gi).nonzero().flatten()
        w = wt[rows]
        if sym:
            amax = w.abs().amax(0).clamp_min(1e-8)
            s = (2 * amax / maxq).half()
            z = torch.full((n,), 2 ** (bits - 1), dtype=torch.int64)
        else:
            lo, hi = w.amin(0).clamp(max=0), w.amax(0).clamp(min=0)
            s = ((hi - lo).clamp_min(1e-8) / maxq).half()
            z = torch.round(-lo / s.float()).long().clamp(min_zero, maxq)
        scales[gi], zeros[gi] = s, z
        q[rows] = (torch.round(w / s.float()) + z).clamp(0, maxq).long()
    return q, scales, zeros


def dequant(q, scales, zeros, group_of_row) -> torch.Tensor:
    """W^T [K, N] fp32 from the quantized pieces (the reference every format must decode to)."""
    return (q.float() - zeros.float()[group_of_row]) * scales.float()[group_of_row]


# =============================================================================================
# Checkpoint builders
# =============================================================================================

def _linear_names(state: dict) -> list[str]:
    return [k for k in state if k.endswith(".weight") and k.rsplit(".", 2)[-2] in PROJ]


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], quant_config: dict | None,
                     config_overrides: dict | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((STORIES / "config.json").read_text())
    if quant_config is not None:
        cfg["quantization_config"] = quant_config
    cfg.update(config_overrides or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in AUX_FILES:
        if (STORIES / f).exists():
            shutil.copy(STORIES / f, out / f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def build_awq(out: Path, group_size: int = 32, skip: tuple[str, ...] = ("mlp",)) -> Path:
    """AutoAWQ GEMM checkpoint (4-bit, zero points, fp16 scales)."""
    state = load_file(str(STORIES / "model.safetensors"))
    tensors = {}
    for name, t in state.items():
        mod = name.rsplit(".", 1)[0]
        if name in _linear_names(state) and not any(s in mod for s in skip):
            wt = t.float().t().contiguous()  # [K, N]
            k = wt.shape[0]
            gr = torch.arange(k) // group_size
            q, s, z = rtn_groups(wt, 4, gr, k // group_size, sym=False)
            tensors[f"{mod}.qweight"] = pack_along_cols(q, 4, AWQ_ORDER)
            tensors[f"{mod}.qzeros"] = pack_along_cols(z, 4, AWQ_ORDER)
            tensors[f"{mod}.scales"] = s
        else:
            tensors[name] = t
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
          "modules_to_not_convert": list(skip)}
    return write_checkpoint(out, tensors, qc, {"torch_dtype": "float32"})


def build_gptq(out: Path, bits: int, group_size: int, sym: bool, desc_act: bool, fmt: str = "gptq",
               skip_regex: str | None = None, seed: int = 0) -> Path:
    """GPTQ checkpoint. ``desc_act``: a random act-order permutation per layer input (shared by
    the fused shards, as the same Hessian orders them), g_idx[perm[i]] = i // group."""
    state = load_file(str(STORIES / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple, torch.Tensor] = {}
    tensors = {}
    for name, t in state.items():
        mod = name.rsplit(".", 1)[0]
        if name in _linear_names(state) and not (skip_regex and re.match(skip_regex, mod)):
            wt = t.float().t().contiguous()
            k, n = wt.shape
            gs = k if group_size == -1 else group_size
            groups = -(-k // gs)
            if desc_act:
                parent, proj = mod.rsplit(".", 1)
                key = (parent, SHARED_INPUT.get(proj, proj))  # q/k/v and gate/up see the same input
                if key not in perms:
                    perms[key] = torch.randperm(k, generator=gen)
                g_idx = torch.empty(k, dtype=torch.int64)
                g_idx[perms[key]] = torch.arange(k) // gs
            else:
                g_idx = torch.arange(k) // gs
            # v1 cannot store a zero point of 0 (it writes z - 1), so its packer keeps z >= 1.
            q, s, z = rtn_groups(wt, bits, g_idx, groups, sym, min_zero=1 if fmt == "gptq" else 0)
            stored_z = z - 1 if fmt == "gptq" else z
            tensors[f"{mod}.qweight"] = pack_along_rows(q, bits)
            tensors[f"{mod}.qzeros"] = pack_along_cols(stored_z, bits)
            tensors[f"{mod}.scales"] = s
            tensors[f"{mod}.g_idx"] = g_idx.to(torch.int32)
        else:
            tensors[name] = t
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
          "lm_head": False, "checkpoint_format": fmt, "pack_dtype": "int32"}
    if skip_regex:
        qc["dynamic"] = {f"-:{skip_regex}": {}}
    return write_checkpoint(out, tensors, qc, {"torch_dtype": "float32"})


def fp8_quantize(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 weight + fp32 scale ([N, 1] per channel, [] per tensor): with the
    compressed-tensors library where installed, else from the spec (scale = max|w| / 448)."""
    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import quantize
    except Exception:
        quantize = None
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / 448.0).float()
    if quantize is not None:
        args = QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                strategy="channel" if per_channel else "tensor")
        q = quantize(w.float(), scale if per_channel else scale.reshape(1, 1), None, args,
                     dtype=torch.float8_e4m3fn)
    else:
        q = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def calibrate_input_amax() -> dict[str, float]:
    """max |input| of every linear module of stories260K (HF transformers) over a few stories."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(STORIES), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(STORIES))
    amax: dict[str, float] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJ:
            def hook(mod, inp, _out, name=name):
                amax[name] = max(amax.get(name, 0.0), inp[0].abs().max().item())
            hooks.append(m.register_forward_hook(hook))
    with torch.no_grad():
        for text in ["Once upon a time, there was a little girl named Lily. She loved to play outside.",
                     "Tom had a big red ball. One day, he went to the park with his mom and dog."]:
            model(**tok(text, return_tensors="pt"))
    for h in hooks:
        h.remove()
    return amax


def build_fp8(out: Path, per_channel: bool, static: bool) -> Path:
    """vLLM/llm-compressor ``fp8`` checkpoint (per-tensor or per-channel weights, static or dynamic)."""
    state = load_file(str(STORIES / "model.safetensors"))
    amax = calibrate_input_amax() if static else {}
    tensors = {}
    for name, t in state.items():
        mod = name.rsplit(".", 1)[0]
        if name in _linear_names(state):
            q, s = fp8_quantize(t, per_channel)
            tensors[f"{mod}.weight"] = q
            tensors[f"{mod}.weight_scale"] = s
            if static:
                tensors[f"{mod}.input_scale"] = torch.tensor(amax[mod] / 448.0, dtype=torch.float32)
        else:
            tensors[name] = t
    qc = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic", "ignored_layers": ["lm_head"]}
    return write_checkpoint(out, tensors, qc, {"torch_dtype": "float32"})
