"""Shared pieces of the quantization plugins: checked checkpoint loaders, module-name
matching for fused layers, int32 (un)packing, and the settings every method shares.

Naming: kvforge fuses HF projections (``q_proj|k_proj|v_proj`` -> ``qkv_proj``,
``gate_proj|up_proj`` -> ``gate_up_proj``), but quantized checkpoints and their
``quantization_config`` skip lists name the HF modules. :func:`shard_names` maps a
fused prefix back to the HF names so loaders and errors name the real tensor.
"""
from __future__ import annotations

import os

import re
from typing import Iterable, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from kvforge.interfaces.quantization import checkpoint_quant_method

from .checks import refuse_bad_scales

#: kvforge fused module name -> the HF module names of its shards, in shard order.
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

#: ``backend`` setting shared by all methods: ``auto`` = Triton/cuBLAS kernels on CUDA,
#: the dequantize-then-matmul reference elsewhere; ``reference`` forces the reference.
Backend = Literal["auto", "triton", "reference"]

INT_DTYPES = (torch.int32,)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class QuantSettings(BaseModel):
    """Settings every quantizer accepts (``quantization.settings``)."""

    model_config = ConfigDict(extra="forbid")
    backend: Backend = "auto"


Int4Layout = Literal["auto", "mma", "pairs", "checkpoint"]


#: Default ``WeightOnlySettings.fuse_norm_max_tokens`` (measured, see its docstring).
FUSE_NORM_MAX_TOKENS = 2


class WeightOnlySettings(QuantSettings):
    """Settings of the weight-only int4/int8 quantizers (``awq``, ``gptq``).

    ``int4_layout``: ``auto``/``pairs`` repack 4-bit weights at load time into the layout of
    ``kernels/w4_pairs.py`` on the Triton path (the reference path dequantizes the checkpoint's
    packing and repacks nothing). The layout needs fp16/bf16 models and groups of a multiple
    of 64: where it cannot apply, ``auto`` keeps the checkpoint's packing and ``pairs``
    refuses the layer, on every backend. ``mma`` repacks into the layout of
    ``kernels/w4_mma.py`` instead (a CUDA C++ kernel on ``mma.sync``, needs CuPy and an sm80+
    GPU; K and N multiples of 64, groups of a multiple of 64); it too refuses a layer it
    cannot hold. ``checkpoint`` keeps the checkpoint's packing (the ``wna16`` kernels), for A/B runs.

    ``fuse_norm``: with the ``mma`` layout, a layer after a pre-norm (Llama's qkv and gate|up)
    computes the add + RMSNorm in its GEMM's prologue (``w4_mma.mma_gemm_rmsnorm``) when a step
    has at most ``fuse_norm_max_tokens`` tokens, and a q|k|v weight is repacked so that GEMM's
    epilogue applies RoPE too: one kernel where there were three. False keeps the plain layout
    and runs them apart, for A/B runs.

    ``fuse_norm_max_tokens`` (1..8, the kernel's one token block): every CTA of the fused kernel
    normalizes all the step's rows itself, so its cost grows with the tokens. On an H200 with a
    Llama-3-8B shape the fused step was 6% / 1.8% faster at 1 / 2 tokens and 6% / 7% / 21% slower
    at 3 / 4 / 8 (BENCHMARKS.md, session 29), hence 2.
    """

    int4_layout: Int4Layout = "auto"
    fuse_norm: bool = True
    fuse_norm_max_tokens: int = Field(FUSE_NORM_MAX_TOKENS, ge=1, le=8)  # le: w4_mma.MAX_NORM_M (a test checks)


def require_checkpoint_method(cfg: dict, method: str, checkpoint: str) -> None:
    """Raise ValueError unless ``cfg`` (config.json's ``quantization_config``) is ``method``'s
    (``quant_method`` matched ignoring case): ``checkpoint`` names what is needed ("an AutoAWQ
    checkpoint"). Formats made by calibration (AWQ, GPTQ) cannot be produced from a plain
    checkpoint at load time, and the message says so."""
    got = checkpoint_quant_method(cfg)
    if got == method:
        return
    if got:
        raise ValueError(f"quantization method {method!r} needs {checkpoint} (config.json quantization_config "
                         f"with quant_method {method!r}); this checkpoint has {got!r}")
    raise ValueError(f"quantization method {method!r} needs {checkpoint}; this one is not quantized "
                     f"({method.upper()} needs calibration, so it cannot be applied online: use fp8 or int8)")


def shard_names(prefix: str, num_shards: int | None = None) -> list[str]:
    """HF module names of the shards of kvforge linear ``prefix``.

    ``model.layers.0.self_attn.qkv_proj`` -> ``[...q_proj, ...k_proj, ...v_proj]``;
    an unfused prefix maps to itself. ``num_shards`` (if given) must agree with the
    fused name, otherwise shards are named ``prefix#i``.
    """
    parent, _, leaf = prefix.rpartition(".")
    hf = FUSED_SHARDS.get(leaf)
    if hf is not None and num_shards in (None, len(hf)):
        return [f"{parent}.{h}" if parent else h for h in hf]
    if num_shards in (None, 1):
        return [prefix]
    return [f"{prefix}#{i}" for i in range(num_shards)]


def decide_per_shard(prefix: str, decide, describe=str) -> object:
    """Evaluate ``decide(hf_module_name)`` for each shard of ``prefix``; all must agree.
    ``describe(result)``: the words for one answer in the error (default ``str``).

    Raises:
        ValueError: the shards of one fused kvforge layer get different answers (e.g.
            ``q_proj`` skipped but ``k_proj`` quantized): they cannot share one GEMM.
    """
    names = shard_names(prefix)
    results = [decide(n) for n in names]
    if any(r != results[0] for r in results[1:]):
        detail = ", ".join(f"{n}: {describe(r)}" for n, r in zip(names, results))
        raise ValueError(f"{prefix}: the fused projections get different quantization settings ({detail}); "
                         "kvforge runs them as one GEMM, so they must be quantized alike")
    return results[0]


def matches_any(name: str, patterns: Iterable[str] | None) -> bool:
    """AutoAWQ / transformers ``modules_to_not_convert`` rule: substring of the module name."""
    return any(p and p in name for p in (patterns or ()))


def layer_ignored(name: str, patterns: Iterable[str] | None) -> bool:
    """vLLM / compressed-tensors ignore-list rule: the exact module name, a parent module's
    name, or ``re:<regex>`` matching the module name (``re.match``)."""
    for p in patterns or ():
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.startswith(p + "."):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# Checked loaders
# ---------------------------------------------------------------------------------------------

def add_param(layer: torch.nn.Module, name: str, shape: Sequence[int], dtype: torch.dtype, *,
              dim: int | None, shard_sizes: Sequence[int], allowed: Sequence[torch.dtype],
              packed_factor: int | None = None, what: str = "", loader=None,
              input_dim: int | None = None, scale_values: str | None = None) -> torch.nn.Parameter:
    """Register a zero-filled parameter whose checkpoint shards are concatenated along ``dim``.

    ``shard_sizes`` are the per-shard extents along ``dim`` (in stored units, i.e. already
    divided by the packing factor). ``dim=None``: each shard's tensor is the whole
    parameter (e.g. GPTQ ``g_idx``, which the loader stores per shard in row ``shard``).
    ``allowed``: checkpoint dtypes accepted; anything else is refused naming the tensor.
    ``input_dim``: the dimension of the CHECKPOINT tensor running along the input features
    (packed or grouped), for
    tensor-parallel row slicing (``kvforge.layers.parallel_linear``); None = replicated.
    ``scale_values``: the parameter holds quantization scales, whose checkpoint values
    :func:`load_checked` refuses when non-finite (``"finite"``) or also when <= 0
    (``"positive"``); None checks no values.
    """
    p = torch.nn.Parameter(torch.zeros(tuple(shape), dtype=dtype), requires_grad=False)
    p.output_dim = dim
    p.input_dim = input_dim
    if packed_factor is not None:
        p.packed_factor = packed_factor
    offs = [0]
    for s in shard_sizes:
        offs.append(offs[-1] + int(s))
    p.shard_offsets = offs
    p.allowed_dtypes = tuple(allowed)
    p.tensor_names = [f"{n}.{name}" for n in shard_names(layer.prefix, len(shard_sizes))]
    p.format_hint = what
    p.load_raw = True
    p.scale_values = scale_values
    p.weight_loader = loader or load_checked
    p.loaded_shards = set()
    layer.register_parameter(name, p)
    return p


def _dtypes(ds: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in ds)


def tensor_name(param: torch.nn.Parameter, shard: int | None) -> str:
    """The checkpoint name of shard ``shard`` of ``param`` (all shards joined by '+' for None)."""
    if shard is None and len(param.tensor_names) > 1:
        return "+".join(param.tensor_names)
    return param.tensor_names[shard or 0]


def checked_tensor(param: torch.nn.Parameter, loaded: torch.Tensor, shard: int | None,
                   expected_shape: Sequence[int]) -> torch.Tensor:
    """Refuse a checkpoint tensor of the wrong dtype or shape; the error names the tensor."""
    name = tensor_name(param, shard)
    hint = f" ({param.format_hint})" if getattr(param, "format_hint", "") else ""
    if loaded.dtype not in param.allowed_dtypes:
        raise ValueError(f"checkpoint tensor {name!r} has dtype {str(loaded.dtype).replace('torch.', '')}, "
                         f"expected {_dtypes(param.allowed_dtypes)}{hint}")
    if tuple(loaded.shape) != tuple(expected_shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(loaded.shape)}, "
                         f"expected {tuple(expected_shape)}{hint}")
    return loaded


def load_checked(param: torch.nn.Parameter, loaded: torch.Tensor, shard: int | None) -> None:
    """``weight_loader`` of :func:`add_param` parameters: check dtype, shape and (scales) values,
    then copy.

    Raises:
        ValueError: naming the checkpoint tensor, before anything is copied.
    """
    dim = param.output_dim
    if dim is None:
        if param.dim() == loaded.dim() + 1:  # per-shard copy of a whole tensor (stacked on dim 0)
            dst = param.data[shard or 0]
        else:
            dst = param.data
    elif shard is None:
        dst = param.data
    else:
        lo, hi = param.shard_offsets[shard], param.shard_offsets[shard + 1]
        dst = param.data.narrow(dim, lo, hi - lo)
    checked_tensor(param, loaded, shard, dst.shape)
    if getattr(param, "scale_values", None):
        refuse_bad_scales(loaded, tensor_name(param, shard), param.scale_values == "positive")
    dst.copy_(loaded.to(dst.dtype))
    param.loaded_shards.add(shard)


# ---------------------------------------------------------------------------------------------
# int32 packing (little-endian within the word: element i sits in bits [i*b, (i+1)*b))
# ---------------------------------------------------------------------------------------------

#: AutoAWQ GEMM: nibble i of a packed int32 holds column ``AWQ_PACK_ORDER[i]`` of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Inverse: column j of the 8 sits in nibble ``AWQ_UNPACK_ORDER[j]``.
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_cols(packed: torch.Tensor, bits: int, awq_order: bool = False) -> torch.Tensor:
    """[R, C] int32 packed along columns -> [R, C * 32/bits] int32 in [0, 2**bits).

    Plain order: column ``c*pf + i`` is field i. ``awq_order``: AutoAWQ's interleave
    (column ``c*8 + AWQ_PACK_ORDER[i]`` is nibble i).
    """
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, pf]
    if awq_order:
        fields = fields[..., list(AWQ_UNPACK_ORDER)]
    return fields.reshape(packed.shape[0], packed.shape[1] * pf)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 packed along rows (GPTQ qweight) -> [R * 32/bits, C]; row ``r*pf + i`` is field i."""
    pf = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    fields = (packed.to(torch.int32).unsqueeze(1) >> shifts.view(1, pf, 1)) & ((1 << bits) - 1)  # [R, pf, C]
    return fields.reshape(packed.shape[0] * pf, packed.shape[1])


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_rows`: [R, C] ints in [0, 2**bits) -> [R * bits/32, C] int32."""
    pf = 32 // bits
    v = values.to(torch.int64).reshape(values.shape[0] // pf, pf, values.shape[1])
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64).view(1, pf, 1)
    word = (v << shifts).sum(1)  # disjoint bit fields: sum == bitwise or
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def float8_reasons() -> list[str]:
    """Why this torch cannot hold float8 E4M3 tensors (empty if it can)."""
    if not hasattr(torch, "float8_e4m3fn"):
        return [f"torch {torch.__version__} has no float8_e4m3fn dtype (FP8 needs torch >= 2.1)"]
    return []


def triton_backend_reasons(backend: str, device: torch.device) -> list[str]:
    """An explicit kernel backend (``triton``; ``torch``, whose activation quantization is a
    Triton kernel) off CUDA runs only under the Triton interpreter (empty if it can run)."""
    if backend not in ("auto", "reference") and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return [f"quantization.settings.backend {backend!r} needs a CUDA device, or TRITON_INTERPRET=1 to run "
                "the Triton interpreter on the CPU (slow: for tests); use backend 'auto' or 'reference' here"]
    return []


def cuda_capability_reasons(device: torch.device, need: tuple[int, int], what: str) -> list[str]:
    """Reasons a CUDA ``device`` is too old for ``what`` (empty off CUDA or when new enough)."""
    if device.type != "cuda":
        return []
    cap = torch.cuda.get_device_capability(device)
    if cap < need:
        return [f"{what} needs a GPU of compute capability >= {need[0]}.{need[1]}; "
                f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}"]
    return []


def use_kernels(x: torch.Tensor, backend: str) -> bool:
    """Run the kernels for ``x``? ``auto``: on CUDA only; ``reference``: never; an explicit
    kernel backend: always (off CUDA that means the Triton interpreter, for tests)."""
    if backend == "auto":
        return x.is_cuda
    return backend != "reference"
