"""Per-step metadata for ``triton_paged``: built once per step, shared by every layer.

Splits the flattened varlen batch into decode rows (query_len == 1, served by
the decode kernel) and prefill/extend tiles (query_len > 1, cut into
``block_m``-query tiles for the prefill kernel). All index tensors are built on
the host from ``AttentionInputs.*_cpu`` lists and copied to the device here with one
non-blocking upload, so neither this nor ``forward`` synchronises.

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
        prefill_tiles: int32 [2, num_prefill_tiles]: request index, first query offset in it.
            Longest-key-range tiles come first so the heaviest programs start earliest.
        block_m: queries per prefill tile.
        decode_count / tile_count: int32 [1] device counts, only in graph metadata (then
            ``num_decodes`` / ``num_prefill_tiles`` are the capacities).
    """

    inputs: AttentionInputs
    decode_rows: torch.Tensor | None
    num_decodes: int
    prefill_tiles: torch.Tensor
    num_prefill_tiles: int
    block_m: int
    decode_count: torch.Tensor | None = None
    tile_count: torch.Tensor | None = None

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.inputs.slot_mapping


def _plan(inputs: AttentionInputs, block_m: int) -> tuple[list[int], np.ndarray]:
    """Decode request indices and the [2, num_tiles] prefill tiles (longest key range first)."""
    qlens, ctxs = inputs.query_lens_cpu, inputs.context_lens_cpu
    decodes = [i for i, n in enumerate(qlens) if n == 1]
    tiles = [(ctxs[i] + min(m0 + block_m, n), i, m0)
             for i, n in enumerate(qlens) if n > 1 for m0 in range(0, n, block_m)]
    tiles.sort(key=lambda x: -x[0])
    tile_a = np.array([[r for _, r, _ in tiles], [m for _, _, m in tiles]], dtype=np.int32).reshape(2, -1)
    return decodes, tile_a


def build_triton_metadata(inputs: AttentionInputs, block_m: int) -> TritonPagedMetadata:
    """Plan one step (host work only, O(B + tiles)); see module docstring."""
    dev = inputs.query_start_loc.device
    if all(n == 1 for n in inputs.query_lens_cpu):
        return TritonPagedMetadata(inputs, None, len(inputs.query_lens_cpu),
                                   torch.empty((2, 0), dtype=torch.int32, device=dev), 0, block_m)
    decodes, tile_a = _plan(inputs, block_m)
    decode_rows, tile_t = upload([np.asarray(decodes, dtype=np.int32), np.ascontiguousarray(tile_a)], dev)
    return TritonPagedMetadata(inputs, decode_rows, len(decodes), tile_t, tile_a.shape[1], block_m)


def make_graph_metadata(inputs: AttentionInputs, max_num_tokens: int, block_m: int) -> TritonPagedMetadata:
    """Fixed-capacity metadata for capturing steps of up to ``max_num_tokens`` tokens and
    ``len(inputs.context_lens)`` requests (the static ``inputs`` of a graph bucket)."""
    dev = inputs.query_start_loc.device
    cap = inputs.context_lens.shape[0]
    # Capacities bound the launch grids (programs past the real count exit at once, but
    # still cost a slot): at most one decode per token, and a prefill request has >= 2
    # tokens, each request's last tile possibly partial.
    max_decodes = min(cap, max_num_tokens)
    max_tiles = -(-max_num_tokens // block_m) + min(cap, max_num_tokens // 2)
    i32 = dict(dtype=torch.int32, device=dev)
    return TritonPagedMetadata(inputs, torch.zeros(max_decodes, **i32), max_decodes,
                               torch.zeros((2, max_tiles), **i32), max_tiles, block_m,
                               decode_count=torch.zeros(1, **i32), tile_count=torch.zeros(1, **i32))


def update_graph_metadata(md: TritonPagedMetadata, inputs: AttentionInputs) -> None:
    """Refill ``md`` (from :func:`make_graph_metadata`) for a real step; device copies only.

    Raises:
        ValueError: the step has more requests or tiles than the capacity.
    """
    decodes, tile_a = _plan(inputs, md.block_m)
    nd, nt = len(decodes), tile_a.shape[1]
    if nd > md.num_decodes or nt > md.num_prefill_tiles:
        raise ValueError(f"step of {nd} decodes / {nt} prefill tiles exceeds the graph's "
                         f"capacity ({md.num_decodes} / {md.num_prefill_tiles})")
    rows_t, tiles_t, counts_t = upload([np.asarray(decodes, dtype=np.int32), np.ascontiguousarray(tile_a),
                                        np.array([nd, nt], dtype=np.int32)], md.decode_rows.device)
    if nd:
        md.decode_rows[:nd].copy_(rows_t)
    if nt:
        md.prefill_tiles[:, :nt].copy_(tiles_t)
    md.decode_count.copy_(counts_t[:1])
    md.tile_count.copy_(counts_t[1:])
