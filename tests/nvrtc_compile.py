"""Compile CUDA C++ with NVRTC through ctypes, no GPU and no CUDA driver needed (the
``nvidia-cuda-nvrtc-cu12`` wheel ships the library). Used to check the kernels that the
device compiles at run time (through CuPy) on CPU-only CI."""
from __future__ import annotations

import ctypes
import glob
import os


def find_nvrtc() -> str | None:
    """Path of libnvrtc from the nvidia-cuda-nvrtc wheel, or None when it is not installed."""
    try:
        import nvidia.cuda_nvrtc as pkg
    except ImportError:
        return None
    for root in list(getattr(pkg, "__path__", [])):
        hits = sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[0]
    return None


class Nvrtc:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, source: str, name: str, options: tuple[str, ...]) -> tuple[bool, str, bytes]:
        """-> (ok, compile log, PTX or CUBIN bytes; empty when it failed)."""
        lib, prog = self.lib, ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                    "nvrtcCreateProgram")
        try:
            opts = [o.encode() for o in options]
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)), "nvrtcGetProgramLogSize")
            log = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetProgramLog(prog, log), "nvrtcGetProgramLog")
            if rc != 0:
                return False, log.value.decode(errors="replace"), b""
            cubin = any(o.startswith(("-arch=sm_", "--gpu-architecture=sm_")) for o in options)
            get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin
                             else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
            self._check(get_size(prog, ctypes.byref(size)), "size")
            out = ctypes.create_string_buffer(size.value)
            self._check(get(prog, out), "get")
            return True, log.value.decode(errors="replace"), out.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
