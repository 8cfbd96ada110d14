"""Every registered plugin passes its kind's conformance suite (kvforge.testing).

The cases are generated from the live registry, so a new built-in (or any
installed plugin) is covered without touching this file. Attention backends
whose kernels only run on this machine through Triton's CPU interpreter run
their suite in a subprocess with ``TRITON_INTERPRET=1`` (the variable must be
set before triton is imported), through the ``pytest --kvforge-conformance``
command plugin authors use, limited to the mixed-batch check on the small shape
grid (the interpreter is slow; tests/test_triton_paged.py covers the kernels in
depth, and on a GPU the whole suite runs in-process); backends that cannot run
here at all are skipped with their ``validate()`` reasons.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import FakePytestConfig
from kvforge.plugin_manager import load_registry
from kvforge.testing import SUITE_KINDS

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Discovery runs in a subprocess: importing the plugin modules here, at collection time,
# would decorate their Triton kernels under whatever TRITON_INTERPRET the test modules
# collected before this one leave behind, mixing interpreted and compiled kernels.
_DISCOVER = r"""
import json, os, sys, torch
from kvforge.interfaces import AttentionRequirements
from kvforge.plugin_manager import load_registry
from kvforge.testing import SUITE_KINDS
from kvforge.testing.attention import BLOCK_SIZES, HEADS
reg = load_registry()
dev = torch.device(sys.argv[1])

def accepts(name, env):
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        reasons = []
        for dtype in (torch.float32, torch.float16):
            for bs in BLOCK_SIZES:
                for hq, hkv, d in HEADS:
                    req = AttentionRequirements(dtype, d, hq, hkv, bs, dtype)
                    r = reg.get("attention", name).factory.validate(req, dev)
                    if not r:
                        return True, []
                    reasons += r
        return False, sorted(set(reasons))
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

modes = {}
for name in reg.names("attention"):
    ok, reasons = accepts(name, {})
    if ok:
        modes[name] = ["in-process", []]
    elif dev.type == "cpu" and accepts(name, {"TRITON_INTERPRET": "1"})[0]:
        modes[name] = ["interpreter", []]
    else:
        modes[name] = ["cannot-run", reasons]
print(json.dumps({"names": {k: reg.names(k) for k in SUITE_KINDS}, "attention": modes}))
"""


def _discover() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _DISCOVER, DEVICE.type], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


FOUND = _discover()
NAMES: dict[str, list[str]] = FOUND["names"]
ATTENTION_MODES: dict[str, list] = FOUND["attention"]
_REG: list = []


def registry():
    """The in-process registry, loaded when the first test runs (not at collection)."""
    if not _REG:
        _REG.append(load_registry())
    return _REG[0]


class LazyCase:
    """One check of one suite for one plugin; the registry is resolved when it runs."""

    def __init__(self, kind: str, name: str, check_name: str) -> None:
        self.kind, self.name, self.check_name = kind, name, check_name

    def run(self) -> None:
        from kvforge.testing import Case, suite_checks
        check = next(c for c in suite_checks(self.kind) if c.__name__ == self.check_name)
        Case(self.kind, self.name, check).run(registry=registry())


def _params():
    from kvforge.testing import suite_checks
    out = []
    for kind in SUITE_KINDS:
        names = NAMES[kind]
        if not names:
            out.append(pytest.param(None, id=f"{kind}:<none registered>", marks=pytest.mark.skip(
                reason=f"no {kind} plugin is registered, so the {kind} suite has nothing to run against")))
        for name in names:
            if kind == "attention" and ATTENTION_MODES[name][0] != "in-process":
                continue
            for check in suite_checks(kind):
                cid = f"{kind}:{name}-{check.__name__.removeprefix('check_')}"
                out.append(pytest.param(LazyCase(kind, name, check.__name__), id=cid))
    return out


@pytest.mark.parametrize("case", _params())
def test_builtin_conformance(case):
    case.run()


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


@pytest.mark.parametrize("name", sorted(n for n, (m, _) in ATTENTION_MODES.items() if m != "in-process"))
def test_attention_conformance_out_of_process(name, tmp_path):
    mode, reasons = ATTENTION_MODES[name]
    if mode == "cannot-run":
        pytest.skip(f"attention backend {name!r} cannot run on {DEVICE.type} here: {'; '.join(reasons)}")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "--kvforge-conformance", f"attention:{name}", "--kvforge-grid", "small",
                           "-k", "mixed_batch_numerics or fp8_kv_cache"],
                          cwd=tmp_path, env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-2000:]


def test_every_kind_with_plugins_is_covered():
    """The suites cover every plugin kind except models (those are checked against
    Hugging Face in test_models_hf.py)."""
    kinds = {k for k in ("kv_allocator", "scheduler", "attention", "quantizer", "drafter") if registry().names(k)}
    assert set(SUITE_KINDS) >= kinds


def test_pytest_plugin_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in md.entry_points(group="pytest11") if ep.dist and ep.dist.name == "kvforge"}
    assert eps == {"kvforge": "kvforge.testing.pytest_plugin"}, (
        f"pytest11 entry points of kvforge: {eps} (re-run pip install -e .)")


@pytest.mark.parametrize("targets, needle", [
    (["scheduler:no_such_sched"], "unknown scheduler 'no_such_sched'; registered schedulers: "),
    (["nope"], "expected KIND:NAME"),
    (["model:LlamaForCausalLM"], "unknown plugin kind 'model'"),
])
def test_cli_option_errors_are_usage_errors(targets, needle):
    from kvforge.testing import pytest_plugin
    with pytest.raises(pytest.UsageError, match="--kvforge-conformance") as ei:
        pytest_plugin.pytest_configure(FakePytestConfig(targets))
    assert needle in str(ei.value), str(ei.value)
