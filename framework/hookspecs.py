"""Hook specifications: every extension point of kvforge.

Each hook receives a ``register(name, factory, settings_model=None, **capabilities)``
callback. A plugin calls it once per thing it provides. Hooks run exactly once,
when an engine is built (:func:`kvforge.plugin_manager.load_registry`); nothing
in ``LLMEngine.step()`` calls pluggy.

A plugin module declares the hook API it targets with a module-level
``KVFORGE_HOOK_API = "1"``; a different major version is refused at load.

Layout and naming follow pytest's ``hookspec.py``: one ``kvforge_register_*``
spec per extension point, documented with what the factory must return.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import pluggy

PROJECT_NAME = "kvforge"
#: Version of the hook and interface contract. Bump the major on breaking changes.
KVFORGE_HOOK_API = "1"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


class RegisterFn(Protocol):
    def __call__(
        self,
        name: str,
        factory: Callable[..., Any],
        settings_model: type | None = None,
        **capabilities: Any,
    ) -> None: ...


@hookspec
def kvforge_register_models(register: RegisterFn) -> None:
    """Register model classes by Hugging Face architecture name
    (``config.json`` ``architectures[0]``, e.g. ``"LlamaForCausalLM"``).

    ``factory(hf_config, ctx) -> kvforge.interfaces.Model`` where ``ctx`` is a
    :class:`kvforge.interfaces.model.ModelContext`.
    """


@hookspec
def kvforge_register_kv_allocators(register: RegisterFn) -> None:
    """Register KV cache allocators, chosen by ``cache.allocator``.

    ``factory(num_blocks, block_size, settings, cache_config) -> kvforge.interfaces.KVAllocator``.
    """


@hookspec
def kvforge_register_schedulers(register: RegisterFn) -> None:
    """Register schedulers, chosen by ``scheduler.name``.

    ``factory(scheduler_config, allocator, settings, ctx: SchedulerContext) -> kvforge.interfaces.Scheduler``.
    """


@hookspec
def kvforge_register_attention_backends(register: RegisterFn) -> None:
    """Register attention backends, chosen by ``attention.backend`` (or ``auto``).

    ``factory`` is a subclass of :class:`kvforge.interfaces.AttentionBackend`;
    the engine calls its classmethod ``validate`` before instantiating it with
    ``factory(settings)``. Capability ``priority`` (int, higher wins) orders
    ``auto`` candidates.
    """


@hookspec
def kvforge_register_quantizers(register: RegisterFn) -> None:
    """Register quantization methods, chosen by the checkpoint's
    ``quantization_config.quant_method`` or ``quantization.method``.

    ``factory(hf_quant_config: dict | None, settings) -> kvforge.interfaces.QuantizationConfig``.
    """


@hookspec
def kvforge_register_drafters(register: RegisterFn) -> None:
    """Register speculative-decoding drafters, chosen by ``speculative.method``.

    ``factory(speculative_config, settings, ctx) -> kvforge.interfaces.Drafter`` where
    ``ctx`` is a :class:`kvforge.interfaces.DrafterContext`. Capability
    ``needs_hidden_states=True``: ``propose`` gets the target's hidden states.
    """


#: Hook name -> plugin kind (the word used in config and ``kvforge plugins``).
HOOK_KINDS: dict[str, str] = {
    "kvforge_register_models": "model",
    "kvforge_register_kv_allocators": "kv_allocator",
    "kvforge_register_schedulers": "scheduler",
    "kvforge_register_attention_backends": "attention",
    "kvforge_register_quantizers": "quantizer",
    "kvforge_register_drafters": "drafter",
}
