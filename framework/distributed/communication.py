"""Collectives of the parallel layers, over the groups of :mod:`kvforge.distributed.parallel_state`.

Each is the identity when its group has one rank, so layers call them unconditionally.
Backends: NCCL on GPU, gloo on CPU (gloo implements all_reduce, all_gather,
all_to_all_single with uneven splits, send/recv — everything used here).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kvforge.distributed import parallel_state as ps


# torch >= 2.13 renamed all_gather_into_tensor (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group (in place; returns ``x``).
    The row-parallel layer's reduction (Megatron-LM, Shoeybi et al. 2019, sec. 3)."""
    if ps.get_tp_size() == 1:
        return x
    fast = ps.get_state().fast_all_reduce
    if fast is not None and fast.can_run(x):  # small CUDA messages: symmetric memory (NVLink)
        return fast(x)
    dist.all_reduce(x, group=ps.get_tp_group())
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every tensor-parallel rank's ``x`` (equal shapes) along ``dim``, in rank order."""
    tp = ps.get_tp_size()
    if tp == 1:
        return x
    x = x.contiguous()
    out = torch.empty((tp * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=ps.get_tp_group())
    if dim in (0, -x.dim()):
        return out
    # [tp * a, ...] -> [a, ..., tp * d] : move the rank axis next to ``dim``.
    dim = dim % x.dim()
    out = out.view((tp,) + tuple(x.shape))
    return out.movedim(0, dim).reshape(tuple(x.shape[:dim]) + (tp * x.shape[dim],) + tuple(x.shape[dim + 1:]))


def tp_broadcast(x: torch.Tensor, src_tp_rank: int = 0) -> torch.Tensor:
    """Overwrite ``x`` on every tensor-parallel rank with tensor-parallel rank ``src_tp_rank``'s
    (in place; returns ``x``). Shapes and dtypes must agree on all ranks."""
    if ps.get_tp_size() == 1:
        return x
    group = ps.get_tp_group()
    dist.broadcast(x, src=dist.get_global_rank(group, src_tp_rank), group=group)
    return x


def ep_all_to_all(x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """Rows ``x[sum(send_counts[:r]) : ...]`` go to expert-parallel rank ``r``; returns the rows
    received from every rank, concatenated in rank order (``sum(recv_counts)`` rows).
    GShard-style token dispatch/combine (Lepikhin et al. 2020)."""
    out = torch.empty((sum(recv_counts),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts,
                           group=ps.get_tp_group())
    return out


def ep_exchange_counts(send_counts: torch.Tensor) -> torch.Tensor:
    """int64 [ep] rows this rank sends to each rank -> int64 [ep] rows it receives from each."""
    recv = torch.empty_like(send_counts)
    dist.all_to_all_single(recv, send_counts.contiguous(), group=ps.get_tp_group())
    return recv


def pp_isend(x: torch.Tensor, dst_stage: int):
    """Start sending ``x`` to this rank's counterpart in pipeline stage ``dst_stage``; returns the work."""
    st = ps.get_state()
    return dist.isend(x.contiguous(), dst=st.stage_rank(dst_stage), group=st.pp_group)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, src_stage: int, device: torch.device) -> torch.Tensor:
    """Receive a tensor of ``shape``/``dtype`` from the counterpart in pipeline stage ``src_stage``."""
    st = ps.get_state()
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src=st.stage_rank(src_stage), group=st.pp_group)
    return buf
