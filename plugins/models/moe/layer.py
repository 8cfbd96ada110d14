"""Top-k routed SwiGLU experts (Shazeer et al. 2017; Mixtral, Jiang et al. 2024), sharded
for tensor or expert parallelism.

Weights: ``w13_weight`` [E_local, 2 * I_local, H] (each expert's gate rows, then its up
rows) and ``w2_weight`` [E_local, H, I_local].

* One rank: every expert whole.
* Tensor parallel (``tp > 1``, expert parallelism off): every expert's intermediate
  dimension is split like a dense MLP (column-parallel gate/up, row-parallel down); each
  rank returns a partial sum that the block all-reduces once.
* Expert parallel (``parallel.enable_expert_parallel``): rank r holds whole experts
  ``[r * E / ep, (r + 1) * E / ep)``. The tokens of the step (the same on every rank after
  the attention all-reduce) are cut into ``ep`` slices; each rank routes its slice, sends
  every (token, expert) pair to the rank holding the expert with ``all_to_all`` (GShard,
  Lepikhin et al. 2020), runs its experts on what it receives, sends the results back with
  a second ``all_to_all``, combines them with the routing weights, and an all-gather
  restores the whole step on every rank.

Routing (HF ``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter``): softmax over the router
logits in float32, top-k, optionally renormalised to sum to 1.
"""
from __future__ import annotations

import torch

from kvforge.distributed import parallel_state as ps
from kvforge.distributed.communication import ep_all_to_all, ep_exchange_counts, tp_all_gather
from kvforge_plugins.models.moe.triton_moe import moe_pairs


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (float32 weights [T, k], int64 expert ids [T, k])."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class Router(torch.nn.Module):
    """The dense gate ``[E, H]`` (kept unquantized, as checkpoints store it)."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class FusedMoE(torch.nn.Module):
    """``num_experts`` SwiGLU experts of ``hidden_size -> intermediate_size -> hidden_size``.

    :meth:`forward` returns, without expert parallelism, this rank's *partial* output
    (sum over ranks = the MoE output; with one rank it is the output) and, with expert
    parallelism, the complete output on every rank.

    Raises:
        ValueError: experts or intermediate size that do not divide by the ranks.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 prefix: str, *, renormalize: bool) -> None:
        super().__init__()
        self.prefix = prefix
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.ep_size, self.ep_rank = ps.get_ep_size(), ps.get_ep_rank()
        self.tp_size = 1 if self.ep_size > 1 else ps.get_tp_size()
        self.tp_rank = 0 if self.ep_size > 1 else ps.get_tp_rank()
        if num_experts % self.ep_size:
            raise ValueError(f"{prefix}: {num_experts} experts do not divide by expert-parallel size {self.ep_size}")
        if intermediate_size % self.tp_size:
            raise ValueError(f"{prefix}: expert intermediate size {intermediate_size} does not divide by "
                             f"tensor_parallel_size {self.tp_size}")
        self.num_local_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.num_local_experts
        self.intermediate_size = intermediate_size
        self.i_local = intermediate_size // self.tp_size
        e, i = self.num_local_experts, self.i_local
        self.w13_weight = torch.nn.Parameter(torch.zeros(e, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(e, hidden_size, i, dtype=dtype), requires_grad=False)

    # -- loading --------------------------------------------------------------------------
    def _rows(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of one expert's intermediate dimension."""
        return t.narrow(dim, self.tp_rank * self.i_local, self.i_local) if self.tp_size > 1 else t

    def load_expert(self, kind: str, expert: int, tensor: torch.Tensor) -> str | None:
        """Load one expert's checkpoint tensor. ``kind``: ``gate`` [I, H], ``up`` [I, H] or
        ``down`` [H, I]. Returns the name it counts as loaded, or None for an expert held
        by another rank.

        Raises:
            ValueError: expert index or shape out of range.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"{self.prefix}: expert {expert} out of range [0, {self.num_experts})")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return None
        h, i, il = self.w2_weight.shape[1], self.intermediate_size, self.i_local
        want = (h, i) if kind == "down" else (i, h)
        if tuple(tensor.shape) != want:
            raise ValueError(f"{self.prefix}.experts.{expert} {kind}: shape {tuple(tensor.shape)}, expected {want}")
        tensor = tensor.to(self.w13_weight.dtype)
        if kind == "down":
            self.w2_weight.data[local].copy_(self._rows(tensor, 1))
        else:
            off = 0 if kind == "gate" else il
            self.w13_weight.data[local, off:off + il].copy_(self._rows(tensor, 0))
        return f"{self.prefix}.{kind}#{expert}"

    def expected_names(self) -> set[str]:
        """What :meth:`load_expert` reports for a complete checkpoint of this rank's experts."""
        return {f"{self.prefix}.{k}#{e}" for k in ("gate", "up", "down")
                for e in range(self.expert_start, self.expert_start + self.num_local_experts)}

    # -- forward --------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, shared=None) -> torch.Tensor:
        """``x`` [T, H], ``router_logits`` [T, E] -> [T, H].

        ``shared``: optional callable ``x_rows -> [rows, H]`` (a shared expert) added to the
        output of the same rows; with expert parallelism it runs on this rank's slice only.
        """
        if self.ep_size > 1:
            return self._forward_ep(x, router_logits, shared)
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        y = self._combine(moe_pairs(x, ids.reshape(-1), self.top_k, self.w13_weight, self.w2_weight), weights, x)
        if shared is not None:
            y = y + shared(x)
        return y

    @staticmethod
    def _combine(pairs: torch.Tensor, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T * k, H] pair outputs -> [T, H] weighted sum (in float32, cast to x's dtype)."""
        t, k = weights.shape
        return (pairs.view(t, k, -1).float() * weights.unsqueeze(-1)).sum(1).to(x.dtype)

    def _forward_ep(self, x: torch.Tensor, router_logits: torch.Tensor, shared) -> torch.Tensor:
        ep, k = self.ep_size, self.top_k
        t_all = x.shape[0]
        chunk = -(-t_all // ep)
        lo = min(self.ep_rank * chunk, t_all)
        hi = min(lo + chunk, t_all)
        xs = x[lo:hi]
        weights, ids = select_experts(router_logits[lo:hi], k, self.renormalize)
        flat = ids.reshape(-1)
        dest = flat // self.num_local_experts
        order = torch.argsort(dest, stable=True)
        send = torch.bincount(dest, minlength=ep).to(torch.int64)
        recv = ep_exchange_counts(send.to(x.device))
        send_l, recv_l = send.tolist(), recv.tolist()
        rx = ep_all_to_all(xs[order // k], send_l, recv_l)                  # token rows for our experts
        re = ep_all_to_all(flat[order], send_l, recv_l) - self.expert_start  # their (local) experts
        ry = moe_pairs(rx, re, 1, self.w13_weight, self.w2_weight) if rx.shape[0] else rx
        back = ep_all_to_all(ry, recv_l, send_l)                             # results, in `order`
        pairs = torch.empty_like(back)
        pairs[order] = back
        ys = self._combine(pairs, weights, x) if hi > lo else xs.clone()
        if shared is not None and hi > lo:
            ys = ys + shared(xs)
        if ys.shape[0] < chunk:  # the all-gather needs equal slices
            ys = torch.cat([ys, ys.new_zeros(chunk - ys.shape[0], ys.shape[1])])
        return tp_all_gather(ys, dim=0)[:t_all]


class SwiGLUMLP(torch.nn.Module):
    """Dense ``down(silu(gate(x)) * up(x))`` of any intermediate size (a shared expert, or the
    dense layers of a partly sparse model). ``parallel=False`` keeps it whole on every rank;
    ``reduce_results=False`` leaves the tensor-parallel partial sum to the caller."""

    def __init__(self, hidden_size: int, intermediate_size: int, ctx, prefix: str, *, parallel: bool = True,
                 reduce_results: bool = True) -> None:
        super().__init__()
        from kvforge.layers.parallel_linear import MergedColumnParallelLinear, RowParallelLinear
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, ctx.quant_config,
                                                       f"{prefix}.gate_up_proj", ctx.dtype, parallel=parallel)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, ctx.quant_config,
                                           f"{prefix}.down_proj", ctx.dtype, parallel=parallel,
                                           reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))
