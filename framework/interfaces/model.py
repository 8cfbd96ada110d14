"""Model interface: a flattened (varlen) causal LM over a paged KV cache."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from kvforge.hookspecs import KVFORGE_HOOK_API
from kvforge.interfaces.attention import AttentionBackend
from kvforge.interfaces.quantization import QuantizationConfig


@dataclass
class ModelContext:
    """What a model factory gets besides the HF config."""

    dtype: torch.dtype
    device: torch.device
    attention_backend: AttentionBackend
    quant_config: QuantizationConfig


@dataclass
class ForwardMetadata:
    """Per-step data every attention layer reads: backend metadata and the caches
    (``kv_caches[layer_idx]``)."""

    attn_metadata: Any
    kv_caches: list[torch.Tensor] = field(default_factory=list)


class Model(torch.nn.Module, ABC):
    """A causal LM in kvforge's flattened layout."""

    KVFORGE_HOOK_API = KVFORGE_HOOK_API

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: ForwardMetadata) -> torch.Tensor:
        """``input_ids`` int64 [T], ``positions`` int64 [T] -> hidden states [T, hidden_size]."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> float32 logits [N, vocab_size]."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors (HF names); return the names of parameters filled."""
