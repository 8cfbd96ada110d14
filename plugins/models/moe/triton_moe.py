"""Fused MoE expert GEMM (Triton, GPU) with the torch reference it must match.

Every (token, expert) pair of the routing is one row. The rows are grouped by expert
and each group padded to a multiple of ``BLOCK_M`` (:func:`align_pairs`), so one
program of the grouped GEMM multiplies a tile of rows that all use the same expert's
weights, reading the activation rows by index (no gathered copy). The two GEMMs of
the SwiGLU expert MLP run as two launches with the activation in between:

    h = A[pair // a_div] @ W13[e]^T        [M, 2I]
    o = silu(h_gate) * h_up @ W2[e]^T      [M, H]   (optionally scaled by the pair's routing weight)

The alignment uses only device ops with static output sizes (an upper bound of the
padded length, ``M + E * (BLOCK_M - 1)``; blocks past the real end exit early), so it
makes no host synchronisation and can be captured in a CUDA graph. Grouped-GEMM
layout after MegaBlocks (Gale et al. 2022) and vLLM's fused_moe design; written here
from those descriptions.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional off Linux
    triton = None


def triton_enabled(x: torch.Tensor) -> bool:
    """Run the Triton kernel for ``x``? On CUDA (unless ``KVFORGE_DISABLE_FUSED_KERNELS=1``),
    or on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` and ``KVFORGE_TRITON_CPU=1``)."""
    if triton is None:
        return False
    if x.is_cuda:
        return os.environ.get("KVFORGE_DISABLE_FUSED_KERNELS") != "1"
    return os.environ.get("KVFORGE_TRITON_CPU") == "1" and os.environ.get("TRITON_INTERPRET") == "1"


def align_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group pair rows by expert, each group padded to ``block_m`` rows.

    Args:
        expert_ids: int [M], expert of each pair row (0 <= id < num_experts).
    Returns:
        sorted_ids: int32 [P], pair index per padded slot (``M`` = padding), P static;
        block_expert: int32 [P / block_m], expert of each block;
        total: int32 [1], padded rows actually used (blocks at or past it are skipped).
    """
    dev = expert_ids.device
    m = expert_ids.numel()
    ids = expert_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(ids, stable=True)
    sorted_e = ids[order]
    first = torch.cumsum(counts, 0) - counts
    dest = starts[sorted_e] + torch.arange(m, device=dev) - first[sorted_e]
    cap = -(-(m + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((cap,), m, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, cap, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


_KERNELS: dict[bool, object] = {}


def _moe_gemm_kernel_src(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                         N, K, num_pairs, a_div,
                         stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                         HAS_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    total = tl.load(total_ptr)
    if pid_m * BLOCK_M < total:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        valid = pair < num_pairs
        row = (pair // a_div).to(tl.int64)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)  # (tl.zeros is a jit helper: no interpreter)
        for k0 in range(0, (K + BLOCK_K - 1) // BLOCK_K):
            kmask = offs_k < K - k0 * BLOCK_K
            a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & (offs_n[None, :] < N), other=0.0)
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if HAS_WEIGHT:
            w = tl.load(w_ptr + pair, mask=valid, other=0.0)
            acc = acc * w[:, None]
        c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _kernel():
    """The jitted kernel; decorated on first use so tests can turn the interpreter on first."""
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    k = _KERNELS.get(interp)
    if k is None:
        k = _KERNELS[interp] = triton.jit(_moe_gemm_kernel_src)
    return k


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids, block_expert, total,
                  num_pairs: int, a_div: int, block_m: int, pair_weights: torch.Tensor | None) -> None:
    """out[p] = a[p // a_div] @ w[expert(p)]^T (* pair_weights[p]) for every real pair p."""
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (sorted_ids.numel() // block_m, triton.cdiv(n, block_n))
    wts = pair_weights if pair_weights is not None else out  # unused pointer when HAS_WEIGHT is False
    _kernel()[grid](a, w, out, wts, sorted_ids, block_expert, total, n, k, num_pairs, a_div,
                    a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
                    HAS_WEIGHT=pair_weights is not None, IEEE=a.dtype == torch.float32,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def moe_pairs_triton(x: torch.Tensor, expert_ids: torch.Tensor, top_k: int, w13: torch.Tensor, w2: torch.Tensor,
                     pair_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`moe_pairs_reference` (same arguments and result)."""
    m = expert_ids.numel()
    num_experts, two_i, _ = w13.shape
    block_m = 16 if m <= 4096 else 64
    sorted_ids, block_expert, total = align_pairs(expert_ids, num_experts, block_m)
    h = torch.empty(m, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, sorted_ids, block_expert, total, m, top_k, block_m, None)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    out = torch.empty(m, w2.shape[1], dtype=x.dtype, device=x.device)
    wts = pair_weights.reshape(-1).float().contiguous() if pair_weights is not None else None
    _grouped_gemm(act, w2, out, sorted_ids, block_expert, total, m, 1, block_m, wts)
    return out


def moe_pairs_reference(x: torch.Tensor, expert_ids: torch.Tensor, top_k: int, w13: torch.Tensor,
                        w2: torch.Tensor, pair_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Expert SwiGLU MLP of every (token, expert) pair row.

    Args:
        x: [T, H]; pair row p uses token ``p // top_k``.
        expert_ids: int [T * top_k] expert of each pair (into ``w13``/``w2``'s first dim).
        w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I].
        pair_weights: optional float [T * top_k] routing weight multiplied into each row.
    Returns:
        [T * top_k, H] in x's dtype.
    """
    ids = expert_ids.reshape(-1)
    out = torch.empty(ids.numel(), w2.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        rows = torch.nonzero(ids == e).squeeze(1)
        h = F.linear(x[rows // top_k], w13[e])
        gate, up = h.chunk(2, dim=-1)
        o = F.linear(F.silu(gate) * up, w2[e])
        if pair_weights is not None:
            o = (o.float() * pair_weights.reshape(-1)[rows, None].float()).to(x.dtype)
        out[rows] = o
    return out


def moe_pairs(x, expert_ids, top_k, w13, w2, pair_weights=None) -> torch.Tensor:
    """:func:`moe_pairs_triton` on GPU, :func:`moe_pairs_reference` elsewhere."""
    fn = moe_pairs_triton if triton_enabled(x) else moe_pairs_reference
    return fn(x, expert_ids, top_k, w13, w2, pair_weights)
