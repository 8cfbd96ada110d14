"""Pieces shared by the A/B harness's real and simulated replays: ``--scheduler`` specs, the
per-scheduler engine config, model facts read from ``config.json``, and trace checks.

``--scheduler NAME[:key=val,...]`` rule: each ``key=val`` goes to

1. the flat engine option of that name when ``key`` is a flat config field (``kvforge.config.FLAT_FIELDS``:
   ``enable_prefix_caching``, ``max_num_batched_tokens``, ``max_num_seqs``, ``block_size``,
   ``num_gpu_blocks``, ``swap_space_bytes``, ...);
2. the dotted config path when ``key`` contains a dot (``cache.settings.foo=1``);
3. otherwise ``scheduler.settings.<key>`` (the scheduler plugin's own settings, e.g.
   ``preemption_mode=swap``, ``long_prefill_token_threshold=256``).

``label=TEXT`` names the column (default: the whole spec). Values are parsed as JSON when they
can be (``true``, ``512``, ``"x"``), else kept as strings. Per-scheduler keys override the
shared engine flags for that scheduler only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.bench.trace import Trace
from kvforge.bench.workload import split_top_level
from kvforge.config import FLAT_FIELDS, EngineConfig

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass
class SchedulerSpec:
    """One ``--scheduler`` argument: plugin name, column label and config overrides."""

    spec: str
    name: str
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)


def _value(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_scheduler_spec(spec: str) -> SchedulerSpec:
    """Parse ``NAME[:key=val,...]`` (module docstring).

    Raises:
        ValueError: an empty name or a pair without ``=``.
    """
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"--scheduler {spec!r}: missing the scheduler name")
    label = spec
    overrides: dict[str, Any] = {}
    for pair in split_top_level(rest):
        key, eq, raw = pair.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--scheduler {spec!r}: expected key=value, got {pair!r}")
        if key == "label":
            label = raw.strip()
        elif key in ("model", "scheduler", "scheduler.name") or key.startswith("model."):
            raise ValueError(f"--scheduler {spec!r}: {key!r} cannot be set per scheduler (every arm runs "
                             "the same model; the scheduler is NAME)")
        elif key in FLAT_FIELDS or "." in key:
            overrides[key] = _value(raw.strip())
        else:
            overrides[f"scheduler.settings.{key}"] = _value(raw.strip())
    return SchedulerSpec(spec, name, label, overrides)


def unique_labels(specs: list[SchedulerSpec]) -> None:
    """Make labels unique in place (``fcfs``, ``fcfs#2``, ...)."""
    seen: dict[str, int] = {}
    for s in specs:
        seen[s.label] = seen.get(s.label, 0) + 1
        if seen[s.label] > 1:
            s.label = f"{s.label}#{seen[s.label]}"


def scheduler_config(base: dict[str, Any], spec: SchedulerSpec, config_file: str | None = None) -> EngineConfig:
    """The engine config of one A/B arm: ``base`` (shared flags) + the scheduler name + its overrides.

    Raises:
        ValueError / pydantic.ValidationError: naming the bad option.
    """
    merged = {**base, "scheduler": spec.name}
    for k, v in spec.overrides.items():
        merged[k] = v
    return EngineConfig.from_sources(config_file, merged)


@dataclass(frozen=True)
class ModelFacts:
    """What the harness needs from a checkpoint's ``config.json`` (no weights are read).

    Attributes: vocab_size, max_position_embeddings (tokens), num_hidden_layers, num_kv_heads,
    head_dim, dtype (config name), special token ids (bos/eos/pad).
    """

    vocab_size: int
    max_position_embeddings: int
    num_hidden_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    special_ids: frozenset[int]

    def kv_block_bytes(self, block_size: int, dtype: str = "auto", kv_cache_dtype: str = "auto") -> int:
        """Bytes of one KV block over all layers (K and V), as the engine's builder computes it
        (``kv_cache_dtype``: ``cache.kv_cache_dtype``; the FP8 ones store one byte a value)."""
        d = self.dtype if dtype == "auto" else dtype
        elem = _DTYPE_BYTES.get(d, 4) if kv_cache_dtype == "auto" else 1
        return 2 * self.num_hidden_layers * block_size * self.num_kv_heads * self.head_dim * elem


def model_facts(model_dir: str) -> ModelFacts:
    """Read :class:`ModelFacts` from ``model_dir/config.json`` (+ generation_config.json).

    Raises:
        ValueError: no readable config.json.
    """
    p = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--model {model_dir}: cannot read config.json: {e}") from None
    cfg = cfg.get("text_config", cfg) if "vocab_size" not in cfg else cfg
    special: set[int] = set()
    sources = [cfg]
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        try:
            sources.append(json.loads(gen.read_text()))
        except json.JSONDecodeError:
            pass
    for src in sources:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = src.get(key)
            special.update(v if isinstance(v, list) else ([v] if isinstance(v, int) else []))
    heads = cfg["num_attention_heads"]
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return ModelFacts(vocab_size=cfg["vocab_size"], max_position_embeddings=cfg.get("max_position_embeddings") or 2048,
                      num_hidden_layers=cfg["num_hidden_layers"],
                      num_kv_heads=cfg.get("num_key_value_heads") or heads,
                      head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                      dtype=dtype if dtype in _DTYPE_BYTES else "float32", special_ids=frozenset(special))


def max_model_len(config: EngineConfig, facts: ModelFacts) -> int:
    """The engine's max_model_len: the config's, else the model's max_position_embeddings."""
    n = config.model.max_model_len or facts.max_position_embeddings
    if n > facts.max_position_embeddings:
        raise ValueError(f"model.max_model_len {n} exceeds the model's max_position_embeddings "
                         f"{facts.max_position_embeddings}")
    return n


def check_trace_fits(trace: Trace, limit: int) -> None:
    """Every request must fit ``max_model_len`` (prompt + output), else fail before any replay.

    Raises:
        ValueError: naming the first request that does not fit.
    """
    for i, r in enumerate(trace.requests):
        if r.prompt_len + r.output_len > limit:
            raise ValueError(f"trace request {i}: prompt_len {r.prompt_len} + output_len {r.output_len} exceeds "
                             f"max_model_len {limit}; shorten the workload (its prompt= / output= lengths, e.g. "
                             f"prompt=uniform(8,{max(8, limit // 2)}),output=uniform(8,{max(8, limit // 4)})) or "
                             "raise --max-model-len where the model's positions allow")


def check_cache_holds(config: EngineConfig, num_blocks: int, longest: int) -> None:
    """Refuse, as the engine would, a (real or simulated) cache too small for the trace's ``longest``
    request (prompt + output tokens): such a request could never run.

    Raises:
        ValueError: naming the setting that sized the cache.
    """
    c = config.cache
    tokens = num_blocks * c.block_size
    if tokens < longest:
        knob = ("cache.num_gpu_blocks" if c.num_gpu_blocks is not None else
                "cache.kv_cache_memory_bytes" if c.kv_cache_memory_bytes is not None else
                "the cost model's engine.kv_cache_memory_bytes (set cache.num_gpu_blocks or "
                "cache.kv_cache_memory_bytes)")
        raise ValueError(f"{knob}: {num_blocks} KV blocks of {c.block_size} tokens hold {tokens} tokens, fewer "
                         f"than the trace's longest request ({longest} tokens)")


def replay_order(trace: Trace) -> list[int]:
    """Trace indices in arrival order (ties keep trace order)."""
    return sorted(range(len(trace.requests)), key=lambda i: (trace.requests[i].arrival_time, i))


def request_id(i: int) -> str:
    return f"r{i}"
