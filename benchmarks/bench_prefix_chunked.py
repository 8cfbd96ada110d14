"""Issue 4 GPU targets (a script, not a test).

    python benchmarks/bench_prefix_chunked.py --model /tmp/l3   # Llama-3-8B shape, load_format dummy

1. Shared prefix: N requests = one 2000-token shared system prompt + 100 unique tokens,
   128 output tokens (ignore_eos), prefix caching on vs off; prints throughput and the ratio
   (target: on >= 4x off).
2. Chunked prefill: 32 running decodes reach steady state, then one 8000-token prompt
   arrives. ITL of the running decodes = wall time of each engine step (each step gives
   every running decode one token). Prints steady-state median ITL and the p99 ITL over
   the steps from the long prompt's arrival until its first token, for chunked_prefill
   (budget 2048 tokens) and for fcfs (whole prompt in one step). Target: chunked p99 <= 2x steady.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import statistics
import sys
import time

import torch

from kvforge import LLM, SamplingParams


SHARED, LONG = 2000, 8000
PROFILE_STEPS = False


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shared_prefix(model: str, n: int, caching: bool) -> float:
    llm = LLM(model, load_format="dummy", enable_prefix_caching=caching, max_num_seqs=256,
              max_num_batched_tokens=8192, seed=0)
    rng = random.Random(0)
    v = llm.llm_engine.vocab_size
    shared = [rng.randrange(10, v) for _ in range(SHARED)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(10, v) for _ in range(100)]} for _ in range(n)]
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    _sync()
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t
    hit = llm.llm_engine.stats().get("prefix_cache_hit_rate", 0.0)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    print(f"shared prefix, caching={'on ' if caching else 'off'}: {n / dt:7.2f} req/s  ({dt:6.1f} s, hit rate {hit:.2f})")
    return n / dt


def chunked_itl(model: str, scheduler: str, budget: int, extra: dict | None = None) -> dict:
    llm = LLM(model, load_format="dummy", scheduler=scheduler, max_num_batched_tokens=budget, max_num_seqs=64,
              seed=0, **(extra or {}))
    e = llm.llm_engine
    rng = random.Random(1)
    v = e.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=min(600, e.max_model_len - 128), ignore_eos=True, detokenize=False)
    for i in range(32):
        e.add_request(f"d{i}", {"prompt_token_ids": [rng.randrange(10, v) for _ in range(128)]}, sp)
    times = []
    for _ in range(80):  # prefill + reach steady decode
        t = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t)
    steady = statistics.median(times[-40:])
    e.add_request("long", {"prompt_token_ids": [rng.randrange(10, v) for _ in range(LONG)]},
                  SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, detokenize=False))
    window = []
    got_first = False
    slowest = (0.0, None)
    while not got_first:
        prof = cProfile.Profile() if PROFILE_STEPS else None
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        outs = e.step()
        if prof is not None:
            prof.disable()
        window.append(time.perf_counter() - t)
        if prof is not None and window[-1] > slowest[0]:
            slowest = (window[-1], prof)
        got_first = any(o.request_id == "long" and o.outputs[0].token_ids for o in outs)
    if slowest[1] is not None:
        print(f"  slowest step ({slowest[0] * 1e3:.2f} ms, step {window.index(slowest[0])}), cProfile:")
        pstats.Stats(slowest[1], stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    in_order = [round(w * 1e3, 3) for w in window]
    window.sort()
    p99 = window[min(len(window) - 1, int(round(0.99 * (len(window) - 1))))]
    res = {"scheduler": scheduler, "budget": budget, "steady_itl_ms": steady * 1e3, "p99_itl_ms": p99 * 1e3,
           "max_itl_ms": window[-1] * 1e3, "steps_to_first_token": len(window), "ratio": p99 / steady,
           "median_itl_during_ms": statistics.median(window) * 1e3, "itl_during_ms": in_order}
    print(f"{scheduler:16s} budget {budget:5d}: steady ITL {steady * 1e3:6.2f} ms, p99 during 8k arrival "
          f"{p99 * 1e3:7.2f} ms (max {window[-1] * 1e3:.2f}, median {statistics.median(window) * 1e3:.2f}, "
          f"{len(window)} steps) -> {p99 / steady:.2f}x steady")
    print(f"  ITL per step during the arrival (ms): {in_order}")
    e.abort_request([f"d{i}" for i in range(32)] + ["long"])
    while e.has_unfinished_requests():
        e.step()
    del llm, e
    gc.collect()  # the engine holds reference cycles; its KV cache must go before the next run's sizing
    torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--num-requests", type=int, default=500)
    ap.add_argument("--output-json")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--chunk-budget", type=int, nargs="+", default=[2048],
                    help="max_num_batched_tokens for chunked_prefill (several: one run each)")
    ap.add_argument("--skip-unchunked", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="tiny lengths for a CPU smoke run")
    ap.add_argument("--profile-steps", action="store_true",
                    help="cProfile every step of the arrival and print the slowest step's profile")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="engine option for the chunked runs, e.g. attention.settings.split_kv_target_tiles=0")
    a = ap.parse_args()
    PROFILE_STEPS = a.profile_steps
    extra = {}
    for kv in a.set:
        key, _, val = kv.partition("=")
        extra[key] = int(val) if val.lstrip("-").isdigit() else val
    if a.smoke:
        SHARED, LONG = 64, 200
    print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch", torch.__version__)
    out = {}
    if not a.skip_prefix:
        off = shared_prefix(a.model, a.num_requests, False)
        on = shared_prefix(a.model, a.num_requests, True)
        out["shared_prefix"] = {"off_req_s": off, "on_req_s": on, "ratio": on / off}
        print(f"shared prefix speed-up: {on / off:.2f}x (target >= 4x)")
    for budget in a.chunk_budget:
        out[f"chunked_{budget}"] = chunked_itl(a.model, "chunked_prefill", budget, extra)
    if not a.skip_unchunked:
        out["unchunked"] = chunked_itl(a.model, "fcfs", LONG + 256)
    if a.output_json:
        json.dump(out, open(a.output_json, "w"), indent=2)
