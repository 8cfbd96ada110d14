"""Inputs of a pure-decode step from persistent block-table arrays (a ModelRunner fast path).

In a step where every request computes exactly its last token, the general
``ModelRunner._prepare`` walks each request's block table in Python. When the allocator
keeps its tables in a :class:`~kvforge.engine.block_table_array.BlockTableArray`, the
block table and slot mapping are one numpy gather instead, and what remains per request
is reading its last token (plus its computed count and length when the scheduler did not
hand them over in ``SchedulerOutput.decode_batch``). The result is identical to the
general path's; anything else (prefill chunks, drafts, a request without a table row,
sequences that are not :class:`Request`) falls back to it.
"""
from __future__ import annotations

import numpy as np
import torch

from kvforge.engine.block_table_array import BlockTableArray
from kvforge.engine.request import Request
from kvforge.engine.step_inputs import pack_attention_inputs


class DecodeInputBuilder:
    """Builds ``ModelRunner._prepare``'s result for a step of plain decodes.

    The rows of the step's requests and their prompt lengths are looked up once and
    reused while the same requests run in the same order and no row changed owner
    (``BlockTableArray.epoch``): a steady decode batch does no per-request lookups.
    """

    def __init__(self, tables: BlockTableArray, block_size: int, device: torch.device) -> None:
        self.tables = tables
        self.block_size = block_size
        self.device = device
        self._reqs: list = []
        self._epoch = -1
        self._rows = np.zeros(0, dtype=np.int64)
        self._prompt_lens = np.zeros(0, dtype=np.int64)
        self._qsl: list[int] = [0]

    def build(self, reqs: list[Request], prev_rows: dict[str, int] | None, decode_batch: tuple | None = None):
        """``reqs``: the step's requests, each scheduled for exactly one token, no drafts;
        ``decode_batch``: the scheduler's ``SchedulerOutput.decode_batch`` if any (rows and
        computed counts already read, and the step known to be plain decodes).
        Returns ``_prepare``'s tuple, or None when this step is not a batch of plain
        decodes with table rows (the caller then takes the general path)."""
        b = len(reqs)
        if decode_batch is not None and len(decode_batch[0]) == b:
            rows, ctx, ctx_list = decode_batch
            # (list comprehensions: the cheapest way to read an attribute of every request)
            ids = np.fromiter([(r.output_token_ids or r.prompt_token_ids)[-1] for r in reqs], dtype=np.int64, count=b)
        else:
            tables = self.tables
            if tables.epoch != self._epoch or reqs != self._reqs:
                if type(reqs[0]) is not Request or type(reqs[-1]) is not Request:
                    return None  # duck-typed sequences (a draft model's) go the general way
                try:
                    rows = tables.rows([r.request_id for r in reqs])
                except KeyError:
                    return None
                self._reqs, self._epoch, self._rows = list(reqs), tables.epoch, rows
                self._prompt_lens = np.fromiter([len(r.prompt_token_ids) for r in reqs], dtype=np.int64, count=b)
            rows = self._rows
            ctx = np.fromiter([r.num_computed_tokens for r in reqs], dtype=np.int64, count=b)
            outs = [r.output_token_ids for r in reqs]
            num_out = np.fromiter([len(o) for o in outs], dtype=np.int64, count=b)
            # a plain decode computes its last token, here an output token
            if not np.array_equal(self._prompt_lens + num_out - 1, ctx) or not num_out.all():
                return None
            ids = np.fromiter([o[-1] for o in outs], dtype=np.int64, count=b)
            ctx_list = ctx.tolist()
        if len(self._qsl) != b + 1:
            self._qsl = list(range(b + 1))
        tables = self.tables
        bs = self.block_size
        width = max(int(tables.lens[rows].max()), 1)
        table = tables.table[rows, :width]
        slots = table[np.arange(b), ctx // bs].astype(np.int64) * bs + ctx % bs
        extra = [ids, np.arange(b, dtype=np.int64)]  # every row is sampled
        ph = np.flatnonzero(ids < 0)  # PLACEHOLDER_TOKEN_ID: sampled last step, still on the device
        if ph.size:
            extra += [ph.astype(np.int64), np.asarray([prev_rows[reqs[i].request_id] for i in ph.tolist()],
                                                      dtype=np.int64)]
        qsl = np.arange(b + 1, dtype=np.int64)
        pos, inputs, dev = pack_attention_inputs(ctx, qsl, ctx, ctx + 1, table, slots, 1, [1] * b, list(ctx_list),
                                                 bs, self.device, tuple(extra))
        placeholders = (dev[2], dev[3]) if ph.size else None
        return dev[0], pos, inputs, self._qsl, dev[1], b, list(reqs), placeholders
