"""Plugin discovery and the registry of named factories.

Plugins are Python modules (or objects) exposed through the entry-point group
``kvforge.plugins``. Built-in plugins are listed there exactly like third-party
ones; the core never imports ``kvforge_plugins``.

Environment:
    KVFORGE_PLUGINS          comma-separated allow-list of entry-point names
                             (only these load; unset = all).
    KVFORGE_DISABLE_PLUGINS  comma-separated block-list of entry-point names.
"""
from __future__ import annotations

import importlib.metadata as md
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy

from kvforge import hookspecs
from kvforge.hookspecs import HOOK_KINDS, KVFORGE_HOOK_API, PROJECT_NAME

ENTRY_POINT_GROUP = "kvforge.plugins"


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered (API mismatch, duplicate name, bad hook)."""


@dataclass(frozen=True)
class PluginSpec:
    """One registered thing: a scheduler, a model class, an attention backend...

    Attributes:
        kind: one of ``HOOK_KINDS.values()``.
        name: the name used in config (``scheduler.name: fcfs``).
        factory: callable building the object (signature per hook spec).
        settings_model: pydantic model (``extra="forbid"``) for this plugin's
            ``settings`` section, or None if it takes none.
        plugin: entry-point name of the plugin module that registered it.
        distribution / version: the installed distribution providing it.
        hook_api: the KVFORGE_HOOK_API the plugin declared.
        capabilities: free-form declarations (``priority``, ``dtypes``, ...).
    """

    kind: str
    name: str
    factory: Callable[..., Any]
    settings_model: type | None
    plugin: str
    distribution: str
    version: str
    hook_api: str
    capabilities: dict[str, Any] = field(default_factory=dict)


class Registry:
    """Everything the loaded plugins registered, keyed by kind then name."""

    def __init__(self) -> None:
        self._specs: dict[str, dict[str, PluginSpec]] = {k: {} for k in HOOK_KINDS.values()}
        self.loaded_plugins: list[tuple[str, str, str, str]] = []  # (plugin, dist, version, api)

    def add(self, spec: PluginSpec) -> None:
        table = self._specs[spec.kind]
        if spec.name in table:
            old = table[spec.name]
            raise PluginError(
                f"{spec.kind} {spec.name!r} is registered twice: by plugin {old.plugin!r} "
                f"(distribution {old.distribution} {old.version}) and by plugin {spec.plugin!r} "
                f"(distribution {spec.distribution} {spec.version}). Uninstall one, or block one "
                f"with KVFORGE_DISABLE_PLUGINS."
            )
        table[spec.name] = spec

    def get(self, kind: str, name: str) -> PluginSpec:
        """Return the spec for ``name``; raise ValueError listing the known names otherwise."""
        table = self._specs[kind]
        if name not in table:
            known = ", ".join(sorted(table)) or "(none)"
            raise ValueError(f"unknown {kind} {name!r}; registered {kind}s: {known}")
        return table[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self._specs[kind])

    def all(self) -> Iterable[PluginSpec]:
        for table in self._specs.values():
            yield from table.values()


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return {x.strip() for x in raw.split(",") if x.strip()}


def _iter_entry_points() -> list[md.EntryPoint]:
    eps = md.entry_points(group=ENTRY_POINT_GROUP)
    allow = _env_list("KVFORGE_PLUGINS")
    block = _env_list("KVFORGE_DISABLE_PLUGINS") or set()
    return [ep for ep in eps if (allow is None or ep.name in allow) and ep.name not in block]


def _check_api(name: str, dist: str, obj: Any) -> str:
    api = getattr(obj, "KVFORGE_HOOK_API", None)
    if api is None:
        raise PluginError(
            f"plugin {name!r} (distribution {dist}) does not declare KVFORGE_HOOK_API; "
            f"add KVFORGE_HOOK_API = {KVFORGE_HOOK_API!r} to the module"
        )
    if str(api).split(".")[0] != KVFORGE_HOOK_API.split(".")[0]:
        raise PluginError(
            f"plugin {name!r} (distribution {dist}) targets kvforge hook API {api}, but this "
            f"kvforge provides hook API {KVFORGE_HOOK_API}; upgrade the plugin or kvforge"
        )
    return str(api)


def load_registry(extra_plugins: Iterable[tuple[str, Any]] = ()) -> Registry:
    """Discover plugins, validate them, run every ``kvforge_register_*`` hook once.

    Args:
        extra_plugins: ``(name, module_or_object)`` pairs registered in addition to
            the entry points (for tests and embedding); they obey the same checks.

    Raises:
        PluginError: API mismatch, a hook implementation with no matching spec,
            or a name registered twice.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    meta: dict[str, tuple[str, str, str]] = {}
    registry = Registry()

    candidates: list[tuple[str, Any, str, str]] = []
    for ep in _iter_entry_points():
        dist = ep.dist.name if ep.dist is not None else "unknown"
        version = ep.dist.version if ep.dist is not None else "unknown"
        try:
            obj = ep.load()
        except Exception as e:  # surface the plugin name, keep the cause
            raise PluginError(f"plugin {ep.name!r} (distribution {dist}) failed to import: {e}") from e
        candidates.append((ep.name, obj, dist, version))
    for name, obj in extra_plugins:
        candidates.append((name, obj, "<in-process>", "0"))

    for name, obj, dist, version in candidates:
        api = _check_api(name, dist, obj)
        if pm.get_plugin(name) is not None:
            raise PluginError(f"two plugins share the entry-point name {name!r} (one is from {dist})")
        try:
            pm.register(obj, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin {name!r} (distribution {dist}) has an invalid hook implementation: {e}") from e
        meta[name] = (dist, version, api)
        registry.loaded_plugins.append((name, dist, version, api))
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        raise PluginError(f"a plugin implements a hook kvforge does not define: {e}") from e

    for hook_name, kind in HOOK_KINDS.items():
        caller = getattr(pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            dist, version, api = meta[impl.plugin_name]

            def register(name: str, factory: Callable[..., Any], settings_model: type | None = None,
                         _kind: str = kind, _impl=impl, _dist=dist, _ver=version, _api=api,
                         **capabilities: Any) -> None:
                registry.add(PluginSpec(_kind, name, factory, settings_model, _impl.plugin_name,
                                        _dist, _ver, _api, dict(capabilities)))

            impl.function(register=register)
    return registry
