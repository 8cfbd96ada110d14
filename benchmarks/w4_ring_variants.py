"""Where the time of the mma W4A16 kernel's ring loop (XR, WG) goes, by leaving parts out:
the wgmmas, the deferred wait (``wait0``: each chunk waits for its own wgmmas), the x copies
(``nox``; WG's host-side x reorder, timed alone at the end, stays in),
the per-chunk CTA barrier; then launch-config variants. 14336 x 14336 at M = 64 and 16, bf16
timed in the same run. Wrong outputs by design: timing only.

    python benchmarks/w4_ring_variants.py
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_quant import bench, make_operands, methods  # noqa: E402
from kvforge_plugins.quant.kernels import w4_mma, w4_mma_jit  # noqa: E402

BASE = w4_mma_jit.SOURCE


def rep(a, b, src=BASE):
    assert a in src, a
    return src.replace(a, b)


V = {
    "full": BASE,
    "nomma": rep("    for (int i = 0; i < 4; ++i) wgmma_step(d, fc[i], wg_desc(xs + 32 * i));", ""),
    "wait0": rep("wgmma.wait_group.sync.aligned 1;", "wgmma.wait_group.sync.aligned 0;"),
    "nox": rep("for (int u = threadIdx.x; u < M * 8; u += NT) {\n        const int row = u >> 3, unit = u & 7;",
               "for (int u = threadIdx.x; u < 0; u += NT) {\n        const int row = u >> 3, unit = u & 7;"),
    "nobar": rep("            __syncthreads();  // ... and every thread's", "            //"),
}
WG = dict(NB=8, TW=1, WARPS=8, KW=1, S=1, XS=0, XR=1, WG=1, CPA=4, SCALE_A=True, LDW=1, MINB=1, waves=1)
XR = dict(NB=8, TW=2, WARPS=8, KW=1, S=1, XS=0, XR=1, CPA=4, SCALE_A=True, LDW=1, MINB=1, waves=1)
k = n = 14336
ops = make_operands(k, n)
fns = methods(ops)
for m in (64, 16):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    nb = 8 if m == 64 else 2
    for label, cfg, names in (("WG", WG, ["full", "nomma", "wait0", "nox", "nobar"]),
                              ("WS", {**WG, "WG": 2, "CPA": 6}, ["full"]),
                              ("XR", XR, ["full"])):
        cfg = {**cfg, "NB": nb}
        row = []
        for name in names:
            w4_mma_jit.SOURCE = V[name]
            w4_mma_jit._KERNELS = None
            t = min(bench(lambda v: fns["w4a16-mma"](v, cfg), x, True, rep=30) for _ in range(2))
            row.append(f"{name} {t * 1e6:6.1f}")
        for extra in (({"CPA": 6}, {"WARPS": 16}, {"WARPS": 16, "CPA": 6}, {"WARPS": 16, "CPA": 5},
                       {"WARPS": 4, "MINB": 2, "CPA": 6, "waves": 2})
                      if label == "WG" else
                      ({"CPA": 8}, {"WARPS": 16}, {"WARPS": 16, "CPA": 8}, {"WARPS": 4, "CPA": 8, "MINB": 2, "waves": 2},
                       {"WARPS": 4, "CPA": 8, "waves": 1}) if label == "WS" else ({"CPA": 8},)):
            w4_mma_jit.SOURCE = BASE
            w4_mma_jit._KERNELS = None
            c2 = {**cfg, **extra}
            t = min(bench(lambda v: fns["w4a16-mma"](v, c2), x, True, rep=30) for _ in range(2))
            row.append(f"{extra} {t * 1e6:6.1f}")
        print(f"M={m} {label}: " + " | ".join(row), flush=True)
    t = min(bench(fns["bf16"], x, True, rep=30) for _ in range(2))
    tp = min(bench(w4_mma.chunk_k_order, x, True, rep=30) for _ in range(2))
    print(f"M={m} bf16 {t * 1e6:.1f}  WG's x reorder alone {tp * 1e6:.1f}", flush=True)
