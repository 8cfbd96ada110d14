"""Process groups of one engine replica: tensor-, pipeline- and expert-parallel ranks.

Rank layout (Megatron-LM, Shoeybi et al. 2019; Narayanan et al. 2021): a replica of
``world = tp * pp`` ranks numbers them ``rank = pp_rank * tp + tp_rank``, so the ranks of
one pipeline stage are consecutive (one tensor-parallel group per stage) and the ranks
with the same ``tp_rank`` form a pipeline group. Expert parallelism, when enabled, uses
the tensor-parallel group (experts are split across the ranks that share a stage).

A model plugin reads its place through the getters below; in a process where
:func:`init_parallel_state` was never called (the single-process engine) every size
is 1 and every rank 0, so the same model code runs unsharded.

Collectives go through ``torch.distributed``: NCCL on GPU, gloo on CPU.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    """This process's place in its replica and the groups it belongs to."""

    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    tp_group: Any
    pp_group: Any
    expert_parallel: bool
    device: torch.device
    backend: str
    fast_all_reduce: Any = None  # SymmMemAllReduce for small TP all-reduces (None: NCCL/gloo only)
    ep_asked: bool = False  # whether a layer asked for its expert shard (get_ep_size / get_ep_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of this process's counterpart (same tp_rank) in stage ``pp_rank``."""
        return pp_rank * self.tp_size + self.tp_rank


_STATE: ParallelState | None = None


def init_parallel_state(*, rank: int, world_size: int, tp_size: int, pp_size: int, init_method: str,
                        device: torch.device, expert_parallel: bool = False,
                        timeout_s: float = 300.0) -> ParallelState:
    """Join the replica's default process group and build its tensor/pipeline groups.

    Every rank of the replica calls this with the same sizes (``new_group`` is collective).
    ``init_method``: a ``tcp://host:port`` rendezvous. ``timeout_s`` bounds every
    collective: a rank whose peer died raises instead of waiting forever.

    Raises:
        ValueError: ``world_size != tp_size * pp_size``.
    """
    global _STATE
    if world_size != tp_size * pp_size:
        raise ValueError(f"world_size {world_size} != tensor_parallel_size {tp_size} x "
                         f"pipeline_parallel_size {pp_size}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    tp_group = pp_group = None

    def group(ranks: list[int]):
        # new_group is collective over the whole world: every rank creates every group, in the
        # same order. One-rank groups are never used for a collective, so none is made.
        if len(ranks) == world_size:
            return dist.group.WORLD
        return dist.new_group(ranks) if len(ranks) > 1 else None

    for p in range(pp_size):
        g = group([p * tp_size + t for t in range(tp_size)])
        if p == pp_rank:
            tp_group = g
    for t in range(tp_size):
        g = group([p * tp_size + t for p in range(pp_size)])
        if t == tp_rank:
            pp_group = g
    _STATE = ParallelState(rank, world_size, tp_rank, tp_size, pp_rank, pp_size, tp_group, pp_group,
                           expert_parallel and tp_size > 1, device, backend)
    return _STATE


def set_parallel_state(state: ParallelState | None) -> None:
    """Install (or clear, with None) the state directly; for tests of single layers."""
    global _STATE
    _STATE = state


def destroy_parallel_state() -> None:
    """Leave the process group (best effort)."""
    global _STATE
    _STATE = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer may already be gone
            pass


def get_state() -> ParallelState | None:
    return _STATE


def get_tp_size() -> int:
    return _STATE.tp_size if _STATE is not None else 1


def get_tp_rank() -> int:
    return _STATE.tp_rank if _STATE is not None else 0


def get_tp_group():
    return _STATE.tp_group if _STATE is not None else None


def get_pp_size() -> int:
    return _STATE.pp_size if _STATE is not None else 1


def get_pp_rank() -> int:
    return _STATE.pp_rank if _STATE is not None else 0


def get_ep_size() -> int:
    """Ranks the MoE experts are split across (1 unless expert parallelism is on). An expert
    layer calls this (or :func:`get_ep_rank`) while it is built; the worker refuses
    ``enable_expert_parallel`` for a model none of whose layers did."""
    if _STATE is not None:
        _STATE.ep_asked = True
    return _STATE.tp_size if _STATE is not None and _STATE.expert_parallel else 1


def get_ep_rank() -> int:
    if _STATE is not None:
        _STATE.ep_asked = True
    return _STATE.tp_rank if _STATE is not None and _STATE.expert_parallel else 0


def pp_layer_range(num_layers: int, pp_rank: int | None = None, pp_size: int | None = None) -> tuple[int, int]:
    """Decoder layers ``[start, end)`` of pipeline stage ``pp_rank``: contiguous, sizes
    differing by at most one (GPipe's even partition; Huang et al. 2019).

    Raises:
        ValueError: fewer layers than stages.
    """
    pp_rank = get_pp_rank() if pp_rank is None else pp_rank
    pp_size = get_pp_size() if pp_size is None else pp_size
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    return pp_rank * num_layers // pp_size, (pp_rank + 1) * num_layers // pp_size
