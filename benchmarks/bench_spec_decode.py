"""Speculative decoding benchmark (a script, not a test): TPOT with and without speculation.

    python benchmarks/bench_spec_decode.py                 # CUDA, Llama-3-8B shape, bf16, dummy weights
    python benchmarks/bench_spec_decode.py --tiny --device cpu --gen-len 32 --batch 4   # smoke run

Target: a Llama-3-8B-shaped model (``make_dummy_model.py``) with ``load_format=dummy``
(uniform(-1e-3, 1e-3) weights, RMSNorm weights included). The drafts read the same
checkpoint and share the target's tensors (``share_weights``): the self-draft is the
target, the 2-layer draft is exactly its first 2 layers plus its final norm and LM head.
With these weights the residual stream is dominated by the token embedding, so the
truncated draft mostly agrees with the target and greedy outputs settle into cycles
(copy-friendly). ``--init normal`` redraws the weights as Hugging Face initialises a fresh
Llama (normal(0, 0.02), RMSNorm weights 1): then every layer moves the residual a lot and
a 2-layer draft rarely agrees (a pessimistic case for the adaptive rule).

Scenarios (greedy, ignore_eos, prompt token ids, detokenization off):

* ``base``: no speculation, batch 1, on a random prompt and on a copy-heavy prompt
  (seed + the target's own greedy continuation C of the seed + the seed again, so the
  output repeats C, a span of the prompt);
* ``self``: the target drafting for itself, k = 4, adaptive off (100% acceptance in
  exact arithmetic). Ideal TPOT = base * (k * c + 1) / E with c = 1 (a draft step costs
  a target step) and E = measured tokens per verification; the machinery overhead is
  TPOT / ideal - 1 (target <= 15%);
* ``draft2``: the target's first 2 layers as the draft (same width), k = 4, adaptive on;
* ``ngram``: prompt lookup, k = 4, on the copy-heavy prompt, adaptive on;
* ``batch``: ``--batch`` (64) requests, no speculation vs each drafter with the default
  adaptive rule (target: no slowdown beyond 5%). Each engine first serves one batch of
  other random prompts, reported as ``cold``: it includes whatever an engine pays once at
  a new batch size (with ``measure_step_cost`` the rule's first step-time measurements
  there), and the later ``random``/``copy`` batches show the steady state of a serving
  engine. The target is judged on the steady state; the cold ratio is printed too.

TPOT per request = (finished_time - first_token_time) / (output tokens - 1); batch TPOT is
the mean over requests. Each engine runs a warm-up request first. Prints a table and the
ratios (speedup = base TPOT / speculative TPOT).
"""
from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dummy_model import DEFAULT_TOKENIZER, make_dummy_model  # noqa: E402

from kvforge import SamplingParams  # noqa: E402
from kvforge.config import EngineConfig  # noqa: E402
from kvforge.engine.llm_engine import LLMEngine  # noqa: E402


def reinit_normal(model: torch.nn.Module, seed: int) -> None:
    """HF-style fresh-Llama init in place: matrices ~ normal(0, 0.02), 1-D weights (RMSNorm) = 1."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def build(args, model_dir: str, **spec) -> LLMEngine:
    opts = {"model": model_dir, "tokenizer": args.tokenizer, "dtype": args.dtype, "load_format": "dummy",
            "device": args.device, "max_model_len": args.max_model_len, "max_num_seqs": max(args.batch, 1),
            "seed": 0, "kv_cache_memory_bytes": int(args.kv_gib * (1 << 30)), **spec}
    eng = LLMEngine(EngineConfig.from_sources(None, opts))
    if args.init == "normal":
        reinit_normal(eng.parts.model, 0)
        for d in (eng.spec.drafters.values() if eng.spec is not None else ()):
            stack = getattr(d, "stack", None)
            if stack is not None and any(p.data_ptr() not in {q.data_ptr() for q in eng.parts.model.parameters()}
                                         for p in stack.model.parameters()):
                reinit_normal(stack.model, 0)  # an unshared draft: same seed, same values by name order
    return eng


def run(eng: LLMEngine, prompts: list[list[int]], gen_len: int) -> dict:
    """Generate ``gen_len`` tokens for each prompt at once; returns TPOT and speculation stats."""
    sp = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, detokenize=False)
    tag = f"r{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, sp)
    before = eng.stats()
    outs = {}
    k_steps: dict[int, int] = {}  # engine steps by the largest k' the adaptive rule chose
    if eng.spec is not None:
        plan = eng.spec.plan

        def counting_plan(*a, **kw):
            groups = plan(*a, **kw)
            k = max(eng.spec.last_k.values(), default=0)
            k_steps[k] = k_steps.get(k, 0) + 1
            return groups
        eng.spec.plan = counting_plan
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.monotonic()
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    wall = time.monotonic() - t0
    if eng.spec is not None:
        del eng.spec.plan  # back to the class's method
    after = eng.stats()
    tpots = []
    for o in outs.values():
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if n > 1 and "first_token_time" in m:
            tpots.append((m["finished_time"] - m["first_token_time"]) / (n - 1))
    drafts = after.get("spec_num_drafts", 0) - before.get("spec_num_drafts", 0)
    drafted = after.get("spec_num_draft_tokens", 0) - before.get("spec_num_draft_tokens", 0)
    accepted = after.get("spec_num_accepted_tokens", 0) - before.get("spec_num_accepted_tokens", 0)
    return {"tpot": sum(tpots) / len(tpots), "wall": wall, "tokens": sum(len(o.outputs[0].token_ids)
                                                                            for o in outs.values()),
            "acceptance": accepted / drafted if drafted else float("nan"),
            "mean_len": 1 + accepted / drafts if drafts else 1.0, "k": after.get("spec_k", 0),
            "k_steps": dict(sorted(k_steps.items()))}


def continuations(eng: LLMEngine, prompts: list[list[int]], gen_len: int) -> list[list[int]]:
    """Greedy continuations (``gen_len`` tokens) of ``prompts`` by ``eng``."""
    sp = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        eng.add_request(f"cont-{i}", {"prompt_token_ids": p}, sp)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return [outs[f"cont-{i}"] for i in range(len(prompts))]


def set_adaptive(eng: LLMEngine, on: bool) -> None:
    """Switch the adaptive rule of every drafter of ``eng`` on or off (k fixed when off)."""
    if eng.spec is not None:
        for rule in eng.spec.adaptive.values():
            rule.adaptive = on


def measure(eng: LLMEngine, name: str, workloads: dict[str, list[list[int]]], gen_len: int) -> dict:
    res = {w: run(eng, prompts, gen_len) for w, prompts in workloads.items()}
    for w, r in res.items():
        print(f"{name:>8} {w:>10}: TPOT {1e3 * r['tpot']:8.3f} ms  tok/s {r['tokens'] / r['wall']:9.1f}  "
              f"acceptance {r['acceptance']:.3f}  tokens/verify {r['mean_len']:.2f}  last k {r['k']:.0f}"
              + (f"  steps by k' {r['k_steps']}" if r["k_steps"] else ""),
              flush=True)
    meter = eng.spec.meter if eng.spec is not None else None
    if meter is not None and meter.times:  # the adaptive rule's measured step times, ms by (bucket, k')
        print(f"{'':>8} step times (ms) by (batch bucket, k'): "
              + ", ".join(f"{b},{k}: {1e3 * t:.2f}" for (b, k), t in sorted(meter.times.items())), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="tiny model shape (CPU smoke run)")
    ap.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    ap.add_argument("--init", choices=["dummy", "normal"], default="dummy")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-gib", type=float, default=12.0, help="KV cache budget per engine (GiB)")
    ap.add_argument("--skip", default="", help="comma-separated scenarios to skip: self,draft2,ngram,batch")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    tmp = tempfile.mkdtemp(prefix="kvforge-spec-bench-")
    model_dir = str(make_dummy_model(tmp, tiny=args.tiny, dtype=args.dtype))
    vocab = 1024 if args.tiny else 128256
    rng = random.Random(0)
    rand = [3 + rng.randrange(vocab - 3) for _ in range(args.prompt_len)]
    b = args.batch
    batch_rand = [[3 + rng.randrange(vocab - 3) for _ in range(args.prompt_len)] for _ in range(b)]
    k = args.k
    print(f"target {'tiny' if args.tiny else 'Llama-3-8B'}-shaped, {args.dtype}, init {args.init}, "
          f"device {args.device}, k={k}, prompt {args.prompt_len}, generate {args.gen_len}, batch {b}", flush=True)

    # Copy-heavy prompts: seed + the target's own greedy continuation C of it + seed again,
    # so the output repeats a span of the prompt (C) as in quoting or editing workloads.
    base_eng = build(args, model_dir)
    seed_len = max(1, (args.prompt_len - args.gen_len) // 2)
    seeds = [p[:seed_len] for p in [rand] + batch_rand[:b if b > 1 else 0]]
    conts = continuations(base_eng, seeds, args.gen_len)
    copies = [s_ + c + s_ for s_, c in zip(seeds, conts)]
    copy, batch_copy = copies[0], copies[1:]
    batch_cold = [[3 + rng.randrange(vocab - 3) for _ in range(args.prompt_len)] for _ in range(b)]
    batch_wl = ({f"cold x{b}": batch_cold, f"random x{b}": batch_rand, f"copy x{b}": batch_copy}
                if "batch" not in skip and b > 1 else {})
    scenarios = [("base", {}, {"random": [rand], "copy": [copy]}),
                 ("self", {"speculative_method": "draft_model"}, {"random": [rand]}),
                 ("draft2", {"speculative_method": "draft_model", "speculative.settings.num_layers": 2},
                  {"random": [rand], "copy": [copy]}),
                 ("ngram", {"speculative_method": "ngram"}, {"copy": [copy]})]
    single: dict[str, dict] = {}
    batched: dict[str, dict] = {}
    for name, spec, wl in scenarios:
        if name in skip:
            continue
        if spec:
            spec = {**spec, "num_speculative_tokens": k}
        eng = base_eng if name == "base" else build(args, model_dir, **spec)
        base_eng = None
        run(eng, [wl[next(iter(wl))][0]], 8)  # warm-up: lazy init, autotuning
        set_adaptive(eng, name != "self")  # self-drafting measures the machinery at a fixed k
        single[name] = measure(eng, name, wl, args.gen_len)
        if batch_wl:
            set_adaptive(eng, True)  # at batch size b the default rule decides
            batched[name] = measure(eng, name, batch_wl, args.gen_len)
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    base = single["base"]
    ratios = []
    if "self" in single:
        r = single["self"]["random"]
        ideal = base["random"]["tpot"] * (k * 1.0 + 1) / r["mean_len"]
        ratios.append(("self-draft k=4: overhead vs ideal", r["tpot"] / ideal - 1, "<= 0.15"))
        ratios.append(("self-draft k=4: speedup", base["random"]["tpot"] / r["tpot"], "(ideal 1.0 at 100%)"))
    if "draft2" in single:
        for w in ("random", "copy"):
            ratios.append((f"2-layer draft: batch-1 speedup ({w})", base[w]["tpot"] / single["draft2"][w]["tpot"],
                           ">= 2"))
    if "ngram" in single:
        ratios.append(("n-gram: batch-1 speedup (copy-heavy)", base["copy"]["tpot"] / single["ngram"]["copy"]["tpot"],
                       ">= 2"))
    for name, res in batched.items():
        if name == "base":
            continue
        for w in res:
            cold = w.startswith("cold")
            ratios.append((f"batch {b} {name} ({w.split()[0]}): TPOT spec/base",
                           res[w]["tpot"] / batched["base"][w]["tpot"],
                           "(an engine's first batch at this size)" if cold else "<= 1.05"))
    print("\nsummary")
    for label, value, target in ratios:
        print(f"  {label:<48} {value:7.3f}   target {target}")


if __name__ == "__main__":
    main()
