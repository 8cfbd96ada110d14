"""Stop-string matching for the detokenizer, in time that does not grow with the number of stop
strings: one regular expression finds the earliest match in a text window, and a set of every
stop string's proper prefixes gives the longest text suffix that could still become one (the
text held back from a stream). A request may carry thousands of stop strings, checked at every
step of every sequence on the engine thread."""
from __future__ import annotations

import functools
import re


class StopMatcher:
    """The stop strings of one request (non-empty strings; duplicates allowed)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.max_len = max((len(s) for s in stops), default=0)
        # at one position the alternation takes its first match: shortest first, as a scan of the
        # strings that keeps the shortest at the earliest position would
        self._regex = re.compile("|".join(map(re.escape, sorted(set(stops), key=len)))) if stops else None
        self._prefixes = frozenset(s[:k] for s in stops for k in range(1, len(s)))

    def find(self, window: str) -> tuple[str, int] | None:
        """(stop string, its start in ``window``) of the earliest match (the shortest one where
        several start there), or None."""
        if self._regex is None:
            return None
        m = self._regex.search(window)
        return (m.group(0), m.start()) if m else None

    def held_back_len(self, tail: str) -> int:
        """Length of the longest suffix of ``tail`` that is a proper prefix of a stop string."""
        for k in range(min(self.max_len - 1, len(tail)), 0, -1):
            if tail[-k:] in self._prefixes:
                return k
        return 0


@functools.lru_cache(maxsize=16)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    """The matcher of ``stops``, shared by the sequences of a request (n > 1) and by requests
    with the same stop strings."""
    return StopMatcher(stops)
