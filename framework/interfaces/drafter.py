"""Drafter interface for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A drafter proposes up to ``k`` tokens per request; the target model scores all
``k + 1`` positions in one forward and the rejection sampler
(:mod:`kvforge.engine.rejection_sampler`) keeps a prefix, so the output
distribution is exactly the target's.

Life cycle (driven by the engine, :mod:`kvforge.engine.spec_decode`):

1. build: ``factory(speculative_config, settings, ctx: DrafterContext)``, once;
   then ``kv_cache_block_bytes(block_size)`` is added to the target's per-block
   size when the KV budget is split into blocks, and ``init_kv_cache(num_blocks)``
   is called with the target's block count (a drafter with no KV ignores both);
2. after every step, ``propose(requests, num_tokens)`` for the running requests
   whose prompt is done and that may speculate; proposals are verified in the
   next step;
3. ``free(request)`` when a request finishes, is aborted or is preempted: its
   next proposal starts from scratch.

EAGLE-style drafters (Li et al. 2024), which extrapolate the target's hidden
states, plug in through the same ``propose`` call: the engine passes the
target's last hidden states for each request in ``hidden_states`` (shape
``[num_requests, hidden_size]``, the model dtype; row i is the final-norm hidden
state at the position that produced ``requests[i]``'s last token) when the
drafter declares the capability ``needs_hidden_states=True`` at registration
(``register("eagle", factory, Settings, needs_hidden_states=True)``). The
target model itself is ``ctx.target_model`` (e.g. to share its embedding and
LM head).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from kvforge.hookspecs import KVFORGE_HOOK_API

if TYPE_CHECKING:
    import torch

    from kvforge.engine.request import Request


@dataclass
class DraftProposal:
    """What ``propose`` returns.

    Attributes:
        token_ids: request_id -> draft token ids (at most the number asked for;
            empty or absent = no speculation for that request this step).
        probs: request_id -> float32 ``[len(token_ids[rid]), V]`` draft distribution
            ``q`` each draft token was sampled from (rows need not be normalised
            exactly; V = the target vocabulary). Absent for a request = its drafts
            are deterministic (``q`` is one-hot on the draft token), as for n-gram
            lookup or a greedy draft.
    """

    token_ids: dict[str, list[int]] = field(default_factory=dict)
    probs: dict[str, "torch.Tensor"] = field(default_factory=dict)


@dataclass
class DrafterContext:
    """What a drafter factory receives besides its settings.

    Attributes:
        target_model: the target :class:`~kvforge.interfaces.Model` (shared, do not modify).
        target_hf_config: its Hugging Face config; target_model_dir: its checkpoint directory.
        device, dtype: where and in which dtype the target runs.
        vocab_size: the target's vocabulary (draft logits must use the same token ids).
        max_model_len, max_num_seqs, block_size, max_num_batched_tokens: engine limits
            (tokens, requests, tokens per block, tokens per forward).
        seed: the engine seed (for the drafter's own RNG of unseeded requests).
        load_format: the target's load format (``dummy`` for benchmarks).
        build_model: ``build_model(model_dir, dtype="auto", num_layers=None, share_weights=False)``
            -> a model stack (model + attention backend + KV geometry) built through
            the same registry and builder code as the target (``num_layers`` keeps only
            the first N decoder layers; ``share_weights`` reuses the target's tensors
            by name instead of loading a copy).
        build_runner: ``build_runner(stack, num_blocks) -> (allocator, runner)``: a fresh
            KV allocator (the configured ``cache.allocator``, prefix caching off), KV cache
            tensors and a :class:`~kvforge.engine.model_runner.ModelRunner` for ``stack``.
    """

    target_model: Any
    target_hf_config: Any
    target_model_dir: str
    device: Any
    dtype: Any
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int
    max_num_batched_tokens: int = 2048
    seed: int = 0
    load_format: str = "auto"
    build_model: Callable[..., Any] | None = None
    build_runner: Callable[..., Any] | None = None


class Drafter(ABC):
    """Proposes draft tokens.

    Attributes:
        num_speculative_tokens: k, the most tokens ever asked for per request.
        relative_cost: cost of one draft step relative to one target decode step
            (0 for n-gram lookup; about the parameter ratio for a draft model); the
            adaptive rule (:class:`kvforge.engine.spec_adaptive.AdaptiveSpeculation`) uses it.
    """

    KVFORGE_HOOK_API = KVFORGE_HOOK_API
    num_speculative_tokens: int
    relative_cost: float = 0.0

    @abstractmethod
    def propose(self, requests: list["Request"], num_tokens: list[int],
                hidden_states: Any = None) -> "DraftProposal | dict[str, list[int]]":
        """Propose draft tokens.

        Args:
            requests: running requests whose prompt is fully computed; their last
                token (``all_token_ids[-1]``) has no KV yet. Do not modify them.
            num_tokens: per request, the most drafts wanted (1 <= n <= k).
            hidden_states: see the module docstring (None unless ``needs_hidden_states``).

        Returns:
            a :class:`DraftProposal`, or a plain ``request_id -> token ids`` dict
            for a deterministic drafter.
        """

    def free(self, request: "Request") -> None:
        """Release per-request drafter state (e.g. the draft model's own KV blocks).
        Called for finished, aborted and preempted requests; unknown ids are a no-op."""

    def kv_cache_block_bytes(self, block_size: int) -> int:
        """Bytes of drafter KV cache per block of ``block_size`` tokens (0 = none)."""
        return 0

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the drafter's own KV cache of ``num_blocks`` blocks (after the budget split)."""

    def stats(self) -> dict[str, float]:
        """Drafter counters for ``engine.stats()`` (e.g. its KV usage)."""
        return {}
