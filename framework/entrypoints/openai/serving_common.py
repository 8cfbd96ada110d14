"""Shared pieces of the completion and chat handlers: server context, adding and awaiting
requests, streaming deltas, SSE framing, disconnect handling (the request-field mapping lives in
:mod:`.request_fields` and the logprobs helpers in :mod:`.logprob_utils`; both are re-exported here)."""
from __future__ import annotations

import asyncio
import functools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request, Response
from starlette.responses import StreamingResponse

from kvforge.engine.async_engine import AsyncLLMEngine, EngineClosedError, EngineError, RequestStream
from kvforge.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvforge.engine.request_choices import EXTRA_ARGS_KEY
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.tokenizer import check_text, eos_token_ids, extra_eos_token_ids, max_token_chars
from kvforge.entrypoints.openai.errors import OpenAIError
from kvforge.entrypoints.openai.logprob_utils import (LOGPROB_FLOOR, clamp, prompt_logprobs_json,  # noqa: F401
                                                      sorted_top, token_bytes, token_text)

from kvforge.entrypoints.openai.request_fields import (REQUEST_ID_HEADER, engine_prompt, request_id,  # noqa: F401
                                                       resolve_max_tokens, sampling_params, truncate_prompt)


@dataclass
class ServerContext:
    """What the handlers share.

    Attributes:
        engine: the running :class:`AsyncLLMEngine`.
        tokenizer: the server's own tokenizer instance (the engine thread uses another).
        served_model_names: names accepted in ``model`` (the first is reported).
        max_model_len: prompt + output token limit (tokens).
        chat_template: ``--chat-template`` text, overriding the tokenizer's.
        model_path: checkpoint directory.
        max_logprobs: the engine's ``model.max_logprobs`` (most log-probabilities per token).
        trust_request_chat_template: ``--trust-request-chat-template``: render a request's own
            ``chat_template`` (refused with a 400 otherwise, as in vLLM).
        tool_call_parser: with ``--enable-auto-tool-choice``, the parser of ``tool_choice: auto``
            answers (:mod:`.tool_calls`); None refuses ``auto``.
        executor: the one thread that uses ``tokenizer`` (a fast tokenizer is not shared across threads).
        max_prompt_chars: text prompts longer than this are refused before they are tokenized.
        render_executor: threads for chat-template rendering (pure Python Jinja, no tokenizer
            state), so a slow template holds up neither the event loop nor other requests' tokenizing.
    """

    engine: AsyncLLMEngine
    tokenizer: Any
    served_model_names: list[str]
    max_model_len: int
    vocab_size: int
    chat_template: str | None = None
    model_path: str = ""
    api_key: str | None = None
    max_logprobs: int = 20
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "kvforge-tokenize"))
    render_executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, "kvforge-chat-template"))
    #: More characters than this cannot fit ``max_model_len`` tokens: x 4 over max_model_len x the
    #: longest token, for a normalizer that composes a few characters into one (NFC / NFKC).
    max_prompt_chars: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_prompt_chars = 4 * self.max_model_len * max_token_chars(self.tokenizer)

    @functools.cached_property
    def eos_ids(self) -> tuple[frozenset[int], frozenset[int]]:
        """(every EOS id, those that are stop ids rather than the tokenizer's own EOS): read from
        the tokenizer and ``generation_config.json`` once, as the engine reads them."""
        eos = eos_token_ids(self.tokenizer, self.model_path)
        return eos, extra_eos_token_ids(self.tokenizer, eos)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def response_model(self, requested: str | None) -> str:
        """The ``model`` a response names: the served name the request asked for (as vLLM echoes
        it), else the first served name."""
        return requested if requested in self.served_model_names else self.model_name

    def check_model(self, model: str | None) -> None:
        """Raise 404 ``model_not_found`` (OpenAI's and vLLM's status) for a model this server does not
        serve; no ``model`` at all means the served one, as in vLLM."""
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(f"model: the model {model!r} does not exist; this server serves "
                              f"{', '.join(repr(n) for n in self.served_model_names)}", 404,
                              param="model", code="model_not_found")

    async def run_tokenizer(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a (possibly slow) tokenizer call off the event loop, one at a time."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def json_response(self, build: Callable[[], dict[str, Any]], headers: dict[str, str]) -> Response:
        """A JSON response whose body ``build()`` makes, off the event loop: a large one (n = 128
        with echo and logprobs is ~100 MB) would otherwise hold every other request, /health
        included, for seconds. ``build`` decodes tokens, so it runs on the tokenizer's thread;
        the serialization (as Starlette's JSONResponse does it) runs on another."""
        obj = await self.run_tokenizer(build)
        body = await asyncio.get_running_loop().run_in_executor(
            None, lambda: json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None,
                                     separators=(",", ":")).encode("utf-8"))
        return Response(body, media_type="application/json", headers=headers)

    async def run_render(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run a chat-template render off the event loop, beside (not behind) tokenizer calls."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.render_executor, lambda: fn(*args, **kwargs))

    def check_text(self, text: str, field: str, prompt: bool = True) -> None:
        """Raise OpenAIError (400) naming ``field`` for text that is not valid Unicode and, for a
        ``prompt``, for one too long for the model by its character count alone."""
        try:
            check_text(text, field)
        except ValueError as e:
            raise OpenAIError(str(e), 400, param=field) from None
        if prompt and len(text) > self.max_prompt_chars:
            raise OpenAIError(f"{field}: this model's maximum context length is {self.max_model_len} tokens, and "
                              f"{len(text)} characters are more than that many tokens spell", 400, param=field,
                              code="context_length_exceeded")

    async def encode(self, text: str, add_special_tokens: bool, field: str = "prompt",
                     prompt: bool = True) -> list[int]:
        """Token ids of ``text`` (on the tokenizer thread). Raises OpenAIError (400) naming ``field``
        for text that is not valid Unicode and, for a ``prompt``, for one too long for the model
        by its character count alone (so a huge body does not hold the tokenizer thread)."""
        self.check_text(text, field, prompt)
        return await self.run_tokenizer(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    def shutdown(self) -> None:
        """Stop the worker threads (queued calls are dropped; running ones finish on their own)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.render_executor.shutdown(wait=False, cancel_futures=True)


async def add_all(ctx: ServerContext, items: list[tuple[str, dict, SamplingParams]],
                  priority: int) -> list[RequestStream]:
    """Add several engine requests; all-or-nothing (a rejection aborts the ones added)."""
    streams: list[RequestStream] = []
    try:
        for rid, prompt, params in items:
            streams.append(await ctx.engine.add_request(rid, prompt, params, priority=priority))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, ValueError):  # the engine names SamplingParams.extra_args["kvforge"]: here it is "kvforge"
            raise OpenAIError(str(e).replace(f"extra_args.{EXTRA_ARGS_KEY}", "kvforge"), 400) from e
        if isinstance(e, EngineClosedError):
            raise OpenAIError(str(e), 503) from e
        if isinstance(e, EngineError):
            raise OpenAIError(str(e), 500, code="engine_error") from e
        raise
    return streams


def check_failed(out: RequestOutput) -> None:
    """Raise the OpenAI error for an output that ended in ``error`` or ``abort``."""
    reasons = {c.finish_reason for c in out.outputs}
    if "error" in reasons or out.error:
        raise OpenAIError(out.error or "engine error", 500, code="engine_error")
    if "abort" in reasons:
        raise OpenAIError("request aborted (server shutting down)", 503)


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Wait for every stream's final output; aborts them all if cancelled or failed."""
    async def last(s: RequestStream) -> RequestOutput:
        out = None
        async for out in s:
            pass
        return out

    try:
        outs = await asyncio.gather(*(last(s) for s in streams))
    except EngineClosedError as e:
        raise OpenAIError(str(e), 503) from e
    except EngineError as e:
        raise OpenAIError(str(e), 500, code="engine_error") from e
    finally:
        for s in streams:
            s.abort()
    for o in outs:
        check_failed(o)
    return outs


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several streams as ``(stream index, output)``; aborts all on early exit."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    q.put_nowait((i, out, None))
                q.put_nowait((i, None, None))
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                q.put_nowait((i, None, e))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, out, err = await q.get()
                if err is not None:
                    raise err
                if out is None:
                    remaining -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.abort()


async def race_disconnect(raw: Request, coro: Awaitable[Any]) -> Any:
    """Run ``coro``; if the client disconnects first, cancel it (its streams abort) and
    raise :class:`OpenAIError` 499."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            msg = await raw.receive()
            if msg.get("type") == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:  # noqa: BLE001 - the client is gone; nothing to report
        pass
    raise OpenAIError("client disconnected", 499)


# -- streaming --------------------------------------------------------------------------------
def dumps(obj: Any) -> str:
    """Compact JSON; raises on NaN/inf (log-probabilities are clamped before)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_chunk(rid: str, obj: str, created: int, model: str, choices: list[dict], include_usage: bool,
                 usage: dict | None) -> str:
    """One SSE chunk of a streamed completion (``obj``: ``text_completion`` or
    ``chat.completion.chunk``); ``usage`` is present (maybe null) only when asked for."""
    body = {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": None,
            "choices": choices}
    if include_usage:
        body["usage"] = usage
    return sse(body)


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response that, however it ends, closes its body iterator and
    aborts ``streams`` (a no-op for finished ones), so a request whose client vanished
    before or during streaming stops running at once."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, streams: list[RequestStream], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", **(headers or {})})
        self._streams = streams

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


class ChoiceDelta:
    """Streaming state of one choice: what text and tokens were sent already.

    Deltas come from the engine's cumulative ``CompletionOutput.text``, which never
    shrinks (the engine holds back a possible stop-string start while a choice runs).
    """

    def __init__(self, params: SamplingParams) -> None:
        self.sent_chars = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.finished = False

    def update(self, c: CompletionOutput) -> tuple[str, list[int], list[dict[int, Logprob]] | None, bool]:
        """``(new text, new token ids, new logprob entries or None, just finished)``."""
        done = c.finish_reason is not None
        text = c.text
        new_text = text[self.sent_chars:]
        self.sent_chars = max(self.sent_chars, len(text))
        new_ids = c.token_ids[self.sent_tokens:]
        self.sent_tokens = len(c.token_ids)
        new_lps = None
        if c.logprobs is not None:
            new_lps = c.logprobs[self.sent_logprobs:]
            self.sent_logprobs = len(c.logprobs)
        just_finished = done and not self.finished
        self.finished = self.finished or done
        return new_text, new_ids, new_lps, just_finished


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    """Unix time (s) for ``created``."""
    return int(time.time())


def error_event(exc: BaseException) -> str:
    """An SSE error event (vLLM sends these for failures after the 200 headers went out)."""
    if isinstance(exc, OpenAIError):
        return sse(exc.body())
    status = 503 if isinstance(exc, EngineClosedError) else 500
    return sse(OpenAIError(str(exc), status, code="engine_error" if status == 500 else None).body())
