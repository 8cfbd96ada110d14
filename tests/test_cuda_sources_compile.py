"""The CUDA C++ kernels the GPU compiles at run time (through CuPy / NVRTC) compile here,
on a CPU-only machine, with the options the device uses: NVRTC from the
``nvidia-cuda-nvrtc-cu12`` wheel (a dev dependency) needs no GPU and no driver. Compiled for
sm_90 (the H200) to PTX and to a cubin, so ptxas runs too. This catches a broken kernel
before any device time is spent on it; the numerics are tested on the GPU
(tests/test_gpu_backends.py, tests/test_quant_w4_mma.py)."""
from __future__ import annotations

import json
import platform
import re
from pathlib import Path

import pytest
import torch

from nvrtc_compile import Nvrtc, find_nvrtc

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def nvrtc():
    path = find_nvrtc()
    if path is None and (torch.cuda.is_available() or platform.system() != "Linux" or platform.machine() != "x86_64"):
        # a GPU host compiles these kernels natively in its GPU tests; the wheel is Linux x86-64 only
        pytest.skip("no nvidia-cuda-nvrtc wheel on this host")
    assert path, "nvidia-cuda-nvrtc-cu12 is a dev dependency on Linux x86-64 (pip install -e '.[dev]')"
    return Nvrtc(path)


def _compile(nvrtc, src: str, name: str, opts: tuple[str, ...], entries: tuple[str, ...], sm: str = "90") -> None:
    """PTX (every entry present) and an sm_90 cubin through ptxas, whose report must show no
    register spills: these kernels are written to keep their tiles in registers, and a spill
    is a performance bug the GPU tests would not notice. ``sm`` "90a": the arch-specific
    target (wgmma)."""
    for arch in ((f"-arch=compute_{sm}",), (f"-arch=sm_{sm}", "--ptxas-options=-v")):
        ok, log, out = nvrtc.compile(src, name, opts + arch)
        assert ok, f"{name} {opts} {arch}:\n{log}"
        assert "warning" not in log.lower(), f"{name} {opts} {arch}:\n{log}"
        # ptxas reports lost performance as "info" (e.g. C7518: wgmmas serialized because of a
        # divergent path); the kernels are written not to trigger any of these
        assert "performance loss" not in log.lower(), f"{name} {opts} {arch}:\n{log}"
        if arch[0].startswith("-arch=compute_"):
            ptx = out.decode(errors="replace")
            for e in entries:
                assert re.search(rf"\.entry\s+{e}\b", ptx), f"{name}: no kernel {e} in the PTX"
        else:
            spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", log)]
            assert len(spills) == len(entries) and not any(spills), f"{name} {opts}: spills\n{log}"


def _w4_configs() -> list[dict]:
    """The defaults, every tuned config of the shipped choices table (what the H200 runs) and
    the configs the GPU tests and the emulation run, each with and without the group chunks
    compiled in (GCC); and those with the SwiGLU epilogue (ACT), the PDL prologue, the RMSNorm
    prologue (NORM) and the RoPE epilogue (ROPE); the table's RMSNorm-prologue rows with NORM."""
    table = json.loads((ROOT / "plugins/quant/kernels/gemm_choices.json").read_text())
    tuned = [{k: v for k, v in cfg.items() if k not in ("schema", "waves")}
             for gpu in table.values() for cfg in gpu.get("w4_mma", {}).values()]
    out = []
    from test_quant_w4_mma import GPU_CONFIGS  # what the GPU and the emulation run: every #if branch
    from test_quant_w4_mma_emulated import EMULATED
    extra = GPU_CONFIGS + [c for *_, c in EMULATED if c]
    extra += [{**c, "CLU": 4} for c in extra if c.get("CLU")]  # the define is the cluster's size: 2..8
    for cfg in [{}] + tuned + extra:
        for gcc in (0, 2):
            c = {**cfg, "GCC": gcc}
            if c not in out:
                out.append(c)
    # the fused SwiGLU epilogue (gate|up layers run the table's configs with ACT = 1), and the
    # programmatic-dependent-launch build (PDL = 1: what an sm_90 GPU runs), and the RMSNorm
    # prologue (NORM, which implies XS)
    from test_quant_w4_gate_up import CASES
    norm = {"NORM": 1, "XS": 1, "XR": 0, "WG": 0}  # as w4_mma._gemm sets them: the norm takes x's place
    for cfg in [{}] + tuned + [c for *_, c in CASES if c]:
        for c in ({**cfg, "GCC": 2, "ACT": 1}, {**cfg, "GCC": 2, "ACT": 1, "PDL": 1}, {**cfg, "GCC": 2, "PDL": 1},
                  {**cfg, "GCC": 2, "PDL": 1, "PDLP": 2}, {**cfg, "GCC": 2, **norm},
                  {**cfg, "GCC": 2, **norm, "ACT": 1, "PDL": 1}, {**cfg, "GCC": 2, "ROPE": 1},
                  {**cfg, "GCC": 2, **norm, "ROPE": 2}):
            if c.get("ROPE") == 2 and c.get("NB", 1) > 2:
                continue  # the rotation runs with the norm, M <= 8: NB 1 (the M = 1 entries), 2 at most
            if c not in out:
                out.append(c)
    # the rows tuned on the RMSNorm-prologue kernel run only there: with the RoPE (q|k|v) or the
    # SwiGLU (gate|up) epilogue, with and without PDL
    prenorm = [{k: v for k, v in cfg.items() if k not in ("schema", "waves")}
               for gpu in table.values() for cfg in gpu.get("w4_mma_prenorm", {}).values()]
    for cfg in prenorm:
        for epilogue in ({"ROPE": 2}, {"ACT": 1}):
            for pdl in (0, 1):
                c = {**cfg, "GCC": 2, **norm, **epilogue, "PDL": pdl}
                if c not in out:
                    out.append(c)
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w4_mma_kernels_compile(nvrtc, dtype):
    from kvforge_plugins.quant.kernels.w4_mma_jit import SOURCE, nvrtc_options
    configs = _w4_configs()
    assert len(configs) > 2, "the shipped choices table has no w4_mma configs"
    for cfg in configs:
        _compile(nvrtc, SOURCE, "w4_mma.cu", nvrtc_options(dtype, cfg), ("w4_mma_gemm", "w4_mma_dequant", "w4_x_tiles"),
                 "90a" if cfg.get("WG") else "90")


def test_w4_ss_probe_compiles(nvrtc):
    """benchmarks/w4_ss_probe.cu (a measured probe, not shipped) builds on the shipped kernel's
    helpers: it must keep compiling as they change (N 128 and 256, one- and four-chunk stages)."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import w4_ss_probe as probe
    from kvforge_plugins.quant.kernels.w4_mma_jit import SOURCE, nvrtc_options
    for pbn, pch in ((2, 1), (4, 4)):
        src = SOURCE + "\n" + probe.PROBE.replace("@WGMMA_SS@", probe.wgmma_source(64 * pbn))
        opts = (*nvrtc_options(torch.bfloat16, probe.HOST_CFG), f"-DPBN={pbn}", "-DPCPA=3", f"-DPCH={pch}")
        _compile(nvrtc, src, "w4_ss_probe.cu", opts, ("w4_mma_gemm", "w4_mma_dequant", "w4_x_tiles", "w4_ss_probe"),
                 "90a")


def test_w4_floor_cuda_compiles(nvrtc):
    """benchmarks/w4_floor_cuda.py's read-floor kernels (an empty kernel, 16-byte loads, bulk copies
    through mbarrier stages) build with the defines its sweep uses, smallest and largest."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import w4_floor_cuda
    for u, st, cb in ((1, 2, 4096), (8, 8, 16384)):
        _compile(nvrtc, w4_floor_cuda.SOURCE, "w4_floor_cuda.cu", ("-std=c++17", f"-DU={u}", f"-DS={st}", f"-DCB={cb}"),
                 ("empty_kernel", "ldg_read", "bulk_read"))


def test_wgmma_probe_compiles(nvrtc):
    """benchmarks/wgmma_probe.cu (a measurement probe): register and shared-memory A, one and
    four accumulator sets, the smallest and largest N."""
    import sys
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import wgmma_probe as probe
    for n, ss, sets, wait in ((8, 0, 4, 1), (64, 0, 4, 0), (256, 1, 1, 1), (128, 0, 1, 1)):
        opts = tuple(o for o in probe.options(n, 4, wait, sets, ss) if not o.startswith("-arch"))
        _compile(nvrtc, probe.source(n), "wgmma_probe.cu", opts, ("wgmma_probe",), "90a")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_flash_decode_kernels_compile(nvrtc, dtype):
    from kvforge_plugins.attention.flash_decode.jit import SOURCE, nvrtc_options
    cases = [(d, g, 16) for d in (64, 128, 256) for g in (1, 4, 8)] + [(128, 4, 32)]
    for head_dim, group, block_size in cases:
        if dtype == torch.float32 and head_dim > 128:
            continue  # refused by flash_decode's validate()
        _compile(nvrtc, SOURCE, "kernels.cu", nvrtc_options(dtype, head_dim, group, block_size),
                 ("fd_partial", "fd_merge"))


def test_a_broken_kernel_is_reported(nvrtc):
    ok, log, _ = nvrtc.compile('extern "C" __global__ void k(int* x) { x[0] = undefined_name; }', "bad.cu",
                               ("-arch=compute_90",))
    assert not ok and "undefined_name" in log
