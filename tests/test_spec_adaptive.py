"""The adaptive rule with measured step costs (kvforge.engine.spec_adaptive), on a fake clock."""
from __future__ import annotations

import pytest
from helpers import fresh_rng

from kvforge.config import SpeculativeConfig
from kvforge.engine.spec_adaptive import AdaptiveSpeculation, StepCostMeter


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulate(step_ms: dict[int, float], steps: int, batch: int = 64, acceptance: float = 1.0,
             relative_cost: float = 0.13, noise: float = 0.0) -> list[int]:
    """Run the rule as the engine does (tick, choose, label, the step's time passes with
    relative jitter up to ``noise``, verification observed); returns k' per step."""
    rng = fresh_rng("spec-adaptive-sim")
    clock = FakeClock()
    meter = StepCostMeter(clock)
    rule = AdaptiveSpeculation(4, SpeculativeConfig(method="x", num_speculative_tokens=4), relative_cost, meter)
    ks = []
    for _ in range(steps):
        meter.tick()
        k = rule.choose(batch)
        meter.label(batch, k, True)
        clock.t += step_ms[k] * 1e-3 * (1.0 + noise * rng.uniform(-1, 1))
        if k:
            accepted = sum(1 for _ in range(batch * k) if rng.random() < acceptance)
            rule.observe(batch * k, accepted)
        ks.append(k)
    return ks


def test_meter_counts_steady_clean_steps_only():
    clock = FakeClock()
    m = StepCostMeter(clock)
    plan = [(64, 0, True, 7.0), (64, 0, True, 7.0), (64, 1, True, 30.0), (64, 1, True, 16.0),
            (64, 1, False, 50.0), (64, 1, True, 16.0), (64, 1, True, 18.0), (3, 1, True, 1.0)]
    for b, k, clean, ms in plan:
        m.tick()
        m.label(b, k, clean)
        clock.t += ms * 1e-3
    m.tick()
    # k'=0: the first step follows nothing, the second is steady
    assert m.time(64, 0) == pytest.approx(7e-3)
    # k'=1: the switch step (30 ms) and the unclean one are left out; the one after the
    # unclean step is a switch too; 16 then 18 ms averaged with ALPHA
    assert m.time(64, 1) == pytest.approx(16e-3 + StepCostMeter.ALPHA * 2e-3)
    assert m.time(3, 1) is None and m.time(100, 1) == m.time(64, 1)  # 64..127 share a bucket


def test_meter_drops_a_pause_unless_it_repeats():
    clock = FakeClock()
    m = StepCostMeter(clock)
    for ms in [5, 5, 5, 200] + [40] * 6:
        m.tick()
        m.label(8, 0, True)
        clock.t += ms * 1e-3
    m.tick()
    assert m.time(8, 0) > 20e-3  # 40 ms repeated: a real change, taken in after OUTLIER_RUN tries
    clock2 = FakeClock()
    m2 = StepCostMeter(clock2)
    for ms in [5, 5, 5, 200, 5, 5]:
        m2.tick()
        m2.label(8, 0, True)
        clock2.t += ms * 1e-3
    m2.tick()
    assert m2.time(8, 0) == pytest.approx(5e-3)


def test_measured_costs_turn_off_speculation_the_model_would_keep():
    """At batch 64 the model (o = 0.25) expects a k'=1 step to cost 1.4 plain steps; here it
    costs 2.3 (host work of a synchronous step), so two tokens per step do not pay."""
    rule = AdaptiveSpeculation(4, SpeculativeConfig(method="x", num_speculative_tokens=4), 0.13)
    assert rule.best_k(64, 1.0) == 1  # the model alone speculates
    ks = simulate({0: 6.8, 1: 15.9, 2: 19.0, 3: 22.0, 4: 25.0}, steps=2000, noise=0.05)
    spec_steps = sum(1 for k in ks if k)
    # two steps to measure k'=1, then (not even acceptance 1 would pay) a probe per 1024 steps
    assert ks[-1] == 0 and spec_steps <= 6, spec_steps
    assert any(ks), "the model's choice was never tried"


@pytest.mark.parametrize("step_ms,expect", [({0: 6.8, 1: 8.0, 2: 9.0, 3: 10.0, 4: 11.0}, 4),
                                            ({0: 6.8, 1: 8.0, 2: 16.0, 3: 24.0, 4: 32.0}, 1)])
def test_measured_costs_pick_the_k_that_pays(step_ms, expect):
    ks = simulate(step_ms, steps=400, noise=0.05)
    assert ks[-50:].count(expect) >= 45, ks[-50:]


def test_low_acceptance_turns_off_even_when_steps_are_cheap():
    ks = simulate({0: 6.8, 1: 6.9, 2: 7.0, 3: 7.1, 4: 7.2}, steps=600, acceptance=0.02, noise=0.02)
    assert ks[-100:].count(0) >= 95
    # cheap steps: probes keep re-measuring the acceptance (every 64, 128, 256... steps)
    assert sum(1 for k in ks[100:] if k) >= 4
