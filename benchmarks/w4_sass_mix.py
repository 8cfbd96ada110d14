"""Instruction mix of the W4A16 mma kernel's loops, with no GPU: NVRTC (the nvidia-cuda-nvrtc
wheel, a dev dependency) compiles one config to a cubin, ``cuobjdump -sass`` (the
``nvidia-cuda-cuobjdump`` wheel, or CUOBJDUMP=path) disassembles it, and each loop that holds
MMAs (a backward branch and everything from its target) is printed with its instruction
count by opcode. A static count: how often each instruction runs is ncu's business.

    pip install nvidia-cuda-cuobjdump
    python benchmarks/w4_sass_mix.py --config '{"NB": 8, "TW": 1, "WARPS": 4, "CPA": 4, "XR": 1,
        "WG": 2, "SCALE_A": 1, "CLU": 2, "GCC": 2}' [--sm 90a] [--fp16]
"""
import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from nvrtc_compile import Nvrtc, find_nvrtc  # noqa: E402


def cuobjdump() -> str:
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not found:
        try:
            import nvidia
            hits = [h for root in nvidia.__path__ for h in glob.glob(os.path.join(root, "*", "bin", "cuobjdump"))]
            found = hits[0] if hits else None
        except ImportError:
            pass
    if not found:
        sys.exit("no cuobjdump: pip install nvidia-cuda-cuobjdump, or set CUOBJDUMP")
    return found


def sass(src: str, opts: tuple, entry: str) -> list:
    """(address, instruction text) of ``entry`` in the cubin NVRTC makes of ``src``."""
    path = find_nvrtc()
    if path is None:
        sys.exit("no NVRTC: pip install nvidia-cuda-nvrtc-cu12")
    ok, log, out = Nvrtc(path).compile(src, "w4_mma.cu", opts)
    if not ok:
        sys.exit(log)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(out)
        f.flush()
        text = subprocess.run([cuobjdump(), "-sass", "-fun", entry, f.name], capture_output=True, text=True,
                              check=True).stdout
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", text)]


def mma_loops(ins: list) -> list:
    """(first address, last address, instructions) of each backward branch's span holding an MMA."""
    out = []
    for addr, text in ins:
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            if any("MMA" in t for t in body):
                out.append((int(m.group(1), 16), addr, body))
    return out


def opcode_mix(body: list) -> dict:
    ops = (re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    return dict(collections.Counter(ops).most_common())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="{}", help="the kernel's compile-time constants, JSON (w4_mma_jit._DEFINES)")
    p.add_argument("--sm", default="90a", help="target: 90a (wgmma) or 90")
    p.add_argument("--fp16", action="store_true", help="fp16 activations (default bf16)")
    a = p.parse_args()
    from kvforge_plugins.quant.kernels import w4_mma_jit
    opts = w4_mma_jit.nvrtc_options(torch.float16 if a.fp16 else torch.bfloat16, json.loads(a.config))
    ins = sass(w4_mma_jit.SOURCE, opts + (f"-arch=sm_{a.sm}",), "w4_mma_gemm")
    print(f"w4_mma_gemm: {len(ins)} instructions")
    for first, last, body in mma_loops(ins):
        print(f"loop {first:#x}-{last:#x}: {len(body)} instructions {opcode_mix(body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
