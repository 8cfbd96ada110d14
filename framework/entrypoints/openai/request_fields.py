"""The request fields the completion and chat handlers map onto the engine's inputs: the request
id, the output budget against ``max_model_len``, :class:`SamplingParams`, the engine prompt
(re-exported by :mod:`.serving_common`)."""
from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvforge.engine.request_choices import EXTRA_ARGS_KEY
from kvforge.engine.sampling_params import SamplingParams
from kvforge.entrypoints.openai.errors import OpenAIError
from kvforge.entrypoints.openai.protocol import _SamplingFields

if TYPE_CHECKING:  # pragma: no cover
    from kvforge.entrypoints.openai.serving_common import ServerContext

REQUEST_ID_HEADER = "X-Request-Id"

#: What the response's ``X-Request-Id`` header can carry (RFC 9110 field values): visible ASCII,
#: spaces inside only. A body ``request_id`` outside it would fail only when the answer is sent.
_HEADER_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


def request_id(raw: Request, body_id: str | None, prefix: str) -> str:
    """The request id: the ``X-Request-Id`` header, else the body's ``request_id``, else a fresh one.
    Raises OpenAIError (400) for an id of more than 256 characters or, from the body, one that
    is not a legal header value (it is echoed in ``X-Request-Id``)."""
    header = raw.headers.get(REQUEST_ID_HEADER)
    rid, field = (header, REQUEST_ID_HEADER) if header else (body_id, "request_id")
    if rid is not None:
        if not 0 < len(rid) <= 256:
            raise OpenAIError(f"{field}: must be 1..256 characters", 400, param=field)
        if not _HEADER_VALUE.fullmatch(rid):
            raise OpenAIError(f"{field}: must be visible ASCII characters (spaces only inside), as it is echoed "
                              f"in the {REQUEST_ID_HEADER} response header", 400, param=field)
        return rid
    return f"{prefix}-{uuid.uuid4().hex}"


def resolve_max_tokens(ctx: ServerContext, num_prompt: int, requested: int | None, explicit: bool,
                       prompt_field: str, max_field: str) -> int:
    """Check a prompt of ``num_prompt`` tokens against ``max_model_len`` and return the
    output budget (tokens). An explicit ``max_tokens`` that does not fit is a 400; a default
    one is clamped to the room left; None means "up to max_model_len"."""
    room = ctx.max_model_len - num_prompt
    if room < 1:
        raise OpenAIError(f"{prompt_field}: this model's maximum context length is {ctx.max_model_len} "
                          f"tokens, but the prompt has {num_prompt} tokens", 400, param=prompt_field,
                          code="context_length_exceeded")
    if requested is None:
        return room
    if requested > room:
        if not explicit:
            return room
        raise OpenAIError(f"{max_field}: this model's maximum context length is {ctx.max_model_len} tokens, "
                          f"but {num_prompt} prompt tokens + {requested} {max_field} = "
                          f"{num_prompt + requested}", 400, param=max_field, code="context_length_exceeded")
    return requested


def truncate_prompt(ctx: ServerContext, ids: list[int], keep: int | None) -> list[int]:
    """The prompt's last ``keep`` tokens (``truncate_prompt_tokens``; -1: ``max_model_len``), before
    the prompt is checked against the context; OpenAIError (400) for ``keep`` over ``max_model_len``."""
    if keep is None:
        return ids
    if keep > ctx.max_model_len:
        raise OpenAIError(f"truncate_prompt_tokens: {keep} exceeds max_model_len ({ctx.max_model_len})", 400,
                          param="truncate_prompt_tokens")
    return ids[-(ctx.max_model_len if keep == -1 else keep):]


def sampling_params(req: _SamplingFields, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """Map the shared request fields onto :class:`SamplingParams` (vLLM's defaults where unset)."""
    kw: dict[str, Any] = dict(
        n=req.n, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.kvforge is not None:
        kw["extra_args"] = {EXTRA_ARGS_KEY: req.kvforge}
    constraint = structured_outputs(req)
    if constraint is not None:
        kw["structured_outputs"] = constraint
    if req.min_tokens > max_tokens:
        raise OpenAIError(f"min_tokens: must be <= max_tokens ({max_tokens}), got {req.min_tokens}", 400)
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise OpenAIError(str(e), 400) from e


def structured_outputs(req: _SamplingFields) -> dict[str, Any] | None:
    """The request's output constraint as ``StructuredOutputsParams`` fields (the protocol
    allows at most one source): a forced tool call (``tool_choice``, :mod:`.tool_calls`),
    ``response_format`` json_object / json_schema, vLLM's
    ``structured_outputs`` object or its older ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar``."""
    from kvforge.entrypoints.openai.tool_calls import constraint
    forced = constraint(req)  # (a named or required tool call)
    if forced is not None:
        return forced
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        return {"json_object": True}
    if rf is not None and rf.type == "json_schema":
        return {"json": rf.json_schema.json_schema}
    if req.structured_outputs is not None:
        return dict(req.structured_outputs)
    for field in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{field}")
        if value is not None:
            return {field: value}
    return None


def engine_prompt(ids: list[int], text: str | None, cache_salt: str | None) -> dict[str, Any]:
    p: dict[str, Any] = {"prompt_token_ids": ids}
    if text is not None:
        p["prompt"] = text
    if cache_salt is not None:
        p["cache_salt"] = cache_salt
    return p
