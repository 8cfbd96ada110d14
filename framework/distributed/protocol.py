"""What the driver sends the workers each step, and how a worker turns it into tensors.

The driver (the engine's process: scheduler, KV allocator, sampler) owns every
:class:`~kvforge.engine.request.Request`; workers own the model shards and KV caches.
A step crosses as a :class:`StepMessage` of flat numpy arrays (cheap to pickle): the new
tokens of every scheduled request, where they start, their block tables, and which rows
need logits. The row rule is :meth:`kvforge.engine.model_runner.ModelRunner.execute`'s:
the last ``1 + num_drafts`` rows of a request that reaches its last known token, and the
prompt rows of a request that asks for ``prompt_logprobs``.

For pipeline parallelism a worker splits the step into micro-batches of whole requests
(GPipe, Huang et al. 2019), balanced by token count; every rank computes the same split.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kvforge.distributed.worker_sampling import WorkerSample
from kvforge.engine.step_inputs import build_attention_inputs
from kvforge.interfaces import AttentionInputs


@dataclass
class StepMessage:
    """One step, flattened. B requests, T new tokens, R logit rows.

    Attributes:
        tokens: int64 [T] new token ids, request after request.
        starts: int64 [B] position of each request's first new token (its computed tokens).
        qlens: int64 [B] new tokens per request.
        tables: int32 [sum(table_lens)] block tables, concatenated.
        table_lens: int64 [B].
        rows: int64 [R] rows of the flattened batch whose logits are returned, in order
            (first the sampling rows, then the prompt-logprob rows).
        swap_out, swap_in: (src, dst) block pairs copied before the forward.
        ph_pos, ph_row: int64 [P] placeholders (async scheduling, tokens sent separately):
            ``tokens[ph_pos[i]]`` is the previous step's sampled token of row ``ph_row[i]``,
            which the driver sends as a ``("tokens", array)`` message once it has sampled
            it (see :meth:`kvforge.distributed.worker.Worker.execute`); empty otherwise.
        ph_on_device: the previous step was sampled on the workers, whose GPUs hold its
            tokens: the placeholders are filled from there and no tokens message follows.
        sample: set when the output worker samples this step's sampling rows itself
            (:mod:`kvforge.distributed.worker_sampling`) and returns token ids, not logits.
    """

    tokens: np.ndarray
    starts: np.ndarray
    qlens: np.ndarray
    tables: np.ndarray
    table_lens: np.ndarray
    rows: np.ndarray
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    ph_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ph_row: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    ph_on_device: bool = False
    sample: WorkerSample | None = None


@dataclass
class StepPlan:
    """Driver-side bookkeeping of a :class:`StepMessage`: what the returned rows mean."""

    sample_requests: list
    num_sample_rows: int
    prompt_slices: list[tuple[str, int, int, int]]  # (request_id, first position, row offset, rows)


def encode_step(so, allocator, prev_tokens: list[int] | None = None,
                prev_rows: dict[str, int] | None = None) -> tuple[StepMessage, StepPlan]:
    """Flatten a :class:`~kvforge.interfaces.SchedulerOutput` (driver side).

    With async scheduling a request's last token may still be a placeholder
    (``PLACEHOLDER_TOKEN_ID``, sampled by the previous step, whose rows ``prev_rows``
    maps). With ``prev_tokens`` (that step's sampled tokens, on the host) it is replaced
    here; without, it is listed in ``ph_pos``/``ph_row`` for the worker to fill in from
    the tokens the driver sends later.

    Raises:
        RuntimeError: a placeholder of a request missing from ``prev_rows``.
    """
    ph_pos: list[int] = []
    ph_row: list[int] = []
    toks: list[int] = []
    starts, qlens, table_lens = [], [], []
    tables: list[int] = []
    sample_rows: list[int] = []
    prompt_rows: list[int] = []
    sample_reqs = []
    prompt_slices = []
    offset = 0
    for req in so.scheduled:
        rid = req.request_id
        n = so.num_scheduled_tokens[rid]
        start = req.num_computed_tokens
        drafts = so.spec_token_ids.get(rid) if so.spec_token_ids else None
        if drafts:  # verification: the drafts follow the last token
            toks.extend((req.token_slice(start, req.num_tokens) + list(drafts))[:n])
        elif n == 1:
            tok = req.token_id_at(start)
            if tok < 0:  # PLACEHOLDER_TOKEN_ID: sampled by the previous step
                if prev_rows is None or rid not in prev_rows:
                    raise RuntimeError(f"request {rid!r}: a placeholder input token without the previous "
                                       "step's sampled tokens")
                if prev_tokens is not None:
                    tok = prev_tokens[prev_rows[rid]]
                else:
                    ph_pos.append(offset)
                    ph_row.append(prev_rows[rid])
            toks.append(tok)
        else:
            toks.extend(req.token_slice(start, start + n))
        table = allocator.get_block_table(rid)
        tables.extend(table)
        table_lens.append(len(table))
        starts.append(start)
        qlens.append(n)
        if start + n >= req.num_tokens:
            nd = len(drafts or ())
            sample_rows.extend(range(offset + n - 1 - nd, offset + n))
            sample_reqs.append(req)
        if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
            hi = min(start + n, req.num_prompt_tokens - 1)
            prompt_slices.append((rid, start + 1, len(prompt_rows), hi - start))
            prompt_rows.extend(range(offset, offset + hi - start))
        offset += n
    msg = StepMessage(np.asarray(toks, dtype=np.int64), np.asarray(starts, dtype=np.int64),
                      np.asarray(qlens, dtype=np.int64), np.asarray(tables, dtype=np.int32),
                      np.asarray(table_lens, dtype=np.int64),
                      np.asarray(sample_rows + prompt_rows, dtype=np.int64),
                      list(so.swap_out), list(so.swap_in), np.asarray(ph_pos, dtype=np.int64),
                      np.asarray(ph_row, dtype=np.int64))
    return msg, StepPlan(sample_reqs, len(sample_rows), prompt_slices)


@dataclass
class MicroBatch:
    """Tensors of a group of whole requests: ``input_ids``/``positions`` [t], attention
    inputs, ``row_idx`` rows of this group (local) that need logits and ``out_idx`` their
    places in the step's row order."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    inputs: AttentionInputs
    row_idx: torch.Tensor
    out_idx: torch.Tensor
    num_tokens: int
    token_start: int = 0  # index of its first token in the step


def split_requests(qlens: np.ndarray, num_parts: int) -> list[tuple[int, int]]:
    """Contiguous request ranges ``[lo, hi)``, at most ``num_parts``, each non-empty, with
    token counts as even as whole requests allow (cut where the running total passes
    each ``k / num_parts`` of the tokens)."""
    b = len(qlens)
    num_parts = max(1, min(num_parts, b))
    if num_parts == 1:
        return [(0, b)]
    cum = np.cumsum(qlens)
    total = int(cum[-1])
    cuts = [0]
    for k in range(1, num_parts):
        c = int(np.searchsorted(cum, total * k / num_parts, side="left")) + 1
        c = max(c, cuts[-1] + 1)
        c = min(c, b - (num_parts - k))
        cuts.append(c)
    cuts.append(b)
    return [(cuts[i], cuts[i + 1]) for i in range(num_parts)]


def build_micro_batches(msg: StepMessage, num_parts: int, block_size: int, device: torch.device) -> list[MicroBatch]:
    """The step's micro-batches as device tensors (the layout of ``ModelRunner._prepare``),
    built with vectorized numpy (no per-request Python work)."""
    tok_off = np.zeros(len(msg.qlens) + 1, dtype=np.int64)
    np.cumsum(msg.qlens, out=tok_off[1:])
    tab_off = np.zeros(len(msg.table_lens) + 1, dtype=np.int64)
    np.cumsum(msg.table_lens, out=tab_off[1:])
    rows = msg.rows
    bs = block_size
    out = []
    for lo, hi in split_requests(msg.qlens, num_parts):
        t0, t1 = int(tok_off[lo]), int(tok_off[hi])
        q = msg.qlens[lo:hi].astype(np.int64)
        ctx = msg.starts[lo:hi].astype(np.int64)
        tl = msg.table_lens[lo:hi].astype(np.int64)
        sel = np.nonzero((rows >= t0) & (rows < t1))[0]
        pos, inputs, _, (tokens, mb_rows, mb_sel) = build_attention_inputs(
            q, ctx, msg.tables[tab_off[lo]:tab_off[hi]], tl, bs, device,
            extra=(np.ascontiguousarray(msg.tokens[t0:t1]), rows[sel] - t0, sel))
        out.append(MicroBatch(tokens, pos, inputs, mb_rows, mb_sel, t1 - t0, t0))
    return out
