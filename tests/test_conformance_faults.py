"""The conformance suites catch planted bugs.

Each fault is planted in a copy of a built-in (a subclass registered in-process
through the real registry under a new name, or a wrapper of the engine's
function), and the suite for its kind must fail on it, with a message that
says what went wrong:

- a KV allocator that leaks a block on free          -> kv_allocator suite;
- a scheduler that exceeds its token budget           -> scheduler suite;
- a scheduler that starves early arrivals (LIFO)      -> scheduler suite;
- a scheduler whose finish_requests keeps the blocks  -> scheduler suite (abort, stop string);
- a scheduler that stops only on length (no EOS, no stop_token_ids) -> scheduler suite;
- an attention kernel with an off-by-one causal mask  -> attention suite;
- an FP8 KV cache written and read without its scales -> attention suite;
- a rejection sampler without the correction step     -> drafter suite;
- a fused SwiGLU that swaps gate and up               -> quantizer suite;
- a fused pre-norm that leaves out the norm's weight    -> quantizer suite;
- a fused pre-norm that drops the rotation asked of it  -> quantizer suite.
"""
from __future__ import annotations

from dataclasses import replace

import sys
import types
from pathlib import Path

import pytest
import torch

import kvforge
from kvforge.engine.request import RequestStatus
from kvforge.plugin_manager import load_registry
from kvforge.testing import Target
from kvforge.testing import attention as attention_suite
from kvforge.testing import drafter as drafter_suite
from kvforge.testing import kv_allocator as alloc_suite
from kvforge.testing import quantizer as quant_suite
from kvforge.testing import scheduler as sched_suite
from kvforge_plugins.attention.torch_ref import TorchRefBackend, gather_kv, write_kv
from kvforge_plugins.kv_cache.paged import PagedAllocator, PagedSettings
from kvforge_plugins.quant.unquantized import UnquantizedConfig, UnquantizedLinearMethod
from kvforge_plugins.schedulers.base import QueueSettings, queue_factory
from kvforge_plugins.schedulers.chunked_prefill import ChunkedPrefillScheduler

FIXTURE_PKG = Path(__file__).resolve().parent / "fixtures" / "kvforge_example_sched"


def _plugin(name: str, hook: str, register_args: list[tuple]) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.KVFORGE_HOOK_API = kvforge.KVFORGE_HOOK_API

    def impl(register):
        for args, caps in register_args:
            register(*args, **caps)

    impl.__name__ = hook
    setattr(mod, hook, kvforge.hookimpl(impl))
    return mod


# -- planted faults ----------------------------------------------------------------------------

class LeakyPaged(PagedAllocator):
    """paged, but free() forgets the request's last block (it stays referenced forever)."""

    def free(self, request) -> None:
        table = self._tables.get(request.request_id)
        if table and len(table) > 1:
            table.pop()
        super().free(request)


class OverBudgetScheduler(ChunkedPrefillScheduler):
    """chunked_prefill, but a prompt chunk is never cut to the remaining token budget."""

    def _chunk(self, remaining: int, budget: int) -> int:
        return remaining


class KeepsBlocksOnFinishScheduler(ChunkedPrefillScheduler):
    """chunked_prefill, but finish_requests (abort, stop string) never frees the request's blocks."""

    def finish_requests(self, request_ids, status):
        self.allocator.free = lambda request: None  # the bug (an instance attribute hides the method)
        try:
            return super().finish_requests(request_ids, status)
        finally:
            del self.allocator.free


class KeepsBlocksOfPromptAbortsScheduler(ChunkedPrefillScheduler):
    """chunked_prefill, but a request aborted before its first token keeps its blocks."""

    def finish_requests(self, request_ids, status):
        free = self.allocator.free
        self.allocator.free = lambda request: free(request) if request.output_token_ids else None  # the bug
        try:
            return super().finish_requests(request_ids, status)
        finally:
            del self.allocator.free


class LengthOnlyStopScheduler(ChunkedPrefillScheduler):
    """chunked_prefill, but its stop check knows only max_tokens / max_model_len: EOS and
    stop_token_ids never end a request."""

    def update(self, output, sampled):
        finished = []
        for req in output.scheduled:
            if req.is_finished:
                continue
            req.num_computed_tokens += output.num_scheduled_tokens[req.request_id]
            for tok in sampled.get(req.request_id, ()):
                req.output_token_ids.append(tok)
                if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:  # the bug
                    self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                    finished.append(req)
                    break
        for fn in output.on_step_done:
            fn()
        return finished


class OffByOneMaskBackend(TorchRefBackend):
    """torch_ref, but each query also sees the key right after it (``kpos <= qpos + 1``)."""

    name = "off_by_one"

    def forward(self, layer, q, k, v, kv_cache, metadata):
        write_kv(kv_cache, k, v, metadata.slot_mapping)
        out = torch.empty_like(q)
        start = 0
        for i, (qlen, ctx) in enumerate(zip(metadata.query_lens_cpu, metadata.context_lens_cpu)):
            seq = ctx + qlen
            blocks = metadata.block_table[i, : -(-seq // metadata.block_size)].long()
            ks, vs = gather_kv(kv_cache, blocks, seq)
            group = q.shape[1] // ks.shape[1]
            kf, vf = ks.float().repeat_interleave(group, 1), vs.float().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[start:start + qlen].float(), kf) * layer.scale
            qpos = torch.arange(qlen).unsqueeze(1) + ctx
            kpos = torch.arange(seq).unsqueeze(0)
            scores = scores.masked_fill(~(kpos <= qpos + 1), float("-inf"))  # the bug: + 1
            out[start:start + qlen] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)
            start += qlen
        return out


class UnscaledFP8Backend(TorchRefBackend):
    """torch_ref, declaring FP8 caches, but it writes and reads them without the layer's scales."""

    name = "fp8_unscaled"

    def forward(self, layer, q, k, v, kv_cache, metadata):
        return super().forward(replace(layer, kv_scale=None), q, k, v, kv_cache, metadata)  # the bug


class SwappedSwiGLUMethod(UnquantizedLinearMethod):
    """unquantized, plus a fused SwiGLU that computes silu(up) * gate."""

    def apply_silu_and_mul(self, layer, x, bias):
        gate, up = self.apply(layer, x, bias).chunk(2, dim=-1)
        return torch.nn.functional.silu(up) * gate  # the bug: gate and up swapped


class SwappedSwiGLUConfig(UnquantizedConfig):
    name = "swapped_swiglu"

    def __init__(self, hf_quant_config=None, settings=None) -> None:
        self._method = SwappedSwiGLUMethod()


class UnweightedNormMethod(UnquantizedLinearMethod):
    """unquantized, plus a fused pre-norm that leaves out the norm's weight."""

    def apply_add_rmsnorm(self, layer, x, residual, norm_weight, eps, bias, silu_and_mul=False, rope=None):
        if silu_and_mul or rope is not None:
            return None
        r = x + residual
        rf = r.float()
        h = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # the bug: no * norm_weight
        return self.apply(layer, h, bias), r


class UnrotatedMethod(UnquantizedLinearMethod):
    """unquantized, plus a fused pre-norm that drops the rotation it was asked for."""

    def apply_add_rmsnorm(self, layer, x, residual, norm_weight, eps, bias, silu_and_mul=False, rope=None):
        if silu_and_mul:
            return None
        r = x + residual
        rf = r.float()
        h = ((rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * norm_weight)
        return self.apply(layer, h, bias), r  # the bug: rope ignored


class UnrotatedConfig(UnquantizedConfig):
    name = "unrotated"

    def __init__(self, hf_quant_config=None, settings=None) -> None:
        self._method = UnrotatedMethod()


class UnweightedNormConfig(UnquantizedConfig):
    name = "unweighted_norm"

    def __init__(self, hf_quant_config=None, settings=None) -> None:
        self._method = UnweightedNormMethod()


def _make_leaky(num_blocks, block_size, settings, cache_config):
    return LeakyPaged(num_blocks, block_size, cache_config.enable_prefix_caching)


class PlaceholderHashingPaged(PagedAllocator):
    """paged, but it hashes every token, async-scheduling placeholders included."""

    def _hashes(self, request):
        from kvforge_plugins.kv_cache.block_hash import extend_hashes
        hs = self._req_hashes.setdefault(request.request_id, [])
        extend_hashes(hs, request.token_slice, request.num_tokens, self.block_size,
                      (request.cache_salt or "").encode())
        return hs


def _make_placeholder_hashing(num_blocks, block_size, settings, cache_config):
    return PlaceholderHashingPaged(num_blocks, block_size, cache_config.enable_prefix_caching)


@pytest.fixture(scope="module")
def registry():
    planted = _plugin("planted_faults", "kvforge_register_kv_allocators",
                      [(("leaky_paged", _make_leaky, PagedSettings), {"prefix_caching": True}),
                       (("placeholder_hashing_paged", _make_placeholder_hashing, PagedSettings),
                        {"prefix_caching": True})])
    sched = _plugin("planted_sched", "kvforge_register_schedulers",
                    [(("over_budget", queue_factory(OverBudgetScheduler), QueueSettings), {}),
                     (("keeps_blocks", queue_factory(KeepsBlocksOnFinishScheduler), QueueSettings), {}),
                     (("keeps_prompt_aborts", queue_factory(KeepsBlocksOfPromptAbortsScheduler), QueueSettings),
                      {}),
                     (("length_only_stop", queue_factory(LengthOnlyStopScheduler), QueueSettings), {})])
    attn = _plugin("planted_attn", "kvforge_register_attention_backends",
                   [(("off_by_one", OffByOneMaskBackend), {"priority": -1}),
                    (("fp8_unscaled", UnscaledFP8Backend), {"priority": -1, "kv_cache_dtypes": ("fp8_e4m3",)})])
    quant = _plugin("planted_quant", "kvforge_register_quantizers",
                    [(("swapped_swiglu", SwappedSwiGLUConfig), {}), (("unweighted_norm", UnweightedNormConfig), {}),
                     (("unrotated", UnrotatedConfig), {})])
    sys.path.insert(0, str(FIXTURE_PKG))
    try:
        sys.modules.pop("kvforge_example_sched", None)
        import kvforge_example_sched as lifo
    finally:
        sys.path.remove(str(FIXTURE_PKG))
    return load_registry(extra_plugins=[("planted_faults", planted), ("planted_sched", sched),
                                        ("planted_attn", attn), ("planted_quant", quant), ("example_sched", lifo)])


def _fails(check, target: Target, *needles: str) -> str:
    with pytest.raises(AssertionError) as ei:
        check(target)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{check.__name__} failed, but its message lacks {n!r}: {msg}"
    return msg


# -- the suites catch them ---------------------------------------------------------------------

@pytest.mark.parametrize("check", [alloc_suite.check_lifecycle, alloc_suite.check_refcounts_and_no_double_allocation,
                                   alloc_suite.check_prefix_cache_integrity, alloc_suite.check_engine_drain_recompute])
def test_leaked_block_is_caught(registry, check):
    _fails(check, Target("kv_allocator", "leaky_paged", registry), "leak")


def test_paged_itself_passes_the_same_checks(registry):
    for check in (alloc_suite.check_lifecycle, alloc_suite.check_refcounts_and_no_double_allocation,
                  alloc_suite.check_placeholder_tokens_are_not_hashed):
        check(Target("kv_allocator", "paged", registry))


def test_hashing_a_placeholder_token_is_caught(registry):
    _fails(alloc_suite.check_placeholder_tokens_are_not_hashed,
           Target("kv_allocator", "placeholder_hashing_paged", registry), "num_known_tokens")


def test_token_budget_overrun_is_caught(registry):
    _fails(sched_suite.check_token_budget_and_max_num_seqs, Target("scheduler", "over_budget", registry),
           "max_num_batched_tokens is 40")


def test_starving_scheduler_is_caught(registry):
    _fails(sched_suite.check_no_starvation_fcfs_load, Target("scheduler", "lifo_example", registry), "starves")


def test_finish_requests_keeping_blocks_is_caught(registry):
    _fails(sched_suite.check_stops_and_aborts, Target("scheduler", "keeps_blocks", registry), "still holds blocks",
           "finish_requests")


def test_blocks_kept_by_an_abort_mid_prompt_are_caught(registry):
    _fails(sched_suite.check_stops_and_aborts, Target("scheduler", "keeps_prompt_aborts", registry),
           "(abort) still holds blocks")  # (mid-prompt; on some seeds the random aborts hit it first)


def test_scheduler_ignoring_eos_and_stop_ids_is_caught(registry):
    _fails(sched_suite.check_stops_and_aborts, Target("scheduler", "length_only_stop", registry),
           "the scheduler ignores EOS", "the scheduler ignores stop_token_ids")


def test_chunked_prefill_itself_passes_the_stop_and_abort_check(registry):
    sched_suite.check_stops_and_aborts(Target("scheduler", "chunked_prefill", registry))


def test_off_by_one_mask_is_caught(registry):
    _fails(attention_suite.check_mixed_batch_numerics, Target("attention", "off_by_one", registry),
           "differs from torch_ref")


def test_fp8_cache_without_scales_is_caught(registry):
    attention_suite.check_fp8_kv_cache(Target("attention", "torch_ref", registry))
    _fails(attention_suite.check_fp8_kv_cache, Target("attention", "fp8_unscaled", registry),
           "differs from torch_ref", "kv_cache=float8_e4m3fn")
    with pytest.raises(pytest.skip.Exception, match="declares no kv_cache_dtypes"):
        attention_suite.check_fp8_kv_cache(Target("attention", "off_by_one", registry))


def test_swapped_fused_swiglu_is_caught(registry):
    quant_suite.check_linear_matches_dequantized_reference(Target("quantizer", "unquantized", registry))
    _fails(quant_suite.check_linear_matches_dequantized_reference, Target("quantizer", "swapped_swiglu", registry),
           "silu_and_mul", "gate_up_proj")


def test_fused_prenorm_without_its_weight_is_caught(registry):
    _fails(quant_suite.check_linear_matches_dequantized_reference, Target("quantizer", "unweighted_norm", registry),
           "forward_prenorm")


def test_fused_prenorm_dropping_the_rotation_is_caught(registry):
    _fails(quant_suite.check_linear_matches_dequantized_reference, Target("quantizer", "unrotated", registry),
           "forward_prenorm (rope)", "qkv_proj")


def _without_correction(real):
    """The engine's rejection sampler, but a rejected position is resampled from p instead
    of norm(max(0, p - q)): the correction step is gone."""
    def faulty(target_probs, draft_token_ids, draft_probs=None, generator=None):
        out = real(target_probs, draft_token_ids, draft_probs, generator)
        k = draft_token_ids.shape[1]
        for r, toks in enumerate(out):
            if len(toks) <= k:  # a rejection happened at position len(toks) - 1
                p = target_probs[r, len(toks) - 1]
                toks[-1] = int(torch.multinomial(p, 1, generator=generator))
        return out
    return faulty


def test_rejection_sampler_without_correction_is_caught(registry, monkeypatch):
    real = drafter_suite.engine_rejection_sampler() or drafter_suite.reference_rejection_sample
    drafter_suite.check_rejection_sampler_fn(real, "unmodified", seed=3)  # the unmodified one passes
    monkeypatch.setattr(drafter_suite, "engine_rejection_sampler", lambda: _without_correction(real))
    names = registry.names("drafter")
    target = Target("drafter", names[0], registry) if names else None
    if target is None:  # no drafter registered: exercise the check function directly
        with pytest.raises(AssertionError, match="not the target distribution"):
            drafter_suite.check_rejection_sampler_fn(_without_correction(real))
        return
    _fails(drafter_suite.check_rejection_sampler_lossless, target, "not the target distribution")


def test_reference_rejection_sampler_is_lossless():
    drafter_suite.check_rejection_sampler_fn(drafter_suite.reference_rejection_sample, "reference", seed=11)
