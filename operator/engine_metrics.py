"""The engines' /metrics, read into windows of snapshots and observations of load and latency.

Every tuning interval the operator scrapes each Ready engine pod's Prometheus
exposition (``engine_client.py`` does the HTTP) and hands the texts to a
``MetricsCollector``. A pod keeps a sliding window of parsed snapshots; the difference
between the oldest and newest snapshot in the window gives rates and
histogram bucket increases, from which quantiles are read the way
Prometheus's ``histogram_quantile`` does (linear interpolation inside the
bucket that holds the rank). Summing pods' increases gives the service view.

A window never spans a change of the engine's ``max_num_seqs``: the tuner
learns how latency follows the batch size, so mixing two settings in one
window would blur exactly what it measures.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as names

GAUGES = (
    names.REQUESTS_RUNNING,
    names.REQUESTS_WAITING,
    names.KV_CACHE_USAGE,
    names.KV_CACHE_BLOCKS,
    names.MAX_NUM_SEQS,
    names.MAX_NUM_BATCHED_TOKENS,
    names.GPU_MEMORY_UTILIZATION,
)
COUNTERS = (
    names.PREEMPTIONS,
    names.PREFIX_CACHE_QUERIES,
    names.PREFIX_CACHE_HITS,
    names.PROMPT_TOKENS,
    names.GENERATION_TOKENS,
    names.REQUEST_SUCCESS,
    names.REQUESTS_REJECTED,
    names.ENGINE_STEPS,
    names.STEP_RUNNING_SEQS,
)
HISTOGRAMS = (
    names.TIME_TO_FIRST_TOKEN,
    names.INTER_TOKEN_LATENCY,
    names.TIME_PER_OUTPUT_TOKEN,
    names.E2E_REQUEST_LATENCY,
    names.REQUEST_QUEUE_TIME,
)
# Families read per label value (the engine's cost curve), by the parser's family name: the exposed
# name and the label; their series are kept as "exposed{value}".
LABELLED = {
    names.counter_base_name(names.STEP_COST_SUMS): (names.STEP_COST_SUMS, names.TERM_LABEL),
    names.STEP_DURATION: (names.STEP_DURATION, names.STEP_KIND_LABEL),
}


def labelled(name: str, value: str) -> str:
    """The key of one label value of a LABELLED family in a snapshot."""
    return f"{name}{{{value}}}"


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts, as exposed: ``(upper_bound, count)`` sorted, last bound +Inf."""

    buckets: tuple[tuple[float, float], ...]
    total: float  # the _sum sample

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, earlier: Histogram) -> Histogram:
        """Bucket increases since ``earlier`` (same bucket layout required)."""
        if [b for b, _ in self.buckets] != [b for b, _ in earlier.buckets]:
            raise ValueError("histogram bucket layouts differ between snapshots")
        return Histogram(
            tuple((b, c - e) for (b, c), (_, e) in zip(self.buckets, earlier.buckets)),
            self.total - earlier.total,
        )

    def plus(self, other: Histogram) -> Histogram:
        if [b for b, _ in self.buckets] != [b for b, _ in other.buckets]:
            raise ValueError("histogram bucket layouts differ between pods")
        return Histogram(
            tuple((b, c + o) for (b, c), (_, o) in zip(self.buckets, other.buckets)),
            self.total + other.total,
        )

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.buckets)


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile of cumulative buckets, as Prometheus's ``histogram_quantile``.

    Returns None when there are no observations. A rank that falls in the +Inf
    bucket answers the largest finite bound: the histogram cannot say more.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        raise ValueError("a histogram needs at least one finite bucket and the +Inf bucket")
    # Counts scraped at slightly different moments can dip; keep them monotone.
    monotone: list[tuple[float, float]] = []
    running_max = 0.0
    for bound, count in ordered:
        running_max = max(running_max, count)
        monotone.append((bound, running_max))
    observations = monotone[-1][1]
    if observations <= 0:
        return None
    rank = q * observations
    index = next(i for i, (_, count) in enumerate(monotone) if count >= rank)
    if index == len(monotone) - 1:
        return monotone[-2][0]
    upper, count_at_upper = monotone[index]
    if index == 0:
        if upper <= 0:
            return upper
        lower, count_below = 0.0, 0.0
    else:
        lower, count_below = monotone[index - 1]
    in_bucket = count_at_upper - count_below
    if in_bucket <= 0:
        return upper
    return lower + (upper - lower) * (rank - count_below) / in_bucket


@dataclass(frozen=True)
class Snapshot:
    """One scrape of one pod, summed over label sets (model name, finish reason)."""

    time: float
    gauges: Mapping[str, float]
    counters: Mapping[str, float]
    histograms: Mapping[str, Histogram]


def parse_snapshot(text: str, scraped_at: float) -> Snapshot:
    """Parse a Prometheus text exposition into the metrics the operator reads."""
    gauges: dict[str, float] = {}
    counters: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    wanted_gauges, wanted_counters = set(GAUGES), set(COUNTERS)
    bucket_names = {f"{h}_bucket": h for h in HISTOGRAMS}
    sum_names = {f"{h}_sum": h for h in HISTOGRAMS}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if family.name in LABELLED:
                # One series per label value (not one summed over them), named by it.
                exposed, label = LABELLED[family.name]
                key = labelled(exposed, sample.labels.get(label, ""))
                if exposed == names.STEP_COST_SUMS:
                    counters[key] = counters.get(key, 0.0) + value
                    continue
                name = key + name[len(family.name):]  # "..._bucket", "..._sum"
                bucket_names[f"{key}_bucket"], sum_names[f"{key}_sum"] = key, key
            if name in wanted_gauges:
                gauges[name] = gauges.get(name, 0.0) + value
            elif name in wanted_counters:
                counters[name] = counters.get(name, 0.0) + value
            elif name in bucket_names:
                bound = float(sample.labels["le"])
                per_bound = buckets.setdefault(bucket_names[name], {})
                per_bound[bound] = per_bound.get(bound, 0.0) + value
            elif name in sum_names:
                sums[sum_names[name]] = sums.get(sum_names[name], 0.0) + value
    histograms = {
        hist: Histogram(tuple(sorted(per_bound.items())), sums.get(hist, 0.0))
        for hist, per_bound in buckets.items()
        if len(per_bound) >= 2
    }
    return Snapshot(scraped_at, gauges, counters, histograms)


@dataclass(frozen=True)
class WindowDelta:
    """What happened in one window: counter and bucket increases, gauge means.

    Deltas of several pods add up to the service's (``merge_deltas``); the
    window length is then the pods' mean, which is what per-second rates need.
    """

    seconds: float
    pods: int
    counters: Mapping[str, float]
    histograms: Mapping[str, Histogram]
    gauge_means: Mapping[str, float]  # summed over pods
    gauge_lasts: Mapping[str, float]  # summed over pods
    setting_gauges: Mapping[str, float]  # max_num_seqs etc.: the smallest over pods


def window_delta(snapshots: list[Snapshot]) -> WindowDelta | None:
    """The delta across snapshots (oldest first); None for fewer than two."""
    if len(snapshots) < 2:
        return None
    first, last = snapshots[0], snapshots[-1]
    seconds = last.time - first.time
    if seconds <= 0:
        return None
    counters = {
        name: last.counters[name] - first.counters.get(name, 0.0)
        for name in last.counters
    }
    histograms = {
        name: hist.minus(first.histograms[name])
        for name, hist in last.histograms.items()
        if name in first.histograms
    }
    gauge_means = {
        name: sum(s.gauges.get(name, 0.0) for s in snapshots) / len(snapshots)
        for name in last.gauges
    }
    settings = {
        name: last.gauges[name]
        for name in (names.MAX_NUM_SEQS, names.MAX_NUM_BATCHED_TOKENS, names.GPU_MEMORY_UTILIZATION)
        if name in last.gauges
    }
    return WindowDelta(seconds, 1, counters, histograms, gauge_means, dict(last.gauges), settings)


def merge_deltas(deltas: Iterable[WindowDelta]) -> WindowDelta | None:
    deltas = list(deltas)
    if not deltas:
        return None
    counters: dict[str, float] = {}
    histograms: dict[str, Histogram] = {}
    gauge_means: dict[str, float] = {}
    gauge_lasts: dict[str, float] = {}
    settings: dict[str, float] = {}
    for delta in deltas:
        for name, value in delta.counters.items():
            counters[name] = counters.get(name, 0.0) + value
        for name, hist in delta.histograms.items():
            histograms[name] = histograms[name].plus(hist) if name in histograms else hist
        for name, value in delta.gauge_means.items():
            gauge_means[name] = gauge_means.get(name, 0.0) + value
        for name, value in delta.gauge_lasts.items():
            gauge_lasts[name] = gauge_lasts.get(name, 0.0) + value
        for name, value in delta.setting_gauges.items():
            settings[name] = min(settings.get(name, value), value)
    pods = sum(d.pods for d in deltas)
    seconds = sum(d.seconds * d.pods for d in deltas) / pods
    return WindowDelta(seconds, pods, counters, histograms, gauge_means, gauge_lasts, settings)


# A TTFT made at least this much of queueing is the autoscaler's to fix, not the batch size's.
QUEUEING_SHARE = 0.5


@dataclass(frozen=True)
class Observation:
    """A window's metrics, for one pod or a whole service (sums over pods).

    Latency quantiles are in seconds and None when the window saw no sample.
    ``mean_running_per_pod`` is the step-weighted mean batch size, the x of the
    tuner's latency model. ``ttft_queue_share`` splits the time to first token:
    the share of it spent waiting for a batch slot (mean queue time / mean TTFT;
    both are observed once per request, so the rest is prefill).
    """

    window_seconds: float
    pods: int
    output_tokens_per_second: float
    prompt_tokens_per_second: float
    requests_per_second: float
    requests_finished: float
    itl_samples: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    queue_time_p99: float | None
    mean_running_per_pod: float | None
    running: float  # mean over the window, summed over pods
    waiting: float  # mean over the window, summed over pods
    waiting_now: float
    kv_cache_usage: float  # mean over the window and over pods
    kv_cache_blocks: float  # summed over pods
    preemptions_per_second: float
    prefix_cache_hit_rate: float | None
    mean_output_tokens_per_request: float | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    gpu_memory_utilization: float | None
    ttft_queue_share: float | None = None
    # The engine's cost curve over the window (operator/step_cost.py fits it; None from engines that
    # do not export it) and its steps' durations by kind.
    step_cost_sums: Mapping[str, float] | None = None
    decode_step_mean: float | None = None
    decode_step_p99: float | None = None
    prefill_step_p99: float | None = None
    prefill_step_share: float | None = None  # of the steps, those carrying prefill tokens
    prefill_tokens_per_prefill_step: float | None = None
    # Requests' time per output token (one sample per finished request; None from engines without it).
    tpot_samples: float = 0.0
    tpot_p99: float | None = None
    tpot_p95: float | None = None
    itl_mean: float | None = None  # seconds: the running requests' mean gap between tokens
    rejected_per_second: float = 0.0  # requests admission turned away (429), summed over pods
    running_now: float = 0.0  # at the window's end, summed over pods

    @property
    def overloaded(self) -> bool:
        """Requests were turned away for want of capacity: the pods were full, whatever their latency."""
        return self.rejected_per_second > 0

    def token_latency_p99(self, kind: str) -> float | None:
        """The P99 of the SLO's per-token latency (``Slo.token_latency``'s kind): "TPOT" or "ITL"."""
        return self.tpot_p99 if kind == "TPOT" else self.itl_p99

    @property
    def ttft_from_queueing(self) -> bool:
        """Most of the time to first token went to waiting for a batch slot: capacity, not step time."""
        return self.ttft_queue_share is not None and self.ttft_queue_share >= QUEUEING_SHARE


def observe(delta: WindowDelta) -> Observation:
    """Rates, quantiles and means of one (pod or merged) window delta."""
    counters, hists, seconds = delta.counters, delta.histograms, delta.seconds

    def rate(name: str) -> float:
        return max(counters.get(name, 0.0), 0.0) / seconds

    def quantile(name: str, q: float) -> float | None:
        hist = hists.get(name)
        return None if hist is None else hist.quantile(q)

    steps = counters.get(names.ENGINE_STEPS, 0.0)
    cost = {term: counters[labelled(names.STEP_COST_SUMS, term)] for term in names.STEP_COST_TERMS
            if labelled(names.STEP_COST_SUMS, term) in counters}
    decode_steps = hists.get(labelled(names.STEP_DURATION, "decode"))
    prefill_steps = hists.get(labelled(names.STEP_DURATION, "prefill"))
    kind_steps = (decode_steps.count if decode_steps else 0.0) + (prefill_steps.count if prefill_steps else 0.0)
    queries = counters.get(names.PREFIX_CACHE_QUERIES, 0.0)
    finished = counters.get(names.REQUEST_SUCCESS, 0.0)
    generated = counters.get(names.GENERATION_TOKENS, 0.0)
    itl = hists.get(names.INTER_TOKEN_LATENCY)
    tpot = hists.get(names.TIME_PER_OUTPUT_TOKEN)
    ttft = hists.get(names.TIME_TO_FIRST_TOKEN)
    queue = hists.get(names.REQUEST_QUEUE_TIME)
    settings = delta.setting_gauges

    def setting_int(name: str) -> int | None:
        return int(round(settings[name])) if name in settings else None

    return Observation(
        window_seconds=seconds,
        pods=delta.pods,
        output_tokens_per_second=rate(names.GENERATION_TOKENS),
        prompt_tokens_per_second=rate(names.PROMPT_TOKENS),
        requests_per_second=rate(names.REQUEST_SUCCESS),
        requests_finished=finished,
        itl_samples=itl.count if itl is not None else 0.0,
        ttft_p50=quantile(names.TIME_TO_FIRST_TOKEN, 0.5),
        ttft_p99=quantile(names.TIME_TO_FIRST_TOKEN, 0.99),
        itl_p50=quantile(names.INTER_TOKEN_LATENCY, 0.5),
        itl_p99=quantile(names.INTER_TOKEN_LATENCY, 0.99),
        e2e_p50=quantile(names.E2E_REQUEST_LATENCY, 0.5),
        e2e_p99=quantile(names.E2E_REQUEST_LATENCY, 0.99),
        queue_time_p99=quantile(names.REQUEST_QUEUE_TIME, 0.99),
        mean_running_per_pod=(counters.get(names.STEP_RUNNING_SEQS, 0.0) / steps) if steps > 0 else None,
        running=delta.gauge_means.get(names.REQUESTS_RUNNING, 0.0),
        waiting=delta.gauge_means.get(names.REQUESTS_WAITING, 0.0),
        waiting_now=delta.gauge_lasts.get(names.REQUESTS_WAITING, 0.0),
        kv_cache_usage=delta.gauge_means.get(names.KV_CACHE_USAGE, 0.0) / delta.pods,
        kv_cache_blocks=delta.gauge_lasts.get(names.KV_CACHE_BLOCKS, 0.0),
        preemptions_per_second=rate(names.PREEMPTIONS),
        rejected_per_second=rate(names.REQUESTS_REJECTED),
        running_now=delta.gauge_lasts.get(names.REQUESTS_RUNNING, 0.0),
        prefix_cache_hit_rate=(counters.get(names.PREFIX_CACHE_HITS, 0.0) / queries) if queries > 0 else None,
        mean_output_tokens_per_request=(generated / finished) if finished > 0 else None,
        max_num_seqs=setting_int(names.MAX_NUM_SEQS),
        max_num_batched_tokens=setting_int(names.MAX_NUM_BATCHED_TOKENS),
        gpu_memory_utilization=settings.get(names.GPU_MEMORY_UTILIZATION),
        ttft_queue_share=min(max(queue.total / ttft.total, 0.0), 1.0)
        if ttft is not None and queue is not None and ttft.total > 0 else None,
        step_cost_sums=cost if len(cost) == len(names.STEP_COST_TERMS) else None,
        decode_step_mean=decode_steps.total / decode_steps.count if decode_steps and decode_steps.count > 0 else None,
        decode_step_p99=decode_steps.quantile(0.99) if decode_steps else None,
        prefill_step_p99=prefill_steps.quantile(0.99) if prefill_steps else None,
        prefill_step_share=prefill_steps.count / kind_steps if prefill_steps and kind_steps > 0 else None,
        prefill_tokens_per_prefill_step=cost.get("prefill", 0.0) / prefill_steps.count
        if prefill_steps and prefill_steps.count > 0 else None,
        tpot_samples=tpot.count if tpot is not None else 0.0,
        tpot_p99=quantile(names.TIME_PER_OUTPUT_TOKEN, 0.99),
        tpot_p95=quantile(names.TIME_PER_OUTPUT_TOKEN, 0.95),
        itl_mean=itl.total / itl.count if itl is not None and itl.count > 0 else None,
    )


class PodWindow:
    """A pod's recent snapshots, oldest first, at most ``window_seconds`` apart.

    The window restarts (keeping only the newest snapshot) when the engine
    restarted (a counter went down) or its max_num_seqs changed.
    """

    def __init__(self, window_seconds: float) -> None:
        if window_seconds <= 0:
            raise ValueError(f"window_seconds must be positive, got {window_seconds}")
        self.window_seconds = window_seconds
        self.snapshots: deque[Snapshot] = deque()
        self.expected_max_num_seqs: int | None = None  # a change we made ourselves: no break for it

    def add(self, snapshot: Snapshot) -> None:
        if self.snapshots and self._breaks_window(self.snapshots[-1], snapshot, self.expected_max_num_seqs):
            self.snapshots.clear()
        self.expected_max_num_seqs = None
        self.snapshots.append(snapshot)
        # Keep one snapshot at or beyond the window's start so the window stays full length.
        while len(self.snapshots) > 2 and snapshot.time - self.snapshots[1].time >= self.window_seconds:
            self.snapshots.popleft()

    def restart(self, expect_max_num_seqs: int | None = None) -> None:
        """Forget all but the newest snapshot, after the operator applied ``expect_max_num_seqs``.

        The next window then starts at this moment and runs under the new setting.
        """
        while len(self.snapshots) > 1:
            self.snapshots.popleft()
        self.expected_max_num_seqs = expect_max_num_seqs

    def latest_gauge(self, name: str) -> float | None:
        return self.snapshots[-1].gauges.get(name) if self.snapshots else None

    def delta(self) -> WindowDelta | None:
        return window_delta(list(self.snapshots))

    @staticmethod
    def _breaks_window(previous: Snapshot, current: Snapshot, expected_max_num_seqs: int | None) -> bool:
        if any(current.counters.get(n, 0.0) < v for n, v in previous.counters.items()):
            return True
        before = previous.gauges.get(names.MAX_NUM_SEQS)
        after = current.gauges.get(names.MAX_NUM_SEQS)
        if before is None or after is None or before == after:
            return False
        return expected_max_num_seqs is None or int(after) != expected_max_num_seqs


@dataclass(frozen=True)
class PodReport:
    """One pod's part of a collection: its observation, or why there is none."""

    pod: str
    observation: Observation | None
    error: str | None = None  # scrape failed: the pod is reported, tuning goes on


@dataclass(frozen=True)
class ServiceMetrics:
    service: Observation | None
    pods: Mapping[str, PodReport] = field(default_factory=dict)

    @property
    def unreachable(self) -> list[str]:
        return sorted(p for p, report in self.pods.items() if report.error is not None)


class MetricsCollector:
    """Keeps a service's pod windows between tuning intervals.

    Each round of scrapes maps a pod to its exposition text or the exception
    that failed it; a pod missing from a round (gone, or no longer Ready) is
    forgotten, so a replaced pod starts a fresh window.
    """

    def __init__(self, window_seconds: float) -> None:
        self.window_seconds = window_seconds
        self.windows: dict[str, PodWindow] = {}

    def ingest(self, texts: Mapping[str, str | BaseException], scraped_at: float) -> ServiceMetrics:
        """Add one round of scrape results (text, or the exception that failed it)."""
        for gone in set(self.windows) - set(texts):
            del self.windows[gone]
        reports: dict[str, PodReport] = {}
        deltas: list[WindowDelta] = []
        for pod, text in texts.items():
            if isinstance(text, BaseException):
                reports[pod] = PodReport(pod, None, f"{type(text).__name__}: {text}".strip(": "))
                continue
            try:
                snapshot = parse_snapshot(text, scraped_at)
            except ValueError as exc:
                reports[pod] = PodReport(pod, None, f"unparsable metrics: {exc}")
                continue
            window = self.windows.setdefault(pod, PodWindow(self.window_seconds))
            window.add(snapshot)
            delta = window.delta()
            if delta is None:
                reports[pod] = PodReport(pod, None)
                continue
            deltas.append(delta)
            reports[pod] = PodReport(pod, observe(delta))
        merged = merge_deltas(deltas)
        return ServiceMetrics(observe(merged) if merged is not None else None, reports)

    def restart_windows(self, expect_max_num_seqs: int | None = None) -> None:
        """Start every pod's window now: the operator just applied ``expect_max_num_seqs``."""
        for window in self.windows.values():
            window.restart(expect_max_num_seqs)

    def restart_pod_window(self, pod: str, expect_max_num_seqs: int | None = None) -> None:
        if pod in self.windows:
            self.windows[pod].restart(expect_max_num_seqs)

    def latest_gauge(self, pod: str, name: str) -> float | None:
        """A gauge from the pod's newest snapshot (None if never scraped or absent)."""
        window = self.windows.get(pod)
        return None if window is None else window.latest_gauge(name)
