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
import inspect
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pluggy
from pydantic import BaseModel

from kvforge import hookspecs
from kvforge.hookspecs import HOOK_KINDS, KVFORGE_HOOK_API, PROJECT_NAME

ENTRY_POINT_GROUP = "kvforge.plugins"

log = logging.getLogger("kvforge")


class PluginError(RuntimeError):
    """A plugin could not be loaded, registered or built (API mismatch, duplicate name, bad
    hook, a hook that raised, a bad settings model, a factory that cannot be called as its
    hook spec says or returns the wrong kind of object)."""


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
        #: (plugin, distribution, error) of each plugin left out by ``load_registry(keep_going=True)``
        self.broken: list[tuple[str, str, str]] = []

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
            filters = [f"{var}={os.environ[var]}" for var in ("KVFORGE_PLUGINS", "KVFORGE_DISABLE_PLUGINS")
                       if _env_list(var) is not None]
            why = (f"; {' and '.join(filters)} limit which plugins load" if filters else
                   f" (a plugin is found through the {ENTRY_POINT_GROUP!r} entry-point group of an installed "
                   f"distribution: `kvforge plugins` lists what loaded)")
            raise ValueError(f"unknown {kind} {name!r}; registered {kind}s: {known}{why}")
        return table[name]

    def names(self, kind: str) -> list[str]:
        return sorted(self._specs[kind])

    def all(self) -> Iterable[PluginSpec]:
        for table in self._specs.values():
            yield from table.values()

    def drop_plugin(self, plugin: str) -> None:
        """Forget everything the plugin (entry-point name) registered."""
        for table in self._specs.values():
            for name in [n for n, spec in table.items() if spec.plugin == plugin]:
                del table[name]
        self.loaded_plugins = [p for p in self.loaded_plugins if p[0] != plugin]


def _env_list(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return {x.strip() for x in raw.split(",") if x.strip()}


def enabled_entry_points() -> list[md.EntryPoint]:
    """The installed entry points of group ``kvforge.plugins`` that ``KVFORGE_PLUGINS`` (an
    allow list, comma-separated names) and ``KVFORGE_DISABLE_PLUGINS`` (a block list) leave:
    the plugins the plugin manager would load. Nothing is imported."""
    eps = md.entry_points(group=ENTRY_POINT_GROUP)
    allow = _env_list("KVFORGE_PLUGINS")
    block = _env_list("KVFORGE_DISABLE_PLUGINS") or set()
    return [ep for ep in eps if (allow is None or ep.name in allow) and ep.name not in block]


def _check_api(name: str, dist: str, obj: Any) -> str:
    api = getattr(obj, "KVFORGE_HOOK_API", None)
    if api is None and inspect.isfunction(obj):  # e.g. "mod:kvforge_register_schedulers"
        raise PluginError(
            f"plugin {name!r} (distribution {dist}): its entry point names the function "
            f"{obj.__module__}.{obj.__qualname__}; it must name the plugin module, e.g. "
            f"{name} = \"{obj.__module__}\" under [project.entry-points.\"{ENTRY_POINT_GROUP}\"]"
        )
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


def load_registry(extra_plugins: Iterable[tuple[str, Any]] = (), *, keep_going: bool = False) -> Registry:
    """Discover plugins, validate them, run every ``kvforge_register_*`` hook once.

    A plugin that implements no hook at all (a hook function without ``@kvforge.hookimpl``)
    is loaded but logged as a warning naming it: it provides nothing.

    Args:
        extra_plugins: ``(name, module_or_object)`` pairs registered in addition to
            the entry points (for tests and embedding); they obey the same checks.
        keep_going: leave a broken plugin out (with everything it registered) and record
            it in ``Registry.broken`` instead of raising: ``kvforge plugins`` uses this, so
            the command that diagnoses an installation works while one plugin is broken.

    Raises:
        PluginError: (unless ``keep_going``) API mismatch, a hook implementation with no
            matching spec, a name registered twice, a ``settings_model`` that is not a pydantic
            model class, or an exception raised inside a plugin's hook (naming the plugin, its
            distribution and the hook; the original exception is chained as ``__cause__``).
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    meta: dict[str, tuple[str, str, str]] = {}
    registry = Registry()

    def fail(name: str, dist: str, err: PluginError) -> None:
        if not keep_going:
            raise err
        registry.broken.append((name, dist, str(err)))

    candidates: list[tuple[str, Any, str, str]] = []
    for ep in enabled_entry_points():
        dist = ep.dist.name if ep.dist is not None else "unknown"
        version = ep.dist.version if ep.dist is not None else "unknown"
        try:
            obj = ep.load()
        except (Exception, SystemExit) as e:  # surface the plugin name, keep the cause
            # (SystemExit too: a module that calls sys.exit() would end every kvforge command)
            err = PluginError(f"plugin {ep.name!r} (distribution {dist}) failed to import: "
                              f"{type(e).__name__}: {e} (KVFORGE_DISABLE_PLUGINS={ep.name} skips it; "
                              f"or uninstall {dist})")
            err.__cause__ = e
            fail(ep.name, dist, err)
            continue
        candidates.append((ep.name, obj, dist, version))
    for name, obj in extra_plugins:
        candidates.append((name, obj, "<in-process>", "0"))

    for name, obj, dist, version in candidates:
        try:
            api = _register(pm, name, obj, dist)
        except PluginError as e:
            fail(name, dist, e)
            continue
        if not pm.get_hookcallers(obj):
            _warn_registers_nothing(name, dist, version, obj)
        meta[name] = (dist, version, api)
        registry.loaded_plugins.append((name, dist, version, api))

    for hook_name, kind in HOOK_KINDS.items():
        caller = getattr(pm.hook, hook_name)
        for impl in caller.get_hookimpls():
            if impl.plugin_name not in meta:
                continue  # left out (keep_going) after an earlier hook of it failed
            dist, version, api = meta[impl.plugin_name]

            def register(name: str, factory: Callable[..., Any], settings_model: type | None = None,
                         _kind: str = kind, _impl=impl, _dist=dist, _ver=version, _api=api, _hook=hook_name,
                         **capabilities: Any) -> None:
                if "settings" in capabilities:  # (it would pass as an unknown capability, the model unused)
                    raise PluginError(f"plugin {_impl.plugin_name!r} (distribution {_dist} {_ver}) registers "
                                      f"{_kind} {name!r} with settings=...; the keyword is settings_model=")
                spec = PluginSpec(_kind, name, factory, settings_model, _impl.plugin_name, _dist, _ver, _api,
                                  dict(capabilities))
                _check_settings_model(spec, _hook)
                if _kind == "attention":
                    _check_attention_class(spec)
                registry.add(spec)

            try:
                impl.function(register=register)
            except (Exception, SystemExit) as e:
                if isinstance(e, PluginError):
                    err = e  # raised by ``register`` itself: already names the plugin (and the other one)
                else:
                    # Without this the CLI prints only the plugin's own message ("boom"), and the
                    # user cannot tell which installed package is broken; a SystemExit would end
                    # every command with no message at all.
                    err = PluginError(f"plugin {impl.plugin_name!r} (distribution {dist} {version}) raised in its "
                                      f"{hook_name} hook: {type(e).__name__}: {e}")
                    err.__cause__ = e
                if not keep_going:
                    raise err
                registry.drop_plugin(impl.plugin_name)
                del meta[impl.plugin_name]
                fail(impl.plugin_name, dist, err)
    return registry


def _register(pm: pluggy.PluginManager, name: str, obj: Any, dist: str) -> str:
    """Register one plugin object with pluggy after its API check; returns its declared hook
    API. Raises PluginError, leaving nothing of it registered."""
    api = _check_api(name, dist, obj)
    if pm.get_plugin(name) is not None:
        raise PluginError(f"two plugins share the entry-point name {name!r} (one is from {dist})")
    try:
        pm.register(obj, name=name)
    except pluggy.PluginValidationError as e:
        raise PluginError(f"plugin {name!r} (distribution {dist}) has an invalid hook implementation: {e}") from e
    try:
        pm.check_pending()  # per plugin, so an unknown hook names the plugin that has it
    except pluggy.PluginValidationError as e:
        pm.unregister(obj)
        raise PluginError(f"plugin {name!r} (distribution {dist}) implements a hook kvforge does not define: "
                          f"{e}") from e
    return api


def _check_attention_class(spec: PluginSpec) -> None:
    """An attention backend registers its class: ``auto`` calls ``cls.validate(req, device)``
    before building anything, then the engine calls ``cls(settings)``."""
    who = describe_plugin(spec)
    if not inspect.isclass(spec.factory):
        raise PluginError(f"{who}: registers a {type(spec.factory).__name__}; an attention backend registers its "
                          "AttentionBackend subclass itself (the engine calls cls.validate(req, device), then "
                          "cls(settings))")
    if not isinstance(inspect.getattr_static(spec.factory, "validate", None), (classmethod, staticmethod)):
        raise PluginError(f"{who}: {spec.factory.__qualname__}.validate must be a @classmethod (it is called "
                          "on the class, before any instance exists)")


def _warn_registers_nothing(name: str, dist: str, version: str, obj: Any) -> None:
    """A module that implements no hook loads fine and provides nothing, which otherwise only
    shows up later as an "unknown scheduler" far from its cause; the usual reason is a hook
    function written without the decorator, so name those."""
    undecorated = sorted(a for a in dir(obj) if a in HOOK_KINDS)
    where = f" (not decorated: {', '.join(undecorated)})" if undecorated else ""
    log.warning("plugin %r (distribution %s %s) registered nothing; did you forget @kvforge.hookimpl?%s",
                name, dist, version, where)


def _check_settings_model(spec: PluginSpec, hook_name: str) -> None:
    """Refuse a ``settings_model`` that is not a pydantic model class at registration: the
    engine calls ``settings_model.model_validate`` on every build, so anything else would make
    each build fail later with an AttributeError that names neither the plugin nor the field.

    Raises:
        PluginError: naming the plugin, its distribution, the hook and ``settings_model``.
    """
    model = spec.settings_model
    if model is None or (isinstance(model, type) and issubclass(model, BaseModel)):
        return
    got = f"the class {model.__qualname__}" if isinstance(model, type) else f"{type(model).__name__} {model!r:.80}"
    raise PluginError(f"plugin {spec.plugin!r} (distribution {spec.distribution} {spec.version}), {hook_name}: "
                      f"{spec.kind} {spec.name!r} was registered with settings_model={got}, which is not a "
                      f"pydantic BaseModel subclass; pass the model class itself (class MySettings(BaseModel)), "
                      f"or settings_model=None if it takes no settings")


#: kind -> (its interface in ``kvforge.interfaces``, how the engine calls the registered factory).
FACTORY_CONTRACTS: dict[str, tuple[str, str]] = {
    "model": ("Model", "factory(hf_config, ctx: ModelContext)"),
    "kv_allocator": ("KVAllocator", "factory(num_blocks, block_size, settings, cache_config)"),
    "scheduler": ("Scheduler", "factory(scheduler_config, allocator, settings, ctx: SchedulerContext)"),
    "attention": ("AttentionBackend", "cls(settings), cls being the registered AttentionBackend subclass"),
    "quantizer": ("QuantizationConfig", "factory(hf_quant_config: dict | None, settings)"),
    "drafter": ("Drafter", "factory(speculative_config, settings, ctx: DrafterContext)"),
}


def describe_plugin(spec: PluginSpec) -> str:
    """``kind 'name' (plugin P, distribution D V)``: how every error names a plugin."""
    return f"{spec.kind} {spec.name!r} (plugin {spec.plugin}, distribution {spec.distribution} {spec.version})"


def validate_backend(spec: PluginSpec, req: Any, device: Any) -> list[str]:
    """An attention backend's ``validate(req, device)``: the reasons it cannot run (empty: it can).

    ``auto`` asks every installed backend, so a crash there (an exception, ``sys.exit()``)
    would stop engines that never chose that backend; it becomes an error naming the plugin.

    Raises:
        PluginError: ``validate`` raised, called ``sys.exit()``, or returned a string instead
            of a list of reasons.
    """
    try:
        reasons = spec.factory.validate(req, device)
    except PluginError:
        raise
    except (Exception, SystemExit) as e:
        raise PluginError(f"{describe_plugin(spec)}: its validate() raised {type(e).__name__}: {e}") from e
    if isinstance(reasons, str):
        raise PluginError(f"{describe_plugin(spec)}: its validate() returned the string {reasons!r}; it must "
                          "return a list of reasons (empty when the backend can run)")
    return list(reasons or [])


def build_plugin(spec: PluginSpec, *args: Any) -> Any:
    """Call ``spec.factory(*args)`` (the arguments of its kind's hook spec) and check that it
    returned an instance of its kind's interface (:data:`FACTORY_CONTRACTS`).

    Every kind's interface is an ABC that the engine calls methods of right away, so an object
    of another type (``None`` from a factory that forgot ``return``) is refused here rather
    than failing on its first use, far from the plugin that caused it.

    Raises:
        PluginError: naming the plugin, its distribution, the kind and what was expected, when
            the call itself raises TypeError (a factory whose parameters do not match the hook
            spec, or one that is not callable) or the result is not an instance of the interface.
        Exception: whatever the factory's own code raises passes through with its type and
            traceback (a quantizer refusing a checkpoint raises its own ValueError), plus a note
            (``add_note``) naming the plugin, which the CLI prints under the message.
    """
    import kvforge.interfaces as interfaces  # not at import time: kvforge.interfaces imports torch
    iface_name, call = FACTORY_CONTRACTS[spec.kind]
    who = describe_plugin(spec)
    try:
        obj = spec.factory(*args)
    except SystemExit as e:  # (not an error the engine can report: it would end the process)
        raise PluginError(f"{who}: its factory called sys.exit({e.code!r})") from e
    except TypeError as e:
        # Binding the arguments fails before any frame of the factory starts, so the traceback
        # ends here; a TypeError from inside the factory has the factory's frame after this one.
        if e.__traceback__ is not None and e.__traceback__.tb_next is not None:
            e.add_note(f"kvforge: raised while building {who}")
            raise
        raise PluginError(f"{who}: its factory cannot be called as the engine calls it, "
                          f"{call} ({len(args)} positional arguments): {e}") from e
    except Exception as e:  # the plugin's own error, unchanged but for a note naming the plugin
        e.add_note(f"kvforge: raised while building {who}")
        raise
    iface = getattr(interfaces, iface_name)
    if not isinstance(obj, iface):
        got = ("None" if obj is None else
               f"the class {obj.__module__}.{obj.__qualname__} itself, not an instance" if isinstance(obj, type) else
               f"a {type(obj).__module__}.{type(obj).__qualname__}")
        raise PluginError(f"{who}: its factory returned {got}, expected an instance of "
                          f"kvforge.interfaces.{iface_name} ({call} must return one)")
    return obj
