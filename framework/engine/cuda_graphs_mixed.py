"""CUDA-graph buckets for small mixed steps (prefill chunks next to decodes).

A chunked-prefill step of a few hundred tokens is as launch-bound as a decode: run
eagerly, an 8B model's 32 layers cost ~13 ms of host launches for ~6 ms of GPU work
(measured on the H200), so every running decode's ITL triples while a long prompt is
chunked in. Each bucket here is captured for up to ``num_tokens`` tokens and
``max_seqs`` requests: inputs are copied into static buffers, padded tokens write only
the scratch KV block, and the attention backend keeps its per-step plan in
fixed-capacity device buffers (``graph_metadata`` / ``update_graph_metadata``, backend
capability ``mixed_cuda_graphs``) whose kernels read the real counts on the device.
"""
from __future__ import annotations

import torch

from kvforge.interfaces import AttentionInputs, ForwardMetadata

#: Token-count buckets captured for mixed steps (capped at max_num_batched_tokens).
DEFAULT_MIXED_TOKENS = (32, 64, 128, 192, 256, 320, 384, 512, 640, 768, 1024)


class MixedBucket:
    """Static buffers and graph of one token-count bucket."""

    def __init__(self, num_tokens: int, max_seqs: int, max_blocks: int, block_size: int, max_model_len: int,
                 scratch_block: int, device: torch.device) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.num_tokens = num_tokens
        self.max_seqs = max_seqs
        self.scratch_slot = scratch_block * block_size
        self.input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((num_tokens,), self.scratch_slot, dtype=torch.int64, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, **i32)
        self.context_lens = torch.zeros(max_seqs, **i32)
        self.seq_lens = torch.zeros(max_seqs, **i32)
        self.block_table = torch.full((max_seqs, max_blocks), scratch_block, **i32)
        self.inputs = AttentionInputs(
            query_start_loc=self.query_start_loc, context_lens=self.context_lens, seq_lens=self.seq_lens,
            block_table=self.block_table, slot_mapping=self.slot_mapping, max_query_len=num_tokens,
            max_seq_len=max_model_len, query_lens_cpu=[0] * max_seqs, context_lens_cpu=[0] * max_seqs,
            block_size=block_size)
        self.attn_meta = None
        self.meta: ForwardMetadata | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def capture(self, model, backend, kv_caches, pool):
        """Warm up, then capture the forward; returns the graph's memory pool."""
        self.attn_meta = backend.graph_metadata(self.inputs, self.num_tokens)
        self.meta = ForwardMetadata(self.attn_meta, kv_caches)
        for _ in range(2):  # compile and allocate outside the graph
            model(self.input_ids, self.positions, self.meta)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            self.output = model(self.input_ids, self.positions, self.meta)
        self.graph = g
        return g.pool()

    def run(self, backend, input_ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """Copy a real step in (device copies only), replay, return hidden [t, H]."""
        t = input_ids.shape[0]
        b = inputs.context_lens.shape[0]
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(inputs.slot_mapping)
        self.slot_mapping[t:].fill_(self.scratch_slot)  # padded tokens write only the scratch block
        self.query_start_loc[:b + 1].copy_(inputs.query_start_loc)
        self.query_start_loc[b + 1:].fill_(t)  # unused request slots are empty
        self.context_lens[:b].copy_(inputs.context_lens)
        self.seq_lens[:b].copy_(inputs.seq_lens)
        self.block_table[:b, :inputs.block_table.shape[1]].copy_(inputs.block_table)
        backend.update_graph_metadata(self.attn_meta, inputs)
        self.graph.replay()
        return self.output[:t]
