"""`llama` model plugin: Llama 2/3 (incl. llama3 rope scaling), Mistral, TinyLlama.

Follows Hugging Face transformers' ``modeling_llama`` (the numerical reference)
in kvforge's flattened varlen layout: q/k/v and gate/up projections are fused
(``qkv_proj``, ``gate_up_proj``) and filled from the HF tensors at load time.

Distributed (docs/distributed.md): under tensor parallelism the fused projections are
column-parallel (whole heads per rank; KV heads replicated when fewer than ranks),
``o_proj``/``down_proj`` row-parallel, embedding and LM head vocabulary-parallel. Under
pipeline parallelism a stage builds only its layers (``start_layer``..``end_layer``);
the others are :class:`PPMissingLayer` placeholders and their checkpoint tensors are skipped.
"""
from __future__ import annotations

from typing import Iterable

import torch

from kvforge import hookimpl
from kvforge.distributed import parallel_state as ps
from kvforge.interfaces import AttentionLayer, ForwardMetadata, Model, ModelContext
from kvforge.layers.attention import PagedAttention, kv_scale_target
from kvforge.layers.layernorm import RMSNorm
from kvforge.layers.linear import FusedLinear
from kvforge.layers.parallel_linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvforge.layers.rotary import RotaryEmbedding
from kvforge.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_logits

KVFORGE_HOOK_API = "1"

#: HF projection name -> (fused module name, shard index).
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(torch.nn.Module):
    qkv_bias_default = False
    o_bias_default = False

    def __init__(self, cfg, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(cfg)
        qkv_bias, o_bias = self.biases(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv_heads, qkv_bias,
                                          ctx.quant_config, f"{prefix}.qkv_proj", ctx.dtype)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, o_bias, ctx.quant_config,
                                        f"{prefix}.o_proj", ctx.dtype)
        self.rotary = RotaryEmbedding(cfg, self.head_dim, cfg.max_position_embeddings)
        if self.rotary.rotary_dim == self.head_dim:  # the method may fold RoPE into the qkv GEMM
            self.qkv_proj.rope_heads = self.num_heads + self.num_kv_heads
        window = self.sliding_window(cfg, layer_idx)
        self.attn = PagedAttention(ctx.attention_backend, AttentionLayer(
            layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, window))

    def biases(self, cfg) -> tuple[bool, bool]:
        b = bool(getattr(cfg, "attention_bias", False))
        return b, b

    def sliding_window(self, cfg, layer_idx: int) -> int | None:
        return getattr(cfg, "sliding_window", None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(x), meta)

    def forward_prenorm(self, positions, x, residual, norm, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(x, residual)`` then :meth:`forward`, the norm folded into the qkv GEMM
        where its method can (``FusedLinear.forward_prenorm``); returns (out, x + residual)."""
        qkv, residual = self.qkv_proj.forward_prenorm(x, residual, norm, rope=(positions, self.rotary))
        return self.attend(positions, qkv, meta, rotated=True), residual

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: ForwardMetadata,
               rotated: bool = False) -> torch.Tensor:
        """qkv [T, q_size + 2 * kv_size] -> RoPE (unless ``rotated``), paged attention,
        o_proj: [T, hidden]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if not rotated:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta)
        return self.o_proj(out)


class LlamaMLP(torch.nn.Module):
    def __init__(self, cfg, ctx: ModelContext, prefix: str) -> None:
        super().__init__()
        bias = bool(getattr(cfg, "mlp_bias", False))
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only 'silu')")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias,
                                                       ctx.quant_config, f"{prefix}.gate_up_proj", ctx.dtype)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias, ctx.quant_config,
                                           f"{prefix}.down_proj", ctx.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))

    def forward_prenorm(self, x, residual, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(x, residual)`` then :meth:`forward` (the norm folded into the gate|up GEMM
        where its method can); returns (out, x + residual)."""
        h, residual = self.gate_up_proj.forward_prenorm(x, residual, norm, silu_and_mul=True)
        return self.down_proj(h), residual


class LlamaDecoderLayer(torch.nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg, ctx: ModelContext, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(cfg, ctx, layer_idx, f"{prefix}.self_attn")
        self.mlp = self.make_mlp(cfg, ctx, layer_idx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype)

    def make_mlp(self, cfg, ctx: ModelContext, layer_idx: int, prefix: str) -> torch.nn.Module:
        """The feed-forward block (MoE plugins return their sparse block here)."""
        return LlamaMLP(cfg, ctx, prefix)

    def forward(self, positions, x, residual, meta):
        # each add + RMSNorm goes to the GEMM after it (FusedLinear.forward_prenorm), which may
        # fold it into its own kernel; MoE blocks (routers read the normed x) take it apart
        if residual is None:
            residual, x = x, self.input_layernorm(x)
            x = self.self_attn(positions, x, meta)
        elif _keeps_forward(self.self_attn, LlamaAttention):
            x, residual = self.self_attn.forward_prenorm(positions, x, residual, self.input_layernorm, meta)
        else:
            x, residual = self.input_layernorm(x, residual)
            x = self.self_attn(positions, x, meta)
        if _keeps_forward(self.mlp, LlamaMLP):
            return self.mlp.forward_prenorm(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def _keeps_forward(module: torch.nn.Module, base: type) -> bool:
    """``module`` is a ``base`` whose ``forward`` no subclass replaced: its ``forward_prenorm``
    computes the same (a plugin's subclass that overrides ``forward`` keeps it called)."""
    return isinstance(module, base) and type(module).forward is base.forward


class PPMissingLayer(torch.nn.Identity):
    """Placeholder for a module another pipeline stage owns (no parameters)."""


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg, ctx: ModelContext, layer_cls: type) -> None:
        super().__init__()
        self.is_first_stage = ps.get_pp_rank() == 0
        self.is_last_stage = ps.get_pp_rank() == ps.get_pp_size() - 1
        self.start_layer, self.end_layer = ps.pp_layer_range(cfg.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.dtype)
                             if self.is_first_stage else PPMissingLayer())
        self.layers = torch.nn.ModuleList(
            layer_cls(cfg, ctx, i, f"model.layers.{i}") if self.start_layer <= i < self.end_layer
            else PPMissingLayer() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx.dtype) if self.is_last_stage else PPMissingLayer()

    def forward(self, input_ids, positions, meta, intermediate_tensors=None):
        """First stage: from ``input_ids``; later stages: from ``intermediate_tensors``
        (``hidden_states``, ``residual``). The last stage returns the final hidden
        states [T, H], the others the intermediate tensors for the next stage."""
        if self.is_first_stage:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.layers[self.start_layer:self.end_layer]:
            x, residual = layer(positions, x, residual, meta)
        if not self.is_last_stage:
            return {"hidden_states": x, "residual": residual}
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(Model):
    """Llama-family causal LM. Shapes: input_ids/positions int64 [T] -> hidden [T, hidden_size]."""

    layer_cls = LlamaDecoderLayer
    #: forward takes/returns ``intermediate_tensors`` between pipeline stages.
    supports_pipeline_parallel = True

    def __init__(self, hf_config, ctx: ModelContext) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, ctx, self.layer_cls)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if not self.model.is_last_stage:
            self.lm_head = PPMissingLayer()
        elif self.tie_word_embeddings and self.model.is_first_stage:
            self.lm_head = self.model.embed_tokens
        else:  # (a tied head on a later pipeline stage keeps its own copy of the embedding)
            self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, ctx.dtype)

    def forward(self, input_ids, positions, metadata, intermediate_tensors=None):
        return self.model(input_ids, positions, metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden_states, self.lm_head)

    def _is_local(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to this pipeline stage."""
        m = self.model
        parts = name.split(".")
        if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
            return m.start_layer <= int(parts[2]) < m.end_layer
        if name.startswith("model.embed_tokens."):
            return m.is_first_stage or (self.tie_word_embeddings and m.is_last_stage)
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return m.is_last_stage
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; raise ValueError naming any unknown or mis-shaped tensor."""
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if not self._is_local(name):  # another pipeline stage's tensor
                continue
            if (name == "model.embed_tokens.weight" and self.tie_word_embeddings and self.model.is_last_stage
                    and not self.model.is_first_stage):
                self.lm_head.weight.weight_loader(self.lm_head.weight, tensor)
                loaded.add("lm_head.weight")
                continue
            if "." not in name:  # (every tensor of the architecture lives in a module)
                raise ValueError(f"checkpoint tensor {name!r} does not belong to {type(self).__name__}")
            if self._load_kv_scale(name, tensor):
                continue
            module_path, pname = name.rsplit(".", 1)
            parent, _, proj = module_path.rpartition(".")
            shard = None
            if proj in STACKED:
                proj, shard = STACKED[proj]
                module_path = f"{parent}.{proj}"
            try:
                module = self.get_submodule(module_path)
            except AttributeError:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to {type(self).__name__}") from None
            if isinstance(module, FusedLinear):
                module.load(pname, tensor, shard)
                loaded.add(f"{module_path}.{pname}" + (f"#{shard}" if shard is not None else ""))
                continue
            param = getattr(module, pname, None)
            if not isinstance(param, torch.nn.Parameter):
                raise ValueError(f"checkpoint tensor {name!r} does not belong to {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:  # vocabulary-parallel tables keep this rank's rows
                try:
                    loader(param, tensor.to(param.dtype))
                except ValueError as e:
                    raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
                loaded.add(name)
                continue
            if param.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Set an FP8 KV cache scale (``...self_attn.k_scale`` and the names in
        ``KV_SCALE_NAMES``) on its layer's PagedAttention; False for any other tensor."""
        target = kv_scale_target(name)
        if target is None:
            return False
        try:
            attn = self.get_submodule(target[0] + ".attn")
        except AttributeError:
            attn = None
        if not isinstance(attn, PagedAttention):
            raise ValueError(f"checkpoint tensor {name!r} does not belong to {type(self).__name__}")
        try:
            attn.load_kv_scale(target[1], tensor)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        return True

    def expected_weights(self) -> set[str]:
        """Names ``load_weights`` must have reported for a complete checkpoint."""
        names: set[str] = set()
        for mname, module in self.named_modules():
            if isinstance(module, FusedLinear):
                for pname, _ in module.named_parameters(recurse=False):
                    if len(module.output_sizes) == 1:
                        names.add(f"{mname}.{pname}")
                    else:
                        names.update(f"{mname}.{pname}#{i}" for i in range(len(module.output_sizes)))
        for pname, _ in self.named_parameters():
            mod = pname.rsplit(".", 1)[0]
            if not isinstance(self.get_submodule(mod), FusedLinear):
                names.add(pname)
        if self.tie_word_embeddings and self.model.is_first_stage:
            names.discard("lm_head.weight")
        return names


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama layout with an optional sliding attention window."""


@hookimpl
def kvforge_register_models(register) -> None:
    register("LlamaForCausalLM", LlamaForCausalLM)
    register("MistralForCausalLM", MistralForCausalLM)
