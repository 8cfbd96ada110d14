"""The CPU mirror of ``w4_mma_dequant`` (w4_mma.cu), the prefill path's dequantization of the
int4 mma layout to W^T, thread by thread with the kernel's index arithmetic and rounding, for
tests/w4_mma_emulate.py's stand-in kernels. Keep it in step with the .cu file."""
from __future__ import annotations

import numpy as np

from w4_mma_emulate_io import rnd


def dequant_emu(dtype, wq, sc, zp, N, KC, GC):
    """``w4_mma_dequant``: W^T [N * K] float64 (rounded to ``dtype``)."""
    NBLK = N >> 6
    wt = np.full(N * KC * 64, np.nan)
    for idx in range(NBLK * KC * 128):
        lane, tile = idx & 31, (idx >> 5) & 3
        rest = idx >> 7
        c, nblk = rest % KC, rest // KC
        g, t = lane >> 2, lane & 3
        v = wq[4 * idx: 4 * idx + 4].astype(np.int64)
        gq = ((c // GC) * NBLK + nblk) * 8 + g
        for r in range(2):
            s = float(sc[gq * 8 + 2 * tile + r: gq * 8 + 2 * tile + r + 1].view(np.float16)[0])
            z = (int(zp[gq * 2 + (tile >> 1)]) >> (8 * (tile & 1) + 4 * r)) & 15
            vals = []
            for i in range(4):
                for e in range(4):
                    bit = 4 * (2 * (e >> 1) + r) + 16 * (e & 1)
                    vals.append(((v[i] >> bit) & 15) - z)
            vals = rnd(np.array(vals) * s, dtype)
            row = nblk * 64 + tile * 16 + g + 8 * r
            o = row * KC * 64 + c * 64 + 16 * t
            wt[o:o + 16] = vals
    return wt
