"""Conformance suite for KV cache allocators (``kvforge_register_kv_allocators``).

Checks, through the :class:`~kvforge.interfaces.KVAllocator` interface only:

- lifecycle: block tables grow append-only to cover ``num_computed_tokens +
  num_new_tokens + num_lookahead_tokens``; returned ids are the table's new tail;
  ``free`` returns everything; freeing twice or freeing an unknown request is a
  no-op (no double free);
- a failed ``allocate_slots`` (None) changes nothing;
- reference counts: ``num_free_blocks == num_blocks - |union of live tables|`` after
  every operation, a block is never handed to a second request while held (unless
  shared as a cached prefix), and ``ref_count(b)`` (if the allocator has it) equals
  the number of tables holding ``b``;
- hash-chain integrity under prefix caching (when the allocator declares
  ``prefix_caching=True``): a shadow KV cache records, for every slot, which token
  *with which whole prefix and cache salt* was written there; every read of a
  request's context must find its own prefix, so a hit on a block of another
  prefix, a block reused while still referenced, or a cached block overwritten
  after eviction all fail; repeated prompts must actually hit;
- async scheduling: a block completed by a placeholder output token joins the prefix
  cache only once the token's id is known (hash ``num_known_tokens`` only);
- every block drains after aborts and preemptions in a real ``LLMEngine`` (recompute
  and swap), and the surviving requests' greedy outputs equal the reference's;
- the optional vectorized-decode capability (``table_array`` + ``allocate_decodes``),
  where present, equals ``allocate_slots`` one request at a time.
"""
from __future__ import annotations

from typing import Any

from kvforge.testing.harness import (StepMonitor, Target, assert_drained, compare_outputs, random_prompts,
                                     reference_outputs)
from kvforge.testing.shadow_kv import ShadowKV


def make_allocator(target: Target, num_blocks: int, block_size: int, prefix_caching: bool):
    """Build the allocator with the hook's factory signature
    ``factory(num_blocks, block_size, settings, cache_config)``."""
    from kvforge.config import CacheConfig
    from kvforge.engine.builder import validate_plugin_settings
    from kvforge.plugin_manager import build_plugin
    spec = target.spec
    settings = validate_plugin_settings(spec, dict(target.settings), "cache.settings")
    cc = CacheConfig(allocator=target.name, block_size=block_size, num_gpu_blocks=num_blocks,
                     enable_prefix_caching=prefix_caching)
    alloc = build_plugin(spec, num_blocks, block_size, settings, cc)
    assert alloc.num_blocks == num_blocks and alloc.block_size == block_size, (
        f"{target}: factory built an allocator with num_blocks={alloc.num_blocks}, "
        f"block_size={alloc.block_size}; asked for {num_blocks}, {block_size}")
    assert alloc.num_free_blocks == num_blocks, f"{target}: a new allocator has {alloc.num_free_blocks} free blocks"
    return alloc


def _request(rid: str, tokens: list[int], salt: str | None = None, max_tokens: int = 64):
    from kvforge import SamplingParams
    from kvforge.engine.request import Request
    r = Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), max_tokens)
    r.cache_salt = salt
    return r


def check_lifecycle(target: Target) -> None:
    """Grow, lookahead, free, double free, unknown ids."""
    bs = 4
    a = make_allocator(target, 16, bs, prefix_caching=False)
    sh = ShadowKV(a, f"{target} lifecycle")
    if a.get_block_table("nobody") != []:
        sh.fail(f"get_block_table of an unknown request is {a.get_block_table('nobody')}, expected []")
    r = _request("r", list(range(1, 11)))
    sh.admit(r)
    if r.num_computed_tokens != 0:
        sh.fail("get_computed_tokens returned a hit with prefix caching disabled")
    if not sh.allocate(r, 10):
        sh.fail("allocate_slots failed on an empty cache")
    if len(a.get_block_table("r")) != 3:
        sh.fail(f"10 tokens in blocks of {bs} took {len(a.get_block_table('r'))} blocks, expected 3")
    sh.run_step([(r, 10)])
    r.output_token_ids.append(7)
    r.output_token_ids.append(8)
    if not sh.allocate(r, 1):
        sh.fail("growing within the last block failed")
    sh.run_step([(r, 1)])
    if not sh.allocate(r, 1, lookahead=4):
        sh.fail("allocation with lookahead failed")
    if len(a.get_block_table("r")) * bs < 12 + 4:
        sh.fail("lookahead slots were not allocated")
    sh.run_step([(r, 1)])
    other = _request("o", [5] * 6)
    sh.admit(other)
    if not sh.allocate(other, 6):
        sh.fail("a second request could not allocate")
    sh.run_step([(other, 6)])
    if set(a.get_block_table("r")) & set(a.get_block_table("o")):
        sh.fail("two requests without shared prefixes got the same block")
    sh.finish(r)
    if a.get_block_table("r"):
        sh.fail("a freed request still has a block table")
    a.free(_request("ghost", [1, 2, 3]))  # unknown request: no-op
    sh.check()
    sh.finish(other)
    if a.num_free_blocks != a.num_blocks:
        sh.fail(f"{a.num_blocks - a.num_free_blocks} blocks leaked after freeing every request")


def check_failed_allocation_is_atomic(target: Target) -> None:
    """``allocate_slots`` returning None changes nothing, also when a prefix hit is pending."""
    bs = 4
    prefix = target.capabilities.get("prefix_caching", False) is True
    a = make_allocator(target, 6, bs, prefix_caching=prefix)
    sh = ShadowKV(a, f"{target} atomic")
    warm = _request("warm", [1, 9, 9, 9, 8, 8, 8, 8, 3])
    sh.admit(warm)
    if not sh.allocate(warm, warm.num_tokens):
        sh.fail("allocation failed in a nearly empty cache")
    sh.run_step([(warm, warm.num_tokens)])
    big = _request("big", [1, 9, 9, 9, 8, 8, 8, 8] + [4] * 30)  # shares 2 blocks, needs 10 in all
    sh.admit(big)
    if sh.allocate(big, big.num_tokens - big.num_computed_tokens):
        sh.fail(f"allocated {big.num_tokens} tokens ({-(-big.num_tokens // bs)} blocks) in a cache of 6 blocks")
    big.num_computed_tokens = 0
    sh.finish(warm)
    sh.finish(big)
    if a.num_free_blocks != a.num_blocks:
        sh.fail(f"{a.num_blocks - a.num_free_blocks} blocks leaked after a failed allocation")


def _stress(target: Target, prefix: bool, rounds: int = 400) -> ShadowKV:
    """Random admissions, chunked prefills, decodes, preemptions, aborts and finishes
    over a small cache (evictions) and a tiny alphabet (equal blocks under unequal
    prefixes), with two cache salts."""
    rng, tag = target.rng("stress prefix_caching=%s" % prefix)
    bs = 4
    a = make_allocator(target, 24, bs, prefix_caching=prefix)
    sh = ShadowKV(a, f"{target} {tag}")
    heads = [[1] + [rng.choice((3, 4)) for _ in range(rng.choice((3, 7, 11)))] for _ in range(4)]
    waiting: list = []
    running: list = []
    counter = 0
    for _ in range(rounds):
        while len(waiting) < 3:
            toks = rng.choice(heads) + [rng.choice((3, 4, 5)) for _ in range(rng.randrange(0, 9))]
            waiting.append(_request(f"s{counter}", toks, rng.choice((None, None, "tenant-b"))))
            counter += 1
        batch: list = []
        for r in list(running):  # decodes and prefill chunks
            if r not in running:  # preempted as a victim earlier in this loop
                continue
            n = min(r.num_tokens - r.num_computed_tokens, rng.choice((1, 3, 8)))
            ok = True
            while not sh.allocate(r, n):
                victim = running.pop()  # newest first, like the built-in schedulers
                sh.preempt(victim)
                waiting.insert(0, victim)
                batch = [(x, m) for x, m in batch if x is not victim]
                if victim is r:
                    ok = False
                    break
            if ok:
                batch.append((r, n))
        while waiting and len(running) < 6:
            r = waiting[0]
            sh.admit(r)
            n = min(r.num_tokens - r.num_computed_tokens, rng.choice((2, 5, 40)))
            if not sh.allocate(r, n, rng.choice((0, 0, 2))):
                r.num_computed_tokens = r.num_cached_tokens = 0
                break
            waiting.pop(0)
            running.append(r)
            batch.append((r, n))
        sh.run_step(batch)
        for r in list(running):
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(rng.choice((3, 4)))
            if r.num_output_tokens >= rng.choice((3, 6, 12)) or rng.random() < 0.03:
                running.remove(r)
                sh.finish(r)
    for r in running + waiting:
        sh.finish(r)
    if a.num_free_blocks != a.num_blocks:
        sh.fail(f"{a.num_blocks - a.num_free_blocks} blocks leaked after every request finished")
    return sh


def check_refcounts_and_no_double_allocation(target: Target) -> None:
    """Random stress without prefix caching: no block is ever shared or lost."""
    sh = _stress(target, prefix=False)
    if sh.cached_tokens:
        sh.fail("get_computed_tokens returned hits with enable_prefix_caching=False")


def check_prefix_cache_integrity(target: Target) -> None:
    """Random stress with prefix caching (allocators declaring ``prefix_caching=True``):
    every hit returns blocks holding exactly the request's prefix; salts isolate."""
    import pytest
    if target.capabilities.get("prefix_caching") is not True:
        pytest.skip(f"{target} does not declare prefix_caching=True")
    sh = _stress(target, prefix=True)
    if sh.cached_tokens == 0:
        sh.fail("declares prefix_caching=True but no request ever got a prefix-cache hit under a workload "
                "of repeated prefixes")
    bs = 4
    a = make_allocator(target, 16, bs, prefix_caching=True)
    sh = ShadowKV(a, f"{target} prefix basics")
    toks = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    first = _request("first", toks)
    sh.admit(first)
    if not sh.allocate(first, first.num_tokens):
        sh.fail("allocation failed in a nearly empty cache")
    sh.run_step([(first, first.num_tokens)])
    same = _request("same", toks)
    if sh.admit(same) == 0:
        sh.fail(f"a repeated {len(toks)}-token prompt got no prefix-cache hit while its blocks are held")
    if not sh.allocate(same, same.num_tokens - same.num_computed_tokens):
        sh.fail("allocation failed in a nearly empty cache")
    sh.run_step([(same, same.num_tokens - same.num_computed_tokens)])
    salted = _request("salted", toks, salt="other-tenant")
    if sh.admit(salted) != 0:
        sh.fail("a request with a different cache_salt hit another tenant's cached blocks")
    salted.num_computed_tokens = 0
    sh.finish(salted)
    sh.finish(first)
    sh.finish(same)
    again = _request("again", toks)
    if sh.admit(again) == 0:
        sh.fail("freed blocks no longer hit: a free block must keep its cached prefix until evicted")
    if not sh.allocate(again, again.num_tokens - again.num_computed_tokens):
        sh.fail("allocation failed in a nearly empty cache")
    sh.run_step([(again, again.num_tokens - again.num_computed_tokens)])
    sh.finish(again)
    if a.num_free_blocks != a.num_blocks:
        sh.fail(f"{a.num_blocks - a.num_free_blocks} blocks leaked")


def check_placeholder_tokens_are_not_hashed(target: Target) -> None:
    """Async scheduling: a block completed by a placeholder output token (its id still on
    the device) may join the prefix cache only once the id is known; hashing the
    placeholder would cache the block under a wrong key for good."""
    import pytest

    from kvforge.engine.request import PLACEHOLDER_TOKEN_ID
    if target.capabilities.get("prefix_caching") is not True:
        pytest.skip(f"{target} does not declare prefix_caching=True")
    bs = 4
    a = make_allocator(target, 16, bs, prefix_caching=True)
    tag = f"{target} placeholder"
    r = _request("r", [1, 5, 6])
    a.get_computed_tokens(r)
    if a.allocate_slots(r, 3) is None:
        raise AssertionError(f"{tag}: allocation failed in an empty cache")
    r.num_computed_tokens = 3
    for real in (9, 4):  # two decodes, each fed a token that was a placeholder when scheduled
        r.output_token_ids.append(PLACEHOLDER_TOKEN_ID)
        r.num_pending_tokens = 1
        if a.allocate_slots(r, 1) is None:
            raise AssertionError(f"{tag}: allocation failed in an empty cache")
        r.output_token_ids[-1] = real
        r.num_pending_tokens = 0
        r.num_computed_tokens += 1
    probe = _request("probe", [1, 5, 6, 9, 8, 8])
    hit = a.get_computed_tokens(probe)
    if hit != bs:
        raise AssertionError(f"{tag}: a prompt sharing the first block [1, 5, 6, 9] (whose last token was a "
                             f"placeholder when allocated) got {hit} cached tokens, expected {bs}: hash only "
                             "request.num_known_tokens")
    a.free(r)
    if a.num_free_blocks != a.num_blocks:
        raise AssertionError(f"{tag}: {a.num_blocks - a.num_free_blocks} blocks leaked")


def _engine_drain(target: Target, swap: bool) -> None:
    from kvforge import SamplingParams
    rng, tag = target.rng("engine drain (swap)" if swap else "engine drain")
    prefix = target.capabilities.get("prefix_caching") is True
    prompts = random_prompts(rng, 10, 6, 40, shared_prefix=20)
    max_tokens = 24
    ref = reference_outputs(target, prompts, max_tokens)
    extra: dict[str, Any] = {}
    if swap:
        extra = {"swap_space_bytes": 1 << 20, "scheduler.settings.preemption_mode": "swap"}
    eng = target.engine(kv_allocator=target.name, scheduler="chunked_prefill", enable_prefix_caching=prefix,
                        num_gpu_blocks=9, max_num_batched_tokens=48, max_num_seqs=6,
                        **{"cache.settings": dict(target.settings)}, **extra)
    mon = StepMonitor(eng, f"{target} {tag}")
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [f"q{i}" for i in range(len(prompts))]
    arrivals = {0: [(ids[i], {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts[:6])],
                3: [(ids[i], {"prompt_token_ids": prompts[i]}, sp) for i in range(6, len(prompts))]}
    aborted = set(rng.sample(ids, 3))
    aborts: dict[int, list[str]] = {}
    for rid in aborted:
        aborts.setdefault(rng.choice((0, 1, 4, 9, 20)), []).append(rid)
    done = mon.drain(arrivals, aborts)
    assert_drained(eng, f"{target} {tag}")
    if mon.num_preempted == 0:
        raise AssertionError(f"{target} {tag}: the workload was meant to force preemptions but none happened")
    keep = [i for i, rid in enumerate(ids) if rid not in aborted]
    compare_outputs(done, [ids[i] for i in keep], [ref[i] for i in keep], f"{target} {tag}",
                    "greedy output after preemptions and aborts")


def check_engine_drain_recompute(target: Target) -> None:
    """Real engine, 9 blocks for 10 requests, 3 aborts: every block comes back (recompute preemption)."""
    _engine_drain(target, swap=False)


def check_engine_drain_swap(target: Target) -> None:
    """The same with swap preemption (block ids go out and come back through the CPU pool)."""
    _engine_drain(target, swap=True)


from kvforge.testing.kv_allocator_decode_batch import check_decode_batch_capability  # noqa: E402 (uses the above)

CHECKS = [check_lifecycle, check_failed_allocation_is_atomic, check_refcounts_and_no_double_allocation,
          check_prefix_cache_integrity, check_placeholder_tokens_are_not_hashed, check_engine_drain_recompute,
          check_engine_drain_swap, check_decode_batch_capability]
