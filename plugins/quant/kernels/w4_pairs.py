"""Int4 weight-only GEMM on the "pairs" layout: ``y = x @ dequant(W)`` with the weight
repacked once at load time so that two instructions dequantize two weights straight into
the tensor-core operand registers. Kernels: ``w4_pairs_kernels.py``.

Why a layout of its own. Read from AutoAWQ's or GPTQ's packing, the fused kernel
(``wna16.py``) spends ~4.5 instructions per weight and 253 registers (two warps per
scheduler); ncu on the H200 (14336 x 14336, M = 1) shows it latency-bound at 35% of DRAM
bandwidth (BENCHMARKS.md). Marlin (Frantar et al., 2024, "MARLIN: Mixed-Precision
Auto-Regressive Parallel Inference on Large Language Models") repacks the weight offline so
that a LOP3 turns a nibble pair into a pair of 16-bit floats, in the order the MMA consumes
them. This layout does that for Triton:

* ``words`` int32 [K/8, N], in tiles of ``tile_k`` input rows (``BKW = tile_k / 8`` word
  rows, ``KP = tile_k / 4``). Nibble ``P + 4h`` (bits ``4P + 16h``) of word row ``j`` of
  tile ``t`` holds ``q[t*tile_k + P*KP + 2j + h, n]``.
* Extracting pair P: ``(w >> 4P) & 0x000f000f | BIAS_BITS`` gives two 16-bit floats
  ``BIAS + q`` (bf16 0x4300 = 128, fp16 0x6400 = 1024; q sits in the mantissa, exact): K
  columns ``2j, 2j + 1`` of the operand for x's contiguous slice ``[P*KP, (P+1)*KP)`` of the
  tile. Triton keeps adjacent K elements in one register of the MMA operand layout, so an
  inline-asm pair op (``pack=2``) writes the operand registers directly (3 shifts + 4 LOP3
  per word, no shared-memory round trip for the weight); a packed subtraction of
  ``BIAS + z`` leaves the exact integers ``q - z``. The compiled sm90 loop counts 2.5-2.8
  instructions per weight at M <= 16 (was ~4.5).
* The group scale multiplies each tile's MMA product, so a tile lies inside one group
  (``group % tile_k == 0``).

Measured on the H200 (BENCHMARKS.md): 1.78-1.82x bf16 cuBLAS at 14336 x 14336, M <= 16
(~1.75 TB/s of packed weight), 1.05x at M = 64. Not issue-bound: per nibble pair the
compiled loop stores the x slice to shared memory, fences, syncs the CTA, runs the MMAs and
waits for them: four serialized round trips per tile (~1 us per tile measured).

Shapes: x [M, K] fp16/bf16 -> [M, N] in x.dtype (fp32 accumulation); scales [G, N] float,
zeros [G, N] uint8 (true zero points), G = K / group_size. ``tile_k`` 128 or 64
(:func:`pairs_tile_k`). Decode (M < ``PREFILL_MIN_M``): one kernel, split-K with the serial
reduction of ``wna16_tiles._store_tile``; prefill: dequantize to a [K, N] temporary, cuBLAS.
"""
from __future__ import annotations

import os

import torch

from kvforge.layers.arrival_counters import arrival_counters

from ..common import pack_rows, unpack_rows
from .choices import lookup
from .wna16 import PREFILL_MIN_M, _num_sms, dequantize_groups
from .wna16_kernels import kernels

#: Launch config per bucket (``BLOCK_M`` x ``BLOCK_N`` output tile; split-K fills
#: ``waves`` x SMs programs, at most ``max_split`` splits; ``scale_a``: the group scale in the
#: MMA operand instead of a second accumulator; ``unroll``: T > 0 runs the unrolled kernel with
#: T tiles per split, not yet timed). Chosen by a sweep on the H200 (BENCHMARKS.md);
#: ``benchmarks/bench_quant.py --tune`` stores per-shape winners in the choices table
#: (``choices.py``, kind "w4_pairs"), which override these.
CONFIGS = {
    "decode16": dict(BLOCK_M=16, BLOCK_N=128, num_warps=8, num_stages=3, scale_a=False, max_split=32, waves=2),
    "decode64": dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3, scale_a=True, max_split=32, waves=2),
    "prefill": dict(BLOCK_N=128, num_warps=4),
}
#: Tuned-table entries carry ``"schema": TABLE_SCHEMA``; others (older kernels) are ignored.
TABLE_SCHEMA = 1
DTYPES = (torch.float16, torch.bfloat16)


def pairs_tile_k(k: int, group_size: int) -> "int | None":
    """The tile height for a [K, N] weight with this group size, or None if the layout does
    not apply (a tile must lie inside one group and divide K; MMAs need KP >= 16)."""
    for tk in (128, 64):
        if k % tk == 0 and group_size % tk == 0:
            return tk
    return None


def pack_pairs(q: torch.Tensor, tile_k: int) -> torch.Tensor:
    """Int4 values [K, N] (ints in [0, 16)) -> words int32 [K/8, N] in the pairs layout."""
    k, n = q.shape
    assert k % tile_k == 0 and tile_k % 32 == 0, (k, tile_k)
    bkw = tile_k // 8
    # (tile, P, j, h, n) -> (tile, j, h, P, n): nibble P + 4h of word (tile, j)
    v = q.reshape(k // tile_k, 4, bkw, 2, n).permute(0, 2, 3, 1, 4).reshape(k, n)
    return pack_rows(v, 4)


def unpack_pairs(words: torch.Tensor, tile_k: int) -> torch.Tensor:
    """Inverse of :func:`pack_pairs`: [K/8, N] int32 -> [K, N] int32 in [0, 16)."""
    v = unpack_rows(words, 4)
    k, n = v.shape
    return v.reshape(k // tile_k, tile_k // 8, 2, 4, n).permute(0, 3, 1, 2, 4).reshape(k, n)


def dequantize_pairs(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int,
                     tile_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Reference: W^T [K, N] = (q - z) * s in ``dtype`` (computed in fp32)."""
    return dequantize_groups(unpack_pairs(words, tile_k), scales, zeros, group_size, dtype)


def bucket(m: int) -> str:
    return "decode16" if m <= 16 else "decode64" if m < PREFILL_MIN_M else "prefill"


def pairs_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
               group_size: int, tile_k: int, n: int, config: "dict | None" = None) -> torch.Tensor:
    """``x`` [M, K] fp16/bf16 -> [M, N] in ``x.dtype``; operands as in the module docstring.

    Raises ValueError for another dtype, a K that is not a multiple of ``tile_k`` or a
    ``tile_k`` that does not fit the group (callers pick the layout with :func:`pairs_tile_k`).
    """
    if x.dtype not in DTYPES:
        raise ValueError(f"w4 pairs GEMM: x dtype {x.dtype} is not fp16 or bf16")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if k % tile_k or group_size % tile_k or words.shape != (k // 8, n):
        raise ValueError(f"w4 pairs GEMM: K {k}, group {group_size}, tile_k {tile_k}, words {tuple(words.shape)} "
                         f"do not fit the layout")
    if m == 0:
        return x.new_empty((0, n))
    if config is None and x.is_cuda:
        tuned = lookup("w4_pairs", m, n, k, x.device) or {}
        config = {key: v for key, v in tuned.items() if key != "schema"} if tuned.get("schema") == TABLE_SCHEMA else None
    cfg = {**CONFIGS[bucket(m)], **(config or {})}
    ks = kernels()
    bn = cfg["BLOCK_N"]
    if bucket(m) == "prefill" and not (config and "BLOCK_M" in config):
        w = torch.empty((k, n), dtype=x.dtype, device=x.device)
        ks["_pairs_dequant_kernel"][(k // tile_k, -(-n // bn))](
            words, scales, zeros, w, n, GROUP=group_size, TILE_K=tile_k, BLOCK_N=bn, num_warps=cfg["num_warps"])
        return x @ w
    bm = cfg["BLOCK_M"]
    tiles = -(-m // bm) * -(-n // bn)
    k_tiles = k // tile_k
    unroll = int(cfg.get("unroll") or 0)
    split = cfg.get("split_k")
    if unroll:  # a fixed number of tiles per split (a constant of the unrolled kernel)
        per_split = min(unroll, k_tiles)
    else:
        if not split:
            sms = _num_sms(x.device.index or 0) if x.is_cuda else 4
            split = max(1, min(cfg["max_split"], k_tiles, cfg["waves"] * sms // tiles))
        per_split = -(-k_tiles // split)
    split = -(-k_tiles // per_split)  # no empty splits
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ws = cnt = out
    if split > 1:
        assert split * m * n < 2 ** 31
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        cnt = arrival_counters(tiles, x.device)
    common = dict(GROUP=group_size, TILE_K=tile_k, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, SERIAL=split > 1,
                  IS_BF16=x.dtype == torch.bfloat16, USE_ASM=os.environ.get("TRITON_INTERPRET", "0") != "1",
                  SCALE_A=bool(cfg["scale_a"]), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if unroll:
        ks["_pairs_unrolled_kernel"][(tiles, split)](
            x, words, scales, zeros, out, ws, cnt, m, n, k, x.stride(0), out.stride(0), TILES=per_split, **common)
    else:
        ks["_pairs_kernel"][(tiles, split)](
            x, words, scales, zeros, out, ws, cnt, m, n, k, x.stride(0), out.stride(0), per_split, **common)
    return out
