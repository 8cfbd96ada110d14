"""A CPU mirror of ``w4_mma.cu`` (``w4_mma_gemm`` / ``w4_mma_dequant``): the kernels' own
index arithmetic (per CTA, warp and lane; stages, groups, the XS shared-memory copy, the XR ring, the NORM
prologue thread by thread, split-K partials and the last-arriver sum, in a random arrival
order, the ROPE epilogue's stores lane by lane) replayed in numpy with bounds and
alignment checks on every load, and the m16n8k16 MMAs computed from the PTX ISA's fragment
layouts. ``install(monkeypatch)`` puts it behind ``w4_mma.mma_gemm`` (a fake ``kernels()``), so
the host side (``plan``, workspace, XS fallback) runs for real. Keep it in step with the .cu.
(Written by a reviewing helper in session 8; it found the kernel's indexing correct.)
"""
from __future__ import annotations

import random
import re

import numpy as np
import torch

from kvforge_plugins.quant.kernels import w4_mma, w4_mma_jit
from w4_mma_emulate_dequant import dequant_emu
from w4_mma_emulate_io import (bits_to_f, fill_norm_emu, rnd, store_rope, wg_lane_x, wg_ring_emu,  # noqa: F401
                               xr_ring_emu)
from w4_mma_emulate_sched import check_ring_schedule, kernel_schedule
from w4_mma_emulate_ws import _c_expr, check_ws_protocol, ws_lane_reads, ws_layout, ws_protocol, ws_stage_emu



class Flat:
    """A flat array with bounds + alignment checks."""

    def __init__(self, arr, name, esize):
        self.a, self.name, self.esize = arr, name, esize

    def get(self, idx, count, align=None):
        idx = np.asarray(idx)
        assert (idx >= 0).all() and (idx + count <= len(self.a)).all(), f"{self.name}: OOB {idx.min()}..{idx.max()}+{count} of {len(self.a)}"
        if align:
            assert ((idx * self.esize) % align == 0).all(), f"{self.name}: misaligned"
        return np.stack([self.a[idx + k] for k in range(count)], -1)


def _frags(unit, TW, NB, g, t):
    """(tile a, token block b, register f, token [32], output row [32]) of a warp's accumulators."""
    nbase = unit // (4 // TW) * 64 + (unit % (4 // TW)) * TW * 16 + g
    for a in range(TW):
        for b in range(NB):
            for f in range(4):
                yield a, b, f, 8 * b + 2 * t + (f & 1), nbase + 16 * a + 8 * (f >> 1)


def gemm_emu(cfg, dtype, x_bits, M, stride_x, wq, sc, zp, N, KC, gc_rt, cps, splits, norm=None, rope=None):
    """``w4_mma_gemm`` on flat arrays (x as uint16 bits, words uint32, scales fp16 bits as
    uint16, zero-point words uint32) with the kernel's launch constants ``cfg``; returns y [M * N] float64.
    With ``cfg["NORM"]``, ``norm`` is (residual bits [M * K], norm weight bits [K], eps) and
    the result is (y, residual out bits [M, K])."""
    TW, NB, WARPS, S, XS, SA = (int(cfg[k]) for k in ("TW", "NB", "WARPS", "S", "XS", "SCALE_A"))
    NORM = int(cfg.get("NORM", 0))
    ROPE = int(cfg.get("ROPE", 0))  # (rows, head_dim, positions, cos, sin) in ``rope``
    assert not NORM or (XS and M <= 8 and norm is not None), "NORM needs XS, M <= 8 and its operands"
    if NORM:
        R, NW, eps = Flat(norm[0], "residual", 2), Flat(norm[1], "norm weight", 2), norm[2]
        res_out = np.full(M * KC * 64, 0xFFFF, dtype=np.uint16)  # NaN bits until CTA (0, 0) writes
    CPA = int(cfg.get("CPA", 0))
    XR = int(cfg.get("XR", 0))  # x through the CTA's ring of CPA chunk slots
    assert not XR or (CPA and not XS and not NORM), "XR needs CPA, and not XS or NORM"
    WG = int(cfg.get("WG", 0))  # warpgroup MMAs: x from the ring by descriptor
    WST = int(cfg.get("WST", 0))  # WG 2 consumers in trips of CPA chunks (when CPA, GCC and the count allow)
    assert not WG or (XR and TW == 1 and int(cfg.get("KW", 1)) == 1 and WARPS % 4 == 0 and SA and NB in (1, 2, 4, 8)
                      and CPA >= 3)
    if XR and WG != 2:  # the ring's constants as the kernel source has them, and its schedule proved safe
        sched = kernel_schedule()
        dist = check_ring_schedule(CPA, bool(WG), sched)
    if WG == 2:  # the stage layout of w4_wgmma_ws.cuh inside the host's bytes; its mbarrier protocol
        sched, proto, lay = kernel_schedule(), ws_protocol(), ws_layout()
        ws_st = lay["stage"](NB, WARPS)  # (the copies' bounds and overlaps: ws_stage_emu)
        assert lay["wgs"](NB, WARPS) == WARPS // 4, "WG 2: one consumer warpgroup per 64-row block"
        assert proto["align"] == 1024 and ws_st % 1024 == 0, "WG 2: x's 128-byte swizzle needs 1024-byte stages"
        assert CPA * ws_st + 1024 <= w4_mma.xr_bytes(cfg) and w4_mma.stage_bytes(cfg) == 0
    ACT = int(cfg.get("ACT", 0))  # the SwiGLU epilogue: finished rows are kept unrounded, activated at the end
    assert not (ROPE and ACT) and (not ROPE or (rope[0] % 16 == 0 and rope[0] <= N))
    KW = int(cfg.get("KW", 1))
    COLS = WARPS // KW  # columns of warps along N; the KW warps of a column split K
    if KW > 1:  # every fragment slot of the shared-memory sums inside the bytes the host asked for
        slots = {((k - 1) * COLS * TW * NB * 4 + col * TW * NB * 4 + i) * 32 + ln for k in range(1, KW)
                 for col in range(COLS) for i in range(TW * NB * 4) for ln in range(32)}
        assert len(slots) == (KW - 1) * COLS * TW * NB * 128 and 4 * (max(slots) + 1) <= w4_mma.reduce_bytes(cfg)
    if CPA and WG != 2:  # the stages' 16-byte units: one owner each, inside the bytes the host asked for
        units = TW + (0 if XS or XR else 2 * NB) + 2
        addr = {((s * units + u) * 32 * WARPS + tid) * 16 for s in range(CPA) for u in range(units)
                for tid in range(32 * WARPS)}
        assert len(addr) == CPA * units * 32 * WARPS and max(addr) + 16 <= w4_mma.stage_bytes(cfg)
    if CPA and WG != 2:  # the shift read_stage gets for a lane's zero-point word, as the source passes it
        found = set(re.findall(r"read_stage\(cur, [^;]*?, gstart, (.*?)\);", w4_mma_jit.SOURCE))
        assert len(found) == 1, f"read_stage calls pass different zero-point shifts: {found}"
        zsh_expr = found.pop()
    GCC = gc_rt if gc_rt <= 8 else 0
    GC = GCC if GCC > 0 else gc_rt
    units = (N // 16) // TW
    gx = -(-units // COLS)
    NBLK = N >> 6
    lane = np.arange(32)
    g, t = lane >> 2, lane & 3
    X = Flat(x_bits, "x", 2)
    W = Flat(wq, "wq", 4)
    SC = Flat(sc, "sc", 2)
    Z = Flat(zp, "zp", 4)
    ws = np.full(splits * M * N, np.nan)
    out = np.full(M * N, np.nan)
    written = np.zeros(M * N, dtype=np.int64)
    cnt = np.zeros(gx, dtype=np.int64)
    for bx in range(gx):
        order = list(range(splits))
        random.shuffle(order)  # arrival order
        for by in order:
            cbeg, cend = by * cps, min(by * cps + cps, KC)
            assert cbeg < cend, "empty split"
            if XS:
                xpitch = (KC if NORM else cps) * 64 + 8
                xoff = 0 if NORM else cbeg * 64  # NORM: whole rows (each CTA takes their norms)
                assert M * xpitch * 2 == w4_mma.x_bytes(cfg, M, KC * 64, cps, 2)
                if NORM:
                    smem = fill_norm_emu(dtype, X, R, NW, M, stride_x, KC * 64, eps, xpitch, cbeg, cend, 32 * WARPS,
                                         res_out if bx == 0 and by == 0 else None)
                else:
                    smem = np.zeros(M * xpitch, dtype=np.uint16)
                    units_ = (cend - cbeg) * 8  # the columns the CTA's warps read: its split's
                    for u in range(M * units_):
                        row, col = u // units_, cbeg * 64 + (u % units_) * 8
                        at = row * xpitch + col - xoff
                        assert at + 8 <= len(smem) and (at * 2) % 16 == 0
                        smem[at: at + 8] = X.get([row * stride_x + col], 8, align=16)[0]
                XSM = Flat(smem, "xs", 2)
            accs = {}
            ngrp = (cend - cbeg) // GC
            if WG == 2:  # the producer's bulk copy of each chunk's tile to its stage's slot
                blk0 = bx * (WARPS // 4)
                nb = max(0, min(WARPS // 4, NBLK - blk0))  # live blocks: the producer copies theirs only
                seed = random.getrandbits(32)
                try:
                    check_ws_protocol(CPA, ngrp * GC, nb, random.Random(seed), proto, GC=GC,
                                      wst=WST and GCC > 0 and CPA % 2 == 0 and CPA % GCC == 0 and ngrp * GC % 2 == 0)
                except AssertionError as e:
                    raise AssertionError(f"interleaving seed {seed}: {e}") from e
                arrays = {"xt": X.a.view(np.uint8), "wq": W.a.view(np.uint8), "sc": SC.a.view(np.uint8),
                          "zp": Z.a.view(np.uint8)}
                stages = [ws_stage_emu(proto, lay, arrays, NB=NB, WARPS=WARPS, M=M, KC=KC, NBLK=NBLK, GC=GC,
                                       c=cbeg + j, gs=j % GC == 0, blk0=blk0, nb=nb) for j in range(ngrp * GC)]
                xr_slots = [ws_lane_reads(proto, lay, *st, NB=NB, WARPS=WARPS, warp=0, gs=False)["x"] for st in stages]
            elif WG:  # the stages end at a 16-byte aligned shared address: any of them
                base = random.randrange(0, 1024, 16) + w4_mma.stage_bytes(cfg)
                xr_slots = wg_ring_emu(X, M, stride_x, cbeg, ngrp * GC, NB, CPA, 32 * WARPS, w4_mma.xr_bytes(cfg), dist,
                                       sched["align"], base)
            elif XR:
                xr_slots = xr_ring_emu(X, M, stride_x, cbeg, ngrp, GC, KW, NB, CPA, 32 * WARPS, w4_mma.xr_bytes(cfg),
                                       sched["pitch"], dist)
            for warp in range(WARPS):
                kw = warp % KW
                unit = bx * COLS + warp // KW
                nblk = unit // (4 // TW)
                tile0 = (unit % (4 // TW)) * TW
                live = nblk < NBLK
                if not live:
                    continue
                acc = np.zeros((TW, NB, 4, 32))
                nloc = ((ngrp - 1 - kw) // KW + 1) * GC if kw < ngrp else 0

                def chunk_of(j):  # this warp's local chunk j: groups kw, kw + KW, ... of the split
                    return cbeg + ((j // GC) * KW + kw) * GC + j % GC
                wp = nblk * KC * 128 + tile0 * 32 + lane
                rec0 = (nblk * 8 + g) * 8 + 2 * tile0
                rec_step = NBLK * 64
                xp = []
                for b in range(NB):
                    row = np.minimum(b * 8 + g, M - 1)
                    xp.append(row * xpitch + 16 * t - xoff if XS else row * stride_x + 16 * t)

                def load(c, cpa=False):
                    d = {"c": c}
                    d["w"] = [W.get(4 * (wp + c * 128 + a * 32), 4, align=16) for a in range(TW)]
                    if not (XS or XR):
                        d["x"] = [X.get(xp[b] + c * 64, 16, align=16) for b in range(NB)]
                    if c % GC == 0:
                        rec = rec0 + (c // GC) * rec_step
                        d["s"] = SC.get(rec, 2 * TW, align=4 * TW)
                        zw = -(-TW // 2)  # the lane's words: two tiles each
                        d["z"] = Z.get(rec >> 2, zw, align=4 * zw)
                        if not cpa:  # load_stage: TW 1, an odd tile's entries 8 bits down
                            d["z"][:, 0] >>= (4 * (rec & 3)).astype(np.uint32)
                        elif zw == 1:  # read_stage shifts the landed word by the kernel's zsh argument
                            d["z"][:, 0] >>= np.uint32(_c_expr(zsh_expr, tile0=tile0))
                    return d

                def ws_stage(j):  # WG 2: local chunk j's stage, read as this warp's lanes do
                    r = ws_lane_reads(proto, lay, *stages[j], NB=NB, WARPS=WARPS, warp=warp, gs=j % GC == 0)
                    return {"c": chunk_of(j), "w": [r["w"]], **({"s": r["s"], "z": r["z"]} if j % GC == 0 else {})}

                def chunks():  # (j, c, the stage holding chunk c) in the kernel's order of loads
                    if WG == 2:  # full barrier j: the producer's copies of chunk j have landed
                        for j in range(nloc):
                            yield j, chunk_of(j), ws_stage(j)
                        return
                    if CPA:  # cp.async ring: local chunk j + D goes to stage (j + D) % CPA, D = XR_DIST
                        dist = (CPA - 2 if WG else CPA - 1) if not XR else check_ring_schedule(CPA, bool(WG), sched)
                        ring = [None] * CPA
                        for s in range(dist):
                            if s < nloc:
                                ring[s] = load(chunk_of(s), cpa=True)
                        for j in range(nloc):
                            if j + dist < nloc:
                                ring[(j + dist) % CPA] = load(chunk_of(j + dist), cpa=True)
                            yield j, chunk_of(j), ring[j % CPA]
                        return
                    st = [None] * S
                    for s in range(S - 1):
                        if s < nloc:
                            st[s] = load(chunk_of(s))
                    for j0 in range(0, nloc, S):
                        for s in range(S):
                            j = j0 + s
                            if S == 1 and j < nloc:
                                st[0] = load(chunk_of(j))
                            elif S > 1 and j + S - 1 < nloc:
                                st[(s + S - 1) % S] = load(chunk_of(j + S - 1))
                            if j < nloc:
                                yield j, chunk_of(j), st[s]
                zb = sf = sa = tmp = None
                seen = []
                for jl, c, cur in chunks():
                    assert cur["c"] == c and cbeg <= c < cend, "stage holds another chunk"
                    seen.append(c)
                    if XS:
                        cur["x"] = [XSM.get(xp[b] + c * 64, 16, align=16) for b in range(NB)]
                    if WG:
                        cur["x"] = wg_lane_x(xr_slots[jl], NB, g, t, sched["sbo"])
                    elif XR:  # rows 8b + g of this share's part of the slot (no clamp to M - 1)
                        pitch = sched["pitch"] // 2
                        xr = Flat(xr_slots[jl], "x ring", 2)
                        cur["x"] = [xr.get((kw * NB * 8 + 8 * b + g) * pitch + 16 * t, 16, align=16) for b in range(NB)]
                    if jl % GC == 0:
                        assert "s" in cur, "scales not loaded at group start"
                        # zb[h][:, 2a + r]: the zero point half h of the pair subtracts (bits 16h + 8 (a & 1) + 4r
                        # of word a >> 1), as open_group makes the pair
                        zw = cur["z"].astype(np.int64)
                        zb = [np.stack([(zw[:, a >> 1] >> (16 * h + 8 * (a & 1) + 4 * r)) & 15
                                        for a in range(TW) for r in range(2)], -1) for h in range(2)]
                        s16 = cur["s"].astype(np.uint16).view(np.float16).astype(np.float64)  # [32, 2TW]
                        if SA:
                            sa = rnd(s16, dtype)
                        else:
                            sf = s16
                            tmp = np.zeros_like(acc)
                    xv = [bits_to_f(cur["x"][b], dtype) for b in range(NB)]  # [32, 16]
                    for a in range(TW):
                        for i in range(4):
                            w = cur["w"][a][:, i].astype(np.int64)
                            A = np.zeros((16, 16))
                            for j in range(4):
                                r = j & 1
                                for h in range(2):
                                    qv = (w >> (4 * j + 16 * h)) & 15
                                    v = qv - zb[h][:, 2 * a + r]
                                    if SA:
                                        v = rnd(v * sa[:, 2 * a + r], dtype)
                                    A[g + 8 * r, 2 * t + 8 * (j >> 1) + h] = v
                            for b in range(NB):
                                B = np.zeros((16, 8))
                                base = 8 * (i >> 1) + 4 * (i & 1)
                                for rr in range(2):
                                    for h in range(2):
                                        B[2 * t + 8 * rr + h, g] = xv[b][:, base + 2 * rr + h]
                                D = A @ B
                                tgt = acc if SA else tmp
                                for f in range(4):
                                    tgt[a, b, f] += D[g + 8 * (f >> 1), 2 * t + (f & 1)]
                    if not SA and jl % GC == GC - 1:
                        for f in range(4):
                            acc[:, :, f] += sf.T.reshape(TW, 2, 32)[:, f >> 1][:, None, :] * tmp[:, :, f]
                accs[warp] = (acc, seen)
            # the KW warps of a column: their chunks partition the split; warp kw = 0 adds the
            # others' sums in kw order and stores alone
            owners = {}
            for warp, (acc, seen) in sorted(accs.items()):
                col = warp // KW
                if warp % KW == 0:
                    owners[col] = acc.copy()
                    cols_seen = [accs[col * KW + k][1] for k in range(KW)]
                    got = sorted(c for sn in cols_seen for c in sn)
                    assert got == list(range(cbeg, cend)), "a column's warps do not cover the split once"
                else:
                    owners[col] += acc
            for col, acc in owners.items():
                if ROPE and splits == 1:
                    store_rope(out, written, M, N, bx * COLS + col, TW, NB, lambda a, b, f: acc[a, b, f], rope,
                               ROPE == 2, dtype)
                    continue
                for a, b, f, tok, row in _frags(bx * COLS + col, TW, NB, g, t):
                    m = tok < M
                    assert (row < N).all()
                    if splits == 1:
                        out[(tok * N + row)[m]] = acc[a, b, f][m] if ACT else rnd(acc[a, b, f][m], dtype)
                    else:
                        ws[((by * M + tok) * N + row)[m]] = acc[a, b, f][m]
            if splits > 1:
                cnt[bx] += 1
                if cnt[bx] == splits:  # the last arrival sums the partials in split order
                    cnt[bx] = 0
                    for col in range(COLS):
                        if (bx * COLS + col) // (4 // TW) >= NBLK:
                            continue
                        sums = {}
                        for a, b, f, tok, row in _frags(bx * COLS + col, TW, NB, g, t):
                            m = tok < M
                            tot = np.zeros(32)
                            for k in range(splits):
                                v = ws[((k * M + tok) * N + row)[m]]
                                assert not np.isnan(v).any(), "ws read before written"
                                tot[m] += v
                            sums[a, b, f] = tot
                            if not ROPE:
                                out[(tok * N + row)[m]] = tot[m] if ACT else rnd(tot[m], dtype)
                        if ROPE:
                            store_rope(out, written, M, N, bx * COLS + col, TW, NB, lambda a, b, f: sums[a, b, f],
                                       rope, ROPE == 2, dtype)
    assert (cnt == 0).all()
    if ACT:  # gate and up of feature 8T + i are rows 16T + i and 16T + 8 + i
        y = out.reshape(M, N // 16, 2, 8)
        gate, up = y[:, :, 0], y[:, :, 1]
        out = rnd(gate / (1 + np.exp(-gate)) * up, dtype).reshape(-1)
    if ROPE:
        assert (written == 1).all(), "the RoPE epilogue stored an output twice or never"
    return (out, res_out) if NORM else out


class FakeKernels:
    """``w4_mma_jit.W4MmaKernels`` with the launches emulated (records each gemm call)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def gemm(self, x, words, scales, zeros, out, ws, cnt, *, n, group_chunks, chunks_per_split, splits, cfg, smem=0,
             norm=None, rope=None):
        tiles = x.dim() == 3  # WG 2's x tiles [K / 64, M, 64]
        m, k = (x.shape[1], x.shape[0] * 64) if tiles else x.shape
        assert tiles == (cfg.get("WG") == 2) and (not tiles or x.is_contiguous())
        xs = w4_mma.x_bytes(cfg, m, k, chunks_per_split, x.element_size())
        assert smem == max(xs + w4_mma.stage_bytes(cfg) + w4_mma.xr_bytes(cfg), w4_mma.reduce_bytes(cfg),
                           w4_mma.cluster_bytes(cfg))
        if cfg.get("CLU"):  # the splits are one cluster (the kernel sums them in split order, as ws's reader)
            assert cfg["CLU"] == splits and 2 <= splits <= w4_mma.MAX_CLUSTER
        elif splits > 1:
            cols = cfg["WARPS"] // cfg.get("KW", 1)
            assert ws.shape == (splits, m, n) and cnt.numel() >= -(-((n // 16) // cfg["TW"]) // cols)
        # x as a flat view from its data pointer: storage from x's first element
        assert x.stride(-1) == 1
        flat = (x.reshape(-1) if tiles else torch.as_strided(x, ((m - 1) * x.stride(0) + k,), (1,))
                ).contiguous().view(torch.int16).numpy().astype(np.uint16)
        self.calls.append(dict(cfg=dict(cfg), cps=chunks_per_split, splits=splits, smem=smem,
                                      xalign=x.data_ptr() % 16, stride=x.stride(0)))
        assert x.data_ptr() % 16 == 0, f"x misaligned: data_ptr % 16 = {x.data_ptr() % 16}"
        assert x.stride(0) % 8 == 0 or m == 1, "x stride"
        emu_norm = None
        if cfg.get("NORM"):
            res, nw, eps, res_out = norm
            assert res.is_contiguous() and nw.is_contiguous() and res_out.shape == (m, k)
            assert res.data_ptr() % 16 == 0 and nw.data_ptr() % 16 == 0
            emu_norm = tuple(t.reshape(-1).view(torch.int16).numpy().astype(np.uint16) for t in (res, nw)) + (eps,)
        y = gemm_emu(cfg, x.dtype, flat, m, x.stride(0), words.contiguous().view(-1).numpy().view(np.uint32),
                     scales.reshape(-1).view(torch.int16).numpy().view(np.uint16),
                     zeros.reshape(-1).numpy().view(np.uint32), n, k // 64, group_chunks, chunks_per_split, splits, emu_norm,
                     None if not cfg.get("ROPE") else
                     (*rope[:2], *(v.cpu().numpy() if v is not None else None for v in rope[2:])))
        if cfg.get("NORM"):
            y, r_bits = y
            res_out.copy_(torch.from_numpy(r_bits.astype(np.int16)).view(x.dtype).reshape(m, k))
        assert out.shape == (m, n // 2 if cfg.get("ACT") else n)
        out.copy_(torch.from_numpy(y.reshape(out.shape)).to(out.dtype))

    def x_tiles(self, x):  # the reference (the GPU test compares the kernel with it bit for bit)
        return w4_mma.wg_x_tiles(x)

    def dequant(self, words, scales, zeros, wt, *, n, k, group_chunks):
        v = dequant_emu(wt.dtype, words.contiguous().view(-1).numpy().view(np.uint32),
                        scales.reshape(-1).view(torch.int16).numpy().view(np.uint16),
                        zeros.reshape(-1).numpy().view(np.uint32), n, k // 64, group_chunks)
        wt.copy_(torch.from_numpy(v.reshape(n, k)).to(wt.dtype))


def install(monkeypatch, num_sms: int = 132, smem_limit: int = 227 * 1024) -> FakeKernels:
    """Route ``w4_mma.mma_gemm`` to the emulation (as on a GPU with ``num_sms`` SMs)."""
    fk = FakeKernels()
    monkeypatch.setattr(w4_mma_jit, "kernels", lambda: fk)
    monkeypatch.setattr(w4_mma, "_num_sms", lambda index: num_sms)
    monkeypatch.setattr(w4_mma, "_smem_limit", lambda device: smem_limit)
    monkeypatch.setattr(w4_mma, "lookup", lambda *a, **k: None)
    monkeypatch.setattr(w4_mma, "wgmma_capable", lambda device: True)  # WG configs run (emulated) as on an H200
    return fk
