"""Request bodies of the OpenAI-compatible API (pydantic v2), with vLLM's extra sampling fields.

Field names and ranges follow the OpenAI API reference (``/v1/completions``,
``/v1/chat/completions``) and vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ...).
Validation is strict about types (``"2"`` is not an integer) and ranges, so every
error names its field; unknown fields are ignored, as a lenient client library expects.
Responses are plain dicts built by the serving modules.
"""
from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

#: Most completions per prompt (OpenAI's limit for ``n``).
MAX_N = 128
#: Most stop strings and stop token ids per request: each is checked on the engine thread at
#: every step of every sequence, so an unbounded list would slow every other request.
MAX_STOP = 256
MAX_STOP_TOKEN_IDS = 1024
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")  # ASCII digits only (str.isdigit takes "²")
_SEED_MAX = 2**63 - 1 - MAX_N


class _Strict(BaseModel):
    # allow_inf_nan=False: NaN / inf / 1e400 are refused as "finite number", before range checks
    model_config = ConfigDict(extra="ignore", strict=True, protected_namespaces=(), allow_inf_nan=False)


class _Request(_Strict):
    """A top-level request body: unknown fields are kept aside (``model_extra``, not used) so
    the server can name them in its log without parsing the body again."""
    model_config = ConfigDict(extra="allow")


def ignored_fields(req: BaseModel) -> list[str]:
    """The top-level fields of a validated request body that the API has no use for, sorted."""
    return sorted(req.model_extra or {})


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


#: Sampling fields beam search does not apply (refused when set, not ignored).
_IGNORED_BY_BEAM_SEARCH = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                           "logit_bias", "seed", "stop", "stop_token_ids", "min_tokens", "bad_words",
                           "allowed_token_ids")


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0)  # (no upper bound: vLLM's, not OpenAI's <= 2)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=_SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    prompt_logprobs: int | None = Field(None, ge=-1)  # per prompt token (-1: the vocabulary; cap: max_logprobs)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # the last k prompt tokens; -1: max_model_len
    # kvforge extension: the request's plugin choices, as SamplingParams.extra_args["kvforge"]
    # offline (e.g. {"drafter": "none"} opts out of speculative decoding); validated by the engine.
    kvforge: dict[str, Any] | None = None
    request_id: str | None = Field(None, min_length=1, max_length=256)
    use_beam_search: bool = False  # vLLM's: beam search of width n (serving_beam.py); not streamed
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    length_penalty: float = 1.0  # with use_beam_search: the final score is cum_logprob / len**length_penalty

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            return v
        raise ValueError("must be a string or a list of strings")

    @field_validator("stop", mode="after")
    @classmethod
    def _nonempty_stop(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in items):
            raise ValueError("must not contain empty strings")
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(items)}")
        return v

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _check_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, val in (v or {}).items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"keys must be token ids (integers as strings), got {key[:40]!r}")
            if not -100.0 <= val <= 100.0:
                raise ValueError(f"values must be in [-100, 100], got {val} for token {key}")
        return v

    @field_validator("stop_token_ids", mode="after")
    @classmethod
    def _check_stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        if v and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(v)}")
        return v

    @model_validator(mode="after")
    def _check_stream_options(self) -> "_SamplingFields":
        if self.use_beam_search:
            for name, on in (("stream", self.stream), ("prompt_logprobs", self.prompt_logprobs is not None),
                             ("logprobs", getattr(self, "logprobs", None) is not None
                              and getattr(self, "logprobs") is not False)):  # (0 asks for logprobs too)
                if on:
                    raise ValueError(f"{name}: not available with use_beam_search")
            fields = type(self).model_fields
            for name in _IGNORED_BY_BEAM_SEARCH:  # set to something: it would be silently ignored
                if name in self.model_fields_set and getattr(self, name) != fields[name].default:
                    raise ValueError(f"{name}: not applied by use_beam_search (it ranks the beams' raw "
                                     "log-probabilities); leave it unset")
        if not math.isfinite(self.length_penalty):
            raise ValueError("length_penalty: must be a finite number")
        given = [n for n in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, n) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"{given[1]}: only one output constraint per request (also got {given[0]})")
        if given and self.use_beam_search:
            raise ValueError(f"{given[0]}: not available with use_beam_search")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens: must be >= 1, or -1 for max_model_len")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: returned with the full response only
            raise ValueError("prompt_logprobs: not available when stream is true")
        return self


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token
    ids, or a list of token-id lists (a batch)."""

    prompt: Any
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo (prompt scoring)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)  # cap: the engine's model.max_logprobs
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> Any:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool)
                                                            for t in x)
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(p, str) for p in v) or is_ids(v) or all(is_ids(p) for p in v):
                return v
        raise ValueError("must be a string, a non-empty list of strings, a non-empty list of token ids, "
                         "or a list of non-empty token-id lists")

    @model_validator(mode="after")
    def _check_unsupported(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if self.suffix:
            raise ValueError("suffix: not supported by this server")
        if self.max_tokens == 0 and not self.echo:  # as vLLM: 0 means "score the prompt", which needs echo
            raise ValueError("max_tokens: must be >= 1 (0 is allowed only with echo, to return the prompt "
                             "and its logprobs)")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; ``content`` is a string, a list of text parts, or null (assistant tool calls)."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _check_content(cls, v: Any, info: ValidationInfo) -> Any:
        # as OpenAI's API: only an assistant message (one that carried tool calls) may omit it
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"required for a {info.data['role']!r} message (a string or a list of text parts)")
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"part {i}: only text content parts are supported, got type {kind!r}")
            return v
        raise ValueError("must be a string, a list of content parts, or null")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's ``{name, schema, strict, description}``."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema`` (structured outputs)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")  # (pydantic prefixes the field)
        return self


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # cap: the engine's model.max_logprobs
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    @model_validator(mode="after")
    def _check_chat(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot be combined with add_generation_prompt=true")
        from kvforge.entrypoints.openai.tool_calls import check_tools
        check_tools(self.tools, self.tool_choice)  # ("auto" needs the server's parser: the handler checks)
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            others = [n for n in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                                  "guided_choice", "guided_grammar") if getattr(self, n) is not None
                      and not (n == "response_format" and self.response_format.type == "text")]
            if others:
                raise ValueError(f"{others[0]}: cannot be combined with tool_choice {self.tool_choice!r:.60} "
                                 "(it constrains the output itself)")
            if self.use_beam_search:
                raise ValueError("tool_choice: not available with use_beam_search")
        return self

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens``, else the deprecated ``max_tokens`` (tokens)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(_Request):
    """``POST /tokenize``: either ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = True
