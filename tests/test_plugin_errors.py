"""Plugin mistakes are reported where they happen, naming the plugin and its distribution:
a register hook that raises, a settings model that is not a pydantic model, a module that
implements no hook (forgot ``@kvforge.hookimpl``), a factory with the wrong arguments or
one returning the wrong object, and ``--kvforge-settings`` for a plugin not under test."""
from __future__ import annotations

import logging
import types

import pytest
import torch

import kvforge
import kvforge.plugin_manager as plugin_manager
from helpers import FakePytestConfig, STORIES_MODEL
from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.entrypoints.cli import main as cli_main
from kvforge.plugin_manager import FACTORY_CONTRACTS, PluginError, PluginSpec, build_plugin, load_registry
from kvforge_plugins.attention.torch_ref import TorchRefBackend
from kvforge_plugins.kv_cache.paged import PagedSettings, make_paged
from kvforge_plugins.schedulers.base import QueueSettings
from kvforge_plugins.schedulers.fcfs import make_fcfs


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("KVFORGE_PLUGINS", raising=False)
    monkeypatch.delenv("KVFORGE_DISABLE_PLUGINS", raising=False)


def _module(name: str, **hooks) -> types.ModuleType:
    """A plugin module; ``hooks`` maps hook names to functions, decorated with hookimpl."""
    mod = types.ModuleType(name)
    mod.KVFORGE_HOOK_API = kvforge.KVFORGE_HOOK_API
    for hook, fn in hooks.items():
        fn.__name__ = hook
        setattr(mod, hook, kvforge.hookimpl(fn))
    return mod


def _registering(name: str, hook: str, *registrations: tuple) -> types.ModuleType:
    """A plugin whose ``hook`` calls ``register(*args)`` for each of ``registrations``."""
    def impl(register):
        for args in registrations:
            register(*args)
    return _module(name, **{hook: impl})


# -- 1. a register hook that raises ----------------------------------------------------------

def test_hook_that_raises_names_plugin_distribution_and_hook():
    def hook(register):
        raise RuntimeError("boom in hook")
    with pytest.raises(PluginError) as ei:
        load_registry(extra_plugins=[("boom_plugin", _module("boom_plugin", kvforge_register_schedulers=hook))])
    msg = str(ei.value)
    for part in ("'boom_plugin'", "distribution <in-process>", "kvforge_register_schedulers", "RuntimeError",
                 "boom in hook"):
        assert part in msg, f"{part!r} not in: {msg}"
    assert isinstance(ei.value.__cause__, RuntimeError) and str(ei.value.__cause__) == "boom in hook"


class _FakeDist:
    name, version = "acme-boom", "1.2"


class _FakeEntryPoint:
    """What load_registry reads of an importlib.metadata entry point."""

    def __init__(self, name: str, obj) -> None:
        self.name, self.dist, self._obj = name, _FakeDist(), obj

    def load(self):
        return self._obj


def test_cli_error_for_a_raising_hook_names_the_installed_distribution(monkeypatch, capsys):
    """The user's report: `kvforge plugins` printed only `kvforge: error: boom in hook`."""
    def hook(register):
        raise ValueError("boom in hook")
    ep = _FakeEntryPoint("boom", _module("boom", kvforge_register_kv_allocators=hook))
    monkeypatch.setattr(plugin_manager, "enabled_entry_points", lambda: [ep])
    assert cli_main(["plugins"]) == 1  # the listing still runs; the status says something is broken
    err = capsys.readouterr().err
    assert ("broken plugin 'boom' (distribution acme-boom), left out: plugin 'boom' (distribution acme-boom 1.2) "
            "raised in its kvforge_register_kv_allocators hook: ValueError: boom in hook") in err, err
    with pytest.raises(PluginError, match="raised in its kvforge_register_kv_allocators hook"):
        load_registry()  # an engine, unlike the listing, refuses to start


def test_sys_exit_in_a_hook_or_at_import_is_a_plugin_error(monkeypatch, capsys):
    """Before: a plugin calling sys.exit() ended every kvforge command with rc 1 and no message."""
    def hook(register):
        raise SystemExit(3)
    with pytest.raises(PluginError, match=r"'exits' \(distribution <in-process> 0\) raised in its "
                                          r"kvforge_register_schedulers hook: SystemExit: 3"):
        load_registry(extra_plugins=[("exits", _module("exits", kvforge_register_schedulers=hook))])

    class _ExitOnImport(_FakeEntryPoint):
        def load(self):
            raise SystemExit("cannot run here")
    monkeypatch.setattr(plugin_manager, "enabled_entry_points", lambda: [_ExitOnImport("exits_early", None)])
    assert cli_main(["plugins"]) == 1
    err = capsys.readouterr().err
    assert ("plugin 'exits_early' (distribution acme-boom) failed to import: SystemExit: cannot run here") in err, err
    assert "KVFORGE_DISABLE_PLUGINS=exits_early skips it" in err, err


def test_duplicate_name_error_is_not_rewrapped():
    """register()'s own PluginError (a duplicate name) keeps naming both plugins."""
    dup = _registering("dup_plugin", "kvforge_register_schedulers", ("fcfs", make_fcfs, QueueSettings))
    with pytest.raises(PluginError, match="registered twice") as ei:
        load_registry(extra_plugins=[("dup_plugin", dup)])
    assert "raised in its" not in str(ei.value)


# -- 3. settings models ----------------------------------------------------------------------

class _NotPydantic:
    a: int = 1


@pytest.mark.parametrize("settings_model, shown", [(_NotPydantic, "the class _NotPydantic"), (dict, "the class dict"),
                                                   (QueueSettings(), "QueueSettings")])
def test_settings_model_that_is_not_a_pydantic_class_is_refused_at_registration(settings_model, shown):
    bad = _registering("bad_settings", "kvforge_register_schedulers", ("bad_sched", make_fcfs, settings_model))
    with pytest.raises(PluginError) as ei:
        load_registry(extra_plugins=[("bad_settings", bad)])
    msg = str(ei.value)
    for part in ("'bad_settings'", "<in-process>", "kvforge_register_schedulers", "scheduler 'bad_sched'",
                 "settings_model=", shown, "pydantic BaseModel"):
        assert part in msg, f"{part!r} not in: {msg}"


def test_pydantic_settings_models_and_none_are_accepted():
    ok = _registering("ok_settings", "kvforge_register_schedulers", ("with_model", make_fcfs, QueueSettings),
                      ("without_model", make_fcfs, None))
    reg = load_registry(extra_plugins=[("ok_settings", ok)])
    assert reg.get("scheduler", "with_model").settings_model is QueueSettings
    assert reg.get("scheduler", "without_model").settings_model is None


# -- 4. a module that implements no hook -----------------------------------------------------

def test_plugin_without_hookimpl_logs_a_warning(caplog):
    mod = types.ModuleType("forgetful")
    mod.KVFORGE_HOOK_API = kvforge.KVFORGE_HOOK_API

    def kvforge_register_schedulers(register):  # no @kvforge.hookimpl: pluggy never sees it
        register("forgotten", make_fcfs, QueueSettings)
    mod.kvforge_register_schedulers = kvforge_register_schedulers
    with caplog.at_level(logging.WARNING, logger="kvforge"):
        reg = load_registry(extra_plugins=[("forgetful", mod)])
    assert "forgotten" not in reg.names("scheduler")
    msgs = [r.getMessage() for r in caplog.records if "registered nothing" in r.getMessage()]
    assert len(msgs) == 1, [r.getMessage() for r in caplog.records]
    for part in ("plugin 'forgetful'", "<in-process>", "registered nothing; did you forget @kvforge.hookimpl?",
                 "kvforge_register_schedulers"):
        assert part in msgs[0], f"{part!r} not in: {msgs[0]}"


def test_builtin_plugins_and_a_hook_registering_nothing_do_not_warn(caplog):
    """Only a module implementing no hook warns: a hook that registers nothing on this
    machine (say, a CUDA-only plugin) is legitimate."""
    quiet = _module("quiet", kvforge_register_schedulers=lambda register: None)
    with caplog.at_level(logging.WARNING, logger="kvforge"):
        load_registry(extra_plugins=[("quiet", quiet)])
    assert not [r for r in caplog.records if "registered nothing" in r.getMessage()]


# -- 2. factories: arity and return type -----------------------------------------------------

def _three_arg_allocator(num_blocks, block_size, settings):
    raise AssertionError("never called with three arguments")


def _none_scheduler(scheduler_config, allocator, settings, ctx):
    return None


@pytest.fixture(scope="module")
def factory_registry():
    alloc = _registering("arity_plugin", "kvforge_register_kv_allocators",
                         ("three_arg", _three_arg_allocator, PagedSettings))
    sched = _registering("none_plugin", "kvforge_register_schedulers", ("returns_none", _none_scheduler, QueueSettings))
    return load_registry(extra_plugins=[("arity_plugin", alloc), ("none_plugin", sched)])


def _engine(registry, **overrides):
    torch.set_num_threads(1)
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "num_gpu_blocks": 16, **overrides})
    return LLMEngine(cfg, registry=registry)


def test_allocator_factory_with_wrong_arity_names_plugin_and_signature(factory_registry):
    with pytest.raises(PluginError) as ei:
        _engine(factory_registry, kv_allocator="three_arg")
    msg = str(ei.value)
    for part in ("kv_allocator 'three_arg'", "plugin arity_plugin", "distribution <in-process>",
                 "factory(num_blocks, block_size, settings, cache_config)", "4 positional arguments",
                 "takes 3 positional arguments but 4 were given"):
        assert part in msg, f"{part!r} not in: {msg}"
    assert isinstance(ei.value.__cause__, TypeError)


def test_scheduler_factory_returning_none_fails_at_build(factory_registry):
    """Before: the engine was built and the first request failed with
    AttributeError: 'NoneType' object has no attribute 'admission_error'."""
    with pytest.raises(PluginError) as ei:
        _engine(factory_registry, scheduler="returns_none")
    msg = str(ei.value)
    for part in ("scheduler 'returns_none'", "plugin none_plugin", "distribution <in-process>", "returned None",
                 "expected an instance of kvforge.interfaces.Scheduler"):
        assert part in msg, f"{part!r} not in: {msg}"


def _spec(kind: str, factory) -> PluginSpec:
    return PluginSpec(kind, "x", factory, None, "unit_plugin", "acme", "1.0", "1")


@pytest.mark.parametrize("kind", sorted(FACTORY_CONTRACTS))
def test_every_kind_checks_its_interface(kind):
    iface = FACTORY_CONTRACTS[kind][0]
    with pytest.raises(PluginError, match=rf"{kind} 'x' \(plugin unit_plugin, distribution acme 1.0\): its factory "
                                          rf"returned a builtins.object, expected an instance of "
                                          rf"kvforge.interfaces.{iface}"):
        build_plugin(_spec(kind, lambda *a: object()), 1, 2)


def test_attention_class_with_wrong_init_and_non_backend_class():
    class NoSettings(TorchRefBackend):
        def __init__(self) -> None:
            super().__init__(None)

    with pytest.raises(PluginError, match=r"cannot be called as the engine calls it, cls\(settings\)"):
        build_plugin(_spec("attention", NoSettings), None)
    assert isinstance(build_plugin(_spec("attention", TorchRefBackend), None), TorchRefBackend)
    with pytest.raises(PluginError, match="expected an instance of kvforge.interfaces.AttentionBackend"):
        build_plugin(_spec("attention", _NotPydantic))


def test_type_error_inside_a_factory_passes_through_unwrapped():
    """Only a call that cannot bind is the plugin's signature mistake; a TypeError from the
    factory's own code keeps its type and traceback."""
    def factory(num_blocks, block_size, settings, cache_config):
        return len(num_blocks)  # TypeError: object of type 'int' has no len()

    with pytest.raises(TypeError, match="has no len") as ei:
        build_plugin(_spec("kv_allocator", factory), 4, 16, None, None)
    assert not isinstance(ei.value, PluginError)


def test_factory_calling_sys_exit_is_a_plugin_error():
    def factory(num_blocks, block_size, settings, cache_config):
        raise SystemExit(0)
    with pytest.raises(PluginError, match=r"kv_allocator 'x' \(plugin unit_plugin.*its factory called sys.exit\(0\)"):
        build_plugin(_spec("kv_allocator", factory), 4, 16, None, None)


def test_drafter_factory_returning_none_fails_at_build():
    """The drafter builder went around build_plugin: a drafter factory returning None failed
    later, on its first use, with an AttributeError naming no plugin."""
    reg = load_registry(extra_plugins=[("none_drafter_plugin", _registering(
        "none_drafter_plugin", "kvforge_register_drafters", ("none_drafter", lambda cfg, settings, ctx: None)))])
    with pytest.raises(PluginError, match=r"drafter 'none_drafter' \(plugin none_drafter_plugin.*returned None"):
        _engine(reg, speculative="none_drafter", num_speculative_tokens=2)


class _ExitingValidate(TorchRefBackend):
    @classmethod
    def validate(cls, req, device):
        raise SystemExit("validate exit")


class _RaisingValidate(TorchRefBackend):
    @classmethod
    def validate(cls, req, device):
        return {}["missing"]


class _StringValidate(TorchRefBackend):
    @classmethod
    def validate(cls, req, device):
        return "no GPU here"


@pytest.mark.parametrize("backend, shown", [(_ExitingValidate, "raised SystemExit: validate exit"),
                                            (_RaisingValidate, "raised KeyError: 'missing'"),
                                            (_StringValidate, "returned the string 'no GPU here'")])
def test_attention_validate_that_crashes_is_a_plugin_error_under_auto(backend, shown):
    """``auto`` asks every installed backend: one that crashed in validate() stopped engines that
    never chose it, with nothing naming it (a sys.exit gave rc 1 and a bare message)."""
    reg = load_registry(extra_plugins=[("crashy_attn", _registering(
        "crashy_attn", "kvforge_register_attention_backends", ("crashy", backend)))])
    with pytest.raises(PluginError, match=r"attention 'crashy' \(plugin crashy_attn.*its validate\(\) "
                                          + shown.replace("(", r"\(")):
        _engine(reg)  # attention.backend: auto


def test_drafter_conformance_suite_reports_a_none_factory_as_the_engine_does():
    from kvforge.testing.drafter import check_greedy_lossless
    from kvforge.testing.harness import Target
    reg = load_registry(extra_plugins=[("none_drafter_plugin", _registering(
        "none_drafter_plugin", "kvforge_register_drafters", ("none_drafter", lambda cfg, settings, ctx: None)))])
    with pytest.raises(PluginError, match=r"drafter 'none_drafter' \(plugin none_drafter_plugin.*returned None"):
        check_greedy_lossless(Target("drafter", "none_drafter", reg, STORIES_MODEL, "cpu"))


def test_settings_model_calling_sys_exit_is_a_plugin_error():
    from pydantic import BaseModel, field_validator

    from kvforge.engine.resolve import validate_plugin_settings

    class Exiting(BaseModel):
        x: int = 0

        @field_validator("x")
        @classmethod
        def _exit(cls, v):
            raise SystemExit("settings validator exit")

    spec = PluginSpec("kv_allocator", "x", make_paged, Exiting, "unit_plugin", "acme", "1.0", "1")
    with pytest.raises(PluginError, match=r"kv_allocator 'x' \(plugin unit_plugin.*settings model called sys.exit"):
        validate_plugin_settings(spec, {"x": 7}, "cache.settings")


def test_forkserver_preloads_only_the_enabled_plugins(monkeypatch):
    """A disabled plugin must not be imported anywhere, the CPU workers' forkserver included
    (one that failed at import killed the forkserver: EOFError, no plugin named)."""
    from kvforge.distributed.mp import _plugin_modules
    everything = _plugin_modules()
    assert "kvforge_plugins.schedulers.fcfs" in everything
    monkeypatch.setenv("KVFORGE_DISABLE_PLUGINS", "fcfs")
    assert "kvforge_plugins.schedulers.fcfs" not in _plugin_modules()
    monkeypatch.setenv("KVFORGE_PLUGINS", "paged,llama")
    assert _plugin_modules() == ["kvforge_plugins.kv_cache.paged", "kvforge_plugins.models.llama"]


def test_not_callable_factory_is_a_plugin_error():
    with pytest.raises(PluginError, match="'int' object is not callable"):
        build_plugin(_spec("scheduler", 42), 1, 2, 3, 4)


def test_working_factories_are_returned():
    alloc = build_plugin(_spec("kv_allocator", make_paged), 8, 16, None,
                         EngineConfig.from_sources(None, {"model": STORIES_MODEL}).cache)
    assert alloc.num_blocks == 8


# -- 6. --kvforge-settings for a plugin not under test ---------------------------------------

def test_settings_for_a_plugin_not_under_test_are_a_usage_error():
    from kvforge.testing import pytest_plugin
    cfg = FakePytestConfig(["scheduler:fcfs"], ['scheduler:sjf={"preemption_mode": "swap"}'])
    with pytest.raises(pytest.UsageError) as ei:
        pytest_plugin.pytest_configure(cfg)
    msg = str(ei.value)
    for part in ("--kvforge-settings", "scheduler:sjf is not under test", "scheduler:fcfs"):
        assert part in msg, f"{part!r} not in: {msg}"


def test_settings_without_any_target_are_a_usage_error():
    from kvforge.testing import pytest_plugin
    with pytest.raises(pytest.UsageError, match="no plugin is under test"):
        pytest_plugin.pytest_configure(FakePytestConfig([], ['scheduler:sjf={"preemption_mode": "swap"}']))


def test_settings_for_the_plugin_under_test_are_kept():
    from kvforge.testing import pytest_plugin
    cfg = FakePytestConfig(["scheduler:fcfs", "kv_allocator:paged"], ['scheduler:fcfs={"preemption_mode": "swap"}'])
    pytest_plugin.pytest_configure(cfg)
    assert cfg.stash[pytest_plugin._OPTIONS]["settings"] == {("scheduler", "fcfs"): {"preemption_mode": "swap"}}
