"""Tokenizer loading and end-of-sequence id discovery."""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(path: str, **kwargs: Any) -> "PreTrainedTokenizerBase":
    """Load the Hugging Face tokenizer stored in the local directory ``path``.

    Calls ``AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)``,
    so nothing is fetched from the network.

    Raises:
        ValueError: naming ``path`` when the tokenizer cannot be loaded.
    """
    from transformers import AutoTokenizer

    kwargs.setdefault("local_files_only", True)
    if not os.path.isdir(path):  # (else transformers takes it for a Hub repo id and says so)
        raise ValueError(f"could not load a tokenizer from {path!r}: not a directory (a local folder with the "
                         "tokenizer files is expected)")
    try:
        tok = AutoTokenizer.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure becomes one clear error
        raise ValueError(f"could not load a tokenizer from {path!r}: {type(exc).__name__}: {exc}") from exc
    # The engine checks prompt lengths against max_model_len itself (a clear error per
    # request); the tokenizer's own limit only warned "sequence length is longer than ...".
    tok.model_max_length = int(1e30)
    return tok


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set, frozenset)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


def extra_eos_token_ids(tokenizer: Any, eos_ids: frozenset[int]) -> frozenset[int]:
    """The ids of ``eos_ids`` other than ``tokenizer.eos_token_id``: the ones vLLM turns into
    stop_token_ids (``SamplingParams.update_from_generation_config``), so that a request
    ending on one reports it as ``stop_reason``."""
    return frozenset(eos_ids - _as_id_set(getattr(tokenizer, "eos_token_id", None)))


def eos_token_ids(tokenizer: Any, model_dir: str) -> frozenset[int]:
    """Every token id that ends a sequence for this model.

    The union of ``tokenizer.eos_token_id`` and the ``eos_token_id`` entry (an int or
    a list of ints) of ``model_dir/generation_config.json`` when that file exists.
    A missing or unreadable generation config only contributes nothing.
    """
    ids = _as_id_set(getattr(tokenizer, "eos_token_id", None))
    cfg_path = os.path.join(model_dir, "generation_config.json") if model_dir else ""
    if cfg_path and os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            ids |= _as_id_set(cfg.get("eos_token_id"))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    return frozenset(ids)


def check_text(text: str, field: str) -> None:
    """Raise ValueError naming ``field`` unless ``text`` is valid Unicode: a lone surrogate
    (``"\\ud800"``, which JSON's ``\\u`` escapes can produce) has no UTF-8 form, and fast
    tokenizers refuse it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{field}: not valid Unicode text ({e.reason} at character {e.start})") from None


def max_token_chars(tokenizer: Any) -> int:
    """The longest string of one vocabulary token, in characters (byte-level BPE: bytes, which
    are at least as many as the characters they spell). A text many times longer than
    ``max_model_len * max_token_chars`` characters is longer than the model takes, with no need
    to tokenize it (the server's early refusal). One pass over the vocabulary: call it once."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(1, max((len(t) for t in tokens if isinstance(t, str)), default=1))
