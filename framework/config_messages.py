"""Messages for configuration errors: pydantic's errors as one line per field, and the check
for a boolean given where a number is meant (YAML's yes / no / on / off)."""
from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import ValidationError


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool) or type(v).__name__ in ("bool", "bool_")  # (numpy's too: np.bool_)


def boolean_for_number(annotation: Any, value: Any) -> bool:
    """Whether ``value`` is a boolean (or a list / tuple holding one) given to a field whose type
    admits only numbers there (int / float, optionally None; or a list / tuple of them).
    pydantic's lax mode would read it as 1 or 0, and YAML reads yes / no / on / off as booleans."""
    members = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    members = [m for m in members if m is not type(None)]
    if _is_bool(value):
        return bool(members) and all(m in (int, float) for m in members)
    if isinstance(value, (list, tuple)):
        elems = [e for m in members if get_origin(m) in (list, tuple) for e in get_args(m) if e is not Ellipsis]
        return bool(elems) and all(e in (int, float) for e in elems) and any(_is_bool(v) for v in value)
    return False


def boolean_for_number_message(value: Any) -> str:
    what = f"the boolean {value!r}" if _is_bool(value) else f"{value!r}, which holds a boolean"
    return f"expected a number, got {what} (in YAML, yes / no / on / off are booleans)"


def validation_message(err: dict) -> str:
    """A pydantic error's message without pydantic's own prefix ("Value error, " for a
    validator's ValueError, "Assertion failed, " for its assert)."""
    msg = str(err.get("msg", "invalid value"))
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def config_error_message(e: ValidationError) -> str:
    """``invalid config: FIELD: MESSAGE; ...``: one clause per bad field (no pydantic dump); a
    missing model says where one comes from; a flag's flat name used as a file key, its path."""
    from kvforge.config import FLAT_FIELDS as flat  # (kvforge.config imports this module)

    def one(err: dict) -> str:
        where = ".".join(map(str, err["loc"]))
        missing_model = err.get("type") == "missing" and tuple(err["loc"]) in (("model",), ("model", "model"))
        hint = (" (pass --model DIR, LLM('DIR') in Python, or set model.model in the config file)"
                if missing_model else "")
        loc = tuple(err["loc"])
        if err.get("type") == "extra_forbidden" and len(loc) == 1 and loc[0] in flat:
            hint = f" (in a config file it is {flat[loc[0]]})"  # a flag's name used as a file key
        return f"{where}: {validation_message(err)}{hint}" if where else validation_message(err)
    return "invalid config: " + "; ".join(one(err) for err in e.errors())
