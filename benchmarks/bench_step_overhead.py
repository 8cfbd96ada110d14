"""CPU step overhead of the engine loop, without the model forward (issue 4, Targets).

Measures, per engine step with ``--num-requests`` (default 1,024) running decode requests and
prefix caching on, on ONE CPU core (``torch.set_num_threads(1)``):

* ``schedule`` — ``scheduler.schedule()``, which includes the allocator's ``allocate_slots``;
* ``allocate`` — the part of ``schedule`` spent in ``allocate_slots`` and the paged allocator's batch
  ``allocate_decodes`` (a second, instrumented pass; the timer wrapper's own cost per call is
  measured and subtracted);
* ``prepare`` — ``ModelRunner._prepare(so, None)`` (input ids, positions, slot mapping, block table and the
  attention inputs as tensors) plus the backend's ``build_metadata``;
* ``update`` — ``scheduler.update(so, sampled)`` with one fake token per request (token append,
  stop checks, prefix-cache block registration on the next ``allocate_slots``).

The scheduler and allocator are the real plugins, built by name through the plugin registry
(default ``chunked_prefill`` + ``paged``); the ModelRunner is the real class with no model and no KV
tensors (``_prepare`` needs neither). Requests share ``--prefix-groups`` prefixes of
``--prefix-len`` tokens, so prefix-cache lookups hit and blocks are shared.

Reports the median milliseconds per step of each part and of the sum (target: <= 1 ms/step), the
command and the machine. ``--profile`` adds cProfile's hottest functions; ``--line-profile`` (needs
the ``line_profiler`` package) adds the hottest lines of schedule / allocate_slots / _prepare / update.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_step_overhead.py [--steps 300] [--profile] [--line-profile]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build(args):
    """(scheduler, allocator, runner, backend, requests) with every request decoding."""
    from kvforge.bench.sim import build_scheduler
    from kvforge.config import EngineConfig
    from kvforge.engine.model_runner import ModelRunner
    from kvforge.engine.request import Request
    from kvforge.engine.sampling_params import SamplingParams
    from kvforge.plugin_manager import load_registry

    registry = load_registry()
    n, plen = args.num_requests, args.prompt_len
    max_len = plen + args.warmup + args.steps + args.steps // 2 + 120  # every timed pass stays in decode
    cfg = EngineConfig.from_sources(None, {
        "model": "unused-no-weights", "scheduler": args.scheduler, "enable_prefix_caching": True,
        "block_size": args.block_size, "max_num_seqs": n, "max_num_batched_tokens": args.max_num_batched_tokens})
    num_blocks = n * (-(-max_len // args.block_size)) + 16
    sched, alloc = build_scheduler(cfg, registry, num_blocks, max_len, 0)
    backend = registry.get("attention", args.attention_backend).factory(None)
    runner = ModelRunner(None, backend, alloc, [], torch.device("cpu"))
    sp = SamplingParams(temperature=0.0, max_tokens=max_len - plen, ignore_eos=True)
    reqs = []
    for i in range(n):
        g = i % args.prefix_groups
        prefix = [3 + (g * 7 + j) % 500 for j in range(args.prefix_len)]
        own = [3 + (i * 13 + j * 5) % 500 for j in range(plen - args.prefix_len)]
        r = Request(f"r{i}", prefix + own, sp, sp.max_tokens, frozenset({2}), parent_id=f"r{i}", arrival_time=float(i))
        sched.add_request(r)
        reqs.append(r)
    # Prefill everything (not timed) until every request is a running decode.
    while any(r.num_tokens - r.num_computed_tokens != 1 or r.status.name != "RUNNING" for r in reqs):
        so = sched.schedule()
        counts = so.num_scheduled_tokens
        sched.update(so, {r.request_id: [5] for r in so.scheduled
                          if r.num_computed_tokens + counts[r.request_id] >= r.num_tokens})
    return sched, alloc, runner, backend, reqs


def one_step(sched, runner, backend, timer=time.perf_counter):
    t0 = timer()
    so = sched.schedule()
    t1 = timer()
    inputs = runner._prepare(so, None)[2]
    backend.build_metadata(inputs)
    t2 = timer()
    sampled = {r.request_id: [5] for r in so.scheduled}
    sched.update(so, sampled)
    t3 = timer()
    assert len(so.scheduled) == len(sampled) and not so.preempted
    return t1 - t0, t2 - t1, t3 - t2, len(so.scheduled)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefix-len", type=int, default=64, help="shared prefix tokens per group")
    ap.add_argument("--prefix-groups", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--scheduler", default="chunked_prefill")
    ap.add_argument("--attention-backend", default="torch_ref")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps; print the hottest functions")
    ap.add_argument("--line-profile", action="store_true", help="line_profiler on the four hot functions")
    args = ap.parse_args()
    torch.set_num_threads(1)

    sched, alloc, runner, backend, reqs = build(args)
    for _ in range(args.warmup):
        one_step(sched, runner, backend)
    rows = [one_step(sched, runner, backend) for _ in range(args.steps)]
    sch = [r[0] for r in rows]
    prep = [r[1] for r in rows]
    upd = [r[2] for r in rows]
    tot = [a + b + c for a, b, c, _ in rows]
    batch = rows[-1][3]

    # Instrumented pass: how much of schedule() is allocate_slots().
    orig = alloc.allocate_slots
    spent = [0.0]
    calls = [0]

    def timed(req, n, la=0):
        t = time.perf_counter()
        try:
            return orig(req, n, la)
        finally:
            spent[0] += time.perf_counter() - t
            calls[0] += 1

    def noop(req, n, la=0):
        return None

    def timed_noop(req, n, la=0):  # the wrapper's own cost, to subtract
        t = time.perf_counter()
        try:
            return noop(req, n, la)
        finally:
            spent[0] += time.perf_counter() - t

    # the paged allocator's batch call for steps of plain decodes (kv_cache/paged.py)
    orig_batch = getattr(alloc, "allocate_decodes", None)
    batch_calls = [0]

    def timed_batch(*a):
        t = time.perf_counter()
        try:
            return orig_batch(*a)
        finally:
            spent[0] += time.perf_counter() - t
            batch_calls[0] += 1

    alloc.allocate_slots = timed
    if orig_batch is not None:
        alloc.allocate_decodes = timed_batch
    alloc_ms, sched_inst = [], []
    for _ in range(args.steps // 2):
        spent[0] = 0.0
        calls[0] = batch_calls[0] = 0
        s, _, _, _ = one_step(sched, runner, backend)
        alloc_ms.append(spent[0])
        sched_inst.append(s)
    per_call = calls[0] + batch_calls[0]
    alloc.allocate_slots = orig
    if orig_batch is not None:
        alloc.allocate_decodes = orig_batch
    t = time.perf_counter()
    for _ in range(1000):
        timed_noop(None, 1)
    wrap_cost = (time.perf_counter() - t) / 1000 - 0.0
    spent[0] = 0.0
    t_noop = time.perf_counter()
    for _ in range(1000):
        noop(None, 1)
    wrap_cost -= (time.perf_counter() - t_noop) / 1000
    alloc_med = statistics.median(alloc_ms)
    sched_med_inst = statistics.median(sched_inst)
    overhead = max(0.0, wrap_cost) * per_call

    ms = 1000.0
    print(f"command: OMP_NUM_THREADS=1 python {' '.join(sys.argv)}")
    print(f"machine: {cpu_name()} ({platform.machine()}), python {platform.python_version()}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"setup: {len(reqs)} running decodes (batch {batch}), prompt {args.prompt_len} tokens with "
          f"{args.prefix_groups} shared {args.prefix_len}-token prefixes, block_size {args.block_size}, "
          f"scheduler {args.scheduler} + paged (prefix caching on), {args.steps} timed steps; "
          f"prefix hit rate {alloc.stats().get('prefix_cache_hit_rate', 0):.2f}")
    print(f"median ms/step: schedule {statistics.median(sch) * ms:.3f}  prepare {statistics.median(prep) * ms:.3f}  "
          f"update {statistics.median(upd) * ms:.3f}  TOTAL {statistics.median(tot) * ms:.3f}  "
          f"(p90 total {sorted(tot)[int(0.9 * len(tot))] * ms:.3f})")
    print(f"  of schedule: allocation {(alloc_med - overhead) * ms:.3f} ms ({calls[0]} allocate_slots + "
          f"{batch_calls[0]} allocate_decodes calls/step), "
          f"scheduling logic {(sched_med_inst - alloc_med) * ms:.3f} ms "
          f"(instrumented pass; wrapper cost {overhead * ms:.3f} ms/step subtracted)")
    target = statistics.median(tot) * ms
    print(f"target <= 1 ms/step: {'MET' if target <= 1.0 else 'NOT MET'} ({target:.3f} ms)")

    if args.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(min(50, args.steps)):
            one_step(sched, runner, backend)
        prof.disable()
        print("\ncProfile, 50 steps, by own time:")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    if args.line_profile:
        from line_profiler import LineProfiler
        from kvforge.engine.model_runner import ModelRunner
        lp = LineProfiler()
        fns = [type(sched).schedule, type(sched).update, type(alloc).allocate_slots, ModelRunner._prepare]
        for c in type(sched).__mro__:
            for name in ("schedule", "update", "_allocate_or_preempt", "_chunk"):
                if name in vars(c):
                    fns.append(vars(c)[name])
        for f in dict.fromkeys(fns):
            lp.add_function(f)
        lp.enable_by_count()
        for _ in range(min(50, args.steps)):
            one_step(sched, runner, backend)
        lp.disable_by_count()
        stats = lp.get_stats()
        lines = []
        for (fn, lineno, name), timings in stats.timings.items():
            src = Path(fn).read_text().splitlines() if Path(fn).exists() else []
            for ln, hits, t in timings:
                lines.append((t * stats.unit, Path(fn).name, ln, name, hits, src[ln - 1].strip() if ln <= len(src) else ""))
        lines.sort(reverse=True)
        total = sum(x[0] for x in lines if x[3].rsplit(".", 1)[-1] in ("schedule", "_prepare", "update"))
        print("\nhottest lines (line_profiler, 50 steps; % of schedule+_prepare+update time):")
        for t, f, ln, name, hits, code in lines[:20]:
            print(f"  {100 * t / total:5.1f}%  {t / 50 * ms:7.3f} ms/step (profiled)  {f}:{ln} {name} "
                  f"(hits {hits}): {code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
