"""GPU kernels of the quantization plugins (Triton), each with a torch reference.

Kernels are decorated lazily (:func:`lazy_jit`): Triton picks interpreter or compiler
when ``triton.jit`` runs, so the mode is the one ``TRITON_INTERPRET`` has at first launch.
Triton 3.9 fixes the mode of its own library functions (``tl.cdiv``...) when it is
imported, so tests that interpret set ``TRITON_INTERPRET=1`` before importing Triton (they
run in a subprocess).
"""
from __future__ import annotations

import os
from typing import Callable

try:  # Triton is optional: CPU-only installs use the torch reference paths.
    import triton as _triton  # noqa: F401
    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAS_TRITON = False


class lazy_jit:
    """``triton.jit`` applied on first launch, once per ``TRITON_INTERPRET`` setting.

    Triton decides between compiling and interpreting when ``triton.jit`` runs; deferring
    it keys the jitted kernel by the mode in force at launch (see the module docstring).
    """

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._compiled: dict[bool, object] = {}

    def kernel(self):
        interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
        k = self._compiled.get(interp)
        if k is None:
            import triton
            k = self._compiled[interp] = triton.jit(self.fn)
        return k

    def __getitem__(self, grid):
        return self.kernel()[grid]
