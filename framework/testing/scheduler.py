"""Conformance suite for schedulers (``kvforge_register_schedulers``).

Every check drives a real ``LLMEngine`` on the test model with the scheduler
under test (allocator ``paged``; prefix caching on when the scheduler declares
``requires_prefix_caching=True``) and wraps its ``schedule()`` with
:class:`~kvforge.testing.harness.StepMonitor`, so every step is checked for:
``len(scheduled) <= max_num_seqs``, ``total tokens <= max_num_batched_tokens``,
``1 <= n <= remaining tokens``, blocks allocated before a request runs, preempted
and finished requests holding no blocks, and exact block accounting.

Checks:

- ``token_budget_and_max_num_seqs``: a burst of requests over tight limits;
  the limits must also be reached (a scheduler that runs one request at a time
  is not tested by a budget check);
- ``no_starvation_fcfs_load``: equal-sized requests arriving every step; each
  must finish within twice the time FCFS would need for it (``2 * (i // max_num_seqs + 1)``
  service times after its arrival), and all of them must finish;
- ``preemption_correct``: too few KV blocks for the load: the scheduler must
  preempt, every block must come back, and the greedy outputs must equal those
  of the same scheduler without memory pressure;
- ``greedy_matches_fcfs``: with prefix caching off and on, chunk-sized budgets and
  shared prefixes, greedy outputs equal the reference scheduler ``fcfs``'s;
- ``stops_and_aborts``: requests ended by EOS (prompts cut from a story the test model
  ends with EOS), by ``stop_token_ids`` and stop strings picked from the reference's own
  outputs (so they are certain to be hit), by ``max_tokens`` despite an EOS
  (``ignore_eos``), and by ``engine.abort_request`` while waiting or running: finish
  reasons, stop reasons and token ids equal ``fcfs``'s (an aborted request's tokens are a
  prefix of them), and every block comes back (``finish_requests`` must free them), also
  for a request aborted mid-prompt (chunking schedulers).
"""
from __future__ import annotations

from typing import Any

from kvforge.testing.harness import (StepMonitor, Target, assert_drained, compare_outputs, random_prompts,
                                     reference_engine, reference_outputs)


def _engine(target: Target, prefix: bool | None = None, **kw: Any):
    caps = target.capabilities
    if prefix is None:
        prefix = bool(caps.get("requires_prefix_caching"))
    elif caps.get("requires_prefix_caching"):
        prefix = True
    return target.engine(scheduler=target.name, kv_allocator="paged", enable_prefix_caching=prefix,
                         **{"scheduler.settings": dict(target.settings)}, **kw)


def _greedy(max_tokens: int | None, ignore_eos: bool = False):
    from kvforge import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def check_token_budget_and_max_num_seqs(target: Target) -> None:
    rng, tag = target.rng("budget")
    seqs, budget = 3, 40
    eng = _engine(target, max_num_seqs=seqs, max_num_batched_tokens=budget, num_gpu_blocks=64)
    mon = StepMonitor(eng, f"{target} {tag}")
    prompts = random_prompts(rng, 12, 4, budget - seqs, shared_prefix=12)
    # Two full-length prompts arrive first so that step 0 always has more prompt tokens than
    # budget: a scheduler that does not cut to the budget is caught on every seed.
    prompts[:2] = random_prompts(rng, 2, budget - seqs, budget - seqs)
    sp = _greedy(12, ignore_eos=True)
    arrivals = {0: [(f"b{i}", {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts[:8])],
                2: [(f"b{i}", {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts[8:], 8)]}
    done = mon.drain(arrivals)
    assert_drained(eng, f"{target} {tag}")
    bad = {rid: o.outputs[0].finish_reason for rid, o in done.items() if o.outputs[0].finish_reason != "length"}
    if len(done) != len(prompts) or bad:
        raise AssertionError(f"{target} {tag}: {len(done)} of {len(prompts)} requests finished; abnormal: {bad}")
    if mon.max_scheduled < seqs:
        raise AssertionError(f"{target} {tag}: never ran more than {mon.max_scheduled} requests in a step although "
                             f"{len(prompts)} were waiting and max_num_seqs={seqs} (continuous batching expected)")


def check_no_starvation_fcfs_load(target: Target) -> None:
    rng, tag = target.rng("starvation")
    seqs, budget, plen, out_len, n = 4, 64, 12, 8, 32
    eng = _engine(target, max_num_seqs=seqs, max_num_batched_tokens=budget, num_gpu_blocks=64)
    mon = StepMonitor(eng, f"{target} {tag}")
    sp = _greedy(out_len, ignore_eos=True)
    prompts = random_prompts(rng, n, plen, plen)
    arrivals: dict[int, list] = {}
    for i, p in enumerate(prompts):  # two arrivals a step: more than the service rate
        arrivals.setdefault(i // 2, []).append((f"s{i:02d}", {"prompt_token_ids": p}, sp))
    service = -(-plen // budget) + out_len
    done = mon.drain(arrivals, max_steps=n * service * 2 + 50)
    assert_drained(eng, f"{target} {tag}")
    for i in range(n):
        rid = f"s{i:02d}"
        if rid not in done or done[rid].outputs[0].finish_reason != "length":
            why = done[rid].outputs[0].finish_reason if rid in done else "never finished"
            raise AssertionError(f"{target} {tag}: request {rid} did not complete normally ({why})")
        waited = mon.finished_at[rid] - mon.added_at[rid]
        bound = 2 * (i // seqs + 1) * service + 2
        if waited > bound:
            raise AssertionError(
                f"{target} {tag}: request {rid} (arrival #{i}) took {waited} steps; under FCFS-style load of "
                f"equal requests ({plen}-token prompts, {out_len} tokens, max_num_seqs={seqs}) it must finish within "
                f"{bound} steps of its arrival (twice FCFS's time): it starves")


def check_preemption_correct(target: Target) -> None:
    rng, tag = target.rng("preemption")
    prompts = random_prompts(rng, 8, 8, 30, shared_prefix=16)
    sp = _greedy(28, ignore_eos=True)
    outs = {}
    for pressure in (False, True):
        blocks = 7 if pressure else 64
        eng = _engine(target, max_num_seqs=6, max_num_batched_tokens=64, num_gpu_blocks=blocks)
        mon = StepMonitor(eng, f"{target} {tag} num_gpu_blocks={blocks}")
        done = mon.drain({0: [(f"p{i}", {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts)]})
        assert_drained(eng, f"{target} {tag} num_gpu_blocks={blocks}")
        outs[pressure] = (done, mon)
    done, mon = outs[True]
    if mon.num_preempted == 0:
        raise AssertionError(f"{target} {tag}: 8 requests of up to 58 tokens in 7 blocks of 16 never preempted; "
                             f"a scheduler must preempt when allocate_slots returns None")
    ids = [f"p{i}" for i in range(len(prompts))]
    ref = [outs[False][0][rid].outputs[0].token_ids for rid in ids]
    compare_outputs(done, ids, ref, f"{target} {tag}", "greedy output under memory pressure vs. without")


def check_greedy_matches_fcfs(target: Target) -> None:
    rng, tag = target.rng("greedy vs fcfs")
    prompts = random_prompts(rng, 10, 4, 44, shared_prefix=32)
    prompts.append(list(prompts[0]))  # an exact repeat: a full prefix-cache hit
    max_tokens = 24
    ref = reference_outputs(target, prompts, max_tokens)
    ids = [f"g{i}" for i in range(len(prompts))]
    for prefix in (False, True):
        eng = _engine(target, prefix=prefix, max_num_seqs=5, max_num_batched_tokens=48, num_gpu_blocks=96)
        mon = StepMonitor(eng, f"{target} {tag} prefix_caching={prefix}")
        sp = _greedy(max_tokens)
        arrivals = {0: [(ids[i], {"prompt_token_ids": p}, sp) for i, p in enumerate(prompts[:6])],
                    5: [(ids[i], {"prompt_token_ids": prompts[i]}, sp) for i in range(6, len(prompts))]}
        done = mon.drain(arrivals)
        assert_drained(eng, f"{target} {tag}")
        compare_outputs(done, ids, ref, f"{target} {tag} prefix_caching={eng.config.cache.enable_prefix_caching}",
                        "greedy output vs. the fcfs reference")


#: The text the EOS check's story is generated from; stories260K's greedy continuation ends
#: with EOS after about 340 tokens.
STORY_PROMPT = "Once upon a time"
_EOS_STORY: dict[tuple, tuple[list[int] | None, int]] = {}


def _eos_story(target: Target) -> tuple[list[int] | None, int]:
    """(prompt + greedy output of :data:`STORY_PROMPT` in the reference configuration, ending
    with an EOS token, or None where the test model does not end it with EOS; max_model_len)."""
    key = (target.model, target.device)
    if key not in _EOS_STORY:
        eng = reference_engine(target, 0, 1)
        sp = _greedy(None)  # up to max_model_len: long enough for stories260K to end the story
        done = StepMonitor(eng, "reference fcfs (EOS story)").drain({0: [("story", STORY_PROMPT, sp)]})
        o = done["story"]
        c = o.outputs[0]
        # (not "stop_reason is None": an EOS id of generation_config.json reports itself, as in vLLM)
        ends_with_eos = c.finish_reason == "stop" and bool(c.token_ids) and c.token_ids[-1] in eng.eos_token_ids
        _EOS_STORY[key] = (list(o.prompt_token_ids) + list(c.token_ids) if ends_with_eos else None,
                           eng.max_model_len)
    return _EOS_STORY[key]


def _run(engine, label: str, requests: list[tuple], on_step=None) -> dict[str, Any]:
    """Drain ``(request_id, prompt ids, params, why)`` requests; request_id -> final CompletionOutput."""
    mon = StepMonitor(engine, label)
    done = mon.drain({0: [(rid, {"prompt_token_ids": p}, sp) for rid, p, sp, _ in requests]}, on_step=on_step)
    assert_drained(engine, label)
    return {rid: o.outputs[0] for rid, o in done.items()}


def _stop_string(rng, text: str) -> str | None:
    """A substring of ``text`` (3-8 characters, not only whitespace) from its first three quarters."""
    for _ in range(20):
        start = rng.randrange(max(1, len(text) * 3 // 4))
        cand = text[start:start + rng.randint(3, 8)]
        if cand.strip():
            return cand
    return None


def _stop_requests(target: Target, rng, max_tokens: int) -> list[tuple]:
    """``(request_id, prompt ids, params, what should end it)`` for the stops-and-aborts check."""
    from kvforge import SamplingParams
    prompts = random_prompts(rng, 12, 4, 28, shared_prefix=12)
    plain = _run(reference_engine(target, 28 + max_tokens, len(prompts)), "reference fcfs (plain)",
                 [(f"x{i}", p, _greedy(max_tokens), "") for i, p in enumerate(prompts)])
    requests = []
    for i, p in enumerate(prompts):
        out = plain[f"x{i}"]
        # Stop ids and strings come from the request's own reference output: certain to be hit.
        stop = _stop_string(rng, out.text) if i % 4 == 1 else None
        if stop is not None:
            sp, why = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop=[stop]), f"stop={[stop]!r}"
        elif i % 4 < 2:
            tok = out.token_ids[rng.randrange(len(out.token_ids))]
            sp, why = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[tok]), \
                f"stop_token_ids=[{tok}]"
        else:
            sp, why = _greedy(max_tokens), f"max_tokens={max_tokens}"
        requests.append((f"x{i}", p, sp, why))
    story, max_model_len = _eos_story(target)
    if story is None:
        print(f"[{target}: {STORY_PROMPT!r} does not end with EOS on this model: EOS endings NOT CHECKED]")
        return requests
    for i in range(4):  # a prompt cut a few tokens before the story's EOS: greedy ends it there
        cut = rng.randint(max(1, len(story) - 20), len(story) - 2)
        n = min(len(story) - cut + 16, max_model_len - cut)
        ignore = i == 3  # ... unless ignore_eos: then only max_tokens ends it
        why = f"ignore_eos=True, max_tokens={n}" if ignore else f"EOS within {len(story) - cut} tokens"
        requests.append((f"e{i}", story[:cut], _greedy(n, ignore_eos=ignore), why))
    return requests


def _mismatch(rid: str, why: str, got, want, stop_token_ids=()) -> str | None:
    """What differs between ``got`` and the reference's ``want`` (CompletionOutputs), or None.
    ``stop_token_ids``: the request's own (an EOS id of generation_config.json also reports
    its id as stop_reason, so stop_reason alone cannot tell EOS from a stop id)."""
    if (got.finish_reason, got.stop_reason, got.token_ids) == (want.finish_reason, want.stop_reason, want.token_ids):
        return None
    hint = ""
    ran_past = got.token_ids[:len(want.token_ids)] == want.token_ids and len(got.token_ids) > len(want.token_ids)
    if want.finish_reason == "stop" and ran_past:
        if isinstance(want.stop_reason, str):  # the engine matched it and called finish_requests
            hint = ": the request ran past its stop string (finish_requests must end it)"
        else:
            what = "stop_token_ids" if want.token_ids and want.token_ids[-1] in stop_token_ids else "EOS"
            hint = f": the scheduler ignores {what} (update must end a request there, see check_stop)"
    elif got.token_ids != want.token_ids:
        i = next((k for k, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b),
                 min(len(got.token_ids), len(want.token_ids)))
        hint = f" (token ids differ from output index {i})"
    return (f"request {rid} ({why}) ended with finish_reason={got.finish_reason!r}, stop_reason="
            f"{got.stop_reason!r} after {len(got.token_ids)} tokens; the reference (fcfs) ended it with "
            f"finish_reason={want.finish_reason!r}, stop_reason={want.stop_reason!r} after "
            f"{len(want.token_ids)} tokens{hint}")


def check_stops_and_aborts(target: Target) -> None:
    from kvforge.engine.request import RequestStatus
    rng, tag = target.rng("stops and aborts")
    label = f"{target} {tag}"
    requests = _stop_requests(target, rng, max_tokens=32)
    rng.shuffle(requests)  # arrival order
    longest = max(len(p) + sp.max_tokens for _, p, sp, _ in requests)
    ref = _run(reference_engine(target, longest, len(requests)), "reference fcfs", requests)
    # Aborts are chosen as the run goes, among requests in the wanted state, so each one hits
    # a request that holds blocks (or waits for them) whatever order the scheduler admits in.
    waiting, running = (RequestStatus.WAITING, RequestStatus.PREEMPTED), (RequestStatus.RUNNING,)
    plan = [(1, waiting), (2, running), (4, running), (6, running)]  # (earliest step, states to pick from)
    # only plain requests (half of the random ones): every EOS, stop id and stop string ending stays
    abortable = {rid for rid, _, _, why in requests if why.startswith("max_tokens")}
    aborted: dict[str, str] = {}

    def abort(mon: StepMonitor) -> None:
        while plan and plan[0][0] <= mon.step:
            cands = sorted(rid for rid, r in mon.requests.items()
                           if rid in abortable and rid not in aborted and r.status in plan[0][1])
            if not cands:
                return  # try again after the next step
            rid = rng.choice(cands)
            aborted[rid] = f"aborted while {mon.requests[rid].status.value} after step {mon.step}"
            mon.engine.abort_request(rid)
            plan.pop(0)

    # every request at once in the default 16-token blocks: no preemption (checked elsewhere)
    blocks = sum(-(-(len(p) + sp.max_tokens) // 16) + 1 for _, p, sp, _ in requests)
    # Synchronous steps: with async scheduling the engine applies EOS / stop ids to the
    # placeholder tokens itself, and the scheduler's own stop check would go untested.
    eng = _engine(target, max_num_seqs=4, max_num_batched_tokens=max(64, max(len(p) for _, p, _, _ in requests)),
                  num_gpu_blocks=blocks, async_scheduling=False)
    got = _run(eng, label, requests, on_step=abort)
    if plan:
        raise AssertionError(f"{label}: only {len(aborted)} of the {len(aborted) + len(plan)} planned aborts found "
                             f"a request to abort ({aborted or 'none'}): with {len(requests)} requests and "
                             f"max_num_seqs=4, plain requests must be waiting at step 1 and running later")
    problems = []
    for rid, _, sp, why in requests:
        if rid not in got:
            problems.append(f"request {rid} ({why}) never finished")
        elif rid in aborted:
            c, want = got[rid], ref[rid]
            if c.finish_reason != "abort" or c.token_ids != want.token_ids[:len(c.token_ids)]:
                problems.append(f"request {rid} ({why}; {aborted[rid]}) finished with {c.finish_reason!r} after "
                                f"{len(c.token_ids)} tokens; expected 'abort' with a prefix of the reference's "
                                f"{len(want.token_ids)} tokens")
        else:
            problems.append(_mismatch(rid, why, got[rid], ref[rid], sp.stop_token_ids))
    problems = [p for p in problems if p]
    if problems:
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise AssertionError(f"{label}: " + "; ".join(problems[:8]) + more)
    _abort_mid_prompt(target, rng, label)


def _abort_mid_prompt(target: Target, rng, label: str) -> None:
    """A request aborted while its prompt is still being computed in chunks (running, no token
    yet) must give its blocks back too; only for a scheduler that splits prompts (one that
    refuses a prompt over the budget up front is not asked)."""
    budget = 8
    eng = _engine(target, max_num_seqs=4, max_num_batched_tokens=budget, num_gpu_blocks=32, async_scheduling=False)
    prompts = random_prompts(rng, 3, 3 * budget, 4 * budget)
    if eng.scheduler.admission_error(len(prompts[0])) is not None:
        return
    label = f"{label} (abort mid-prompt)"
    mon = StepMonitor(eng, label)
    hit: list[str] = []

    def abort(m: StepMonitor) -> None:
        if hit:
            return
        mid = sorted(rid for rid, r in m.requests.items() if r.num_computed_tokens > 0 and not r.output_token_ids
                     and not r.is_finished)
        if mid:
            hit.append(rng.choice(mid))
            m.engine.abort_request(hit[0])

    mon.drain({0: [(f"m{i}", {"prompt_token_ids": p}, _greedy(4)) for i, p in enumerate(prompts)]}, on_step=abort)
    if not hit:
        raise AssertionError(f"{label}: no request was ever mid-prompt with {len(prompts)} prompts of "
                             f"{[len(p) for p in prompts]} tokens and max_num_batched_tokens={budget}, yet the "
                             f"scheduler accepted prompts over the budget")
    assert_drained(eng, label)


CHECKS = [check_token_budget_and_max_num_seqs, check_no_starvation_fcfs_load, check_preemption_correct,
          check_greedy_matches_fcfs, check_stops_and_aborts]
