"""LLM.beam_search: the search on a step function worked by hand (EOS hypotheses, length
penalty, stop ids), and end to end on stories260K against Hugging Face's
``generate(num_beams=...)`` (fp32, CPU; prompts drawn fresh each run, seed printed).
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers import STORIES_MODEL, fresh_rng, random_story_prompts
from kvforge.engine.outputs import Logprob
from kvforge.entrypoints.beam_search import BeamSearchParams, search

EOS = 9


def _table_step(table):
    """A step function reading the candidates of a beam off ``table[last token]``."""
    def step(beams):
        return [{t: Logprob(math.log(p)) for t, p in table[b[-1]].items()} for b in beams]
    return step


def test_search_worked_by_hand():
    # from 0: 1 (0.6) or 2 (0.4); from 1: EOS (0.5) or 3 (0.5); from 2: 4 (0.9) or 3 (0.1);
    # from 3 and 4: 5 (1.0). Width 2, three steps.
    table = {0: {1: .6, 2: .4}, 1: {EOS: .5, 3: .5}, 2: {4: .9, 3: .1}, 3: {5: 1.0}, 4: {5: 1.0}, 5: {5: 1.0}}
    step = _table_step(table)
    # step 1: [0,1] .6, [0,2] .4; step 2: [0,1,EOS] .3 (done), [0,1,3] .3, [0,2,4] .36, [0,2,3] .04
    # -> live [0,2,4] .36, [0,1,3] .3; step 3: [0,2,4,5] .36, [0,1,3,5] .3
    got = search([[0]], BeamSearchParams(beam_width=2, max_tokens=3), step, {EOS}, [3])[0]
    # scores cum/len: [0,2,4,5] log(.36)/3 = -0.341, [0,1,EOS] log(.3)/2 = -0.602, [0,1,3,5] -0.401
    assert [s.tokens for s in got] == [[0, 2, 4, 5], [0, 1, 3, 5]]
    assert [s.finish_reason for s in got] == ["length", "length"]
    assert math.isclose(got[0].cum_logprob, math.log(.36)) and len(got[0].logprobs) == 3
    # no length normalisation: the short EOS hypothesis (log .3 = -1.20) beats [0,1,3,5] (-1.20, a tie
    # broken by order) and loses to [0,2,4,5] (-1.02)
    got = search([[0]], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0), step, {EOS}, [3])[0]
    assert got[0].tokens == [0, 2, 4, 5] and {tuple(s.tokens) for s in got[1:]} <= {(0, 1, EOS), (0, 1, 3, 5)}
    # ignore_eos: EOS is an ordinary token; stop ids are reported
    got = search([[0]], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0), _table_step(
        {0: {1: .6, 2: .4}, 1: {EOS: .9, 3: .1}, 2: {4: 1.0}}), {EOS}, [2], stop_ids={EOS})[0]
    assert got[0].tokens == [0, 1, EOS] and (got[0].finish_reason, got[0].stop_reason) == ("stop", EOS)
    got = search([[0]], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), _table_step(
        {0: {EOS: .9, 2: .1}}), {EOS}, [1])[0]
    assert got[0].tokens == [0, EOS] and got[0].finish_reason == "length"
    # per-prompt budgets (the room max_model_len leaves)
    a, b = search([[0], [0]], BeamSearchParams(beam_width=1, max_tokens=3), step, {EOS}, [1, 3])
    # (b: EOS ties 3 at step 2 and ranks first, and the live [0, 1, 3] cannot beat it: early stop)
    assert a[0].tokens == [0, 1] and b[0].tokens == [0, 1, EOS]


def test_hugging_face_rules_by_hand():
    """An EOS candidate counts only if it ranks among the best beam_width of all candidates;
    a prompt stops once beam_width hypotheses are finished and no live beam can beat them."""
    # width 1: from 0, 3 (.7) beats EOS (.3): EOS ranks 2nd of the candidates, so it is dropped
    table = {0: {3: .7, EOS: .3}, 3: {4: .5, 5: .5}, 4: {4: 1.0}, 5: {5: 1.0}}
    (got,) = search([[0]], BeamSearchParams(beam_width=1, max_tokens=2, length_penalty=0.0), _table_step(table),
                    {EOS}, [2])
    assert [s.tokens for s in got] == [[0, 3, 4]]  # ([0, EOS] at log .3 would have won: log .35 < log .3)
    # width 1: EOS ranks first at step 1 (.6): finished; the live beam (.4) cannot beat it at its
    # current length (length_penalty 0), so the prompt stops and step 2 never runs
    calls = []

    def step(beams):
        calls.append(beams)
        return _table_step({0: {EOS: .6, 3: .4}, 3: {4: 1.0}})(beams)
    (got,) = search([[0]], BeamSearchParams(beam_width=1, max_tokens=5, length_penalty=0.0), step, {EOS}, [5])
    assert [s.tokens for s in got] == [[0, EOS]] and len(calls) == 1
    # extreme length penalties rank without overflowing
    for lp in (1000.0, -1000.0, 1e308):
        (got,) = search([[0]], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=lp),
                        _table_step({0: {1: .6, 2: .4}, 1: {EOS: .5, 3: .5}, 2: {4: .9, 3: .1}, 3: {5: 1.0},
                                     4: {5: 1.0}, 5: {5: 1.0}}), {EOS}, [3])
        assert len(got) == 2


@pytest.mark.parametrize("kw, field", [(dict(beam_width=0, max_tokens=2), "beam_width"),
                                       (dict(beam_width=2, max_tokens=True), "max_tokens"),
                                       (dict(beam_width=2, max_tokens=2, temperature=-1.0), "temperature"),
                                       (dict(beam_width=2, max_tokens=2, length_penalty=float("nan")),
                                        "length_penalty"),
                                       (dict(beam_width=2, max_tokens=2, ignore_eos=1), "ignore_eos")])
def test_bad_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        BeamSearchParams(**kw)


@pytest.fixture(scope="module")
def llm():
    from kvforge import LLM
    return LLM(model=STORIES_MODEL, dtype="float32", enable_prefix_caching=True, block_size=16)


def test_matches_hf_beam_search(llm):
    """Every beam runs max_tokens (ignore_eos), so the ranking is by cum_logprob alone: the
    sequences and their scores equal HF's num_beams search."""
    from transformers import AutoModelForCausalLM
    rng = fresh_rng("beam")
    prompts = random_story_prompts(rng, 2)
    width, steps = rng.choice([2, 3, 4]), 12
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(STORIES_MODEL, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, min_new_tokens=steps, early_stopping=False, length_penalty=0.0,
                              output_scores=True, return_dict_in_generate=True, repetition_penalty=1.0,
                              eos_token_id=None, pad_token_id=0)
        assert len(out.sequences) == width
        want = [r.tolist() for r in ref.sequences]
        got = [s.tokens for s in out.sequences]
        assert got == want, f"{prompt!r}: {got} != {want}"
        for s, score in zip(out.sequences, ref.sequences_scores.tolist()):
            assert abs(s.cum_logprob - score) < 1e-3, (s.cum_logprob, score)
            assert s.text == tok.decode(s.tokens, skip_special_tokens=True) and s.finish_reason == "length"
    assert llm.llm_engine.allocator.num_free_blocks == llm.llm_engine.allocator.num_blocks


def test_matches_hf_beam_search_with_eos(llm):
    """Prompts that end a few tokens before greedy decoding ends the story, so beams finish on
    EOS: sequences (EOS included) and their length-normalised scores equal HF's."""
    from transformers import AutoModelForCausalLM

    from kvforge import SamplingParams
    rng = fresh_rng("beam-hf-eos")
    openings = rng.sample(["The bird sang", "In the park", "The little boy saw a", "Sue liked to play with",
                           "The fox", "Max and his friend", "The old tree"], 2)
    greedy = llm.generate(openings, SamplingParams(temperature=0, max_tokens=400), use_tqdm=False)
    eos = sorted(llm.llm_engine.eos_token_ids)
    hf = AutoModelForCausalLM.from_pretrained(STORIES_MODEL, dtype=torch.float32).eval()
    stopped = 0
    for g in greedy:
        assert g.outputs[0].finish_reason == "stop"
        ids = g.prompt_token_ids + g.outputs[0].token_ids[:-rng.randint(2, 6)]
        width, lp, steps = rng.choice([2, 3, 4]), rng.choice([0.0, 0.5, 1.0]), 12
        tag = f"width {width} length_penalty {lp}"
        (out,) = llm.beam_search([{"prompt_token_ids": ids}],
                                 BeamSearchParams(beam_width=width, max_tokens=steps, length_penalty=lp))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                              max_new_tokens=steps, early_stopping=False, length_penalty=lp, eos_token_id=eos,
                              pad_token_id=0, output_scores=True, return_dict_in_generate=True, repetition_penalty=1.0)
        want = []
        for row in ref.sequences.tolist():
            gen = row[len(ids):]
            end = next((j + 1 for j, t in enumerate(gen) if t in eos), len(gen))  # (HF pads after EOS)
            want.append(ids + gen[:end])
        assert [s.tokens for s in out.sequences] == want, tag
        stopped += any(s.finish_reason == "stop" for s in out.sequences)
        for s, sc in zip(out.sequences, ref.sequences_scores.tolist()):
            assert abs(s.cum_logprob / (len(s.tokens) - len(ids)) ** lp - sc) < 1e-4, (tag, s.cum_logprob, sc)
    assert stopped  # (the EOS rules were exercised: some returned sequence ended on EOS)


def test_beams_stop_at_eos_and_keep_order(llm):
    """Prompts that end where greedy decoding ends a story (its EOS was the argmax there): with
    one step, the EOS hypothesis must rank first, finished as "stop"; with more steps every
    returned sequence is ordered by normalised score and has EOS only at its end."""
    from kvforge import SamplingParams
    from helpers import STORY_OPENINGS
    rng = fresh_rng("beam-eos")
    openings = rng.sample(["The bird sang", "In the park", "The little boy saw a", "Sue liked to play with",
                           "The fox", "Max and his friend", "The old tree"], 2)
    assert set(openings) <= set(STORY_OPENINGS)
    tok = llm.get_tokenizer()
    eos, extra = llm.llm_engine.eos_token_ids, llm.llm_engine.extra_eos_token_ids  # (generation_config's 1)
    greedy = llm.generate(openings, SamplingParams(temperature=0, max_tokens=400), use_tqdm=False)
    assert all(g.outputs[0].finish_reason == "stop" for g in greedy)  # (greedy ends these stories)
    ends = [{"prompt_token_ids": g.prompt_token_ids + g.outputs[0].token_ids[:-1]} for g in greedy]
    for out in llm.beam_search(ends, BeamSearchParams(beam_width=2, max_tokens=1)):
        best = out.sequences[0]
        last = best.tokens[-1]
        assert last in eos and (best.finish_reason, best.stop_reason) == ("stop", last if last in extra else None)
        assert out.sequences[1].finish_reason == "length"
        assert best.text == tok.decode(best.tokens[:-1], skip_special_tokens=True)
    for end, out in zip(ends, llm.beam_search(ends, BeamSearchParams(beam_width=3, max_tokens=6))):
        plen = len(end["prompt_token_ids"])
        scores = [s.cum_logprob / (len(s.tokens) - plen) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in out.sequences:
            assert (s.tokens[-1] in eos) == (s.finish_reason == "stop") and not eos & set(s.tokens[plen:-1])


def test_bad_input_is_refused_up_front(llm):
    with pytest.raises(ValueError, match="^beam_width: 7 needs 21 log-probabilities"):  # (3 x 7: two EOS ids)
        llm.beam_search("Once", BeamSearchParams(beam_width=7, max_tokens=2))
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2)) == []
    with pytest.raises(ValueError, match="^params: expected BeamSearchParams"):
        llm.beam_search("Once", {"beam_width": 2})
    with pytest.raises(ValueError, match=r"^prompts\[1\]: prompt_token_ids: ids outside"):
        llm.beam_search(["Once", {"prompt_token_ids": [10 ** 6]}], BeamSearchParams(beam_width=2, max_tokens=2))
    assert not llm.llm_engine.has_unfinished_requests()
