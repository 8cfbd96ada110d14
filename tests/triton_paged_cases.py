"""triton_paged kernels vs the torch_ref reference: cache write, decode, prefill/extend,
mixed batches, and (GPU only) large shapes and CUDA-graph capture. Set-up, tolerances and
the interpreter arrangement: triton_paged_support.py."""
from __future__ import annotations

import pytest
import torch

# triton_paged_support first: it arranges the interpreter before the kernels are imported
from triton_paged_support import (  # noqa: F401 - _interpreter_env is an autouse fixture
    ALL_DTYPES, CPU_DTYPES, DEV, MIXED, _interpreter_env, check_close, gpu_only, make_batch, reference, run_case,
)

from helpers import urandom_seed  # noqa: E402
from kvforge.interfaces import AttentionLayer  # noqa: E402
from kvforge_plugins.attention.torch_ref import write_kv  # noqa: E402
from kvforge_plugins.attention.triton_paged import TritonPagedBackend, TritonPagedSettings  # noqa: E402
from kvforge_plugins.attention.triton_paged.cache_kernel import reshape_and_cache  # noqa: E402


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


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("window", [None, 100])
def test_split_kv_prefill(dtype, window):
    """Chunks behind long prefixes, split across programs and merged by log-sum-exp (some
    ranges fully masked for some rows, some below a sliding window), next to decodes."""
    settings = TritonPagedSettings(prefill_block_m=16, split_kv_target_tiles=24, split_kv_min_keys=48)
    md = run_case(dtype, 16, 2, 2, 32, [(300, 20), (150, 1), (0, 70), (77, 5), (513, 2)], window=window,
                  settings=settings)
    assert md.num_merges > 0


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
