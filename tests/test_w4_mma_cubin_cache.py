"""The sm_90a cubin cache of ``w4_mma_jit`` (WG's warpgroup MMAs need an arch-specific build,
which CuPy's RawModule cannot ask for): it lives in CuPy's per-user cache directory, is keyed by
source, options and NVRTC version, is loaded without compiling when present, and a file that
does not load is compiled again. NVRTC and CuPy are stand-ins here (no GPU)."""
from __future__ import annotations

import sys
import types

import pytest

from kvforge_plugins.quant.kernels import w4_mma_jit


class FakeNvrtc(types.ModuleType):
    class NVRTCError(Exception):
        pass

    def __init__(self, version=(12, 9)):
        super().__init__("nvrtc")
        self.version, self.compiled = version, []

    def getVersion(self):
        return self.version

    def createProgram(self, src, name, headers, names):
        return [src]

    def compileProgram(self, prog, opts):
        self.compiled.append(tuple(opts))

    def getCUBIN(self, prog):
        return b"CUBIN %d" % len(self.compiled)

    def getProgramLog(self, prog):
        return ""

    def destroyProgram(self, prog):
        pass


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    nvrtc = FakeNvrtc()
    libs = types.ModuleType("cupy_backends.cuda.libs")
    libs.nvrtc = nvrtc
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cache"))
    loaded = []

    class RawModule:  # as CuPy's: the file is read when a function is first taken
        def __init__(self, path):
            self.path = path

        def get_function(self, name):
            data = open(self.path, "rb").read()
            if not data.startswith(b"CUBIN"):
                raise RuntimeError("not a cubin")
            loaded.append(data)
            return (name, data)
    cupy = types.ModuleType("cupy")
    cupy.RawModule = RawModule
    for name, mod in (("cupy", cupy), ("cupy_backends", types.ModuleType("cupy_backends")),
                      ("cupy_backends.cuda", types.ModuleType("cupy_backends.cuda")),
                      ("cupy_backends.cuda.libs", libs)):
        monkeypatch.setitem(sys.modules, name, mod)
    k = object.__new__(w4_mma_jit.W4MmaKernels)
    k.cupy = cupy
    return k, nvrtc, loaded, tmp_path / "cache"


def test_compiles_once_then_loads_from_the_user_cache(fakes):
    k, nvrtc, loaded, folder = fakes
    assert k._function_sm90a(("-DWG=1",), "w4_mma_gemm") == ("w4_mma_gemm", b"CUBIN 1")
    assert nvrtc.compiled == [("-DWG=1", "-arch=sm_90a")]
    files = list(folder.glob("kvforge_w4_mma_*.cubin"))
    assert len(files) == 1 and not list(folder.glob("*.tmp"))
    assert (folder.stat().st_mode & 0o777) == 0o700
    assert k._function_sm90a(("-DWG=1",), "w4_mma_gemm")[1] == b"CUBIN 1" and len(nvrtc.compiled) == 1  # loaded
    k._function_sm90a(("-DWG=0",), "w4_mma_gemm")  # other options: another file
    nvrtc.version = (13, 0)
    k._function_sm90a(("-DWG=1",), "w4_mma_gemm")  # another NVRTC: another file
    assert len(nvrtc.compiled) == 3 and len(list(folder.glob("*.cubin"))) == 3


def test_a_file_that_does_not_load_is_compiled_again(fakes):
    k, nvrtc, loaded, folder = fakes
    k._function_sm90a(("-DWG=1",), "w4_mma_gemm")
    path = next(folder.glob("*.cubin"))
    path.write_bytes(b"torn")
    assert k._function_sm90a(("-DWG=1",), "w4_mma_gemm")[1] == b"CUBIN 2" and len(nvrtc.compiled) == 2
    assert path.read_bytes() == b"CUBIN 2"


def test_default_folder_is_cupys_default(fakes, tmp_path, monkeypatch):
    k, nvrtc, loaded, folder = fakes
    monkeypatch.delenv("CUPY_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    k._function_sm90a(("-DWG=1",), "w4_mma_gemm")
    assert len(list((tmp_path / "home" / ".cupy" / "kernel_cache").glob("kvforge_w4_mma_*.cubin"))) == 1
    assert not folder.exists()
