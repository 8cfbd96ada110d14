"""Per-GPU, per-shape kernel choices measured by ``benchmarks/bench_quant.py``.

The table ``gemm_choices.json`` beside this file maps GPU name -> kind -> ``"M|N|K"`` (M
rounded up to a power of two, capped at 4096) -> entry:

* kinds ``"fp8"`` / ``"int8"``: which W8A8 GEMM runs, ``"triton"`` or ``"torch"``
  (``torch._scaled_mm`` / ``torch._int_mm``). A shape missing from the table gets the
  default: FP8 -> ``torch`` where cuBLAS accepts the shape (K and N multiples of 16), INT8 ->
  ``triton`` (fused scaling epilogue); otherwise ``triton``.
* kind ``"wna16"``: a Triton launch config (dict) for the weight-only GEMM; missing shapes
  use ``wna16.CONFIGS`` by M bucket (``"w4_pairs"`` likewise: its neighbours' configs ran
  0.35-1.32x the defaults' speed at untuned shapes, so it keeps the defaults; BENCHMARKS.md).
* kind ``"w4_mma"``: a launch config for the int4 mma kernel (``w4_mma.py``); a missing shape
  takes its nearest tuned neighbour's entry (:func:`nearest`), else ``w4_mma.CONFIGS``.
* kind ``"w4_mma_prenorm"`` (``w4_mma.PRENORM_KIND``): rows for the same kernel with its RMSNorm
  prologue (``mma_gemm_rmsnorm``, M <= 8): the M bucket's row (2, 4, 8), else the "1|N|K" row;
  a shape without either takes the "w4_mma" rows.

Written on the GPU by ``benchmarks/bench_quant.py --write-choices`` / ``--tune`` and, for the
w4_mma kinds, ``benchmarks/w4_cold_tune.py --write`` (timed with cold L2). Set
``KVFORGE_QUANT_CHOICES`` to use another table file.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("gemm_choices.json")


def m_bucket(m: int) -> int:
    return min(4096, 1 << max(0, (m - 1).bit_length()))


def key(m: int, n: int, k: int) -> str:
    return f"{m_bucket(m)}|{n}|{k}"


@functools.lru_cache(maxsize=None)
def _table(path: str) -> dict:
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else {}


def table_path() -> str:
    return os.environ.get("KVFORGE_QUANT_CHOICES", str(TABLE_PATH))


def torch_shape_ok(kind: str, m: int, n: int, k: int) -> bool:
    """Shapes cuBLAS accepts: FP8 ``_scaled_mm`` wants K, N % 16; ``_int_mm`` wants M > 16, K, N % 8."""
    if kind == "fp8":
        return k % 16 == 0 and n % 16 == 0
    return m > 16 and k % 8 == 0 and n % 8 == 0


def choose(kind: str, m: int, n: int, k: int, device: torch.device) -> str:
    """``"triton"`` or ``"torch"`` for a ``kind`` ("fp8"/"int8") GEMM of shape [M,K] x [K,N]."""
    if not torch_shape_ok(kind, m, n, k):
        return "triton"
    got = lookup(kind, m, n, k, device)
    if got in ("triton", "torch"):
        return got
    return "torch" if kind == "fp8" else "triton"


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def lookup(kind: str, m: int, n: int, k: int, device: torch.device):
    """The table's entry for this GPU / kind / shape, or None."""
    gpu = _gpu_name(device.index or 0) if device.type == "cuda" else "cpu"
    return _table(table_path()).get(gpu, {}).get(kind, {}).get(key(m, n, k))


def nearest(kind: str, m: int, n: int, k: int, device: torch.device, reach: float = 4.0):
    """For a shape the table lacks: the entry of the nearest tuned shape with the same M key
    (distance |log N'/N| + |log K'/K|, ties to the smaller shape; each of N', K' within a
    factor ``reach`` of N, K), as ``(entry, "M|N'|K'")``, or None. Launch configs carry over
    between shapes (tiles and splits adapt to N and K); a neighbour's tuned config beat the M
    bucket's defaults at every untuned shape measured (BENCHMARKS.md, issue 6, session 26).
    Cached per shape: a decode step asks once per layer."""
    gpu = _gpu_name(device.index or 0) if device.type == "cuda" else "cpu"
    return _nearest(table_path(), gpu, kind, m_bucket(m), n, k, reach)


def shape_distance(row: str, n: int, k: int) -> float:
    """|log N'/N| + |log K'/K| between the table row "M|N'|K'" and the shape (N, K)."""
    import math
    _, en, ek = (int(v) for v in row.split("|"))
    return abs(math.log(en / n)) + abs(math.log(ek / k))


@functools.lru_cache(maxsize=4096)
def _nearest(path: str, gpu: str, kind: str, mk: int, n: int, k: int, reach: float):
    rows = _table(path).get(gpu, {}).get(kind, {})
    near = []
    for row in rows:
        em, en, ek = (int(v) for v in row.split("|"))
        rn, rk = en / n, ek / k
        if em == mk and 1 / reach <= rn <= reach and 1 / reach <= rk <= reach:
            near.append((shape_distance(row, n, k), en, ek, row))
    if not near:
        return None
    row = min(near)[3]  # ties: the smaller shape
    return rows[row], row


def table_entries(kind: str, gpu: str) -> dict:
    """Every entry of ``kind`` the table holds for the GPU named ``gpu``: ``{"M|N|K": entry}``."""
    return dict(_table(table_path()).get(gpu, {}).get(kind, {}))


def write_table(entries: dict, path: str | None = None) -> Path:
    """Merge ``{gpu: {kind: {"M|N|K": entry}}}`` into the table file; returns its path."""
    p = Path(path or table_path())
    data = json.loads(p.read_text()) if p.exists() else {}
    for gpu, kinds in entries.items():
        for kind, rows in kinds.items():
            data.setdefault(gpu, {}).setdefault(kind, {}).update(rows)
    p.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    _table.cache_clear()
    _nearest.cache_clear()
    return p
