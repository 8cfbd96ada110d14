"""Plugin manager: discovery through entry points, listing, allow/block lists, load-time
checks (hook API, duplicates, misspelled hooks) and a real third-party plugin package
(tests/fixtures/kvforge_example_sched) installed with pip and used from the CLI."""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

import kvforge
from helpers import STORIES_MODEL, run_engine
from kvforge.entrypoints.cli import main as cli_main
from kvforge.plugin_manager import ENTRY_POINT_GROUP, PluginError, load_registry

REPO = Path(__file__).resolve().parents[1]
FIXTURE_PKG = REPO / "tests" / "fixtures" / "kvforge_example_sched"
CLI = [sys.executable, "-m", "kvforge.entrypoints.cli"]

#: Known built-ins and the kind they must be listed under.
KNOWN_KINDS = {"fcfs": "scheduler", "paged": "kv_allocator", "torch_ref": "attention", "llama": "model",
               "unquantized": "quantizer"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("KVFORGE_PLUGINS", raising=False)
    monkeypatch.delenv("KVFORGE_DISABLE_PLUGINS", raising=False)


def _builtin_entry_points() -> dict[str, md.EntryPoint]:
    return {ep.name: ep for ep in md.entry_points(group=ENTRY_POINT_GROUP)
            if ep.dist is not None and ep.dist.name == "kvforge"}


def _parse_table(text: str) -> list[dict[str, str]]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    head = lines[0].split()
    assert lines[0].startswith("KIND"), text
    # "HOOK API" is two words: columns are separated by 2+ spaces.
    cols = re.split(r"\s{2,}", lines[0].strip())
    assert cols == ["KIND", "NAME", "PLUGIN", "DISTRIBUTION", "VERSION", "HOOK API"], head
    rows = []
    for ln in lines[1:]:
        if not re.match(r"^\S", ln) or ln.startswith("attention backends"):
            break
        rows.append(dict(zip(cols, re.split(r"\s{2,}", ln.strip()))))
    return rows


# -- listing ---------------------------------------------------------------------------------

def test_cli_plugins_lists_every_builtin(capsys):
    assert cli_main(["plugins"]) == 0
    rows = _parse_table(capsys.readouterr().out)
    builtins = _builtin_entry_points()
    assert builtins, "no kvforge.plugins entry points installed for the kvforge distribution"
    version = md.version("kvforge")
    by_plugin: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by_plugin.setdefault(r["PLUGIN"], []).append(r)
    for name in builtins:
        assert name in by_plugin, f"built-in plugin {name!r} missing from `kvforge plugins`"
        for r in by_plugin[name]:
            assert r["DISTRIBUTION"] == "kvforge", r
            assert r["VERSION"] == version, r
            assert r["HOOK API"] == kvforge.KVFORGE_HOOK_API, r
    for plugin, kind in KNOWN_KINDS.items():
        assert any(r["KIND"] == kind for r in by_plugin[plugin]), f"{plugin} not listed as a {kind}"
    names = {(r["KIND"], r["NAME"]) for r in rows}
    assert {("scheduler", "fcfs"), ("kv_allocator", "paged"), ("attention", "torch_ref"),
            ("model", "LlamaForCausalLM"), ("quantizer", "unquantized")} <= names
    # The table agrees with the registry.
    reg = load_registry()
    assert len(rows) == len(list(reg.all()))


def test_pyproject_declares_every_builtin_plugin_module():
    """Built-ins are discovered only through entry points: every plugin module in plugins/
    that implements a hook has an entry point, and every declared entry point is installed."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    declared = meta["project"]["entry-points"][ENTRY_POINT_GROUP]
    installed = {n: ep.value for n, ep in _builtin_entry_points().items()}
    assert declared == installed, "installed entry points differ from pyproject.toml (re-run pip install -e .)"
    with_hooks = set()
    for path in (REPO / "plugins").rglob("*.py"):
        if "@hookimpl" in path.read_text():
            mod = "kvforge_plugins." + ".".join(path.relative_to(REPO / "plugins").with_suffix("").parts)
            with_hooks.add(mod.removesuffix(".__init__"))
    missing = {m for m in with_hooks if m not in declared.values()}
    assert not missing, f"plugin modules with hooks but no entry point: {sorted(missing)}"


# -- allow / block lists ---------------------------------------------------------------------

def test_allow_list(monkeypatch):
    monkeypatch.setenv("KVFORGE_PLUGINS", " fcfs , paged ")
    reg = load_registry()
    assert {p[0] for p in reg.loaded_plugins} == {"fcfs", "paged"}
    assert reg.names("scheduler") == ["fcfs"]
    assert reg.names("kv_allocator") == ["paged"]
    assert reg.names("model") == [] and reg.names("attention") == []
    with pytest.raises(ValueError, match="torch_ref"):
        reg.get("attention", "torch_ref")


def test_block_list(monkeypatch):
    all_plugins = {p[0] for p in load_registry().loaded_plugins}
    monkeypatch.setenv("KVFORGE_DISABLE_PLUGINS", "fcfs,torch_ref")
    reg = load_registry()
    loaded = {p[0] for p in reg.loaded_plugins}
    assert loaded == all_plugins - {"fcfs", "torch_ref"}
    assert "fcfs" not in reg.names("scheduler")
    assert "torch_ref" not in reg.names("attention")
    with pytest.raises(ValueError, match=r"unknown scheduler 'fcfs'"):
        reg.get("scheduler", "fcfs")
    assert "paged" in reg.names("kv_allocator")


def test_allow_and_block_list_combined(monkeypatch):
    monkeypatch.setenv("KVFORGE_PLUGINS", "fcfs,paged,llama")
    monkeypatch.setenv("KVFORGE_DISABLE_PLUGINS", "paged")
    reg = load_registry()
    assert {p[0] for p in reg.loaded_plugins} == {"fcfs", "llama"}


def test_engine_build_with_blocked_scheduler_names_it(monkeypatch):
    monkeypatch.setenv("KVFORGE_DISABLE_PLUGINS", "fcfs")
    from kvforge import LLM
    with pytest.raises(ValueError, match=r"unknown scheduler 'fcfs'"):
        LLM(STORIES_MODEL, scheduler="fcfs")


# -- load-time checks on in-process plugins --------------------------------------------------

def _plugin(name: str, api: str | None = "1", **hooks) -> types.ModuleType:
    mod = types.ModuleType(name)
    if api is not None:
        mod.KVFORGE_HOOK_API = api
    for hook_name, fn in hooks.items():
        setattr(mod, hook_name, kvforge.hookimpl(fn))
    return mod


def _sched_hook(*names):
    def kvforge_register_schedulers(register):
        for n in names:
            register(n, lambda *a, **k: None)
    return kvforge_register_schedulers


def test_extra_plugin_registers():
    reg = load_registry(extra_plugins=[("my_sched", _plugin("my_sched", kvforge_register_schedulers=_sched_hook("mine")))])
    spec = reg.get("scheduler", "mine")
    assert (spec.plugin, spec.distribution, spec.hook_api) == ("my_sched", "<in-process>", "1")
    assert "fcfs" in reg.names("scheduler")


def test_duplicate_name_with_builtin_names_both():
    dup = _plugin("dup_sched", kvforge_register_schedulers=_sched_hook("fcfs"))
    with pytest.raises(PluginError) as ei:
        load_registry(extra_plugins=[("dup_sched", dup)])
    msg = str(ei.value)
    for part in ("'fcfs'", "dup_sched", "kvforge", "<in-process>"):
        assert part in msg, f"{part!r} not in: {msg}"


def test_duplicate_name_between_two_plugins_names_both():
    a = _plugin("alpha_plugin", kvforge_register_schedulers=_sched_hook("twin"))
    b = _plugin("beta_plugin", kvforge_register_schedulers=_sched_hook("twin"))
    with pytest.raises(PluginError) as ei:
        load_registry(extra_plugins=[("alpha_plugin", a), ("beta_plugin", b)])
    msg = str(ei.value)
    assert "'twin'" in msg and "alpha_plugin" in msg and "beta_plugin" in msg, msg


def test_duplicate_blocked_builtin_is_replaceable(monkeypatch):
    monkeypatch.setenv("KVFORGE_DISABLE_PLUGINS", "fcfs")
    reg = load_registry(extra_plugins=[("my_fcfs", _plugin("my_fcfs", kvforge_register_schedulers=_sched_hook("fcfs")))])
    assert reg.get("scheduler", "fcfs").plugin == "my_fcfs"


def test_entry_point_name_clash():
    with pytest.raises(PluginError, match="fcfs"):
        load_registry(extra_plugins=[("fcfs", _plugin("fcfs", kvforge_register_schedulers=_sched_hook("other")))])


@pytest.mark.parametrize("api", ["2", "2.0", "0", "10"])
def test_wrong_hook_api_major_is_refused(api):
    p = _plugin("future_plugin", api=api, kvforge_register_schedulers=_sched_hook("future"))
    with pytest.raises(PluginError) as ei:
        load_registry(extra_plugins=[("future_plugin", p)])
    msg = str(ei.value)
    assert "future_plugin" in msg and api in msg and kvforge.KVFORGE_HOOK_API in msg and "hook API" in msg, msg


def test_same_major_hook_api_is_accepted():
    p = _plugin("minor_plugin", api="1.7", kvforge_register_schedulers=_sched_hook("minor"))
    assert load_registry(extra_plugins=[("minor_plugin", p)]).get("scheduler", "minor").hook_api == "1.7"


def test_missing_hook_api_is_refused():
    p = _plugin("old_plugin", api=None, kvforge_register_schedulers=_sched_hook("old"))
    with pytest.raises(PluginError) as ei:
        load_registry(extra_plugins=[("old_plugin", p)])
    assert "old_plugin" in str(ei.value) and "KVFORGE_HOOK_API" in str(ei.value)


def test_misspelled_hook_fails_loudly():
    def kvforge_register_schedulerz(register):
        register("typo", lambda *a, **k: None)
    p = _plugin("typo_plugin", kvforge_register_schedulerz=kvforge_register_schedulerz)
    with pytest.raises(PluginError) as ei:
        load_registry(extra_plugins=[("typo_plugin", p)])
    assert "kvforge_register_schedulerz" in str(ei.value), str(ei.value)


def test_hook_with_wrong_argument_name_is_a_plugin_error():
    """A hookimpl whose argument is not the spec's ``register`` is a bad hook: PluginError
    naming the plugin (so `kvforge plugins` prints a clean error instead of a traceback)."""
    def kvforge_register_schedulers(reg):
        reg("typo", lambda *a, **k: None)
    p = _plugin("argname_plugin", kvforge_register_schedulers=kvforge_register_schedulers)
    with pytest.raises(PluginError) as ei:
        load_registry(extra_plugins=[("argname_plugin", p)])
    assert "argname_plugin" in str(ei.value)


# -- a real third-party plugin package -------------------------------------------------------

def _load_fixture_module(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURE_PKG))
    sys.modules.pop("kvforge_example_sched", None)
    import kvforge_example_sched
    return kvforge_example_sched


def test_example_scheduler_admits_newest_first(monkeypatch):
    """In-process: the fixture's scheduler really is LIFO (max_num_seqs=1 -> finish order reversed)."""
    from kvforge.config import EngineConfig
    from kvforge.engine.llm_engine import LLMEngine
    from kvforge import SamplingParams

    mod = _load_fixture_module(monkeypatch)
    reg = load_registry(extra_plugins=[("example_sched", mod)])
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        orders = {}
        for sched in ("lifo_example", "fcfs"):
            cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "scheduler": sched, "max_num_seqs": 1,
                                                   "num_gpu_blocks": 32})
            eng = LLMEngine(cfg, registry=reg)
            assert type(eng.scheduler).__name__ == ("LIFOScheduler" if sched == "lifo_example" else "FCFSScheduler")
            for rid in ("a", "b", "c"):
                eng.add_request(rid, "Once upon a time", SamplingParams(temperature=0.0, max_tokens=4))
            finish_order = []
            run_engine(eng, on_step=lambda e, outs: finish_order.extend(o.request_id for o in outs if o.finished))
            orders[sched] = finish_order
            assert eng.allocator.num_free_blocks == eng.allocator.num_blocks
    finally:
        torch.set_num_threads(old)
    assert orders == {"lifo_example": ["c", "b", "a"], "fcfs": ["a", "b", "c"]}


@pytest.fixture(scope="module")
def example_target(tmp_path_factory):
    """pip-install the fixture package (no deps, no network) into a --target directory."""
    tmp = tmp_path_factory.mktemp("example_sched")
    src = tmp / "src"
    shutil.copytree(FIXTURE_PKG, src, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    target = tmp / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "--quiet", "--target", str(target), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(target.glob("kvforge_example_sched-*.dist-info")), sorted(p.name for p in target.iterdir())
    return target


def _env(target: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVFORGE_PLUGINS", "KVFORGE_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(target)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


GENERATE = ["generate", "--model", STORIES_MODEL, "--scheduler", "lifo_example", "--max-tokens", "20",
            "Once upon a time"]


def test_third_party_plugin_generate(example_target):
    proc = subprocess.run(CLI + GENERATE, env=_env(example_target), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # Greedy continuation of the reference checkpoint (see /work/shared/models/README.md).
    assert proc.stdout.startswith("Once upon a time, there was a little girl named Lily"), proc.stdout
    assert "20 tokens" in proc.stderr and "finish_reason=length" in proc.stderr, proc.stderr


def test_third_party_plugin_listed(example_target):
    proc = subprocess.run(CLI + ["plugins"], env=_env(example_target), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = _parse_table(proc.stdout)
    mine = [r for r in rows if r["NAME"] == "lifo_example"]
    assert mine == [{"KIND": "scheduler", "NAME": "lifo_example", "PLUGIN": "example_sched",
                     "DISTRIBUTION": "kvforge-example-sched", "VERSION": "0.0.1", "HOOK API": "1"}], proc.stdout
    assert any(r["NAME"] == "fcfs" and r["DISTRIBUTION"] == "kvforge" for r in rows)


def test_third_party_plugin_disabled(example_target):
    proc = subprocess.run(CLI + GENERATE, env=_env(example_target, KVFORGE_DISABLE_PLUGINS="example_sched"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "unknown scheduler 'lifo_example'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not proc.stdout.strip()


def test_cli_plugins_settings_lists_fields_and_config_path(capsys):
    assert cli_main(["plugins", "--settings", "quantizer:awq"]) == 0
    out = capsys.readouterr().out
    assert "quantizer awq: quantization.settings" in out
    assert "int4_layout: 'auto' | 'mma' | 'pairs' | 'checkpoint' (default 'auto')" in out
    assert "quantizer gptq" not in out  # filtered to one plugin
    assert not out.startswith("KIND")  # the section alone, not the whole table first
    assert cli_main(["plugins", "--settings", "drafter"]) == 0
    out = capsys.readouterr().out
    assert "drafter ngram: speculative.settings" in out and "prompt_lookup_max: int (default 4, >= 1)" in out
    assert out.startswith("drafter")  # no blank line first
    assert cli_main(["plugins", "--settings", "quantiser"]) == 2
    cap = capsys.readouterr()
    assert "no plugin matches 'quantiser'" in cap.err and "kinds: " in cap.err and "quantizer" in cap.err
    assert not cap.out  # refused before the table is printed
    assert cli_main(["plugins", "--settings", "scheduler:nope"]) == 2
    cap = capsys.readouterr()
    assert "scheduler names: " in cap.err and "fcfs" in cap.err and not cap.out


def test_cli_plugins_explain_names_each_backends_verdict(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli_main(["plugins", "--explain", "--model", STORIES_MODEL]) == 0
    out = capsys.readouterr().out
    assert not out.lstrip().startswith("KIND")  # the section alone, not the whole table first
    assert f"attention backends for {STORIES_MODEL} on cpu" in out
    assert "torch_ref (priority 0): ok, picked by auto" in out
    assert re.search(r"triton_paged \(priority \d+\): rejected: needs a CUDA device", out), out


def test_cli_plugins_explain_reads_the_model_from_config_and_needs_one(capsys, monkeypatch, tmp_path):
    """A QA finding: --explain ignored --config, and without a model it said so with status 0."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(f"model:\n  model: {STORIES_MODEL}\ncache:\n  block_size: 32\n")
    assert cli_main(["plugins", "--explain", "--config", str(cfg)]) == 0
    assert f"attention backends for {STORIES_MODEL} on cpu (torch.float32; block_size 32)" in capsys.readouterr().out
    assert cli_main(["plugins", "--explain"]) == 2
    assert "model: Field required (pass --model DIR" in capsys.readouterr().err
