"""EngineConfig from YAML/JSON files + flat overrides, field-naming errors, and the
``kvforge generate`` CLI (``--json`` output with vLLM field names, ``--config``)."""
from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError

from helpers import STORIES_MODEL, fresh_rng, random_story_prompts
from kvforge import LLM, EngineConfig, SamplingParams
from kvforge.config import load_file
from kvforge.entrypoints.cli import main as cli_main



@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("KVFORGE_PLUGINS", raising=False)
    monkeypatch.delenv("KVFORGE_DISABLE_PLUGINS", raising=False)


def _file_data(rng) -> dict:
    return {
        "model": {"model": STORIES_MODEL, "dtype": "float32", "max_model_len": rng.choice([128, 256, 384]),
                  "seed": rng.randrange(1000)},
        "cache": {"block_size": rng.choice([8, 16, 32]), "num_gpu_blocks": rng.randint(20, 200)},
        "scheduler": {"name": "fcfs", "max_num_seqs": rng.randint(2, 64),
                      "max_num_batched_tokens": rng.choice([512, 1024, 4096])},
        "attention": {"backend": "torch_ref"},
    }


def _write(tmp_path, data: dict, fmt: str):
    path = tmp_path / f"cfg.{fmt}"
    path.write_text(yaml.safe_dump(data) if fmt in ("yaml", "yml") else json.dumps(data))
    return path


@pytest.mark.parametrize("fmt", ["yaml", "yml", "json"])
def test_config_from_file(tmp_path, fmt):
    rng = fresh_rng(fmt)
    data = _file_data(rng)
    cfg = EngineConfig.from_sources(_write(tmp_path, data, fmt))
    assert cfg.model.model == STORIES_MODEL
    assert cfg.model.max_model_len == data["model"]["max_model_len"]
    assert cfg.model.seed == data["model"]["seed"]
    assert cfg.cache.block_size == data["cache"]["block_size"]
    assert cfg.cache.num_gpu_blocks == data["cache"]["num_gpu_blocks"]
    assert cfg.scheduler.name == "fcfs"
    assert cfg.scheduler.max_num_seqs == data["scheduler"]["max_num_seqs"]
    assert cfg.scheduler.max_num_batched_tokens == data["scheduler"]["max_num_batched_tokens"]
    assert cfg.attention.backend == "torch_ref"
    # Unset fields keep their defaults.
    assert cfg.cache.enable_prefix_caching is False


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_flat_overrides_beat_file(tmp_path, fmt):
    rng = fresh_rng(fmt)
    data = _file_data(rng)
    path = _write(tmp_path, data, fmt)
    seqs = data["scheduler"]["max_num_seqs"] + rng.randint(1, 10)
    block = {8: 16, 16: 32, 32: 8}[data["cache"]["block_size"]]
    cfg = EngineConfig.from_sources(path, {"max_num_seqs": seqs, "block_size": block, "max_model_len": 64,
                                           "scheduler.settings.x": 1, "dtype": None})
    assert cfg.scheduler.max_num_seqs == seqs
    assert cfg.cache.block_size == block
    assert cfg.model.max_model_len == 64
    assert cfg.scheduler.settings == {"x": 1}
    assert cfg.model.dtype == "float32"  # None override is ignored, the file value stays
    # untouched file values survive
    assert cfg.cache.num_gpu_blocks == data["cache"]["num_gpu_blocks"]
    assert cfg.scheduler.max_num_batched_tokens == data["scheduler"]["max_num_batched_tokens"]
    assert cfg.model.model == STORIES_MODEL
    # LLM(config=..., **flat) uses the same precedence.
    llm = LLM(STORIES_MODEL, config=str(path), max_num_seqs=seqs, num_gpu_blocks=48)  # (48 x 8 >= the file's max_model_len)
    assert llm.llm_engine.config.scheduler.max_num_seqs == seqs
    assert llm.llm_engine.allocator.num_blocks == 48
    assert llm.llm_engine.allocator.block_size == data["cache"]["block_size"]


@pytest.mark.parametrize("section,key,value,field", [
    ("scheduler", "max_num_seqs", 0, "scheduler.max_num_seqs"),
    ("scheduler", "max_num_batched_tokens", -5, "scheduler.max_num_batched_tokens"),
    ("cache", "block_size", "abc", "cache.block_size"),
    ("cache", "gpu_memory_utilization", 1.5, "cache.gpu_memory_utilization"),
    ("model", "dtype", "float64", "model.dtype"),
    ("model", "max_model_len", 0, "model.max_model_len"),
    ("scheduler", "no_such_option", 1, "scheduler.no_such_option"),
])
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_file_errors_name_field(tmp_path, fmt, section, key, value, field):
    data = _file_data(fresh_rng())
    data[section][key] = value
    with pytest.raises(ValidationError) as ei:
        EngineConfig.from_sources(_write(tmp_path, data, fmt))
    assert field in str(ei.value), str(ei.value)


def test_yaml_booleans_are_not_numbers(tmp_path):
    # YAML reads ``yes`` as true, and pydantic's lax mode would read true as 1 (one sequence)
    path = tmp_path / "c.yaml"
    path.write_text(f"model:\n  model: {STORIES_MODEL}\nscheduler:\n  max_num_seqs: yes\n")
    with pytest.raises(ValidationError, match=r"(?s)scheduler\.max_num_seqs.*expected a number, got the boolean True"):
        EngineConfig.from_sources(path)
    path.write_text(f"model:\n  model: {STORIES_MODEL}\ncache:\n  gpu_memory_utilization: on\n")
    with pytest.raises(ValidationError, match=r"cache\.gpu_memory_utilization"):
        EngineConfig.from_sources(path)
    with pytest.raises(ValidationError, match=r"scheduler\.max_num_seqs"):  # keywords / flags too
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "max_num_seqs": True})
    # booleans stay booleans, and numbers in quotes still read as numbers
    path.write_text(f"model:\n  model: {STORIES_MODEL}\n  enforce_eager: yes\nscheduler:\n  max_num_seqs: '8'\n")
    cfg = EngineConfig.from_sources(path)
    assert cfg.model.enforce_eager is True and cfg.scheduler.max_num_seqs == 8


def test_booleans_inside_sequences_and_plugin_settings_are_not_numbers():
    import numpy as np
    from kvforge.engine.resolve import validate_plugin_settings
    from kvforge.plugin_manager import load_registry
    with pytest.raises(ValidationError, match=r"request_choices\.priorities"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "request_choices.priorities": [True, True]})
    with pytest.raises(ValidationError, match=r"scheduler\.max_num_seqs"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "max_num_seqs": np.bool_(True)})
    assert EngineConfig.from_sources(None, {"model": STORIES_MODEL, "request_choices.priorities": [0, 3]}
                                     ).request_choices.priorities == (0, 3)
    # a plugin's own settings model: chunked_prefill's threshold read True as 1 token per step
    spec = load_registry().get("scheduler", "chunked_prefill")
    with pytest.raises(ValueError, match=r"scheduler\.settings\.long_prefill_token_threshold: expected a number"):
        validate_plugin_settings(spec, {"long_prefill_token_threshold": True}, "scheduler.settings")
    assert validate_plugin_settings(spec, {"long_prefill_token_threshold": 64},
                                    "scheduler.settings").long_prefill_token_threshold == 64


def test_override_errors_name_field(tmp_path):
    path = _write(tmp_path, _file_data(fresh_rng()), "yaml")
    with pytest.raises(ValidationError, match=r"scheduler\.max_num_seqs"):
        EngineConfig.from_sources(path, {"max_num_seqs": 0})
    with pytest.raises(ValueError, match="max_num_seqz"):
        EngineConfig.from_sources(path, {"max_num_seqz": 4})
    with pytest.raises(ValidationError, match=r"nosuchsection"):
        EngineConfig.from_sources(path, {"nosuchsection.x": 1})


def test_section_shorthand_in_files_and_keywords(tmp_path):
    """``quantization: fp8`` (as the README words it) and friends: a bare string stands for the
    section's main field; a dict keyword (``LLM(quantization={...})``) sets the whole section."""
    (tmp_path / "c.yaml").write_text("quantization: int8\nscheduler: fcfs\nattention: torch_ref\n")
    cfg = EngineConfig.from_sources(tmp_path / "c.yaml", {"model": STORIES_MODEL,
                                                         "quantization.settings.backend": "reference"})
    assert (cfg.quantization.method, cfg.quantization.settings) == ("int8", {"backend": "reference"})
    assert (cfg.scheduler.name, cfg.attention.backend) == ("fcfs", "torch_ref")
    cfg = EngineConfig.from_sources(tmp_path / "c.yaml", {"model": STORIES_MODEL,
                                                         "quantization": {"settings": {"fast_accum": False}}})
    assert (cfg.quantization.method, cfg.quantization.settings) == ("int8", {"fast_accum": False})
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "quantization": {"method": "fp8"}})
    assert cfg.quantization.method == "fp8"
    # section names work as keywords / --set keys too
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "attention": "torch_ref", "speculative": "ngram",
                                           "num_speculative_tokens": 2})
    assert (cfg.attention.backend, cfg.speculative.method) == ("torch_ref", "ngram")
    # a section keyword merges its settings into the file's, and flat / dotted options win
    # over it whatever the keyword order
    (tmp_path / "q.yaml").write_text("quantization: {method: fp8, settings: {backend: reference, fast_accum: false}}\n")
    cfg = EngineConfig.from_sources(tmp_path / "q.yaml", {"model": STORIES_MODEL,
                                                         "quantization": {"settings": {"fast_accum": True}}})
    assert cfg.quantization.settings == {"backend": "reference", "fast_accum": True}
    for kw in ({"max_num_seqs": 4, "scheduler": {"name": "fcfs", "max_num_seqs": 8}},
               {"scheduler": {"name": "fcfs", "max_num_seqs": 8}, "max_num_seqs": 4}):
        cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, **kw})
        assert (cfg.scheduler.name, cfg.scheduler.max_num_seqs) == ("fcfs", 4), kw
    keyword = {"method": "fp8", "settings": {"fast_accum": False}}
    cfg = EngineConfig.from_sources(None, {"model": STORIES_MODEL, "quantization.settings.backend": "reference",
                                           "quantization": keyword})
    assert cfg.quantization.settings == {"backend": "reference", "fast_accum": False}
    assert keyword == {"method": "fp8", "settings": {"fast_accum": False}}  # the caller's dict is not changed
    with pytest.raises(ValidationError, match=r"quantization\.bogus"):
        EngineConfig.from_sources(None, {"model": STORIES_MODEL, "quantization": {"method": "fp8", "bogus": 1}})
    with pytest.raises(ValidationError, match=r"quantization\n.*valid dictionary"):
        EngineConfig.model_validate({"model": {"model": STORIES_MODEL}, "quantization": 5})


def test_switching_plugin_drops_the_files_settings_for_the_old_one(tmp_path):
    """A file's plugin settings belong to the plugin the file names: an override that picks
    another plugin starts from no settings (plus its own), one that keeps it merges over them."""
    (tmp_path / "q.yaml").write_text("quantization: {method: fp8, settings: {backend: reference, fast_accum: false}}\n"
                                     "scheduler: {settings: {policy: x}}\ncache: {settings: {a: 1}}\n")

    def cfg(**kw):
        return EngineConfig.from_sources(tmp_path / "q.yaml", {"model": STORIES_MODEL, **kw})
    assert cfg().quantization.settings == {"backend": "reference", "fast_accum": False}
    assert cfg(quantization="int8").quantization.settings == {}
    assert cfg(**{"quantization": "int8", "quantization.settings.backend": "torch"}).quantization.settings == {
        "backend": "torch"}
    assert cfg(quantization={"method": "int8", "settings": {"backend": "torch"}}).quantization.settings == {
        "backend": "torch"}
    assert cfg(**{"quantization.method": "fp8", "quantization.settings.fast_accum": True}).quantization.settings == {
        "backend": "reference", "fast_accum": True}  # the same plugin named again: merged
    # a section without its selector in the file: the settings belong to the default plugin
    assert cfg().scheduler.settings == {"policy": "x"}
    assert cfg(scheduler="chunked_prefill").scheduler.settings == {"policy": "x"}
    assert cfg(scheduler="fcfs").scheduler.settings == {}
    assert cfg(kv_allocator="paged").cache.settings == {"a": 1}
    assert cfg(kv_allocator="other").cache.settings == {}
    # an explicit empty dict clears the file's settings (a merge of {} would keep them)
    assert cfg(**{"quantization.settings": {}}).quantization.settings == {}
    assert cfg(quantization={"settings": {}}).quantization.settings == {}
    # beside 'auto' (or no method) the file picked no plugin: its settings go to the one chosen
    (tmp_path / "a.yaml").write_text("quantization: {settings: {int4_layout: checkpoint}}\n"
                                     "attention: {backend: auto, settings: {prefill_block_m: 32}}\n")
    a = EngineConfig.from_sources(tmp_path / "a.yaml", {"model": STORIES_MODEL, "quantization": "awq",
                                                         "attention_backend": "triton_paged"})
    assert a.quantization.settings == {"int4_layout": "checkpoint"}
    assert a.attention.settings == {"prefill_block_m": 32}


def test_dropped_settings_are_reported(tmp_path, caplog):
    (tmp_path / "s.yaml").write_text("scheduler: {name: fcfs, settings: {x: 1}}\n")
    with caplog.at_level("WARNING", logger="kvforge"):
        EngineConfig.from_sources(tmp_path / "s.yaml", {"model": STORIES_MODEL, "scheduler": "sjf"})
    assert "scheduler.settings from" in caplog.text and "'fcfs'" in caplog.text and "'sjf'" in caplog.text


def test_file_top_level_errors(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        EngineConfig.from_sources(tmp_path / "list.yaml")
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump({**_file_data(fresh_rng()), "schedular": {}}))
    with pytest.raises(ValidationError, match="schedular"):
        EngineConfig.from_sources(tmp_path / "extra.yaml")
    (tmp_path / "nomodel.yaml").write_text(yaml.safe_dump({"cache": {"block_size": 16}}))
    with pytest.raises(ValidationError, match="model"):
        EngineConfig.from_sources(tmp_path / "nomodel.yaml")


# -- CLI -------------------------------------------------------------------------------------

def _reference(prompts, max_tokens, **engine_kw):
    llm = LLM(STORIES_MODEL, scheduler="fcfs", **engine_kw)
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)


def test_generate_json_uses_vllm_field_names(capsys):
    rng = fresh_rng("json")
    prompts = random_story_prompts(rng, 2)
    max_tokens = rng.randint(5, 20)
    capsys.readouterr()  # drop the seed line
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--scheduler", "fcfs", "--json",
                   "--max-tokens", str(max_tokens), *prompts])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)  # stdout is only the JSON document
    assert isinstance(data, list) and len(data) == len(prompts)
    ref = _reference(prompts, max_tokens)
    for item, prompt, r in zip(data, prompts, ref):
        assert {"request_id", "prompt", "prompt_token_ids", "outputs", "finished"} <= set(item)
        assert item["prompt"] == prompt
        assert item["prompt_token_ids"] == r.prompt_token_ids and item["prompt_token_ids"][0] == 1  # BOS
        assert item["finished"] is True
        out = item["outputs"][0]
        assert {"index", "text", "token_ids", "finish_reason", "cumulative_logprob", "logprobs",
                "stop_reason"} <= set(out)
        assert out["index"] == 0
        assert out["token_ids"] == r.outputs[0].token_ids
        assert out["text"] == r.outputs[0].text and out["text"]
        assert out["finish_reason"] in ("stop", "length")
        assert out["finish_reason"] == r.outputs[0].finish_reason
        if out["finish_reason"] == "length":
            assert len(out["token_ids"]) == max_tokens


def test_generate_with_config_file(tmp_path, capsys):
    data = {"model": {"model": STORIES_MODEL, "max_model_len": 40},
            "cache": {"block_size": 8, "num_gpu_blocks": 30}, "scheduler": {"name": "fcfs", "max_num_seqs": 2}}
    cfg = _write(tmp_path, data, "yaml")
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--config", str(cfg), "--max-tokens", "12", "--json",
                   "Once upon a time"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    out = json.loads(captured.out)[0]["outputs"][0]
    ref = _reference(["Once upon a time"], 12, block_size=8, num_gpu_blocks=30)
    assert out["token_ids"] == ref[0].outputs[0].token_ids
    assert "there was a little girl" in out["text"]

    # The file is really applied: its max_model_len (40) stops a longer request there...
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--config", str(cfg), "--max-tokens", "64",
                   "--ignore-eos", "--json", "Once upon a time"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    prompt_len = len(json.loads(captured.out)[0]["prompt_token_ids"])
    out = json.loads(captured.out)[0]["outputs"][0]
    assert len(out["token_ids"]) == 40 - prompt_len and out["finish_reason"] == "length", out
    # ...and a flag beats it.
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--config", str(cfg), "--max-model-len", "128",
                   "--max-tokens", "64", "--json", "Once upon a time"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert len(json.loads(captured.out)[0]["outputs"][0]["token_ids"]) > 12


def test_generate_with_config_file_naming_the_model(tmp_path, capsys):
    """``kvforge generate --config cfg.yaml PROMPT``: the model may come from the file alone."""
    cfg = _write(tmp_path, {"model": {"model": STORIES_MODEL}, "scheduler": {"name": "fcfs"}}, "yaml")
    try:
        rc = cli_main(["generate", "--config", str(cfg), "--max-tokens", "8", "Once upon a time"])
    except SystemExit as e:  # argparse refusing the command line
        rc = e.code
    captured = capsys.readouterr()
    assert rc == 0, f"exit {rc}: {captured.err}"
    assert captured.out.startswith("Once upon a time,"), captured.out


def test_generate_bad_flag_value_names_field(capsys):
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--max-num-seqs", "0", "Once upon a time"])
    err = capsys.readouterr().err
    assert rc != 0
    assert "scheduler.max_num_seqs" in err and "kvforge: error" in err, err
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--set", "scheduler.settings.foo=1", "Once"])
    err = capsys.readouterr().err
    assert rc != 0 and "scheduler.settings.foo" in err, err
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--set", "foo", "Once"])
    err = capsys.readouterr().err
    assert rc == 2 and "kvforge: error: --set expects KEY=VALUE" in err, err
    # engine-config errors read as one line per field, not a pydantic dump
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--dtype", "float8", "Once"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("kvforge: error: invalid config: model.dtype: ") and err.count("\n") == 1, err
    assert "errors.pydantic.dev" not in err, err
    # a missing model says where one comes from
    rc = cli_main(["generate", "Once"])
    err = capsys.readouterr().err
    assert rc == 2 and "model: Field required (pass --model DIR, LLM('DIR') in Python, or set model.model" in err, err
    with pytest.raises(ValueError, match=r"^invalid config: model: Field required \(pass --model DIR"):
        LLM()


def test_generate_refuses_a_prompt_the_kv_cache_cannot_hold(capsys):
    """One KV block of 16 tokens: max_model_len is lowered to 16, so a longer prompt is refused
    before anything runs, with exit status 2 and a message naming max_model_len."""
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--num-gpu-blocks", "1", "--block-size", "16",
                   "Once upon a time there was a little girl named Lily who loved to play"])
    err = capsys.readouterr().err
    assert rc == 2 and "max_model_len (16)" in err, err
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--max-tokens", "4", "Once"])
    assert rc == 0


def test_generate_stop_reads_shell_escapes():
    """A QA finding: `--stop '\\n'` (a backslash and an n from the shell) never matched a newline."""
    from kvforge.entrypoints.cli import _sampling_from_args, build_parser
    args = build_parser().parse_args(["generate", "--model", STORIES_MODEL, "--stop", "\\n", "--stop", "a\\\\nb",
                                      "--stop", "tab\\there", "--stop", "\\x", "Once"])
    assert _sampling_from_args(args).stop == ["\n", "a\\nb", "tab\there", "\\x"]


def test_cli_conflicts_and_config_file_forms(tmp_path, capsys):
    """QA findings: --set silently overrode the flag for the same field; a YAML file not named
    .yaml was parsed as JSON; --speculative-method none (the per-request opt-out's name) was an
    unknown drafter."""
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--max-num-seqs", "4", "--set", "scheduler.max_num_seqs=8",
                   "Once"])
    assert rc == 2 and "scheduler.max_num_seqs is also set by --max-num-seqs; give it once" in capsys.readouterr().err
    cfg = tmp_path / "engine.txt"
    cfg.write_text(f"model:\n  model: {STORIES_MODEL}\nscheduler:\n  max_num_seqs: 3\n")
    assert load_file(cfg)["scheduler"] == {"max_num_seqs": 3}
    assert EngineConfig.from_sources(None, {"model": STORIES_MODEL, "speculative_method": "none"}).speculative.method \
        is None


def test_flag_help_comes_from_the_config_field(capsys):
    """Each engine flag's --help says which field it sets, what it means, its default and
    bounds (read from the pydantic field, so it cannot drift from the config)."""
    from kvforge.config import EngineConfig
    from kvforge.entrypoints.cli import main
    with pytest.raises(SystemExit):
        main(["generate", "-h"])
    text = " ".join(capsys.readouterr().out.split())
    f = EngineConfig.model_fields["cache"].annotation.model_fields["block_size"]
    assert f"--block-size BLOCK_SIZE cache.block_size: {f.description} (default {f.default}, > 0)" in text
    assert "--max-num-seqs MAX_NUM_SEQS scheduler.max_num_seqs" in text


def test_null_for_a_field_that_takes_no_null_is_refused(capsys):
    """``--block-size null`` quietly meant the default; a field without a null value refuses it
    (a nullable one, ``--max-model-len null`` or ``--max-num-seqs null``, is its default None,
    which the engine resolves)."""
    from kvforge.entrypoints.cli import main
    assert main(["generate", "--model", STORIES_MODEL, "--block-size", "null", "--max-tokens", "2", "Once"]) == 2
    assert "--block-size: null is not a value of cache.block_size" in capsys.readouterr().err
    assert main(["generate", "--model", STORIES_MODEL, "--max-model-len", "null", "--max-tokens", "2", "Once"]) == 0
    assert main(["generate", "--model", STORIES_MODEL, "--max-num-seqs", "null", "--max-tokens", "2", "Once"]) == 0
