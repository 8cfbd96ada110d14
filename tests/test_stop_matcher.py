"""StopMatcher against the plain scan it replaces (earliest match, shortest at one position;
longest tail suffix that is a proper prefix of a stop string), on fresh random strings over a
small alphabet (so matches, overlaps and shared prefixes are common), regex metacharacters and
non-ASCII included."""
from __future__ import annotations

import pytest

from helpers import fresh_rng
from kvforge.engine.stop_matcher import StopMatcher, stop_matcher

ALPHABET = "ab.*(\\é"


def _find_ref(stops, window):
    best = None
    for stop in stops:
        pos = window.find(stop)
        if pos >= 0 and (best is None or pos < best[1] or (pos == best[1] and len(stop) < len(best[0]))):
            best = (stop, pos)
    return best


def _held_ref(stops, tail):
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(tail)), best, -1):
            if tail.endswith(stop[:k]):
                best = k
                break
    return best


@pytest.mark.parametrize("num_stops", [1, 3, 40])
def test_matches_the_plain_scan(num_stops):
    rng = fresh_rng(f"stops{num_stops}")
    word = lambda lo, hi: "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    for _ in range(300):
        stops = tuple(word(1, 5) for _ in range(num_stops))
        m = StopMatcher(stops)
        assert m.max_len == max(map(len, stops))
        for _ in range(10):
            text = word(0, 12)
            assert m.find(text) == _find_ref(stops, text), (stops, text)
            assert m.held_back_len(text) == _held_ref(stops, text), (stops, text)


def test_no_stops_and_sharing():
    m = StopMatcher(())
    assert m.find("anything") is None and m.held_back_len("anything") == 0 and m.max_len == 0
    assert stop_matcher(("x", "yz")) is stop_matcher(("x", "yz"))  # built once per stop list


def test_thousands_of_stops_stay_cheap():
    """10k stop strings: one search and at most max_len set lookups per call (the scan it replaced
    made 10k Python calls per step per sequence)."""
    rng = fresh_rng("many")
    stops = tuple("".join(rng.choice("abcdefgh") for _ in range(12)) for _ in range(10_000))
    m = StopMatcher(stops)
    text = "".join(rng.choice("abcdefgh") for _ in range(40))
    assert m.find(text) == _find_ref(stops, text)
    assert m.held_back_len(text) == _held_ref(stops, text)
    assert m.find(text[:5] + stops[1234] + text[5:]) == _find_ref(stops, text[:5] + stops[1234] + text[5:])
