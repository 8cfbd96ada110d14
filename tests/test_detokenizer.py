"""Tests for kvforge.engine.tokenizer and kvforge.engine.detokenizer with real local tokenizers."""
from __future__ import annotations

import os
import random
import re

import pytest

from kvforge import SamplingParams
from kvforge.engine.detokenizer import IncrementalDetokenizer, decode_single_token
from kvforge.engine.tokenizer import eos_token_ids, extra_eos_token_ids, load_tokenizer

STORIES = "/work/shared/models/stories260K"
LLAMA2 = "/work/shared/tokenizers/llama2"
TOKENIZER_PATHS = [STORIES, LLAMA2]

UNICODE_SNIPPETS = [
    "héllo 世界 🤖 naïve", "café", "über straße", "日本語のテキスト", "😀😃🎉", "👩‍💻 codes",
    "Ωμέγα", "crème brûlée", "한국어", "emoji🤖mid", "ñandú", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "a—b…c", " spaced  out ",
    "Once upon a time", "\n\nnew lines\t", "¿Qué?", "Zürich 🇨🇭",
]


def _rng() -> random.Random:
    seed = int.from_bytes(os.urandom(8), "little")
    print(f"seed={seed}")
    return random.Random(seed)


@pytest.fixture(scope="module", params=TOKENIZER_PATHS, ids=["stories260K", "llama2"])
def tok(request):
    return load_tokenizer(request.param)


_ID_CACHE: dict[tuple[int, str], object] = {}


def _byte_ids(tok) -> set[int]:
    key = (id(tok), "bytes")
    if key not in _ID_CACHE:
        _ID_CACHE[key] = {i for t, i in tok.get_vocab().items() if re.fullmatch(r"<0x[0-9A-F]{2}>", t)}
    return _ID_CACHE[key]


def _plain_ids(tok) -> list[int]:
    key = (id(tok), "plain")
    if key not in _ID_CACHE:
        bad = _byte_ids(tok) | set(tok.all_special_ids)
        _ID_CACHE[key] = [i for i in range(len(tok)) if i not in bad]
    return _ID_CACHE[key]


def _random_generation(tok, rng: random.Random, n_segments: int) -> list[int]:
    """Plain tokens, encoded unicode snippets (byte-fallback runs) and special tokens, mixed."""
    plain = _plain_ids(tok)
    ids: list[int] = []
    for _ in range(n_segments):
        r = rng.random()
        if r < 0.45:
            ids += [rng.choice(plain) for _ in range(rng.randint(1, 4))]
        elif r < 0.9:
            s = rng.choice(UNICODE_SNIPPETS)
            ids += tok.encode(s, add_special_tokens=False)
        else:
            ids.append(rng.choice(tok.all_special_ids))
    return ids


def _run(tok, prompt, gen, params, chunked_rng=None):
    """Feed gen (one by one, or in random chunks); return (detok, texts after each update, deltas)."""
    d = IncrementalDetokenizer(tok, prompt, params)
    texts, deltas = [], []
    i = 0
    while i < len(gen):
        k = 1 if chunked_rng is None else chunked_rng.randint(1, 4)
        stop, n = d.update(gen[i:i + k])
        assert stop is None and n == len(gen[i:i + k])
        i += k
        texts.append(d.output_text)
        deltas.append(d.get_delta())
    deltas.append(d.get_delta(finished=True))
    return d, texts, deltas


def _reference(tok, prompt, gen, params) -> str | None:
    kw = dict(skip_special_tokens=params.skip_special_tokens,
              spaces_between_special_tokens=params.spaces_between_special_tokens)
    before = tok.decode(prompt, **kw)
    after = tok.decode(prompt + gen, **kw)
    if not after.startswith(before):
        return None
    return after[len(before):]


# ---------------------------------------------------------------------- tokenizer.py

def test_eos_token_ids_stories():
    tok = load_tokenizer(STORIES)
    assert eos_token_ids(tok, STORIES) == frozenset({1, 2})


def test_extra_eos_token_ids_are_generation_configs_own():
    # stories260K: the tokenizer's EOS is 2; generation_config.json lists [2, 1]. vLLM makes 1 a
    # stop_token_id (so it is reported as stop_reason) and leaves 2 as plain EOS.
    tok = load_tokenizer(STORIES)
    assert tok.eos_token_id == 2
    assert extra_eos_token_ids(tok, eos_token_ids(tok, STORIES)) == frozenset({1})
    assert extra_eos_token_ids(tok, frozenset({2})) == frozenset()


def test_check_stop_reports_extra_eos_ids_only():
    from kvforge.engine.request import Request, RequestStatus, check_stop

    def finish(last, **sp):
        r = Request("r", [5, 6], SamplingParams(max_tokens=8, **sp), 8, frozenset({1, 2}), frozenset({1}))
        r.output_token_ids = [9, last]
        return check_stop(r, 64), r.stop_reason
    assert finish(2) == (RequestStatus.FINISHED_STOPPED, None)  # the tokenizer's EOS
    assert finish(1) == (RequestStatus.FINISHED_STOPPED, 1)  # generation_config's extra EOS
    assert finish(1, ignore_eos=True) == (None, None)
    assert finish(1, min_tokens=3) == (None, None)
    assert finish(1, stop_token_ids=[1]) == (RequestStatus.FINISHED_STOPPED, 1)


def test_eos_token_ids_without_generation_config(tmp_path):
    tok = load_tokenizer(LLAMA2)
    assert eos_token_ids(tok, LLAMA2) == frozenset({2})
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7}')
    assert eos_token_ids(tok, str(tmp_path)) == frozenset({2, 7})


def test_load_tokenizer_bad_path(tmp_path):
    missing = str(tmp_path / "no_such_model")
    with pytest.raises(ValueError, match=re.escape(missing)):
        load_tokenizer(missing)


# ---------------------------------------------------------------------- detokenizer.py

@pytest.mark.parametrize("skip_special", [True, False])
def test_random_sequences_match_reference(tok, skip_special):
    rng = _rng()
    params = SamplingParams(skip_special_tokens=skip_special)
    for trial in range(40):
        gen = _random_generation(tok, rng, rng.randint(1, 12))
        kind = trial % 3
        if kind == 0:
            prompt = []
        elif kind == 1:
            prompt = [tok.bos_token_id]
        else:
            prompt = tok.encode(rng.choice(UNICODE_SNIPPETS)) + _random_generation(tok, rng, 2)
        d, texts, deltas = _run(tok, prompt, gen, params, chunked_rng=rng if trial % 2 else None)
        ref = _reference(tok, prompt, gen, params)
        assert ref is not None
        assert d.output_text == ref, (prompt, gen)
        if not prompt or (prompt == [tok.bos_token_id] and skip_special):
            assert d.output_text == tok.decode(gen, skip_special_tokens=skip_special)
        assert "".join(deltas) == d.output_text
        if "\ufffd" not in ref:
            assert all("\ufffd" not in t for t in texts), texts
        # texts only grow
        for a, b in zip(texts, texts[1:]):
            assert b.startswith(a)


def test_fully_random_ids_no_spurious_replacement_chars(tok):
    """Any ids, byte tokens included; when the full decode is clean, so is every step."""
    rng = _rng()
    params = SamplingParams()
    byte_ids = sorted(_byte_ids(tok))
    n_clean = 0
    for _ in range(60):
        pool = byte_ids if rng.random() < 0.5 and byte_ids else range(len(tok))
        gen = [rng.choice(pool) for _ in range(rng.randint(1, 10))]
        d, texts, deltas = _run(tok, [tok.bos_token_id], gen, params)
        assert "".join(deltas) == d.output_text
        assert not d.output_text.endswith("\ufffd")
        ref = tok.decode(gen, skip_special_tokens=True)
        if "\ufffd" not in ref:
            n_clean += 1
            assert d.output_text == ref
            assert all("\ufffd" not in t for t in texts)
    assert n_clean > 0


def test_flush_at_the_end_keeps_an_unfinished_character(tok):
    """A sequence that ends inside a UTF-8 character (byte-fallback tokens) keeps that text once
    flushed at its end: the final text is the decode of the output, replacement characters
    included, instead of dropping the last tokens; the deltas still add up to it."""
    rng = _rng()
    byte_ids = sorted(_byte_ids(tok))
    if not byte_ids:
        pytest.skip("no byte-fallback tokens in this vocabulary")
    lead = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE4, 0xF0)]  # 3- and 4-byte leads
    n_held = 0
    for _ in range(30):
        # (a plain token before the leads: a byte run that mixes a finished character with a broken
        # one decodes to one U+FFFD per byte in full, which no incremental decoder reproduces)
        gen = (_random_generation(tok, rng, rng.randint(0, 4)) + [rng.choice(_plain_ids(tok))]
               + [rng.choice(lead) for _ in range(rng.randint(1, 6))])
        d, _, deltas = _run(tok, [tok.bos_token_id], gen, SamplingParams())
        before = d.output_text
        d.flush()
        deltas.append(d.get_delta(finished=True))
        ref = _reference(tok, [tok.bos_token_id], gen, SamplingParams())
        assert d.output_text == ref and ref.endswith("\ufffd"), (gen, d.output_text, ref)
        assert "".join(deltas) == d.output_text
        n_held += len(before) < len(ref)
        d.flush()  # idempotent
        assert d.output_text == ref
    assert n_held > 0


def test_engine_output_keeps_an_unfinished_character():
    """End to end: greedy decoding forced onto a byte-fallback lead token (logit_bias) returns
    the decode of its token ids as text, not an empty string."""
    from kvforge import LLM
    llm = LLM(model=STORIES, dtype="float32", max_num_seqs=2)
    tok = load_tokenizer(STORIES)
    lead = tok.convert_tokens_to_ids("<0xF0>")
    out = llm.generate(["Once"], SamplingParams(temperature=0, max_tokens=6, logit_bias={lead: 100}))[0].outputs[0]
    assert out.token_ids == [lead] * 6
    assert out.text == tok.decode(out.token_ids) and out.text


@pytest.mark.parametrize("text", ["héllo 世界 🤖 naïve", "😀😃🎉 ok", "日本語", "👩‍💻"])
def test_unicode_one_by_one(tok, text):
    gen = tok.encode(text, add_special_tokens=False)
    d, texts, _ = _run(tok, [tok.bos_token_id], gen, SamplingParams())
    assert d.output_text == tok.decode(gen, skip_special_tokens=True)
    for t in texts:
        assert "\ufffd" not in t
        assert d.output_text.startswith(t)


def test_leading_space_uses_prompt_context(tok):
    prompt = tok.encode("Once upon a time")
    gen = tok.encode("Once upon a time there was", add_special_tokens=False)[len(prompt) - 1:]
    d, _, _ = _run(tok, prompt, gen, SamplingParams())
    assert d.output_text == _reference(tok, prompt, gen, SamplingParams())
    assert d.output_text.startswith(" ")
    # Long prompt: only its tail is the context, with the same result.
    long_prompt = tok.encode("hello " * 50 + "Once upon a time")
    d2, _, _ = _run(tok, long_prompt, gen, SamplingParams())
    assert d2.output_text == d.output_text


def test_special_tokens_flag(tok):
    gen = tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_id, tok.bos_token_id] + \
        tok.encode("more", add_special_tokens=False)
    for skip in (True, False):
        for spaces in (True, False):
            p = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
            d, _, _ = _run(tok, [tok.bos_token_id], gen, p)
            assert d.output_text == _reference(tok, [tok.bos_token_id], gen, p)
            assert (tok.eos_token in d.output_text) is (not skip)


def _stop_case(tok, rng):
    """A generation that contains a multi-token stop string, plus where it lies in the text."""
    before = rng.choice(["The cat sat", "héllo wörld", "I like 🤖 robots", "abc 世界"])
    stop = rng.choice([" on the mat", "wörld", "🤖 rob", "界", " sat", "ot"])
    after = rng.choice([" and then", " 世界 more", "!!"])
    gen = tok.encode(before + (stop if stop not in before else "") + after, add_special_tokens=False)
    return gen, stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_tokens(tok, include):
    rng = _rng()
    for _ in range(30):
        gen, stop = _stop_case(tok, rng)
        full = tok.decode(gen, skip_special_tokens=True)
        if stop not in full:
            continue
        params = SamplingParams(stop=["zzzq", stop], include_stop_str_in_output=include)
        # Expected consumed count: the first prefix of gen whose decode contains the stop string.
        expected_n = next(k for k in range(1, len(gen) + 1) if stop in tok.decode(gen[:k], skip_special_tokens=True))
        pos = full.index(stop)
        expected_text = full[:pos + len(stop)] if include else full[:pos]
        for chunked in (False, True):
            d = IncrementalDetokenizer(tok, [tok.bos_token_id], params)
            deltas = []
            i, result = 0, None
            while i < len(gen):
                k = rng.randint(1, 5) if chunked else 1
                chunk = gen[i:i + k]
                matched, n = d.update(chunk)
                deltas.append(d.get_delta())
                if matched is not None:
                    assert matched == stop
                    assert 1 <= n <= len(chunk)
                    result = i + n
                    break
                assert n == len(chunk)
                i += k
            assert result == expected_n, (gen, stop, chunked)
            assert d.output_text == expected_text
            assert d.stop_reason == stop
            assert "".join(deltas) + d.get_delta(finished=True) == expected_text
            assert d.update(gen[result:] or [5]) == (None, 0)


def test_stop_in_middle_of_one_update(tok):
    gen = tok.encode("alpha beta STOP gamma delta", add_special_tokens=False)
    expected_n = next(k for k in range(1, len(gen) + 1) if "STOP" in tok.decode(gen[:k]))
    for include in (False, True):
        d = IncrementalDetokenizer(tok, [tok.bos_token_id], SamplingParams(stop="STOP", include_stop_str_in_output=include))
        matched, n = d.update(gen)
        assert matched == "STOP"
        assert n == expected_n < len(gen)
        assert d.output_text == ("alpha beta STOP" if include else "alpha beta ")


def test_streaming_holds_back_stop_prefix(tok):
    gen = tok.encode("xx ab ab abc yy", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [tok.bos_token_id], SamplingParams(stop=["abc"]))
    deltas = []
    for t in gen:
        matched, n = d.update([t])
        deltas.append(d.get_delta())
        if matched:
            break
    assert d.output_text == "xx ab ab "
    assert "".join(deltas) == "xx ab ab "
    # No stop: the held-back tail is released with finished=True.
    gen2 = tok.encode("hello ab", add_special_tokens=False)
    d2 = IncrementalDetokenizer(tok, [], SamplingParams(stop=["abc"]))
    d2.update(gen2)
    assert d2.get_delta() == "hello "
    assert d2.get_delta(finished=True) == "ab"
    assert d2.output_text == "hello ab"


def test_detokenize_false(tok):
    d = IncrementalDetokenizer(tok, [1], SamplingParams(detokenize=False))  # (stop strings need text: refused)
    ids = tok.encode("a b c", add_special_tokens=False)
    assert d.update(ids) == (None, len(ids))
    assert d.output_text == "" and d.get_delta() == ""


def test_decoded_token(tok):
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    world = tok.encode("hello world", add_special_tokens=False)[-1]
    assert d.decoded_token(world).strip() == tok.decode([world]).strip()
    if tok.convert_ids_to_tokens(world).startswith("\u2581"):
        assert d.decoded_token(world).startswith(" ")
    assert d.decoded_token(tok.eos_token_id) == tok.eos_token
    assert decode_single_token(tok, world) == d.decoded_token(world)


def test_long_generation_is_linear(tok):
    """Many tokens: the window stays small and the result still matches the full decode."""
    rng = _rng()
    gen = []
    while len(gen) < 3000:
        gen += tok.encode(rng.choice(UNICODE_SNIPPETS) + " ", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [tok.bos_token_id], SamplingParams())
    for t in gen:
        d.update([t])
        assert len(d._ids) <= 300
    assert d.output_text == tok.decode(gen, skip_special_tokens=True)
