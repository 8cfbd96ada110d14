"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): app factory and ``kvforge serve``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus), ``POST /tokenize``, ``POST /detokenize``.
With ``--api-key`` every route except ``/health`` and ``/metrics`` needs
``Authorization: Bearer KEY`` (401 otherwise). ``X-Request-Id`` names a request (a
duplicate in-flight id is a 400) and is echoed in the response. A request's own
``chat_template`` is rendered only with ``--trust-request-chat-template``; ``--chat-template``
is compiled at start-up (a syntax error stops the server before it loads the model).

Shutdown (SIGTERM / SIGINT): uvicorn stops accepting connections and the engine starts to drain:
in-flight requests finish, or at ``--drain-timeout`` are aborted and answered 503; uvicorn waits
a few seconds longer for those answers, then the engine stops; the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvforge.engine.async_engine import AsyncLLMEngine
from kvforge.engine.metrics import CONTENT_TYPE, EngineMetrics
from kvforge.engine.tokenizer import load_tokenizer
from kvforge.entrypoints.openai import serving_chat, serving_completion
from kvforge.entrypoints.openai.chat_utils import compile_chat_template, encode_chat_prompt
from kvforge.entrypoints.openai.errors import OpenAIError, error_response, install_handlers
from kvforge.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, ignored_fields)
from kvforge.entrypoints.openai.serving_common import ServerContext

log = logging.getLogger("kvforge.server")
_OPEN_PATHS = frozenset({"/health", "/metrics", "/ping"})


#: Seconds uvicorn waits for connections after the engine's drain deadline (the 503s to send).
_GRACE_MARGIN_S = 5.0


def _draining_server(config: Any, engine: AsyncLLMEngine, drain_timeout: float | None) -> Any:
    """A ``uvicorn.Server`` that starts the engine's drain (``AsyncLLMEngine.shutdown``) as soon as
    its own shutdown starts, instead of after every connection closed (the lifespan's turn): the
    requests still running at the drain deadline are aborted and answered (503) while uvicorn
    waits for their connections."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            drain = asyncio.ensure_future(engine.shutdown(drain_timeout))
            try:
                await super().shutdown(sockets)
            finally:
                await drain

    return DrainingServer(config)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str] | None = None,
              api_key: str | None = None, chat_template: str | None = None,
              drain_timeout: float | None = 30.0, trust_request_chat_template: bool = False,
              tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine`` (started on app startup, drained on shutdown).

    Args:
        engine: an :class:`AsyncLLMEngine` (not yet started, or started).
        served_model_names: names accepted as ``model`` (default: the model directory path).
        api_key: required bearer token, or None for no authentication.
        chat_template: Jinja chat template text overriding the tokenizer's.
        drain_timeout: seconds the engine waits for in-flight requests at shutdown.
        trust_request_chat_template: render a chat request's own ``chat_template`` (else a 400).
        tool_call_parser: parser of ``tool_choice: auto`` answers (a key of
            :data:`~kvforge.entrypoints.openai.tool_parsers.PARSERS`); None refuses auto.

    Raises:
        ValueError: ``chat_template`` is empty or has a Jinja syntax error (naming ``chat_template``).
    """
    if chat_template is not None:
        compile_chat_template(chat_template, "chat_template")
    core = engine.engine
    cfg = core.config.model
    names = list(served_model_names or [cfg.model])
    if engine.metrics is None:
        engine.metrics = EngineMetrics(names[0], engine.stats)
    ctx = ServerContext(engine=engine, tokenizer=load_tokenizer(cfg.tokenizer or cfg.model),
                        served_model_names=names, max_model_len=core.max_model_len,
                        vocab_size=core.vocab_size, chat_template=chat_template, model_path=cfg.model,
                        api_key=api_key, max_logprobs=cfg.max_logprobs,
                        trust_request_chat_template=trust_request_chat_template, tool_call_parser=tool_call_parser)
    _check_tokenizer_template(ctx)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown(drain_timeout)
            ctx.shutdown()

    app = FastAPI(title="kvforge", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    app.state.engine = engine
    install_handlers(app)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if api_key and request.url.path not in _OPEN_PATHS and request.method != "OPTIONS":
            auth = request.headers.get("authorization", "")
            token = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), api_key.encode()):
                msg = "missing API key" if not auth else "incorrect API key"
                return error_response(OpenAIError(f"Authorization: {msg}", 401, param=None,
                                                  code="invalid_api_key"))
        return await call_next(request)

    async def body(raw: Request, model_cls):
        from starlette.requests import ClientDisconnect
        try:
            data = await raw.body()
        except ClientDisconnect:  # (not the server's error: no traceback at ERROR level for it)
            raise OpenAIError("body: the client disconnected while sending it", 400, param="body") from None
        req = model_cls.model_validate_json(data or b"")
        extra = ignored_fields(req)
        if extra:  # (as vLLM does: OpenAI clients send fields this server has no use for)
            shown = ", ".join(name[:40] for name in extra[:10]) + (f" and {len(extra) - 10} more" if len(extra) > 10
                                                                    else "")
            log.warning("%s: the request's fields %s are not part of the API and were ignored", raw.url.path, shown)
        return req

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await serving_completion.create_completion(ctx, await body(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await serving_chat.create_chat_completion(ctx, await body(raw, ChatCompletionRequest), raw)

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        data = [{"id": n, "object": "model", "created": created, "owned_by": "kvforge", "root": cfg.model,
                 "parent": None, "max_model_len": ctx.max_model_len} for n in names]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        req = await body(raw, TokenizeRequest)
        ctx.check_model(req.model)
        if req.messages is not None:
            text = await ctx.run_render(serving_chat.render_chat, ctx, req.messages, req.add_generation_prompt)
            ids = await ctx.run_tokenizer(encode_chat_prompt, ctx.tokenizer, text, False)
        else:
            ids = await ctx.encode(req.prompt, req.add_special_tokens, prompt=False)
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req = await body(raw, DetokenizeRequest)
        ctx.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < ctx.vocab_size]
        if bad:
            raise OpenAIError(f"tokens: ids outside the vocabulary [0, {ctx.vocab_size}): {bad[:5]}", 400)
        text = await ctx.run_tokenizer(ctx.tokenizer.decode, req.tokens,
                                       skip_special_tokens=req.skip_special_tokens)
        return {"prompt": text}

    return app


def _check_tokenizer_template(ctx: ServerContext) -> None:
    """Warn at start-up when the model's own chat template (the one used without
    ``--chat-template``) does not compile: chat requests would then get 500s. Not fatal, since
    completions still work and the operator may not serve chat at all."""
    template = getattr(ctx.tokenizer, "chat_template", None)
    if ctx.chat_template is None and isinstance(template, str):
        try:
            compile_chat_template(template, "the tokenizer's chat template")
        except ValueError as e:
            log.warning("%s; chat requests will fail until --chat-template FILE replaces it", e)


# -- command line -----------------------------------------------------------------------------
def read_chat_template(path: str) -> str:
    """The ``--chat-template`` file's text, compiled once to catch a broken template before the
    model loads.

    Raises:
        ValueError: naming ``--chat-template PATH``: unreadable, not UTF-8, empty, or a Jinja syntax error.
    """
    source = f"--chat-template {path}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{source}: cannot read the template: {e}") from None
    compile_chat_template(text, source)
    return text


def run_server(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    """Build the engine and serve until SIGTERM/SIGINT; returns the exit status (0 after a
    graceful shutdown).

    Raises:
        ValueError: a bad ``--chat-template`` or tool-choice flags (checked before the model loads)
            or engine config.
    """
    import os
    import signal

    import uvicorn

    from kvforge.config import EngineConfig

    if args.enable_auto_tool_choice != bool(args.tool_call_parser):  # (before the model loads)
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: the parser reads the "
                         "tool calls out of 'auto' answers")
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    api_key = args.api_key or os.environ.get("KVFORGE_API_KEY") or None
    from kvforge.engine.executor import create_engine  # LLMEngine, or data-parallel replicas
    engine = AsyncLLMEngine(create_engine(EngineConfig.from_sources(args.config, overrides)))
    app = build_app(engine, args.served_model_name, api_key, chat_template, args.drain_timeout,
                    trust_request_chat_template=args.trust_request_chat_template,
                    tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)
    # uvicorn's own grace outlasts the drain: the requests still running at its deadline get the
    # engine's 503 while their connections are open, not a cancelled handler's bare 500
    grace = None if args.drain_timeout is None else args.drain_timeout + _GRACE_MARGIN_S
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=grace, timeout_keep_alive=5)
    server = _draining_server(config, engine, args.drain_timeout)
    # uvicorn re-raises the signal it caught once it has shut down; these handlers make that
    # a no-op so a graceful shutdown ends with exit status 0.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 0 if server.started else 1
