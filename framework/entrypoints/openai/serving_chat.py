"""``POST /v1/chat/completions``.

The prompt is the conversation rendered by the chat template — ``--chat-template FILE``
if given, else the tokenizer's own — with ``tokenizer.apply_chat_template``
(transformers' sandboxed Jinja; see :mod:`.chat_utils`, shared with the offline
``LLM.chat``). A model with neither gets a 400. A request's own ``chat_template`` is code
the server would run, so it is refused (400) unless the server was started with
``--trust-request-chat-template`` (as vLLM). Rendering and tokenizing run off the event
loop. Streaming follows OpenAI: a first chunk per choice carries ``delta.role``, then
``delta.content`` pieces, then a chunk with the choice's ``finish_reason`` (exactly one per
choice).
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from fastapi import Request

from kvforge.engine.outputs import Logprob, RequestOutput
from kvforge.entrypoints.openai import chat_utils
from kvforge.entrypoints.openai import serving_common as sc
from kvforge.entrypoints.openai import tool_calls
from kvforge.entrypoints.openai.errors import OpenAIError
from kvforge.entrypoints.openai.serving_beam import run_beam_search
from kvforge.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from kvforge.entrypoints.openai.tool_stream import stream_for

log = logging.getLogger("kvforge.server")


def request_template(ctx: sc.ServerContext, req: ChatCompletionRequest) -> str | None:
    """The request's own chat template (``chat_template``, or ``chat_template_kwargs.chat_template``,
    where vLLM also reads one), or None.

    Raises:
        OpenAIError: 400 naming ``chat_template`` when the server does not trust request templates
            (a nested loop in one would tie up a server thread) or the value is not a string.
    """
    template = req.chat_template
    if template is None and req.chat_template_kwargs:
        template = req.chat_template_kwargs.get("chat_template")
    if template is None:
        return None
    if not ctx.trust_request_chat_template:
        raise OpenAIError("chat_template: this server does not render chat templates sent with requests; "
                          "start it with --trust-request-chat-template to allow them", 400,
                          param="chat_template", code="untrusted_chat_template")
    if not isinstance(template, str):
        raise OpenAIError(f"chat_template: must be a string, got {type(template).__name__}", 400,
                          param="chat_template")
    return template


def render_chat(ctx: sc.ServerContext, messages: list[ChatMessage], add_generation_prompt: bool,
                continue_final_message: bool = False, template: str | None = None,
                tools: list | None = None, kwargs: dict | None = None) -> str:
    """The prompt text for ``messages`` (blocking: call it through ``ctx.run_render``).

    ``template``: a request's own template, already allowed by :func:`request_template`.

    Raises:
        OpenAIError: 400 when no chat template is available or the request made rendering fail
            (naming the field); 500 ``chat_template_error`` when the server's template is broken.
    """
    from_request = template is not None
    if template is None:
        template = ctx.chat_template or getattr(ctx.tokenizer, "chat_template", None)
    if not template and not from_request:
        raise OpenAIError("messages: this model has no chat template; start the server with "
                          "--chat-template FILE or use /v1/completions", 400, param="messages",
                          code="no_chat_template")
    try:
        return chat_utils.render_chat(ctx.tokenizer, messages, template,
                                      add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message, tools=tools,
                                      template_kwargs=kwargs, template_from_request=from_request)
    except chat_utils.ChatTemplateError as e:
        if e.client_fault:
            raise OpenAIError(str(e), 400, param=e.param) from e
        log.error("the server's chat template failed: %s", e.detail)  # the operator has to fix it
        raise OpenAIError(f"the server's chat template failed: {e.detail}", 500, param=None,
                          code="chat_template_error") from e


def _logprobs_content(ctx: sc.ServerContext, ids: list[int], entries: list[dict[int, Logprob]],
                      k: int) -> list[dict[str, Any]]:
    content = []
    for tid, entry in zip(ids, entries):
        lp = entry.get(tid) if entry else None
        text = sc.token_text(ctx.tokenizer, tid, lp)
        top = []
        for t, e in sc.sorted_top(entry or {}, k):
            tt = sc.token_text(ctx.tokenizer, t, e)
            top.append({"token": tt, "logprob": sc.clamp(e.logprob), "bytes": sc.token_bytes(ctx.tokenizer, t, tt)})
        content.append({"token": text, "logprob": sc.clamp(lp.logprob) if lp is not None else sc.LOGPROB_FLOOR,
                        "bytes": sc.token_bytes(ctx.tokenizer, tid, text), "top_logprobs": top})
    return content


async def create_chat_completion(ctx: sc.ServerContext, req: ChatCompletionRequest, raw: Request):
    """Handle one chat completions request; returns a JSON or SSE response."""
    ctx.check_model(req.model)
    rid = sc.request_id(raw, req.request_id, "chatcmpl")
    # vLLM's rule: 'auto', also as the default when tools are given, needs a parser (else the tools
    # would be rendered into the prompt and any call the model writes returned as plain text)
    if (req.tool_choice == "auto" or (req.tools and req.tool_choice is None)) and ctx.tool_call_parser is None:
        raise OpenAIError("tool_choice: 'auto' (the default when tools are given) needs the server started with "
                          "--enable-auto-tool-choice and --tool-call-parser; or pass tool_choice 'none', "
                          "'required' or a named function", 400, param="tool_choice")
    prompt = await ctx.run_render(render_chat, ctx, req.messages, req.add_generation_prompt,
                                  req.continue_final_message, request_template(ctx, req),
                                  req.tools if req.tool_choice != "none" else None, req.chat_template_kwargs)
    ctx.check_text(prompt, "messages")
    ids = await ctx.run_tokenizer(chat_utils.encode_chat_prompt, ctx.tokenizer, prompt, req.add_special_tokens)
    if not ids:
        raise OpenAIError("messages: the rendered prompt is empty", 400, param="messages")
    ids = sc.truncate_prompt(ctx, ids, req.truncate_prompt_tokens)
    explicit_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = sc.resolve_max_tokens(ctx, len(ids), req.max_output_tokens, True, "messages", explicit_field)
    num_lps = (req.top_logprobs or 0) if req.logprobs else None
    if num_lps and 0 <= ctx.max_logprobs < num_lps:  # named as the request names it (the engine says "logprobs")
        raise OpenAIError(f"top_logprobs: {num_lps} exceeds max_logprobs ({ctx.max_logprobs}); "
                          "start the server with a larger --max-logprobs", 400, param="top_logprobs")
    echo = ""
    if req.echo and req.messages[-1].role == "assistant":
        echo = req.messages[-1].text()
    headers = {sc.REQUEST_ID_HEADER: rid}
    if req.use_beam_search:
        (out,) = await run_beam_search(ctx, raw, rid, [ids], [prompt], req, [max_tokens])
        return await ctx.json_response(lambda: _full_response(ctx, req, rid, out, ids, echo), headers)
    params = sc.sampling_params(req, max_tokens, num_lps, req.prompt_logprobs)
    tool_calls.adjust_params(params, tool_calls.mode(req, ctx.tool_call_parser), ctx.tool_call_parser)
    streams = await sc.add_all(ctx, [(rid, sc.engine_prompt(ids, prompt, req.cache_salt), params)], req.priority)
    if req.stream:
        return sc.SSEResponse(_stream(ctx, req, rid, len(ids), params, streams[0], echo), streams,
                              headers=headers)
    try:
        (out,) = await sc.race_disconnect(raw, sc.final_outputs(streams))
    finally:
        streams[0].abort()
    return await ctx.json_response(lambda: _full_response(ctx, req, rid, out, ids, echo), headers)


def _full_response(ctx: sc.ServerContext, req: ChatCompletionRequest, rid: str, out: RequestOutput,
                   ids: list[int], echo: str) -> dict[str, Any]:
    """The non-streamed chat.completion body (built off the event loop: ``ctx.json_response``)."""
    choices = []
    how = tool_calls.mode(req, ctx.tool_call_parser)
    for c in out.outputs:
        logprobs = None
        if req.logprobs:
            logprobs = {"content": _logprobs_content(ctx, c.token_ids, c.logprobs or [], req.top_logprobs or 0)}
        message: dict[str, Any] = {"role": "assistant", "content": echo + c.text}
        reason = c.finish_reason
        if how is not None:
            content, calls = tool_calls.extract(how, c.text, req, ctx.tool_call_parser or "hermes")
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = tool_calls.finish_reason(how, calls, reason)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason,
                        "stop_reason": c.stop_reason})
    body = {"id": rid, "object": "chat.completion", "created": sc.now(), "model": ctx.response_model(req.model),
            "system_fingerprint": None, "choices": choices,
            "usage": sc.usage(len(ids), sum(len(c.token_ids) for c in out.outputs))}
    if req.prompt_logprobs is not None:  # vLLM: on the response, for the rendered prompt
        body["prompt_logprobs"] = sc.prompt_logprobs_json(ctx.tokenizer, out.prompt_logprobs, out.prompt_token_ids,
                                                          req.prompt_logprobs)
    return body


async def _stream(ctx: sc.ServerContext, req: ChatCompletionRequest, rid: str, num_prompt: int, params,
                  stream, echo: str) -> AsyncIterator[str]:
    created = sc.now()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    trackers = [sc.ChoiceDelta(params) for _ in range(req.n)]
    completion_tokens = 0
    how = tool_calls.mode(req, ctx.tool_call_parser)
    parser = ctx.tool_call_parser or "hermes"
    buffers: dict[int, Any] = {}  # choice -> its tool-call stream (named calls: marks an announced call)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        return sc.stream_chunk(rid, "chat.completion.chunk", created, ctx.response_model(req.model),
                               choices, include_usage, usage)

    try:
        first = {"role": "assistant", "content": echo}
        yield chunk([{"index": i, "delta": first, "logprobs": None, "finish_reason": None}
                     for i in range(req.n)], sc.usage(num_prompt, 0) if continuous else None)
        async for _, out in sc.merge_streams([stream]):
            completion_tokens = sum(len(c.token_ids) for c in out.outputs)
            if out.error or any(c.finish_reason == "error" for c in out.outputs):
                yield sc.error_event(OpenAIError(out.error or "engine error", 500, code="engine_error"))
                yield sc.SSE_DONE
                return
            choices = []
            for c in out.outputs:
                tr = trackers[c.index]
                if tr.finished:
                    continue
                text, new_ids, new_lps, fin = tr.update(c)
                if not (text or new_ids or fin):
                    continue
                reason = c.finish_reason if fin else None
                delta: dict[str, Any] = {"content": text} if (text or not fin) else {}
                if how == "named":  # the output is the call's arguments: stream them as they come
                    started = c.index in buffers
                    buffers.setdefault(c.index, [])
                    if not text and started:
                        delta = {}
                    else:
                        call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                        if not started:  # (the first delta names the call, as OpenAI's)
                            call = {"index": 0, **tool_calls.named_call(req, text)}
                        delta = {"tool_calls": [call]}
                elif how is not None:  # required / auto: calls as they complete (tool_stream)
                    st = buffers.setdefault(c.index, stream_for(how, parser))
                    content, items = st.feed(text)
                    if fin:
                        more, last = st.finish()
                        content, items = content + more, items + last
                        reason = tool_calls.finish_reason(how, range(st.index + 1), reason)  # (the calls sent)
                    delta = ({"content": content} if content else {}) | ({"tool_calls": items} if items else {})
                    if not (delta or fin or (new_ids and req.logprobs)):  # (held text: nothing to send yet)
                        continue
                logprobs = None
                if req.logprobs:
                    logprobs = {"content": _logprobs_content(ctx, new_ids, new_lps or [], req.top_logprobs or 0)}
                choices.append({"index": c.index, "delta": delta, "logprobs": logprobs,
                                "finish_reason": reason, "stop_reason": c.stop_reason if fin else None})
            if choices:
                yield chunk(choices, sc.usage(num_prompt, completion_tokens) if continuous else None)
        if include_usage:
            yield sc.sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                          "model": ctx.response_model(req.model), "system_fingerprint": None, "choices": [],
                          "usage": sc.usage(num_prompt, completion_tokens)})
        yield sc.SSE_DONE
    except Exception as e:  # noqa: BLE001 - headers are out: report in-band
        yield sc.error_event(e)
        yield sc.SSE_DONE
