"""kvforge.layers.pdl on the CPU: the ctypes mirrors of cuda.h's launch structs (sizes and
offsets as the driver reads them on x86-64), the kernel-argument packing, and what a
refusing driver does (PDL off, one warning, the caller launches normally). The launch itself
runs on the GPU (the int4 GEMM's tests, tests/test_quant_w4_mma.py, with ``KVFORGE_PDL=1``)."""
from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest
import torch

from kvforge.layers import pdl


def test_struct_layouts_match_cuda_h():
    # CUlaunchAttribute: id (4) + pad (4) + a 64-byte value union; CUlaunchConfig: seven
    # unsigned ints, then the stream handle at 32, attrs at 40, numAttrs at 48 (size 56)
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72 and pdl.LaunchAttribute.val.offset == 8
    assert pdl.LaunchConfig.sharedMemBytes.offset == 24 and pdl.LaunchConfig.hStream.offset == 32
    assert pdl.LaunchConfig.attrs.offset == 40 and pdl.LaunchConfig.numAttrs.offset == 48
    assert ctypes.sizeof(pdl.LaunchConfig) == 56


def test_pack_args_points_at_each_value():
    args = (np.uint64(0xDEADBEEF000), np.int32(-7), np.int64(1 << 40), np.uint32(9), np.float32(0.5))
    ptrs, keep = pdl.pack_args(args)
    kinds = (ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint32, ctypes.c_float)
    for p, kind, a in zip(ptrs, kinds, args):
        assert ctypes.cast(p, ctypes.POINTER(kind)).contents.value == a.item()
    with pytest.raises(TypeError, match="argument 1 \\(int\\)"):
        pdl.pack_args((np.int32(1), 5))


def test_opt_in_and_off_the_gpu(monkeypatch):
    assert pdl.env_off({}) and pdl.env_off({"KVFORGE_PDL": "0"})  # opt-in: measured slower on the H200 so far
    assert not pdl.env_off({"KVFORGE_PDL": "1"})
    assert not pdl.enabled(torch.device("cpu"))
    monkeypatch.setitem(pdl._state, "off", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setitem(pdl._state, "off", False)
    assert pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not pdl.enabled(torch.device("cuda", 0))  # griddepcontrol needs sm_90


def test_prefetch_chunks_from_the_environment():
    assert pdl.prefetch_chunks({}) == -1 and pdl.prefetch_chunks({"KVFORGE_PDL_PREFETCH": "ALL"}) == -1
    assert pdl.prefetch_chunks({"KVFORGE_PDL_PREFETCH": "0"}) == 0
    assert pdl.prefetch_chunks({"KVFORGE_PDL_PREFETCH": " 3 "}) == 3
    for bad in ("-1", "two", ""):
        with pytest.raises(ValueError, match="KVFORGE_PDL_PREFETCH"):
            pdl.prefetch_chunks({"KVFORGE_PDL_PREFETCH": bad})


def test_prefetch_setting_is_read_once(monkeypatch):
    monkeypatch.setitem(pdl._state, "prefetch", None)
    monkeypatch.setenv("KVFORGE_PDL_PREFETCH", "2")
    assert pdl.prefetch_setting() == 2
    monkeypatch.setenv("KVFORGE_PDL_PREFETCH", "bad")  # not read again
    assert pdl.prefetch_setting() == 2


def test_launch_passes_the_config_and_a_refusal_turns_pdl_off(monkeypatch, caplog):
    seen = {}

    def fake_driver(cfg_p, fn, params, extra):
        cfg = cfg_p._obj
        seen.update(grid=(cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), block=(cfg.blockDimX, cfg.blockDimY),
                    smem=cfg.sharedMemBytes, stream=cfg.hStream, n=cfg.numAttrs, attr=cfg.attrs[0].id,
                    on=cfg.attrs[0].val.value, fn=fn.value,
                    arg1=ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int32)).contents.value)
        return seen.get("result", 0)

    monkeypatch.setitem(pdl._state, "fn", fake_driver)
    monkeypatch.setitem(pdl._state, "off", False)
    monkeypatch.setitem(pdl._state, "told", False)
    assert pdl.launch(1234, (5, 3), (256,), (np.uint64(1), np.int32(42)), 4096, 77)
    assert seen == dict(grid=(5, 3, 1), block=(256, 1), smem=4096, stream=77, n=1,
                        attr=pdl.ATTR_PROGRAMMATIC_STREAM_SERIALIZATION, on=1, fn=1234, arg1=42)
    seen["result"] = 1  # CUDA_ERROR_INVALID_VALUE
    with caplog.at_level(logging.WARNING, logger="kvforge.pdl"):
        assert not pdl.launch(1234, (5,), (256,), (np.uint64(1), np.int32(1)), 0, 77)
        assert not pdl.enabled(torch.device("cuda", 0))
    assert "CUresult 1" in caplog.text
    for grid, block in (((), (32,)), ((1, 1, 1, 1), (32,)), ((1,), ())):
        with pytest.raises(ValueError, match="1 to 3 sizes"):
            pdl.launch(1234, grid, block, (np.int32(1),), 0, 77)
