"""pyproject.toml lists every package (explicit because of the package-dir renames), and the
packages' metadata builds under current setuptools without deprecations."""
import os
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_every_package_is_listed():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = set()
    for src, name in (("framework", "kvforge"), ("plugins", "kvforge_plugins")):
        for d, _, files in os.walk(os.path.join(ROOT, src)):
            if "__init__.py" in files:
                rel = os.path.relpath(d, os.path.join(ROOT, src))
                found.add(name if rel == "." else f"{name}.{rel.replace(os.sep, '.')}")
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"


@pytest.mark.parametrize("project", [".", "examples/kvforge-cache-aware-scheduler", "examples/kvforge-lfu-allocator"])
def test_metadata_builds_without_deprecations(project, tmp_path):
    """The wheel metadata builds with setuptools' deprecation warnings as errors (a TOML-table
    ``project.license`` is one: setuptools stops accepting it), and declares the SPDX license."""
    code = ("import sys, warnings\n"
            "from setuptools import build_meta\n"
            "from setuptools.warnings import SetuptoolsDeprecationWarning\n"
            "warnings.simplefilter('error', SetuptoolsDeprecationWarning)\n"
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=os.path.join(ROOT, project),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = (tmp_path / proc.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in meta.splitlines()
