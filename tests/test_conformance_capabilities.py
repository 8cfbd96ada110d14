"""Capability declarations (refused combinations at engine build, before any weight is
read) and per-request choices (validated in ``LLMEngine.prepare_request``)."""
from __future__ import annotations

import logging
import types

import pytest

import kvforge
from helpers import STORIES_MODEL
from kvforge import SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.request_choices import get_choice
from kvforge.plugin_manager import load_registry
from kvforge_plugins.attention.torch_ref import TorchRefBackend
from kvforge_plugins.kv_cache.paged import PagedSettings, make_paged
from kvforge_plugins.schedulers.base import QueueSettings
from kvforge_plugins.schedulers.fcfs import make_fcfs


def _plugin(name: str, **hooks) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.KVFORGE_HOOK_API = kvforge.KVFORGE_HOOK_API
    for hook, regs in hooks.items():
        def impl(register, _regs=regs):
            for args, caps in _regs:
                register(*args, **caps)
        impl.__name__ = hook
        setattr(mod, hook, kvforge.hookimpl(impl))
    return mod


@pytest.fixture(scope="module")
def registry():
    caps = _plugin(
        "caps_plugin",
        kvforge_register_schedulers=[(("needs_prefix", make_fcfs, QueueSettings), {"requires_prefix_caching": True}),
                                     (("no_spec_sched", make_fcfs, QueueSettings), {"spec_decode": False}),
                                     (("no_prio", make_fcfs, QueueSettings), {"priorities": False})],
        kvforge_register_kv_allocators=[(("no_prefix", make_paged, PagedSettings), {"prefix_caching": False}),
                                        (("no_rollback", make_paged, PagedSettings),
                                         {"prefix_caching": True, "rollback": False}),
                                        (("hinted", make_paged, PagedSettings),
                                         {"prefix_caching": True, "eviction_hints": ("keep", "drop")}),
                                        (("bad_decl", make_paged, PagedSettings), {"block_sizes": (16, "32")}),
                                        (("typo_decl", make_paged, PagedSettings), {"prefix_cachng": True})],
        kvforge_register_attention_backends=[(("fp32_only", TorchRefBackend),
                                              {"priority": -5, "dtypes": ("float32",), "block_sizes": (16,)}),
                                             (("gpu_only", TorchRefBackend), {"priority": -5, "devices": ("cuda",)})])
    return load_registry(extra_plugins=[("caps_plugin", caps)])


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if the build gets as far as building the model and reading weights."""
    import kvforge.engine.builder as builder

    def boom(*a, **k):
        raise AssertionError("the model was built before the capability check refused the config")
    monkeypatch.setattr(builder, "build_model_stack", boom)


def build(registry, **overrides) -> LLMEngine:
    opts = {"model": STORIES_MODEL, "dtype": "float32", "device": "cpu"}
    opts.update(overrides)
    return LLMEngine(EngineConfig.from_sources(None, opts), registry=registry)


REFUSED = [
    (dict(scheduler="needs_prefix", kv_allocator="no_prefix", enable_prefix_caching=True),
     ["incompatible plugins", "scheduler 'needs_prefix'", "kv_allocator 'no_prefix'", "caps_plugin",
      "prefix_caching=True"]),
    (dict(scheduler="needs_prefix", kv_allocator="paged", enable_prefix_caching=False),
     ["scheduler 'needs_prefix'", "cache.enable_prefix_caching"]),
    (dict(attention_backend="fp32_only", dtype="float16"),
     ["attention 'fp32_only'", "model dtype 'float16'", "dtypes=('float32',)"]),
    (dict(attention_backend="fp32_only", block_size=32), ["attention 'fp32_only'", "cache.block_size 32"]),
    (dict(attention_backend="gpu_only"), ["attention 'gpu_only'", "device 'cpu'"]),
    (dict(kv_allocator="no_rollback", speculative_method="ngram", num_speculative_tokens=2),
     ["incompatible plugins", "drafter 'ngram'", "kv_allocator 'no_rollback'", "rollback=False"]),
    (dict(scheduler="no_spec_sched", speculative_method="ngram", num_speculative_tokens=2),
     ["drafter 'ngram'", "scheduler 'no_spec_sched'", "spec_decode=False"]),
    (dict(kv_allocator="bad_decl"), ["kv_allocator 'bad_decl'", "block_sizes=(16, '32')", "type ints"]),
    ({"request_choices.eviction_hints": ["keep"]}, ["request_choices.eviction_hints ['keep']",
                                                   "kv_allocator 'paged'"]),
    ({"request_choices.drafters": ["no_such_drafter"], "num_speculative_tokens": 2},
     ["unknown drafter 'no_such_drafter'", "registered drafters"]),
    ({"request_choices.drafters": ["ngram"], "num_speculative_tokens": 2, "kv_allocator": "no_rollback"},
     ["drafter 'ngram'", "kv_allocator 'no_rollback'", "rollback=False"]),
    ({"scheduler": "no_prio", "request_choices.priorities": [0, 3]}, ["request_choices.priorities",
                                                                      "scheduler 'no_prio'"]),
]


@pytest.mark.parametrize("overrides, needles", REFUSED, ids=[str(i) for i in range(len(REFUSED))])
def test_incompatible_combination_refused_before_weights(registry, no_weights, overrides, needles):
    if ("speculative_method" in overrides or "ngram" in overrides.get("request_choices.drafters", ())) \
            and "ngram" not in registry.names("drafter"):
        pytest.skip("no ngram drafter registered")
    with pytest.raises(ValueError) as ei:
        build(registry, **overrides)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in: {msg}"


def test_compatible_declarations_build(registry):
    eng = build(registry, attention_backend="fp32_only", kv_allocator="hinted", enable_prefix_caching=True,
                scheduler="needs_prefix", **{"request_choices.eviction_hints": ["keep"]})
    assert eng.parts.choices["attention"] == "fp32_only"


def test_unknown_capability_key_is_logged_once(registry, caplog, monkeypatch):
    from kvforge.engine import capabilities
    monkeypatch.setattr(capabilities, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="kvforge"):
        build(registry, kv_allocator="typo_decl")
        build(registry, kv_allocator="typo_decl")
    hits = [r.getMessage() for r in caplog.records if "prefix_cachng" in r.getMessage()]
    assert len(hits) == 1 and "kv_allocator 'typo_decl'" in hits[0] and "prefix_caching" in hits[0], hits


def test_unknown_capability_fails_conformance_and_is_listed(registry, capsys, monkeypatch):
    from kvforge.entrypoints import cli
    from kvforge.testing import Target
    from kvforge.testing.declarations import check_declarations
    with pytest.raises(AssertionError, match="'prefix_cachng' \\(did you mean 'prefix_caching'\\?"):
        check_declarations(Target("kv_allocator", "typo_decl", registry=registry))
    with pytest.raises(AssertionError, match="block_sizes"):
        check_declarations(Target("kv_allocator", "bad_decl", registry=registry))
    check_declarations(Target("kv_allocator", "hinted", registry=registry))
    monkeypatch.setattr("kvforge.plugin_manager.load_registry", lambda **kw: registry)
    assert cli.main(["plugins"]) == 0
    err = capsys.readouterr().err
    assert "warning: kv_allocator 'typo_decl'" in err and "did you mean 'prefix_caching'" in err


def test_builtin_declarations_are_well_typed():
    from kvforge.engine.capabilities import validate_declarations
    for spec in load_registry().all():
        validate_declarations(spec)


# -- per-request choices -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def chooser(registry):
    drafters = ["ngram"] if "ngram" in registry.names("drafter") else []
    return build(registry, kv_allocator="hinted", enable_prefix_caching=True, scheduler="priority",
                 num_speculative_tokens=2 if drafters else 0,
                 **{"request_choices.drafters": drafters, "request_choices.priorities": [-2, 2],
                    "request_choices.eviction_hints": ["keep"]})


def _kv(**choices) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, extra_args={"kvforge": choices})


def test_allowed_choices_are_accepted_and_readable(chooser):
    choices = {"eviction_hint": "keep", "drafter": "none"}
    if chooser.config.request_choices.drafters:
        choices["drafter"] = "ngram"
    chooser.add_request("ok", "Once upon a time", _kv(**choices), priority=2)
    req = chooser.scheduler.requests["ok"]
    assert get_choice(req, "eviction_hint") == "keep" and get_choice(req, "drafter") == choices["drafter"]
    while chooser.has_unfinished_requests():
        chooser.step()


@pytest.mark.parametrize("params, priority, needles", [
    (_kv(eviction_hint="drop"), 0, ["extra_args.kvforge.eviction_hint", "'drop' is not allowed", "keep",
                                    "request_choices.eviction_hints"]),
    (_kv(drafter="draft_model"), 0, ["extra_args.kvforge.drafter", "'draft_model' is not allowed",
                                     "request_choices.drafters"]),
    (_kv(colour="blue"), 0, ["extra_args.kvforge", "unknown choice", "colour", "drafter, eviction_hint"]),
    (SamplingParams(extra_args={"kvforge": "ngram"}), 0, ["extra_args.kvforge: must be a dict"]),
    (_kv(eviction_hint=3), 0, ["extra_args.kvforge.eviction_hint: must be a string"]),
    (SamplingParams(), 3, ["priority: 3 is outside the allowed range [-2, 2]", "request_choices.priorities"]),
])
def test_disallowed_choice_is_a_clear_error(chooser, params, priority, needles):
    with pytest.raises(ValueError) as ei:
        chooser.add_request("bad", "Once upon a time", params, priority=priority)
    for n in needles:
        assert n in str(ei.value), f"{n!r} not in: {ei.value}"
    assert not chooser.has_unfinished_requests()  # nothing was queued


def test_nothing_is_allowed_by_default(registry):
    eng = build(registry)
    with pytest.raises(ValueError, match=r"allowed values: none \(set by the operator"):
        eng.add_request("x", "Once upon a time", _kv(drafter="ngram"))
    with pytest.raises(ValueError, match="allowed values: \\(none\\)"):
        eng.add_request("y", "Once upon a time", _kv(eviction_hint="keep"))
    # the default scheduler ignores priority (priorities=False): any other value than 0 is refused
    with pytest.raises(ValueError, match=r"priority: 100 was given, but scheduler 'chunked_prefill' .* ignores "
                                         r"request priority"):
        eng.add_request("z", "Once upon a time", SamplingParams(max_tokens=2), priority=100)
    prio = build(registry, scheduler="priority")
    prio.add_request("z", "Once upon a time", SamplingParams(max_tokens=2), priority=100)  # no range set: any
    for e in (eng, prio):
        while e.has_unfinished_requests():
            e.step()


def test_bad_priority_range_is_a_config_error():
    with pytest.raises(ValueError, match="priorities"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "request_choices.priorities": [3, 1]})
