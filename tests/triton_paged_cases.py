"""triton_paged attention backend vs the torch_ref reference.

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1,
set while the kernel modules are imported and while this module's tests run,
and unset otherwise, so other test modules' ``auto`` backend choice is not
switched to the slow interpreter); with CUDA they run natively.

Every case: fresh ``torch.randn`` inputs (seed printed in failures), shuffled
non-contiguous block tables padded with -1, NaN-poisoned cache slots and output
buffers (every output element must be written and finite), and the reference is
``TorchRefBackend`` run in float32 on the same data.

Tolerances (max |triton - ref| <= atol + rtol * |ref|, ref in float32):
fp32 1e-4/1e-4 (2e-4 on GPU: ``input_precision="ieee"``, different exp/summation
order), fp16 2e-3/2e-3 (output rounding plus fp16 P in the PV product), bf16
1.6e-2/1.6e-2 (GPU only: the interpreter computes bf16 ``tl.dot`` wrongly).
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # must precede the @triton.jit decorations in the kernel modules
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
try:
    for _m in ("cache_kernel", "decode_kernel", "prefill_kernel"):
        _name = f"kvforge_plugins.attention.triton_paged.{_m}"
        importlib.reload(sys.modules[_name]) if _name in sys.modules else importlib.import_module(_name)
finally:
    if not HAS_CUDA:
        if _prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _prev

import pytest  # noqa: E402
from helpers import urandom_seed  # noqa: E402

from kvforge.interfaces import AttentionInputs, AttentionLayer, AttentionRequirements  # noqa: E402
from kvforge_plugins.attention.torch_ref import TorchRefBackend, write_kv  # noqa: E402
from kvforge_plugins.attention.triton_paged import TritonPagedBackend, TritonPagedSettings  # noqa: E402
from kvforge_plugins.attention.triton_paged.cache_kernel import reshape_and_cache  # noqa: E402

DEV = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True, scope="module")
def _interpreter_env():
    """Triton also consults TRITON_INTERPRET at launch; set it only while this module runs."""
    if HAS_CUDA:
        yield
        return
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    yield
    mp.undo()

TOL = {torch.float32: (2e-4, 2e-4) if HAS_CUDA else (1e-4, 1e-4), torch.float16: (2e-3, 2e-3),
       torch.bfloat16: (1.6e-2, 1.6e-2)}
gpu_only = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (bf16 / large sizes are wrong or too slow "
                                                   "in Triton's CPU interpreter)")
CPU_DTYPES = [torch.float16, torch.float32]
ALL_DTYPES = CPU_DTYPES + [pytest.param(torch.bfloat16, marks=gpu_only)]

MIXED = [(40, 1), (0, 17), (1, 1), (16, 33), (0, 1), (33, 100), (99, 1), (5, 2)]  # (context_len, query_len)


def make_batch(seed: int, dtype, block_size: int, hkv: int, group: int, d: int, reqs, extra_blocks: int = 3):
    """Random step: (AttentionInputs, q, k, v, cache) with the prefixes already cached.

    Blocks are a random permutation of the pool (non-contiguous), the table is padded
    with -1, and every cache slot not holding a prefix token is NaN.
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in reqs]
    nb = sum(need) + extra_blocks
    perm = torch.randperm(nb, generator=g).tolist()
    width = max(need) + 2
    table = torch.full((len(reqs), width), -1, dtype=torch.int32)
    tables, i = [], 0
    for r, n in enumerate(need):
        tables.append(perm[i:i + n])
        table[r, :n] = torch.tensor(tables[-1], dtype=torch.int32)
        i += n
    cache = torch.full((2, nb, block_size, hkv, d), float("nan"), dtype=dtype)
    flat = cache.view(2, nb * block_size, hkv, d)
    slots, qsl = [], [0]
    for (c, n), t in zip(reqs, tables):
        pos = torch.arange(c + n)
        s = torch.tensor(t, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size
        flat[:, s[:c]] = torch.randn(2, c, hkv, d, generator=g).to(dtype)
        slots.extend(s[c:].tolist())
        qsl.append(qsl[-1] + n)
    tot = qsl[-1]
    q = torch.randn(tot, hkv * group, d, generator=g).to(dtype)
    k = torch.randn(tot, hkv, d, generator=g).to(dtype)
    v = torch.randn(tot, hkv, d, generator=g).to(dtype)
    ctx = torch.tensor([c for c, _ in reqs], dtype=torch.int32)
    qlen = torch.tensor([n for _, n in reqs], dtype=torch.int32)
    inputs = AttentionInputs(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV), context_lens=ctx.to(DEV),
        seq_lens=(ctx + qlen).to(DEV), block_table=table.to(DEV),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEV), max_query_len=int(qlen.max()),
        max_seq_len=int((ctx + qlen).max()), query_lens_cpu=qlen.tolist(), context_lens_cpu=ctx.tolist(),
        block_size=block_size)
    return inputs, q.to(DEV), k.to(DEV), v.to(DEV), cache.to(DEV)


def reference(layer, q, k, v, cache, inputs):
    """torch_ref in float32 on copies: (out float32, cache after the write, float32)."""
    c32 = cache.float().clone()
    out = TorchRefBackend().forward(layer, q.float(), k.float(), v.float(), c32, inputs)
    return out, c32


def check_close(got, ref, dtype, seed, what="out"):
    atol, rtol = TOL[dtype]
    assert torch.isfinite(got).all(), f"{what}: non-finite (unwritten?) elements, seed={seed}"
    err = (got.float() - ref).abs()
    bad = err > atol + rtol * ref.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, max abs err {err.max().item():.3g} "
                           f"(atol {atol}, rtol {rtol}), seed={seed}")


def run_case(dtype, block_size, hkv, group, d, reqs, window=None, settings=None, layers=1,
             strided_q=False):
    seed = urandom_seed()
    inputs, q, k, v, cache = make_batch(seed, dtype, block_size, hkv, group, d, reqs)
    if strided_q:  # q/k/v as views of one fused qkv projection, like a real model
        hq = hkv * group
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
        q = qkv[:, :hq * d].view(-1, hq, d)
        k = qkv[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
        v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    backend = TritonPagedBackend(settings)
    md = backend.build_metadata(inputs)  # once per step, shared by every layer
    for li in range(layers):
        layer = AttentionLayer(li, hkv * group, hkv, d, d ** -0.5 * (1 + 0.25 * li), window)
        c = cache.clone()
        ref, ref_cache = reference(layer, q, k, v, c, inputs)
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
        got = backend.forward(layer, q, k, v, c, md, out=out)
        assert got is out and got.dtype == dtype and got.shape == q.shape
        check_close(got, ref, dtype, seed)
        # the write leaves exactly torch_ref's cache (NaN where nothing was ever written)
        assert torch.equal(c.float().isnan(), ref_cache.isnan()), f"cache NaN pattern differs, seed={seed}"
        assert torch.equal(c.float().nan_to_num(), ref_cache.nan_to_num()), f"cache values differ, seed={seed}"
        if li == 0:
            fresh = backend.forward(layer, q, k, v, cache.clone(), md)  # default: allocates its output
            check_close(fresh, ref, dtype, seed, "out (allocated)")


# ---------------------------------------------------------------- (a) cache write
@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache(dtype, block_size):
    seed = urandom_seed()
    g = torch.Generator().manual_seed(seed)
    nb, hkv, d, t = 7, 3, 64, 40
    cache = torch.full((2, nb, block_size, hkv, d), float("nan"), dtype=dtype, device=DEV)
    slots = torch.randperm(nb * block_size, generator=g)[:t]
    slots[::7] = -1  # padding rows (CUDA-graph batches) are skipped
    k = torch.randn(t, hkv, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(t, hkv, d, generator=g).to(dtype).to(DEV)
    want = cache.clone()
    keep = slots >= 0
    write_kv(want, k[keep.to(DEV)], v[keep.to(DEV)], slots[keep].to(DEV))
    reshape_and_cache(k, v, cache, slots.to(DEV))
    assert torch.equal(cache.isnan(), want.isnan()), f"seed={seed}"
    assert torch.equal(cache.nan_to_num(), want.nan_to_num()), f"seed={seed}"


def test_reshape_and_cache_strided_fp32_to_cache_dtype():
    """k/v views with a row stride (slices of a fused projection) are read correctly."""
    seed = urandom_seed()
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(9, 2 * 2 * 32, generator=g).to(DEV)
    k, v = kv[:, :64].view(9, 2, 32), kv[:, 64:].view(9, 2, 32)
    cache = torch.full((2, 4, 16, 2, 32), float("nan"), device=DEV)
    slots = torch.tensor([3, 60, 17, 0, 33, 5, 48, 16, 63], device=DEV)
    want = cache.clone()
    write_kv(want, k, v, slots)
    reshape_and_cache(k, v, cache, slots)
    assert torch.equal(cache.nan_to_num(), want.nan_to_num()) and torch.equal(cache.isnan(), want.isnan())


# ---------------------------------------------------------------- (b) decode
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode(dtype, block_size, group):
    run_case(dtype, block_size, 2, group, 64, [(0, 1), (1, 1), (16, 1), (17, 1), (33, 1), (100, 1)])


# ---------------------------------------------------------------- (c) prefill / extend
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_with_prefix(dtype, block_size, group):
    run_case(dtype, block_size, 2, group, 64, [(0, 17), (16, 33), (1, 100), (50, 2)])


# ---------------------------------------------------------------- mixed batches
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_batch_two_layers(dtype, block_size):
    run_case(dtype, block_size, 2, 4, 64, MIXED, layers=2, strided_q=True)


@pytest.mark.parametrize("dtype,block_size,group", [(torch.float16, 16, 8), (torch.float32, 32, 1)])
def test_head_dim_128(dtype, block_size, group):
    run_case(dtype, block_size, 1, group, 128, [(17, 1), (0, 20), (33, 40), (100, 1)])


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("window", [1, 20])
def test_sliding_window(dtype, window):
    run_case(dtype, 16, 2, 4, 64, MIXED, window=window)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_long_context(dtype):
    """Many K/V tiles per program, prefill chunks spanning several query tiles."""
    run_case(dtype, 16, 1, 8, 64, [(1000, 1), (700, 77), (0, 300), (513, 1)])


@pytest.mark.parametrize("d,block_size", [(16, 64), (32, 128)])
def test_small_heads_large_blocks(d, block_size):
    run_case(torch.float32, block_size, 2, 2, d, [(3, 1), (70, 60), (0, 9), (129, 1)])


def test_small_tiles_many_prefill_tiles():
    """block_m 16 / block_n 16 < block_size: several query tiles per request, several tiles per block."""
    run_case(torch.float16, 32, 1, 2, 64, MIXED, settings=TritonPagedSettings(prefill_block_m=16, kv_block_n=16))


# ---------------------------------------------------------------- plumbing
def test_metadata_split():
    inputs, *_ = make_batch(0, torch.float32, 16, 1, 1, 16, MIXED)
    md = TritonPagedBackend().build_metadata(inputs)
    assert md.num_decodes == 4 and md.decode_rows.tolist() == [0, 2, 4, 6]
    tiles = md.prefill_tiles.cpu()
    assert md.num_prefill_tiles == tiles.shape[1] == 1 + 1 + 2 + 1
    assert sorted(zip(*tiles.tolist())) == [(1, 0), (3, 0), (5, 0), (5, 64), (7, 0)]
    assert tiles[0].tolist()[0] == 5 and tiles[1].tolist()[0] == 64  # heaviest tile first
    md = TritonPagedBackend().build_metadata(make_batch(0, torch.float32, 16, 1, 1, 16, [(3, 1), (9, 1)])[0])
    assert md.num_prefill_tiles == 0 and md.num_decodes == 2 and md.decode_rows is None  # identity rows


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_graph_metadata_fixed_capacity(dtype):
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
    backend = TritonPagedBackend(TritonPagedSettings(prefill_block_m=16))
    md = backend.graph_metadata(static, cap_t)
    md.decode_rows.fill_(b - 1)  # stale values from an earlier step must not matter
    md.prefill_tiles.fill_(0)
    # what MixedBucket.run copies in
    static.query_start_loc[:b + 1].copy_(inputs.query_start_loc)
    static.query_start_loc[b + 1:].fill_(t)
    static.context_lens[:b].copy_(inputs.context_lens)
    static.seq_lens[:b].copy_(inputs.seq_lens)
    static.block_table[:b, :inputs.block_table.shape[1]].copy_(inputs.block_table)
    static.slot_mapping[:t].copy_(inputs.slot_mapping)
    backend.update_graph_metadata(md, inputs)
    assert int(md.decode_count) == 4 and int(md.tile_count) == 2 + 3 + 7 + 1  # ceil(query_len / 16) per prefill
    pad = lambda x: torch.cat([x, torch.randn((cap_t - t, *x.shape[1:]), device=DEV).to(dtype)])  # noqa: E731
    layer = AttentionLayer(0, hkv * group, hkv, d, d ** -0.5, None)
    plain_cache, graph_cache = cache.clone(), cache.clone()
    want = backend.forward(layer, q, k, v, plain_cache, backend.build_metadata(inputs))
    got = backend.forward(layer, pad(q), pad(k), pad(v), graph_cache, md)
    check_close(got[:t], want.float(), dtype, seed)
    keep = torch.arange(cache.shape[1], device=DEV) != spare
    assert torch.equal(graph_cache[:, keep].nan_to_num(), plain_cache[:, keep].nan_to_num()), f"seed={seed}"
    with pytest.raises(ValueError, match="capacity"):
        backend.update_graph_metadata(backend.graph_metadata(static, 16), inputs)


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


def test_registered_and_auto_choice(monkeypatch):
    from kvforge.engine.builder import choose_attention
    from kvforge.plugin_manager import load_registry

    monkeypatch.setenv("KVFORGE_PLUGINS", "torch_ref,triton_paged")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reg = load_registry()
    spec = reg.get("attention", "triton_paged")
    assert spec.capabilities == {"priority": 10, "dtypes": ("float16", "bfloat16", "float32"), "cuda_graphs": True,
                                 "mixed_cuda_graphs": True}
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
    import shutil

    from helpers import STORIES_MODEL
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    spec = E2E_CONFIGS[request.param]
    seed = urandom_seed()
    torch.manual_seed(seed)
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=1, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    cfg = (MistralConfig(**common, head_dim=16, sliding_window=spec["sliding_window"]) if spec["arch"] == "mistral"
           else LlamaConfig(**common))
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, prm in hf.named_parameters():
            prm.copy_(1 + 0.3 * torch.randn_like(prm)) if name.endswith("norm.weight") else prm.normal_(0.0, 0.25)
    d = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(d, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(STORIES_MODEL, f)):
            shutil.copy(os.path.join(STORIES_MODEL, f), d)
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


# ---------------------------------------------------------------- GPU only (native kernels)
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_large(dtype, d):
    reqs = [(4000, 1), (0, 1), (1000, 1), (2047, 300), (0, 777), (123, 1), (513, 64)]
    run_case(dtype, 16, 4, 8, d, reqs, layers=2)
    run_case(dtype, 32, 8, 1, d, reqs[:4], window=1024)


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_decode_cuda_graph(dtype):
    """A pure-decode step is capturable (no host sync) and replays correctly on new data."""
    reqs = [(c, 1) for c in (0, 15, 16, 17, 100, 1000, 2049, 33)]
    inputs, q, k, v, cache = make_batch(urandom_seed(), dtype, 16, 2, 4, 128, reqs)
    layer = AttentionLayer(0, 8, 2, 128, 128 ** -0.5)
    backend = TritonPagedBackend()
    md = backend.build_metadata(inputs)
    out = torch.empty_like(q)
    static = [t.clone() for t in (q, k, v)]
    backend.forward(layer, *static, cache.clone(), md, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    work = cache.clone()
    with torch.cuda.graph(graph):
        backend.forward(layer, *static, work, md, out=out)
    for _ in range(2):
        seed = urandom_seed()
        g = torch.Generator().manual_seed(seed)
        q2, k2, v2 = (torch.randn(t.shape, generator=g).to(dtype).to(DEV) for t in (q, k, v))
        for s, new in zip(static, (q2, k2, v2)):
            s.copy_(new)
        work.copy_(cache)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, _ = reference(layer, q2, k2, v2, cache.clone(), inputs)
        check_close(out, ref, dtype, seed, "graph replay")
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.forward(layer, q, k, v, cache.clone(), md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
