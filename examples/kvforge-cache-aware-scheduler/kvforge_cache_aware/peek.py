"""A side-effect-free prefix-cache probe: how many of a request's tokens are cached now?

``KVAllocator.get_computed_tokens`` is the allocator's admission call: it may
remember the hit for the next ``allocate_slots`` and count a query in its
statistics, so a scheduler must not call it just to *rank* waiting requests.
:func:`peek_computed_tokens` answers the same question without touching the
allocator:

1. an allocator that offers ``peek_computed_tokens(request)`` answers itself
   (duck typing; the ``kvforge-lfu-allocator`` example does);
2. the built-in ``paged`` allocator (and subclasses) keeps ``{block hash -> block id}``
   in ``_cached``: the request's chained block hashes (the same
   :func:`kvforge_plugins.kv_cache.block_hash.hash_block` it uses) are looked up
   there, read-only;
3. any other allocator: 0 (no preference; the scheduler degrades to FCFS).
"""
from __future__ import annotations

from kvforge_plugins.kv_cache.block_hash import BlockHash, hash_block


def prefix_hashes(request, block_size: int) -> list[BlockHash]:
    """Chained hashes of the request's full blocks that could ever be hits (the last
    token is always computed, so at most ``(num_tokens - 1) // block_size`` blocks)."""
    salt = (getattr(request, "cache_salt", None) or "").encode()
    out: list[BlockHash] = []
    for b in range((request.num_tokens - 1) // block_size):
        out.append(hash_block(out[-1] if out else None, request.token_slice(b * block_size, (b + 1) * block_size),
                              salt if b == 0 else b""))
    return out


def peek_computed_tokens(allocator, request, hashes: list[BlockHash] | None = None) -> int:
    """Tokens of ``request``'s prefix the allocator could serve from its cache now.

    Never changes the allocator. ``hashes``: the request's :func:`prefix_hashes`
    if the caller caches them.
    """
    peek = getattr(allocator, "peek_computed_tokens", None)
    if callable(peek):
        return int(peek(request))
    cached = getattr(allocator, "_cached", None)
    if not getattr(allocator, "enable_prefix_caching", False) or not isinstance(cached, dict):
        return 0
    if request.sampling_params.prompt_logprobs is not None:
        return 0  # the allocator never serves these from the cache
    if hashes is None:
        hashes = prefix_hashes(request, allocator.block_size)
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n * allocator.block_size
