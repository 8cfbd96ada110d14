"""Triton kernel (a): scatter a step's new K/V into the paged KV cache.

Layout (vLLM's FlashAttention layout, shared with ``torch_ref``): one tensor per
layer, ``[2, num_blocks, block_size, num_kv_heads, head_size]``; index 0 is K,
1 is V. Token ``t`` goes to flat slot ``slot_mapping[t] = block_id * block_size
+ offset`` (PagedAttention, Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP'23). A negative slot
(padding rows of a captured CUDA graph) is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_tokens"])
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HKV_P: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # One program per BLOCK_T new tokens; each token's [Hkv, D] K and V rows are
    # handled as one flattened HKV_P * D vector (HKV_P = Hkv rounded up to a power of 2).
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + offs_t, mask=offs_t < num_tokens, other=-1)
    offs_c = tl.arange(0, HKV_P * HEAD_D)
    head = offs_c // HEAD_D
    dim = offs_c % HEAD_D
    mask = (slot >= 0)[:, None] & (head < NUM_KV_HEADS)[None, :]
    blk = tl.where(slot >= 0, slot, 0) // BLOCK_SIZE
    off = tl.where(slot >= 0, slot, 0) % BLOCK_SIZE
    dst = cache_ptr + (blk * stride_cb + off * stride_cs)[:, None] + (head * stride_ch + dim)[None, :]
    k = tl.load(k_ptr + (offs_t * stride_kt)[:, None] + (head * stride_kh + dim)[None, :], mask=mask)
    v = tl.load(v_ptr + (offs_t * stride_vt)[:, None] + (head * stride_vh + dim)[None, :], mask=mask)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` into ``kv_cache`` at ``slot_mapping`` (no host sync; graph-capturable).

    Args:
        k, v: [T, Hkv, D], any float dtype (cast to the cache dtype); last dim contiguous.
        kv_cache: [2, num_blocks, block_size, Hkv, D]; last dim contiguous.
        slot_mapping: int64 [T] flat slots; entries < 0 are skipped.
    """
    t, hkv, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert kv_cache.stride(-1) == 1 and kv_cache.shape[3:] == (hkv, d)
    width = triton.next_power_of_2(hkv) * d
    block_t = max(1, min(16, 4096 // width))
    _reshape_and_cache_kernel[(triton.cdiv(t, block_t),)](
        k, v, kv_cache, slot_mapping, t,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=hkv, HKV_P=triton.next_power_of_2(hkv), HEAD_D=d, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_T=block_t, num_warps=4,
    )
