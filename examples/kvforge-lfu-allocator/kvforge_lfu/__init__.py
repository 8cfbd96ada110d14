"""``lfu``: a kvforge KV allocator with prefix caching and LFU-DA eviction.

Same contract as the built-in ``paged`` allocator (fixed-size blocks, reference
counts, per-request block tables, automatic prefix caching keyed by chained
block hashes, PagedAttention, Kwon et al. SOSP'23), but a different choice of
which cached block to give up when a fresh block is needed:

- ``paged`` evicts the least *recently* freed cached block (LRU);
- ``lfu`` evicts the cached block with the lowest priority
  ``K = hits + L`` -- LFU with dynamic aging (LFU-DA; Arlitt, Cherkasova, Dilley,
  Friedrich and Jin, "Evaluating content management techniques for Web proxy
  caches", 2000): ``hits`` counts how often the block's prefix was reused, and
  ``L`` (the "age") is raised to the priority of every evicted block, so blocks
  that were popular long ago eventually lose to blocks popular now. With
  ``dynamic_aging: false`` it is plain LFU. Ties go to the least recently freed.

A shared system prompt reused by every request keeps its blocks through bursts
of one-off prompts that would flush an LRU cache.

Free blocks that hold no cached prefix are always used before any eviction.
Per-request eviction hints (``SamplingParams(extra_args={"kvforge":
{"eviction_hint": ...}})``, allowed by the operator in
``request_choices.eviction_hints``):

- ``evict_first``: the request's cached blocks are evicted before any others
  (one-off documents);
- ``retain``: they are evicted only after every block without the hint.

Registered as ``cache.allocator: lfu`` (entry point ``lfu_cache``) with
capabilities ``prefix_caching=True``, ``rollback=True`` (``free_tail`` returns
the slots of rejected draft tokens) and ``eviction_hints=("evict_first", "retain")``.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque

from pydantic import BaseModel, ConfigDict, Field

from kvforge import hookimpl
from kvforge.engine.request_choices import get_choice
from kvforge.interfaces import KVAllocator
from kvforge_plugins.kv_cache.block_hash import BlockHash, extend_hashes, hash_block

#: The kvforge hook API this plugin targets (checked at load).
KVFORGE_HOOK_API = "1"

__version__ = "0.1.0"

EVICTION_HINTS = ("evict_first", "retain")
_HINT_BIAS = {"evict_first": -1e12, "retain": 1e12}


class LFUSettings(BaseModel):
    """``cache.settings`` of the ``lfu`` allocator."""

    model_config = ConfigDict(extra="forbid")
    dynamic_aging: bool = Field(True, description="LFU-DA (true) or plain LFU (false).")


class LFUAllocator(KVAllocator):
    """Block allocator with prefix caching and LFU-DA eviction of free cached blocks.

    Args:
        num_blocks: physical blocks; block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests by chained hash.
        dynamic_aging: LFU-DA's age term (see the module docstring).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 dynamic_aging: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.dynamic_aging = dynamic_aging
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._hits = [0] * num_blocks                      # reuses of the block's cached prefix
        self._cached: dict[BlockHash, int] = {}
        self._clean: deque[int] = deque(range(num_blocks))  # free, holding no cached prefix
        self._heap: list[tuple[float, int, int]] = []      # (priority, tick, block) of free cached blocks
        self._key: dict[int, tuple[float, int]] = {}       # block -> its live heap entry
        self._tick = itertools.count()
        self._age = 0.0
        self._tables: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        self._pending_hits: dict[str, list[int]] = {}
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # -- prefix cache -----------------------------------------------------------------
    def _request_hashes(self, request) -> list[BlockHash]:
        hs = self._req_hashes.setdefault(request.request_id, [])
        salt = (getattr(request, "cache_salt", None) or "").encode()
        # placeholders (async scheduling) are not hashed until their ids are known
        extend_hashes(hs, request.token_slice, request.num_known_tokens, self.block_size, salt)
        return hs

    def _lookup(self, request, hashes) -> list[int]:
        max_blocks = (request.num_tokens - 1) // self.block_size  # leave a token to compute
        hit = []
        for h in hashes[:max_blocks]:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def peek_computed_tokens(self, request) -> int:
        """What :meth:`get_computed_tokens` would return now, with no side effects
        (no statistics, nothing remembered); for schedulers ranking waiting requests."""
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return 0
        if request.sampling_params.prompt_logprobs is not None:
            return 0
        salt = (getattr(request, "cache_salt", None) or "").encode()
        hashes: list[BlockHash] = []
        for b in range((request.num_tokens - 1) // self.block_size):
            h = hash_block(hashes[-1] if hashes else None,
                           request.token_slice(b * self.block_size, (b + 1) * self.block_size),
                           salt if b == 0 else b"")
            if h not in self._cached:
                break
            hashes.append(h)
        return len(hashes) * self.block_size

    def get_computed_tokens(self, request) -> int:
        self._pending_hits.pop(request.request_id, None)
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return 0
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # cached positions would have no logits to report
        hit = self._lookup(request, self._request_hashes(request))
        self.queries += request.num_tokens
        self.hits += len(hit) * self.block_size
        if hit:
            self._pending_hits[request.request_id] = hit
        return len(hit) * self.block_size

    def _register_full_blocks(self, request, table: list[int], num_tokens: int) -> None:
        start = self._num_registered.get(request.request_id, 0)
        full = min(num_tokens // self.block_size, len(table))
        if full <= start:
            return
        hashes = self._request_hashes(request)
        full = min(full, len(hashes))  # a block holding a placeholder waits for its id
        for i in range(start, full):
            b, h = table[i], hashes[i]
            if self._hash[b] is None and h not in self._cached:
                self._hash[b] = h
                self._cached[h] = b
                self._hits[b] = 1
        self._num_registered[request.request_id] = full

    # -- free pool ----------------------------------------------------------------------
    def _release(self, b: int, hint: str | None) -> None:
        """Block ``b``'s last reference is gone: back to the clean pool, or evictable."""
        if self._hash[b] is None:
            self._clean.append(b)
            return
        prio = self._hits[b] + (self._age if self.dynamic_aging else 0.0) + _HINT_BIAS.get(hint, 0.0)
        key = (prio, next(self._tick))
        self._key[b] = key
        heapq.heappush(self._heap, (key[0], key[1], b))
        if len(self._heap) > 4 * self.num_blocks:  # drop stale entries now and then
            self._heap = [(p, t, x) for x, (p, t) in self._key.items()]
            heapq.heapify(self._heap)

    def _reclaim(self, b: int) -> None:
        """A free cached block is taken back by a prefix hit (not evicted)."""
        del self._key[b]  # its heap entry goes stale

    def _take(self) -> int:
        """A fresh block: a clean one, else evict the lowest-priority free cached block."""
        if self._clean:
            return self._clean.popleft()
        while True:
            prio, tick, b = heapq.heappop(self._heap)
            if self._key.get(b) == (prio, tick):
                break
        del self._key[b]
        del self._cached[self._hash[b]]
        self._hash[b] = None
        self._hits[b] = 0
        self.evictions += 1
        if self.dynamic_aging and abs(prio) < 1e11:  # hint biases do not age the cache
            self._age = max(self._age, prio)
        return b

    # -- interface ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._clean) + len(self._key)

    def allocate_slots(self, request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> list[int] | None:
        rid = request.request_id
        table = self._tables.get(rid)
        hits = self._pending_hits.get(rid, []) if table is None else []
        have = len(table) if table is not None else len(hits)
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = max(0, -(-total // self.block_size) - have)
        reclaimed = sum(1 for b in hits if self._ref[b] == 0)
        if need > self.num_free_blocks - reclaimed:
            return None
        if table is None:
            table = self._tables[rid] = []
            for b in hits:
                if self._ref[b] == 0:
                    self._reclaim(b)
                self._ref[b] += 1
                self._hits[b] += 1
                table.append(b)
            self._pending_hits.pop(rid, None)
            self._num_registered[rid] = len(hits)
        new = []
        for _ in range(need):
            b = self._take()
            self._ref[b] = 1
            new.append(b)
        table.extend(new)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, table, request.num_computed_tokens + num_new_tokens)
        return new

    def _drop(self, request, blocks: list[int]) -> None:
        hint = get_choice(request, "eviction_hint")
        for b in reversed(blocks):  # tail first
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise RuntimeError(f"block {b} freed twice (request {request.request_id})")
            if self._ref[b] == 0:
                self._release(b, hint)

    def free(self, request) -> None:
        rid = request.request_id
        self._pending_hits.pop(rid, None)
        self._req_hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        table = self._tables.pop(rid, None)
        if table:
            self._drop(request, table)

    def free_tail(self, request, num_tokens: int) -> None:
        """Keep the blocks holding the first ``num_tokens`` tokens; return the rest
        (rejected draft tokens' lookahead slots, never registered in the cache)."""
        table = self._tables.get(request.request_id)
        if not table:
            return
        keep = max(-(-num_tokens // self.block_size), self._num_registered.get(request.request_id, 0))
        if keep < len(table):
            tail = table[keep:]
            del table[keep:]
            self._drop(request, tail)

    def get_block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def stats(self) -> dict[str, float]:
        return {"kv_cache_usage": 1.0 - self.num_free_blocks / self.num_blocks,
                "prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0,
                "prefix_cache_evictions": self.evictions}


def make_lfu(num_blocks: int, block_size: int, settings: LFUSettings | None, cache_config) -> LFUAllocator:
    """Allocator hook factory: ``(num_blocks, block_size, settings, cache_config) -> KVAllocator``."""
    settings = settings or LFUSettings()
    return LFUAllocator(num_blocks, block_size, cache_config.enable_prefix_caching, settings.dynamic_aging)


@hookimpl
def kvforge_register_kv_allocators(register) -> None:
    register("lfu", make_lfu, LFUSettings, prefix_caching=True, rollback=True, eviction_hints=EVICTION_HINTS)
