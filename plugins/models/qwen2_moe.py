"""`qwen2_moe` model plugin: Qwen1.5-MoE / Qwen2-MoE.

Qwen2 attention (q/k/v bias) with sparse blocks of ``num_experts`` routed SwiGLU experts
(top ``num_experts_per_tok``, renormalised only if ``norm_topk_prob``) plus one shared
expert whose output is scaled by ``sigmoid(shared_expert_gate(x))``. Layers listed in
``mlp_only_layers``, or not on the ``decoder_sparse_step`` grid, keep a dense MLP.
Reference: transformers' ``modeling_qwen2_moe``. Parallelism as in
:mod:`kvforge_plugins.models.moe.layer`; under expert parallelism the shared expert is
kept whole on every rank and runs on the rank's token slice.
"""
from __future__ import annotations

import torch

from kvforge import hookimpl
from kvforge.distributed.communication import tp_all_reduce
from kvforge.interfaces import ModelContext
from kvforge_plugins.models.llama import LlamaForCausalLM, LlamaMLP
from kvforge_plugins.models.moe.layer import FusedMoE, Router, SwiGLUMLP
from kvforge_plugins.models.moe.model import MoEWeightsMixin
from kvforge_plugins.models.qwen2 import Qwen2Attention, Qwen2DecoderLayer

KVFORGE_HOOK_API = "1"


class Qwen2MoeAttention(Qwen2Attention):
    def biases(self, cfg):
        return bool(getattr(cfg, "qkv_bias", True)), False


class Qwen2MoeSparseMoeBlock(torch.nn.Module):
    def __init__(self, cfg, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        self.gate = Router(cfg.num_experts, cfg.hidden_size, ctx.dtype)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                ctx.dtype, f"{prefix}.experts", renormalize=bool(getattr(cfg, "norm_topk_prob", False)))
        ep = self.experts.ep_size > 1
        self.shared_expert = None
        shared_size = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        if shared_size:
            # TP: sharded like a dense MLP, its partial sum joins the experts' in one all-reduce.
            # EP: whole on every rank, applied to the rank's token slice.
            self.shared_expert = SwiGLUMLP(cfg.hidden_size, shared_size, ctx, f"{prefix}.shared_expert",
                                           parallel=not ep, reduce_results=False)
            self.shared_expert_gate = Router(1, cfg.hidden_size, ctx.dtype)

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.experts(x, self.gate(x), self._shared if self.shared_expert is not None else None)
        return y if self.experts.ep_size > 1 else tp_all_reduce(y)


class Qwen2MoeDecoderLayer(Qwen2DecoderLayer):
    attention_cls = Qwen2MoeAttention

    def make_mlp(self, cfg, ctx, layer_idx, prefix):
        sparse = (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or [])
                  and cfg.num_experts > 0 and (layer_idx + 1) % getattr(cfg, "decoder_sparse_step", 1) == 0)
        return Qwen2MoeSparseMoeBlock(cfg, ctx, prefix) if sparse else LlamaMLP(cfg, ctx, prefix)


class Qwen2MoeForCausalLM(MoEWeightsMixin, LlamaForCausalLM):
    layer_cls = Qwen2MoeDecoderLayer


@hookimpl
def kvforge_register_models(register) -> None:
    register("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM)
