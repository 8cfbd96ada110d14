"""pyproject.toml lists every package (explicit because of the package-dir renames)."""
import os
import tomllib

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
