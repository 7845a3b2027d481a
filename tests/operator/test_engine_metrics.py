"""The engines' metrics, read: quantiles from bucket deltas, rates, windows, merging pods."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpilot import engine_contract as names
from kvpilot.operator.engine_metrics import (
    MetricsCollector,
    PodWindow,
    histogram_quantile,
    observe,
    parse_snapshot,
    window_delta,
)

INF = math.inf


class EngineMetrics:
    """The contract's metrics in a private registry, as an engine would export them."""

    def __init__(self, model: str = "m") -> None:
        self.registry = CollectorRegistry()
        r, label = self.registry, [names.MODEL_NAME_LABEL]
        self.running = Gauge(names.REQUESTS_RUNNING, "", label, registry=r).labels(model)
        self.waiting = Gauge(names.REQUESTS_WAITING, "", label, registry=r).labels(model)
        self.kv_usage = Gauge(names.KV_CACHE_USAGE, "", label, registry=r).labels(model)
        self.max_num_seqs = Gauge(names.MAX_NUM_SEQS, "", label, registry=r).labels(model)

        def counter(name: str, extra: list[str] | None = None):
            return Counter(names.counter_base_name(name), "", label + (extra or []), registry=r)

        self.generation = counter(names.GENERATION_TOKENS).labels(model)
        self.prompt = counter(names.PROMPT_TOKENS).labels(model)
        self.success = counter(names.REQUEST_SUCCESS, [names.FINISH_REASON_LABEL])
        self.rejected = counter(names.REQUESTS_REJECTED, [names.REJECT_REASON_LABEL])
        self.steps = counter(names.ENGINE_STEPS).labels(model)
        self.step_running = counter(names.STEP_RUNNING_SEQS).labels(model)
        self.preemptions = counter(names.PREEMPTIONS).labels(model)
        self.prefix_queries = counter(names.PREFIX_CACHE_QUERIES).labels(model)
        self.prefix_hits = counter(names.PREFIX_CACHE_HITS).labels(model)
        self.itl = Histogram(
            names.INTER_TOKEN_LATENCY, "", label, buckets=names.INTER_TOKEN_LATENCY_BUCKETS, registry=r
        ).labels(model)
        self.tpot = Histogram(
            names.TIME_PER_OUTPUT_TOKEN, "", label, buckets=names.INTER_TOKEN_LATENCY_BUCKETS, registry=r
        ).labels(model)
        self.ttft = Histogram(
            names.TIME_TO_FIRST_TOKEN, "", label, buckets=names.TIME_TO_FIRST_TOKEN_BUCKETS, registry=r
        ).labels(model)
        self.queue_time = Histogram(
            names.REQUEST_QUEUE_TIME, "", label, buckets=names.REQUEST_LATENCY_BUCKETS, registry=r
        ).labels(model)
        self.max_num_seqs.set(16)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = [(0.1, 10.0), (0.2, 20.0), (INF, 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.15)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.05)  # first bucket starts at 0


def test_quantile_edge_cases():
    assert histogram_quantile(0.99, [(0.1, 0.0), (INF, 0.0)]) is None
    # A rank in +Inf answers the largest finite bound.
    assert histogram_quantile(0.99, [(0.1, 1.0), (0.2, 2.0), (INF, 10.0)]) == 0.2
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, [(0.1, 1.0), (INF, 1.0)])
    with pytest.raises(ValueError, match="Inf"):
        histogram_quantile(0.5, [(0.1, 1.0), (0.2, 1.0)])
    # Non-monotone counts (scrape skew) are coalesced instead of giving negative widths.
    assert histogram_quantile(0.5, [(0.1, 6.0), (0.2, 5.0), (INF, 10.0)]) == pytest.approx(0.1 * 5 / 6)


def exact_quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q * len(ordered))) - 1)]


def bucket_containing(value: float, bounds: tuple[float, ...]) -> tuple[float, float]:
    lower = 0.0
    for upper in bounds:
        if value <= upper:
            return lower, upper
        lower = upper
    return lower, INF


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_quantile_from_bucket_deltas_matches_known_samples(q):
    rng = random.Random(7)
    engine = EngineMetrics()
    for _ in range(3000):  # before the window: a different, slower distribution
        engine.itl.observe(rng.lognormvariate(math.log(0.2), 0.3))
    before = parse_snapshot(engine.text(), 100.0)
    window = [rng.lognormvariate(math.log(0.04), 0.5) for _ in range(5000)]
    for value in window:
        engine.itl.observe(value)
    after = parse_snapshot(engine.text(), 110.0)

    delta = after.histograms[names.INTER_TOKEN_LATENCY].minus(before.histograms[names.INTER_TOKEN_LATENCY])
    assert delta.count == 5000
    estimate = delta.quantile(q)
    lower, upper = bucket_containing(exact_quantile(window, q), names.INTER_TOKEN_LATENCY_BUCKETS)
    assert lower <= estimate <= upper
    assert delta.total == pytest.approx(sum(window))


def test_observation_rates_batch_and_ratios():
    engine = EngineMetrics()
    engine.generation.inc(100)
    engine.steps.inc(10)
    engine.step_running.inc(40)
    first = parse_snapshot(engine.text(), 0.0)
    engine.generation.inc(500)
    engine.prompt.inc(2000)
    engine.steps.inc(50)
    engine.step_running.inc(400)
    engine.success.labels("m", "stop").inc(3)
    engine.success.labels("m", "length").inc(2)  # summed over finish reasons
    engine.preemptions.inc(4)
    engine.rejected.labels("m", "queue_wait").inc(6)
    engine.rejected.labels("m", "queue_full").inc(1)  # summed over reasons
    engine.prefix_queries.inc(1000)
    engine.prefix_hits.inc(250)
    engine.waiting.set(6)
    engine.running.set(12)
    engine.kv_usage.set(0.5)
    for tpot in [0.04] * 97 + [0.3] * 3:  # requests' TPOT in the window: the P99 lies among the three slow ones
        engine.tpot.observe(tpot)
    last = parse_snapshot(engine.text(), 10.0)

    obs = observe(window_delta([first, last]))
    assert obs.output_tokens_per_second == pytest.approx(50.0)
    assert obs.prompt_tokens_per_second == pytest.approx(200.0)
    assert obs.requests_per_second == pytest.approx(0.5)
    assert obs.mean_running_per_pod == pytest.approx(8.0)
    assert obs.preemptions_per_second == pytest.approx(0.4)
    assert obs.rejected_per_second == pytest.approx(0.7) and obs.overloaded
    assert obs.prefix_cache_hit_rate == pytest.approx(0.25)
    assert obs.mean_output_tokens_per_request == pytest.approx(100.0)
    assert obs.waiting == pytest.approx(3.0)  # mean of the two snapshots
    assert obs.waiting_now == 6 and obs.running_now == 12 and obs.running == pytest.approx(6.0)
    assert obs.max_num_seqs == 16
    assert obs.itl_p99 is None and obs.itl_samples == 0
    assert obs.tpot_samples == 100 and 0.25 < obs.tpot_p99 <= 0.3


def test_window_slides_and_restarts_on_engine_restart_or_setting_change():
    engine = EngineMetrics()
    window = PodWindow(window_seconds=10.0)
    for t in range(0, 30, 2):
        engine.generation.inc(10)
        window.add(parse_snapshot(engine.text(), float(t)))
    delta = window.delta()
    assert 10.0 <= delta.seconds <= 12.0
    assert delta.counters[names.GENERATION_TOKENS] == pytest.approx(5 * delta.seconds)

    engine.max_num_seqs.set(32)
    window.add(parse_snapshot(engine.text(), 30.0))
    assert window.delta() is None  # a window never spans two settings

    restarted = EngineMetrics()  # counters back at zero
    window.add(parse_snapshot(engine.text(), 32.0))
    assert window.delta() is not None
    window.add(parse_snapshot(restarted.text(), 34.0))
    assert window.delta() is None


def test_a_change_the_operator_made_starts_a_fresh_window_instead_of_breaking_it():
    engine = EngineMetrics()
    window = PodWindow(window_seconds=10.0)
    window.add(parse_snapshot(engine.text(), 0.0))
    engine.generation.inc(10)
    window.add(parse_snapshot(engine.text(), 2.0))
    window.restart(expect_max_num_seqs=32)
    engine.max_num_seqs.set(32)
    engine.generation.inc(30)
    window.add(parse_snapshot(engine.text(), 5.0))
    delta = window.delta()
    assert delta.seconds == pytest.approx(3.0)
    assert delta.counters[names.GENERATION_TOKENS] == pytest.approx(30.0)
    assert observe(delta).max_num_seqs == 32


def test_collector_merges_pods_and_reports_unscrapable_ones():
    collector = MetricsCollector(window_seconds=60.0)
    a, b = EngineMetrics(), EngineMetrics()
    collector.ingest({"a": a.text(), "b": b.text(), "c": ConnectionRefusedError("refused")}, 0.0)
    for _ in range(100):
        a.itl.observe(0.01)
        b.itl.observe(0.5)
    a.generation.inc(100)
    b.generation.inc(300)
    result = collector.ingest({"a": a.text(), "b": b.text(), "c": ConnectionRefusedError("refused")}, 10.0)

    assert result.unreachable == ["c"]
    assert "refused" in result.pods["c"].error
    assert result.service.pods == 2
    assert result.service.output_tokens_per_second == pytest.approx(40.0)
    assert result.pods["a"].observation.itl_p99 <= 0.01
    # The service's P99 comes from summed buckets: half the samples sit at 0.5 s.
    assert 0.4 <= result.service.itl_p99 <= 0.5
    assert 0.0 < result.service.itl_p50 <= 0.5


def test_a_pod_missing_from_a_round_starts_afresh_when_it_returns():
    collector = MetricsCollector(window_seconds=60.0)
    a = EngineMetrics()
    collector.ingest({"a": a.text()}, 0.0)
    a.generation.inc(100)
    assert collector.ingest({"a": a.text()}, 10.0).service.output_tokens_per_second == pytest.approx(10.0)
    collector.ingest({}, 20.0)  # not Ready this round: forgotten
    a.generation.inc(100)
    assert collector.ingest({"a": a.text()}, 30.0).service is None  # one snapshot: no window yet


def test_ttft_splits_into_queueing_and_prefill():
    collector = MetricsCollector(window_seconds=60.0)
    engine = EngineMetrics()
    collector.ingest({"a": engine.text()}, 0.0)
    for _ in range(50):  # each request: 1.5 s in the queue, then 0.5 s of prefill
        engine.queue_time.observe(1.5)
        engine.ttft.observe(2.0)
    queued = collector.ingest({"a": engine.text()}, 10.0).service
    assert queued.ttft_queue_share == pytest.approx(0.75) and queued.ttft_from_queueing
    for _ in range(450):  # then many requests that never wait: the window (both rounds) is mostly prefill
        engine.queue_time.observe(0.0)
        engine.ttft.observe(0.4)
    prefill = collector.ingest({"a": engine.text()}, 20.0).service
    assert prefill.ttft_queue_share == pytest.approx(75 / 280) and not prefill.ttft_from_queueing
