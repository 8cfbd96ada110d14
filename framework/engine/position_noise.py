"""Sampling noise keyed by output position, for seeded requests.

A seeded request draws the Exp(1) noise of its output token ``j`` from its generator
re-seeded with :func:`position_seed` ``(seed, child index, j)``, so the token at each
position depends only on the seed and the target distribution there — not on batch mates,
on how many tokens earlier steps produced, or on speculation. Speculative verification of
a seeded request then compares each draft with the token plain sampling would produce at
that position with the same noise (a Gumbel-max coupling of draft and target, as in
SpecTr, Sun et al. 2023): the emitted tokens are exactly plain sampling's, and a draft
model that samples with the same noise is accepted whenever its argmax of ``q / E``
equals the target's.
"""
from __future__ import annotations

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele, Lea, Flood 2014): a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_seed(request, position: int) -> int:
    """63-bit generator seed for output token ``position`` (0-based) of a seeded request.

    Raises:
        ValueError: the request has no seed.
    """
    seed = request.sampling_params.seed
    if seed is None:
        raise ValueError("position_seed: the request has no sampling_params.seed")
    h = _splitmix64(seed & _MASK)
    h = _splitmix64(h ^ (request.index & _MASK))
    return _splitmix64(h ^ position) >> 1
