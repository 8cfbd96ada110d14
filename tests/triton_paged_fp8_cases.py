"""triton_paged over an FP8 KV cache (cache.kv_cache_dtype fp8 / fp8_e5m2) against torch_ref on
the same cache: the write must store exactly torch's round-to-nearest-even of x / scale
(saturated), and decode / prefill / mixed attention must match torch_ref reading the same FP8
values, within the dtype's usual tolerance (triton_paged_support.py). Scales are fresh random
powers and non-powers of two per run. Run through test_triton_paged.py."""
from __future__ import annotations

import pytest
import torch

from triton_paged_support import (  # noqa: F401 - _interpreter_env is an autouse fixture
    ALL_DTYPES, DEV, MIXED, _interpreter_env, check_close, gpu_only, make_batch,
)
from triton_paged_engine_cases import tiny_model  # noqa: F401,E402 - a fixture

from helpers import urandom_seed  # noqa: E402
from kvforge.interfaces import AttentionLayer  # noqa: E402
from kvforge.layers.kv_cache_dtype import FP8_MAX, quantize_kv  # noqa: E402
from kvforge_plugins.attention.torch_ref import TorchRefBackend, write_kv  # noqa: E402
from kvforge_plugins.attention.triton_paged import TritonPagedBackend, TritonPagedSettings  # noqa: E402
from kvforge_plugins.attention.triton_paged.cache_kernel import reshape_and_cache  # noqa: E402

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _scales(g: torch.Generator) -> torch.Tensor:
    """K and V scales in [1/8, 4), fresh per run (float32 [2] on the device)."""
    return (2.0 ** (torch.rand(2, generator=g) * 5 - 3)).to(DEV)


def _to_fp8(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A model-dtype cache (NaN = never written) as the FP8 cache torch_ref would have written."""
    return torch.stack([quantize_kv(cache[i], scale[i], dtype) for i in range(2)])


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp8_cache_write_rounds_like_torch(fp8, dtype):
    """Every value class: normal, subnormal, past the range (saturates), and values that round
    up into the next power of two (the case Triton's interpreter casts wrongly)."""
    seed = urandom_seed()
    g = torch.Generator().manual_seed(seed)
    nb, bs, hkv, d, t = 5, 16, 2, 64, 48
    scale = _scales(g)
    lim = FP8_MAX[fp8]
    k = torch.randn(t, hkv, d, generator=g) * 3
    v = torch.randn(t, hkv, d, generator=g) * 3
    k[:8] *= 1e-3  # subnormal range of the format
    k[8:12] = torch.sign(k[8:12]) * lim * 3  # past the range
    v[:6] = torch.sign(v[:6]) * (1.9375 + 0.0625 * torch.rand(6, hkv, d, generator=g)) * 2.0 ** torch.randint(
        -4, 4, (6, hkv, d), generator=g)  # just under a power of two
    k, v = (k * scale[0].cpu()).to(dtype).to(DEV), (v * scale[1].cpu()).to(dtype).to(DEV)
    slots = torch.randperm(nb * bs, generator=g)[:t].to(DEV)
    slots[::9] = -1
    cache = torch.zeros(2, nb, bs, hkv, d, dtype=fp8, device=DEV)
    want = cache.clone()
    keep = slots >= 0
    write_kv(want, k[keep], v[keep], slots[keep], scale)
    reshape_and_cache(k, v, cache, slots, scale)
    diff = (cache.view(torch.uint8) != want.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, (f"{len(diff)} bytes differ, first at {diff[0].tolist()}: got "
                               f"{cache[tuple(diff[0])].float().item()} want {want[tuple(diff[0])].float().item()}, "
                               f"seed={seed}")
    assert want.float().abs().max().item() == lim  # the saturated rows reached the bound


def _run_fp8(fp8, dtype, block_size, group, d, reqs, window=None, settings=None):
    seed = urandom_seed()
    inputs, q, k, v, cache = make_batch(seed, dtype, block_size, 2, group, d, reqs)
    scale = _scales(torch.Generator().manual_seed(seed + 1))
    cache = _to_fp8(cache.float() * scale.view(2, 1, 1, 1, 1), scale, fp8)  # prefix values near the scales' range
    layer = AttentionLayer(0, 2 * group, 2, d, d ** -0.5, window, kv_scale=scale)
    backend = TritonPagedBackend(settings)
    md = backend.build_metadata(inputs)
    ref_cache = cache.clone()
    ref = TorchRefBackend().forward(layer, q.float(), k.float(), v.float(), ref_cache, inputs)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
    got = backend.forward(layer, q, k, v, cache, md, out=out)
    check_close(got, ref, dtype, seed)
    assert _bits_equal(cache, ref_cache), f"cache bytes differ from torch_ref's write, seed={seed}"
    # the scales are used: attention over the stored values without them differs
    unscaled = TorchRefBackend().forward(AttentionLayer(0, 2 * group, 2, d, d ** -0.5, window), q.float(),
                                         k.float(), v.float(), cache.clone(), inputs)
    assert (unscaled - ref).abs().max() > 1e-2, f"scales had no effect, seed={seed}"


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("block_size,group", [(16, 4), (32, 1), (16, 8)])
def test_fp8_decode(fp8, dtype, block_size, group):
    _run_fp8(fp8, dtype, block_size, group, 64, [(0, 1), (16, 1), (33, 1), (100, 1)])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_fp8_prefill_with_prefix(fp8, dtype):
    _run_fp8(fp8, dtype, 16, 4, 64, [(0, 17), (16, 33), (50, 2)])


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dot", ["float16", pytest.param("model", marks=gpu_only)])
def test_fp8_bf16_query(fp8, dot):
    """A bf16 model over an FP8 cache: dots in fp16 (the default; this runs in the CPU
    interpreter too, whose bf16 dots are wrong) or in bf16 (``fp8_dot_dtype: model``)."""
    _run_fp8(fp8, torch.bfloat16, 16, 4, 64, MIXED[:5], settings=TritonPagedSettings(fp8_dot_dtype=dot))


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_fp8_mixed_batch_sliding_window_head_128(dtype):
    _run_fp8(torch.float8_e4m3fn, dtype, 32, 4, 128, MIXED[:5], window=24)


def test_fp8_engine_triton_paged_equals_torch_ref(tiny_model):
    """Whole engine, fp32 model, E4M3 cache with fresh random per-layer scales set on the
    layers: triton_paged's logits (one step and chunked over the cache) match torch_ref's over
    the same FP8 cache, and greedy tokens match; against the fp32-cache HF model they stay
    within the FP8 error.

    Bounds: the backends' fp32 sums differ by ~1e-6, and a later layer's K or V value that sits
    at a rounding boundary then lands on the neighbouring FP8 value (a 6% step), so the logits
    may part by more than fp32 rounding: rel 2e-2 (measured up to 3e-3; a lost scale gives
    O(1)), greedy ties within 0.05 log-prob. Against HF, per position max |diff| / max |ref|, its
    median over a prompt's positions <= 0.2 (measured 0.058-0.107 over 40 prompts of 20 random
    models; E4M3 keeps 3 mantissa bits; a cache read back wrong gives errors near 1)."""
    import random

    from helpers import assert_outputs_match, prompt_logits, rel_err
    from kvforge import LLM, SamplingParams
    from kvforge.layers.attention import PagedAttention

    name, hf, path, wseed = tiny_model
    seed = urandom_seed()
    rng = random.Random(seed)
    tag = f"[{name}] weights seed {wseed}, seed {seed}"
    prompts = [[rng.randrange(512) for _ in range(rng.randint(20, 40))] for _ in range(2)]
    chunks = [[len(p) // 2, len(p) - len(p) // 2] for p in prompts]
    scales = None
    runs = {}
    for backend in ("torch_ref", "triton_paged"):
        llm = LLM(path, dtype="float32", block_size=16, attention_backend=backend, kv_cache_dtype="fp8")
        engine = llm.llm_engine
        assert all(c.dtype == torch.float8_e4m3fn for c in engine.runner.kv_caches), tag
        layers = [m for m in engine.runner.model.modules() if isinstance(m, PagedAttention)]
        if scales is None:
            scales = [torch.tensor([rng.uniform(0.01, 0.1), rng.uniform(0.01, 0.1)]) for _ in layers]
        for m, s in zip(layers, scales):
            m.kv_scale.copy_(s)
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        runs[backend] = ([prompt_logits(engine, prompts, ch) for ch in (None, chunks)], outs)
    for (ref_lg, ref_out), (got_lg, got_out) in [(runs["torch_ref"], runs["triton_paged"])]:
        for ref_step, got_step in zip(ref_lg, got_lg):
            for r, g in zip(ref_step, got_step):
                assert rel_err(g, r) <= 2e-2, f"{tag}: rel err {rel_err(g, r):.3g} against torch_ref on fp8"
        assert_outputs_match([o.outputs[0] for o in got_out], [o.outputs[0] for o in ref_out], tag, tie_tol=0.05)
    with torch.no_grad():
        for p, got in zip(prompts, runs["triton_paged"][0][0]):
            ref = hf(torch.tensor([p])).logits[0].float()
            per_pos = (got - ref).abs().amax(-1) / ref.abs().amax(-1)
            assert per_pos.median() <= 0.2, f"{tag}: median per-position rel err {per_pos.median():.3g} against HF"
