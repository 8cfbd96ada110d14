"""The CPU mirror of how x comes into ``w4_mma_gemm`` and y goes out, for
tests/w4_mma_emulate.py: the XR ring (``issue_x`` of w4_mma_stages.cuh) and WG's
(``issue_x_wg``, w4_wgmma.cuh) in the CTA's chunk order, the NORM prologue (``fill_x_norm``) thread by thread and the ROPE epilogue
(``store_out``) lane by lane, with the kernels' index arithmetic and roundings. Keep it in step
with the .cuh files."""
from __future__ import annotations

import numpy as np
import torch

#: The dequantizing bias of the layout's packed pairs: BIAS + q is exact in the dtype's mantissa.
BIAS = {torch.bfloat16: 128.0, torch.float16: 1024.0}


def bits_to_f(bits: np.ndarray, dtype) -> np.ndarray:
    """16-bit patterns -> their fp16/bf16 values (float64)."""
    return torch.from_numpy(bits.astype(np.int16)).view(dtype).float().numpy().astype(np.float64)


def rnd(v, dtype):
    """Round to ``dtype`` as the kernel's conversions do (via fp32)."""
    return torch.from_numpy(np.asarray(v, dtype=np.float32)).to(dtype).float().numpy().astype(np.float64)


def _replay(ring, issue, n, dist, CPA, slot_len):
    """A ring's chunk order (XR and WG alike): chunks 0 .. dist - 1 before the loop, then at
    chunk j the copy of chunk j + dist into its slot (after the barrier); returns what chunk j's
    readers see, slot (j % CPA) of ``slot_len`` elements, for j < n."""
    for s in range(min(dist, n)):
        issue(s, s)
    slots = []
    for j in range(n):
        if j + dist < n:
            issue((j + dist) % CPA, j + dist)
        slots.append(ring[(j % CPA) * slot_len:(j % CPA + 1) * slot_len].copy())
    return slots


def xr_ring_emu(X, M, stride_x, cbeg, ngrp, GC, KW, NB, CPA, nt, ring_bytes, pitch_bytes, dist):
    """One CTA's XR ring: the prologue's CPA - 1 chunks, then at each local chunk j the copy of
    chunk j + CPA - 1 into the slot chunk j - 1 used (after the barrier), then what the warps
    read: returns the ring slot of each j as uint16 bits [KW * 8 * NB * pitch] (rows past M
    stay NaN: their tokens' outputs must never be stored). Thread tid copies units tid, tid +
    nt, ...; every copy is checked in bounds, 16-byte aligned and from x's rows < M."""
    pitch = pitch_bytes // 2
    slot_el = NB * 8 * pitch
    ring = np.full(ring_bytes // 2, 0x7FFF, dtype=np.uint16)  # NaN in fp16 and bf16

    def nloc_of(k):
        return ((ngrp - 1 - k) // KW + 1) * GC if k < ngrp else 0

    def chunk_at(j, k):
        return cbeg + j if KW == 1 else cbeg + ((j // GC) * KW + k) * GC + j % GC

    def issue(slot, j):
        per = M * 8
        for tid in range(nt):
            for u in range(tid, KW * per, nt):
                k2, rem = (0, u) if KW == 1 else divmod(u, per)
                if j < nloc_of(k2):
                    r, col = rem >> 3, (rem & 7) * 8
                    at = slot * KW * slot_el + (k2 * NB * 8 + r) * pitch + col
                    assert 0 <= at and at + 8 <= len(ring) and (at * 2) % 16 == 0, "x ring: copy out of bounds"
                    ring[at:at + 8] = X.get(r * stride_x + chunk_at(j, k2) * 64 + col, 8, align=16)
    return _replay(ring, issue, nloc_of(0), dist, CPA, KW * slot_el)




def swizzle128(addr):
    """The 128-byte swizzle of a shared byte address: bits 4-6 XOR bits 7-9."""
    return addr ^ (((addr >> 7) & 7) << 4)


def wg_ring_emu(X, M, stride_x, cbeg, nloc, NB, CPA, nt, ring_bytes, dist, align, base):
    """WG's ring for one CTA (KW 1): ``issue_x_wg`` thread by thread (thread tid copies the
    16-byte units tid, tid + nt, ... of the chunk's M rows, x as the host passes it: chunks in
    the layout's K order, to their 128-byte-swizzled places), CPA - 2 chunks ahead (one chunk's
    wgmmas stay in flight); returns the slot each local chunk j is read from (uint16 bits
    [NB * 512]; rows past M stay NaN). Slot 0 starts at the kernel's rounding of the ring start
    up to ``align`` from ``base`` (the shared address the stages end at), which must leave the
    ring inside the host's ``ring_bytes``. Each unit is checked written once."""
    slot_el = NB * 512
    start = -(-base // align) * align - base  # bytes the kernel skips to reach an aligned slot 0
    assert start + CPA * slot_el * 2 <= ring_bytes, f"WG ring: {start} bytes of alignment overrun the host's bytes"
    ring = np.full(CPA * slot_el, 0x7FFF, dtype=np.uint16)

    def issue(slot, j):
        seen = set()
        for tid in range(nt):
            for u in range(tid, M * 8, nt):
                row, unit = u >> 3, u & 7
                byte = row * 128 + ((unit ^ (row & 7)) << 4)
                at = slot * slot_el + byte // 2
                assert 0 <= at and at + 8 <= CPA * slot_el and at not in seen, "WG ring: copy out of bounds or twice"
                seen.add(at)
                ring[at:at + 8] = X.get(row * stride_x + (cbeg + j) * 64 + unit * 8, 8, align=16)
        assert len(seen) == M * 8, "WG ring: a unit of the chunk was not copied"
    return _replay(ring, issue, nloc, dist, CPA, slot_el)


def wg_lane_x(slot, NB, g, t, sbo):
    """What the warpgroup MMAs multiply a lane's A fragments with, in the mma path's terms: per
    token block b, [32 lanes, 16] with entry 4i + 2s + h = B_i(k = 8s + 2t + h, n = 8b + g), B_i
    read as the descriptor of K step i says: start 32 * i bytes into the (1024-aligned) slot,
    element (k, n) at start + (n // 8) * SBO + (n % 8) * 128 + 2k, then the 128-byte swizzle."""
    out = []
    for b in range(NB):
        v = np.zeros((32, 16), dtype=np.uint16)
        for i in range(4):
            for s in range(2):
                for h in range(2):
                    k, n = 8 * s + 2 * t + h, 8 * b + g
                    byte = swizzle128(32 * i + (n // 8) * sbo + (n % 8) * 128 + 2 * k)
                    v[:, 4 * i + 2 * s + h] = slot[byte // 2]
        out.append(v)
    return out


NORM_BATCH = 2  # w4_mma_io.cuh


def fill_norm_emu(dtype, X, R, NW, M, stride_x, K, eps, xpitch, cbeg, cend, nt, res_out):
    """``fill_x_norm`` thread by thread for one CTA: phase 1 (each thread's units in batches
    of NORM_BATCH: dt(h + r) into the shared rows, squares summed in fp32 in its order, the
    warp's xor-shuffle tree, part[warp][row]); phase 2 (the CTA's K slice: thread tid's units
    tid + i * nt, the norm weight it fetched first, dt(dt(s * rstd) * w)). Returns the shared
    rows (uint16 bits [M * xpitch]); ``res_out`` (uint16 [M * K], or None: not CTA (0, 0)) gets
    dt(h + r). Each shared unit is checked to be written once per phase."""
    units, nw_ = K // 8, nt // 32
    smem = np.zeros(M * xpitch, dtype=np.uint16)
    seen = np.zeros(M * units, dtype=np.int64)
    part = np.zeros((nw_, M), dtype=np.float32)
    for row in range(M):
        ss = np.zeros(nt, dtype=np.float32)
        for tid in range(nt):
            for u0 in range(tid, units, NORM_BATCH * nt):
                for i in range(NORM_BATCH):
                    u = u0 + i * nt
                    if u >= units:
                        continue
                    h = bits_to_f(X.get([row * stride_x + u * 8], 8, align=16)[0], dtype)
                    r = bits_to_f(R.get([row * K + u * 8], 8, align=16)[0], dtype)
                    sv = rnd(h + r, dtype)
                    for e in range(8):  # element order, fp32
                        ss[tid] = np.float32(ss[tid] + np.float32(sv[e]) * np.float32(sv[e]))
                    bits = torch.from_numpy(sv.astype(np.float32)).to(dtype).view(torch.int16).numpy().astype(np.uint16)
                    smem[row * xpitch + u * 8: row * xpitch + u * 8 + 8] = bits
                    seen[row * units + u] += 1
                    if res_out is not None:
                        res_out[row * K + u * 8: row * K + u * 8 + 8] = bits
        for w in range(nw_):  # __shfl_xor_sync over offsets 16, 8, 4, 2, 1: lane 0's value
            v = ss[32 * w: 32 * w + 32].copy()
            for o in (16, 8, 4, 2, 1):
                v = (v + v[np.arange(32) ^ o]).astype(np.float32)
            part[w, row] = v[0]
    assert (seen == 1).all(), "phase 1 wrote a unit twice or never"
    su = (cend - cbeg) * 8
    scaled = np.zeros(M * su, dtype=np.int64)
    for tid in range(nt):
        for u in range(tid, M * su, nt):  # i < NORM_BATCH from wpre, the rest re-read: same unit either way
            row = u // su
            tot = np.float32(0)
            for w in range(nw_):
                tot = np.float32(tot + part[w, row])
            rstd = np.float32(1) / np.sqrt(np.float32(tot / np.float32(K) + np.float32(eps)))
            at = row * xpitch + cbeg * 64 + (u % su) * 8
            sv = bits_to_f(smem[at: at + 8], dtype)
            wv = bits_to_f(NW.get([cbeg * 64 + (u % su) * 8], 8, align=16)[0], dtype)
            y = rnd(rnd(sv * rstd, dtype) * wv, dtype)
            smem[at: at + 8] = torch.from_numpy(y.astype(np.float32)).to(dtype).view(torch.int16).numpy().astype(np.uint16)
            scaled[u] += 1
    assert (scaled == 1).all(), "phase 2 scaled a slice unit twice or never"
    return smem


def store_rope(out, written, M, N, unit, TW, NB, val, rope, rotate, dtype):
    """``store_out``'s ROPE branch for the 32 lanes of one column unit, index by index:
    ``val(a, b, f)`` is fragment f of (tile a, token block b) per lane; rows below rope_rows
    hold dims d (f = 0, 1) and d + hd / 2 (f + 2) of one head (``rope_dim``), rotated by the
    cos / sin that ``rope_load`` fetches (ROPE 2). ``written`` counts stores per output."""
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    rows, hd = rope[0], rope[1]
    nbase = unit // (4 // TW) * 64 + (unit % (4 // TW)) * TW * 16 + g
    for a in range(TW):
        for b in range(NB):
            for f in range(2):
                row0, tok = nbase + 16 * a, 8 * b + 2 * t + f
                m = tok < M
                x1, x2 = val(a, b, f).astype(np.float32), val(a, b, f + 2).astype(np.float32)
                qk = row0 < rows  # rope_rows is a multiple of 16: row0 + 8 is on the same side
                rdim = ((row0 % hd) >> 4) * 8 + (row0 & 7)
                if rotate:
                    pos, cos, sin = rope[2], rope[3], rope[4]
                    use = qk & m
                    at = np.where(use, pos[np.minimum(tok, M - 1)] * (hd // 2) + rdim, 0)
                    c = np.where(use, cos.reshape(-1)[at], 1.0).astype(np.float32)
                    sn = np.where(use, sin.reshape(-1)[at], 0.0).astype(np.float32)
                    x1, x2 = x1 * c - x2 * sn, x2 * c + x1 * sn
                d = row0 - row0 % hd + rdim
                for dest, v in ((np.where(qk, d, row0), x1), (np.where(qk, d + hd // 2, row0 + 8), x2)):
                    assert (dest < N).all()
                    idx = (tok * N + dest)[m]
                    out[idx] = rnd(v[m], dtype)
                    written[idx] += 1
