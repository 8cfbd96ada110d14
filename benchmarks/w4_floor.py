"""What issue 6's W4A16 targets ask of the memory system: per Llama-3-8B shape, the time of
the fastest plain read of the int4 bytes (no arithmetic), beside bf16 cuBLAS, the table's
W4A16 kernel and torch's tinygemm (``torch._weight_int4pack_mm``), all in one run.

    python benchmarks/w4_floor.py [--shapes 4096x4096,...] [--m 1,16]

If even the read floor is slower than bf16 / 3, no W4A16 kernel can reach 3x at that shape.
Two regimes, each a CUDA graph of back-to-back calls (median of replays, cuda events):

* ``warm``: one weight, called over and over, as ``bench_quant.py`` times (small weights then
  sit in the 50 MB L2);
* ``cold``: the calls rotate over copies of the weight whose sum is >= 3x the L2, as a model's
  layers do in a decode step.

The read floor is a Triton kernel that loads each 32-bit word of a buffer once (128-bit
loads) and folds them into one sum per program, over a grid of block sizes / warps / words per
program; the best config per shape is printed. Its buffer has the bytes a W4A16 weight needs
at least: K * N / 2 of packed weights, fp16 scales and 4-bit zeros per group of 128.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import GROUP, SHAPES, make_operands  # noqa: E402

L2_BYTES = 50 * 2 ** 20


@triton.jit
def _read_kernel(src, out, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(ITERS):
        offs = (pid * ITERS + i) * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + pid, tl.sum(acc, axis=0))


def read_fn(buf: torch.Tensor, block: int, iters: int, warps: int):
    n = buf.numel()
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, dtype=torch.int32, device=buf.device)

    def fn(b=buf):
        _read_kernel[(grid,)](b, out, n, BLOCK=block, ITERS=iters, num_warps=warps)
        return out
    return fn


def graph_time(calls, reps: int = 20, replays: int = 7) -> float:
    """Median seconds per call of ``calls`` (a list of no-arg fns run in turn, ``reps`` times
    over, in one CUDA graph)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for c in calls:  # warm-up on the capture stream
            c()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                for c in calls:
                    c()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / (reps * len(calls)))
    return sorted(times)[len(times) // 2]


def copies(nbytes: int, cold: bool) -> int:
    return max(2, -(-3 * L2_BYTES // nbytes)) if cold else 1


def floor_bytes(k: int, n: int) -> int:
    groups = k // GROUP
    return k * n // 2 + groups * n * 2 + groups * n // 2


def tinygemm_operands(ops: dict, k: int, n: int):
    """tinygemm's packing of the same weights: w = (q - 8) * s + zf, zf = (8 - z) * s (bf16)."""
    from kvforge_plugins.quant.common import unpack_cols
    q = unpack_cols(ops["awq_qweight"], 4, awq_order=True)  # [K, N] int32
    qt = q.t().contiguous()  # [N, K]
    u8 = ((qt[:, ::2] << 4) | qt[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(u8, 8)
    s = ops["awq_scales"].float()
    zf = (8 - ops["awq_zeros"].float()) * s
    sz = torch.stack([s, zf], dim=2).to(torch.bfloat16).contiguous()  # [K / g, N, 2]
    return packed, sz


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN list")
    p.add_argument("--m", default="1,16")
    a = p.parse_args(argv)
    from kvforge_plugins.quant.kernels.w4_mma import mma_gemm
    from kvforge_plugins.quant.kernels.wna16 import dequantize_wna16
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    ms = [int(v) for v in a.m.split(",")]
    grid = [(blk, it, w) for blk in (1024, 2048, 4096) for it in (1, 2, 4, 8) for w in (4, 8)]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print("K x N | M | regime | bf16 | W4A16 table | tinygemm | read floor (config) | bf16/floor | 3x needs")
    for k, n in shapes:
        ops = make_operands(k, n)
        nb = floor_bytes(k, n)
        fb = {}
        for cold in (False, True):
            r = copies(nb, cold)
            bufs = [torch.randint(-2 ** 30, 2 ** 30, (nb // 4,), dtype=torch.int32, device="cuda") for _ in range(r)]
            best = None
            for blk, it, w in grid:
                fns = [read_fn(b, blk, it, w) for b in bufs]
                t = graph_time(fns)
                if best is None or t < best[0]:
                    best = (t, f"{blk}x{it}, {w} warps")
            fb[cold] = best
            del bufs
        try:
            tg = tinygemm_operands(ops, k, n)
        except Exception as e:  # noqa: BLE001 - report, keep timing the rest
            print(f"  tinygemm unavailable: {type(e).__name__}: {str(e)[:100]}")
            tg = None
        ref_w = dequantize_wna16(ops["awq_qweight"], ops["awq_scales"], ops["awq_zeros"], bits=4, group_size=GROUP,
                                 pack_k=False, awq_order=True, dtype=torch.float32)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ ref_w
            errs = {}
            y = mma_gemm(x, ops["mma_words"], ops["mma_scales"], ops["mma_zeros"], group_size=GROUP, n=n)
            errs["table"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if tg is not None:
                y = torch._weight_int4pack_mm(x, tg[0], GROUP, tg[1])
                errs["tinygemm"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            for cold in (False, True):
                r = copies(2 * k * n, cold)
                ws = [ops["w_bf16"].clone() for _ in range(r)]
                tb = graph_time([lambda w=w: F.linear(x, w) for w in ws])
                del ws
                r = copies(nb, cold)
                mm = [(ops["mma_words"].clone(), ops["mma_scales"].clone(), ops["mma_zeros"].clone()) for _ in range(r)]
                tw = graph_time([lambda o=o: mma_gemm(x, o[0], o[1], o[2], group_size=GROUP, n=n) for o in mm])
                del mm
                tt = float("nan")
                if tg is not None:
                    tgs = [(tg[0].clone(), tg[1].clone()) for _ in range(r)]
                    tt = graph_time([lambda o=o: torch._weight_int4pack_mm(x, o[0], GROUP, o[1]) for o in tgs])
                    del tgs
                tf, cfg = fb[cold]
                print(f"{k} x {n} | {m} | {'cold' if cold else 'warm'} | {tb * 1e6:.1f} us | {tw * 1e6:.1f} us "
                      f"({tb / tw:.2f}x) | {tt * 1e6:.1f} us ({tb / tt:.2f}x) | {tf * 1e6:.2f} us, "
                      f"{nb / tf / 1e12:.2f} TB/s ({cfg}) | {tb / tf:.2f}x | {tb / 3 * 1e6:.2f} us", flush=True)
            print("  rel err vs fp32 dequantized reference: " + ", ".join(f"{kk} {v:.1e}" for kk, v in errs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
