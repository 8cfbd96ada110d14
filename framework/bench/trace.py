"""Request traces for the scheduler A/B harness: format, files and prompt token synthesis.

Trace format
------------
A trace is a list of requests, each with (pydantic model :class:`TraceRequest`):

* ``arrival_time`` — seconds since the start of the replay (float, >= 0);
* ``prompt_len`` / ``output_len`` — tokens (the output is forced to exactly this length);
* ``prefix_group`` — requests with the same group id share the group's first
  ``prefix_len`` prompt tokens (real, identical token ids, so prefix caching hits);
  ``None`` = no shared prefix;
* ``prefix_len`` — tokens shared with the group (<= ``prompt_len``; 0 without a group);
* ``priority`` — lower is more important (vLLM convention; used by the ``priority`` scheduler).

On disk a trace is either JSON (``{"kvforge_trace": 1, "seed": 0, "workload": ..., "requests": [...]}``)
or JSON lines (``*.jsonl``): an optional header line ``{"kvforge_trace": 1, "seed": 0, ...}`` then one
request object per line. ``seed`` seeds the synthesized prompt token ids
(:func:`synthesize_prompts`); a file without it uses seed 0.

Traces are generated from a workload spec by :func:`kvforge.bench.workload.generate_trace`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

TRACE_VERSION = 1


class TraceRequest(BaseModel):
    """One request of a trace (see the module docstring for units)."""

    model_config = ConfigDict(extra="forbid")
    arrival_time: float = Field(..., ge=0, description="seconds since the start of the replay")
    prompt_len: int = Field(..., ge=1, description="prompt tokens, shared prefix included")
    output_len: int = Field(..., ge=1, description="output tokens (forced with ignore_eos)")
    prefix_group: int | None = Field(None, ge=0, description="shared-prefix group, None = none")
    prefix_len: int = Field(0, ge=0, description="tokens shared with the group")
    priority: int = 0

    @model_validator(mode="after")
    def _check_prefix(self) -> "TraceRequest":
        if self.prefix_len > self.prompt_len:
            raise ValueError(f"prefix_len {self.prefix_len} exceeds prompt_len {self.prompt_len}")
        if self.prefix_group is None and self.prefix_len:
            raise ValueError("prefix_len > 0 needs a prefix_group")
        return self


class Trace(BaseModel):
    """A replayable request trace. ``seed`` seeds the synthesized prompt token ids;
    ``workload`` records the spec it was generated from (informational)."""

    model_config = ConfigDict(extra="forbid")
    requests: list[TraceRequest]
    seed: int = 0
    workload: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "Trace":
        if not self.requests:
            raise ValueError("a trace needs at least one request")
        return self

    def summary(self) -> dict[str, Any]:
        """Counts and totals for reports."""
        rs = self.requests
        return {"num_requests": len(rs), "duration_s": max(r.arrival_time for r in rs),
                "prompt_tokens": sum(r.prompt_len for r in rs), "output_tokens": sum(r.output_len for r in rs),
                "num_prefix_groups": len({r.prefix_group for r in rs if r.prefix_group is not None}),
                "workload": self.workload, "seed": self.seed}


# -- files ---------------------------------------------------------------------------------
def save_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as JSON, or as JSON lines when ``path`` ends with ``.jsonl``."""
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True)
    if p.suffix == ".jsonl":
        head = {"kvforge_trace": TRACE_VERSION, "seed": trace.seed, "workload": trace.workload}
        lines = [json.dumps(head)] + [json.dumps(r.model_dump()) for r in trace.requests]
        p.write_text("\n".join(lines) + "\n")
    else:
        p.write_text(json.dumps({"kvforge_trace": TRACE_VERSION, **trace.model_dump()}, indent=1) + "\n")


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by :func:`save_trace` (or by hand / another tool in the same format).

    Raises:
        ValueError: unreadable file, bad JSON, or an invalid request (naming the line or index).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"--trace {path}: {e}") from None
    try:
        if p.suffix == ".jsonl":
            head: dict[str, Any] = {}
            reqs = []
            for i, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "kvforge_trace" in obj:
                    head = obj
                    continue
                try:
                    reqs.append(TraceRequest.model_validate(obj))
                except ValueError as e:
                    raise ValueError(f"--trace {path} line {i}: {e}") from None
            return Trace(requests=reqs, seed=head.get("seed", 0), workload=head.get("workload"))
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--trace {path}: not valid JSON: {e}") from None
    if isinstance(obj, list):
        obj = {"requests": obj}
    obj.pop("kvforge_trace", None)
    try:
        return Trace.model_validate(obj)
    except ValueError as e:
        raise ValueError(f"--trace {path}: {e}") from None


# -- token ids -----------------------------------------------------------------------------
def synthesize_prompts(trace: Trace, vocab_size: int, avoid: set[int] | frozenset[int] = frozenset(),
                       low: int = 3) -> list[list[int]]:
    """Deterministic prompt token ids for every request of ``trace`` (in trace order).

    Group g's shared prefix is drawn from ``default_rng([trace.seed, 1000, g])``, request i's own
    tokens from ``default_rng([trace.seed, 2000, i])``; ids lie in ``[low, vocab_size)`` minus
    ``avoid`` (special tokens such as EOS). Requests of one group share exactly their first
    ``prefix_len`` ids (the group prefix is as long as the group's longest ``prefix_len``).

    Raises:
        ValueError: no usable token id.
    """
    allowed = np.array([t for t in range(low, vocab_size) if t not in avoid], dtype=np.int64)
    if len(allowed) == 0:
        raise ValueError(f"vocab_size {vocab_size}: no token ids to synthesize prompts from")
    longest: dict[int, int] = {}
    for r in trace.requests:
        if r.prefix_group is not None:
            longest[r.prefix_group] = max(longest.get(r.prefix_group, 0), r.prefix_len)
    prefixes = {g: allowed[np.random.default_rng([trace.seed, 1000, g]).integers(0, len(allowed), size=L)].tolist()
                for g, L in sorted(longest.items())}
    out = []
    for i, r in enumerate(trace.requests):
        head = prefixes[r.prefix_group][:r.prefix_len] if r.prefix_group is not None else []
        tail = np.random.default_rng([trace.seed, 2000, i]).integers(0, len(allowed), size=r.prompt_len - len(head))
        out.append(head + allowed[tail].tolist())
    return out
