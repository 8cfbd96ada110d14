"""`draft_model` drafter: a smaller causal LM sharing the target's tokenizer
(Leviathan et al. 2023; Chen et al. 2023) runs k steps ahead with its own paged KV cache.

The draft is built by the engine's own builder (``ctx.build_model``: registry model
class, quantizer, attention backend, weights) and gets its own KV allocator, cache
tensors and :class:`~kvforge.engine.model_runner.ModelRunner` (``ctx.build_runner``).
``num_layers`` keeps only the first N decoder layers (a truncated draft, e.g. the
first 2 layers of the target itself, sharing its embedding, final norm and LM head).

Per request the draft keeps the tokens whose KV it holds. A proposal:

1. compares them with the request's tokens and rolls back to the common prefix (the
   drafts the target rejected; KV blocks beyond are returned);
2. one forward over the tokens it has not seen (the whole prompt the first time; then
   the last accepted tokens), sampling draft 1 from the last position;
3. k - 1 single-token forwards for drafts 2..k.

Draft tokens are drawn from ``q`` = the draft's logits processed exactly like the
target's (penalties, temperature, top-k/top-p/min-p; greedy requests take the argmax);
``q`` is returned for the rejection sampler. Seeded requests draw from their own
generator, so their outputs are reproducible.
"""
from __future__ import annotations

import os
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvforge import hookimpl
from kvforge.engine.position_noise import position_seed
from kvforge.engine.request import PLACEHOLDER_TOKEN_ID
from kvforge.engine.rejection_sampler import SequenceView, process_logits, warp_to_probs
from kvforge.engine.sampler import Sampler
from kvforge.engine.sampling_ops import exponential_race_sample
from kvforge.interfaces import Drafter, DraftProposal, SchedulerOutput

KVFORGE_HOOK_API = "1"

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class DraftModelSettings(BaseModel):
    """``speculative.settings`` of the ``draft_model`` drafter."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    model: str | None = Field(None, description="Draft checkpoint directory (default: the target's own).")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Draft dtype (auto = the target's).")
    num_layers: int | None = Field(None, ge=1, description="Keep only the first N decoder layers.")
    share_weights: bool = Field(
        True, description="When the draft reads the target's checkpoint in the target's dtype, use the "
                          "target's weight tensors instead of a copy (with load_format=dummy this is what "
                          "makes a truncated draft a true truncation of the target).")
    relative_cost: float | None = Field(
        None, ge=0, description="Cost of a draft step relative to a target step, for the adaptive rule "
                                "(default: ratio of matmul parameters).")


class _NoPromptLogprobs:
    prompt_logprobs = None


class _DraftSeq:
    """The draft's view of one request, shaped for ModelRunner and the KV allocator."""

    __slots__ = ("request_id", "tokens", "num_computed_tokens", "verified")
    sampling_params = _NoPromptLogprobs()

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.tokens: list[int] = []       # context (+ drafts); KV held for tokens[:num_computed_tokens]
        self.num_computed_tokens = 0
        self.verified = 0                 # tokens[:verified] are known to be the request's tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens)

    def token_slice(self, lo: int, hi: int) -> list[int]:
        return self.tokens[lo:hi]

    def token_id_at(self, i: int) -> int:
        return self.tokens[i]


def _matmul_params(model: torch.nn.Module) -> int:
    """Parameters used in matmuls per token (embedding lookups excluded; a tied LM head counted)."""
    emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    total = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if head is not None and id(head) in emb:
        total += head.numel()
    return total


class DraftModelDrafter(Drafter):
    """Draft-model proposer (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, settings: DraftModelSettings, ctx) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        model_dir = settings.model or ctx.target_model_dir
        same_ckpt = os.path.realpath(model_dir) == os.path.realpath(ctx.target_model_dir)
        same_dtype = settings.dtype == "auto" or _DTYPES[settings.dtype] == ctx.dtype
        share = settings.share_weights and same_ckpt and same_dtype
        self.stack = ctx.build_model(model_dir, settings.dtype, settings.num_layers, share)
        max_pos = getattr(self.stack.hf_config, "max_position_embeddings", None)
        if max_pos is not None and max_pos < ctx.max_model_len:
            raise ValueError(f"speculative.settings.model: the draft's max_position_embeddings {max_pos} is "
                             f"below max_model_len {ctx.max_model_len}; lower max_model_len")
        self.relative_cost = settings.relative_cost if settings.relative_cost is not None else \
            _matmul_params(self.stack.model) / max(1, _matmul_params(ctx.target_model))
        self.vocab_size = ctx.vocab_size
        self.device = ctx.device
        self.max_batch_tokens = max(1, ctx.max_num_batched_tokens)
        self._build_runner = ctx.build_runner
        self.generator = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 0x5EED)
        self.allocator = None
        self.runner = None
        self._seqs: dict[str, _DraftSeq] = {}

    # -- KV cache -----------------------------------------------------------------------
    def kv_cache_block_bytes(self, block_size: int) -> int:
        return self.stack.kv_block_bytes(block_size)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.allocator, self.runner = self._build_runner(self.stack, num_blocks)

    # -- proposals ----------------------------------------------------------------------
    def _sync(self, req, k: int) -> _DraftSeq | None:
        """Roll the draft's state for ``req`` back to the common prefix, append the new
        tokens and reserve KV slots for this proposal. None if the draft cache is full."""
        st = self._seqs.get(req.request_id)
        if st is None:
            st = self._seqs[req.request_id] = _DraftSeq(req.request_id)
        total = req.num_tokens
        lo = min(st.verified, total)
        real = req.token_slice(lo, total)
        hi = min(st.num_computed_tokens, total - 1)  # the last token is always fed: it yields draft 1
        j = min(lo, hi)
        while j < hi and st.tokens[j] == real[j - lo]:
            j += 1
        del st.tokens[lo:]
        st.tokens.extend(real)
        st.verified = total
        st.num_computed_tokens = j
        self.allocator.free_tail(st, j)
        if self.allocator.allocate_slots(st, total - j, num_lookahead_tokens=k - 1) is None:
            self.free(req)
            return None
        return st

    def _sample(self, logits: torch.Tensor, reqs: list, drafts: list[list[int]]):
        """One draft token per row, left on the device (int64 ``[R]``), and each row's q
        (float32 ``[V]``; None for greedy rows)."""
        if Sampler.needs_logits_processing(reqs):
            work = process_logits(logits, [SequenceView(r, d) for r, d in zip(reqs, drafts)], self.vocab_size)
        else:  # read-only below
            work = logits[:, :self.vocab_size].float()
        q: list[torch.Tensor | None] = [None] * len(reqs)
        rand = [i for i, r in enumerate(reqs) if not r.sampling_params.greedy]
        if not rand:
            return work.argmax(dim=-1), q
        tokens = torch.empty(len(reqs), dtype=torch.int64, device=work.device)
        if len(rand) < len(reqs):
            greedy = torch.tensor([i for i, r in enumerate(reqs) if r.sampling_params.greedy], device=work.device)
            tokens[greedy] = work.index_select(0, greedy).argmax(dim=-1)
        idx = torch.tensor(rand, device=work.device)
        probs = warp_to_probs(work.index_select(0, idx), [reqs[i].sampling_params for i in rand])
        # seeded requests draw with the noise the target's verification will use at that
        # position (kvforge.engine.position_noise): a draft equal to the target is accepted
        seeds = [position_seed(reqs[i], len(reqs[i].output_token_ids) + len(drafts[i]))
                 if reqs[i].generator is not None else None for i in rand]
        tokens[idx] = exponential_race_sample(probs, [reqs[i].generator for i in rand], self.generator, seeds)
        for j, i in enumerate(rand):
            q[i] = probs[j]
        return tokens, q

    def _catch_up(self, seqs: list[_DraftSeq]) -> None:
        """Feed unseen context tokens (all but each sequence's last) in chunked forwards
        of at most ``max_num_batched_tokens`` tokens, as the target's prefill is."""
        while True:
            todo = [(st, st.num_tokens - st.num_computed_tokens - 1) for st in seqs
                    if st.num_tokens - st.num_computed_tokens > 1]
            if not todo or sum(n for _, n in todo) + len(seqs) <= self.max_batch_tokens:
                return
            so, budget = SchedulerOutput(), self.max_batch_tokens
            for st, n in todo:
                take = min(n, budget)
                if take <= 0:
                    break
                so.scheduled.append(st)
                so.num_scheduled_tokens[st.request_id] = take
                budget -= take
            self.runner.execute(so)  # no sampling rows: each keeps at least its last token
            for st in so.scheduled:
                st.num_computed_tokens += so.num_scheduled_tokens[st.request_id]

    def propose(self, requests, num_tokens, hidden_states=None) -> DraftProposal:
        reqs, seqs, ks = [], [], []
        for req, k in zip(requests, num_tokens):
            st = self._sync(req, k)
            if st is not None:
                reqs.append(req)
                seqs.append(st)
                ks.append(k)
        self._catch_up(seqs)
        first = {st.request_id: st.num_tokens - st.num_computed_tokens for st in seqs}
        # Penalties read the draft ids on the host; otherwise each draft stays on the device
        # and feeds the next forward as a placeholder input (as async scheduling does), so
        # the k forwards queue back to back and the host reads all drafts once at the end.
        lazy = not any(r.sampling_params.reads_history for r in reqs)
        drafts: list[list[int]] = [[] for _ in reqs]
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        on_device: list[tuple[list[int], torch.Tensor]] = []  # (active indices, their drafts [n])
        active = list(range(len(reqs)))
        sched = first
        prev, prev_rows = None, None
        while active:
            so = SchedulerOutput(scheduled=[seqs[i] for i in active],
                                 num_scheduled_tokens={seqs[i].request_id: sched[seqs[i].request_id]
                                                       for i in active})
            ex = self.runner.execute(so, prev, prev_rows)
            for i in active:
                seqs[i].num_computed_tokens += sched[seqs[i].request_id]
            toks, q = self._sample(ex.logits, [reqs[i] for i in active], [drafts[i] for i in active])
            if lazy:
                on_device.append((active, toks))
                prev, prev_rows = toks, {seqs[i].request_id: j for j, i in enumerate(active)}
                new = [PLACEHOLDER_TOKEN_ID] * len(active)
            else:
                new = toks.tolist()
            for j, i in enumerate(active):
                drafts[i].append(new[j])
                seqs[i].tokens.append(new[j])
                if q[j] is not None:
                    qs[i].append(q[j])
            active = [i for i in active if len(drafts[i]) < ks[i]]
            sched = {seqs[i].request_id: 1 for i in active}
        if on_device:
            known = torch.cat([t for _, t in on_device]).tolist()  # the one wait for the device
            pos = 0
            for step, (rows, _) in enumerate(on_device):
                for i in rows:
                    drafts[i][step] = known[pos]
                    seqs[i].tokens[len(seqs[i].tokens) - len(drafts[i]) + step] = known[pos]
                    pos += 1
        out = DraftProposal()
        for req, d, q in zip(reqs, drafts, qs):
            out.token_ids[req.request_id] = d
            if q:
                out.probs[req.request_id] = torch.stack(q)
        return out

    def free(self, request) -> None:
        st = self._seqs.pop(request.request_id, None)
        if st is not None and self.allocator is not None:
            self.allocator.free(st)

    def stats(self) -> dict[str, float]:
        if self.allocator is None:
            return {}
        return {"spec_draft_kv_cache_usage": 1.0 - self.allocator.num_free_blocks / max(1, self.allocator.num_blocks)}


def make_draft_model(speculative_config, settings: DraftModelSettings, ctx) -> DraftModelDrafter:
    return DraftModelDrafter(speculative_config.num_speculative_tokens, settings, ctx)


@hookimpl
def kvforge_register_drafters(register) -> None:
    register("draft_model", make_draft_model, DraftModelSettings)
