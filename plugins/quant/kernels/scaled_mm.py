"""W8A8 GEMMs (FP8 E4M3 and INT8) with scales, plus activation quantization.

``y[m, n] = (sum_k qa[m, k] * qw[n, k]) * a_scale[m] * w_scale[n] (+ bias[n])``

* ``qa`` [M, K] float8_e4m3fn or int8 (row-major), ``a_scale`` fp32 [M] (per token) or [1]
  (per tensor);
* ``qw`` [N, K] same dtype (row-major, i.e. K-major as cuBLAS / wgmma want B),
  ``w_scale`` fp32 [N] (per output channel) or [1];
* fp32 (FP8) or int32 (INT8) accumulation, result in the activation dtype.

Activation quantization (:func:`quantize_act`), symmetric, no zero point:
dynamic per token ``scale[m] = max(max_k |x[m, k]|, eps) / QMAX`` (QMAX 448 for E4M3,
127 for int8) or static ``scale`` from the checkpoint; ``q = x / scale`` clamped to
``[-QMAX, QMAX]``, rounded to nearest (int8: half away from zero; FP8: the hardware
cast, nearest-even). Same scheme as vLLM / compressed-tensors "dynamic token" scales.

Which GEMM runs on a CUDA shape (Triton vs ``torch._scaled_mm`` / ``torch._int_mm``) is
decided by :mod:`.choices`, filled by ``benchmarks/bench_quant.py`` on the GPU.
"""
import os

import torch

from . import lazy_jit

try:
    import triton.language as tl
except Exception:  # pragma: no cover - CPU-only installs never launch the kernels
    class tl:  # type: ignore[no-redef]
        constexpr = None

FP8_MAX = 448.0
INT8_MAX = 127.0
#: Smallest activation scale (an all-zero token would otherwise divide by zero).
EPS = 1e-10


def _scaled_mm_kernel(a_ptr, w_ptr, as_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_am, stride_wn, stride_om,
                      A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
                      IS_INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
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
    if IS_INT8:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IS_INT8:
            acc += tl.dot(a, w, out_dtype=tl.int32)
        else:
            acc += tl.dot(a, w, out_dtype=tl.float32)
    res = acc.to(tl.float32)
    if A_PER_TOKEN:
        res = res * tl.load(as_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    else:
        res = res * tl.load(as_ptr)
    if W_PER_CHANNEL:
        res = res * tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    else:
        res = res * tl.load(ws_ptr)
    if HAS_BIAS:
        res = res + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], res.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _quant_act_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, eps,
                      QMAX: tl.constexpr, IS_INT8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr,
                      ONE_PASS: tl.constexpr, HW_CAST: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    if ONE_PASS:  # K <= BLOCK: the row stays in registers, read once
        offs0 = tl.arange(0, BLOCK)
        x0 = tl.load(x_row + offs0, mask=offs0 < K, other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(s_ptr)
    else:
        if ONE_PASS:
            amax_all = tl.max(tl.abs(x0), axis=0)
        else:
            amax = tl.zeros((BLOCK,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK):
                offs = k0 + tl.arange(0, BLOCK)
                x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            amax_all = tl.max(amax, axis=0)
        # div_rn: IEEE division (Triton's "/" may use the approximate one), so the scales and
        # the quantized values equal the torch reference's bit for bit.
        scale = tl.div_rn(tl.maximum(amax_all, eps), QMAX)
        tl.store(s_ptr + row, scale)
    inv = tl.div_rn(1.0, scale)  # one division per row; elements are multiplied
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        if ONE_PASS:
            x = x0
        else:
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)
        if IS_INT8:  # half away from zero
            y = tl.where(y >= 0, tl.floor(y + 0.5), -tl.floor(0.5 - y))
            q = y.to(q_ptr.dtype.element_ty)
        elif HW_CAST:  # the GPU's cvt.rn (nearest-even) to E4M3: one instruction per two values
            q = y.to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        else:
            # Interpreter: round to the E4M3 grid in fp32 first, so the result does not depend
            # on how the interpreter casts. The spacing below |y| is 2^(e-3) for exponent e >= -6 (2^-9 for
            # subnormals); scaling by its exact power-of-two inverse and adding 1.5 * 2^23
            # rounds y / spacing (< 16) to an integer.
            e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
            step = ((e + 124) << 23).to(tl.float32, bitcast=True)      # 2^(e-3)
            inv_step = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3-e)
            r = ((y * inv_step + 12582912.0) - 12582912.0) * step
            # keep y's sign bit (-0.0, and negatives rounding to 0, stay E4M3 0x80 as in torch)
            y = (r.to(tl.int32, bitcast=True) | (y.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32,
                                                                                                bitcast=True)
            q = y.to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * stride_qm + offs, q, mask=offs < K)


_scaled_mm = lazy_jit(_scaled_mm_kernel)
_quant_act = lazy_jit(_quant_act_kernel)

#: Triton launch configs by M bucket (decode: few rows, bandwidth bound).
CONFIGS = {
    "small": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    "medium": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    "large": dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
}


def _bucket(m: int) -> str:
    return "small" if m <= 16 else "medium" if m <= 128 else "large"


def qmax_of(dtype: torch.dtype) -> float:
    return INT8_MAX if dtype == torch.int8 else FP8_MAX


def quantize_act_ref(x: torch.Tensor, qdtype: torch.dtype, scale: "torch.Tensor | None" = None):
    """Reference activation quantization. ``x`` [M, K] -> (q [M, K] ``qdtype``, scale fp32 [M] or [1]).

    ``q = round(clamp(x * (1 / scale), -QMAX, QMAX))`` (the reciprocal IEEE-rounded once per row).

    ``scale`` None: dynamic per-token; else the static per-tensor scale (numel 1).
    """
    qmax = qmax_of(qdtype)
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=1).clamp_min(EPS)
        # a tensor divisor: torch divides by a Python scalar as a multiply by its reciprocal
        # on CUDA (1 ulp off IEEE division, which the Triton kernel does)
        scale = amax / torch.full_like(amax, qmax)
    else:
        scale = scale.float().reshape(1)
    # x times the IEEE reciprocal of the scale (one division per row, not per element: the
    # kernel's arithmetic, bit for bit)
    y = xf * (torch.ones_like(scale) / scale).reshape(-1, 1)
    y = y.clamp(-qmax, qmax)
    if qdtype == torch.int8:
        y = torch.where(y >= 0, torch.floor(y + 0.5), -torch.floor(0.5 - y))
    return y.to(qdtype), scale


def quantize_act(x: torch.Tensor, qdtype: torch.dtype, scale: "torch.Tensor | None" = None,
                 max_block: int = 16384, num_warps: int = 0):
    """Triton activation quantization, one program per token; same contract as :func:`quantize_act_ref`.

    A row of up to ``max_block`` (power of two) elements is read once and kept in registers;
    longer rows are read twice (amax, then quantize) in ``max_block`` chunks. ``num_warps``
    0 = by block size. (Both are launch knobs for ``benchmarks/probe_fp8.py --quant-sweep``.)
    """
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=qdtype, device=x.device)
    static = scale is not None
    s = scale.float().reshape(1).contiguous() if static else torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    pow2 = max(16, 1 << (k - 1).bit_length())
    block = min(max_block, pow2)  # by default Llama-3-8B's widths (4096, 14336) take one pass
    _quant_act[(m,)](x, q, s, k, x.stride(0), q.stride(0), EPS, QMAX=qmax_of(qdtype),
                     IS_INT8=qdtype == torch.int8, STATIC=static, BLOCK=block, ONE_PASS=pow2 <= block,
                     # the interpreter's rtne cast to E4M3 rounds some ties wrongly: grid rounding there
                     HW_CAST=x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1",
                     # swept on the H200 (probe_fp8.py --quant-sweep): 4 warps up to 4096, then 8
                     num_warps=num_warps or (4 if block <= 4096 else 8))
    return q, s


def scaled_mm_triton(qa: torch.Tensor, a_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype, bias: "torch.Tensor | None" = None,
                     config: "dict | None" = None) -> torch.Tensor:
    """Triton W8A8 GEMM; shapes in the module docstring. -> [M, N] ``out_dtype``."""
    m, k = qa.shape
    n = qw.shape[0]
    cfg = dict(config or CONFIGS[_bucket(m)])
    out = torch.empty((m, n), dtype=out_dtype, device=qa.device)
    if m == 0:
        return out
    grid = (-(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"]),)
    _scaled_mm[grid](qa, qw, a_scale, w_scale, bias if bias is not None else w_scale, out, m, n, k,
                     qa.stride(0), qw.stride(0), out.stride(0), A_PER_TOKEN=a_scale.numel() > 1,
                     W_PER_CHANNEL=w_scale.numel() > 1, HAS_BIAS=bias is not None,
                     IS_INT8=qa.dtype == torch.int8, **cfg)
    return out


def scaled_mm_ref(qa: torch.Tensor, a_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype, bias: "torch.Tensor | None" = None) -> torch.Tensor:
    """Reference: dequantize both operands to fp32, matmul, cast. -> [M, N] ``out_dtype``."""
    a = qa.float() * (a_scale.float().view(-1, 1) if a_scale.numel() > 1 else a_scale.float().reshape(()))
    w = qw.float() * (w_scale.float().view(-1, 1) if w_scale.numel() > 1 else w_scale.float().reshape(()))
    y = a @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def scaled_mm_torch(qa: torch.Tensor, a_scale: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype, bias: "torch.Tensor | None" = None,
                    use_fast_accum: bool = False) -> torch.Tensor:
    """cuBLAS: ``torch._scaled_mm`` (FP8; per-tensor scales or row-wise [M,1] x [1,N]) or
    ``torch._int_mm`` (INT8) with the scales applied after. Raises RuntimeError where torch
    does not support the combination (the caller falls back to Triton)."""
    m, n = qa.shape[0], qw.shape[0]
    if qa.dtype == torch.int8:
        acc = torch._int_mm(qa, qw.t())
        y = acc.float() * a_scale.float().view(-1, 1) * w_scale.float().view(1, -1)
        if bias is not None:
            y = y + bias.float()
        return y.to(out_dtype)
    if a_scale.numel() == 1 and w_scale.numel() == 1:
        sa, sb = a_scale.float().reshape(()), w_scale.float().reshape(())
    else:  # row-wise scaling wants both operands' scales as vectors
        sa = a_scale.float().reshape(-1, 1).expand(m, 1).contiguous()
        sb = w_scale.float().reshape(1, -1).expand(1, n).contiguous()
    return torch._scaled_mm(qa, qw.t(), scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)
