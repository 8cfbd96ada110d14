"""Tensor parallelism on GPUs: TP=N vs TP=1 decode throughput and batch-1 TPOT (issue 8, GPU target).

Target (device kind ``nvidia-h200-x2``): on a Llama-3-8B-shaped model (dummy weights, bf16), TP=2
reaches >= 1.7x the TP=1 decode throughput at batch 64, and a lower batch-1 TPOT.

Method, per tensor-parallel size (each in a fresh subprocess, so one configuration's GPU memory
never limits the next):

* build ``LLMEngine`` with ``load_format=dummy`` (uniform(-1e-3, 1e-3) weights), CUDA graphs on,
  ``max_num_seqs`` = the batch, TP > 1 through the multiprocessing executor (one worker per GPU,
  NCCL);
* **decode throughput, batch B** (default 64): add B requests of ``--input-len`` random token
  ids (``ignore_eos``, ``max_tokens`` large enough), step until every request has its first
  token (prefill done), then time ``--decode-steps`` steps with ``torch.cuda.synchronize``
  around them: throughput = B * steps / seconds (output tokens per second; every step decodes
  one token per request);
* **batch-1 TPOT**: the same with one request; TPOT = seconds / steps (median of
  ``--repeats`` runs).

Both measures include the whole engine step (schedule, forward on the workers, logits to the
driver, sampling, detokenization off), as a user sees it. Prints a Markdown table for
BENCHMARKS.md and writes ``--output-json``.

Usage (on the device)::

    python benchmarks/make_dummy_model.py /tmp/llama3-8b-dummy
    python benchmarks/bench_tp.py --model /tmp/llama3-8b-dummy --tp 1 2 --output-json tp.json
    # A/B of the TP all-reduce in one run (TP=1 once, TP=2 per mode):
    python benchmarks/bench_tp.py --model /tmp/llama3-8b-dummy --tp 1 2 --all-reduce nccl symm_mem
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(args) -> dict:
    """Measure one tensor-parallel size in this process (the ``--child`` mode)."""
    import numpy as np
    import torch

    from kvforge import SamplingParams
    from kvforge.config import EngineConfig
    from kvforge.engine.llm_engine import LLMEngine

    tp = args.child
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    cfg = EngineConfig.from_sources(None, {
        "model": args.model, "load_format": "dummy", "dtype": args.dtype, "tensor_parallel_size": tp,
        "max_num_seqs": max(args.batch, 1), "max_model_len": args.input_len + args.decode_steps + 64,
        "gpu_memory_utilization": args.gpu_memory_utilization, "enable_prefix_caching": False,
        "distributed_executor_backend": "mp" if tp > 1 else None,
        **({} if args.async_scheduling == "auto" else {"async_scheduling": args.async_scheduling == "true"}),
        **({} if args.sample_on_worker == "auto" else {"sample_on_worker": args.sample_on_worker == "true"}),
        **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
        **({"parallel.all_reduce": args.child_all_reduce} if args.child_all_reduce else {})})
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    vocab = min(engine.vocab_size, len(engine.tokenizer))
    sp = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 8, ignore_eos=True, detokenize=False)
    counter = [0]

    def timed_decode(batch: int, steps: int, profile_dir: str | None = None) -> float:
        ids = []
        for _ in range(batch):
            rid = f"b{counter[0]}"
            counter[0] += 1
            engine.add_request(rid, {"prompt_token_ids": rng.integers(3, vocab, args.input_len).tolist()}, sp)
            ids.append(rid)
        # Prefill: step until every request has produced its first token.
        first = set()
        while len(first) < batch:
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    first.add(out.request_id)
        sync()
        if profile_dir:
            engine.start_profile(profile_dir)
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        dt = time.perf_counter() - t
        if profile_dir:
            engine.stop_profile()
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        return dt

    timed_decode(args.batch, 8)  # warm-up (allocator, graphs, caches)
    if args.profile_dir:  # traces of a few decode steps per batch size, then the usual timing
        for b in (args.batch, 1):  # decode steps only (after the prefill)
            timed_decode(b, args.profile_steps, os.path.join(args.profile_dir, f"tp{tp}_b{b}"))
    thr = [args.batch * args.decode_steps / timed_decode(args.batch, args.decode_steps) for _ in range(args.repeats)]
    timed_decode(1, 8)
    tpot = [timed_decode(1, args.decode_steps) / args.decode_steps for _ in range(args.repeats)]
    res = {"tp": tp, "all_reduce": engine.config.parallel.all_reduce if tp > 1 else "-", "build_s": build_s, "batch": args.batch, "decode_steps": args.decode_steps,
           "decode_tok_s": statistics.median(thr), "decode_tok_s_all": thr,
           "tpot_b1_ms": 1e3 * statistics.median(tpot), "tpot_b1_ms_all": [1e3 * x for x in tpot],
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "choices": engine.parts.choices}
    ex = getattr(engine, "executor", None)
    if ex is not None:
        ex.shutdown()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="model dir (benchmarks/make_dummy_model.py writes one)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (default: 1 2)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request (default: 512)")
    p.add_argument("--decode-steps", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-scheduling", choices=["auto", "true", "false"], default="auto",
                   help="scheduler.async_scheduling (auto: on for CUDA, TP > 1 included)")
    p.add_argument("--sample-on-worker", choices=["auto", "true", "false"], default="auto",
                   help="parallel.sample_on_worker (auto: on for CUDA with TP > 1)")
    p.add_argument("--all-reduce", choices=["auto", "nccl", "symm_mem"], nargs="+", default=None,
                   help="parallel.all_reduce; several values A/B them for each TP > 1 in one run "
                        "(default: the engine's)")
    p.add_argument("--attention-backend", help="attention.backend (default: the engine's choice)")
    p.add_argument("--output-json")
    p.add_argument("--profile-dir", help="also write torch.profiler traces of --profile-steps decode steps at "
                   "batch --batch and 1 to DIR/tp{N}_b{B}/ (driver.json, rank{R}.json; "
                   "benchmarks/trace_summary.py reads them)")
    p.add_argument("--profile-steps", type=int, default=24)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-all-reduce", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(run_one(args)), flush=True)
        return 0
    results = []
    passthrough = list(sys.argv[1:] if argv is None else argv)
    runs = [(tp, mode) for tp in args.tp for mode in ([None] if tp == 1 else args.all_reduce or [None])]
    for tp, mode in runs:
        cmd = [sys.executable, os.path.abspath(__file__), *passthrough, "--child", str(tp),
               *(["--child-all-reduce", mode] if mode else [])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            print(proc.stdout[-4000:], proc.stderr[-8000:], file=sys.stderr)
            print(f"TP={tp} (all-reduce {mode or 'default'}) failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        r = json.loads(line[len("RESULT "):])
        results.append(r)
        print(f"TP={tp} ({r['all_reduce']}): {r['decode_tok_s']:.0f} tok/s at batch {r['batch']}, batch-1 TPOT "
              f"{r['tpot_b1_ms']:.2f} ms (build {r['build_s']:.0f} s)", flush=True)
    base = next((r for r in results if r["tp"] == 1), None)
    print(f"\n{results[0]['gpu']}, {os.path.basename(os.path.normpath(args.model))} (dummy weights, {args.dtype}), "
          f"input {args.input_len}, "
          f"{args.decode_steps} decode steps, median of {args.repeats}\n")
    print("| TP | all-reduce | decode tok/s (batch %d) | speed-up | batch-1 TPOT (ms) |" % args.batch)
    print("|---|---|---|---|---|")
    for r in results:
        sp = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        print(f"| {r['tp']} | {r['all_reduce']} | {r['decode_tok_s']:.0f} | {sp} | {r['tpot_b1_ms']:.2f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
