"""Per-request choices: a request picks, by name, among what the operator allows.

The request side (vLLM keeps engine-specific request options in
``SamplingParams.extra_args``; kvforge's live under the key ``"kvforge"``)::

    SamplingParams(extra_args={"kvforge": {"drafter": "ngram", "eviction_hint": "evict_first"}})
    llm.generate(prompts, params, priority=[-1, 0])     # priority: the existing argument

The operator side is the config section ``request_choices``
(:class:`kvforge.config.RequestChoicesConfig`)::

    request_choices: {drafters: [ngram], priorities: [-10, 10], eviction_hints: [evict_first, retain]}

Keys:
    drafter:       a registered drafter listed in ``request_choices.drafters``, or
                   ``"none"`` (no speculation for this request; always allowed).
    eviction_hint: a name in ``request_choices.eviction_hints``; the KV allocator reads
                   it with :func:`get_choice` (the allocator must declare the hint in its
                   ``eviction_hints`` capability, checked at engine build).
    priority:      the request's ``priority`` must lie in ``request_choices.priorities``
                   ``[min, max]`` when that is set (lower = more important).

Nothing is allowed by default: an empty allow-list refuses every choice, so a
request cannot change engine behaviour the operator did not opt into.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvforge.engine.capabilities import describe, ignores_priority

if TYPE_CHECKING:
    from kvforge.config import EngineConfig
    from kvforge.plugin_manager import Registry

#: The ``SamplingParams.extra_args`` key holding kvforge's per-request choices.
EXTRA_ARGS_KEY = "kvforge"
#: The choice keys a request may set.
CHOICE_KEYS = ("drafter", "eviction_hint")
NO_DRAFTER = "none"


def get_choice(obj: Any, key: str, default: Any = None) -> Any:
    """A request's (or a SamplingParams') validated choice ``key``, e.g.
    ``get_choice(request, "eviction_hint")``; ``default`` when not chosen."""
    params = getattr(obj, "sampling_params", obj)
    choices = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY) or {}
    return choices.get(key, default)


def _allowed(value: Any, allowed: list[str], field: str, section: str, always: tuple[str, ...] = ()) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{field}: must be a string, got {value!r}")
    if value in always:
        return
    if value not in allowed:
        names = ", ".join(list(allowed) + list(always)) or "(none)"
        raise ValueError(f"{field}: {value!r} is not allowed; allowed values: {names} "
                         f"(set by the operator in {section})")


def validate_request_choices(config: "EngineConfig", registry: "Registry", params: Any, priority: int) -> None:
    """Validate a request's choices against ``config.request_choices``; changes nothing.

    Raises:
        ValueError: naming the field (``extra_args.kvforge.drafter``, ``priority``...)
            and the allowed values.
    """
    rc = config.request_choices
    raw = (getattr(params, "extra_args", None) or {}).get(EXTRA_ARGS_KEY)
    if raw is not None:
        if not isinstance(raw, dict):
            raise ValueError(f"extra_args.{EXTRA_ARGS_KEY}: must be a dict of per-request choices "
                             f"({', '.join(CHOICE_KEYS)}), got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(CHOICE_KEYS))
        if unknown:
            raise ValueError(f"extra_args.{EXTRA_ARGS_KEY}: unknown choice(s) {unknown}; known: "
                             f"{', '.join(CHOICE_KEYS)}")
        if "drafter" in raw:
            name = raw["drafter"]
            _allowed(name, rc.drafters, f"extra_args.{EXTRA_ARGS_KEY}.drafter", "request_choices.drafters",
                     (NO_DRAFTER,))
            if name != NO_DRAFTER:
                try:
                    registry.get("drafter", name)
                except ValueError as e:
                    raise ValueError(f"extra_args.{EXTRA_ARGS_KEY}.drafter: {e}") from None
        if "eviction_hint" in raw:
            _allowed(raw["eviction_hint"], rc.eviction_hints, f"extra_args.{EXTRA_ARGS_KEY}.eviction_hint",
                     "request_choices.eviction_hints")
    # (always: a priority scheduler compares them, and one bad value would break every later step)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority: must be an integer, got {priority!r}")
    if priority != 0:  # as vLLM: a priority the scheduler would silently ignore is refused
        sched = registry.get("scheduler", config.scheduler.name)
        if ignores_priority(sched):
            raise ValueError(f"priority: {priority} was given, but {describe(sched)} ignores request priority "
                             f"(it declares priorities=False); send 0, or serve with a scheduler that honours "
                             f"it (scheduler.name: priority)")
    if rc.priorities is not None:
        lo, hi = rc.priorities
        if not lo <= priority <= hi:
            raise ValueError(f"priority: {priority} is outside the allowed range [{lo}, {hi}] "
                             f"(set by the operator in request_choices.priorities)")
