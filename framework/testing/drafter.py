"""Conformance suite for speculative-decoding drafters (``kvforge_register_drafters``).

Speculation must be lossless: the drafter only changes speed, never outputs.

- ``greedy_lossless``: greedy outputs with ``speculative.method = NAME`` (k = 1
  and 3 draft tokens, with and without memory pressure) equal the outputs with
  speculation off, every KV block comes back, and the drafter really proposed
  tokens (a drafter that never proposes is trivially lossless and is refused);
- ``rejection_sampler_lossless``: the engine's rejection sampler, fed synthetic
  target and draft distributions, emits tokens distributed exactly as the
  target (Leviathan et al. 2023, Thm. 1; Chen et al. 2023): first-token and
  second-token marginals within 5 sigma per token over 20000 rows, for
  probabilistic and deterministic (one-hot) drafts.

The rejection-sampler check works on any function with the signature of
:func:`reference_rejection_sample`; :func:`check_rejection_sampler_fn` runs it
directly (the project's tests plant a sampler without the correction step and
expect it to fail).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kvforge.testing.harness import (StepMonitor, Target, assert_drained, compare_outputs, reference_outputs)

#: Prompts whose greedy continuations repeat themselves, so n-gram drafters find matches too.
PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside. Once upon a time,",
           "The cat sat on the mat. The cat sat on the mat. The cat",
           "Tom had a big red ball. Tom had a big red ball. Tom had a big",
           "One day, a little bird"]


def reference_rejection_sample(target_probs, draft_token_ids, draft_probs=None, generator=None) -> list[list[int]]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    Args:
        target_probs: float32 [B, k + 1, V], the target distribution at each draft
            position plus the bonus position.
        draft_token_ids: int64 [B, k].
        draft_probs: float32 [B, k, V], the distribution each draft was sampled from,
            or None for deterministic drafts (one-hot ``q``).
        generator: torch.Generator for the uniform draws.
    Returns:
        per row, the accepted draft prefix followed by one token: the correction
        drawn from ``norm(max(0, p - q))`` at the first rejection, or the bonus
        token drawn from ``p[k]`` when every draft is accepted (length 1 .. k + 1).
    """
    import torch
    b, k1, v = target_probs.shape
    k = k1 - 1
    drafts = draft_token_ids.long()
    rows = torch.arange(b)
    p_d = target_probs[:, :k].gather(2, drafts.unsqueeze(-1)).squeeze(-1)                  # [B, k]
    q_d = (draft_probs.gather(2, drafts.unsqueeze(-1)).squeeze(-1) if draft_probs is not None
           else torch.ones_like(p_d))
    u = torch.rand(b, k, generator=generator)
    accepted = (u < (p_d / q_d.clamp_min(1e-20)).clamp(max=1.0)).long().cumprod(1)          # accepted prefix
    n_acc = accepted.sum(1)                                                                 # [B]
    p_at = target_probs[rows, n_acc]                                                        # [B, V]
    at = n_acc.clamp(max=k - 1)
    q_at = (draft_probs[rows, at] if draft_probs is not None
            else torch.nn.functional.one_hot(drafts[rows, at], v).to(p_at.dtype))
    residual = torch.where((n_acc < k).unsqueeze(1), (p_at - q_at).clamp_min(0), p_at)
    total = residual.sum(1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(1e-20), p_at)
    last = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    d_list, n_list, l_list = drafts.tolist(), n_acc.tolist(), last.tolist()
    return [d[:n] + [t] for d, n, t in zip(d_list, n_list, l_list)]


def _marginal_ok(counts, probs, n: int, what: str, tag: str) -> None:
    import math
    for x, (c, p) in enumerate(zip(counts, probs)):
        sigma = math.sqrt(max(n * p * (1 - p), 1.0))
        if abs(c - n * p) > 5 * sigma + 1:
            freq = [round(cc / n, 4) for cc in counts]
            raise AssertionError(f"{tag}: {what} is not the target distribution: token {x} drawn with frequency "
                                 f"{c / n:.4f}, target probability {p:.4f} (5 sigma = {5 * sigma / n:.4f}); "
                                 f"frequencies {freq} vs target {[round(float(q), 4) for q in probs]}. A rejection "
                                 f"sampler must resample rejected positions from norm(max(0, p - q))")


def check_rejection_sampler_fn(fn: Callable, tag: str = "rejection sampler", rows: int = 20000,
                               seed: int = 0) -> None:
    """Statistical losslessness of ``fn`` (signature of :func:`reference_rejection_sample`)."""
    import torch
    p = torch.tensor([[0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
                      [0.05, 0.40, 0.05, 0.30, 0.10, 0.10],
                      [0.10, 0.10, 0.20, 0.20, 0.20, 0.20]])
    q = torch.tensor([[0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                      [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])
    g = torch.Generator().manual_seed(seed)
    k, v = q.shape
    for mode in ("probabilistic drafts", "deterministic drafts"):
        target = p.unsqueeze(0).expand(rows, k + 1, v).contiguous()
        if mode == "probabilistic drafts":
            dprobs = q.unsqueeze(0).expand(rows, k, v).contiguous()
            drafts = torch.stack([torch.multinomial(q[i], rows, replacement=True, generator=g) for i in range(k)], 1)
        else:
            dprobs = None
            drafts = torch.tensor([[0, 1]]).expand(rows, k).contiguous()
        out = fn(target, drafts, dprobs, g)
        if len(out) != rows:
            raise AssertionError(f"{tag} ({mode}): returned {len(out)} rows for {rows}")
        first = [0] * v
        second = [0] * v
        n2 = 0
        for r, toks in enumerate(out):
            toks = [int(t) for t in toks]
            if not 1 <= len(toks) <= k + 1 or toks[:-1] != drafts[r, :len(toks) - 1].tolist():
                raise AssertionError(f"{tag} ({mode}): row {r} returned {toks} for drafts {drafts[r].tolist()}; "
                                     f"expected an accepted draft prefix plus one token")
            first[toks[0]] += 1
            if len(toks) >= 2:
                second[toks[1]] += 1
                n2 += 1
        _marginal_ok(first, p[0].tolist(), rows, f"first emitted token ({mode})", tag)
        if n2 > 500:
            _marginal_ok(second, p[1].tolist(), n2, f"second emitted token given the first draft was accepted "
                                                      f"({mode})", tag)


def engine_rejection_sampler() -> Callable | None:
    """The engine's rejection sampler (``kvforge.engine.rejection_sampler.rejection_sample``)
    adapted to :func:`reference_rejection_sample`'s signature, or None if this kvforge has none.

    The engine's batched form takes ``target_probs`` as ``[sum_i (1 + k_i), V]``, per-request
    draft lists and ``q`` tensors, per-request generators and a default generator, and
    returns ``(tokens, num_accepted)``.
    """
    import importlib
    import inspect
    try:
        mod = importlib.import_module("kvforge.engine.rejection_sampler")
    except ImportError:
        return None
    fn = getattr(mod, "rejection_sample", None)
    if not callable(fn):
        return None
    if "default_generator" not in inspect.signature(fn).parameters:
        return fn

    def adapted(target_probs, draft_token_ids, draft_probs=None, generator=None):
        b, k1, v = target_probs.shape
        qs = [draft_probs[i] for i in range(b)] if draft_probs is not None else [None] * b
        tokens, _ = fn(target_probs.reshape(b * k1, v), draft_token_ids.tolist(), qs, None, generator)
        return tokens

    return adapted


def _spy_registry(target: Target, counter: dict[str, int]):
    """A copy of the registry whose drafter factory counts proposed draft tokens."""
    from kvforge.plugin_manager import Registry
    reg = Registry()
    reg.loaded_plugins = list(target.registry.loaded_plugins)
    from kvforge.plugin_manager import build_plugin
    for spec in target.registry.all():
        if spec.kind == "drafter" and spec.name == target.name:
            def factory(*args: Any, _spec=spec):
                drafter = build_plugin(_spec, *args)  # (the engine's checks and errors, on the real factory)
                orig = drafter.propose

                def propose(*a: Any, **kw: Any):
                    res = orig(*a, **kw)
                    toks = getattr(res, "token_ids", res) or {}
                    counter["proposed"] += sum(len(t) for t in toks.values())
                    return res

                drafter.propose = propose
                return drafter

            spec = dataclasses.replace(spec, factory=factory)
        reg.add(spec)
    return reg


def check_greedy_lossless(target: Target) -> None:
    from kvforge import SamplingParams
    _, tag = target.rng("greedy lossless")
    probe = Target("scheduler", "fcfs", target.registry, target.model, target.device)
    eng0 = probe.engine()
    prompts = [eng0.tokenizer.encode(p) for p in PROMPTS]
    max_tokens = 40
    ref = reference_outputs(probe, prompts, max_tokens)
    ids = [f"d{i}" for i in range(len(prompts))]
    for k, blocks in ((1, None), (3, None), (3, 10)):
        counter = {"proposed": 0}
        spy = Target(target.kind, target.name, _spy_registry(target, counter), target.model, target.device)
        opts: dict[str, Any] = {"speculative_method": target.name, "num_speculative_tokens": k,
                                "speculative.settings": dict(target.settings), "max_num_seqs": 4}
        from kvforge.config import SpeculativeConfig
        if "adaptive" in SpeculativeConfig.model_fields:  # speculate every step: exercise every draft
            opts["speculative.adaptive"] = False
        if blocks:
            opts["num_gpu_blocks"] = blocks
        eng = spy.engine(**opts)
        label = f"{target} {tag} k={k} num_gpu_blocks={blocks or 'auto'}"
        mon = StepMonitor(eng, label)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        done = mon.drain({0: [(rid, {"prompt_token_ids": p}, sp) for rid, p in zip(ids, prompts)]})
        assert_drained(eng, label)
        compare_outputs(done, ids, ref, label, "greedy output with speculation vs. without")
        if counter["proposed"] == 0:
            raise AssertionError(f"{label}: the drafter never proposed a token on repetitive prompts, so "
                                 f"losslessness was not exercised")


def check_rejection_sampler_lossless(target: Target) -> None:
    import pytest
    fn = engine_rejection_sampler()
    if fn is None:
        pytest.skip("this kvforge has no kvforge.engine.rejection_sampler.rejection_sample(target_probs, "
                    "draft_token_ids, draft_probs, generator) to check")
    rng, tag = target.rng("rejection sampler")
    check_rejection_sampler_fn(fn, f"{target} {tag}", seed=rng.randrange(1 << 30))


CHECKS = [check_greedy_lossless, check_rejection_sampler_lossless]
