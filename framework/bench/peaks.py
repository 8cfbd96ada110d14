"""The two peaks a roofline divides by: dense GEMM throughput (TFLOP/s) and memory bandwidth
(TB/s). Given on the command line, else the project's measured H200 figures on an H200, else
measured here in about a second, so a benchmark on a CPU or another GPU is not compared with
an H200.

Method: a device-to-device copy of ``copy_bytes`` counts the bytes read plus the bytes written
(the convention behind the H200's 4.27 TB/s); a square GEMM of side ``gemm_n`` in the model's
dtype counts ``2 n^3`` FLOPs. Each is the median of ``reps`` timed runs after one warm-up (CUDA
events on a GPU, the wall clock on a CPU).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from kvforge.bench.roofline import H200_MEM_BW_TBPS, H200_PEAK_TFLOPS


def _median_s(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    fn()  # warm-up (allocation, kernel selection)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy_tbps(device: torch.device, copy_bytes: int | None = None, reps: int = 5) -> float:
    """Copy bandwidth in TB/s: (bytes read + bytes written) / median time of ``dst.copy_(src)``."""
    n = copy_bytes or (1 << 28 if device.type == "cuda" else 1 << 27)  # (small: the KV cache holds the rest)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    return 2 * n / _median_s(lambda: dst.copy_(src), device, reps) / 1e12


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype, gemm_n: int | None = None, reps: int = 5) -> float:
    """Dense GEMM throughput in TFLOP/s: ``2 n^3`` / median time of an ``n x n`` matmul in ``dtype``."""
    n = gemm_n or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / _median_s(lambda: torch.matmul(a, b), device, reps) / 1e12


def resolve_peaks(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> str:
    """Fill ``args.peak_tflops`` / ``args.mem_bw_tbps`` where the command line left them None;
    returns where the figures came from (for the report)."""
    if args.peak_tflops is not None and args.mem_bw_tbps is not None:
        return "command line"
    if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device):
        args.peak_tflops = args.peak_tflops or H200_PEAK_TFLOPS
        args.mem_bw_tbps = args.mem_bw_tbps or H200_MEM_BW_TBPS
        return "the project's H200 measurements (4.27 TB/s copy, 799 TFLOP/s bf16 GEMM) where not given"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "this CPU"
    if args.mem_bw_tbps is None:
        args.mem_bw_tbps = measure_copy_tbps(device)
    if args.peak_tflops is None:
        args.peak_tflops = measure_gemm_tflops(device, dtype)
    return f"measured on {name} by kvforge.bench.peaks where not given ({str(dtype).removeprefix('torch.')} GEMM)"
