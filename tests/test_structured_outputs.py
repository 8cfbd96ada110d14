"""Structured outputs (SamplingParams.structured_outputs, XGrammar): the parameters' checks,
the sampler's bitmask against XGrammar's own, and end to end on stories260K (CPU, fp32):
sampled outputs obey a JSON schema, a regex, a choice and a grammar; constrained requests
keep their output through speculation, async scheduling and preemption; bad constraints are
refused before anything is queued. Seeds and prompts are fresh each run (printed).
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from helpers import assert_no_block_leak, fresh_rng, make_engine, random_story_prompts, run_engine
from kvforge import SamplingParams
from kvforge.engine.sampling_ops import apply_token_bitmask
from kvforge.engine.structured_outputs import StructuredOutputsParams
from test_spec_decode import DRAFTERS

xgr = pytest.importorskip("xgrammar")  # (a dev dependency: CI installs it; this guards a bare install)

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "happy", "age"],
          "properties": {"name": {"enum": ["Lily", "Tom", "Sue"]}, "happy": {"type": "boolean"},
                         "age": {"type": "integer", "minimum": 1, "maximum": 99}}}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no way", 'a "quoted" one']
GRAMMAR = 'root ::= "Once" " upon" (" a" | " the") " time" ("." | "!")'


def _valid(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            v = json.loads(text)
        except json.JSONDecodeError:
            return False
        return (set(v) == {"name", "happy", "age"} and v["name"] in ("Lily", "Tom", "Sue")
                and isinstance(v["happy"], bool) and isinstance(v["age"], int) and 1 <= v["age"] <= 99)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(r"Once upon (a|the) time[.!]", text) is not None


CONSTRAINTS = {"json": dict(json=SCHEMA, disable_any_whitespace=True), "regex": dict(regex=REGEX),
               "choice": dict(choice=CHOICES), "grammar": dict(grammar=GRAMMAR)}


@pytest.mark.parametrize("kw, msg", [
    ({}, "^structured_outputs: set exactly one"), (dict(json=SCHEMA, regex="a"), "got json, regex"),
    (dict(choice=[]), "^structured_outputs.choice: must be a non-empty list"),
    (dict(choice=["a", 3]), "^structured_outputs.choice"),
    (dict(regex=""), "^structured_outputs.regex: must be a non-empty string"),
    (dict(json_object="yes"), "^structured_outputs.json_object: must be True"),
    (dict(json=3), "^structured_outputs.json: must be a JSON schema"),
])
def test_params_name_the_field(kw, msg):
    with pytest.raises(ValueError, match=msg):
        StructuredOutputsParams(**kw)


def test_dict_form_and_unknown_keys():
    sp = SamplingParams(structured_outputs={"regex": "a+"})
    assert isinstance(sp.structured_outputs, StructuredOutputsParams) and sp.reads_history
    with pytest.raises(ValueError, match=r"^structured_outputs: unknown field\(s\) \['guided_regex'\]"):
        SamplingParams(structured_outputs={"guided_regex": "a+"})


@pytest.mark.parametrize("vocab", [64, 100, 512])
def test_bitmask_matches_xgrammar(vocab):
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ()).item()))
    n = 5
    logits = torch.randn(n, vocab, generator=g)
    words = (vocab + 31) // 32
    mask = torch.randint(-(1 << 31), 1 << 31, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    rows = [0, 2, 4]
    want = logits.clone()
    for j, r in enumerate(rows):
        sub = want[r:r + 1].clone()
        xgr.apply_token_bitmask_inplace(sub, mask[j:j + 1].clone())
        want[r] = sub[0]
    got = logits.clone()
    apply_token_bitmask(got, torch.tensor(rows), mask)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_sampled_outputs_obey_the_constraint(kind):
    rng = fresh_rng(f"structured-{kind}")
    eng = make_engine(dtype="float32")
    prompts = random_story_prompts(rng, 2)
    for i, p in enumerate(prompts):
        eng.add_request(f"s{i}", p, SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30), n=2, max_tokens=80,
                                                    structured_outputs=CONSTRAINTS[kind]))
    eng.add_request("free", prompts[0], SamplingParams(temperature=0, max_tokens=20))  # batched alongside
    got = run_engine(eng)
    for i in range(len(prompts)):
        for c in got[f"s{i}"].outputs:
            assert c.finish_reason == "stop" and _valid(kind, c.text), (kind, c.text)
    assert not _valid(kind, got["free"].outputs[0].text)
    assert_no_block_leak(eng)


@pytest.mark.parametrize("mode", ["async", "ngram", "self", "preempt"])
def test_constrained_output_unchanged_by_engine_mode(mode):
    """Greedy constrained outputs equal the plain engine's, with speculation (constrained
    requests draft too: a draft the grammar refuses is rejected), async scheduling and preemption."""
    rng = fresh_rng("structured-modes")
    prompts = random_story_prompts(rng, 4)
    reqs = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=80, ignore_eos=i % 2 == 1,
                                        structured_outputs=CONSTRAINTS[kind] if i % 2 == 0 else None))
            for i, (p, kind) in enumerate(zip(prompts, ["json", "regex", "choice", "grammar"]))]
    kw = {"async": dict(async_scheduling=True), "ngram": {**DRAFTERS["ngram"], "speculative.adaptive": False},
          "self": {**DRAFTERS["self"], "speculative.adaptive": False},
          "preempt": dict(num_gpu_blocks=16, block_size=8, max_num_batched_tokens=64)}[mode]
    outs = {}
    for label, extra in (("plain", {}), (mode, kw)):
        eng = make_engine(dtype="float32", **extra)
        for r in reqs:
            eng.add_request(*r)
        outs[label] = run_engine(eng)
        assert_no_block_leak(eng)
    for rid, _, sp in reqs:
        a, b = outs["plain"][rid].outputs[0], outs[mode][rid].outputs[0]
        assert b.token_ids == a.token_ids, (mode, rid)
        if sp.structured_outputs is not None:
            assert _valid(sp.structured_outputs.kind, b.text), b.text
    if mode in ("ngram", "self"):  # constrained requests draft too, each position masked past its drafts
        assert eng.stats()["spec_num_drafts"] > 0
        drafted = [outs[mode][rid].metrics.get("spec_num_draft_tokens", 0) for rid, _, sp in reqs
                   if sp.structured_outputs is not None]
        assert sum(drafted) > 0, drafted
    if mode == "preempt":
        assert eng.stats()["num_preemptions"] > 0


def test_bad_constraints_are_refused_before_queueing():
    eng = make_engine(dtype="float32")
    for so, field in ((dict(regex="([a-z"), "regex"), (dict(json="{not json"), "json"),
                      (dict(grammar="root ::= (("), "grammar")):
        with pytest.raises(ValueError, match=f"^structured_outputs.{field}: cannot be compiled"):
            eng.add_request("x", "Once", SamplingParams(structured_outputs=so))
    assert not eng.has_unfinished_requests()
    eng.add_request("ok", "Once", SamplingParams(max_tokens=8, structured_outputs=dict(choice=["hi"])))
    assert run_engine(eng)["ok"].outputs[0].text == "hi"


def test_ignore_eos_after_the_grammar_ends_emits_only_stop_tokens():
    eng = make_engine(dtype="float32")
    eng.add_request("a", "Hi", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              structured_outputs=dict(choice=["yes", "no"])))
    out = run_engine(eng)["a"].outputs[0]
    assert out.text in ("yes", "no") and len(out.token_ids) == 12
    first = next(i for i, t in enumerate(out.token_ids) if t in eng.eos_token_ids)  # where the grammar ended
    assert 0 < first < 11 and set(out.token_ids[first:]) <= set(eng.eos_token_ids)


def test_async_engine_compiles_off_the_engine_thread():
    """The server's engine compiles a constraint on an executor thread before queueing it (the
    engine thread, which every stream waits on, then finds it in XGrammar's cache); a bad one
    fails add_request with the field named."""
    import asyncio
    import threading

    from kvforge.engine.async_engine import AsyncLLMEngine
    eng = make_engine(dtype="float32")
    threads = []
    compile_ = eng._grammars.compile

    def spy(params):
        threads.append(threading.current_thread())
        return compile_(params)

    eng._grammars.compile = spy

    async def main():
        engine = AsyncLLMEngine(eng)
        engine.start()
        try:
            outs = [o async for o in engine.generate("a", "Once", SamplingParams(
                max_tokens=20, structured_outputs=dict(regex=REGEX)))]
            with pytest.raises(ValueError, match="^structured_outputs.regex: cannot be compiled"):
                await engine.add_request("b", "Once", SamplingParams(structured_outputs=dict(regex="([")))
            return outs[-1], engine._thread
        finally:
            await engine.shutdown()

    last, engine_thread = asyncio.run(main())
    assert _valid("regex", last.outputs[0].text)
    assert threads[0] is not engine_thread and threads[1] is engine_thread and len(threads) == 3


def test_bans_yield_to_a_constraint_that_allows_nothing_else():
    """min_tokens and bad words never push a constrained row to no token at all (token 0 was
    sampled then, and the output left its grammar): the grammar's EOS ends the output, and
    allowed_token_ids keep their tokens; allowed_token_ids with a grammar is refused."""
    eng = make_engine(dtype="float32")
    eng.add_request("re", "Once upon a time", SamplingParams(temperature=0, max_tokens=10, min_tokens=5,
                                                             structured_outputs={"regex": "ab"}))
    eng.add_request("ch", "Once upon a time", SamplingParams(temperature=1.0, seed=4, max_tokens=10, min_tokens=5,
                                                             structured_outputs={"choice": ["yes", "no"]}))
    eng.add_request("bw", "Once upon a time", SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=[400],
                                                             bad_words=["do do"]))
    got = run_engine(eng)
    assert got["re"].outputs[0].text == "ab" and got["re"].outputs[0].finish_reason == "stop"
    assert got["ch"].outputs[0].text in ("yes", "no")
    assert got["bw"].outputs[0].token_ids == [400] * 6
    with pytest.raises(ValueError, match="^allowed_token_ids: cannot be combined with structured_outputs"):
        SamplingParams(allowed_token_ids=[400], structured_outputs={"choice": ["a"]})
    so = StructuredOutputsParams(choice=["a"])
    so.regex = "b"  # changed after it was built: checked again when used
    with pytest.raises(ValueError, match="got regex, choice"):
        SamplingParams(structured_outputs=so)
    assert_no_block_leak(eng)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, async_scheduling=True), dict(data_parallel_size=2)],
                         ids=["tp2-async", "dp2"])
def test_distributed_engines_agree(layout):
    """A constraint crosses to worker processes (DP replicas build their own matchers; TP samples
    constrained rows on the driver): outputs equal the single-process engine's, beam search too."""
    from helpers import STORIES_MODEL
    from kvforge import LLM, BeamSearchParams
    from test_distributed import _shutdown
    rng = fresh_rng("structured-distributed")
    prompts = random_story_prompts(rng, 2)
    params = [SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30), max_tokens=40,
                             structured_outputs=CONSTRAINTS["regex"]),
              SamplingParams(temperature=0, max_tokens=12, bad_words=["Lily", "park"])]
    outs = {}
    for label, kw in (("one", {}), ("many", layout)):
        llm = LLM(model=STORIES_MODEL, dtype="float32", num_gpu_blocks=64, **kw)
        try:
            got = llm.generate(prompts, params, use_tqdm=False)
            beams = llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=4))
            outs[label] = ([o.outputs[0].token_ids for o in got], [s.tokens for s in beams[0].sequences])
        finally:
            _shutdown(llm)
    assert outs["many"] == outs["one"]
    assert _valid("regex", llm.get_tokenizer().decode(outs["many"][0][0], skip_special_tokens=True))


def test_draft_positions_mask_past_their_drafts():
    """fill_bitmask on DraftPosition items: the mask after k drafts equals a matcher advanced by
    them by hand; a position behind a refused draft allows everything; the matcher is left
    where it was."""
    from kvforge.engine.structured_outputs import DraftPosition, fill_bitmask
    eng = make_engine(dtype="float32")
    compiled = eng._grammars.compile(StructuredOutputsParams(regex=REGEX))
    m, ref = eng._grammars.matcher(compiled), eng._grammars.matcher(compiled)

    def allowed(mask, row):
        return [t for t in range(eng.vocab_size) if (int(mask[row, t // 32]) >> (t % 32)) & 1]

    rng = fresh_rng("draft-positions")
    before = fill_bitmask([m], eng.vocab_size)
    drafts = []
    for _ in range(3):  # a random valid draft of three tokens
        drafts.append(rng.choice(allowed(fill_bitmask([ref], eng.vocab_size), 0)))
        assert ref.accept_token(drafts[-1])
    bad = [t for t in range(eng.vocab_size) if t not in allowed(before, 0)][0]
    mask = fill_bitmask([DraftPosition(m, drafts[:j]) for j in range(4)] + [DraftPosition(m, [bad, drafts[0]])],
                        eng.vocab_size)
    assert torch.equal(mask[3], fill_bitmask([ref], eng.vocab_size)[0]) and torch.equal(mask[0], before[0])
    assert allowed(mask, 4) == list(range(eng.vocab_size))
    assert torch.equal(fill_bitmask([m], eng.vocab_size), before)  # (rolled back)


def test_sampled_constrained_requests_speculate_validly():
    rng = fresh_rng("structured-spec-sampled")
    eng = make_engine(dtype="float32", **DRAFTERS["ngram"], **{"speculative.adaptive": False})
    for i, p in enumerate(random_story_prompts(rng, 3)):
        eng.add_request(f"s{i}", p, SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30), n=2, max_tokens=80,
                                                    structured_outputs=CONSTRAINTS["json"]))
    got = run_engine(eng)
    for out in got.values():
        for c in out.outputs:
            assert c.finish_reason == "stop" and _valid("json", c.text), c.text
    assert sum(o.metrics.get("spec_num_draft_tokens", 0) for o in got.values()) > 0
    assert_no_block_leak(eng)
