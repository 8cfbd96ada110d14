"""NVRTC compilation (through CuPy) and launch of the ``w4_mma.cu`` kernels.

One module per (dtype, ``_DEFINES``), compiled on first use and cached in
process (CuPy also caches the cubin on disk). Launches go on torch's current stream, so they
are ordered with torch work and captured by CUDA graphs.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from kvforge.layers import pdl
from kvforge.layers.cupy_launch import TorchStreams
from kvforge.layers.cupy_launch import ptr as _ptr

#: The kernels' CUDA C++: helpers, one chunk's stages, x in / y out, the kernels, as one NVRTC translation
#: unit (joined here rather than #included, so CuPy's on-disk cache key covers every part).
SOURCE = "\n".join(Path(__file__).with_name(f).read_text()
                   for f in ("w4_mma_ops.cuh", "w4_mma_stages.cuh", "w4_wgmma.cuh", "w4_wgmma_ws.cuh", "w4_mma_io.cuh",
                             "w4_cluster.cuh", "w4_mma.cu"))
_LOCK = threading.Lock()
_DEFINES = (("NB", 1), ("TW", 4), ("WARPS", 4), ("S", 2), ("XS", 0), ("SCALE_A", 0), ("MINB", 1), ("LDW", 0), ("GCC", 0), ("CPA", 0), ("KW", 1), ("ACT", 0), ("PDL", 0), ("PDLP", -1), ("NORM", 0), ("ROPE", 0), ("XR", 0), ("WG", 0), ("CLU", 0), ("CUR", 0), ("WST", 0))


def nvrtc_options(dtype: torch.dtype, cfg: "dict | None" = None) -> tuple[str, ...]:
    """NVRTC options of one compiled variant: the dtype and the ``_DEFINES`` (``cfg`` overrides
    their defaults). Pure: the CPU compile check (tests/test_cuda_sources_compile.py) uses it."""
    cfg = cfg or {}
    return ("-std=c++17", f"-DW4_BF16={int(dtype == torch.bfloat16)}",
            *(f"-D{f}={int(cfg.get(f, d))}" for f, d in _DEFINES))


class W4MmaKernels:
    """Compiles lazily; raises RuntimeError with NVRTC's log on a compile failure."""

    def __init__(self) -> None:
        import cupy
        self.cupy = cupy
        self._mods: dict[tuple, object] = {}
        self._streams = TorchStreams(cupy)

    def _fn(self, name: str, device: torch.device, dtype: torch.dtype, cfg: "dict | None" = None):
        cfg = cfg or {}
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (name, index, dtype) + tuple(int(cfg.get(f, d)) for f, d in _DEFINES)
        with _LOCK:
            fn = self._mods.get(key)
            if fn is None:
                opts = nvrtc_options(dtype, cfg)
                try:
                    with self.cupy.cuda.Device(index):  # a module is loaded into one device's context
                        fn = (self._function_sm90a(opts, name) if cfg.get("WG")
                              else self.cupy.RawModule(code=SOURCE, options=opts).get_function(name))
                        # allow the shared-memory x slice past the 48 KB default (XS); the
                        # kernel's static shared memory (NORM's sums, the split-K flag) comes first
                        optin = torch.cuda.get_device_properties(index).shared_memory_per_block_optin
                        fn.max_dynamic_shared_size_bytes = optin - fn.shared_size_bytes  # a RawKernel (CuPy >= 12)
                except Exception as e:
                    raise RuntimeError(f"w4_mma: NVRTC compile failed for {key}: {e}") from e
                self._mods[key] = fn
        return fn

    def _function_sm90a(self, opts: tuple[str, ...], name: str):
        """Kernel ``name`` of the module built for sm_90a (wgmma is not in plain sm_90, and CuPy's RawModule always
        appends the device's own -arch): NVRTC to a cubin, cached in CuPy's per-user kernel cache
        directory (``CUPY_CACHE_DIR``, default ~/.cupy/kernel_cache) under a hash of the source,
        the options and the NVRTC version, and loaded from there (CuPy loads a module when a
        function is first taken from it); a file that does not load is compiled again."""
        from cupy_backends.cuda.libs import nvrtc
        opts = (*opts, "-arch=sm_90a")
        key = "\0".join((SOURCE, *opts, "nvrtc %d.%d" % nvrtc.getVersion()))
        # CuPy's own rule for its cache directory (it has no public getter for it)
        folder = Path(os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = folder / f"kvforge_w4_mma_{hashlib.sha256(key.encode()).hexdigest()}.cubin"
        if path.exists():
            try:
                return self.cupy.RawModule(path=str(path)).get_function(name)
            except Exception:  # torn or foreign file: build it again
                pass
        prog = nvrtc.createProgram(SOURCE, "w4_mma.cu", (), ())
        try:
            try:
                nvrtc.compileProgram(prog, opts)
            except nvrtc.NVRTCError as e:
                raise RuntimeError(nvrtc.getProgramLog(prog)) from e
            cubin = nvrtc.getCUBIN(prog)
        finally:
            nvrtc.destroyProgram(prog)
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:  # then an atomic rename
            f.write(cubin)
        os.replace(f.name, path)
        return self.cupy.RawModule(path=str(path)).get_function(name)

    def gemm(self, x, words, scales, zeros, out, ws, cnt, *, n: int, group_chunks: int, chunks_per_split: int,
             splits: int, cfg: dict, smem: int = 0, norm: "tuple | None" = None,
             rope: "tuple | None" = None) -> None:
        """out [M, N] = x [M, K] @ W (with ``cfg["ACT"]``: out [M, N / 2] = silu(gate) * up of
        an interleaved gate|up weight); operands as in ``w4_mma.py`` (x rows 16-byte aligned);
        ``smem``: dynamic shared memory bytes (the x slice with XS, CPA stages, KW sums).
        With ``cfg["NORM"]``, ``norm`` is (residual [M, K] contiguous, RMSNorm weight [K],
        eps, residual_out [M, K]): the kernel multiplies RMSNorm(x + residual) * weight and
        writes x + residual to residual_out. With ``cfg["ROPE"]``, ``rope`` is (rows in the
        rotary layout, head_dim, positions int64 [M] or None, cos, sin fp32 [max_pos,
        head_dim / 2] or None; the three tensors for ROPE 2)."""
        m, k = (x.shape[1], x.shape[0] * 64) if x.dim() == 3 else x.shape  # (WG 2's x tiles: [K / 64, M, 64])
        # the kernel fetches a group's scales at its first chunk and walks whole groups:
        # splits and K must hold whole groups
        assert chunks_per_split % group_chunks == 0 and (k // 64) % group_chunks == 0, (k, chunks_per_split,
                                                                                       group_chunks)
        # groups of up to 8 chunks (group_size <= 512) are compiled in: their % and / become shifts
        use_pdl = pdl.enabled(x.device)  # a PDL build is correct with either launch
        fn = self._fn("w4_mma_gemm", x.device, x.dtype,
                      {**cfg, "GCC": group_chunks if group_chunks <= 8 else 0, "PDL": int(use_pdl),
                       "PDLP": pdl.prefetch_setting() if use_pdl else -1})
        units = (n // 16) // cfg["TW"]
        grid = (-(-units // (cfg["WARPS"] // cfg.get("KW", 1))), splits)
        block = (32 * (cfg["WARPS"] + (cfg.get("WG") == 2)),)  # WG 2: + the producer warp
        args = (_ptr(x), np.int32(m), np.int64(x.stride(0)), _ptr(words), _ptr(scales), _ptr(zeros), np.int32(n),
                np.int32(k // 64), np.int32(group_chunks), np.int32(chunks_per_split), _ptr(ws), _ptr(cnt),
                _ptr(out), np.int64(out.stride(0)))
        if cfg.get("NORM"):
            res, nw, eps, res_out = norm
            args += (_ptr(res), _ptr(nw), np.float32(eps), _ptr(res_out))
        else:
            args += (np.uint64(0), np.uint64(0), np.float32(0.0), np.uint64(0))
        rows, hd, pos, cos, sin = rope if cfg.get("ROPE") else (0, 0, None, None, None)
        args += (np.int32(rows), np.int32(hd),
                 *(_ptr(v) if v is not None else np.uint64(0) for v in (pos, cos, sin)))
        with self._streams.current(x.device):
            if not (use_pdl and pdl.launch(fn.kernel.ptr, grid, block, args, smem,
                                           torch.cuda.current_stream(x.device).cuda_stream)):
                fn(grid, block, args, shared_mem=smem)

    def x_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """WG 2's x tiles [K / 64, M, 64] of x [M, K] (rows 16-byte aligned), as
        ``w4_mma_orders.wg_x_tiles`` makes them: one thread per 16-byte unit."""
        m, k = x.shape
        out = torch.empty((k // 64, m, 64), dtype=x.dtype, device=x.device)
        fn = self._fn("w4_x_tiles", x.device, x.dtype)
        units = (k // 64) * m * 8
        with self._streams.current(x.device):
            fn((-(-units // 256),), (256,), (_ptr(x), np.int32(m), np.int64(x.stride(0)), np.int32(k // 64), _ptr(out)))
        return out

    def dequant(self, words, scales, zeros, wt, *, n: int, k: int, group_chunks: int) -> None:
        """wt [N, K] (x's dtype) = the dequantized weight, transposed."""
        fn = self._fn("w4_mma_dequant", wt.device, wt.dtype)
        threads = (n // 64) * (k // 64) * 128
        with self._streams.current(wt.device):
            fn((-(-threads // 256),), (256,),
               (_ptr(words), _ptr(scales), _ptr(zeros), np.int32(n), np.int32(k // 64), np.int32(group_chunks),
                _ptr(wt)))


_KERNELS: "W4MmaKernels | None" = None


def kernels() -> W4MmaKernels:
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = W4MmaKernels()
    return _KERNELS
