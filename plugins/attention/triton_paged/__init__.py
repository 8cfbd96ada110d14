"""`triton_paged` attention backend: Triton kernels over vLLM's paged KV layout.

Cache per layer: ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(identical to ``torch_ref``). Per step ``build_metadata`` splits the batch into
decode rows and prefill tiles; per layer ``forward`` launches
(a) ``reshape_and_cache`` (cache_kernel.py), (b) GQA-packed paged decode
(decode_kernel.py; PagedAttention, Kwon et al. 2023) and (c) varlen
prefill/extend with causal masking over the cached prefix (prefill_kernel.py;
FlashAttention-2, Dao 2023). Online softmax, float32 accumulation.
``forward`` does no host<->device synchronisation; pure-decode steps are
CUDA-graph capturable.

Runs on CUDA, or on CPU through Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported; slow, for tests). Kernels are imported lazily so
a machine without triton can still load the plugin (validate says why not).
"""
from __future__ import annotations

import importlib.util
import os
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvforge import hookimpl
from kvforge.interfaces import AttentionBackend, AttentionInputs, AttentionLayer, AttentionRequirements
from kvforge.layers.kv_cache_dtype import is_fp8
from .metadata import (
    MAX_SPLIT_SLOTS, SplitPolicy, TritonPagedMetadata, build_triton_metadata, make_graph_metadata,
    update_graph_metadata,
)

KVFORGE_HOOK_API = "1"

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
MIN_HEAD, MAX_HEAD = 16, 256


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


class TritonPagedSettings(BaseModel):
    """``attention.settings`` for triton_paged.

    ``prefill_block_m`` / ``kv_block_n``: tile sizes (0 = pick by head size);
    ``prefill_block_n`` overrides ``kv_block_n`` for the prefill kernel.
    ``prefill_num_warps`` / ``prefill_num_stages``: the prefill kernel's Triton launch
    options (0 = by tile size).
    ``split_kv_target_tiles``: a step with fewer prefill tiles than this has its long key
    ranges split across programs (0: never split). ``split_kv_min_keys``: the shortest
    key range a split leaves (keys, i.e. cached + new tokens).
    """

    model_config = ConfigDict(extra="forbid")
    prefill_block_m: int = Field(64, description="queries per prefill tile: a power of two in [16, 256]")
    kv_block_n: int = Field(0, description="keys per K/V tile, decode and prefill: 0 (by head size) or a power "
                                           "of two in [16, 256]")
    prefill_block_n: int = Field(0, description="keys per K/V tile of the prefill kernel: 0 (kv_block_n's) or a "
                                                "power of two in [16, 256]")
    prefill_num_warps: int = Field(0, ge=0, le=16, description="prefill kernel warps: 0 (by tile size) or a power "
                                                               "of two up to 16")
    prefill_num_stages: int = Field(0, ge=0, le=6, description="prefill kernel pipeline stages: 0 (2) or 1-6")
    decode_num_warps: int = Field(0, ge=0, le=16, description="decode kernel warps: 0 (by head size) or a power "
                                                              "of two up to 16")
    decode_num_stages: int = Field(0, ge=0, le=6, description="decode kernel pipeline stages: 0 (3; 5 over an FP8 cache) or 1-6")
    split_kv_target_tiles: int = Field(16, ge=0, description="split long key ranges when a step has fewer "
                                                             "prefill tiles than this (0: never)")
    split_kv_min_keys: int = Field(512, ge=16, description="shortest key range a split leaves (>= 16)")
    fp8_dot_dtype: Literal["float16", "model"] = Field(
        "float16", description="over an FP8 KV cache, a bf16 model's attention dots run in float16 (one "
                               "conversion instruction per two values on sm_89+; the query must lie within "
                               "+-65504) or in the model dtype")

    @field_validator("prefill_block_m")
    @classmethod
    def _check_m(cls, v: int) -> int:
        if not _pow2(v) or not 16 <= v <= 256:
            raise ValueError("must be a power of two in [16, 256]")
        return v

    @field_validator("prefill_num_warps", "decode_num_warps")
    @classmethod
    def _check_warps(cls, v: int) -> int:
        if v != 0 and not _pow2(v):
            raise ValueError("must be 0 (auto) or a power of two (1 to 16)")
        return v

    @field_validator("kv_block_n", "prefill_block_n")
    @classmethod
    def _check_n(cls, v: int) -> int:
        if v != 0 and (not _pow2(v) or not 16 <= v <= 256):
            raise ValueError("must be 0 (auto) or a power of two in [16, 256]")
        return v


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonPagedBackend(AttentionBackend):
    """Paged attention with Triton kernels; see the module docstring."""

    name = "triton_paged"

    def __init__(self, settings: TritonPagedSettings | None = None) -> None:
        self.settings = settings or TritonPagedSettings()
        from kvforge_plugins.attention.triton_paged import cache_kernel, decode_kernel, prefill_kernel
        self._cache, self._decode, self._prefill = cache_kernel, decode_kernel, prefill_kernel
        self._split = SplitPolicy(self.settings.split_kv_target_tiles, self.settings.split_kv_min_keys)
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def validate(cls, req: AttentionRequirements, device: torch.device) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("triton is not installed")
        on_cuda = torch.device(device).type == "cuda"
        if not on_cuda and not _interpreting():
            reasons.append("needs a CUDA device (or TRITON_INTERPRET=1)")
        if req.dtype not in SUPPORTED_DTYPES:
            reasons.append(f"dtype {req.dtype} unsupported (float16, bfloat16, float32)")
        elif req.dtype == torch.bfloat16 and not on_cuda:
            reasons.append("bfloat16 tl.dot is wrong in Triton's CPU interpreter")
        if req.kv_cache_dtype != req.dtype and not is_fp8(req.kv_cache_dtype):
            reasons.append(f"kv_cache_dtype {req.kv_cache_dtype} unsupported (the model dtype {req.dtype}, "
                           "float8_e4m3fn or float8_e5m2)")
        if not _pow2(req.head_size) or not MIN_HEAD <= req.head_size <= MAX_HEAD:
            reasons.append(f"head_size {req.head_size} unsupported (power of two in [{MIN_HEAD}, {MAX_HEAD}])")
        if req.block_size not in SUPPORTED_BLOCK_SIZES:
            reasons.append(f"block_size {req.block_size} unsupported {SUPPORTED_BLOCK_SIZES}")
        if req.num_kv_heads <= 0 or req.num_heads % req.num_kv_heads:
            reasons.append(f"num_heads {req.num_heads} is not a multiple of num_kv_heads {req.num_kv_heads}")
        if req.sliding_window is not None and req.sliding_window < 1:
            reasons.append(f"sliding_window {req.sliding_window} must be >= 1")
        return reasons

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, inputs: AttentionInputs) -> TritonPagedMetadata:
        """Decode/prefill split and prefill tiles, once per step (host lists -> device tensors)."""
        return build_triton_metadata(inputs, self.settings.prefill_block_m, self._split)

    def graph_metadata(self, inputs: AttentionInputs, max_num_tokens: int) -> TritonPagedMetadata:
        """Fixed-capacity metadata over a graph bucket's static ``inputs`` (mixed steps)."""
        return make_graph_metadata(inputs, max_num_tokens, self.settings.prefill_block_m)

    def update_graph_metadata(self, metadata: TritonPagedMetadata, inputs: AttentionInputs) -> None:
        update_graph_metadata(metadata, inputs, self._split)

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, metadata: TritonPagedMetadata,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Write k/v [T, Hkv, D] into ``kv_cache`` and attend; returns [T, Hq, D] in q's dtype.

        ``out`` (optional, [T, Hq, D], q's dtype) is written in place and returned.
        No host<->device synchronisation.
        """
        md = metadata
        inp = md.inputs
        self._cache.reshape_and_cache(k, v, kv_cache, inp.slot_mapping, layer.kv_scale)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        self._decode.paged_decode(q, kv_cache, out, inp.block_table, inp.seq_lens, inp.query_start_loc,
                                  md.decode_rows, md.num_decodes, layer.scale, layer.sliding_window,
                                  self.settings.kv_block_n, count=md.decode_count, kv_scale=layer.kv_scale,
                                  fp16_dots=self.settings.fp8_dot_dtype == "float16",
                                  num_warps=self.settings.decode_num_warps, num_stages=self.settings.decode_num_stages)
        self.forward_prefill(layer, q, kv_cache, md, out)
        return out

    def forward_prefill(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor,
                        md: TritonPagedMetadata, out: torch.Tensor) -> None:
        """Kernel (c) only: attention of the prefill/extend rows of ``md`` into ``out``
        ([T, Hq, D], q's dtype), the step's K/V already in ``kv_cache``. Other backends
        (``flash_decode``) use it for their prefill rows."""
        inp, st = md.inputs, self.settings
        self._prefill.paged_prefill(q, kv_cache, out, inp.block_table, inp.query_start_loc, inp.context_lens,
                                    md.prefill_tiles, md.num_prefill_tiles, md.block_m, layer.scale,
                                    layer.sliding_window, st.prefill_block_n or st.kv_block_n, count=md.tile_count,
                                    merges=md.merges, num_merges=md.num_merges, merge_count=md.merge_count,
                                    scratch=self._scratch_for(q, md.block_m) if md.num_merges else None,
                                    num_warps=st.prefill_num_warps, num_stages=st.prefill_num_stages,
                                    kv_scale=layer.kv_scale, fp16_dots=st.fp8_dot_dtype == "float16")

    def _scratch_for(self, q: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Split-KV partial outputs / log-sum-exps, one buffer per shape shared by every layer
        (layers run one after another); allocated once, so CUDA graphs keep its address."""
        _, hq, d = q.shape
        key = (q.device, hq, d, block_m)
        if key not in self._scratch:
            self._scratch[key] = (
                torch.empty((MAX_SPLIT_SLOTS, hq, block_m, d), dtype=torch.float32, device=q.device),
                torch.empty((MAX_SPLIT_SLOTS, hq, block_m), dtype=torch.float32, device=q.device))
        return self._scratch[key]


@hookimpl
def kvforge_register_attention_backends(register) -> None:
    register("triton_paged", TritonPagedBackend, settings_model=TritonPagedSettings, priority=10,
             dtypes=("float16", "bfloat16", "float32"), cuda_graphs=True, mixed_cuda_graphs=True,
             kv_cache_dtypes=("fp8_e4m3", "fp8_e5m2"))
