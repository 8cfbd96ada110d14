"""Triton kernel (c): prefill / extend attention over a varlen batch and a paged cache.

Each request contributes a chunk of ``query_len`` new tokens at absolute
positions ``context_len .. context_len + query_len - 1``; its K/V (prefix and
the chunk itself, already written by ``reshape_and_cache``) are read from the
paged cache through the block table. One program handles one ``BLOCK_M``-query
tile of one request for one query head (the list of (request, first query)
tiles is built on the host once per step, see ``metadata.py``). It walks keys
``BLOCK_N`` at a time up to the tile's last query position, masks with the
causal rule ``key_pos <= context_len + t`` (and ``key_pos > qpos - window`` for
sliding windows), and keeps an online softmax in float32 with ``tl.dot`` for
QK^T and PV (FlashAttention-2, Dao 2023; paged gathers as in PagedAttention,
Kwon et al. 2023).

Split-KV: when a step has few tiles with long key ranges (a prefill chunk behind a
long cached prefix, next to decodes), one tile's keys are cut into ranges run by
separate programs (the per-step plan in ``metadata.py`` decides). Such a program
stores its normalized partial output and log-sum-exp (base 2) in a scratch slot, and
``_merge_kernel`` combines a tile's slots by their log-sum-exp (the flash-decoding
merge, Dao et al. 2023; FlashInfer's split-KV prefill, Ye et al. 2025).

An FP8 cache is widened to the query's dtype as it is read; the K scale joins the softmax
scale and the V scale multiplies each (partial) output, and ``fp16_dots`` applies, as in
``decode_kernel.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_kernel import LOG2E, compute_dtype, dot_precision, fp8_scale_arg


@triton.jit
def _key_blocks(acc, l_i, m_i, q, cache_ptr, bt_row, head_off, stride_ckv, stride_cb, stride_cs,
                qpos, lo, mid, hi, scale_log2, window, offs_n, offs_d,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr):
    """Online softmax over keys [lo, hi), BLOCK_N at a time, in one loop (one software
    pipeline): the causal / window / bounds tests run only from ``mid`` on (blocks below it are
    visible to every query of the tile)."""
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + offs_n
        kvalid = kpos < hi
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=kvalid, other=0).to(tl.int64)
        tok_off = blk * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + head_off     # [BLOCK_N]
        k = tl.load(cache_ptr + tok_off[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        # Raw scores; the scale joins the exponent as one FMA per score (s * c - m), as in
        # FlashAttention-2 (m_i is kept scaled; c > 0).
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)   # [BLOCK_M, BLOCK_N]
        if n0 >= mid:
            allowed = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (kpos[None, :] > qpos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_ckv + tok_off[:, None] + offs_d[None, :], mask=kvalid[:, None], other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


# Integers that change from step to step are not specialized (Triton would otherwise
# compile a variant per "divisible by 16" / "equal to 1" class, mid-serving).
@triton.jit(do_not_specialize=["num_tiles", "stride_bt"])
def _paged_prefill_kernel(
    q_ptr, out_ptr, cache_ptr, block_table_ptr, qsl_ptr, ctx_ptr, tiles_ptr, num_tiles, count_ptr,
    part_ptr, lse_ptr, kv_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_bt,
    scale_log2, window,
    GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr,
    COUNT_ON_DEVICE: tl.constexpr, KV_FP8: tl.constexpr, CDT: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    if COUNT_ON_DEVICE:  # CUDA-graph mixed step: the grid is the capacity, the count is data
        if tile >= tl.load(count_ptr):
            return
    kvh = h // GROUP
    req = tl.load(tiles_ptr + tile).to(tl.int64)
    m0 = tl.load(tiles_ptr + num_tiles + tile)
    k_lo = tl.load(tiles_ptr + 2 * num_tiles + tile)   # this program's key range [k_lo, k_hi)
    k_hi = tl.load(tiles_ptr + 3 * num_tiles + tile)
    slot = tl.load(tiles_ptr + 4 * num_tiles + tile)   # -1: whole range, store the output
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    ctx = tl.load(ctx_ptr + req)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    qpos = ctx + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0).to(CDT)  # the dots' dtype (fp16_dots)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)

    hi = tl.minimum(tl.minimum(ctx + q_len, ctx + m0 + BLOCK_M), k_hi)  # <= one past the last query position
    lo = k_lo
    if HAS_WINDOW:
        lo = tl.maximum(lo, tl.maximum(ctx + m0 - window + 1, 0) // BLOCK_N * BLOCK_N)
    bt_row = block_table_ptr + req * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    # Keys below the tile's first query position are visible to all its queries: those whole
    # blocks skip every test (the FlashAttention-2 split of off-diagonal and diagonal blocks);
    # a sliding window bounds each row differently, so it keeps the tests throughout.
    mid = lo
    if not HAS_WINDOW:
        mid = lo + tl.maximum(tl.minimum(ctx + m0, hi) - lo, 0) // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _key_blocks(acc, l_i, m_i, q, cache_ptr, bt_row, head_off, stride_ckv, stride_cb, stride_cs,
                                qpos, lo, mid, hi, scale_log2, window, offs_n, offs_d,
                                BLOCK_SIZE, BLOCK_N, HAS_WINDOW, DOT_PREC)

    empty = l_i == 0.0  # every key of this range masked for the row (only in split ranges)
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(kv_scale_ptr + 1)
    if slot < 0:
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
    else:
        nh = tl.num_programs(1)
        base = (slot.to(tl.int64) * nh + h) * BLOCK_M
        offs_r = tl.arange(0, BLOCK_M)
        tl.store(part_ptr + (base + offs_r)[:, None] * HEAD_D + offs_d[None, :], o)
        tl.store(lse_ptr + base + offs_r, tl.where(empty, -1.0e30, m_i + tl.log2(l_safe)))


@triton.jit(do_not_specialize=["num_merges"])
def _merge_kernel(
    out_ptr, part_ptr, lse_ptr, qsl_ptr, merges_ptr, num_merges, count_ptr,
    stride_ot, stride_oh,
    HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, COUNT_ON_DEVICE: tl.constexpr,
):
    """out rows of one split tile = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse)."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    nh = tl.num_programs(1)
    if COUNT_ON_DEVICE:
        if i >= tl.load(count_ptr):
            return
    req = tl.load(merges_ptr + i).to(tl.int64)
    m0 = tl.load(merges_ptr + num_merges + i)
    first = tl.load(merges_ptr + 2 * num_merges + i)
    n = tl.load(merges_ptr + 3 * num_merges + i)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_D)
    m_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    for s in range(0, n):
        base = ((first + s).to(tl.int64) * nh + h) * BLOCK_M
        m_max = tl.maximum(m_max, tl.load(lse_ptr + base + offs_r))
    w_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    for s in range(0, n):
        base = ((first + s).to(tl.int64) * nh + h) * BLOCK_M
        w = tl.exp2(tl.load(lse_ptr + base + offs_r) - m_max)
        w_sum += w
        acc += w[:, None] * tl.load(part_ptr + (base + offs_r)[:, None] * HEAD_D + offs_d[None, :])
    o = acc / w_sum[:, None]
    rows = (q_start + m0 + offs_r).to(tl.int64)
    mask = (m0 + offs_r) < q_len
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask[:, None])


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
                  query_start_loc: torch.Tensor, context_lens: torch.Tensor, tiles: torch.Tensor, num_tiles: int,
                  block_m: int, scale: float, sliding_window: int | None, block_n: int = 0,
                  count: torch.Tensor | None = None, merges: torch.Tensor | None = None, num_merges: int = 0,
                  merge_count: torch.Tensor | None = None,
                  scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
                  num_warps: int = 0, num_stages: int = 0, kv_scale: torch.Tensor | None = None,
                  fp16_dots: bool = True) -> None:
    """Attention for the prefill/extend work items listed in ``tiles``.

    With ``count`` (int32 [1] on the device) ``num_tiles`` is a capacity and only the first
    ``count[0]`` items run (CUDA-graph capture); likewise ``merge_count`` for ``num_merges``.

    Args:
        q: [T, Hq, D] fp16/bf16/fp32, last dim contiguous; out: same shape/dtype (written rows only).
        kv_cache: [2, num_blocks, block_size, Hkv, D], already holding this step's K/V; q's
            dtype, or FP8 holding K / kv_scale[0], V / kv_scale[1] (kv_scale: float32 [2], None: 1.0).
        block_table: int32 [B, max_blocks]; query_start_loc: int32 [B + 1]; context_lens: int32 [B].
        tiles: int32 [5, num_tiles], one column per work item: request index, first query
            offset in the request, key range [k_lo, k_hi) (positions; clipped to the causal
            limit in the kernel), scratch slot (-1: the item covers the whole range and writes
            ``out``; else it writes a partial result there).
        block_m: queries per tile (the value the tiles were cut with).
        block_n: keys per tile, power of two >= 16 (0 = auto); independent of block_size.
        num_warps / num_stages: Triton launch options of the attention kernel (0 = auto).
        merges: int32 [4, num_merges]: request, first query offset, first slot, number of
            slots of each split tile; ``scratch``: (float32 [S, Hq, block_m, D] partial outputs,
            float32 [S, Hq, block_m] log2-sum-exp), needed when any item has a slot.
    Raises:
        ValueError: merges without scratch, or a scratch of the wrong shape.
    """
    if num_tiles == 0:
        return
    _, hq, d = q.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    if block_n <= 0:
        block_n = 64 if d <= 128 else 32
    block_n = max(block_n, 16)
    if num_merges and (scratch is None or scratch[0].shape[1:] != (hq, block_m, d)):
        raise ValueError(f"split tiles need a float32 scratch of shape [S, {hq}, {block_m}, {d}]")
    part, lse = scratch if scratch is not None else (out, out)  # unused without split items
    kv_fp8, kv_scale = fp8_scale_arg(kv_cache, kv_scale)
    _paged_prefill_kernel[(num_tiles, hq)](
        q, out, kv_cache, block_table, query_start_loc, context_lens, tiles, num_tiles,
        context_lens if count is None else count, part, lse, context_lens if kv_scale is None else kv_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        scale * LOG2E, sliding_window or 0,
        GROUP=hq // hkv, HEAD_D=d, BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None, DOT_PREC=dot_precision(q.dtype),
        COUNT_ON_DEVICE=count is not None, KV_FP8=kv_fp8, CDT=compute_dtype(q.dtype, kv_fp8, fp16_dots),
        num_warps=num_warps or (4 if d * block_m <= 64 * 128 else 8), num_stages=num_stages or 2,
    )
    if num_merges:
        _merge_kernel[(num_merges, hq)](
            out, part, lse, query_start_loc, merges, num_merges,
            context_lens if merge_count is None else merge_count,
            out.stride(0), out.stride(1),
            HEAD_D=d, BLOCK_M=block_m, COUNT_ON_DEVICE=merge_count is not None,
            num_warps=4,
        )
