"""GPU check of the tuned table (``gemm_choices.json``) on the Llama-3-8B shapes it is keyed by.
The tests' GPU cases use small shapes, which no table entry matches, so a tuned entry (a split
count, a stage count) only runs at these shapes. For M in 1 / 2 / 4 / 8 / 16 / 32 / 64 (each
M key the table can hold up to 64), bf16 and fp16:
each plain GEMM through the table (``config=None``), the q|k|v layer with RMSNorm and RoPE
folded in, and the gate|up layer with the SwiGLU epilogue, against the fp32 / fp64 references
of the tests (same bounds). Prints one line per case and the failure count; exit 1 on a failure.

    python benchmarks/w4_table_check.py
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_quant_w4_gate_up import _gate_up_layer, _swiglu_ref  # noqa: E402
from test_quant_w4_mma import BOUND, gpu_kernel_cases  # noqa: E402
from test_quant_w4_prenorm import _norm  # noqa: E402
from test_quant_w4_rope import _err, _qkv_layer, _roped_ref, _rotary  # noqa: E402

MS = (1, 2, 4, 8, 16, 32, 64)
GROUP = 128


def main() -> int:
    seed = int(time.time())
    gen = torch.Generator().manual_seed(seed)
    print("GPU", torch.cuda.get_device_name(), "seed", seed, flush=True)
    bad = 0

    def report(what, m, err, bound, ok=True):
        nonlocal bad
        ok = ok and err <= bound
        bad += not ok
        print(f"  {what} M={m}: err {err:.2e} (bound {bound:.0e}) {'ok' if ok else 'FAIL'}", flush=True)

    for dtype in (torch.bfloat16, torch.float16):
        print(dtype, flush=True)
        for k, n in ((4096, 6144), (4096, 4096), (4096, 14336), (4096, 28672), (14336, 4096), (14336, 14336)):
            for m, _, err, same in gpu_kernel_cases(k, n, GROUP, dtype, [None], MS, gen):
                report(f"GEMM {k}x{n} (deterministic: {same})", m, err, BOUND[dtype], same)
        hq, hk, hd, k = 32, 8, 128, 4096  # q|k|v: N = 6144, RMSNorm and RoPE folded in
        layer, w_ref = _qkv_layer(k, hq, hk, hd, GROUP, dtype, "cuda", gen)
        norm, rotary, w_ref = _norm(k, dtype, gen, "cuda"), _rotary(hd, 8192).cuda(), w_ref.cuda()
        for m in MS:
            x, res = (torch.randn(m, k, device="cuda", dtype=dtype) for _ in range(2))
            positions = torch.randint(0, 8192, (m,), device="cuda")
            with torch.inference_mode():
                y, r = layer.forward_prenorm(x, res, norm, rope=(positions, rotary))
            h_ref, r_ref = norm(x, res)
            ref = _roped_ref(h_ref.double() @ w_ref.double(), positions, rotary, hq, hk, hd, dtype)
            report("q|k|v + norm + RoPE", m, _err(y, ref), BOUND[dtype], torch.equal(r, r_ref))
        del layer, w_ref
        layer, w_ref = _gate_up_layer(14336, 4096, GROUP, dtype, "cuda", gen, backend="auto")
        w_ref = w_ref.cuda()
        for m in MS:
            x = torch.randn(m, 4096, device="cuda", dtype=dtype)
            with torch.inference_mode():
                act = layer.silu_and_mul(x)
            report("gate|up + SwiGLU", m, _err(act, _swiglu_ref(x, w_ref)), BOUND[dtype], layer.wna16_gated)
        del layer, w_ref
        torch.cuda.empty_cache()
    print(f"seed {seed}: failures {bad}", flush=True)
    return int(bad > 0)


if __name__ == "__main__":
    sys.exit(main())
