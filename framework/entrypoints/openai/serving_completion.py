"""``POST /v1/completions`` (OpenAI's legacy text completions, with vLLM's extensions).

A batch prompt (list of strings or of token-id lists) becomes one engine request per
prompt; choice ``index`` is ``prompt_index * n + i``. ``echo`` prepends the prompt (and,
with ``logprobs``, the prompt tokens' log-probabilities, the first being null); with
``max_tokens`` 0 it returns only that (prompt scoring, as vLLM and OpenAI's legacy API:
finish_reason ``length``, no completion tokens). Tokenizer work on prompts (encoding, the
echoed text and its token offsets) runs off the event loop.
"""
from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator

from fastapi import Request

from kvforge.engine.outputs import Logprob, RequestOutput
from kvforge.entrypoints.openai import serving_common as sc
from kvforge.entrypoints.openai.errors import OpenAIError
from kvforge.entrypoints.openai.serving_beam import run_beam_search
from kvforge.entrypoints.openai.protocol import CompletionRequest


async def _prompts(ctx: sc.ServerContext, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    p = req.prompt
    if isinstance(p, str):
        texts: list[Any] = [p]
    elif all(isinstance(x, int) for x in p):
        texts = [p]
    else:
        texts = list(p)
    out = []
    for i, item in enumerate(texts):
        if len(item) == 0:  # as offline: an empty prompt is refused, not generated from BOS alone
            where = "prompt" if len(texts) == 1 else f"prompt[{i}]"
            raise OpenAIError(f"{where}: must not be empty", 400, param="prompt")
        if isinstance(item, str):
            ids = await ctx.encode(item, req.add_special_tokens, "prompt" if len(texts) == 1 else f"prompt[{i}]")
            out.append((item, ids))
        else:
            bad = [t for t in item if not 0 <= t < ctx.vocab_size]
            if bad:
                where = "prompt" if len(texts) == 1 else f"prompt[{i}]"
                raise OpenAIError(f"{where}: token ids outside the vocabulary [0, {ctx.vocab_size}): {bad[:5]}",
                                  400, param="prompt")
            out.append((None, list(item)))
    kept = [sc.truncate_prompt(ctx, ids, req.truncate_prompt_tokens) for _, ids in out]
    # a truncated prompt is echoed as its kept tokens decode, not as the text sent
    return [(text if len(k) == len(ids) else None, k) for (text, ids), k in zip(out, kept)]


def _logprobs_obj(ctx: sc.ServerContext, ids: list[int], entries: list[dict[int, Logprob] | None],
                  offset: int, echo: tuple[list[int], int] | None = None) -> tuple[dict[str, Any], int]:
    """OpenAI legacy logprobs: tokens, token_logprobs, top_logprobs, text_offset (characters
    into the choice's text), and the offset after the last token. ``echo``: (the prompt tokens'
    starts in the echoed prompt text, that text's length) when ``ids`` begin with the prompt,
    echoed at ``offset``; the generated tokens follow its end."""
    tokens, token_lps, tops, offsets = [], [], [], []
    starts, echo_len = echo or ([], 0)
    num_echo = len(starts)
    for i, (tid, entry) in enumerate(zip(ids, entries)):
        lp = entry.get(tid) if entry else None
        text = sc.token_text(ctx.tokenizer, tid, lp)
        tokens.append(text)
        token_lps.append(sc.clamp(lp.logprob) if lp is not None else None)
        if entry:
            tops.append({sc.token_text(ctx.tokenizer, t, e): sc.clamp(e.logprob) for t, e in entry.items()})
        else:
            tops.append(None)
        if i < num_echo:
            offsets.append(offset + starts[i])
            if i == num_echo - 1:
                offset += echo_len
        else:
            offsets.append(offset)
            offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _echo_starts(ctx: sc.ServerContext, text: str, ids: list[int]) -> tuple[list[int], int]:
    """(Where each prompt token starts in the echoed prompt ``text``, len(text)): the fast
    tokenizer's offset mapping when ``text`` encodes to exactly ``ids`` (special tokens such as
    BOS start at 0); otherwise the decoded lengths of the token prefixes' pieces, capped at the
    text's length. Once per prompt: its choices share it."""
    for special in (True, False):
        try:
            enc = ctx.tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        except Exception:  # noqa: BLE001 - a slow tokenizer has no offset mapping
            break
        if list(enc["input_ids"]) == list(ids):
            return [int(a) for a, _ in enc["offset_mapping"]], len(text)
    starts, pos = [], 0
    for tid in ids:
        starts.append(min(pos, len(text)))
        pos += len(sc.token_text(ctx.tokenizer, tid))
    return starts, len(text)


def _echo_info(ctx: sc.ServerContext, prompts: list[tuple[str | None, list[int]]],
               with_offsets: bool) -> list[tuple[str, tuple[list[int], int] | None]]:
    """Per prompt: the echoed text (decoded for a token-id prompt) and, for echo logprobs, its
    tokens' starts (see :func:`_echo_starts`). Tokenizer work: run through ``ctx.run_tokenizer``."""
    out = []
    for text, ids in prompts:
        if text is None:
            text = ctx.tokenizer.decode(ids)
        out.append((text, _echo_starts(ctx, text, ids) if with_offsets else None))
    return out


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """``out`` without its generated tokens, for ``max_tokens`` 0: the engine generates at least one
    token (computing the prompt's logprobs on the way), which the client did not ask for."""
    def strip(c):
        reason = c.finish_reason if c.finish_reason in (None, "abort", "error") else "length"
        return dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                   finish_reason=reason, stop_reason=None)
    return dataclasses.replace(out, outputs=[strip(c) for c in out.outputs])


async def create_completion(ctx: sc.ServerContext, req: CompletionRequest, raw: Request):
    """Handle one completions request; returns a JSON or SSE response."""
    ctx.check_model(req.model)
    rid = sc.request_id(raw, req.request_id, "cmpl")
    scoring = req.echo and req.max_tokens == 0  # the engine runs one token, dropped from the response
    if scoring and req.min_tokens:
        raise OpenAIError(f"min_tokens: must be 0 when max_tokens is 0, got {req.min_tokens}", 400)
    if req.logprobs is not None and 0 <= ctx.max_logprobs < req.logprobs:  # (with echo it also asks prompt_logprobs)
        raise OpenAIError(f"logprobs: {req.logprobs} exceeds max_logprobs ({ctx.max_logprobs}); start the server "
                          "with a larger --max-logprobs", 400, param="logprobs")
    prompts = await _prompts(ctx, req)
    explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
    if req.use_beam_search:
        return await _beam_search(ctx, req, raw, rid, prompts, explicit)
    items = []
    for i, (text, ids) in enumerate(prompts):
        field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        max_tokens = sc.resolve_max_tokens(ctx, len(ids), 1 if scoring else req.max_tokens, explicit, field,
                                           "max_tokens")
        asked = [v for v in (req.logprobs if req.echo else None, req.prompt_logprobs) if v is not None]
        params = sc.sampling_params(req, max_tokens, None if scoring else req.logprobs,
                                    (-1 if -1 in asked else max(asked)) if asked else None)
        sub = rid if len(prompts) == 1 else f"{rid}-{i}"
        items.append((sub, sc.engine_prompt(ids, text, req.cache_salt), params))
    echoes = await ctx.run_tokenizer(_echo_info, ctx, prompts, req.logprobs is not None) if req.echo else None
    streams = await sc.add_all(ctx, items, req.priority)
    headers = {sc.REQUEST_ID_HEADER: rid}
    if req.stream:
        return sc.SSEResponse(_stream(ctx, req, rid, prompts, items, streams, echoes, scoring), streams,
                              headers=headers)
    try:
        outs = await sc.race_disconnect(raw, sc.final_outputs(streams))
    finally:
        for s in streams:
            s.abort()
    if scoring:
        outs = [_prompt_only(o) for o in outs]
    return await ctx.json_response(lambda: _full_response(ctx, req, rid, outs, echoes), headers)


async def _beam_search(ctx: sc.ServerContext, req: CompletionRequest, raw: Request, rid: str, prompts,
                       explicit: bool) -> Any:
    if req.max_tokens == 0:
        raise OpenAIError("max_tokens: must be >= 1 with use_beam_search", 400, param="max_tokens")
    budgets = [sc.resolve_max_tokens(ctx, len(ids), req.max_tokens, explicit,
                                     "prompt" if len(prompts) == 1 else f"prompt[{i}]", "max_tokens")
               for i, (_, ids) in enumerate(prompts)]
    outs = await run_beam_search(ctx, raw, rid, [ids for _, ids in prompts], [t for t, _ in prompts], req, budgets)
    echoes = await ctx.run_tokenizer(_echo_info, ctx, prompts, False) if req.echo else None
    return await ctx.json_response(lambda: _full_response(ctx, req, rid, outs, echoes), {sc.REQUEST_ID_HEADER: rid})


def _echo_logprobs(ctx: sc.ServerContext, out: RequestOutput, top: int) -> tuple[list[int], list]:
    """Prompt ids and their entries trimmed to the token itself + the ``top`` most likely
    (the request may also have asked for more ``prompt_logprobs``)."""
    ids = list(out.prompt_token_ids)
    entries = list(out.prompt_logprobs or [None] * len(ids))
    entries += [None] * (len(ids) - len(entries))
    return ids, [None if not e else {t: lp for t, lp in e.items() if t == tid or (lp.rank or top + 1) <= top}
                 for tid, e in zip(ids, entries)]


def _full_response(ctx: sc.ServerContext, req: CompletionRequest, rid: str, outs: list[RequestOutput],
                   echoes: list[tuple[str, tuple[list[int], int] | None]] | None) -> dict[str, Any]:
    choices = []
    prompt_tokens = completion_tokens = 0
    for pi, out in enumerate(outs):
        prompt_tokens += len(out.prompt_token_ids)
        prefix, echo = echoes[pi] if echoes else ("", None)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            logprobs = None
            if req.logprobs is not None:
                ids, entries = (_echo_logprobs(ctx, out, req.logprobs) if req.echo else ([], []))
                ids = ids + list(c.token_ids)
                entries = entries + list(c.logprobs or [])
                logprobs, _ = _logprobs_obj(ctx, ids, entries, 0, echo)
            choice = {"index": pi * req.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = sc.prompt_logprobs_json(ctx.tokenizer, out.prompt_logprobs,
                                                                    out.prompt_token_ids, req.prompt_logprobs)
            choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": sc.now(), "model": ctx.response_model(req.model),
            "system_fingerprint": None, "choices": choices,
            "usage": sc.usage(prompt_tokens, completion_tokens)}


async def _stream(ctx: sc.ServerContext, req: CompletionRequest, rid: str, prompts, items, streams,
                  echoes: list[tuple[str, tuple[list[int], int] | None]] | None,
                  scoring: bool) -> AsyncIterator[str]:
    created = sc.now()
    opts = req.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    trackers = [[sc.ChoiceDelta(params) for _ in range(req.n)] for _, _, params in items]
    echoed = [[False] * req.n for _ in items]
    offsets = [[0] * req.n for _ in items]
    completion_tokens = [0] * len(items)
    prompt_tokens = sum(len(ids) for _, ids in prompts)

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        return sc.stream_chunk(rid, "text_completion", created, ctx.response_model(req.model),
                               choices, include_usage, usage)

    try:
        async for pi, out in sc.merge_streams(streams):
            if scoring:
                out = _prompt_only(out)
            completion_tokens[pi] = sum(len(c.token_ids) for c in out.outputs)
            if out.error or any(c.finish_reason == "error" for c in out.outputs):
                yield sc.error_event(OpenAIError(out.error or "engine error", 500, code="engine_error"))
                yield sc.SSE_DONE
                return
            choices = []
            for c in out.outputs:
                tr = trackers[pi][c.index]
                if tr.finished:
                    continue
                text, new_ids, new_lps, fin = tr.update(c)
                prefix = ""
                lp_ids: list[int] = []
                lp_entries: list = []
                echo = None
                if req.echo and not echoed[pi][c.index]:
                    echoed[pi][c.index] = True
                    prefix, echo = echoes[pi]
                    if req.logprobs is not None:
                        lp_ids, lp_entries = _echo_logprobs(ctx, out, req.logprobs)
                if not (text or prefix or new_ids or fin):
                    continue
                logprobs = None
                if req.logprobs is not None:
                    lp_ids += list(new_ids)
                    lp_entries += list(new_lps or [])
                    logprobs, offsets[pi][c.index] = _logprobs_obj(ctx, lp_ids, lp_entries, offsets[pi][c.index],
                                                                   echo)
                choices.append({"index": pi * req.n + c.index, "text": prefix + text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason if fin else None,
                                "stop_reason": c.stop_reason if fin else None})
            if choices:
                usage = sc.usage(prompt_tokens, sum(completion_tokens)) if continuous else None
                yield chunk(choices, usage)
        if include_usage:
            body = {"id": rid, "object": "text_completion", "created": created, "model": ctx.response_model(req.model),
                    "system_fingerprint": None, "choices": [],
                    "usage": sc.usage(prompt_tokens, sum(completion_tokens))}
            yield sc.sse(body)
        yield sc.SSE_DONE
    except Exception as e:  # noqa: BLE001 - headers are out: report in-band
        yield sc.error_event(e)
        yield sc.SSE_DONE
