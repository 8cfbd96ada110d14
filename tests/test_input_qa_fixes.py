"""Offline fixes from an adversarial QA pass (session 19): numbers past float's range, an
absurd ``n``, duplicate stop ids, parameters changed after construction, an out-of-range seed
and a KV block count larger than the device. Each is a ValueError naming the field, raised
before any engine state changes."""
from __future__ import annotations

import logging
import pytest

from kvforge import SamplingParams
from kvforge.engine.sampling_params import MAX_N
from helpers import STORIES_MODEL
from test_server_common import reference_llm


@pytest.mark.parametrize("kw,field", [(dict(temperature=10**400), "temperature"), (dict(top_p=-10**400), "top_p"),
                                      (dict(repetition_penalty=10**400), "repetition_penalty"),
                                      (dict(logit_bias={1: 10**400}), "logit_bias"),
                                      (dict(logit_bias={float("inf"): 1.0}), "logit_bias"),
                                      (dict(n=MAX_N + 1), "n")])
def test_out_of_range_numbers_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}: ") as exc:
        SamplingParams(**kw)
    assert len(str(exc.value)) < 300  # a 400-digit value is not echoed whole


def test_n_up_to_the_limit_and_stop_ids_deduplicated():
    assert SamplingParams(n=MAX_N).n == MAX_N
    assert SamplingParams(stop_token_ids=[5, 3, 5] * 10_000 + [7]).stop_token_ids == [5, 3, 7]


def test_params_changed_after_construction_are_checked_again():
    llm = reference_llm()
    sp = SamplingParams(max_tokens=3)
    sp.logit_bias = {"x": 1}
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(["Once"], sp, use_tqdm=False)
    sp = SamplingParams(max_tokens=3)
    sp.n = 10**8  # refused before the engine builds a sequence per sample
    with pytest.raises(ValueError, match="n: must be <= "):
        llm.generate(["Once"], sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued
    out = llm.generate(["Once"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_seed_out_of_range_names_the_field(capsys):
    from kvforge.entrypoints.cli import main
    rc = main(["generate", "--model", STORIES_MODEL, "--seed", str(2**64), "Once"])
    assert rc == 2 and "model.seed" in capsys.readouterr().err


def test_num_gpu_blocks_beyond_the_device_is_refused():
    from kvforge import LLM
    with pytest.raises(ValueError, match="^cache.num_gpu_blocks: 1000000000000 blocks"):
        LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=10**12)


def test_gpu_memory_utilization_that_does_not_apply_is_named(caplog):
    """A QA finding: --gpu-memory-utilization on the CPU was silently ignored."""
    from helpers import make_engine
    with caplog.at_level(logging.WARNING, logger="kvforge"):
        make_engine(device="cpu", gpu_memory_utilization=0.5)
    assert "cache.gpu_memory_utilization 0.5 is not used: it applies to CUDA devices" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvforge"):
        make_engine(device="cpu", kv_cache_memory_bytes=1 << 20)
    assert "gpu_memory_utilization" not in caplog.text  # not set: nothing to say


def test_generate_from_several_threads_runs_each_call_whole():
    """A QA finding: two threads calling generate on one LLM stepped the engine together; a step
    failed for one and the other waited forever for outputs the first had taken."""
    import threading

    from kvforge import LLM
    llm = LLM(STORIES_MODEL, dtype="float32", max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=24)
    prompts = [["Once upon a time", "The cat"], ["A little girl", "One day, a dog"], ["Tom had a ball"]]
    ref = [[o.outputs[0].token_ids for o in llm.generate(p, sp, use_tqdm=False)] for p in prompts]
    got, errors = [None] * len(prompts), []

    def run(i):
        try:
            got[i] = [o.outputs[0].token_ids for o in llm.generate(prompts[i], sp, use_tqdm=False)]
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert got == ref
    assert llm.llm_engine.allocator.num_free_blocks == llm.llm_engine.allocator.num_blocks


def test_numpy_integers_work_everywhere_an_int_does():
    """A QA finding: seed=np.int64(3) passed validation, then generate raised a bare TypeError."""
    import numpy as np

    from kvforge import LLM
    sp = SamplingParams(temperature=1.0, seed=np.int64(3), max_tokens=np.int32(6), n=np.int64(2),
                        stop_token_ids=[np.int64(5)])
    assert type(sp.seed) is int and type(sp.max_tokens) is int and type(sp.stop_token_ids[0]) is int
    llm = LLM(STORIES_MODEL, dtype="float32")
    a = llm.generate("Once upon a time", sp, use_tqdm=False)[0]
    b = llm.generate("Once upon a time", SamplingParams(temperature=1.0, seed=3, max_tokens=6, n=2,
                                                        stop_token_ids=[5]), use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_min_tokens_holds_back_stop_strings_and_stop_needs_detokenize():
    """QA findings: a stop string ended the text inside min_tokens (vLLM ignores stop strings
    there), and stop strings were silently ignored with detokenize=False (vLLM refuses them)."""
    from kvforge import LLM
    llm = LLM(STORIES_MODEL, dtype="float32")
    free = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    ids, text = free.outputs[0].token_ids, free.outputs[0].text
    tok = llm.get_tokenizer()
    # a stop string that occurs early in the greedy text and again later
    first = next(a for a in range(len(text) - 1) if text.find(text[a:a + 2], a + 12) > 0)
    stop = text[first:first + 2]
    k = next(j for j in range(1, len(ids) + 1) if len(tok.decode(ids[:j])) > first)  # tokens to reach it
    got = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert got.text == text[:first] and got.stop_reason == stop
    held = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=40, stop=[stop], min_tokens=k),
                        use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) > k and held.token_ids == ids[:len(held.token_ids)]  # the same greedy run
    searched_from = len(tok.decode(ids[:k]))
    later = text.find(stop, searched_from)
    assert later > first and held.text == text[:later] and held.stop_reason == stop, (held.text, text, k)
    with pytest.raises(ValueError, match="stop: stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_draft_model_path_errors_name_the_field():
    """A QA finding: a wrong draft path gave a Hugging Face Hub message about repo ids."""
    from kvforge import LLM
    with pytest.raises(ValueError, match=r"^speculative.settings.model: '/nonexistent' is not a directory"):
        LLM(STORIES_MODEL, dtype="float32", num_speculative_tokens=2,
            speculative={"method": "draft_model", "settings": {"model": "/nonexistent"}})


def test_settings_errors_read_without_pydantic_wording():
    """A QA finding: 'speculative.settings.: Value error, prompt_lookup_min (5) must be ...'."""
    from kvforge import LLM
    with pytest.raises(ValueError) as ei:
        LLM(STORIES_MODEL, dtype="float32", num_speculative_tokens=2,
            speculative={"method": "ngram", "settings": {"prompt_lookup_min": 5, "prompt_lookup_max": 3}})
    assert str(ei.value).endswith("speculative.settings: prompt_lookup_min (5) must be <= prompt_lookup_max (3)")


def test_a_bare_list_of_token_ids_is_explained():
    from kvforge import LLM
    llm = LLM(STORIES_MODEL, dtype="float32")
    with pytest.raises(ValueError, match=r"^prompts: a list of integers would be that many one-token prompts; pass "
                                         r"token ids as \{'prompt_token_ids': \[...\]\}"):
        llm.generate([1, 403, 407], use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 403, 407]}, SamplingParams(max_tokens=2), use_tqdm=False)
    assert out[0].prompt_token_ids == [1, 403, 407]


def test_a_flag_name_as_a_config_file_key_points_to_its_path(tmp_path, capsys):
    from kvforge.entrypoints.cli import main as cli_main
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model:\n  model: {STORIES_MODEL}\nmax_num_seqs: 4\n")
    assert cli_main(["generate", "--config", str(cfg), "--max-tokens", "2", "Once"]) == 2
    assert ("max_num_seqs: Extra inputs are not permitted (in a config file it is scheduler.max_num_seqs)"
            in capsys.readouterr().err)


def test_workers_do_not_warn_about_defaults(caplog):
    """A QA finding: every TP worker and DP replica warned "cache.gpu_memory_utilization 0.9 is
    not used" though nobody set it: the config reached them as a full dump, where every field
    reads as set. They now get only the non-default fields (EngineConfig.to_transfer, what the
    mp / ray executors and the replicas send), so the config a worker rebuilds warns only about
    what the user set, and keeps every value. (Checked on the rebuilt config: a worker's stderr
    goes wherever its forkserver's went, which pytest cannot always capture.)"""
    import torch

    from kvforge.config import EngineConfig
    from kvforge.engine.sizing import num_kv_blocks
    for over, warns in (({}, False), ({"gpu_memory_utilization": 0.5}, True)):
        cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "device": "cpu", "tensor_parallel_size": 2,
                                               "kv_cache_memory_bytes": 1 << 20, "max_num_seqs": 256, **over})
        again = EngineConfig.model_validate(cfg.to_transfer())
        assert again == cfg
        assert ("gpu_memory_utilization" in again.cache.model_fields_set) is warns
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvforge"):
            assert num_kv_blocks(again, torch.device("cpu"), 1024, 128) == 1024
        assert ("gpu_memory_utilization" in caplog.text) is warns, caplog.text
    full = EngineConfig.model_validate(cfg.model_dump())  # (what they got before: every field "set")
    assert "gpu_memory_utilization" in full.cache.model_fields_set
