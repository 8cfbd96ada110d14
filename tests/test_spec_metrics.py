"""Engine metrics read from its stats on the Prometheus endpoint: the speculative-decoding
series (issue 7) follow the engine's own counters, and an engine that does not speculate
exports none; the preemption counter follows the scheduler's."""
from __future__ import annotations

import re

from helpers import STORIES_MODEL
from kvforge import LLM, SamplingParams
from kvforge.engine.metrics import EngineMetrics


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(kvforge:spec_decode_\w+)(\{[^}]*\})? ([0-9.eE+-]+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            key = m.group(1) + (f"[{labels['position']}]" if "position" in labels else "")
            out[key] = float(m.group(3))
    return out


def test_spec_decode_series_follow_engine_stats():
    llm = LLM(STORIES_MODEL, dtype="float32", speculative_method="ngram", num_speculative_tokens=3)
    prompt = "Once upon a time there was a cat. The cat was big. Once upon a time there was a cat. The cat"
    llm.generate([prompt] * 2, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    stats = llm.llm_engine.stats()
    assert stats["spec_num_draft_tokens"] > 0, "the n-gram drafter never proposed (test prompt too short?)"
    got = _series(EngineMetrics("stories", llm.llm_engine.stats).render().decode())
    assert got["kvforge:spec_decode_num_drafts_total"] == stats["spec_num_drafts"]
    assert got["kvforge:spec_decode_num_draft_tokens_total"] == stats["spec_num_draft_tokens"]
    assert got["kvforge:spec_decode_num_accepted_tokens_total"] == stats["spec_num_accepted_tokens"]
    assert got["kvforge:spec_decode_acceptance_rate"] == stats["spec_acceptance_rate"]
    assert 0.0 <= got["kvforge:spec_decode_acceptance_rate"] <= 1.0
    assert got["kvforge:spec_decode_mean_accepted_length"] == stats["spec_mean_accepted_length"] >= 1.0
    assert got["kvforge:spec_decode_acceptance_rate_per_pos[0]"] == stats["spec_acceptance_rate_pos_0"]


def test_no_spec_decode_series_without_speculation():
    llm = LLM(STORIES_MODEL, dtype="float32")
    llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    text = EngineMetrics("stories", llm.llm_engine.stats).render().decode()
    assert "kvforge:num_requests_running" in text and "spec_decode" not in text


def test_preemption_counter_follows_the_scheduler():
    """``kvforge:num_preemptions_total`` is the scheduler's own count (vLLM's
    ``vllm:num_preemptions``): a small cache with many long requests preempts."""
    llm = LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=8, block_size=16, max_num_seqs=6)
    llm.generate([{"prompt_token_ids": [1, 403 + i]} for i in range(6)],
                 SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)
    n = llm.llm_engine.stats()["num_preemptions"]
    assert n > 0
    text = EngineMetrics("stories", llm.llm_engine.stats).render().decode()
    m = re.search(r'^kvforge:num_preemptions_total\{model_name="stories"\} ([0-9.eE+-]+)$', text, re.M)
    assert m and float(m.group(1)) == n
