"""``benchmarks/step_timeline.py`` on the CPU: every step of a run is recorded with its shape,
the kinds partition the steps, and the tokens add up to the workload's."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from helpers import STORIES_MODEL
from kvforge.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("step_timeline", ROOT / "benchmarks" / "step_timeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_timeline_records_every_step_and_token(capsys):
    tl = _module()
    engine = LLMEngine.from_kwargs(STORIES_MODEL, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                                   num_gpu_blocks=64)
    prompts, input_len, output_len = 6, 40, 5
    steps = tl.run(engine, prompts, input_len, output_len)
    shaped = [s for s, _ in steps if s]
    # every prompt token is prefilled once; every output token after the first is one decode
    assert sum(s["num_prefill_tokens"] for s in shaped) == prompts * input_len
    assert sum(s["num_decode_seqs"] for s in shaped) == prompts * (output_len - 1)
    assert all(s["num_seqs"] <= 4 and s["num_batched_tokens"] <= 64 for s in shaped)
    assert all(t > 0 for _, t in steps)
    kinds = [tl.kind(s) for s, _ in steps]
    assert {"prefill only", "mixed", "decode only"} <= set(kinds)
    assert kinds.count("prefill only") == 1  # only the first step (64 prompt tokens) has no decode
    # with async scheduling the last call only collects tokens: its own bucket, not a prefill
    engine = LLMEngine.from_kwargs(STORIES_MODEL, dtype="float32", max_num_seqs=4, max_num_batched_tokens=64,
                                   num_gpu_blocks=64, async_scheduling=True)
    tail = tl.run(engine, 2, 8, 3)
    assert tl.kind(tail[-1][0]) == "no schedule (async tail)"
    assert [tl.kind(s) for s, _ in tail[:-1]].count("prefill only") == 1
    tl.summarize(steps, sum(t for _, t in steps))
    out = capsys.readouterr().out
    assert f"{len(steps)} steps" in out and "decode only" in out


def test_bad_flags_are_refused_before_the_run(monkeypatch, capsys, tmp_path):
    import pytest
    tl = _module()
    for argv, msg in ((["--num-prompts", "0"], "must be > 0"), (["--output-len", "-2"], "must be > 0"),
                      (["--json", str(tmp_path)], "--json"),
                      (["--input-len", "600", "--warmup-prompts", "0"], "exceed max_model_len 512")):
        monkeypatch.setattr("sys.argv", ["step_timeline.py", "--model", STORIES_MODEL, *argv])
        with pytest.raises(SystemExit) as e:
            tl.main()
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
