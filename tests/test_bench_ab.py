"""`kvforge bench ab`: traces, the deterministic simulator over the real scheduler plugins, the real
engine replay, calibration and the CLI (CPU, stories260K)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from helpers import STORIES_MODEL
from kvforge.bench.common import model_facts, parse_scheduler_spec, scheduler_config
from kvforge.bench.cost_model import FEATURES, CostModel, StepShape, fit_linear
from kvforge.bench.metrics import summarize
from kvforge.bench.report import results_document
from kvforge.bench.sim import simulate
from kvforge.bench.trace import Trace, TraceRequest, load_trace, save_trace, synthesize_prompts
from kvforge.bench.workload import generate_trace, parse_distribution

REPO = Path(__file__).resolve().parents[1]
SHIPPED_COST_MODEL = REPO / "benchmarks" / "cost_models" / "cpu-stories260K.json"
COST = CostModel({"const": 0.005, "num_batched_tokens": 1e-4, "num_seqs": 1e-3, "sum_context_tokens": 1e-6})
SPEC = ("poisson:rate=4,n=200,prompt=uniform(32,256),output=uniform(16,128),prefix_groups=4,prefix_len=64,"
        "priority=uniform(0,3),seed=0")


@pytest.fixture(scope="module")
def registry():
    from kvforge.plugin_manager import load_registry
    return load_registry()


@pytest.fixture(scope="module")
def facts():
    return model_facts(STORIES_MODEL)


def sim(trace: Trace, spec: str, registry, facts, cost=COST, **flags):
    """Simulate one arm; checks that every KV block came back."""
    s = parse_scheduler_spec(spec)
    cfg = scheduler_config({"model": STORIES_MODEL, **flags}, s)
    prompts = synthesize_prompts(trace, facts.vocab_size, facts.special_ids)
    r = simulate(trace, prompts, cfg, registry, cost, facts, label=s.label, spec=spec)
    assert r.extra["leaked_blocks"] == 0, f"{spec}: KV blocks leaked"
    assert all(rec.ok for rec in r.records), [rec.error for rec in r.records if rec.error][:3]
    assert [len(rec.token_times) for rec in r.records] == [q.output_len for q in trace.requests]
    return r


# -- traces ---------------------------------------------------------------------------------
def test_trace_is_deterministic_and_round_trips(tmp_path, facts):
    a, b = generate_trace(SPEC), generate_trace(SPEC)
    assert a == b and len(a.requests) == 200
    assert generate_trace(SPEC.replace("seed=0", "seed=1")) != a
    arrivals = [r.arrival_time for r in a.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert 30 < arrivals[-1] < 70  # 200 requests at 4 req/s
    for r in a.requests:
        assert r.prefix_group in range(4) and r.prefix_len == 64 and 96 <= r.prompt_len <= 320
        assert 16 <= r.output_len <= 128 and 0 <= r.priority <= 3
    for name in ("t.json", "t.jsonl"):
        save_trace(a, tmp_path / name)
        assert load_trace(tmp_path / name) == a
    p1 = synthesize_prompts(a, facts.vocab_size, facts.special_ids)
    assert p1 == synthesize_prompts(load_trace(tmp_path / "t.jsonl"), facts.vocab_size, facts.special_ids)
    assert [len(p) for p in p1] == [r.prompt_len for r in a.requests]
    assert all(3 <= t < facts.vocab_size and t not in facts.special_ids for p in p1 for t in p)
    by_group: dict[int, list[list[int]]] = {}
    for r, p in zip(a.requests, p1):
        by_group.setdefault(r.prefix_group, []).append(p)
    heads = {g: ps[0][:64] for g, ps in by_group.items()}
    assert all(p[:64] == heads[g] for g, ps in by_group.items() for p in ps)
    assert len({tuple(h) for h in heads.values()}) == 4
    assert len({tuple(p[64:]) for p in p1}) == 200  # own parts differ


def test_workload_language_and_errors(tmp_path):
    rng = np.random.default_rng(0)
    x = parse_distribution("choice(uniform(8,24):9,uniform(400,480):1)")(rng, 2000)
    assert ((x >= 8) & (x <= 24) | (x >= 400) & (x <= 480)).all()
    assert 0.05 < (x >= 400).mean() < 0.15
    assert (parse_distribution("7")(rng, 3) == 7).all()
    burst = generate_trace("burst:n=5,prompt=10,output=3")
    assert [r.arrival_time for r in burst.requests] == [0.0] * 5
    const = generate_trace("constant:rate=2,n=3,prompt=4,output=2")
    assert [r.arrival_time for r in const.requests] == [0.0, 0.5, 1.0]
    for bad in ("poison:rate=1", "poisson:rat=1", "poisson:prompt=unifrm(1,2)", "poisson:prompt=uniform(5,1)",
                "poisson:n=0", "poisson:prompt=uniform(1,2", "poisson:rate=-1"):
        with pytest.raises(ValueError):
            generate_trace(bad)
    (tmp_path / "bad.jsonl").write_text('{"arrival_time": 0, "prompt_len": 4, "output_len": 0}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_trace(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="prefix_len"):
        TraceRequest(arrival_time=0, prompt_len=4, output_len=1, prefix_group=0, prefix_len=5)


def test_scheduler_spec_rule():
    s = parse_scheduler_spec("priority:enable_prefix_caching=true,max_num_batched_tokens=256,"
                             "preemption_mode=swap,cache.swap_space_bytes=1000000,label=p")
    assert s.name == "priority" and s.label == "p"
    assert s.overrides == {"enable_prefix_caching": True, "max_num_batched_tokens": 256,
                           "scheduler.settings.preemption_mode": "swap", "cache.swap_space_bytes": 1000000}
    cfg = scheduler_config({"model": STORIES_MODEL, "max_num_seqs": 7}, s)
    assert cfg.scheduler.name == "priority" and cfg.scheduler.max_num_seqs == 7
    assert cfg.cache.enable_prefix_caching and cfg.scheduler.settings == {"preemption_mode": "swap"}
    with pytest.raises(ValueError):
        parse_scheduler_spec("fcfs:model.model=/x")
    with pytest.raises(ValueError):
        parse_scheduler_spec("fcfs:oops")


# -- simulator ------------------------------------------------------------------------------
def test_sim_is_exactly_repeatable_and_fast(registry, facts):
    import time
    trace = generate_trace(SPEC)
    t = time.perf_counter()
    a = sim(trace, "chunked_prefill:enable_prefix_caching=true", registry, facts, max_num_seqs=16)
    elapsed = time.perf_counter() - t
    b = sim(trace, "chunked_prefill:enable_prefix_caching=true", registry, facts, max_num_seqs=16)
    da, db = (json.dumps(results_document([r], {"x": 1}), allow_nan=False) for r in (a, b))
    assert da == db
    assert elapsed < 3.0, f"200-request simulation took {elapsed:.2f} s"
    s = summarize(a)
    assert s["num_finished"] == 200 and s["output_throughput"] > 0 and math.isfinite(s["ttft_ms"]["p99"])


def test_sim_needs_only_the_model_config(tmp_path, registry):
    """No weights are read and no KV tensors are made: a directory with config.json is enough."""
    import shutil

    import torch
    shutil.copy(Path(STORIES_MODEL) / "config.json", tmp_path / "config.json")
    facts = model_facts(str(tmp_path))
    trace = generate_trace("poisson:rate=20,n=30,prompt=uniform(8,64),output=uniform(2,16),seed=1")
    prompts = synthesize_prompts(trace, facts.vocab_size, facts.special_ids)
    cfg = scheduler_config({"model": str(tmp_path)}, parse_scheduler_spec("chunked_prefill"))
    made = []
    orig_zeros = torch.zeros
    torch.zeros = lambda *a, **k: made.append(a) or orig_zeros(*a, **k)
    try:
        r = simulate(trace, prompts, cfg, registry, COST, facts)
    finally:
        torch.zeros = orig_zeros
    assert not made and r.extra["leaked_blocks"] == 0 and all(rec.ok for rec in r.records)
    assert r.config["num_blocks"] == 8193  # sized like the engine's CPU default (1 GiB budget, capped)


def test_sjf_beats_fcfs_median_ttft_on_few_long_many_short(registry, facts):
    trace = generate_trace("poisson:rate=40,n=100,prompt=choice(uniform(8,24):9,uniform(300,400):1),"
                           "output=uniform(8,16),seed=0")
    flags = {"max_num_seqs": 4, "max_num_batched_tokens": 512}
    fcfs = summarize(sim(trace, "fcfs", registry, facts, **flags))
    sjf = summarize(sim(trace, "sjf", registry, facts, **flags))
    assert sjf["ttft_ms"]["p50"] < 0.5 * fcfs["ttft_ms"]["p50"], (sjf["ttft_ms"], fcfs["ttft_ms"])


def test_priority_serves_important_requests_first(registry, facts):
    trace = generate_trace("poisson:rate=30,n=120,prompt=uniform(16,200),output=uniform(16,64),"
                           "priority=uniform(0,3),seed=0")
    r = sim(trace, "priority", registry, facts, max_num_seqs=8)
    by = summarize(r)["mean_ttft_ms_by_priority"]
    assert by["0"] < by["1"] < by["3"] and by["0"] < 0.25 * by["3"], by
    fcfs = summarize(sim(trace, "fcfs", registry, facts, max_num_seqs=8))["mean_ttft_ms_by_priority"]
    assert fcfs["0"] > 2 * by["0"], (fcfs, by)


def test_prefix_hit_rate_needs_caching_and_shared_groups(registry, facts):
    trace = generate_trace("poisson:rate=10,n=40,prompt=uniform(8,40),output=uniform(4,12),prefix_groups=2,"
                           "prefix_len=96,seed=2")
    on = summarize(sim(trace, "chunked_prefill:enable_prefix_caching=true", registry, facts))
    off = summarize(sim(trace, "chunked_prefill:enable_prefix_caching=false", registry, facts))
    assert on["prefix_cache_hit_rate"] > 0.3 and off["prefix_cache_hit_rate"] == 0.0
    assert on["busy_time_s"] < off["busy_time_s"]  # cached prefixes are not recomputed
    none = generate_trace("poisson:rate=10,n=40,prompt=uniform(40,120),output=4,seed=2")
    assert summarize(sim(none, "chunked_prefill:enable_prefix_caching=true", registry,
                         facts))["prefix_cache_hit_rate"] == 0.0


def test_sim_runs_the_registered_scheduler_plugins(registry, facts, monkeypatch):
    from kvforge_plugins.schedulers.sjf import SJFScheduler
    calls = {"waiting_order": 0, "schedule": 0}
    orig_order, orig_schedule = SJFScheduler.waiting_order, SJFScheduler.schedule

    def waiting_order(self):
        calls["waiting_order"] += 1
        return orig_order(self)

    def schedule(self):
        calls["schedule"] += 1
        return orig_schedule(self)

    monkeypatch.setattr(SJFScheduler, "waiting_order", waiting_order)
    monkeypatch.setattr(SJFScheduler, "schedule", schedule)
    trace = generate_trace("poisson:rate=20,n=20,prompt=uniform(8,64),output=uniform(2,8),seed=4")
    r = sim(trace, "sjf", registry, facts)
    assert calls["schedule"] == r.num_steps and calls["waiting_order"] > 0
    # a third-party scheduler registered in-process is found by name, like the engine does
    import importlib.util
    from kvforge.plugin_manager import load_registry
    path = REPO / "tests" / "fixtures" / "kvforge_example_sched" / "kvforge_example_sched" / "__init__.py"
    spec = importlib.util.spec_from_file_location("kvforge_example_sched_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        reg = load_registry(extra_plugins=[("example_sched_ab", mod)])
    except Exception:  # already installed as an entry point: the name is registered twice
        reg = registry
    assert sim(trace, "lifo_example", reg, facts).num_steps > 0
    with pytest.raises(ValueError, match="unknown scheduler"):
        sim(trace, "no_such_scheduler", registry, facts)
    with pytest.raises(ValueError, match="scheduler.settings"):
        sim(trace, "sjf:bogus=1", registry, facts)


def test_sim_refuses_what_the_engine_refuses(facts):
    """The simulator applies the engine's capability rules: a scheduler that requires prefix
    caching is refused without it, naming the plugin, as `kvforge generate` refuses it."""
    from helpers import registry_with_schedulers
    from kvforge_plugins.schedulers.chunked_prefill import ChunkedPrefillScheduler
    reg = registry_with_schedulers(("needs_cache", ChunkedPrefillScheduler, {"requires_prefix_caching": True}))
    trace = generate_trace("poisson:rate=20,n=5,prompt=uniform(8,32),output=4,seed=1")
    with pytest.raises(ValueError, match=r"scheduler 'needs_cache'.*requires prefix caching"):
        sim(trace, "needs_cache", reg, facts)
    assert sim(trace, "needs_cache:enable_prefix_caching=true", reg, facts).num_steps > 0


def test_sim_refuses_a_step_over_the_token_budget(facts):
    """A scheduler that never cuts a prompt to the budget is stopped at its first such step,
    named, instead of being credited with the latencies of the bigger steps it ran."""
    from helpers import registry_with_schedulers
    from kvforge.engine.schedule_check import SchedulerContractError
    from kvforge_plugins.schedulers.chunked_prefill import ChunkedPrefillScheduler

    class Uncut(ChunkedPrefillScheduler):
        def _chunk(self, remaining, budget):
            return remaining

    reg = registry_with_schedulers(("uncut", Uncut, {}))
    trace = generate_trace("poisson:rate=50,n=6,prompt=uniform(40,60),output=4,seed=2")
    with pytest.raises(SchedulerContractError, match=r"scheduler 'uncut' \(plugin test_schedulers_plugin.*"
                                                      r"scheduled \d+ tokens in one step, more than "
                                                      r"scheduler.max_num_batched_tokens \(32\)"):
        sim(trace, "uncut", reg, facts, max_num_batched_tokens=32)
    assert sim(trace, "chunked_prefill", reg, facts, max_num_batched_tokens=32).num_steps > 0


def test_sim_preemption_recompute_and_swap_free_every_block(registry, facts):
    trace = generate_trace("burst:n=24,prompt=uniform(40,90),output=uniform(40,80),seed=5")
    rec = summarize(sim(trace, "fcfs", registry, facts, num_gpu_blocks=40, max_num_seqs=16))
    assert rec["num_preemptions"] > 0 and rec["num_recomputed_tokens"] > 0
    swap = sim(trace, "chunked_prefill:preemption_mode=swap", registry, facts, num_gpu_blocks=40, max_num_seqs=16,
               swap_space_bytes=4 << 20)
    s = summarize(swap)
    assert s["num_preemptions"] > 0 and s["num_recomputed_tokens"] < rec["num_recomputed_tokens"]
    too_long = Trace(requests=[TraceRequest(arrival_time=0, prompt_len=500, output_len=100)])
    with pytest.raises(ValueError, match="max_model_len"):
        sim(too_long, "fcfs", registry, facts)


def test_cost_model_fit_and_file(tmp_path):
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(200), rng.integers(1, 4000, 200), rng.integers(1, 64, 200),
                         rng.integers(1, 20000, 200), rng.integers(1, 10 ** 6, 200),
                         rng.integers(1, 2000, 200)]).astype(float)
    true = np.array([3e-3, 2e-5, 4e-4, 1e-7, 0.0, 2e-6])
    coef, fit = fit_linear(x, x @ true, FEATURES)
    assert np.allclose([coef[f] for f in FEATURES], true, rtol=1e-6, atol=1e-12) and fit["max_abs_rel_err"] < 1e-9
    coef, _ = fit_linear(x[:, :3], x[:, :3] @ [1e-3, 1e-5, 0] - 1e-9 * x[:, 2], FEATURES[:3])
    assert coef["num_seqs"] == 0.0  # a negative coefficient is dropped, never used
    m = CostModel(dict(zip(FEATURES, true)), 1e-4, 1e-6, {"device": "test"})
    m.save(tmp_path / "m.json")
    m2 = CostModel.load(tmp_path / "m.json")
    shape = StepShape(num_batched_tokens=10, num_seqs=2, sum_context_tokens=100, attn_pairs=50, swap_blocks=3,
                      max_context_tokens=70)
    assert m2.step_time(shape) == m.step_time(shape) > 0
    longer = StepShape(num_batched_tokens=10, num_seqs=2, sum_context_tokens=100, attn_pairs=50, swap_blocks=3,
                       max_context_tokens=90)
    assert m.step_time(longer) - m.step_time(shape) == pytest.approx(20 * 2e-6)  # the imbalance term
    old_file = {**m.to_dict(), "coef": {f: v for f, v in m.to_dict()["coef"].items() if f != "max_context_tokens"}}
    assert CostModel.from_dict(old_file).step_time(longer) == pytest.approx(m.step_time(longer) - 90 * 2e-6)
    assert m2.step_time(StepShape(swap_blocks=2)) == pytest.approx(1e-4 + 2e-6)
    with pytest.raises(ValueError):
        CostModel({"const": -1.0})
    if SHIPPED_COST_MODEL.exists():  # the example calibrated on a CPU
        shipped = CostModel.load(SHIPPED_COST_MODEL)
        assert {"device", "torch", "date", "fit"} <= set(shipped.meta)


# -- CLI and real engine --------------------------------------------------------------------
def _cli(tmp_path: Path, out: str, *extra: str) -> dict:
    from kvforge.entrypoints.cli import main
    argv = ["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--scheduler",
            "sjf:enable_prefix_caching=true,label=sjf+cache", "--output-dir", str(tmp_path / out), "--no-progress",
            *extra]
    assert main(argv) == 0
    return json.loads((tmp_path / out / "ab_results.json").read_text())


def test_cli_sim_end_to_end(tmp_path, capsys):
    cm = SHIPPED_COST_MODEL if SHIPPED_COST_MODEL.exists() else tmp_path / "cm.json"
    if not SHIPPED_COST_MODEL.exists():
        COST.save(cm)
    wl = "poisson:rate=8,n=60,prompt=uniform(16,128),output=uniform(8,32),prefix_groups=3,prefix_len=48,seed=7"
    doc = _cli(tmp_path, "a", "--mode", "sim", "--cost-model", str(cm), "--workload", wl, "--max-num-seqs", "8",
               "--save-trace", str(tmp_path / "saved.jsonl"))
    out = capsys.readouterr().out
    for row in ("TTFT p50 (ms)", "TPOT p99 (ms)", "ITL p90 (ms)", "E2E p99 (ms)", "req/s", "out tok/s",
                "preemptions", "recomputed tokens", "prefix hit rate"):
        assert row in out
    assert "fcfs" in out and "sjf+cache" in out
    d = tmp_path / "a"
    assert (d / "ab_plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (d / "ab_table.txt").read_text().count("\n") > 15
    assert [s["label"] for s in doc["schedulers"]] == ["fcfs", "sjf+cache"]
    assert doc["schedulers"][1]["summary"]["prefix_cache_hit_rate"] > 0
    assert doc["schedulers"][0]["summary"]["prefix_cache_hit_rate"] == 0
    assert all(s["leaked_blocks"] == 0 for s in doc["schedulers"])
    assert len(doc["schedulers"][0]["requests"]) == 60
    # same inputs -> byte-identical JSON, also when the trace comes back from the saved file
    _cli(tmp_path, "b", "--mode", "sim", "--cost-model", str(cm), "--trace", str(tmp_path / "saved.jsonl"),
         "--max-num-seqs", "8")
    a = json.loads((d / "ab_results.json").read_text())
    b = json.loads((tmp_path / "b" / "ab_results.json").read_text())
    assert a["schedulers"] == b["schedulers"]
    _cli(tmp_path, "c", "--mode", "sim", "--cost-model", str(cm), "--workload", wl, "--max-num-seqs", "8")
    assert (tmp_path / "c" / "ab_results.json").read_bytes() == (d / "ab_results.json").read_bytes()


def test_real_mode_on_stories260k(tmp_path):
    """Real engine replay (and the simulator beside it, mode both) of a tiny trace."""
    COST.save(tmp_path / "cm.json")
    # (with priorities: fcfs and sjf ignore them, and the replay sends them 0, which the engine accepts)
    wl = ("poisson:rate=40,n=6,prompt=uniform(8,40),output=uniform(3,6),prefix_groups=1,prefix_len=32,"
          "priority=uniform(1,3),seed=3")
    doc = _cli(tmp_path, "r", "--mode", "both", "--cost-model", str(tmp_path / "cm.json"), "--workload", wl,
               "--no-plot", "--enable-prefix-caching", "true")
    labels = [s["label"] for s in doc["schedulers"]]
    assert labels == ["fcfs (real)", "fcfs (sim)", "sjf+cache (real)", "sjf+cache (sim)"]
    for s in doc["schedulers"]:
        summ = s["summary"]
        assert summ["num_finished"] == 6 and summ["num_errors"] == 0 and s["leaked_blocks"] == 0
        assert math.isfinite(summ["ttft_ms"]["p50"]) and summ["ttft_ms"]["p50"] > 0
        assert summ["total_output_tokens"] == sum(r["output_len"] for r in s["requests"])
        assert summ["prefix_cache_hit_rate"] > 0  # one group shares a 32-token prefix (2 blocks)
    real, simd = doc["schedulers"][0], doc["schedulers"][1]
    assert real["summary"]["prefix_cache_hit_rate"] == simd["summary"]["prefix_cache_hit_rate"]
    assert set(doc["sim_accuracy"]) == {"fcfs", "sjf+cache"}
    assert doc["environment"]["torch"]


def test_calibrate_writes_a_cost_model(tmp_path):
    from kvforge.entrypoints.cli import main
    out = tmp_path / "cm.json"
    assert main(["bench", "calibrate", "--model", STORIES_MODEL, "--output", str(out), "--batch-sizes", "1,4",
                 "--prompt-lens", "8,32", "--decode-steps", "3", "--repeats", "1", "--swap-blocks", "1,8",
                 "--no-progress", "--num-gpu-blocks", "64"]) == 0
    m = CostModel.load(out)
    assert m.meta["device"] and m.meta["torch"] and m.meta["date"] and m.meta["engine"]["num_gpu_blocks"] == 64
    assert m.meta["fit"]["num_samples"] >= 10 and len(m.meta["fit"]["residuals_s"]) == m.meta["fit"]["num_samples"]
    assert m.step_time(StepShape(num_batched_tokens=4, num_seqs=4, sum_context_tokens=40, attn_pairs=40)) > 0
    assert any(pt[3] for pt in m.meta["sweep"]["points"]), "no unequal-length batch in the sweep"
    cols = m.meta["samples"]["columns"]
    seqs, total, longest = (cols.index(c) for c in ("num_seqs", "sum_context_tokens", "max_context_tokens"))
    assert any(r[longest] * r[seqs] > r[total] * 1.5 for r in m.meta["samples"]["rows"]), \
        "no sampled step where the longest context stands apart from the mean"
