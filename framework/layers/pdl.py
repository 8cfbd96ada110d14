"""Programmatic dependent launch (PDL, sm_90+) for kernels compiled by NVRTC through CuPy.

A kernel launched with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may have its
CTAs start while the kernel before it on the stream is still finishing (once that kernel's
CTAs have run ``griddepcontrol.launch_dependents`` or exited). It must run
``griddepcontrol.wait`` before it reads anything the earlier kernel wrote or writes anything
the earlier kernel may still read; what it does before the wait (the int4 GEMM prefetches its
static weights into L2) overlaps the earlier kernel's tail and the launch latency. Without
the attribute ``griddepcontrol.wait`` returns at once, so such a kernel is correct either way.
Source: CUDA C++ Programming Guide, "Programmatic Dependent Launch and Synchronization"; PTX
ISA, ``griddepcontrol``. Stream capture records the programmatic edge (CUDA 12.3+), so CUDA
graphs keep the overlap.

CuPy's launch takes no launch attributes, so :func:`launch` calls the driver's
``cuLaunchKernelEx`` through ctypes with the CuPy function's handle. PDL is opt-in,
``KVFORGE_PDL=1``: measured on the H200 (BENCHMARKS.md, twelfth and thirteenth sessions) the
int4 model's batch-1 decode step was 0.25 ms *slower* with it (2.67 vs 2.41 ms) and no faster
without the prefetch (``KVFORGE_PDL_PREFETCH=0``: 2.403 vs 2.406 ms), so it stays off until a
variant wins. A launch the driver refuses turns it off for the process, with one warning,
and the caller launches the usual way.
"""
from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import torch

log = logging.getLogger("kvforge.pdl")

#: ``CUlaunchAttributeID`` of programmatic stream serialization (cuda.h)
ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue: a 64-byte union
    _fields_ = [("pad", ctypes.c_char * 64), ("value", ctypes.c_int)]


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, value
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("val", _AttrValue)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_CTYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
           np.dtype(np.float32): ctypes.c_float}


def pack_args(args) -> tuple[ctypes.Array, list]:
    """Kernel arguments (NumPy scalars, as CuPy takes them) -> the ``void*[]`` that
    ``cuLaunchKernelEx`` reads, and the ctypes values it points to (keep them alive).
    Raises TypeError for an argument of another type."""
    values = []
    for i, a in enumerate(args):
        ct = _CTYPES.get(getattr(a, "dtype", None))
        if ct is None:
            raise TypeError(f"PDL launch: argument {i} ({type(a).__name__}) is not a NumPy int32/int64/"
                            "uint32/uint64/float32 scalar")
        values.append(ct(a.item()))
    ptrs = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    return ptrs, values


def env_off(environ=os.environ) -> bool:
    """PDL is opt-in: off unless ``KVFORGE_PDL=1`` (read once, at import)."""
    return environ.get("KVFORGE_PDL", "0") != "1"


def prefetch_chunks(environ=os.environ) -> int:
    """How many of its 64-wide K chunks each warp of a PDL-launched int4 GEMM prefetches into
    L2 before ``griddepcontrol.wait``: ``KVFORGE_PDL_PREFETCH`` (an integer >= 0, or ``all``,
    the default, returned as -1). Prefetching all of a weight larger than L2 (the 58 MB
    gate|up of Llama-3-8B against the H200's 50 MB) evicts lines before their use. Raises
    ValueError naming the variable for another value."""
    raw = environ.get("KVFORGE_PDL_PREFETCH", "all").strip().lower()
    if raw == "all":
        return -1
    try:
        n = int(raw)
    except ValueError:
        n = -1
        raw = None
    if raw is None or n < 0:
        raise ValueError(f"KVFORGE_PDL_PREFETCH must be 'all' or an integer >= 0, got "
                         f"{environ.get('KVFORGE_PDL_PREFETCH')!r}")
    return n


_state: dict = {"fn": None, "off": env_off(), "told": False, "prefetch": None}


def prefetch_setting() -> int:
    """:func:`prefetch_chunks` of the process environment, read once (at the first PDL
    launch: a bad value raises there, never where PDL is off)."""
    if _state["prefetch"] is None:
        _state["prefetch"] = prefetch_chunks()
    return _state["prefetch"]


def _driver_launch():
    if _state["fn"] is None:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError) as e:  # no driver, or one older than CUDA 11.8
            _disable(f"no cuLaunchKernelEx in the driver ({e})")
            return None
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _state["fn"] = fn
    return _state["fn"]


def _disable(why: str) -> None:
    _state["off"] = True
    if not _state["told"]:
        _state["told"] = True
        log.warning("programmatic dependent launch is off: %s", why)


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` should be built for and launched with PDL:
    ``KVFORGE_PDL=1``, a CUDA device of compute capability 9.0 or newer, and no launch
    refused so far."""
    return (not _state["off"] and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (9, 0))


def launch(function_ptr: int, grid: tuple, block: tuple, args, shared_mem: int, stream: int) -> bool:
    """Launch the CUDA function ``function_ptr`` (a ``CUfunction``, e.g. a CuPy RawKernel's
    ``kernel.ptr``) on the stream handle ``stream`` with programmatic stream serialization;
    ``grid`` / ``block``: 1 to 3 sizes, ``args``: NumPy scalars as CuPy takes them. Returns
    False, having launched nothing, where the driver refuses (PDL is then off). Raises
    ValueError for a grid or block of no or more than 3 sizes, TypeError for another kind of
    argument (:func:`pack_args`)."""
    if not (1 <= len(grid) <= 3 and 1 <= len(block) <= 3):
        raise ValueError(f"PDL launch: grid {tuple(grid)} and block {tuple(block)} need 1 to 3 sizes each")
    ptrs, keep = pack_args(args)
    fn = _driver_launch()
    if fn is None:
        return False
    g = tuple(grid) + (1,) * (3 - len(grid))
    b = tuple(block) + (1,) * (3 - len(block))
    attr = LaunchAttribute(id=ATTR_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.val.value = 1
    cfg = LaunchConfig(*g, *b, shared_mem, ctypes.c_void_p(stream), ctypes.pointer(attr), 1)
    err = fn(ctypes.byref(cfg), ctypes.c_void_p(function_ptr), ptrs, None)
    del keep
    if err:
        _disable(f"cuLaunchKernelEx returned CUresult {err}")
        return False
    return True
