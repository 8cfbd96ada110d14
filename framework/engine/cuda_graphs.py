"""CUDA-graph capture and replay of pure-decode steps, per batch-size bucket (and of
small mixed steps, per token-count bucket: :mod:`kvforge.engine.cuda_graphs_mixed`).

A decode step of a large model is hundreds of small kernel launches; replaying a
captured graph removes the CPU launch cost (as vLLM and SGLang do). Each bucket
``b`` owns static input buffers; a step with ``n <= b`` decodes copies its inputs
in, pads rows ``n..b-1`` onto a scratch KV block that no request owns, replays,
and reads the first ``n`` hidden rows.

Backend contract (capability ``cuda_graphs=True``): for a pure-decode batch,
``build_metadata`` may depend only on the batch size and on tensors of the
AttentionInputs (which stay the static buffers), and ``forward`` makes no host
synchronisation. At capture ``max_seq_len`` is ``max_model_len``.
"""
from __future__ import annotations

import logging

import torch

from kvforge.interfaces import AttentionBackend, AttentionInputs, ForwardMetadata, Model

log = logging.getLogger("kvforge")

def capture_sizes(spec: "int | list[int] | None", max_batch: int) -> tuple[int, ...]:
    """Decode batch sizes to capture (``model.cuda_graph_sizes``), each <= ``max_batch``; a
    batch larger than the largest runs eagerly (as in vLLM).

    ``None``: 1, 2, 4 and every multiple of 8 up to ``max_batch``, and ``max_batch`` itself;
    one value N: the same pattern up to min(N, max_batch), N included; a list: those sizes
    (those above ``max_batch`` dropped). With the pattern a step of n decodes pads to the next
    multiple of 8: at most 7 padding rows run the GEMMs (coarser buckets padded a
    193-request batch to 256).
    """
    if isinstance(spec, list):
        return tuple(sorted({s for s in spec if s <= max_batch}))
    top = max_batch if spec is None else min(max_batch, spec)
    return tuple(sorted({s for s in (1, 2, 4, *range(8, top + 1, 8)) if s < top} | {top}))


#: the largest decode batch captured whatever max_num_seqs (larger ones run eagerly)
MAX_CAPTURE_BATCH = 512


def decode_capture(config) -> tuple[int, tuple[int, ...]]:
    """(largest decode batch captured, the sizes captured) for an ``EngineConfig``."""
    max_batch = min(config.scheduler.max_num_seqs, MAX_CAPTURE_BATCH)
    return max_batch, capture_sizes(config.model.cuda_graph_sizes, max_batch)


class _StaticInputs:
    """One set of static input buffers for the largest bucket; every bucket's graph reads a
    leading slice of them (steps run one after another on one stream, so a slice is never
    refilled while a graph that reads it is queued before the copy). One set instead of one
    per bucket keeps the block tables at max_batch x max_blocks however many sizes are
    captured (at a 128k context, 32 KiB per row)."""

    def __init__(self, size: int, max_blocks: int, block_size: int, scratch_block: int, device: torch.device) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), scratch_block * block_size, dtype=torch.int64, device=device)
        self.block_table = torch.full((size, max_blocks), scratch_block, **i32)
        self.context_lens = torch.zeros(size, **i32)
        self.seq_lens = torch.ones(size, **i32)
        self.query_start_loc = torch.arange(size + 1, **i32)


class _Bucket:
    def __init__(self, size: int, static: _StaticInputs, block_size: int, max_model_len: int,
                 scratch_block: int) -> None:
        self.size = size
        self.scratch_block = scratch_block
        self.input_ids = static.input_ids[:size]
        self.positions = static.positions[:size]
        self.slot_mapping = static.slot_mapping[:size]
        self.block_table = static.block_table[:size]
        self.context_lens = static.context_lens[:size]
        self.seq_lens = static.seq_lens[:size]
        self.inputs = AttentionInputs(
            query_start_loc=static.query_start_loc[:size + 1], context_lens=self.context_lens,
            seq_lens=self.seq_lens, block_table=self.block_table, slot_mapping=self.slot_mapping, max_query_len=1,
            max_seq_len=max_model_len, query_lens_cpu=[1] * size, context_lens_cpu=[0] * size,
            block_size=block_size)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.meta: ForwardMetadata | None = None
        self.output: torch.Tensor | None = None


class CudaGraphRunner:
    """Captures the model's forward for decode batches of each bucket size.

    Args:
        max_batch: largest decode batch to capture (larger ones run eagerly).
        scratch_block: a KV block id outside the allocator's range, written by padded rows.
    """

    def __init__(self, model: Model, backend: AttentionBackend, kv_caches: list[torch.Tensor], max_batch: int,
                 max_model_len: int, block_size: int, scratch_block: int, device: torch.device,
                 buckets: "tuple[int, ...] | None" = None, max_mixed_tokens: int = 0) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.device = device
        self.max_blocks = -(-max_model_len // block_size)
        sizes = sorted(b for b in (capture_sizes(None, max_batch) if buckets is None else set(buckets))
                       if 1 <= b <= max_batch)
        static = _StaticInputs(sizes[-1], self.max_blocks, block_size, scratch_block, device) if sizes else None
        self.buckets = [_Bucket(b, static, block_size, max_model_len, scratch_block) for b in sizes]
        self.pool = None
        # Mixed prefill/decode steps of up to max_mixed_tokens tokens (0 = decode graphs only).
        from kvforge.engine.cuda_graphs_mixed import DEFAULT_MIXED_TOKENS, MixedBucket
        tok = sorted({t for t in DEFAULT_MIXED_TOKENS if t < max_mixed_tokens}
                     | ({max_mixed_tokens} if 0 < max_mixed_tokens <= max(DEFAULT_MIXED_TOKENS) else set()))
        self.mixed = [MixedBucket(t, max_batch, self.max_blocks, block_size, max_model_len, scratch_block, device)
                      for t in tok]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller graphs reuse its memory pool."""
        for mb in reversed(self.mixed):
            self.pool = mb.capture(self.model, self.backend, self.kv_caches, self.pool)
        for bucket in reversed(self.buckets):
            # Kept on the bucket: tensors the backend made for this metadata are read by every replay.
            bucket.meta = meta = ForwardMetadata(self.backend.build_metadata(bucket.inputs), self.kv_caches)
            for _ in range(2):  # warm-up: autotuning and lazy allocations stay out of the graph
                self.model(bucket.input_ids, bucket.positions, meta)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                bucket.output = self.model(bucket.input_ids, bucket.positions, meta)
            if self.pool is None:
                self.pool = g.pool()
            bucket.graph = g
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batch sizes %s", [b.size for b in self.buckets])

    def bucket_for(self, n: int) -> _Bucket | None:
        for b in self.buckets:
            if b.size >= n:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor | None:
        """Replay for a step of n tokens; returns hidden [n, H], or None if no bucket fits."""
        n = input_ids.shape[0]
        if inputs.max_query_len > 1:
            if inputs.block_table.shape[1] > self.max_blocks:
                return None
            for mb in self.mixed:
                if mb.num_tokens >= n and mb.max_seqs >= inputs.context_lens.shape[0]:
                    return mb.run(self.backend, input_ids, positions, inputs)
            return None
        b = self.bucket_for(n)
        if b is None or inputs.block_table.shape[1] > self.max_blocks:
            return None
        b.input_ids[:n].copy_(input_ids)
        b.positions[:n].copy_(positions)
        b.slot_mapping[:n].copy_(inputs.slot_mapping)
        b.context_lens[:n].copy_(inputs.context_lens)
        b.seq_lens[:n].copy_(inputs.seq_lens)
        w = inputs.block_table.shape[1]
        b.block_table[:n, :w].copy_(inputs.block_table)
        if n < b.size:  # padded rows attend to one token of the scratch block and write only there
            b.input_ids[n:].zero_()
            b.positions[n:].zero_()
            b.slot_mapping[n:].fill_(b.scratch_block * inputs.block_size)
            b.block_table[n:].fill_(b.scratch_block)
            b.context_lens[n:].zero_()
            b.seq_lens[n:].fill_(1)
        b.graph.replay()
        return b.output[:n]
