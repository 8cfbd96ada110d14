"""Unit tests of the paged allocator: reference counts, hash chains, LRU eviction."""
from __future__ import annotations

import random

import pytest

from kvforge import SamplingParams
from kvforge.engine.request import Request
from kvforge_plugins.kv_cache.block_hash import hash_block
from kvforge_plugins.kv_cache.paged import PagedAllocator

BS = 4


def req(rid, tokens, salt=None):
    r = Request(rid, list(tokens), SamplingParams(max_tokens=4), 4)
    r.cache_salt = salt
    return r


def admit(a: PagedAllocator, r: Request) -> list[int]:
    r.num_computed_tokens = a.get_computed_tokens(r)
    assert a.allocate_slots(r, r.num_tokens - r.num_computed_tokens) is not None
    return a.get_block_table(r.request_id)


def test_refcounts_share_and_free():
    a = PagedAllocator(8, BS, enable_prefix_caching=True)
    toks = [random.randrange(100) for _ in range(10)]
    t1 = admit(a, req("a", toks))
    r2 = req("b", toks)
    t2 = admit(a, r2)
    assert r2.num_computed_tokens == 8 and t1[:2] == t2[:2] and t1[2] != t2[2]
    assert [a.ref_count(b) for b in t1[:2]] == [2, 2]
    a.free(req("a", toks))
    assert [a.ref_count(b) for b in t2] == [1, 1, 1]
    a.free(r2)
    assert a.num_free_blocks == 8
    with pytest.raises(KeyError):
        a._free.move_to_end(99)


def test_hash_chain_depends_on_parent_and_salt():
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    h1 = hash_block(None, x)
    assert hash_block(h1, y) != hash_block(hash_block(None, [9, 9, 9, 9]), y)
    assert hash_block(None, x, b"salt") != h1
    a = PagedAllocator(8, BS, enable_prefix_caching=True)
    admit(a, req("a", x + y + [1], salt="t1"))
    assert a.get_computed_tokens(req("b", x + y + [1], salt="t2")) == 0
    assert a.get_computed_tokens(req("c", x + y + [1], salt="t1")) == 8
    # same second block after a different first block: no hit (chained)
    assert a.get_computed_tokens(req("d", [0, 0, 0, 0] + y + [1], salt="t1")) == 0


def test_full_hit_leaves_one_token():
    a = PagedAllocator(8, BS, enable_prefix_caching=True)
    toks = list(range(8))
    admit(a, req("a", toks))
    assert a.get_computed_tokens(req("b", toks)) == 4  # not 8: the last token must run


def test_lru_eviction_tail_first_and_counters():
    a = PagedAllocator(4, BS, enable_prefix_caching=True)
    toks = list(range(13))  # blocks: 3 full + 1 partial
    r = req("a", toks)
    table = admit(a, r)
    a.free(r)
    assert a.num_cached_blocks == 3 and a.num_free_blocks == 4
    # need 1 block: the partial (uncached) tail goes first, then cached tails, head last
    other = req("b", [99] * 3)
    admit(a, other)
    assert a.get_block_table("b") == [table[3]] and a.evictions == 0
    other2 = req("c", [98] * 3)
    admit(a, other2)
    assert a.get_block_table("c") == [table[2]] and a.evictions == 1
    assert a.get_computed_tokens(req("d", toks)) == 8  # the head of the chain survived
    st = a.stats()
    assert st["prefix_cache_evictions"] == 1 and 0 < st["prefix_cache_hit_rate"] < 1


def test_failed_allocation_changes_nothing():
    a = PagedAllocator(3, BS, enable_prefix_caching=True)
    r = req("a", list(range(20)))
    before = (a.num_free_blocks, dict(a._cached))
    assert a.allocate_slots(r, 20) is None
    assert (a.num_free_blocks, dict(a._cached)) == before and a.get_block_table("a") == []
