"""Step-time cost model of the A/B simulator (``kvforge bench ab --mode sim``).

One engine step runs the scheduled tokens of every scheduled request in one flattened forward
(DESIGN.md, core loop). The simulator replaces that step — forward, sampling, detokenization and
the engine's bookkeeping — by a linear model of the step's shape::

    step_time_s = c_const
                + c_num_batched_tokens * num_batched_tokens   # sum of scheduled tokens (GEMM rows)
                + c_num_seqs           * num_seqs             # scheduled requests (per-sequence work:
                                                              #   metadata, attention launch, sampling)
                + c_sum_context_tokens * sum_context_tokens   # sum over requests of KV length after
                                                              #   the step (keys read by the last query)
                + c_attn_pairs         * attn_pairs           # query-key pairs: n*s + n*(n+1)/2 per
                                                              #   request with n new tokens after s cached
                + c_max_context_tokens * max_context_tokens   # the longest request's KV length: a decode
                                                              #   kernel with one program per (request, KV
                                                              #   head) that fits in ~one wave lasts as long
                                                              #   as its longest sequence, so unequal batches
                                                              #   cost more than their sum predicts
    (+ swap_const_s + swap_per_block_s * swapped_blocks, in steps that swap KV blocks)

(the first four terms are the usual c0 + c1*tokens + c2*seqs + c3*context roofline-style model, as
in Vidur, Agrawal et al. MLSys'24, and LLMServingSim; ``attn_pairs`` adds the quadratic prefill
attention term; ``max_context_tokens`` the load imbalance of unequal batches, which only a
calibration with mixed lengths can separate from the sum: cost models fitted before it was added
read it as 0). The coefficients are fitted by ``kvforge bench calibrate`` from measured engine
steps with weighted least squares that minimizes the RELATIVE error (rows scaled by 1/t), keeping
coefficients non-negative (a feature whose coefficient comes out negative is dropped and the rest
refitted), so predictions never go below ``c_const``.

Cost model file (JSON)::

    {"kvforge_cost_model": 1, "coef": {"const": s, "num_batched_tokens": s/token, ...},
     "swap": {"const_s": s, "per_block_s": s/block},
     "device": "...", "torch": "2.x", "date": "ISO-8601", "model": {...}, "engine": {...},
     "fit": {"num_samples": n, "rmse_s": ..., "mean_abs_rel_err": ..., "max_abs_rel_err": ...,
             "r2": ..., "residuals_s": [...]}, "samples": [[features..., measured_s], ...]}
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

COST_MODEL_VERSION = 1
FEATURES = ("const", "num_batched_tokens", "num_seqs", "sum_context_tokens", "attn_pairs", "max_context_tokens")


@dataclass(frozen=True)
class StepShape:
    """The shape of one engine step, read off a SchedulerOutput before ``update``.

    Attributes (tokens unless stated): ``num_batched_tokens``, ``num_seqs`` (requests),
    ``num_decode_seqs`` (requests computing one token at the end of their sequence),
    ``num_prefill_tokens`` (the rest), ``sum_context_tokens``, ``attn_pairs``,
    ``swap_blocks`` (blocks copied out + in), ``max_context_tokens`` (the longest request's
    KV length after the step).
    """

    num_batched_tokens: int = 0
    num_seqs: int = 0
    num_decode_seqs: int = 0
    num_prefill_tokens: int = 0
    sum_context_tokens: int = 0
    attn_pairs: int = 0
    swap_blocks: int = 0
    max_context_tokens: int = 0

    def vector(self) -> list[float]:
        """Feature values in :data:`FEATURES` order."""
        return [1.0, float(self.num_batched_tokens), float(self.num_seqs), float(self.sum_context_tokens),
                float(self.attn_pairs), float(self.max_context_tokens)]


def step_shape(so) -> StepShape:
    """:class:`StepShape` of a :class:`~kvforge.interfaces.SchedulerOutput`; call it BEFORE the
    scheduler's ``update`` (it reads each request's ``num_computed_tokens``)."""
    tokens = seqs = decodes = prefill = ctx = pairs = longest = 0
    counts = so.num_scheduled_tokens
    for req in so.scheduled:
        n = counts[req.request_id]
        s = req.num_computed_tokens
        tokens += n
        seqs += 1
        if n == 1 and s + 1 == req.num_tokens and req.output_token_ids:
            decodes += 1
        else:
            prefill += n
        ctx += s + n
        longest = max(longest, s + n)
        pairs += n * s + n * (n + 1) // 2
    return StepShape(tokens, seqs, decodes, prefill, ctx, pairs, len(so.swap_out) + len(so.swap_in), longest)


@dataclass
class CostModel:
    """Linear step-time model; see the module docstring. ``coef`` in seconds per feature unit."""

    coef: dict[str, float]
    swap_const_s: float = 0.0
    swap_per_block_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coef) - set(FEATURES)
        if unknown:
            raise ValueError(f"cost model: unknown features {sorted(unknown)}; known: {', '.join(FEATURES)}")
        bad = {k: v for k, v in self.coef.items() if not (isinstance(v, (int, float)) and v >= 0)}
        if bad or self.swap_const_s < 0 or self.swap_per_block_s < 0:
            raise ValueError(f"cost model: coefficients must be finite and >= 0, got {bad or 'negative swap'}")
        self._w = [float(self.coef.get(f, 0.0)) for f in FEATURES]

    def step_time(self, shape: StepShape) -> float:
        """Predicted seconds for one step of ``shape`` (a swap-only step costs the swap alone)."""
        t = 0.0
        if shape.num_seqs:
            t = sum(w * x for w, x in zip(self._w, shape.vector()))
        if shape.swap_blocks:
            t += self.swap_const_s + self.swap_per_block_s * shape.swap_blocks
        return t

    # -- files ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"kvforge_cost_model": COST_MODEL_VERSION,
                "formula": "step_time_s = " + " + ".join(f"coef[{f}] * {f}" for f in FEATURES)
                           + " (+ swap.const_s + swap.per_block_s * swapped_blocks)",
                "coef": {f: float(self.coef.get(f, 0.0)) for f in FEATURES},
                "swap": {"const_s": self.swap_const_s, "per_block_s": self.swap_per_block_s}, **self.meta}

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        if d.get("kvforge_cost_model") != COST_MODEL_VERSION or "coef" not in d:
            raise ValueError(f"not a kvforge cost model (version {COST_MODEL_VERSION}): needs "
                             "'kvforge_cost_model' and 'coef'")
        swap = d.get("swap", {})
        meta = {k: v for k, v in d.items() if k not in ("kvforge_cost_model", "formula", "coef", "swap")}
        return cls(dict(d["coef"]), float(swap.get("const_s", 0.0)), float(swap.get("per_block_s", 0.0)), meta)

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        """Raises ValueError for a missing or malformed file (naming it)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"--cost-model {path}: {e}") from None

    def summary(self) -> dict[str, Any]:
        """Coefficients plus where they came from (for reports)."""
        return {"coef": {f: float(self.coef.get(f, 0.0)) for f in FEATURES},
                "swap": {"const_s": self.swap_const_s, "per_block_s": self.swap_per_block_s},
                **{k: self.meta[k] for k in ("device", "torch", "date", "model", "source") if k in self.meta},
                **({"fit": {k: v for k, v in self.meta["fit"].items() if k != "residuals_s"}}
                   if "fit" in self.meta else {})}


def fit_linear(x: np.ndarray, y: np.ndarray, names: Iterable[str]) -> tuple[dict[str, float], dict[str, Any]]:
    """Non-negative, relative-error least squares: minimize sum(((x @ c) - y) / y)^2 with c >= 0.

    Active-set heuristic: solve with numpy.linalg.lstsq on columns scaled to unit max; while a
    coefficient is negative, drop the most negative feature and solve again.

    Args:
        x: float64 [N, F] features; y: float64 [N] measured seconds (> 0).
    Returns:
        (name -> coefficient, fit statistics incl. residuals in seconds).
    Raises:
        ValueError: fewer samples than features, or non-positive times.
    """
    names = list(names)
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape[0] < x.shape[1]:
        raise ValueError(f"cost model fit: {x.shape[0]} samples for {x.shape[1]} features")
    if (y <= 0).any():
        raise ValueError("cost model fit: measured times must be > 0")
    w = 1.0 / y
    active = [j for j in range(x.shape[1]) if np.abs(x[:, j]).max() > 0]
    coef = np.zeros(x.shape[1])
    while active:
        cols = x[:, active]
        scale = np.abs(cols).max(axis=0)
        sol, *_ = np.linalg.lstsq((cols / scale) * w[:, None], y * w, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    pred = x @ coef
    res = pred - y
    rel = res / y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    stats = {"num_samples": int(len(y)), "rmse_s": float(np.sqrt((res ** 2).mean())),
             "mean_abs_rel_err": float(np.abs(rel).mean()), "max_abs_rel_err": float(np.abs(rel).max()),
             "r2": float(1.0 - (res ** 2).sum() / ss_tot) if ss_tot > 0 else 1.0,
             "dropped_features": [names[j] for j in range(len(names)) if coef[j] == 0.0],
             "residuals_s": [float(r) for r in res]}
    return {n: float(c) for n, c in zip(names, coef)}, stats
