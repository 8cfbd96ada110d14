"""Discrete-event simulation of the engine loop for the scheduler A/B harness (``--mode sim``).

The REAL scheduler and KV allocator plugins run — built through the plugin registry by name, with
the same validated settings the engine would give them — against a virtual clock. Each step:

1. requests whose ``arrival_time <= clock`` are added (``Request`` objects like the engine's, with
   ``SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)``);
2. ``scheduler.schedule()`` picks the step (allocating block ids, preempting, swapping);
3. the clock advances by the cost model's prediction for the step's shape
   (:mod:`kvforge.bench.cost_model`) instead of running a forward pass;
4. every request whose step reaches its last known token "samples" :data:`FAKE_TOKEN`, and
   ``scheduler.update()`` advances the requests exactly as in :meth:`LLMEngine.step`.

When nothing is runnable the clock jumps to the next arrival. No model weights and no KV tensors
exist: the allocator hands out block ids only. Everything is deterministic (no wall clock, no
randomness), so the same trace, config and cost model give identical results on any machine.
"""
from __future__ import annotations

import logging
from typing import Any

from tqdm.auto import tqdm

from kvforge.bench.common import (ModelFacts, check_cache_holds, check_trace_fits, max_model_len, replay_order,
                                  request_id)
from kvforge.bench.cost_model import CostModel, step_shape
from kvforge.bench.metrics import RequestRecord, RunResult
from kvforge.bench.trace import Trace
from kvforge.config import EngineConfig
from kvforge.engine.capabilities import describe, ignores_priority
from kvforge.engine.request import Request, RequestStatus
from kvforge.engine.sampling_params import SamplingParams
from kvforge.engine.schedule_check import checked_schedule
from kvforge.engine.sizing import CPU_DEFAULT_KV_BYTES, DEFAULT_MAX_NUM_SEQS, default_max_num_batched_tokens
from kvforge.interfaces import SchedulerContext
from kvforge.plugin_manager import Registry, build_plugin

log = logging.getLogger("kvforge")

#: The token id every simulated step "samples" (never EOS in practice, and ``ignore_eos`` is set).
FAKE_TOKEN = 4


def sim_scheduler_defaults(config: EngineConfig, limit: int, cost_model: CostModel | None = None) -> None:
    """Fill what the builder would resolve in ``config.scheduler`` (in place): the token budget
    (:func:`~kvforge.engine.sizing.default_max_num_batched_tokens`), and ``max_num_seqs`` as the engine the cost model was measured
    on had it (``engine.max_num_seqs`` in its JSON), else the builder's 256."""
    s = config.scheduler
    if s.max_num_batched_tokens is None:
        s.max_num_batched_tokens = default_max_num_batched_tokens(limit)
    if s.max_num_seqs is None:
        measured = (cost_model.meta.get("engine", {}) if cost_model is not None else {}).get("max_num_seqs")
        s.max_num_seqs = int(measured or DEFAULT_MAX_NUM_SEQS)


def sim_num_blocks(config: EngineConfig, facts: ModelFacts, cost_model: CostModel, limit: int) -> int:
    """KV blocks of the simulated cache, mirroring the engine builder's sizing.

    Order: ``cache.num_gpu_blocks``; else ``cache.kv_cache_memory_bytes``; else the KV budget the
    cost model's calibration device had (``engine.kv_cache_memory_bytes`` in its JSON); else the
    builder's CPU default (1 GiB). A budget is capped, as in the builder, at what
    ``max_num_seqs`` sequences of ``max_model_len`` could ever fill.
    """
    c = config.cache
    if c.num_gpu_blocks is not None:
        return c.num_gpu_blocks
    block_bytes = facts.kv_block_bytes(c.block_size, config.model.dtype, c.kv_cache_dtype)
    budget = c.kv_cache_memory_bytes or cost_model.meta.get("engine", {}).get("kv_cache_memory_bytes") \
        or CPU_DEFAULT_KV_BYTES
    cap = config.scheduler.max_num_seqs * (-(-limit // c.block_size)) + 1
    n = min(int(budget) // block_bytes, cap)
    if n < 1:
        raise ValueError(f"cache: KV budget of {budget} bytes holds no block of {block_bytes} bytes")
    return n


def build_scheduler(config: EngineConfig, registry: Registry, num_blocks: int, limit: int, num_cpu_blocks: int):
    """(scheduler, allocator) built by plugin name exactly as :func:`build_engine_parts` does.

    Raises:
        ValueError: unknown plugin names, invalid plugin settings (naming the field) or a
            declared conflict between the scheduler, the allocator and the cache config (as
            :func:`kvforge.engine.capabilities.check_combination` refuses it).
    """
    from kvforge.engine.builder import validate_plugin_settings
    from kvforge.engine.capabilities import check_combination
    sched_spec = registry.get("scheduler", config.scheduler.name)
    alloc_spec = registry.get("kv_allocator", config.cache.allocator)
    # (the model-side kinds, attention and quantizer, are not simulated: their rules do not apply)
    check_combination(config, {"scheduler": sched_spec, "kv_allocator": alloc_spec}, str(config.model.dtype), "cuda",
                      registry)
    sched_settings = validate_plugin_settings(sched_spec, config.scheduler.settings, "scheduler.settings")
    alloc_settings = validate_plugin_settings(alloc_spec, config.cache.settings, "cache.settings")
    allocator = build_plugin(alloc_spec, num_blocks, config.cache.block_size, alloc_settings, config.cache)
    scheduler = build_plugin(sched_spec, config.scheduler, allocator, sched_settings,
                             SchedulerContext(limit, num_cpu_blocks))
    return scheduler, allocator


def simulate(trace: Trace, prompts: list[list[int]], config: EngineConfig, registry: Registry,
             cost_model: CostModel, facts: ModelFacts, label: str = "", spec: str = "",
             progress: bool = False, max_steps: int = 10_000_000) -> RunResult:
    """Replay ``trace`` (token ids ``prompts``, in trace order) on the simulated engine.

    Returns:
        a :class:`RunResult` on the virtual clock (seconds since t = 0).
    Raises:
        ValueError: bad config or a request longer than max_model_len (before anything runs).
        RuntimeError: the scheduler stalls (unfinished requests, nothing schedulable, nothing
            left to arrive) or exceeds ``max_steps``.
    """
    config = config.model_copy(deep=True)
    if config.speculative.method is not None:
        raise ValueError("sim mode does not model speculative decoding (speculative.method); use --mode real")
    limit = max_model_len(config, facts)
    check_trace_fits(trace, limit)
    sim_scheduler_defaults(config, limit, cost_model)
    num_blocks = sim_num_blocks(config, facts, cost_model, limit)
    check_cache_holds(config, num_blocks, max((r.prompt_len + r.output_len for r in trace.requests), default=0))
    num_cpu_blocks = config.cache.swap_space_bytes // facts.kv_block_bytes(config.cache.block_size,
                                                                          config.model.dtype,
                                                                          config.cache.kv_cache_dtype)
    scheduler, allocator = build_scheduler(config, registry, num_blocks, limit, num_cpu_blocks)
    sched_spec = registry.get("scheduler", config.scheduler.name)
    who = describe(sched_spec)  # a broken step is refused as the engine does
    honours = not ignores_priority(sched_spec)  # (as the real replay: 0 otherwise)

    reqs = trace.requests
    records = [RequestRecord(request_id(i), r.arrival_time, r.prompt_len, r.output_len, r.priority, r.prefix_group)
               for i, r in enumerate(reqs)]
    by_id: dict[str, RequestRecord] = {rec.request_id: rec for rec in records}
    live: dict[str, Request] = {}
    order = replay_order(trace)
    clock = 0.0
    nxt = 0
    steps = 0
    busy = 0.0
    bar = tqdm(total=len(reqs), desc=f"sim {label}", disable=not progress, dynamic_ncols=True, leave=False)

    def done(req: Request) -> None:
        rec = by_id[req.request_id]
        rec.finish = clock
        rec.num_cached_tokens = req.num_cached_tokens
        rec.num_preemptions = req.num_preemptions
        if req.status is RequestStatus.FINISHED_ERROR:
            rec.error = req.error or "error"
        del live[req.request_id]
        bar.update(1)

    while nxt < len(order) or scheduler.has_unfinished_requests():
        while nxt < len(order) and reqs[order[nxt]].arrival_time <= clock:
            i = order[nxt]
            r = reqs[i]
            sp = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
            req = Request(request_id(i), list(prompts[i]), sp, r.output_len, facts.special_ids,
                          parent_id=request_id(i), priority=r.priority if honours else 0,
                          arrival_time=r.arrival_time)
            live[req.request_id] = req
            scheduler.add_request(req)
            nxt += 1
        if not scheduler.has_unfinished_requests():
            clock = max(clock, reqs[order[nxt]].arrival_time)
            continue
        so = checked_schedule(scheduler, who, config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens,
                              live)  # (keyed by request_id, which is each request's parent_id here)
        for req in so.finished:
            if req.request_id in live:
                done(req)
        shape = step_shape(so)
        if not so.scheduled and not shape.swap_blocks:
            if so.finished:
                continue
            if nxt < len(order):  # nothing is runnable until the next arrival
                clock = max(clock, reqs[order[nxt]].arrival_time)
                continue
            raise RuntimeError(f"sim {label}: scheduler {config.scheduler.name!r} scheduled nothing with "
                               f"{len(live)} unfinished requests and none left to arrive (a stall)")
        dt = cost_model.step_time(shape)
        clock += dt
        busy += dt
        counts = so.num_scheduled_tokens
        sampled = {req.request_id: [FAKE_TOKEN] for req in so.scheduled
                   if req.num_computed_tokens + counts[req.request_id] >= req.num_tokens}
        scheduler.update(so, sampled)
        for rid in sampled:
            rec = by_id[rid]
            if rec.first_token is None:
                rec.first_token = clock
            rec.token_times.append(clock)
        for req in so.scheduled:
            if req.is_finished and req.request_id in live:
                done(req)
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"sim {label}: more than {max_steps} steps; is the scheduler making progress?")
    bar.close()
    stats: dict[str, Any] = {**scheduler.stats(), **allocator.stats()}
    leaked = allocator.num_blocks - allocator.num_free_blocks
    if leaked:
        log.warning("sim %s: %d KV blocks still allocated after every request finished", label, leaked)
    return RunResult(label, spec, "sim", records, stats, steps, busy,
                     config={"scheduler": config.scheduler.model_dump(), "cache": config.cache.model_dump(),
                             "num_blocks": num_blocks, "num_cpu_blocks": num_cpu_blocks, "max_model_len": limit},
                     extra={"leaked_blocks": leaked})
