"""``kvforge bench ab``: replay one request trace against several schedulers, side by side.

Usage::

    kvforge bench ab --model DIR --scheduler fcfs --scheduler sjf \\
        --workload 'poisson:rate=4,n=200,prompt=uniform(32,512),output=uniform(16,128),seed=0' \\
        --mode sim --cost-model benchmarks/cost_models/cpu-stories260K.json --output-dir ab_out

    kvforge bench ab --model DIR --trace trace.jsonl --max-num-seqs 32 \\
        --scheduler chunked_prefill:enable_prefix_caching=true \\
        --scheduler chunked_prefill:enable_prefix_caching=false,label=no-cache --mode real

Modes:

* ``real`` — the real LLMEngine on this machine's device (:mod:`kvforge.bench.real`);
* ``sim`` — the deterministic simulator: real scheduler and allocator plugins, a calibrated cost
  model instead of the forward pass (:mod:`kvforge.bench.sim`; needs ``--cost-model``);
* ``both`` — real then sim for each scheduler, with the simulator's throughput and TTFT errors
  (how far to trust the cost model on this workload).

Every arm replays the same trace with the same synthesized token ids; the scheduler spec rule
(``NAME[:key=val,...]``) is in :mod:`kvforge.bench.common`, the trace format and the ``--workload``
mini-language in :mod:`kvforge.bench.workload`, the metrics in :mod:`kvforge.bench.metrics` and the
output files in :mod:`kvforge.bench.report`. The trace is also saved to ``OUTPUT_DIR/trace.json``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_EPILOG = """\
--scheduler NAME[:key=val,...]: key=val goes to the flat engine option of that name when it is one
(enable_prefix_caching, max_num_batched_tokens, max_num_seqs, num_gpu_blocks, block_size, ...), to a
dotted config path when the key has a dot (cache.settings.x=1), else to scheduler.settings.<key>
(e.g. preemption_mode=swap, long_prefill_token_threshold=256). label=TEXT names the column.

--workload ARRIVAL:key=val,...  ARRIVAL: poisson | gamma | constant | burst.
keys: n, rate (req/s; inf = all at t=0), burstiness (gamma shape), prompt (own tokens per request),
output, prefix_groups, prefix_len, prefix_frac, priority, seed.
distributions: N | uniform(a,b) | normal(mean,std) | lognormal(median,sigma) | choice(d1:w1,d2:w2,...)
e.g. poisson:rate=4,n=200,prompt=uniform(32,512),output=uniform(16,128),prefix_groups=4,prefix_len=256,priority=uniform(0,3),seed=0
"""


def add_engine_flags(p: argparse.ArgumentParser, skip: tuple[str, ...] = ("scheduler",),
                     model_help: str = "checkpoint directory, or model.model in --config (sim mode reads only "
                                       "its config.json)",
                     config_help: str = "YAML or JSON engine config shared by every arm; flags override it") -> None:
    """The engine's flat-config flags (as ``kvforge generate``), minus ``skip``; values land in
    ``cfg_<name>`` for :func:`kvforge.entrypoints.cli.engine_overrides`."""
    from kvforge.config import FLAT_FIELDS
    p.add_argument("--model", help=model_help)
    p.add_argument("--config", help=config_help)
    for name in sorted(FLAT_FIELDS):
        if name == "model" or name in skip:
            continue
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"cfg_{name}", default=None,
                       help=f"sets {FLAT_FIELDS[name]}")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config path, e.g. cache.settings.foo=1 (value parsed as JSON if it can be)")


def add_ab_parser(bench_sub) -> None:
    """Register ``bench ab`` on the ``bench`` subcommand group."""
    p = bench_sub.add_parser("ab", help="A/B several schedulers on one request trace (real engine or simulator)",
                             description=__doc__.split("\n\n")[0], epilog=_EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", dest="ab_schedulers", action="append", required=True,
                   metavar="NAME[:key=val,...]", help="a scheduler arm; repeat for each (see below)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="a saved trace (.json or .jsonl)")
    src.add_argument("--workload", metavar="SPEC", help="generate a trace (see below)")
    p.add_argument("--save-trace", metavar="FILE", help="also write the trace here (.json or .jsonl)")
    p.add_argument("--mode", choices=("real", "sim", "both"), default="real",
                   help="real engine, simulator, or both (default: real)")
    p.add_argument("--cost-model", metavar="FILE", help="cost model JSON from `kvforge bench calibrate` (sim/both)")
    p.add_argument("--output-dir", default="ab_results", help="where the table, JSON and PNG go (default: ab_results)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show progress bars (default: when stderr is a terminal)")
    add_engine_flags(p)
    p.set_defaults(func=cmd_ab)


def cmd_ab(args: argparse.Namespace) -> int:
    run_ab(args)
    return 0


def load_or_generate(args: argparse.Namespace):
    from kvforge.bench.trace import load_trace
    from kvforge.bench.workload import generate_trace
    return load_trace(args.trace) if args.trace else generate_trace(args.workload)


def sim_accuracy(real, sim, cost_model) -> dict[str, Any]:
    """How well the simulator matched the real run of the same arm: throughput and TTFT errors
    (sim / real - 1) and the cost model's per-step error on the real run's own step shapes."""
    import numpy as np

    from kvforge.bench.cost_model import StepShape
    from kvforge.bench.metrics import summarize
    rs, ss = summarize(real), summarize(sim)

    def err(a, b):
        return (b / a - 1.0) if a and b is not None else None
    steps = real.extra.get("steps", [])
    pred = np.array([cost_model.step_time(StepShape(**shape)) for shape, _ in steps])
    meas = np.array([t for _, t in steps])
    return {"output_throughput_err": err(rs["output_throughput"], ss["output_throughput"]),
            "request_throughput_err": err(rs["request_throughput"], ss["request_throughput"]),
            "ttft_p50_err": err(rs["ttft_ms"]["p50"], ss["ttft_ms"]["p50"]),
            "busy_time_err": err(float(meas.sum()), float(pred.sum())) if len(steps) else None,
            "step_time_mean_abs_rel_err": float(np.mean(np.abs(pred / meas - 1.0))) if len(steps) else None}


def check_real_arm(config, registry, facts=None, longest: int = 0) -> None:
    """The capability and quantizer checks an engine build of ``config`` runs, without building
    it or reading weights, so that a bad arm fails before the first arm runs. With ``facts``
    (the model's :class:`~kvforge.bench.common.ModelFacts`) and an explicit KV budget
    (``cache.num_gpu_blocks`` or ``cache.kv_cache_memory_bytes``), also that the budget holds a
    block, an explicit ``model.max_model_len``, and the trace's ``longest`` request (tokens).
    A drafter's share of each block (a draft model's own KV) is not counted: it is known only
    once the drafter is built, so such an arm can still fail when it starts.

    Raises:
        ValueError: as :func:`kvforge.engine.capabilities.check_capabilities` and
            :func:`kvforge.engine.builder.build_quant_config`; or naming the cache setting.
    """
    from kvforge.bench.common import check_cache_holds
    from kvforge.engine.builder import build_quant_config, load_hf_config
    from kvforge.engine.sizing import kv_block_bytes
    from kvforge.engine.resolve import resolve_device, resolve_dtype
    from kvforge.engine.capabilities import check_capabilities
    from kvforge.layers.kv_cache_dtype import resolve_kv_cache_dtype
    hf_config = load_hf_config(config.model.model)
    dtype, device = resolve_dtype(config.model.dtype, hf_config), resolve_device(config.model.device)
    check_capabilities(config, registry, hf_config, dtype, device)
    q = config.quantization  # (the checkpoint's format: e.g. gptq asked of a dense model)
    build_quant_config(registry, hf_config, q.method, q.settings, dtype, device)
    c = config.cache
    if facts is None or (c.num_gpu_blocks is None and c.kv_cache_memory_bytes is None):
        return  # (a GPU's default budget depends on the memory free when the arm starts)
    if c.num_gpu_blocks is not None:
        blocks, knob = c.num_gpu_blocks, "cache.num_gpu_blocks"
    else:  # the engine's block: K and V of every layer, in the dtype it resolves
        block_bytes = kv_block_bytes(hf_config, facts.head_dim, facts.num_kv_heads, c.block_size,
                                      resolve_kv_cache_dtype(c.kv_cache_dtype, dtype))
        blocks, knob = c.kv_cache_memory_bytes // block_bytes, "cache.kv_cache_memory_bytes"
        if blocks < 1:
            raise ValueError(f"{knob}: {c.kv_cache_memory_bytes} bytes hold no KV block of {block_bytes} bytes "
                             f"({c.block_size} tokens)")
    tokens, explicit = blocks * c.block_size, config.model.max_model_len
    if explicit is not None and tokens < explicit:
        raise ValueError(f"model.max_model_len {explicit} exceeds the {tokens} tokens that {blocks} KV blocks of "
                         f"{c.block_size} tokens hold: raise {knob} or lower model.max_model_len")
    check_cache_holds(config, blocks, longest)


def run_ab(args: argparse.Namespace) -> dict[str, Any]:
    """Run every arm and write the reports; returns the JSON document.

    Raises:
        ValueError: bad trace, workload, scheduler spec, config or cost model — all checked
            before any arm runs.
    """
    from kvforge.bench.common import (check_cache_holds, check_trace_fits, max_model_len, model_facts,
                                      parse_scheduler_spec, scheduler_config, unique_labels)
    from kvforge.bench.sim import build_scheduler, sim_num_blocks, sim_scheduler_defaults
    from kvforge.bench.cost_model import CostModel
    from kvforge.bench.report import format_table, results_document, write_json, write_plot
    from kvforge.bench.trace import save_trace, synthesize_prompts
    from kvforge.entrypoints.cli import engine_overrides
    from kvforge.plugin_manager import load_registry

    mode = args.mode
    if mode in ("sim", "both") and not args.cost_model:
        raise ValueError(f"--mode {mode} needs --cost-model FILE (make one with `kvforge bench calibrate`)")
    cost_model = CostModel.load(args.cost_model) if args.cost_model else None
    trace = load_or_generate(args)
    base = engine_overrides(args)
    specs = [parse_scheduler_spec(s) for s in args.ab_schedulers]
    unique_labels(specs)
    registry = load_registry()
    configs = [scheduler_config(base, s, args.config) for s in specs]
    model_dir = configs[0].model.model
    facts = model_facts(model_dir)
    longest = max((r.prompt_len + r.output_len for r in trace.requests), default=0)
    for spec, cfg in zip(specs, configs):  # every arm is checked before anything runs or is written
        try:
            limit = max_model_len(cfg, facts)
            check_trace_fits(trace, limit)
            c = cfg.model_copy(deep=True)
            sim_scheduler_defaults(c, limit, cost_model)
            if mode in ("sim", "both"):
                check_cache_holds(c, sim_num_blocks(c, facts, cost_model, limit), longest)
            cpu_blocks = c.cache.swap_space_bytes // facts.kv_block_bytes(c.cache.block_size, c.model.dtype,
                                                                          c.cache.kv_cache_dtype)
            build_scheduler(c, registry, 1, limit, cpu_blocks)  # a dry build: block ids only, no tensors
            if mode in ("real", "both"):  # the engine's whole capability check, model-side kinds too
                check_real_arm(c, registry, facts, longest)
        except ValueError as e:
            if len(specs) > 1 and type(e) is ValueError:  # (pydantic's errors format themselves)
                raise ValueError(f"arm {spec.label!r}: {e}") from None
            raise
    if getattr(args, "save_trace", None):
        save_trace(trace, args.save_trace)
    prompts = synthesize_prompts(trace, facts.vocab_size, facts.special_ids)
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    results = []
    accuracy: dict[str, Any] = {}
    for s, cfg in zip(specs, configs):
        if mode in ("real", "both"):
            from kvforge.bench.real import run_real
            real = run_real(trace, prompts, cfg, registry, label=s.label + (" (real)" if mode == "both" else ""),
                            spec=s.spec, progress=progress)
            results.append(real)
            _release_device_memory()  # the next arm's engine sizes its KV cache from free memory
        if mode in ("sim", "both"):
            from kvforge.bench.sim import simulate
            sim = simulate(trace, prompts, cfg, registry, cost_model, facts,
                           label=s.label + (" (sim)" if mode == "both" else ""), spec=s.spec, progress=progress)
            results.append(sim)
        if mode == "both":
            accuracy[s.label] = sim_accuracy(real, sim, cost_model)
        for r in results[-2 if mode == "both" else -1:]:
            if r.extra.get("leaked_blocks"):
                print(f"kvforge: warning: {r.label}: {r.extra['leaked_blocks']} KV blocks still allocated at the end",
                      file=sys.stderr)

    meta: dict[str, Any] = {"mode": mode, "model": model_dir, "trace": trace.summary(),
                            "engine_overrides": {k: v for k, v in base.items() if k not in ("model", "model.model")}}
    if cost_model is not None:
        meta["cost_model"] = {"path": str(args.cost_model), **cost_model.summary()}
    if mode != "sim":  # a sim document stays byte-identical across runs: no dates, no host facts
        meta["environment"] = environment()
    if accuracy:
        meta["sim_accuracy"] = accuracy
    doc = results_document(results, meta)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_trace(trace, out / "trace.json")
    table = format_table([r.label for r in results], [s["summary"] for s in doc["schedulers"]])
    header = (f"kvforge bench ab — mode {mode}, {len(trace.requests)} requests"
              + (f", workload {trace.workload}" if trace.workload else f", trace {args.trace}"))
    text = header + "\n" + table + "\n"
    if accuracy:
        text += "\nsimulator vs real (sim/real - 1): " + "; ".join(
            f"{k}: out tok/s {_pct(v['output_throughput_err'])}, TTFT p50 {_pct(v['ttft_p50_err'])}, "
            f"mean |step time err| {_pct(v['step_time_mean_abs_rel_err'], signed=False)}"
            for k, v in accuracy.items()) + "\n"
    (out / "ab_table.txt").write_text(text)
    write_json(doc, out / "ab_results.json")
    if not args.no_plot:
        write_plot(results, out / "ab_plot.png", title=header)
    print(text, end="")
    print(f"\nwrote {out / 'ab_results.json'}, {out / 'ab_table.txt'}"
          + ("" if args.no_plot else f", {out / 'ab_plot.png'}") + f", {out / 'trace.json'}")
    return doc


def _release_device_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _pct(v: float | None, signed: bool = True) -> str:
    return "-" if v is None else (f"{100.0 * v:+.1f}%" if signed else f"{100.0 * v:.1f}%")


def environment() -> dict[str, Any]:
    """Device, versions and date of a measured run (not used in sim documents)."""
    import datetime
    import platform

    import torch
    return {"device": device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch_num_threads": torch.get_num_threads()}


def device_name(device: Any = None) -> str:
    """``NVIDIA H200`` (the CUDA device, default: 0 when CUDA is available) or the CPU model name
    from /proc/cpuinfo."""
    import platform

    import torch
    dev = torch.device(device) if device is not None else None
    if (dev is None and torch.cuda.is_available()) or (dev is not None and dev.type == "cuda"):
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU: " + (platform.processor() or platform.machine())
