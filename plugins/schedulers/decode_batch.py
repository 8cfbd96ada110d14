"""Vectorized scheduling of a step in which every running request is a plain decode.

With 1,024 running decodes, calling ``allocate_slots`` once per request costs more than
the rest of a step's host work. An allocator that keeps its tables in a
``BlockTableArray`` and offers ``allocate_decodes`` (the built-in ``paged`` one) finds,
in one numpy pass, the few requests whose next token starts a block or fills one (about
2 in ``block_size``) and works only on those. It refuses, changing nothing, when the
batch's new blocks exceed the free blocks, so no allocation fails and no preemption is
needed on this path: the outcome is exactly the general loop's. Anything else (prefills,
drafts, a budget smaller than the batch, too few free blocks, another allocator) returns
False and the caller runs the general loop.
"""
from __future__ import annotations

import numpy as np

from kvforge.engine.request import Request, RequestStatus
from kvforge.interfaces import KVAllocator, SchedulerOutput


class DecodeBatch:
    """Per-scheduler cache of the running decodes' table rows, prompt lengths and ids.

    The cache holds while the running list has the same requests in the same order and
    no table row changed owner (``BlockTableArray.epoch``).
    """

    def __init__(self, allocator: KVAllocator, max_model_len: int) -> None:
        self.allocator = allocator
        self.max_model_len = max_model_len
        self.tables = getattr(allocator, "table_array", None)
        self.available = self.tables is not None and hasattr(allocator, "allocate_decodes")
        self._reqs: list[Request] = []
        self._epoch = -1
        self._rows = np.zeros(0, dtype=np.int64)
        self._expected_shape = np.zeros(0, dtype=np.int64)
        self._rids: list[str] = []
        self._counts: dict[str, int] = {}
        self._limits = np.zeros(0, dtype=np.int64)
        self._blocker: Request | None = None

    def schedule(self, running: list[Request], budget: int, out: SchedulerOutput) -> bool:
        """Schedule one token for each of ``running`` into ``out`` when all are plain
        decodes (no drafts) that fit ``budget`` and the free blocks. Returns False with
        ``out``, the requests and the allocator untouched otherwise."""
        b = len(running)
        if not b or b > budget:
            return False
        blocker = self._blocker
        if blocker is not None:  # the request that spoiled the last try: O(1) re-check first
            if blocker.status is RequestStatus.RUNNING and (blocker.spec_token_ids or len(blocker.prompt_token_ids)
                                                           + len(blocker.output_token_ids)
                                                           - blocker.num_computed_tokens != 1):
                return False
            self._blocker = None
        tables = self.tables
        if tables.epoch != self._epoch or running != self._reqs:
            try:
                rows = tables.rows([r.request_id for r in running])
            except KeyError:  # a request without a table (not allocated yet)
                return False
            self._reqs, self._epoch, self._rows = list(running), tables.epoch, rows
            # len(output) - computed of a plain decode: 1 - len(prompt)
            self._expected_shape = 1 - np.fromiter([len(r.prompt_token_ids) for r in running], dtype=np.int64, count=b)
            self._rids = [r.request_id for r in running]
            self._counts = dict.fromkeys(self._rids, 1)
            # tokens (prompt + output) at which check_stop's length limits end each request
            self._limits = np.minimum(
                np.fromiter([r.max_tokens for r in running], dtype=np.int64, count=b) + 1 - self._expected_shape,
                self.max_model_len)
        # (list comprehensions: the cheapest way to read one attribute of every request)
        computed_list = [r.num_computed_tokens for r in running]
        computed = np.fromiter(computed_list, dtype=np.int64, count=b)
        # a plain decode has prompt + outputs = computed + 1 tokens and no drafts; a request
        # with drafts is pushed off the expected value by its draft count << 32
        shape = np.fromiter([len(r.output_token_ids) + (len(r.spec_token_ids) << 32) for r in running],
                            dtype=np.int64, count=b) - computed
        if not np.array_equal(shape, self._expected_shape):
            # a prefill chunk or drafts: likely still there next step (mixed steps skip the gathers)
            self._blocker = running[int(np.flatnonzero(shape != self._expected_shape)[0])]
            return False
        if not self.allocator.allocate_decodes(running, self._rows, computed + 1):
            return False  # short of blocks: the general loop allocates one by one and preempts
        out.scheduled.extend(running)
        out.num_scheduled_tokens = self._counts.copy()
        out.decode_batch = (self._rows, computed, computed_list)
        return True

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]], stop_ids: set[int]) -> list[Request] | None:
        """The token-appending part of ``update`` for a step this batch scheduled (``out``),
        when every request is still running and got exactly one token: advances each by
        one computed token and appends its token, a pass at a time.

        Returns:
            the requests (in batch order) whose new token may stop them (a token in
            ``stop_ids``, or a length limit reached), for the caller's exact ``check_stop``;
            or None, with nothing changed, when the step is not such a step.
        """
        hint = out.decode_batch
        if hint is None or hint[0] is not self._rows:
            return None
        reqs = out.scheduled
        running = RequestStatus.RUNNING
        if len(sampled) == len(reqs) and list(sampled) == self._rids:  # the sampler's usual order
            toks = list(sampled.values())
            if [r.status for r in reqs].count(running) != len(reqs):
                return None  # one was finished after scheduling (abort, stop string)
        else:
            get = sampled.get
            # (a request finished after scheduling reads as None here)
            toks = [get(r.request_id) if r.status is running else None for r in reqs]
        try:
            flat = [t for (t,) in toks]  # exactly one token each
        except (TypeError, ValueError):
            return None
        for r, t in zip(reqs, flat):
            r.num_computed_tokens += 1
            r.output_token_ids.append(t)
        # after this step a request holds computed + 2 tokens (computed as scheduled)
        maybe = np.flatnonzero(hint[1] + 2 >= self._limits).tolist()
        if not stop_ids.isdisjoint(flat):
            maybe = sorted(set(maybe).union(i for i, t in enumerate(flat) if t in stop_ids))
        return [reqs[i] for i in maybe]
