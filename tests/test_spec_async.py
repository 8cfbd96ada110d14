"""Speculative decoding under async scheduling (CPU, fp32, stories260K).

Steps that verify drafts run synchronously; steps in which the adaptive rule turns
speculation off overlap (kvforge.engine.overlap). The engine switches per step, so these
tests force both kinds into one run (``disable_by_batch_size``: speculation only once the
batch has shrunk) and check that greedy outputs equal plain decoding, that both kinds of
step happened, and that no target or draft KV block leaks, also with aborts and
preemption in the middle.
"""
from __future__ import annotations

import pytest

from helpers import fresh_rng, make_engine, random_story_prompts, run_engine
from kvforge import SamplingParams
from test_spec_decode import DRAFTERS, _assert_drained, _assert_same, _run


def _requests(rng, n: int, lo: int = 8) -> list:
    return [(f"a{i}", p, SamplingParams(temperature=0, max_tokens=rng.randint(lo, 20) * (i + 1), ignore_eos=True,
                                        logprobs=1))
            for i, p in enumerate(random_story_prompts(rng, n))]


@pytest.mark.parametrize("drafter", ["self", "ngram"])
def test_switches_between_overlapped_and_verify_steps(drafter):
    rng = fresh_rng("spec-async")
    reqs = _requests(rng, 5)
    # the last request runs 30 tokens alone, so speculation (batch <= 2) has room to draft: with
    # random lengths two requests could finish together, and the n-gram drafter first matches
    # only some steps into the single-request tail
    rid, prompt, sp = reqs[-1]
    reqs[-1] = (rid, prompt, sp.clone(max_tokens=max(r[2].max_tokens for r in reqs[:-1]) + 30))
    ref, e0 = _run(reqs, async_scheduling=False)
    _assert_drained(e0)
    kinds = []
    eng = make_engine(dtype="float32", async_scheduling=True, **DRAFTERS[drafter],
                      **{"speculative.adaptive": False, "speculative.disable_by_batch_size": 2})
    for r in reqs:
        eng.add_request(*r)
    got = run_engine(eng, on_step=lambda e, _: kinds.append(e.stats()["spec_k"]))
    _assert_same(got, ref, reqs, f"async/{drafter}", logprobs=True)
    st = eng.stats()
    assert st["spec_num_drafts"] > 0, "no verify step ran"
    assert eng._overlap.num_overlapped_steps > 0, "no step overlapped"
    assert 0 in kinds and any(k > 0 for k in kinds), kinds
    if drafter == "self":
        assert st["spec_acceptance_rate"] == 1.0
    _assert_drained(eng)


def test_abort_and_preemption_while_switching():
    rng = fresh_rng("spec-async-abort")
    reqs = _requests(rng, 6, lo=15)  # 6 x (prompt + up to 120 tokens) > 10 blocks of 16: preemption
    ref, _ = _run(reqs, async_scheduling=False)
    eng = make_engine(dtype="float32", async_scheduling=True, num_gpu_blocks=10, block_size=16,
                      **DRAFTERS["trunc2"], **{"speculative.adaptive": False, "speculative.disable_by_batch_size": 3})
    for r in reqs:
        eng.add_request(*r)
    done = {}
    for step in range(30):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if step == 7:
            eng.abort_request("a0")
    done.update(run_engine(eng))
    assert done["a0"].outputs[0].finish_reason == "abort"
    kept = [r for r in reqs if r[0] != "a0"]
    _assert_same(done, ref, kept, "async/abort+preemption", logprobs=True)
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["spec_num_drafts"] > 0 and eng._overlap.num_overlapped_steps > 0
    _assert_drained(eng)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_keep_drafts_on_the_host(async_scheduling):
    """Drafts stay on the device between draft forwards unless a request's penalties read
    them; greedy outputs with penalties (batched with requests without) equal plain decoding."""
    rng = fresh_rng("spec-penalties")
    prompts = random_story_prompts(rng, 4)
    reqs = [(f"p{i}", p, SamplingParams(temperature=0, max_tokens=rng.randint(20, 40), ignore_eos=True,
                                        repetition_penalty=1.3 if i % 2 else 1.0,
                                        frequency_penalty=0.5 if i == 2 else 0.0))
            for i, p in enumerate(prompts)]
    ref, _ = _run(reqs, async_scheduling=False)
    got, eng = _run(reqs, async_scheduling=async_scheduling, **DRAFTERS["self"], **{"speculative.adaptive": False})
    _assert_same(got, ref, reqs, "penalties")
    assert eng.stats()["spec_acceptance_rate"] == 1.0
    _assert_drained(eng)


def test_a_drafter_that_never_proposes_is_turned_off():
    """Empty proposals count as first-draft rejections: the adaptive rule switches the
    drafter off, and the steps then overlap (async) instead of running synchronously."""
    import types

    from kvforge import hookimpl
    from kvforge.config import EngineConfig
    from kvforge.engine.llm_engine import LLMEngine
    from kvforge.interfaces import DraftProposal, Drafter
    from kvforge.plugin_manager import load_registry

    class Silent(Drafter):
        def __init__(self, k):
            self.num_speculative_tokens = k
            self.calls = 0

        def propose(self, requests, num_tokens, hidden_states=None):
            self.calls += 1
            return DraftProposal()

    mod = types.ModuleType("silent_drafter")
    mod.KVFORGE_HOOK_API = "1"

    @hookimpl
    def kvforge_register_drafters(register):
        register("silent", lambda cfg, settings, ctx: Silent(cfg.num_speculative_tokens))

    mod.kvforge_register_drafters = kvforge_register_drafters
    from helpers import STORIES_MODEL
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "dtype": "float32", "async_scheduling": True,
                                           "speculative_method": "silent", "num_speculative_tokens": 3,
                                           # the modelled cost: measured times vary from run to run
                                           "speculative.measure_step_cost": False})
    eng = LLMEngine(cfg, registry=load_registry(extra_plugins=[("silent_drafter", mod)]))
    rng = fresh_rng("spec-silent")
    reqs = _requests(rng, 3, lo=15)
    for r in reqs:
        eng.add_request(*r)
    ks = []
    got = run_engine(eng, on_step=lambda e, _: ks.append(e.stats()["spec_k"]))
    ref, _ = _run(reqs, async_scheduling=False)
    _assert_same(got, ref, reqs, "silent drafter", logprobs=True)
    assert ks[-1] == 0 and ks.count(0) > len(ks) // 2, ks
    assert eng.spec.adaptive["silent"].acceptance < 0.2
    assert eng._overlap.num_overlapped_steps > len(ks) // 2


def test_eagle_style_drafter_never_sees_a_stale_hidden_state():
    """Steps that overlap record no hidden states: a drafter that needs them gets a request
    again only after a synchronous step recorded a fresh one (checked: the state must
    predict the request's last token)."""
    from helpers import STORIES_MODEL
    from kvforge.config import EngineConfig
    from kvforge.engine.llm_engine import LLMEngine
    from test_spec_decode import hidden_checker_registry

    checks = []
    cfg = EngineConfig.from_sources(None, {
        "model": STORIES_MODEL, "dtype": "float32", "async_scheduling": True, "speculative_method": "toy_eagle",
        "num_speculative_tokens": 3, "speculative.adaptive": False, "speculative.disable_by_batch_size": 2})
    eng = LLMEngine(cfg, registry=hidden_checker_registry(checks))
    rng = fresh_rng("spec-eagle-async")
    prompts = random_story_prompts(rng, 5)
    sp = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)  # noqa: E731
    # Two long requests speculate (synchronous steps), three short ones join (batch 5 > 2:
    # overlapped steps) and leave (speculation again): hidden states from before the
    # overlapped steps must not be used.
    reqs = [(f"long{i}", prompts[i], sp(60)) for i in range(2)] + \
           [(f"short{i}", prompts[2 + i], sp(rng.randint(6, 12))) for i in range(3)]
    for r in reqs[:2]:
        eng.add_request(*r)
    got = {}
    for _ in range(8):
        got.update({o.request_id: o for o in eng.step() if o.finished})
    before = len(checks)
    for r in reqs[2:]:
        eng.add_request(*r)
    got.update(run_engine(eng))
    assert len(checks) > before, "no proposal after the overlapped steps"
    ref, _ = _run(reqs, async_scheduling=False)
    _assert_same(got, ref, reqs, "eagle/async", logprobs=True)
    assert checks and all(checks), f"{checks.count(False)} of {len(checks)} proposals got a stale hidden state"
    assert eng._overlap.num_overlapped_steps > 0
    _assert_drained(eng)


@pytest.mark.parametrize("drafter", ["ngram", "self", "trunc2"])
def test_seeded_outputs_equal_decoding_without_speculation(drafter):
    """Seeded sampling draws position-keyed noise and seeded drafts are verified by the
    coupling: outputs equal plain decoding's whatever the batch mates, the steps that
    speculate or async scheduling (kvforge.engine.position_noise)."""
    rng = fresh_rng("spec-seeded-coupled")
    prompts = random_story_prompts(rng, 6)
    seeded = [(f"s{i}", p, SamplingParams(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                                          seed=rng.randrange(1 << 30), n=1 + i % 2, max_tokens=rng.randint(20, 50),
                                          ignore_eos=True, logprobs=1))
              for i, p in enumerate(prompts[:3])]
    # mates end before any seeded request (<= 15 < 20 tokens), so every mixed run has steps
    # with only the 4 seeded sequences left, which speculate
    mates = [(f"m{i}", p, SamplingParams(temperature=0.8, max_tokens=rng.randint(5, 15)))
             for i, p in enumerate(prompts[3:])]
    ref, _ = _run(seeded, async_scheduling=False)
    for async_scheduling, batch in ((False, seeded + mates), (True, seeded + mates), (True, seeded)):
        # drafting depends on the batch: only steps with <= 4 running sequences speculate, so
        # the seeded ones alone (4 sequences) always do and with their mates only some steps do
        got, eng = _run(batch, async_scheduling=async_scheduling, **DRAFTERS[drafter],
                        **{"speculative.adaptive": False, "speculative.disable_by_batch_size": 4})
        for rid, _, _ in seeded:
            assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in ref[rid].outputs], \
                (rid, async_scheduling, len(batch))
        assert eng.stats()["spec_num_drafts"] > 0
        _assert_drained(eng)
