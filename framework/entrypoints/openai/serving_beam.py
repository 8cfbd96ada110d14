"""``use_beam_search: true`` on ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's
extension): ``n`` is the beam width, ``length_penalty`` the final score's length exponent.
The search is :func:`kvforge.entrypoints.beam_search.search_steps`, each step a batch of
one-token engine requests, awaited here; the result comes back as one
:class:`RequestOutput` per prompt (its ``n`` completions best first), so the endpoints'
usual non-streamed bodies carry it. A client that disconnects aborts the step in flight.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from kvforge.engine.outputs import CompletionOutput, RequestOutput
from kvforge.engine.request_choices import EXTRA_ARGS_KEY
from kvforge.engine.sampling_params import SamplingParams
from kvforge.entrypoints.beam_search import BeamSearchParams, candidates_per_beam, generated_text, search_steps
from kvforge.entrypoints.openai.errors import OpenAIError
from kvforge.entrypoints.openai.request_fields import engine_prompt

if TYPE_CHECKING:  # pragma: no cover
    from kvforge.entrypoints.openai.protocol import _SamplingFields
    from kvforge.entrypoints.openai.serving_common import ServerContext


async def run_beam_search(ctx: ServerContext, raw: Request, rid: str, prompts: list[list[int]],
                          texts: list[str | None], req: _SamplingFields, max_tokens: list[int]
                          ) -> list[RequestOutput]:
    """Beam search over ``prompts`` (token ids; ``texts`` their prompt strings or None), each
    generating at most ``max_tokens[i]``; returns one finished RequestOutput per prompt.

    Raises:
        OpenAIError: 400 when the K = max(2, 1 + EOS ids) * n log-probabilities a step asks per
            beam exceed ``max_logprobs``; as
            the engine's request errors; 499 when the client disconnects.
    """
    from kvforge.entrypoints.openai import serving_common as sc
    width = req.n
    params = BeamSearchParams(beam_width=width, max_tokens=max(max_tokens), ignore_eos=req.ignore_eos,
                              temperature=req.temperature or 0.0, length_penalty=req.length_penalty,
                              include_stop_str_in_output=req.include_stop_str_in_output)
    eos, stop_ids = ctx.eos_ids
    k = candidates_per_beam(params, len(eos))
    if 0 <= ctx.max_logprobs < k:
        raise OpenAIError(f"n: beam search with n={width} needs {k} log-probabilities per step, over "
                          f"max_logprobs ({ctx.max_logprobs}); start the server with a larger --max-logprobs",
                          400, param="n")
    step_params = SamplingParams(max_tokens=1, logprobs=k, temperature=params.temperature, detokenize=False,
                                 extra_args={EXTRA_ARGS_KEY: req.kvforge} if req.kvforge is not None else {})
    steps = search_steps(prompts, params, eos, max_tokens, stop_ids)

    async def drive():
        n = 0
        try:
            beams = next(steps)
            while True:
                items = [(f"{rid}-beam{n}-{j}", engine_prompt(b, None, req.cache_salt), step_params)
                         for j, b in enumerate(beams)]
                outs = await sc.final_outputs(await sc.add_all(ctx, items, req.priority))
                n += 1
                beams = steps.send([o.outputs[0].logprobs[0] for o in outs])
        except StopIteration as done:
            return done.value

    found = await sc.race_disconnect(raw, drive())

    def outputs() -> list[RequestOutput]:  # (decoding: on the tokenizer's own thread)
        results = []
        for i, (ids, seqs) in enumerate(zip(prompts, found)):
            outs = [CompletionOutput(k, generated_text(ctx.tokenizer, s, len(ids), params.include_stop_str_in_output),
                                     s.tokens[len(ids):], s.cum_logprob, None, s.finish_reason, s.stop_reason)
                    for k, s in enumerate(seqs)]
            results.append(RequestOutput(rid if len(prompts) == 1 else f"{rid}-{i}", texts[i], ids, None, outs, True))
        return results

    return await ctx.run_tokenizer(outputs)
