"""FP8 KV cache (cache.kv_cache_dtype) across the rest of the engine, on the CPU (stories260K,
fp32, torch_ref): tensor, pipeline and data parallelism (multiprocess workers / replicas),
swap preemption through the workers, speculative decoding (n-gram and a self-drafting draft
model, whose own cache stays in the model dtype), async scheduling, ``kvforge generate`` /
``kvforge serve --kv-cache-dtype`` and a bad value, and ``kvforge plugins --explain`` reading
the cache dtype of its --config.

Greedy outputs are compared with :func:`assert_outputs_match` at ``TIE_TOL`` = 0.1 (natural
log-prob), not its fp32 default 1e-4. Why: runs that batch or reduce differently (TP's split
o_proj / down_proj sums, a verify step's multi-token matmuls, other batch shapes) differ in the
last float32 bits of K and V, and where a value sits on an FP8 rounding boundary it lands one
FP8 step (1/8 relative in E4M3) apart. One such flip moved a chosen token's log-prob by up to
0.058 (E4M3, TP=2 against one process), 0.084 (E5M2, TP=2) and 0.037 (draft model), measured
over ~100 requests x 100 tokens each; with an fp32 cache the same runs part by <= 3e-6. A
divergence is excused only where both runs' top two hold both tokens within TIE_TOL, and most
outputs must still be token-identical (``_compare``), so a broken FP8 path still fails.

Prompts and lengths are fresh random draws (the seed is printed by ``fresh_rng``).
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import (STORIES_MODEL, assert_no_block_leak, assert_outputs_match, fresh_rng, make_engine,
                     prompt_logits, random_story_prompts, rel_err, run_requests)
from kvforge import LLM, SamplingParams
from kvforge.entrypoints.cli import main as cli_main

TIE_TOL = 0.1  # see the module docstring
BUDGET = 1 << 21  # kv_cache_memory_bytes: fp8 and fp32 engines get the same bytes
BASE = dict(dtype="float32", attention="torch_ref", block_size=16, max_num_batched_tokens=32)
E4M3 = torch.float8_e4m3fn
COPY = "Tom had a big red ball. Tom had a big red ball. Tom had a big"  # n-gram drafts hit here


@pytest.fixture(scope="module")
def scaled_model(tmp_path_factory):
    """stories260K plus fresh random per-layer self_attn.k_scale / v_scale (ranges that keep its
    K (|27|) and V (|2.8|) inside E4M3's 448, as test_kv_cache_fp8 measured)."""
    rng = fresh_rng("scales")
    d = tmp_path_factory.mktemp("scaled")
    for f in os.listdir(STORIES_MODEL):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(STORIES_MODEL, f), d)
    w = load_file(os.path.join(STORIES_MODEL, "model.safetensors"))
    n = 1 + max(int(k.split(".")[2]) for k in w if k.startswith("model.layers."))
    for i in range(n):
        w[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(rng.uniform(0.07, 0.2))
        w[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(rng.uniform(0.008, 0.02))
    save_file(w, str(d / "model.safetensors"))
    return str(d)


def _reqs(rng, n=6, extra=()):
    prompts = random_story_prompts(rng, n) + list(extra)
    return [(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=rng.randint(40, 70), ignore_eos=True,
                                        logprobs=2)) for i, p in enumerate(prompts)]


def _compare(got, ref, reqs, tag):
    for rid, _, _ in reqs:
        assert got[rid].error is None, f"{tag} {rid}: {got[rid].error}"
        assert_outputs_match([got[rid].outputs[0]], [ref[rid].outputs[0]], f"{tag} {rid}", tie_tol=TIE_TOL)
    same = sum(got[rid].outputs[0].token_ids == ref[rid].outputs[0].token_ids for rid, _, _ in reqs)
    assert 2 * same >= len(reqs), f"{tag}: only {same} of {len(reqs)} outputs token-identical"


def _shutdown(engine):
    ex = getattr(engine, "executor", None)
    if ex is not None:
        ex.shutdown()
    elif hasattr(engine, "shutdown"):
        engine.shutdown()


def _block_bytes(engine) -> int:
    """Bytes of one block over all layers of this process's KV cache tensors."""
    dim = engine.runner.backend.block_dim
    return sum(c.numel() * c.element_size() // c.shape[dim] for c in engine.runner.kv_caches)


# -- tensor / pipeline parallelism --------------------------------------------------------------

@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2"])
def test_parallel_fp8_matches_one_process(scaled_model, layout):
    """Workers hold FP8 caches (4x the fp32 engine's blocks in the same budget) with the
    checkpoint's scales (their logits equal the one-process scaled run's, not the 1.0-scale
    or fp32-cache ones); greedy outputs match one process; every block comes back."""
    rng = fresh_rng(str(layout))
    reqs = _reqs(rng)
    kw = dict(BASE, model=scaled_model, kv_cache_memory_bytes=BUDGET)
    one = make_engine(**kw, kv_cache_dtype="fp8")
    ref = run_requests(one, reqs)
    plain = make_engine(**kw, **layout)
    n32 = plain.allocator.num_blocks
    _shutdown(plain)
    eng = make_engine(**kw, **layout, kv_cache_dtype="fp8")
    try:
        n8 = eng.allocator.num_blocks
        assert 4 * n32 <= n8 <= 4 * n32 + 3, f"{layout}: {n8} fp8 blocks vs {n32} fp32: not a 1-byte cache"
        _compare(run_requests(eng, reqs), ref, reqs, str(layout))
        ids = [list(ref[rid].prompt_token_ids) + list(ref[rid].outputs[0].token_ids[:24]) for rid, _, _ in reqs[:3]]
        chunks = [[len(p) // 2, len(p) - len(p) // 2] for p in ids]  # the second chunk reads FP8 blocks
        got = prompt_logits(eng, ids, chunks)
        assert_no_block_leak(eng)
    finally:
        _shutdown(eng)
    want = prompt_logits(one, ids, chunks)
    unit = prompt_logits(make_engine(**dict(kw, model=STORIES_MODEL), kv_cache_dtype="fp8"), ids, chunks)
    f32 = prompt_logits(make_engine(**kw), ids, chunks)
    err = max(rel_err(g, w) for g, w in zip(got, want))
    far = min(max(rel_err(g, o) for g, o in zip(got, other)) for other in (unit, f32))
    assert err <= 0.02 and err < far / 4, f"{layout}: logits vs one process {err:.3g}, vs 1.0 scales / fp32 {far:.3g}"


def test_tp2_swap_preemption_keeps_fp8_bytes():
    """Swap preemption through the TP workers' FP8 CPU caches: the same outputs as an
    unpressured one-process FP8 run, no block left behind."""
    rng = fresh_rng()
    reqs = _reqs(rng, 6)
    ref = run_requests(make_engine(**BASE, kv_cache_dtype="fp8", num_gpu_blocks=256), reqs)
    eng = make_engine(**BASE, kv_cache_dtype="fp8", num_gpu_blocks=rng.randint(10, 13), swap_space_bytes=1 << 20,
                      tensor_parallel_size=2, **{"scheduler.settings.preemption_mode": "swap"})
    try:
        got = run_requests(eng, reqs)
        assert eng.scheduler.num_preemptions > 0, "no preemption: the test is not testing"
        _compare(got, ref, reqs, "tp2 swap")
    finally:
        _shutdown(eng)


# -- data parallelism -------------------------------------------------------------------------

def test_dp2_replicas_hold_fp8_caches():
    rng = fresh_rng()
    prompts = random_story_prompts(rng, 6)
    sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(30, 60), ignore_eos=True, logprobs=2)
    kw = dict(dtype="float32", kv_cache_memory_bytes=BUDGET, max_num_batched_tokens=32)
    one = LLM(STORIES_MODEL, **kw, kv_cache_dtype="fp8")
    ref = one.generate(prompts, sp, use_tqdm=False)
    n32 = LLM(STORIES_MODEL, **kw).llm_engine.allocator.num_blocks
    llm = LLM(STORIES_MODEL, **kw, kv_cache_dtype="fp8", data_parallel_size=2)
    engine = llm.llm_engine
    try:
        got = llm.generate(prompts, sp, use_tqdm=False)
        assert all(n > 0 for n in engine.num_routed), f"requests not spread over replicas: {engine.num_routed}"
        for i, st in enumerate(engine.replica_stats()):
            assert st["num_blocks"] == one.llm_engine.allocator.num_blocks, (i, st["num_blocks"])
            assert 4 * n32 <= st["num_blocks"] <= 4 * n32 + 3, f"replica {i}: {st['num_blocks']} vs fp32 {n32}"
            assert st["num_free_blocks"] == st["num_blocks"], f"replica {i} holds KV blocks"
    finally:
        _shutdown(engine)
    for k, (g, r) in enumerate(zip(got, ref)):
        assert g.error is None, g.error
        assert_outputs_match(g.outputs, r.outputs, f"dp2 prompt {k}", tie_tol=TIE_TOL)


# -- speculative decoding ---------------------------------------------------------------------

SPEC = {"ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3,
                  "speculative.settings.prompt_lookup_max": 3},
        "draft_model": {"speculative_method": "draft_model", "num_speculative_tokens": 3}}


@pytest.mark.parametrize("method", list(SPEC))
def test_speculative_fp8_equals_plain_fp8(method):
    """Greedy outputs with speculation over an FP8 target cache equal the plain FP8 run. The
    self-drafting draft model keeps its own cache in the model dtype (fp32), and the KV budget
    is split by both caches' real bytes (fp8 target + fp32 draft a block)."""
    rng = fresh_rng(method)
    reqs = _reqs(rng, 5, extra=[COPY])
    kw = dict(BASE, kv_cache_dtype="fp8", kv_cache_memory_bytes=BUDGET)
    ref = run_requests(make_engine(**kw), reqs)
    eng = make_engine(**kw, **SPEC[method], **{"speculative.adaptive": False})
    assert all(c.dtype == E4M3 for c in eng.runner.kv_caches)
    tb = _block_bytes(eng)
    got = run_requests(eng, reqs)
    _compare(got, ref, reqs, method)
    assert eng.stats()["spec_num_accepted_tokens"] > 0, "no draft accepted: speculation did not run"
    for d in eng.spec.drafters.values():
        assert not getattr(d, "_index", None), "n-gram state of finished requests kept"
    if method == "draft_model":
        d = eng.spec.drafters["draft_model"]
        assert all(c.dtype == torch.float32 for c in d.runner.kv_caches), [c.dtype for c in d.runner.kv_caches]
        db = d.kv_cache_block_bytes(BASE["block_size"])
        assert db == 4 * tb, (db, tb)
        assert eng.allocator.num_blocks == d.allocator.num_blocks == BUDGET // (tb + db)
        assert d.allocator.num_free_blocks == d.allocator.num_blocks, "draft KV blocks leaked"
    else:
        assert eng.allocator.num_blocks == BUDGET // tb


# -- async scheduling -------------------------------------------------------------------------

def test_async_scheduling_fp8_same_outputs():
    rng = fresh_rng()
    reqs = _reqs(rng, 6)
    kw = dict(BASE, kv_cache_dtype="fp8", num_gpu_blocks=128)
    sync = make_engine(**kw, async_scheduling=False)
    ref = run_requests(sync, reqs)
    assert sync._overlap is None
    on = make_engine(**kw, async_scheduling=True)
    _compare(run_requests(on, reqs), ref, reqs, "async")
    assert on._overlap.num_overlapped_steps > 0, "async scheduling never overlapped a step"
    tp = make_engine(**kw, async_scheduling=True, tensor_parallel_size=2)
    try:
        _compare(run_requests(tp, reqs), ref, reqs, "async tp2")
        assert tp._overlap.num_overlapped_steps > 0
    finally:
        _shutdown(tp)


# -- command line and server ------------------------------------------------------------------

def test_generate_cli_kv_cache_dtype(capsys, monkeypatch):
    import json

    import kvforge.entrypoints.llm as llm_mod
    built = []

    class Spy(llm_mod.LLM):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            built.append(self)

    monkeypatch.setattr(llm_mod, "LLM", Spy)
    rng = fresh_rng()
    prompts, n = random_story_prompts(rng, 2), rng.randint(5, 20)
    capsys.readouterr()
    rc = cli_main(["generate", "--model", STORIES_MODEL, "--kv-cache-dtype", "fp8", "--num-gpu-blocks", "64",
                   "--json", "--max-tokens", str(n), *prompts])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert [c.dtype for c in built[0].llm_engine.runner.kv_caches] == [E4M3] * len(built[0].llm_engine.runner.kv_caches)
    ref = LLM(STORIES_MODEL, kv_cache_dtype="fp8", num_gpu_blocks=64).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    assert [d["outputs"][0]["token_ids"] for d in json.loads(cap.out)] == [r.outputs[0].token_ids for r in ref]


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("value", ["int4", "FP8", "bfloat16"])
def test_bad_kv_cache_dtype_refused_naming_the_field(command, value, capsys, monkeypatch):
    import kvforge.engine.executor as executor
    import kvforge.entrypoints.llm as llm_mod

    def no_engine(*_a, **_k):
        raise AssertionError("an engine was built")

    monkeypatch.setattr(executor, "create_engine", no_engine)
    monkeypatch.setattr(llm_mod, "create_engine", no_engine, raising=False)
    argv = [command, "--model", STORIES_MODEL, "--kv-cache-dtype", value]
    rc = cli_main(argv + (["Once"] if command == "generate" else ["--port", "0"]))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("kvforge: error: invalid config: cache.kv_cache_dtype: ") and "'fp8_e5m2'" in err, err
    assert "Traceback" not in err and "errors.pydantic.dev" not in err, err


def test_serve_kv_cache_dtype_fp8(monkeypatch):
    """``kvforge serve --kv-cache-dtype fp8``: the engine it builds holds an FP8 cache and a
    completion equals the offline FP8 one. No socket: uvicorn's server is replaced by one
    that drives the app in-process (starlette's TestClient, lifespan included)."""
    from starlette.testclient import TestClient

    import kvforge.engine.executor as executor
    import kvforge.entrypoints.openai.api_server as api
    rng = fresh_rng()
    prompt, n = random_story_prompts(rng, 1)[0], rng.randint(5, 20)
    seen = {}
    real = executor.create_engine

    def spy(cfg):
        seen["engine"] = real(cfg)
        return seen["engine"]

    class InProcess:
        def __init__(self, config):
            self.config, self.started = config, False

        def run(self):
            with TestClient(self.config.app) as c:
                seen["resp"] = c.post("/v1/completions", json={"model": "stories", "prompt": prompt,
                                                               "max_tokens": n, "temperature": 0})
            self.started = True

    monkeypatch.setattr(executor, "create_engine", spy)
    monkeypatch.setattr(api, "_draining_server", lambda config, engine, drain: InProcess(config))
    monkeypatch.delenv("KVFORGE_API_KEY", raising=False)
    rc = cli_main(["serve", "--model", STORIES_MODEL, "--kv-cache-dtype", "fp8", "--num-gpu-blocks", "64",
                   "--served-model-name", "stories", "--port", "0"])
    assert rc == 0
    assert all(c.dtype == E4M3 for c in seen["engine"].runner.kv_caches)
    r = seen["resp"]
    assert r.status_code == 200, r.text
    [ref] = LLM(STORIES_MODEL, kv_cache_dtype="fp8", num_gpu_blocks=64).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
    assert r.json()["choices"][0]["text"] == ref.outputs[0].text
    assert_no_block_leak(seen["engine"])


# -- kvforge plugins --explain ----------------------------------------------------------------

def test_explain_reads_the_cache_dtype_of_its_config(tmp_path, capsys, monkeypatch):
    """A bug found here: ``kvforge plugins --explain --config`` ignored cache.kv_cache_dtype, so it
    named as "picked by auto" a backend that cannot hold an FP8 cache (the engine then picks
    another one). A CPU backend without FP8, ranked above torch_ref, shows the difference."""
    import types

    import kvforge
    import kvforge.plugin_manager as pm
    from kvforge.config import EngineConfig
    from kvforge.engine.builder import load_hf_config
    from kvforge.engine.resolve import choose_attention
    from kvforge.layers.kv_cache_dtype import resolve_kv_cache_dtype
    from kvforge.interfaces import AttentionRequirements
    from kvforge_plugins.attention.torch_ref import TorchRefBackend
    mod = types.ModuleType("test_nofp8_plugin")
    mod.KVFORGE_HOOK_API = kvforge.KVFORGE_HOOK_API

    def kvforge_register_attention_backends(register):
        register("nofp8_cpu", TorchRefBackend, priority=50, dtypes=("float32",), devices=("cpu",),
                 cuda_graphs=False, spec_decode=True)

    mod.kvforge_register_attention_backends = kvforge.hookimpl(kvforge_register_attention_backends)
    real = pm.load_registry
    monkeypatch.setattr(pm, "load_registry", lambda *a, **k: real(*a, extra_plugins=[(mod.__name__, mod)], **k))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hf = load_hf_config(STORIES_MODEL)
    for kv, picked in (("auto", "nofp8_cpu"), ("fp8", "torch_ref"), ("fp8_e5m2", "torch_ref")):
        cfg = tmp_path / f"{kv}.yaml"
        cfg.write_text(f"model:\n  model: {STORIES_MODEL}\n  dtype: float32\ncache:\n  kv_cache_dtype: {kv}\n")
        assert cli_main(["plugins", "--explain", "--config", str(cfg)]) == 0
        out = capsys.readouterr().out
        assert f"{picked} (priority " in out and out.count("picked by auto") == 1, out
        line = next(x for x in out.splitlines() if x.strip().startswith(f"{picked} (priority"))
        assert line.endswith("ok, picked by auto"), out
        c = EngineConfig.from_sources(cfg)  # what the engine's own choice makes of that config
        req = AttentionRequirements(torch.float32, hf.hidden_size // hf.num_attention_heads, hf.num_attention_heads,
                                    hf.num_key_value_heads, c.cache.block_size,
                                    resolve_kv_cache_dtype(c.cache.kv_cache_dtype, torch.float32))
        assert choose_attention(pm.load_registry(), c.attention.backend, req, torch.device("cpu"))[0].name == picked
        if kv != "auto":
            assert f"kv_cache_dtype {kv}" in out and "nofp8_cpu (priority 50): rejected: cache.kv_cache_dtype" in out, out
