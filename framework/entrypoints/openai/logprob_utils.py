"""Log-probabilities as JSON: clamping, token text and bytes, top-k ordering, vLLM's
``prompt_logprobs`` field (shared by the completion and chat handlers)."""
from __future__ import annotations

from typing import Any

from kvforge.engine.detokenizer import decode_single_token
from kvforge.engine.outputs import Logprob

#: Log-probabilities are clamped to this floor so ``-inf`` stays valid JSON (as vLLM does).
LOGPROB_FLOOR = -9999.0


def clamp(lp: float) -> float:
    """A JSON-safe log-probability: NaN and values below ``LOGPROB_FLOOR`` become the floor."""
    return lp if lp == lp and lp > LOGPROB_FLOOR else LOGPROB_FLOOR


def prompt_logprobs_json(tokenizer: Any, entries: list[dict[int, Logprob] | None] | None,
                         prompt_ids: list[int], top: int) -> list[dict[str, dict] | None]:
    """vLLM's ``prompt_logprobs`` response field: per prompt token, None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` holding the token itself and the
    ``top`` most likely ones (``entries`` may hold more, e.g. for ``echo`` logprobs; -1: all)."""
    out: list[dict[str, dict] | None] = []
    if top == -1:
        top = 1 << 62
    for i, tid in enumerate(prompt_ids):
        entry = entries[i] if entries is not None and i < len(entries) else None
        if not entry:
            out.append(None)
            continue
        out.append({str(t): {"logprob": clamp(e.logprob), "rank": e.rank,
                             "decoded_token": token_text(tokenizer, t, e)}
                    for t, e in entry.items() if t == tid or (e.rank is not None and e.rank <= top)})
    return out


def token_text(tokenizer: Any, token_id: int, lp: Logprob | None = None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode_single_token(tokenizer, token_id)


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """UTF-8 bytes of a token; a byte-fallback piece ``<0xNN>`` gives its single byte."""
    if "\ufffd" in text:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return [int(piece[3:5], 16)]
            except ValueError:
                pass
    return list(text.encode("utf-8"))


def sorted_top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of one position, by rank."""
    items = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    items.sort(key=lambda x: (x[1].rank, -x[1].logprob))
    return items[:k]
