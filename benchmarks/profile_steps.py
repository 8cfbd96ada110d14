"""Where a step's GPU time goes: torch.profiler over engine steps of a chosen shape.

Prints the top CUDA kernels (self time, share of the profiled device time) for
  * prefill-heavy steps (``--prefill-prompts`` prompts of ``--input-len`` tokens arriving together);
  * decode-only steps at ``--decode-batch`` running requests of ``--decode-context`` prompt
    tokens each (CUDA-graph replays included).

  * with ``--steady N``: instead, the offline workload's steady state: N prompts of
    ``--input-len`` tokens, ``--output-len`` each, queued at once; after ``--skip-steps``
    steps, ``--steps`` steps are profiled (mixed prefill + decode, as the throughput bench).

    python benchmarks/profile_steps.py --model /tmp/l3 --load-format dummy
    python benchmarks/profile_steps.py --model /tmp/l3 --load-format dummy --steady 1000 --skip-steps 200
    python benchmarks/profile_steps.py --model /tmp/l3awq --load-format dummy --prefill-prompts 1 \
        --set quantization.settings.int4_layout=mma   # an AWQ dummy (make_dummy_model.py --awq-group 128)
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kvforge import SamplingParams
from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.entrypoints.cli import _add_engine_flags, engine_overrides


_GROUPS = (("GEMM (cuBLAS)", ("nvjet", "gemm", "xmma", "cutlass", "splitKreduce")),
           ("attention", ("_paged_", "flash_decode", "_merge")),
           ("norm / RoPE / SiLU / cache write", ("_rmsnorm", "_rope", "_silu", "_reshape_and_cache")),
           ("sampling", ("_greedy", "_sample", "softmax", "argmax")))


def _table(prof, title: str, rows: int, steps: int = 0) -> float:
    """Print the top kernels (device-side events only: a CPU op's self device time is its
    kernels' again) and their groups; returns the kernel time in ms."""
    stats = [e for e in prof.key_averages()
             if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in stats)
    if not total:
        print(f"\n== {title}: no kernel ran (a CPU run?)")
        return 0.0
    per = f" ({total / 1e3 / steps:.2f} ms per step)" if steps else ""
    print(f"\n== {title}: {total / 1e3:.2f} ms of kernel time{per}")
    for e in sorted(stats, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"  {e.self_device_time_total / 1e3:9.2f} ms {100 * e.self_device_time_total / total:5.1f}%  "
              f"x{e.count:<5d} {e.key[:110]}")
    grouped = dict.fromkeys([g for g, _ in _GROUPS] + ["other"], 0.0)
    for e in stats:
        name = next((g for g, keys in _GROUPS if any(k in e.key for k in keys)), "other")
        grouped[name] += e.self_device_time_total
    print("  by group: " + ", ".join(f"{g} {100 * v / total:.1f}%" for g, v in grouped.items()))
    return total / 1e3


def _run(engine, steps: int, title: str, rows: int) -> None:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    _table(prof, title, rows, steps)


def _steady(engine, a) -> None:
    sp = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    span = max(1, engine.vocab_size - 5)
    for i in range(a.steady):
        engine.add_request(f"s{i}", {"prompt_token_ids": [(7 * i + j) % span + 5 for j in range(a.input_len)]}, sp)
    for _ in range(a.skip_steps):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / a.steps
    stats = {k: v for k, v in engine.stats().items() if "running" in k or "waiting" in k}
    print(f"steady state: {wall * 1e3:.2f} ms per step (wall, unprofiled) over {a.steps} steps; "
          f"scheduler: {stats}")
    _run(engine, a.steps, f"{a.steps} steady-state steps after {a.skip_steps + a.steps}", a.rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_engine_flags(p)  # --model, --config, every flat engine option (--load-format, --quantization...), --set
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--prefill-prompts", type=int, default=32)
    p.add_argument("--decode-batch", type=int, default=1)
    p.add_argument("--decode-context", type=int, default=32, help="prompt tokens of each decode-phase request")
    p.add_argument("--rows", type=int, default=18)
    p.add_argument("--steady", type=int, default=0, help="profile the steady state of N queued prompts")
    p.add_argument("--output-len", type=int, default=128, help="--steady: tokens generated per prompt")
    p.add_argument("--skip-steps", type=int, default=200, help="--steady: steps run before profiling")
    p.add_argument("--steps", type=int, default=30, help="--steady: steps profiled")
    a = p.parse_args()
    try:
        engine = LLMEngine(EngineConfig.from_sources(a.config, engine_overrides(a)))
    except ValueError as e:
        p.error(str(e))
    if a.steady:
        _steady(engine, a)
        return
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(a.prefill_prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": [(7 * i + j) % 1000 + 5 for j in range(a.input_len)]}, sp)
    _run(engine, 3, f"3 prefill steps ({a.prefill_prompts} x {a.input_len} tokens queued)", a.rows)
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(a.decode_batch):
        engine.add_request(f"d{i}", {"prompt_token_ids": [5 + (i + j) % 1000 for j in range(a.decode_context)]},
                           SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(5 + -(-a.decode_batch * a.decode_context // 8192)):  # past every prefill chunk
        engine.step()
    _run(engine, 20, f"20 decode steps at batch {a.decode_batch}, context ~{a.decode_context}", a.rows)


if __name__ == "__main__":
    main()
