"""Quick GPU check of the XR / WG (1 and 2) configs of the mma W4A16 kernel (few compiles, unlike the
full ``tests/test_quant_w4_mma.py`` grid, whose ``gpu_kernel_cases`` it runs): three shapes x
bf16/fp16 x M in 1..64, each result against the fp32 reference of the dequantized weight
(``BOUND`` as the tests) and re-run for bit-identical replays. Prints the M = 64 rows and every
failure, then the failure count.

    python benchmarks/w4_ring_check.py [--clu]

``--clu`` runs the tests' CLU configs instead (split K summed in a thread block cluster).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_quant_w4_mma import BOUND, GPU_CONFIGS, gpu_kernel_cases  # noqa: E402

CONFIGS = (dict(TW=1, WARPS=4, CPA=4, XR=1, WG=1, SCALE_A=True),
           dict(TW=1, WARPS=8, CPA=3, XR=1, WG=1, SCALE_A=True, split_k=2),
           dict(TW=2, WARPS=8, CPA=4, XR=1, SCALE_A=True),
           dict(TW=2, WARPS=4, KW=2, CPA=3, XR=1, split_k=2),
           dict(TW=1, WARPS=4, CPA=4, XR=1, WG=2, SCALE_A=True),
           dict(TW=1, WARPS=16, CPA=5, XR=1, WG=2, SCALE_A=True, split_k=2))


def main() -> int:
    configs = [c for c in GPU_CONFIGS if c.get("CLU")] if "--clu" in sys.argv[1:] else CONFIGS
    seed = int(time.time())
    gen = torch.Generator().manual_seed(seed)
    bad = 0
    for k, n, group in ((1024, 2048, 128), (768, 320, 256), (512, 192, 64), (576, 256, 64)):  # (9 chunks: odd)
        for dtype in (torch.bfloat16, torch.float16):
            for m, cfg, err, same in gpu_kernel_cases(k, n, group, dtype, configs, (1, 5, 16, 13, 32, 33, 64), gen):
                ok = err <= BOUND[dtype] and same
                bad += not ok
                if not ok or m == 64:
                    print(k, n, group, dtype, m, cfg, f"err {err:.2e}", "ok" if ok else "FAIL", flush=True)
    print(f"seed {seed}: failures {bad}", flush=True)
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
