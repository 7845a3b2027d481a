"""Admission by predicted wait: how long a request arriving now would wait for a batch slot.

``--max-waiting-requests`` caps the waiting queue by count, but the count that keeps a time to first
token (TTFT) SLO moves with the traffic: 70 short chats start within 10 s on a CPU pod, 70 long prompts
take a minute. ``--max-waiting-seconds`` caps it by time instead: a request is turned away (429 +
Retry-After, which the kvpilot gateway answers by trying another Ready pod) when the requests waiting
ahead of it would take longer than that to start at the pace the engine has been starting them. Under
overload a first-come-first-served queue otherwise grows until every request waits past the SLO, and
the backlog outlives the burst; capped by time, the admitted requests keep their TTFT and the rest
learn at once that this pod is full.

``StartRate`` measures that pace on the engine's own steps: requests that left the waiting queue per
second of step time while one waited, weighted towards the last ``horizon`` seconds of such time.
"""

from __future__ import annotations

import math

# Seconds of busy step time the rate is weighted over: long enough to average the starts that come
# in bunches as a batch's requests finish together, short enough to follow a change of traffic.
HORIZON_S = 10.0
# Busy seconds observed before the rate predicts anything; until then only the count limit applies.
MIN_BUSY_S = 1.0


class StartRate:
    """Requests the engine starts per second while requests wait (engine thread writes, any reads
    under the caller's lock)."""

    def __init__(self, horizon_s: float = HORIZON_S, min_busy_s: float = MIN_BUSY_S) -> None:
        if horizon_s <= 0 or min_busy_s < 0:
            raise ValueError(f"horizon_s must be > 0 and min_busy_s >= 0, got {horizon_s}, {min_busy_s}")
        self.horizon_s = horizon_s
        self.min_busy_s = min_busy_s
        self._busy_s = 0.0  # decayed step time with a request waiting
        self._started = 0.0  # decayed requests that left the waiting queue in that time
        self._observed_s = 0.0  # undecayed busy time, for the warm-up

    def observe(self, step_seconds: float, queued: int, started: int) -> None:
        """One engine step of ``step_seconds`` that found ``queued`` requests waiting (those left
        from before and those added since) and started ``started`` of them. Steps with none
        waiting say nothing about how fast waiting requests start, and are skipped."""
        if queued <= 0 or step_seconds <= 0:
            return
        keep = math.exp(-step_seconds / self.horizon_s)
        self._busy_s = self._busy_s * keep + step_seconds
        self._started = self._started * keep + max(0, min(started, queued))
        self._observed_s += step_seconds

    @property
    def per_second(self) -> float | None:
        """Requests started per busy second; None before ``min_busy_s`` of evidence."""
        if self._observed_s <= 0 or self._observed_s < self.min_busy_s:
            return None
        return self._started / self._busy_s

    def predicted_wait(self, waiting: int) -> float | None:
        """Seconds until a request queued behind ``waiting`` others starts; None when unknown.
        A queue that started nothing in the whole horizon predicts an unbounded wait."""
        if waiting <= 0:
            return 0.0
        rate = self.per_second
        if rate is None:
            return None
        return math.inf if rate <= 0 else waiting / rate
