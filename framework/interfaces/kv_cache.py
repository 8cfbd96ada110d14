"""KV cache allocator interface: block ids only; tensors belong to the model runner.

PagedAttention (Kwon et al., SOSP'23): the KV cache is split into fixed-size
blocks of ``block_size`` tokens; each request holds a block table mapping its
logical blocks to physical block ids in ``[0, num_blocks)``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from kvforge.hookspecs import KVFORGE_HOOK_API

if TYPE_CHECKING:
    from kvforge.engine.request import Request


class KVAllocator(ABC):
    """Hands out physical block ids. Attributes ``num_blocks`` and ``block_size`` (tokens)."""

    KVFORGE_HOOK_API = KVFORGE_HOOK_API
    num_blocks: int
    block_size: int

    def get_computed_tokens(self, request: "Request") -> int:
        """Tokens of ``request``'s prefix already in the cache (prefix caching).

        Called before a waiting request's first allocation; the default (no
        prefix caching) is 0. An implementation that returns n > 0 must then
        place those cached blocks first in the request's block table on the next
        ``allocate_slots``. Must leave at least one token to compute.
        """
        return 0

    @abstractmethod
    def allocate_slots(self, request: "Request", num_new_tokens: int,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Grow ``request``'s block table to hold ``request.num_computed_tokens +
        num_new_tokens + num_lookahead_tokens`` tokens. Lookahead slots hold the KV of
        draft tokens (speculative decoding): they are never prefix-cache registered.

        Returns: the newly added block ids (possibly empty), or None when there
        are not enough free blocks, in which case nothing changed.
        """

    @abstractmethod
    def free(self, request: "Request") -> None:
        """Return all of ``request``'s blocks (decrementing shared reference counts).
        Freeing a request with no blocks is a no-op."""

    def free_tail(self, request: "Request", num_tokens: int) -> None:
        """Speculative decoding rollback: keep only the blocks that hold the first
        ``num_tokens`` tokens of ``request`` and return the rest (the lookahead slots
        of rejected draft tokens). Blocks whose tokens are not all accepted must never
        have been registered in the prefix cache (``allocate_slots`` only registers
        the ``num_new_tokens`` part, never the lookahead). The default keeps the blocks
        (safe: they come back with :meth:`free`)."""

    @abstractmethod
    def get_block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids in logical order (empty if none)."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now."""

    def stats(self) -> dict[str, float]:
        """Counters: usage (0..1), prefix hit rate, queries, evictions."""
        return {"kv_cache_usage": 1.0 - self.num_free_blocks / max(1, self.num_blocks)}
