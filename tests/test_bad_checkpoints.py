"""Broken checkpoint folders and odd prompt shapes are refused with a message naming the file,
tensor, key or setting, before the engine runs anything (what a fresh user hit in session 16)."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from helpers import STORIES_MODEL
from kvforge import LLM, SamplingParams


def _copy_model(tmp_path, name="m"):
    d = tmp_path / name
    shutil.copytree(STORIES_MODEL, d)
    return d


def test_truncated_safetensors_names_the_file(tmp_path):
    d = _copy_model(tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    cut = torch.randint(200, len(data) // 2, (1,)).item()  # (inside the header or the tensor data)
    f.write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"checkpoint file .*model\.safetensors"):
        LLM(str(d), dtype="float32")


def test_tensor_outside_every_module_is_named(tmp_path):
    d = _copy_model(tmp_path)
    save_file({"foo": torch.randn(2)}, str(d / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'foo' does not belong to"):
        LLM(str(d), dtype="float32")


def test_missing_config_json_and_tokenizer_folder_are_named(tmp_path):
    d = _copy_model(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match=r"model.model: no config.json in"):
        LLM(str(d), dtype="float32")
    with pytest.raises(ValueError, match=r"could not load a tokenizer from '/nonexistent/tok': not a directory"):
        LLM(STORIES_MODEL, dtype="float32", tokenizer="/nonexistent/tok")


def test_prompt_shapes_and_keys_are_named():
    llm = LLM(STORIES_MODEL, dtype="float32", max_num_seqs=2)
    params = SamplingParams(temperature=0, max_tokens=2)
    for bad, msg in (({"prompt": "Hi", "bogus": 1}, r"prompt: unknown key\(s\) \['bogus'\]"),
                     ({"prompt": 5}, r"prompt: the 'prompt' of a dict prompt must be a string"),
                     ({"prompt": None}, r"prompt: the 'prompt' of a dict prompt must be a string"),
                     ({"prompt_token_ids": [1, "a"]}, r"prompt_token_ids: must be a list of ints")):
        with pytest.raises(ValueError, match=msg):
            llm.generate([bad], params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt: expected a string, a list of token ids or a dict, got float"):
        llm.llm_engine.add_request("r", 1.5, params)
    assert not llm.llm_engine.has_unfinished_requests()


def test_non_chunking_scheduler_refuses_a_prompt_over_the_token_budget_up_front():
    llm = LLM(STORIES_MODEL, dtype="float32", scheduler="fcfs", max_num_batched_tokens=4)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt: 7 tokens exceed scheduler.max_num_batched_tokens "
                                         r"\(4\) and this scheduler does not chunk prefills \(scheduler 'fcfs'\)"):
        llm.generate([{"prompt_token_ids": [1, 5, 9]}, {"prompt_token_ids": [1] + [7] * 6}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and out.error is None
    chunking = LLM(STORIES_MODEL, dtype="float32", max_num_batched_tokens=4)  # the default scheduler splits it
    out = chunking.generate([{"prompt_token_ids": [1] + [7] * 6}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and out.error is None


def test_a_tokenizer_larger_than_the_models_vocabulary_is_warned_about(caplog):
    """Another model's tokenizer (llama2's 32000 tokens for a 512-token model) would make most
    text fail at request time; start-up says so, naming model.tokenizer."""
    import os
    llama2 = os.path.join(os.path.dirname(STORIES_MODEL), "..", "tokenizers", "llama2")
    if not os.path.isdir(llama2):
        pytest.fail(f"missing shared tokenizer {llama2}")
    with caplog.at_level("WARNING", logger="kvforge"):
        LLM(STORIES_MODEL, dtype="float32", tokenizer=llama2, num_gpu_blocks=8)
    assert any("model.tokenizer" in r.message and "32000 tokens" in r.message and "vocab_size is 512" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvforge"):
        LLM(STORIES_MODEL, dtype="float32", num_gpu_blocks=8)
    assert not any("model.tokenizer" in r.message for r in caplog.records)
