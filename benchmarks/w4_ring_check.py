"""Quick GPU check of the XR / WG configs of the mma W4A16 kernel (few compiles, unlike the
full ``tests/test_quant_w4_mma.py`` grid): three shapes x bf16/fp16 x M in 1..64, each result
against the fp32 reference of the dequantized weight (``BOUND`` as the tests) and re-run for
bit-identical replays. Prints the M = 64 rows and every failure, then the failure count.

    python benchmarks/w4_ring_check.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from kvforge_plugins.quant.kernels import w4_mma  # noqa: E402
from kvforge_plugins.quant.kernels.w4_mma import pack_mma, pack_mma_groups  # noqa: E402
from test_quant_w4_mma import BOUND, _quant  # noqa: E402

CONFIGS = (dict(TW=1, WARPS=4, CPA=4, XR=1, WG=1, SCALE_A=True),
           dict(TW=1, WARPS=8, CPA=3, XR=1, WG=1, SCALE_A=True, split_k=2),
           dict(TW=2, WARPS=8, CPA=4, XR=1, SCALE_A=True),
           dict(TW=2, WARPS=4, KW=2, CPA=3, XR=1, split_k=2))


def main() -> int:
    seed = int(time.time())
    gen = torch.Generator().manual_seed(seed)
    bad = 0
    for k, n, group in ((1024, 2048, 128), (768, 320, 256), (512, 192, 64)):
        q, s, z, w_ref = _quant(k, n, group, gen)
        for dtype in (torch.bfloat16, torch.float16):
            ps, pz = pack_mma_groups(s, z, dtype)
            words, ps, pz, wr = pack_mma(q).cuda(), ps.cuda(), pz.cuda(), w_ref.cuda()
            for m in (1, 5, 16, 13, 32, 33, 64):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                ref = x.float() @ wr
                for cfg in CONFIGS:
                    y = w4_mma.mma_gemm(x, words, ps, pz, group_size=group, n=n, config=cfg)
                    y2 = w4_mma.mma_gemm(x, words, ps, pz, group_size=group, n=n, config=cfg)
                    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                    ok = err <= BOUND[dtype] and torch.equal(y, y2)
                    bad += not ok
                    if not ok or m == 64:
                        print(k, n, group, dtype, m, cfg, f"err {err:.2e}", "ok" if ok else "FAIL", flush=True)
    print(f"seed {seed}: failures {bad}", flush=True)
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
