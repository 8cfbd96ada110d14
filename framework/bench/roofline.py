"""The roofline floor of a workload (``kvforge bench throughput`` / ``latency``): the time the
model's FLOPs take at the GPU's peak GEMM rate and its weight + KV bytes at its copy rate,
from the model's shape (:class:`ModelShape`) or, for a quantized model, its loaded tensors.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Sequence

from kvforge.bench.args import positive_float

# Measured on the project's H200 (issue 3): device copy bandwidth and dense bf16 GEMM throughput.
H200_MEM_BW_TBPS = 4.27
H200_PEAK_TFLOPS = 799.0


# ---------------------------------------------------------------------------------------- roofline

@dataclass(frozen=True)
class ModelShape:
    """Dense decoder shape read from a Hugging Face config (``config.json`` dict or ``PretrainedConfig``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelShape":
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        nh = get("num_attention_heads")
        return cls(get("hidden_size"), get("num_hidden_layers"), nh, get("num_key_value_heads") or nh,
                   get("head_dim") or get("hidden_size") // nh, get("intermediate_size"), get("vocab_size"),
                   bool(get("tie_word_embeddings", False)))

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's GEMMs: q, k, v, o projections and the gated MLP (gate, up, down)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size

    @property
    def num_params(self) -> int:
        """All parameters: embedding, layers (+ 2 RMSNorms each), final norm, untied LM head."""
        emb = self.vocab_size * self.hidden_size
        return (emb * (1 if self.tie_word_embeddings else 2)
                + self.num_layers * (self.layer_matmul_params + 2 * self.hidden_size) + self.hidden_size)

    def step_weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes one forward step must read: every layer's weights + final norm + LM head (embedding
        lookups touch only a few rows and are not counted)."""
        return dtype_bytes * (self.num_layers * (self.layer_matmul_params + 2 * self.hidden_size)
                              + self.hidden_size + self.vocab_size * self.hidden_size)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def step_weight_bytes_for(llm: Any, shape: ModelShape, dtype_bytes: int) -> tuple[int, str]:
    """(bytes, source) of the weights a step reads, for the roofline: the analytic figure of an
    unquantized model, the loaded model's own tensors (``sizing.model_weight_bytes``, step reads) for a
    quantized one when it lives in this process (else the analytic figure, marked so)."""
    engine = llm.llm_engine
    if engine.parts.choices.get("quantizer", "unquantized") == "unquantized":
        return shape.step_weight_bytes(dtype_bytes), "analytic (model dtype)"
    model = getattr(getattr(engine, "runner", None), "model", None)
    if model is None:
        return shape.step_weight_bytes(dtype_bytes), "analytic (model dtype; quantized weights live in workers)"
    from kvforge.engine.sizing import model_weight_bytes
    return model_weight_bytes(model, step_reads=True), "measured (the loaded quantized model's tensors)"


def kv_cache_bytes(engine: Any) -> int:
    """Bytes of one cached K or V value in ``engine`` (its ``cache.kv_cache_dtype`` resolved)."""
    from kvforge.layers.kv_cache_dtype import resolve_kv_cache_dtype
    return resolve_kv_cache_dtype(engine.config.cache.kv_cache_dtype, engine.parts.dtype).itemsize


def roofline(shape: ModelShape, input_lens: Sequence[int], output_lens: Sequence[int], dtype_bytes: int,
             max_num_seqs: int, peak_tflops: float = H200_PEAK_TFLOPS,
             mem_bw_tbps: float = H200_MEM_BW_TBPS, weight_bytes: int | None = None,
             kv_dtype_bytes: int | None = None) -> dict[str, float]:
    """Floor time (seconds) of an offline workload: prefill compute-bound, decode at the roofline.

    A prompt of n tokens produces the first output token; the other ``output_len - 1`` are decode steps.
    With H = hidden, L = layers, Hq = query heads, D = head_dim, V = vocab, P = L * layer GEMM params:

    * prefill FLOPs = sum over prompts of 2*P*n + 2*V*H (LM head on the last position only)
      + attention 2*L*Hq*D*n*(n+1) (causal QK^T and PV); ``prefill_s = FLOPs / peak``.
    * decode, token j (1..out-1) of a prompt of n: context c = n + j; FLOPs = 2*(P + V*H) + 4*L*Hq*D*c;
      KV bytes read = c * 2*L*Hkv*D*kv_dtype_bytes (default ``dtype_bytes``; 1 for an FP8 cache).
    * decode steps >= max(max(out) - 1, ceil(decode tokens / max_num_seqs)); each step reads all
      weights once: ``weight_bytes`` (bytes; default :meth:`ModelShape.step_weight_bytes`, pass
      :func:`step_weight_bytes_for` for a quantized model).
    * ``decode_s = max(decode FLOPs / peak, (steps * weight bytes + KV bytes) / bandwidth)``.
    * ``floor_s = prefill_s + decode_s`` (overlap of prefill compute with decode weight reads in mixed
      batches is ignored, as in the issue's estimate: 1000 x 1024 in / 128 out on an H200 ~ 40 req/s).

    Dense models only (MoE expert sparsity is not modelled; for quantized models only the weight
    bytes are: the compute term keeps ``peak_tflops``).
    Returns the terms above plus ``requests_per_s``, ``output_tokens_per_s``, ``total_tokens_per_s``.
    """
    peak, bw = peak_tflops * 1e12, mem_bw_tbps * 1e12
    h, L, hq, d = shape.hidden_size, shape.num_layers, shape.num_heads, shape.head_dim
    p = L * shape.layer_matmul_params
    kv_tok = shape.kv_bytes_per_token(dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes)
    pre_flops = dec_flops = kv_bytes = 0.0
    dec_tokens = 0
    for n, m in zip(input_lens, output_lens):
        pre_flops += 2 * p * n + 2 * shape.vocab_size * h + 2 * L * hq * d * n * (n + 1)
        k = m - 1  # decode tokens of this request
        ctx_sum = k * n + k * (k + 1) / 2  # sum of contexts n+1 .. n+k
        dec_flops += 2 * (p + shape.vocab_size * h) * k + 4 * L * hq * d * ctx_sum
        kv_bytes += ctx_sum * kv_tok
        dec_tokens += k
    steps = max(max(output_lens) - 1, math.ceil(dec_tokens / max_num_seqs)) if dec_tokens else 0
    step_bytes = shape.step_weight_bytes(dtype_bytes) if weight_bytes is None else weight_bytes
    dec_bytes = steps * step_bytes + kv_bytes
    prefill_s = pre_flops / peak
    decode_s = max(dec_flops / peak, dec_bytes / bw)
    floor_s = prefill_s + decode_s
    n_req, n_out, n_in = len(input_lens), sum(output_lens), sum(input_lens)
    return {"peak_tflops": peak_tflops, "mem_bw_tbps": mem_bw_tbps, "dtype_bytes": dtype_bytes,
            "num_params": shape.num_params, "prefill_flops": pre_flops, "prefill_s": prefill_s,
            "step_weight_bytes": step_bytes, "decode_tokens": dec_tokens, "decode_steps": steps, "decode_flops": dec_flops,
            "decode_bytes": dec_bytes, "decode_kv_bytes": kv_bytes, "decode_s": decode_s, "floor_s": floor_s,
            "requests_per_s": n_req / floor_s, "output_tokens_per_s": n_out / floor_s,
            "total_tokens_per_s": (n_in + n_out) / floor_s}


def add_roofline_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("roofline")
    g.add_argument("--peak-tflops", type=positive_float, default=None,
                   help=f"dense GEMM peak, TFLOP/s (default: {H200_PEAK_TFLOPS} on an H200, measured bf16 there; "
                        "elsewhere measured on the device at the end of the run)")
    g.add_argument("--mem-bw-tbps", type=positive_float, default=None,
                   help=f"memory bandwidth, TB/s (default: {H200_MEM_BW_TBPS} on an H200, its measured device copy; "
                        "elsewhere measured on the device at the end of the run)")
