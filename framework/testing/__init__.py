"""kvforge.testing: conformance suites for plugin authors.

Run a suite against a registered plugin by name, from any directory, with the
pytest plugin this package registers (entry point ``pytest11: kvforge``)::

    pytest --kvforge-conformance scheduler:my_sched
    pytest --kvforge-conformance kv_allocator:lfu --kvforge-conformance attention:my_attn

or from your own test module::

    import pytest
    from kvforge.testing import conformance_cases

    @pytest.mark.parametrize("case", conformance_cases("scheduler", "my_sched"), ids=str)
    def test_kvforge_conformance(case):
        case.run()

Kinds: ``kv_allocator``, ``scheduler``, ``attention``, ``quantizer``, ``drafter``.
Engine-driven checks need a model: ``$KVFORGE_TEST_MODEL`` / ``--kvforge-model``
(default ``../shared/models/stories260K`` next to the kvforge checkout).
See docs/plugins.md for what each suite checks.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from kvforge.testing.harness import (GRID_ENV, MODEL_ENV, SEED_ENV, SUITE_KINDS, Target, default_model_path,
                                     default_registry)

#: kind -> module holding that suite's ``CHECKS`` list.
SUITES: dict[str, str] = {kind: f"kvforge.testing.{kind}" for kind in SUITE_KINDS}


def suite_checks(kind: str) -> list[Callable[[Target], None]]:
    """The check functions of one suite, in order."""
    if kind not in SUITES:
        raise ValueError(f"no conformance suite for kind {kind!r}; kinds: {', '.join(SUITE_KINDS)}")
    from kvforge.testing.declarations import check_declarations
    return [check_declarations, *importlib.import_module(SUITES[kind]).CHECKS]


@dataclass(frozen=True)
class Case:
    """One check of one suite against one plugin; ``run()`` raises AssertionError on failure."""

    kind: str
    name: str
    check: Callable[[Target], None]
    settings: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.name}-{self.check.__name__.removeprefix('check_')}"

    def __str__(self) -> str:
        return self.id

    def target(self, registry=None, model: str | None = None, device: str = "auto",
               grid: str | None = None) -> Target:
        return Target(self.kind, self.name, registry, model, device, dict(self.settings), grid)

    def run(self, registry=None, model: str | None = None, device: str = "auto", grid: str | None = None) -> None:
        self.check(self.target(registry, model, device, grid))


def conformance_cases(kind: str, name: str, registry=None, settings: dict[str, Any] | None = None) -> list[Case]:
    """Every check of ``kind``'s suite for the plugin registered as ``name``.

    Raises:
        ValueError: unknown kind, or no plugin of that kind registered under ``name``
            (the message lists the registered names).
    """
    checks = suite_checks(kind)
    (registry or default_registry()).get(kind, name)
    return [Case(kind, name, c, dict(settings or {})) for c in checks]


def parse_target(text: str) -> tuple[str, str]:
    """``"scheduler:my_sched"`` -> ``("scheduler", "my_sched")``; ValueError on bad syntax or kind."""
    kind, sep, name = text.partition(":")
    kind, name = kind.strip(), name.strip()
    if not sep or not kind or not name:
        raise ValueError(f"expected KIND:NAME (e.g. scheduler:fcfs), got {text!r}")
    if kind not in SUITE_KINDS:
        raise ValueError(f"unknown plugin kind {kind!r} in {text!r}; kinds with a suite: {', '.join(SUITE_KINDS)}")
    return kind, name


__all__ = ["Case", "Target", "SUITES", "SUITE_KINDS", "MODEL_ENV", "SEED_ENV", "GRID_ENV", "conformance_cases",
           "suite_checks", "parse_target", "default_model_path", "default_registry"]
