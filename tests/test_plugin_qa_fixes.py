"""Plugin mistakes found by session 20's QA passes (a plugin author's first day): a broken
plugin must not stop `kvforge plugins` from listing the rest; an error inside a factory is
printed with the note naming its plugin; an entry point that names a function, a factory that
returns its class, and register(settings=...) each get a message saying what to change."""
from __future__ import annotations

import pytest

import kvforge.plugin_manager as plugin_manager
from helpers import STORIES_MODEL
from kvforge.entrypoints.cli import main as cli_main
from kvforge.plugin_manager import PluginError, PluginSpec, build_plugin, load_registry
from kvforge_plugins.attention.torch_ref import TorchRefBackend
from kvforge_plugins.schedulers.base import QueueSettings
from kvforge_plugins.schedulers.fcfs import make_fcfs
from test_plugin_errors import _FakeEntryPoint, _module, _registering


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("KVFORGE_PLUGINS", raising=False)
    monkeypatch.delenv("KVFORGE_DISABLE_PLUGINS", raising=False)


def test_plugins_command_lists_the_working_plugins_beside_broken_ones(monkeypatch, capsys):
    """A QA report: one broken third-party plugin made `kvforge plugins`, the command that
    diagnoses an installation, fail with nothing listed. Each kind of breakage is left out
    alone, with what it registered before it broke, and named on stderr."""
    def raises_after_one(register):
        register("half_done", make_fcfs, QueueSettings)
        raise ValueError("second registration failed")

    class _BadImport(_FakeEntryPoint):
        def load(self):
            raise ImportError("no module named acme_dep")
    no_api = _module("no_api", kvforge_register_schedulers=lambda register: None)
    del no_api.KVFORGE_HOOK_API
    broken = [_BadImport("bad_import", None),
              _FakeEntryPoint("no_api", no_api),
              _FakeEntryPoint("typo", _module("typo", kvforge_register_schedulerz=lambda register: None)),
              _FakeEntryPoint("half", _module("half", kvforge_register_schedulers=raises_after_one)),
              _FakeEntryPoint("dup", _registering("dup", "kvforge_register_schedulers",
                                                  ("fcfs", make_fcfs, QueueSettings)))]
    real = plugin_manager.enabled_entry_points()
    monkeypatch.setattr(plugin_manager, "enabled_entry_points", lambda: real + broken)
    reg = load_registry(keep_going=True)
    assert sorted(p for p, _, _ in reg.broken) == ["bad_import", "dup", "half", "no_api", "typo"]
    assert "half_done" not in reg.names("scheduler") and "fcfs" in reg.names("scheduler")
    assert reg.get("scheduler", "fcfs").plugin != "dup"  # the built-in keeps its name
    assert not {p for p, *_ in reg.loaded_plugins} & {"half", "dup", "typo", "no_api"}
    assert cli_main(["plugins"]) == 1
    out, err = capsys.readouterr()
    listed = {tuple(line.split()[:2]) for line in out.splitlines()}
    assert {("scheduler", "fcfs"), ("attention", "torch_ref")} <= listed and ("scheduler", "half_done") not in listed
    for part in ("broken plugin 'bad_import'", "ImportError: no module named acme_dep", "broken plugin 'no_api'",
                 "KVFORGE_HOOK_API", "kvforge_register_schedulerz", "broken plugin 'half'",
                 "second registration failed", "registered twice"):
        assert part in err, f"{part!r} not in: {err}"
    monkeypatch.setattr(plugin_manager, "enabled_entry_points", lambda: real)
    assert cli_main(["plugins"]) == 0


def test_cli_prints_the_note_naming_a_plugin_whose_factory_raised(monkeypatch, capsys):
    """A QA finding: a ValueError from inside a plugin's factory printed only its message."""
    def make(config, allocator, settings, ctx):
        return int("3x")
    mod = _registering("acme_sched", "kvforge_register_schedulers", ("acme", make, None))
    real = plugin_manager.enabled_entry_points()
    monkeypatch.setattr(plugin_manager, "enabled_entry_points", lambda: real + [_FakeEntryPoint("acme_sched", mod)])
    assert cli_main(["generate", "--model", STORIES_MODEL, "--scheduler", "acme", "--max-tokens", "2", "Once"]) == 2
    err = capsys.readouterr().err
    assert "kvforge: error: invalid literal for int() with base 10: '3x'" in err, err
    assert "kvforge: raised while building scheduler 'acme' (plugin acme_sched, distribution acme-boom" in err, err


def test_factory_returning_its_class_says_so():
    spec = PluginSpec("attention", "cls", lambda *a: TorchRefBackend, None, "p", "d", "1", "1")
    with pytest.raises(PluginError, match="returned the class kvforge_plugins.attention.torch_ref.TorchRefBackend "
                                          "itself, not an instance"):
        build_plugin(spec, None, None, None, None)


def test_entry_point_naming_a_function_says_so(monkeypatch):
    """A QA finding: "mod:kvforge_register_schedulers" as the entry point was diagnosed as a
    module without KVFORGE_HOOK_API, which the module did declare."""
    def kvforge_register_schedulers(register):
        pass
    kvforge_register_schedulers.__module__ = "acme_mod"
    monkeypatch.setattr(plugin_manager, "enabled_entry_points",
                        lambda: [_FakeEntryPoint("qa_ep", kvforge_register_schedulers)])
    with pytest.raises(PluginError, match=r"its entry point names the function acme_mod\..*kvforge_register_"
                                          r"schedulers; it must name the plugin module, e.g. qa_ep = \"acme_mod\""):
        load_registry()


def test_settings_keyword_instead_of_settings_model_is_refused():
    def hook(register):
        register("s", make_fcfs, settings=QueueSettings)
    with pytest.raises(PluginError, match=r"registers scheduler 's' with settings=\.\.\.; the keyword is "
                                          r"settings_model="):
        load_registry(extra_plugins=[("kw_plugin", _module("kw_plugin", kvforge_register_schedulers=hook))])


def test_unknown_name_says_where_plugins_come_from_or_which_filter_hid_it(monkeypatch):
    reg = load_registry()
    with pytest.raises(ValueError, match=r"unknown scheduler 'qa_noep'; registered schedulers: .*fcfs.* \(a plugin is "
                                         r"found through the 'kvforge.plugins' entry-point group"):
        reg.get("scheduler", "qa_noep")
    monkeypatch.setenv("KVFORGE_PLUGINS", "fcfs")
    with pytest.raises(ValueError, match=r"unknown kv_allocator 'paged'; registered kv_allocators: \(none\); "
                                         r"KVFORGE_PLUGINS=fcfs limit which plugins load"):
        load_registry().get("kv_allocator", "paged")


def test_attention_registration_mistakes_say_what_to_register():
    def as_function(settings):
        return TorchRefBackend(settings)

    class PlainValidate(TorchRefBackend):
        def validate(self, req, device):  # forgot @classmethod
            return []

    for factory, msg in ((as_function, r"registers a function; an attention backend registers its AttentionBackend "
                                       r"subclass itself"),
                         (PlainValidate, r"PlainValidate.validate must be a @classmethod")):
        def hook(register, factory=factory):
            register("mine", factory)
        with pytest.raises(PluginError, match=msg):
            plugin = _module("attn_plugin", kvforge_register_attention_backends=hook)
            load_registry(extra_plugins=[("attn_plugin", plugin)])


def test_conformance_settings_with_a_typo_are_a_usage_error_up_front():
    """A QA finding: a misspelled setting failed every case of the suite with one traceback each."""
    from helpers import FakePytestConfig
    from kvforge.testing import pytest_plugin
    cfg = FakePytestConfig(["scheduler:fcfs"], ['scheduler:fcfs={"preemption_mod": "swap"}'])
    with pytest.raises(pytest.UsageError, match=r"--kvforge-conformance scheduler:fcfs: invalid settings for "
                                                r"scheduler 'fcfs': --kvforge-settings scheduler:fcfs.preemption_mod"):
        pytest_plugin.pytest_configure(cfg)


def test_unknown_llm_keyword_shows_the_forms_that_work():
    from kvforge.config import EngineConfig
    with pytest.raises(ValueError, match=r"unknown config option 'scheduler_settings'; known flat options: .*; any "
                                         r"other field by its dotted path \(e.g. \*\*\{'scheduler.settings'"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "scheduler_settings": {"x": 1}})
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "scheduler.settings": {"preemption_mode": "swap"}})
    assert cfg.scheduler.settings == {"preemption_mode": "swap"}


# -- an attention backend's validate() sees its own settings -------------------------------------

def _picky_registry():
    """The installed plugins plus 'picky': torch_ref's kernels, refusing heads wider than its
    ``max_head`` setting, ranked above torch_ref."""
    import types

    from pydantic import BaseModel, ConfigDict

    import kvforge
    from kvforge.plugin_manager import load_registry
    from kvforge_plugins.attention.torch_ref import TorchRefBackend

    class PickySettings(BaseModel):
        model_config = ConfigDict(extra="forbid")
        max_head: int = 256

    class Picky(TorchRefBackend):
        name = "picky"
        seen: list = []

        @classmethod
        def validate(cls, req, device):
            cls.seen.append(req.settings)
            if req.head_size > req.settings.max_head:
                return [f"head_size {req.head_size} > max_head {req.settings.max_head}"]
            return []

    mod = types.ModuleType("picky_plugin")
    mod.KVFORGE_HOOK_API = kvforge.KVFORGE_HOOK_API
    mod.kvforge_register_attention_backends = kvforge.hookimpl(
        lambda register: register("picky", Picky, PickySettings, priority=5, dtypes=("float32",), devices=("cpu",)))
    return load_registry(extra_plugins=[("picky_plugin", mod)]), Picky


def test_attention_validate_sees_its_settings():
    import torch

    from kvforge.engine.resolve import choose_attention
    from kvforge.interfaces import AttentionRequirements
    reg, picky = _picky_registry()
    req = AttentionRequirements(torch.float32, 64, 4, 2, 16, torch.float32)
    cpu = torch.device("cpu")
    assert choose_attention(reg, "auto", req, cpu)[0].name == "picky" and picky.seen[-1].max_head == 256
    with pytest.raises(ValueError, match="'picky' cannot run here: head_size 64 > max_head 32"):
        choose_attention(reg, "picky", req, cpu, {"max_head": 32})
    assert choose_attention(reg, "picky", req, cpu, {"max_head": 64})[0].name == "picky"
    # auto: each backend is asked with the settings as its own model reads them; torch_ref takes none
    with pytest.raises(ValueError, match="no backend can run here.*max_head 32.*torch_ref.*takes no settings"):
        choose_attention(reg, "auto", req, cpu, {"max_head": 32})
    spec, rejected = choose_attention(reg, "auto", req, cpu, {"max_head": 128})
    assert spec.name == "picky" and "takes no settings" in rejected["torch_ref"][0]
    with pytest.raises(ValueError, match="attention.settings.max_head"):
        choose_attention(reg, "picky", req, cpu, {"max_head": "wide"})
