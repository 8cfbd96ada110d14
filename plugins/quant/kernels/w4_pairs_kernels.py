"""Triton kernels of the "pairs" int4 layout (API, layout and algorithm notes: ``w4_pairs.py``).

Shapes: x [M, K] fp16/bf16; words [K/8, N] int32 (tile t of TILE_K input rows = word rows
t*BKW .. t*BKW + BKW - 1, BKW = TILE_K / 8); scales [G, N] float; zeros [G, N] uint8.
Plain functions, jitted with the other weight-only kernels by ``wna16_kernels.kernels()``
(the split-K store helper ``_store_tile`` is shared with them).
"""
from __future__ import annotations

from .wna16_tiles import _store_tile  # noqa: F401  (rebound to its jitted version by kernels())

try:
    import triton.language as tl
except Exception:  # pragma: no cover - CPU-only installs never launch the kernels
    class tl:  # type: ignore[no-redef]
        constexpr = None


def _pairs(w, P: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr, IS_BF16: tl.constexpr,
           USE_ASM: tl.constexpr):
    """Words [BLOCK_N, KP/2] -> [BLOCK_N, KP] in x's dtype: column 2j + h = nibble P + 4h of
    word j as ``BIAS + q`` (bf16 128 + q / fp16 1024 + q: the nibble OR-ed into the mantissa of
    BIAS, exact). USE_ASM: one SHF + one LOP3 make a packed pair straight in the MMA operand
    registers (Triton packs adjacent K elements per register); else (the interpreter, which
    runs no PTX) the same bits through int16 bitcasts."""
    if USE_ASM:
        w2 = tl.reshape(tl.join(w, w), (BLOCK_N, KP))  # each word twice: the asm sees the pair
        shift = tl.full((BLOCK_N, KP), 4 * P, tl.int32)
        if IS_BF16:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.u32 t, $1, $3; lop3.b32 $0, t, 0x000f000f, 0x43004300, 0xea; }",
                "=r,r,r,r,r", [w2, shift], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.u32 t, $1, $3; lop3.b32 $0, t, 0x000f000f, 0x64006400, 0xea; }",
                "=r,r,r,r,r", [w2, shift], dtype=tl.float16, is_pure=True, pack=2)
    else:
        MAGIC: tl.constexpr = 0x4300 if IS_BF16 else 0x6400
        DT: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
        lo = (((w >> (4 * P)) & 15) | MAGIC).to(tl.int16).to(DT, bitcast=True)
        hi = (((w >> (4 * P + 16)) & 15) | MAGIC).to(tl.int16).to(DT, bitcast=True)
        r = tl.reshape(tl.join(lo, hi), (BLOCK_N, KP))
    return r


def _program_tile(x_ptr, qw_ptr, M, N, stride_xm, TILE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """This program's (pid, split, rows + mask, columns + mask) and the pointers of K tile 0:
    words [BLOCK_N, TILE_K/8] (transposed: the weight is the MMA's M side) and x slice 0
    [TILE_K/4, BLOCK_M]. Grid (M tiles * N tiles, splits), M tile fastest."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    offs_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    w_ptrs = qw_ptr + tl.arange(0, TILE_K // 8)[None, :] * N + offs_n[:, None]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + tl.arange(0, TILE_K // 4)[:, None]
    return pid, pid_k, offs_m, offs_m < M, offs_n, offs_n < N, w_ptrs, x_ptrs


def _pairs_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_om,
                  tiles_per_split, GROUP: tl.constexpr, TILE_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr, IS_BF16: tl.constexpr,
                  USE_ASM: tl.constexpr, SCALE_A: tl.constexpr):
    """y[tile] (+)= x @ dequant(W) over this split's K tiles; the weight is the MMA's M side
    (``W^T x^T``: Hopper wgmma takes it from registers), the tokens its N side.

    Per K tile (one scale group): four MMAs, one per nibble pair P, on the exact integers
    ``(BIAS + q) - (BIAS + z)`` (one packed 16-bit subtraction per two weights) against the
    contiguous x slice ``[t*TILE_K + P*KP, +KP)``; the group scale multiplies the tile's
    [BLOCK_N, BLOCK_M] product (SCALE_A: the operand, rounded to x's dtype as a dequantized
    weight would be; no second accumulator, fewer registers at larger BLOCK_M). Grid and
    split-K reduction as the fused weight-only kernel.
    """
    pid, pid_k, offs_m, mask_m, offs_n, mask_n, w_ptrs, x_ptrs = _program_tile(x_ptr, qw_ptr, M, N, stride_xm, TILE_K,
                                                                                BLOCK_M, BLOCK_N)
    BKW: tl.constexpr = TILE_K // 8
    KP: tl.constexpr = TILE_K // 4
    BIAS: tl.constexpr = 128.0 if IS_BF16 else 1024.0
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t_first = pid_k * tiles_per_split
    n_t = tl.minimum(tiles_per_split, K // TILE_K - t_first)
    for t in range(t_first, t_first + n_t):
        w = tl.load(w_ptrs + t * BKW * N, mask=mask_n[:, None], other=0)
        g_off = (t * TILE_K // GROUP) * N
        s = tl.load(s_ptr + g_off + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off + offs_n, mask=mask_n, other=0).to(tl.float32)
        zb = (z + BIAS).to(x_ptr.dtype.element_ty)[:, None]  # BIAS + z: (BIAS + q) - zb = q - z, exact
        if SCALE_A:  # the scale in the operand (one more packed op per two weights, no second accumulator)
            sb = s.to(x_ptr.dtype.element_ty)[:, None]
            for p in tl.static_range(4):
                b = tl.load(x_ptrs + (t * TILE_K + p * KP), mask=mask_m[None, :], other=0.0)
                acc = tl.dot((_pairs(w, p, BLOCK_N, KP, IS_BF16, USE_ASM) - zb) * sb, b, acc)
        else:
            tacc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for p in tl.static_range(4):
                b = tl.load(x_ptrs + (t * TILE_K + p * KP), mask=mask_m[None, :], other=0.0)
                tacc = tl.dot(_pairs(w, p, BLOCK_N, KP, IS_BF16, USE_ASM) - zb, b, tacc)
            acc += s[:, None] * tacc
    _store_tile(tl.trans(acc), out_ptr, ws_ptr, cnt_ptr, pid, pid_k, offs_m, offs_n, M, N, stride_om, SPLIT_K,
                SERIAL)


def _pairs_dequant_kernel(qw_ptr, s_ptr, z_ptr, w_ptr, N, GROUP: tl.constexpr, TILE_K: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """W [K, N] = (q - z) * s (fp32 math, as the reference) in ``w_ptr``'s dtype, one
    [TILE_K, BLOCK_N] tile per program (cuBLAS multiplies it next)."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    BKW: tl.constexpr = TILE_K // 8
    KP: tl.constexpr = TILE_K // 4
    offs_j = tl.arange(0, BKW)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_j < BKW)[:, None] & (offs_n < N)[None, :]
    w = tl.load(qw_ptr + (pid_k * BKW + offs_j)[:, None] * N + offs_n[None, :], mask=mask, other=0)
    g_off = (pid_k * TILE_K // GROUP) * N
    s = tl.load(s_ptr + g_off + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    z = tl.load(z_ptr + g_off + offs_n, mask=offs_n < N, other=0).to(tl.float32)[None, :]
    for pos in tl.static_range(8):  # nibble pos = P + 4h holds row P*KP + 2j + h of the tile
        row = pid_k * TILE_K + (pos % 4) * KP + 2 * offs_j + pos // 4
        q = ((w >> (4 * pos)) & 15).to(tl.float32)
        tl.store(w_ptr + row[:, None] * N + offs_n[None, :], ((q - z) * s).to(w_ptr.dtype.element_ty), mask=mask)


def _pairs_unrolled_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm, stride_om,
                           GROUP: tl.constexpr, TILE_K: tl.constexpr, TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, SERIAL: tl.constexpr,
                           IS_BF16: tl.constexpr, USE_ASM: tl.constexpr, SCALE_A: tl.constexpr):
    """:func:`_pairs_kernel` with TILES K tiles per split, unrolled (config ``unroll``): all
    of the split's words and x slices are loaded, and the x slices staged for the MMAs,
    before the first MMA, so the MMAs run without the per-pair stage / barrier / load round
    trips of the loop (sm90 SASS: 2 CTA barriers per tile among the MMAs instead of 9). Tiles past K (a
    last, shorter split) load zeros. Not yet timed on a GPU (BENCHMARKS.md)."""
    pid, pid_k, offs_m, mask_m, offs_n, mask_n, w_ptrs, x_ptrs = _program_tile(x_ptr, qw_ptr, M, N, stride_xm, TILE_K,
                                                                                BLOCK_M, BLOCK_N)
    BKW: tl.constexpr = TILE_K // 8
    KP: tl.constexpr = TILE_K // 4
    BIAS: tl.constexpr = 128.0 if IS_BF16 else 1024.0
    t0 = pid_k * TILES
    xs = ()
    ws = ()
    for i in tl.static_range(TILES):
        # a tile of this split that exists (as vectors: the interpreter takes no scalar masks)
        live_n = mask_n & (offs_n * 0 + (t0 + i) * TILE_K < K)
        live_m = mask_m & (offs_m * 0 + (t0 + i) * TILE_K < K)
        ws = ws + (tl.load(w_ptrs + (t0 + i) * BKW * N, mask=live_n[:, None], other=0),)
        for p in tl.static_range(4):
            xs = xs + (tl.load(x_ptrs + ((t0 + i) * TILE_K + p * KP), mask=live_m[None, :], other=0.0),)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in tl.static_range(TILES):
        g_off = ((t0 + i) * TILE_K // GROUP) * N
        live_n = mask_n & (offs_n * 0 + (t0 + i) * TILE_K < K)
        s = tl.load(s_ptr + g_off + offs_n, mask=live_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off + offs_n, mask=live_n, other=0).to(tl.float32)
        zb = (z + BIAS).to(x_ptr.dtype.element_ty)[:, None]
        if SCALE_A:
            sb = s.to(x_ptr.dtype.element_ty)[:, None]
            for p in tl.static_range(4):
                acc = tl.dot((_pairs(ws[i], p, BLOCK_N, KP, IS_BF16, USE_ASM) - zb) * sb, xs[4 * i + p], acc)
        else:
            tacc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for p in tl.static_range(4):
                tacc = tl.dot(_pairs(ws[i], p, BLOCK_N, KP, IS_BF16, USE_ASM) - zb, xs[4 * i + p], tacc)
            acc += s[:, None] * tacc
    _store_tile(tl.trans(acc), out_ptr, ws_ptr, cnt_ptr, pid, pid_k, offs_m, offs_n, M, N, stride_om, SPLIT_K,
                SERIAL)
