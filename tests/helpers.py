"""Shared test helpers (plain functions; import with ``from helpers import ...``)."""
from __future__ import annotations

import itertools
import os
import random
from typing import Sequence

import torch

_ids = itertools.count()


def urandom_seed() -> int:
    """A fresh seed from os.urandom (print it / put it in assertion messages)."""
    return int.from_bytes(os.urandom(6), "little")


def seeded_rng(seed: int) -> random.Random:
    return random.Random(seed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of ``a`` against the reference ``b``: max|a - b| / max|b| (float64)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max()).item()


def prompt_logits(engine, prompts: Sequence[Sequence[int]],
                  chunks: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
    """Logits for EVERY prompt position, float32 [len(prompt), vocab], from kvforge.

    Drives the engine's real ModelRunner (``engine.runner.execute``) with hand-made
    SchedulerOutputs, bypassing the scheduler and sampler. Requests carry
    ``prompt_logprobs=0`` so ``execute`` returns the raw logits of all prompt
    positions (``ExecuteOutput.prompt_logits``) plus the last position
    (``ExecuteOutput.logits``).

    ``chunks[i]``: token counts of prompt i per step (default: the whole prompt in
    one step). Step s runs chunk s of every prompt that has one, all in ONE
    flattened forward, so later chunks attend to their cached prefix in the paged
    KV cache. KV blocks come from ``engine.allocator`` and are freed at the end.
    """
    from kvforge import SamplingParams
    from kvforge.engine.request import Request, RequestStatus
    from kvforge.interfaces import SchedulerOutput

    chunks = [list(c) for c in chunks] if chunks is not None else [[len(p)] for p in prompts]
    assert len(chunks) == len(prompts)
    for p, c in zip(prompts, chunks):
        assert sum(c) == len(p) and all(n >= 1 for n in c), (len(p), c)
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    reqs = [Request(f"test-logits-{next(_ids)}", list(p), sp, 1) for p in prompts]
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    alloc = engine.allocator
    try:
        for step in range(max(len(c) for c in chunks)):
            so = SchedulerOutput()
            for r, c in zip(reqs, chunks):
                if step < len(c):
                    assert alloc.allocate_slots(r, c[step]) is not None, "test: KV cache too small"
                    r.status = RequestStatus.RUNNING
                    so.scheduled.append(r)
                    so.num_scheduled_tokens[r.request_id] = c[step]
            ex = engine.runner.execute(so)
            for r in so.scheduled:
                n, start = so.num_scheduled_tokens[r.request_id], r.num_computed_tokens
                parts = []
                if r.request_id in ex.prompt_logits:
                    first, lg = ex.prompt_logits[r.request_id]
                    assert first == start + 1, (first, start)
                    parts.append(lg)
                if any(s is r for s in ex.sample_requests):
                    row = next(i for i, s in enumerate(ex.sample_requests) if s is r)
                    parts.append(ex.logits[row:row + 1])
                lg = torch.cat(parts).float().cpu()
                assert lg.shape[0] == n, f"runner returned {lg.shape[0]} logit rows for a {n}-token chunk"
                got[reqs.index(r)].append(lg)
                r.num_computed_tokens += n
    finally:
        for r in reqs:
            alloc.free(r)
    return [torch.cat(g) for g in got]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing element (or of the end of the shorter one); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_match(got: Sequence[int], ref: Sequence[int], ref_logits: Sequence[torch.Tensor] | None,
                        msg: str, tie_rtol: float = 1e-5) -> None:
    """Assert kvforge greedy tokens ``got`` equal the HF reference ``ref``.

    A divergence is excused only where HF's own logits make it an exact-tie call:
    at the first differing step the reference logit of kvforge's token is within
    ``tie_rtol * max|logits|`` of the reference top logit (float32 rounding may then
    legitimately pick either). Tokens are compared up to that point.
    """
    got, ref = list(got), list(ref)
    i = first_divergence(got, ref)
    if i is None:
        return
    detail = ""
    if ref_logits is not None and i < min(len(got), len(ref)) and i < len(ref_logits):
        lg = ref_logits[i].double().flatten()
        gap = (lg[ref[i]] - lg[got[i]]).item()
        scale = lg.abs().max().item()
        if gap <= tie_rtol * scale:
            return
        detail = f"; HF logit gap there = {gap:.4g} (scale {scale:.4g}), not a tie"
    raise AssertionError(
        f"{msg}: greedy tokens differ from HF at output index {i}{detail}\n"
        f"  kvforge ({len(got)}): {got[max(0, i - 3):i + 8]} ...\n"
        f"  HF      ({len(ref)}): {ref[max(0, i - 3):i + 8]} ...")


def assert_outputs_match(got: Sequence, ref: Sequence, msg: str, tie_tol: float = 1e-4) -> None:
    """Assert two engine runs' greedy outputs (``CompletionOutput`` lists, sampled with
    ``logprobs >= 2``) agree. Runs that batch differently sum float32 in another order, so a
    pair may part only at a near tie: at the first differing position each run's top two
    hold both tokens, their log-probabilities within ``tie_tol`` in both runs; tokens are
    compared up to that point."""
    assert len(got) == len(ref), (msg, len(got), len(ref))
    for k, (g, r) in enumerate(zip(got, ref)):
        i = first_divergence(g.token_ids, r.token_ids)
        if i is None:
            continue
        gaps = []
        if i < min(len(g.token_ids), len(r.token_ids)) and g.logprobs and r.logprobs:
            a, b = r.token_ids[i], g.token_ids[i]
            for lps in (r.logprobs[i], g.logprobs[i]):
                gaps.append(abs(lps[a].logprob - lps[b].logprob) if a in lps and b in lps else float("inf"))
        if gaps and max(gaps) <= tie_tol:
            continue
        raise AssertionError(f"{msg}: output {k} differs at token {i} and it is not a near tie (log-prob gaps "
                             f"{gaps}):\n  got {list(g.token_ids[max(0, i - 3):i + 6])}\n"
                             f"  ref {list(r.token_ids[max(0, i - 3):i + 6])}")


# --- engine-level helpers (preemption / validation / plugin / config tests) -----------------

STORIES_MODEL = "/work/shared/models/stories260K"

#: Short natural-language openings for the TinyStories model; tests combine them randomly.
STORY_OPENINGS = [
    "Once upon a time", "The cat", "Lily went to the", "Tom had a big", "One day, a little",
    "The sun was", "Ben and Mia", "A small dog", "There was a girl named", "The bird sang",
    "Sam wanted to", "In the park", "Mom said", "The little boy saw a", "Sue liked to play with",
    "It was a sunny day", "The fox", "Anna found a", "Max and his friend", "The old tree",
]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


def save_random_hf(cfg, out_dir, seed: int):
    """A Hugging Face model built from ``cfg`` with random weights (seeded by ``seed``: std 0.25,
    RMSNorm weights 1 +- 0.3, biases nonzero), fp32, eager attention, saved as safetensors in
    ``out_dir`` beside stories260K's tokenizer files (vocab 512). Returns the HF model."""
    import shutil

    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, prm in hf.named_parameters():
            if name.endswith("norm.weight"):
                prm.copy_(1 + 0.3 * torch.randn_like(prm))
            else:
                prm.normal_(0.0, 0.25)
    hf.save_pretrained(out_dir, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(STORIES_MODEL, f)):
            shutil.copy(os.path.join(STORIES_MODEL, f), out_dir)
    return hf


def fresh_rng(label: str = "") -> random.Random:
    """A ``random.Random`` seeded from os.urandom; the seed is printed (pytest shows it on failure)."""
    seed = urandom_seed()
    print(f"{label} seed={seed}")
    return random.Random(seed)


def random_story_prompts(rng: random.Random, n: int) -> list[str]:
    """``n`` prompts built from 1-2 random openings."""
    return [". ".join(rng.sample(STORY_OPENINGS, rng.choice([1, 1, 2]))) for _ in range(n)]


def make_engine(**overrides):
    """Build an ``LLMEngine`` on the stories260K model from flat/dotted config overrides."""
    from kvforge.config import EngineConfig
    from kvforge.engine.llm_engine import LLMEngine
    overrides.setdefault("model", STORIES_MODEL)
    return LLMEngine(EngineConfig.from_sources(None, overrides))


def run_engine(engine, max_steps: int = 100_000, on_step=None) -> dict:
    """Step ``engine`` until it has no unfinished requests; return request_id -> final RequestOutput.

    ``on_step(engine, outputs)`` runs after every step (per-step invariant checks).
    """
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        for o in outs:
            if o.finished:
                assert o.request_id not in finished, f"request {o.request_id} finished twice"
                finished[o.request_id] = o
        if on_step is not None:
            on_step(engine, outs)
        steps += 1
        assert steps < max_steps, f"engine did not drain in {max_steps} steps"
    return finished


def run_requests(engine, reqs) -> dict:
    """Add ``reqs`` ((request id, prompt, SamplingParams) triples) to ``engine``, run it dry and
    check no KV block leaked; returns request_id -> final RequestOutput."""
    for rid, prompt, sp in reqs:
        engine.add_request(rid, prompt, sp)
    out = run_engine(engine)
    assert_no_block_leak(engine)
    return out


def assert_no_block_leak(engine) -> None:
    """Every KV block is back in the allocator's free list."""
    alloc = engine.allocator
    assert alloc.num_free_blocks == alloc.num_blocks, (
        f"KV blocks leaked: {alloc.num_blocks - alloc.num_free_blocks} of {alloc.num_blocks} still allocated")



#: EOS id of the requests built by :func:`sampler_request`.
SAMPLER_EOS = 2


def sampler_request(rid: str, sp, prompt=None, output=None, generator=None):
    """A bare Request for sampler tests (prompt [5, 7, 11] unless given, EOS 2, max_tokens 16)."""
    from kvforge.engine.request import Request
    return Request(request_id=rid, prompt_token_ids=list(prompt if prompt is not None else [5, 7, 11]),
                   sampling_params=sp, max_tokens=16, eos_token_ids=frozenset({SAMPLER_EOS}),
                   output_token_ids=list(output or []), generator=generator)


def registry_with_schedulers(*entries: tuple) -> "object":
    """The installed plugins plus an in-process plugin registering ``(name, QueueScheduler
    subclass, capabilities dict)`` entries (built by ``queue_factory``, ``QueueSettings``)."""
    import types

    import kvforge
    from kvforge.plugin_manager import load_registry
    from kvforge_plugins.schedulers.base import QueueSettings, queue_factory
    mod = types.ModuleType("test_schedulers_plugin")
    mod.KVFORGE_HOOK_API = kvforge.KVFORGE_HOOK_API

    def kvforge_register_schedulers(register):
        for name, cls, caps in entries:
            register(name, queue_factory(cls), QueueSettings, **caps)

    mod.kvforge_register_schedulers = kvforge.hookimpl(kvforge_register_schedulers)
    return load_registry(extra_plugins=[("test_schedulers_plugin", mod)])


class FakePytestConfig:
    """Just what kvforge's pytest plugin (``pytest_configure``) reads from a pytest config."""

    def __init__(self, targets: list[str], settings: list[str] | None = None) -> None:
        import pytest
        self.opts = {"kvforge_conformance": targets, "kvforge_settings": settings or [], "kvforge_model": None,
                     "kvforge_device": "auto", "kvforge_grid": None}
        self.stash: dict = {}
        self.args_source = pytest.Config.ArgsSource.ARGS
        self.args: list[str] = []

    def getoption(self, name, default=None):
        return self.opts.get(name, default)

    def addinivalue_line(self, *a) -> None:
        pass
