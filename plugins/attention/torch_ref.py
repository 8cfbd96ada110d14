"""`torch_ref` attention backend: the numerical reference for every kernel.

Plain PyTorch, one request at a time, softmax in float32. Runs on CPU and GPU
in any dtype. Cache layout per layer: ``[2, num_blocks, block_size,
num_kv_heads, head_size]`` (index 0 = K, 1 = V), as in vLLM's FlashAttention
backend. Causal rule: new token t of a request (absolute position
``context_len + t``) attends to keys ``0 .. context_len + t`` — a prefill chunk
sees its cached prefix and itself (causally), a decode sees everything.
"""
from __future__ import annotations

import torch

from kvforge import hookimpl
from kvforge.interfaces import AttentionBackend, AttentionInputs, AttentionLayer, AttentionRequirements
from kvforge.layers.kv_cache_dtype import dequantize_kv, is_fp8, quantize_kv, unit_kv_scale

KVFORGE_HOOK_API = "1"


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """Scatter ``k``/``v`` [T, Hkv, D] into ``kv_cache`` [2, NB, BS, Hkv, D] at flat slots [T] (int64).

    An FP8 cache stores ``k / kv_scale[0]`` and ``v / kv_scale[1]`` (float32 [2]; None: 1.0),
    saturated and rounded to nearest even (:func:`kvforge.layers.kv_cache_dtype.quantize_kv`).
    """
    nb, bs, hkv, d = kv_cache.shape[1:]
    if not is_fp8(kv_cache.dtype):
        kv_cache[0].view(nb * bs, hkv, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].view(nb * bs, hkv, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
        return
    scales = unit_kv_scale(k.device) if kv_scale is None else kv_scale
    # index_copy_ has no FP8 kernel (CPU): scatter the bytes through a uint8 view.
    flat = kv_cache.view(torch.uint8)
    for i, x in enumerate((k, v)):
        q = quantize_kv(x, scales[i], kv_cache.dtype)
        flat[i].view(nb * bs, hkv, d).index_copy_(0, slot_mapping, q.view(torch.uint8))


def gather_kv(kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int,
              kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read one request's K and V, each [seq_len, Hkv, D], from its block ids [nblocks]; an FP8
    cache's values come back dequantized (float32, times ``kv_scale`` [2])."""
    hkv, d = kv_cache.shape[3:]
    k = kv_cache[0, blocks].reshape(-1, hkv, d)[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, hkv, d)[:seq_len]
    if is_fp8(kv_cache.dtype):
        k = dequantize_kv(k, None if kv_scale is None else kv_scale[0])
        v = dequantize_kv(v, None if kv_scale is None else kv_scale[1])
    return k, v


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float,
                  sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention of one request in float32.

    Args:
        q: [n, Hq, D] new tokens at positions context_len .. context_len+n-1.
        k, v: [context_len + n, Hkv, D]; Hq must be a multiple of Hkv (GQA, Ainslie et al. 2023).
    Returns:
        [n, Hq, D] float32.
    """
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    qpos = torch.arange(n, device=q.device).unsqueeze(1) + context_len
    kpos = torch.arange(k.shape[0], device=q.device).unsqueeze(0)
    allowed = kpos <= qpos
    if sliding_window is not None:
        allowed &= kpos > qpos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vf)


class TorchRefBackend(AttentionBackend):
    """Reference paged attention; see module docstring."""

    name = "torch_ref"

    def __init__(self, settings=None) -> None:
        self.settings = settings

    @classmethod
    def validate(cls, req: AttentionRequirements, device: torch.device) -> list[str]:
        reasons = []
        if req.num_heads % req.num_kv_heads:
            reasons.append(f"num_heads {req.num_heads} is not a multiple of num_kv_heads {req.num_kv_heads}")
        return reasons

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, inputs: AttentionInputs) -> AttentionInputs:
        return inputs

    def forward(self, layer: AttentionLayer, q, k, v, kv_cache, metadata: AttentionInputs):
        write_kv(kv_cache, k, v, metadata.slot_mapping, layer.kv_scale)
        out = torch.empty_like(q)
        start = 0
        for i, qlen in enumerate(metadata.query_lens_cpu):
            self.attend_row(layer, q, kv_cache, metadata, i, start, out)
            start += qlen
        return out

    def attend_row(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                   inputs: AttentionInputs, i: int, start: int, out: torch.Tensor) -> None:
        """Attention of request row ``i`` (its tokens start at ``start`` in ``q``) into ``out``."""
        qlen, ctx = inputs.query_lens_cpu[i], inputs.context_lens_cpu[i]
        seq_len = ctx + qlen
        blocks = inputs.block_table[i, : -(-seq_len // inputs.block_size)].long()
        ks, vs = gather_kv(kv_cache, blocks, seq_len, layer.kv_scale)
        out[start:start + qlen] = ref_attention(q[start:start + qlen], ks, vs, ctx, layer.scale,
                                                layer.sliding_window).to(q.dtype)


@hookimpl
def kvforge_register_attention_backends(register) -> None:
    register("torch_ref", TorchRefBackend, priority=0, dtypes=("float32", "float16", "bfloat16"),
             devices=("cpu", "cuda"), cuda_graphs=False, spec_decode=True, kv_cache_dtypes=("fp8_e4m3", "fp8_e5m2"))
