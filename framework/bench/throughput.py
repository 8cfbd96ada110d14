"""``kvforge bench throughput``: offline throughput of ``LLM.generate`` on a synthetic workload.

Usage (flag names follow vLLM's ``benchmarks/benchmark_throughput.py``)::

    kvforge bench throughput --model DIR --load-format dummy \\
        --input-len 1024 --output-len 128 --num-prompts 1000 --output-json tput.json

    kvforge bench throughput --model DIR --load-format dummy --dataset variable \\
        --num-prompts 256 --min-len 100 --max-len 1024 --seed 0 --baseline hf --hf-batch-size 128

Every request is ``{"prompt_token_ids": [...]}`` (see :mod:`kvforge.bench.datasets`) with
``SamplingParams(ignore_eos=True, max_tokens=<its output_len>, temperature=--temperature)``.
The default temperature is 0 (greedy): the HF baseline then runs ``do_sample=False``, so both sides do
the same (cheapest) sampling work and random weights can't make HF's multinomial see NaNs.
One warm-up ``generate`` (the first ``--num-warmup-prompts`` prompts, 8 tokens each) runs before the
timed call, so kernel JIT / autotuning / graph capture are not timed.

Figures (seconds from ``time.perf_counter`` around ``LLM.generate``, synchronized on CUDA):
requests/s, total tokens/s ((input + output) / s) and output tokens/s. Each is also given as a
fraction of the roofline (:func:`roofline`), and with ``--baseline hf`` as a ratio to Hugging Face
transformers ``generate`` on the same prompts (:mod:`kvforge.bench.hf_baseline`).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kvforge.bench.args import check_output_path, nonneg_int, positive_float, positive_int, raise_limit_hint
from kvforge.bench.peaks import resolve_peaks
from kvforge.bench.roofline import ModelShape, add_roofline_flags, kv_cache_bytes, roofline, step_weight_bytes_for

# ---------------------------------------------------------------------------------------- reporting

def environment(device: Any = None) -> dict[str, Any]:
    """Device name and library versions for the JSON report."""
    import torch
    import transformers
    env: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "torch": torch.__version__, "transformers": transformers.__version__,
                           "cuda": torch.version.cuda}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        from importlib.metadata import version
        env["kvforge"] = version("kvforge")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        env["kvforge"] = None
    dev = torch.device(device) if device is not None else None
    env["device"] = str(dev) if dev is not None else None
    if dev is not None and dev.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(dev)
    else:
        env["device_name"] = platform.processor() or platform.machine() or "cpu"
    return env


def command_line(args: argparse.Namespace, parser: argparse.ArgumentParser, prog: str) -> str:
    """A shell command that reproduces ``args`` (flags whose value differs from the default)."""
    parts = prog.split()
    for a in parser._actions:
        if not a.option_strings or a.dest in ("help", "func"):
            continue
        v = getattr(args, a.dest, a.default)
        if v == a.default or v is None:
            continue
        flag = max(a.option_strings, key=len)
        if isinstance(a, (argparse._StoreTrueAction, argparse._StoreConstAction)):
            parts.append(flag)
        elif isinstance(v, list):
            for item in v:
                parts += [flag, str(item)]
        else:
            parts += [flag, str(v)]
    return shlex.join(parts)


def report_header(args: argparse.Namespace, parser: argparse.ArgumentParser, prog: str, llm: Any,
                  startup_s: float | None = None) -> dict:
    """``command``, ``argv``, ``date``, ``environment``, engine ``config`` and start-up of a run:
    ``engine_start_s`` (seconds to build the engine: load, warm-up, graph capture) and the
    decode batch sizes captured as CUDA graphs (``cuda_graph_sizes``: empty when eager, None
    when the model runs in worker processes, which capture their own)."""
    parts = llm.llm_engine.parts
    graphs = getattr(getattr(llm.llm_engine, "runner", None), "graphs", None)
    in_workers = parts.config.parallel.world_size > 1 or parts.config.parallel.data_parallel_size > 1
    sizes = None if in_workers else [b.size for b in graphs.buckets] if graphs else []
    return {"command": command_line(args, parser, prog), "argv": sys.argv,
            "engine_start_s": startup_s, "cuda_graph_sizes": sizes,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "environment": environment(parts.device),
            "config": {**parts.config.model_dump(mode="json"), "resolved": {
                **parts.choices, "dtype": str(parts.dtype).replace("torch.", ""), "device": str(parts.device),
                "max_model_len": parts.max_model_len, "num_gpu_blocks": getattr(parts.allocator, "num_blocks", None)}}}


def write_json(path: str | None, data: dict) -> None:
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(data, indent=2, default=str) + "\n")
        print(f"wrote {p}")


def synchronize(device: Any) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def detokenize_ok(llm: Any, want: bool) -> bool:
    """Detokenize only when asked and when every model token id exists in the tokenizer (a dummy model
    may pair a large vocabulary with a small tokenizer; benchmarks pass token ids, so text is optional)."""
    if not want:
        return False
    if llm.llm_engine.vocab_size > len(llm.get_tokenizer()):
        print(f"note: model vocab {llm.llm_engine.vocab_size} > tokenizer's {len(llm.get_tokenizer())}: "
              "detokenization disabled", file=sys.stderr)
        return False
    return True


# ---------------------------------------------------------------------------------------- command

def add_throughput_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``bench throughput`` on the ``bench`` subcommand group."""
    from kvforge.bench.datasets import DATASETS
    from kvforge.entrypoints.cli import _add_engine_flags
    p = bench_sub.add_parser("throughput", help="offline throughput of LLM.generate (optionally vs HF transformers)",
                             description=__doc__.split("\n\n")[0],
                             epilog="--seed seeds both the engine and the dataset.")
    _add_engine_flags(p)
    w = p.add_argument_group("workload")
    w.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random",
                   help="random: fixed lengths (or +-range-ratio); variable: lengths uniform in [min-len, max-len]")
    w.add_argument("--input-len", type=positive_int, default=1024, help="prompt tokens (default: 1024)")
    w.add_argument("--output-len", type=positive_int, default=128, help="generated tokens per prompt (default: 128)")
    w.add_argument("--num-prompts", type=positive_int, default=1000, help="requests (default: 1000)")
    w.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="lengths uniform in [N*(1-r), N*(1+r)] (default: 0)")
    w.add_argument("--min-len", type=int, help="variable: smallest input and output length")
    w.add_argument("--max-len", type=int, help="variable: largest input and output length")
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default; HF baseline matches)")
    w.add_argument("--num-warmup-prompts", type=nonneg_int, default=16, help="warm-up batch size (default: 16; 0 = none)")
    w.add_argument("--disable-detokenize", action="store_true", help="return token ids only")
    w.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    w.add_argument("--output-json", help="write the results here")
    b = p.add_argument_group("baseline")
    b.add_argument("--baseline", choices=("hf",),
                   help="also run Hugging Face transformers generate on the same prompts")
    b.add_argument("--hf-batch-size", "--hf-max-batch-size", dest="hf_batch_size", type=positive_int, default=128,
                   help="HF static batch size (default: 128)")
    add_roofline_flags(p)
    p.add_argument("--roofline-req-s", type=positive_float, help="use this roofline (requests/s) instead of the computed one")
    p.set_defaults(func=lambda a, _p=p: cmd_throughput(a, _p))


def cmd_throughput(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from kvforge.bench.datasets import make_requests, summarize
    from kvforge.engine.sampling_params import SamplingParams
    from kvforge.entrypoints.cli import engine_overrides
    from kvforge.entrypoints.llm import LLM
    check_output_path(args.output_json)
    t_start = time.perf_counter()
    llm = LLM(config=args.config, **engine_overrides(args))
    startup_s = time.perf_counter() - t_start
    engine = llm.llm_engine
    seed = engine.config.model.seed  # --seed (or the config file's) seeds the workload too
    reqs = make_requests(args.dataset, args.num_prompts, args.input_len, args.output_len, engine.vocab_size,
                         seed, args.range_ratio, args.min_len, args.max_len)
    too_long = [i for i, r in enumerate(reqs) if r.prompt_len + r.output_len > engine.max_model_len]
    if too_long:
        r = reqs[too_long[0]]
        raise ValueError(f"request {too_long[0]}: {r.prompt_len} + {r.output_len} tokens exceed max_model_len "
                         f"{engine.max_model_len}; lower --input-len / --output-len, or {raise_limit_hint(engine)}")
    detok = detokenize_ok(llm, not args.disable_detokenize)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=r.output_len,
                             detokenize=detok) for r in reqs]
    device = engine.parts.device
    if args.num_warmup_prompts:
        k = min(args.num_warmup_prompts, len(reqs))
        llm.generate(prompts[:k], [SamplingParams(temperature=args.temperature, ignore_eos=True,
                                                  max_tokens=min(8, r.output_len), detokenize=detok)
                                   for r in reqs[:k]], use_tqdm=False)
    synchronize(device)
    before = engine.stats()  # the scheduler's counters are cumulative: count the timed run only
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    synchronize(device)
    elapsed = time.perf_counter() - t0
    after = engine.stats()
    sched = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_preemptions", "num_recomputed_tokens")}
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(r.prompt_len for r in reqs)
    res = {"elapsed_time": elapsed, "num_requests": len(reqs), "total_num_tokens": n_in + n_out,
           "input_tokens": n_in, "output_tokens": n_out, "requests_per_second": len(reqs) / elapsed,
           "tokens_per_second": (n_in + n_out) / elapsed, "output_tokens_per_second": n_out / elapsed,
           "num_preemptions": int(sched["num_preemptions"]),
           "num_recomputed_tokens": int(sched["num_recomputed_tokens"])}
    shape = ModelShape.from_hf_config(engine.parts.hf_config)
    dtype_bytes = engine.parts.dtype.itemsize
    wbytes, wsource = step_weight_bytes_for(llm, shape, dtype_bytes)
    peaks_source = resolve_peaks(args, device, engine.parts.dtype)
    roof = roofline(shape, [r.prompt_len for r in reqs], [r.output_len for r in reqs], dtype_bytes,
                    engine.config.scheduler.max_num_seqs, args.peak_tflops, args.mem_bw_tbps, wbytes,
                    kv_cache_bytes(engine))
    roof["step_weight_bytes_source"] = wsource
    roof["peaks_source"] = peaks_source
    if args.roofline_req_s:
        scale = args.roofline_req_s / roof["requests_per_s"]
        roof.update(source="command line", requests_per_s=args.roofline_req_s, floor_s=roof["floor_s"] / scale,
                    output_tokens_per_s=roof["output_tokens_per_s"] * scale,
                    total_tokens_per_s=roof["total_tokens_per_s"] * scale)
    else:
        roof["source"] = "computed (kvforge.bench.roofline.roofline)"
    roof["fraction_of_roofline"] = res["requests_per_second"] / roof["requests_per_s"]
    report = {"benchmark": "throughput", **report_header(args, parser, "kvforge bench throughput", llm, startup_s),
              "workload": {"dataset": args.dataset, "seed": seed, "temperature": args.temperature,
                           "ignore_eos": True, "detokenize": detok, "range_ratio": args.range_ratio,
                           "min_len": args.min_len, "max_len": args.max_len, **summarize(reqs)},
              **res, "roofline": roof}
    print(f"kvforge: {res['requests_per_second']:.2f} requests/s, {res['tokens_per_second']:.1f} total tokens/s, "
          f"{res['output_tokens_per_second']:.1f} output tokens/s ({len(reqs)} requests in {elapsed:.2f} s, "
          f"{res['num_preemptions']} preemptions)")
    print(f"roofline: {roof['requests_per_s']:.2f} requests/s, {roof['output_tokens_per_s']:.1f} output tokens/s "
          f"(peak {args.peak_tflops:g} TFLOP/s, {args.mem_bw_tbps:g} TB/s) -> kvforge at "
          f"{100 * roof['fraction_of_roofline']:.3g}% of roofline")
    print(f"roofline peaks: {peaks_source}", file=sys.stderr)
    if args.baseline == "hf":
        from kvforge.bench.hf_baseline import load_hf_model, run_hf_generate
        model_dir, load_format, dtype = engine.config.model.model, engine.config.model.load_format, engine.parts.dtype
        del llm, engine, outs
        gc.collect()
        left = None
        if device.type == "cuda":
            import torch
            torch.cuda.empty_cache()
            left = torch.cuda.memory_allocated(device)  # what kvforge did not give back
        hf = run_hf_generate(load_hf_model(model_dir, load_format, dtype, device, seed, not args.disable_tqdm),
                             reqs, args.hf_batch_size,
                             args.temperature, device, use_tqdm=not args.disable_tqdm)
        hf["device_memory_allocated_before_hf_bytes"] = left
        hf["kvforge_over_hf"] = res["output_tokens_per_second"] / hf["useful_output_tokens_per_second"]
        report["baseline"] = hf
        print(f"hf transformers: {hf['useful_output_tokens_per_second']:.1f} useful output tokens/s "
              f"({hf['num_batches']} static batches of <= {args.hf_batch_size}, {hf['elapsed_time']:.2f} s)")
        print(f"kvforge / hf: {hf['kvforge_over_hf']:.2f}x (output tokens/s)")
    write_json(args.output_json, report)
    return 0

