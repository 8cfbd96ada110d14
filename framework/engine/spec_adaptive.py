"""The adaptive speculation rule: how many drafts (k') a step verifies, 0 = none.

Expected tokens per verification come from the measured acceptance rate (Leviathan et
al. 2023, eq. 1). The cost of a speculating step relative to a plain decode step starts
from an analytical model and, with ``speculative.measure_step_cost``, is replaced by the
wall time of steps measured while serving (:class:`StepCostMeter`), in the spirit of
SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving LLMs Using
Goodput"): on a fast GPU at batch 64 the host work of a synchronous verifying step can
outweigh the tokens it gains, and no fixed model knows that for every machine.
"""
from __future__ import annotations

import math
import time
from typing import Callable

__all__ = ["AdaptiveSpeculation", "StepCostMeter"]


class StepCostMeter:
    """Wall time of pure-decode engine steps, by batch-size bucket and k'.

    :meth:`tick` is called at the start of every step and :meth:`label` says what that
    step runs; the interval to the next tick (seconds) is the step's cost, counted only when the step
    and the one before it were pure decodes of the same bucket and k' (so the first step
    after a switch, whose time includes draining or refilling the async pipeline, is
    left out). Samples go into an exponential moving average (weight ``ALPHA``); one more
    than ``OUTLIER`` times the average (a pause between steps) is dropped unless it
    repeats ``OUTLIER_RUN`` times in a row.

    Buckets: batch sizes ``2^(j-1) .. 2^j - 1`` share bucket ``j`` (1, 2-3, 4-7, ...).
    """

    ALPHA = 0.25
    OUTLIER = 3.0
    OUTLIER_RUN = 3

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.times: dict[tuple[int, int], float] = {}  # (bucket, k') -> seconds per step
        self._last: tuple[float, tuple[int, int] | None] | None = None  # (start, key if clean)
        self._prev_key: tuple[int, int] | None = None
        self._outliers = 0

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(1, int(batch_size)).bit_length()

    def time(self, batch_size: int, k: int) -> float | None:
        """Mean seconds per step at this batch size's bucket and k' (None: not measured)."""
        return self.times.get((self.bucket(batch_size), k))

    def tick(self) -> None:
        """A step starts: the previous one's interval ends (call before choosing k')."""
        now = self.clock()
        if self._last is not None:
            start, last_key = self._last
            if last_key is not None and last_key == self._prev_key:
                self._record(last_key, now - start)
            self._prev_key = last_key
        self._last = (now, None)

    def label(self, batch_size: int, k: int, clean: bool) -> None:
        """What the step :meth:`tick` started runs: ``batch_size`` decodes with ``k`` drafts
        each; ``clean`` = nothing but one-token decodes (and their drafts) is scheduled."""
        if self._last is not None:
            self._last = (self._last[0], (self.bucket(batch_size), k) if clean else None)

    def _record(self, key: tuple[int, int], seconds: float) -> None:
        old = self.times.get(key)
        if old is None:
            self.times[key] = seconds
            return
        if seconds > self.OUTLIER * old:
            self._outliers += 1
            if self._outliers < self.OUTLIER_RUN:
                return
        self._outliers = 0
        self.times[key] = old + self.ALPHA * (seconds - old)


class AdaptiveSpeculation:
    """Chooses this step's k' (0 = no speculation).

    Rule (``speculative`` config section): with ``a`` the recent per-draft acceptance
    probability, ``B`` the running requests, ``c`` the drafter's ``relative_cost`` and
    ``T`` = ``verify_free_tokens``:

    * expected tokens per step with k' drafts (Leviathan et al. 2023, eq. 1):
      ``E(k') = (1 - a^(k'+1)) / (1 - a)``;
    * step cost relative to a plain decode step, modelled:
      ``C(B, k') = (1 + c k') * max(B (k'+1), T) / max(B, T) * (1 + o)`` for k' >= 1 (a forward
      costs about the same up to ``T`` tokens, memory-bound, then grows linearly; ``o`` =
      ``step_overhead``, the host work of a synchronous verifying step);
    * with a :class:`StepCostMeter` (``measure_step_cost``) and both k' and plain steps
      measured at B's bucket, ``C`` is the measured time ratio instead; a k' not yet
      measured keeps the model scaled by how far the model was off for the measured k'
      of that bucket (geometric mean);
    * k' = argmax over 0..k of ``E(k') / C(B, k')`` (ties: the smaller k'; with measured
      costs a k' >= 1 must beat plain decoding by ``MEASURED_MARGIN``); 0 when
      ``B > disable_by_batch_size``. With ``adaptive`` off k' = k (still 0 above
      ``disable_by_batch_size``).

    ``a`` starts at ``initial_acceptance_rate``; each verified step moves it towards that
    step's accepted / tried drafts (a round with a rejection tried ``accepted + 1``) with
    weight ``tried / (tried + 32)``, so a large batch is trusted more than one request.

    Probes (measured steps need two in a row, :class:`StepCostMeter`): when the rule
    speculates at a bucket whose plain step time is unknown, two plain steps measure it
    first; once its k' is measured, two steps each measure the unmeasured neighbours
    k' + 1 and k' - 1, so the choice climbs to the measured best. While the rule says 0 but the model would speculate at
    ``initial_acceptance_rate``, two steps with k' = 1 probe again after ``PROBE_INTERVAL``
    plain steps, an interval that doubles after each probe that does not turn speculation
    back on (up to ``MAX_PROBE_INTERVAL``, at once when the measured costs leave no gain
    even at acceptance 1), so a drafter that starts to match again is picked up and one
    that never pays costs little.
    """

    PSEUDO_COUNT = 32
    PROBE_INTERVAL = 64
    MAX_PROBE_INTERVAL = 1024
    PROBE_STEPS = 2
    MEASURED_MARGIN = 0.05  # measured times are noisy: speculate only for a clear gain

    def __init__(self, k: int, config, relative_cost: float, meter: StepCostMeter | None = None) -> None:
        self.k = k
        self.adaptive = bool(config.adaptive)
        self.disable_by_batch_size = config.disable_by_batch_size
        self.free_tokens = config.verify_free_tokens
        self.prior = config.initial_acceptance_rate
        self.overhead = config.step_overhead
        self.relative_cost = max(0.0, float(relative_cost))
        self.meter = meter
        self.acceptance = self.prior
        self._off_steps = 0
        self._probe_interval = self.PROBE_INTERVAL
        self._hold: tuple[int, int] | None = None  # (k', steps left) of a running probe

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def cost(self, batch_size: int, k: int) -> float:
        """Modelled cost of a step with k' drafts per request relative to a plain step."""
        b, t = max(1, batch_size), self.free_tokens
        if k == 0:
            return 1.0
        return (1.0 + self.relative_cost * k) * max(b * (k + 1), t) / max(b, t) * (1.0 + self.overhead)

    def costs(self, batch_size: int) -> list[float]:
        """Cost of k' = 0..k relative to a plain step: measured where the meter has both
        times, else modelled (scaled by the model's measured error at this bucket)."""
        model = [self.cost(batch_size, k) for k in range(self.k + 1)]
        base = self.meter.time(batch_size, 0) if self.meter is not None else None
        if not base:
            return model
        measured = [None] + [self.meter.time(batch_size, k) for k in range(1, self.k + 1)]
        logs = [math.log(m / base / model[k]) for k, m in enumerate(measured) if m]
        scale = math.exp(sum(logs) / len(logs)) if logs else 1.0
        return [1.0] + [measured[k] / base if measured[k] else model[k] * scale for k in range(1, self.k + 1)]

    def best_k(self, batch_size: int, acceptance: float, costs: list[float] | None = None,
               margin: float = 0.0) -> int:
        """argmax_k' E(k') / C(B, k') at this acceptance (0 unless some k' beats plain
        decoding by more than ``margin``, a fraction)."""
        costs = costs if costs is not None else [self.cost(batch_size, k) for k in range(self.k + 1)]
        best_k, best = 0, 1.0 + margin
        for k in range(1, self.k + 1):
            gain = self.expected_tokens(acceptance, k) / costs[k]
            if gain > best * (1.0 + 1e-9):
                best_k, best = k, gain
        return best_k

    def _start_probe(self, k: int) -> int:
        self._hold = (k, self.PROBE_STEPS - 1) if self.PROBE_STEPS > 1 else None
        return k

    def choose(self, batch_size: int) -> int:
        if self.disable_by_batch_size is not None and batch_size > self.disable_by_batch_size:
            return 0
        if not self.adaptive:
            return self.k
        if self._hold is not None:
            k, left = self._hold
            self._hold = (k, left - 1) if left > 1 else None
            return k
        measured = self.meter is not None and self.meter.time(batch_size, 0) is not None
        k = self.best_k(batch_size, self.acceptance, self.costs(batch_size),
                        self.MEASURED_MARGIN if measured else 0.0)
        if k > 0:
            self._off_steps = 0
            self._probe_interval = self.PROBE_INTERVAL
            if self.meter is not None:
                if self.meter.time(batch_size, 0) is None:
                    return self._start_probe(0)  # measure the plain step this is compared with
                if self.meter.time(batch_size, k) is not None:
                    # hill-climb: an unmeasured neighbour is only modelled; measure it once
                    for n in (k + 1, k - 1):
                        if 1 <= n <= self.k and self.meter.time(batch_size, n) is None:
                            return self._start_probe(n)
            return k
        self._off_steps += 1
        interval = self._probe_interval
        if measured and self.best_k(batch_size, 1.0, self.costs(batch_size), self.MEASURED_MARGIN) == 0:
            interval = self.MAX_PROBE_INTERVAL  # at the measured cost not even perfect drafts pay
        if self._off_steps >= interval and self.best_k(batch_size, self.prior) > 0:
            self._off_steps = 0
            self._probe_interval = min(2 * self._probe_interval, self.MAX_PROBE_INTERVAL)
            return self._start_probe(1)
        return 0

    def observe(self, tried: int, accepted: int) -> None:
        if tried > 0:
            w = tried / (tried + self.PSEUDO_COUNT)
            self.acceptance += w * (accepted / tried - self.acceptance)
