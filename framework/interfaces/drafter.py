"""Drafter interface for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A drafter proposes up to ``k`` tokens per request; the target model scores all
``k + 1`` positions in one forward and the rejection sampler keeps a prefix.

EAGLE-style drafters (Li et al. 2024), which extrapolate the target's hidden
states, plug in through the same ``propose`` call: the engine passes the
target's last hidden states for each request in ``hidden_states`` (shape
``[num_requests, hidden_size]``, the model dtype) when the drafter declares the
capability ``needs_hidden_states=True`` at registration.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from kvforge.hookspecs import KVFORGE_HOOK_API

if TYPE_CHECKING:
    from kvforge.engine.request import Request


class Drafter(ABC):
    """Proposes draft tokens. Attribute ``num_speculative_tokens`` (k)."""

    KVFORGE_HOOK_API = KVFORGE_HOOK_API
    num_speculative_tokens: int

    @abstractmethod
    def propose(self, requests: list["Request"], hidden_states: Any = None) -> dict[str, list[int]]:
        """Return request_id -> up to k draft token ids (an empty list means no speculation)."""

    def free(self, request: "Request") -> None:
        """Release per-request drafter state (e.g. the draft model's own KV blocks)."""
