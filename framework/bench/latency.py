"""``kvforge bench latency``: end-to-end latency of one batch through ``LLM.generate``.

Usage (flag names follow vLLM's ``benchmarks/benchmark_latency.py``)::

    kvforge bench latency --model DIR --load-format dummy --input-len 32 --output-len 128 \\
        --batch-size 1 --num-iters-warmup 5 --num-iters 20 --output-json lat.json

Each iteration submits ``--batch-size`` prompts of ``--input-len`` random token ids (fresh ids every
iteration, so prefix caching cannot skip the prefill) with ``SamplingParams(ignore_eos=True,
max_tokens=--output-len, temperature=--temperature)`` (default 0, greedy) and times the whole
``generate`` call (``time.perf_counter``, synchronized on CUDA). After ``--num-iters-warmup`` untimed
iterations come ``--num-iters`` timed ones, each followed by a prefill-only one (``max_tokens=1``).

Reported: average, median, p90, p99 (and p10/p25/p75) of the end-to-end latency (seconds); the
prefill latency (median); and the time per output token
``TPOT = (median latency - median prefill latency) / (output_len - 1)``, with its ratio to the
roofline floor (:func:`kvforge.bench.roofline.roofline`: decode-step weight + KV reads over memory
bandwidth, or FLOPs over peak, whichever is larger) and to the weights-read floor alone.
"""
from __future__ import annotations

import argparse
import sys
import time

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_latency_parser(bench_sub: argparse._SubParsersAction) -> None:
    """Register ``bench latency`` on the ``bench`` subcommand group."""
    from kvforge.bench.roofline import add_roofline_flags
    from kvforge.entrypoints.cli import _add_engine_flags
    p = bench_sub.add_parser("latency", help="end-to-end latency of one batch, prefill latency and TPOT",
                             description=__doc__.split("\n\n")[0],
                             epilog="--seed seeds both the engine and the prompts.")
    _add_engine_flags(p)
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: 32)")
    w.add_argument("--output-len", type=int, default=128, help="generated tokens per prompt (default: 128)")
    w.add_argument("--batch-size", type=int, default=8, help="prompts per batch (default: 8)")
    w.add_argument("--num-iters-warmup", type=int, default=10, help="untimed iterations first (default: 10)")
    w.add_argument("--num-iters", type=int, default=30, help="timed iterations (default: 30)")
    w.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    w.add_argument("--disable-detokenize", action="store_true", help="return token ids only")
    w.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    w.add_argument("--output-json", help="write the results here")
    add_roofline_flags(p)
    p.set_defaults(func=lambda a, _p=p: cmd_latency(a, _p))


def cmd_latency(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import numpy as np
    from tqdm.auto import tqdm

    from kvforge.bench.args import check_output_path, raise_limit_hint
    from kvforge.bench.peaks import resolve_peaks
    from kvforge.bench.roofline import ModelShape, kv_cache_bytes, roofline, step_weight_bytes_for
    from kvforge.bench.throughput import detokenize_ok, report_header, synchronize, write_json
    from kvforge.engine.sampling_params import SamplingParams
    from kvforge.entrypoints.cli import engine_overrides
    from kvforge.entrypoints.llm import LLM
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    check_output_path(args.output_json)
    t_start = time.perf_counter()
    llm = LLM(config=args.config, **engine_overrides(args))
    startup_s = time.perf_counter() - t_start
    engine = llm.llm_engine
    seed = engine.config.model.seed  # --seed (or the config file's) seeds the workload too
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} exceed max_model_len "
                         f"{engine.max_model_len}; lower them, or {raise_limit_hint(engine)}")
    max_num_seqs = engine.config.scheduler.max_num_seqs
    if args.batch_size > max_num_seqs:
        print(f"note: --batch-size {args.batch_size} > max_num_seqs {max_num_seqs}: the batch runs in waves",
              file=sys.stderr)
    detok = detokenize_ok(llm, not args.disable_detokenize)
    device = engine.parts.device
    rng = np.random.default_rng(seed)

    def run(max_tokens: int) -> float:
        ids = rng.integers(0, engine.vocab_size, size=(args.batch_size, args.input_len)).tolist()
        sp = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=max_tokens, detokenize=detok)
        synchronize(device)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": row} for row in ids], sp, use_tqdm=False)
        synchronize(device)
        dt = time.perf_counter() - t0
        bad = [o for o in outs if o.error or len(o.outputs[0].token_ids) != max_tokens]
        if bad:
            raise RuntimeError(f"request {bad[0].request_id} failed: {bad[0].error or 'short output'}")
        return dt

    quiet = args.disable_tqdm
    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=quiet):
        run(args.output_len)
    lat, pre = [], []
    for _ in tqdm(range(args.num_iters), desc="Profiling iterations", disable=quiet):
        lat.append(run(args.output_len))
        pre.append(run(1))  # interleaved, so load drift on a shared machine hits both alike
    lat, pre = np.array(lat), np.array(pre)
    med, pre_med = float(np.median(lat)), float(np.median(pre))
    tpot = (med - pre_med) / (args.output_len - 1) if args.output_len > 1 else None

    shape = ModelShape.from_hf_config(engine.parts.hf_config)
    dtype_bytes = engine.parts.dtype.itemsize
    wbytes, wsource = step_weight_bytes_for(llm, shape, dtype_bytes)
    peaks_source = resolve_peaks(args, engine.parts.device, engine.parts.dtype)
    roof = roofline(shape, [args.input_len] * args.batch_size, [args.output_len] * args.batch_size, dtype_bytes,
                    max_num_seqs, args.peak_tflops, args.mem_bw_tbps, wbytes, kv_cache_bytes(engine))
    steps = roof["decode_steps"]
    floor = {"prefill_s": roof["prefill_s"], "tpot_s": roof["decode_s"] / steps if steps else None,
             "tpot_weights_read_s": wbytes / (args.mem_bw_tbps * 1e12),
             "step_weight_bytes": wbytes, "step_weight_bytes_source": wsource,
             "latency_s": roof["floor_s"], "peak_tflops": args.peak_tflops, "mem_bw_tbps": args.mem_bw_tbps,
             "peaks_source": peaks_source,
             "num_params": roof["num_params"]}
    res = {"avg_latency": float(lat.mean()), "median_latency": med, "p90_latency": float(np.percentile(lat, 90)),
           "p99_latency": float(np.percentile(lat, 99)), "latencies": lat.tolist(),
           "percentiles": {str(q): float(np.percentile(lat, q)) for q in PERCENTILES},
           "prefill": {"avg_latency": float(pre.mean()), "median_latency": pre_med,
                       "p90_latency": float(np.percentile(pre, 90)), "p99_latency": float(np.percentile(pre, 99)),
                       "latencies": pre.tolist()},
           "tpot": tpot, "output_tokens_per_second": args.batch_size * args.output_len / med,
           "floor": floor,
           "latency_over_floor": med / floor["latency_s"],
           "tpot_over_floor": tpot / floor["tpot_s"] if tpot is not None and floor["tpot_s"] else None,
           "tpot_over_weights_read_floor": tpot / floor["tpot_weights_read_s"] if tpot is not None else None}
    report = {"benchmark": "latency", **report_header(args, parser, "kvforge bench latency", llm, startup_s),
              "workload": {"batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                           "num_iters": args.num_iters, "num_iters_warmup": args.num_iters_warmup, "seed": seed,
                           "temperature": args.temperature, "ignore_eos": True, "detokenize": detok},
              **res}
    def ms(x: float) -> str:
        return f"{x * 1e3:.4g} ms"

    print(f"batch {args.batch_size} x {args.input_len} in / {args.output_len} out, {args.num_iters} iterations:")
    print(f"  latency: avg {ms(res['avg_latency'])}, median {ms(med)}, p90 {ms(res['p90_latency'])}, "
          f"p99 {ms(res['p99_latency'])} ({res['latency_over_floor']:.3g}x floor {ms(floor['latency_s'])})")
    print(f"  prefill (max_tokens=1): median {ms(pre_med)} (floor {ms(floor['prefill_s'])})")
    if tpot is not None:
        print(f"  TPOT: {ms(tpot)} ({res['tpot_over_floor']:.3g}x roofline floor {ms(floor['tpot_s'])}; "
              f"{res['tpot_over_weights_read_floor']:.3g}x weights-read floor {ms(floor['tpot_weights_read_s'])})")
    print(f"  floors' peaks: {args.peak_tflops:.4g} TFLOP/s, {args.mem_bw_tbps:.4g} TB/s ({peaks_source})")
    write_json(args.output_json, report)
    return 0
