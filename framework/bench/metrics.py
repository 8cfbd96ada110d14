"""Per-request timing records of an A/B run and their summary statistics.

Definitions (as vLLM's ``benchmark_serving``; all times in seconds since the replay started, the
summary in milliseconds):

* TTFT — first output token time minus arrival time;
* TPOT — (finish - first token) / (output tokens - 1), per request with >= 2 output tokens;
* ITL — every gap between consecutive output tokens of a request, pooled over requests;
* E2E — finish minus arrival;
* duration — from the replay start (t = 0) to the last finish; req/s = finished requests / duration,
  out tok/s = output tokens / duration.

A token's time is the end of the engine step that produced it (real mode: the wall clock right after
``engine.step()`` returns; sim mode: the virtual clock after the step's predicted time).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """Timing of one trace request (seconds since the replay start)."""

    request_id: str
    arrival: float
    prompt_len: int
    output_len: int
    priority: int = 0
    prefix_group: int | None = None
    first_token: float | None = None
    finish: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token_times")
        d["output_tokens"] = len(self.token_times)
        d["ttft"] = self.first_token - self.arrival if self.first_token is not None else None
        d["e2e"] = self.finish - self.arrival if self.finish is not None else None
        return d


@dataclass
class RunResult:
    """Everything one scheduler's replay produced.

    Attributes:
        label: the column name; spec: the ``--scheduler`` argument; mode: ``real`` or ``sim``.
        records: one per trace request, in trace order.
        stats: engine counters (``num_preemptions``, ``num_recomputed_tokens``,
            ``prefix_cache_hit_rate``, ...) over the replay.
        num_steps: engine steps; busy_time: seconds spent inside steps.
        config: the resolved engine config sections that matter for the A/B.
        steps: optional per-step (shape dict, measured or predicted seconds) samples.
    """

    label: str
    spec: str
    mode: str
    records: list[RequestRecord]
    stats: dict[str, float]
    num_steps: int
    busy_time: float
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _pcts(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), **{f"p{q}": float(np.percentile(a, q)) for q in PERCENTILES}}


def ttfts(result: RunResult) -> list[float]:
    return [r.first_token - r.arrival for r in result.records if r.first_token is not None]


def itls(result: RunResult) -> list[float]:
    out: list[float] = []
    for r in result.records:
        t = r.token_times
        out.extend(t[i + 1] - t[i] for i in range(len(t) - 1))
    return out


def e2es(result: RunResult) -> list[float]:
    return [r.finish - r.arrival for r in result.records if r.ok]


def summarize(result: RunResult) -> dict[str, Any]:
    """The summary metrics of one run (latencies in ms; see the module docstring)."""
    ok = [r for r in result.records if r.ok]
    tpot = [(r.finish - r.first_token) / (len(r.token_times) - 1) for r in ok
            if r.first_token is not None and len(r.token_times) > 1]
    duration = max((r.finish for r in result.records if r.finish is not None), default=0.0)
    out_tokens = sum(len(r.token_times) for r in result.records)
    by_prio: dict[int, list[float]] = {}
    for r in result.records:
        if r.first_token is not None:
            by_prio.setdefault(r.priority, []).append(r.first_token - r.arrival)
    st = result.stats
    return {
        "ttft_ms": _pcts(ttfts(result)),
        "tpot_ms": _pcts(tpot),
        "itl_ms": _pcts(itls(result)),
        "e2e_ms": _pcts(e2es(result)),
        "duration_s": duration,
        "num_finished": len(ok),
        "num_errors": sum(1 for r in result.records if r.error is not None),
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": out_tokens,
        "num_preemptions": int(st.get("num_preemptions", 0)),
        "num_recomputed_tokens": int(st.get("num_recomputed_tokens", 0)),
        "prefix_cache_hit_rate": float(st.get("prefix_cache_hit_rate", 0.0)),
        "mean_ttft_ms_by_priority": {str(p): 1000.0 * float(np.mean(v)) for p, v in sorted(by_prio.items())},
        "num_steps": result.num_steps,
        "busy_time_s": result.busy_time,
    }
