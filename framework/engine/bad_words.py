"""``SamplingParams.bad_words``: words turned into token-id sequences, and the tokens they ban.

The rule is vLLM's (``bad_words`` in its ``SamplingParams``): a word is encoded without
special tokens both as written (leading spaces stripped) and with one leading space, since a
BPE tokenizer spells a word differently at the start of the text and after a space. A
one-token sequence is banned at every step; for a longer one the last token is banned
whenever the generated tokens end with the others. Only the request's generated tokens are
matched, not its prompt. vLLM keeps the spaced form only when it has as many tokens as the
plain one; here every distinct form is kept, so " Paris" is banned even where "Paris" splits
in two.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def encode_bad_words(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """Token-id sequences for ``words``, duplicates dropped (first occurrence kept).

    Args:
        tokenizer: a Hugging Face tokenizer (``encode(text, add_special_tokens=False)``).
        words: non-blank strings.

    Returns:
        one or two sequences per word (plain and spaced forms, when they differ).

    Raises:
        ValueError: naming ``bad_words[i]``, for a word that encodes to no tokens.
    """
    out: dict[tuple[int, ...], None] = {}
    for i, word in enumerate(words):
        stripped = word.lstrip()
        forms = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in (stripped, " " + stripped)]
        if not forms[0]:
            raise ValueError(f"bad_words[{i}]: {word[:40]!r} encodes to no tokens")
        for ids in forms:
            if ids:
                out.setdefault(ids, None)
    return [list(seq) for seq in out]


def banned_tokens(sequences: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> set[int]:
    """Tokens the next step may not sample, given the tokens generated so far.

    Args:
        sequences: the request's bad-word token-id sequences.
        output_token_ids: the generated tokens (only the last ``len(seq) - 1`` are read per
            sequence; a sequence longer than the output cannot match yet).
    """
    banned: set[int] = set()
    n = len(output_token_ids)
    tail: list[int] | None = None
    for seq in sequences:
        k = len(seq) - 1
        if k == 0:
            banned.add(seq[0])
            continue
        if k > n:
            continue
        if tail is None:  # the last few tokens, read once (a speculative view is a lazy concatenation)
            longest = min(n, max(len(s) for s in sequences) - 1)
            ids = output_token_ids if isinstance(output_token_ids, list) else list(output_token_ids)
            tail = ids[n - longest:] if longest else []
        if list(seq[:-1]) == tail[len(tail) - k:]:
            banned.add(seq[-1])
    return banned
