"""Where an mma W4A16 call's time goes, by leaving parts out (no hardware counters needed):
the kernel as is, without its split-K reduction (each split stores its partial sums as the
output), without its main loop (launch + reduction only) and empty (launch only), with the
split rule of the config and with one split. Wrong outputs by design: timing only.

    python benchmarks/w4_mma_variants.py
"""
import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from bench_quant import bench, make_operands, methods
from kvforge_plugins.quant.kernels import w4_mma, w4_mma_jit

BASE = w4_mma_jit.SOURCE
VARIANTS = {
    "full": BASE,
    "noreduce": BASE.replace("if (splits == 1) {", "if (true) {"),
    "noloop": BASE.replace("    if (live) {\n#if CPA\n        int slot", "    if (false) {\n#if CPA\n        int slot"),
    "empty": BASE.replace("    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;", "    if (M > 0) return;\n    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;", 1),
}
for name, src in VARIANTS.items():
    assert name == "full" or src != BASE, name
CFG = {  # the first session-12 sweep's best at M = 1 (before KW; give KW=... to time those)
    (4096, 28672): dict(TW=4, WARPS=4, S=1, CPA=3, XS=0, waves=2),
    (14336, 4096): dict(TW=2, WARPS=4, S=2, CPA=0, XS=0, waves=4),
    (4096, 6144): dict(TW=2, WARPS=4, S=2, CPA=0, XS=0, waves=4),
    (4096, 4096): dict(TW=2, WARPS=4, S=1, CPA=0, XS=0, waves=2),
}
for (k, n), c in CFG.items():
    ops = make_operands(k, n)
    fns = methods(ops)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    cfg = {**w4_mma.CONFIGS[8], **c, "LDW": 1, "MINB": 1, "SCALE_A": False}
    row = []
    for split_k in (None, 1):
        for name, src in VARIANTS.items():
            w4_mma_jit.SOURCE = src
            w4_mma_jit._KERNELS = None
            cc = {**cfg, "split_k": split_k} if split_k else cfg
            t = min(bench(lambda v: fns["w4a16-mma"](v, cc), x, True, rep=30) for _ in range(3))
            row.append(f"{name}{'' if split_k is None else '/nosplit'} {t * 1e6:6.2f}")
    w4_mma_jit.SOURCE = BASE
    w4_mma_jit._KERNELS = None
    _, cps, splits = w4_mma.plan(1, n, k, 128, cfg, 132)
    print(f"K={k} N={n} splits={splits} cps={cps}: " + " | ".join(row), flush=True)
