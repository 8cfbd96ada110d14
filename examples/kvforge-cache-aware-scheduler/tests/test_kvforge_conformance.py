"""kvforge's scheduler conformance suite against this plugin, from our own tests.

The same checks run from the command line with
``pytest --kvforge-conformance scheduler:cache_aware``.
"""
import pytest

from kvforge.testing import conformance_cases


@pytest.mark.parametrize("case", conformance_cases("scheduler", "cache_aware"), ids=str)
def test_kvforge_conformance(case):
    case.run()
