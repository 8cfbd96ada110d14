"""W4A16 / W8A16 kernel checks: ``wna16_gemm`` against ``dequantize_wna16`` + an fp32 matmul.

Used by ``test_quant_kernels.py`` on CPU (Triton interpreter subprocess) and on CUDA. Each run
draws fresh random weights and activations: the seed is ``KVFORGE_TEST_SEED`` if set, else
random; it is reported with every result (``seed``) so a failure can be replayed. Every
float buffer the wrapper allocates with ``torch.empty`` (output, split-K workspace, the
prefill path's dequantized weight) is filled with NaN first: an element a kernel fails to
write shows up as NaN in the result. Random q, zero points and scales (uniform over their
range) make any permutation of packed fields change the result far beyond the bounds; the
``*_order_*`` checks show it by swapping two fields in the packed words.

Bounds (``rel = max|y - ref| / max|ref|``): fp32 activations 1e-5 (summation order only: the
kernels reproduce the reference's fp32 ``(q - z) * s`` exactly, or multiply exact integers and
scale after); fp16 2e-3 (weights or products rounded to fp16, 2^-11, and the fp16 output);
fp16 with ``reduce="atomic"`` 3e-3 (each split's partial sum is rounded to fp16).
"""
from __future__ import annotations

import contextlib
import os
import random
import zlib

import torch

SEED = int(os.environ.get("KVFORGE_TEST_SEED") or random.SystemRandom().randrange(2 ** 31))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@contextlib.contextmanager
def nan_poisoned_empty():
    """``torch.empty`` returns NaN-filled float tensors while active."""
    orig = torch.empty

    def empty(*args, **kwargs):
        t = orig(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = orig


def make_weight(k: int, n: int, bits: int, group: int, layout: str, gen: torch.Generator):
    """Random packed weight: layout "awq" (AutoAWQ nibble order), "nplain" (N-packed, plain
    order) or "gptq" (K-packed). Returns (qweight, scales fp16, zeros uint8, kwargs)."""
    from kvforge_plugins.quant.common import pack_rows
    q = torch.randint(0, 2 ** bits, (k, n), generator=gen, dtype=torch.int32)
    groups = -(-k // group)
    s = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).half()
    z = torch.randint(0, 2 ** bits, (groups, n), generator=gen).to(torch.uint8)
    if layout == "gptq":
        qw = pack_rows(q, bits)
    else:
        cols = torch.arange(n)
        if layout == "awq":  # nibble i of word c holds column 8c + (0, 2, 4, 6, 1, 3, 5, 7)[i]
            cols = cols.view(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(-1)
        qw = pack_rows(q[:, cols].t().contiguous(), bits).t().contiguous()
    kw = dict(bits=bits, group_size=group, pack_k=layout == "gptq", awq_order=layout == "awq")
    return qw, s, z, kw


def run_case(device, m, k, n, bits, group, layout, dtype, config, seed, swap_fields=None) -> float:
    """rel error of ``wna16_gemm`` (``config``) vs the fp32 reference. ``swap_fields=(i, j)``:
    exchange fields i and j of every packed word after computing the reference (the error
    then measures how well the check detects a field-order bug)."""
    from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16, wna16_gemm
    gen = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    qw, s, z, kw = make_weight(k, n, bits, group, layout, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = x.float() @ dequantize_wna16(qw, s, z, dtype=torch.float32, **kw)
    if swap_fields is not None:
        i, j = swap_fields
        fi, fj = (qw >> (i * bits)) & (2 ** bits - 1), (qw >> (j * bits)) & (2 ** bits - 1)
        keep = ~(((2 ** bits - 1) << (i * bits)) | ((2 ** bits - 1) << (j * bits)))
        qw = (qw & keep) | (fi << (j * bits)) | (fj << (i * bits))
    qw, s, z, x = (t.to(device) for t in (qw, s, z, x))
    with nan_poisoned_empty():
        y = wna16_gemm(x, qw, s, z, n=n, config=config, **kw)
    assert y.dtype == dtype and y.shape == (m, n), (y.dtype, y.shape)
    return _rel(y, ref)


def _seed(name: str) -> int:
    return (SEED + zlib.crc32(name.encode())) % 2 ** 31


F16, F32 = torch.float16, torch.float32
#: name -> (m, k, n, bits, group (-1: per channel), layout, dtype, config, bound). K and N are
#: not multiples of the tiles unless noted; config None = the M bucket's defaults.
CASES = {
    # bucket defaults: M = 1 (AWQ: per-field MMA; GPTQ: CUDA cores), 3 / 16 (per-field MMAs), 64 (joined MMA),
    # 65 / 130 (prefill)
    "awq4_m1_g128_f32": (1, 256, 200, 4, 128, "awq", F32, None, 1e-5),
    "awq4_m1_g32_f16_oddk": (1, 200, 200, 4, 32, "awq", F16, None, 2e-3),
    "gptq4_m1_perchannel_f32": (1, 200, 136, 4, -1, "gptq", F32, None, 1e-5),
    "gptq8_m1_g32_f16": (1, 256, 200, 8, 32, "gptq", F16, None, 2e-3),
    "nplain8_m1_g64_f32": (1, 192, 200, 8, 64, "nplain", F32, None, 1e-5),
    "awq4_m3_g128_f16": (3, 256, 200, 4, 128, "awq", F16, None, 2e-3),
    "awq4_m16_g32_f32": (16, 192, 200, 4, 32, "awq", F32, None, 1e-5),
    "gptq4_m16_g128_f32": (16, 256, 200, 4, 128, "gptq", F32, None, 1e-5),
    "gptq8_m16_perchannel_f16": (16, 200, 200, 8, -1, "gptq", F16, None, 2e-3),
    "nplain8_m16_g64_f16": (16, 192, 200, 8, 64, "nplain", F16, None, 2e-3),
    "awq4_m64_g128_f16": (64, 256, 200, 4, 128, "awq", F16, None, 2e-3),
    "gptq4_m64_g32_f32": (64, 192, 136, 4, 32, "gptq", F32, None, 1e-5),
    "awq4_m65_g128_f16": (65, 256, 200, 4, 128, "awq", F16, None, 2e-3),
    "gptq4_m130_g32_f32": (130, 192, 136, 4, 32, "gptq", F32, None, 1e-5),
    "gptq8_m65_perchannel_f16": (65, 200, 200, 8, -1, "gptq", F16, None, 2e-3),
    # explicit paths: per-element scales with groups that straddle tiles, swap / joined MMAs,
    # split-K reductions, CUDA-core corner cases, the dequantize kernel on its own
    "awq4_m5_dot_g24_f16": (5, 192, 200, 4, 24, "awq", F16,
                            dict(swap_ab=False, scale_after=False, BLOCK_N=128, BLOCK_K=64), 2e-3),
    "gptq4_m5_swap_g24_f32": (5, 192, 200, 4, 24, "gptq", F32, dict(swap_ab=True, BLOCK_N=64, BLOCK_K=128), 1e-5),
    "gptq8_m3_swap_unscaled_f16": (3, 256, 200, 8, 64, "gptq", F16,
                                   dict(swap_ab=True, scale_after=False, BLOCK_N=64, BLOCK_K=64), 2e-3),
    "awq4_m3_noswap_f32": (3, 256, 200, 4, 128, "awq", F32, dict(swap_ab=False, BLOCK_N=128, BLOCK_K=64), 1e-5),
    "gptq4_m3_joined_f16": (3, 256, 200, 4, 128, "gptq", F16, dict(joined=True, BLOCK_N=64, BLOCK_K=64), 2e-3),
    # joined MMAs with groups that straddle tiles (per-element scales)
    "awq4_m5_joined_g24_f32": (5, 192, 200, 4, 24, "awq", F32, dict(joined=True, BLOCK_N=64, BLOCK_K=64), 1e-5),
    "gptq4_m5_joined_g24_f32": (5, 192, 136, 4, 24, "gptq", F32, dict(joined=True, BLOCK_N=64, BLOCK_K=64), 1e-5),
    "awq4_m5_serial3_f32": (5, 384, 200, 4, 128, "awq", F32, dict(BLOCK_N=128, BLOCK_K=64, split_k=3), 1e-5),
    "gptq4_m5_atomic_f16": (5, 256, 200, 4, 64, "gptq", F16,
                            dict(BLOCK_N=64, BLOCK_K=128, split_k=2, reduce="atomic"), 3e-3),
    "awq4_m3_atomicf32_f16": (3, 256, 200, 4, 128, "awq", F16,
                              dict(joined=True, BLOCK_N=64, BLOCK_K=64, split_k=4, reduce="atomic_fp32"), 2e-3),
    "awq4_m2_cudacore_g40_f32_oddk": (2, 116, 200, 4, 40, "awq", F32,
                                      dict(dot=False, prefetch=False, num_warps=2, split_k=2), 1e-5),
    "awq4_m1_cudacore_g128_f32": (1, 256, 200, 4, 128, "awq", F32, dict(dot=False), 1e-5),
    "gptq8_m1_g4_f32": (1, 64, 40, 8, 4, "gptq", F32, dict(dot=False), 1e-5),
    "gptq4_m1_g4_fallback_f32": (1, 64, 40, 4, 4, "gptq", F32, dict(dot=False), 1e-5),
    "awq4_m3_dequant_g32_f16": (3, 192, 200, 4, 32, "awq", F16, dict(path="dequant", BLOCK_N=128, BLOCK_K=64), 2e-3),
    "gptq4_m3_dequant_g24_f32": (3, 192, 136, 4, 24, "gptq", F32, dict(path="dequant", BLOCK_N=64, BLOCK_K=64), 1e-5),
}

#: name -> (case name, fields swapped): the same check on weights with two fields exchanged
#: must fail by a wide margin (its "error" is bound / rel, required <= 0.02: rel >= 50x bound).
ORDER_CASES = {
    "awq4_order_m1": ("awq4_m1_g128_f32", (1, 2)),
    "awq4_order_m3": ("awq4_m3_g128_f16", (4, 5)),
    "gptq4_order_m1": ("gptq4_m1_perchannel_f32", (0, 7)),
    "gptq4_order_m16": ("gptq4_m16_g128_f32", (3, 6)),
}


def _check(name: str):
    m, k, n, bits, group, layout, dtype, config, bound = CASES[name]
    return (lambda d: run_case(d, m, k, n, bits, group, layout, dtype, config, _seed(name))), bound


def _order_check(name: str):
    case, swap = ORDER_CASES[name]
    m, k, n, bits, group, layout, dtype, config, bound = CASES[case]
    return (lambda d: bound / run_case(d, m, k, n, bits, group, layout, dtype, config, _seed(name), swap)), 0.02


def run_pairs_case(device, m, k, n, group, layout, dtype, config, seed, swap_fields=None) -> float:
    """rel error of ``pairs_gemm`` (``config``) on a checkpoint-packed weight repacked as the
    awq/gptq plugins do, vs the fp32 reference dequantized from the checkpoint packing (not
    from the pairs layout: a repacking bug shows). ``swap_fields``: exchange two nibble
    positions of every repacked word (the error then measures the check's power)."""
    from kvforge_plugins.quant.common import unpack_cols, unpack_rows
    from kvforge_plugins.quant.kernels.w4_pairs import pack_pairs, pairs_gemm, pairs_tile_k
    from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16
    gen = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    qw, s, z, kw = make_weight(k, n, 4, group, layout, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = x.float() @ dequantize_wna16(qw, s, z, dtype=torch.float32, **kw)
    q = unpack_cols(qw, 4, awq_order=True) if layout == "awq" else unpack_rows(qw, 4)
    tk = pairs_tile_k(k, group)
    words = pack_pairs(q, tk)
    if swap_fields is not None:
        i, j = swap_fields
        fi, fj = (words >> (4 * i)) & 15, (words >> (4 * j)) & 15
        words = (words & ~((15 << (4 * i)) | (15 << (4 * j)))) | (fi << (4 * j)) | (fj << (4 * i))
    words, s, z, x = (t.to(device) for t in (words, s, z, x))
    with nan_poisoned_empty():
        y = pairs_gemm(x, words, s, z, group_size=group, tile_k=tk, n=n, config=config)
    assert y.dtype == dtype and y.shape == (m, n), (y.dtype, y.shape)
    return _rel(y, ref)


#: name -> (m, k, n, group, layout, dtype, config, bound) for ``run_pairs_case`` (fp16 only on
#: the CPU: the interpreter's bf16 tl.dot is wrong; bf16 runs on the GPU). N is not a multiple
#: of the tiles unless noted.
PAIRS_CASES = {
    "awq_m1_g128": (1, 256, 200, 128, "awq", F16, None, 2e-3),
    "gptq_m16_g64": (16, 192, 136, 64, "gptq", F16, None, 2e-3),  # tile_k 64
    "gptq_m5_perchannel": (5, 256, 64, -1, "gptq", F16, None, 2e-3),
    "awq_m40_scale_a": (40, 256, 72, 128, "awq", F16, None, 2e-3),  # decode64 bucket: scale in the operand
    "awq_m40_tacc": (40, 256, 72, 128, "awq", F16, dict(scale_a=False, BLOCK_N=64), 2e-3),
    "gptq_m3_serial3": (3, 384, 200, 128, "gptq", F16, dict(split_k=3, BLOCK_N=64), 2e-3),
    "awq_m70_prefill": (70, 256, 200, 128, "awq", F16, None, 2e-3),  # dequantize + matmul
    # the unrolled kernel: 5 tiles in splits of 2 (the last split one tile: its second loads zeros)
    "gptq_m3_unroll2_partial": (3, 640, 72, 128, "gptq", F16, dict(unroll=2, BLOCK_N=64), 2e-3),
    "awq_m16_unroll3_scale_a": (16, 384, 136, 128, "awq", F16, dict(unroll=3, scale_a=True), 2e-3),
}
PAIRS_ORDER_CASES = {"pairs_order_h": ("awq_m1_g128", (0, 4)), "pairs_order_p": ("gptq_m16_g64", (1, 2))}


def _pairs_check(name: str):
    m, k, n, group, layout, dtype, config, bound = PAIRS_CASES[name]
    return (lambda d: run_pairs_case(d, m, k, n, group, layout, dtype, config, _seed(name))), bound


def _pairs_order_check(name: str):
    case, swap = PAIRS_ORDER_CASES[name]
    m, k, n, group, layout, dtype, config, bound = PAIRS_CASES[case]
    return (lambda d: bound / run_pairs_case(d, m, k, n, group, layout, dtype, config, _seed(name), swap)), 0.02


#: name -> (callable(device) -> error, bound), for test_quant_kernels.CPU_CHECKS
CPU_CHECKS = {f"wna16_{name}": _check(name) for name in CASES}
CPU_CHECKS.update({f"wna16_{name}": _order_check(name) for name in ORDER_CASES})
CPU_CHECKS.update({f"w4pairs_{name}": _pairs_check(name) for name in PAIRS_CASES})
CPU_CHECKS.update({f"w4{name}": _pairs_order_check(name) for name in PAIRS_ORDER_CASES})
