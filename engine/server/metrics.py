"""Prometheus metrics of one server, named by the contract in kvpilot/engine_contract.py.

Gauges and the engine's own counters are read from the engine's latest stats
snapshot at scrape time (a custom collector), so they can never drift from the
engine's accounting. Per-request histograms and the finish-reason counter are
observed on the engine thread as outputs come out of ``step()``
(``ServerMetrics`` is the async engine's ``StepObserver``). Every sample carries
a ``model_name`` label, as vLLM's do, so ported dashboards can filter on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpilot import engine_contract as names

if TYPE_CHECKING:
    from kvpilot.engine.llm_engine import EngineStats
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.step_cost import StepCostSnapshot

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class _Progress:
    num_tokens: dict[int, int] = field(default_factory=dict)  # per sequence index: its tokens so far
    finish_reasons: dict[int, str] = field(default_factory=dict)  # per sequence index, once it ended
    last_token_time: float | None = None
    num_preemptions: int = 0
    decode_seconds: float = 0.0  # the inter-token gaps observed for it, summed (its TPOT's numerator)
    decode_tokens: int = 0  # and their count


class EngineStatsCollector(Collector):
    """Exposes the engine's stats snapshot as gauges and counters at scrape time."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        num_waiting: Callable[[], int],
        model_name: str,
        gpu_memory_utilization: float,
        model_info: dict[str, str],
    ) -> None:
        self._stats = stats
        self._num_waiting = num_waiting
        self._model_name = model_name
        self._gpu_memory_utilization = gpu_memory_utilization
        self._model_info = model_info

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        label = [names.MODEL_NAME_LABEL]
        value = [self._model_name]

        def gauge(name: str, doc: str, sample: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=label)
            family.add_metric(value, sample)
            return family

        def counter(name: str, doc: str, sample: float) -> CounterMetricFamily:
            family = CounterMetricFamily(names.counter_base_name(name), doc, labels=label)
            family.add_metric(value, sample)
            return family

        yield gauge(names.REQUESTS_RUNNING, "Requests being generated (in the running batch).", stats.num_running)
        yield gauge(
            names.REQUESTS_WAITING,
            "Requests accepted and not yet scheduled (the engine's waiting queue plus requests handed to it).",
            self._num_waiting(),
        )
        yield gauge(names.KV_CACHE_USAGE, "KV cache blocks in use / blocks total (0-1).", stats.kv_cache_usage)
        yield gauge(names.KV_CACHE_BLOCKS, "KV cache blocks the engine was given at start-up.", stats.num_kv_blocks)
        yield gauge(
            names.KV_CACHE_UTILIZATION,
            "Tokens stored / token slots held by live requests (0-1): how full the allocated blocks are.",
            stats.kv_utilization,
        )
        yield gauge(names.MAX_NUM_SEQS, "Current max_num_seqs (changes live via the admin API).", stats.max_num_seqs)
        yield gauge(
            names.MAX_NUM_BATCHED_TOKENS,
            "Current max_num_batched_tokens (changes live via the admin API).",
            stats.max_num_batched_tokens,
        )
        yield gauge(
            names.GPU_MEMORY_UTILIZATION,
            "gpu_memory_utilization the engine started with (fraction of device memory).",
            self._gpu_memory_utilization,
        )
        info = GaugeMetricFamily(
            names.MODEL_INFO,
            "Always 1; the labels describe the served model and engine settings.",
            labels=[names.MODEL_NAME_LABEL, *self._model_info],
        )
        info.add_metric([self._model_name, *self._model_info.values()], 1)
        yield info
        yield counter(names.PREEMPTIONS, "Sequences preempted (KV freed, recomputed later).", stats.preemptions_total)
        yield counter(
            names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries_total
        )
        yield counter(
            names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits_total
        )
        yield counter(names.PROMPT_TOKENS, "Prompt tokens of admitted requests.", stats.prompt_tokens_total)
        yield counter(names.GENERATION_TOKENS, "Tokens generated.", stats.generation_tokens_total)
        yield counter(names.ENGINE_STEPS, "Engine steps that ran a forward pass.", stats.steps_total)
        yield counter(
            names.STEP_RUNNING_SEQS,
            "Running sequences summed over steps (divide by steps for the mean batch size).",
            stats.step_running_seqs_total,
        )
        if stats.step_cost is not None:
            yield from self._step_cost(stats.step_cost)
        if stats.spec_decode is not None:
            yield from self._spec_decode(stats, gauge, counter)

    def _step_cost(self, cost: StepCostSnapshot) -> Iterator[Metric]:
        """The engine's cost curve (engine/step_cost.py)."""
        sums = CounterMetricFamily(
            names.counter_base_name(names.STEP_COST_SUMS),
            "Sums over engine steps for a least-squares fit of step seconds on decode rows and prefill tokens "
            "(term: steps, rows, prefill, seconds, and their squares and products).",
            labels=[names.MODEL_NAME_LABEL, names.TERM_LABEL],
        )
        for term in names.STEP_COST_TERMS:
            sums.add_metric([self._model_name, term], cost.sums[term])
        yield sums
        durations = HistogramMetricFamily(
            names.STEP_DURATION,
            "Engine step durations by kind: decode (decode rows only) or prefill (carrying prefill tokens).",
            labels=[names.MODEL_NAME_LABEL, names.STEP_KIND_LABEL],
        )
        bounds = [str(b) for b in names.INTER_TOKEN_LATENCY_BUCKETS] + ["+Inf"]
        for kind in names.STEP_KINDS:
            cumulative = list(itertools.accumulate(cost.bucket_counts[kind]))
            durations.add_metric([self._model_name, kind], list(zip(bounds, cumulative)), cost.seconds[kind])
        yield durations

    def _spec_decode(self, stats: EngineStats, gauge: Callable, counter: Callable) -> Iterator[Metric]:
        """Speculative decoding, only when the engine runs it (vLLM's vllm:spec_decode_* counters)."""
        spec = stats.spec_decode
        yield gauge(
            names.SPEC_DECODE_NUM_SPECULATIVE_TOKENS,
            "Tokens proposed per sequence per step (changes live via the admin API; 0 = paused).",
            stats.num_speculative_tokens,
        )
        yield counter(
            names.SPEC_DECODE_NUM_DRAFTS, "Sequence-steps that verified at least one proposed token.", spec.num_drafts
        )
        yield counter(names.SPEC_DECODE_NUM_DRAFT_TOKENS, "Proposed tokens verified.", spec.num_draft_tokens)
        yield counter(
            names.SPEC_DECODE_NUM_ACCEPTED_TOKENS,
            "Proposed tokens the target model accepted.",
            spec.num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            names.counter_base_name(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS),
            "Accepted proposed tokens by position in the step's proposals (0 = first).",
            labels=[names.MODEL_NAME_LABEL, names.POSITION_LABEL],
        )
        for position, accepted in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([self._model_name, str(position)], accepted)
        yield per_pos
        yield gauge(
            names.SPEC_DECODE_ACCEPTANCE_RATE,
            "Accepted / verified proposed tokens since start (0-1; 0 before any verification).",
            spec.acceptance_rate or 0.0,
        )
        yield gauge(
            names.SPEC_DECODE_MEAN_ACCEPTANCE_LENGTH,
            "Tokens emitted per verifying step of a sequence since start: 1 + accepted / drafts (0 before any).",
            spec.mean_acceptance_length or 0.0,
        )


class ServerMetrics:
    """The server's registry; also the async engine's StepObserver (called on the engine thread)."""

    def __init__(
        self,
        *,
        model_name: str,
        stats: Callable[[], EngineStats],
        num_waiting: Callable[[], int],
        gpu_memory_utilization: float,
        model_info: dict[str, str],
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.registry.register(
            EngineStatsCollector(stats, num_waiting, model_name, gpu_memory_utilization, model_info)
        )
        label = [names.MODEL_NAME_LABEL]
        self.request_success = Counter(
            names.counter_base_name(names.REQUEST_SUCCESS),
            "Finished sequences by finish reason (stop, length, abort); n>1 counts each sequence.",
            labelnames=[names.MODEL_NAME_LABEL, names.FINISH_REASON_LABEL],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        self.requests_rejected = Counter(
            names.counter_base_name(names.REQUESTS_REJECTED),
            "Requests turned away at admission with 429, by reason: queue_full (--max-waiting-requests) or "
            "queue_wait (the predicted wait over --max-waiting-seconds).",
            labelnames=[names.MODEL_NAME_LABEL, names.REJECT_REASON_LABEL],
            registry=self.registry,
        )
        for reason in names.REJECT_REASONS:
            self.requests_rejected.labels(model_name, reason)
        def histogram(name: str, documentation: str, buckets: tuple[float, ...]):
            return Histogram(
                name, documentation, labelnames=label, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.time_to_first_token = histogram(
            names.TIME_TO_FIRST_TOKEN,
            "Seconds from arrival to the first generated token.",
            names.TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.inter_token_latency = histogram(
            names.INTER_TOKEN_LATENCY,
            "Seconds between consecutive tokens of a request (per token).",
            names.INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            names.TIME_PER_OUTPUT_TOKEN,
            "A finished request's seconds per output token after the first (its mean inter-token latency).",
            names.INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            names.E2E_REQUEST_LATENCY,
            "Seconds from arrival to the last token of a finished request.",
            names.REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            names.REQUEST_QUEUE_TIME,
            "Seconds from arrival until the request was first scheduled.",
            names.REQUEST_LATENCY_BUCKETS,
        )
        self.preemption_stall = histogram(
            names.PREEMPTION_STALL,
            "Seconds from a preempted request's last token to its next: its wait to be scheduled again.",
            names.REQUEST_LATENCY_BUCKETS,
        )
        self.lora_requests = Counter(
            names.counter_base_name(names.LORA_REQUESTS), "Finished requests that ran with a LoRA adapter, by adapter.",
            labelnames=[names.LORA_NAME_LABEL], registry=self.registry,
        )
        self.lora_generation_tokens = Counter(
            names.counter_base_name(names.LORA_GENERATION_TOKENS), "Tokens generated with a LoRA adapter, by adapter.",
            labelnames=[names.LORA_NAME_LABEL], registry=self.registry,
        )
        self._progress: dict[str, _Progress] = {}

    def forget_lora(self, name: str) -> None:
        """An unloaded adapter's series go, so the label set stays the adapters loaded."""
        for counter in (self.lora_requests, self.lora_generation_tokens):
            try:
                counter.remove(name)
            except KeyError:  # never used
                pass

    # ---- StepObserver (engine thread) -------------------------------------------

    def on_step(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            progress = self._progress.setdefault(output.request_id, _Progress())
            longest_before = max(progress.num_tokens.values(), default=0)
            for seq in output.outputs:  # deltas: the server asks for RequestOutputKind.DELTA
                progress.num_tokens[seq.index] = progress.num_tokens.get(seq.index, 0) + len(seq.token_ids)
                if seq.finish_reason is not None:
                    progress.finish_reasons[seq.index] = seq.finish_reason
            # A step's new tokens: how far the request's longest sequence grew.
            new_tokens = max(progress.num_tokens.values(), default=0) - longest_before
            lora = output.lora_request
            if lora is not None:
                self.lora_generation_tokens.labels(lora.lora_name).inc(sum(len(seq.token_ids) for seq in output.outputs))
                if output.finished:
                    self.lora_requests.labels(lora.lora_name).inc()
            if new_tokens > 0:
                if progress.last_token_time is None:
                    self._observe_first_token(output, now)
                elif output.metrics.num_preemptions > progress.num_preemptions:
                    self.preemption_stall.observe(now - progress.last_token_time)
                else:
                    per_token = (now - progress.last_token_time) / new_tokens
                    for _ in range(new_tokens):
                        self.inter_token_latency.observe(per_token)
                    progress.decode_seconds += now - progress.last_token_time
                    progress.decode_tokens += new_tokens
                progress.last_token_time = now
                progress.num_preemptions = output.metrics.num_preemptions
            if output.finished:
                del self._progress[output.request_id]
                metrics = output.metrics
                finished = metrics.finished_time if metrics.finished_time is not None else now
                self.e2e_request_latency.observe(max(finished - metrics.arrival_time, 0.0))
                if progress.decode_tokens > 0:
                    self.time_per_output_token.observe(progress.decode_seconds / progress.decode_tokens)
                # Counted when the whole request ends: one aborted later counts all its sequences as aborted.
                for reason in progress.finish_reasons.values():
                    self.request_success.labels(self.model_name, reason).inc()

    def on_abort(self, request_id: str, num_sequences: int) -> None:
        self._progress.pop(request_id, None)
        self.request_success.labels(self.model_name, "abort").inc(num_sequences)

    def on_reject(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def _observe_first_token(self, output: RequestOutput, now: float) -> None:
        metrics = output.metrics
        first_token = metrics.first_token_time if metrics.first_token_time is not None else now
        self.time_to_first_token.observe(max(first_token - metrics.arrival_time, 0.0))
        scheduled = metrics.first_scheduled_time if metrics.first_scheduled_time is not None else first_token
        self.request_queue_time.observe(max(scheduled - metrics.arrival_time, 0.0))
