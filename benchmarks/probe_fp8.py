"""Where an FP8 W8A8 GEMM's time goes, piece by piece, at prefill sizes (M >= 512).

    python benchmarks/probe_fp8.py [--shapes 4096x4096,4096x14336] [--m 512,2048] [--sweep]

Per (K, N, M), CUDA-graph medians (``triton.testing.do_bench_cudagraph``), in microseconds:

* ``bf16``: ``F.linear`` (cuBLAS), the baseline;
* ``quant``: the dynamic per-token activation quantization alone (Triton, one pass per row);
* ``rowwise``: ``torch._scaled_mm`` with [M, 1] x [1, N] fp32 scales made beforehand (no copies);
  ``rowwise-fast``: the same with ``use_fast_accum=True``;
* ``tensorwise``: ``torch._scaled_mm`` with scalar scales (a reference: not the per-token scheme);
* ``path``: what the fp8 plugin runs by default (quantize + ``_scaled_mm`` with fast_accum);
  ``path-exact``: the same with fp32 accumulation (``fast_accum: false``);
* with ``--sweep``: the Triton FP8 GEMM over launch configs (GEMM alone), best printed;
* with ``--quant-sweep``: only the activation quantization, over row block x warps (each
  checked bit-equal to the reference first).
Each GEMM is checked against the fp32 dequantized product first (relative error printed).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kvforge_plugins.quant.kernels.scaled_mm import quantize_act, scaled_mm_torch, scaled_mm_triton
from kvforge_plugins.quant.w8a8 import quantize_weight

SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s)
         for bm, bn, bk, w, s in ((128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 256, 64, 8, 4),
                                  (256, 128, 128, 8, 3), (128, 128, 128, 4, 4), (64, 256, 128, 4, 4),
                                  (128, 256, 128, 8, 4), (256, 128, 64, 8, 4), (128, 128, 64, 4, 5))]


def t_us(fn) -> float:
    import triton.testing as tt
    fn()
    torch.cuda.synchronize()
    return tt.do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def quant_sweep(ks, ms) -> None:
    from kvforge_plugins.quant.kernels.scaled_mm import quantize_act_ref
    for k in ks:
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * torch.rand(m, 1, device="cuda") * 8
            qr, sr = quantize_act_ref(x, torch.float8_e4m3fn)
            ideal = (x.numel() * 3 + m * 4) / 4.27e12 * 1e6
            cells = []
            for block in (1024, 2048, 4096, 8192, 16384):
                for warps in (4, 8, 16, 32):
                    if block < 1024 * warps // 8:
                        continue
                    q, s = quantize_act(x, torch.float8_e4m3fn, max_block=block, num_warps=warps)
                    if not (torch.equal(s, sr) and torch.equal(q.float(), qr.float())):
                        cells.append((float("inf"), f"block {block} warps {warps}: WRONG"))
                        continue
                    t = t_us(lambda: quantize_act(x, torch.float8_e4m3fn, max_block=block, num_warps=warps))
                    cells.append((t, f"block {block} warps {warps}: {t:.1f} us"))
            cells.sort()
            print(f"quant K={k} M={m} (copy-rate floor {ideal:.1f} us): " + "; ".join(c for _, c in cells[:6]),
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="4096x4096,4096x6144,4096x28672,14336x4096")
    p.add_argument("--m", default="512,1024,2048,4096")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--quant-sweep", action="store_true")
    a = p.parse_args()
    torch.manual_seed(torch.seed() % 2**31)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    if a.quant_sweep:
        quant_sweep(sorted({int(s.split("x")[0]) for s in a.shapes.split(",")}), list(map(int, a.m.split(","))))
        return
    for shape in a.shapes.split(","):
        k, n = map(int, shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        qw, ws = quantize_weight(w, torch.float8_e4m3fn, per_channel=True)
        ws_row = ws.float().reshape(1, n).contiguous()
        for m in map(int, a.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            qa, sa = quantize_act(x, torch.float8_e4m3fn)
            sa_col = sa.reshape(m, 1).contiguous()
            ref = (qa.float() * sa[:, None]) @ (qw.float() * ws[:, None]).t()
            rel = lambda y: ((y.float() - ref).norm() / ref.norm()).item()  # noqa: E731
            y_row = torch._scaled_mm(qa, qw.t(), scale_a=sa_col, scale_b=ws_row, out_dtype=torch.bfloat16)
            y_tri = scaled_mm_triton(qa, sa, qw, ws, torch.bfloat16)
            row = {
                "bf16": t_us(lambda: F.linear(x, w)),
                "quant": t_us(lambda: quantize_act(x, torch.float8_e4m3fn)),
                "rowwise": t_us(lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa_col, scale_b=ws_row,
                                                        out_dtype=torch.bfloat16)),
                "rowwise-fast": t_us(lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa_col, scale_b=ws_row,
                                                             out_dtype=torch.bfloat16, use_fast_accum=True)),
                "tensorwise": t_us(lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa[:1].reshape(()),
                                                           scale_b=ws[:1].reshape(()), out_dtype=torch.bfloat16)),
                "triton": t_us(lambda: scaled_mm_triton(qa, sa, qw, ws, torch.bfloat16)),
                "path": t_us(lambda: scaled_mm_torch(*quantize_act(x, torch.float8_e4m3fn), qw, ws,
                                                     torch.bfloat16, use_fast_accum=True)),
                "path-exact": t_us(lambda: scaled_mm_torch(*quantize_act(x, torch.float8_e4m3fn), qw, ws,
                                                           torch.bfloat16)),
            }
            base = row["bf16"]
            print(f"K={k:5d} N={n:5d} M={m:5d} | " + "  ".join(f"{kk} {v:7.1f}" for kk, v in row.items())
                  + f" | path {base / row['path']:.2f}x (target 1.6x), path-exact {base / row['path-exact']:.2f}x"
                  f" | rel err rowwise {rel(y_row):.1e} triton {rel(y_tri):.1e}", flush=True)
            if a.sweep:
                best = None
                for cfg in SWEEP:
                    try:
                        y = scaled_mm_triton(qa, sa, qw, ws, torch.bfloat16, config=cfg)
                        if rel(y) > 1e-2:
                            print(f"    {cfg}: WRONG rel {rel(y):.1e}")
                            continue
                        t = t_us(lambda: scaled_mm_triton(qa, sa, qw, ws, torch.bfloat16, config=cfg))
                    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                        print(f"    {cfg}: {type(e).__name__}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
                if best:
                    print(f"    triton best {best[0]:.1f} us ({base / (best[0] + row['quant']):.2f}x with quant): "
                          f"{best[1]}", flush=True)


if __name__ == "__main__":
    main()
