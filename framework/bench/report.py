"""Reports of an A/B run: a side-by-side terminal table, a JSON file and a PNG plot (matplotlib).

Files written to ``--output-dir``: ``ab_table.txt`` (the table), ``ab_results.json`` (everything:
trace summary, cost model, per-scheduler config, summary metrics and per-request records) and
``ab_plot.png`` (CDFs of TTFT, ITL and E2E latency per scheduler, and throughput bars).
"""
from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.bench.metrics import RunResult, e2es, itls, summarize, ttfts

#: (row label, path in the summary dict, format)
ROWS: list[tuple[str, tuple[str, ...], str]] = [
    ("TTFT p50 (ms)", ("ttft_ms", "p50"), "ms"), ("TTFT p90 (ms)", ("ttft_ms", "p90"), "ms"),
    ("TTFT p99 (ms)", ("ttft_ms", "p99"), "ms"),
    ("TPOT p50 (ms)", ("tpot_ms", "p50"), "ms"), ("TPOT p90 (ms)", ("tpot_ms", "p90"), "ms"),
    ("TPOT p99 (ms)", ("tpot_ms", "p99"), "ms"),
    ("ITL p50 (ms)", ("itl_ms", "p50"), "ms"), ("ITL p90 (ms)", ("itl_ms", "p90"), "ms"),
    ("ITL p99 (ms)", ("itl_ms", "p99"), "ms"),
    ("E2E p50 (ms)", ("e2e_ms", "p50"), "ms"), ("E2E p99 (ms)", ("e2e_ms", "p99"), "ms"),
    ("req/s", ("request_throughput",), "rate"), ("out tok/s", ("output_throughput",), "rate"),
    ("preemptions", ("num_preemptions",), "int"), ("recomputed tokens", ("num_recomputed_tokens",), "int"),
    ("prefix hit rate", ("prefix_cache_hit_rate",), "pct"),
    ("finished / errors", ("num_finished", "num_errors"), "pair"), ("duration (s)", ("duration_s",), "rate"),
]


def _fmt(summary: dict[str, Any], path: tuple[str, ...], kind: str) -> str:
    if kind == "pair":
        return f"{summary[path[0]]} / {summary[path[1]]}"
    v: Any = summary
    for k in path:
        v = v[k]
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "int":
        return f"{int(v):,}"
    if kind == "pct":
        return f"{100.0 * v:.1f}%"
    if kind == "ms":
        return f"{v:,.1f}" if v >= 10 else f"{v:.3f}"
    return f"{v:,.2f}"


def format_table(labels: list[str], summaries: list[dict[str, Any]]) -> str:
    """One column per scheduler, one row per metric (:data:`ROWS`)."""
    head = ["metric"] + labels
    body = [[name] + [_fmt(s, path, kind) for s in summaries] for name, path, kind in ROWS]
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    line = "  ".join("-" * w for w in widths)

    def row(r: list[str]) -> str:
        return "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))
    return "\n".join([row(head), line] + [row(r) for r in body])


def results_document(results: list[RunResult], meta: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: ``meta`` plus, per scheduler, config, summary and per-request records."""
    return {"kvforge_bench_ab": 1, **meta, "schedulers": [
        {"label": r.label, "spec": r.spec, "mode": r.mode, "config": r.config, "summary": summarize(r),
         "stats": r.stats, **{k: v for k, v in r.extra.items() if k != "steps"},
         "requests": [rec.to_dict() for rec in r.records]} for r in results]}


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n")


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    v = np.sort(np.asarray(values) * 1000.0)
    ax.step(v, np.arange(1, len(v) + 1) / len(v), where="post", label=label)


def write_plot(results: list[RunResult], path: Path, title: str = "") -> None:
    """2x2 figure: CDFs of TTFT, ITL and E2E (ms, log x) per scheduler; output tok/s bars
    labelled with tok/s and req/s."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (name, fn) in zip(axes.flat[:3], (("TTFT", ttfts), ("ITL", itls), ("E2E latency", e2es))):
        for r in results:
            _cdf(ax, fn(r), r.label)
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("gaps" if name == "ITL" else "requests"))
        vals = [v for r in results for v in fn(r)]
        if vals and min(vals) > 0:
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    sums = [summarize(r) for r in results]
    x = np.arange(len(results))
    bars = ax.bar(x, [s["output_throughput"] for s in sums], 0.6, color=[f"C{i}" for i in range(len(results))])
    for b, s in zip(bars, sums):
        ax.annotate(f"{s['output_throughput']:,.0f} tok/s\n{s['request_throughput']:.2f} req/s",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.margins(y=0.2)
    ax.set_xticks(x)
    ax.set_xticklabels([r.label for r in results], rotation=15, fontsize=8)
    ax.set_title("throughput")
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
