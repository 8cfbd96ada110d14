"""Triton kernel (b): paged decode attention (query_len == 1), GQA-packed.

One program per (decode row, KV head). It loads the ``group = Hq / Hkv`` query
heads that share the KV head as a ``[GROUP_P, D]`` tile (``GROUP_P`` = group
padded to >= 16 so ``tl.dot`` applies; padded rows are zeros and never stored),
then walks the request's keys ``BLOCK_N`` tokens at a time, gathering each
token's row through the block table (PagedAttention, Kwon et al. 2023; a tile
may cover several cache blocks or part of one). Each K/V tile is read once for the whole
group. Softmax is online (running max / running sum, FlashAttention-2, Dao
2023), in base 2 with the scale folded in, accumulating in float32.

Everything the kernel needs (sequence lengths, block tables, token offsets)
is read from device tensors, so a launch is graph-capturable: the grid depends
only on the number of decode rows.

An FP8 cache (``KV_FP8``) is read as is and widened to the query's dtype (exact: every E4M3 /
E5M2 value is a bf16 and an fp16 value); its K scale is folded into the softmax scale and its V
scale multiplies the output, both read from device memory (``kv_scale``, float32 [2]).
With ``fp16_dots`` a bf16 query meets an FP8 cache in fp16 dots: on sm_89+ an E4M3 pair
widens to fp16 in one instruction, while bf16 has no such conversion and costs several
(the query must then lie within fp16's +-65504; P is in [0, 1]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.layers.kv_cache_dtype import is_fp8, unit_kv_scale

LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots in exact IEEE fp32 (not tf32) to match torch_ref; 16-bit inputs use tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


# Integers that change from step to step are not specialized (Triton would otherwise
# compile a variant per "divisible by 16" / "equal to 1" class, mid-serving).
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_decode_kernel(
    q_ptr, out_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, rows_ptr, count_ptr, kv_scale_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_ckv, stride_cb, stride_cs, stride_ch, stride_bt,
    scale_log2, window,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PREC: tl.constexpr, ROWS_ARE_REQS: tl.constexpr,
    COUNT_ON_DEVICE: tl.constexpr, KV_FP8: tl.constexpr, CDT: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    if COUNT_ON_DEVICE:  # CUDA-graph mixed step: the grid is the capacity, the count is data
        if row >= tl.load(count_ptr):
            return
    if ROWS_ARE_REQS:  # pure-decode step: row i is request i
        req = row.to(tl.int64)
    else:
        req = tl.load(rows_ptr + row).to(tl.int64)
    tok = tl.load(qsl_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    qpos = seq_len - 1

    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, HEAD_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0).to(CDT)  # the dots' dtype (fp8_dot_dtype)

    m_i = tl.full([GROUP_P], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_P], dtype=tl.float32)
    acc = tl.zeros([GROUP_P, HEAD_D], dtype=tl.float32)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)

    start = 0
    if HAS_WINDOW:
        start = tl.maximum(qpos - window + 1, 0) // BLOCK_N * BLOCK_N
    bt_row = block_table_ptr + req * stride_bt
    head_off = kvh.to(tl.int64) * stride_ch
    for n0 in range(start, seq_len, BLOCK_N):
        kpos = n0 + offs_n
        valid = kpos < seq_len
        if HAS_WINDOW:
            valid = valid & (kpos > qpos - window)
        blk = tl.load(bt_row + kpos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        tok_off = blk * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + head_off      # [BLOCK_N]
        k = tl.load(cache_ptr + tok_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * scale_log2  # [GROUP_P, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_ckv + tok_off[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    if KV_FP8:
        o = o * tl.load(kv_scale_ptr + 1)
    tl.store(out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def compute_dtype(q_dtype: torch.dtype, kv_fp8: bool, fp16_dots: bool):
    """The Triton dtype of the attention dots: the query's, or fp16 for a bf16 query over an
    FP8 cache when ``fp16_dots`` (see the module docstring)."""
    if kv_fp8 and fp16_dots and q_dtype == torch.bfloat16:
        return tl.float16
    return _TL_DTYPES[q_dtype]


def fp8_scale_arg(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
    """(whether ``kv_cache`` is FP8, the K/V scale tensor its kernels read: ``kv_scale``, or
    ones when None)."""
    if not is_fp8(kv_cache.dtype):
        return False, None
    if kv_scale is None:
        kv_scale = unit_kv_scale(kv_cache.device)
    return True, kv_scale


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, query_start_loc: torch.Tensor, decode_rows: torch.Tensor | None,
                 num_decodes: int, scale: float, sliding_window: int | None, block_n: int = 0,
                 count: torch.Tensor | None = None, kv_scale: torch.Tensor | None = None,
                 fp16_dots: bool = True, num_warps: int = 0, num_stages: int = 0) -> None:
    """Attention for the ``num_decodes`` requests listed in ``decode_rows`` (each query_len == 1).

    With ``count`` (int32 [1] on the device) ``num_decodes`` is a capacity: programs past
    ``count[0]`` exit at once, so the launch does not depend on the step (CUDA-graph capture
    of mixed steps).

    Args:
        q: [T, Hq, D] fp16/bf16/fp32, last dim contiguous; out: same shape/dtype (written rows only).
        kv_cache: [2, num_blocks, block_size, Hkv, D], already holding this step's K/V; q's
            dtype, or FP8 (float8_e4m3fn / float8_e5m2) holding K / kv_scale[0], V / kv_scale[1].
        kv_scale: float32 [2] on the device (FP8 caches; None: 1.0).
        fp16_dots: a bf16 query over an FP8 cache computes its dots in fp16 (module docstring).
        num_warps / num_stages: Triton launch options (0 = auto: 4 warps, 8 past head_dim 128; 3 stages,
            5 over an FP8 cache).
        block_table: int32 [B, max_blocks]; seq_lens: int32 [B] (context + 1);
        query_start_loc: int32 [B + 1]; decode_rows: int32 [>= num_decodes] request indices,
            or None: rows 0 .. num_decodes-1 are requests 0 .. num_decodes-1.
        scale: softmax scale; sliding_window: keys with pos <= qpos - window are dropped.
        block_n: tokens per K/V tile, power of two >= 16 (0 = auto: 64, 32 for head_dim > 128, twice
            that over an FP8 cache); a tile may span several cache blocks or part of one (each
            token's block is looked up).
    No host synchronisation: safe to capture in a CUDA graph.
    """
    if num_decodes == 0:
        return
    _, hq, d = q.shape
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = hq // hkv
    kv_fp8, kv_scale = fp8_scale_arg(kv_cache, kv_scale)
    if block_n <= 0:  # an FP8 tile of twice the keys has the same bytes in flight (H200: 319 -> 231 us)
        block_n = (64 if d <= 128 else 32) * (2 if kv_fp8 else 1)
    block_n = max(block_n, 16)
    _paged_decode_kernel[(num_decodes, hkv)](
        q, out, kv_cache, block_table, seq_lens, query_start_loc,
        query_start_loc if decode_rows is None else decode_rows, seq_lens if count is None else count,
        seq_lens if kv_scale is None else kv_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_table.stride(0),
        scale * LOG2E, sliding_window or 0,
        GROUP=group, GROUP_P=max(16, triton.next_power_of_2(group)), HEAD_D=d, BLOCK_SIZE=bs,
        BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None, DOT_PREC=dot_precision(q.dtype),
        ROWS_ARE_REQS=decode_rows is None, COUNT_ON_DEVICE=count is not None, KV_FP8=kv_fp8,
        CDT=compute_dtype(q.dtype, kv_fp8, fp16_dots),
        # FP8: 5 stages give the K/V tiles two shared-memory buffers (Triton's pipeliner gives one
        # at 2-4, the block-table load taking a stage), so one tile streams in while one is used;
        # 3 stay best for 16-bit caches, whose registers allow more programs per SM instead.
        num_warps=num_warps or (4 if d <= 128 else 8), num_stages=num_stages or (5 if kv_fp8 else 3),
    )
