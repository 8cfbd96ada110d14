"""CPU emulation (numpy) of the flash_decode kernels' exact indexing, for checking the
CUDA code without a GPU: which thread copies which 16-byte vector of which key into
which ring slot, the key-group shuffles, the running-max rescales, the warp and program
combines and the split merge are all mirrored from kernels.cu, thread by thread (the
threads of one program are numpy rows). Memory the kernels must never use is poisoned
with NaN: cache slots past each request's length, the shared-memory ring before its
first copy, part_out/out before the launch, block-table entries past a request's blocks
(-1, which fails the bounds asserts if read).

    python -m kvforge_plugins.attention.flash_decode.emulate [num_cases]

checks random shapes against a plain float64 softmax attention.
"""
from __future__ import annotations

import random
import sys

import numpy as np

from kvforge_plugins.attention.flash_decode.jit import head_slices, heads_per_program
from kvforge_plugins.attention.flash_decode.plan import plan_splits

LOG2E = np.float32(1.4426950408889634)
LN2 = np.float32(0.6931471805599453)
F32 = np.float32
FLT_MAX = F32(3.402823466e38)
STATS = {"rescales": 0}  # accumulator rescales after a key group's first valid key


def pow2ceil(x: int) -> int:
    p = 1
    while p < x:
        p <<= 1
    return p


class Layout:
    """The constexprs of fd_common.cuh / kernels.cu for (element bytes, HEAD_DIM, GROUP, BLOCK_SIZE)."""

    def __init__(self, elem_bytes: int, head_dim: int, group: int, block_size: int) -> None:
        self.D, self.G, self.BS = head_dim, group, block_size
        self.VEC = 16 // elem_bytes
        self.NV = head_dim // self.VEC
        self.GH = heads_per_program(group)
        self.HSLICES = (group + self.GH - 1) // self.GH
        assert self.HSLICES == head_slices(group)
        self.VPL = 2 if (self.GH <= 4 and self.NV >= 2) else 1
        self.EPL = self.VPL * self.VEC
        self.LPK = pow2ceil((self.NV + self.VPL - 1) // self.VPL)
        self.KPW = 32 // self.LPK
        self.NWARPS, self.NT = 4, 128
        self.UNROLL = 2 // self.VPL
        self.STAGES = 4
        self.WKEYS = self.KPW * self.UNROLL
        self.PKEYS = self.NWARPS * self.WKEYS
        assert head_dim % self.VEC == 0 and 1 <= self.NV <= 32 and self.LPK * self.VPL >= self.NV
        assert block_size % self.UNROLL == 0

    def owns(self, r, j):
        return (self.NV == self.LPK * self.VPL) | (r + j * self.LPK < self.NV)


def _xor(x: np.ndarray, tid: np.ndarray, o: int) -> np.ndarray:
    """__shfl_xor_sync(x, o) for all threads of a program (axis 0 = thread)."""
    return x[(tid // 32) * 32 + ((tid % 32) ^ o)]


def fd_partial(lay: Layout, q_flat, q_row_stride, kv_flat, kv_half, block_table, seq_lens, row_tok, row_req,
               num_kv_heads, partition, num_splits, scale, part_out, part_lse, out_flat, out_row_stride):
    """Runs every program of the grid (num_kv_heads * HSLICES, num_splits, rows)."""
    D, G, BS, GH, VEC, VPL, EPL, LPK = lay.D, lay.G, lay.BS, lay.GH, lay.VEC, lay.VPL, lay.EPL, lay.LPK
    NT, S, U, PKEYS, WKEYS = lay.NT, lay.STAGES, lay.UNROLL, lay.PKEYS, lay.WKEYS
    tid = np.arange(NT)
    warp, lane = tid // 32, tid % 32
    g, r = lane // LPK, lane % LPK
    max_blocks = block_table.shape[1]
    num_heads = num_kv_heads * G
    for row in range(len(row_tok)):
        for split in range(num_splits):
            for bx in range(num_kv_heads * lay.HSLICES):
                hk, hs = bx // lay.HSLICES, bx % lay.HSLICES
                tok, req = int(row_tok[row]), int(row_req[row])
                seq_len = int(seq_lens[req])
                head0 = hk * G + hs * GH
                nh = min(GH, G - hs * GH)
                qf = np.zeros((NT, GH, EPL), F32)
                for h in range(nh):
                    for j in range(VPL):
                        own = lay.owns(r, j)
                        for e in range(VEC):
                            idx = tok * q_row_stride + (head0 + h) * D + (r + j * LPK) * VEC + e
                            qf[own, h, j * VEC + e] = q_flat[idx[own]] * (F32(scale) * LOG2E)
                start = split * partition
                end = min(start + partition, seq_len)
                if start >= end:
                    if num_splits > 1:
                        for t in range(nh):
                            part_lse[(row * num_heads + head0 + t) * num_splits + split] = -np.inf
                    continue
                m = np.full((NT, GH), -FLT_MAX, F32)
                l = np.zeros((NT, GH), F32)
                acc = np.zeros((NT, GH, EPL), F32)
                tok_stride = num_kv_heads * D
                blk_stride = BS * tok_stride
                kvh = hk * D + np.where((lay.NV == LPK * VPL) | (r < lay.NV), r * VEC, 0)
                ring = np.full((S, U, 2, VPL, NT, VEC), np.nan, F32)  # uninitialised shared memory
                my_key = warp * WKEYS + g * U

                def lookup(key0):
                    ok = key0 < end
                    idx = key0 // BS
                    assert (idx[ok] < max_blocks).all()
                    b = np.where(ok, block_table[req, np.where(ok, idx, 0)], 0)
                    assert (b[ok] >= 0).all(), "read a block-table entry past the request's blocks"
                    return b

                def issue(t, key0, blk, active):
                    slot = t & (S - 1)
                    src = kvh + blk.astype(np.int64) * blk_stride + (key0 % BS) * tok_stride
                    for u in range(U):
                        for c in range(2):
                            for j in range(VPL):
                                ok = (key0 + u < end) & lay.owns(r, j)
                                vo = np.where(lay.owns(r, j), j * LPK * VEC, 0)
                                a = src + (kv_half if c else 0) + u * tok_stride + vo
                                assert ((a >= 0) & (a + VEC <= kv_flat.size))[active].all(), "copy address"
                                for i in np.nonzero(active)[0]:
                                    ring[slot, u, c, j, i] = kv_flat[a[i]:a[i] + VEC] if ok[i] else 0.0

                all_threads = np.ones(NT, bool)
                key_issue = start + my_key
                blk = lookup(key_issue)
                for t in range(S - 1):
                    nb = lookup(key_issue + PKEYS)
                    issue(t, key_issue, blk, all_threads)
                    blk = nb
                    key_issue = key_issue + PKEYS
                key0 = start + my_key
                t = 0
                while True:
                    act = key0 - g * U < end  # per thread; uniform within a warp
                    assert all(len(set(act[w * 32:(w + 1) * 32])) == 1 for w in range(4))
                    if not act.any():
                        break
                    nb = lookup(key_issue + PKEYS)
                    issue(t + S - 1, np.where(act, key_issue, 0), blk, act)
                    blk = np.where(act, nb, blk)
                    key_issue = np.where(act, key_issue + PKEYS, key_issue)
                    slot = t & (S - 1)
                    s = np.zeros((NT, U, GH), F32)
                    kf = np.zeros((NT, U, EPL), F32)
                    vf = np.zeros((NT, U, EPL), F32)
                    for u in range(U):
                        for j in range(VPL):
                            own = lay.owns(r, j)
                            kf[own, u, j * VEC:(j + 1) * VEC] = ring[slot, u, 0, j, own]
                            vf[own, u, j * VEC:(j + 1) * VEC] = ring[slot, u, 1, j, own]
                    for u in range(U):
                        for h in range(GH):
                            parts = [(qf[:, h, j * VEC:(j + 1) * VEC] * kf[:, u, j * VEC:(j + 1) * VEC])
                                     .sum(1, dtype=F32) for j in range(VPL)]
                            s[:, u, h] = np.sum(parts, axis=0, dtype=F32)
                    o = 1
                    while o < LPK:
                        s = s + _xor(s, tid, o)
                        o <<= 1
                    for u in range(U):
                        s[key0 + u >= end, u, :] = -np.inf
                    cm = s.max(axis=1)
                    grow = (cm > m + F32(8)).any(axis=1) & act  # RESCALE_SLACK
                    STATS["rescales"] += int((grow & (m > -FLT_MAX).all(axis=1)).sum())
                    mn = np.maximum(m, cm)
                    alpha = np.exp2(m - mn).astype(F32)
                    m = np.where(grow[:, None], mn, m)
                    l = np.where(grow[:, None], l * alpha, l)
                    acc = np.where(grow[:, None, None], acc * alpha[:, :, None], acc)
                    for u in range(U):
                        p = np.exp2(s[:, u, :] - m).astype(F32)
                        l = np.where(act[:, None], l + p, l)
                        acc = np.where(act[:, None, None], acc + p[:, :, None] * vf[:, u, None, :], acc)
                    key0 = np.where(act, key0 + PKEYS, key0)
                    t += 1
                # key groups -> warp
                mw = m.copy()
                o = LPK
                while o < 32:
                    mw = np.maximum(mw, _xor(mw, tid, o))
                    o <<= 1
                sc = np.exp2(m - mw).astype(F32)
                lh, a = l * sc, acc * sc[:, :, None]
                o = LPK
                while o < 32:
                    lh, a = lh + _xor(lh, tid, o), a + _xor(a, tid, o)
                    o <<= 1
                # warps -> program
                cmax = np.full((4, GH), np.nan, F32)
                csum = np.full((4, GH), np.nan, F32)
                cacc = np.full((4, GH, D), np.nan, F32)
                for w in range(4):
                    cmax[w], csum[w] = mw[w * 32], lh[w * 32]
                    for ln in range(LPK):
                        for j in range(VPL):
                            if lay.owns(ln, j):
                                d0 = (ln + j * LPK) * VEC
                                cacc[w, :, d0:d0 + VEC] = a[w * 32 + ln, :, j * VEC:(j + 1) * VEC]
                for i in range(nh * D):
                    h, d = i // D, i % D
                    mx = cmax[:, h].max()
                    scw = np.exp2(cmax[:, h] - mx).astype(F32)
                    den = (csum[:, h] * scw).sum(dtype=F32)
                    num = (cacc[:, h, d] * scw).sum(dtype=F32)
                    o_ = num / den
                    if num_splits == 1:
                        out_flat[tok * out_row_stride + (head0 + h) * D + d] = o_
                    else:
                        pidx = (row * num_heads + head0 + h) * num_splits + split
                        part_out[pidx * D + d] = o_
                        if d == 0:
                            part_lse[pidx] = (mx + np.log2(den)) * LN2


def fd_merge(D, part_out, part_lse, row_tok, num_heads, num_splits, out_flat, out_row_stride):
    MW = 8
    for row in range(len(row_tok)):
        for head in range(num_heads):
            base = (row * num_heads + head) * num_splits
            mx = part_lse[base:base + num_splits].max()
            red = np.zeros((MW, D), F32)
            red_den = np.zeros(MW, F32)
            for w in range(MW):
                for s in range(w, num_splits, MW):
                    lse = part_lse[base + s]
                    live = lse != -np.inf
                    wt = F32(np.exp(lse - mx)) if live else F32(0)
                    red_den[w] += wt
                    x = part_out[(base + s) * D:(base + s + 1) * D]
                    red[w] += np.where(live, wt * x, F32(0))
            dsum = red_den.sum(dtype=F32)
            v = red.sum(0, dtype=F32)
            out_flat[int(row_tok[row]) * out_row_stride + head * D + np.arange(D)] = v / dsum if dsum > 0 else 0


def check_case(rng: random.Random, elem_bytes: int, D: int, G: int, BS: int, hkv: int, seqs, partition=None,
               num_sms=132, q_gain=1.0, verbose=False) -> float:
    """One random batch; returns the max relative error vs float64 softmax attention. A large
    ``q_gain`` spreads the scores so the running max passes the rescale slack mid-stream."""
    lay = Layout(elem_bytes, D, G, BS)
    nrs = np.random.default_rng(rng.randrange(1 << 30))
    hq = hkv * G
    nblk = [-(-s // BS) for s in seqs]
    total = sum(nblk) + 2
    ids = list(range(total))
    rng.shuffle(ids)
    width = max(nblk) + rng.randrange(0, 3)
    table = np.full((len(seqs), width), -1, np.int64)  # poisoned past each request's blocks
    pos = 0
    cache = np.full((2, total, BS, hkv, D), np.nan, F32)
    for i, (s, n) in enumerate(zip(seqs, nblk)):
        table[i, :n] = ids[pos:pos + n]
        pos += n
        for p in range(s):
            b = table[i, p // BS]
            cache[:, b, p % BS] = nrs.standard_normal((2, hkv, D)).astype(np.float16 if elem_bytes < 4 else F32)
    # Mixed batch: decode rows sit at scattered token indices; q/out rows padded (row stride > Hq * D).
    T = len(seqs) + rng.randrange(0, 4)
    row_tok = np.array(sorted(rng.sample(range(T), len(seqs))), np.int64)
    row_req = np.arange(len(seqs))
    rng.shuffle(row_req)
    q_stride = hq * D + rng.choice([0, 8, 3 * D])
    o_stride = hq * D + rng.choice([0, 16, D])
    q_flat = (q_gain * nrs.standard_normal(T * q_stride)).astype(np.float16 if elem_bytes < 4 else F32).astype(F32)
    q_flat.reshape(T, q_stride)[:, hq * D:] = np.nan  # row padding: must never be read
    out_flat = np.full(T * o_stride, np.nan, F32)
    if partition is None:
        splits, part = plan_splits(len(seqs), hkv, max(seqs), BS, num_sms)
    else:
        part = partition
        splits = -(-max(seqs) // part)
    part_out = np.full(len(seqs) * hq * splits * D, np.nan, F32)
    part_lse = np.full(len(seqs) * hq * splits, np.nan, F32)
    scale = D ** -0.5
    kv_flat = cache.reshape(-1)
    fd_partial(lay, q_flat, q_stride, kv_flat, cache[0].size, table, np.array(seqs), row_tok, row_req, hkv, part,
               splits, scale, part_out, part_lse, out_flat, o_stride)
    if splits > 1:
        fd_merge(D, part_out, part_lse, row_tok, hq, splits, out_flat, o_stride)
    worst = 0.0
    written = np.zeros(T, bool)
    for i, (tok, req) in enumerate(zip(row_tok, row_req)):
        written[tok] = True
        s = seqs[req]
        blocks = table[req, np.arange(s) // BS]
        k = cache[0, blocks, np.arange(s) % BS].astype(np.float64)  # [s, hkv, D]
        v = cache[1, blocks, np.arange(s) % BS].astype(np.float64)
        qr = q_flat[tok * q_stride: tok * q_stride + hq * D].reshape(hq, D).astype(np.float64)
        got = out_flat[tok * o_stride: tok * o_stride + hq * D].reshape(hq, D)
        for h in range(hq):
            sc = k[:, h // G] @ qr[h] * scale
            p = np.exp(sc - sc.max())
            want = p @ v[:, h // G] / p.sum()
            assert np.isfinite(got[h]).all(), ("unwritten/NaN output", tok, h)
            worst = max(worst, float(np.abs(got[h] - want).max() / (np.abs(want).max() + 1e-6)))
    for tok in range(T):  # rows that are not decode rows stay untouched
        if not written[tok]:
            assert np.isnan(out_flat[tok * o_stride: (tok + 1) * o_stride]).all()
    if verbose:
        print(f"bytes={elem_bytes} D={D} G={G} BS={BS} hkv={hkv} seqs={seqs} splits={splits} part={part} gain={q_gain} "
              f"LPK={lay.LPK} VPL={lay.VPL} PKEYS={lay.PKEYS} err={worst:.2e}")
    return worst


def main(n: int = 40, seed: int = 0) -> None:
    rng = random.Random(seed)
    # Fixed cases first: the benchmark shape (short), edges of every mapping, then random ones.
    cases = [(2, 128, 4, 16, 2, [1, 15, 16, 17, 300], None, 132), (2, 128, 4, 16, 1, [700], 256, 132),
             (2, 128, 8, 16, 2, [33, 1], None, 100000), (4, 128, 4, 32, 2, [5, 64], 32, 132),
             (2, 8, 2, 16, 4, [1, 300], None, 100000), (4, 8, 1, 8, 1, [9], 8, 1),
             (2, 96, 4, 8, 1, [41], 16, 1), (2, 256, 16, 32, 1, [70], 64, 1), (4, 96, 3, 16, 2, [50, 17], 16, 1),
             (2, 160, 9, 8, 1, [26], 8, 1), (2, 16, 5, 8, 2, [3, 40], None, 132), (4, 64, 12, 16, 1, [90], 32, 1)]
    for eb, d, grp, bs in [(2, 96, 3, 8), (2, 8, 2, 16), (2, 16, 5, 32), (2, 256, 12, 16), (4, 96, 9, 8),
                           (2, 160, 4, 32)]:  # test_flash_decode_kernel_lane_mappings' shapes
        for sms in (1, 100000):
            cases.append((eb, d, grp, bs, 2, [1, bs, 701, 3 * bs + 1], None, sms))
    for _ in range(n):
        eb = rng.choice([2, 4])
        D = rng.choice([8, 16, 32, 64, 96, 128] + ([160, 192, 256] if eb == 2 else []))
        G = rng.choice([1, 2, 3, 4, 5, 7, 8, 9, 16])
        BS = rng.choice([8, 16, 32])
        seqs = [rng.choice([1, BS, BS + 1, rng.randrange(1, 400)]) for _ in range(rng.randrange(1, 4))]
        part = rng.choice([None, BS, 2 * BS, 3 * BS, 256])
        cases.append((eb, D, G, BS, rng.choice([1, 2]), seqs, part, rng.choice([1, 132, 100000])))
    worst = 0.0
    for i, (eb, D, G, BS, hkv, seqs, part, sms) in enumerate(cases):
        gain = 1.0 if i % 3 == 0 else 6.0  # 6: log2-scores spread ~12, rescales well past the first key
        worst = max(worst, check_case(rng, eb, D, G, BS, hkv, seqs, part, sms, gain, verbose=True))
    print(f"{len(cases)} cases, worst relative error {worst:.2e}, {STATS['rescales']} thread rescales past "
          "the first key")
    assert STATS["rescales"] > 0
    assert worst < 1e-4, worst


if __name__ == "__main__":
    with np.errstate(over="ignore", invalid="ignore"):
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
