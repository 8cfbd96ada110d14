"""kvforge's KV-allocator conformance suite against this plugin, from our own tests.

The same checks run from the command line with
``pytest --kvforge-conformance kv_allocator:lfu``.
"""
import pytest

from kvforge.testing import conformance_cases


@pytest.mark.parametrize("case", conformance_cases("kv_allocator", "lfu"), ids=str)
def test_kvforge_conformance(case):
    case.run()
