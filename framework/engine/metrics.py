"""Prometheus metrics of a serving engine (prometheus_client).

Series (names follow vLLM's ``vllm:*`` metrics with the ``kvforge:`` prefix; every
series has the label ``model_name``):

* gauges ``kvforge:num_requests_running``, ``kvforge:num_requests_waiting``,
  ``kvforge:kv_cache_usage_perc`` (0..1), ``kvforge:prefix_cache_hit_rate`` (0..1; 0
  when the allocator reports none) — read from the engine's latest ``stats()`` snapshot;
* histograms ``kvforge:time_to_first_token_seconds`` (TTFT),
  ``kvforge:time_per_output_token_seconds`` (TPOT: decode time / (output tokens - 1)),
  ``kvforge:inter_token_latency_seconds`` (ITL: between a request's successive outputs of new
  tokens, one observation per step that brings it tokens),
  ``kvforge:e2e_request_latency_seconds`` (arrival to finish);
* counters ``kvforge:prompt_tokens_total``, ``kvforge:generation_tokens_total`` (tokens),
  ``kvforge:request_success_total{finished_reason}`` (finished requests by reason: stop,
  length, abort, error), ``kvforge:num_preemptions_total`` (from the scheduler's stats);
* with speculative decoding (engine stats with ``spec_*`` keys), as vLLM's
  ``vllm:spec_decode_*``: counters ``kvforge:spec_decode_num_drafts_total`` (verification
  rounds), ``kvforge:spec_decode_num_draft_tokens_total``,
  ``kvforge:spec_decode_num_accepted_tokens_total``; gauges
  ``kvforge:spec_decode_acceptance_rate`` (accepted / draft tokens),
  ``kvforge:spec_decode_mean_accepted_length`` (tokens per round, drafts + 1),
  ``kvforge:spec_decode_acceptance_rate_per_pos{position}`` and
  ``kvforge:spec_decode_num_speculative_tokens`` (the adaptive rule's current k).

Each :class:`EngineMetrics` owns a private ``CollectorRegistry``, so several engines
(e.g. in tests) never clash on series names. All methods are thread-safe.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvforge.engine.outputs import RequestOutput

#: ``Content-Type`` of :meth:`EngineMetrics.render`'s output.
CONTENT_TYPE = CONTENT_TYPE_LATEST

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0)


class EngineMetrics:
    """The serving metrics of one engine.

    Args:
        model_name: value of the ``model_name`` label.
        stats_fn: returns the engine's latest stats dict (``num_running``, ``num_waiting``,
            ``kv_cache_usage``, ``prefix_cache_hit_rate``, ...); called at scrape time.
    """

    def __init__(self, model_name: str, stats_fn: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats_fn = stats_fn or (lambda: {})
        labels = {"model_name": model_name}
        reg = self.registry

        def gauge(name: str, doc: str, key: str) -> None:
            g = Gauge(name, doc, ["model_name"], registry=reg).labels(**labels)
            g.set_function(lambda: float(self._stats_fn().get(key, 0.0) or 0.0))

        gauge("kvforge:num_requests_running", "Sequences in the running batch.", "num_running")
        gauge("kvforge:num_requests_waiting", "Sequences waiting to be scheduled.", "num_waiting")
        gauge("kvforge:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", "kv_cache_usage")
        gauge("kvforge:prefix_cache_hit_rate", "Prefix cache hit rate (0..1; 0 without prefix caching).",
              "prefix_cache_hit_rate")
        self.ttft = Histogram("kvforge:time_to_first_token_seconds", "Time to first token (s).",
                              ["model_name"], buckets=_TTFT_BUCKETS, registry=reg).labels(**labels)
        self.tpot = Histogram("kvforge:time_per_output_token_seconds", "Time per output token after the "
                              "first (s).", ["model_name"], buckets=_TPOT_BUCKETS, registry=reg).labels(**labels)
        self.itl = Histogram("kvforge:inter_token_latency_seconds", "Time between a request's successive "
                             "token outputs (s).", ["model_name"], buckets=_TPOT_BUCKETS,
                             registry=reg).labels(**labels)
        self.e2e = Histogram("kvforge:e2e_request_latency_seconds", "Request latency, arrival to finish (s).",
                             ["model_name"], buckets=_E2E_BUCKETS, registry=reg).labels(**labels)
        self.prompt_tokens = Counter("kvforge:prompt_tokens", "Prompt tokens accepted.", ["model_name"],
                                     registry=reg).labels(**labels)
        self.generation_tokens = Counter("kvforge:generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=reg).labels(**labels)
        self._success = Counter("kvforge:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=reg)
        self._labels = labels
        reg.register(_SpecDecodeCollector(model_name, self._stats_fn))
        reg.register(_PreemptionCollector(model_name, self._stats_fn))

    def on_request_added(self, num_prompt_tokens: int) -> None:
        """Count an accepted request's prompt tokens."""
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_tokens: int, itl: float | None = None) -> None:
        """Count newly generated tokens; ``itl``: seconds since the request's previous tokens
        (None for its first), observed in the ITL histogram."""
        if num_tokens > 0:
            self.generation_tokens.inc(num_tokens)
        if itl is not None:
            self.itl.observe(max(0.0, itl))

    def on_request_finished(self, out: RequestOutput, num_output_tokens: int | None = None) -> None:
        """Observe TTFT / TPOT / E2E of a finished request from ``out.metrics`` (monotonic seconds).

        ``num_output_tokens``: the longest completion's token count (TPOT), when ``out`` does
        not hold them all (a DELTA output); default: counted from ``out``.

        TTFT is observed whenever a first token exists; TPOT and E2E only for requests that
        ended normally (``stop`` / ``length``), so aborts and errors do not skew latency.
        """
        reasons = {c.finish_reason for c in out.outputs if c.finish_reason}
        reason = "error" if "error" in reasons else ("abort" if "abort" in reasons else
                                                      ("length" if reasons == {"length"} else "stop"))
        self._success.labels(finished_reason=reason, **self._labels).inc()
        m = out.metrics or {}
        arrival, first, done = m.get("arrival_time"), m.get("first_token_time"), m.get("finished_time")
        if arrival is not None and first is not None:
            self.ttft.observe(max(0.0, first - arrival))
        if reason not in ("stop", "length") or arrival is None or done is None:
            return
        self.e2e.observe(max(0.0, done - arrival))
        num_out = num_output_tokens if num_output_tokens is not None else \
            max((len(c.token_ids) for c in out.outputs), default=0)
        if first is not None and num_out > 1:
            self.tpot.observe(max(0.0, done - first) / (num_out - 1))

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


class _PreemptionCollector:
    """``kvforge:num_preemptions_total``: the scheduler's cumulative preemption count, read from
    the engine's stats at scrape time (0 for a scheduler that does not report one)."""

    def __init__(self, model_name: str, stats_fn: Callable[[], dict[str, float]]) -> None:
        self.model_name = model_name
        self.stats_fn = stats_fn

    def describe(self):
        return []

    def collect(self):
        c = CounterMetricFamily("kvforge:num_preemptions", "Requests preempted because KV blocks ran out.",
                                labels=["model_name"])
        c.add_metric([self.model_name], float(self.stats_fn().get("num_preemptions", 0.0) or 0.0))
        yield c


class _SpecDecodeCollector:
    """Speculative-decoding series, read from the engine's stats at scrape time (nothing
    when the engine does not speculate)."""

    def __init__(self, model_name: str, stats_fn: Callable[[], dict[str, float]]) -> None:
        self.model_name = model_name
        self.stats_fn = stats_fn

    def describe(self):
        return []  # series exist only for speculating engines: let the registry collect lazily

    def collect(self):
        st = self.stats_fn()
        if "spec_num_drafts" not in st:
            return
        m = [self.model_name]
        for key, name, doc in (("spec_num_drafts", "num_drafts", "Verification rounds."),
                               ("spec_num_draft_tokens", "num_draft_tokens", "Draft tokens proposed."),
                               ("spec_num_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted.")):
            c = CounterMetricFamily(f"kvforge:spec_decode_{name}", doc, labels=["model_name"])
            c.add_metric(m, float(st.get(key, 0.0)))
            yield c
        for key, name, doc in (("spec_acceptance_rate", "acceptance_rate", "Accepted / draft tokens (0..1)."),
                               ("spec_mean_accepted_length", "mean_accepted_length",
                                "Tokens emitted per verification round (accepted drafts + 1)."),
                               ("spec_k", "num_speculative_tokens", "Draft tokens per round chosen now (k).")):
            g = GaugeMetricFamily(f"kvforge:spec_decode_{name}", doc, labels=["model_name"])
            g.add_metric(m, float(st.get(key, 0.0)))
            yield g
        g = GaugeMetricFamily("kvforge:spec_decode_acceptance_rate_per_pos",
                              "Accepted / verified drafts at each draft position (0..1).",
                              labels=["model_name", "position"])
        prefix = "spec_acceptance_rate_pos_"
        for key, value in st.items():
            if key.startswith(prefix):
                g.add_metric(m + [key[len(prefix):]], float(value))
        yield g
