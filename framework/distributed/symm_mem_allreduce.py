"""Small tensor-parallel all-reduces through torch's symmetric memory (NVLink peer access).

A TP decode step all-reduces the hidden states twice per layer, at a size (8 KB - 1 MB for
a 4096-wide model at 1-128 tokens) where NCCL's ring protocol is latency-bound. Torch's
symmetric memory (``torch.distributed._symmetric_memory``) maps one buffer of every rank
into every other rank's address space, so an all-reduce is a copy into the buffer, a
barrier on signal pads, and loads from the peers' buffers: ``two_shot_all_reduce_`` (each
rank reduces its 1/world share, then all gather the shares; the idea of vLLM's and
TensorRT-LLM's custom all-reduces) or ``one_shot_all_reduce_out`` (every rank reads all
peers whole). Measured side by side on two H200s (NVLink), inside CUDA graphs, copy-in
included (``benchmarks/bench_allreduce.py --symm-mem``, BENCHMARKS.md): 8 KB NCCL 10.9-12.7
us vs two-shot 7.5 us; 512 KB 15.2-16.5 vs 9.1-9.3 us; 1 MB 21.0 vs 11.5 us. Larger
messages (prefill) stay on NCCL.

It is still ``torch.distributed``: the buffer is rendezvoused over the TP process group,
and every rank calls it with the same shapes in the same order, like any collective.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("kvforge.distributed")

#: Largest message (bytes) sent through symmetric memory; above it, NCCL (measured up to 1 MiB).
MAX_BYTES = 1 << 20
#: The dtypes torch's symm_mem all-reduce kernels implement (float16 is not among them).
DTYPES = (torch.bfloat16, torch.float32)


class SymmMemAllReduce:
    """Sum-all-reduce of small CUDA tensors over one process group through a symmetric buffer.

    Args:
        group: the tensor-parallel process group (NCCL).
        device: this rank's CUDA device.
        dtype: the activations' dtype (the only one taken).
        max_bytes: capacity of the buffer; larger tensors are not taken (:meth:`can_run`).

    Raises:
        RuntimeError: symmetric memory is unavailable here (no CUDA peer access, a torch
            without ``torch.ops.symm_mem``); callers fall back to NCCL.
    """

    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int = MAX_BYTES) -> None:
        try:
            import torch.distributed._symmetric_memory as symm_mem
            self._two_shot = torch.ops.symm_mem.two_shot_all_reduce_
            self._one_shot = torch.ops.symm_mem.one_shot_all_reduce_out
        except (ImportError, AttributeError, RuntimeError) as e:
            raise RuntimeError(f"torch symmetric memory is not available: {e}") from e
        self.group_name = group.group_name
        self.world = group.size()
        self.dtype = dtype
        self.max_numel = max_bytes // torch.tensor([], dtype=dtype).element_size()
        # One buffer for every size: each call uses a view of its first elements (allocated
        # and rendezvoused here, since nothing may be allocated inside a CUDA-graph capture).
        self._buf = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self._buf, self.group_name)

    def can_run(self, x: torch.Tensor) -> bool:
        """Whether ``x`` goes through the symmetric buffer (CUDA, the buffer's dtype, contiguous,
        fits, a whole number of 4-byte words as the kernels load)."""
        return (x.is_cuda and x.dtype == self.dtype and x.is_contiguous() and x.numel() <= self.max_numel
                and (x.numel() * x.element_size()) % 4 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group, in place; returns ``x``."""
        nbytes = x.numel() * x.element_size()
        buf = self._buf[:x.numel()].view(x.shape)
        buf.copy_(x)
        if (x.numel() % self.world == 0) and (nbytes // self.world) % 16 == 0:
            self._two_shot(buf, "sum", self.group_name)  # result in buf (every rank)
            x.copy_(buf)
        else:  # shares would not be 16-byte aligned: every rank reads all peers whole
            self._one_shot(buf, "sum", self.group_name, x)
        return x


def build(group, device: torch.device, dtype: torch.dtype, mode: str) -> SymmMemAllReduce | None:
    """The fast all-reduce for ``parallel.all_reduce`` = ``mode`` on this rank, or None (NCCL).

    ``auto``: symmetric memory when it initialises (else NCCL, logged); ``symm_mem``: it must;
    ``nccl``: None. Every rank of the group must call this (the rendezvous is collective).

    Raises:
        RuntimeError: ``mode == "symm_mem"`` and it cannot be set up (not CUDA, no symmetric memory).
    """
    if mode == "nccl" or group is None:
        return None
    if device.type != "cuda" or dtype not in DTYPES:
        if mode == "symm_mem":
            why = f"CUDA GPUs (this rank runs on {device.type})" if device.type != "cuda" else \
                f"bfloat16 or float32 activations (the model runs in {dtype})"
            raise RuntimeError(f"parallel.all_reduce=symm_mem needs {why}")
        return None
    try:
        return SymmMemAllReduce(group, device, dtype)
    except Exception as e:  # noqa: BLE001 - auto falls back; an explicit choice fails loudly
        if mode == "symm_mem":
            raise RuntimeError(f"parallel.all_reduce=symm_mem: {e}") from e
        log.warning("symmetric-memory all-reduce unavailable (%s); using NCCL", e)
        return None
