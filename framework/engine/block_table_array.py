"""Persistent, array-backed block tables (an optional allocator capability).

Rebuilding every request's block table from Python lists each step costs a Python pass
per request. An allocator that also keeps its tables here, updated only when a table
changes (a new block, a freed request, a rolled-back draft), lets the model runner and the
built-in scheduler handle a step of pure decodes with a few vectorized numpy operations
(issue 4's CPU-overhead target). Allocators without it use the general per-request path.
"""
from __future__ import annotations

import numpy as np


class BlockTableArray:
    """Block tables of live requests as rows of one int32 array.

    Attributes:
        table: int32 [capacity, width] physical block ids; row ``r`` holds the table of
            the request mapped to ``r`` in its first ``lens[r]`` entries and zeros after
            them (so a gathered row equals the zero-padded table of the general path).
        lens: int64 [capacity] block-table length of each row (0 for unused rows).
        marks: int64 [capacity] one counter per row for the owner's own bookkeeping (the
            ``paged`` allocator: how many of the row's blocks are prefix-cache registered).
        row_of: request_id -> row.
        epoch: bumped whenever a row is assigned or released, so a caller that cached the
            rows of a list of requests knows when to look them up again.
    """

    def __init__(self, capacity: int = 64, width: int = 16) -> None:
        self.table = np.zeros((capacity, width), dtype=np.int32)
        self.lens = np.zeros(capacity, dtype=np.int64)
        self.marks = np.zeros(capacity, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(capacity - 1, -1, -1))
        self.epoch = 0

    def set_table(self, request_id: str, blocks: list[int]) -> int:
        """Store ``request_id``'s whole table (block ids in logical order); returns its row."""
        row = self.row_of.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self._free_rows.pop()
            self.row_of[request_id] = row
            self.epoch += 1
        n = len(blocks)
        if n > self.table.shape[1]:
            self._widen(n)
        self.table[row, :n] = blocks
        if n < self.lens[row]:  # shrunk (rolled-back drafts): keep the padding zero
            self.table[row, n:self.lens[row]] = 0
        self.lens[row] = n
        return row

    def append(self, request_id: str, blocks: list[int]) -> None:
        """Add ``blocks`` at the end of the (existing) table of ``request_id``."""
        row = self.row_of[request_id]
        lo = int(self.lens[row])
        hi = lo + len(blocks)
        if hi > self.table.shape[1]:
            self._widen(hi)
        if len(blocks) == 1:  # the common case (a decode entering a new block)
            self.table[row, lo] = blocks[0]
        else:
            self.table[row, lo:hi] = blocks
        self.lens[row] = hi

    def append_one(self, rows: np.ndarray, blocks: list[int]) -> None:
        """Add one block at the end of each of the given (distinct, in use) rows.

        Args:
            rows: int64 [K] rows; blocks: K block ids, in the same order.
        """
        lens = self.lens[rows]
        if int(lens.max()) >= self.table.shape[1]:
            self._widen(int(lens.max()) + 1)
        self.table[rows, lens] = blocks
        self.lens[rows] = lens + 1

    def release(self, request_id: str) -> None:
        """Forget ``request_id``'s row (no-op when it has none)."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.table[row, :self.lens[row]] = 0
            self.lens[row] = 0
            self.marks[row] = 0
            self._free_rows.append(row)
            self.epoch += 1

    def rows(self, request_ids: list[str]) -> np.ndarray:
        """int64 [B] rows of the given requests (KeyError for one without a table)."""
        return np.fromiter(map(self.row_of.__getitem__, request_ids), dtype=np.int64, count=len(request_ids))

    def _widen(self, width: int) -> None:
        wider = np.zeros((self.table.shape[0], max(width, 2 * self.table.shape[1])), dtype=np.int32)
        wider[:, :self.table.shape[1]] = self.table
        self.table = wider

    def _grow_rows(self) -> None:
        cap = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
        self.marks = np.concatenate([self.marks, np.zeros_like(self.marks)])
        self._free_rows.extend(range(2 * cap - 1, cap - 1, -1))
