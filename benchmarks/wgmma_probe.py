"""Probe, not a shipped kernel: the throughput of chains of Hopper wgmmas with few warpgroups per
SM, to tell what bounds the W4A16 WG kernels at M = 64 (BENCHMARKS.md, sixteenth session: one
consumer warpgroup per CTA, one or two CTAs per SM, each chunk a serial chain). For N in 8..256,
A from registers (RS, as WG / WG 2) or shared memory (SS), one or four accumulator sets, a wait
after each group that leaves 0 or 1 group in flight, and 1, 2 or 4 CTAs (warpgroups) per SM:
the dense bf16 TFLOP/s of the whole grid (CUDA events) and the cycles per wgmma of one
warpgroup (clock64). Compare with the measured 799 TFLOP/s bf16 GEMM peak.

    python benchmarks/wgmma_probe.py
"""
import itertools
import sys
from pathlib import Path

import numpy as np
import torch

PROBE = Path(__file__).with_name("wgmma_probe.cu").read_text()


def wgmma_source(n: int) -> str:
    """wgmma_rs(d, a[4], desc_b) and wgmma_ss(d, desc_a, desc_b, accumulate = 1) for m64n{n}k16
    (bf16 in, fp32 D: n / 2 registers; accumulate 0 overwrites D). Also used by w4_ss_probe."""
    nd = n // 2
    outs = ", ".join(f"%{i}" for i in range(nd))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
    op = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16"
    rs = ("__device__ __forceinline__ void wgmma_rs(float* d, const unsigned* a, unsigned long long db) {\n"
          f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 5}, 0;\\n"\n'
          f'  "{op} {{{outs}}}, {{%{nd}, %{nd + 1}, %{nd + 2}, %{nd + 3}}}, %{nd + 4}, p, 1, 1, 0;\\n}}"\n'
          f'  : {cons} : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));\n}}\n')
    ss = ("__device__ __forceinline__ void wgmma_ss(float* d, unsigned long long da, unsigned long long db,\n"
          "                                         int acc = 1) {\n"
          f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{nd + 2}, 0;\\n"\n'
          f'  "{op} {{{outs}}}, %{nd}, %{nd + 1}, p, 1, 1, 0, 0;\\n}}"\n'
          f'  : {cons} : "l"(da), "l"(db), "r"(acc));\n}}\n')
    return rs + ss


def source(n: int) -> str:
    return PROBE.replace("@WGMMA@", wgmma_source(n))


def options(n: int, g: int, wait: int, sets: int, ss: int) -> tuple[str, ...]:
    return ("-std=c++17", f"-DN={n}", f"-DG={g}", f"-DWAIT={wait}", f"-DSETS={sets}", f"-DSS={ss}", "-arch=sm_90a")


def compile_cubin(n, g, wait, sets, ss) -> bytes:
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source(n), "wgmma_probe.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, options(n, g, wait, sets, ss))
        except nvrtc.NVRTCError as e:
            raise RuntimeError(nvrtc.getProgramLog(prog)) from e
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


def measure(n, g, wait, sets, ss, per_sm, iters=2000):
    import cupy
    path = Path(f"/tmp/wgmma_probe_{n}_{g}_{wait}_{sets}_{ss}.cubin")
    if not path.exists():
        path.write_bytes(compile_cubin(n, g, wait, sets, ss))
    fn = cupy.RawModule(path=str(path)).get_function("wgmma_probe")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    # CTAs per SM set by shared memory: each asks for 1 / per_sm of it (at least what it uses)
    need = n * 128 + 8192 + 1024
    smem = max(need, props.shared_memory_per_multiprocessor // per_sm - 1024 - 1)
    fn.max_dynamic_shared_size_bytes = smem
    ctas = sms * per_sm
    cycles = torch.zeros(ctas, dtype=torch.int64, device="cuda")
    args = (np.int32(iters), np.uint64(cycles.data_ptr()))
    fn((ctas,), (128,), args, shared_mem=smem)  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn((ctas,), (128,), args, shared_mem=smem)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    t = float(np.median(times))
    flops = 2.0 * 64 * n * 16 * g * iters * ctas
    try:  # CTAs that really share an SM (registers may allow fewer than shared memory does)
        occ = cupy.cuda.runtime.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, 128, smem)
    except Exception:
        occ = -1
    return flops / t / 1e12, cycles.float().median().item() / (iters * g), occ


def main() -> int:
    print("GPU", torch.cuda.get_device_name(), "torch", torch.__version__)
    print(f"{'N':>4} {'A':>3} {'sets':>4} {'wait':>4} {'CTAs/SM asked':>13} {'resident':>8} | {'TFLOP/s':>8} "
          f"{'cycles/wgmma (one warpgroup)':>30}")
    for n, ss, sets, wait, per_sm in itertools.product((8, 64, 128, 256), (0, 1), (1, 4), (0, 1), (1, 2, 4)):
        if sets * n // 2 > 128:
            continue  # over 128 accumulators per thread
        try:
            tf, cyc, occ = measure(n, 4, wait, sets, ss, per_sm)
            print(f"{n:>4} {'SS' if ss else 'RS':>3} {sets:>4} {wait:>4} {per_sm:>13} {occ:>8} | {tf:8.1f} {cyc:30.1f}",
                  flush=True)
        except Exception as e:
            print(f"{n:>4} {'SS' if ss else 'RS':>3} {sets:>4} {wait:>4} {per_sm:>13} | failed: {str(e)[:120]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
