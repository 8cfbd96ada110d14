"""Summarise the Chrome traces of one profiled engine (``LLM.start_profile``): per process,
the ``kvforge.*`` phase ranges (count, median and total ms) and the GPU's busy share of the
traced span with its top kernels. With several processes (``driver.json``, ``rank{R}.json``)
the spans are on one wall clock, so phases can be compared across them.

    python benchmarks/trace_summary.py DIR [--top 8]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from collections import defaultdict


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (us)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarise(path: str, top: int) -> str:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "traceEvents" not in data:
        return f"{os.path.basename(path)}: not a Chrome trace (no traceEvents), skipped"
    events = [e for e in data["traceEvents"] if e.get("ph") == "X"]
    if not events:
        return f"{os.path.basename(path)}: no events"
    phases = defaultdict(list)
    kernels = defaultdict(float)
    spans = []
    for e in events:
        cat, name, ts, dur = e.get("cat", ""), e.get("name", ""), float(e["ts"]), float(e.get("dur", 0))
        if cat == "user_annotation" and name.startswith("kvforge."):
            phases[name].append(dur)
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[name] += dur
            spans.append((ts, ts + dur))
    lo = min(float(e["ts"]) for e in events)
    hi = max(float(e["ts"]) + float(e.get("dur", 0)) for e in events)
    lines = [f"== {os.path.basename(path)}: traced span {(hi - lo) / 1e3:.2f} ms"]
    for name, d in sorted(phases.items()):
        lines.append(f"  {name:28s} x{len(d):<4d} median {statistics.median(d) / 1e3:7.3f} ms  "
                     f"total {sum(d) / 1e3:8.2f} ms")
    if spans:
        glo, ghi = min(s for s, _ in spans), max(e for _, e in spans)
        busy = _busy_us(spans)
        lines.append(f"  GPU busy {busy / 1e3:.2f} ms of {(ghi - glo) / 1e3:.2f} ms between its first and last "
                     f"kernel ({100 * busy / max(ghi - glo, 1e-9):.1f}%)")
        gaps, end = [], None
        for s0, e0 in sorted(spans):
            if end is not None and s0 - end > 50:
                gaps.append(s0 - end)
            end = e0 if end is None else max(end, e0)
        if gaps:
            lines.append(f"  GPU idle gaps > 50 us: {len(gaps)}, total {sum(gaps) / 1e3:.2f} ms, "
                         f"median {statistics.median(gaps):.0f} us")
        tot = sum(kernels.values())
        for name, d in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {d / 1e3:8.2f} ms {100 * d / tot:5.1f}%  {name[:100]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", help="directory of *.json traces (one profiled engine), or one trace file")
    p.add_argument("--top", type=int, default=8, help="kernels listed per process")
    args = p.parse_args(argv)
    paths = [args.dir] if os.path.isfile(args.dir) else sorted(glob.glob(os.path.join(args.dir, "*.json")))
    if not paths:
        p.error(f"no *.json traces in {args.dir}")
    for path in paths:
        print(summarise(path, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
