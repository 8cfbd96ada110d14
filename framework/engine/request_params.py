"""The checks and rewrites of one request's :class:`SamplingParams` that need the model:
its vocabulary, ``max_model_len``, ``max_logprobs`` and tokenizer (``LLMEngine.prepare_request``).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvforge.engine.sampling_params import SamplingParams


def finalize_params(params: SamplingParams, ids: list[int], *, vocab_size: int, max_model_len: int,
                    max_logprobs: int, tokenizer: Any, eos_token_ids: Iterable[int]) -> list[int]:
    """Check ``params`` against the model and resolve what depends on it, in place:
    ``logprobs`` / ``prompt_logprobs`` of -1 become ``vocab_size``, and ``bad_words`` are
    encoded. Returns the prompt ids, truncated to ``truncate_prompt_tokens`` (the last ones).

    ``params`` must be the request's own copy; nothing else is touched.

    Raises:
        ValueError: naming the field: token ids outside the vocabulary, logprobs over
            ``max_logprobs`` (-1 there means no cap), ``truncate_prompt_tokens`` over
            ``max_model_len``, a bad word that encodes to nothing, or ``allowed_token_ids``
            all of which are banned while ``min_tokens`` holds.
    """
    params.verify_vocab(vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is None:
            continue
        wanted = vocab_size if asked == -1 else asked
        if 0 <= max_logprobs < wanted:
            what = f"-1 (the whole vocabulary, {vocab_size})" if asked == -1 else str(asked)
            raise ValueError(f"{name}: {what} exceeds max_logprobs ({max_logprobs}); raise model.max_logprobs "
                             "(-1 for no cap) to allow more")
        setattr(params, name, min(wanted, vocab_size))
    k = params.truncate_prompt_tokens
    if k is not None:
        if k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {k} exceeds max_model_len ({max_model_len})")
        ids = ids[-(max_model_len if k == -1 else k):]
    params.update_from_tokenizer(tokenizer)
    if params.allowed_token_ids:
        banned = {seq[0] for seq in params.bad_words_token_ids if len(seq) == 1}
        at_start = set(banned)
        if params.min_tokens:  # as the sampler's min_tokens mask
            at_start.update(params.stop_token_ids)
            if not params.ignore_eos:
                at_start.update(eos_token_ids)
        for blocked, when in ((banned, "bad_words bans"), (at_start, "min_tokens holds back")):
            if set(params.allowed_token_ids) <= blocked:
                raise ValueError(f"allowed_token_ids: every allowed token is one that {when}, so none "
                                 "could be sampled")
    return ids
