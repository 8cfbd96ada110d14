"""Command-line argument checks shared by ``kvforge bench`` commands: argparse types that
refuse a bad number up front (naming the flag), an output-path check run before any
benchmark time is spent, and the hint an over-long workload's error gives."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def _bounded(kind: type, lo: float, strict: bool):
    """argparse ``type=``: a finite number > lo (strict) or >= lo, so a bad flag is refused
    up front with argparse's own message naming it."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if v != v or v in (float("inf"), float("-inf")) or (v <= lo if strict else v < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo:g}"
                                             f"{' and finite' if kind is float else ''}, got {text}")
        return v
    return parse


positive_int = _bounded(int, 0, True)
nonneg_int = _bounded(int, 0, False)
positive_float = _bounded(float, 0, True)


def check_output_path(path: str | None, flag: str = "--output-json") -> None:
    """Refuse an output file that cannot be written, before any benchmark time is spent.

    Raises:
        ValueError: naming ``flag``: the path is a directory, or its directory cannot be
            created or written.
    """
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create its directory ({e.strerror or e})") from None
    try:  # really open it: os.access says yes to root for almost anything (/proc, read-only files)
        if p.exists():
            with open(p, "a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=p.parent):
                pass
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot be written ({e.strerror or e})") from None


def raise_limit_hint(engine) -> str:
    """How to serve longer requests: the KV cache's size when it lowered max_model_len below the
    model's positions (the builder does that, with a warning), else --max-model-len."""
    c = engine.config.cache
    positions = getattr(engine.parts.hf_config, "max_position_embeddings", None) or engine.max_model_len
    if engine.config.model.max_model_len is None and engine.max_model_len < positions:
        knob = ("--num-gpu-blocks" if c.num_gpu_blocks is not None else
                "cache.kv_cache_memory_bytes" if c.kv_cache_memory_bytes is not None else
                "cache.gpu_memory_utilization" if engine.parts.device.type == "cuda" else "cache.kv_cache_memory_bytes")
        return (f"give the KV cache more room ({knob}): its {engine.allocator.num_blocks} blocks hold "
                f"{engine.max_model_len} tokens, fewer than the model's {positions} positions")
    return "raise --max-model-len where the model's positions allow"
