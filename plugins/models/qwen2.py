"""`qwen2` model plugin: Qwen2 / Qwen2.5 = Llama layout + q/k/v bias (no o_proj bias).

Reference: transformers' ``modeling_qwen2``. Sliding-window layers follow
``use_sliding_window`` / ``max_window_layers`` as there.
"""
from __future__ import annotations

from kvforge import hookimpl
from kvforge_plugins.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

KVFORGE_HOOK_API = "1"


class Qwen2Attention(LlamaAttention):
    def biases(self, cfg):
        return True, False

    def sliding_window(self, cfg, layer_idx):
        if not getattr(cfg, "use_sliding_window", False):
            return None
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return cfg.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
        return cfg.sliding_window if layer_idx >= getattr(cfg, "max_window_layers", 0) else None


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer


@hookimpl
def kvforge_register_models(register) -> None:
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
