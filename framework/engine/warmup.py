"""Warm-up forwards at engine start, so that no request pays for kernel compilation.

Triton compiles a kernel the first time it sees a new combination of constexpr values
and of integer-argument specializations (divisible by 16, equal to 1); a first prefill
chunk of an unseen shape can stall every running decode for hundreds of milliseconds
(seen on the H200 as a ~1 s step in the chunked-prefill ITL benchmark). Before serving,
the runner runs one forward per shape class below; every token reads and writes only the
scratch KV block past the allocator's range (the block padded CUDA-graph rows use), so
no request's KV is touched.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvforge.engine.step_inputs import build_attention_inputs
from kvforge.interfaces import ForwardMetadata

log = logging.getLogger("kvforge")


def warmup_shapes(max_num_batched_tokens: int, max_model_len: int) -> list[tuple[list[int], list[int]]]:
    """(query_lens, context_lens) batches covering prefill, extend, mixed and decode steps,
    with token counts both divisible and not divisible by 16."""
    budget = max(2, min(max_num_batched_tokens, max_model_len))
    odd = max(1, budget - 7)
    half = max(1, min(budget // 2, max_model_len - 64))
    shapes = [
        ([budget], [0]),                                  # a whole-budget prefill
        ([odd], [0]),                                     # ... of a length not divisible by 16
        ([min(33, budget)], [min(100, max_model_len - 33)]),  # extend over a cached prefix
        ([1] * 3 + [min(64, budget - 3)], [17, 40, 5, 0]),    # decodes + a prefill chunk
        ([1] * 2 + [min(half, budget - 2)], [9, 30, 64]),     # decodes + a chunk over a prefix
        ([1] * 5, [3, 16, 31, 47, 8]),                    # an eager decode batch
    ]
    out = []
    for q, c in shapes:
        c = [max(0, min(ci, max_model_len - qi)) for qi, ci in zip(q, c)]
        if sum(q) <= budget and all(qi >= 1 for qi in q):
            out.append((q, c))
    return out


@torch.inference_mode()
def warm_up(runner, max_num_batched_tokens: int, max_model_len: int, scratch_block: int,
            max_sample_rows: int = 0) -> float:
    """Run the model over :func:`warmup_shapes` on the scratch block; returns seconds spent.

    ``max_sample_rows``: the most rows a step samples (``max_num_seqs``, times ``k + 1``
    with speculation). Their logits (and a float32 copy, as the sampler makes) are computed
    once, so that the caching allocator holds blocks that large: otherwise the first step
    whose batch is larger than any before allocates with ``cudaMalloc``, which waits for the
    whole queued device work (measured on the H200: a 21 ms stall of every running decode
    when an 8k prompt's last chunk joins 32 decodes)."""
    t0 = time.perf_counter()
    bs = runner.block_size
    for qlens, ctx in warmup_shapes(max_num_batched_tokens, max_model_len):
        q = np.asarray(qlens, dtype=np.int64)
        c = np.asarray(ctx, dtype=np.int64)
        tlens = -(-(q + c) // bs)
        flat = np.full(int(tlens.sum()), scratch_block, dtype=np.int32)
        ids = np.ones(int(q.sum()), dtype=np.int64)
        pos, inputs, qsl, (input_ids,) = build_attention_inputs(q, c, flat, tlens, bs, runner.device, (ids,))
        meta = ForwardMetadata(runner.backend.build_metadata(inputs), runner.kv_caches)
        hidden = runner.model(input_ids, pos, meta)
        last = torch.tensor([x - 1 for x in qsl[1:]], dtype=torch.int64, device=hidden.device)
        runner.model.compute_logits(hidden.index_select(0, last))
    if max_sample_rows > 0:
        rows = min(max_sample_rows, max_num_batched_tokens)
        logits = runner.model.compute_logits(hidden.new_zeros((rows, hidden.shape[-1])))
        logits.float().log_softmax(dim=-1)
        del logits
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    spent = time.perf_counter() - t0
    log.info("warm-up forwards took %.2f s", spent)
    return spent
