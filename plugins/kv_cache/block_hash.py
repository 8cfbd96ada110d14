"""Chained block hashes for prefix caching.

A full block's identity is ``H(parent_hash, token_ids, extra_keys)``: equal
hashes mean equal whole prefixes, so a hit on block i implies hits on blocks
0..i-1 (vLLM's automatic prefix caching; SGLang's RadixAttention keys the same
information by a tree). BLAKE2b-128 keeps collisions out of reach and makes a
cache salt effective against cross-tenant probing.
"""
from __future__ import annotations

import hashlib
import struct

BlockHash = bytes
_NO_PARENT = b"\0" * 16
_PACKERS: dict = {}
_blake2b = hashlib.blake2b


def _packer(n: int):
    """``pack(*ids)`` of n token ids as int64 in native order (the bytes of ``array("q", ids)``);
    a precompiled struct is the cheapest way to turn a few ints into bytes."""
    pack = _PACKERS.get(n)
    if pack is None:
        pack = _PACKERS[n] = struct.Struct(f"{n}q").pack
    return pack


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block: parent digest (None for the first block), its
    ``block_size`` token ids, and extra keys (cache salt; adapter ids later)."""
    # one call over the concatenation: the same digest as updating piece by piece, cheaper
    return _blake2b((parent or _NO_PARENT) + _packer(len(token_ids))(*token_ids) + extra, digest_size=16).digest()


def extend_hashes(hashes: list[BlockHash], token_ids_of, num_tokens: int, block_size: int,
                  salt: bytes = b"") -> None:
    """Append hashes for every newly full block of a request, in place.

    Args:
        hashes: the request's hashes so far (one per full block, in order).
        token_ids_of: ``(lo, hi) -> list[int]`` returning the request's tokens [lo, hi).
        num_tokens: tokens known now; only blocks fully inside are hashed.
        salt: extra key mixed into the first block (and so into the whole chain).
    """
    parent = hashes[-1] if hashes else None
    for b in range(len(hashes), num_tokens // block_size):
        parent = hash_block(parent, token_ids_of(b * block_size, (b + 1) * block_size), salt if b == 0 else b"")
        hashes.append(parent)
