"""Attention layer: holds the per-layer facts and calls the chosen backend."""
from __future__ import annotations

import torch

from kvforge.interfaces import AttentionBackend, AttentionLayer, ForwardMetadata


class PagedAttention(torch.nn.Module):
    """q [T, Hq*D], k/v [T, Hkv*D] -> [T, Hq*D] via ``backend.forward`` over this layer's paged cache."""

    def __init__(self, backend: AttentionBackend, layer: AttentionLayer) -> None:
        super().__init__()
        self.backend = backend
        self.layer = layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        L = self.layer
        t = q.shape[0]
        out = self.backend.forward(L, q.view(t, L.num_heads, L.head_size), k.view(t, L.num_kv_heads, L.head_size),
                                   v.view(t, L.num_kv_heads, L.head_size), meta.kv_caches[L.layer_idx],
                                   meta.attn_metadata)
        return out.reshape(t, L.num_heads * L.head_size)
