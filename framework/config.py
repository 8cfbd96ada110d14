"""Engine configuration (pydantic v2). Field names follow vLLM's engine args.

Plugin-specific options live in each section's ``settings`` dict and are
validated by the chosen plugin's own settings model at engine build
(:func:`kvforge.engine.builder.validate_plugin_settings`).

Load order: a YAML/JSON file, then flat overrides (CLI flags or ``LLM(**kwargs)``).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kvforge.config_base import _Section
from kvforge.config_messages import (  # noqa: F401  (re-exported: kvforge.config is where callers look)
    boolean_for_number, boolean_for_number_message, config_error_message, validation_message)
from kvforge.config_parallel import ParallelConfig  # noqa: F401  (re-exported, like the other sections)


log = logging.getLogger("kvforge")

#: section -> the field a bare string stands for (``quantization: fp8`` = ``{method: fp8}``)
SHORTHAND = {"quantization": "method", "attention": "backend", "scheduler": "name", "speculative": "method"}


class ModelConfig(_Section):
    model: str = Field(..., description="Path to a Hugging Face-layout checkpoint directory.")
    tokenizer: str | None = Field(None, description="Tokenizer directory (default: model).")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    max_model_len: int | None = Field(None, gt=0, description="Max prompt + output tokens.")
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    seed: int = Field(0, ge=-2**63, lt=2**64, description="Seed of the engine's random state (torch's range).")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    enforce_eager: bool = Field(False, description="Never capture CUDA graphs (debugging, profiling).")
    cuda_graph_sizes: int | list[int] | None = Field(
        None, description="Decode batch sizes captured as CUDA graphs (vLLM's option): one value N = 1, 2, 4 and "
        "every multiple of 8 up to N, and N; a list = exactly those sizes; default N = max_num_seqs (at most "
        "512). A batch replays the smallest captured size that holds it (the other rows are padding); a batch "
        "above the largest runs eagerly.")

    @field_validator("cuda_graph_sizes", mode="before")
    @classmethod
    def _check_graph_sizes(cls, v):
        sizes = [v] if not isinstance(v, list) else v
        if v is not None and (not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1
                                                 for s in sizes)):
            raise ValueError("must be a positive integer or a non-empty list of positive integers")
        return v
    max_logprobs: int = Field(20, ge=-1, description="Largest logprobs / prompt_logprobs a request may ask for "
                              "(-1: no cap; a request's -1 asks for the whole vocabulary).")


class CacheConfig(_Section):
    allocator: str = "paged"
    block_size: int = Field(16, gt=0, description="Tokens per KV block.")
    num_gpu_blocks: int | None = Field(None, gt=0, description="Explicit block count (overrides the budget).")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1.0)
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0, description="KV cache budget in bytes (default: GPU utilization target, or 1 GiB on CPU).")
    enable_prefix_caching: bool = False
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="What the KV cache stores: auto (the model's dtype), fp8 / fp8_e4m3 (E4M3) or "
        "fp8_e5m2, with per-layer K/V scales from the checkpoint (else 1.0); half the bytes of bf16.")
    calculate_kv_scales: bool = Field(
        False, description="Set each layer's FP8 K/V scales from the first step's K and V (their largest "
        "magnitude lands at half the format's range) instead of the checkpoint's or 1.0.")
    swap_space_bytes: int = Field(0, ge=0, description="CPU memory for swapped-out KV blocks (preemption_mode swap).")
    settings: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_scales(self) -> "CacheConfig":
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales: only used with an FP8 cache (set kv_cache_dtype fp8, fp8_e4m3 "
                             "or fp8_e5m2)")
        return self


class SchedulerConfig(_Section):
    name: str = "chunked_prefill"
    max_num_seqs: int | None = Field(
        None, gt=0, description="Most requests in one step (default: 512 on a CUDA GPU of >= 70 GiB, else 256; "
        "vLLM too raises its default on such GPUs).")
    max_num_batched_tokens: int | None = Field(None, gt=0, description="Token budget per step (default: max(2048, max_model_len)).")
    async_scheduling: bool | None = Field(
        None, description="Schedule and prepare step N+1 while the device runs step N (vLLM's async "
        "scheduling); outputs are unchanged. Steps that verify speculative drafts run synchronously. "
        "None: on for CUDA (also with tensor/pipeline parallelism).")
    settings: dict[str, Any] = Field(default_factory=dict)


class AttentionConfig(_Section):
    backend: str = "auto"
    settings: dict[str, Any] = Field(default_factory=dict)


class QuantizationSection(_Section):
    method: str = "auto"
    settings: dict[str, Any] = Field(default_factory=dict)


class SpeculativeConfig(_Section):
    """Speculative decoding (off unless ``method`` names a registered drafter).

    The adaptive rule (``adaptive``; :class:`kvforge.engine.spec_adaptive.AdaptiveSpeculation`)
    picks, every step, the k' <= ``num_speculative_tokens`` that maximises the expected
    tokens per unit of work, ``E(k') / C(B, k')``, with ``E(k') = (1 - a^(k'+1)) / (1 - a)``
    (Leviathan et al. 2023, eq. 1; ``a`` = recent acceptance rate) and
    ``C(B, k') = (1 + c * k') * max(B * (k' + 1), T) / max(B, T) * (1 + o)`` (``B`` running
    requests, ``c`` the drafter's cost per draft step relative to a target step, ``T`` =
    ``verify_free_tokens``, ``o`` = ``step_overhead``); k' = 0 turns speculation off for
    that step (while off, two steps with k' = 1 probe again after 64 plain steps, an
    interval that doubles while probes fail). With ``measure_step_cost`` the modelled cost
    gives way to measured step times (:mod:`kvforge.engine.spec_adaptive`). A request the
    drafter proposes nothing for counts as a rejection of its first draft.
    """

    method: str | None = None
    num_speculative_tokens: int = Field(0, ge=0, description="k: draft tokens verified per step (at most).")

    @field_validator("method", mode="before")
    @classmethod
    def _none_is_off(cls, v: Any) -> Any:
        return None if v == "none" else v  # "none": the per-request opt-out's name, here "off"
    settings: dict[str, Any] = Field(default_factory=dict)
    adaptive: bool = Field(True, description="Shrink k, or speculate not at all, when it would not pay.")
    disable_by_batch_size: int | None = Field(
        None, gt=0, description="Never speculate in a step with more running requests than this.")
    verify_free_tokens: int = Field(
        128, gt=0, description="Tokens per forward below which the target's step time hardly grows "
                               "(memory-bound); above it, cost grows in proportion to the tokens.")
    step_overhead: float = Field(
        0.25, ge=0.0, allow_inf_nan=False, description="Extra cost of a speculating step over a plain decode step, as a fraction "
                                  "of the latter: the step runs synchronously (no async scheduling) and "
                                  "verifies on the host. Measured on the H200 (8B, bf16): 0.3 at batch 1, "
                                  "0.5 at batch 64.")
    measure_step_cost: bool = Field(
        True, description="Let the adaptive rule use measured wall times of plain and speculating "
                          "decode steps (per batch-size bucket) instead of the modelled cost once both "
                          "are known; off: the model alone decides (deterministic).")
    initial_acceptance_rate: float = Field(
        0.7, ge=0.0, le=1.0, description="Acceptance-rate estimate before any draft has been verified "
                                         "(and the rate at which an off drafter is still worth probing).")


class RequestChoicesConfig(_Section):
    """What a request may choose for itself, by name (the operator's allow-list).

    A request chooses in ``SamplingParams.extra_args["kvforge"]`` (``drafter``,
    ``eviction_hint``) and with its ``priority``; the engine validates the choice
    when the request is added (:mod:`kvforge.engine.request_choices`).
    """

    drafters: list[str] = Field(default_factory=list, description="Drafters a request may pick ('none' = no "
                                                                  "speculation is always allowed).")
    priorities: tuple[int, int] | None = Field(None, description="Allowed [min, max] request priority (None = any).")
    eviction_hints: list[str] = Field(default_factory=list, description="Eviction hints a request may give; the "
                                                                        "KV allocator must declare each one.")

    @model_validator(mode="after")
    def _check_range(self) -> "RequestChoicesConfig":
        if self.priorities is not None and self.priorities[0] > self.priorities[1]:
            raise ValueError(f"priorities: min {self.priorities[0]} > max {self.priorities[1]}")
        return self


def _expand_shorthand(data: Any) -> Any:
    """``{"quantization": "fp8"}`` -> ``{"quantization": {"method": "fp8"}}`` (see SHORTHAND)."""
    if isinstance(data, dict):
        data = dict(data)
        for sec, field in SHORTHAND.items():
            if isinstance(data.get(sec), str):
                data[sec] = {field: data[sec]}
    return data


class EngineConfig(_Section):
    """The whole engine configuration.

    Raises:
        pydantic.ValidationError: on any bad field, naming it (e.g. ``scheduler.max_num_seqs``).
    """

    model: ModelConfig
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    quantization: QuantizationSection = Field(default_factory=QuantizationSection)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    request_choices: RequestChoicesConfig = Field(default_factory=RequestChoicesConfig)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        return _expand_shorthand(data)

    @model_validator(mode="after")
    def _check_parallel(self) -> "EngineConfig":
        p = self.parallel
        if p.world_size * p.data_parallel_size > 1 and self.speculative.method is not None:
            raise ValueError("speculative.method: speculative decoding runs on a single rank only; "
                             "set tensor/pipeline/data_parallel_size to 1 to use it")
        spec = self.speculative
        if spec.num_speculative_tokens and spec.method is None and \
                not [d for d in self.request_choices.drafters if d != "none"]:
            raise ValueError("speculative.num_speculative_tokens: set, but no drafter would use it (set "
                             "speculative.method, or request_choices.drafters for per-request drafters)")
        return self

    def to_transfer(self) -> dict[str, Any]:
        """This config as a plain dict for another process (workers, replicas), which rebuilds
        it with ``model_validate``. Fields at their default are left out, so there they read as
        unset again (``model_fields_set``): a warning about a field the user set, such as an
        unused ``gpu_memory_utilization``, is not repeated by every worker for defaults."""
        return self.model_dump(exclude_defaults=True)

    @classmethod
    def from_sources(cls, file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> "EngineConfig":
        """Build from an optional YAML/JSON file plus flat or dotted overrides.

        ``overrides`` keys are flat names (``max_num_seqs``, see :data:`FLAT_FIELDS`)
        or dotted paths (``scheduler.settings.foo``). None values are ignored.
        """
        data: dict[str, Any] = _expand_shorthand(load_file(file)) if file else {}
        # The file's plugin settings are set aside and merged back (under the overrides' own)
        # only where the overrides keep the file's plugin (or the file named none: 'auto'):
        # settings written for one attention backend or quantizer mean nothing to another one
        # chosen on the command line. An override of settings with {} clears them.
        chosen_in_file = {sec: _selected(data, sec) for sec in SELECTORS}
        file_settings = {sec: data[sec].pop("settings") for sec in SELECTORS
                         if isinstance(data.get(sec), dict) and isinstance(data[sec].get("settings"), dict)}
        items = [(k, v) for k, v in (overrides or {}).items() if v is not None]
        # LLM(quantization={"method": "fp8", "settings": {...}}): the section's fields over the
        # file's (its settings merge with the file's below, as dotted ones do); applied before
        # the flat and dotted overrides, so those win whatever the keyword order.
        for key, value in items:
            if (name := _section_keyword(key, value)) is not None:
                mine = {k: dict(v) if isinstance(v, dict) else v for k, v in value.items()}  # not the caller's
                data[name] = {**(data[name] if isinstance(data.get(name), dict) else {}), **mine}
        for key, value in items:
            if _section_keyword(key, value) is not None:
                continue
            path = _override_path(key).split(".")
            if len(path) == 1:
                raise ValueError(f"unknown config option {key!r}; known flat options: "
                                 f"{', '.join(sorted(FLAT_FIELDS))}; any other field by its dotted path "
                                 f"(e.g. **{{'scheduler.settings': {{...}}}}) or a whole section "
                                 f"(e.g. scheduler={{'name': ..., 'settings': {{...}}}})")
            node = data
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ValueError(f"config option {key!r}: {part!r} is not a section")
            node[path[-1]] = value
        for sec, kept in file_settings.items():
            before, now = chosen_in_file[sec], _selected(data, sec)
            # 'auto' / None name no plugin: settings beside them are for whichever plugin is chosen
            if before not in ("auto", None) and now != before:
                log.warning("config: %s.settings from %s dropped: they were for %s %r; the overrides chose %r",
                            sec, file, sec, before, now)
                continue
            node = data.setdefault(sec, {})
            mine = node.get("settings")
            if mine is None:
                node["settings"] = kept
            elif isinstance(mine, dict) and mine:  # an explicit {} clears the file's settings
                node["settings"] = {**kept, **mine}
        return cls.model_validate(data)


def _selected(data: dict[str, Any], sec: str) -> Any:
    """The plugin section ``sec`` of raw config ``data`` names (its field's default when unset)."""
    field = SELECTORS[sec]
    node = data.get(sec)
    if isinstance(node, dict) and field in node:
        return node[field]
    return _SECTION_MODELS[sec].model_fields[field].default


def _section_keyword(key: str, value: Any) -> str | None:
    """The section a dict value for flat ``key`` sets (``quantization={...}``: "quantization"), else None."""
    path = _override_path(key).split(".")
    if isinstance(value, dict) and len(path) == 2 and SHORTHAND.get(path[0]) == path[1]:
        return path[0]
    return None


def _override_path(key: str) -> str:
    """Dotted config path of an override key: a flat name, a section name standing for its
    main field (``attention`` -> ``attention.backend``, see SHORTHAND), or a dotted path."""
    if key in FLAT_FIELDS:
        return FLAT_FIELDS[key]
    return f"{key}.{SHORTHAND[key]}" if key in SHORTHAND else key


def load_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON (``.json``) or YAML (any other name: YAML reads JSON too) config file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {p}: no such file")
    text = p.read_text()
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml
            data = yaml.safe_load(text) or {}
    except Exception as e:  # YAML/JSON syntax: name the file, keep the parser's position
        raise ValueError(f"config file {p}: cannot parse: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {p}: top level must be a mapping")
    return data


def _flat_fields() -> dict[str, str]:
    """Flat name -> dotted path, for ``LLM(**kwargs)`` and CLI flags (vLLM's names)."""
    sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                "parallel": ParallelConfig}
    out: dict[str, str] = {}
    for sec, cls in sections.items():
        for name in cls.model_fields:
            if name not in ("settings", "name"):
                out[name] = f"{sec}.{name}"
    out.update({
        "kv_allocator": "cache.allocator",
        "scheduler": "scheduler.name",
        "attention_backend": "attention.backend",
        "quantization": "quantization.method",
        "speculative_method": "speculative.method",
        "num_speculative_tokens": "speculative.num_speculative_tokens",
    })
    return out


FLAT_FIELDS: dict[str, str] = _flat_fields()
#: Plugin sections: the field naming the plugin, whose ``settings`` the section holds.
SELECTORS = {"cache": "allocator", **SHORTHAND}
_SECTION_MODELS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "attention": AttentionConfig,
                   "quantization": QuantizationSection, "speculative": SpeculativeConfig}
