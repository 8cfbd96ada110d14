"""Weight-only int4/int8 GEMM (W4A16 / W8A16): ``y = x @ dequant(W)`` with the weight
dequantized in registers, for the AutoAWQ and GPTQ packed layouts.

Layouts (K = in features, N = out features, pf = 32 // bits values per int32, value i of a
word in bits [i*bits, (i+1)*bits)):

* ``pack_k=False`` (AutoAWQ GEMM): ``qweight`` int32 [K, N/pf]; with ``awq_order`` nibble
  i of word c holds column ``8c + (0,2,4,6,1,3,5,7)[i]`` (AutoAWQ's order), else ``pf*c + i``.
* ``pack_k=True`` (GPTQ): ``qweight`` int32 [K/pf, N]; field i of word r is row ``pf*r + i``.

Both take ``scales`` [G, N] (fp16/bf16/fp32) and ``zeros`` [G, N] uint8 already unpacked
(true zero points, any GPTQ v1 ``-1`` offset removed by the caller); G = ceil(K / group)
and row k uses group ``k // group_size``. ``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]``.
Act-order (GPTQ ``desc_act``) checkpoints are handled by the caller: rows are permuted at
load time so groups are contiguous, and ``x`` is gathered with the same permutation.

Kernel: one program per (BLOCK_M x BLOCK_N) output tile and K split; packed words are
loaded once per tile and broadcast to the fields they hold; fp32 accumulation. Decode
shapes (M <= 64) use small M tiles and split-K (fp32 atomics) to fill the GPU;
prefill uses large tiles with grouped tile order for L2 reuse. Configs: ``CONFIGS``.
"""
import functools

import torch

from . import lazy_jit
from .choices import lookup

try:
    import triton.language as tl
except Exception:  # pragma: no cover - CPU-only installs never launch the kernel
    class tl:  # type: ignore[no-redef]
        constexpr = None


def _wna16_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, M, N, K, stride_xm, stride_om, k_per_split,
                  BITS: tl.constexpr, PACK_K: tl.constexpr, AWQ_ORDER: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, FP32_DOT: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    QMASK: tl.constexpr = (1 << BITS) - 1
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_here
    pid_n = (pid % per_group) // rows_here

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if PACK_K:
            offs_kw = k0 // PF + tl.arange(0, BLOCK_K // PF)
            words = tl.load(qw_ptr + offs_kw[:, None] * N + offs_n[None, :],
                            mask=(offs_kw[:, None] < K // PF) & mask_n[None, :], other=0)
            words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // PF, PF, BLOCK_N)), (BLOCK_K, BLOCK_N))
            q = (words >> ((offs_k % PF) * BITS)[:, None]) & QMASK
        else:
            offs_nw = pid_n * (BLOCK_N // PF) + tl.arange(0, BLOCK_N // PF)
            words = tl.load(qw_ptr + offs_k[:, None] * (N // PF) + offs_nw[None, :],
                            mask=mask_k[:, None] & (offs_nw[None, :] < N // PF), other=0)
            words = tl.reshape(tl.broadcast_to(words[:, :, None], (BLOCK_K, BLOCK_N // PF, PF)), (BLOCK_K, BLOCK_N))
            field = offs_n % PF
            if AWQ_ORDER:
                field = (field % 2) * 4 + field // 2
            q = (words >> (field * BITS)[None, :]) & QMASK
        if GROUP % BLOCK_K == 0:  # one group per K tile: a row of scales / zeros
            g = k0 // GROUP
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)[None, :]
        else:
            g = offs_k // GROUP
            gmask = mask_k[:, None] & mask_n[None, :]
            s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=gmask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g[:, None] * N + offs_n[None, :], mask=gmask, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s
        if FP32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    omask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tl.atomic_add(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


_wna16 = lazy_jit(_wna16_kernel)

#: Launch configs by M bucket. Decode (M <= 64) is weight-bandwidth bound: small M tiles,
#: split-K to fill every SM. Prefill is compute bound: large tiles, grouped order.
#: ``fp32_splitk``: split-K partial sums are added (atomically) into an fp32 buffer, then cast
#: (3 launches); False: straight into the fp16/bf16 output (2 launches, as in the PyTorch
#: "SplitK" W4A16 kernels; each partial sum is rounded once to the output dtype); None:
#: False for fp16, True for bf16 (bf16 atomics need sm90) -- the tuner may set it.
#: Per-shape overrides come from the tuned table (``choices.py``, kind "wna16"), written by
#: ``benchmarks/bench_quant.py --tune`` on a GPU.
CONFIGS: dict[str, dict] = {
    "decode16": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, max_split=16,
                     fp32_splitk=None),
    "decode64": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4, max_split=8,
                     fp32_splitk=None),
    "prefill": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, max_split=1,
                    fp32_splitk=None),
}


def bucket(m: int) -> str:
    return "decode16" if m <= 16 else "decode64" if m <= 64 else "prefill"


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_k(cfg: dict, m: int, n: int, k: int, device: torch.device) -> int:
    """K splits so that decode launches ~2 programs per SM (1 on CPU / prefill)."""
    if cfg["max_split"] <= 1:
        return 1
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    k_tiles = -(-k // cfg["BLOCK_K"])
    return max(1, min(cfg["max_split"], (2 * sms) // max(tiles, 1), k_tiles))


def wna16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
               bits: int, group_size: int, pack_k: bool, awq_order: bool, n: int,
               config: "dict | None" = None) -> torch.Tensor:
    """Triton weight-only GEMM. ``x`` [M, K] fp16/bf16/fp32 -> [M, N] in ``x.dtype``.

    ``qweight``/``scales``/``zeros`` as in the module docstring; ``group_size`` = K for
    per-channel. ``config`` overrides the bucket's launch config (tuning).
    """
    assert bits in (4, 8) and (not awq_order or bits == 4)
    x = x.contiguous()
    m, k = x.shape
    if m == 0:
        return x.new_empty((0, n))
    pf = 32 // bits
    if config is None and x.is_cuda:
        config = lookup("wna16", m, n, k, x.device)
    cfg = {**CONFIGS[bucket(m)], **(config or {})}
    assert cfg["BLOCK_K"] % pf == 0 and cfg["BLOCK_N"] % pf == 0
    split = cfg.pop("split_k", None) or _split_k(cfg, m, n, k, x.device)
    cfg.pop("max_split", None)
    fp32_splitk = cfg.pop("fp32_splitk", None)
    if fp32_splitk is None:  # fp16 atomics are native everywhere; bf16 ones only on recent GPUs
        fp32_splitk = x.dtype != torch.float16
    fp32_splitk = fp32_splitk or x.dtype == torch.float32
    k_per_split = -(-(-(-k // split)) // cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = -(-k // k_per_split)
    if split == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.zeros((m, n), dtype=torch.float32 if fp32_splitk else x.dtype, device=x.device)
    grid = (-(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]), split)
    _wna16[grid](x, qweight, scales, zeros, out, m, n, k, x.stride(0), out.stride(0), k_per_split,
                 BITS=bits, PACK_K=pack_k, AWQ_ORDER=awq_order, GROUP=group_size, SPLIT_K=split,
                 FP32_DOT=x.dtype == torch.float32, **cfg)
    return out if split == 1 else out.to(x.dtype)


def dequantize_wna16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, bits: int,
                     group_size: int, pack_k: bool, awq_order: bool, dtype: torch.dtype,
                     g_idx: "torch.Tensor | None" = None) -> torch.Tensor:
    """Reference dequantization -> W^T [K, N] in ``dtype`` (computed in fp32).

    ``g_idx`` [K] (GPTQ act-order): row k uses group ``g_idx[k]`` instead of ``k // group_size``.
    """
    from ..common import unpack_cols, unpack_rows
    q = unpack_rows(qweight, bits) if pack_k else unpack_cols(qweight, bits, awq_order)
    k = q.shape[0]
    g = g_idx.long() if g_idx is not None else torch.arange(k, device=q.device) // group_size
    w = (q.float() - zeros.float()[g]) * scales.float()[g]
    return w.to(dtype)
