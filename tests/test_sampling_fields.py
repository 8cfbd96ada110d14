"""vLLM's SamplingParams fields allowed_token_ids, bad_words, truncate_prompt_tokens and
logprobs=-1: their checks, the sampler's masks against a reference built here, and end to
end on stories260K (CPU, fp32), with speculative decoding and async scheduling too.
Prompts and logits are fresh random draws each run (seeds printed by fresh_rng).
"""
from __future__ import annotations

import pytest
import torch

from helpers import fresh_rng, make_engine, random_story_prompts, run_engine, sampler_request
from kvforge import SamplingParams
from kvforge.engine.bad_words import banned_tokens, encode_bad_words
from kvforge.engine.sampler import Sampler
from test_spec_decode import DRAFTERS, _assert_drained


@pytest.mark.parametrize("kw, field", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids"), (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["  "]), "bad_words"), (dict(bad_words=[3]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=1.5), "truncate_prompt_tokens"),
    (dict(logprobs=-2), "logprobs"), (dict(prompt_logprobs=-3), "prompt_logprobs"),
    (dict(output_kind=3), "output_kind"), (dict(output_kind="DELTA"), "output_kind"),
])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kw)


def test_accepted_forms():
    sp = SamplingParams(allowed_token_ids=(5, 3, 5), bad_words="cat", output_kind=1, truncate_prompt_tokens=-1)
    assert sp.allowed_token_ids == [5, 3] and sp.bad_words == ["cat"] and sp.output_kind.name == "DELTA"
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1


def test_banned_tokens_worked_by_hand():
    seqs = [[7], [3, 4], [1, 2, 9]]
    assert banned_tokens(seqs, []) == {7}
    assert banned_tokens(seqs, [5, 3]) == {7, 4}
    assert banned_tokens(seqs, [1, 2]) == {7, 9}
    assert banned_tokens(seqs, [1, 2, 3]) == {7, 4}
    assert banned_tokens(seqs, [2]) == {7}  # (a prefix must match whole, at the end)


def test_encode_bad_words_forms():
    eng = make_engine(dtype="float32")
    tok = eng.tokenizer
    for word in ("Lily", "park", " happy"):
        plain = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        want = [plain] + ([spaced] if spaced != plain else [])
        assert encode_bad_words(tok, [word, word]) == want  # (duplicates dropped)


def _reference_mask(logits, allowed, banned):
    ref = torch.full_like(logits, float("-inf"))
    for i, (a, b) in enumerate(zip(allowed, banned)):
        cols = list(range(logits.shape[1])) if a is None else a
        ref[i, cols] = logits[i, cols]
        ref[i, sorted(b)] = float("-inf")
    return ref


def test_sampler_masks_match_reference():
    rng = fresh_rng("mask")
    v, n = 64, 6
    logits = torch.randn(n, v) * 3
    reqs, allowed, banned = [], [], []
    for i in range(n):
        allow = rng.sample(range(v), rng.randint(1, 20)) if i % 2 == 0 else None
        single, pair = rng.randrange(v), [rng.randrange(3, v), rng.randrange(v)]
        out = [rng.randrange(v) for _ in range(5)] + ([pair[0]] if i % 3 == 0 else [])
        sp = SamplingParams(allowed_token_ids=allow, temperature=0)
        sp._bad_words_token_ids = [[single], pair]
        reqs.append(sampler_request(f"r{i}", sp, output=out))
        allowed.append(allow)
        banned.append({single} | ({pair[1]} if out[-1] == pair[0] else set()))
    work = logits.clone()
    assert Sampler.needs_logits_processing(reqs)
    Sampler._apply_logits_processors(work, reqs, work.device, v)
    assert torch.equal(work, _reference_mask(logits, allowed, banned))
    # sampled rows (temperature 1) only ever draw allowed, unbanned tokens
    hot = [sampler_request(r.request_id, r.sampling_params.clone(temperature=1.0), output=list(r.output_token_ids))
           for r in reqs]
    for r, old in zip(hot, reqs):
        r.sampling_params._bad_words_token_ids = old.sampling_params._bad_words_token_ids
    sampler = Sampler(v)
    for _ in range(20):
        toks = sampler(torch.randn(n, v) * 3, hot).sampled_token_ids
        for t, a, b in zip(toks, allowed, banned):
            assert (a is None or t in a) and t not in b


def _contains(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("mode", ["plain", "async", "ngram", "self"])
def test_bad_words_end_to_end(mode):
    """Words the unconstrained greedy run writes are banned; the constrained run never
    generates their token sequences, and speculative / async runs give the same text."""
    rng = fresh_rng("bad-words")
    prompts = random_story_prompts(rng, 3)
    ref_eng = make_engine(dtype="float32")
    for i, p in enumerate(prompts):
        ref_eng.add_request(f"f{i}", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    free = run_engine(ref_eng)
    tok = ref_eng.tokenizer
    # two words from each free text: one spelled by one token, one by several (if present),
    # each generated as one of its encoded forms (so banning it must change the output)
    words = []
    for i in range(len(prompts)):
        ids = free[f"f{i}"].outputs[0].token_ids
        ws = [w.strip(".,!?\"'") for w in free[f"f{i}"].outputs[0].text.split()]
        ws = [w for w in ws if w and any(_contains(ids, seq) for seq in encode_bad_words(tok, [w]))]
        one = [w for w in ws if len(tok.encode(w, add_special_tokens=False)) == 1]
        many = [w for w in ws if len(tok.encode(w, add_special_tokens=False)) > 1]
        words.append(([rng.choice(one)] if one else []) + ([rng.choice(many)] if many else []))
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, bad_words=w) for w in words]
    kw = {"plain": {}, "async": {"async_scheduling": True},
          "ngram": {**DRAFTERS["ngram"], "speculative.adaptive": False},
          "self": {**DRAFTERS["self"], "speculative.adaptive": False}}[mode]
    eng = make_engine(dtype="float32", **kw)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"b{i}", p, sp)
    got = run_engine(eng)
    _assert_drained(eng)
    changed = 0
    for i, w in enumerate(words):
        ids = got[f"b{i}"].outputs[0].token_ids
        for seq in encode_bad_words(tok, w):
            assert not _contains(ids, seq), f"{w}: {seq} generated in {ids}"
        changed += ids != free[f"f{i}"].outputs[0].token_ids
    assert changed == sum(bool(w) for w in words)
    if mode != "plain":  # the same constrained text as without speculation / overlap
        base = make_engine(dtype="float32")
        for i, (p, sp) in enumerate(zip(prompts, params)):
            base.add_request(f"b{i}", p, sp)
        want = run_engine(base)
        for i in range(len(prompts)):
            assert got[f"b{i}"].outputs[0].token_ids == want[f"b{i}"].outputs[0].token_ids, mode


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_end_to_end(temperature):
    rng = fresh_rng("allowed")
    eng = make_engine(dtype="float32")
    allowed = rng.sample(range(3, 512), 12)
    eng.add_request("a", random_story_prompts(rng, 1)[0],
                    SamplingParams(temperature=temperature, max_tokens=25, allowed_token_ids=allowed, logprobs=2,
                                   seed=rng.randrange(1 << 30)))
    out = run_engine(eng)["a"].outputs[0]
    assert len(out.token_ids) == 25 and set(out.token_ids) <= set(allowed)
    # logprobs stay those of the raw distribution (vLLM's default): the top ones need not be allowed
    assert all(len(lp) >= 2 for lp in out.logprobs)


def test_allowed_tokens_all_banned_is_refused():
    eng = make_engine(dtype="float32")
    eos = min(eng.eos_token_ids)
    with pytest.raises(ValueError, match="^allowed_token_ids: .*min_tokens"):
        eng.add_request("a", "Once", SamplingParams(allowed_token_ids=[eos], min_tokens=2, max_tokens=4))
    lily = eng.tokenizer.encode("Lily", add_special_tokens=False)
    with pytest.raises(ValueError, match="^allowed_token_ids: .*bad_words"):
        eng.add_request("a", "Once", SamplingParams(allowed_token_ids=lily, bad_words=["Lily"]))
    with pytest.raises(ValueError, match="^allowed_token_ids: ids outside"):
        eng.add_request("a", "Once", SamplingParams(allowed_token_ids=[5, 10 ** 6]))
    assert not eng.has_unfinished_requests()


def test_truncate_prompt_tokens():
    rng = fresh_rng("truncate")
    eng = make_engine(dtype="float32", max_model_len=64)
    prompt = ". ".join(random_story_prompts(rng, 4))
    ids = eng.tokenizer.encode(prompt)
    k = rng.randint(2, min(len(ids) - 1, 20))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    eng.add_request("t", prompt, sp.clone(truncate_prompt_tokens=k))
    eng.add_request("ref", {"prompt_token_ids": ids[-k:]}, sp)
    eng.add_request("long", {"prompt_token_ids": ids}, sp.clone(truncate_prompt_tokens=len(ids) + 5))
    got = run_engine(eng)
    assert got["t"].prompt_token_ids == ids[-k:] and got["t"].prompt == prompt
    assert got["t"].outputs[0].token_ids == got["ref"].outputs[0].token_ids
    assert got["long"].prompt_token_ids == ids  # (k past the prompt keeps it whole)
    with pytest.raises(ValueError, match="^truncate_prompt_tokens: 65 exceeds max_model_len"):
        eng.add_request("x", prompt, SamplingParams(truncate_prompt_tokens=65))
    with pytest.raises(ValueError, match="^prompt: 64 tokens leave no room"):  # (-1: max_model_len, as vLLM)
        eng.add_request("x", {"prompt_token_ids": ids * 10}, SamplingParams(truncate_prompt_tokens=-1))


def test_logprobs_whole_vocabulary():
    eng = make_engine(dtype="float32")
    with pytest.raises(ValueError, match=r"^logprobs: -1 \(the whole vocabulary, 512\) exceeds max_logprobs"):
        eng.add_request("x", "Once", SamplingParams(logprobs=-1))
    eng = make_engine(dtype="float32", **{"model.max_logprobs": -1})
    eng.add_request("a", "Once upon", SamplingParams(temperature=0, max_tokens=3, logprobs=-1, prompt_logprobs=-1))
    out = run_engine(eng)["a"]
    assert [len(lp) for lp in out.outputs[0].logprobs] == [512] * 3
    assert all(len(e) == 512 for e in out.prompt_logprobs[1:])
    first = list(out.outputs[0].logprobs[0].values())
    lps = torch.tensor([lp.logprob for lp in first])
    # rank = 1 + how many tokens are strictly more likely (ties share a rank)
    assert [lp.rank for lp in first] == [1 + int((lps > lp.logprob).sum()) for lp in first]
    assert abs(lps.exp().sum().item() - 1) < 1e-4
