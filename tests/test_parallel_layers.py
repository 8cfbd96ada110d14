"""Parallel layers checked in one process (issue 8), no workers needed:

* sharding of quantized linear layers goes through the method's ``output_dim``/``input_dim``
  (a packed, grouped fake method on two simulated TP ranks);
* the fused Triton MoE GEMM (on CPU through the Triton interpreter) against the torch reference.

Each test's random inputs come from a fresh seed printed in its messages.
"""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err, urandom_seed

# ---------------------------------------------------------------------------------------------
# Quantized layers shard through output_dim / input_dim (no processes)
# ---------------------------------------------------------------------------------------------

class _PackedMethod:
    """Fake AWQ-like format: ``qweight`` int32 [K, N/4] (4 values per int along N),
    ``scales`` [K/8, N] (groups of 8 input rows), ``tensor_scale`` [1] (replicated)."""

    def create_weights(self, layer, input_size, output_sizes, params_dtype):
        def add(name, shape, dtype, output_dim, input_dim, sizes):
            p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            p.output_dim, p.input_dim = output_dim, input_dim
            offs = [0]
            for s in sizes:
                offs.append(offs[-1] + s)
            p.shard_offsets = offs

            def loader(param, t, shard):
                if shard is None:
                    param.data.copy_(t)
                else:
                    lo, hi = param.shard_offsets[shard:shard + 2]
                    param.data.narrow(param.output_dim, lo, hi - lo).copy_(t)
            p.weight_loader = loader
            p.load_raw = True
            layer.register_parameter(name, p)
        add("qweight", (input_size, sum(output_sizes) // 4), torch.int32, 1, 0, [o // 4 for o in output_sizes])
        add("scales", (input_size // 8, sum(output_sizes)), torch.float32, 1, 0, output_sizes)
        add("tensor_scale", (1,), torch.float32, None, None, [1])

    def apply(self, layer, x, bias):
        raise NotImplementedError

    def process_weights_after_loading(self, layer):
        pass


class _PackedConfig:
    name = "packed"

    def get_linear_method(self, prefix):
        return _PackedMethod()


def test_quantized_layers_shard_by_declared_dims():
    from kvforge.distributed import parallel_state as ps
    from kvforge.layers.parallel_linear import QKVParallelLinear, RowParallelLinear
    g = torch.Generator().manual_seed(urandom_seed() % 2**31)
    hidden, d, heads, kv = 64, 8, 8, 1  # one KV head, replicated on both ranks
    q_full = torch.randint(-2**31, 2**31 - 1, (hidden, heads * d // 4), generator=g, dtype=torch.int32)
    k_full = torch.randint(-2**31, 2**31 - 1, (hidden, kv * d // 4), generator=g, dtype=torch.int32)
    sq_full, sk_full = torch.rand(hidden // 8, heads * d, generator=g), torch.rand(hidden // 8, kv * d, generator=g)
    o_q = torch.randint(-2**31, 2**31 - 1, (heads * d, hidden // 4), generator=g, dtype=torch.int32)
    o_s = torch.rand(heads * d // 8, hidden, generator=g)
    try:
        for rank in range(2):
            ps.set_parallel_state(ps.ParallelState(rank, 2, rank, 2, 0, 1, None, None, False,
                                                   torch.device("cpu"), "gloo"))
            qkv = QKVParallelLinear(hidden, d, heads, kv, False, _PackedConfig(), "l.qkv_proj", torch.float32)
            assert (qkv.num_heads, qkv.num_kv_heads) == (4, 1)
            for shard, (qw, sc) in enumerate([(q_full, sq_full), (k_full, sk_full), (k_full, sk_full)]):
                qkv.load("qweight", qw, shard)
                qkv.load("scales", sc, shard)
            qkv.load("tensor_scale", torch.tensor([0.5]), None)
            q_cols = slice(rank * 4 * d // 4, (rank + 1) * 4 * d // 4)
            want_q = torch.cat([q_full[:, q_cols], k_full, k_full], 1)
            assert torch.equal(qkv.qweight, want_q), f"rank {rank}: packed qkv columns"
            want_s = torch.cat([sq_full[:, rank * 4 * d:(rank + 1) * 4 * d], sk_full, sk_full], 1)
            assert torch.equal(qkv.scales, want_s), f"rank {rank}: qkv scales"
            assert qkv.tensor_scale.item() == 0.5
            o = RowParallelLinear(heads * d, hidden, False, _PackedConfig(), "l.o_proj", torch.float32)
            o.load("qweight", o_q, None)
            o.load("scales", o_s, None)
            half = heads * d // 2
            assert torch.equal(o.qweight, o_q[rank * half:(rank + 1) * half]), f"rank {rank}: row-parallel rows"
            assert torch.equal(o.scales, o_s[rank * half // 8:(rank + 1) * half // 8]), f"rank {rank}: groups"
    finally:
        ps.set_parallel_state(None)


# ---------------------------------------------------------------------------------------------
# Fused MoE GEMM (Triton; on CPU through the Triton interpreter) vs the torch reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_moe_triton_matches_reference(monkeypatch, dtype):
    from kvforge_plugins.models.moe.triton_moe import align_pairs, moe_pairs_reference, moe_pairs_triton
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    seed = urandom_seed()
    g = torch.Generator().manual_seed(seed % 2**31)
    for t, h, i, e, k in [(1, 64, 48, 4, 2), (13, 32, 40, 8, 3), (40, 64, 32, 4, 1)]:
        x = torch.randn(t, h, generator=g).to(dev, dtype)
        w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dev, dtype)
        w2 = (torch.randn(e, h, i, generator=g) * 0.2).to(dev, dtype)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).reshape(-1).to(dev)
        wts = torch.rand(t * k, generator=g).to(dev)
        sorted_ids, block_expert, total = align_pairs(ids, e, 16)
        real = sorted_ids[sorted_ids < t * k]
        assert sorted(real.tolist()) == list(range(t * k)), "every pair exactly once"
        for b in range(int(total) // 16):  # each block's pairs all use the block's expert
            blk = sorted_ids[b * 16:(b + 1) * 16]
            blk = blk[blk < t * k].long()
            assert (ids[blk] == block_expert[b]).all()
        for weights in (None, wts):
            got = moe_pairs_triton(x, ids, k, w13, w2, weights).float()
            want = moe_pairs_reference(x, ids, k, w13, w2, weights).float()
            err = rel_err(got, want)
            tol = 1e-5 if dtype == torch.float32 else 2e-3
            assert err <= tol, f"(t={t}, e={e}, k={k}, weights={weights is not None}, seed {seed}) rel_err {err:.3g}"
