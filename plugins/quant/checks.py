"""Input checks shared by the quantization plugins: fields of config.json's
``quantization_config`` and the values of checkpoint scale tensors.

Every check raises ValueError naming what is wrong by its config field
(``quantization_config.group_size``) or checkpoint tensor name
(``model.layers.0.self_attn.q_proj.scales``), at load time, before the model is used:
a raw ``int()`` / ``re`` error would name neither, and a NaN scale would load silently
and turn every logit into NaN.
"""
from __future__ import annotations

import re
from typing import Any

import torch

_INT_STRING = re.compile(r"[+-]?\d+")


def int_field(value: Any, field: str) -> int:
    """``value`` of config field ``field`` as an int.

    Accepted: JSON integers, integral floats (``128.0``) and decimal integer strings
    (``"128"``, which ``int()`` accepted before this check).

    Raises:
        ValueError: anything else (null, ``true``, ``"abc"``, ``32.7``), naming ``field``.
    """
    if isinstance(value, bool):  # (bool is an int subclass: true would read as 1)
        pass
    elif isinstance(value, int):
        return value
    elif isinstance(value, float) and value.is_integer():
        return int(value)
    elif isinstance(value, str) and _INT_STRING.fullmatch(value.strip()):
        return int(value)
    raise ValueError(f"{field}: expected an integer, got {value!r}")


def bool_field(value: Any, field: str) -> bool:
    """``value`` of config field ``field`` as a bool (JSON true / false only).

    Raises:
        ValueError: any other value, naming ``field`` (``bool("false")`` would read as true).
    """
    if isinstance(value, bool):
        return value
    raise ValueError(f"{field}: expected true or false, got {value!r}")


def compile_regex(pattern: Any, field: str) -> re.Pattern:
    """``pattern`` (from config field ``field``) compiled.

    Raises:
        ValueError: not a string or not a valid Python regular expression, naming ``field``.
    """
    if not isinstance(pattern, str):
        raise ValueError(f"{field}: expected a regular expression string, got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{field}: invalid regular expression {pattern!r}: {e}") from None


def check_module_patterns(patterns: Any, field: str) -> list[str]:
    """A module list (``ignore``, ``ignored_layers``, ``targets``...): names or ``re:<regex>``.

    Returns the list; each ``re:`` entry is compiled once here so that a bad one is
    refused naming its field instead of failing while the model is built.

    Raises:
        ValueError: not a list of strings, or an invalid ``re:`` regex, naming ``field``.
    """
    if patterns is None:
        return []
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{field}: expected a list of module names, got {patterns!r}")
    for i, p in enumerate(patterns):
        if p.startswith("re:"):
            compile_regex(p[3:], f"{field}[{i}]")
    return list(patterns)


def refuse_bad_scales(t: torch.Tensor, name: str, positive: bool) -> None:
    """Refuse checkpoint scale tensor ``name`` holding NaN / Inf, or with ``positive``
    (FP8 / INT8 W8A8 weight and activation scales, which divide or are maxed over)
    zero or negative values. One ``isfinite`` pass when the tensor is fine.

    Raises:
        ValueError: naming ``name``, how many values are bad, and the first one.
    """
    ok = torch.isfinite(t)
    if positive:
        ok &= t > 0
    if bool(ok.all()):
        return
    flat = t.reshape(-1)
    nonfinite = ~torch.isfinite(flat)
    if bool(nonfinite.any()):
        first = flat[nonfinite.nonzero()[0, 0]].item()
        raise ValueError(f"checkpoint tensor {name!r} has {int(nonfinite.sum())} non-finite values "
                         f"(first: {first}); quantization scales must be finite (a corrupt export?)")
    bad = flat <= 0
    raise ValueError(f"checkpoint tensor {name!r} has {int(bad.sum())} values <= 0 (first: "
                     f"{flat[bad.nonzero()[0, 0]].item()}); these quantization scales must be positive")

