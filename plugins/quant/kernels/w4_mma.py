"""Int4 weight-only GEMM on the "mma" layout: ``y = x @ dequant(W)`` by a CUDA C++ kernel
(``w4_mma.cu``, compiled at run time by NVRTC through CuPy) on ``mma.sync`` tensor-core
instructions, with the weight repacked once at load time into per-thread MMA fragments.

Why a CUDA kernel beside the Triton ones. On Hopper, Triton lowers the decode GEMM to wgmma,
whose activation operand must sit in shared memory: each K step stores it, fences, syncs the
CTA and waits for the MMA, and that chain held the Triton "pairs" kernel at ~1.75 TB/s of
packed weight (BENCHMARKS.md). ``mma.sync`` takes both operands from registers, so a warp
streams its weights and activations with 16-byte loads and never waits for another warp. The
per-thread weight layout dequantized by LOP3 is Marlin's idea (Frantar et al., 2024,
"MARLIN: Mixed-Precision Auto-Regressive Parallel Inference on Large Language Models"); the
layout and kernel here are derived from the PTX ISA's m16n8k16 fragment layouts.

Layout (``pack_mma``): ``words`` int32 [N/64, K*8]. Row ``nb`` holds the 64-row block ``nb``
of W^T (rows n of the output), as K/64 chunks of 512 words ordered [tile T (16 rows)][lane
(32)][MMA i (4)]. With lane = 4g + t, rows n0 = 64nb + 16T + g, n1 = n0 + 8 and
p = 64c + 16t + 4i, the word's nibbles are (bit: value) 0: q[p, n0], 16: q[p+1, n0],
4: q[p, n1], 20: q[p+1, n1], 8: q[p+2, n0], 24: q[p+3, n0], 12: q[p+2, n1], 28: q[p+3, n1], so
``(w >> 4j) & 0x000f000f | BIAS`` is register j of the MMA's A fragment as two 16-bit floats
``BIAS + q`` (bf16 128 / fp16 1024, exact). The kernel applies the same K permutation to x.
``scales`` fp16 [G, N/64, 8, 8]: entry [grp, nb, g, 2T + r] is row 64nb + 16T + 8r + g;
``zeros`` int32 [G, N/64, 8, 2]: word [grp, nb, g, T >> 1] holds that row's zero point at bits
8 (T & 1) + 4r of both 16-bit halves (``pack_mma_groups``), so one LOP3 makes the pair
``-(BIAS + z)`` the dequantization adds; the layout serves fp16 and bf16 activations alike.
Stored so, a scale group costs 3 bytes per column for its scale and zero point instead of 6
(fp32 + 16-bit): at group 128 the weight's bytes are 4% fewer.

Shapes: x [M, K] fp16/bf16 -> [M, N] in x.dtype (fp32 accumulation); K, N multiples of 64,
group_size a multiple of 64 dividing K. M <= 64: the fused kernel (split K, deterministic
serial reduction, through global memory or, with config CLU, inside a thread block cluster); larger M: a dequantize kernel writes W^T, cuBLAS multiplies.
"""
from __future__ import annotations

import functools

import torch

from kvforge.layers.arrival_counters import arrival_counters
from kvforge.layers.cupy_launch import nvrtc_reasons

from .choices import lookup, nearest, shape_distance
from .w4_mma_config import (CONFIG_KEYS, MAX_CLUSTER, MAX_FUSED_M, XR_PITCH, check_config,  # noqa: F401
                            check_config_keys, cluster_bytes, cluster_splits, reduce_bytes, stage_bytes,
                            ws_stage_bytes, x_bytes, xr_bytes)
from .w4_mma_orders import (chunk_k_order, deinterleave_gate_up, deinterleave_heads, interleave_gate_up,  # noqa: F401
                            interleave_heads, silu_and_mul_interleaved, wg_x_tiles)
from .wna16 import _num_sms, dequantize_groups

DTYPES = (torch.float16, torch.bfloat16)
#: Launch config per M bucket (the compile-time constants of ``w4_mma.cu``): NB token blocks of
#: 8, TW 16-row tiles per warp, WARPS per CTA, S register stages, XS (x slice in shared memory;
#: dropped where it does not fit), SCALE_A (group scale in the operand instead of a second
#: accumulator), MINB, LDW (weight loads bypass L1), CPA (0, or cp.async stages in shared
#: memory: the weights and x of CPA - 1 chunks in flight per thread), KW (warps of a CTA that
#: split its K range, summed in shared memory; WARPS / KW columns of warps along N), XR (with
#: CPA: x through a CTA-wide ring of CPA chunk slots in shared memory, read half a chunk at a time),
#: WG (with XR, TW 1, KW 1, WARPS a multiple of 4: Hopper warpgroup MMAs reading x from the ring;
#: on another GPU the same tiles run on mma.sync); CUR (with CPA 0: chunk addresses from per-warp
#: bases, no per-chunk bounds test where S divides a group's chunks); WST (with WG 2, an even
#: CPA: the consumers in trips of CPA chunks, their stage and barrier arithmetic compile-time,
#: where a call's group chunks divide CPA; else the usual loop);
#: ``waves``: split K until about waves x SMs CTAs; GCC (chunks per group) is set per call.
#: Tuned entries (choices table kind "w4_mma", timed cold by ``benchmarks/w4_cold_tune.py``;
#: ``bench_quant.py --tune-mma`` times warm) override these; an M = 1 entry also serves M = 2..8 (the
#: same one-token-block kernel), which the table's power-of-two M keys would otherwise miss.
CONFIGS = {  # M <= 16: the winners at 14336 x 14336 on the H200 (BENCHMARKS.md, eighth session)
    8: dict(NB=1, TW=4, WARPS=4, S=1, XS=0, SCALE_A=False, MINB=1, LDW=1, waves=4),
    16: dict(NB=2, TW=4, WARPS=4, S=1, XS=0, SCALE_A=False, MINB=1, LDW=1, waves=4),
    32: dict(NB=4, TW=1, WARPS=8, S=1, XS=0, SCALE_A=True, MINB=1, waves=2),
    64: dict(NB=8, TW=1, WARPS=4, S=1, XS=0, SCALE_A=True, MINB=1, waves=2),
}
TABLE_SCHEMA = 1
#: Choices-table kind of the rows tuned on :func:`mma_gemm_rmsnorm`'s kernel (the RMSNorm prologue,
#: with the model's RoPE or SwiGLU epilogue; an "M|N|K" row serves its M bucket (2, 4, 8) and the
#: "1|N|K" row the M = 1..8 that have none), which a model runs for q|k|v and gate|up at batch <=
#: ``fuse_norm_max_tokens``: the plain GEMM's best config there measured 5% slower end to end
#: (BENCHMARKS.md, session 28). A shape without such a row takes the "w4_mma" rows.
PRENORM_KIND = "w4_mma_prenorm"
# nibble shift of K offset e (0..3) inside a word for row half r (0: n0, 1: n1)
_SHIFTS = torch.tensor([[4 * (2 * (e >> 1) + r) + 16 * (e & 1) for r in range(2)] for e in range(4)])


def mma_blocker(k: int, n: int, group_size: int, dtype: torch.dtype) -> "str | None":
    """Why the layout cannot hold a [K, N] weight (None if it can)."""
    if dtype not in DTYPES:
        return f"the model dtype {dtype} is not float16/bfloat16 (model.dtype / --dtype)"
    if k % 64 or n % 64:
        bad = [f"{what} {v}" for what, v in (("in features", k), ("out features", n)) if v % 64]
        return f"{' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of 64"
    if group_size % 64 or k % group_size:
        return f"group_size {group_size} is not a multiple of 64 dividing in features {k}"
    return None


def runtime_blocker(device: torch.device) -> "str | None":
    """Why the kernel cannot run on ``device`` (None if it can)."""
    reasons = nvrtc_reasons(device, "the kernel is")
    if reasons:
        return reasons[0]
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "needs compute capability 8.0 or newer (bf16 mma.sync)"
    return None


def pack_mma(q: torch.Tensor) -> torch.Tensor:
    """Int4 values [K, N] (ints in [0, 16)) -> words int32 [N/64, K*8] (module docstring)."""
    k, n = q.shape
    assert k % 64 == 0 and n % 64 == 0, (k, n)
    # k = 64c + 16t + 4i + e, n = 64nb + 16T + 8r + g -> [nb, c, T, g, t, i, e, r]
    v = q.to(torch.int64).reshape(k // 64, 4, 4, 4, n // 64, 4, 2, 8).permute(4, 0, 5, 7, 1, 2, 3, 6)
    words = (v << _SHIFTS.to(q.device)).sum(dim=(-2, -1))  # disjoint bit fields: the sum is an OR
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32).reshape(n // 64, k * 8)


def unpack_mma(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_mma`: [N/64, K*8] int32 -> [K, N] int32 in [0, 16)."""
    nblk, k8 = words.shape
    k = k8 // 8
    w = words.to(torch.int64).reshape(nblk, k // 64, 4, 8, 4, 4, 1, 1)  # [nb, c, T, g, t, i, 1, 1]
    v = (w >> _SHIFTS.to(words.device)) & 15                              # [nb, c, T, g, t, i, e, r]
    return v.permute(1, 4, 5, 6, 0, 2, 7, 3).reshape(k, nblk * 64).to(torch.int32)


def groups_blocker(scales: torch.Tensor, zeros: torch.Tensor) -> "str | None":
    """Why the layout's group records cannot hold ``scales`` / ``zeros`` [G, N] exactly (None
    if they can): scales are stored as fp16 (AWQ and GPTQ checkpoints store fp16, so theirs
    always fit), zero points in 4 bits (a GPTQ v1 zero of 16, a stored 15 plus 1, does not)."""
    if scales.dtype != torch.float16 and not torch.equal(scales.to(torch.float16).to(scales.dtype), scales):
        return f"its {scales.dtype} scales are not all exact in float16 (the layout stores float16 scales)"
    if zeros.numel() and not (0 <= int(zeros.min()) and int(zeros.max()) < 16):
        return "its zero points are not all 4-bit, in [0, 16) (a GPTQ v1 zero of 16 does not fit)"
    return None


def pack_mma_groups(scales: torch.Tensor, zeros: torch.Tensor):
    """scales [G, N] float, zero points [G, N] ints in [0, 16) -> (scales fp16 [G, N/64, 8, 8],
    entry [grp, nb, g, 2T + r] for row 64nb + 16T + 8r + g; zeros int32 [G, N/64, 8, 2], that
    row's zero point at bits 8 (T & 1) + 4r and 16 + 8 (T & 1) + 4r of word [grp, nb, g, T >> 1]).
    Raises ValueError for values the records cannot hold exactly (:func:`groups_blocker`)."""
    g_, n = scales.shape
    why = groups_blocker(scales, zeros)
    if why:
        raise ValueError(f"w4 mma layout: {why}")

    def order(t):  # [G, nb, T, r, g] -> [G, nb, g, T, r]
        return t.reshape(g_, n // 64, 4, 2, 8).permute(0, 1, 4, 2, 3).reshape(g_, n // 64, 8, 8)
    z = order(zeros.to(torch.int64)).reshape(g_, n // 64, 8, 2, 4)  # [..., word, entry in it]
    half = (z << (4 * torch.arange(4, device=zeros.device))).sum(dim=-1)  # disjoint fields: the sum is an OR
    words = half | (half << 16)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return order(scales.to(torch.float16)).contiguous(), words.to(torch.int32).contiguous()


def unpack_mma_groups(scales: torch.Tensor, zeros: torch.Tensor):
    """Inverse of :func:`pack_mma_groups`: (scales fp32 [G, N], true zero points int32 [G, N])."""
    g_, nblk = scales.shape[:2]

    def order(t):
        return t.reshape(g_, nblk, 8, 4, 2).permute(0, 1, 3, 4, 2).reshape(g_, nblk * 64)
    z = (zeros.to(torch.int64)[..., None] >> (4 * torch.arange(4, device=zeros.device))) & 15  # low halves
    return order(scales.float()), order(z.reshape(g_, nblk, 8, 8)).to(torch.int32)


def dequantize_mma(words, scales, zeros, *, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Reference: W^T [K, N] = (q - z) * s in ``dtype`` (computed in fp32)."""
    s, z = unpack_mma_groups(scales, zeros)
    return dequantize_groups(unpack_mma(words), s, z, group_size, dtype)


def bucket(m: int) -> int:
    return next(b for b in sorted(CONFIGS) if m <= b)


def fit_kw(cfg: dict, k: int, group_size: int) -> dict:
    """``cfg`` with KW cut to the largest divisor of WARPS that is at most the scale groups
    of K: KW warps split K by whole groups, so with fewer groups (large groups, per-channel
    scales; the tuned table is keyed by shape, not group size) the extra warps would idle."""
    groups = k // group_size
    if cfg.get("KW", 1) <= groups:
        return cfg
    return {**cfg, "KW": max(d for d in range(1, groups + 1) if cfg["WARPS"] % d == 0)}


def plan(m: int, n: int, k: int, group_size: int, cfg: dict, num_sms: int) -> tuple[int, int, int]:
    """(CTAs along N, chunks per split, splits): splits fill about ``waves`` x SMs CTAs; a
    split holds whole groups."""
    ctas_n = -(-(n // 16 // cfg["TW"]) // (cfg["WARPS"] // cfg.get("KW", 1)))
    groups = k // group_size
    want = cfg.get("split_k") or max(1, round(cfg["waves"] * num_sms / ctas_n))
    per = -(-groups // min(groups, want))
    return ctas_n, per * (group_size // 64), -(-groups // per)


def mma_gemm(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *,
             group_size: int, n: int, config: "dict | None" = None, silu_and_mul: bool = False,
             rope_layout: "tuple[int, int] | None" = None) -> torch.Tensor:
    """``x`` [M, K] fp16/bf16 on CUDA -> [M, N] in ``x.dtype``; operands as in the module
    docstring. With ``silu_and_mul`` the weight is a gate|up pair packed interleaved
    (:func:`interleave_gate_up`) and the result is silu(gate) * up, [M, N / 2]. Raises
    ValueError for another dtype, a shape the layout does not hold, scales / zeros not in the
    layout's dtypes and shapes, or a ``config`` that is not a launchable one covering M (:func:`check_config`).
    ``rope_layout`` (heads, head_dim): the weight's first heads * head_dim rows are in the
    rotary layout (:func:`interleave_heads`); the result comes back in head order."""
    rope = (*rope_layout, None, None, None) if rope_layout else None
    return _gemm(x, words, scales, zeros, group_size, n, config, silu_and_mul, None, rope)[0]


#: Most tokens the RMSNorm prologue (``NORM``) takes: one token block, whole rows in shared memory.
MAX_NORM_M = 8


def mma_gemm_rmsnorm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, *, group_size: int, n: int,
                     config: "dict | None" = None, silu_and_mul: bool = False,
                     rope: "tuple | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm of a transformer block folded into the GEMM's prologue: with r = x +
    residual (rounded to x's dtype), returns (``mma_gemm(RMSNorm(r) * norm_weight)``, r), the
    same numbers as ``kvforge.layers.triton_ops.rmsnorm`` then :func:`mma_gemm` up to the
    fp32 sum order of the norm. x, residual [M, K] and norm_weight [K] in one dtype, M <=
    ``MAX_NORM_M``; eps > 0. Every CTA computes the rows' norms itself (M x K reads from L2),
    so a batch-1 decode layer launches one kernel where it launched two. Raises ValueError as
    :func:`mma_gemm` does, and for M > ``MAX_NORM_M`` or operands of another shape / dtype.
    ``rope`` (heads, head_dim, positions int64 [M] each < max_pos, cos, sin fp32 [max_pos,
    head_dim / 2]): a q|k|v weight in the rotary layout (:func:`interleave_heads`) whose q and
    k heads come back rotated (rotate-half RoPE at each token's position, as
    ``kvforge.layers.rotary``, but applied to the fp32 sums before their one rounding; with
    positions None, head order only)."""
    m, k = x.shape
    if not 1 <= m <= MAX_NORM_M:
        raise ValueError(f"w4 mma GEMM + RMSNorm: M {m} must be 1..{MAX_NORM_M} (one token block)")
    if residual.shape != x.shape or norm_weight.shape != (k,) or residual.dtype != x.dtype \
            or norm_weight.dtype != x.dtype:
        raise ValueError(f"w4 mma GEMM + RMSNorm: residual {tuple(residual.shape)} {residual.dtype} and norm weight "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype} must be x's shape [{m}, {k}] / [{k}] "
                         f"and dtype {x.dtype}")
    if not eps > 0:
        raise ValueError(f"w4 mma GEMM + RMSNorm: eps must be > 0, got {eps}")
    if rope is not None and rope[2] is not None:
        heads, hd, pos, cos, sin = rope
        half = (cos.shape[1] if cos.dim() == 2 else -1)
        if pos.shape != (m,) or pos.dtype != torch.int64 or half != hd // 2 or sin.shape != cos.shape \
                or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError(f"w4 mma GEMM + RoPE: positions {tuple(pos.shape)} {pos.dtype} must be int64 [{m}] and "
                             f"cos / sin {tuple(cos.shape)} / {tuple(sin.shape)} float32 [max_pos, {hd // 2}]")
        if pos.device != x.device or cos.device != x.device or sin.device != x.device:
            raise ValueError(f"w4 mma GEMM + RoPE: positions / cos / sin must be on x's device {x.device}")
        rope = (heads, hd, pos.contiguous(), cos.contiguous(), sin.contiguous())
    return _gemm(x, words, scales, zeros, group_size, n, config, silu_and_mul,
                 (_aligned(residual), _aligned(norm_weight), float(eps)), rope)


def norm_fits(m: int, k: int, esize: int, device: torch.device) -> bool:
    """Whether the NORM prologue's whole rows (M x (K + 8) elements) fit in a CTA's shared
    memory (e.g. not K = 16384 at M = 8 on an H200, nor K = 8192 at M = 8 on a 99 KB GPU)."""
    return m * (k + 8) * esize <= _smem_limit(device)


def check_rope(rope, n: int, silu_and_mul: bool) -> None:
    """Raise ValueError unless ``rope`` (heads, head_dim, ...) describes a rotary layout the
    kernel can store: head_dim a positive multiple of 16, 0 < heads * head_dim <= N, and no
    SwiGLU epilogue with it (a q|k|v weight is not a gate|up pair)."""
    heads, hd = rope[0], rope[1]
    if not (isinstance(heads, int) and isinstance(hd, int) and hd > 0 and hd % 16 == 0 and 0 < heads * hd <= n):
        raise ValueError(f"w4 mma GEMM: rope layout (heads {heads}, head_dim {hd}) must have head_dim a positive "
                         f"multiple of 16 and 0 < heads * head_dim <= out features {n}")
    if silu_and_mul:
        raise ValueError("w4 mma GEMM: rope layout and silu_and_mul exclude each other (q|k|v vs gate|up)")


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous with its first element 16-byte aligned (the kernel's row loads)."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _gemm(x, words, scales, zeros, group_size, n, config, silu_and_mul, norm, rope):
    from .w4_mma_jit import kernels
    m, k = x.shape
    if rope:
        check_rope(rope, n, silu_and_mul)
    if config is not None:
        check_config_keys(config)  # a bad config is an error even where the dequantize path ignores it
    if x.dtype not in DTYPES:
        raise ValueError(f"w4 mma GEMM: x dtype {x.dtype} must be fp16/bf16")
    if words.shape != (n // 64, k * 8) or mma_blocker(k, n, group_size, x.dtype):
        raise ValueError(f"w4 mma GEMM: K {k}, N {n}, group {group_size}, words {tuple(words.shape)} "
                         "do not fit the layout")
    groups = (k // group_size, n // 64, 8, 8)
    zgroups = (*groups[:3], 2)
    if scales.dtype != torch.float16 or scales.shape != groups or zeros.dtype != torch.int32 \
            or zeros.shape != zgroups \
            or not (scales.is_contiguous() and zeros.is_contiguous() and words.is_contiguous()):
        raise ValueError(f"w4 mma GEMM: scales {scales.dtype} {tuple(scales.shape)} / zeros {zeros.dtype} "
                         f"{tuple(zeros.shape)} must be contiguous float16 {groups} / int32 {zgroups} "
                         "(pack_mma_groups)")
    if m == 0:
        return x.new_empty((0, n // 2 if silu_and_mul else n)), None
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # 16-byte row loads (a fresh, aligned allocation)
    if m > MAX_FUSED_M:  # (rope is a layout here: mma_gemm_rmsnorm takes M <= 8)
        wt = torch.empty((n, k), dtype=x.dtype, device=x.device)
        kernels().dequant(words, scales, zeros, wt, n=n, k=k, group_chunks=group_size // 64)
        y = x @ wt.t()
        if rope:
            y = deinterleave_heads(y, rope[0], rope[1])
        return (silu_and_mul_interleaved(y) if silu_and_mul else y), None
    given = config is not None
    if config is None:  # the defaults and the shipped table pass check_config (tests): not re-checked per call
        # the RMSNorm-prologue kernel (M <= 8) has rows of its own, tuned on it; else the GEMM's serve.
        # In each kind the M bucket's row comes first, then at M = 2..8 the M = 1 row (one token
        # block serves M <= 8: the same kernel)
        one_block = 1 < m <= 8
        tuned = None
        for kind in (PRENORM_KIND, "w4_mma") if norm is not None else ("w4_mma",):
            tuned = lookup(kind, m, n, k, x.device)
            if tuned is None and one_block:
                tuned = lookup(kind, 1, n, k, x.device)
            if tuned is not None:
                break
        if tuned is None:  # an untuned shape: its nearest tuned neighbour's config; at M = 2..8 the
            # M = 1 rows serve too (one token block): the nearer of the two (ties: the M bucket's)
            near = [c for c in (nearest("w4_mma", m, n, k, x.device),
                                nearest("w4_mma", 1, n, k, x.device) if one_block else None) if c]
            tuned = min(near, key=lambda c: shape_distance(c[1], n, k))[0] if near else None
        tuned = tuned or {}
        config = {key: v for key, v in tuned.items() if key != "schema"} if tuned.get("schema") == TABLE_SCHEMA else {}
    cfg = {**CONFIGS[bucket(m)], **config}
    if given:
        check_config(cfg, m)
    cfg = fit_kw(cfg, k, group_size)
    cfg["ACT"] = int(silu_and_mul)  # the epilogue, not a tuning choice
    if norm is not None:  # the normalized rows live in shared memory, whole (x_bytes)
        cfg["NORM"], cfg["XS"], cfg["XR"], cfg["WG"] = 1, 1, 0, 0
    if rope:
        cfg["ROPE"] = 2 if rope[2] is not None else 1
    if cfg.get("WG") and not wgmma_capable(x.device):
        cfg["WG"] = 0  # wgmma is sm_90a only: elsewhere the same tiles run on mma.sync
    if cfg.get("WG") == 2:
        x = kernels().x_tiles(x)  # chunk-major, swizzled (wg_x_tiles): one bulk copy per chunk
    elif cfg.get("WG"):
        x = chunk_k_order(x)  # the B operand's K order (a contiguous, aligned copy of M x K)
    ctas_n, cps, splits = plan(m, n, k, group_size, cfg, _num_sms(_index(x.device)))
    cfg["CLU"] = cluster_splits(cfg, splits)  # the compile-time cluster size (0: global partials)
    xs = x_bytes(cfg, m, k, cps, x.element_size())
    if norm is not None and xs + stage_bytes(cfg) > _smem_limit(x.device):
        if xs > _smem_limit(x.device):  # (callers ask norm_fits first)
            raise ValueError(f"w4 mma GEMM + RMSNorm: M {m} rows of K {k} need {xs} bytes of shared memory, more than "
                             f"the device's {_smem_limit(x.device)}")
        cfg["CPA"] = 0  # the rows must stay: the stages go to registers (S) instead (XR is off with NORM)
    elif (xs or cfg.get("CPA")) and xs + stage_bytes(cfg) > _smem_limit(x.device):  # (query only when asked)
        cfg["XS"], xs = 0, 0  # the x slice does not fit beside the stages: each warp loads x itself
    smem = max(xs + stage_bytes(cfg) + xr_bytes(cfg), reduce_bytes(cfg), cluster_bytes(cfg))
    if smem and smem > _smem_limit(x.device):
        raise ValueError(f"w4 mma GEMM: config {cfg} needs {smem} bytes of shared memory for its CPA stages / x ring / KW sums, "
                         f"more than the device's {_smem_limit(x.device)}")
    out = torch.empty((m, n // 2 if silu_and_mul else n), dtype=x.dtype, device=x.device)
    ws = cnt = out
    if splits > 1 and not cfg["CLU"]:
        ws = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        cnt = arrival_counters(ctas_n, x.device)
    res_out = None
    if norm is not None:
        res_out = torch.empty((m, k), dtype=x.dtype, device=x.device)
        norm = (*norm, res_out)
    kernels().gemm(x, words, scales, zeros, out, ws, cnt, n=n, group_chunks=group_size // 64, chunks_per_split=cps,
                   splits=splits, cfg=cfg, smem=smem, norm=norm,
                   rope=(rope[0] * rope[1], *rope[1:]) if rope else None)
    return out, res_out


@functools.lru_cache(maxsize=None)
def _device_facts(index: int) -> tuple[tuple[int, int], int]:
    # Asked once per device: the eager decode path calls the GEMM ~100 times a step.
    props = torch.cuda.get_device_properties(index)
    return (props.major, props.minor), props.shared_memory_per_block_optin


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0  # (CPU: the emulated tests)


def wgmma_capable(device: torch.device) -> bool:
    """Whether ``device`` runs sm_90a code (WG's warpgroup MMAs): compute capability 9.0."""
    return _device_facts(_index(device))[0] == (9, 0)


def _smem_limit(device: torch.device) -> int:
    """Dynamic shared memory a CTA may take: the opt-in maximum less 2 KB for the kernel's
    static shared memory (at most 1 KB of NORM sums and the split-K flag)."""
    return _device_facts(_index(device))[1] - 2048
