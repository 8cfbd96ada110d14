"""``kvforge bench throughput`` / ``bench latency`` end to end on the CPU, the synthetic datasets,
the roofline helper and ``benchmarks/make_dummy_model.py``."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from kvforge.bench.datasets import make_requests, sample_lengths
from kvforge.bench.roofline import ModelShape, roofline
from kvforge.entrypoints.cli import main

STORIES = "/work/shared/models/stories260K"
ROOT = Path(__file__).resolve().parents[1]


def _load_make_dummy():
    spec = importlib.util.spec_from_file_location("make_dummy_model", ROOT / "benchmarks" / "make_dummy_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_dummy(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny-dummy")
    _load_make_dummy().make_dummy_model(d, tiny=True)
    assert not list(d.glob("*.safetensors"))
    return str(d)


def _pos(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _run(argv: list[str], out: Path) -> dict:
    assert main(argv + ["--output-json", str(out), "--disable-tqdm"]) == 0
    return json.loads(out.read_text())


def _check_header(d: dict, bench: str) -> None:
    assert d["benchmark"] == bench
    assert d["command"].startswith(f"kvforge bench {bench} --model ")
    assert d["date"] and d["config"]["model"]["model"] and d["config"]["resolved"]["attention"]
    env = d["environment"]
    for k in ("torch", "triton", "transformers", "device", "device_name"):
        assert k in env, k
    assert _pos(d["engine_start_s"])
    if env["device"] == "cuda":  # graphs are on by default there
        assert d["cuda_graph_sizes"], "a CUDA run reported no captured graph sizes"
    else:
        assert d["cuda_graph_sizes"] == []


def test_throughput_stories_with_hf_baseline(tmp_path, capfd):
    d = _run(["bench", "throughput", "--model", STORIES, "--num-prompts", "4", "--input-len", "16",
              "--output-len", "8", "--baseline", "hf"], tmp_path / "t.json")
    assert "Loading weights" not in capfd.readouterr().err  # --disable-tqdm hides transformers' bar too
    _check_header(d, "throughput")
    assert d["num_requests"] == 4 and d["input_tokens"] == 64 and d["output_tokens"] == 32
    assert d["total_num_tokens"] == 96
    for k in ("elapsed_time", "requests_per_second", "tokens_per_second", "output_tokens_per_second"):
        assert _pos(d[k]), (k, d[k])
    assert d["workload"]["detokenize"] is True
    r = d["roofline"]
    assert _pos(r["requests_per_s"]) and _pos(r["floor_s"]) and _pos(r["fraction_of_roofline"])
    # on the CPU the peaks are this machine's, measured (not the H200's)
    assert r["peaks_source"].startswith("measured on this CPU") and _pos(r["peak_tflops"]) and _pos(r["mem_bw_tbps"])
    assert (r["peak_tflops"], r["mem_bw_tbps"]) != (799.0, 4.27)
    hf = d["baseline"]
    assert hf["name"] == "hf" and hf["useful_output_tokens"] == 32 and hf["generated_tokens"] == 32
    assert _pos(hf["useful_output_tokens_per_second"]) and _pos(hf["kvforge_over_hf"])
    assert math.isclose(hf["kvforge_over_hf"],
                        d["output_tokens_per_second"] / hf["useful_output_tokens_per_second"])


def test_throughput_reports_the_timed_runs_preemptions(tmp_path, tiny_dummy):
    # 8 requests of 24 + 16 tokens need 24 blocks of 16 at once; 6 blocks hold only two, so the
    # scheduler must preempt during the timed run (and never in the 1-prompt warm-up)
    base = ["bench", "throughput", "--model", tiny_dummy, "--load-format", "dummy", "--input-len", "24",
            "--output-len", "16", "--num-prompts", "8", "--num-warmup-prompts", "1", "--block-size", "16"]
    small = _run(base + ["--set", "cache.num_gpu_blocks=6"], tmp_path / "small.json")
    assert small["num_preemptions"] > 0 and small["num_recomputed_tokens"] > 0
    assert small["output_tokens"] == 8 * 16  # no request lost to the preemptions
    big = _run(base + ["--set", "cache.num_gpu_blocks=64"], tmp_path / "big.json")
    assert big["num_preemptions"] == 0 and big["num_recomputed_tokens"] == 0


def test_throughput_tiny_dummy_variable_with_hf(tmp_path, tiny_dummy):
    args = ["--dataset", "variable", "--min-len", "4", "--max-len", "24", "--num-prompts", "5", "--seed", "1"]
    d = _run(["bench", "throughput", "--model", tiny_dummy, "--load-format", "dummy", *args,
              "--baseline", "hf", "--hf-batch-size", "2"], tmp_path / "t.json")
    _check_header(d, "throughput")
    ins, outs = sample_lengths("variable", 5, 0, 0, seed=1, min_len=4, max_len=24)
    assert d["input_tokens"] == sum(ins) and d["output_tokens"] == sum(outs)
    w = d["workload"]
    assert w["dataset"] == "variable" and w["seed"] == 1 and w["detokenize"] is False  # vocab 1024 > 512
    assert 4 <= w["input_len_min"] <= w["input_len_max"] <= 24
    assert _pos(d["requests_per_second"]) and _pos(d["roofline"]["fraction_of_roofline"])
    hf = d["baseline"]
    assert hf["num_batches"] == 3 and hf["useful_output_tokens"] == sum(outs)
    batch_max = [max(outs[i:i + 2]) * len(outs[i:i + 2]) for i in range(0, 5, 2)]
    assert hf["generated_tokens"] == sum(batch_max) >= hf["useful_output_tokens"]
    assert _pos(hf["kvforge_over_hf"])


@pytest.mark.parametrize("which", ["stories", "tiny_dummy"])
def test_latency(tmp_path, tiny_dummy, which):
    model = ["--model", STORIES] if which == "stories" else ["--model", tiny_dummy, "--load-format", "dummy"]
    # 32 output tokens: the decode time must stand well above a busy CPU's noise for TPOT to be > 0.
    d = _run(["bench", "latency", *model, "--input-len", "16", "--output-len", "32", "--batch-size", "2",
              "--num-iters", "5", "--num-iters-warmup", "1"], tmp_path / "l.json")
    _check_header(d, "latency")
    assert len(d["latencies"]) == 5 and len(d["prefill"]["latencies"]) == 5
    for k in ("avg_latency", "median_latency", "p90_latency", "p99_latency", "output_tokens_per_second", "tpot",
              "latency_over_floor", "tpot_over_floor", "tpot_over_weights_read_floor"):
        assert _pos(d[k]), (k, d[k])
    assert set(d["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert _pos(d["prefill"]["median_latency"])
    assert d["median_latency"] <= d["p90_latency"] <= d["p99_latency"]
    assert math.isclose(d["tpot"], (d["median_latency"] - d["prefill"]["median_latency"]) / 31)
    for k in ("prefill_s", "tpot_s", "tpot_weights_read_s", "latency_s"):
        assert _pos(d["floor"][k]), k
    assert d["floor"]["peaks_source"].startswith("measured on this CPU")


def test_given_peaks_are_used(tmp_path):
    d = _run(["bench", "latency", "--model", STORIES, "--input-len", "8", "--output-len", "4", "--num-iters", "2",
              "--num-iters-warmup", "0", "--peak-tflops", "2.5", "--mem-bw-tbps", "0.05"], tmp_path / "l.json")
    f = d["floor"]
    assert (f["peak_tflops"], f["mem_bw_tbps"], f["peaks_source"]) == (2.5, 0.05, "command line")
    assert math.isclose(f["tpot_weights_read_s"], f["step_weight_bytes"] / 0.05e12)


def test_workload_too_long_is_a_clear_error(capsys):
    # stories260K: max_position_embeddings 512.
    assert main(["bench", "throughput", "--model", STORIES, "--num-prompts", "2", "--input-len", "500",
                 "--output-len", "20", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "exceed max_model_len 512" in err and "raise --max-model-len" in err, err


@pytest.mark.parametrize("which", ["throughput", "latency"])
def test_a_cache_limited_max_model_len_points_at_the_cache(capsys, which):
    # 2 blocks of 16 hold 32 tokens: the builder lowers max_model_len from 512 to 32, so the
    # error must not send the user to --max-model-len (which the cache would refuse next)
    assert main(["bench", which, "--model", STORIES, "--input-len", "24", "--output-len", "16",
                 "--num-gpu-blocks", "2", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "exceed max_model_len 32" in err and "(--num-gpu-blocks): its 2 blocks hold 32 tokens" in err, err
    assert "raise --max-model-len" not in err


@pytest.mark.parametrize("flag,value,msg", [
    ("--peak-tflops", "0", "must be > 0"), ("--mem-bw-tbps", "-1", "must be > 0"),
    ("--peak-tflops", "nan", "must be > 0"), ("--roofline-req-s", "0", "must be > 0"),
    ("--input-len", "-32", "must be > 0"), ("--output-len", "0", "must be > 0"),
    ("--num-warmup-prompts", "-1", "must be >= 0"), ("--hf-batch-size", "0", "must be > 0"),
    ("--num-prompts", "x", "expected an integer")])
def test_bad_flags_refused_before_the_engine_starts(capsys, flag, value, msg):
    with pytest.raises(SystemExit) as e:  # argparse: the flag is named, nothing is built
        main(["bench", "throughput", "--model", STORIES, flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and msg in err, err


@pytest.mark.parametrize("which", ["throughput", "latency"])
def test_unwritable_output_json_refused_up_front(tmp_path, capsys, which):
    (tmp_path / "afile").write_text("x")
    bads = [(tmp_path / "afile" / "x.json", "cannot create its directory"), (tmp_path, "is a directory")]
    if Path("/proc/version").is_file():  # exists, but no one (not even root) may append to it
        bads.append((Path("/proc/version"), "cannot be written"))
    for bad, msg in bads:
        assert main(["bench", which, "--model", STORIES, "--num-prompts" if which == "throughput" else "--batch-size",
                     "1", "--output-json", str(bad), "--disable-tqdm"]) == 2
        err = capsys.readouterr().err
        assert "--output-json" in err and msg in err, err


def test_variable_lengths_deterministic_and_bounded():
    a = sample_lengths("variable", 256, 0, 0, seed=0, min_len=100, max_len=1024)
    assert a == sample_lengths("variable", 256, 0, 0, seed=0, min_len=100, max_len=1024)
    assert a != sample_lengths("variable", 256, 0, 0, seed=1, min_len=100, max_len=1024)
    ins, outs = a
    assert len(ins) == len(outs) == 256
    assert all(100 <= n <= 1024 for n in ins + outs)
    assert min(ins + outs) < 200 and max(ins + outs) > 900  # spread over the range
    reqs = make_requests("variable", 256, 0, 0, vocab_size=300, seed=0, min_len=100, max_len=1024)
    assert [r.prompt_len for r in reqs] == ins and [r.output_len for r in reqs] == outs
    assert all(0 <= t < 300 for r in reqs for t in r.prompt_token_ids)
    again = make_requests("variable", 256, 0, 0, vocab_size=300, seed=0, min_len=100, max_len=1024)
    assert [r.prompt_token_ids for r in again] == [r.prompt_token_ids for r in reqs]
    # random: fixed lengths; with --range-ratio, vLLM's [N(1-r), N(1+r)]
    assert sample_lengths("random", 3, 16, 8) == ([16] * 3, [8] * 3)
    ins, outs = sample_lengths("random", 200, 100, 10, seed=2, range_ratio=0.5)
    assert all(50 <= n <= 150 for n in ins) and all(5 <= n <= 15 for n in outs) and len(set(ins)) > 1
    ins, outs = sample_lengths("variable", 50, 100, 10, seed=2, range_ratio=0.2)
    assert all(80 <= n <= 120 for n in ins) and all(8 <= n <= 12 for n in outs)
    for bad in (dict(dataset="variable"), dict(dataset="random", min_len=1, max_len=5),
                dict(dataset="variable", min_len=5, max_len=4), dict(dataset="variable", min_len=5),
                dict(dataset="nope"), dict(dataset="random", range_ratio=1.0)):
        kw = {"num_prompts": 4, "input_len": 16, "output_len": 8, **bad}
        with pytest.raises(ValueError):
            sample_lengths(**kw)


def test_make_dummy_model_llama3_shape_and_roofline(tmp_path):
    from transformers import AutoConfig

    mod = _load_make_dummy()
    assert mod.main([str(tmp_path / "l3")]) == 0
    d = tmp_path / "l3"
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["max_position_embeddings"], cfg["torch_dtype"]) == \
        (4096, 32, 32, 8, 14336, 128256, 8192, "bfloat16")
    hf = AutoConfig.from_pretrained(str(d), local_files_only=True)
    assert hf.model_type == "llama" and (d / "tokenizer.json").exists()
    shape = ModelShape.from_hf_config(hf)
    assert shape.num_params == 8_030_261_248  # Llama-3-8B
    # Issue 3: 1000 x 1024 in / 128 out on the H200 -> roofline of about 40 requests/s.
    r = roofline(shape, [1024] * 1000, [128] * 1000, dtype_bytes=2, max_num_seqs=256)
    assert 37 < r["requests_per_s"] < 44, r
    assert r["prefill_s"] > r["decode_s"] > 0
    # batch-1 decode: the weights-read floor is ~15 GB / 4.27 TB/s ~ 3.5 ms per token.
    r1 = roofline(shape, [32], [129], dtype_bytes=2, max_num_seqs=256)
    assert 3.3e-3 < r1["decode_s"] / r1["decode_steps"] < 3.9e-3


def test_weight_bytes_count_each_storage_once_and_step_reads_skip_the_input_table():
    import torch
    from kvforge.engine.sizing import model_weight_bytes

    class Tiny(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(100, 8)               # 3200 B (fp32)
            self.proj = torch.nn.Linear(8, 8, bias=False)                # 256 B
            self.register_buffer("scale", torch.ones(8, dtype=torch.float16))  # 16 B
            self.lm_head = torch.nn.Linear(8, 100, bias=False)           # 3200 B
            self.rotary = RotaryTables()                                  # position tables: not weights
            if tied:
                self.lm_head.weight = self.embed_tokens.weight

    class RotaryTables(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("cos", torch.ones(4096, 4), persistent=False)

    assert model_weight_bytes(Tiny(tied=False), step_reads=True) == 256 + 16 + 3200  # the lookup table is not read whole
    assert model_weight_bytes(Tiny(tied=True), step_reads=True) == 256 + 16 + 3200   # the shared table counts once, as the head
    # in memory the input table counts (once when tied); the rotary tables never do
    assert model_weight_bytes(Tiny(tied=False)) == 3200 + 256 + 16 + 3200
    assert model_weight_bytes(Tiny(tied=True)) == 3200 + 256 + 16


def test_latency_roofline_reads_a_quantized_models_own_bytes(tmp_path):
    """With int8 weights the batch-1 floor counts the loaded int8 weights and their scales, not
    the checkpoint dtype's bytes."""
    cfg = json.loads((Path(STORIES) / "config.json").read_text())
    shape = ModelShape.from_hf_config(cfg)
    base = ["bench", "latency", "--model", STORIES, "--input-len", "8", "--output-len", "4", "--batch-size", "1",
            "--num-iters", "1", "--num-iters-warmup", "0", "--dtype", "float32"]
    plain = _run(base, tmp_path / "plain.json")["floor"]
    assert plain["step_weight_bytes"] == shape.step_weight_bytes(4) and plain["step_weight_bytes_source"].startswith(
        "analytic")
    q = _run(base + ["--quantization", "int8"], tmp_path / "int8.json")["floor"]
    assert q["step_weight_bytes_source"].startswith("measured")
    # by hand: one byte per layer GEMM weight, an fp32 scale per output channel, the fp32 norms
    # and the (tied) fp32 table as the LM head; no rotary tables
    h, inter, L = shape.hidden_size, shape.intermediate_size, shape.num_layers
    q_out, kv_out = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    channels = L * (q_out + 2 * kv_out + h + 2 * inter + h)
    norms = 4 * (2 * L + 1) * h
    want = L * shape.layer_matmul_params + 4 * channels + norms + 4 * shape.vocab_size * h
    assert q["step_weight_bytes"] == want, (q["step_weight_bytes"], want)
    assert math.isclose(q["tpot_weights_read_s"], q["step_weight_bytes"] / (q["mem_bw_tbps"] * 1e12))
