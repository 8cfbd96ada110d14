"""triton_paged plumbing and end to end: the per-step plan (metadata split, fixed-capacity
CUDA-graph metadata), validation reasons, registration and settings, and the engine with a
random tiny Llama / Mistral against Hugging Face. Set-up: triton_paged_support.py."""
from __future__ import annotations

import pytest
import torch

# triton_paged_support first: it arranges the interpreter before the kernels are imported
from triton_paged_support import (  # noqa: F401 - _interpreter_env is an autouse fixture
    CPU_DTYPES, DEV, MIXED, _interpreter_env, check_close, make_batch,
)

from helpers import urandom_seed  # noqa: E402
from kvforge.interfaces import AttentionInputs, AttentionLayer, AttentionRequirements  # noqa: E402
from kvforge_plugins.attention.triton_paged import TritonPagedBackend, TritonPagedSettings  # noqa: E402


# ---------------------------------------------------------------- plumbing
def test_metadata_split():
    inputs, *_ = make_batch(0, torch.float32, 16, 1, 1, 16, MIXED)
    md = TritonPagedBackend().build_metadata(inputs)
    assert md.num_decodes == 4 and md.decode_rows.tolist() == [0, 2, 4, 6]
    tiles = md.prefill_tiles.cpu()
    assert md.num_prefill_tiles == tiles.shape[1] == 1 + 1 + 2 + 1 and md.num_merges == 0
    # (request, first query, key range, slot): MIXED's contexts are too short to split
    assert sorted(zip(*tiles.tolist())) == [(1, 0, 0, 17, -1), (3, 0, 0, 49, -1), (5, 0, 0, 97, -1),
                                            (5, 64, 0, 133, -1), (7, 0, 0, 7, -1)]
    assert tiles[0].tolist()[0] == 5 and tiles[1].tolist()[0] == 64  # heaviest tile first
    md = TritonPagedBackend().build_metadata(make_batch(0, torch.float32, 16, 1, 1, 16, [(3, 1), (9, 1)])[0])
    assert md.num_prefill_tiles == 0 and md.num_decodes == 2 and md.decode_rows is None  # identity rows


def test_metadata_split_kv_plan():
    """Few tiles with long key ranges are cut into aligned ranges covering [0, hi) exactly."""
    inputs, *_ = make_batch(0, torch.float32, 16, 1, 1, 16, [(2000, 40), (5, 1), (0, 30)])
    md = TritonPagedBackend(TritonPagedSettings(split_kv_target_tiles=8, split_kv_min_keys=256)).build_metadata(inputs)
    items = list(zip(*md.prefill_tiles.cpu().tolist()))
    merges = list(zip(*md.merges.cpu().tolist()))
    assert merges == [(0, 0, 0, 4)]  # 2040 keys / 4 (= ceil(8 / 2 tiles)) splits, each >= 256 keys
    ranges = sorted((lo, hi) for r, m0, lo, hi, slot in items if r == 0)
    assert ranges[0][0] == 0 and ranges[-1][1] == 2040 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(lo % 64 == 0 for lo, _ in ranges)
    assert sorted(slot for r, *_, slot in items if r == 0) == [0, 1, 2, 3]
    assert [i for i in items if i[0] == 2] == [(2, 0, 0, 30, -1)]  # too short to split
    off = TritonPagedBackend(TritonPagedSettings(split_kv_target_tiles=0)).build_metadata(inputs)
    assert off.num_merges == 0 and off.num_prefill_tiles == 2


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split_kv"])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_graph_metadata_fixed_capacity(dtype, split):
    """The CUDA-graph path of mixed steps: static, over-sized buffers holding stale values,
    refilled by update_graph_metadata; kernels read the counts on the device. Same output
    as the plain per-step metadata on the real rows; padded rows write only a spare block."""
    seed = urandom_seed()
    hkv, group, d, bs = 2, 4, 32, 16
    inputs, q, k, v, cache = make_batch(seed, dtype, bs, hkv, group, d, MIXED)
    t, b = q.shape[0], len(MIXED)
    cap_t, cap_b, width = t + 21, b + 3, inputs.block_table.shape[1] + 2
    used = set(inputs.block_table[inputs.block_table >= 0].tolist())
    spare = next(x for x in range(cache.shape[1]) if x not in used)
    i32 = dict(dtype=torch.int32, device=DEV)
    static = AttentionInputs(
        query_start_loc=torch.full((cap_b + 1,), 7, **i32), context_lens=torch.full((cap_b,), 5, **i32),
        seq_lens=torch.full((cap_b,), 9, **i32), block_table=torch.full((cap_b, width), spare, **i32),
        slot_mapping=torch.full((cap_t,), spare * bs, dtype=torch.int64, device=DEV), max_query_len=cap_t,
        max_seq_len=4096, query_lens_cpu=[0] * cap_b, context_lens_cpu=[0] * cap_b, block_size=bs)
    settings = TritonPagedSettings(prefill_block_m=16, split_kv_target_tiles=40 if split else 0, split_kv_min_keys=32)
    backend = TritonPagedBackend(settings)
    md = backend.graph_metadata(static, cap_t)
    md.decode_rows.fill_(b - 1)  # stale values from an earlier step must not matter
    md.prefill_tiles.fill_(0)
    md.merges.fill_(0)
    # what MixedBucket.run copies in
    static.query_start_loc[:b + 1].copy_(inputs.query_start_loc)
    static.query_start_loc[b + 1:].fill_(t)
    static.context_lens[:b].copy_(inputs.context_lens)
    static.seq_lens[:b].copy_(inputs.seq_lens)
    static.block_table[:b, :inputs.block_table.shape[1]].copy_(inputs.block_table)
    static.slot_mapping[:t].copy_(inputs.slot_mapping)
    backend.update_graph_metadata(md, inputs)
    if split:
        assert int(md.merge_count) > 0 and int(md.tile_count) > 2 + 3 + 7 + 1
    else:
        assert int(md.merge_count) == 0
        assert int(md.decode_count) == 4 and int(md.tile_count) == 2 + 3 + 7 + 1  # ceil(query_len / 16) per prefill
    pad = lambda x: torch.cat([x, torch.randn((cap_t - t, *x.shape[1:]), device=DEV).to(dtype)])  # noqa: E731
    layer = AttentionLayer(0, hkv * group, hkv, d, d ** -0.5, None)
    plain_cache, graph_cache = cache.clone(), cache.clone()
    want = backend.forward(layer, q, k, v, plain_cache, backend.build_metadata(inputs))
    got = backend.forward(layer, pad(q), pad(k), pad(v), graph_cache, md)
    check_close(got[:t], want.float(), dtype, seed)
    keep = torch.arange(cache.shape[1], device=DEV) != spare
    assert torch.equal(graph_cache[:, keep].nan_to_num(), plain_cache[:, keep].nan_to_num()), f"seed={seed}"
    big = make_batch(seed, dtype, bs, hkv, group, d, [(0, 40)] * 20)[0]  # 60 tiles > 1 + 8 + 32 split slots
    with pytest.raises(ValueError, match="capacity"):
        backend.update_graph_metadata(backend.graph_metadata(static, 16), big)


def _req(dtype=torch.float16, head=64, block=16, window=None):
    return AttentionRequirements(dtype, head, 8, 2, block, dtype, window)


def test_validate_reasons(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert TritonPagedBackend.validate(_req(), cpu) == ["needs a CUDA device (or TRITON_INTERPRET=1)"]
    assert TritonPagedBackend.validate(_req(), cuda) == []
    assert TritonPagedBackend.validate(_req(torch.bfloat16, window=4096), cuda) == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonPagedBackend.validate(_req(torch.float32), cpu) == []
    assert any("bfloat16" in r for r in TritonPagedBackend.validate(_req(torch.bfloat16), cpu))
    assert any("head_size 8" in r for r in TritonPagedBackend.validate(_req(head=8), cpu))
    assert any("head_size 96" in r for r in TritonPagedBackend.validate(_req(head=96), cuda))
    assert any("block_size 8" in r for r in TritonPagedBackend.validate(_req(block=8), cuda))
    bad_kv = AttentionRequirements(torch.float16, 64, 8, 2, 16, torch.float32)
    assert any("kv_cache_dtype" in r for r in TritonPagedBackend.validate(bad_kv, cuda))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert TritonPagedBackend.validate(AttentionRequirements(torch.float16, 64, 8, 2, 16, fp8), cuda) == []


def test_registered_and_auto_choice(monkeypatch):
    from kvforge.engine.builder import choose_attention
    from kvforge.plugin_manager import load_registry

    monkeypatch.setenv("KVFORGE_PLUGINS", "torch_ref,triton_paged")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reg = load_registry()
    spec = reg.get("attention", "triton_paged")
    assert spec.capabilities == {"priority": 10, "dtypes": ("float16", "bfloat16", "float32"), "cuda_graphs": True,
                                 "mixed_cuda_graphs": True, "kv_cache_dtypes": ("fp8_e4m3", "fp8_e5m2")}
    assert spec.settings_model is TritonPagedSettings
    assert choose_attention(reg, "auto", _req(), torch.device("cpu"))[0].name == "triton_paged"
    spec, rejected = choose_attention(reg, "auto", _req(head=8), torch.device("cpu"))
    assert spec.name == "torch_ref" and "head_size 8" in " ".join(rejected["triton_paged"])
    monkeypatch.delenv("TRITON_INTERPRET")
    assert choose_attention(reg, "auto", _req(), torch.device("cpu"))[0].name == "torch_ref"


def test_settings_model():
    assert TritonPagedSettings.model_validate({}).prefill_block_m == 64
    for bad in ({"prefill_block_m": 48}, {"kv_block_n": 8}, {"block_m": 64}):
        with pytest.raises(ValueError):
            TritonPagedSettings.model_validate(bad)


# ---------------------------------------------------------------- end to end (engine + model)
E2E_CONFIGS = {  # head_dim 16 (the smallest the backend takes), GQA 4:1; one with a sliding window
    "llama": dict(arch="llama", sliding_window=None),
    "mistral_window8": dict(arch="mistral", sliding_window=8),
}


@pytest.fixture(scope="module", params=list(E2E_CONFIGS))
def tiny_model(request, tmp_path_factory):
    """Random-weight 2-layer model saved like a real checkpoint (tokenizer from stories260K)."""
    from helpers import save_random_hf
    from transformers import LlamaConfig, MistralConfig

    spec = E2E_CONFIGS[request.param]
    seed = urandom_seed()
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    cfg = (MistralConfig(**common, head_dim=16, sliding_window=spec["sliding_window"]) if spec["arch"] == "mistral"
           else LlamaConfig(**common))
    d = tmp_path_factory.mktemp(request.param)
    hf = save_random_hf(cfg, d, seed)
    return request.param, hf, str(d), seed


def test_engine_end_to_end_vs_hf(tiny_model):
    """The engine picks triton_paged (auto), and its logits (one step and chunked over the
    paged cache, two prompts per flattened forward) and greedy tokens match HF (fp32)."""
    import random

    from helpers import assert_greedy_match, prompt_logits, rel_err
    from kvforge import LLM, SamplingParams

    name, hf, path, wseed = tiny_model
    seed = urandom_seed()
    rng = random.Random(seed)
    tag = f"[{name}] weights seed {wseed}, prompt seed {seed}"
    llm = LLM(path, dtype="float32", block_size=16, attention_backend="auto")
    engine = llm.llm_engine
    assert type(engine.runner.backend).__name__ == "TritonPagedBackend", tag
    prompts = [[rng.randrange(512) for _ in range(rng.randint(20, 40))] for _ in range(2)]
    with torch.no_grad():
        refs = [hf(torch.tensor([p])).logits[0].float() for p in prompts]
    chunks = [[len(p) // 3, len(p) - 2 * (len(p) // 3) - 1, len(p) // 3 + 1] for p in prompts]
    for ch in (None, chunks):
        for got, ref in zip(prompt_logits(engine, prompts, ch), refs):
            assert rel_err(got, ref) <= 1e-4, f"{tag} chunks={ch}: rel err {rel_err(got, ref):.3g}"
    n_new = 6
    sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n_new, eos_token_id=None,
                              pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                              attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert out.error is None, f"{tag}: {out.error}"
        assert_greedy_match(out.outputs[0].token_ids, ref.sequences[0, len(p):].tolist(),
                            [lg[0].float() for lg in ref.logits], tag)


@pytest.mark.parametrize("block_size", [16, 8])
def test_flash_decode_prefill_rows_use_triton_prefill(block_size):
    """flash_decode's prefill/extend rows run triton_paged's kernel (c) where it supports the
    layer (block size 16), else the reference loop (block size 8); same numbers either way.
    The CUDA C++ decode half is not built here (no GPU): its numerics are GPU tests."""
    from kvforge_plugins.attention.flash_decode import FlashDecodeBackend
    from kvforge_plugins.attention.torch_ref import TorchRefBackend, write_kv
    from triton_paged_support import reference

    seed = urandom_seed()
    reqs = [(40, 1), (0, 17), (130, 33), (7, 1), (0, 70)]
    inputs, q, k, v, cache = make_batch(seed, torch.float32, block_size, 2, 4, 32, reqs)
    fd = object.__new__(FlashDecodeBackend)  # without its CuPy kernels
    fd._prefill, fd._ref, fd._prefill_ok, fd._num_sms = TritonPagedBackend(), TorchRefBackend(), {}, 1
    md = fd.build_metadata(inputs)
    assert md.prefill_rows == [1, 2, 4] and md.prefill_md is not None
    layer = AttentionLayer(0, 8, 2, 32, 32 ** -0.5, None)
    want, _ = reference(layer, q, k, v, cache.clone(), inputs)
    c = cache.clone()
    write_kv(c, k, v, inputs.slot_mapping)
    out = torch.full(q.shape, float("nan"), device=DEV)
    fd._forward_prefill(layer, q, c, md, out)
    assert fd._prefill_ok and list(fd._prefill_ok.values()) == [block_size == 16]
    rows = torch.cat([torch.arange(s, e) for s, e in zip(inputs.query_start_loc[:-1].tolist(),
                                                          inputs.query_start_loc[1:].tolist())
                      if e - s > 1])
    check_close(out[rows], want[rows], torch.float32, seed)
    assert out[[0, 1 + 17 + 33]].isnan().all(), "decode rows are the decode kernel's to write"
