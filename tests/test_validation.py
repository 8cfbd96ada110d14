"""Bad input gets a clear error naming the field, before any state changes, and never
disturbs requests already in flight (DESIGN.md, Conventions).

Each case: a good request is mid-decode in a shared engine; the bad call must raise
ValueError / pydantic.ValidationError naming the field, leave the engine exactly as it was,
and the good request must then finish with the same output as a clean run, with no KV
block leaked. Prompts and lengths are fresh random draws.
"""
from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from helpers import STORIES_MODEL, assert_no_block_leak, fresh_rng, random_story_prompts, run_engine
from kvforge import LLM, EngineConfig, SamplingParams

MAX_MODEL_LEN = 192
VOCAB = 512
ERRORS = (ValueError, ValidationError)



@pytest.fixture(scope="module")
def llm():
    return LLM(STORIES_MODEL, block_size=16, num_gpu_blocks=48, max_model_len=MAX_MODEL_LEN, scheduler="fcfs")


@pytest.fixture(autouse=True)
def _drain(request):
    """After each test, abort and drain whatever a failed assertion left in the shared engine,
    so one failure does not cascade into the next test."""
    yield
    if "llm" not in request.fixturenames:
        return
    eng = request.getfixturevalue("llm").llm_engine
    eng.abort_request(list(eng.outputs.parents))
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            break
        eng.step()


@pytest.fixture(scope="module")
def good(llm):
    """A good request (prompt, params) and its clean-run output, computed once."""
    rng = fresh_rng("validation-good")
    prompt = random_story_prompts(rng, 1)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 28), ignore_eos=True)
    eng = llm.llm_engine
    eng.add_request("clean", prompt, sp)
    ref = run_engine(eng)["clean"]
    assert_no_block_leak(eng)
    return prompt, sp, ref


def _snapshot(eng) -> dict:
    s = eng.scheduler
    return {
        "parents": sorted(eng.outputs.parents),
        "live": sorted(eng._live),
        "pending": len(eng._pending),
        "waiting": [r.request_id for r in s.waiting],
        "running": [r.request_id for r in s.running],
        "progress": {rid: (r.num_computed_tokens, list(r.output_token_ids), r.status) for rid, r in eng._live.items()},
        "free_blocks": eng.allocator.num_free_blocks,
        "tables": {rid: list(eng.allocator.get_block_table(rid)) for rid in eng._live},
        "unfinished": eng.get_num_unfinished_requests(),
    }


def _check_isolated(llm, good, bad_call, *names: str):
    """Run ``bad_call`` while the good request is mid-decode; return the raised exception."""
    prompt, sp, ref = good
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    eng.add_request("inflight", prompt, sp)
    for _ in range(4):
        eng.step()
    req = eng._live["inflight"]
    assert req.output_token_ids and not req.is_finished, "good request should be mid-decode"
    before = _snapshot(eng)
    with pytest.raises(ERRORS) as ei:
        bad_call()
    msg = str(ei.value)
    for name in names:
        assert name in msg, f"error does not name {name!r}: {msg}"
    assert _snapshot(eng) == before, "a rejected input changed engine state"
    got = run_engine(eng)
    assert set(got) == {"inflight"}, f"unexpected outputs: {sorted(got)}"
    out = got["inflight"]
    assert out.error is None
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert out.outputs[0].text == ref.outputs[0].text
    assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
    assert_no_block_leak(eng)
    assert not eng.has_unfinished_requests()
    return ei.value


# -- bad prompts / sampling params through engine.add_request --------------------------------

def _sp(**kw):
    return SamplingParams(**{"max_tokens": 8, **kw})


def test_empty_token_id_prompt(llm, good):
    eng = llm.llm_engine
    _check_isolated(llm, good, lambda: eng.add_request("bad", {"prompt_token_ids": []}, _sp()), "prompt")
    _check_isolated(llm, good, lambda: eng.add_request("bad", [], _sp()), "prompt")


def test_empty_text_prompt(llm, good):
    """An empty text prompt is empty input even if the tokenizer adds BOS to it."""
    eng = llm.llm_engine
    _check_isolated(llm, good, lambda: eng.add_request("bad", "", _sp()), "prompt")


@pytest.mark.parametrize("prompts", [None, 123, b"Once"], ids=["none", "int", "bytes"])
def test_generate_names_a_prompts_argument_of_the_wrong_type(llm, good, prompts):
    _check_isolated(llm, good, lambda: llm.generate(prompts, _sp(), use_tqdm=False), "prompts")


def test_prompt_plus_max_tokens_exceeds_max_model_len(llm, good):
    rng = fresh_rng("too-long")
    eng = llm.llm_engine
    n = rng.randint(5, 60)
    ids = [1] + [rng.randrange(3, VOCAB) for _ in range(n - 1)]
    over = MAX_MODEL_LEN - n + rng.randint(1, 100)
    # As vLLM's offline engine: accepted, and it stops at max_model_len with "length"
    out = llm.generate([{"prompt_token_ids": ids}], _sp(max_tokens=over, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and out.error is None
    assert len(out.outputs[0].token_ids) == MAX_MODEL_LEN - n
    # A prompt that alone fills max_model_len leaves no room to generate.
    full = [1] + [rng.randrange(3, VOCAB) for _ in range(MAX_MODEL_LEN - 1 + rng.randint(0, 20))]
    for mt in (None, 4):  # the prompt is at fault, whatever max_tokens says
        _check_isolated(llm, good, lambda: eng.add_request("bad", {"prompt_token_ids": full}, _sp(max_tokens=mt)),
                        "prompt:", "max_model_len")


def test_generate_sampling_params_of_the_wrong_type(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate("Once upon a time", {"max_tokens": 3}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_token_ids_outside_vocab(llm, good):
    rng = fresh_rng("oov")
    eng = llm.llm_engine
    bad_id = rng.choice([VOCAB + rng.randint(0, 1000), -rng.randint(1, 50)])
    _check_isolated(llm, good, lambda: eng.add_request("bad", {"prompt_token_ids": [1, 5, bad_id]}, _sp()),
                    "prompt_token_ids")


@pytest.mark.parametrize("field,kwargs", [
    ("temperature", {"temperature": -0.5}),
    ("temperature", {"temperature": -1e-3}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.5}),
    ("n", {"n": 0}),
    ("n", {"n": -2}),
    ("max_tokens", {"max_tokens": 0}),
    # wrong types: refused when the request is added (a bool or float logprobs used to reach
    # the sampler and fail every request of its step)
    ("logprobs", {"logprobs": True}), ("logprobs", {"logprobs": 2.5}), ("prompt_logprobs", {"prompt_logprobs": 1.5}),
    ("max_tokens", {"max_tokens": 3.5}), ("max_tokens", {"max_tokens": "4"}), ("top_k", {"top_k": 2.5}),
    ("top_k", {"top_k": None}), ("min_tokens", {"min_tokens": 2.5}), ("n", {"n": True}),
    ("temperature", {"temperature": True}), ("stop", {"stop": [5]}), ("stop_token_ids", {"stop_token_ids": ["a"]}),
    ("stop_token_ids", {"stop_token_ids": [2.5]}), ("extra_args", {"extra_args": [1]}),
    ("logit_bias", {"logit_bias": {"abc": 1}}), ("seed", {"seed": 2 ** 70}),
    ("logit_bias", {"logit_bias": {5: 1e308}}),  # overflows float32 logits to inf (was token 0)
])
def test_bad_sampling_params(llm, good, field, kwargs):
    eng = llm.llm_engine
    _check_isolated(llm, good, lambda: eng.add_request("bad", "Once upon a time", SamplingParams(**kwargs)), field)


def test_nan_temperature_rejected(llm, good):
    """NaN slips past ``temperature < 0``; it must be rejected like any other bad value."""
    eng = llm.llm_engine
    _check_isolated(llm, good, lambda: eng.add_request("bad", "The cat", SamplingParams(temperature=math.nan)),
                    "temperature")


@pytest.mark.parametrize("bias_id", [VOCAB, VOCAB + 17, -1])
def test_logit_bias_outside_vocab(llm, good, bias_id):
    eng = llm.llm_engine
    _check_isolated(llm, good, lambda: eng.add_request("bad", "The cat", _sp(logit_bias={5: 1.0, bias_id: 2.0})),
                    "logit_bias")


def test_duplicate_in_flight_request_id(llm, good):
    eng = llm.llm_engine
    _check_isolated(llm, good, lambda: eng.add_request("inflight", "The dog", _sp()), "request_id", "inflight")


# -- LLM.generate: a bad prompt anywhere in a batch queues nothing ---------------------------

def test_generate_batch_with_one_bad_prompt_queues_nothing(llm, good):
    rng = fresh_rng("batch")
    prompts = random_story_prompts(rng, 4)
    pos = rng.randrange(1, 5)  # at least one good prompt precedes the bad one
    bad_prompts = prompts[:pos] + [{"prompt_token_ids": []}] + prompts[pos:]
    _check_isolated(llm, good, lambda: llm.generate(bad_prompts, _sp(), use_tqdm=False), "prompt")

    # Bad params for one prompt of the batch (per-prompt SamplingParams list).
    params = [_sp() for _ in prompts]
    bad = rng.randrange(1, len(params))
    params[bad] = _sp(logit_bias={VOCAB + 3: 1.0})
    _check_isolated(llm, good, lambda: llm.generate(prompts, params, use_tqdm=False), "logit_bias")
    with pytest.raises(ValueError, match=rf"^prompts\[{bad}\]: logit_bias"):  # which prompt, then why
        llm.generate(prompts, params, use_tqdm=False)


def test_generate_bad_batch_leaves_engine_idle(llm):
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["Once upon a time", "The cat", {"prompt_token_ids": []}], _sp(), use_tqdm=False)
    assert not eng.has_unfinished_requests(), (
        f"a rejected batch left work behind: {eng.get_num_unfinished_requests()} requests, "
        f"{len(eng._pending)} pending outputs")
    assert eng.step() == [], "a rejected batch still produces outputs on the next step"
    assert not eng.scheduler.has_unfinished_requests()
    assert_no_block_leak(eng)
    # And the LLM still works afterwards.
    outs = llm.generate(["Once upon a time"], _sp(temperature=0.0), use_tqdm=False)
    assert outs[0].finished and outs[0].outputs[0].token_ids


# -- config-time errors (engine build) never touch a running engine --------------------------

@pytest.mark.parametrize("kwargs,names", [
    ({"scheduler": "nope"}, ["scheduler", "nope", "fcfs"]),
    ({"attention_backend": "nope"}, ["attention", "nope", "torch_ref"]),
    ({"kv_allocator": "nope"}, ["kv_allocator", "nope", "paged"]),
    ({"max_num_seqz": 4}, ["max_num_seqz"]),
    ({"scheduler.settings.foo": 1}, ["scheduler.settings.foo"]),
    ({"cache.settings.foo": 1}, ["cache.settings", "foo"]),
    ({"attention.settings.foo": 1}, ["attention.settings", "foo"]),
    # a named backend's settings are checked even where the backend cannot run (triton_paged
    # cannot on stories260K: head_size 8); the message is about the setting, not the device
    ({"attention_backend": "triton_paged", "attention.settings.prefill_num_warps": 3},
     ["attention.settings.prefill_num_warps", "power of two"]),
    ({"scheduler.nosuch": 1}, ["scheduler.nosuch"]),
    ({"max_num_seqs": 0}, ["scheduler.max_num_seqs"]),
    ({"block_size": -16}, ["cache.block_size"]),
    ({"num_speculative_tokens": 3}, ["speculative.num_speculative_tokens", "speculative.method"]),
])
def test_bad_engine_config(llm, good, kwargs, names):
    _check_isolated(llm, good, lambda: LLM(STORIES_MODEL, **kwargs), *names)


def test_unknown_plugin_error_lists_registered():
    with pytest.raises(ValueError) as ei:
        LLM(STORIES_MODEL, scheduler="nope")
    msg = str(ei.value)
    assert "registered schedulers:" in msg and "fcfs" in msg.split("registered schedulers:")[1], msg


def test_config_error_raised_before_reading_weights(monkeypatch):
    """Plugin names and settings are checked before the model is built or weights load."""
    import kvforge.engine.weights as weights

    def boom(*a, **k):
        raise AssertionError("weights were loaded before the config error was raised")

    monkeypatch.setattr(weights, "load_weights", boom)
    for kw in ({"scheduler": "nope"}, {"scheduler.settings.foo": 1}, {"kv_allocator": "nope"}):
        with pytest.raises(ValueError):
            LLM(STORIES_MODEL, **kw)
    with pytest.raises(ValidationError):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "max_num_seqs": 0})


# -- inputs found by a fresh-user trial ------------------------------------------------------

def test_more_bad_inputs_name_their_field(tmp_path):
    import pytest as _pytest

    from kvforge import LLM, SamplingParams
    from kvforge.config import EngineConfig
    with _pytest.raises(ValueError, match="seed"):
        SamplingParams(seed="a")
    with _pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: float("inf")})
    with _pytest.raises(ValueError, match="model.model"):
        LLM(str(tmp_path / "missing"))
    with _pytest.raises(ValueError, match="no such file"):
        EngineConfig.from_sources(tmp_path / "missing.yaml", {})
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: [unclosed\n")
    with _pytest.raises(ValueError, match="cannot parse"):
        EngineConfig.from_sources(bad_yaml, {})
    llm = LLM(STORIES_MODEL, dtype="float32")
    with _pytest.raises(ValueError, match="priority: got 1 values for 2 prompts"):
        llm.generate(["Once", "Lily"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[1])
    with _pytest.raises(ValueError, match="max_logprobs"):
        llm.generate("Once", SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    e = llm.llm_engine
    assert not e.has_unfinished_requests() and e.allocator.num_free_blocks == e.allocator.num_blocks



def test_kv_cache_smaller_than_the_model_lowers_max_model_len(caplog):
    """A cache that cannot hold one request of the model's full length is served with
    max_model_len lowered to what it holds (a start-up warning names the fields), so a longer
    request is refused up front, by name, instead of failing mid-flight; short ones run."""
    with caplog.at_level("WARNING", logger="kvforge"):
        llm = LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=2, block_size=16)
    assert any("max_model_len lowered to 32" in r.getMessage() and "cache.num_gpu_blocks" in r.getMessage()
               for r in caplog.records)
    assert llm.llm_engine.max_model_len == 32
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt: 41 tokens .* max_model_len \(32\)"):
        llm.generate([{"prompt_token_ids": [1, 5, 9]}, {"prompt_token_ids": [1] + [7] * 40}], params, use_tqdm=False)
    (short,) = llm.generate([{"prompt_token_ids": [1, 5, 9]}], params, use_tqdm=False)
    assert len(short.outputs[0].token_ids) == 4 and short.error is None
    assert_no_block_leak(llm.llm_engine)


def test_explicit_max_model_len_beyond_the_kv_cache_is_refused():
    """An explicit model.max_model_len the cache cannot hold is a configuration error naming
    both settings (vLLM refuses to start there too), not a silent cap."""
    with pytest.raises(ValueError, match=r"model.max_model_len 64 exceeds the 32 tokens .* cache.num_gpu_blocks"):
        LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=2, block_size=16, max_model_len=64)


def test_small_kv_budget_warning_names_the_field_that_was_set(caplog):
    with caplog.at_level("WARNING", logger="kvforge"):
        LLM(STORIES_MODEL, dtype="float32", kv_cache_memory_bytes=200_000)
    msgs = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert msgs and "cache.kv_cache_memory_bytes" in msgs[0] and "gpu_memory_utilization" not in msgs[0]


@pytest.mark.parametrize("value", [float("inf"), -0.1, float("nan")])
def test_step_overhead_must_be_finite_and_non_negative(value):
    with pytest.raises(ValidationError, match="step_overhead"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "speculative.step_overhead": value})


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_priority_must_be_an_integer_and_a_failed_generate_leaves_nothing_queued(scheduler):
    """A non-integer priority is refused up front whatever the scheduler (a priority scheduler
    compares them: one bad value used to break every later step); and when a generate() call
    fails midway, its requests are aborted, so the next call runs as if it never happened."""
    llm = LLM(STORIES_MODEL, dtype="float32", scheduler=scheduler, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3)
    ref = llm.generate(["Lily"], params, use_tqdm=False)[0].outputs[0].token_ids
    for bad in (None, "abc", 1.5, True):
        with pytest.raises(ValueError, match=r"prompts\[0\]: priority: must be an integer"):
            llm.generate(["Hi", "Lily"], params, priority=[bad, 2], use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected step failure")
        return real_step()
    engine.step = failing_step
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["Hi", "Once upon a time", "Lily"], params, use_tqdm=False)
    engine.step = real_step
    st = engine.stats()  # aborted at once, not left queued ahead of the next call (their blocks back)
    assert st["num_waiting"] == 0 and st["num_running"] == 0, st
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    assert llm.generate(["Lily"], params, use_tqdm=False)[0].outputs[0].token_ids == ref
    assert not engine.has_unfinished_requests()
    assert_no_block_leak(engine)
