"""Triton kernel (a): scatter a step's new K/V into the paged KV cache.

Layout (vLLM's FlashAttention layout, shared with ``torch_ref``): one tensor per
layer, ``[2, num_blocks, block_size, num_kv_heads, head_size]``; index 0 is K,
1 is V. Token ``t`` goes to flat slot ``slot_mapping[t] = block_id * block_size
+ offset`` (PagedAttention, Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP'23). A negative slot
(padding rows of a captured CUDA graph) is skipped.

An FP8 cache (``torch.float8_e4m3fn`` / ``float8_e5m2``) stores ``x / scale`` (the layer's
K and V scales, float32 [2] on the device), saturated to the format's range and rounded to
nearest even in fp32 bit arithmetic before the cast, so the cast itself is exact: Triton's CPU
interpreter rounds a value that carries into the next power of two wrongly (1.95 -> 1.0 in E4M3).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvforge.layers.kv_cache_dtype import unit_kv_scale


@triton.jit
def _round_to_fp8(x, scale, FP8_MAX: tl.constexpr, MANT: tl.constexpr, MIN_NORMAL: tl.constexpr,
                  SUB_QUANTUM: tl.constexpr):
    """fp32 ``x / scale`` clamped to +-FP8_MAX and rounded (nearest even) to the FP8 grid of
    MANT mantissa bits (normal values) or to multiples of SUB_QUANTUM (subnormals)."""
    y = tl.minimum(tl.maximum(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX), FP8_MAX)  # IEEE x / scale, as torch
    DROP: tl.constexpr = 23 - MANT
    bits = y.to(tl.int32, bitcast=True)
    # add half an FP8 ulp (minus one, plus the kept lsb: ties to even); a carry moves into the exponent
    normal = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)
    magic = SUB_QUANTUM * 12582912.0  # 1.5 * 2^23 quanta: fp32 addition rounds to whole quanta
    sub = ((tl.abs(y) + magic) - magic).to(tl.int32, bitcast=True) | ((bits >> 31) << 31)  # keeps -0.0
    return tl.where(tl.abs(y) < MIN_NORMAL, sub, normal).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["num_tokens"])
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, scale_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckv, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HKV_P: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
    MIN_NORMAL: tl.constexpr, SUB_QUANTUM: tl.constexpr,
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
    if KV_FP8:
        k = _round_to_fp8(k, tl.load(scale_ptr), FP8_MAX, MANT, MIN_NORMAL, SUB_QUANTUM)
        v = _round_to_fp8(v, tl.load(scale_ptr + 1), FP8_MAX, MANT, MIN_NORMAL, SUB_QUANTUM)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


#: per FP8 cache dtype: (largest finite value, mantissa bits, smallest normal, subnormal spacing)
_FP8_GRID = {torch.float8_e4m3fn: (448.0, 3, 2.0 ** -6, 2.0 ** -9),
             torch.float8_e5m2: (57344.0, 2, 2.0 ** -14, 2.0 ** -16)}


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_scale: torch.Tensor | None = None) -> None:
    """Write ``k``/``v`` into ``kv_cache`` at ``slot_mapping`` (no host sync; graph-capturable).

    Args:
        k, v: [T, Hkv, D], any float dtype (cast to the cache dtype); last dim contiguous.
        kv_cache: [2, num_blocks, block_size, Hkv, D]; last dim contiguous. An FP8 cache
            stores ``k / kv_scale[0]``, ``v / kv_scale[1]`` (see the module docstring).
        slot_mapping: int64 [T] flat slots; entries < 0 are skipped.
        kv_scale: float32 [2] on the device (FP8 caches only; None: 1.0).
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
    fp8 = _FP8_GRID.get(kv_cache.dtype)
    if fp8 is not None and kv_scale is None:
        kv_scale = unit_kv_scale(k.device)
    fmax, mant, min_normal, quantum = fp8 or (0.0, 0, 0.0, 0.0)
    _reshape_and_cache_kernel[(triton.cdiv(t, block_t),)](
        k, v, kv_cache, slot_mapping, slot_mapping if kv_scale is None else kv_scale, t,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=hkv, HKV_P=triton.next_power_of_2(hkv), HEAD_D=d, BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_T=block_t, KV_FP8=fp8 is not None, FP8_MAX=fmax, MANT=mant, MIN_NORMAL=min_normal,
        SUB_QUANTUM=quantum, num_warps=4,
    )
