"""pytest plugin (entry point ``pytest11: kvforge``): ``--kvforge-conformance KIND:NAME``.

Options:
    --kvforge-conformance KIND:NAME   run KIND's conformance suite against the plugin
                                      registered as NAME (repeatable). Kinds:
                                      kv_allocator, scheduler, attention, quantizer, drafter.
    --kvforge-model DIR               model for engine-driven checks (default
                                      $KVFORGE_TEST_MODEL, then ../shared/models/stories260K
                                      next to the kvforge checkout).
    --kvforge-device auto|cpu|cuda    device for engines and kernels (default auto).
    --kvforge-grid full|small         attention shape grid (default $KVFORGE_TEST_GRID or full).
    --kvforge-settings KIND:NAME=JSON the plugin's ``settings`` section for the run (repeatable);
                                      KIND:NAME must be one of the --kvforge-conformance targets.

The plugin is resolved through the real registry (entry points of group
``kvforge.plugins``, ``KVFORGE_PLUGINS`` / ``KVFORGE_DISABLE_PLUGINS`` applied); an
unknown name is a usage error listing the registered ones, and so are settings for a
plugin that is not under test. When no test paths are given on the command line only
the suites run; with paths, both run.

Nothing here imports kvforge until the option is used, so the plugin costs
nothing in other test runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

_TARGETS = pytest.StashKey[list]()
_OPTIONS = pytest.StashKey[dict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvforge", "kvforge plugin conformance")
    group.addoption("--kvforge-conformance", action="append", default=[], metavar="KIND:NAME",
                    dest="kvforge_conformance",
                    help="run the kvforge conformance suite of KIND (kv_allocator, scheduler, attention, "
                         "quantizer, drafter) against the plugin registered as NAME; repeatable")
    group.addoption("--kvforge-model", default=None, metavar="DIR", dest="kvforge_model",
                    help="model directory for engine-driven conformance checks (default: $KVFORGE_TEST_MODEL, "
                         "then ../shared/models/stories260K next to the kvforge checkout)")
    group.addoption("--kvforge-device", default="auto", choices=("auto", "cpu", "cuda"), dest="kvforge_device",
                    help="device for conformance engines and kernels (default: auto)")
    group.addoption("--kvforge-grid", default=None, choices=("full", "small"), dest="kvforge_grid",
                    help="kernel shape grid of the attention suite (default: $KVFORGE_TEST_GRID or full; small "
                         "suits emulated devices such as Triton's CPU interpreter)")
    group.addoption("--kvforge-settings", action="append", default=[], metavar="KIND:NAME=JSON",
                    dest="kvforge_settings", help="settings section for a plugin under test; repeatable")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kvforge_conformance: a kvforge plugin conformance check")
    raw = config.getoption("kvforge_conformance", default=None) or []
    if not raw:
        stray = config.getoption("kvforge_settings", default=None) or []
        if stray:  # nothing is under test, so these settings would reach no plugin
            raise pytest.UsageError(f"--kvforge-settings {stray[0]!r}: no plugin is under test; settings apply "
                                    f"only to --kvforge-conformance KIND:NAME targets")
        return
    from kvforge.testing import parse_target
    from kvforge.testing.harness import default_model_path, default_registry
    targets: list[tuple[str, str]] = []
    for text in raw:
        try:
            kt = parse_target(text)
        except ValueError as e:
            raise pytest.UsageError(f"--kvforge-conformance: {e}") from None
        if kt not in targets:
            targets.append(kt)
    settings: dict[tuple[str, str], dict] = {}
    for text in config.getoption("kvforge_settings", default=None) or []:
        head, sep, body = text.partition("=")
        try:
            kt = parse_target(head)
            value = json.loads(body) if sep else None
        except (ValueError, json.JSONDecodeError) as e:
            raise pytest.UsageError(f"--kvforge-settings {text!r}: expected KIND:NAME=JSON ({e})") from None
        if not isinstance(value, dict):
            raise pytest.UsageError(f"--kvforge-settings {text!r}: the JSON value must be an object")
        if kt not in targets:
            # Settings only reach the plugins under test; ignoring these would run the suite
            # with defaults while the user believes their settings were tested.
            under_test = ", ".join(f"{k}:{n}" for k, n in targets)
            raise pytest.UsageError(
                f"--kvforge-settings {text!r}: {kt[0]}:{kt[1]} is not under test (--kvforge-conformance "
                f"targets: {under_test}); add --kvforge-conformance {kt[0]}:{kt[1]} or drop these settings")
        settings[kt] = value
    try:
        registry = default_registry()
    except Exception as e:  # a broken plugin: say which, without a traceback
        raise pytest.UsageError(f"--kvforge-conformance: loading kvforge plugins failed: {e}") from None
    from kvforge.engine.resolve import validate_plugin_settings
    for kind, name in targets:
        try:
            spec = registry.get(kind, name)
            if (kind, name) in settings:  # a typo fails once, here, not in every case of the suite
                validate_plugin_settings(spec, settings[(kind, name)], f"--kvforge-settings {kind}:{name}")
        except ValueError as e:
            hint = ""
            if kind == "drafter" and not registry.names("drafter"):
                hint = (" -- no drafter is registered in this installation, so there is nothing to run the "
                        "drafter suite against")
            raise pytest.UsageError(f"--kvforge-conformance {kind}:{name}: {e}{hint}") from None
    config.stash[_TARGETS] = targets
    config.stash[_OPTIONS] = {"model": config.getoption("kvforge_model") or default_model_path(),
                              "device": config.getoption("kvforge_device"), "settings": settings,
                              "grid": config.getoption("kvforge_grid")}
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = []  # no paths given: run only the requested suites


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    targets = config.stash.get(_TARGETS, None)
    if not targets:
        return None
    opts = config.stash[_OPTIONS]
    return [f"kvforge conformance: {', '.join(f'{k}:{n}' for k, n in targets)} "
            f"(model {opts['model']}, device {opts['device']})"]


class _SuiteModule(pytest.Module):
    """The suite module, imported by name (it lives inside the installed kvforge)."""

    def _getobj(self):
        import importlib
        return importlib.import_module("kvforge.testing._suite")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    rep = yield
    if isinstance(collector, pytest.Session) and collector.config.stash.get(_TARGETS, None) and rep.passed:
        import kvforge.testing._suite as suite
        rep.result.append(_SuiteModule.from_parent(collector, path=Path(suite.__file__),
                                                   name="kvforge-conformance", nodeid="kvforge-conformance"))
    return rep


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvforge_case" not in metafunc.fixturenames:
        return
    from kvforge.testing import Case, suite_checks
    targets = metafunc.config.stash.get(_TARGETS, [])
    settings = metafunc.config.stash[_OPTIONS]["settings"] if targets else {}
    cases = [Case(kind, name, check, settings.get((kind, name), {}))
             for kind, name in targets for check in suite_checks(kind)]
    metafunc.parametrize("kvforge_case", cases, ids=[c.id for c in cases])


@pytest.fixture
def kvforge_options(request: pytest.FixtureRequest) -> dict:
    """``{"model": DIR | None, "device": "auto" | "cpu" | "cuda", "grid": "full" | "small" | None}``."""
    opts = request.config.stash.get(_OPTIONS, None) or {}
    return {"model": opts.get("model"), "device": opts.get("device", "auto"), "grid": opts.get("grid")}
