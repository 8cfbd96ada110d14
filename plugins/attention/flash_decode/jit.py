"""NVRTC compilation (through CuPy) and launch of the flash_decode kernels.

Modules are compiled once per (dtype, head_dim, group, block_size) with those as
compile-time constants, cached in-process (CuPy also caches the cubin on disk).
Launches go on torch's current stream, so they are ordered with torch work and
captured by CUDA graphs.

``fd_partial`` runs one 128-thread program per (KV head x head slice, split, row): a
program serves :func:`heads_per_program` query heads of its KV head (all of them up to
8; past 8 the group is cut in two slices, which then share the K/V reads through L2).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvforge.layers.cupy_launch import TorchStreams
from kvforge.layers.cupy_launch import ptr as _ptr

#: The kernels' CUDA C++ as one NVRTC translation unit: helpers, then the kernels (joined here
#: rather than #included, so CuPy's on-disk cache key covers both files).
SOURCE = "\n".join(Path(__file__).with_name(f).read_text() for f in ("fd_common.cuh", "kernels.cu"))
_DT = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
PARTIAL_THREADS = 128  # NTHREADS in kernels.cu
MERGE_THREADS = 256    # MERGE_WARPS * 32 in kernels.cu


def heads_per_program(group: int) -> int:
    """Query heads one fd_partial program serves (HEADS in kernels.cu): the whole GQA group
    up to 8 (q slices and accumulators for all of them stay in registers), else the group
    split evenly in ceil(group / 8) slices."""
    slices = -(-group // 8)
    return -(-group // slices)


def head_slices(group: int) -> int:
    """Programs per KV head (HSLICES in kernels.cu)."""
    return -(-group // heads_per_program(group))


def nvrtc_options(dtype: torch.dtype, head_dim: int, group: int, block_size: int) -> tuple[str, ...]:
    """NVRTC options of one compiled variant (pure: the CPU compile check uses it too)."""
    return ("-std=c++17", "--use_fast_math", f"-DKV_DTYPE={_DT[dtype]}", f"-DHEAD_DIM={head_dim}",
            f"-DGROUP={group}", f"-DHEADS={heads_per_program(group)}", f"-DBLOCK_SIZE={block_size}")


class Kernels:
    """Compiles lazily; raises RuntimeError with the NVRTC log on a compile failure."""

    def __init__(self) -> None:
        import cupy
        self.cupy = cupy
        self._mods: dict[tuple, tuple] = {}
        self._streams = TorchStreams(cupy)

    def _get(self, dtype: torch.dtype, head_dim: int, group: int, block_size: int):
        key = (dtype, head_dim, group, block_size)
        mod = self._mods.get(key)
        if mod is None:
            opts = nvrtc_options(dtype, head_dim, group, block_size)
            try:
                m = self.cupy.RawModule(code=SOURCE, options=opts)
                mod = (m.get_function("fd_partial"), m.get_function("fd_merge"))
            except Exception as e:
                raise RuntimeError(f"flash_decode: NVRTC compile failed for {key}: {e}") from e
            self._mods[key] = mod
        return mod

    def decode(self, q, kv_cache, block_table, seq_lens, row_tok, row_req, num_rows: int, layer,
               block_size: int, num_splits: int, partition: int, part_out, part_lse, out) -> None:
        """Decode attention for ``num_rows`` rows; writes ``out[row_tok[i]]``.

        q/out: [T, Hq, D] with unit stride inside a row (row strides may differ);
        kv_cache: [2, NB, BS, Hkv, D] contiguous, 16-byte aligned; block_table int32 [B, max_blocks];
        seq_lens int32 [B]; row_tok/row_req int32 [num_rows]. ``partition`` (tokens per split)
        must be a multiple of ``block_size`` (:func:`plan_splits` makes it one); with
        ``num_splits`` > 1, part_out/part_lse hold num_rows * Hq * num_splits (* D) fp32."""
        group = layer.num_heads // layer.num_kv_heads
        partial, merge = self._get(q.dtype, layer.head_size, group, block_size)
        programs = layer.num_kv_heads * head_slices(group)
        assert q.stride(2) == 1 and q.stride(1) == layer.head_size and kv_cache.is_contiguous()
        assert out.stride(2) == 1 and out.stride(1) == layer.head_size
        assert kv_cache.data_ptr() % 16 == 0 and partition % block_size == 0  # 16-byte K/V copies
        bt = block_table if block_table.dtype == torch.int32 else block_table.int()
        sl = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()
        stream = self._streams.current(q.device)
        with stream:
            partial((programs, num_splits, num_rows), (PARTIAL_THREADS,),
                    (_ptr(q), np.int64(q.stride(0)), _ptr(kv_cache), np.int64(kv_cache[0].numel()),
                     _ptr(bt), np.int32(bt.shape[1]), _ptr(sl), _ptr(row_tok), _ptr(row_req),
                     np.int32(layer.num_kv_heads), np.int32(partition), np.int32(num_splits),
                     np.float32(layer.scale), _ptr(part_out), _ptr(part_lse), _ptr(out),
                     np.int64(out.stride(0))))
            if num_splits > 1:
                merge((layer.num_heads, num_rows), (MERGE_THREADS,),
                      (_ptr(part_out), _ptr(part_lse), _ptr(row_tok), np.int32(layer.num_heads),
                       np.int32(num_splits), _ptr(out), np.int64(out.stride(0))))
