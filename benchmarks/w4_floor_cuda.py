"""The floor under issue 6's M <= 16 W4A16 targets, measured with CUDA C++ rather than Triton:
per Llama-3-8B shape, cold L2 (calls rotate over copies >= 3x the L2, each a CUDA graph of
back-to-back calls, as ``w4_floor.py`` and the A/B scripts time):

* ``empty``: a kernel that reads nothing. Its time per call is what a graph of back-to-back
  kernels costs per launch (the launch, the grid's start and drain), which bf16 cuBLAS and any
  W4A16 kernel both pay once per call;
* ``ldg``: every thread issues U 16-byte ``ld.global.nc.L1::no_allocate`` loads at once (all in
  flight) and folds them, over a grid of threads per CTA x U;
* ``bulk``: one thread per CTA streams a contiguous range of the buffer through S shared-memory
  stages with 1-D bulk copies (``cp.async.bulk``, the TMA engine; PTX ISA 8.0) and mbarriers,
  over a grid of chunk bytes x stages x CTAs per SM, folding each chunk's first word into a
  per-CTA checksum once its barrier completes (``tests/test_w4_floor_cuda.py`` checks it on the
  GPU). No register file or LSU in the way of the bytes;
* the Triton read floor of ``w4_floor.py`` (its best config), bf16 cuBLAS and the table's W4A16
  kernel, in the same process.

The buffer has the bytes a W4A16 weight needs at least (``w4_floor.floor_bytes``). If the best
read is within a few percent of bf16 / 3, no W4A16 kernel can be 3x bf16 there: it must read
the same bytes and also load x, dequantize, multiply and reduce.

    python benchmarks/w4_floor_cuda.py [--shapes 4096x4096,...] [--m 1,16]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_quant import GROUP, SHAPES, make_operands  # noqa: E402
from w4_floor import copies, floor_bytes, graph_time, read_fn  # noqa: E402

SOURCE = r"""
#ifndef U
#define U 1
#endif
#ifndef S
#define S 2
#endif
#ifndef CB
#define CB 4096
#endif
extern "C" __global__ void empty_kernel(int* out, int flag) {
    if (flag == 12345 && threadIdx.x == 0) out[blockIdx.x] = 0;  // never true: the grid reads nothing
}

extern "C" __global__ void ldg_read(const uint4* __restrict__ src, long long n16, int* __restrict__ out) {
    long long base = (long long)blockIdx.x * blockDim.x * U + threadIdx.x;
    unsigned a[U], b[U], c[U], d[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {  // every load issued before any is used: U in flight per thread
        long long i = base + (long long)u * blockDim.x;
        a[u] = b[u] = c[u] = d[u] = 0u;
        if (i < n16) {
            asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(a[u]), "=r"(b[u]), "=r"(c[u]), "=r"(d[u]) : "l"(src + i));
        }
    }
    unsigned acc = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= a[u] ^ b[u] ^ c[u] ^ d[u];
    if (acc == 0x9e3779b9u) out[0] = acc;  // keeps the loads live; (almost) never stores
}

// One thread per CTA: bytes [begin, end) of src (multiples of 16) through S stages of CB bytes.
// out[blockIdx.x] = XOR of each chunk's first word, read from its stage after its barrier (a check
// that the bytes arrived before the stage was reused; tests/test_w4_floor_cuda.py).
extern "C" __global__ void bulk_read(const char* __restrict__ src, long long nbytes, int* __restrict__ out) {
    extern __shared__ __align__(128) char stage[];
    __shared__ __align__(8) unsigned long long bars[S];
    if (threadIdx.x != 0) return;
    long long per = ((nbytes + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
    long long begin = (long long)blockIdx.x * per, end = min(nbytes, begin + per);
    if (begin >= end) return;
    unsigned base = (unsigned)__cvta_generic_to_shared(stage);
    unsigned bar0 = (unsigned)__cvta_generic_to_shared(bars);
    for (int s = 0; s < S; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    long long chunks = (end - begin + CB - 1) / CB;
    unsigned acc = 0;
    for (long long j = 0; j < chunks + S; ++j) {
        if (j >= S) {  // wait for chunk j - S, whose stage chunk j reuses
            unsigned bar = bar0 + 8 * ((j - S) % S), phase = ((j - S) / S) & 1;
            asm volatile("{\n.reg .pred p;\nW%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W%=;\n}"
                         ::"r"(bar), "r"(phase) : "memory");
            acc ^= *reinterpret_cast<const volatile unsigned*>(stage + ((j - S) % S) * CB);
        }
        if (j < chunks) {
            long long off = begin + j * CB;
            unsigned bytes = (unsigned)min((long long)CB, end - off);
            unsigned bar = bar0 + 8 * (j % S);
            asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}"
                         ::"r"(bar), "r"(bytes) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(base + (unsigned)((j % S) * CB)), "l"(src + off), "r"(bytes), "r"(bar) : "memory");
        }
    }
    out[blockIdx.x] = acc;
}
"""


class Kernels:
    def __init__(self) -> None:
        import cupy
        from kvforge.layers.cupy_launch import TorchStreams
        self.cupy, self.streams, self._mods = cupy, TorchStreams(cupy), {}

    def fn(self, name: str, **defines):
        key = (name, *sorted(defines.items()))
        if key not in self._mods:
            opts = ("-std=c++17", *(f"-D{k}={v}" for k, v in defines.items()))
            f = self.cupy.RawModule(code=SOURCE, options=opts).get_function(name)
            if "CB" in defines:
                f.max_dynamic_shared_size_bytes = defines["CB"] * defines["S"]
            self._mods[key] = f
        return self._mods[key]

    def launch(self, f, grid: int, block: int, args, smem: int = 0) -> None:
        with self.streams.current(torch.device("cuda")):
            f((grid,), (block,), args, shared_mem=smem)

    def bulk_read(self, buf: torch.Tensor, out: torch.Tensor, cb: int, stages: int, grid: int) -> None:
        """Launch ``bulk_read`` over ``buf`` (contiguous CUDA, a multiple of 16 bytes) with ``grid``
        one-thread CTAs; ``out`` int32 [>= grid] gets each CTA's checksum (:func:`bulk_checksums`)."""
        import numpy as np
        from kvforge.layers.cupy_launch import ptr
        nbytes = buf.numel() * buf.element_size()
        if nbytes % 16:
            raise ValueError(f"bulk_read: buf holds {nbytes} bytes, not a multiple of 16 (bulk copies move 16-byte units)")
        if out.numel() < grid:
            raise ValueError(f"bulk_read: out holds {out.numel()} checksums, fewer than the grid's {grid} CTAs")
        self.launch(self.fn("bulk_read", CB=cb, S=stages), grid, 32, (ptr(buf), np.int64(nbytes), ptr(out)),
                    cb * stages)


def bulk_checksums(buf: torch.Tensor, cb: int, grid: int) -> torch.Tensor:
    """What ``bulk_read`` writes per CTA: the XOR of the first 32-bit word of each CB-byte chunk of
    the CTA's range (ranges of ceil(bytes / grid) rounded up to 16 bytes; 0 for an empty range).
    int32 [grid]."""
    words = buf.view(torch.int32).flatten()
    nbytes = words.numel() * 4
    per = (-(-nbytes // grid) + 15) // 16 * 16  # the kernel's range: ceil(bytes / grid), rounded up to 16
    sums = []
    for b in range(grid):
        begin, end = b * per, min(nbytes, (b + 1) * per)
        first = words[torch.arange(begin, end, cb, device=words.device) // 4] if begin < end else words[:0]
        acc = 0
        for v in first.tolist():
            acc ^= v
        sums.append(acc)
    return torch.tensor(sums, dtype=torch.int32)


def main(argv=None) -> int:
    import numpy as np
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN list")
    p.add_argument("--m", default="1,16")
    a = p.parse_args(argv)
    from kvforge.layers.cupy_launch import ptr
    from kvforge_plugins.quant.kernels.w4_mma import mma_gemm
    kern = Kernels()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.zeros(64 * sms, dtype=torch.int32, device="cuda")
    empty = kern.fn("empty_kernel")
    t_empty = {g: graph_time([lambda g=g: kern.launch(empty, g, 128, (ptr(out), np.int32(0)))] * 8)
               for g in (1, sms, 4 * sms)}
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  SMs {sms}")
    print("empty kernel per call in a graph: " + ", ".join(f"{g} CTAs {t * 1e6:.2f} us" for g, t in t_empty.items()))
    print("K x N | M | bf16 | W4A16 table | empty | read floors: Triton / ldg / bulk (best config) | "
          "best read | 3x needs | 3x needs / best read")
    for k, n in [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]:
        nb = floor_bytes(k, n)
        assert nb % 16 == 0, f"{k} x {n}: {nb} bytes is not a multiple of 16 (bulk copies move 16-byte units)"
        bufs = [torch.randint(-2 ** 30, 2 ** 30, (nb // 4,), dtype=torch.int32, device="cuda")
                for _ in range(copies(nb, True))]
        floors = {}
        for blk, it, w in [(b, i, w) for b in (1024, 2048, 4096) for i in (1, 2, 4, 8) for w in (4, 8)]:
            t = graph_time([read_fn(b, blk, it, w) for b in bufs])
            floors["triton"] = min(floors.get("triton", (1e9, "")), (t, f"{blk}x{it}, {w} warps"))
        for threads in (128, 256, 512):
            for u in (1, 2, 4, 8):
                f, n16 = kern.fn("ldg_read", U=u), nb // 16
                grid = -(-n16 // (threads * u))
                t = graph_time([lambda b=b: kern.launch(f, grid, threads, (ptr(b), np.int64(n16), ptr(out)))
                                for b in bufs])
                floors["ldg"] = min(floors.get("ldg", (1e9, "")), (t, f"{threads} threads x {u}"))
        for cb in (4096, 8192, 16384):
            for s in (2, 4, 8):
                for per_sm in (1, 2, 4):
                    if cb * s * per_sm > 200 * 1024:
                        continue
                    t = graph_time([lambda b=b: kern.bulk_read(b, out, cb, s, per_sm * sms) for b in bufs])
                    floors["bulk"] = min(floors.get("bulk", (1e9, "")), (t, f"{cb // 1024} KB x {s} stages, "
                                                                          f"{per_sm} CTA/SM"))
        del bufs
        best = min(v[0] for v in floors.values())
        ops = make_operands(k, n)
        wbytes = sum(ops[key].numel() * ops[key].element_size() for key in ("mma_words", "mma_scales", "mma_zeros"))
        for m in [int(v) for v in a.m.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ws = [ops["w_bf16"].clone() for _ in range(copies(2 * k * n, True))]
            tb = graph_time([lambda w=w: F.linear(x, w) for w in ws])
            del ws
            mm = [(ops["mma_words"].clone(), ops["mma_scales"].clone(), ops["mma_zeros"].clone())
                  for _ in range(copies(wbytes, True))]
            tw = graph_time([lambda o=o: mma_gemm(x, o[0], o[1], o[2], group_size=GROUP, n=n) for o in mm])
            del mm
            fl = " / ".join(f"{floors[key][0] * 1e6:.2f} us ({floors[key][1]})" for key in ("triton", "ldg", "bulk"))
            print(f"{k} x {n} | {m} | {tb * 1e6:.1f} us | {tw * 1e6:.1f} us ({tb / tw:.2f}x) | "
                  f"{t_empty[sms] * 1e6:.2f} us | {fl} | {best * 1e6:.2f} us, {nb / best / 1e12:.2f} TB/s | "
                  f"{tb / 3 * 1e6:.2f} us | {tb / 3 / best:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
