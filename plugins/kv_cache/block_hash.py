"""Chained block hashes for prefix caching.

A full block's identity is ``H(parent_hash, token_ids, extra_keys)``: equal
hashes mean equal whole prefixes, so a hit on block i implies hits on blocks
0..i-1 (vLLM's automatic prefix caching; SGLang's RadixAttention keys the same
information by a tree). BLAKE2b-128 keeps collisions out of reach and makes a
cache salt effective against cross-tenant probing.
"""
from __future__ import annotations

import hashlib
from array import array

BlockHash = bytes
_NO_PARENT = b"\0" * 16


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    """Hash of one full block: parent digest (None for the first block), its
    ``block_size`` token ids, and extra keys (cache salt; adapter ids later)."""
    # one call over the concatenation: the same digest as updating piece by piece, cheaper
    return hashlib.blake2b(b"".join((parent or _NO_PARENT, array("q", token_ids).tobytes(), extra)),
                           digest_size=16).digest()


def extend_hashes(hashes: list[BlockHash], token_ids_of, num_tokens: int, block_size: int,
                  salt: bytes = b"") -> None:
    """Append hashes for every newly full block of a request, in place.

    Args:
        hashes: the request's hashes so far (one per full block, in order).
        token_ids_of: ``(lo, hi) -> list[int]`` returning the request's tokens [lo, hi).
        num_tokens: tokens known now; only blocks fully inside are hashed.
        salt: extra key mixed into the first block (and so into the whole chain).
    """
    first = len(hashes)
    parent = hashes[-1] if first else _NO_PARENT
    for b in range(first, num_tokens // block_size):
        # hash_block inlined (this runs for every block that fills, every step)
        toks = array("q", token_ids_of(b * block_size, (b + 1) * block_size)).tobytes()
        parent = hashlib.blake2b(b"".join((parent, toks, salt if b == 0 else b"")), digest_size=16).digest()
        hashes.append(parent)
