"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

Status codes: 400 invalid request (bad JSON, types, ranges, prompt too long, duplicate
request id), 401 missing or wrong API key, 404 unknown route or model, 500 engine failure,
503 shutting down.
"""
from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvforge.config_messages import validation_message

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "service_unavailable"}
_TYPE_TAGS = frozenset({"function-after", "function-before", "function-wrap", "function-plain", "str", "int",
                        "float", "bool", "list", "dict", "none", "literal"})
_PARAM_PREFIX = re.compile(r"^([A-Za-z_][\w.\[\]-]*):\s")


class OpenAIError(Exception):
    """An error to return to the client.

    Args:
        message: human-readable; starts with the field name for invalid input.
        status: HTTP status code.
        param: the offending field, if any (derived from ``"field: ..."`` messages).
        code: short machine-readable code (e.g. ``"invalid_api_key"``).
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        if param is None:
            m = _PARAM_PREFIX.match(message)
            param = m.group(1) if m else None
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param, self.code)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object for ``status``."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _loc_str(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in str(part):  # union-member / validator tags, not fields
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """The first pydantic error, as ``"field: message"`` (400)."""
    errs = exc.errors()
    if not errs:
        return OpenAIError("invalid request body", 400)
    # A union (e.g. ``content: str | list[part]``) reports one error per member; the deepest
    # one for the first failing field is the informative one.
    top = tuple(errs[0].get("loc", ()))[:2]
    e = max((x for x in errs if tuple(x.get("loc", ()))[:2] == top), key=lambda x: len(x.get("loc", ())))
    loc = tuple(x for x in e.get("loc", ()) if x != "body")
    msg = validation_message(e)
    if e.get("type") == "json_invalid":
        return OpenAIError(f"body: malformed JSON: {msg}", 400, param="body", code="invalid_json")
    if e.get("type") == "model_type" and not loc:
        return OpenAIError("body: must be a JSON object", 400, param="body")
    field = _loc_str(loc)
    if not field:
        return OpenAIError(msg, 400)
    if e.get("type") == "missing":
        return OpenAIError(f"{field}: field required", 400, param=field)
    return OpenAIError(f"{field}: {msg}", 400, param=field)


def install_handlers(app: FastAPI) -> None:
    """Render every error (ours, FastAPI's, Starlette's, unexpected ones) as an OpenAI error."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc))

    @app.exception_handler(ValidationError)
    async def _validation2(_: Request, exc: ValidationError) -> JSONResponse:
        return error_response(from_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)
