"""Sizing the engine from its device and config: KV blocks, the served max_model_len, and the
``scheduler.max_num_seqs`` default. Used by the builder and by the distributed workers."""
from __future__ import annotations

import logging
import os

import torch

from kvforge.config import EngineConfig

log = logging.getLogger("kvforge")

#: the KV budget on a CPU device when cache.kv_cache_memory_bytes is unset
CPU_DEFAULT_KV_BYTES = 1 << 30


def kv_block_bytes(hf_config, head_dim: int, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: K and V of ``block_size`` tokens in every layer, in ``dtype``."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * block_size * num_kv_heads * head_dim * elem


def fit_max_model_len(config: EngineConfig, max_model_len: int, num_blocks: int, device: torch.device,
                      draft_block_bytes: int = 0, block_bytes: int = 0) -> int:
    """The max_model_len the engine serves, given ``num_blocks`` KV blocks: a request longer than
    the cache holds could never run (it would fail mid-flight), so the front ends must refuse it
    up front. A max_model_len taken from the model's max_position_embeddings is lowered to the
    cache's capacity (with a warning); one the config sets explicitly raises ValueError naming it
    and the cache setting to raise (vLLM refuses to start there too)."""
    c = config.cache
    capacity = num_blocks * c.block_size
    if capacity >= max_model_len:
        return max_model_len
    knob = ("cache.num_gpu_blocks" if c.num_gpu_blocks is not None else
            "cache.kv_cache_memory_bytes" if c.kv_cache_memory_bytes is not None or device.type != "cuda" else
            "cache.gpu_memory_utilization")
    share = (f"; the draft model's KV takes {draft_block_bytes / block_bytes:.0%} of each block's bytes"
             if draft_block_bytes and block_bytes and c.num_gpu_blocks is None else "")
    if config.model.max_model_len is not None:
        raise ValueError(f"model.max_model_len {max_model_len} exceeds the {capacity} tokens that {num_blocks} KV "
                         f"blocks of {c.block_size} tokens hold: raise {knob} or lower model.max_model_len{share}")
    log.warning("cache: %d KV blocks of %d tokens hold %d tokens, fewer than the model's %d positions: "
                "max_model_len lowered to %d (raise %s to serve longer requests)%s", num_blocks, c.block_size,
                capacity, max_model_len, capacity, knob, share)
    return capacity


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of ``device``: the GPU's, or the host's physical memory for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


#: (device memory threshold, max_num_seqs above it, below it)
BIG_GPU_BYTES, BIG_GPU_MAX_NUM_SEQS, DEFAULT_MAX_NUM_SEQS = 70 * 2**30, 512, 256


def default_max_num_batched_tokens(max_model_len: int) -> int:
    """``scheduler.max_num_batched_tokens`` when unset: ``max(2048, max_model_len)`` tokens."""
    return max(2048, max_model_len)


def default_max_num_seqs(device: torch.device) -> int:
    """``scheduler.max_num_seqs`` when the config leaves it unset: 512 on a CUDA GPU of at least
    70 GiB, else 256. vLLM likewise raises its default on such GPUs (to 1024). On the H200 the
    offline 1000 x 1024/128 run gained 1.2-1.7% from 512 over 256 on two machines; 1024 was no
    faster than 256, as the bf16 cache holds only ~780 of the 1152-token requests and preempts
    (BENCHMARKS.md, session 25)."""
    if device.type == "cuda" and device_memory_bytes(device) >= BIG_GPU_BYTES:
        return BIG_GPU_MAX_NUM_SEQS
    return DEFAULT_MAX_NUM_SEQS


def num_kv_blocks(cfg: EngineConfig, device: torch.device, block_bytes: int, max_model_len: int) -> int:
    """KV blocks of ``block_bytes`` to allocate: ``cache.num_gpu_blocks``; else the budget
    (``cache.kv_cache_memory_bytes``; on CUDA ``gpu_memory_utilization`` of the GPU less what is
    in use; on the CPU 1 GiB) over the block size, capped at what ``max_num_seqs`` sequences of
    ``max_model_len`` could fill (vLLM's sizing, after its memory profile).

    Raises:
        ValueError: naming the cache setting, when the blocks exceed the device's memory or the
            budget holds none.
    """
    c = cfg.cache
    if c.num_gpu_blocks is not None:
        memory = device_memory_bytes(device)
        if c.num_gpu_blocks * block_bytes > memory:  # before anything is allocated for them
            raise ValueError(f"cache.num_gpu_blocks: {c.num_gpu_blocks} blocks of {block_bytes} bytes need "
                             f"{c.num_gpu_blocks * block_bytes} bytes, more than the {memory} bytes of memory "
                             f"the {device.type} device has")
        return c.num_gpu_blocks
    if "gpu_memory_utilization" in c.model_fields_set and (c.kv_cache_memory_bytes is not None
                                                           or device.type != "cuda"):
        log.warning("cache.gpu_memory_utilization %s is not used: %s", c.gpu_memory_utilization,
                    "cache.kv_cache_memory_bytes sets the KV budget" if c.kv_cache_memory_bytes is not None else
                    f"it applies to CUDA devices; on {device.type} the KV budget is cache.kv_cache_memory_bytes "
                    f"(default {CPU_DEFAULT_KV_BYTES} bytes)")
    if c.kv_cache_memory_bytes is not None:
        budget = c.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * c.gpu_memory_utilization) - (total - free)
    else:
        budget = CPU_DEFAULT_KV_BYTES
    n = budget // block_bytes
    # More blocks than every sequence could ever fill is only wasted memory.
    cap = cfg.scheduler.max_num_seqs * (-(-max_model_len // c.block_size)) + 1
    n = min(n, cap)
    if n < 1:
        knobs = ("cache.kv_cache_memory_bytes" if c.kv_cache_memory_bytes is not None or device.type != "cuda"
                 else "cache.gpu_memory_utilization or set cache.kv_cache_memory_bytes")
        raise ValueError(f"cache: KV budget of {budget} bytes holds no block of {block_bytes} bytes; raise {knobs}")
    return int(n)


def model_weight_bytes(model: torch.nn.Module, *, step_reads: bool = False) -> int:
    """Bytes of a loaded model's weights: every parameter and buffer (packed quantized weights,
    scales and zero points, which some layouts keep as buffers, norms, embeddings), each
    storage once (tied or shared tensors count once), less rotary cos/sin tables and attention
    layers' FP8 KV scales (``kv_scale``), which are not weights. What the weights take in
    memory: the figure vLLM logs after loading, issue 6's weight memory per format.

    ``step_reads``: also less the input embedding tables that are not the LM head's too (a
    lookup reads a few rows): the bytes one forward step reads, for the roofline. Modules are
    told apart by class name (``*Embedding``, ``Rotary*``), so model plugins' own classes count
    alike."""
    sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in [*model.parameters(), *model.buffers()]}
    head = getattr(model, "lm_head", None)
    head_ptrs = {t.untyped_storage().data_ptr() for t in head.parameters()} if head is not None else set()
    for m in model.modules():
        name = type(m).__name__
        kv_scale = m._buffers.get("kv_scale")
        if kv_scale is not None:
            sizes.pop(kv_scale.untyped_storage().data_ptr(), None)
        if "Rotary" in name:
            for t in m.buffers(recurse=False):
                sizes.pop(t.untyped_storage().data_ptr(), None)
        elif step_reads and "Embedding" in name and m is not head:
            for t in m.parameters(recurse=False):
                if t.untyped_storage().data_ptr() not in head_ptrs:
                    sizes.pop(t.untyped_storage().data_ptr(), None)
    return sum(sizes.values())


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps the figure >= 1 (B, KiB, MiB, GiB), so a
    260K-parameter model's weights do not print as 0.000 GiB."""
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
