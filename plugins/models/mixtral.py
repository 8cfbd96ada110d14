"""`mixtral` model plugin: Mixtral-8x7B-style sparse MoE (Jiang et al. 2024).

Llama attention (GQA, RoPE) with every MLP replaced by ``num_local_experts`` SwiGLU
experts of which ``num_experts_per_tok`` run per token, weighted by the renormalised
top-k softmax of the router. Reference: transformers' ``modeling_mixtral``. Checkpoint
names ``block_sparse_moe.{gate, experts.N.w1/w2/w3}`` (w1 = gate, w3 = up, w2 = down).
Tensor, pipeline and expert parallelism as described in :mod:`kvforge_plugins.models.moe.layer`.
"""
from __future__ import annotations

import torch

from kvforge import hookimpl
from kvforge.distributed.communication import tp_all_reduce
from kvforge.interfaces import ModelContext
from kvforge_plugins.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kvforge_plugins.models.moe.layer import FusedMoE, Router
from kvforge_plugins.models.moe.model import MoEWeightsMixin

KVFORGE_HOOK_API = "1"


class MixtralSparseMoeBlock(torch.nn.Module):
    """x [T, H] -> [T, H]: router, then the top-k experts (one all-reduce under TP)."""

    def __init__(self, cfg, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        self.gate = Router(cfg.num_local_experts, cfg.hidden_size, ctx.dtype)
        self.experts = FusedMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.intermediate_size, ctx.dtype, f"{prefix}.experts", renormalize=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x))
        return y if self.experts.ep_size > 1 else tp_all_reduce(y)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg, ctx, layer_idx, prefix):
        return MixtralSparseMoeBlock(cfg, ctx, prefix)


class MixtralForCausalLM(MoEWeightsMixin, LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    RENAMES = ((".block_sparse_moe.", ".mlp."),)


@hookimpl
def kvforge_register_models(register) -> None:
    register("MixtralForCausalLM", MixtralForCausalLM)
