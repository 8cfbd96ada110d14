"""The quantizer conformance protocol (``kvforge.testing.quantizer``) for the built-in
quantized linear methods: random checkpoint-format test weights and their float32
dequantization.

``make_test_weights`` draws the quantized values (ints, zero points, scales) first, packs
them into the method's checkpoint layout, and remembers the float32 weight they encode;
``dequantize_test_weights`` returns that weight. The suite then loads the packed tensors
through the real loaders and compares the layer's GEMM with ``x @ W^T``.

W8A8 methods quantize the activations too, which the suite's reference does not, so their
``test_rtol`` allows the activation rounding: INT8 (per token, step max|x|/127) 3e-2,
FP8 E4M3 (relative step 2^-3) 8e-2.
"""
from __future__ import annotations

import torch

from .common import AWQ_PACK_ORDER, pack_rows

W8A8_RTOL = {"int8": {"float32": 3e-2, "float16": 3e-2, "bfloat16": 5e-2},
             "fp8": {"float32": 8e-2, "float16": 8e-2, "bfloat16": 1e-1}}


def _pack_cols(q: torch.Tensor, bits: int, awq_order: bool = False) -> torch.Tensor:
    """[R, C] -> [R, C * bits / 32] int32, packed along columns (optionally in AWQ order)."""
    if awq_order:
        q = q[:, torch.arange(q.shape[1]).view(-1, 8)[:, list(AWQ_PACK_ORDER)].reshape(-1)]
    return pack_rows(q.t().contiguous(), bits).t().contiguous()


class _Stash:
    """Float32 references of the test tensors, keyed by the identity of the first tensor."""

    def __init__(self) -> None:
        self.refs: dict[int, torch.Tensor] = {}

    def put(self, tensors: dict[str, list[torch.Tensor]], ref: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        self.refs[id(next(iter(tensors.values()))[0])] = ref
        return tensors

    def get(self, tensors: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        return self.refs.pop(id(next(iter(tensors.values()))[0]))


STASH = _Stash()


def wna16_test_weights(m, k: int, outs: list[int], gen: torch.Generator) -> dict[str, list[torch.Tensor]]:
    """Test tensors of a :class:`~.weight_only.WNA16LinearMethod` ``m`` (awq / gptq / ct)."""
    bits = m.bits
    gs = k if m.group_size == -1 else m.group_size
    groups = -(-k // gs)
    if m.fmt == "gptq" and m.desc_act:  # act order: one permutation for all shards (shared input)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // gs
    else:
        g_idx = torch.arange(k) // gs
    tensors: dict[str, list[torch.Tensor]] = {}
    refs = []
    for n in outs:
        q = torch.randint(0, 2 ** bits, (k, n), generator=gen)
        lo = m.zero_offset
        z = (torch.full((groups, n), 2 ** (bits - 1)) if m.fmt == "ct" and m.symmetric
             else torch.randint(lo, 2 ** bits, (groups, n), generator=gen))
        s = (torch.rand(groups, n, generator=gen) + 0.5) * (2.0 / 2 ** bits) * k ** -0.5
        s = s.half()
        refs.append(((q - z[g_idx]).float() * s.float()[g_idx]).t())
        if m.fmt == "awq":
            shard = {"qweight": _pack_cols(q, bits, True), "qzeros": _pack_cols(z, bits, True), "scales": s}
        elif m.fmt == "gptq":
            shard = {"qweight": pack_rows(q, bits), "qzeros": _pack_cols(z - m.zero_offset, bits), "scales": s,
                     "g_idx": g_idx.to(torch.int32)}
        else:
            shard = {"weight_packed": pack_rows(q, bits).t().contiguous(), "weight_scale": s.float().t().contiguous(),
                     "weight_shape": torch.tensor([n, k])}
            if not m.symmetric:
                shard["weight_zero_point"] = pack_rows(z.t().contiguous(), bits)
        for name, t in shard.items():
            tensors.setdefault(name, []).append(t)
    return STASH.put(tensors, torch.cat(refs))


def w8a8_test_weights(m, k: int, outs: list[int], params_dtype: torch.dtype,
                      gen: torch.Generator) -> dict[str, list[torch.Tensor]]:
    """Test tensors of a :class:`~.w8a8.W8A8LinearMethod` ``m`` (checkpoint or online)."""
    from .kernels.scaled_mm import qmax_of
    from .w8a8 import quantize_weight
    ws = [torch.randn(n, k, generator=gen) * k ** -0.5 for n in outs]
    if not m.from_checkpoint:  # online: the plugin quantizes the fused, dtype-rounded weight
        full = torch.cat(ws).to(params_dtype).float()
        q, s = quantize_weight(full, m.qdtype, m.online_per_channel)
        ref = q.float() * (s.view(-1, 1) if s.numel() > 1 else s)
        return STASH.put({"weight": [w.to(params_dtype) for w in ws]}, ref)
    per_channel = not m.static_input  # cover both: per-tensor scales with static activations
    tensors: dict[str, list[torch.Tensor]] = {"weight": [], "weight_scale": []}
    refs = []
    for w in ws:
        q, s = quantize_weight(w, m.qdtype, per_channel)
        tensors["weight"].append(q)
        tensors["weight_scale"].append(s.view(-1, 1) if per_channel else s.reshape(()))
        refs.append(q.float() * (s.view(-1, 1) if per_channel else s))
    if m.static_input:  # randn activations stay below 6: no clipping
        tensors["input_scale"] = [torch.tensor(6.0 / qmax_of(m.qdtype)) for _ in outs]
    return STASH.put(tensors, torch.cat(refs))
