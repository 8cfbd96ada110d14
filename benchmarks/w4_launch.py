"""Launch the table's W4A16 mma GEMM a few times at one shape, for a profiler: random
AutoAWQ-layout operands as ``bench_quant.py`` makes them.

    ncu --kernel-name w4_mma_gemm --launch-skip 2 --launch-count 1 --section SpeedOfLight \\
        python benchmarks/w4_launch.py --shape 14336x14336 --m 64

``--config-of KxN --time`` instead times the table's config for KxN (same M) at ``--shape``
(CUDA graph, median), e.g. to ask whether a grid's last partial wave costs what a whole one
does: N 16896 gives 14336^2's configs 132 (M = 16) or 1056 (M = 64) CTAs, whole waves.
``--config-m`` runs another M's config, e.g. M = 64's at M = 16: the same kernel with a quarter
of the x bytes (each CTA reads all of x, so x's L2 traffic scales with M).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import GROUP, make_operands, methods  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="14336x14336", help="KxN")
    p.add_argument("--m", type=int, default=64, help="tokens")
    p.add_argument("--launches", type=int, default=4)
    p.add_argument("--config-of", help="KxN: use the table's config of this shape")
    p.add_argument("--config-m", type=int, help="... and of this M (default --m): e.g. M = 16's config at M = 1")
    p.add_argument("--time", action="store_true", help="time it (and bf16) instead")
    a = p.parse_args()
    k, n = (int(v) for v in a.shape.split("x"))
    ops = make_operands(k, n)
    fns = methods(ops)
    fn = fns["w4a16-mma"]
    x = torch.randn(a.m, k, device="cuda", dtype=torch.bfloat16)
    if a.config_of:
        from kvforge_plugins.quant.kernels.choices import lookup
        ck, cn = (int(v) for v in a.config_of.split("x"))
        cm = a.config_m or a.m
        cfg = lookup("w4_mma", cm, cn, ck, x.device)
        assert cfg, f"no table entry for M={cm} {a.config_of}"
        cfg = {key: v for key, v in cfg.items() if key != "schema"}
        fn = (lambda v, c=cfg, base=fns["w4a16-mma"]: base(v, c))
    if a.time:
        from bench_quant import bench
        from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16
        ref = x.float() @ dequantize_wna16(ops["awq_qweight"], ops["awq_scales"], ops["awq_zeros"], bits=4,
                                           group_size=GROUP, pack_k=False, awq_order=True, dtype=torch.float32)
        rel = ((fn(x).float() - ref).abs().max() / ref.abs().max()).item()
        tb, tw = bench(fns["bf16"], x, True), bench(fn, x, True)
        of = f"{a.config_of} M={a.config_m or a.m}" if a.config_of else "its own shape"
        print(f"K={k} N={n} M={a.m} config of {of}: w4a16-mma {tw * 1e6:.1f} us, "
              f"bf16 {tb * 1e6:.1f} us ({tb / tw:.2f}x), rel err {rel:.1e}")
        return 0
    for _ in range(a.launches):
        fn(x)
    torch.cuda.synchronize()
    print(f"launched w4a16-mma {a.launches}x at K={k} N={n} M={a.m}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
