"""Real-engine replay for the scheduler A/B harness (``--mode real``).

A driver loop over a real :class:`~kvforge.engine.llm_engine.LLMEngine` (CPU or GPU): before each
``engine.step()`` it adds every trace request whose ``arrival_time`` has passed on the wall clock
(its engine ``arrival_time`` is the scheduled arrival, so queueing delay in the driver counts toward
TTFT, as it would in a server), then records each returned token at the wall-clock time the step
ended. When the engine is idle it sleeps until the next arrival.

Before the clock starts, one short warm-up request (fewer tokens than a KV block, so it leaves
nothing in the prefix cache) runs to completion; counters are reported as deltas over the replay.
The step shapes and durations are recorded too (``RunResult.extra["steps"]``) so a cost model's
predictions can be checked against the real engine (:func:`kvforge.bench.ab.sim_accuracy`).
"""
from __future__ import annotations

import time
from typing import Any

from tqdm.auto import tqdm

from kvforge.bench.common import check_trace_fits, replay_order, request_id
from kvforge.bench.cost_model import step_shape
from kvforge.bench.metrics import RequestRecord, RunResult
from kvforge.bench.trace import Trace
from kvforge.config import EngineConfig
from kvforge.engine.capabilities import ignores_priority
from kvforge.engine.sampling_params import SamplingParams
from kvforge.plugin_manager import Registry

_COUNTERS = ("num_preemptions", "num_recomputed_tokens", "prefix_cache_queries", "prefix_cache_hits",
             "prefix_cache_evictions")


def _warm_up(engine, token: int) -> None:
    n = max(1, min(4, engine.allocator.block_size - 3))
    engine.add_request("__kvforge_ab_warmup__", [token] * n,
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_real(trace: Trace, prompts: list[list[int]], config: EngineConfig, registry: Registry | None = None,
             label: str = "", spec: str = "", progress: bool = False, engine=None) -> RunResult:
    """Replay ``trace`` on a real engine built from ``config`` (or on ``engine`` if given).

    Raises:
        ValueError: a request longer than max_model_len (before anything runs) or bad config.
    """
    from kvforge.engine.llm_engine import LLMEngine
    if engine is None:
        engine = LLMEngine(config, registry)
    check_trace_fits(trace, engine.max_model_len)
    firsts = {p[0] for p in prompts}
    _warm_up(engine, next((t for t in range(3, engine.vocab_size) if t not in firsts), 3))
    base = engine.stats()

    steps: list[tuple[dict[str, int], float]] = []
    sched = engine.scheduler
    orig_schedule = sched.schedule
    shapes: list = []

    def schedule():  # instance-level wrapper: records the step's shape before update() runs
        so = orig_schedule()
        shapes.append(step_shape(so))
        return so

    sched.schedule = schedule
    reqs = trace.requests
    records = [RequestRecord(request_id(i), r.arrival_time, r.prompt_len, r.output_len, r.priority, r.prefix_group)
               for i, r in enumerate(reqs)]
    by_id = {rec.request_id: rec for rec in records}
    order = replay_order(trace)
    # one trace serves every arm: a scheduler that ignores priority gets 0 (the engine refuses others)
    honours = not ignores_priority(engine.registry.get("scheduler", engine.config.scheduler.name))
    nxt = 0
    busy = 0.0
    bar = tqdm(total=len(reqs), desc=f"real {label}", disable=not progress, dynamic_ncols=True, leave=False)
    t0 = time.monotonic()
    try:
        while nxt < len(order) or engine.has_unfinished_requests():
            now = time.monotonic() - t0
            while nxt < len(order) and reqs[order[nxt]].arrival_time <= now:
                i = order[nxt]
                r = reqs[i]
                engine.add_request(request_id(i), list(prompts[i]),
                                   SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True),
                                   priority=r.priority if honours else 0, arrival_time=t0 + r.arrival_time)
                nxt += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, reqs[order[nxt]].arrival_time - (time.monotonic() - t0)))
                continue
            ts = time.monotonic()
            outs = engine.step()
            te = time.monotonic()
            busy += te - ts
            if shapes:
                steps.append((vars(shapes.pop()), te - ts))
                shapes.clear()
            t = te - t0
            for o in outs:
                rec = by_id.get(o.request_id)
                if rec is None:
                    continue
                new = len(o.outputs[0].token_ids) - len(rec.token_times) if o.outputs else 0
                if new > 0:
                    if rec.first_token is None:
                        rec.first_token = t
                    rec.token_times.extend([t] * new)
                if o.finished:
                    rec.finish = t
                    rec.error = o.error
                    rec.num_cached_tokens = o.num_cached_tokens
                    bar.update(1)
    finally:
        sched.schedule = orig_schedule
        bar.close()
    now_stats = engine.stats()
    stats: dict[str, Any] = dict(now_stats)
    for k in _COUNTERS:
        if k in now_stats:
            stats[k] = now_stats[k] - base.get(k, 0)
    if "prefix_cache_queries" in stats:
        q = stats["prefix_cache_queries"]
        stats["prefix_cache_hit_rate"] = stats["prefix_cache_hits"] / q if q else 0.0
    alloc = engine.allocator
    cfg = engine.config
    return RunResult(label, spec, "real", records, stats, len(steps), busy,
                     config={"scheduler": cfg.scheduler.model_dump(), "cache": cfg.cache.model_dump(),
                             "num_blocks": alloc.num_blocks, "max_model_len": engine.max_model_len,
                             "device": str(engine.parts.device), "choices": engine.parts.choices},
                     extra={"leaked_blocks": alloc.num_blocks - alloc.num_free_blocks, "steps": steps})
