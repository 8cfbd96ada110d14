"""`paged` KV allocator: fixed-size blocks, a free list, reference counts,
per-request block tables (PagedAttention, Kwon et al., SOSP'23) and optional
automatic prefix caching with LRU eviction of free cached blocks.

Free blocks wait in one LRU queue; a free block that still holds a cached
prefix keeps its hash until it is handed out again (an eviction). A finished
request returns its blocks tail first, so the ends of chains are evicted
before the shared heads.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
from pydantic import BaseModel, ConfigDict

from kvforge import hookimpl
from kvforge.engine.block_table_array import BlockTableArray
from kvforge.interfaces import KVAllocator
from kvforge_plugins.kv_cache.block_hash import BlockHash, extend_hashes, hash_block

KVFORGE_HOOK_API = "1"


class PagedSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PagedAllocator(KVAllocator):
    """Block-id allocator with optional prefix caching.

    Args:
        num_blocks: physical blocks in the cache.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests by chained hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._ref = [0] * num_blocks
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        self._pending_hits: dict[str, list[int]] = {}
        # The same tables as rows of an array (marks = _num_registered), kept in step with
        # _tables on every change, for the vectorized decode paths of the runner/scheduler.
        self.table_array = BlockTableArray()
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    # -- prefix cache -----------------------------------------------------------------
    def _hashes(self, request) -> list[BlockHash]:
        hs = self._req_hashes.setdefault(request.request_id, [])
        # (the salt only enters the first block's hash)
        salt = b"" if hs else (getattr(request, "cache_salt", None) or "").encode()
        # placeholders (async scheduling) are not hashed until their ids are known
        extend_hashes(hs, request.token_slice, request.num_known_tokens, self.block_size, salt)
        return hs

    def get_computed_tokens(self, request) -> int:
        self._pending_hits.pop(request.request_id, None)
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return 0
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # cached positions would have no logits to report
        hashes = self._hashes(request)
        # Leave at least one token to compute so the step yields logits.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            b = self._cached.get(h)
            if b is None:
                break
            hit.append(b)
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
        hashes = self._hashes(request)
        full = min(full, len(hashes))  # a block holding a placeholder waits for its id
        for i in range(start, full):
            b, h = table[i], hashes[i]
            if self._block_hash[b] is None and h not in self._cached:
                self._block_hash[b] = h
                self._cached[h] = b
        self._num_registered[request.request_id] = full
        self.table_array.marks[self.table_array.row_of[request.request_id]] = full

    # -- interface --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate_slots(self, request, num_new_tokens: int, num_lookahead_tokens: int = 0) -> list[int] | None:
        rid = request.request_id
        table = self._tables.get(rid)
        computed = request.num_computed_tokens + num_new_tokens
        if table is not None and computed + num_lookahead_tokens <= len(table) * self.block_size:
            # Fast path (most decode steps): no new block; register a block only when one fills.
            if self.enable_prefix_caching and computed // self.block_size > self._num_registered.get(rid, 0):
                self._register_full_blocks(request, table, computed)
            return []
        hits = self._pending_hits.get(rid, []) if table is None else []
        have = len(table) if table is not None else len(hits)
        total = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        need = max(0, -(-total // self.block_size) - have)
        reclaimed = sum(1 for b in hits if self._ref[b] == 0)
        if need > len(self._free) - reclaimed:
            return None
        created = table is None
        if created:
            table = self._tables[rid] = []
            for b in hits:
                if self._ref[b] == 0:
                    del self._free[b]
                self._ref[b] += 1
                table.append(b)
            self._pending_hits.pop(rid, None)
            self._num_registered[rid] = len(hits)
        new = self._take_free_blocks(need)
        table.extend(new)
        if created:
            row = self.table_array.set_table(rid, table)  # (may grow the arrays: index after)
            self.table_array.marks[row] = self._num_registered[rid]
        elif new:
            self.table_array.append(rid, new)
        if self.enable_prefix_caching:
            self._register_full_blocks(request, table, request.num_computed_tokens + num_new_tokens)
        return new

    def _take_free_blocks(self, need: int) -> list[int]:
        """Hand out ``need`` free blocks (the caller checked there are enough), LRU first."""
        new = []
        for _ in range(need):
            b, _ = self._free.popitem(last=False)
            h = self._block_hash[b]
            if h is not None:  # evict the cached prefix this free block still held
                del self._cached[h]
                self._block_hash[b] = None
                self.evictions += 1
            self._ref[b] = 1
            new.append(b)
        return new

    def allocate_decodes(self, requests: list, rows: np.ndarray, num_tokens: np.ndarray) -> bool:
        """``allocate_slots(r, num_tokens[i] - r.num_computed_tokens)`` (no lookahead) for a
        batch of requests that each have a table covering their computed tokens, with one
        vectorized check instead of a call per request: only the requests that enter a new
        block or fill one (about 2 in ``block_size`` per decode step) do any work.

        Args:
            requests: the batch; rows: int64 [B] their :attr:`table_array` rows;
            num_tokens: int64 [B] ``num_computed_tokens + num_new_tokens`` of each.
        Returns:
            False, with nothing changed, when their new blocks exceed the free blocks
            (the caller then allocates one request at a time and preempts).
        """
        arr = self.table_array
        bs = self.block_size
        need = np.maximum(-(-num_tokens // bs) - arr.lens[rows], 0)  # new blocks
        fill = num_tokens // bs > arr.marks[rows] if self.enable_prefix_caching else None  # blocks to register
        busy = np.flatnonzero(need > 0 if fill is None else (need > 0) | fill)
        if not busy.size:
            return True
        need = need[busy]
        total = int(need.sum())
        if total > len(self._free):
            return False
        tables = self._tables
        if total:
            # All new blocks first, then the registrations: one request at a time would
            # interleave them, which differs only when a block evicted here held the hash
            # a request registers here (then this order keeps that prefix cached).
            new = self._take_free_blocks(total)
            enter = busy[need > 0]
            if total == len(enter):  # the common case: one block each
                for i, b in zip(enter.tolist(), new):
                    tables[requests[i].request_id].append(b)
                arr.append_one(rows[enter], new)
            else:
                at = 0
                for i, n in zip(enter.tolist(), need[need > 0].tolist()):
                    rid = requests[i].request_id
                    tables[rid].extend(new[at:at + n])
                    arr.append(rid, new[at:at + n])
                    at += n
        if fill is not None and fill.any():
            self._register_filled(requests, np.flatnonzero(fill), num_tokens[fill], rows)
        return True

    def _register_filled(self, requests: list, idx: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray) -> None:
        """``_register_full_blocks`` for ``requests[i]`` (i in ``idx``, int64 [K]) holding
        ``num_tokens`` (int64 [K]) tokens, inlined for the usual decode case: exactly one
        block filled, not the first (its hash takes the salt), the earlier blocks' hashes
        known and no placeholder. Anything else goes through the general method."""
        bs = self.block_size
        marks = self.table_array.marks
        start = marks[rows[idx]]  # = _num_registered
        one = ((num_tokens // bs == start + 1) & (start > 0)).tolist()
        tables = self._tables
        hashes_of = self._req_hashes
        registered = self._num_registered
        block_hash = self._block_hash
        cached = self._cached
        done = []  # positions in idx registered inline (their marks are set at the end)
        for k, (i, first, computed, inline) in enumerate(zip(idx.tolist(), start.tolist(), num_tokens.tolist(), one)):
            req = requests[i]
            rid = req.request_id
            hs = hashes_of.get(rid)
            if not inline or hs is None or len(hs) != first or req.num_pending_tokens:
                self._register_full_blocks(req, tables[rid], computed)
                continue
            lo = first * bs - len(req.prompt_token_ids)
            toks = req.output_token_ids[lo:lo + bs] if lo >= 0 else req.token_slice(first * bs, first * bs + bs)
            h = hash_block(hs[-1], toks)
            hs.append(h)
            b = tables[rid][first]
            if block_hash[b] is None and h not in cached:
                block_hash[b] = h
                cached[h] = b
            registered[rid] = first + 1
            done.append(k)
        if done:
            marks[rows[idx[done]]] = start[done] + 1

    def free(self, request) -> None:
        rid = request.request_id
        table = self._tables.get(rid)
        if self.enable_prefix_caching and table:
            # A block completed by a token that was still on the device when it was
            # scheduled (async scheduling) was not registered then; its id is known now.
            self._register_full_blocks(request, table, request.num_computed_tokens)
        self._pending_hits.pop(rid, None)
        self._req_hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        self.table_array.release(rid)
        table = self._tables.pop(rid, None)
        if not table:
            return
        for b in reversed(table):  # tail first: evicted before the shared head
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise RuntimeError(f"block {b} freed twice (request {rid})")
            if self._ref[b] == 0:
                self._free[b] = None

    def free_tail(self, request, num_tokens: int) -> None:
        """Keep the blocks holding the first ``num_tokens`` tokens; return the rest (the
        lookahead slots of rejected draft tokens), newest first. Lookahead blocks are never
        registered in the prefix cache (registration stops at ``num_computed + num_new``),
        so no hash of a rejected token survives."""
        table = self._tables.get(request.request_id)
        if not table:
            return
        keep = -(-max(0, num_tokens) // self.block_size)
        while len(table) > keep:
            b = table.pop()
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None
                if self._block_hash[b] is None:  # holds nothing reusable: hand it out first
                    self._free.move_to_end(b, last=False)
        rid = request.request_id
        if self._num_registered.get(rid, 0) > len(table):
            self._num_registered[rid] = len(table)
        row = self.table_array.set_table(rid, table)
        self.table_array.marks[row] = self._num_registered.get(rid, 0)

    def get_block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def reset_prefix_cache(self) -> None:
        """Drop every cached hash of free blocks (e.g. after weights change)."""
        for b in list(self._free):
            h = self._block_hash[b]
            if h is not None:
                del self._cached[h]
                self._block_hash[b] = None

    def stats(self) -> dict[str, float]:
        return {"kv_cache_usage": 1.0 - len(self._free) / self.num_blocks,
                "prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0,
                "prefix_cache_evictions": self.evictions}


def make_paged(num_blocks: int, block_size: int, settings, cache_config) -> PagedAllocator:
    return PagedAllocator(num_blocks, block_size, cache_config.enable_prefix_caching)


@hookimpl
def kvforge_register_kv_allocators(register) -> None:
    register("paged", make_paged, PagedSettings, prefix_caching=True, rollback=True)
