"""``kvforge bench calibrate``: measure real engine steps on this device and fit the simulator's
cost model (:mod:`kvforge.bench.cost_model`).

Method. A real :class:`LLMEngine` is built from the engine flags. For each batch size B and prompt
length P of the sweep, B requests of P random token ids and ``--decode-steps`` output tokens
(``ignore_eos``) are added together and the engine is stepped until they finish; a second pass per B
adds half the requests two steps late, so prefill chunks and decodes share steps (mixed batches),
and a third pass alternates prompt lengths P and P/8, so the longest request's context varies apart
from the sum (unequal batches).
Every ``engine.step()`` is timed (on CUDA on the device timeline, between events recorded after
consecutive calls; on the CPU on the wall clock) and its shape is read off the SchedulerOutput, so
the fitted time covers the whole step the simulator replaces: forward, sampling, detokenization and
bookkeeping, or, under async scheduling, whichever of the host and the device takes longer. The sweep
runs ``--repeats`` times with fresh token ids (identical shapes); each step's time is the median
(or, with ``--statistic min``, the minimum) over repeats. A first, discarded run warms up the device.

KV swap cost: whole blocks are copied device -> CPU and back through the runner's own ``swap`` with
a temporary CPU pool (``--swap-blocks`` counts); ``time = const + per_block * blocks`` is fitted.

The JSON records the device name, torch version, date (UTC), model facts, engine settings (block
size, KV blocks and bytes, token budget, attention backend, dtype), sweep, fit statistics and
residuals, and the raw samples.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

_DEFAULT_BATCHES = "1,2,4,8,16,32"
_DEFAULT_PROMPTS = "16,64,128,256"


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 0:
        raise ValueError(f"{flag}: expected non-negative integers, got {text!r}")
    return vals


def add_calibrate_parser(bench_sub) -> None:
    """Register ``bench calibrate`` on the ``bench`` subcommand group."""
    from kvforge.bench.ab import add_engine_flags
    p = bench_sub.add_parser("calibrate", help="fit the A/B simulator's step-time cost model on this device",
                             description=__doc__.split("\n\n")[0],
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="cost model JSON to write")
    p.add_argument("--batch-sizes", default=_DEFAULT_BATCHES, help=f"requests per batch (default {_DEFAULT_BATCHES})")
    p.add_argument("--prompt-lens", default=_DEFAULT_PROMPTS, help=f"prompt tokens (default {_DEFAULT_PROMPTS})")
    p.add_argument("--decode-steps", type=int, default=8, help="output tokens per request (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="sweep repetitions (default 3)")
    p.add_argument("--statistic", choices=("median", "min"), default="median",
                   help="per-step time over the repeats that is fitted: median (default) or min "
                        "(the uncontended cost, for a machine shared with other work)")
    p.add_argument("--swap-blocks", default="1,4,16,64", help="block counts for the swap timing ('0' skips)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    add_engine_flags(p, skip=(), model_help="checkpoint directory, or model.model in --config (the engine "
                                            "that is timed)",
                     config_help="YAML or JSON engine config of the timed engine; flags override it")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvforge.entrypoints.cli import engine_overrides
    batches = _ints(args.batch_sizes, "--batch-sizes")
    prompts = _ints(args.prompt_lens, "--prompt-lens")
    swaps = [k for k in _ints(args.swap_blocks, "--swap-blocks") if k > 0]
    if args.decode_steps < 1 or args.repeats < 1:
        raise ValueError("--decode-steps and --repeats must be >= 1")
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    model = calibrate(engine_overrides(args), args.config, batches, prompts, args.decode_steps, args.repeats,
                      swaps, progress=progress, statistic=args.statistic)
    model.save(args.output)
    fit = model.meta["fit"]
    print(f"cost model for {model.meta['model']['name']} on {model.meta['device']}: "
          + ", ".join(f"{k}={v:.4g}" for k, v in model.coef.items())
          + f"; swap {model.swap_const_s:.3g} s + {model.swap_per_block_s:.3g} s/block")
    print(f"fit over {fit['num_samples']} steps: mean |rel err| {100 * fit['mean_abs_rel_err']:.1f}%, "
          f"max {100 * fit['max_abs_rel_err']:.1f}%, R^2 {fit['r2']:.3f}; wrote {args.output}")
    return 0


def timed_steps(engine, prompts: list[list[int]], max_tokens: int, late: int = 0, tag: str = "t",
                keep_empty: bool = False) -> list[tuple[Any, float]]:
    """Step the engine over ``prompts`` (token id lists; the last ``late`` of them added after
    two steps, all with ``max_tokens`` greedy tokens, ``ignore_eos``) until none is left;
    returns (StepShape, seconds) per step. ``keep_empty``: also the calls that scheduled
    nothing (shape None, or one with ``num_seqs`` 0: with async scheduling the last call only
    collects tokens), so the seconds add up to the whole run."""
    from kvforge.bench.cost_model import step_shape
    from kvforge.engine.sampling_params import SamplingParams
    sched = engine.scheduler
    orig = sched.schedule
    shapes: list = []

    def schedule():
        so = orig()
        shapes.append(step_shape(so))
        return so

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = prompts[:len(prompts) - late]
    rest = prompts[len(prompts) - late:]
    for i, p in enumerate(first):
        engine.add_request(f"{tag}-{i}", p, sp)
    call_shapes: list = []
    times: list[float] = []
    # On CUDA each step is timed on the device timeline: an event recorded after each call
    # completes when everything that call launched has run, so the time of the step
    # scheduled in call i is event[i] - event[i-1]. This holds with async scheduling too,
    # where a call returns before its own step ran (and a step with nothing to sample is
    # not waited for at all); host work that overlaps the device is then not counted.
    cuda = engine.parts.device.type == "cuda"
    events = []
    if cuda:
        import torch
        torch.cuda.synchronize()
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
    sched.schedule = schedule
    try:
        steps = 0
        while engine.has_unfinished_requests() or rest:
            if rest and steps == 2:
                for i, p in enumerate(rest):
                    engine.add_request(f"{tag}-late-{i}", p, sp)
                rest = []
            t = time.perf_counter()
            engine.step()
            if cuda:
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
            times.append(time.perf_counter() - t)
            steps += 1
            call_shapes.append(shapes[-1] if shapes else None)
            shapes.clear()
    finally:
        sched.schedule = orig
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
    return [(s, t) for s, t in zip(call_shapes, times) if keep_empty or (s is not None and s.num_seqs)]


def _measure_swap(engine, counts: list[int], repeats: int) -> tuple[float, float, list[list[float]]]:
    """Time ``runner.swap`` out and in for each block count; fit const + per_block (s)."""
    import numpy as np
    import torch

    from kvforge.bench.cost_model import fit_linear
    runner = engine.runner
    counts = [k for k in counts if k <= engine.allocator.num_blocks]
    if not counts or not runner.kv_caches:
        return 0.0, 0.0, []
    dim = engine.parts.backend.block_dim
    shape = list(runner.kv_caches[0].shape)
    shape[dim] = max(counts)
    cuda = runner.kv_caches[0].is_cuda
    saved = runner.cpu_caches
    runner.cpu_caches = [torch.zeros(shape, dtype=c.dtype, pin_memory=cuda) for c in runner.kv_caches]
    samples: list[list[float]] = []
    try:
        for _ in range(repeats + 1):  # the first round warms up
            rnd = []
            for k in counts:
                pairs = [(i, i) for i in range(k)]
                for to_cpu in (True, False):
                    if cuda:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    runner.swap(pairs, to_cpu=to_cpu)
                    if cuda:
                        torch.cuda.synchronize()
                    rnd.append([1.0, float(k), time.perf_counter() - t])
            samples.extend(rnd if _ else [])
    finally:
        runner.cpu_caches = saved
    a = np.array(samples)
    coef, _ = fit_linear(a[:, :2], np.maximum(a[:, 2], 1e-9), ["const", "per_block"])
    return coef["const"], coef["per_block"], samples


def calibrate(overrides: dict[str, Any], config_file: str | None, batch_sizes: list[int], prompt_lens: list[int],
              decode_steps: int, repeats: int, swap_blocks: list[int], progress: bool = False, seed: int = 0,
              statistic: str = "median"):
    """Measure and fit; returns a :class:`~kvforge.bench.cost_model.CostModel` (module docstring).

    Raises:
        ValueError: bad engine config, or a sweep with no point that fits the engine.
    """
    import datetime

    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from kvforge.bench.ab import device_name
    from kvforge.bench.cost_model import FEATURES, CostModel, fit_linear
    from kvforge.config import EngineConfig
    from kvforge.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_sources(config_file, overrides))
    cfg = engine.config
    bs = engine.allocator.block_size
    special = set(engine.eos_token_ids)
    allowed = np.array([t for t in range(3, engine.vocab_size) if t not in special])
    points = []
    for b in batch_sizes:
        if not 1 <= b <= cfg.scheduler.max_num_seqs:
            continue
        for p in prompt_lens:
            need = b * -(-(p + decode_steps) // bs)
            if p >= 1 and p + decode_steps <= engine.max_model_len and need <= engine.allocator.num_blocks:
                points.append((b, p, 0, False))
        p = max(x for x in prompt_lens if x + decode_steps <= engine.max_model_len) if any(
            x + decode_steps <= engine.max_model_len for x in prompt_lens) else 0
        if b >= 2 and p and b * -(-(p + decode_steps + 2) // bs) <= engine.allocator.num_blocks:
            points.append((b, p, b // 2, False))  # half arrive late: prefill chunks next to decodes
            points.append((b, p, 0, True))        # unequal lengths: the longest request dominates
    if not points:
        raise ValueError("calibrate: no (batch size, prompt length) point fits this engine's max_num_seqs, "
                         "max_model_len and KV cache")
    rng = np.random.default_rng(seed)

    def prompts_for(b: int, p: int, mixed: bool) -> list[list[int]]:
        # mixed: every other prompt is 1/8 as long (max_context_tokens varies apart from the sum)
        lens = [p if not mixed or i % 2 == 0 else max(1, p // 8) for i in range(b)]
        return [allowed[rng.integers(0, len(allowed), size=n)].tolist() for n in lens]

    b, p, late, mixed = points[0]
    timed_steps(engine, prompts_for(b, p, mixed), decode_steps, late, "warmup")
    times: dict[tuple, list[float]] = {}
    shapes: dict[tuple, Any] = {}
    bar = tqdm(total=repeats * len(points), desc="calibrate", disable=not progress, dynamic_ncols=True)
    for r in range(repeats):
        for j, (b, p, late, mixed) in enumerate(points):
            for k, (shape, dt) in enumerate(timed_steps(engine, prompts_for(b, p, mixed), decode_steps, late,
                                                       f"c{r}-{j}")):
                key = (j, k, tuple(shape.vector()), shape.swap_blocks)
                times.setdefault(key, []).append(dt)
                shapes[key] = shape
            bar.update(1)
    bar.close()
    keys = sorted(times)
    x = np.array([shapes[k].vector() for k in keys])
    stat = min if statistic == "min" else statistics.median
    y = np.array([stat(times[k]) for k in keys])
    coef, fit = fit_linear(x, y, FEATURES)
    swap_c, swap_b, swap_samples = _measure_swap(engine, swap_blocks, repeats)
    kv_bytes = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)
    meta = {
        "device": device_name(engine.parts.device), "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": cfg.model.model.rstrip("/").split("/")[-1], "path": cfg.model.model,
                  "architecture": engine.parts.choices.get("model"), "dtype": str(engine.parts.dtype),
                  "load_format": cfg.model.load_format, "vocab_size": engine.vocab_size},
        "engine": {"device": str(engine.parts.device), "block_size": bs, "num_gpu_blocks": engine.allocator.num_blocks,
                   "kv_cache_memory_bytes": kv_bytes, "max_model_len": engine.max_model_len,
                   "max_num_seqs": cfg.scheduler.max_num_seqs,
                   "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
                   "scheduler": cfg.scheduler.name, "choices": engine.parts.choices},
        "engine_overrides": {k: v for k, v in overrides.items() if k not in ("model", "model.model")},
        "sweep": {"batch_sizes": batch_sizes, "prompt_lens": prompt_lens, "decode_steps": decode_steps,
                  "repeats": repeats, "statistic": statistic, "points": [list(pt) for pt in points], "swap_blocks": swap_blocks},
        "fit": fit,
        "samples": {"columns": list(FEATURES) + ["measured_s"],
                    "rows": [list(xr) + [float(yr)] for xr, yr in zip(x.tolist(), y.tolist())],
                    "swap_columns": ["const", "blocks", "measured_s"], "swap_rows": swap_samples},
    }
    return CostModel(coef, swap_c, swap_b, meta)
