"""Per-step metadata for ``triton_paged``: built once per step, shared by every layer.

Splits the flattened varlen batch into decode rows (query_len == 1, served by
the decode kernel) and prefill/extend tiles (query_len > 1, cut into
``block_m``-query tiles for the prefill kernel). All index tensors are built on
the host from ``AttentionInputs.*_cpu`` lists and copied to the device here with one
non-blocking upload, so neither this nor ``forward`` synchronises.

Split-KV: when a step has fewer than ``split_target`` prefill tiles (e.g. one chunk of a
long prompt beside decodes), tiles whose key range is long are cut into ranges of at
least ``split_min_keys`` keys, so that the GPU has enough programs; each range gets a
scratch slot (at most ``MAX_SPLIT_SLOTS`` per step) and the tile a merge entry.

For CUDA-graph capture of mixed steps (:func:`make_graph_metadata`) the decode rows and
tiles live in fixed-capacity device buffers, their counts in device scalars, and
:func:`update_graph_metadata` refills them before each replay.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvforge.engine.host_staging import upload
from kvforge.interfaces import AttentionInputs


@dataclass
class TritonPagedMetadata:
    """What ``TritonPagedBackend.forward`` launches with.

    Attributes:
        inputs: the step's AttentionInputs (device tensors: query_start_loc, context_lens,
            seq_lens, block_table int32; slot_mapping int64).
        decode_rows: int32 [num_decodes] request indices with query_len == 1, or None when
            every request decodes (row i is request i). A pure-decode step thus allocates no
            device tensor of its own: a captured CUDA graph depends only on ``inputs``' buffers.
        prefill_tiles: int32 [5, num_prefill_tiles], one column per prefill work item:
            request index, first query offset in it, key range [lo, hi), scratch slot (-1:
            unsplit). Longest key ranges come first so the heaviest programs start earliest.
        block_m: queries per prefill tile.
        merges: int32 [4, num_merges]: request, first query offset, first slot, slot count
            of each split tile (``num_merges`` 0: nothing split).
        decode_count / tile_count / merge_count: int32 [1] device counts, only in graph
            metadata (then ``num_decodes`` / ``num_prefill_tiles`` / ``num_merges`` are the
            capacities).
    """

    inputs: AttentionInputs
    decode_rows: torch.Tensor | None
    num_decodes: int
    prefill_tiles: torch.Tensor
    num_prefill_tiles: int
    block_m: int
    merges: torch.Tensor | None = None
    num_merges: int = 0
    decode_count: torch.Tensor | None = None
    tile_count: torch.Tensor | None = None
    merge_count: torch.Tensor | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.inputs.slot_mapping


MAX_SPLIT_SLOTS = 32  # scratch slots per step (each float32 [Hq, block_m, D])
_ALIGN = 64  # split boundaries on key-tile multiples


@dataclass(frozen=True)
class SplitPolicy:
    """When to cut prefill tiles' key ranges (``target`` 0: never)."""

    target: int = 16
    min_keys: int = 512


def _plan(inputs: AttentionInputs, block_m: int, split: SplitPolicy) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Decode request indices, the [5, items] prefill work items and the [4, merges] split tiles."""
    qlens, ctxs = inputs.query_lens_cpu, inputs.context_lens_cpu
    decodes = [i for i, n in enumerate(qlens) if n == 1]
    tiles = [(ctxs[i] + min(m0 + block_m, n), i, m0)
             for i, n in enumerate(qlens) if n > 1 for m0 in range(0, n, block_m)]
    items: list[tuple[int, int, int, int, int]] = []
    merges: list[tuple[int, int, int, int]] = []
    per_tile = -(-split.target // len(tiles)) if tiles and len(tiles) < split.target else 1
    slot = 0
    for hi, i, m0 in sorted(tiles, key=lambda x: -x[0]):  # longest ranges get the slots first
        n = min(per_tile, hi // max(1, split.min_keys), MAX_SPLIT_SLOTS - slot)
        if n <= 1:
            items.append((i, m0, 0, hi, -1))
            continue
        per = -(-hi // n)  # ceil(hi / n), rounded up to whole key tiles
        step = -(-per // _ALIGN) * _ALIGN
        ranges = [(lo, min(lo + step, hi)) for lo in range(0, hi, step)]
        merges.append((i, m0, slot, len(ranges)))
        for lo, top in ranges:
            items.append((i, m0, lo, top, slot))
            slot += 1
    items.sort(key=lambda x: x[2] - x[3])
    item_a = np.array(items, dtype=np.int32).reshape(-1, 5).T
    merge_a = np.array(merges, dtype=np.int32).reshape(-1, 4).T
    return decodes, np.ascontiguousarray(item_a), np.ascontiguousarray(merge_a)


def build_triton_metadata(inputs: AttentionInputs, block_m: int, split: SplitPolicy = SplitPolicy()) \
        -> TritonPagedMetadata:
    """Plan one step (host work only, O(B + tiles)); see module docstring."""
    dev = inputs.query_start_loc.device
    if all(n == 1 for n in inputs.query_lens_cpu):
        return TritonPagedMetadata(inputs, None, len(inputs.query_lens_cpu),
                                   torch.empty((5, 0), dtype=torch.int32, device=dev), 0, block_m)
    decodes, item_a, merge_a = _plan(inputs, block_m, split)
    decode_rows, item_t, merge_t = upload([np.asarray(decodes, dtype=np.int32), item_a, merge_a], dev)
    return TritonPagedMetadata(inputs, decode_rows, len(decodes), item_t, item_a.shape[1], block_m,
                               merge_t, merge_a.shape[1])


def make_graph_metadata(inputs: AttentionInputs, max_num_tokens: int, block_m: int) -> TritonPagedMetadata:
    """Fixed-capacity metadata for capturing steps of up to ``max_num_tokens`` tokens and
    ``len(inputs.context_lens)`` requests (the static ``inputs`` of a graph bucket)."""
    dev = inputs.query_start_loc.device
    cap = inputs.context_lens.shape[0]
    # Capacities bound the launch grids (programs past the real count exit at once, but
    # still cost a slot): at most one decode per token, and a prefill request has >= 2
    # tokens, each request's last tile possibly partial.
    max_decodes = min(cap, max_num_tokens)
    max_tiles = -(-max_num_tokens // block_m) + min(cap, max_num_tokens // 2) + MAX_SPLIT_SLOTS
    max_merges = MAX_SPLIT_SLOTS // 2  # a split tile has >= 2 slots
    i32 = dict(dtype=torch.int32, device=dev)
    return TritonPagedMetadata(inputs, torch.zeros(max_decodes, **i32), max_decodes,
                               torch.zeros((5, max_tiles), **i32), max_tiles, block_m,
                               torch.zeros((4, max_merges), **i32), max_merges,
                               decode_count=torch.zeros(1, **i32), tile_count=torch.zeros(1, **i32),
                               merge_count=torch.zeros(1, **i32))


def update_graph_metadata(md: TritonPagedMetadata, inputs: AttentionInputs,
                          split: SplitPolicy = SplitPolicy()) -> None:
    """Refill ``md`` (from :func:`make_graph_metadata`) for a real step; device copies only.

    Raises:
        ValueError: the step has more requests or tiles than the capacity.
    """
    decodes, item_a, merge_a = _plan(inputs, md.block_m, split)
    nd, nt, nm = len(decodes), item_a.shape[1], merge_a.shape[1]
    if nd > md.num_decodes or nt > md.num_prefill_tiles:
        raise ValueError(f"step of {nd} decodes / {nt} prefill tiles exceeds the graph's "
                         f"capacity ({md.num_decodes} / {md.num_prefill_tiles})")
    rows_t, items_t, merges_t, counts_t = upload(
        [np.asarray(decodes, dtype=np.int32), item_a, merge_a, np.array([nd, nt, nm], dtype=np.int32)],
        md.decode_rows.device)
    if nd:
        md.decode_rows[:nd].copy_(rows_t)
    if nt:
        md.prefill_tiles[:, :nt].copy_(items_t)
    if nm:
        md.merges[:, :nm].copy_(merges_t)
    md.decode_count.copy_(counts_t[:1])
    md.tile_count.copy_(counts_t[1:2])
    md.merge_count.copy_(counts_t[2:])
