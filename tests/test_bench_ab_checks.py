"""`kvforge bench ab` refuses a bad run before any arm runs or anything is written: a sim run
without a cost model, and arms whose scheduler, model-side plugins or KV budget the engine would
refuse (CPU, stories260K)."""
from __future__ import annotations

from helpers import STORIES_MODEL

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
