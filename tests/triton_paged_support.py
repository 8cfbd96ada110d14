"""Shared set-up of the triton_paged case files (triton_paged_cases.py: kernels;
triton_paged_engine_cases.py: metadata, plumbing, engine end to end).

Without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1,
set while the kernel modules are imported and while the case modules' tests run,
and unset otherwise, so other test modules' ``auto`` backend choice is not
switched to the slow interpreter); with CUDA they run natively.

Every kernel case: fresh ``torch.randn`` inputs (seed printed in failures), shuffled
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

from kvforge.interfaces import AttentionInputs, AttentionLayer  # noqa: E402
from kvforge_plugins.attention.torch_ref import TorchRefBackend  # noqa: E402
from kvforge_plugins.attention.triton_paged import TritonPagedBackend  # noqa: E402

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
    return md
