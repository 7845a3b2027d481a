"""The engine's step cost, fitted from the sums it exports: seconds ≈ a + b·decode rows + c·prefill tokens.

The engine sums, over every step, the terms a least-squares fit needs
(``kvpilot_step_cost_sums_total{term}``, engine/step_cost.py); the difference of two scrapes is a
window's sums, and sums of several windows or pods add up. ``fit`` solves the normal equations.
Within one window at saturation the batch hardly varies, so the slope comes from pooling windows
at different settings. Until there are such windows, half of a step's time (after the prefill
tokens' share) is taken as fixed and half as the rows': a guess that errs by at most about ×2
either way on the next move, which the next window, at another batch size, then measures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvpilot.engine_contract import STEP_COST_TERMS

# Relative spread below which a regressor counts as constant (no slope can be read from it).
_MIN_RELATIVE_SPREAD = 0.15
# Until the slope is measured: the share of a step's time taken as fixed cost.
PRIOR_FIXED_SHARE = 0.5
LEVEL_ITERATIONS = 4
LEVEL_POWER = 16  # a window 5% slower than the fastest weighs 0.44 in the next fit, 10% slower 0.2


@dataclass(frozen=True)
class StepCost:
    """seconds ≈ intercept + per_row · rows + per_prefill_token · prefill tokens, over ``steps`` steps."""

    intercept: float
    per_row: float
    per_prefill_token: float
    residual_sd: float  # seconds: the steps' spread around the line
    steps: float
    slope_measured: bool  # False: one batch size seen, the split between intercept and per_row a prior

    def seconds(self, rows: float, prefill_tokens: float = 0.0) -> float:
        return self.intercept + self.per_row * rows + self.per_prefill_token * prefill_tokens

    def rows_for(self, seconds: float, prefill_tokens: float = 0.0) -> float:
        """The decode rows whose step takes ``seconds`` (inf when rows cost nothing)."""
        if self.per_row <= 0:
            return math.inf
        return (seconds - self.intercept - self.per_prefill_token * prefill_tokens) / self.per_row

    def describe(self) -> str:
        text = f"step≈{self.intercept * 1e3:.1f}+{self.per_row * 1e3:.2f}·rows"
        if self.per_prefill_token:
            text += f"+{self.per_prefill_token * 1e3:.3f}·prefill"
        return text + " ms" + ("" if self.slope_measured else " (one batch size seen: half of it taken as fixed)")


def add(weighted: Iterable[tuple[Mapping[str, float], float]]) -> dict[str, float]:
    """Windows' (or pods') sums added, each scaled by its weight."""
    total = dict.fromkeys(STEP_COST_TERMS, 0.0)
    for sums, weight in weighted:
        for term in STEP_COST_TERMS:
            total[term] += weight * sums.get(term, 0.0)
    return total


def fit(sums: Mapping[str, float], min_steps: float = 50.0) -> StepCost | None:
    """Least squares of step seconds on decode rows and prefill tokens; None with too few steps."""
    n = sums.get("steps", 0.0)
    if n < min_steps:
        return None
    mean = {name: sums[name] / n for name in ("rows", "prefill", "seconds")}

    def cov(x: str, y: str) -> float:
        key = f"{x}_{y}" if f"{x}_{y}" in sums else f"{y}_{x}"
        return sums[key] / n - mean[x] * mean[y]

    def varies(x: str) -> bool:
        return cov(x, x) > (_MIN_RELATIVE_SPREAD * max(mean[x], 1.0)) ** 2

    regressors = [x for x in ("rows", "prefill") if varies(x)]
    slopes = dict.fromkeys(("rows", "prefill"), 0.0)
    if len(regressors) == 2:
        srr, spp, srp = cov("rows", "rows"), cov("prefill", "prefill"), cov("rows", "prefill")
        det = srr * spp - srp * srp
        if det <= 1e-12 * srr * spp:
            regressors = ["rows"]  # collinear: prefill rides with the batch
        else:
            srt, spt = cov("rows", "seconds"), cov("prefill", "seconds")
            slopes["rows"] = (spp * srt - srp * spt) / det
            slopes["prefill"] = (srr * spt - srp * srt) / det
    if len(regressors) == 1:
        x = regressors[0]
        slopes[x] = cov(x, "seconds") / cov(x, x)
    intercept = mean["seconds"] - slopes["rows"] * mean["rows"] - slopes["prefill"] * mean["prefill"]
    slope_measured = "rows" in regressors and slopes["rows"] > 0
    if not slope_measured:
        # One batch size: the rows' share of the time is unknown (see the module docstring).
        decode_seconds = max(mean["seconds"] - slopes["prefill"] * mean["prefill"], 0.0)
        intercept = PRIOR_FIXED_SHARE * decode_seconds
        slopes["rows"] = (1 - PRIOR_FIXED_SHARE) * decode_seconds / max(mean["rows"], 1.0)
    predicted_sq = _mean_square_prediction(sums, n, intercept, slopes["rows"], slopes["prefill"])
    residual_var = max(sums["seconds_seconds"] / n - 2 * _mean_cross(sums, n, intercept, slopes) + predicted_sq, 0.0)
    return StepCost(intercept, slopes["rows"], max(slopes["prefill"], 0.0), math.sqrt(residual_var), n,
                    slope_measured)


def level(sums: Mapping[str, float], cost: StepCost) -> float | None:
    """How fast a window's steps ran against ``cost``: their seconds over the fitted seconds."""
    fitted = cost.intercept * sums["steps"] + cost.per_row * sums["rows"] + cost.per_prefill_token * sums["prefill"]
    return sums["seconds"] / fitted if fitted > 0 else None


def fit_levelled(weighted: list[tuple[Mapping[str, float], float]], min_steps: float = 50.0
                 ) -> tuple[StepCost, list[float]] | None:
    """The step cost of the machine at its own speed, from windows some of which ran slower (a
    neighbour's load comes and goes; nothing makes a machine faster than it is): seconds ≈
    level · (a + b·rows + c·prefill), one level ≥ 1 per window. Windows slower than the fastest
    against the line weigh less in the next fit, a few times over (reweighted least squares), so
    the line follows the unloaded machine; each window's level is read against it."""
    cost = fit(add(weighted), min_steps)
    if cost is None:
        return None
    for _ in range(LEVEL_ITERATIONS):
        levels = [level(sums, cost) or 1.0 for sums, _ in weighted]
        fastest = min(levels)
        reweighted = [(sums, weight * (fastest / lv) ** LEVEL_POWER) for (sums, weight), lv in zip(weighted, levels)]
        cost = fit(add(reweighted), min_steps) or cost
    return cost, [level(sums, cost) or 1.0 for sums, _ in weighted]


def _mean_cross(sums: Mapping[str, float], n: float, a: float, slopes: Mapping[str, float]) -> float:
    """Mean of seconds · prediction."""
    return (a * sums["seconds"] + slopes["rows"] * sums["rows_seconds"]
            + slopes["prefill"] * sums["prefill_seconds"]) / n


def _mean_square_prediction(sums: Mapping[str, float], n: float, a: float, b: float, c: float) -> float:
    """Mean of (a + b·rows + c·prefill)²."""
    return (a * a * n + b * b * sums["rows_rows"] + c * c * sums["prefill_prefill"] + 2 * a * b * sums["rows"]
            + 2 * a * c * sums["prefill"] + 2 * b * c * sums["rows_prefill"]) / n
