"""Per-step metadata for ``triton_paged``: built once per step, shared by every layer.

Splits the flattened varlen batch into decode rows (query_len == 1, served by
the decode kernel) and prefill/extend tiles (query_len > 1, cut into
``block_m``-query tiles for the prefill kernel). All index tensors are built on
the host from ``AttentionInputs.*_cpu`` lists and copied to the device here, so
``forward`` never synchronises.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """

    inputs: AttentionInputs
    decode_rows: torch.Tensor | None
    num_decodes: int
    prefill_tiles: torch.Tensor
    num_prefill_tiles: int
    block_m: int

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.inputs.slot_mapping


def build_triton_metadata(inputs: AttentionInputs, block_m: int) -> TritonPagedMetadata:
    """Plan one step (host work only, O(B + tiles)); see module docstring."""
    dev = inputs.query_start_loc.device
    qlens, ctxs = inputs.query_lens_cpu, inputs.context_lens_cpu
    decodes = [i for i, n in enumerate(qlens) if n == 1]
    if len(decodes) == len(qlens):
        return TritonPagedMetadata(inputs, None, len(decodes), torch.empty((2, 0), dtype=torch.int32, device=dev),
                                   0, block_m)
    decode_rows = torch.tensor(decodes, dtype=torch.int32).to(dev)
    tiles = [(ctxs[i] + min(m0 + block_m, n), i, m0)
             for i, n in enumerate(qlens) if n > 1 for m0 in range(0, n, block_m)]
    tiles.sort(key=lambda x: -x[0])
    tile_t = torch.tensor([[r for _, r, _ in tiles], [m for _, _, m in tiles]], dtype=torch.int32)
    return TritonPagedMetadata(inputs, decode_rows, len(decodes), tile_t.reshape(2, -1).to(dev), len(tiles),
                               block_m)
