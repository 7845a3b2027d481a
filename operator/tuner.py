"""The tuner: one window's observation in, the next engine parameters out.

A pure function, in four named steps, each testable on synthetic streams:

1. **Evidence** (``_evidence``): the window as a ``Sample`` — the engine's step-cost sums (every
   step of the window: thousands of samples, where a latency P99 is one), the decode and prefill
   steps' tails, the request-level ITL and TTFT P99 — or why the window cannot be judged (too few
   steps or inter-token samples).
2. **Prediction** (``_predict``): the step cost fitted over recent windows (operator/step_cost.py:
   seconds ≈ a + b·rows + c·prefill tokens) times the decode steps' tail (their P99 over their
   mean) predicts the ITL P99 at any ``max_num_seqs``. Steps that carry prefill chunks spike above
   that; when enough of them share the decode steps, the P99 falls among them and is predicted from
   the chunk, which ``max_num_batched_tokens`` caps, and which shrinks with the batch while prompts
   join only as sequences finish (``Prediction.chunk_at``). The request-level ITL P99 only checks and
   corrects the prediction: their ratio, averaged over recent windows, scales it (Dynamo's planner
   corrects its predictions the same way), and the margin below the SLO grows with how much that
   ratio moves from window to window (a noisy node gets a wider margin, not a hunt). Under a TPOT
   SLO (a request's mean gap) the prediction is the mean step, prefill tokens spread over all steps,
   times the requests' tail, and the chunks set no tail of their own; a TPOT over the SLO while the
   decode steps alone meet it, below saturation, is arriving prompts' prefill, which no setting above
   the running batch changes (``_tpot_tail_from_arrivals``).
3. **Guardrails** (``_aim``, ``_ttft_bound``, ``_verdict``, ``_growth_bound``; memory and the
   step budget first): no verdict without enough samples, nor from a per-request latency
   judged by requests that ran before the batch changed (a window that filled up, or that began
   within a slow request's decode span after a cut that held sequences back; after a raise, no
   further growth while most of a window's requests began before it); no growth without a queue
   (more sequences would not raise throughput) or past what the KV cache holds at the observed
   lengths, nor back to a setting confirmed over the SLO lately (towards one only for a measured gain
   of 10%, halfway at most); a move that reverses the last one waits for a second window at the
   setting (a decrease ahead of the load, which held nothing back, is no verdict to reverse); two
   windows over the SLO overrule a prediction that keeps the setting; when no setting
   within the bounds is predicted to meet the SLO for the batch's own steps, or for steps carrying
   prefill while the window's decode steps alone break it, the tuner measures a smaller one unless the
   windows already show none below can (``_probe_below``: the fit is a line, the cost concave),
   then says so and keeps the setting with the best saturated goodput it has seen (below saturation,
   the setting it has) instead of walking down to the minimum (replicas are the cure).
4. **Move** (``_step``, ``_move``): to the largest ``max_num_seqs`` predicted to meet the target, at most
   ×4 up per interval (×2 until the slope is measured) and down to ÷4 of the running batch (a decrease
   acts in the engine's next step: it preempts the excess), and a cut aims at the SLO with the least
   margin, no deeper than the window's own P99, carried along the fitted curve, needs (``_cut``);
   overloaded (requests turned away),
   growth as far as that same curve through the window's own point allows. While the batch stays
   below ``max_num_seqs`` the setting holds nothing back, so it waits for the load at the largest
   setting predicted to meet the target once the batch fills (``_ahead``), and a burst fills only
   that far.
   A tail made of prefill chunks while the decode steps alone meet the SLO lowers
   ``max_num_batched_tokens`` instead (within ``spec.tuning.maxNumBatchedTokens``; without those
   bounds the tuner holds, as a smaller batch would not cure it), and a TTFT over its SLO from
   prefill, with ITL headroom, raises it.

The TTFT SLO splits by where the time to first token goes. Made of prefill (the steps are too slow
for prompts to get through), it is the steps' to fix, as ITL is: over the SLO the tuner backs off,
near it the tuner does not grow. Made of queueing, it is capacity's: growing the batch would trade
inter-token latency for it, so the tuner never grows past what the ITL SLO allows (and holds when
there is no ITL SLO), and the autoscaler adds replicas instead. When no replica can come
(``replicas_can_grow``: autoscaling off or at its maximum), every request in the queue misses its
TTFT, so a TPOT SLO is judged at P95 while the load saturates the batch.

GPU memory utilization moves rarely (each change restarts pods): up one step when preemptions in
consecutive windows show the KV cache is what limits the batch, down after an out-of-memory kill,
and never again up to a fraction that ran out of memory.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace

from kvpilot.operator import step_cost
from kvpilot.operator.engine_metrics import Observation
from kvpilot.operator.spec import EngineSettings, Tuning

MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, GPU_MEMORY_UTILIZATION = "maxNumSeqs", "maxNumBatchedTokens", "gpuMemoryUtilization"


@dataclass(frozen=True)
class TunerConfig:
    margin: float = 0.05  # the least margin below the SLO the prediction aims at
    max_margin: float = 0.25  # the most, however noisy the windows
    spread_margin: float = 2.0  # margin = this × the windows' relative spread of observed/predicted
    min_itl_samples: int = 300  # fewer inter-token gaps than this: the P99 is noise
    min_tpot_samples: int = 10  # fewer finished requests than this: their TPOT P99 is not judged
    min_steps: int = 30  # fewer engine steps than this in a window: its step cost is noise (a 2-core CPU runs 30-100 in 20 s)
    max_growth: float = 4.0  # at most ×4 per interval upwards, once the step cost's slope is measured
    explore_growth: float = 2.0  # before that, at most ×2 (less where the squared headroom is less)
    max_backoff: float = 0.25  # at most ÷4 of the running batch per interval downwards
    probe_share: float = 0.8  # a probe runs at most this share of the sequences that ran
    ahead_batch: float = 4.0  # unsaturated, a batch of at least this many sequences sets max_num_seqs ahead of the load
    ahead_headroom: float = 1.5  # ... at no less than this × the sequences running
    hysteresis: float = 0.05  # ignore moves smaller than this fraction of max_num_seqs
    saturation_fill: float = 0.8  # batch ≥ this × max_num_seqs (with a queue) counts as saturated
    filling_growth: float = 1.5  # a batch ending at ≥ this × the window's mean, saturated, filled up in the window
    full_step: float = 0.9  # steps averaging this share of max_num_batched_tokens are full
    kv_headroom: float = 0.9  # use at most this share of the KV cache at observed lengths
    fit_window: int = 12  # windows pooled for the step-cost fit
    fit_max_ratio: float = 2.0  # windows with an ITL P99 over this × the SLO stay out of the fit
    recency: float = 0.8  # weight of a window relative to the next newer one
    correction_windows: int = 4  # windows averaged for the correction of the prediction
    correction_bounds: tuple[float, float] = (0.5, 2.0)
    prefill_tail_share: float = 0.01  # prefill steps at least this share of steps can set the ITL P99
    tokens_step: float = 2.0  # max_num_batched_tokens moves at most ×2 / ÷2 per interval
    bracket_windows: int = 20  # how long a setting confirmed over the SLO stays out of reach
    budget_floor_seconds: float = 600.0  # how long a budget that relieved a starved queue stays the floor
    tight_bracket: float = 0.25  # climbing back after a decrease only for a gain of at least this share
    bracket_gain: float = 0.10  # towards a setting confirmed over the SLO lately only for a measured gain this large
    max_relaxation: float = 1.5  # judged at P95, the P99 may be at most this × the SLO
    unmoved_batch: float = 0.85  # a cut ran at most this × the batch before it: one reading no lower moved nothing
    history_length: int = 24
    memory_step: float = 0.02
    memory_cooldown_seconds: float = 600.0


@dataclass(frozen=True)
class Sample:
    """What one window taught, under one setting."""

    time: float
    max_num_seqs: int
    max_num_batched_tokens: int | None
    batch: float  # mean running sequences per pod over the window
    latency_p99: float  # the SLO's per-token latency, P99: ITL, or TPOT when the SLO is on TPOT
    tokens_per_second: float
    saturated: bool
    preempting: bool
    starved: bool = False  # prompts waited with slots free while the step budget filled every step
    filling: bool = False  # the load rose in the window: its batch ended saturated, far above its mean
    end_batch: float | None = None  # running sequences per pod at the window's end
    lagging: bool = False  # a per-request latency judged by requests that ran mostly before a change of batch,
    # or read from the steps for want of finished requests: no lesson for the prediction
    ttft_p99: float | None = None
    cost_sums: dict[str, float] | None = None  # the window's step-cost sums (None: not exported)
    decode_tail: float = 1.0  # decode steps' P99 / their mean; for a TPOT SLO, the TPOT P99 / all steps' mean
    prefill_share: float = 0.0  # steps carrying prefill / all steps
    prefill_chunk: float = 0.0  # mean prefill tokens of such a step
    prefill_p99: float | None = None  # seconds, of such steps
    violated: bool = False  # clearly over the SLO, or over it in two of the latest windows at the setting
    relaxed: bool = False  # judged at P95: no replica to come, and the load saturating the batch with a queue
    p99_over_p95: float | None = None  # of the requests' TPOT, in a window judged at P95
    correction: float | None = None  # observed latency P99 / predicted, at this window's batch
    level: float | None = None  # the window's step seconds / the fit's: how fast the machine ran then

    @property
    def running(self) -> float:
        """The sequences the window ran: its mean batch, or its end batch when the batch filled up."""
        return max(self.batch, self.end_batch or 0.0)


@dataclass(frozen=True)
class Change:
    time: float
    parameter: str  # MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS or GPU_MEMORY_UTILIZATION
    old: float
    new: float
    reason: str


@dataclass(frozen=True)
class TuningHistory:
    samples: tuple[Sample, ...] = ()
    changes: tuple[Change, ...] = ()
    oom_memory_ceiling: float | None = None  # a fraction that ran out of memory
    unreachable_at: float | None = None  # when the SLO was last found out of reach of every setting
    budget_floor: int | None = None  # a max_num_batched_tokens raised to relieve a queue it starved
    budget_floor_at: float | None = None  # when

    def to_dict(self) -> dict:
        return {
            "samples": [asdict(s) for s in self.samples],
            "changes": [asdict(c) for c in self.changes],
            "oomMemoryCeiling": self.oom_memory_ceiling,
            "unreachableAt": self.unreachable_at,
            "budgetFloor": self.budget_floor,
            "budgetFloorAt": self.budget_floor_at,
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> TuningHistory:
        if not data:
            return cls()
        return cls(
            samples=tuple(Sample(**s) for s in data.get("samples", ())),
            changes=tuple(Change(**c) for c in data.get("changes", ())),
            oom_memory_ceiling=data.get("oomMemoryCeiling"),
            unreachable_at=data.get("unreachableAt"),
            budget_floor=data.get("budgetFloor"),
            budget_floor_at=data.get("budgetFloorAt"),
        )

    def last_change(self, parameter: str) -> Change | None:
        return next((c for c in reversed(self.changes) if c.parameter == parameter), None)


@dataclass(frozen=True)
class Decision:
    settings: EngineSettings
    reason: str
    history: TuningHistory
    previous: EngineSettings
    slo_unreachable: bool = False  # no setting within the bounds is predicted to meet the SLO

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
class Prediction:
    """The per-token latency P99 at a setting, from the step cost, the steps' tails and the correction.

    An ITL P99 is one gap: the decode steps' tail, or steps carrying prefill chunks when they are
    enough of the steps. A TPOT P99 (``per_request``) is a request's mean gap: the mean step, prefill
    tokens spread over all steps (the chunk size does not change their sum), times the requests' tail."""

    cost: step_cost.StepCost
    level: float  # the machine's recent speed against the cost's line (1: as fitted)
    decode_tail: float
    prefill_share: float  # of the window's steps
    prefill_chunk: float  # prefill tokens of such a step
    chunks_fill_budget: bool  # the chunks filled the step budget: long prompts, which the budget caps
    prefill_tail: float  # prefill steps' P99 over their predicted mean
    correction: float
    config: TunerConfig
    batch: float = 0.0  # the window's
    admissions_follow_batch: bool = False  # saturated: a sequence joins as one finishes
    per_request: bool = False  # the SLO is on TPOT, a request's mean inter-token latency

    def chunk_at(self, seqs: float) -> float:
        """Prefill tokens of a step carrying prefill, at ``seqs`` running.

        Saturated, a sequence joins as one finishes, so prompts join in proportion to the batch: at
        256 running a step carries several prompts, at 32 one (joins per step taken as Poisson, the
        window's share of prefill steps giving their rate). Prompts that fill the step budget, and
        arrivals that do not wait for a slot, do not change with the setting. The share of steps
        carrying prefill is kept as observed: fewer at a smaller batch would only lower the tail."""
        if not self.admissions_follow_batch or self.chunks_fill_budget or self.batch < 1 or self.prefill_share <= 0:
            return self.prefill_chunk
        joins = -math.log(1.0 - min(self.prefill_share, 0.99))  # per step, at the window's batch
        prompt = self.prefill_share * self.prefill_chunk / joins  # tokens one join brings
        at = joins * seqs / self.batch
        return prompt * at / -math.expm1(-at)  # mean tokens of a step with at least one join

    def chunk(self, seqs: float, tokens: int | None) -> float:
        chunk = self.chunk_at(seqs)
        if tokens is None:
            return chunk
        room = max(tokens - seqs, 0.0)
        return room if self.chunks_fill_budget else min(chunk, room)

    def decode_p99(self, seqs: float) -> float:
        prefill = self.mean_prefill(seqs) if self.per_request else 0.0
        return self.cost.seconds(seqs, prefill) * self.level * self.decode_tail * self.correction

    def mean_prefill(self, seqs: float) -> float:
        """Prefill tokens per step, over all steps, at ``seqs`` running: the window's, in proportion
        to the batch while prompts join as sequences finish."""
        mean = self.prefill_share * self.prefill_chunk
        return mean * seqs / self.batch if self.admissions_follow_batch and self.batch >= 1 else mean

    def prefill_p99(self, seqs: float, tokens: int | None) -> float:
        """The ITL P99 as far as steps carrying prefill set it: 0 when they are too few to (or for a
        TPOT, whose mean step holds them)."""
        factor = self._prefill_factor()
        return self.cost.seconds(seqs, self.chunk(seqs, tokens)) * self.level * factor if factor else 0.0

    def budget_for(self, seqs: float, target: float) -> float:
        """The largest step budget whose prefill chunks are predicted to keep the ITL P99 at ``target``."""
        factor = self._prefill_factor()
        if not factor or self.cost.per_prefill_token <= 0:
            return math.inf
        chunk = (target / (factor * self.level) - self.cost.seconds(seqs)) / self.cost.per_prefill_token
        return seqs + max(chunk, 0.0)

    def _prefill_factor(self) -> float:
        """Tail × correction of the steps carrying prefill; 0 when they are too few to set the P99."""
        if self.per_request or self.prefill_share < self.config.prefill_tail_share:
            return 0.0
        # The ITL P99 lies at this quantile of the prefill steps (a share s of all steps holds the
        # top 1% from 1 - 0.01/s up): between their mean (q 0.5) and their P99, linearly.
        q = 1.0 - 0.01 / self.prefill_share
        return (1.0 + (self.prefill_tail - 1.0) * min(max((q - 0.5) / 0.49, 0.0), 1.0)) * self.correction

    def latency_p99(self, seqs: float, tokens: int | None) -> float:
        return max(self.decode_p99(seqs), self.prefill_p99(seqs, tokens))

    def describe(self) -> str:
        tail = "requests' tail" if self.per_request else "decode tail"
        text = (f"{self.cost.describe()}, machine at ×{self.level:.2f}, {tail} ×{self.decode_tail:.2f}, "
                f"correction ×{self.correction:.2f}")
        if self.prefill_share >= self.config.prefill_tail_share:
            text += f", {self.prefill_share:.0%} of steps carry ~{self.prefill_chunk:.0f} prefill tokens"
        return text


def tune(
    observation: Observation | None,
    settings: EngineSettings,
    tuning: Tuning,
    history: TuningHistory,
    now: float,
    oom_kills: int = 0,
    config: TunerConfig = TunerConfig(),
    replicas_can_grow: bool = True,
) -> Decision:
    """Decide the next settings from the latest window, within ``tuning``'s SLO and bounds
    (the module docstring says how). ``replicas_can_grow``: the autoscaler can add a replica (it is on
    and below its maximum), so a queue is capacity's to relieve."""
    if oom_kills > 0:
        return _after_oom(settings, tuning, history, oom_kills, now, config)
    clamped = tuning.clamp(settings)
    if clamped != settings:
        bounds = tuning.max_num_seqs
        return _decision(settings, clamped, f"the settings are outside the tuning bounds (maxNumSeqs {bounds.min}.."
                                            f"{bounds.max}): moving into them", history, now, config)
    # 1. Evidence.
    kind, slo_latency = tuning.slo.token_latency or ("ITL", math.inf)
    evidence = _evidence(observation, settings, kind, now, config, history)
    if isinstance(evidence, str):
        return _decision(settings, settings, evidence, history, now, config)
    assert observation is not None
    # 2. Prediction, checked and corrected by this window's request-level P99.
    w = _read(observation, evidence, settings, tuning, history, now, kind, slo_latency, config, replicas_can_grow)
    # 3. Guardrails: memory and the step budget first; then each step decides, or narrows where
    # max_num_seqs goes.
    decision = _memory_for_preemptions(w) or _budget_for_starved_admissions(w)
    if decision is not None:
        return decision
    aim = _aim(w)
    if isinstance(aim, _Aim):
        aim = _ttft_bound(w, aim)
    if isinstance(aim, Decision):
        return aim
    # The window is a verdict on max_num_seqs from here on, recorded in its sample (one whose decision went
    # to memory or the step budget, or found no setting in reach, says nothing of the setting).
    w = w.judged()
    for guard in (_verdict, _growth_bound):
        aim = guard(w, aim)
        if isinstance(aim, Decision):
            return aim
    # 4. Move.
    return _step(w, aim)


@dataclass(frozen=True)
class _Window:
    """One window, read once for the steps after the evidence: its sample (appended to the history),
    the prediction it checked and corrected, and what they say against the SLO at the setting in
    effect."""

    observation: Observation
    settings: EngineSettings
    tuning: Tuning
    history: TuningHistory
    now: float
    config: TunerConfig
    kind: str  # the SLO's per-token latency: "ITL" or "TPOT"
    slo_latency: float  # seconds (inf: no ITL or TPOT SLO): the P99 it bounds, more than the SLO when judged at P95
    slo_p99: float  # the SLO as the spec gives it
    slo_ttft: float  # seconds (inf: no TTFT SLO)
    sample: Sample
    prediction: Prediction
    margin: float  # below the SLO: the target
    overloaded: bool  # requests turned away, or the TTFT SLO broken by queueing
    last: Change | None  # the last change of max_num_seqs
    just_cut: bool  # the requests finishing now began decoding before a cut to the setting in effect
    just_raised: bool  # most of the window lies within a slow request's decode span of a raise to it
    lag: str  # how long ago that change was, against the decode span
    band: float  # how far a window's P99 strays from the line by chance (``_noise_band``)
    violated: bool  # clearly over the SLO: beyond the noise band, or over in two of the latest four windows

    @property
    def m(self) -> int:
        return self.settings.max_num_seqs

    @property
    def target(self) -> float:
        return self.slo_latency * (1 - self.margin)

    @property
    def tokens(self) -> int | None:
        return self.sample.max_num_batched_tokens

    @property
    def waiting_per_pod(self) -> float:
        return self.observation.waiting / max(self.observation.pods, 1)

    @property
    def where(self) -> str:
        return f"{self.kind} P99 {self.sample.latency_p99 * 1e3:.0f} ms at batch {self.sample.batch:.1f}"

    @property
    def slo_text(self) -> str:
        if not math.isfinite(self.slo_latency):
            return "no ITL or TPOT SLO"
        if self.sample.relaxed:
            return (f"SLO {self.slo_p99 * 1e3:.0f} ms judged at P95 (P99 up to {self.slo_latency * 1e3:.0f} ms: no "
                    "replica can relieve the queue)")
        return f"SLO {self.slo_latency * 1e3:.0f} ms"

    @property
    def why(self) -> str:
        return f" ({self.prediction.describe()}; margin {self.margin:.0%})"

    def judged(self) -> _Window:
        """The window with its verdict on the setting recorded in its sample."""
        samples = self.history.samples[:-1] + (replace(self.sample, violated=self.violated),)
        return replace(self, history=replace(self.history, samples=samples), sample=samples[-1])

    def decide(self, new: EngineSettings, reason: str, unreachable: bool = False) -> Decision:
        return _decision(self.settings, new, reason, self.history, self.now, self.config, unreachable)


@dataclass(frozen=True)
class _Aim:
    """Where max_num_seqs goes, as the guardrails narrow it."""

    best: int
    probe: tuple[int, str] | None = None  # a smaller setting to measure before calling the SLO out of reach, and why
    ttft_driven: bool = False  # a TTFT near its SLO, made of prefill, bounds the batch
    ahead: int | None = None  # a setting ahead of the load, the batch below max_num_seqs


def _decision(previous: EngineSettings, new: EngineSettings, reason: str, history: TuningHistory, now: float,
              config: TunerConfig, unreachable: bool = False) -> Decision:
    """``new``, with every parameter it changes recorded in the history."""
    changes = list(history.changes)
    for parameter, old, value in (
        (MAX_NUM_SEQS, previous.max_num_seqs, new.max_num_seqs),
        (MAX_NUM_BATCHED_TOKENS, previous.max_num_batched_tokens, new.max_num_batched_tokens),
        (GPU_MEMORY_UTILIZATION, previous.gpu_memory_utilization, new.gpu_memory_utilization),
    ):
        if value != old and old is not None and value is not None:
            changes.append(Change(now, parameter, old, value, reason))
    history = replace(history, changes=tuple(changes[-config.history_length:]),
                      unreachable_at=now if unreachable else history.unreachable_at)
    return Decision(new, reason, history, previous, unreachable)


def _read(observation: Observation, evidence: Sample, settings: EngineSettings, tuning: Tuning,
          history: TuningHistory, now: float, kind: str, slo_latency: float, config: TunerConfig,
          replicas_can_grow: bool) -> _Window:
    """The window read: the prediction it checks and corrects, the margin, whether its requests lag a
    change of the batch, and whether it was clearly over the SLO."""
    m = settings.max_num_seqs
    slo_ttft = tuning.slo.ttft_p99_seconds if tuning.slo.ttft_p99_seconds is not None else math.inf
    # A per-request latency (TPOT) lags the batch: in a window whose batch filled up, or until the slowest
    # requests finishing in the window began decoding after a cut, they ran mostly before the change.
    # Such windows neither teach the prediction its tail and correction nor confirm a setting over the SLO.
    # A decrease ahead of the load held no sequence back: the requests after it ran at the batch they would
    # have run at anyway (tuning_day.py run 16: 58 -> 35 ahead of a phase with a CPU-bound neighbour, then
    # 40 s at 35 reading 122-125 ms, each window put down to the lag after a cut).
    last = history.last_change(MAX_NUM_SEQS)
    span, since = _decode_span(observation), math.inf if last is None or last.new != m else now - last.time
    just_cut = since < observation.window_seconds + span and m < last.old and \
        not _held_back_nothing(history.samples, last)
    # After a raise, the mirror: requests that ran at the smaller batch under-read the new one. Growth waits
    # while they are most of the window (more than half of it within a decode span of the raise).
    just_raised = kind == "TPOT" and since < span + observation.window_seconds / 2 and m > last.old
    evidence = replace(evidence, lagging=evidence.lagging or (kind == "TPOT" and (evidence.filling or just_cut)))
    prediction, sample = _predict(history.samples, evidence, slo_latency, kind == "TPOT", config)
    ttft = sample.ttft_p99
    overloaded = observation.overloaded or (ttft is not None and observation.ttft_from_queueing and ttft > slo_ttft)
    # No replica to come and a queue that breaks the TTFT SLO: every request waiting misses its TTFT, where a
    # batch a little past the TPOT P99 line misses a few requests' TPOT. The TPOT SLO is then judged at P95
    # (the P99 allowed as far over it as the window's P99 over its P95), for as long as the load keeps the
    # batch saturated (tuning_day.py run 17: on a noisy node 12 held TPOT P99 86-90 ms with a queue, 45% of
    # the requests within both SLOs, where 32 read 107 ms and served 95% within them).
    slo_p99 = slo_latency
    if kind == "TPOT" and not replicas_can_grow and sample.saturated and \
            (overloaded or (history.samples and history.samples[-1].relaxed)):
        p95 = observation.tpot_p95
        sample = replace(sample, relaxed=True, p99_over_p95=sample.latency_p99 / p95 if p95 else None)
        ratios = [s.p99_over_p95 for s in (history.samples + (sample,))[-config.correction_windows:]
                  if s.relaxed and s.p99_over_p95]
        slo_latency *= min(max(statistics.median(ratios), 1.0), config.max_relaxation) if ratios else 1.0
    samples = (history.samples + (sample,))[-config.history_length:]
    # Overloaded (requests turned away, or the TTFT SLO broken by queueing), every token/s drains the queue
    # that all waiting requests sit in, or admits one more request: aim at the SLO with the least margin;
    # windows over it still bring the batch down. (tuning_day.py's second run: a margin widened by the phase
    # change before a 2x burst held 23-33 sequences where 48 met the TPOT SLO, and the burst's backlog
    # outlasted the quiet phase after it.)
    margin = config.margin if overloaded else _margin(samples, config)
    # Clearly over: beyond the noise band of recent windows, or over in two of the latest four at the setting;
    # a window whose requests began before a cut judges the setting before it.
    band = _noise_band(samples, config)
    violated = sample.latency_p99 > slo_latency and not (sample.lagging and just_cut) and \
        (sample.latency_p99 > slo_latency * (1 + band) or _over_twice(samples, m, slo_latency))
    return _Window(
        observation=observation, settings=settings, tuning=tuning, history=replace(history, samples=samples),
        now=now, config=config, kind=kind, slo_latency=slo_latency, slo_p99=slo_p99, slo_ttft=slo_ttft, sample=sample,
        prediction=prediction, margin=margin, overloaded=overloaded, last=last, just_cut=just_cut,
        just_raised=just_raised,
        lag=f"{since:.0f} s ago, and the requests finishing now began decoding before that (up to {span:.0f} s)",
        band=band, violated=violated,
    )


def _memory_for_preemptions(w: _Window) -> Decision | None:
    """Preemptions with a queue, window after window, mean the KV cache limits the batch: more memory."""
    if w.waiting_per_pod <= 0 or not _preempting_twice(w.history.samples):
        return None
    mem = w.settings.gpu_memory_utilization
    raised = _raised_memory(mem, w.tuning, w.history, w.now, w.config)
    if raised is None:
        return None
    return w.decide(w.settings.replace(gpu_memory_utilization=raised),
                    f"preempting {w.observation.preemptions_per_second:.2f}/s with {w.waiting_per_pod:.1f} waiting "
                    f"per pod: the KV cache is the limit; gpu_memory_utilization {mem:g} → {raised:g}")


def _budget_for_starved_admissions(w: _Window) -> Decision | None:
    """Prompts waiting with slots free while every step is full: the step budget, not the batch, holds
    admission back, so it rises, and is not lowered below that for a while (tuning_day.py's first run
    lowered it to 64 for prefill spikes, and a 2x burst then ran 38 of 64 slots with 300 waiting and a
    TTFT P99 of 84 s)."""
    bounds, tokens = w.tuning.max_num_batched_tokens, w.tokens
    if not w.sample.starved or bounds is None or tokens is None or tokens >= bounds.max:
        return None
    raised = _budget_move(w, f"{w.waiting_per_pod:.0f} waiting per pod with batch {w.sample.batch:.1f} of {w.m}, "
                             f"every step full: the step budget admits prompts too slowly", grow=True)
    return replace(raised, history=replace(raised.history, budget_floor=raised.settings.max_num_batched_tokens,
                                           budget_floor_at=w.now))


def _aim(w: _Window) -> _Aim | Decision:
    """The largest setting predicted to meet the target; a smaller step budget where prefill chunks
    set the tail; the SLO called out of reach where no setting is predicted to meet it."""
    m, sample, prediction, tokens, target = w.m, w.sample, w.prediction, w.tokens, w.target
    bounds = w.tuning.max_num_seqs
    prefill_made = _tpot_tail_from_arrivals(w)
    if prefill_made is not None:
        return w.decide(w.settings, prefill_made, unreachable=True)
    best = _largest(lambda s: prediction.latency_p99(s, tokens) <= target, bounds.min, bounds.max)
    if best is not None and best < m and prediction.latency_p99(m, tokens) <= w.slo_latency:
        # Between the target and the SLO: where growth stops, but no reason to come down.
        best = m
    if w.overloaded and sample.saturated and not sample.lagging and sample.latency_p99 <= target and best is not None:
        # Overloaded, every sequence more serves requests now turned away: grow as far as this window's own
        # P99, carried along the fitted curve, allows, when the prediction (the machine's slowest recent
        # speed, tails of recent windows) holds back (tuning_day.py run 12: a 2x burst held at 17 for 80 s,
        # TPOT P99 77-88 ms, the prediction saying 18-19, where 25 read 99 ms).
        own = _through(prediction, sample, tokens)
        best = max(best, _largest(lambda s: own.latency_p99(s, tokens) <= target, m, bounds.max) or best)
    decode_best = _largest(lambda s: prediction.decode_p99(s) <= target, bounds.min, bounds.max)
    # Windows before lines. A line fitted at large batches is an extrapolation at small ones (a step's
    # cost is concave in the batch), and until two batch sizes are fitted its slope is a prior: before
    # the SLO is called out of reach, or a prior sends the batch down, the windows say whether a
    # smaller setting can meet it.
    # Where no setting is predicted to meet the SLO, the batch is part of the cause when the window's own
    # decode steps, those that carried no prefill, break it (benchmarks/tuning.py run 24 from 256: ITL P99
    # ~600 ms, the decode steps' P99 124 ms; on a prior that took half of the step as fixed cost every
    # setting was predicted over the SLO once a prompt's chunk rode along, the tail was blamed on the
    # chunks alone, and 256 held for all 12 intervals; the sweep read 92 ms at 64).
    probe, refuted = None, False
    prior_down = not prediction.cost.slope_measured and best is not None and best < m
    decode_steps = w.observation.decode_step_p99
    batch_in_it = best is None and (decode_best is None or decode_steps is not None and decode_steps > w.slo_latency)
    if sample.latency_p99 > w.slo_latency and (batch_in_it or prior_down):
        probe = _probe_below(w.history.samples, m, sample.running, w.slo_latency, target, bounds.min, w.config)
        if probe is None:
            refuted = prior_down
        elif best is None:
            best = probe[0]
        else:
            best, probe = max(best, probe[0]), None  # a prior's move, no further than the windows' curve
    if best is None and sample.latency_p99 <= w.slo_latency:
        best = m  # the window meets the SLO: the prediction errs at this batch, not the setting
    if (best is None or best < m) and decode_best is not None and decode_best >= m and \
            w.tuning.max_num_batched_tokens is not None:
        # The tail is prefill chunks sharing decode steps: a smaller budget per step cures it.
        return _budget_move(w, f"{w.where}: steps carrying prefill chunks set the tail{w.why}", grow=False)
    if best is None or refuted:
        prefill_made = best is None and decode_best is not None and not batch_in_it
        # Below saturation the throughput is the load's: a larger setting would only let a backlog run at
        # once, each step slower (tuning_day.py run 21: beside the neighbour, 33 -> 62 at batch 17 and 114 ms
        # ran 40 at 125 ms).
        seen = None if prefill_made or not sample.saturated else _best_seen(w.history.samples, w.slo_latency)
        kept = seen or m
        if prefill_made:
            cause = ("the tail comes from steps carrying prefill chunks, which a smaller batch does not cure "
                     "(bounds in spec.tuning.maxNumBatchedTokens let the tuner cap them)")
        elif best is None and decode_best is None:
            cause = f"even {bounds.min} sequences are predicted over it"
        else:  # the prior's smaller setting, or the decode steps' own tail, refuted by the windows below
            cause = "the windows at smaller settings show none that meets it"
            if decode_steps is not None and decode_steps > w.slo_latency:
                cause = f"the decode steps alone read a P99 of {decode_steps * 1e3:.0f} ms, and {cause}"
        return w.decide(_with_seqs(w.settings, kept),
                        f"{w.where}: no maxNumSeqs within {bounds.min}..{bounds.max} is expected to meet "
                        f"{w.slo_text}: {cause}; keeping {kept}, "
                        f"{'the best goodput seen' if seen else 'the setting in effect'}, for the autoscaler's "
                        f"replicas to relieve{w.why}", unreachable=True)
    return _Aim(best, probe)


def _tpot_tail_from_arrivals(w: _Window) -> str | None:
    """Why no smaller batch is the cure for a TPOT over its SLO, or None when it may be.

    Below saturation (prompts do not wait for slots) the prefill a running request shares its steps
    with is the arrivals': a short answer decoding beside other prompts' 1,000-token chunks takes their
    steps into its mean gap. When the decode steps alone meet the SLO, the requests' tail is those
    chunks; a batch below the sequences running cures it only by making prompts wait for a slot (their
    TTFT), and every setting above them holds none back (tuning_day.py run 17: at 29 over long prompts,
    TPOT P99 122 ms at batch 3 with decode steps' P99 47 ms; the probe went 29 -> 1 and the burst after
    it began at 4). The decode steps' P99 is held to the SLO, not to the margin's target: a request's TPOT
    is a mean of its gaps, below their P99 (run 19: 80 ms against a 75 ms target let the next window probe
    36 -> 1)."""
    sample, decode_p99 = w.sample, w.observation.decode_step_p99
    if w.kind != "TPOT" or sample.latency_p99 <= w.slo_latency or sample.saturated or sample.filling or \
            decode_p99 is None or decode_p99 > w.slo_latency:
        return None
    bounds = w.tuning.max_num_seqs
    return (f"{w.where}: no maxNumSeqs within {bounds.min}..{bounds.max} meets {w.slo_text} without making prompts "
            f"wait: the decode steps alone meet it (P99 {decode_p99 * 1e3:.0f} ms), and the requests' tail is "
            f"other prompts' prefill in their lives, which a batch below the {sample.running:.1f} running cures "
            f"only by queueing the prompts; keeping {w.m}, which holds none back, for the autoscaler's replicas "
            f"to relieve{w.why}")


def _ttft_bound(w: _Window, aim: _Aim) -> _Aim | Decision:
    """The TTFT SLO, by where the time to first token goes: made of prefill, a larger step budget where
    the ITL allows it, else a smaller batch; made of queueing with no ITL SLO to bound the trade, no
    growth (replicas are the cure)."""
    m, ttft, best = w.m, w.sample.ttft_p99, aim.best
    queueing = w.observation.ttft_from_queueing
    ttft_driven = ttft is not None and not queueing and ttft > w.slo_ttft * (1 - w.margin)
    if ttft_driven:
        bounds, tokens = w.tuning.max_num_batched_tokens, w.tokens
        if ttft > w.slo_ttft and bounds is not None and tokens is not None:
            larger = bounds.clamp(tokens * w.config.tokens_step)
            if larger > tokens and w.prediction.latency_p99(m, larger) <= w.target:
                return _budget_move(w, f"TTFT P99 {ttft:.2f} s > TTFT SLO {w.slo_ttft:g} s from prefill, with ITL "
                                       f"headroom{w.why}", grow=True)
        best = min(best, m) if ttft <= w.slo_ttft else \
            min(best, math.floor(m * w.slo_ttft * (1 - w.margin) / ttft), m - 1)
        best = max(best, w.tuning.max_num_seqs.min)
    if best > m and ttft is not None and queueing and not math.isfinite(w.slo_latency):
        return w.decide(w.settings, f"TTFT P99 {ttft:.2f} s is mostly queueing, which more replicas cure; with no "
                                    "ITL SLO to bound the trade, not growing the batch: holding")
    return replace(aim, best=best, ttft_driven=ttft_driven)


def _verdict(w: _Window, aim: _Aim) -> _Aim | Decision:
    """Coming down. Below the SLO with the batch under the setting, the setting waits ahead of the load
    (``_ahead``). Over it, a verdict needs evidence that tells the setting from the SLO: a window clearly
    over (beyond the noise band of recent windows) or over in two of the latest four, whose requests
    ran at this batch; then the cut aims where this window's conditions would meet the target. Two windows
    over it overrule a prediction that puts the setting within the SLO (one may be a spike the prediction
    rightly discounts): its correction may have been learned from a window that read far under it
    (``benchmarks/tuning.py`` run 24 from 2: a window at 62 read 137 ms against a predicted 270, the
    correction fell to ×0.50, and 62 held two more windows at 133 and 123 ms, "the prediction puts the
    best setting here")."""
    m, sample = w.m, w.sample
    overruled = aim.best >= m and sample.latency_p99 > w.slo_latency and \
        _over_twice(w.history.samples, m, w.slo_latency)
    if (aim.best >= m and not overruled) or aim.ttft_driven:
        return aim
    if sample.latency_p99 <= w.slo_latency:
        ahead = _ahead(w.prediction, sample, w.tokens, w.target, w.tuning.max_num_seqs.min, m, w.config)
        return replace(aim, best=ahead, ahead=ahead)
    if sample.lagging and w.just_cut:
        # tuning_day.py run 8: the window after a cut of a 2x burst's 64 to 15 read 180 ms from requests
        # that had run at 63, cut again to 5, and barred 15 for the rest of the burst (held at 14 at 50 ms);
        # run 9, waiting one window only: the second window after the cut still read 148 ms.
        return w.decide(w.settings, f"{w.where}: max_num_seqs came down to {m} {w.lag}: confirming over a later "
                                    f"window{w.why}")
    if not sample.violated:
        return w.decide(w.settings, f"{w.where} is within the noise band ({w.band:.0%}) over {w.slo_text}: "
                                    f"confirming over one more window{w.why}")
    if sample.filling:
        # A per-request latency lags the load: the requests finishing in a window whose batch filled up
        # ran mostly before, under the traffic that came before, or through the fill's own prefill
        # (tuning_day.py's third and fourth runs: the first window of a 2x burst read the long-prompt
        # phase's TPOT and cut 64 to 16). The verdict waits for a window whose batch was full throughout:
        # windows overlap when they are longer than the interval (run 21: the two windows over a burst's
        # first 20 s read 124-125 ms at a mean batch of 11 and 32, and cut 64 to 15, which then read
        # 104-114 ms; 55 held the burst at 99-109 ms).
        return w.decide(w.settings, f"{w.where}: the batch filled up during this window (ending saturated, with a "
                                    f"queue): the requests it judged ran before the load changed; confirming over "
                                    f"a window whose batch was full throughout{w.why}")
    unmoved = _cut_moved_nothing(w)
    if unmoved is not None:
        return unmoved
    if aim.probe is None:
        # A cut aims at the SLO with the least margin: one too shallow is measured and taken further an
        # interval later, one too deep costs throughput until the climb back (tuning_day.py run 17: a noisy
        # node's first window over, 117 ms at 23, aimed at a 25% margin's 75 ms and cut 28 to 12, which
        # queued the phase: 45% of its requests within the SLO, where 32 served 95%).
        cut_target, low = w.slo_latency * (1 - w.config.margin), w.tuning.max_num_seqs.min
        if overruled:
            # Halfway (geometrically) to where the window's own point, carried along the fitted curve, meets
            # the target: the windows outweigh the prediction, not by all of their distance from it.
            own = _through(w.prediction, sample, w.tokens)
            deep = _largest(lambda s: own.latency_p99(s, w.tokens) <= cut_target, low, m - 1) or low
            return replace(aim, best=min(math.floor(math.sqrt(deep * m)), m - 1))
        return replace(aim, best=_cut(w.prediction, sample, w.tokens, cut_target, low, m))
    return aim


def _cut_moved_nothing(w: _Window) -> Decision | None:
    """A cut whose setting, its lag past, reads no lower than the window that asked for it, at a clearly
    smaller batch: the batch is not what sets the latency (a neighbour's share of every step, say), and a
    deeper cut would only queue requests. The tuner holds, and says the SLO is out of the batch's reach
    (tuning_day.py run 20: beside a CPU-bound neighbour 27 -> 19 -> 13 read TPOT P99 125, 125 and 124 ms
    while the queue grew to 24; the cuts rested on a line fitted steep across the neighbour's arrival)."""
    last, sample = w.last, w.sample
    if last is None or last.new != w.m or last.new >= last.old or w.just_cut:
        return None
    asked = _window_that_made(w.history.samples, last)
    if asked is None or sample.batch > w.config.unmoved_batch * asked.batch or \
            sample.latency_p99 * (1 + w.band) < asked.latency_p99:
        return None
    return w.decide(w.settings, f"{w.where}: no lower than {asked.latency_p99 * 1e3:.0f} ms at batch "
                                f"{asked.batch:.1f} before max_num_seqs came down to {w.m}: the batch does not set "
                                f"it, and a smaller one would only queue requests; holding {w.m} for the "
                                f"autoscaler's replicas to relieve{w.why}", unreachable=True)


def _growth_bound(w: _Window, aim: _Aim) -> _Aim | Decision:
    """Going up: not while the window's requests mostly ran before the last raise; towards a setting
    recently confirmed over the SLO, only for a measured gain worth the risk, and halfway at most."""
    m, best = w.m, aim.best
    if best <= m:
        return aim
    if w.just_raised:
        # tuning_day.py run 13: 60 ms read at 16 right after 11 -> 16 sent it to 29, which read 122 ms.
        return w.decide(w.settings, f"{w.where}: max_num_seqs rose to {m} {w.lag}: growing again after a later "
                                    f"window{w.why}")
    recent = w.history.samples[-w.config.bracket_windows:]
    bad = min((s.max_num_seqs for s in recent if s.violated and s.max_num_seqs > m and s.relaxed == w.sample.relaxed),
              default=None)
    if bad is None:
        return aim
    if bad - 1 <= m:
        return w.decide(w.settings, f"{w.where} meets {w.slo_text}; {bad} was confirmed over it lately: holding"
                                    f"{w.why}")
    # Between a setting that meets the SLO and one confirmed over it, the best lies in the SLO's noise
    # (benchmarks/tuning.py run 25: windows at 47-64 read 84-137 ms, the two sweeps 88 and 108 ms at 64):
    # a climb there gains at most what the setting over it served, and risks a cut back, two reversals.
    # The gain is measured, saturated windows at each setting; the climb goes halfway (geometrically), so
    # the next window narrows the bracket (run 25: 64 -> 45 -> 60 -> 42 -> 55 -> 59, for 8% at most).
    # A setting over it that served much less than this one (steps growing faster than the batch, or a
    # thrashing KV cache) bounds nothing: the peak may lie between.
    gain = _measured_gain(recent, m, bad)
    if gain is not None and abs(gain) < w.config.bracket_gain:
        return w.decide(w.settings, f"{w.where} meets {w.slo_text}; {bad}, confirmed over it lately, served "
                                    f"{gain:+.1%} against {m}, short of the {w.config.bracket_gain:.0%} worth the "
                                    f"risk of the SLO: holding{w.why}")
    return replace(aim, best=min(best, bad - 1, max(m + 1, math.floor(math.sqrt(m * bad)))))


def _measured_gain(samples: tuple[Sample, ...], m: int, higher: int) -> float | None:
    """How much more ``higher`` served than ``m``: the median throughput of their saturated windows (below
    saturation the throughput is the load's); None where either has none. Not scaled by the machine's
    speed in each window: against a line fitted mostly at one batch size, that speed takes up the line's
    error at the other (run 25: 64 read ×1.10 against a line through 45, which made +8% look like +20%)."""
    def served(seqs: int) -> list[float]:
        return [s.tokens_per_second for s in samples if s.max_num_seqs == seqs and s.saturated]
    low, high = served(m), served(higher)
    if not low or not high:
        return None
    return statistics.median(high) / statistics.median(low) - 1


def _step(w: _Window, aim: _Aim) -> Decision:
    """The move towards the aim (``_move``), unless it reverses the last change on too little evidence."""
    m, sample, last = w.m, w.sample, w.last
    new, limit = _move(m, aim.best, sample, w.observation, w.tuning.max_num_seqs, w.slo_latency, w.config,
                       w.prediction.cost.slope_measured)
    where, why, slo_text = w.where, w.why, w.slo_text
    if new == m:
        return w.decide(w.settings, f"{where} vs {slo_text}: {limit}: holding{why}")
    if last is not None and (last.new - last.old) * (new - m) < 0 and not _held_back_nothing(w.history.samples, last):
        # A reversal needs more than the noise band: a second window at the setting; and climbing
        # back after a decrease, a gain worth the risk of another (the best lies between the two).
        # A decrease ahead of the load held nothing back, and says nothing of the setting it left.
        if len(_tail_at_setting(w.history.samples, m)) < 2:
            return w.decide(w.settings, f"{where}: the prediction says {new}, which reverses the last change; "
                                        f"confirming over one more window{why}")
        if new > m and new - m < max(2, w.config.tight_bracket * m):
            return w.decide(w.settings, f"{where} meets {slo_text}: {new} would climb back towards the setting just "
                                        f"left for less than {w.config.tight_bracket:.0%}: holding{why}")
    if aim.ahead is not None and new < m:
        return w.decide(_with_seqs(w.settings, new),
                        f"{where} meets {slo_text} with the batch below max_num_seqs: {new} is the largest setting "
                        f"predicted to meet it once the load fills the batch, and holds back none of the "
                        f"{sample.running:.1f} running: max_num_seqs {m} → {new} ahead of the load{why}")
    if aim.probe is not None and new < m:
        return w.decide(_with_seqs(w.settings, new),
                        f"{where} is over {slo_text} and no setting is predicted to meet it, but {aim.probe[1]}: "
                        f"measuring max_num_seqs {m} → {new}{why}")
    verb = "leaves room under" if new > m else "is over the target for"
    return w.decide(_with_seqs(w.settings, new), f"{where} {verb} {slo_text}: max_num_seqs {m} → {new}{why}")


def _evidence(observation: Observation | None, settings: EngineSettings, kind: str, now: float,
              config: TunerConfig, history: TuningHistory) -> Sample | str:
    """The window as a Sample, or why it cannot be judged. ``kind``: the SLO's per-token latency,
    "ITL" or "TPOT".

    Under a TPOT SLO, a window whose batch fills a small ``max_num_seqs`` with prompts waiting finishes
    too few requests to read a P99 from: the setting starves the window, not the load. It is read from the
    gaps its running requests saw instead — their mean times the requests' tail of recent windows — and
    teaches the prediction nothing (``lagging``). (tuning_day.py run 18: cut to 1 over long prompts, 1
    held for 300 s through a burst with 2-6 waiting, every window "too little traffic to learn from".)"""
    if observation is None or observation.itl_p99 is None or observation.mean_running_per_pod is None:
        return "no metrics from any pod in this window: holding"
    sums = observation.step_cost_sums
    m = observation.max_num_seqs or settings.max_num_seqs
    mean_step = sums["seconds"] / sums["steps"] if sums and sums.get("steps", 0.0) >= config.min_steps else None
    tails = [s.decode_tail for s in history.samples[-config.correction_windows:] if not s.lagging]
    thin_by_setting = kind == "TPOT" and observation.itl_mean is not None and bool(tails) and \
        observation.waiting > 0 and observation.mean_running_per_pod >= config.saturation_fill * m
    too_few_gaps = observation.itl_samples < config.min_itl_samples and not thin_by_setting
    if observation.mean_running_per_pod < 1 or too_few_gaps:
        return (f"too little traffic to learn from ({observation.itl_samples:.0f} inter-token samples in "
                f"{observation.window_seconds:.0f} s, need {config.min_itl_samples}): holding")
    if sums is not None and sums.get("steps", 0.0) < config.min_steps:
        return (f"too few engine steps to learn from ({sums.get('steps', 0.0):.0f} in "
                f"{observation.window_seconds:.0f} s, need {config.min_steps}): holding")
    latency, from_steps = observation.token_latency_p99(kind), False
    if kind == "TPOT":
        if latency is None or observation.tpot_samples < config.min_tpot_samples:
            if not thin_by_setting:
                return (f"too few finished requests to judge their TPOT ({observation.tpot_samples:.0f} in "
                        f"{observation.window_seconds:.0f} s, need {config.min_tpot_samples}): holding")
            latency, from_steps = observation.itl_mean * statistics.median_low(tails), True
        # Requests' TPOT P99 over the mean step: how far the slowest requests' share of steps strays.
        decode_tail = latency / mean_step if mean_step else 1.0
    else:
        decode_tail = (observation.decode_step_p99 / observation.decode_step_mean
                       if observation.decode_step_p99 and observation.decode_step_mean else 1.0)
    batch = observation.mean_running_per_pod
    waiting = observation.waiting / max(observation.pods, 1)
    running_now = observation.running_now / max(observation.pods, 1)
    budget = settings.max_num_batched_tokens or observation.max_num_batched_tokens
    return Sample(
        time=now,
        max_num_seqs=m,
        max_num_batched_tokens=budget,
        batch=batch,
        latency_p99=latency,
        tokens_per_second=observation.output_tokens_per_second,
        saturated=batch >= config.saturation_fill * m and waiting > 0,
        starved=batch < config.saturation_fill * m and waiting > 0 and budget is not None and sums is not None
        and (sums["rows"] + sums["prefill"]) / max(sums["steps"], 1.0) >= config.full_step * budget,
        filling=running_now >= max(config.filling_growth * batch, config.saturation_fill * m)
        and observation.waiting_now > 0,
        end_batch=running_now,
        lagging=from_steps,
        preempting=observation.preemptions_per_second > 0,
        ttft_p99=observation.ttft_p99,
        cost_sums=dict(sums) if sums is not None else None,
        decode_tail=max(decode_tail, 1.0),
        prefill_share=observation.prefill_step_share or 0.0,
        prefill_chunk=observation.prefill_tokens_per_prefill_step or 0.0,
        prefill_p99=observation.prefill_step_p99,
    )


def _predict(previous: tuple[Sample, ...], sample: Sample, slo: float, per_request: bool, config: TunerConfig
             ) -> tuple[Prediction, Sample]:
    """The prediction from the recent windows' step cost and this window's tails, at the machine's
    recent speed, corrected by the recent windows' observed / predicted latency P99; and the sample
    with its speed (level) and its own ratio recorded. ``per_request``: the SLO is on TPOT."""
    recent = (previous + (sample,))[-config.fit_window:]
    # Windows far over the SLO (deep in overload, where steps grow faster than the line) say little
    # about the slope near it.
    points = _fit_points(recent, slo, config)
    weighted = [(s.cost_sums, config.recency ** age) for age, s in enumerate(reversed(points)) if s.cost_sums]
    fitted = step_cost.fit_levelled(weighted, min_steps=config.min_steps) if weighted else None
    if fitted is None:
        # An engine without the cost curve: the windows' request-level P99s against their batches,
        # each window one point.
        cost = step_cost.fit(step_cost.add((_point(s), config.recency ** age) for age, s in enumerate(reversed(points))),
                             min_steps=0.5)
        own_level = None
    else:
        cost = fitted[0]
        own_level = step_cost.level(sample.cost_sums, cost) if sample.cost_sums else None
    prefill_mean = cost.seconds(sample.batch, sample.prefill_chunk) * (own_level or 1.0)
    budget = sample.max_num_batched_tokens
    measured = [s for s in recent[-config.correction_windows:] if s.cost_sums]
    tails = [s.decode_tail for s in measured if not s.lagging] or [s.decode_tail for s in measured]
    own = Prediction(
        cost=cost,
        level=own_level or 1.0,
        decode_tail=statistics.median_low(tails) if tails else 1.0,  # of recent windows: a P99 is noisy, one spike is not its tail
        prefill_share=sample.prefill_share,
        prefill_chunk=sample.prefill_chunk,
        chunks_fill_budget=budget is not None and sample.prefill_chunk >= 0.8 * max(budget - sample.batch, 1.0),
        prefill_tail=max((sample.prefill_p99 or prefill_mean) / prefill_mean, 1.0) if prefill_mean > 0 else 1.0,
        correction=1.0,
        config=config,
        batch=sample.batch,
        admissions_follow_batch=sample.saturated,
        per_request=per_request,
    )
    sample = replace(sample, correction=sample.latency_p99 / max(own.latency_p99(sample.batch, budget), 1e-9),
                     level=own_level)
    # The ratio where it was read: windows at this setting (a window at another batch, or one in which
    # the batch was filling up, says little about the prediction's error here).
    window = [s for s in _tail_at_setting(previous + (sample,), sample.max_num_seqs) if not s.lagging
              ][:config.correction_windows]
    low, high = config.correction_bounds
    correction = min(max(_geometric_mean([s.correction for s in window]) or 1.0, low), high)
    # The machine's speed: the slowest of the recent windows', so that a neighbour's load coming
    # back does not break a setting chosen while it was away.
    levels = [s.level for s in (previous + (sample,))[-2 * config.correction_windows:] if s.level]
    return replace(own, level=max(levels, default=1.0), correction=correction), sample


def _fit_points(recent: tuple[Sample, ...], slo: float, config: TunerConfig) -> list[Sample]:
    """The windows the step cost is fitted on: those near the SLO, or the latest alone."""
    near = [s for s in recent if s.latency_p99 <= config.fit_max_ratio * slo]
    return near or [recent[-1]]


def _point(sample: Sample) -> dict[str, float]:
    """A window's request-level ITL P99 at its batch, as the sums of one step."""
    r, t = sample.batch, sample.latency_p99
    return {"steps": 1.0, "rows": r, "prefill": 0.0, "seconds": t, "rows_rows": r * r, "rows_prefill": 0.0,
            "prefill_prefill": 0.0, "rows_seconds": r * t, "prefill_seconds": 0.0, "seconds_seconds": t * t}


def _geometric_mean(values: list[float | None]) -> float | None:
    logs = [math.log(v) for v in values if v]
    return math.exp(sum(logs) / len(logs)) if logs else None


def _margin(samples: tuple[Sample, ...], config: TunerConfig) -> float:
    """The margin below the SLO: wider the more the request-level P99 strays from the prediction from
    window to window (the machine's own speed is in the prediction: its slowest recent level)."""
    recent = samples[-2 * config.correction_windows:]
    spread = math.sqrt(_log_variance([s.correction for s in recent]))
    return min(max(config.margin, config.spread_margin * spread), config.max_margin)


def _noise_band(samples: tuple[Sample, ...], config: TunerConfig) -> float:
    """How far a window's ITL P99 strays from the line by chance: twice the spread of recent windows'
    observed / predicted (their machine speed and correction together)."""
    ratios = [s.level * s.correction for s in samples[-2 * config.correction_windows:] if s.level and s.correction]
    return min(max(config.spread_margin * math.sqrt(_log_variance(ratios)), config.margin), config.max_margin)


def _over_twice(samples: tuple[Sample, ...], seqs: int, slo: float) -> bool:
    """Two of the latest four windows at ``seqs`` (in a row at it) were over the SLO."""
    return sum(1 for s in _tail_at_setting(samples, seqs)[:4] if s.latency_p99 > slo) >= 2


def _log_variance(values: list[float | None]) -> float:
    logs = [math.log(v) for v in values if v]
    if len(logs) < 3:
        return 0.0
    mean = sum(logs) / len(logs)
    return sum((x - mean) ** 2 for x in logs) / (len(logs) - 1)


def _probe_below(samples: tuple[Sample, ...], m: int, running: float, slo: float, target: float, low: int,
                 config: TunerConfig) -> tuple[int, str] | None:
    """A smaller setting worth measuring before the SLO is called out of reach, and why; None when the
    windows already show that none below meets it, or when there is no smaller batch to measure.

    A probe must hold back some of the ``running`` sequences (the window's mean batch, or its end
    batch when the batch filled up): at least one, and ``1 - probe_share`` of them. One the batch would
    not feel measures nothing; it goes to the largest setting that does hold them back instead, and
    with one or two running there is none (tuning_day.py run 6: over long prompts, 1.1 sequences at
    64 read a TPOT P99 of 195 ms from other prompts' chunks in a short answer's life, a probe to 16
    held back nothing, and the chat burst after it started from 16; runs 7 and 10, probing ÷4 of the
    sequences running instead: 1.4 running sent the burst in from 1, and 9 on a noisy node went to 2,
    queueing the phase's requests past the TTFT SLO)."""
    found = _probe_target(samples, m, slo, target, low, config)
    holds_back = math.floor(min(config.probe_share * running, running - 1))
    if found is None or found[0] <= holds_back:
        return found
    if holds_back < low:
        return None
    return holds_back, (f"{found[1]}; {running:.1f} sequences ran, so {holds_back} is the first setting that "
                        "holds some back")


def _probe_target(samples: tuple[Sample, ...], m: int, slo: float, target: float, low: int, config: TunerConfig
                  ) -> tuple[int, str] | None:
    """The smaller setting the windows' curve points at, and why; None when it shows none below meets
    the SLO.

    The windows' ITL P99 per setting (recent ones, median of each) give an optimistic curve below the
    smallest setting measured: a power law through the two smallest, ITL ∝ batch^p (p in 0..1), which
    a concave cost lies above. Where even that curve puts the lower bound over the SLO, no smaller
    setting meets it (a step mostly fixed cost: a flat curve); otherwise the probe goes to where the
    curve meets ``target``, at most ÷4 from ``m``. One setting measured: ÷4. A smaller setting that met
    the SLO lately is returned to."""
    by_setting: dict[int, list[Sample]] = {}
    for s in samples[-config.bracket_windows:]:
        by_setting.setdefault(s.max_num_seqs, []).append(s)
    points = sorted((sum(s.batch for s in group) / len(group), statistics.median_high(s.latency_p99 for s in group), setting)
                    for setting, group in by_setting.items())
    (b1, y1, lowest), rest = points[0], points[1:]
    floor = max(math.floor(m * config.max_backoff), low)
    if lowest < m and y1 <= slo:
        return max(lowest, floor), f"{lowest} met it lately (ITL P99 {y1 * 1e3:.0f} ms)"
    if lowest <= low or y1 <= slo:
        # y1 <= slo: the windows at this very setting, the smallest batch measured, mostly met the SLO; the
        # batch is not what broke it now (tuning_day.py run 19: 36 met it at batch 5-7 over chat, then read
        # 124 ms at batch 2 over long prompts, and a curve "fell as batch^0.00" from them, probing 36 -> 1).
        return None
    if not rest or rest[0][0] < 1.25 * b1:
        return min(floor, lowest - 1), f"only batch {b1:.0f} has been measured"
    b2, y2, _ = rest[0]
    power = min(max(math.log(max(y2, y1) / y1) / math.log(b2 / b1), 0.0), 1.0)
    if y1 * (low / b1) ** power > slo:
        return None
    aim = max(math.floor(b1 * (target / y1) ** (1 / power)) if power > 0 else low, low)
    probe = min(max(aim, floor), lowest - 1)
    text = (f"the ITL P99 fell as batch^{power:.2f} from {b2:.0f} to {b1:.0f} ({y2 * 1e3:.0f} → {y1 * 1e3:.0f} ms), "
            f"which would meet it near {min(aim, probe)}")
    return probe, text


def _cut(prediction: Prediction, sample: Sample, tokens: int | None, target: float, low: int, m: int) -> int:
    """Where a window clearly over the SLO sends max_num_seqs: the shallower of two cuts, the largest
    setting the prediction (at this window's machine speed) puts under ``target``, and the largest at
    which the window's own P99, carried along the fitted curve from the batch it ran at, meets it.

    The prediction's tails and correction were learned over recent windows; when the traffic has
    just changed they belong to the traffic before (tuning_day.py run 5: a requests' tail of ×1.8
    learned over long prompts, where other prompts' chunks set a short answer's TPOT, cut a chat
    burst's 64 to 16, the most one interval allows, where 32-64 served it best), while the window's
    own point is the new traffic's. A cut acts in the next step and is measured one interval later,
    so one too shallow is taken further then, while one too deep costs throughput until the climb
    back."""
    now = replace(prediction, level=sample.level or prediction.level)
    own = _through(prediction, sample, tokens)
    return max(_largest(lambda s: p.latency_p99(s, tokens) <= target, low, m - 1) or low for p in (now, own))


def _through(prediction: Prediction, sample: Sample, tokens: int | None) -> Prediction:
    """The prediction's curve through the window's own point: its latency P99 at the batch it ran."""
    return replace(prediction, correction=prediction.correction * sample.latency_p99
                   / max(prediction.latency_p99(sample.batch, tokens), 1e-9))


def _ahead(prediction: Prediction, sample: Sample, tokens: int | None, target: float, low: int, m: int,
           config: TunerConfig) -> int:
    """Where max_num_seqs waits for the load in a window that meets the SLO: ``m``, or, while the batch
    stays below it, the largest setting predicted to meet ``target`` once the load fills the batch (a
    sequence joining as one finishes), never closer than ``ahead_headroom`` × the sequences running.

    Below the batch, a setting holds nothing back, so the move costs nothing until the load rises; when
    it does, the batch fills only as far as the SLO allows, instead of filling ``m`` and waiting for a
    per-request latency to say so (tuning_day.py run 11: the chat and quiet phases left the default's 64
    in place, a 2x burst filled it, and the cut to 16 and the climb to 22-26, the burst's best, took 70 s
    of its 120). A batch of a few sequences (``ahead_batch``) tells too little of the traffic to size a
    full one, and a setting only somewhat above the prediction stays (``tight_bracket``): it is noise."""
    if sample.saturated or sample.filling or sample.running < config.ahead_batch or not prediction.cost.slope_measured:
        return m
    full = replace(prediction, admissions_follow_batch=True)
    fits = _largest(lambda s: full.latency_p99(s, tokens) <= target, low, m) or low
    new = max(fits, math.ceil(config.ahead_headroom * sample.running))
    return new if new <= m * (1 - config.tight_bracket) else m


def _decode_span(observation: Observation) -> float:
    """Seconds a slow request finishing in the window spent decoding: its end-to-end latency less its
    time to first token (P99s; the medians where they say more)."""
    spans = [(e2e or 0.0) - (ttft or 0.0) for e2e, ttft in ((observation.e2e_p99, observation.ttft_p99),
                                                            (observation.e2e_p50, observation.ttft_p50))]
    return max(spans + [0.0])


def _held_back_nothing(samples: tuple[Sample, ...], change: Change) -> bool:
    """The change was a decrease made while fewer sequences ran than its new setting."""
    made = _window_that_made(samples, change)
    return change.new < change.old and made is not None and made.running <= change.new


def _window_that_made(samples: tuple[Sample, ...], change: Change) -> Sample | None:
    """The window whose decision the change was (None when no window was judged, or it is gone)."""
    return next((s for s in reversed(samples) if s.time == change.time), None)


def _largest(meets, low: int, high: int) -> int | None:
    """The largest whole setting in low..high for which ``meets`` holds; None for none."""
    return next((s for s in range(high, low - 1, -1) if meets(s)), None)


def _move(m: int, best: int, sample: Sample, observation: Observation, bounds, slo: float, config: TunerConfig,
          slope_measured: bool) -> tuple[int, str]:
    """The next max_num_seqs towards ``best``, and what keeps it at ``m`` when it stays."""
    if best < m:
        # At most ÷4 of the sequences running: the limit is on what a cut preempts, and a setting the
        # batch does not reach holds nothing back.
        new = max(best, math.floor(min(m, sample.running) * config.max_backoff), bounds.min)
        return (new, "") if m - new >= max(1, config.hysteresis * m) else (m, "the predicted best is within the hysteresis")
    if best == m:
        return m, "the prediction puts the best setting here"
    if m >= bounds.max:
        return m, f"max_num_seqs is at its upper bound {m}"
    if sample.latency_p99 > slo:
        return m, "the window is over the SLO: no growth on a prediction alone"
    if not sample.saturated:
        return m, (f"not saturated (batch {sample.batch:.1f} of {m}, {observation.waiting:.1f} waiting): "
                   "more sequences would not raise throughput")
    growth = config.max_growth if slope_measured else config.explore_growth
    limits = {best: f"the predicted best is {best}", math.floor(m * growth): f"×{growth:g} per interval",
              bounds.max: f"the upper bound {bounds.max}"}
    kv = _kv_capacity(observation, sample.batch, config)
    if kv is not None:
        limits.setdefault(math.floor(kv), f"the KV cache holds ~{kv:.0f} sequences at the observed lengths")
    new = min(limits)
    if new - m < max(1, config.hysteresis * m):
        return m, limits[new] if new < best else "the predicted best is within the hysteresis"
    return new, ""


def _budget_move(w: _Window, why: str, *, grow: bool) -> Decision:
    """A new max_num_batched_tokens: ×2 up for prefill that is too slow or a queue it starves, or down
    to the largest budget whose chunks are predicted to meet the ITL target (at most ÷2 per interval),
    never again below the one that relieved a queue it starved lately."""
    bounds, history, config = w.tuning.max_num_batched_tokens, w.history, w.config
    assert bounds is not None
    tokens = w.settings.max_num_batched_tokens or bounds.max
    if grow:
        new = bounds.clamp(tokens * config.tokens_step)
    else:
        fits = min(w.prediction.budget_for(w.m, w.target), tokens)
        new = max(math.floor(fits), math.ceil(tokens / config.tokens_step), bounds.min, w.m)
        floor = history.budget_floor
        if floor is not None and history.budget_floor_at is not None and \
                w.now - history.budget_floor_at < config.budget_floor_seconds:
            new = max(new, floor)
            if new >= tokens:
                return w.decide(w.settings, f"{why}; a smaller budget starved the queue lately ({floor} relieved "
                                            "it): holding")
    if new == tokens:
        return w.decide(w.settings, f"{why}; max_num_batched_tokens is at its bound {tokens}: holding",
                        unreachable=not grow)
    return w.decide(w.settings.replace(max_num_batched_tokens=new), f"{why}: max_num_batched_tokens {tokens} → {new}")


def _best_seen(samples: tuple[Sample, ...], slo: float) -> int | None:
    """The setting whose saturated window served the most goodput (below saturation, the throughput is
    the load's, not the setting's): its tokens per second, × SLO / latency P99 where that is over the SLO,
    as a window far over it serves few of its tokens within it (benchmarks/tuning.py run 26 from 256: one
    window at 64 read 107 ms, the SLO was called out of reach, and 256, which had served 1.5x the tokens at
    558 ms, was kept: 8 intervals over the SLO)."""
    saturated = [s for s in samples if s.saturated]
    if not saturated:
        return None
    return max(saturated, key=lambda s: s.tokens_per_second * min(1.0, slo / max(s.latency_p99, 1e-9))).max_num_seqs


def _after_oom(settings: EngineSettings, tuning: Tuning, history: TuningHistory, oom_kills: int, now: float,
               config: TunerConfig) -> Decision:
    """Down two memory steps after an out-of-memory kill, never again up to that fraction; at the
    lowest fraction allowed, fewer sequences instead."""
    mem, m = settings.gpu_memory_utilization, settings.max_num_seqs
    ceiling = mem if history.oom_memory_ceiling is None else min(mem, history.oom_memory_ceiling)
    hist = replace(history, oom_memory_ceiling=ceiling)
    lowered = tuning.gpu_memory_utilization.clamp(mem - 2 * config.memory_step)
    if lowered < mem:
        return _decision(settings, settings.replace(gpu_memory_utilization=lowered),
                         f"{oom_kills} pod(s) ran out of memory at gpu_memory_utilization {mem:g}: lowering it to "
                         f"{lowered:g}", hist, now, config)
    backed = tuning.max_num_seqs.clamp(m * 0.75)
    return _decision(settings, _with_seqs(settings, backed),
                     f"{oom_kills} pod(s) ran out of memory at the lowest allowed gpu_memory_utilization {mem:g}: "
                     f"lowering max_num_seqs {m} → {backed}", hist, now, config)


def _with_seqs(settings: EngineSettings, seqs: int) -> EngineSettings:
    """A new max_num_seqs; the token budget must fit one decode token per sequence."""
    tokens = settings.max_num_batched_tokens
    if tokens is not None and tokens < seqs:
        tokens = seqs
    return settings.replace(max_num_seqs=seqs, max_num_batched_tokens=tokens)


def _tail_at_setting(samples: tuple[Sample, ...], seqs: int) -> list[Sample]:
    """The latest windows in a row at ``seqs``."""
    tail: list[Sample] = []
    for s in reversed(samples):
        if s.max_num_seqs != seqs:
            break
        tail.append(s)
    return tail


def _kv_capacity(observation: Observation, batch: float, config: TunerConfig) -> float | None:
    """Sequences the KV cache holds at the window's mean footprint per sequence."""
    usage = observation.kv_cache_usage
    if usage < 0.05 or batch < 1:
        return None
    return batch / usage * config.kv_headroom


def _preempting_twice(samples: tuple[Sample, ...]) -> bool:
    return len(samples) >= 2 and samples[-1].preempting and samples[-2].preempting


def _raised_memory(mem: float, tuning: Tuning, history: TuningHistory, now: float,
                   config: TunerConfig) -> float | None:
    last = history.last_change(GPU_MEMORY_UTILIZATION)
    if last is not None and now - last.time < config.memory_cooldown_seconds:
        return None
    raised = tuning.gpu_memory_utilization.clamp(mem + config.memory_step)
    ceiling = history.oom_memory_ceiling
    if ceiling is not None and raised >= ceiling:
        raised = tuning.gpu_memory_utilization.clamp(min(raised, ceiling - config.memory_step / 2))
    return raised if raised > mem else None


__all__ = ["Change", "Decision", "Prediction", "Sample", "TunerConfig", "TuningHistory", "tune"]
