"""Where the offline workload's wall time goes, step by step: every engine step of a whole run
(N prompts queued at once, as ``kvforge bench throughput``) timed on the device timeline, with
its shape, then summed by kind: prefill-only, mixed (prefill chunks + decodes), decode-only.

On CUDA each step's time is the gap between CUDA events recorded after consecutive
``engine.step()`` calls (``kvforge.bench.calibrate.timed_steps``, as ``kvforge bench
calibrate`` measures), so the times add up to the run's wall time, including any device idle
time while the host prepares a step; elsewhere it is each call's wall time (the sum then
misses only the time spent adding the requests).

    python benchmarks/step_timeline.py --model /tmp/l3 --load-format dummy --num-prompts 1000
    python benchmarks/step_timeline.py ... --json out.json   # every step: shape and seconds
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from kvforge.bench.args import check_output_path, nonneg_int, positive_int
from kvforge.bench.calibrate import timed_steps
from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.entrypoints.cli import _add_engine_flags, engine_overrides


def run(engine, prompts: int, input_len: int, output_len: int) -> list[tuple[dict, float]]:
    """(shape as a dict or None, seconds) of every engine call until all ``prompts`` are done."""
    span = max(1, engine.vocab_size - 5)
    ids = [[(7 * i + j) % span + 5 for j in range(input_len)] for i in range(prompts)]
    return [(s.__dict__ if s is not None else None, t)
            for s, t in timed_steps(engine, ids, output_len, keep_empty=True)]


def kind(shape: "dict | None") -> str:
    if shape is None or shape["num_seqs"] == 0:  # a call that only collected the last tokens
        return "no schedule (async tail)"
    if shape["num_decode_seqs"] == 0:
        return "prefill only"
    return "mixed" if shape["num_prefill_tokens"] else "decode only"


def summarize(steps: list[tuple[dict, float]], wall: float) -> None:
    total = sum(t for _, t in steps)
    print(f"{len(steps)} steps, {total:.2f} s of steps ({wall:.2f} s wall)")
    for k in ("prefill only", "mixed", "decode only", "no schedule (async tail)"):
        ts = [(s, t) for s, t in steps if kind(s) == k]
        if not ts:
            continue
        sec = sum(t for _, t in ts)
        tok = sum(s["num_batched_tokens"] for s, _ in ts if s)
        dec = sum(s["num_decode_seqs"] for s, _ in ts if s)
        print(f"  {k:25s} {len(ts):5d} steps {sec:7.2f} s ({100 * sec / total:4.1f}%)  median "
              f"{1e3 * statistics.median(t for _, t in ts):7.2f} ms  tokens {tok:8d} (decodes {dec})")
    # decode-only steps by batch size: how full they are
    dec = [(s["num_decode_seqs"], t) for s, t in steps if kind(s) == "decode only"]
    if dec:
        for lo, hi in ((1, 64), (65, 192), (193, None)):
            sel = [t for b, t in dec if lo <= b and (hi is None or b <= hi)]
            if sel:
                print(f"    decode only, batch {lo}{'+' if hi is None else f'-{hi}'}: {len(sel)} steps, "
                      f"{sum(sel):.2f} s, median {1e3 * statistics.median(sel):.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_engine_flags(p)  # --model, --config, every flat engine option (--load-format, --max-num-seqs...), --set
    p.add_argument("--num-prompts", type=positive_int, default=1000)
    p.add_argument("--input-len", type=positive_int, default=1024)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--warmup-prompts", type=nonneg_int, default=64, help="a short run first (compiles, graphs)")
    p.add_argument("--json", help="write every step's shape and seconds here")
    a = p.parse_args()
    try:
        check_output_path(a.json, "--json")  # before the run, not after it
        config = EngineConfig.from_sources(a.config, engine_overrides(a))
    except ValueError as e:
        p.error(str(e))
    engine = LLMEngine(config)
    if a.input_len + a.output_len > engine.max_model_len:
        p.error(f"--input-len {a.input_len} + --output-len {a.output_len} exceed max_model_len {engine.max_model_len}")
    run(engine, a.warmup_prompts, a.input_len, min(8, a.output_len))
    t0 = time.perf_counter()
    steps = run(engine, a.num_prompts, a.input_len, a.output_len)
    wall = time.perf_counter() - t0
    print(f"{a.num_prompts} x {a.input_len} in / {a.output_len} out: {a.num_prompts / wall:.2f} requests/s")
    summarize(steps, wall)
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"shape": s, "seconds": t} for s, t in steps], f)


if __name__ == "__main__":
    main()
