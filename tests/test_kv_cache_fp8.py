"""FP8 KV cache (cache.kv_cache_dtype) end to end on stories260K (CPU, torch_ref): the config,
the cache's size in blocks, accuracy against the model-dtype cache, per-layer scales read from a
checkpoint (and bad ones refused naming the tensor), backends that do not declare FP8, swap
preemption and prefix caching over FP8 blocks. Kernels: triton_paged_fp8_cases.py."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import (STORIES_MODEL, assert_outputs_match, fresh_rng, make_engine, prompt_logits,
                     random_story_prompts, rel_err, run_requests)
from kvforge import SamplingParams
from kvforge.config import EngineConfig
from kvforge.layers.attention import PagedAttention

FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _engine(**kw):
    kw.setdefault("attention", "torch_ref")
    kw.setdefault("kv_cache_memory_bytes", 1 << 22)
    return make_engine(**kw)


def _prompts(rng, n=4):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(STORIES_MODEL)
    return [tok(p).input_ids for p in random_story_prompts(rng, n)]


def _layers(engine) -> list[PagedAttention]:
    return [m for m in engine.runner.model.modules() if isinstance(m, PagedAttention)]


def test_config_names_and_bad_value():
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "kv_cache_dtype": "fp8"})
    assert cfg.cache.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="cache.kv_cache_dtype"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "kv_cache_dtype": "fp16"})


@pytest.mark.parametrize("name", list(FP8))
def test_cache_dtype_and_capacity(name):
    """Same KV budget: an FP8 cache holds 4x the blocks of the fp32 one (1 byte a value, not 4)."""
    base = _engine()
    eng = _engine(kv_cache_dtype=name)
    assert all(c.dtype == FP8[name] for c in eng.runner.kv_caches)
    n, b = eng.allocator.num_blocks, base.allocator.num_blocks
    assert 4 * b <= n <= 4 * b + 3, (n, b)  # (the budget is cut into whole blocks)


@pytest.mark.parametrize("name,bound", [("fp8_e4m3", 0.12), ("fp8_e5m2", 0.25)])
def test_logits_close_to_model_dtype_cache(name, bound):
    """Prompt logits over an FP8 cache (prefill in two chunks, so the second reads FP8 blocks)
    against the fp32 cache. Per position: max |diff| / max |ref logit|; its median over the
    positions, 40 random prompt sets (scales 1.0): E4M3 0.043-0.065, E5M2 0.073-0.143; top-1
    agreement 0.85-1.0 / 0.82-1.0. The worst single position has a heavy tail (E5M2 up to 0.58),
    so it is not bounded here; a cache read back wrong gives errors near 1."""
    rng = fresh_rng(name)
    prompts = _prompts(rng)
    chunks = [[len(p) // 2, len(p) - len(p) // 2] for p in prompts]
    ref = prompt_logits(_engine(), prompts, chunks)
    got = prompt_logits(_engine(kv_cache_dtype=name), prompts, chunks)
    per_pos = torch.cat([(g - r).abs().amax(-1) / r.abs().amax(-1) for g, r in zip(got, ref)])
    agree = sum(int((g.argmax(-1) == r.argmax(-1)).sum()) for g, r in zip(got, ref)) / sum(map(len, prompts))
    assert per_pos.median() <= bound, f"{name}: median per-position rel err {per_pos.median():.3f} > {bound}"
    assert agree >= 0.7, f"{name}: top-1 agreement {agree:.3f}"
    assert per_pos.max() > 1e-3, "the FP8 cache changed nothing: is it storing the model dtype?"


def _checkpoint_with(tmp_path, extra: dict[str, torch.Tensor]) -> str:
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in os.listdir(STORIES_MODEL):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(STORIES_MODEL, f), d)
    w = load_file(os.path.join(STORIES_MODEL, "model.safetensors"))
    w.update(extra)
    save_file(w, str(d / "model.safetensors"))
    return str(d)


def test_scales_read_from_checkpoint(tmp_path, caplog):
    """Every spelling of a KV scale lands on its layer; the scales change the stored values and
    the logits; only a checkpoint without any gets the 1.0 warning."""
    rng = fresh_rng()
    n = len(_layers(_engine()))
    # stories260K's K reach |27| and V |2.8| (measured): these scales keep both inside E4M3's 448
    want = [(rng.uniform(0.07, 0.2), rng.uniform(0.008, 0.02)) for _ in range(n)]
    extra = {}
    for i, (ks, vs) in enumerate(want):
        p = f"model.layers.{i}.self_attn"
        if i == 0:
            extra[f"{p}.k_proj.output_scale"], extra[f"{p}.v_proj.output_scale"] = torch.tensor([ks]), torch.tensor([vs])
        elif i == 2:  # NVIDIA ModelOpt's names
            extra[f"{p}.k_proj.k_scale"], extra[f"{p}.v_proj.v_scale"] = torch.tensor(ks), torch.tensor(vs)
        elif i == 1:  # the old single scale for both (then v_scale overrides it for V)
            extra[f"{p}.kv_scale"] = torch.tensor(ks)
            extra[f"{p}.v_scale"] = torch.tensor(vs)
        else:
            extra[f"{p}.k_scale"], extra[f"{p}.v_scale"] = torch.tensor(ks), torch.tensor(vs)
    path = _checkpoint_with(tmp_path, extra)
    with caplog.at_level(logging.WARNING, logger="kvforge"):
        scaled = _engine(model=path, kv_cache_dtype="fp8")
    assert "no K/V scales" not in caplog.text
    for layer, (ks, vs) in zip(_layers(scaled), want):
        assert torch.equal(layer.kv_scale.cpu(), torch.tensor([ks, vs], dtype=torch.float32))
        assert layer.layer.kv_scale is layer.kv_scale  # what the backend is handed
    with caplog.at_level(logging.WARNING, logger="kvforge"):
        unit = _engine(kv_cache_dtype="fp8")
    assert "no K/V scales" in caplog.text
    prompts = _prompts(rng, 2)
    ref = prompt_logits(_engine(), prompts)
    a, b = prompt_logits(scaled, prompts), prompt_logits(unit, prompts)
    assert max(rel_err(x, y) for x, y in zip(a, b)) > 1e-3, "the checkpoint's scales changed nothing"
    per_pos = torch.cat([(x - r).abs().amax(-1) / r.abs().amax(-1) for x, r in zip(a, ref)])
    assert per_pos.median() <= 0.12, f"median per-position rel err {per_pos.median():.3f} with the scales"
    assert _engine(model=path).runner.kv_caches[0].dtype == torch.float32  # auto: the scales are unused


@pytest.mark.parametrize("value,match", [(torch.tensor([0.1, 0.2, 0.3]), "one value"),
                                         (torch.tensor(-0.5), "> 0"), (torch.tensor(float("inf")), "finite")])
def test_bad_scale_refused_naming_the_tensor(tmp_path, value, match):
    path = _checkpoint_with(tmp_path, {"model.layers.1.self_attn.k_scale": value})
    with pytest.raises(ValueError, match=rf"model\.layers\.1\.self_attn\.k_scale.*{match}"):
        _engine(model=path, kv_cache_dtype="fp8")


def test_scale_outside_an_attention_module_refused(tmp_path):
    path = _checkpoint_with(tmp_path, {"model.layers.1.mlp.v_scale": torch.tensor(0.1)})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.v_scale.*does not belong"):
        _engine(model=path, kv_cache_dtype="fp8")


def test_backend_without_fp8_refused_and_skipped_by_auto():
    """flash_decode declares no kv_cache_dtypes: named, it is refused for that reason; the
    kv_cache_dtypes check runs before a backend's own validate."""
    from kvforge.engine.resolve import choose_attention, kv_dtype_reasons
    from kvforge.interfaces import AttentionRequirements
    from kvforge.plugin_manager import load_registry
    reg = load_registry()
    req = AttentionRequirements(torch.float32, 64, 8, 2, 16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="flash_decode.*cache.kv_cache_dtype fp8_e4m3 unsupported"):
        choose_attention(reg, "flash_decode", req, torch.device("cpu"))
    assert kv_dtype_reasons(reg.get("attention", "torch_ref"), req) == []
    spec, rejected = choose_attention(reg, "auto", req, torch.device("cpu"))
    assert "kv_cache_dtypes" in spec.capabilities
    assert "flash_decode" in rejected and "kv_cache_dtype" in " ".join(rejected["flash_decode"])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _engine(attention="flash_decode", kv_cache_dtype="fp8")


def _greedy(rng, n=6):
    return [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=rng.randint(60, 90), ignore_eos=True,
                                        logprobs=2))
            for i, p in enumerate(random_story_prompts(rng, n))]


def test_swap_preemption_over_fp8_blocks():
    """Blocks swapped out to the CPU and back keep their FP8 bytes: outputs under swap
    preemption equal the unpressured FP8 run."""
    rng = fresh_rng()
    reqs = _greedy(rng)
    ref = run_requests(_engine(kv_cache_dtype="fp8", block_size=16, num_gpu_blocks=256, kv_cache_memory_bytes=None), reqs)
    eng = _engine(kv_cache_dtype="fp8", block_size=16, num_gpu_blocks=rng.randint(12, 16), kv_cache_memory_bytes=None,
                  swap_space_bytes=1 << 20, **{"scheduler.settings.preemption_mode": "swap"})
    assert eng.runner.cpu_caches and eng.runner.cpu_caches[0].dtype == torch.float8_e4m3fn
    got = run_requests(eng, reqs)
    assert eng.scheduler.num_preemptions > 0, "no preemption: the test is not testing"
    for rid, _, _ in reqs:
        assert_outputs_match([got[rid].outputs[0]], [ref[rid].outputs[0]], f"{rid} under swap preemption")


def test_prefix_cache_hits_read_fp8_blocks():
    """Later requests read an earlier one's FP8 prefix blocks and answer as without the cache.
    The shared text is at least 3 blocks of tokens, so each later request hits >= 2 whole blocks."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(STORIES_MODEL)
    rng = fresh_rng()
    shared = ""
    while len(tok(shared).input_ids) < 48:
        shared = " ".join(filter(None, [shared, *random_story_prompts(rng, 1)]))
    reqs = [(f"p{i}", shared + " " + tail, SamplingParams(temperature=0.0, max_tokens=20, logprobs=2))
            for i, tail in enumerate(random_story_prompts(rng, 4))]
    ref = run_requests(_engine(kv_cache_dtype="fp8"), reqs)
    eng = _engine(kv_cache_dtype="fp8", enable_prefix_caching=True, block_size=16)
    got = {}
    for r in reqs:  # one at a time, so each later request finds the shared prefix cached
        got.update(run_requests(eng, [r]))
    assert [got[rid].num_cached_tokens >= 32 for rid, _, _ in reqs] == [False] + [True] * (len(reqs) - 1), \
        [got[rid].num_cached_tokens for rid, _, _ in reqs]
    for rid, _, _ in reqs:
        assert_outputs_match([got[rid].outputs[0]], [ref[rid].outputs[0]], f"{rid} with prefix caching")


def test_bench_roofline_counts_the_cache_bytes():
    """`kvforge bench`'s roofline reads one byte a cached value from an FP8 engine: the decode
    KV bytes halve against a 2-byte cache, the weights' bytes stay."""
    from kvforge.bench.roofline import ModelShape, kv_cache_bytes, roofline
    assert kv_cache_bytes(_engine(kv_cache_dtype="fp8_e5m2")) == 1
    assert kv_cache_bytes(_engine()) == 4  # stories260K runs in float32 here
    rng = fresh_rng()
    shape = ModelShape.from_hf_config(dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                           num_key_value_heads=2, intermediate_size=512, vocab_size=1000))
    ins, outs = [rng.randint(10, 200) for _ in range(8)], [rng.randint(2, 50) for _ in range(8)]
    two, one = (roofline(shape, ins, outs, 2, 4, kv_dtype_bytes=b) for b in (2, 1))
    assert one["decode_kv_bytes"] * 2 == two["decode_kv_bytes"] > 0
    assert one["step_weight_bytes"] == two["step_weight_bytes"]


@pytest.fixture()
def loud_kv_model(tmp_path):
    """A random 2-layer Llama whose K and V are ~1000x larger than its q and o_proj expect (k/v
    weights x1000, q/o weights /1000: the model computes what it did), so at scale 1.0 they
    saturate E4M3 (448). Returns (hf model, checkpoint dir, seed)."""
    from transformers import LlamaConfig

    from helpers import save_random_hf
    seed = fresh_rng().randrange(1 << 30)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2)
    hf = save_random_hf(cfg, tmp_path, seed)
    with torch.no_grad():
        for layer in hf.model.layers:
            a = layer.self_attn
            a.k_proj.weight.mul_(1000)
            a.v_proj.weight.mul_(1000)
            a.q_proj.weight.div_(1000)
            a.o_proj.weight.div_(1000)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf, str(tmp_path), seed


def test_calculate_kv_scales_from_the_first_step(loud_kv_model, caplog):
    """cache.calculate_kv_scales: the first step's largest |K| and |V| land at 224 (half E4M3's
    448) in every layer, the scales then stay, and the logits stay close to HF's where scales of
    1.0 saturate. Median per-position rel err over 40 random models: calibrated 0.074-0.122, scales
    1.0 1.16-1.33."""
    hf, path, seed = loud_kv_model
    rng = fresh_rng()
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(20, 40))] for _ in range(2)]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0].float() for p in prompts]

    def median_err(engine):
        got = prompt_logits(engine, prompts)
        return torch.cat([(g - r).abs().amax(-1) / r.abs().amax(-1) for g, r in zip(got, refs)]).median().item()

    with caplog.at_level(logging.WARNING, logger="kvforge"):
        cal = _engine(model=path, kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert "no K/V scales" not in caplog.text
    err_cal = median_err(cal)
    scales = [m.kv_scale.clone() for m in _layers(cal)]
    blocks = cal.allocator.num_blocks  # (on CUDA, the scratch block past these holds warm-up rows at scale 1.0)
    for cache, s in zip(cal.runner.kv_caches, scales):
        assert (s > 1).all(), f"scales {s.tolist()} not calibrated (K, V reach thousands), seed {seed}"
        held = cache[:, :blocks].float().abs()
        assert held[0].max() == 224 and held[1].max() == 224, f"seed {seed}"
    median_err(cal)  # a second batch of steps leaves the scales alone
    assert all(torch.equal(m.kv_scale, s) for m, s in zip(_layers(cal), scales))
    err_unit = median_err(_engine(model=path, kv_cache_dtype="fp8"))
    assert err_cal <= 0.2, f"calibrated: median per-position rel err {err_cal:.3f}, seed {seed}"
    assert err_unit >= 2 * err_cal, f"scales 1.0 ({err_unit:.3f}) not worse than calibrated ({err_cal:.3f})"


def test_calculate_kv_scales_needs_an_fp8_cache():
    with pytest.raises(ValueError, match="calculate_kv_scales.*FP8 cache"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "calculate_kv_scales": True})


def test_layer_without_scales_reads_one_shared_unit_scale():
    """A backend called without ``kv_scale`` (a model that does not use PagedAttention) uses
    scale 1.0 from one cached tensor per device, not a fresh allocation per call."""
    from kvforge.layers.kv_cache_dtype import unit_kv_scale
    from kvforge_plugins.attention.torch_ref import write_kv
    a = unit_kv_scale(torch.device("cpu"))
    assert a is unit_kv_scale("cpu") and a.dtype == torch.float32 and a.tolist() == [1.0, 1.0]
    g = torch.Generator().manual_seed(fresh_rng().getrandbits(31))
    k, v = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    cache = torch.zeros(2, 2, 4, 2, 8, dtype=torch.float8_e4m3fn)
    write_kv(cache, k, v, torch.tensor([5, 0, 2]), None)
    assert torch.equal(cache[0].view(8, 2, 8)[5].float(), k[0].to(torch.float8_e4m3fn).float())
    assert torch.equal(cache[1].view(8, 2, 8)[2].float(), v[2].to(torch.float8_e4m3fn).float())
