"""Where the time of the mma W4A16 kernel's ring loops goes, by leaving parts out. 14336 x
14336, bf16 timed in the same run. Wrong outputs by design: timing only.

* WG (x ring + CTA barrier) at M = 64 and 16: the wgmmas, the deferred wait (``wait0``: each
  chunk waits for its own wgmmas), the x copies (``nox``; the host's x reorder, timed alone,
  stays in), the per-chunk CTA barrier; launch-config variants; WG 2 and XR beside.
* WG 2 (producer warp, mbarriers) at M = 64, CPA 8, 4 / 8 / 16 warps: the wgmmas, the
  dequantization (raw words as fragments), the loads (the producer copies nothing and the
  consumers do not wait), and the pairs of these; the x tiles kernel and its torch reference.

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


NOMMA = ("    for (int i = 0; i < 4; ++i) wgmma_step(d, fc[i], d0 + 2 * i);", "")
NODEQ = ("    for (int i = 0; i < 4; ++i) dequant_frag(fc[i], A, word_of(cur.w[0], i), 0);",
         "    for (int i = 0; i < 4; ++i) for (int j = 0; j < 4; ++j) fc[i][j] = word_of(cur.w[0], i) >> j;")
NOLOAD = rep("        if (lane != 0) return;\n        for (int j = 0; j < nloc; ++j) {",
             "        if (lane != 0) return;\n        for (int j = 0; j < 0; ++j) {",
             rep("        mbar_wait(FULL(s), (j / CPA) & 1);", ""))
V = {
    "full": BASE,
    "nomma": rep(*NOMMA),
    "wait0": rep("wgmma.wait_group.sync.aligned 1;", "wgmma.wait_group.sync.aligned 0;"),
    "nox": rep("for (int u = threadIdx.x; u < M * 8; u += NT) {\n        const int row = u >> 3, unit = u & 7;",
               "for (int u = threadIdx.x; u < 0; u += NT) {\n        const int row = u >> 3, unit = u & 7;"),
    "nobar": rep("            __syncthreads();  // ... and every thread's", "            //"),
    "nodeq": rep(*NODEQ),
    "noload": NOLOAD,
    "noload_nomma": rep(*NOMMA, NOLOAD),
    "noload_nodeq": rep(*NODEQ, NOLOAD),
}
WG = dict(NB=8, TW=1, WARPS=8, KW=1, S=1, XS=0, XR=1, WG=1, CPA=4, SCALE_A=True, LDW=1, MINB=1, waves=1)
XR = dict(NB=8, TW=2, WARPS=8, KW=1, S=1, XS=0, XR=1, CPA=4, SCALE_A=True, LDW=1, MINB=1, waves=1)
k = n = 14336
fns = methods(make_operands(k, n))


def timed(fn, x) -> str:
    return f"{min(bench(fn, x, True, rep=30) for _ in range(2)) * 1e6:6.1f}"


def gemm_time(variant: str, cfg: dict, x) -> str:
    w4_mma_jit.SOURCE = V[variant]
    w4_mma_jit._KERNELS = None  # compile the variant
    return timed(lambda v: fns["w4a16-mma"](v, cfg), x)


for m in (64, 16):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    nb = 8 if m == 64 else 2
    for label, cfg, names, extras in (
            ("WG", WG, ["full", "nomma", "wait0", "nox", "nobar"],
             ({"CPA": 6}, {"WARPS": 16}, {"WARPS": 16, "CPA": 6}, {"WARPS": 16, "CPA": 5},
              {"WARPS": 4, "MINB": 2, "CPA": 6, "waves": 2})),
            ("WG 2", {**WG, "WG": 2, "CPA": 6}, ["full"],
             ({"CPA": 8}, {"WARPS": 16}, {"WARPS": 16, "CPA": 8}, {"WARPS": 4, "CPA": 8, "MINB": 2, "waves": 2},
              {"WARPS": 4, "CPA": 8, "waves": 1})),
            ("XR", XR, ["full"], ({"CPA": 8},))):
        cfg = {**cfg, "NB": nb}
        row = [f"{name} {gemm_time(name, cfg, x)}" for name in names]
        row += [f"{extra} {gemm_time('full', {**cfg, **extra}, x)}" for extra in extras]
        print(f"M={m} {label}: " + " | ".join(row), flush=True)
    print(f"M={m} bf16 {timed(fns['bf16'], x)}  WG's x reorder alone {timed(w4_mma.chunk_k_order, x)}", flush=True)

x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
for warps in (4, 16, 8):
    cfg = {**WG, "WG": 2, "WARPS": warps, "CPA": 8}
    row = [f"{name} {gemm_time(name, cfg, x)}" for name in ("full", "nomma", "nodeq", "noload", "noload_nomma",
                                                            "noload_nodeq")]
    print(f"M=64 WG 2, {warps} warps, CPA 8: " + " | ".join(row), flush=True)
w4_mma_jit.SOURCE, w4_mma_jit._KERNELS = BASE, None
print(f"x tiles alone: torch {timed(w4_mma.wg_x_tiles, x)}  kernel {timed(w4_mma_jit.kernels().x_tiles, x)}  "
      f"bf16 {timed(fns['bf16'], x)}", flush=True)
