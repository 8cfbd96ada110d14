"""`paged` KV allocator: fixed-size blocks, a free list, reference counts and
per-request block tables (PagedAttention, Kwon et al., SOSP'23)."""
from __future__ import annotations

from collections import deque

from kvforge import hookimpl
from kvforge.interfaces import KVAllocator

KVFORGE_HOOK_API = "1"


class PagedAllocator(KVAllocator):
    """Block-id allocator. Blocks are reference counted so that later features
    (prefix sharing, forks) can share a physical block between requests.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> list[int] | None:
        table = self._tables.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = self.blocks_needed(total) - len(table)
        if need <= 0:
            return []
        if need > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(need)]
        for b in new:
            self._ref[b] = 1
        self._tables.setdefault(request.request_id, table).extend(new)
        return new

    def free(self, request) -> None:
        table = self._tables.pop(request.request_id, None)
        if not table:
            return
        # Free tail first so a future prefix cache evicts chain tails first.
        for b in reversed(table):
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise RuntimeError(f"block {b} freed twice (request {request.request_id})")
            if self._ref[b] == 0:
                self._free.append(b)

    def get_block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]


def make_paged(num_blocks: int, block_size: int, settings, cache_config) -> PagedAllocator:
    if cache_config.enable_prefix_caching:
        raise ValueError("cache.enable_prefix_caching: the `paged` allocator in this build has no "
                         "prefix cache yet; set enable_prefix_caching to false")
    return PagedAllocator(num_blocks, block_size)


@hookimpl
def kvforge_register_kv_allocators(register) -> None:
    register("paged", make_paged, prefix_caching=False)
