"""Attention backend interface: paged KV layout, per-step metadata, forward.

A backend serves mixed batches: each request contributes ``query_len >= 1``
new tokens that attend causally to its ``context_len`` cached tokens and to
themselves (a decode is ``query_len == 1``). Tokens of all requests are
flattened with no padding (varlen), as in FlashAttention-2's varlen API.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from kvforge.hookspecs import KVFORGE_HOOK_API


@dataclass(frozen=True)
class AttentionRequirements:
    """What the model and config ask of a backend (input to ``validate``).

    ``settings``: the backend's own ``attention.settings``, validated by its settings model
    (an instance of it, defaults filled in; None for a backend that takes no settings), so
    ``validate`` can refuse settings this device or model cannot honour.
    ``kv_cache_dtype``: what the cache stores: ``dtype``, or ``torch.float8_e4m3fn`` /
    ``torch.float8_e5m2`` (``cache.kv_cache_dtype``; :mod:`kvforge.layers.kv_cache_dtype`). An
    FP8 cache reaches only backends declaring it (``kv_cache_dtypes`` capability).
    """

    dtype: torch.dtype
    head_size: int
    num_heads: int
    num_kv_heads: int
    block_size: int
    kv_cache_dtype: torch.dtype
    sliding_window: int | None = None
    settings: Any = None


@dataclass(frozen=True)
class AttentionLayer:
    """Static per-layer facts. ``scale`` is the softmax scale (usually head_size**-0.5).

    ``kv_scale``: float32 [2] on the model's device, the per-tensor K and V scales of an FP8
    cache (stored = x / scale; :mod:`kvforge.layers.kv_cache_dtype`), set by
    :class:`~kvforge.layers.attention.PagedAttention`; None means 1.0. Backends read it only
    when the cache tensor is FP8; its values may change after capture (kernels read it
    from device memory).
    """

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: int | None = None
    kv_scale: torch.Tensor | None = field(default=None, compare=False, repr=False)


@dataclass
class AttentionInputs:
    """Backend-neutral per-step batch description, built by the model runner.

    B = number of requests in the step, T = total new tokens (sum of query_lens).

    Attributes:
        query_start_loc: int32 [B + 1], cumulative query lengths (0 first).
        context_lens: int32 [B], tokens already in the cache before this step.
        seq_lens: int32 [B], context_lens + query_lens.
        block_table: int32 [B, max_blocks_per_seq], physical block ids (padding -1... unused).
        slot_mapping: int64 [T], flat cache slot (block_id * block_size + offset) for each new token.
        max_query_len, max_seq_len: ints (tokens).
        query_lens_cpu, context_lens_cpu: the same lengths as Python lists (for planning).
        block_size: tokens per block.
    """

    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    block_size: int


class AttentionBackend(ABC):
    """An attention implementation over a paged KV cache."""

    KVFORGE_HOOK_API = KVFORGE_HOOK_API
    name: str = "?"
    #: Dimension of the cache tensor indexed by block id (the engine copies whole
    #: blocks along it to swap KV to and from CPU memory).
    block_dim: int = 1

    @classmethod
    @abstractmethod
    def validate(cls, req: AttentionRequirements, device: torch.device) -> list[str]:
        """Reasons this backend cannot run here (empty list = it can)."""

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_size: int) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor (K and V together)."""

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> Any:
        """Per-step metadata, computed once per step and shared by all layers."""

    def graph_metadata(self, inputs: AttentionInputs, max_num_tokens: int) -> Any:
        """Only for backends declaring ``mixed_cuda_graphs=True``: metadata for capturing
        mixed steps of up to ``max_num_tokens`` tokens and ``len(inputs.context_lens)``
        requests in a CUDA graph. ``inputs`` are the graph bucket's static buffers; the
        metadata's own tensors must stay fixed, refilled by :meth:`update_graph_metadata`."""
        raise NotImplementedError(f"{self.name} does not capture mixed steps in CUDA graphs")

    def update_graph_metadata(self, metadata: Any, inputs: AttentionInputs) -> None:
        """Refill ``metadata`` (from :meth:`graph_metadata`) for a real step described by
        ``inputs``, with device copies only (no host synchronization)."""
        raise NotImplementedError(f"{self.name} does not capture mixed steps in CUDA graphs")

    @abstractmethod
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: Any) -> torch.Tensor:
        """Write the step's ``k``/``v`` into ``kv_cache`` at ``slot_mapping`` and attend.

        Contract: all of the step's new K/V are written before any cache read,
        so a request may attend to blocks another request of the same step fills
        (two requests sharing a freshly cached prefix).

        Args:
            q: [T, num_heads, head_size]; k, v: [T, num_kv_heads, head_size] (model dtype).
            kv_cache: this layer's cache, shape ``kv_cache_shape(...)``.
        Returns:
            [T, num_heads, head_size] in q's dtype.
        """
