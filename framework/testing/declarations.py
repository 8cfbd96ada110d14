"""The check every conformance suite starts with: the plugin's capability declarations (the
keyword arguments of its ``register`` call) use keys its kind knows, with the documented
types. An unknown key is most likely a typo, which the engine would otherwise ignore
(``prefix_cachng=True`` declares nothing), so here it fails instead of being logged.
"""
from __future__ import annotations

from kvforge.testing.harness import Target


def check_declarations(target: Target) -> None:
    """Fail on an unknown capability key (naming the closest known one) or a known key of the
    wrong type (:func:`kvforge.engine.capabilities.validate_declarations`)."""
    from kvforge.engine.capabilities import unknown_capabilities, validate_declarations
    problems = unknown_capabilities(target.spec)
    try:
        validate_declarations(target.spec)
    except ValueError as e:
        problems.append(str(e))
    assert not problems, "; ".join(problems)
