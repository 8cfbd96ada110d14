"""torch.profiler traces of an engine's processes, on demand (``LLM.start_profile``).

vLLM's ``start_profile`` / ``stop_profile`` pattern: between the two calls every process of
the engine (the driver and, with tensor or pipeline parallelism, each worker) records CPU
ops, CUDA kernels and the ``kvforge.*`` ranges the step loop marks; ``stop`` writes one
Chrome trace per process, ``driver.json`` and ``rank{R}.json``, into the directory given
(or ``$KVFORGE_TORCH_PROFILER_DIR``). Timestamps are wall-clock microseconds, so the
processes' traces line up; ``benchmarks/trace_summary.py`` summarises them per phase.
"""
from __future__ import annotations

import contextlib
import os

DIR_ENV = "KVFORGE_TORCH_PROFILER_DIR"

_NULL = contextlib.nullcontext()
_recording = 0  # TraceProfilers running in this process


def span(name: str):
    """A ``kvforge.*`` phase range for the traces: ``record_function(name)`` while this process's
    :class:`TraceProfiler` runs, else a shared no-op (a ``record_function`` costs ~4.6 us even
    with no profiler active, and the step loop marks ~6 phases per step)."""
    if not _recording:
        return _NULL
    from torch.profiler import record_function
    return record_function(name)


def resolve_dir(out_dir: str | None) -> str:
    """``out_dir``, else ``$KVFORGE_TORCH_PROFILER_DIR``, made absolute and created (so every
    process writes to the same place whatever its working directory).

    Raises:
        ValueError: neither is set, or the directory cannot be created.
    """
    out_dir = out_dir or os.environ.get(DIR_ENV)
    if not out_dir:
        raise ValueError(f"start_profile: give out_dir or set {DIR_ENV}")
    out_dir = os.path.abspath(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"start_profile: cannot create {out_dir!r}: {e}") from None
    return out_dir


class TraceProfiler:
    """One process's profiler: :meth:`start`, then :meth:`stop` writes ``<dir>/<name>.json``."""

    def __init__(self) -> None:
        self._prof = None
        self._path: str | None = None

    @property
    def active(self) -> bool:
        return self._prof is not None

    def start(self, out_dir: str, name: str) -> None:
        """Start recording (CPU ops, plus CUDA kernels when CUDA is available).

        Raises:
            RuntimeError: already started.
        """
        if self._prof is not None:
            raise RuntimeError("start_profile: the profiler is already running (call stop_profile first)")
        import torch
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        os.makedirs(out_dir, exist_ok=True)
        self._path = os.path.join(out_dir, f"{name}.json")
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        global _recording
        _recording += 1

    def stop(self) -> str | None:
        """Stop and write the trace; returns its path (None if not started)."""
        if self._prof is None:
            return None
        prof, self._prof = self._prof, None
        global _recording
        _recording -= 1
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(self._path)
        return self._path
