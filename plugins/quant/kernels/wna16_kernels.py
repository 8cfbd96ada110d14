"""Triton kernels of the weight-only GEMM (API, configs and algorithm notes: ``wna16.py``;
per-tile pieces: ``wna16_tiles.py``). Shapes: x [M, K]; AWQ-style words [K, N/PF] (fields
along N), GPTQ-style words [K/PF, N] (fields along K); scales [G, N] float, zeros [G, N] uint8.

Kernels and helpers are plain functions, passed through ``triton.jit`` on first use
(:func:`kernels`): Triton picks interpreter or compiler when ``jit`` runs, and the helpers
must be jitted in the same mode as the kernels that call them.
"""
from __future__ import annotations

import os

from . import w4_pairs_kernels, wna16_tiles
# the kernels call these by name; kernels() rebinds them to their jitted versions
from .wna16_tiles import (_awq_dot_tile, _awq_gemv_tile, _awq_joined_tile, _gemv_load, _gptq_dot_tile,  # noqa: F401
                          _gptq_gemv_tile, _gptq_joined_tile, _join_tree, _store_tile, _zs, _qf)

try:
    import triton.language as tl
except Exception:  # pragma: no cover - CPU-only installs never launch the kernels
    class tl:  # type: ignore[no-redef]
        constexpr = None


def _awq_main(x_ptr, qw_ptr, s_ptr, z_ptr, magic, M, N, NW, K, stride_xm, pid_m, pid_n, t_first, n_t,
              BITS: tl.constexpr, AWQ_ORDER: tl.constexpr, GROUP: tl.constexpr, ROW_SCALES: tl.constexpr,
              EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              MODE: tl.constexpr, SWAP: tl.constexpr, PREFETCH: tl.constexpr, RW: tl.constexpr,
              WSTRIDE: tl.constexpr, FP32_DOT: tl.constexpr):
    """N-packed words (AWQ) -> fp32 [BLOCK_M (1 for MODE 0), BLOCK_N] in natural column order."""
    PF: tl.constexpr = 32 // BITS
    BNW: tl.constexpr = BLOCK_N // PF
    offs_nw = pid_n * BNW + tl.arange(0, BNW)
    mask_nw = offs_nw < NW
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    accs = ()
    for j in tl.static_range(PF):
        if MODE == 0:
            accs = accs + (tl.zeros((RW, BNW), dtype=tl.float32),)
        elif SWAP:
            accs = accs + (tl.zeros((BNW, BLOCK_M), dtype=tl.float32),)
        else:
            accs = accs + (tl.zeros((BLOCK_M, BNW), dtype=tl.float32),)
    if MODE == 0:
        x_row = x_ptr + pid_m * stride_xm
        # scale / zero offsets (+ PF * row + position) in the word tiles' [RW, BNW] shape: every
        # warp loads the same row (L1 hits); a [BNW] vector would get another layout and a
        # shared-memory conversion per field and tile
        cols2d = tl.zeros((RW, BNW), dtype=tl.int32) + (offs_nw * PF)[None, :]
        mask2d = (cols2d >= 0) & mask_nw[None, :]
        STEPS: tl.constexpr = BLOCK_K // RW
        RM: tl.constexpr = not EVEN_K
        if PREFETCH:  # the next tile's loads are issued before this tile's math
            t_last = t_first + n_t - 1
            vals = _gemv_load(qw_ptr, x_row, WSTRIDE, K, t_first * BLOCK_K, offs_nw, mask_nw, RM, STEPS, RW, 1)
            for t in range(t_first, t_last + 1):
                # past the end: the last tile again (an L2 hit) rather than a mask on every row
                nxt = _gemv_load(qw_ptr, x_row, WSTRIDE, K, tl.minimum(t + 1, t_last) * BLOCK_K, offs_nw, mask_nw, RM,
                                 STEPS, RW, 1)
                accs = _awq_gemv_tile(accs, vals, s_ptr, z_ptr, magic, N, t * BLOCK_K, cols2d, mask2d, BITS,
                                      AWQ_ORDER, GROUP, STEPS)
                vals = nxt
        else:
            for t in range(t_first, t_first + n_t):
                vals = _gemv_load(qw_ptr, x_row, WSTRIDE, K, t * BLOCK_K, offs_nw, mask_nw, RM, STEPS, RW, 1)
                accs = _awq_gemv_tile(accs, vals, s_ptr, z_ptr, magic, N, t * BLOCK_K, cols2d, mask2d, BITS,
                                      AWQ_ORDER, GROUP, STEPS)
        sums = ()
        for j in tl.static_range(PF):  # the warps' partial sums, added once
            sums = sums + (tl.sum(accs[j], axis=0),)
        accs = sums
    else:
        for t in range(t_first, t_first + n_t):
            accs = _awq_dot_tile(accs, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, NW, K, stride_xm, t * BLOCK_K,
                                 offs_m, offs_nw, mask_nw, BITS, AWQ_ORDER, GROUP, ROW_SCALES, EVEN_K, BLOCK_K, MODE,
                                 SWAP, FP32_DOT)
    res = _join_tree(accs, PF)
    if MODE == 0:
        res = tl.reshape(res, (1, BLOCK_N))
    elif SWAP:
        if PF == 8:
            res = tl.reshape(tl.permute(res, (1, 0, 2, 3, 4)), (BLOCK_M, BLOCK_N))
        else:
            res = tl.reshape(tl.permute(res, (1, 0, 2, 3)), (BLOCK_M, BLOCK_N))
    else:
        res = tl.reshape(res, (BLOCK_M, BLOCK_N))
    return res


def _joined_main(x_ptr, qw_ptr, s_ptr, z_ptr, M, N, NW, K, stride_xm, pid_m, pid_n, t_first, n_t,
                 BITS: tl.constexpr, PACK_K: tl.constexpr, AWQ_ORDER: tl.constexpr, GROUP: tl.constexpr,
                 ROW_SCALES: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    """MODE 3: one [BLOCK_M, BLOCK_N] accumulator, one MMA per tile (see the joined tiles)."""
    PF: tl.constexpr = 32 // BITS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PACK_K:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        for t in range(t_first, t_first + n_t):
            acc = _gptq_joined_tile(acc, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, stride_xm, t, offs_m, offs_n,
                                    offs_n < N, BITS, GROUP, ROW_SCALES, EVEN_K, BLOCK_K, BLOCK_N, FP32_DOT)
    else:
        offs_nw = pid_n * (BLOCK_N // PF) + tl.arange(0, BLOCK_N // PF)
        for t in range(t_first, t_first + n_t):
            acc = _awq_joined_tile(acc, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, NW, K, stride_xm, t * BLOCK_K, offs_m,
                                   offs_nw, offs_nw < NW, BITS, AWQ_ORDER, GROUP, ROW_SCALES, EVEN_K, BLOCK_K, BLOCK_N,
                                   FP32_DOT)
    return acc


def _gptq_main(x_ptr, qw_ptr, s_ptr, z_ptr, magic, M, N, K, stride_xm, pid_m, pid_n, t_first, n_t,
               BITS: tl.constexpr, GROUP: tl.constexpr, ROW_SCALES: tl.constexpr, EVEN_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
               SWAP: tl.constexpr, PREFETCH: tl.constexpr, RW: tl.constexpr, WSTRIDE: tl.constexpr,
               FP32_DOT: tl.constexpr):
    """K-packed words (GPTQ) -> fp32 [BLOCK_M (1 for MODE 0), BLOCK_N]."""
    PF: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PF
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if MODE == 0:
        acc = tl.zeros((RW, BLOCK_N), dtype=tl.float32)
        x_row = x_ptr + pid_m * stride_xm
        cols2d = tl.zeros((RW, BLOCK_N), dtype=tl.int32) + offs_n[None, :]  # as in _awq_main
        mask2d = (cols2d >= 0) & mask_n[None, :]
        STEPS: tl.constexpr = BKW // RW
        RM: tl.constexpr = not EVEN_K
        if PREFETCH:
            t_last = t_first + n_t - 1
            vals = _gemv_load(qw_ptr, x_row, WSTRIDE, K, t_first * BKW, offs_n, mask_n, RM, STEPS, RW, PF)
            for t in range(t_first, t_last + 1):
                nxt = _gemv_load(qw_ptr, x_row, WSTRIDE, K, tl.minimum(t + 1, t_last) * BKW, offs_n, mask_n, RM,
                                 STEPS, RW, PF)
                acc = _gptq_gemv_tile(acc, vals, s_ptr, z_ptr, magic, N, t, cols2d, mask2d, BITS, GROUP, BLOCK_K,
                                      STEPS)
                vals = nxt
        else:
            for t in range(t_first, t_first + n_t):
                vals = _gemv_load(qw_ptr, x_row, WSTRIDE, K, t * BKW, offs_n, mask_n, RM, STEPS, RW, PF)
                acc = _gptq_gemv_tile(acc, vals, s_ptr, z_ptr, magic, N, t, cols2d, mask2d, BITS, GROUP, BLOCK_K,
                                      STEPS)
        acc = tl.sum(acc, axis=0)
        acc = acc[None, :]
    else:
        if SWAP:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for t in range(t_first, t_first + n_t):
            acc = _gptq_dot_tile(acc, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, stride_xm, t, offs_m, offs_n, mask_n,
                                 BITS, GROUP, ROW_SCALES, EVEN_K, BLOCK_K, MODE, SWAP, FP32_DOT)
        if SWAP:
            acc = tl.trans(acc)
    return acc


def _fused_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, magic, out_ptr, ws_ptr, cnt_ptr, M, N, NW, K, stride_xm, stride_om,
                  tiles_per_split, BITS: tl.constexpr, PACK_K: tl.constexpr, AWQ_ORDER: tl.constexpr,
                  GROUP: tl.constexpr, ROW_SCALES: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr, SWAP: tl.constexpr,
                  PREFETCH: tl.constexpr, RW: tl.constexpr, WSTRIDE: tl.constexpr, SPLIT_K: tl.constexpr,
                  SERIAL: tl.constexpr, FP32_DOT: tl.constexpr):
    """y[tile] (+)= x @ dequant(W) over the K tiles [t_first, t_first + n_t) of this split.

    MODE 0: CUDA cores, one row of x per program (``RW`` warps, each a word row per step;
    ``WSTRIDE`` the word-row stride as a constant: load offsets become immediates); 1:
    per-field tl.dot on scaled weights; 2: per-field tl.dot on exact integers, the group
    scale after it (tile inside one group); SWAP: the weight as the MMA's M side; 3: fields
    joined, one tl.dot per tile. ``NW = N // PF`` is an argument of its own so that Triton
    sees its divisibility (16-byte word loads). ``magic``: 0x4B000000 (see ``_qf``).

    Grid (M tiles * N tiles, SPLIT_K), M tile fastest: programs sharing a weight tile run
    together (L2). Split-K, SERIAL: each program stores its fp32 partial in ``ws``
    [SPLIT_K, M, N]; the last to arrive (a per-tile counter in ``cnt``, which it resets) sums
    them in split order (deterministic) and writes ``out``: one launch. Else atomic adds into
    ``out`` (zeroed by the caller).
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    ROWS: tl.constexpr = 1 if MODE == 0 else BLOCK_M
    num_m = tl.cdiv(M, ROWS)
    pid_m = pid % num_m
    pid_n = pid // num_m
    t_first = pid_k * tiles_per_split
    n_t = tl.minimum(tiles_per_split, tl.cdiv(K, BLOCK_K) - t_first)
    if MODE == 3:
        acc = _joined_main(x_ptr, qw_ptr, s_ptr, z_ptr, M, N, NW, K, stride_xm, pid_m, pid_n, t_first, n_t, BITS,
                           PACK_K, AWQ_ORDER, GROUP, ROW_SCALES, EVEN_K, ROWS, BLOCK_N, BLOCK_K, FP32_DOT)
    elif PACK_K:
        acc = _gptq_main(x_ptr, qw_ptr, s_ptr, z_ptr, magic, M, N, K, stride_xm, pid_m, pid_n, t_first, n_t, BITS,
                         GROUP, ROW_SCALES, EVEN_K, ROWS, BLOCK_N, BLOCK_K, MODE, SWAP, PREFETCH, RW, WSTRIDE, FP32_DOT)
    else:
        acc = _awq_main(x_ptr, qw_ptr, s_ptr, z_ptr, magic, M, N, NW, K, stride_xm, pid_m, pid_n, t_first, n_t, BITS,
                        AWQ_ORDER, GROUP, ROW_SCALES, EVEN_K, ROWS, BLOCK_N, BLOCK_K, MODE, SWAP, PREFETCH, RW, WSTRIDE,
                        FP32_DOT)
    offs_m = pid_m * ROWS + tl.arange(0, ROWS)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    _store_tile(acc, out_ptr, ws_ptr, cnt_ptr, pid, pid_k, offs_m, offs_n, M, N, stride_om, SPLIT_K, SERIAL)


def _dequant_kernel(qw_ptr, s_ptr, z_ptr, magic, w_ptr, N, NW, K, BITS: tl.constexpr, PACK_K: tl.constexpr,
                    AWQ_ORDER: tl.constexpr, GROUP: tl.constexpr, ROW_SCALES: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W [K, N] = (q - z) * s (in fp32, as the reference) in ``w_ptr``'s dtype, one [BLOCK_K,
    BLOCK_N] tile per program, written once in contiguous rows (cuBLAS multiplies it next)."""
    PF: tl.constexpr = 32 // BITS
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PACK_K:  # field i = rows PF*r + i: each field's store is whole row segments
        BKW: tl.constexpr = BLOCK_K // PF
        offs_kw = pid_k * BKW + tl.arange(0, BKW)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        mask = (offs_kw < K // PF)[:, None] & mask_n[None, :]
        w = tl.load(qw_ptr + offs_kw[:, None] * N + offs_n[None, :], mask=mask, other=0)
        w_lo = w | magic
        w_hi = (w >> 16) | magic
        if ROW_SCALES:
            g_off = (pid_k * BLOCK_K // GROUP) * N
            s = tl.load(s_ptr + g_off + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            z = tl.load(z_ptr + g_off + offs_n, mask=mask_n, other=0).to(tl.float32)[None, :]
        for i in tl.static_range(PF):
            if not ROW_SCALES:
                g_off = ((offs_kw * PF + i) // GROUP * N)[:, None]
                s = tl.load(s_ptr + g_off + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g_off + offs_n[None, :], mask=mask, other=0).to(tl.float32)
            zc, sc = _zs(z, s, i, BITS, False)
            tl.store(w_ptr + (offs_kw * PF + i)[:, None] * N + offs_n[None, :],
                     ((_qf(w_lo, w_hi, i, BITS, False) - zc) * sc).to(w_ptr.dtype.element_ty), mask=mask)
    else:  # field j = columns PF*c + j: joined back to natural order, stored as full rows
        BNW: tl.constexpr = BLOCK_N // PF
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        offs_nw = pid_n * BNW + tl.arange(0, BNW)
        mask_nw = offs_nw < NW
        w = tl.load(qw_ptr + offs_k[:, None] * NW + offs_nw[None, :], mask=mk[:, None] & mask_nw[None, :], other=0)
        w_lo = w | magic
        w_hi = (w >> 16) | magic
        vals = ()
        for j in tl.static_range(PF):
            cols = offs_nw * PF + j
            if ROW_SCALES:
                g_off = (pid_k * BLOCK_K // GROUP) * N
                s = tl.load(s_ptr + g_off + cols, mask=mask_nw, other=0.0).to(tl.float32)[None, :]
                z = tl.load(z_ptr + g_off + cols, mask=mask_nw, other=0).to(tl.float32)[None, :]
            else:
                g_off = ((offs_k // GROUP) * N)[:, None]
                smask = mk[:, None] & mask_nw[None, :]
                s = tl.load(s_ptr + g_off + cols[None, :], mask=smask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + g_off + cols[None, :], mask=smask, other=0).to(tl.float32)
            zc, sc = _zs(z, s, j, BITS, AWQ_ORDER)
            q = _qf(w_lo, w_hi, j, BITS, AWQ_ORDER)
            vals = vals + (((q - zc) * sc).to(w_ptr.dtype.element_ty),)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(w_ptr + offs_k[:, None] * N + offs_n[None, :],
                 tl.reshape(_join_tree(vals, PF), (BLOCK_K, BLOCK_N)), mask=mk[:, None] & (offs_n < N)[None, :])


_HELPERS = ("_awq_main", "_gptq_main", "_joined_main")
_RAW = {name: globals()[name] for name in _HELPERS + ("_fused_kernel", "_dequant_kernel")}
_RAW_TILES = {name: getattr(wna16_tiles, name) for name in wna16_tiles.HELPERS}
_RAW_PAIRS = {name: getattr(w4_pairs_kernels, name) for name in ("_pairs", "_program_tile", "_pairs_kernel", "_pairs_unrolled_kernel", "_pairs_dequant_kernel")}
_JITTED: dict[bool, tuple[dict, dict, dict]] = {}


def kernels() -> dict:
    """Every weight-only kernel by name (``_fused_kernel``, ``_dequant_kernel``,
    ``_pairs_kernel``, ``_pairs_dequant_kernel``), jitted in the current ``TRITON_INTERPRET`` mode.

    Kernels resolve the helpers they call through their module's globals when they compile,
    so those names are pointed at the helpers jitted in the same mode (rebinding is cheap)."""
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    got = _JITTED.get(interp)
    if got is None:
        import triton
        got = _JITTED[interp] = tuple({name: triton.jit(fn) for name, fn in raw.items()}
                                      for raw in (_RAW, _RAW_TILES, _RAW_PAIRS))
    here, tiles, pairs = got
    g, gt, gp = globals(), vars(wna16_tiles), vars(w4_pairs_kernels)
    for name, fn in tiles.items():  # the tiles call each other (in wna16_tiles) and are called from here
        gt[name] = g[name] = fn
    gp["_store_tile"] = tiles["_store_tile"]
    for name in ("_pairs", "_program_tile"):  # called from the pairs kernels
        gp[name] = pairs[name]
    for name in _HELPERS:
        g[name] = here[name]
    return {**here, **pairs}
