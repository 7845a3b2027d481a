"""The step-cost fit from the sums the engine exports (engine/step_cost.py sums them; the same terms)."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine_contract import STEP_COST_TERMS
from kvpilot.operator import step_cost


def sums_of(steps: list[tuple[float, float, float]]) -> dict[str, float]:
    """(rows, prefill tokens, seconds) per step -> the exported sums."""
    sums = dict.fromkeys(STEP_COST_TERMS, 0.0)
    for r, p, t in steps:
        for term, value in zip(STEP_COST_TERMS, (1, r, p, t, r * r, r * p, p * p, r * t, p * t, t * t)):
            sums[term] += value
    return sums


def simulated(rows: list[int], prefill: list[int], n: int = 2000, noise: float = 0.002, seed: int = 0,
              speed: float = 1.0) -> list[tuple[float, float, float]]:
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        r, p = rng.choice(rows), rng.choice(prefill)
        steps.append((r, p, speed * (0.020 + 0.003 * r + 0.0004 * p) + rng.gauss(0.0, noise)))
    return steps


def test_recovers_the_line_and_its_spread():
    cost = step_cost.fit(sums_of(simulated([4, 8, 16], [0, 0, 64, 200])))
    assert cost.slope_measured
    assert cost.intercept == pytest.approx(0.020, abs=5e-4)
    assert cost.per_row == pytest.approx(0.003, rel=0.03)
    assert cost.per_prefill_token == pytest.approx(0.0004, rel=0.03)
    assert cost.residual_sd == pytest.approx(0.002, rel=0.1)
    assert cost.rows_for(cost.seconds(12)) == pytest.approx(12)


def test_one_batch_size_takes_half_the_step_as_fixed():
    cost = step_cost.fit(sums_of(simulated([8], [0], noise=0.0)))
    assert not cost.slope_measured
    step = 0.020 + 0.003 * 8
    assert cost.intercept == pytest.approx(step / 2) and cost.seconds(8) == pytest.approx(step)
    assert "one batch size seen" in cost.describe()


def test_too_few_steps_fit_nothing():
    assert step_cost.fit(sums_of(simulated([4, 8], [0], n=10))) is None


def test_windows_add_up_with_weights():
    a, b = sums_of(simulated([4], [0], seed=1)), sums_of(simulated([16], [0], seed=2))
    assert step_cost.add([(a, 1.0), (b, 1.0)])["steps"] == 4000
    cost = step_cost.fit(step_cost.add([(a, 1.0), (b, 0.5)]))
    assert cost.slope_measured and cost.per_row == pytest.approx(0.003, rel=0.05)


def test_windows_at_other_machine_speeds_keep_the_line_and_read_each_level():
    # A neighbour's load makes one of two windows at 16 run 30% slow: fitted plainly, the slope takes
    # part of it. (One window per batch size could not tell a slow machine from a steep line.)
    windows = [sums_of(simulated([4], [0], seed=3)), sums_of(simulated([16], [0], seed=4, speed=1.3)),
               sums_of(simulated([10], [0], seed=5)), sums_of(simulated([16], [0], seed=6)),
               sums_of(simulated([4], [0], seed=7))]
    plain = step_cost.fit(step_cost.add([(w, 1.0) for w in windows]))
    cost, levels = step_cost.fit_levelled([(w, 1.0) for w in windows])
    assert plain.per_row > 0.0033  # the slow window's time read as the rows'
    assert cost.per_row == pytest.approx(0.003, rel=0.05)
    assert levels[1] == pytest.approx(1.3, rel=0.05)
    assert all(lv == pytest.approx(1.0, rel=0.05) for i, lv in enumerate(levels) if i != 1)
