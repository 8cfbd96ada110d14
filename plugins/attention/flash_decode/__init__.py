"""`flash_decode` attention backend: split-KV paged decode in CUDA C++, JIT-compiled
through CuPy/NVRTC (the way FlashInfer JIT-compiles its kernels).

Decode rows (one query token) run ``fd_partial`` over ``num_splits`` partitions of
their context and, when split, ``fd_merge`` combines the partial softmax states by
log-sum-exp (Flash-Decoding, Dao et al. 2023). ``fd_partial`` spreads keys over lanes
(a few lanes per key, each holding 16-byte vectors of it), keeps the q slices of the
whole GQA group in registers so each K/V byte is read once for all of its query heads,
and streams K/V through a 4-stage cp.async pipeline (see kernels.cu; emulate.py checks
its indexing on the CPU). The split count comes from a plan computed on the CPU once per
step (:func:`plan_splits`). Prefill/extend rows use `triton_paged`'s prefill kernel (its
per-step plan, split-KV included) when that plugin is importable and supports the layer
(block size >= 16, power-of-two head size), else the torch reference loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvforge import hookimpl
from kvforge.interfaces import AttentionBackend, AttentionInputs, AttentionLayer, AttentionRequirements
from kvforge.layers.cupy_launch import nvrtc_reasons
from kvforge_plugins.attention.flash_decode.jit import head_slices, heads_per_program
from kvforge_plugins.attention.flash_decode.plan import plan_splits
from kvforge_plugins.attention.torch_ref import TorchRefBackend, write_kv

KVFORGE_HOOK_API = "1"

_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}


@dataclass
class FlashDecodeMetadata:
    """Per-step plan. ``decode_tok``/``decode_req`` int32 [Bd]: token row and request
    row of each decode; ``prefill`` is the AttentionInputs restricted to prefill rows
    (None if none); ``plans``: (num_splits, partition tokens) from :func:`plan_splits` per
    (KV heads, GQA group), made by the step's first layer of that shape and reused by the rest."""

    inputs: AttentionInputs
    decode_tok: torch.Tensor
    decode_req: torch.Tensor
    num_decode: int
    prefill_rows: list[int]
    prefill_md: object = None  # triton_paged's plan of the prefill rows (None: reference loop)
    plans: dict = field(default_factory=dict)


class FlashDecodeBackend(AttentionBackend):
    name = "flash_decode"

    def __init__(self, settings=None) -> None:  # takes no settings (the registry refuses any)
        from kvforge_plugins.attention.flash_decode.jit import Kernels
        self.kernels = Kernels()
        self._ref = TorchRefBackend()
        self._workspace: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._num_sms: int | None = None
        self._prefill_ok: dict[tuple, bool] = {}
        try:
            from kvforge_plugins.attention.triton_paged import TritonPagedBackend
            self._prefill = TritonPagedBackend()
        except Exception:  # prefill falls back to the reference loop
            self._prefill = None

    @classmethod
    def validate(cls, req: AttentionRequirements, device: torch.device) -> list[str]:
        reasons = nvrtc_reasons(device, "its kernels are")
        if req.dtype not in _DTYPES:
            reasons.append(f"dtype {req.dtype} not supported")
        if req.head_size not in (8, 16) and (req.head_size % 32 or not 32 <= req.head_size <= 256):
            reasons.append(f"head_size {req.head_size} must be 8, 16 or a multiple of 32 up to 256")
        if req.dtype == torch.float32 and req.head_size > 128:
            reasons.append("float32 supports head_size <= 128 (a K/V row is at most 32 16-byte vectors)")
        if req.block_size not in (8, 16, 32):
            reasons.append(f"block_size {req.block_size} not in (8, 16, 32)")
        if req.num_heads % req.num_kv_heads or req.num_heads // req.num_kv_heads > 16:
            reasons.append("query heads per KV head must be an integer <= 16")
        if req.sliding_window is not None:
            reasons.append("sliding-window attention is not supported")
        return reasons

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def build_metadata(self, inputs: AttentionInputs) -> FlashDecodeMetadata:
        dev = inputs.seq_lens.device
        qlens = inputs.query_lens_cpu
        decode_rows = [i for i, n in enumerate(qlens) if n == 1]
        prefill_rows = [i for i, n in enumerate(qlens) if n != 1]
        if len(decode_rows) == len(qlens):  # pure decode: row i is token i (graph-capturable)
            tok = req = torch.arange(len(qlens), dtype=torch.int32, device=dev)
        else:
            starts = [0]
            for n in qlens:
                starts.append(starts[-1] + n)
            tok = torch.tensor([starts[i] for i in decode_rows], dtype=torch.int32, device=dev)
            req = torch.tensor(decode_rows, dtype=torch.int32, device=dev)
        if self._num_sms is None:
            self._num_sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        prefill_md = self._prefill.build_metadata(inputs) if prefill_rows and self._prefill is not None else None
        return FlashDecodeMetadata(inputs, tok, req, len(decode_rows), prefill_rows, prefill_md)

    def plan_for(self, md: FlashDecodeMetadata, layer: AttentionLayer) -> tuple[int, int]:
        """(num_splits, partition tokens) of this step's decode rows for layers shaped like
        ``layer`` (heads are known only per layer; computed once per step and shape)."""
        key = (layer.num_kv_heads, layer.num_heads)
        plan = md.plans.get(key)
        if plan is None:
            group = layer.num_heads // layer.num_kv_heads
            plan = md.plans[key] = plan_splits(md.num_decode, layer.num_kv_heads * head_slices(group),
                                               md.inputs.max_seq_len, md.inputs.block_size, self._num_sms,
                                               resident=3 if heads_per_program(group) <= 4 else 2)
        return plan

    def _ws(self, rows: int, heads: int, splits: int, d: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
        key = (rows, heads, splits, d, dev)
        ws = self._workspace.get(key)
        if ws is None:
            ws = (torch.empty(rows * heads * splits * d, dtype=torch.float32, device=dev),
                  torch.empty(rows * heads * splits, dtype=torch.float32, device=dev))
            self._workspace[key] = ws
        return ws

    @staticmethod
    def _write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """K and V into the cache: triton_paged's one-launch kernel where its row width
        (KV heads rounded up to a power of two, x head_dim) is a power of two, else the
        two index copies of torch_ref (head_dim 96, 160, ...)."""
        hkv, d = k.shape[1:]
        width = (1 << (hkv - 1).bit_length()) * d
        if k.is_cuda and width & (width - 1) == 0:
            from kvforge_plugins.attention.triton_paged.cache_kernel import reshape_and_cache
            reshape_and_cache(k, v, kv_cache, slot_mapping)
        else:
            write_kv(kv_cache, k, v, slot_mapping)

    def forward(self, layer: AttentionLayer, q, k, v, kv_cache, md: FlashDecodeMetadata):
        inputs = md.inputs
        self._write_kv(kv_cache, k, v, inputs.slot_mapping)
        out = torch.empty_like(q)
        if md.num_decode:
            splits, partition = self.plan_for(md, layer)
            part_out, part_lse = self._ws(md.num_decode, layer.num_heads, splits, layer.head_size, q.device)
            self.kernels.decode(q, kv_cache, inputs.block_table, inputs.seq_lens, md.decode_tok, md.decode_req,
                                md.num_decode, layer, inputs.block_size, splits, partition, part_out, part_lse, out)
        if md.prefill_rows:
            self._forward_prefill(layer, q, kv_cache, md, out)
        return out

    def _triton_prefill_ok(self, layer: AttentionLayer, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether triton_paged's prefill kernel covers this layer (its block sizes and head
        sizes are narrower than this backend's); else the reference loop runs."""
        key = (layer.head_size, layer.num_heads, layer.num_kv_heads, kv_cache.shape[2], q.dtype, q.device.type)
        ok = self._prefill_ok.get(key)
        if ok is None:
            req = AttentionRequirements(q.dtype, layer.head_size, layer.num_heads, layer.num_kv_heads,
                                        kv_cache.shape[2], kv_cache.dtype, layer.sliding_window)
            ok = self._prefill_ok[key] = not type(self._prefill).validate(req, q.device)
        return ok

    def _forward_prefill(self, layer, q, kv_cache, md: FlashDecodeMetadata, out) -> None:
        inputs = md.inputs
        if md.prefill_md is not None and self._triton_prefill_ok(layer, q, kv_cache):
            self._prefill.forward_prefill(layer, q, kv_cache, md.prefill_md, out)
            return
        start = 0
        for i, (qlen, ctx) in enumerate(zip(inputs.query_lens_cpu, inputs.context_lens_cpu)):
            if i in md.prefill_rows:
                self._ref.attend_row(layer, q, kv_cache, inputs, i, start, out)
            start += qlen


@hookimpl
def kvforge_register_attention_backends(register) -> None:
    register("flash_decode", FlashDecodeBackend, priority=5, dtypes=("float16", "bfloat16", "float32"),
             block_sizes=(8, 16, 32), devices=("cuda",), cuda_graphs=True)
