"""Model runner: turns a SchedulerOutput into one flattened forward and the logits to sample."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge.engine.request import Request
from kvforge.interfaces import (AttentionBackend, AttentionInputs, ForwardMetadata, KVAllocator, Model,
                                SchedulerOutput)


@dataclass
class ExecuteOutput:
    """``logits`` float32 [N, V] for ``sample_requests`` (requests whose step reaches
    their last known token): one row each, except that a request verifying drafts
    (``SchedulerOutput.spec_token_ids``) gets ``1 + len(drafts)`` consecutive rows (its
    last token's position, then each draft's). ``prompt_logits`` request_id -> (first
    prompt position predicted, float32 [P, V]) for requests asking prompt_logprobs.
    ``hidden_states`` [N, hidden_size]: the final hidden states of the same rows, only
    when ``ModelRunner.return_hidden_states`` is set (EAGLE-style drafters)."""

    logits: torch.Tensor
    sample_requests: list[Request]
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    hidden_states: torch.Tensor | None = None


class ModelRunner:
    """Owns the model, the attention backend and the per-layer KV cache tensors.

    Args:
        kv_caches: one tensor per layer, shape ``backend.kv_cache_shape(...)``.
    """

    def __init__(self, model: Model, backend: AttentionBackend, allocator: KVAllocator,
                 kv_caches: list[torch.Tensor], device: torch.device,
                 cpu_caches: list[torch.Tensor] | None = None) -> None:
        self.model = model
        self.backend = backend
        self.allocator = allocator
        self.kv_caches = kv_caches
        self.cpu_caches = cpu_caches or []
        self.device = device
        self.block_size = allocator.block_size
        self.graphs = None  # CudaGraphRunner, set by the engine when CUDA graphs are on
        self.return_hidden_states = False  # set for drafters that need the target's hidden states

    def _prepare(self, out: SchedulerOutput):
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            table = self.allocator.get_block_table(req.request_id)
            toks = req.all_token_ids
            drafts = out.spec_token_ids.get(req.request_id)
            if drafts:  # verification: the drafts follow the last token, in lookahead slots
                toks = toks + drafts
            ids.extend(toks[start:start + n])
            for p in range(start, start + n):
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + n)
            ctx_lens.append(start)
            tables.append(table)
        width = max(len(t) for t in tables)
        table_t = torch.full((len(tables), width), 0, dtype=torch.int32)
        for i, t in enumerate(tables):
            table_t[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        qlens = [qsl[i + 1] - qsl[i] for i in range(len(ctx_lens))]
        dev = self.device
        ctx_t = torch.tensor(ctx_lens, dtype=torch.int32)
        inputs = AttentionInputs(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            context_lens=ctx_t.to(dev),
            seq_lens=(ctx_t + torch.tensor(qlens, dtype=torch.int32)).to(dev),
            block_table=table_t.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(qlens),
            max_seq_len=max(c + q for c, q in zip(ctx_lens, qlens)),
            query_lens_cpu=qlens,
            context_lens_cpu=ctx_lens,
            block_size=bs,
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                inputs, qsl)

    def swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copy whole blocks between device and CPU caches: (src, dst) block-id pairs."""
        if not pairs:
            return
        dim = self.backend.block_dim
        src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        for dev_cache, cpu_cache in zip(self.kv_caches, self.cpu_caches):
            src, dst = (dev_cache, cpu_cache) if to_cpu else (cpu_cache, dev_cache)
            blocks = src.index_select(dim, src_ids.to(src.device))
            dst.index_copy_(dim, dst_ids.to(dst.device), blocks.to(dst.device))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ExecuteOutput:
        """Apply the step's swaps, then run one forward over all scheduled tokens (no padding)."""
        self.swap(out.swap_out, to_cpu=True)
        self.swap(out.swap_in, to_cpu=False)
        input_ids, positions, inputs, qsl = self._prepare(out)
        hidden = None
        if self.graphs is not None and inputs.max_query_len == 1:
            hidden = self.graphs.run(input_ids, positions, inputs)
        if hidden is None:
            meta = ForwardMetadata(self.backend.build_metadata(inputs), self.kv_caches)
            hidden = self.model(input_ids, positions, meta)
        rows: list[int] = []
        sample_reqs: list[Request] = []
        prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}
        for i, req in enumerate(out.scheduled):
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            if start + n >= req.num_tokens:
                num_drafts = len(out.spec_token_ids.get(req.request_id, ()))
                rows.extend(range(qsl[i + 1] - 1 - num_drafts, qsl[i + 1]))
                sample_reqs.append(req)
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                # position p predicts prompt token p + 1; stop at the last prompt token.
                hi = min(start + n, req.num_prompt_tokens - 1)
                h = hidden[qsl[i]: qsl[i] + (hi - start)]
                prompt_logits[req.request_id] = (start + 1, self.model.compute_logits(h))
        logits = self.model.compute_logits(hidden[rows]) if rows else hidden.new_empty((0, 0)).float()
        kept = hidden[rows] if self.return_hidden_states and rows else None
        return ExecuteOutput(logits, sample_reqs, prompt_logits, kept)
