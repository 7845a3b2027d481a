"""The tuner: one window's observation in, the next engine parameters out.

A pure function. Under a saturating load a continuous-batching engine's
throughput rises with the running batch while its inter-token latency (ITL)
grows about linearly with it (every decode step carries the whole batch), so
the best ``max_num_seqs`` for an ITL SLO is the largest batch whose P99 ITL
still meets it. The tuner fits ``ITL P99 ≈ a + b·batch`` from its recent
windows (least squares, weighted towards recent windows and towards points
near the target, so a convex tail far away does not drag the line), aims at
the SLO less a safety margin, and moves there:

- SLO violated: back off at once, towards the fitted target (at most to a
  quarter per interval), never below a setting recently seen to meet it.
- Headroom and saturated (running ≈ max_num_seqs with a queue): grow towards
  the fitted target in bounded steps; never up to a setting recently seen to
  violate (over more than one window: one stalled window backs a setting off
  but does not rule it out); never past what the KV cache holds at the
  observed sequence lengths.
- Otherwise, inside the margin band or the hysteresis band, during a
  cooldown, or with too little traffic to learn from: hold still.

The TTFT SLO splits by where the time to first token goes. Made of prefill
(the steps are too slow for prompts to get through), it is the batch's to fix,
as ITL is: over the SLO the tuner backs off, near it the tuner holds. Made of
queueing, it is capacity's: growing the batch would trade inter-token latency
for it, so the tuner never grows past what the ITL SLO allows (and holds when
there is no ITL SLO), and the autoscaler adds replicas instead.

GPU memory utilization moves rarely (each change restarts pods): up one step
when preemptions in consecutive windows show the KV cache is what limits the
batch, down one step after an out-of-memory kill, and never again up to a
fraction that ran out of memory.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from kvpilot.operator.engine_metrics import Observation
from kvpilot.operator.spec import EngineSettings, Tuning


@dataclass(frozen=True)
class TunerConfig:
    margin: float = 0.05  # aim the P99 ITL at (1 - margin) × SLO
    min_itl_samples: int = 300  # fewer inter-token gaps than this: the P99 is noise
    max_growth: float = 2.0  # at most ×2 per interval upwards
    max_backoff: float = 0.25  # at most ÷4 per interval downwards
    hysteresis: float = 0.05  # ignore upward moves smaller than this fraction of max_num_seqs
    probe: float = 0.25  # a fitted best this many sequences above a small setting: try one more
    cooldown_seconds: float = 0.0  # between max_num_seqs changes (windows restart anyway)
    saturation_fill: float = 0.8  # batch ≥ this × max_num_seqs (with a queue) counts as saturated
    drain_slack: float = 1.1  # batch above this × max_num_seqs: still draining a decrease
    kv_headroom: float = 0.9  # use at most this share of the KV cache at observed lengths
    fit_window: int = 12  # windows used for the latency fit
    fit_max_ratio: float = 2.0  # windows with a P99 ITL beyond this × target stay out of the fit
    recency: float = 0.75  # weight of a window relative to the next newer one
    bracket_windows: int = 20  # how long a setting's last verdict (good/bad) is trusted
    tight_bracket: float = 1 / 3  # a bad setting this close above the current one: stop probing
    throughput_tolerance: float = 0.97  # a larger setting this much slower than a smaller one is worse
    history_length: int = 24
    memory_step: float = 0.02
    memory_cooldown_seconds: float = 600.0


@dataclass(frozen=True)
class Sample:
    """What one window taught: latency at a batch size, under one setting."""

    time: float
    max_num_seqs: int
    batch: float
    itl_p99: float
    tokens_per_second: float
    saturated: bool
    violated: bool  # the latest windows at this setting, averaged, were too slow for an SLO
    preempting: bool
    evidence_windows: int = 1  # how many windows that average spans
    ttft_p99: float | None = None


@dataclass(frozen=True)
class Change:
    time: float
    parameter: str  # "maxNumSeqs" or "gpuMemoryUtilization"
    old: float
    new: float
    reason: str


@dataclass(frozen=True)
class TuningHistory:
    samples: tuple[Sample, ...] = ()
    changes: tuple[Change, ...] = ()
    oom_memory_ceiling: float | None = None  # a fraction that ran out of memory

    def to_dict(self) -> dict:
        return {
            "samples": [asdict(s) for s in self.samples],
            "changes": [asdict(c) for c in self.changes],
            "oomMemoryCeiling": self.oom_memory_ceiling,
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> TuningHistory:
        if not data:
            return cls()
        return cls(
            samples=tuple(Sample(**s) for s in data.get("samples", ())),
            changes=tuple(Change(**c) for c in data.get("changes", ())),
            oom_memory_ceiling=data.get("oomMemoryCeiling"),
        )

    def last_change(self, parameter: str) -> Change | None:
        return next((c for c in reversed(self.changes) if c.parameter == parameter), None)


@dataclass(frozen=True)
class Decision:
    settings: EngineSettings
    reason: str
    history: TuningHistory
    previous: EngineSettings

    @property
    def num_seqs_changed(self) -> bool:
        return self.settings.max_num_seqs != self.previous.max_num_seqs

    @property
    def live_settings_changed(self) -> bool:
        """What the engines take live, through their admin API."""
        return (self.settings.max_num_seqs, self.settings.max_num_batched_tokens) != \
            (self.previous.max_num_seqs, self.previous.max_num_batched_tokens)

    @property
    def memory_changed(self) -> bool:
        return self.settings.gpu_memory_utilization != self.previous.gpu_memory_utilization

    @property
    def changed(self) -> bool:
        return self.settings != self.previous


@dataclass(frozen=True)
class LatencyFit:
    """ITL P99 ≈ intercept + slope · batch, in seconds."""

    intercept: float
    slope: float

    def batch_for(self, itl_seconds: float) -> float:
        return (itl_seconds - self.intercept) / self.slope

    def describe(self) -> str:
        return f"ITL≈{self.intercept * 1e3:.1f}+{self.slope * 1e3:.2f}·batch ms"


def fit_latency(samples: tuple[Sample, ...], target_itl: float, config: TunerConfig) -> LatencyFit | None:
    """Weighted least squares of ITL P99 on batch; None when the batches don't spread or slope ≤ 0.

    Weights favour recent windows and windows near the target latency.
    """
    # Windows far over the target (deep in overload, where latency explodes) say nothing
    # about the slope near it.
    recent = [s for s in samples[-config.fit_window :] if s.itl_p99 <= config.fit_max_ratio * target_itl]
    if len(recent) < 2:
        return None
    points = []
    for age, s in enumerate(reversed(recent)):
        closeness = 1.0 / (1.0 + abs(s.itl_p99 - target_itl) / target_itl) if math.isfinite(target_itl) else 1.0
        points.append((s.batch, s.itl_p99, config.recency**age * closeness**2))
    total = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    var_x = sum(w * (x - mean_x) ** 2 for x, _, w in points) / total
    if var_x < max(1.0, (0.1 * mean_x) ** 2) / 4:
        return None  # one batch size seen: the slope is unknown
    cov = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / total
    slope = cov / var_x
    if slope <= 0:
        return None
    return LatencyFit(mean_y - slope * mean_x, slope)


def tune(
    observation: Observation | None,
    settings: EngineSettings,
    tuning: Tuning,
    history: TuningHistory,
    now: float,
    oom_kills: int = 0,
    config: TunerConfig = TunerConfig(),
) -> Decision:
    """Decide the next settings from the latest window, within ``tuning``'s SLO and bounds.

    See the module docstring.
    """

    def decide(new: EngineSettings, reason: str, hist: TuningHistory | None = None) -> Decision:
        hist = history if hist is None else hist
        changes = list(hist.changes)
        if new.max_num_seqs != settings.max_num_seqs:
            changes.append(Change(now, "maxNumSeqs", settings.max_num_seqs, new.max_num_seqs, reason))
        if new.gpu_memory_utilization != settings.gpu_memory_utilization:
            changes.append(Change(now, "gpuMemoryUtilization", settings.gpu_memory_utilization,
                                  new.gpu_memory_utilization, reason))
        hist = replace(hist, changes=tuple(changes[-config.history_length :]))
        return Decision(new, reason, hist, settings)

    m = settings.max_num_seqs
    mem = settings.gpu_memory_utilization
    seq_bounds, slo = tuning.max_num_seqs, tuning.slo

    if oom_kills > 0:
        ceiling = mem if history.oom_memory_ceiling is None else min(mem, history.oom_memory_ceiling)
        lowered = tuning.gpu_memory_utilization.clamp(mem - 2 * config.memory_step)
        hist = replace(history, oom_memory_ceiling=ceiling)
        if lowered < mem:
            reason = (
                f"{oom_kills} pod(s) ran out of memory at gpu_memory_utilization {mem:g}: "
                f"lowering it to {lowered:g}"
            )
            return decide(settings.replace(gpu_memory_utilization=lowered), reason, hist)
        backed = seq_bounds.clamp(m * 0.75)
        reason = (
            f"{oom_kills} pod(s) ran out of memory at the lowest allowed gpu_memory_utilization {mem:g}: "
            f"lowering max_num_seqs {m} → {backed}"
        )
        return decide(settings.replace(max_num_seqs=backed), reason, hist)

    clamped = seq_bounds.clamp(m)
    if clamped != m:
        return decide(
            _with_seqs(settings, clamped),
            f"max_num_seqs {m} is outside the tuning bounds {seq_bounds.min}..{seq_bounds.max}: "
            f"moving to {clamped}",
        )

    slo_itl = slo.itl_p99_seconds if slo.itl_p99_seconds is not None else math.inf
    target_itl = slo_itl * (1 - config.margin)
    slo_ttft = slo.ttft_p99_seconds if slo.ttft_p99_seconds is not None else math.inf
    target_ttft = slo_ttft * (1 - config.margin)
    if observation is None or observation.itl_p99 is None or observation.mean_running_per_pod is None:
        return decide(settings, "no metrics from any pod in this window: holding")
    if observation.itl_samples < config.min_itl_samples or observation.mean_running_per_pod < 1:
        return decide(
            settings,
            f"too little traffic to learn from ({observation.itl_samples:.0f} inter-token samples in "
            f"{observation.window_seconds:.0f} s, need {config.min_itl_samples}): holding",
        )

    pods = max(observation.pods, 1)
    batch = observation.mean_running_per_pod
    waiting_per_pod = observation.waiting / pods
    sample = Sample(
        time=now,
        max_num_seqs=observation.max_num_seqs or m,
        batch=batch,
        itl_p99=observation.itl_p99,
        tokens_per_second=observation.output_tokens_per_second,
        saturated=batch >= config.saturation_fill * m and waiting_per_pod > 0.0,
        violated=False,
        preempting=observation.preemptions_per_second > 0,
        ttft_p99=observation.ttft_p99,
    )
    if _draining(sample, config):
        # Requests admitted under a larger setting finish at their own pace: the point is
        # good for the latency fit, but says nothing yet about the new setting.
        history = replace(history, samples=(history.samples + (sample,))[-config.history_length :])
        return decide(
            settings,
            f"draining after the decrease: batch {batch:.1f} is still above max_num_seqs {sample.max_num_seqs}: holding",
        )
    # Evidence at the current setting: the latest windows since it was applied, averaged so
    # that one noisy P99 neither triggers a back-off nor brands the setting as violating.
    at_setting = _tail_at_setting(history.samples + (sample,), sample.max_num_seqs)
    current = [s for s in at_setting if not _draining(s, config)][-3:]
    itl_now = sum(s.itl_p99 for s in current) / len(current)
    batch_now = sum(s.batch for s in current) / len(current)
    ttfts = [s.ttft_p99 for s in current if s.ttft_p99 is not None]
    ttft_now = sum(ttfts) / len(ttfts) if ttfts else None
    # A TTFT made of prefill is the batch's to fix (its steps are too slow); one made of
    # queueing is capacity's: more replicas, not a larger batch (see the module docstring).
    queueing = observation.ttft_from_queueing
    ttft_over_from_steps = ttft_now is not None and ttft_now > slo_ttft and not queueing
    sample = replace(sample, violated=itl_now > slo_itl or ttft_over_from_steps, evidence_windows=len(current))
    history = replace(history, samples=(history.samples + (sample,))[-config.history_length :])

    last_seqs_change = history.last_change("maxNumSeqs")
    if last_seqs_change is not None and now - last_seqs_change.time < config.cooldown_seconds:
        return decide(settings, f"cooling down after the change at {last_seqs_change.time:.0f}: holding")

    fit = fit_latency(history.samples, target_itl, config)
    good, bad, bad_why = _bracket(history.samples[-config.bracket_windows :], m, config)
    kv_cap = _kv_capacity(observation, batch, config)
    where = f"ITL P99 {itl_now * 1e3:.0f} ms at batch {batch_now:.1f}"
    slo_text = f"SLO {slo_itl * 1e3:.0f} ms" if math.isfinite(slo_itl) else "no ITL SLO"
    fit_text = f" ({fit.describe()})" if fit else ""
    ttft_where = (f"TTFT P99 {ttft_now:.2f} s at batch {batch_now:.1f} "
                  f"({_percent(observation.ttft_queue_share)} of it queueing)") if ttft_now is not None else ""
    ttft_slo_text = f"TTFT SLO {slo_ttft:g} s"

    def back_off(target: float, why: str, how: str = "") -> Decision:
        floor = max(m * config.max_backoff, good if good is not None and good < m else 0)
        new = seq_bounds.clamp(min(max(target, floor), m - 1))
        if new >= m:
            return decide(settings, f"{why}, but max_num_seqs is at its lower bound {m}")
        return decide(_with_seqs(settings, new), f"{why}: max_num_seqs {m} → {new}{how}")

    if itl_now > slo_itl:
        if itl_now <= slo_itl * (1 + config.margin) and len(current) < 2:
            return decide(settings, f"{where} is marginally over {slo_text}: confirming over one more window")
        # Trust the fit only where it agrees that the current batch is too large, and where its
        # line admits some batch at all: an intercept over the target comes from noisy windows
        # far up the curve (run 16: 13 → 3), and scaling the batch by the excess is safer.
        fitted = fit.batch_for(target_itl) if fit and fit.intercept < target_itl else None
        target = fitted if fitted is not None and fitted < batch_now else batch_now * target_itl / itl_now
        return back_off(target, f"{where} > {slo_text}", fit_text)

    if ttft_over_from_steps:
        assert ttft_now is not None
        if ttft_now <= slo_ttft * (1 + config.margin) and len(current) < 2:
            return decide(settings, f"{ttft_where} is marginally over {ttft_slo_text}: confirming over one more window")
        # Prefill chunks run in the same steps as the decodes: their time grows with the batch.
        return back_off(batch_now * target_ttft / ttft_now, f"{ttft_where} > {ttft_slo_text}: the steps are too slow")

    if waiting_per_pod > 0 and _preempting_twice(history.samples):
        raised = _raised_memory(mem, tuning, history, now, config)
        if raised is not None:
            return decide(
                settings.replace(gpu_memory_utilization=raised),
                f"preempting {observation.preemptions_per_second:.2f}/s with {waiting_per_pod:.1f} waiting per pod: "
                f"the KV cache is the limit; gpu_memory_utilization {mem:g} → {raised:g}",
            )

    if itl_now > target_itl:
        return decide(settings, f"{where} is within the {config.margin:.0%} margin below {slo_text}: holding")
    ttft_binding = ttft_now is not None and ttft_now > target_ttft
    if ttft_binding and not queueing:
        return decide(settings, f"{ttft_where} is within the {config.margin:.0%} margin below {ttft_slo_text}; "
                                "a larger batch would slow the prefill: holding")
    if not sample.saturated:
        return decide(
            settings,
            f"{where} meets {slo_text}; not saturated (batch {batch:.1f} of {m}, "
            f"{waiting_per_pod:.1f} waiting per pod): holding",
        )
    if ttft_binding and not math.isfinite(slo_itl):
        # A larger batch would drain the queue only by slowing every stream, and no ITL SLO
        # bounds that trade: replicas are the cure, and the autoscaler adds them on this signal.
        return decide(settings, f"{ttft_where} is near or over {ttft_slo_text} from queueing, which more "
                                "replicas cure: not growing the batch at the cost of inter-token latency: holding")

    # Without a fit (one batch size seen) explore: the intercept makes latency grow slower than
    # the batch, so the squared headroom ratio is a fair first step, bounded by max_growth.
    target = fit.batch_for(target_itl) if fit else batch_now * (target_itl / itl_now) ** 2
    limits = [target, m * config.max_growth, seq_bounds.max]
    limit_text = ""
    if kv_cap is not None and kv_cap < min(limits):
        limit_text = f"; the KV cache holds ~{kv_cap:.0f} seqs at observed lengths"
    if kv_cap is not None:
        limits.append(kv_cap)
    if bad is not None:
        # Bisect between what works and what recently did not; a tight bracket means done.
        cap = m if bad <= m * (1 + config.tight_bracket) else (m + bad) // 2
        if cap < min(limits):
            limit_text = f"; {bad} {bad_why} recently"
            limits.append(cap)
    new = seq_bounds.clamp(min(limits))
    if new == m and min(limits) >= m + config.probe:
        # Settings are whole sequences: a best fitted between m and m + 1 would round down to
        # m forever, while at small m one more sequence is a real step (hysteresis still rules
        # it out where it is not). The next window checks it.
        new = seq_bounds.clamp(m + 1)
    if m == seq_bounds.max:
        return decide(settings, f"{where} meets {slo_text}; max_num_seqs is at its upper bound {m}: holding")
    if new - m < max(1, config.hysteresis * m):
        why = limit_text or f"; the fitted best is within {config.hysteresis:.0%}"
        return decide(settings, f"{where} meets {slo_text}{why}: holding")
    queueing_text = f"; {ttft_where} is near or over {ttft_slo_text} from queueing" if ttft_binding else ""
    return decide(
        _with_seqs(settings, new),
        f"{where} meets {slo_text} with a queue: max_num_seqs {m} → {new}{fit_text}{limit_text}{queueing_text}",
    )


def _percent(share: float | None) -> str:
    return "an unknown share" if share is None else f"{share:.0%}"


def _with_seqs(settings: EngineSettings, seqs: int) -> EngineSettings:
    """A new max_num_seqs; the token budget must fit one decode token per sequence."""
    tokens = settings.max_num_batched_tokens
    if tokens is not None and tokens < seqs:
        tokens = seqs
    return settings.replace(max_num_seqs=seqs, max_num_batched_tokens=tokens)


def _tail_at_setting(samples: tuple[Sample, ...], seqs: int) -> list[Sample]:
    tail: list[Sample] = []
    for s in reversed(samples):
        if s.max_num_seqs != seqs:
            break
        tail.append(s)
    return list(reversed(tail)) or [samples[-1]]


def _bracket(samples: tuple[Sample, ...], current: int, config: TunerConfig) -> tuple[int | None, int | None, str]:
    """The largest setting whose latest window met the SLO, and the smallest above ``current``
    not worth having.

    A setting is not worth having when its latest verdict violated the SLO (and
    the batch actually reached it), confirmed by more than one window, or when,
    saturated, it gave less throughput than a smaller setting did.
    """
    latest: dict[int, Sample] = {}
    violations: dict[int, int] = {}
    for s in samples:
        if _draining(s, config) or (s.violated and s.batch < config.saturation_fill * s.max_num_seqs):
            continue
        latest[s.max_num_seqs] = s
        violations[s.max_num_seqs] = violations.get(s.max_num_seqs, 0) + s.violated
    good = max((k for k, s in latest.items() if not s.violated), default=None)
    # A violation seen in a single window backs the setting off (tune does that at once) but does
    # not rule it out: on a busy machine a stall now and then lands in a window's P99. A verdict
    # resting on several windows, or a second one, does.
    violated = min(
        (
            k
            for k, s in latest.items()
            if s.violated and k > current and (s.evidence_windows > 1 or violations[k] > 1)
        ),
        default=None,
    )
    slower = None
    best_below = 0.0
    for k in sorted(latest):
        s = latest[k]
        if k > current and s.saturated and s.tokens_per_second < config.throughput_tolerance * best_below:
            slower = k
            break
        best_below = max(best_below, s.tokens_per_second)
    if slower is not None and (violated is None or slower < violated):
        return good, slower, "gave less throughput than a smaller setting"
    return good, violated, "violated the SLO"


def _draining(sample: Sample, config: TunerConfig) -> bool:
    return sample.batch > sample.max_num_seqs * config.drain_slack


def _kv_capacity(observation: Observation, batch: float, config: TunerConfig) -> float | None:
    """Sequences the KV cache holds at the window's mean footprint per sequence."""
    usage = observation.kv_cache_usage
    if usage < 0.05 or batch < 1:
        return None
    return batch / usage * config.kv_headroom


def _preempting_twice(samples: tuple[Sample, ...]) -> bool:
    return len(samples) >= 2 and samples[-1].preempting and samples[-2].preempting


def _raised_memory(
    mem: float, tuning: Tuning, history: TuningHistory, now: float, config: TunerConfig
) -> float | None:
    last = history.last_change("gpuMemoryUtilization")
    if last is not None and now - last.time < config.memory_cooldown_seconds:
        return None
    raised = tuning.gpu_memory_utilization.clamp(mem + config.memory_step)
    ceiling = history.oom_memory_ceiling
    if ceiling is not None and raised >= ceiling:
        raised = tuning.gpu_memory_utilization.clamp(min(raised, ceiling - config.memory_step / 2))
    return raised if raised > mem else None


__all__ = [
    "Change",
    "Decision",
    "LatencyFit",
    "Sample",
    "TunerConfig",
    "TuningHistory",
    "fit_latency",
    "tune",
]
