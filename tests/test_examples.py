"""The third-party example packages in examples/ install with pip from their own
folders, pass kvforge's conformance suites (run with ``pytest --kvforge-conformance``,
together with their own tests) and run end to end from the ``kvforge`` CLI, selected
by name -- exactly what a plugin author's CI does.

The packages are copied to a temporary directory first (no build artifacts in the
repository) and installed with ``pip install --no-deps --no-build-isolation --target``;
subprocesses see them through ``PYTHONPATH``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import STORIES_MODEL

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {
    # folder: (kind, registered name, distribution, generate flags)
    "kvforge-cache-aware-scheduler": ("scheduler", "cache_aware", "kvforge-cache-aware-scheduler",
                                      ["--scheduler", "cache_aware", "--enable-prefix-caching", "true"]),
    "kvforge-lfu-allocator": ("kv_allocator", "lfu", "kvforge-lfu-allocator",
                              ["--kv-allocator", "lfu", "--enable-prefix-caching", "true"]),
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(site dir with both packages installed, dir holding the copied sources)."""
    tmp = tmp_path_factory.mktemp("examples")
    src = tmp / "src"
    for folder in EXAMPLES:
        shutil.copytree(REPO / "examples" / folder, src / folder,
                        ignore=shutil.ignore_patterns("*.egg-info", "build", "dist", "__pycache__", ".pytest_cache"))
    site = tmp / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--target", str(site)] + [str(src / f) for f in EXAMPLES],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for _, _, dist, _ in EXAMPLES.values():
        assert list(site.glob(f"{dist.replace('-', '_')}-*.dist-info")), sorted(p.name for p in site.iterdir())
    return site, src


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVFORGE_PLUGINS", "KVFORGE_DISABLE_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("KVFORGE_TEST_MODEL", STORIES_MODEL)
    return env


def _artifacts() -> dict[str, list[str]]:
    return {folder: sorted(p.name for p in (REPO / "examples" / folder).iterdir()
                           if p.name.endswith(".egg-info") or p.name in ("build", "dist")) for folder in EXAMPLES}


#: Taken at import: a user's own ``pip install ./examples/...`` builds in place (pip does), which
#: is theirs, not the suite's.
_BEFORE = _artifacts()


def test_examples_are_not_built_in_place(installed):
    """The suite installs copies, so it leaves no build artifacts in the checkout's examples."""
    assert _artifacts() == _BEFORE, f"the suite built in place: {_BEFORE} -> {_artifacts()}"


def test_examples_conformance_and_own_tests(installed, tmp_path):
    """``pytest --kvforge-conformance scheduler:cache_aware --kvforge-conformance kv_allocator:lfu
    <their tests>``: kvforge's suites through the pytest11 plugin plus each package's own behaviour
    tests, in one process (their programmatic copies of the suites are deselected)."""
    site, src = installed
    targets = [f"{kind}:{name}" for kind, name, _, _ in EXAMPLES.values()]
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfEs", "--import-mode=importlib",
           "--rootdir", str(src), "-k", "not test_kvforge_conformance"]
    for t in targets:
        cmd += ["--kvforge-conformance", t]
    cmd += [str(src / folder / "tests") for folder in EXAMPLES]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(site), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    from kvforge.testing import suite_checks
    for kind, name, _, _ in EXAMPLES.values():
        for check in suite_checks(kind):
            item = f"test_conformance[{kind}:{name}-{check.__name__.removeprefix('check_')}] PASSED"
            assert item in proc.stdout, f"{item!r} not in the output:\n{out[-4000:]}"
    for folder in EXAMPLES:
        own = [ln for ln in proc.stdout.splitlines() if f"{folder}/tests/test_" in ln and " PASSED" in ln]
        assert own, f"the own tests of {folder} did not run:\n{out[-4000:]}"


def test_examples_generate_end_to_end(installed):
    """One ``kvforge generate`` selecting both example plugins by name (scheduler and allocator)."""
    site, _ = installed
    flags = [f for *_, fl in EXAMPLES.values() for f in fl]
    cmd = [sys.executable, "-m", "kvforge.entrypoints.cli", "generate", "--model", STORIES_MODEL, *flags,
           "--max-tokens", "20", "Once upon a time", "Once upon a time, there was"]
    proc = subprocess.run(cmd, env=_env(site), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Greedy continuation of the reference checkpoint (see /work/shared/models/README.md); the
    # second prompt's prefix is cached by the time it is admitted.
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Once upon a time, there was a little girl named Lily"), proc.stdout
    assert lines[1].startswith("Once upon a time, there was a little girl named Lily"), proc.stdout
    assert proc.stderr.count("finish_reason=length") == 2, proc.stderr[-2000:]


def test_examples_registered_by_their_distributions(installed, monkeypatch):
    """In-process: with the install dir on sys.path, the registry finds both through their
    entry points, under their own distributions and hook API."""
    site, _ = installed
    monkeypatch.syspath_prepend(str(site))
    from kvforge.plugin_manager import load_registry
    reg = load_registry()
    for kind, name, dist, _ in EXAMPLES.values():
        spec = reg.get(kind, name)
        assert (spec.distribution, spec.version, spec.hook_api) == (dist, "0.1.0", "1"), spec
    assert reg.get("scheduler", "cache_aware").capabilities["requires_prefix_caching"] is True
    assert reg.get("kv_allocator", "lfu").capabilities["prefix_caching"] is True
