"""The shadow KV cache the allocator conformance suite drives allocators with
(:mod:`kvforge.testing.kv_allocator`): it calls an allocator the way the engine does and
records which token, with which whole prefix and cache salt, each slot holds."""
from __future__ import annotations

from typing import Any

from kvforge.testing.harness import check_block_accounting


class ShadowKV:
    """Drives an allocator the way the engine does and simulates the KV writes.

    ``slots[(block, offset)]`` holds the identity of the token written there: a hash
    of the cache salt and the token's whole prefix. A step allocates for every
    request of the batch, then writes all their new tokens, then reads every
    request's context (the attention contract: writes before reads).
    """

    def __init__(self, alloc, tag: str) -> None:
        self.alloc = alloc
        self.bs = alloc.block_size
        self.tag = tag
        self.slots: dict[tuple[int, int], int] = {}
        self.requests: dict[str, Any] = {}
        self._ident: dict[str, list[int]] = {}
        self.cached_tokens = 0
        self.ops = 0

    def fail(self, msg: str) -> None:
        raise AssertionError(f"{self.tag} op {self.ops}: {msg}")

    def ident(self, req, pos: int) -> int:
        ids = self._ident.setdefault(req.request_id, [])
        while len(ids) <= pos:
            i = len(ids)
            ids.append(hash((ids[-1] if ids else ("salt", req.cache_salt), req.token_id_at(i))))
        return ids[pos]

    def check(self) -> None:
        self.ops += 1
        check_block_accounting(self.alloc, self.requests.values(), self.fail)

    def admit(self, req) -> int:
        """Prefix-cache lookup for a request starting from zero computed tokens."""
        self.requests[req.request_id] = req
        self._ident.pop(req.request_id, None)
        cached = self.alloc.get_computed_tokens(req)
        if not isinstance(cached, int) or not 0 <= cached <= req.num_tokens - 1:
            self.fail(f"get_computed_tokens({req.request_id}) returned {cached!r}; must be an int in "
                      f"[0, num_tokens - 1 = {req.num_tokens - 1}] (at least one token left to compute)")
        req.num_computed_tokens = cached
        req.num_cached_tokens = cached
        self.cached_tokens += cached
        return cached

    def allocate(self, req, n: int, lookahead: int = 0) -> bool:
        a = self.alloc
        before = list(a.get_block_table(req.request_id))
        free_before = a.num_free_blocks
        new = a.allocate_slots(req, n, lookahead)
        after = list(a.get_block_table(req.request_id))
        if new is None:
            if after != before or a.num_free_blocks != free_before:
                self.fail(f"allocate_slots({req.request_id}, {n}) returned None but changed state: table "
                          f"{before} -> {after}, free {free_before} -> {a.num_free_blocks}")
            return False
        if after[:len(before)] != before:
            self.fail(f"allocate_slots rewrote {req.request_id}'s existing blocks: {before} -> {after}")
        if new and list(new) != after[len(after) - len(new):] or (before and len(new) != len(after) - len(before)):
            self.fail(f"allocate_slots returned {new} but the table grew {before} -> {after}")
        need = req.num_computed_tokens + n + lookahead
        if len(after) * self.bs < need:
            self.fail(f"{req.request_id}: table {after} holds {len(after) * self.bs} tokens, needs {need}")
        self.check()
        return True

    def run_step(self, batch: list[tuple[Any, int]]) -> None:
        """Write then read: ``batch`` lists (request, n) already allocated this step."""
        for req, n in batch:
            table = self.alloc.get_block_table(req.request_id)
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                self.slots[(table[p // self.bs], p % self.bs)] = self.ident(req, p)
        for req, n in batch:
            table = self.alloc.get_block_table(req.request_id)
            for p in range(req.num_computed_tokens + n):
                if self.slots.get((table[p // self.bs], p % self.bs)) != self.ident(req, p):
                    where = ("a prefix-cache hit" if p < req.num_cached_tokens else "its own earlier write")
                    self.fail(f"hash-chain / reference-count integrity: request {req.request_id} reads position {p} "
                              f"(block {table[p // self.bs]}, from {where}) and finds the KV of a different prefix "
                              f"or salt; the block was shared by an unequal prefix or reused while referenced")
        for req, n in batch:
            req.num_computed_tokens += n

    def finish(self, req, status=None) -> None:
        from kvforge.engine.request import RequestStatus
        self.alloc.free(req)
        req.status = status or RequestStatus.FINISHED_STOPPED
        free = self.alloc.num_free_blocks
        self.alloc.free(req)  # a second free must be a no-op
        if self.alloc.num_free_blocks != free:
            self.fail(f"freeing {req.request_id} twice changed num_free_blocks {free} -> "
                      f"{self.alloc.num_free_blocks} (double free)")
        self.check()

    def preempt(self, req) -> None:
        from kvforge.engine.request import RequestStatus
        self.alloc.free(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.check()


# -- checks ----------------------------------------------------------------------------------
