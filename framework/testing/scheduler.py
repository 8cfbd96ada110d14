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
  shared prefixes, greedy outputs equal the reference scheduler ``fcfs``'s.
"""
from __future__ import annotations

from typing import Any

from kvforge.testing.harness import (StepMonitor, Target, assert_drained, compare_outputs, random_prompts,
                                     reference_outputs)


def _engine(target: Target, prefix: bool | None = None, **kw: Any):
    caps = target.capabilities
    if prefix is None:
        prefix = bool(caps.get("requires_prefix_caching"))
    elif caps.get("requires_prefix_caching"):
        prefix = True
    return target.engine(scheduler=target.name, kv_allocator="paged", enable_prefix_caching=prefix,
                         **{"scheduler.settings": dict(target.settings)}, **kw)


def _greedy(max_tokens: int, ignore_eos: bool = False):
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


CHECKS = [check_token_budget_and_max_num_seqs, check_no_starvation_fcfs_load, check_preemption_correct,
          check_greedy_matches_fcfs]
