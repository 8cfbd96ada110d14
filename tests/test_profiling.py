"""``LLM.start_profile`` / ``stop_profile``: one Chrome trace per engine process, with the
step loop's ``kvforge.*`` phase ranges (CPU: the driver and two gloo workers)."""
from __future__ import annotations

import json
import os

import pytest

from helpers import STORIES_MODEL, STORY_OPENINGS
from kvforge import LLM, SamplingParams

sys_path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _phases(path: str) -> set[str]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return {e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("kvforge.")}


def test_profile_tp2_writes_a_trace_per_process_with_the_step_phases(tmp_path):
    llm = LLM(STORIES_MODEL, tensor_parallel_size=2, dtype="float32", num_gpu_blocks=64, async_scheduling=True)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ref = llm.generate(STORY_OPENINGS[:3], sp, use_tqdm=False)
    llm.start_profile(str(tmp_path))
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile(str(tmp_path))
    outs = llm.generate(STORY_OPENINGS[:3], sp, use_tqdm=False)
    paths = llm.stop_profile()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]  # profiling changes nothing
    assert sorted(os.path.basename(p) for p in paths) == ["driver.json", "rank0.json", "rank1.json"]
    assert {"kvforge.schedule", "kvforge.launch", "kvforge.complete", "kvforge.recv_step"} <= _phases(paths[0])
    for rank_trace in paths[1:]:
        assert {"kvforge.build_inputs", "kvforge.wait_tokens", "kvforge.forward"} <= _phases(rank_trace)
    assert llm.stop_profile() == []  # stopped: nothing more to write
    import sys
    sys.path.insert(0, sys_path)
    from trace_summary import summarise
    text = summarise(paths[1], top=3)
    assert "kvforge.forward" in text and "traced span" in text


def test_profile_bad_directory_is_refused_and_tp_engine_keeps_serving(tmp_path, monkeypatch):
    """A directory that cannot be created is refused on the driver (ValueError) before any
    worker is asked; a relative one is made absolute, so the workers (another working
    directory) write beside the driver."""
    llm = LLM(STORIES_MODEL, tensor_parallel_size=2, dtype="float32", num_gpu_blocks=64)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = llm.generate(STORY_OPENINGS[:2], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="cannot create"):
        llm.start_profile("/proc/kvforge_cannot_be_here")
    assert llm.llm_engine.executor.dead is None
    monkeypatch.chdir(tmp_path)
    llm.start_profile("rel")
    outs = llm.generate(STORY_OPENINGS[:2], sp, use_tqdm=False)
    paths = llm.stop_profile()
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert all(os.path.isabs(p) and os.path.dirname(p) == str(tmp_path / "rel") for p in paths), paths
    assert sorted(os.listdir(tmp_path / "rel")) == ["driver.json", "rank0.json", "rank1.json"]


def test_profile_data_parallel_writes_a_directory_per_replica(tmp_path):
    llm = LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=64, data_parallel_size=2)
    try:
        llm.start_profile(str(tmp_path))
        outs = llm.generate(STORY_OPENINGS[:4], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        paths = llm.stop_profile()
        assert all(o.error is None for o in outs)
        assert sorted(os.path.relpath(p, tmp_path) for p in paths) == [os.path.join("replica0", "driver.json"),
                                                                          os.path.join("replica1", "driver.json")]
        assert all(os.path.getsize(p) > 0 for p in paths)
        assert llm.stop_profile() == []
    finally:
        llm.llm_engine.shutdown()


def test_profile_needs_a_directory(monkeypatch):
    monkeypatch.delenv("KVFORGE_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=32)
    with pytest.raises(ValueError, match="KVFORGE_TORCH_PROFILER_DIR"):
        llm.start_profile()


def test_profile_single_process_env_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_TORCH_PROFILER_DIR", str(tmp_path / "p"))
    llm = LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=32)
    llm.start_profile()
    llm.generate(STORY_OPENINGS[0], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert llm.stop_profile() == [str(tmp_path / "p" / "driver.json")]
    # the synchronous loop (the CPU default) marks its phases too
    assert {"kvforge.schedule", "kvforge.execute", "kvforge.sample"} <= _phases(str(tmp_path / "p" / "driver.json"))
    (tmp_path / "p" / "other.json").write_text('{"not": "a trace"}')
    import sys
    sys.path.insert(0, sys_path)
    from trace_summary import main
    assert main([str(tmp_path / "p")]) == 0 and main([str(tmp_path / "p" / "driver.json")]) == 0
