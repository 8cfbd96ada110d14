"""Find host-device synchronizations inside the engine's step loop (CUDA only).

Async scheduling only overlaps host and device work if nothing in a step waits for the
GPU except reading the previous step's tokens. This runs a short mixed workload with
``torch.cuda.set_sync_debug_mode("warn")`` and prints each distinct synchronizing call
site (the innermost kvforge frame) with how often it fired per step.

    python benchmarks/check_host_sync.py --model /tmp/l3 --load-format dummy
"""
from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

from kvforge import SamplingParams
from kvforge.engine.llm_engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    engine = LLMEngine.from_kwargs(a.model, load_format=a.load_format, async_scheduling=True)
    for i in range(8):
        engine.add_request(f"r{i}", {"prompt_token_ids": list(range(100, 100 + 50 * (i + 1)))},
                           SamplingParams(temperature=0 if i % 2 else 0.8, max_tokens=a.steps, ignore_eos=True,
                                          logprobs=1 if i == 3 else None))
    for _ in range(3):
        engine.step()
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "kvforge" in f.filename]
        where = f"{frames[-1].filename.split('kvforge')[-1]}:{frames[-1].lineno} {frames[-1].line}" if frames \
            else f"{filename}:{lineno}"
        sites[where] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    torch.cuda.set_sync_debug_mode("default")
    print(f"{steps} steps; synchronizing call sites (count, per step):")
    for where, n in sites.most_common():
        print(f"  {n:6d} {n / steps:6.2f}  {where}")
    print(f"overlapped steps: {engine._overlap.num_overlapped_steps}")


if __name__ == "__main__":
    main()
