"""`kvforge bench ab` refuses a bad run before any arm runs or anything is written: a sim run
without a cost model, and arms whose scheduler, model-side plugins or KV budget the engine would
refuse (CPU, stories260K)."""
from __future__ import annotations

from pathlib import Path

from helpers import STORIES_MODEL

REPO = Path(__file__).resolve().parents[1]

WORKLOAD = "poisson:rate=8,n=60,prompt=uniform(16,128),output=uniform(8,32),prefix_groups=3,prefix_len=48,seed=7"


def test_bad_runs_fail_before_any_arm_runs(tmp_path, capsys, monkeypatch):
    from kvforge.entrypoints.cli import main
    assert main(["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--workload", WORKLOAD,
                 "--mode", "sim", "--output-dir", str(tmp_path / "x")]) == 2  # sim needs a cost model
    assert "--cost-model" in capsys.readouterr().err
    # a bad later arm fails before the first arm runs (real mode would build engines)
    assert main(["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--scheduler",
                 "chunked_prefill:preemption_mode=swap", "--workload", WORKLOAD, "--output-dir", str(tmp_path / "y")]) == 2
    assert "swap_space_bytes" in capsys.readouterr().err and not (tmp_path / "y").exists()
    # ... also for the model-side plugins a real arm builds (no CUDA here for flash_decode)
    import kvforge.bench.real

    def no_arm_runs(*a, **k):
        raise AssertionError("an arm ran before every arm was checked")

    monkeypatch.setattr(kvforge.bench.real, "run_real", no_arm_runs)
    assert main(["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--scheduler",
                 "chunked_prefill:attention.backend=flash_decode", "--workload", WORKLOAD, "--mode", "real",
                 "--output-dir", str(tmp_path / "z")]) == 2
    assert "flash_decode" in capsys.readouterr().err and not (tmp_path / "z").exists()
    assert main(["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--scheduler",
                 "chunked_prefill:quantization.method=gptq", "--workload", WORKLOAD, "--mode", "real",
                 "--output-dir", str(tmp_path / "q")]) == 2  # a dense checkpoint is no GPTQ one
    assert "gptq" in capsys.readouterr().err.lower() and not (tmp_path / "q").exists()
    # an arm's explicit KV budget: one holding no block, then one too small for the trace
    for kv, needle in (("cache.kv_cache_memory_bytes=100", "hold no KV block"),
                       ("cache.num_gpu_blocks=2", "fewer than the trace's longest request")):
        assert main(["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--scheduler",
                     f"chunked_prefill:{kv}", "--workload", WORKLOAD, "--mode", "real",
                     "--output-dir", str(tmp_path / "k")]) == 2
        err = capsys.readouterr().err
        assert needle in err and kv.split("=")[0] in err and "arm 'chunked_prefill:" in err, err
        assert not (tmp_path / "k").exists()
    # ... and nothing is written first, --save-trace included
    assert main(["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--num-gpu-blocks", "2",
                 "--workload", WORKLOAD, "--mode", "real", "--save-trace", str(tmp_path / "t.json"),
                 "--output-dir", str(tmp_path / "k")]) == 2
    assert "cache.num_gpu_blocks" in capsys.readouterr().err and not (tmp_path / "t.json").exists()


def test_sim_refuses_a_cache_too_small_for_the_trace_as_real_does(tmp_path, capsys):
    """A simulated cache that cannot hold the longest request used to run and report the requests
    that could never fit as errors; it is refused up front, naming the setting, as in real mode."""
    import random

    from kvforge.entrypoints.cli import main
    cost = str(REPO / "benchmarks" / "cost_models" / "cpu-stories260K.json")
    blocks = random.randint(2, 7)  # 32-112 tokens; the workload's longest request is ~200
    for mode in ("sim", "both"):
        assert main(["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--scheduler",
                     f"sjf:num_gpu_blocks={blocks}", "--cost-model", cost, "--workload", WORKLOAD, "--mode", mode,
                     "--no-plot", "--output-dir", str(tmp_path / mode)]) == 2
        err = capsys.readouterr().err
        assert f"cache.num_gpu_blocks: {blocks} KV blocks of 16 tokens hold {16 * blocks} tokens, fewer than the " \
               "trace's longest request" in err and "arm 'sjf:" in err, err
        assert not (tmp_path / mode).exists()
    # a cache that holds it still runs
    assert main(["bench", "ab", "--model", STORIES_MODEL, "--scheduler", "fcfs:num_gpu_blocks=20", "--cost-model",
                 cost, "--workload", WORKLOAD, "--mode", "sim", "--no-plot", "--output-dir", str(tmp_path / "ok")]) == 0
