"""Per-tile building blocks of the weight-only GEMM kernels (``wna16_kernels.py``; API and
algorithm notes: ``wna16.py``). Plain functions, jitted by ``wna16_kernels.kernels()``.

Words: AWQ-style [K, N/PF] int32 (field j = output columns PF*c + j), GPTQ-style [K/PF, N]
(field i = input rows PF*r + i). Fields are read from ``w_lo = w | 0x4B000000`` and
``w_hi = (w >> 16) | 0x4B000000`` (:func:`_qf`).
"""
from __future__ import annotations

try:
    import triton.language as tl
except Exception:  # pragma: no cover - CPU-only installs never launch the kernels
    class tl:  # type: ignore[no-redef]
        constexpr = None


def _qf(w_lo, w_hi, J: tl.constexpr, BITS: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """Field of position J (AWQ_ORDER: AutoAWQ keeps column 8c + j in nibble (0,4,1,5,2,6,3,7)[j];
    else field J) as fp32 ``2**23 + q * 2**E``, E = the field's bit offset mod 16.

    Int -> float without the slow I2F unit: 0x4B000000 is fp32 2**23, and an integer < 2**23
    in its mantissa bits adds to it exactly. The field is masked in place, not shifted (2**E
    is folded into zero point and scale, :func:`_zs`); fields in bits >= 16 come from the word
    shifted once. The magic is OR-ed into the word once, so a field is ONE logic op with one
    immediate. The CUDA-core path ORs a run-time ``magic`` argument (= 0x4B000000): with a
    constant the compiler folds the two ops back into ``(w & M) | C`` and re-materialises a
    register constant for every field (~0.9 extra instructions per weight). The MMA paths use
    the constant: with the argument Triton stops loading words straight into the MMA operand
    layout and converts every dequantized tile through shared memory.
    """
    QMASK: tl.constexpr = (1 << BITS) - 1
    if AWQ_ORDER:
        SH: tl.constexpr = ((J % 2) * 4 + J // 2) * BITS
    else:
        SH: tl.constexpr = J * BITS
    if SH < 16:
        v = w_lo & ((QMASK << SH) | 0x4B000000)
    else:
        v = w_hi & ((QMASK << (SH - 16)) | 0x4B000000)
    return v.to(tl.float32, bitcast=True)


def _zs(z, s, J: tl.constexpr, BITS: tl.constexpr, AWQ_ORDER: tl.constexpr):
    """fp32 zero point z, scale s of position J (as :func:`_qf`) -> ``(2**23 + z * 2**E,
    s * 2**-E)``: ``_qf - zc`` is the integer ``(q - z) * 2**E`` (exact; |.| <= 255 * 2**8 also
    fits fp16 / bf16 exactly) and ``(_qf - zc) * sc == (q - z) * s``."""
    if AWQ_ORDER:
        E: tl.constexpr = (((J % 2) * 4 + J // 2) * BITS) % 16
    else:
        E: tl.constexpr = (J * BITS) % 16
    return z * (1 << E) + 8388608.0, s * (1.0 / (1 << E))


def _row_scales(s_ptr, z_ptr, g_off, cols, mask_c, SWAP: tl.constexpr):
    """fp32 scale and zero-point row of a tile inside one group (``g_off`` = group * N),
    ``cols`` [n] -> [1, n] each ([n, 1] with SWAP, the transposed load of :func:`_dot`)."""
    s = tl.load(s_ptr + g_off + cols, mask=mask_c, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g_off + cols, mask=mask_c, other=0).to(tl.float32)
    if SWAP:
        s2, z2 = s[:, None], z[:, None]
    else:
        s2, z2 = s[None, :], z[None, :]
    return s2, z2


def _group_tile(s_ptr, z_ptr, g_off, cols, mask_k, mask_c, SWAP: tl.constexpr):
    """fp32 scales and zero points of a tile whose rows lie in several groups: ``g_off`` [k]
    (each row's group offset, ``group * N``), ``cols`` [n] -> two [k, n] tiles ([n, k] with
    SWAP, the transposed load of :func:`_dot`); 0 where ``mask_k`` x ``mask_c`` is off."""
    if SWAP:
        sp = g_off[None, :] + cols[:, None]
        smask = mask_k[None, :] & mask_c[:, None]
    else:
        sp = g_off[:, None] + cols[None, :]
        smask = mask_k[:, None] & mask_c[None, :]
    s = tl.load(s_ptr + sp, mask=smask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sp, mask=smask, other=0).to(tl.float32)
    return s, z


def _join_tree(c, PF: tl.constexpr):
    """Tuple of PF tensors (c[j] = output columns PF*n + j) -> [..., 2, 2(, 2)] whose reshape to
    [..., PF*n] is natural column order. tl.join adds an in-thread dimension: no data movement."""
    if PF == 8:
        t = tl.join(tl.join(tl.join(c[0], c[4]), tl.join(c[2], c[6])),
                    tl.join(tl.join(c[1], c[5]), tl.join(c[3], c[7])))
    else:
        t = tl.join(tl.join(c[0], c[2]), tl.join(c[1], c[3]))
    return t


def _dot(acc, x, b, SWAP: tl.constexpr, FP32_DOT: tl.constexpr):
    """``acc + x @ b`` (x [BLOCK_M, k], b [k, n]); SWAP: ``acc + b @ x`` with b [n, k] and
    x [k, BLOCK_M] (the tiles were loaded transposed): the weight is the MMA's M side -- on
    Hopper wgmma's A operand, taken from registers -- and the few tokens its N side."""
    if FP32_DOT:
        if SWAP:
            r = tl.dot(b, x, acc, input_precision="ieee")
        else:
            r = tl.dot(x, b, acc, input_precision="ieee")
    else:
        if SWAP:
            r = tl.dot(b.to(x.dtype), x, acc)
        else:
            r = tl.dot(x, b.to(x.dtype), acc)
    return r


def _gemv_load(w_ptr, x_row, w_stride, k_lim, rows0, cols, mask_c, ROWMASK: tl.constexpr, STEPS: tl.constexpr,
               RW: tl.constexpr, XPR: tl.constexpr):
    """MODE 0 tile loads, all issued before any use (the compiler then keeps them in flight
    together; loads issued next to their use are scheduled only a row or two ahead). STEPS
    word tiles [RW, len(cols)] at word rows ``rows0 + step*RW + (0..RW-1)`` -- one row per
    warp -- and the x values of their XPR input rows each (x[k], k = XPR*row + i); words at
    input rows >= k_lim read as 0 when ROWMASK."""
    rw = tl.arange(0, RW)
    # one pointer tensor per tile, then constant offsets per step (immediates in the loads)
    p = w_ptr + rows0 * w_stride + (rw[:, None] * w_stride + cols[None, :])
    xp = x_row + (rows0 + rw) * XPR
    vals = ()
    for st in tl.static_range(STEPS):
        if ROWMASK:
            m = mask_c[None, :] & ((rows0 + st * RW + rw) * XPR < k_lim)[:, None]
        else:
            m = mask_c[None, :] & (rw < RW)[:, None]
        vals = vals + (tl.load(p + st * RW * w_stride, mask=m, other=0),)
    for st in tl.static_range(STEPS):
        for i in tl.static_range(XPR):
            if ROWMASK:
                k = (rows0 + st * RW + rw) * XPR + i
                vals = vals + (tl.load(xp + st * RW * XPR + i, mask=k < k_lim, other=0.0).to(tl.float32)[:, None],)
            else:
                vals = vals + (tl.load(xp + st * RW * XPR + i).to(tl.float32)[:, None],)
    return vals


def _awq_gemv_tile(accs, vals, s_ptr, z_ptr, magic, N, k0, cols2d, mask2d, BITS: tl.constexpr,
                   AWQ_ORDER: tl.constexpr, GROUP: tl.constexpr, STEPS: tl.constexpr):
    """M = 1, N-packed words, CUDA cores, on [RW, BNW] word tiles (a row per warp, the
    columns across lanes): the sum over k stays inside each thread (FFMA chains; warps are
    summed once, at the end); ~3 ops per weight (LOP3, FADD, FFMA). The tile lies in one
    group: the scale multiplies the tile's partial sums once."""
    PF: tl.constexpr = 32 // BITS
    g_off = (k0 // GROUP) * N
    zcs = ()
    scs = ()
    parts = ()
    for j in tl.static_range(PF):  # scale / zero rows in the word tile's shape (see cols2d)
        s = tl.load(s_ptr + g_off + cols2d + j, mask=mask2d, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g_off + cols2d + j, mask=mask2d, other=0).to(tl.float32)
        zc, sc = _zs(z, s, j, BITS, AWQ_ORDER)
        zcs = zcs + (zc,)
        scs = scs + (sc,)
        parts = parts + (tl.zeros_like(accs[j]),)
    for st in tl.static_range(STEPS):
        w_lo = vals[st] | magic
        w_hi = (vals[st] >> 16) | magic
        new = ()
        for j in tl.static_range(PF):
            new = new + (parts[j] + vals[STEPS + st] * (_qf(w_lo, w_hi, j, BITS, AWQ_ORDER) - zcs[j]),)
        parts = new
    new = ()
    for j in tl.static_range(PF):
        new = new + (accs[j] + parts[j] * scs[j],)
    return new


def _gptq_gemv_tile(acc, vals, s_ptr, z_ptr, magic, N, t, cols2d, mask2d, BITS: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_K: tl.constexpr, STEPS: tl.constexpr):
    """M = 1, K-packed words, CUDA cores, on [RW, BLOCK_N] word tiles: field i of word row r
    multiplies x[PF*r + i]. Fields with equal in-place offset 2**E (NC = 16 / BITS classes)
    share a partial sum, scaled once per tile (the tile lies in one group)."""
    PF: tl.constexpr = 32 // BITS
    NC: tl.constexpr = 16 // BITS
    g_off = (t * BLOCK_K // GROUP) * N
    s = tl.load(s_ptr + g_off + cols2d, mask=mask2d, other=0.0).to(tl.float32)  # the tile's shape (see cols2d)
    z = tl.load(z_ptr + g_off + cols2d, mask=mask2d, other=0).to(tl.float32)
    zcs = ()
    scs = ()
    parts = ()
    for c in tl.static_range(NC):
        zc, sc = _zs(z, s, c, BITS, False)
        zcs = zcs + (zc,)
        scs = scs + (sc,)
        parts = parts + (tl.zeros_like(acc),)
    for st in tl.static_range(STEPS):
        w_lo = vals[st] | magic
        w_hi = (vals[st] >> 16) | magic
        new = ()
        for c in tl.static_range(NC):
            p = parts[c]
            for h in tl.static_range(PF // NC):
                p = p + vals[STEPS + st * PF + c + h * NC] * (_qf(w_lo, w_hi, c + h * NC, BITS, False) - zcs[c])
            new = new + (p,)
        parts = new
    for c in tl.static_range(NC):
        acc = acc + parts[c] * scs[c]
    return acc


def _awq_dot_tile(accs, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, NW, K, stride_xm, k0, offs_m, offs_nw, mask_nw,
                  BITS: tl.constexpr, AWQ_ORDER: tl.constexpr, GROUP: tl.constexpr, ROW_SCALES: tl.constexpr,
                  EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr, SWAP: tl.constexpr,
                  FP32_DOT: tl.constexpr):
    """N-packed words, tensor cores: field j of the word tile ([BLOCK_K, BNW]; SWAP: loaded as
    [BNW, BLOCK_K]) is the weight of columns PF*n + j; one MMA and one accumulator per field.
    The words are never reshaped."""
    PF: tl.constexpr = 32 // BITS
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mk = (offs_k < K) | EVEN_K
    mm = offs_m < M
    if SWAP:
        x = tl.load(x_ptr + offs_k[:, None] + offs_m[None, :] * stride_xm, mask=mk[:, None] & mm[None, :], other=0.0)
        w = tl.load(qw_ptr + offs_k[None, :] * NW + offs_nw[:, None], mask=mk[None, :] & mask_nw[:, None], other=0)
    else:
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mm[:, None] & mk[None, :], other=0.0)
        w = tl.load(qw_ptr + offs_k[:, None] * NW + offs_nw[None, :], mask=mk[:, None] & mask_nw[None, :], other=0)
    # a compile-time magic here: with the run-time one Triton no longer loads the words straight
    # into the MMA operand layout and converts every dequantized tile through shared memory
    w_lo = w | 0x4B000000
    w_hi = (w >> 16) | 0x4B000000
    new = ()
    for j in tl.static_range(PF):
        cols = offs_nw * PF + j
        if ROW_SCALES:  # one scale row per tile
            s, z = _row_scales(s_ptr, z_ptr, (k0 // GROUP) * N, cols, mask_nw, SWAP)
        else:
            s, z = _group_tile(s_ptr, z_ptr, (offs_k // GROUP) * N, cols, mk, mask_nw, SWAP)
        zc, sc = _zs(z, s, j, BITS, AWQ_ORDER)
        d = _qf(w_lo, w_hi, j, BITS, AWQ_ORDER) - zc
        if MODE == 2:  # the MMA sees the exact integers (q - z) * 2**E; the scale row comes after
            new = new + (accs[j] + _dot(None, x, d, SWAP, FP32_DOT) * sc,)
        else:
            new = new + (_dot(accs[j], x, d * sc, SWAP, FP32_DOT),)
    return new


def _awq_joined_tile(acc, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, NW, K, stride_xm, k0, offs_m, offs_nw, mask_nw,
                     BITS: tl.constexpr, AWQ_ORDER: tl.constexpr, GROUP: tl.constexpr, ROW_SCALES: tl.constexpr,
                     EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    """MODE 3 (larger M): the PF dequantized fields of the word tile are joined (in-thread) into
    the natural [BLOCK_K, BLOCK_N] weight tile and ONE MMA per tile updates a single
    [BLOCK_M, BLOCK_N] accumulator (wgmma's B operand goes through shared memory anyway)."""
    PF: tl.constexpr = 32 // BITS
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mk = (offs_k < K) | EVEN_K
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=(offs_m < M)[:, None] & mk[None, :],
                other=0.0)
    w = tl.load(qw_ptr + offs_k[:, None] * NW + offs_nw[None, :], mask=mk[:, None] & mask_nw[None, :], other=0)
    w_lo = w | 0x4B000000  # compile-time magic: see _awq_dot_tile
    w_hi = (w >> 16) | 0x4B000000
    vals = ()
    for j in tl.static_range(PF):
        cols = offs_nw * PF + j
        if ROW_SCALES:
            s, z = _row_scales(s_ptr, z_ptr, (k0 // GROUP) * N, cols, mask_nw, False)
        else:
            s, z = _group_tile(s_ptr, z_ptr, (offs_k // GROUP) * N, cols, mk, mask_nw, False)
        zc, sc = _zs(z, s, j, BITS, AWQ_ORDER)
        if FP32_DOT:
            vals = vals + ((_qf(w_lo, w_hi, j, BITS, AWQ_ORDER) - zc) * sc,)
        else:
            vals = vals + (((_qf(w_lo, w_hi, j, BITS, AWQ_ORDER) - zc) * sc).to(x.dtype),)
    return _dot(acc, x, tl.reshape(_join_tree(vals, PF), (BLOCK_K, BLOCK_N)), False, FP32_DOT)


def _gptq_joined_tile(acc, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, stride_xm, t, offs_m, offs_n, mask_n,
                      BITS: tl.constexpr, GROUP: tl.constexpr, ROW_SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr):
    """MODE 3 for K-packed words: fields joined to [BKW, BLOCK_N, PF], moved to [BKW, PF,
    BLOCK_N] = the natural [BLOCK_K, BLOCK_N] tile (row PF*r + i), one MMA with x[:, tile]."""
    PF: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PF
    offs_kw = t * BKW + tl.arange(0, BKW)
    mkw = (offs_kw < K // PF) | EVEN_K
    offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=(offs_m < M)[:, None] & ((offs_k < K) | EVEN_K)[None, :], other=0.0)
    w = tl.load(qw_ptr + offs_kw[:, None] * N + offs_n[None, :], mask=mkw[:, None] & mask_n[None, :], other=0)
    w_lo = w | 0x4B000000  # compile-time magic: see _awq_dot_tile
    w_hi = (w >> 16) | 0x4B000000
    if ROW_SCALES:
        s, z = _row_scales(s_ptr, z_ptr, (t * BLOCK_K // GROUP) * N, offs_n, mask_n, False)
    vals = ()
    for i in tl.static_range(PF):
        if not ROW_SCALES:
            s, z = _group_tile(s_ptr, z_ptr, (offs_kw * PF + i) // GROUP * N, offs_n, mkw, mask_n, False)
        zc, sc = _zs(z, s, i, BITS, False)
        if FP32_DOT:
            vals = vals + ((_qf(w_lo, w_hi, i, BITS, False) - zc) * sc,)
        else:
            vals = vals + (((_qf(w_lo, w_hi, i, BITS, False) - zc) * sc).to(x.dtype),)
    if PF == 8:
        wt = tl.permute(_join_tree(vals, PF), (0, 2, 3, 4, 1))
    else:
        wt = tl.permute(_join_tree(vals, PF), (0, 2, 3, 1))
    return _dot(acc, x, tl.reshape(wt, (BLOCK_K, BLOCK_N)), False, FP32_DOT)


def _gptq_dot_tile(acc, x_ptr, qw_ptr, s_ptr, z_ptr, M, N, K, stride_xm, t, offs_m, offs_n, mask_n,
                   BITS: tl.constexpr, GROUP: tl.constexpr, ROW_SCALES: tl.constexpr, EVEN_K: tl.constexpr,
                   BLOCK_K: tl.constexpr, MODE: tl.constexpr, SWAP: tl.constexpr, FP32_DOT: tl.constexpr):
    """K-packed words, tensor cores: field i of word rows r is the weight of k = PF*r + i; it
    multiplies the stride-PF gather x[:, PF*r + i] (x is small and cached). One accumulator.
    SWAP: tiles loaded transposed, as in :func:`_awq_dot_tile`."""
    PF: tl.constexpr = 32 // BITS
    BKW: tl.constexpr = BLOCK_K // PF
    offs_kw = t * BKW + tl.arange(0, BKW)
    mkw = (offs_kw < K // PF) | EVEN_K
    mm = offs_m < M
    if SWAP:
        w = tl.load(qw_ptr + offs_kw[None, :] * N + offs_n[:, None], mask=mkw[None, :] & mask_n[:, None], other=0)
        xp = x_ptr + (offs_kw * PF)[:, None] + offs_m[None, :] * stride_xm
        mask_x = mkw[:, None] & mm[None, :]
    else:
        w = tl.load(qw_ptr + offs_kw[:, None] * N + offs_n[None, :], mask=mkw[:, None] & mask_n[None, :], other=0)
        xp = x_ptr + offs_m[:, None] * stride_xm + (offs_kw * PF)[None, :]
        mask_x = mm[:, None] & mkw[None, :]
    if ROW_SCALES:
        s, z = _row_scales(s_ptr, z_ptr, (t * BLOCK_K // GROUP) * N, offs_n, mask_n, SWAP)
    if MODE == 2:  # exact integer weights (fields shifted down: one zero point), one scale row after
        zc = z + 8388608.0
        tacc = tl.zeros_like(acc)
        for i in tl.static_range(PF):
            q = (((w >> (i * BITS)) & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True)
            tacc = _dot(tacc, tl.load(xp + i, mask=mask_x, other=0.0), q - zc, SWAP, FP32_DOT)
        acc = acc + tacc * s
    else:
        w_lo = w | 0x4B000000  # compile-time magic: see _awq_dot_tile
        w_hi = (w >> 16) | 0x4B000000
        for i in tl.static_range(PF):
            if not ROW_SCALES:
                s, z = _group_tile(s_ptr, z_ptr, (offs_kw * PF + i) // GROUP * N, offs_n, mkw, mask_n, SWAP)
            zc, sc = _zs(z, s, i, BITS, False)
            acc = _dot(acc, tl.load(xp + i, mask=mask_x, other=0.0), (_qf(w_lo, w_hi, i, BITS, False) - zc) * sc, SWAP,
                       FP32_DOT)
    return acc


def _store_tile(acc, out_ptr, ws_ptr, cnt_ptr, pid, pid_k, offs_m, offs_n, M, N, stride_om, SPLIT_K: tl.constexpr,
                SERIAL: tl.constexpr):
    """fp32 ``acc`` [len(offs_m), len(offs_n)] of program ``pid`` -> ``out`` (masked to M x N).
    Split-K, SERIAL: the partial goes to ``ws`` [SPLIT_K, M, N] fp32; the last program of the
    tile to arrive (a counter in ``cnt`` that it resets) sums them in split order
    (deterministic) and stores: one launch. Else atomic adds into ``out`` (zeroed by the caller)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    elif SERIAL:
        ws_tile = ws_ptr + offs_m[:, None] * N + offs_n[None, :]  # ws [SPLIT_K, M, N] fp32 (< 2**31 elements)
        tl.store(ws_tile + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the (releasing) count
        if tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel") == SPLIT_K - 1:
            # last arrival: all partials are complete; summed in split order (deterministic)
            acc = tl.load(ws_tile, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):
                acc += tl.load(ws_tile + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid, 0)  # ready for the next launch (and CUDA graph replay)
    else:
        tl.atomic_add(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


HELPERS = ("_qf", "_zs", "_row_scales", "_group_tile", "_join_tree", "_dot", "_gemv_load", "_awq_gemv_tile", "_gptq_gemv_tile",
           "_awq_dot_tile", "_awq_joined_tile", "_gptq_joined_tile", "_gptq_dot_tile", "_store_tile")
