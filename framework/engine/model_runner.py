"""Model runner: turns a SchedulerOutput into one flattened forward and the logits to sample."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvforge.engine.block_table_array import BlockTableArray
from kvforge.engine.decode_inputs import DecodeInputBuilder
from kvforge.engine.request import Request
from kvforge.engine.step_inputs import build_attention_inputs
from kvforge.interfaces import AttentionBackend, ForwardMetadata, KVAllocator, Model, SchedulerOutput
from kvforge.layers.kv_cache_dtype import is_fp8


@dataclass
class ExecuteOutput:
    """``logits`` float32 [N, V] for ``sample_requests`` (requests whose step reaches
    their last known token): one row each, except that a request verifying drafts
    (``SchedulerOutput.spec_token_ids``) gets ``1 + len(drafts)`` consecutive rows (its
    last token's position, then each draft's). ``prompt_logits`` request_id -> (first
    prompt position predicted, float32 [P, V]) for requests asking prompt_logprobs.
    ``hidden_states`` [N, hidden_size]: the final hidden states of the same rows, only
    when ``ModelRunner.return_hidden_states`` is set (EAGLE-style drafters).
    ``sampled``: a :class:`~kvforge.engine.sampler.SamplerOutput` when the workers sampled
    the step themselves (``parallel.sample_on_worker``); ``logits`` is then empty."""

    logits: torch.Tensor
    sample_requests: list[Request]
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    hidden_states: torch.Tensor | None = None
    sampled: Any = None


def swap_blocks(kv_caches: list[torch.Tensor], cpu_caches: list[torch.Tensor], block_dim: int,
                pairs: list[tuple[int, int]], to_cpu: bool) -> None:
    """Copy whole KV blocks between per-layer device and CPU caches (swap preemption).

    Args:
        kv_caches / cpu_caches: one tensor per layer, paired in order; blocks along ``block_dim``.
        pairs: (source block id, destination block id); ``to_cpu`` picks the direction.
    """
    if not pairs:
        return
    src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    for dev_cache, cpu_cache in zip(kv_caches, cpu_caches):
        src, dst = (dev_cache, cpu_cache) if to_cpu else (cpu_cache, dev_cache)
        if is_fp8(src.dtype):  # index_copy_ has no FP8 kernel (CPU): copy the bytes
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)
        blocks = src.index_select(block_dim, src_ids.to(src.device))
        dst.index_copy_(block_dim, dst_ids.to(dst.device), blocks.to(dst.device))


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
        self.calibrating = False  # the next forward sets FP8 KV scales: run it eagerly
        self.return_hidden_states = False  # set for drafters that need the target's hidden states
        # vectorized pure-decode inputs when the allocator keeps its tables in arrays
        tables = getattr(allocator, "table_array", None)
        self._decode_inputs = (DecodeInputBuilder(tables, self.block_size, device)
                               if isinstance(tables, BlockTableArray) else None)

    def _prepare(self, out: SchedulerOutput, prev_rows: dict[str, int] | None):
        """Flatten the step into input_ids/positions [T], AttentionInputs and the rows to
        sample, uploaded in one host-to-device copy.

        Per request only Python list work is done (one token for a decode); positions,
        slot mapping and the block table are built with a few vectorized numpy ops, since
        this runs every step for every running request (issue 4's CPU-overhead target).
        A placeholder input token (async scheduling) is listed with its row in the previous
        step's sampled tokens, for :meth:`execute` to fill in on the device."""
        reqs = out.scheduled
        nst = out.num_scheduled_tokens
        spec = out.spec_token_ids
        if (self._decode_inputs is not None and reqs and not spec and len(nst) == len(reqs)
                and sum(nst.values()) == len(reqs)):  # one token each (every count is >= 1)
            fast = self._decode_inputs.build(reqs, prev_rows, out.decode_batch)
            if fast is not None:
                return fast
        get_table = self.allocator.get_block_table
        b = len(reqs)
        ids: list[int] = []
        qlens = [0] * b
        ctx_lens = [0] * b
        tlens = [0] * b
        flat: list[int] = []  # every block table, concatenated (list += is one C-level copy)
        rows: list[int] = []
        sample_reqs: list[Request] = []
        ph_pos: list[int] = []
        ph_row: list[int] = []
        end = 0
        for i, req in enumerate(reqs):
            rid = req.request_id
            n = nst[rid]
            start = req.num_computed_tokens
            qlens[i] = n
            ctx_lens[i] = start
            table = get_table(rid)
            tlens[i] = len(table)
            flat += table
            num_tokens = req.num_tokens  # (duck-typed: the draft model's sequences run here too)
            drafts = spec.get(rid) if spec else None
            if n == 1 and not drafts:
                tok = req.token_id_at(start)
                if tok < 0:  # PLACEHOLDER_TOKEN_ID: sampled last step, still on the device
                    ph_pos.append(end)
                    ph_row.append(prev_rows[rid])  # type: ignore[index]
                ids.append(tok)
            elif drafts:  # verification: the drafts follow the last token, in lookahead slots
                ids.extend((req.token_slice(start, num_tokens) + list(drafts))[:n])
            else:
                ids.extend(req.token_slice(start, start + n))
            end += n
            if start + n >= num_tokens:
                num_drafts = len(drafts) if drafts else 0
                rows.extend(range(end - 1 - num_drafts, end))
                sample_reqs.append(req)
        tlens = np.asarray(tlens, dtype=np.int64)
        flat = np.asarray(flat, dtype=np.int32)
        extra = [np.asarray(ids, dtype=np.int64), np.asarray(rows, dtype=np.int64)]
        if ph_pos:
            extra += [np.asarray(ph_pos, dtype=np.int64), np.asarray(ph_row, dtype=np.int64)]
        pos, inputs, qsl, dev = build_attention_inputs(np.asarray(qlens, dtype=np.int64),
                                                       np.asarray(ctx_lens, dtype=np.int64),
                                                       flat, tlens, self.block_size, self.device, tuple(extra))
        input_ids, rows_t = dev[0], dev[1]
        placeholders = (dev[2], dev[3]) if ph_pos else None
        return input_ids, pos, inputs, qsl, rows_t, len(rows), sample_reqs, placeholders

    def swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        """Copy whole blocks between device and CPU caches: (src, dst) block-id pairs."""
        swap_blocks(self.kv_caches, self.cpu_caches, self.backend.block_dim, pairs, to_cpu)

    def arm_kv_scale_calibration(self) -> None:
        """``cache.calculate_kv_scales``: the next step (run eagerly) sets every layer's FP8
        K/V scales from its own K and V (:func:`kvforge.layers.attention.arm_kv_scale_calibration`)."""
        from kvforge.layers.attention import arm_kv_scale_calibration
        self.calibrating = arm_kv_scale_calibration(self.model) > 0

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None,
                prev_rows: dict[str, int] | None = None) -> ExecuteOutput:
        """Apply the step's swaps, then run one forward over all scheduled tokens (no padding).

        Args:
            out: the scheduler's step.
            prev_tokens: int64 [N'] the previous step's sampled tokens, still on the device
                (async scheduling); ``prev_rows`` maps a request id to its row there. Input
                tokens that are placeholders are taken from it, on the device.
        Nothing here waits for the device unless a request asks for prompt_logprobs.
        """
        self.swap(out.swap_out, to_cpu=True)
        self.swap(out.swap_in, to_cpu=False)
        input_ids, positions, inputs, qsl, rows, num_rows, sample_reqs, placeholders = self._prepare(out, prev_rows)
        if placeholders is not None:
            if prev_tokens is None:
                raise RuntimeError("a placeholder input token without the previous step's sampled tokens")
            input_ids[placeholders[0]] = prev_tokens[placeholders[1]]
        hidden = None
        if self.graphs is not None and not self.calibrating:
            hidden = self.graphs.run(input_ids, positions, inputs)
        if hidden is None:
            meta = ForwardMetadata(self.backend.build_metadata(inputs), self.kv_caches)
            hidden = self.model(input_ids, positions, meta)
            self.calibrating = False
        prompt_logits: dict[str, tuple[int, torch.Tensor]] = {}
        for i, req in enumerate(out.scheduled):
            if req.sampling_params.prompt_logprobs is None:
                continue
            n = out.num_scheduled_tokens[req.request_id]
            start = req.num_computed_tokens
            if start < req.num_prompt_tokens - 1:
                # position p predicts prompt token p + 1; stop at the last prompt token.
                hi = min(start + n, req.num_prompt_tokens - 1)
                h = hidden[qsl[i]: qsl[i] + (hi - start)]
                prompt_logits[req.request_id] = (start + 1, self.model.compute_logits(h))
        if num_rows:
            kept = hidden.index_select(0, rows)
            logits = self.model.compute_logits(kept)
        else:
            kept, logits = None, hidden.new_empty((0, 0)).float()
        return ExecuteOutput(logits, sample_reqs, prompt_logits, kept if self.return_hidden_states else None)
