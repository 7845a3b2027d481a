"""The tuner on synthetic windows of a simulated saturated engine, step by step: every window is
made of simulated engine steps (decode rows, prefill chunks, durations), summed as the engine
exports them, so the tuner sees what it sees in production — the step-cost sums, the steps' tails
and the request-level P99s — and each rule is checked against what it is for."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvpilot import engine_contract as names
from kvpilot.operator.engine_metrics import Observation
from kvpilot.operator.spec import EngineSettings, Slo, Tuning
from kvpilot.operator.tuner import Decision, TunerConfig, TuningHistory, tune


def tuning(slo: Slo = Slo(itl_p99_seconds=0.100), seqs: tuple[int, int] = (1, 256),
           memory: tuple[float, float] = (0.8, 0.95), tokens: tuple[int, int] | None = None) -> Tuning:
    extra = {} if tokens is None else {"max_num_batched_tokens": {"min": tokens[0], "max": tokens[1]}}
    return Tuning(slo=slo, max_num_seqs={"min": seqs[0], "max": seqs[1]},
                  gpu_memory_utilization={"min": memory[0], "max": memory[1]}, **extra)


TUNING = tuning()
SLO = TUNING.slo.itl_p99_seconds
INTERVAL = 30.0


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class SimulatedEngine:
    """A saturated engine: a step takes (a + b·rows + c·prefill tokens) × noise; a share of steps
    carries a prefill chunk of the prompt's length, capped by the step budget."""

    a: float = 0.040
    b: float = 0.0015
    power: float = 1.0  # a step's rows cost b·rows^power: below 1, concave (matmuls cheaper per row in a larger batch)
    c: float = 0.0001  # per prefill token
    convex_from: float = math.inf  # beyond this batch, steps grow quadratically
    convex: float = 0.0
    noise: float = 0.05  # per step
    prefill_share: float = 0.0  # of steps
    prompt_tokens: int = 64
    output_tokens: float | None = None  # set: a prompt joins as a sequence finishes (Poisson, rows / this a step)
    kv_seqs: int = 10_000
    arrival_limited_batch: float = math.inf  # traffic keeps at most this many running
    steps: int = 600  # simulated steps per window

    def batch(self, max_num_seqs: int) -> float:
        return min(max_num_seqs, self.kv_seqs, self.arrival_limited_batch)

    def step_seconds(self, rows: float, prefill: float) -> float:
        return (self.a + self.b * rows ** self.power + self.c * prefill
                + self.convex * max(0.0, rows - self.convex_from) ** 2)

    def window(self, params: EngineSettings, rng: random.Random, slowdown: float = 1.0,
               ramp: float = 0.0) -> Observation:
        """``ramp``: the share of the window's steps in which the batch fills up from one row, each
        of those steps prefilling the arrivals (the window after a raise of max_num_seqs)."""
        full = self.batch(params.max_num_seqs)
        budget = params.max_num_batched_tokens or 2048
        sums = dict.fromkeys(names.STEP_COST_TERMS, 0.0)
        decode, prefill, itl = [], [], []
        for step in range(self.steps):
            filled = step / (ramp * self.steps) if ramp else 1.0
            rows = full if filled >= 1.0 else 1.0 + (full - 1.0) * filled
            joins = (_poisson(rng, rows / self.output_tokens) if self.output_tokens
                     else int(rng.random() < self.prefill_share or filled < 1.0))
            chunk = min(joins * self.prompt_tokens, max(budget - rows, 0))
            t = self.step_seconds(rows, chunk) * slowdown * max(0.5, 1.0 + self.noise * rng.gauss(0.0, 1.0))
            for term, value in zip(names.STEP_COST_TERMS, (1, rows, chunk, t, rows * rows, rows * chunk,
                                                           chunk * chunk, rows * t, chunk * t, t * t)):
                sums[term] += value
            (prefill if chunk else decode).append(t)
            itl.append(t)  # every running row gets one token per step
        saturated = self.arrival_limited_batch > full
        seconds = sums["seconds"]
        tpot = _request_tpots(itl, sums["rows"])
        return Observation(
            window_seconds=INTERVAL, pods=1, output_tokens_per_second=sums["rows"] / seconds,
            prompt_tokens_per_second=sums["prefill"] / seconds, requests_per_second=1.0, requests_finished=30.0,
            itl_samples=sums["rows"], ttft_p50=0.2, ttft_p99=0.5, itl_p50=quantile(itl, 0.5),
            itl_p99=quantile(itl, 0.99), e2e_p50=5.0, e2e_p99=9.0, queue_time_p99=0.05,
            mean_running_per_pod=sums["rows"] / self.steps, running=full, running_now=full,
            waiting=8.0 if saturated else 0.0, waiting_now=8.0 if saturated else 0.0, kv_cache_usage=min(1.0, full / self.kv_seqs),
            kv_cache_blocks=1000.0, preemptions_per_second=0.0, prefix_cache_hit_rate=None,
            mean_output_tokens_per_request=100.0, max_num_seqs=params.max_num_seqs,
            max_num_batched_tokens=budget, gpu_memory_utilization=params.gpu_memory_utilization,
            ttft_queue_share=0.1, step_cost_sums=sums,
            decode_step_mean=sum(decode) / len(decode) if decode else None,
            decode_step_p99=quantile(decode, 0.99) if decode else None,
            prefill_step_p99=quantile(prefill, 0.99) if prefill else None,
            prefill_step_share=len(prefill) / self.steps,
            prefill_tokens_per_prefill_step=sums["prefill"] / len(prefill) if prefill else None,
            tpot_samples=len(tpot), tpot_p99=quantile(tpot, 0.99), tpot_p95=quantile(tpot, 0.95),
            itl_mean=sum(itl) / len(itl),
        )

    def expected(self, m: int, tokens: int = 2048) -> Observation:
        return self.window(EngineSettings(max_num_seqs=m, max_num_batched_tokens=tokens), random.Random(99))

    def oracle(self, within: Tuning) -> float:
        """The best throughput whose ITL (or TPOT) P99 meets the SLO, over every setting in the bounds."""
        kind, slo = within.slo.token_latency
        meeting = [obs.output_tokens_per_second for m in range(within.max_num_seqs.min, within.max_num_seqs.max + 1)
                   if (obs := self.expected(m)).token_latency_p99(kind) <= slo]
        return max(meeting)


def _request_tpots(steps: list[float], tokens: float) -> list[float]:
    """Requests' TPOT: each request of 16-160 tokens decodes over consecutive steps, one token a step,
    and its TPOT is their mean. Drawn from the window's own steps (its own generator, so the windows'
    steps stay as they were drawn before TPOT was simulated)."""
    rng = random.Random(len(steps) * 7919 + round(sum(steps) * 1e6))
    prefix = [0.0]
    for t in steps:
        prefix.append(prefix[-1] + t)
    tpots = []
    for _ in range(max(int(tokens / 88), 1)):
        length = min(rng.randint(16, 160), len(steps))
        start = rng.randrange(len(steps) - length + 1)
        tpots.append((prefix[start + length] - prefix[start]) / length)
    return tpots


def _poisson(rng: random.Random, mean: float) -> int:
    count, threshold, product = 0, math.exp(-mean), rng.random()
    while product > threshold:
        count, product = count + 1, product * rng.random()
    return count


def run(engine: SimulatedEngine, start: int, intervals: int = 12, seed: int = 0, within: Tuning = TUNING,
        tokens: int = 2048, slowdowns: list[float] | None = None, config: TunerConfig = TunerConfig(),
        first_ramp: float = 0.0, replicas_can_grow: bool = True):
    """The closed loop: (settings, reason, observation) per interval, and the final settings.
    ``first_ramp``: the share of the first window in which the batch fills up to the start."""
    rng = random.Random(seed)
    params = EngineSettings(max_num_seqs=start, gpu_memory_utilization=0.9, max_num_batched_tokens=tokens)
    history = TuningHistory()
    trace = []
    for i in range(intervals):
        obs = engine.window(params, rng, slowdowns[i] if slowdowns else 1.0, ramp=first_ramp if i == 0 else 0.0)
        decision = tune(obs, params, within, history, now=(i + 1) * INTERVAL, config=config,
                        replicas_can_grow=replicas_can_grow)
        trace.append((params, decision.reason, obs, decision))
        params, history = decision.settings, decision.history
    return trace, params


def seqs_of(trace, final) -> list[int]:
    return [p.max_num_seqs for p, *_ in trace] + [final.max_num_seqs]


def reversals(seqs: list[int]) -> int:
    moves = [b - a for a, b in zip(seqs, seqs[1:]) if b != a]
    return sum(1 for x, y in zip(moves, moves[1:]) if (x > 0) != (y > 0))


ENGINES = {
    "linear": SimulatedEngine(),
    # Gentle to ~30, then the steps' time explodes (vLLM's CPU numbers in issue 7 have this shape).
    "convex": SimulatedEngine(a=0.045, b=0.0012, convex_from=30, convex=0.0004),
}


@pytest.mark.parametrize("shape", sorted(ENGINES))
@pytest.mark.parametrize("start", [2, 256])
def test_reaches_ninety_percent_of_the_oracle_within_six_intervals_and_holds(shape, start):
    engine = ENGINES[shape]
    trace, final = run(engine, start)
    seqs = seqs_of(trace, final)
    oracle = engine.oracle(TUNING)

    def good(m: int) -> bool:
        obs = engine.expected(m)
        return obs.output_tokens_per_second >= 0.9 * oracle and obs.itl_p99 <= SLO

    reached = next((i for i in range(len(seqs)) if all(good(m) for m in seqs[i:])), None)
    assert reached is not None and reached <= 6, (seqs, [r for _, r, *_ in trace])
    assert reversals(seqs) <= 1, seqs


def test_a_decrease_from_the_top_meets_the_slo_by_the_second_interval():
    # The old tuner waited for the batch to drain a decrease: 9-11 intervals over the SLO from 256.
    engine = ENGINES["linear"]
    trace, final = run(engine, 256, intervals=3)
    assert engine.expected(trace[2][0].max_num_seqs).itl_p99 <= SLO, seqs_of(trace, final)


# A step's cost concave in the batch, as on a CPU (benchmarks/tuning.py run 20's sweep: ITL P99 86 ms at
# 2, 115 at 4, 174 at 16, 918 at 256): a line through large batches puts the intercept over the SLO.
CONCAVE = SimulatedEngine(a=0.040, b=0.0246, power=0.63)


@pytest.mark.parametrize("ramp", [0.0, 0.3, 0.5])
def test_a_line_fitted_at_the_top_does_not_call_the_slo_out_of_reach(ramp):
    # Run 20 from 256: the first window held the batch filling up, its fit read an intercept of
    # ~130 ms (over the 100 ms SLO) and the tuner kept 256 for the whole run, 930 ms over the SLO.
    trace, final = run(CONCAVE, 256, intervals=10, first_ramp=ramp)
    seqs = seqs_of(trace, final)
    assert CONCAVE.expected(final.max_num_seqs).itl_p99 <= SLO, (seqs, trace[-1][1])
    assert all(CONCAVE.expected(m).itl_p99 <= SLO for m in seqs[6:]), seqs
    assert reversals(seqs) <= 1, seqs
    assert "measuring max_num_seqs 256 → 64" in trace[0][1], trace[0][1]


# tuning.py's engine in bfloat16 on 2 AVX-512 cores (run 21's sweep: 21 ms at 2, 78 at 32, 490 at 256),
# prompts of 20 or 50 tokens joining as sequences of 88 tokens finish.
BFLOAT16_CPU = {prompt: SimulatedEngine(a=0.0075, b=0.0007, c=0.0005, output_tokens=88, prompt_tokens=prompt,
                                        noise=0.15, convex_from=128, convex=1.8e-5) for prompt in (20, 50)}


@pytest.mark.parametrize("ramp", [0.0, 0.5])
def test_prompts_joining_as_sequences_finish_are_not_a_tail_the_batch_cannot_cure(ramp):
    # benchmarks/tuning.py run 21 (bfloat16) from 256: 94% of the steps carried ~160 prefill tokens,
    # prompts that joined as sequences finished, and the tuner read a tail that no smaller batch cures
    # and kept 256 at 590 ms. Prompts join in proportion to the batch: at 32 a step carries one.
    engine = BFLOAT16_CPU[50]
    trace, final = run(engine, 256, intervals=10, first_ramp=ramp)
    seqs = seqs_of(trace, final)
    assert not any(d.slo_unreachable for *_, d in trace), [r for _, r, *_ in trace]
    assert all(engine.expected(m).itl_p99 <= SLO for m in seqs[6:]), seqs
    assert engine.expected(final.max_num_seqs).output_tokens_per_second >= 0.9 * engine.oracle(TUNING), seqs


# benchmarks/tuning.py run 24's first window from 256 (runs 2 and 3 held 256 for all 12 intervals on it):
# 92% of the steps carried ~73 prefill tokens; the decode steps alone ran 95 ms (P99 124 ms) at 256.
RUN_24_AT_256 = Observation(
    window_seconds=12.03, pods=1, output_tokens_per_second=1596.4, prompt_tokens_per_second=416.9,
    requests_per_second=13.89, requests_finished=167.0, itl_samples=19039.0, ttft_p50=30.0, ttft_p99=39.8,
    itl_p50=0.1506, itl_p99=0.5633, e2e_p50=36.46, e2e_p99=59.42, queue_time_p99=29.9, mean_running_per_pod=256.0,
    running=252.0, waiting=257.5, waiting_now=259.0, kv_cache_usage=0.0384, kv_cache_blocks=32768.0,
    preemptions_per_second=0.0, prefix_cache_hit_rate=0.0, mean_output_tokens_per_request=114.97, max_num_seqs=256,
    max_num_batched_tokens=512, gpu_memory_utilization=0.9, ttft_queue_share=0.9928,
    step_cost_sums={"steps": 75.0, "rows": 19039.0, "prefill": 5014.0, "seconds": 11.4924, "rows_rows": 4833261.0,
                    "rows_prefill": 1268300.0, "prefill_prefill": 504600.0, "rows_seconds": 2915.63,
                    "prefill_seconds": 836.061, "seconds_seconds": 2.04285},
    decode_step_mean=0.09496, decode_step_p99=0.12425, prefill_step_p99=0.5775, prefill_step_share=0.92,
    prefill_tokens_per_prefill_step=72.67, tpot_samples=167.0, tpot_p99=0.1991, tpot_p95=0.1954, itl_mean=0.1589,
    rejected_per_second=0.0, running_now=249.0)


def test_a_batch_whose_own_decode_steps_break_the_slo_is_measured_smaller_not_kept_for_its_prefill():
    # On a prior (one batch size: half the step taken as fixed cost) every setting, with a prompt's
    # chunk riding along, was predicted over the SLO, and the tuner blamed the chunks alone and kept 256
    # at 560-670 ms. The decode steps at 256 are over the target themselves: the batch is part of the
    # cause, and the windows are asked first (the sweep read 92 ms at 64, 29 ms at 2).
    settings = EngineSettings(max_num_seqs=256, gpu_memory_utilization=0.9)
    within = tuning(seqs=(2, 256))
    decision = tune(RUN_24_AT_256, settings, within, TuningHistory(), now=1000.0)
    assert decision.settings.max_num_seqs == 64 and not decision.slo_unreachable, decision.reason
    assert "measuring max_num_seqs 256 → 64" in decision.reason, decision.reason


WINDOWS = json.loads((Path(__file__).parent / "tuning_benchmark_windows.json").read_text())


def replay(windows: list[dict]) -> list[Decision]:
    """The tuner's decisions on a benchmark's recorded windows, each read at the setting it was recorded at."""
    settings, history, decisions = EngineSettings(max_num_seqs=windows[0]["max_num_seqs"],
                                                  gpu_memory_utilization=0.9), TuningHistory(), []
    for window in windows:
        assert settings.max_num_seqs == window["max_num_seqs"], [d.reason for d in decisions]
        decision = tune(Observation(**window["observation"]), settings, tuning(seqs=(2, 256)), history,
                        now=1000.0 + window["t"])
        decisions.append(decision)
        settings, history = decision.settings, decision.history
    return decisions


def test_no_climb_towards_a_setting_confirmed_over_the_slo_for_a_gain_within_the_noise():
    # Run 25 from 256, run 1: 64 read 111 ms and was cut to 45; 45 then read 80 ms twice and the tuner
    # climbed to 60 (134 ms), cut to 42, climbed to 55: three reversals, for at most the 8% more that 64
    # served (1,118 tok/s against 1,021-1,043 at 45).
    decisions = replay(WINDOWS["run_25_from_256_run_1"])
    assert [d.settings.max_num_seqs for d in decisions] == [64, 45, 45, 45, 45], [d.reason for d in decisions]
    assert "64, confirmed over it lately, served +" in decisions[-1].reason, decisions[-1].reason


def test_a_climb_back_towards_a_setting_confirmed_over_the_slo_goes_halfway():
    # Run 25 from 2, run 1: 64 read 116 and 133 ms and was cut to 30 (59 ms, 843 tok/s against 64's
    # 1,066: a gain worth measuring); the tuner climbed straight back to 63, which read 105-109 ms.
    decisions = replay(WINDOWS["run_25_from_2_run_1"])
    assert [d.settings.max_num_seqs for d in decisions][:6] == [4, 16, 64, 64, 30, 30], [d.reason for d in decisions]
    assert 30 < decisions[-1].settings.max_num_seqs <= math.sqrt(30 * 64), decisions[-1].reason


def test_two_windows_over_the_slo_overrule_a_prediction_that_keeps_the_setting():
    # Run 24 from 2, run 1: the first window at 62 read 137 ms against a predicted 270 (its prefill
    # chunks), the correction fell to x0.50, and the prediction kept 62 through two more windows over the
    # SLO (133, 123 ms); the sweeps read 92 ms at 64. The second window over cuts, halfway to where its
    # own point puts the SLO.
    decisions = replay(WINDOWS["run_24_from_2_run_1"])
    assert [d.settings.max_num_seqs for d in decisions][:4] == [4, 16, 62, 62], [d.reason for d in decisions]
    assert 27 < decisions[-1].settings.max_num_seqs < 62, decisions[-1].reason
    assert "is over the target" in decisions[-1].reason, decisions[-1].reason


def test_an_slo_called_out_of_reach_keeps_the_best_goodput_not_a_throughput_far_over_it():
    # Run 26 from 256, run 2: 64 read 94, 98 and then 107 ms; on a one-batch-size prior no setting was
    # predicted to meet the SLO, and the tuner kept 256, which had served 1.5x the tokens at 558 ms:
    # back and forth between 64 and 256 for the rest of the run, 8 intervals over the SLO.
    decisions = replay(WINDOWS["run_26_from_256_run_2"])
    assert [d.settings.max_num_seqs for d in decisions] == [64, 64, 64, 64], [d.reason for d in decisions]
    assert "keeping 64, the best goodput seen" in decisions[-1].reason, decisions[-1].reason


def test_a_window_over_the_slo_never_grows_on_a_prediction_alone():
    # tuning.py run 22: one decode step's 10x spike inflated the tail, the correction fell to its
    # bound x0.5 and the tuner grew 50 -> 63 from a window at 114 ms, over the 100 ms SLO.
    params = EngineSettings(max_num_seqs=48, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    window = SimulatedEngine().window(params, random.Random(0))
    assert window.itl_p99 > SLO
    optimistic = TunerConfig(correction_bounds=(0.5, 0.5))  # the prediction at half what the windows read
    decision = tune(window, params, TUNING, TuningHistory(), now=0.0, config=optimistic)
    assert decision.settings.max_num_seqs <= 48 and "over the SLO" in decision.reason, decision.reason


def test_a_window_meeting_the_slo_is_not_called_out_of_reach():
    # A prediction that puts every setting over the target errs where the window itself meets the SLO.
    params = EngineSettings(max_num_seqs=2, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    window = CONCAVE.window(params, random.Random(0))
    assert 0.085 < window.itl_p99 <= SLO
    decision = tune(window, params, tuning(seqs=(2, 256)), TuningHistory(), now=0.0, config=TunerConfig(margin=0.2))
    assert not decision.slo_unreachable and decision.settings.max_num_seqs == 2, decision.reason


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_noisy_node_does_not_make_it_hunt(seed):
    # Each window the machine runs up to 30% slower (run 18 of benchmarks/tuning.py: windows at one
    # setting read 75 to 122 ms). The old tuner reversed on every window across the SLO; this one
    # aims at the slowest recent speed and comes down only on evidence beyond the noise band.
    rng = random.Random(100 + seed)
    slowdowns = [1.0 + 0.3 * rng.random() for _ in range(40)]
    engine = ENGINES["linear"]
    trace, final = run(engine, 2, intervals=40, seed=seed, slowdowns=slowdowns)
    seqs = seqs_of(trace, final)
    assert reversals(seqs) <= 1, seqs
    over = sum(1 for _, _, obs, _ in trace[6:] if obs.itl_p99 > SLO)
    assert over <= 3, (seqs, [round(obs.itl_p99 * 1e3) for _, _, obs, _ in trace])
    # Against the noise-free oracle: a setting meeting the SLO in the slow windows gives ~75% of it.
    assert engine.expected(final.max_num_seqs).output_tokens_per_second >= 0.6 * engine.oracle(TUNING), seqs


def test_a_tail_from_prefill_chunks_lowers_the_step_budget_not_the_batch():
    # Decode steps at 24 take ~85 ms at their P99; one step in ten also carries a 1,500-token chunk.
    engine = SimulatedEngine(prefill_share=0.1, prompt_tokens=1500)
    within = tuning(tokens=(64, 2048))
    trace, final = run(engine, 24, intervals=8, within=within)
    assert final.max_num_seqs >= 24, [r for _, r, *_ in trace]
    assert final.max_num_batched_tokens < 2048
    assert "steps carrying prefill" in trace[0][1] and "max_num_batched_tokens 2048 →" in trace[0][1]
    assert engine.window(final, random.Random(5)).itl_p99 <= SLO, [r for _, r, *_ in trace]


def test_a_tail_from_prefill_without_budget_bounds_keeps_the_batch_and_says_so():
    engine = SimulatedEngine(prefill_share=0.1, prompt_tokens=1500)
    trace, final = run(engine, 24, intervals=6)
    assert final.max_num_seqs == 24, [r for _, r, *_ in trace]
    decision = trace[-1][3]
    assert decision.slo_unreachable and "a smaller batch does not cure" in decision.reason


def test_an_slo_no_setting_meets_keeps_the_best_throughput_instead_of_the_minimum():
    # The demo's walk in issue 27: 16 → 9 → 6 → ... → 2, a third of the throughput lost, ITL never met.
    engine = SimulatedEngine(a=0.30, b=0.004)  # 300 ms a step at any batch: over a 250 ms SLO
    within = tuning(Slo(itl_p99_seconds=0.25), seqs=(2, 64))
    trace, final = run(engine, 16, intervals=10, within=within)
    assert final.max_num_seqs >= 16, seqs_of(trace, final)
    assert all(d.slo_unreachable for *_, d in trace[1:]), trace[-1][1]
    assert "for the autoscaler's replicas to relieve" in trace[-1][1]


def test_a_cut_aims_at_the_slo_not_at_a_margin_widened_by_noise():
    # tuning_day.py run 17: the noisy phase's first window over (117 ms at 23) aimed at a 25% margin's 75 ms and
    # cut 28 to 12, which queued the phase; a cut too shallow is measured and taken further an interval later.
    engine = SimulatedEngine()
    trace, params = run(engine, 16, intervals=4)
    history = trace[-1][3].history
    history = replace(history, changes=(), samples=tuple(replace(s, correction=c) for s, c in
                                                         zip(history.samples, (0.7, 1.4, 0.8, 1.3))))
    params = params.replace(max_num_seqs=48)  # set by hand, say
    window = engine.window(params, random.Random(3))
    assert window.itl_p99 > 1.1 * SLO
    cut = tune(window, params, TUNING, history, now=5 * INTERVAL)
    assert "margin 25%" in cut.reason, cut.reason
    assert 0.085 <= engine.expected(cut.settings.max_num_seqs).itl_p99 <= SLO, cut.reason


def test_a_reversal_waits_for_a_second_window():
    engine = ENGINES["linear"]
    trace, final = run(engine, 8, intervals=3)
    grown = trace[1][0]
    assert grown.max_num_seqs > 8
    history = trace[1][3].history
    spike = engine.window(grown, random.Random(3), slowdown=1.6)
    held = tune(spike, grown, TUNING, history, now=100.0)
    assert held.settings.max_num_seqs == grown.max_num_seqs and "confirming" in held.reason, held.reason
    again = tune(engine.window(grown, random.Random(4), slowdown=1.6), grown, TUNING, held.history, now=130.0)
    assert again.settings.max_num_seqs < grown.max_num_seqs, again.reason


@pytest.mark.parametrize("start", [2, 256])
def test_respects_bounds(start):
    _, loose = run(SimulatedEngine(), start, within=tuning(Slo(itl_p99_seconds=10.0), seqs=(4, 48)))
    assert loose.max_num_seqs == 48
    trace, strict = run(SimulatedEngine(), start, within=tuning(Slo(itl_p99_seconds=0.001), seqs=(4, 48)))
    assert all(4 <= p.max_num_seqs <= 48 for p, *_ in trace[1:]) and 4 <= strict.max_num_seqs <= 48


def test_too_little_traffic_or_too_few_steps_is_not_judged():
    params = EngineSettings(max_num_seqs=16, gpu_memory_utilization=0.9)
    window = SimulatedEngine().window(params, random.Random(0))
    quiet = tune(replace(window, itl_samples=50.0, itl_p99=0.5), params, TUNING, TuningHistory(), now=0.0)
    assert not quiet.changed and "too little traffic" in quiet.reason and quiet.history.samples == ()
    few = dict(window.step_cost_sums, steps=20.0)
    short = tune(replace(window, step_cost_sums=few, itl_p99=0.5), params, TUNING, TuningHistory(), now=0.0)
    assert not short.changed and "too few engine steps" in short.reason
    assert not tune(None, params, TUNING, TuningHistory(), now=0.0).changed
    by_tpot = tuning(Slo(tpot_p99_seconds=0.1))
    unfinished = tune(replace(window, tpot_samples=5.0, tpot_p99=0.5), params, by_tpot, TuningHistory(), now=0.0)
    assert not unfinished.changed and "too few finished requests" in unfinished.reason


# One step in ten carries a 400-token prompt: the ITL P99 lies among those steps, ~220 ms at any batch,
# while a request's TPOT, the mean of its gaps, meets 100 ms up to 53 sequences.
SPIKY = SimulatedEngine(a=0.02, b=0.001, c=0.0004, prefill_share=0.1, prompt_tokens=400)


@pytest.mark.parametrize("start", [2, 256])
def test_a_tpot_slo_is_set_by_the_mean_step_not_by_prefill_spikes(start):
    # tuning_day.py's goodput counts requests by TPOT P99; an ITL SLO of the same figure is out of reach here
    # (the tuner caps the prefill chunks instead), while the TPOT one is met by a batch of ~50.
    within = tuning(Slo(tpot_p99_seconds=0.1), tokens=(64, 2048))
    trace, final = run(SPIKY, start, within=within)
    seqs = seqs_of(trace, final)
    assert all(SPIKY.expected(m).tpot_p99 <= 0.1 for m in seqs[4:]), (seqs, [r for _, r, *_ in trace])
    assert SPIKY.expected(final.max_num_seqs).output_tokens_per_second >= 0.8 * SPIKY.oracle(within), seqs
    assert reversals(seqs) <= 1, seqs
    # The chunk size spreads the same prefill tokens over steps: it does not move a request's mean gap.
    assert {p.max_num_batched_tokens for p, *_ in trace} | {final.max_num_batched_tokens} == {2048}
    assert "TPOT P99" in trace[-1][1] and "requests' tail" in trace[-1][1], trace[-1][1]
    _, by_itl = run(SPIKY, start, within=tuning(Slo(itl_p99_seconds=0.1), tokens=(64, 2048)))
    assert by_itl.max_num_batched_tokens < 2048


def test_a_window_whose_batch_filled_up_does_not_cut_the_batch_until_one_full_throughout_agrees():
    # tuning_day.py's third and fourth runs: the first window of a 2x burst ran 15 of 64 slots on average and
    # ended with all 64 running and a queue; the requests finishing in it had run in the long-prompt phase
    # before (TPOT 147 ms), and the tuner cut 64 to 16 for five intervals of the burst.
    within = tuning(Slo(tpot_p99_seconds=0.1))
    light = SimulatedEngine(arrival_limited_batch=8)
    trace, params = run(light, 64, intervals=4, within=within)
    assert params.max_num_seqs == 64, seqs_of(trace, params)
    history = trace[-1][3].history
    burst = replace(SimulatedEngine().window(params, random.Random(3), ramp=0.9), tpot_p99=0.147,
                    running_now=64.0, waiting=20.0, waiting_now=43.0)
    held = tune(burst, params, within, history, now=200.0)
    assert held.settings.max_num_seqs == 64 and "filled up during this window" in held.reason, held.reason
    # The same window with a batch that did not grow: a decrease, as before.
    steady = tune(replace(burst, running_now=burst.mean_running_per_pod), params, within, history, now=200.0)
    assert steady.settings.max_num_seqs < 64, steady.reason
    # Nor does a second window like it: windows longer than the interval overlap, and the second still
    # holds the fill (tuning_day.py run 21: 124-125 ms at a mean batch of 11, then 32, cut 64 to 15).
    again = tune(burst, params, within, held.history, now=210.0)
    assert again.settings.max_num_seqs == 64, again.reason
    # The window after them, its batch full throughout and its requests over the SLO: the new load is here
    # to stay, a decrease.
    full = replace(SimulatedEngine().window(params, random.Random(4)), tpot_p99=0.147)
    full = tune(full, params, within, again.history, now=220.0)
    assert full.settings.max_num_seqs < 64, full.reason


def test_a_cut_is_sized_by_the_window_not_by_tails_learned_under_the_traffic_before():
    # tuning_day.py run 5: over long prompts a short answer's TPOT is set by other prompts' chunks (the
    # requests' TPOT P99 ~1.8x the mean step); the chat burst after them read 124 ms at 64 with its own
    # tail of ~1.3-1.5, and the tail, level and correction learned before cut 64 to 16, where 32-64
    # served the burst best.
    within = tuning(Slo(tpot_p99_seconds=0.1))
    rag = SimulatedEngine(a=0.03, b=0.0008, c=0.00003, prefill_share=0.3, prompt_tokens=1000, arrival_limited_batch=4)
    burst = SimulatedEngine(a=0.03, b=0.0008, output_tokens=88, prompt_tokens=20)
    params = EngineSettings(max_num_seqs=64, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng = TuningHistory(), random.Random(5)
    for i in range(4):
        obs = rag.window(params, rng, slowdown=1.3)  # attention over 1,500 tokens: slower than the line
        obs = replace(obs, tpot_p99=1.65 * obs.step_cost_sums["seconds"] / obs.step_cost_sums["steps"])
        decision = tune(obs, params, within, history, now=(i + 1) * INTERVAL)
        assert decision.settings.max_num_seqs == 64, decision.reason
        history = decision.history
    window = burst.window(params, rng)
    mean_step = window.step_cost_sums["seconds"] / window.step_cost_sums["steps"]
    # ~1.5x its own mean step: over the SLO by 24%; overloaded (admission turns requests away), so the
    # tuner aims at the SLO with the least margin.
    window = replace(window, tpot_p99=0.124, rejected_per_second=5.0)
    assert 1.3 <= 0.124 / mean_step <= 1.7
    cut = tune(window, params, within, history, now=5 * INTERVAL)
    # Its own point carried along the line (steps ≈ 30 + 0.8·rows ms) meets the 95 ms target near 40.
    assert 32 <= cut.settings.max_num_seqs < 64, cut.reason
    assert burst.expected(cut.settings.max_num_seqs).tpot_p99 <= 0.1


def test_a_probe_goes_below_the_sequences_that_ran_or_not_at_all():
    # tuning_day.py run 6: over long prompts 1.1 sequences ran at 64 and read a TPOT P99 of 195 ms (other
    # prompts' chunks in a short answer's life); "only batch 3 has been measured" sent 64 to 16, which
    # held back nothing, and the chat burst after it started from 16. Run 7, with ÷4 of the sequences
    # that ran instead: 1.4 of them sent 64 to 1, and the burst came in at 1.
    within = tuning(Slo(tpot_p99_seconds=0.1))
    chat = SimulatedEngine(a=0.011, b=0.0012, arrival_limited_batch=3)
    rag = SimulatedEngine(a=0.011, b=0.0012, c=0.0015, prefill_share=0.05, prompt_tokens=1200,
                          arrival_limited_batch=1.4)
    params = EngineSettings(max_num_seqs=64, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng = TuningHistory(), random.Random(2)
    for i, engine in enumerate([chat, chat, rag, rag, rag]):
        obs = engine.window(params, rng)
        if engine is rag:
            obs = replace(obs, tpot_p99=0.195, tpot_samples=12)
        decision = tune(obs, params, within, history, now=(i + 1) * INTERVAL)
        assert decision.settings.max_num_seqs == 64, decision.reason
        history = decision.history
    assert "no maxNumSeqs" in decision.reason and decision.slo_unreachable, decision.reason
    # Where the batch is a dozen, the probe goes just below it: 64 → 9, the first setting that holds back a
    # fifth of the 12 that ran (not 16, which holds back none; nor ÷4 of them, 3, which on a noisy node in
    # run 10 queued the phase's requests past the TTFT SLO).
    heavy = SimulatedEngine(a=0.05, b=0.01, arrival_limited_batch=12)
    first = tune(heavy.window(params, rng), params, tuning(), TuningHistory(), now=INTERVAL)
    assert first.settings.max_num_seqs == 9, first.reason


def test_a_tpot_tail_from_arriving_prompts_prefill_keeps_the_batch_and_bars_nothing():
    # tuning_day.py run 17: at 29 over long prompts, a short answer decoding beside other prompts' 1,000-token
    # chunks read TPOT P99 122 ms at batch 3 (decode steps' P99 43-47 ms); the probe read the chat windows'
    # curve (56 ms at 5, 40 ms at 14) as "would meet it near 1": 29 -> 1, the burst after it began at 4, and
    # the window at 29 barred 29 and above through the burst ("confirmed over it lately").
    within = tuning(Slo(tpot_p99_seconds=0.1), seqs=(1, 128))
    cost = dict(a=0.018, b=0.0005, c=0.0003)
    params = EngineSettings(max_num_seqs=29, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng = TuningHistory(), random.Random(9)
    for i, running in enumerate([14, 5]):
        window = SimulatedEngine(**cost, arrival_limited_batch=running).window(params, rng)
        decision = tune(window, params, within, history, now=(i + 1) * INTERVAL)
        assert decision.settings == params, decision.reason
        history = decision.history
    rag = SimulatedEngine(**cost, prefill_share=0.05, prompt_tokens=1000, arrival_limited_batch=3)
    for i in range(2):
        window = replace(rag.window(params, rng), tpot_p99=0.122, tpot_samples=12)
        assert window.decode_step_p99 < 0.05
        decision = tune(window, params, within, history, now=(3 + i) * INTERVAL)
        assert decision.settings == params and decision.slo_unreachable, decision.reason
        assert "prefill" in decision.reason and not decision.history.samples[-1].violated, decision.reason
        history = decision.history
    # The burst after them: saturated at 29, well under the SLO: it grows.
    burst = SimulatedEngine(**cost, output_tokens=88, prompt_tokens=30)
    grown = tune(burst.window(params, rng), params, within, history, now=5 * INTERVAL)
    assert grown.settings.max_num_seqs > 29, grown.reason
    # Decode steps between the target and the SLO still meet it (run 19: P99 80 ms against a 75 ms target, and
    # the next window probed 36 -> 1).
    near = replace(rag.window(params, rng), tpot_p99=0.122, tpot_samples=12, decode_step_p99=0.098)
    assert tune(near, params, within, history, now=5 * INTERVAL).settings == params
    # Decode steps over the target are the batch's to cure: the same window with them slow cuts.
    slow = replace(rag.window(params, rng), tpot_p99=0.122, tpot_samples=12, decode_step_p99=0.110)
    assert tune(slow, params, within, history, now=5 * INTERVAL).settings.max_num_seqs < 29


def test_a_setting_too_small_for_a_window_to_judge_is_read_from_its_requests_gaps():
    # tuning_day.py run 18: cut to 1 over long prompts; at 1, with 2-6 prompts waiting, no window finished
    # enough requests (or tokens) to read a TPOT P99 from, and 1 held for 300 s through a burst.
    within = tuning(Slo(tpot_p99_seconds=0.1))
    engine = SimulatedEngine(a=0.05, b=0.002)  # saturated, ~20 sequences meet 100 ms
    trace, params = run(engine, 8, intervals=3, within=within)
    history = trace[-1][3].history
    params = params.replace(max_num_seqs=1)
    thin = replace(engine.window(params, random.Random(4)), itl_samples=80.0, tpot_samples=4.0, tpot_p99=0.2)
    grown = tune(thin, params, within, history, now=4 * INTERVAL)
    assert grown.settings.max_num_seqs > 1, grown.reason
    assert grown.history.samples[-1].lagging  # read from the gaps, not from requests: no lesson for the prediction
    # A thin window of a light load (no prompt waiting) is still too little to judge.
    light = replace(thin, waiting=0.0, waiting_now=0.0)
    assert tune(light, params, within, history, now=4 * INTERVAL).settings == params


def test_no_probe_below_a_setting_whose_windows_met_the_slo_at_a_larger_batch():
    # tuning_day.py run 19: 36 met the TPOT SLO at batch 5-7 over chat (TPOT P99 50 ms), then read 124 ms at
    # batch 2 over long prompts, on steps slower than the line (x1.4); the windows at 36 were read as a curve
    # that "fell as batch^0.00" and the probe went 36 -> 1, from which the burst after it climbed for 90 s.
    within = tuning(Slo(tpot_p99_seconds=0.1), seqs=(1, 128))
    params = EngineSettings(max_num_seqs=36, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng = TuningHistory(), random.Random(11)
    chat = SimulatedEngine(a=0.02, b=0.001, arrival_limited_batch=3)
    for i in range(3):
        decision = tune(replace(chat.window(params, rng), tpot_p99=0.05), params, within, history,
                        now=(i + 1) * INTERVAL)
        assert decision.settings == params, decision.reason
        history = decision.history
    rag = SimulatedEngine(a=0.02, b=0.001, c=0.0005, prefill_share=0.04, prompt_tokens=850, arrival_limited_batch=2)
    for i in range(2):
        slow = replace(rag.window(params, rng, slowdown=1.4), tpot_p99=0.124, decode_step_p99=0.11)
        decision = tune(slow, params, within, history, now=(4 + i) * INTERVAL)
        assert decision.settings == params and "measuring" not in decision.reason, decision.reason
        history = decision.history


def test_a_cut_that_lowered_nothing_is_not_taken_further():
    # tuning_day.py run 20: beside a CPU-bound neighbour 27 -> 19 -> 13 read TPOT P99 125, 125 and 124 ms while
    # the queue grew to 24: the cuts rested on a line fitted steep from the quiet windows before (batch 3) and
    # the neighbour's (batch 27), and the latency was the neighbour's share of every step, not the batch's.
    within = tuning(Slo(tpot_p99_seconds=0.1), seqs=(1, 128))
    params = EngineSettings(max_num_seqs=27, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng, now = TuningHistory(), random.Random(5), 0.0
    quiet, loaded = SimulatedEngine(a=0.02, b=0.0008, arrival_limited_batch=3), SimulatedEngine(a=0.02, b=0.0008)
    for _ in range(4):
        now += 10.0
        history = tune(quiet.window(params, rng), params, within, history, now=now).history
    seqs, reasons = [], []
    for _ in range(8):
        now += 10.0
        window = replace(loaded.window(params, rng, slowdown=2.6), tpot_p99=0.125, window_seconds=20.0)
        decision = tune(window, params, within, history, now=now)
        params, history = decision.settings, decision.history
        seqs.append(params.max_num_seqs)
        reasons.append(decision.reason)
    assert seqs[0] < 27 and seqs[-1] == seqs[0], (seqs, reasons)  # one cut, measured, and no further
    assert decision.slo_unreachable and "the batch does not set it" in decision.reason, decision.reason


def test_windows_after_a_cut_do_not_judge_the_new_setting_by_requests_that_ran_before_it():
    # tuning_day.py run 8: a 2x burst's 64 was cut to 15; the next window's requests had run at 63 (TPOT P99
    # 180 ms), which cut 15 to 5 and barred 15 for the rest of the burst, held at 14 at 50 ms. Run 9: the
    # second window after the cut still read 148 ms. The requests' decode span (e2e less TTFT) is ~8.5 s.
    within = tuning(Slo(tpot_p99_seconds=0.1))
    engine = SimulatedEngine(a=0.02, b=0.0015)
    trace, params = run(engine, 64, intervals=1, within=within)
    cut = trace[-1][3]
    assert params.max_num_seqs < 64 and engine.expected(params.max_num_seqs).tpot_p99 <= 0.1, cut.reason
    lagging = replace(engine.window(params, random.Random(4)), tpot_p99=0.180)
    held = tune(lagging, params, within, cut.history, now=INTERVAL + 10.0)
    assert held.settings == params and not held.history.samples[-1].violated, held.reason
    still = tune(replace(lagging, window_seconds=20.0), params, within, held.history, now=INTERVAL + 20.0)
    assert still.settings == params and not still.history.samples[-1].violated, still.reason
    after = tune(engine.window(params, random.Random(5)), params, within, still.history, now=INTERVAL + 60.0)
    assert after.settings.max_num_seqs >= params.max_num_seqs, after.reason
    # Under an ITL SLO every gap is timed as it happens: the same window is evidence at once.
    itl = tuning(Slo(itl_p99_seconds=0.1))
    lagging_itl = replace(lagging, itl_p99=0.180)
    assert tune(lagging_itl, params, itl, cut.history, now=INTERVAL + 10.0).settings.max_num_seqs < params.max_num_seqs


def test_headroom_without_a_queue_does_not_grow():
    trace, final = run(SimulatedEngine(arrival_limited_batch=10), 16, intervals=6)
    assert final.max_num_seqs == 16 and "not saturated" in trace[-1][1]


def test_below_saturation_max_num_seqs_waits_for_the_load_where_the_slo_allows():
    # tuning_day.py run 11: the chat and quiet phases left the default's 64 in place (they never fill it);
    # a 2x burst filled 64, and the cut to 16 and the climb back to 22-26, its best, took 70 s of 120.
    within = tuning(Slo(tpot_p99_seconds=0.1))
    cost = dict(a=0.02, b=0.0025)  # saturated, ~28 sequences meet 100 ms
    params = EngineSettings(max_num_seqs=64, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng, reasons = TuningHistory(), random.Random(6), []
    for i, running in enumerate([8, 12, 12]):
        decision = tune(SimulatedEngine(**cost, arrival_limited_batch=running).window(params, rng), params, within,
                        history, now=(i + 1) * INTERVAL)
        params, history = decision.settings, decision.history
        reasons.append(decision.reason)
    assert 18 <= params.max_num_seqs < 32 and any("ahead of the load" in r for r in reasons), reasons
    burst = SimulatedEngine(**cost)
    assert burst.expected(params.max_num_seqs).tpot_p99 <= 0.1
    # The load rises to fill it: the batch fills only as far as the SLO allows, with nothing to cut.
    risen = tune(burst.window(params, rng), params, within, history, now=4 * INTERVAL)
    assert risen.settings.max_num_seqs >= params.max_num_seqs, risen.reason
    # A batch of a few sequences says too little about a full one: the setting stays.
    few = tune(SimulatedEngine(**cost, arrival_limited_batch=3).window(params, rng), params, within, history,
               now=4 * INTERVAL)
    assert few.settings == params, few.reason
    # That decrease held nothing back, so it is no verdict on the settings above: a load whose steps turn out
    # cheaper climbs past it at once, with none of the caution that follows a cut (tuning_day.py run 12: a
    # burst held at 17 "for less than 25%" of gain, at TPOT P99 77-88 ms).
    cheaper = SimulatedEngine(a=0.018, b=0.00225)
    climbed = tune(cheaper.window(params, rng), params, within, history, now=4 * INTERVAL)
    assert climbed.settings.max_num_seqs > params.max_num_seqs, climbed.reason
    assert cheaper.expected(climbed.settings.max_num_seqs).tpot_p99 <= 0.1


def test_a_decrease_ahead_of_the_load_is_judged_by_the_first_window_the_load_fills():
    # tuning_day.py run 16: a quiet window set 58 -> 35 ahead of the load; the next phase, with a CPU-bound
    # neighbour, filled 35 and read 122-125 ms for 40 s, each window put down to the lag after a cut, though
    # the cut had held no sequence back: its requests ran at the batch they would have run at anyway.
    within = tuning(Slo(tpot_p99_seconds=0.1))
    cost = dict(a=0.02, b=0.0025)
    params = EngineSettings(max_num_seqs=64, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng = TuningHistory(), random.Random(6)
    for i, running in enumerate([8, 12, 12]):
        decision = tune(SimulatedEngine(**cost, arrival_limited_batch=running).window(params, rng), params, within,
                        history, now=(i + 1) * INTERVAL)
        params, history = decision.settings, decision.history
    ahead = history.last_change("maxNumSeqs")
    assert ahead is not None and "ahead of the load" in ahead.reason and params.max_num_seqs < 64
    slowed = SimulatedEngine(**cost).window(params, rng, slowdown=1.6)
    assert slowed.tpot_p99 > 0.11
    cut = tune(slowed, params, within, history, now=ahead.time + 10.0)
    assert cut.settings.max_num_seqs < params.max_num_seqs and cut.history.samples[-1].violated, cut.reason


def test_overloaded_growth_goes_as_far_as_the_windows_own_point_allows():
    # tuning_day.py run 12: through a 2x burst, requests turned away, the tuner held 17 for 80 s at TPOT P99
    # 77-88 ms: its prediction carried the machine's slowest recent speed (x1.12) and said 18-19; 25 read 99 ms.
    within = tuning(Slo(tpot_p99_seconds=0.1), seqs=(1, 16))
    engine = SimulatedEngine(a=0.02, b=0.0025)
    params = EngineSettings(max_num_seqs=8, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng = TuningHistory(), random.Random(8)
    for i, slowdown in enumerate([1.0, 1.0, 1.0, 1.3, 1.3]):  # a neighbour, then gone
        decision = tune(engine.window(params, rng, slowdown=slowdown), params, within, history, now=(i + 1) * INTERVAL)
        params, history = decision.settings, decision.history
    assert params.max_num_seqs == 16, decision.reason
    window, within = engine.window(params, rng), tuning(Slo(tpot_p99_seconds=0.1))
    calm = tune(window, params, within, history, now=6 * INTERVAL)
    overloaded = tune(replace(window, rejected_per_second=2.0), params, within, history, now=6 * INTERVAL)
    assert overloaded.settings.max_num_seqs > calm.settings.max_num_seqs > 16, (calm.reason, overloaded.reason)
    assert engine.expected(overloaded.settings.max_num_seqs).tpot_p99 <= 0.1
    # Right after the growth, the requests finishing ran mostly at 16: their TPOT under-reads the new setting
    # and is no ground to grow further (tuning_day.py run 13: 60 ms read at 16 right after 11 -> 16 sent it to
    # 29, which read 122 ms). A later window is.
    grown = overloaded.settings
    early = replace(engine.window(grown, rng), tpot_p99=0.061, rejected_per_second=2.0)
    held = tune(early, grown, within, overloaded.history, now=6 * INTERVAL + 10.0)
    assert held.settings == grown and "growing again after a later window" in held.reason, held.reason
    later = tune(early, grown, within, overloaded.history, now=6 * INTERVAL + 40.0)
    assert later.settings.max_num_seqs > grown.max_num_seqs, later.reason


def test_an_slo_out_of_reach_keeps_the_best_saturated_throughput_not_a_light_loads():
    # Below saturation the throughput is the load's: a light load's window at 64 is no reason to return to 64.
    within = tuning(Slo(itl_p99_seconds=0.25), seqs=(2, 64))
    params = EngineSettings(max_num_seqs=64, gpu_memory_utilization=0.9, max_num_batched_tokens=2048)
    history, rng = TuningHistory(), random.Random(7)
    slow = dict(a=0.30, b=0.004)  # 300 ms a step at any batch
    for i in range(3):
        history = tune(SimulatedEngine(**slow, arrival_limited_batch=12).window(params, rng), params, within, history,
                       now=(i + 1) * INTERVAL).history
    params = params.replace(max_num_seqs=20)
    decision = tune(SimulatedEngine(**slow, arrival_limited_batch=6).window(params, rng), params, within, history,
                    now=4 * INTERVAL)
    assert decision.slo_unreachable and decision.settings.max_num_seqs == 20, decision.reason
    # Nor is a saturated window at 64 a reason to raise a light load's setting: 64 would only let a backlog
    # run at once, each step slower (tuning_day.py run 21: beside the neighbour, 33 -> 62 at batch 17 ran 40).
    saturated = tune(SimulatedEngine(**slow).window(params.replace(max_num_seqs=64), rng),
                     params.replace(max_num_seqs=64), within, history, now=4 * INTERVAL)
    assert saturated.history.samples[-1].saturated
    decision = tune(SimulatedEngine(**slow, arrival_limited_batch=6).window(params, rng), params, within,
                    saturated.history, now=5 * INTERVAL)
    assert decision.slo_unreachable and decision.settings.max_num_seqs == 20, decision.reason


def test_violation_without_saturation_still_backs_off():
    engine = SimulatedEngine(a=0.05, b=0.01, arrival_limited_batch=12)  # 12 running → 170 ms
    trace, final = run(engine, 64, intervals=6)
    assert engine.window(final, random.Random(1)).itl_p99 <= SLO, seqs_of(trace, final)


def test_the_kv_cache_caps_growth():
    capped = SimulatedEngine(kv_seqs=20)  # the SLO alone allows ~36
    _, final = run(capped, 4, intervals=10)
    assert 16 <= final.max_num_seqs <= 20
    _, free = run(SimulatedEngine(), 4, intervals=10)
    assert free.max_num_seqs > 24  # the same load without the cap grows past it


def test_out_of_memory_lowers_memory_and_later_rises_short_of_the_fraction_that_failed():
    engine = SimulatedEngine()
    params = EngineSettings(max_num_seqs=32, gpu_memory_utilization=0.94)
    oom = tune(engine.window(params, random.Random(0)), params, TUNING, TuningHistory(), now=0.0, oom_kills=1)
    assert oom.settings.gpu_memory_utilization == pytest.approx(0.90) and oom.settings.max_num_seqs == 32
    assert "out of memory" in oom.reason and oom.history.oom_memory_ceiling == 0.94
    params, history, seen = oom.settings, oom.history, []
    for step in range(1, 12):
        preempting = replace(engine.window(params, random.Random(step)), preemptions_per_second=1.0)
        decision = tune(preempting, params, TUNING, history, now=step * 700.0)
        params, history = decision.settings, decision.history
        seen.append(params.gpu_memory_utilization)
    assert max(seen) > 0.90, seen  # preemptions raise it again ...
    assert max(seen) < 0.94, seen  # ... never back to the fraction that ran out of memory


def test_memory_at_its_lower_bound_backs_off_max_num_seqs_instead():
    params = EngineSettings(max_num_seqs=32, gpu_memory_utilization=0.8)
    decision = tune(None, params, TUNING, TuningHistory(), now=0.0, oom_kills=2)
    assert decision.settings.gpu_memory_utilization == 0.8 and decision.settings.max_num_seqs == 24


def test_persistent_preemption_raises_memory_once_per_cooldown():
    engine = SimulatedEngine()
    params, history, raised_at = EngineSettings(max_num_seqs=32, gpu_memory_utilization=0.86), TuningHistory(), []
    for step in range(30):  # 30 s apart: the 600 s cooldown passes once, after step 1
        window = replace(engine.window(params, random.Random(step)), preemptions_per_second=1.0)
        decision = tune(window, params, TUNING, history, now=step * INTERVAL)
        if decision.memory_changed:
            raised_at.append(step)
        params, history = decision.settings, decision.history
    assert raised_at == [1, 21], raised_at  # two windows of evidence; then once per cooldown
    assert params.gpu_memory_utilization == pytest.approx(0.90)


def test_the_token_budget_follows_max_num_seqs():
    engine = SimulatedEngine(b=0.0001)
    params = EngineSettings(max_num_seqs=128, gpu_memory_utilization=0.9, max_num_batched_tokens=128)
    decision = tune(engine.window(params, random.Random(0)), params, TUNING, TuningHistory(), now=0.0)
    assert decision.settings.max_num_seqs > 128
    assert decision.settings.max_num_batched_tokens >= decision.settings.max_num_seqs


def test_a_queue_the_step_budget_starves_raises_the_budget_and_it_is_not_lowered_back():
    # tuning_day.py's first run: the budget lowered to 64 for prefill spikes, then a 2x burst ran 38 of
    # 64 slots with 300 waiting, every step 38 decode rows + 26 prompt tokens, a TTFT P99 of 84 s.
    # Here: 16 of 24 slots running, every step 16 decode rows + 1,008 prompt tokens of a 1,024 budget.
    within = tuning(tokens=(64, 2048))
    params = EngineSettings(max_num_seqs=24, gpu_memory_utilization=0.9, max_num_batched_tokens=1024)
    engine = SimulatedEngine(prefill_share=1.0, prompt_tokens=1500, arrival_limited_batch=16)
    starved = replace(engine.window(params, random.Random(0)), waiting=300.0, waiting_now=300.0)
    raised = tune(starved, params, within, TuningHistory(), now=0.0)
    assert raised.settings.max_num_batched_tokens == 2048, raised.reason
    assert raised.settings.max_num_seqs == 24 and "admits prompts too slowly" in raised.reason, raised.reason
    # The same window without a queue: the budget is no one's bottleneck.
    idle = tune(replace(starved, waiting=0.0, waiting_now=0.0), params, within, TuningHistory(), now=0.0)
    assert idle.settings.max_num_batched_tokens == 1024, idle.reason
    # Later, prefill spikes would lower it (as in test_a_tail_from_prefill_chunks_lowers_the_step_budget_not_the_batch),
    # but not below the budget that relieved the queue, for ten minutes. (Only the floor is kept from the history,
    # so that every decision reads the same step cost.)
    spiky, at_2048 = SimulatedEngine(prefill_share=0.1, prompt_tokens=1500), raised.settings
    floor = replace(raised.history, samples=(), changes=())
    assert floor.budget_floor == 2048
    for now, history, lowered in ((30.0, floor, False), (700.0, floor, True), (30.0, TuningHistory(), True)):
        decision = tune(spiky.window(at_2048, random.Random(1)), at_2048, within, history, now=now)
        assert (decision.settings.max_num_batched_tokens < 2048) == lowered, (now, decision.reason)
    assert "starved the queue lately" in tune(spiky.window(at_2048, random.Random(1)), at_2048, within, floor,
                                              now=30.0).reason


def test_history_round_trips():
    trace, final = run(SimulatedEngine(), 4, intervals=5)
    history = trace[-1][3].history
    assert TuningHistory.from_dict(history.to_dict()) == history
    assert history.changes and history.changes[-1].new == final.max_num_seqs


def test_invalid_bounds_and_slo_name_the_field():
    with pytest.raises(ValueError, match="maxNumSeqs.min"):
        tuning(seqs=(10, 5))
    with pytest.raises(ValueError, match="maxNumBatchedTokens.min"):
        tuning(tokens=(512, 64))
    with pytest.raises(ValueError, match="gpuMemoryUtilization"):
        tuning(memory=(0.9, 1.2))
    with pytest.raises(ValueError, match="itlP99Seconds"):
        Slo(itlP99Seconds=0)


# --- the TTFT SLO -------------------------------------------------------------------------


@dataclass
class QueueingEngine(SimulatedEngine):
    """Arrivals beyond what any batch serves: requests wait ``queue_seconds`` for a slot, then
    prefill in ``prefill_steps`` steps. The TTFT is mostly queueing."""

    queue_seconds: float = 4.0
    prefill_steps: int = 4

    def window(self, params: EngineSettings, rng: random.Random, slowdown: float = 1.0,
               ramp: float = 0.0) -> Observation:
        obs = super().window(params, rng, slowdown, ramp)
        ttft = self.queue_seconds + self.prefill_steps * obs.itl_p50
        return replace(obs, ttft_p99=ttft, queue_time_p99=self.queue_seconds, ttft_queue_share=self.queue_seconds / ttft)


@dataclass
class SlowPrefillEngine(SimulatedEngine):
    """No queueing to speak of: the TTFT is the prefill, ``prefill_steps`` steps that slow with the batch."""

    prefill_steps: int = 8

    def ttft_p99(self, m: int) -> float:
        return self.prefill_steps * self.step_seconds(self.batch(m), 0) * 1.1

    def window(self, params: EngineSettings, rng: random.Random, slowdown: float = 1.0,
               ramp: float = 0.0) -> Observation:
        obs = super().window(params, rng, slowdown, ramp)
        return replace(obs, ttft_p99=self.ttft_p99(params.max_num_seqs), queue_time_p99=0.01, ttft_queue_share=0.02)


def test_overloaded_the_tuner_aims_at_the_slo_with_the_least_margin():
    # tuning_day.py's second run: the windows before a 2x burst (long prompts) read far from the
    # prediction, the margin widened to 25%, and the burst ran 23-33 sequences where 48 met the SLO,
    # while the queue every request sits in drained at the smaller batch's pace.
    within = tuning(Slo(ttft_p99_seconds=10.0, itl_p99_seconds=0.1))
    trace, params = run(SimulatedEngine(), 64, intervals=4, within=within)
    history = trace[-1][3].history
    history = replace(history, samples=tuple(replace(s, correction=c) for s, c in
                                             zip(history.samples, (0.7, 1.4, 0.8, 1.3))))  # another workload's
    decisions, params = {}, params.replace(max_num_seqs=20)  # ITL P99 ~80 ms
    # TTFT P99 ~1.2 s, ~30 s, and ~7 s with requests turned away (--max-waiting-seconds keeps the admitted
    # ones within the TTFT SLO): mostly queueing each time.
    for queue, rejected in ((1.0, 0.0), (30.0, 0.0), (7.0, 2.5)):
        window = replace(QueueingEngine(queue_seconds=queue).window(params, random.Random(7)),
                         rejected_per_second=rejected)
        decisions[queue] = tune(window, params, within, history, now=150.0)
    assert "margin 25%" in decisions[1.0].reason, decisions[1.0].reason
    for overloaded in (30.0, 7.0):
        assert "margin 5%" in decisions[overloaded].reason, decisions[overloaded].reason
        assert decisions[overloaded].settings.max_num_seqs > decisions[1.0].settings.max_num_seqs, \
            (decisions[1.0].reason, decisions[overloaded].reason)


def test_with_no_replica_to_come_a_queue_past_the_ttft_slo_judges_the_tpot_slo_at_p95():
    # tuning_day.py run 17: on a noisy node, one engine and no autoscaler, 12 held TPOT P99 86-90 ms with a
    # queue past the TTFT SLO (45% of the requests within both SLOs), where 32 read 107 ms and served 95%.
    within = tuning(Slo(tpot_p99_seconds=0.1, ttft_p99_seconds=10.0))
    engine = QueueingEngine(queue_seconds=30.0, noise=0.5)
    trace, held = run(engine, 16, intervals=10, within=within)
    trace_relaxed, relaxed = run(engine, 16, intervals=10, within=within, replicas_can_grow=False)
    seqs = (seqs_of(trace, held), seqs_of(trace_relaxed, relaxed))
    assert engine.expected(held.max_num_seqs).tpot_p99 <= 0.1, seqs
    assert relaxed.max_num_seqs > held.max_num_seqs, seqs
    at = engine.expected(relaxed.max_num_seqs)
    assert at.tpot_p95 <= 0.1 < at.tpot_p99, seqs
    assert "judged at P95" in trace_relaxed[-1][1], trace_relaxed[-1][1]
    # With the queue gone (the TTFT within its SLO) and the batch no longer saturated, the P99 again.
    light = SimulatedEngine(noise=0.5, arrival_limited_batch=relaxed.max_num_seqs / 2)
    calm = tune(light.window(relaxed, random.Random(1)), relaxed, within, trace_relaxed[-1][3].history,
                now=11 * INTERVAL, replicas_can_grow=False)
    assert "judged at P95" not in calm.reason, calm.reason


def test_a_ttft_made_of_queueing_does_not_grow_the_batch_without_an_itl_slo():
    trace, final = run(QueueingEngine(), 16, intervals=8, within=tuning(Slo(ttft_p99_seconds=2.0)))
    assert final.max_num_seqs == 16 and all(p.max_num_seqs == 16 for p, *_ in trace)
    assert all("queueing, which more replicas cure" in reason for _, reason, *_ in trace), trace[-1][1]


def test_a_ttft_made_of_queueing_grows_the_batch_only_within_the_itl_slo():
    engine = QueueingEngine()
    trace, final = run(engine, 8, intervals=12, within=tuning(Slo(ttft_p99_seconds=2.0, itl_p99_seconds=0.100)))
    seqs = seqs_of(trace, final)
    assert final.max_num_seqs > 16, seqs  # more throughput per replica while ITL has room
    assert engine.expected(final.max_num_seqs).itl_p99 <= SLO, seqs


@pytest.mark.parametrize("start", [2, 256])
def test_a_ttft_made_of_prefill_sets_the_batch_like_an_itl_slo(start):
    engine = SlowPrefillEngine()  # TTFT = 8 steps: about 48 sequences meet 1 s
    trace, final = run(engine, start, intervals=16, within=tuning(Slo(ttft_p99_seconds=1.0)))
    seqs = seqs_of(trace, final)
    best = max(m for m in range(1, 257) if engine.ttft_p99(m) <= 1.0)
    assert engine.ttft_p99(final.max_num_seqs) <= 1.0, (seqs, trace[-1][1])
    assert final.max_num_seqs >= 0.8 * best, seqs
    assert reversals(seqs[-8:]) == 0, seqs


@pytest.mark.slow
def test_the_fixed_load_goal_over_simulated_engines():
    """benchmarks/tuning.py's goal (90% of the oracle within 8 intervals, holding, at most one
    reversal) on five simulated engines, from 2 and from 256 (with and without the batch filling up
    in the first window), three seeds each: a scoreboard, printed, that a change must not lower.
    The concave engine's oracle sits 1 ms under the SLO, so it is met mostly by luck."""
    engines = {**ENGINES, "concave": CONCAVE, "bf16-20": BFLOAT16_CPU[20], "bf16-50": BFLOAT16_CPU[50]}
    met, board = 0, {}
    for name, engine in engines.items():
        oracle = engine.oracle(TUNING)

        def good(m: int) -> bool:
            obs = engine.expected(m)
            return obs.output_tokens_per_second >= 0.9 * oracle and obs.itl_p99 <= SLO

        marks = ""
        for start, ramp in [(2, 0.0), (256, 0.0), (256, 0.3), (256, 0.5)]:
            for seed in range(3):
                seqs = seqs_of(*run(engine, start, intervals=12, seed=seed, first_ramp=ramp))
                reached = next((i for i in range(len(seqs)) if all(good(m) for m in seqs[i:])), None)
                ok = reached is not None and reached <= 8 and reversals(seqs) <= 1
                met, marks = met + ok, marks + ("+" if ok else "-")
        board[name] = marks
    print("\n".join(f"{name:8} {marks}" for name, marks in board.items()), f"\nmet {met} of 60")
    # 30 of 60 before tuning.py runs 21 and 22; 45 until cuts stopped aiming at a margin widened by noise
    # (tuning_day.py run 17): the concave engine's one "+" was a cut to 1 and a climb back to 3, the oracle,
    # whose ITL P99 (99 ms) lies within the least margin; the cut now goes to 2 (87 ms) and holds there.
    assert met >= 44, board
