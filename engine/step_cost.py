"""The engine's own cost curve: what each step carried and how long it took, summed for export.

Every step knows its composition — decode rows (sequences computing one token) and prefill tokens
(everything else it computes: prompt chunks, recomputation after a preemption, verified proposals)
— and its duration. Two views go to /metrics (names in kvpilot/engine_contract.py):

- the sums a least-squares fit of ``seconds ≈ a + b·rows + c·prefill`` needs (``STEP_COST_TERMS``:
  counts, sums, sums of squares and of products), so a scraper fits the step cost of any window
  from two scrapes, over every step of it rather than one P99;
- a histogram of step durations by kind, ``decode`` (decode rows only) and ``prefill`` (carrying
  prefill tokens), whose tails show whether slow steps come from the batch or from prefill chunks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvpilot.engine_contract import INTER_TOKEN_LATENCY_BUCKETS, STEP_COST_TERMS, STEP_KINDS


@dataclass(frozen=True)
class StepCostSnapshot:
    sums: dict[str, float]  # STEP_COST_TERMS -> running sum
    bucket_counts: dict[str, tuple[int, ...]]  # step kind -> count per bucket of INTER_TOKEN_LATENCY_BUCKETS, +Inf last
    seconds: dict[str, float]  # step kind -> summed duration


@dataclass
class StepCost:
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_COST_TERMS, 0.0))
    bucket_counts: dict[str, list[int]] = field(
        default_factory=lambda: {kind: [0] * (len(INTER_TOKEN_LATENCY_BUCKETS) + 1) for kind in STEP_KINDS})
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        r, p, t = float(decode_rows), float(prefill_tokens), seconds
        for term, value in zip(STEP_COST_TERMS, (1.0, r, p, t, r * r, r * p, p * p, r * t, p * t, t * t)):
            self.sums[term] += value
        kind = "prefill" if prefill_tokens else "decode"
        self.bucket_counts[kind][bisect.bisect_left(INTER_TOKEN_LATENCY_BUCKETS, seconds)] += 1
        self.seconds[kind] += seconds

    def snapshot(self) -> StepCostSnapshot:
        return StepCostSnapshot(dict(self.sums), {k: tuple(v) for k, v in self.bucket_counts.items()},
                                dict(self.seconds))
