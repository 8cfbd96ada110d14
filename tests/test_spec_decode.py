"""Speculative decoding end to end on stories260K (CPU, fp32).

Greedy outputs are token-identical with speculation on and off, for mixed-length
batches and each drafter: stories260K drafting for itself, its 2-layer truncation,
and n-gram lookup; with prefix caching and chunked prefill too, next to requests
that opted out. A stop token, a stop string or max_tokens inside an accepted block
cuts token ids, logprobs and text at the same place. No KV block (target's or
draft's) leaks after rejections, aborts or preemption. Seeded sampling with
speculation is reproducible. The adaptive rule turns speculation off when it would
not pay. An EAGLE-style drafter gets the target's hidden states.

Prompts and lengths are fresh random draws (seed printed, and in assertion messages).
"""
from __future__ import annotations

import types

import pytest
import torch

from helpers import STORIES_MODEL, fresh_rng, make_engine, random_story_prompts, run_engine
from kvforge import SamplingParams, hookimpl
from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.plugin_manager import load_registry

DRAFTERS = {
    "self": {"speculative_method": "draft_model", "num_speculative_tokens": 4},
    "trunc2": {"speculative_method": "draft_model", "num_speculative_tokens": 3,
               "speculative.settings.num_layers": 2},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3,
              "speculative.settings.prompt_lookup_max": 3},
}
MODES = {
    "plain": {},
    "prefix_chunked": {"enable_prefix_caching": True, "max_num_batched_tokens": 24, "block_size": 8},
}



def _spec(name: str, **kw) -> dict:
    return {**DRAFTERS[name], "speculative.adaptive": False, **kw}


def _run(reqs, **kw):
    eng = make_engine(dtype="float32", **kw)
    for rid, prompt, sp in reqs:
        eng.add_request(rid, prompt, sp)
    return run_engine(eng), eng


def _assert_drained(eng) -> None:
    a = eng.allocator
    assert a.num_free_blocks == a.num_blocks, f"{a.num_blocks - a.num_free_blocks} target KV blocks leaked"
    if eng.spec is None:
        return
    for d in eng.spec.drafters.values():
        if getattr(d, "allocator", None) is not None:
            assert d.allocator.num_free_blocks == d.allocator.num_blocks, "draft KV blocks leaked"
            assert not d._seqs, "draft state of finished requests kept"
        assert not getattr(d, "_index", None), "n-gram state of finished requests kept"
    assert not eng.spec._probs and not eng.spec._hidden and not eng.spec._drafted_by


def _mixed_batch(rng) -> list:
    """Mixed lengths: story openings, a copy-heavy prompt (a sentence repeated), random ids,
    two prompts sharing a 2-block prefix; a few requests opt out of speculation."""
    stories = random_story_prompts(rng, 4)
    copy = "Tom had a big red ball. Tom had a big red ball. Tom had a big"
    shared = [1] + [rng.randrange(3, 512) for _ in range(17)]
    prompts = stories + [copy, {"prompt_token_ids": [1] + [rng.randrange(3, 512) for _ in range(rng.randint(3, 40))]},
                         {"prompt_token_ids": shared + [rng.randrange(3, 512)]},
                         {"prompt_token_ids": shared + [rng.randrange(3, 512) for _ in range(3)]}]
    reqs = []
    for i, p in enumerate(prompts):
        extra = {"kvforge": {"drafter": "none"}} if i in (1, 6) else {}
        sp = SamplingParams(temperature=0, max_tokens=rng.randint(12, 48), ignore_eos=rng.random() < 0.5,
                            extra_args=extra)
        reqs.append((f"r{i}", p, sp))
    return reqs


@pytest.fixture(scope="module")
def mixed():
    rng = fresh_rng("spec-mixed")
    reqs = _mixed_batch(rng)
    ref, eng = _run(reqs)
    _assert_drained(eng)
    return reqs, ref


def _assert_same(got: dict, ref: dict, reqs, msg: str, logprobs: bool = False) -> None:
    for rid, _, _ in reqs:
        a, b = ref[rid].outputs[0], got[rid].outputs[0]
        assert got[rid].error is None, got[rid].error
        assert b.token_ids == a.token_ids, f"{msg}: {rid} differs at {_first_diff(a.token_ids, b.token_ids)}"
        assert b.text == a.text, f"{msg}: {rid} text"
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason), f"{msg}: {rid}"
        if logprobs:
            assert len(b.logprobs) == len(a.logprobs) == len(a.token_ids), f"{msg}: {rid} logprobs length"
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                for t in x:
                    assert abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].decoded_token == y[t].decoded_token
            assert abs(a.cumulative_logprob - b.cumulative_logprob) < 1e-3


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_identical_with_speculation(mixed, drafter, mode):
    reqs, ref = mixed
    got, eng = _run(reqs, **_spec(drafter), **MODES[mode])
    _assert_same(got, ref, reqs, f"{drafter}/{mode}")
    st = eng.stats()
    assert st["spec_num_drafts"] > 0 and st["spec_num_draft_tokens"] > 0
    if drafter == "self":
        assert st["spec_acceptance_rate"] == 1.0, "a draft identical to the target must always be accepted"
        assert st["spec_mean_accepted_length"] > 3
    if drafter == "ngram":
        assert st["spec_num_accepted_tokens"] > 0  # the copy-heavy prompt gets hits
    for rid, _, sp in reqs:  # per-request metrics; opted-out requests never speculate
        m = got[rid].metrics
        if sp.extra_args:
            assert "spec_num_drafts" not in m, rid
        elif "spec_num_drafts" in m:
            assert 0.0 <= m["spec_acceptance_rate"] <= 1.0 and m["spec_mean_accepted_length"] >= 1.0
    if mode == "prefix_chunked":
        assert st["prefix_cache_hits"] > 0
    _assert_drained(eng)


def _reference_and_spec(reqs, drafter="self", **kw):
    ref, e1 = _run(reqs, **kw)
    got, e2 = _run(reqs, **_spec(drafter), **kw)
    _assert_drained(e1)
    _assert_drained(e2)
    return ref, got, e2


def test_stop_token_and_stop_string_inside_accepted_block():
    rng = fresh_rng("spec-stop")
    prompts = random_story_prompts(rng, 3)
    base = [(f"b{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2))
            for i, p in enumerate(prompts)]
    plain, _ = _run(base)
    reqs = []
    for i, p in enumerate(prompts):
        out = plain[f"b{i}"].outputs[0]
        # self-drafting accepts everything: blocks are tokens 1-5, 6-10, ...; cut inside one.
        j = next((j for j in range(6, 30) if j % 5 not in (0, 4) and out.token_ids[j] not in out.token_ids[:j]),
                 None)
        if j is not None:
            reqs.append((f"tok{i}", p, SamplingParams(temperature=0, max_tokens=40, logprobs=2,
                                                      stop_token_ids=[out.token_ids[j]])))
        text = out.text
        cut = next((c for c in range(12, len(text) - 4) if text[c:c + 3] not in text[:c + 2]), None)
        if cut is not None:
            for incl in (False, True):
                reqs.append((f"str{i}{incl}", p, SamplingParams(temperature=0, max_tokens=40, logprobs=2,
                                                                 stop=[text[cut:cut + 3]],
                                                                 include_stop_str_in_output=incl)))
    assert reqs
    # Also cap max_tokens at the end of the block where the stop lands: the scheduler then
    # stops at max_tokens while the stop came earlier in the same block; "stop" must win.
    first, _ = _run(reqs)
    for rid, p, sp in list(reqs):
        s = len(first[rid].outputs[0].token_ids) - 1  # index of the token that completed the stop
        end = 5 * ((s - 1) // 5) + 5
        if s >= 1 and end > s:
            reqs.append((rid + "cap", p, sp.clone(max_tokens=end + 1)))
    ref, got, eng = _reference_and_spec(reqs)
    _assert_same(got, ref, reqs, "stop", logprobs=True)
    assert all(ref[r].outputs[0].finish_reason == "stop" for r, _, _ in reqs)
    assert any(r.endswith("cap") for r, _, _ in reqs)
    assert eng.stats()["spec_acceptance_rate"] == 1.0


def test_max_tokens_from_1_to_k_plus_1():
    rng = fresh_rng("spec-max-tokens")
    k = DRAFTERS["self"]["num_speculative_tokens"]
    prompts = random_story_prompts(rng, k + 3)
    reqs = [(f"m{n}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1))
            for n, p in zip(range(1, k + 4), prompts)]
    ref, got, _ = _reference_and_spec(reqs)
    _assert_same(got, ref, reqs, "max_tokens", logprobs=True)
    for rid, _, sp in reqs:
        assert len(got[rid].outputs[0].token_ids) == sp.max_tokens
        assert got[rid].outputs[0].finish_reason == "length"


def test_no_block_leak_after_rejections_and_aborts():
    rng = fresh_rng("spec-abort")
    eng = make_engine(dtype="float32", **_spec("trunc2"), enable_prefix_caching=True)
    prompts = random_story_prompts(rng, 8)
    for i, p in enumerate(prompts[:6]):
        sp = SamplingParams(temperature=rng.choice([0, 0.8, 1.0]), max_tokens=rng.randint(20, 60), ignore_eos=True)
        eng.add_request(f"a{i}", p, sp)
    done = {}
    for step in range(40):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if step == 5:
            eng.abort_request(["a1", "a4"])
        if step == 8:
            for i, p in enumerate(prompts[6:]):
                eng.add_request(f"late{i}", p, SamplingParams(temperature=0.9, max_tokens=30))
        if step == 12:
            eng.abort_request("late0")
    done.update(run_engine(eng))
    assert done["a1"].outputs[0].finish_reason == "abort" and done["late0"].outputs[0].finish_reason == "abort"
    st = eng.stats()
    assert st["spec_num_draft_tokens"] > st["spec_num_accepted_tokens"], "no rejection happened"
    _assert_drained(eng)


@pytest.mark.parametrize("drafter", ["trunc2", "ngram"])
def test_seeded_sampling_with_speculation_is_reproducible(drafter):
    rng = fresh_rng("spec-seeded")
    prompts = random_story_prompts(rng, 4)
    seeded = [(f"s{i}", p, SamplingParams(temperature=0.9, top_p=0.95, seed=rng.randrange(1 << 30),
                                          max_tokens=40, ignore_eos=True)) for i, p in enumerate(prompts[:2])]
    others = [(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=30)) for i, p in enumerate(prompts[2:])]
    a, _ = _run(seeded, **_spec(drafter))
    b, _ = _run(seeded + others, **_spec(drafter))
    c, eng = _run(seeded, **_spec(drafter))
    for rid, _, _ in seeded:
        assert a[rid].outputs[0].token_ids == b[rid].outputs[0].token_ids == c[rid].outputs[0].token_ids, rid
    assert eng.stats()["spec_num_drafts"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_speculation(mode):
    rng = fresh_rng("spec-preempt")
    reqs = [(f"p{i}", p, SamplingParams(temperature=0, max_tokens=rng.randint(70, 100), ignore_eos=True))
            for i, p in enumerate(random_story_prompts(rng, 6))]
    ref, _ = _run(reqs)
    kw = {"num_gpu_blocks": 14, "block_size": 16}
    if mode == "swap":
        kw.update({"swap_space_bytes": 1 << 22, "scheduler.settings.preemption_mode": "swap", "scheduler": "fcfs"})
    got, eng = _run(reqs, **_spec("self"), **kw)
    _assert_same(got, ref, reqs, f"preemption/{mode}")
    assert eng.stats()["num_preemptions"] > 0 and eng.stats()["spec_num_drafts"] > 0
    _assert_drained(eng)


def test_adaptive_rule_turns_speculation_off():
    rng = fresh_rng("spec-adaptive")
    reqs = [(f"q{i}", p, SamplingParams(temperature=0, max_tokens=10 * (i + 1), ignore_eos=True))
            for i, p in enumerate(random_story_prompts(rng, 4))]
    ref, _ = _run(reqs)
    eng = make_engine(dtype="float32", **DRAFTERS["ngram"], **{"speculative.disable_by_batch_size": 2})
    for r in reqs:
        eng.add_request(*r)
    seen = []
    got = run_engine(eng, on_step=lambda e, _: seen.append((e.stats()["num_running"], e.stats()["spec_k"])))
    _assert_same(got, ref, reqs, "disable_by_batch_size")
    assert all(k == 0 for n, k in seen if n > 2) and any(k > 0 for n, k in seen if n <= 2), seen
    # Self-drafting costs a full target step per draft: the cost rule never speculates.
    got, eng = _run(reqs, **DRAFTERS["self"])
    _assert_same(got, ref, reqs, "adaptive self-draft")
    assert eng.stats()["spec_num_drafts"] == 0 and eng.stats()["spec_k"] == 0


def test_per_request_drafter_choice():
    """Requests pick their drafter among request_choices.drafters ("none" = no speculation),
    here with no engine-wide speculative.method."""
    rng = fresh_rng("spec-choice")
    prompts = random_story_prompts(rng, 3) + ["Tom had a big red ball. Tom had a big red ball. Tom had a big"]
    choice = [None, "ngram", "none", "ngram"]
    reqs = [(f"c{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                        extra_args={"kvforge": {"drafter": c}} if c else {}))
            for i, (p, c) in enumerate(zip(prompts, choice))]
    ref, _ = _run([(r, p, sp.clone(extra_args={})) for r, p, sp in reqs])
    got, eng = _run(reqs, num_speculative_tokens=3, **{"request_choices.drafters": ["ngram"],
                                                       "speculative.adaptive": False})
    _assert_same(got, ref, reqs, "per-request drafter")
    assert [("spec_num_drafts" in got[r].metrics) for r, _, _ in reqs] == [False, True, False, True]
    assert got["c3"].metrics["spec_num_accepted_tokens"] > 0
    with pytest.raises(ValueError, match="drafter"):
        eng.add_request("bad", "Once", SamplingParams(extra_args={"kvforge": {"drafter": "draft_model"}}))
    _assert_drained(eng)


def test_config_errors():
    with pytest.raises(ValueError, match="registered drafters: draft_model, ngram"):
        make_engine(speculative_method="medusa", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative.settings.bogus"):
        make_engine(speculative_method="ngram", num_speculative_tokens=2, **{"speculative.settings.bogus": 1})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_engine(speculative_method="ngram")
    with pytest.raises(ValueError, match="num_layers"):
        make_engine(speculative_method="draft_model", num_speculative_tokens=2,
                    **{"speculative.settings.num_layers": 9})


def hidden_checker_registry(checks: list):
    """A registry with drafter ``toy_eagle``: n-gram drafts, registered with
    needs_hidden_states=True; each proposal appends, per request, whether the hidden state
    it got predicts (through the target's LM head) the request's last token."""
    from kvforge_plugins.spec_decode.ngram import NgramDrafter

    class HiddenChecker(NgramDrafter):
        def __init__(self, k, ctx):
            super().__init__(k)
            self.target = ctx.target_model

        def propose(self, requests, num_tokens, hidden_states=None):
            assert hidden_states is not None and hidden_states.shape[0] == len(requests)
            with torch.inference_mode():
                pred = self.target.compute_logits(hidden_states).argmax(dim=-1).tolist()
            checks.extend(p == r.all_token_ids[-1] for p, r in zip(pred, requests))
            return super().propose(requests, num_tokens)

    mod = types.ModuleType("toy_eagle")
    mod.KVFORGE_HOOK_API = "1"

    @hookimpl
    def kvforge_register_drafters(register):
        register("toy_eagle", lambda cfg, settings, ctx: HiddenChecker(cfg.num_speculative_tokens, ctx),
                 needs_hidden_states=True)

    mod.kvforge_register_drafters = kvforge_register_drafters
    return load_registry(extra_plugins=[("toy_eagle", mod)])


def test_eagle_style_drafter_gets_target_hidden_states():
    """A drafter registered with needs_hidden_states=True gets, per request, the target's
    final hidden state at the position that produced its last token."""
    calls = []
    registry = hidden_checker_registry(calls)
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "dtype": "float32",
                                           "speculative_method": "toy_eagle", "num_speculative_tokens": 3,
                                           "speculative.adaptive": False})
    eng = LLMEngine(cfg, registry=registry)
    copy = "Tom had a big red ball. Tom had a big red ball. Tom had a big"
    for i, p in enumerate([copy, "Once upon a time", "The cat"]):
        eng.add_request(f"h{i}", p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    run_engine(eng)
    assert calls and all(calls)
    assert eng.stats()["spec_num_accepted_tokens"] > 0  # rows after accepted drafts were checked too
    _assert_drained(eng)
