"""A day whose traffic changes: kvpilot's live tuner against the defaults and every fixed max_num_seqs.

The question a user asks before turning tuning on: over a day whose traffic changes, does live
tuning deliver more than the best ``max_num_seqs`` I could have fixed by hand, and more than the
defaults? This benchmark replays one such day against each answer.

Engine. Every system is a fresh ``kvpilot serve`` process (nothing cached from an earlier system
or repeat) serving the generated ``small`` preset on the CPU, on the same cores (unpinned, like
the load client that shares them), with the same deployment flags: ``--dtype`` (bfloat16 where
the CPU has AVX-512 BF16, else float32), ``--max-model-len 2048``, ``--kv-cache-memory`` (1 GiB:
the node's sizing, not a tuning knob), the admin API on, and ``--max-waiting-seconds`` when given
(admission by predicted wait, the same for every system). Only ``--max-num-seqs`` differs.

Capacity, calibrated once on a fresh server with the engine's defaults (as tuning.py calibrates: a
saturating load, figures from /metrics): 64 closed-loop chat clients, started over one
``--calibration-seconds`` window and measured over the next, give the prompt + output tokens/s
the engine computes (``kvpilot_step_cost_sums_total``: decode rows + prefill tokens), over a chat
request's mean prompt + output tokens, in chat requests/s; 16 clients of long prompts, the same
way, in RAG requests/s. Rates below are relative to these, so to the machine.

The day, generated once from ``--seed`` and replayed identically against every system and repeat
(arrival times, prompts, output lengths; EOS ignored, so every request asks for its full output),
five phases of ``--phase-intervals`` tuning intervals each (12 x 10 s by default):

1. chat: 8-48 random words, 16-160 output tokens, Poisson at 0.4x chat capacity (the capacity is
   what 64 serves saturated, with steps too slow for the SLO: this is a load for a middle setting);
2. RAG: 512-1,500 random token ids (an exact length, and no two prompts share a cached block),
   16-64 output tokens, Poisson at 0.4x RAG capacity: prefill chunks now sit in most steps;
3. burst: chat at 2x chat capacity;
4. quiet: chat at 0.15x chat capacity (it first drains what the burst left queued);
5. chat as in 1, on a noisy node: a Python busy loop pinned to the first core (a neighbour's
   CPU-bound job) for the whole phase. Phase 5 rather than 1, so that phase 1 is the same traffic
   on a quiet node and the two differ only in the neighbour.

SLO, fixed before the run and printed: TPOT P99 <= ``--tpot-ms`` (per request: time from its first
to its last token over its tokens - 1) and TTFT P99 <= ``--ttft-s``. The defaults, 200 ms and 10 s,
are what this kind of machine can meet with the small preset in float32. Measured here (AMD EPYC,
2 cores, AVX2; other jobs were sharing the cores, load average 3-4, so a quiet node is faster): a
chat request alone decodes at 30-40 ms a token, 4 together at about 80 ms, 8 at about 210 ms, 16
at 220-270 ms, 32 at about 420 ms and 64 at about 660 ms (the figures of tuning.py's quiet run on
another 2-core machine: ITL P99 about 100 ms at 4, 135 at 16, 275 at 64). So 200 ms is met by a
middle setting, not by the default 64, and leaves a setting for the noisy phase. A long prompt alone
takes 2.7 s (512 tokens) to 9.8 s (1,500) to its first token on the busy node: 10 s is what the
longest needs alone there, so what breaks it is queueing (a RAG phase served too few at a time,
the burst's growing queue) or prefill chunks that starve each other, not one prompt's own cost.

Systems, in an order rotated per repeat so that none always runs first or last:

- ``tuned``: the engine's defaults (a user who turns tuning on without choosing a start), with
  ``MetricsCollector`` and ``tuner.tune`` from ``kvpilot.operator`` run exactly as the operator
  runs them: every interval one scrape of /metrics, ingested into windows of two intervals, one
  decision, its live settings pushed through the admin endpoint by ``EngineClient``; after a
  change the windows restart at once and again after ``plan.settle_seconds``. The spec:
  ``Slo(tpot_p99_seconds=TPOT SLO, ttft_p99_seconds=TTFT SLO)``, the SLO the day is scored on
  (``--tuner-slo itl`` gives the tuner an ITL P99 of the same figure instead, stricter: what the
  first run did, before the spec had a TPOT SLO), ``maxNumSeqs`` 1..128 and ``maxNumBatchedTokens``
  64..2048; one engine and no autoscaler, so the tuner is told no replica can come
  (``replicas_can_grow=False``, as the operator tells it when autoscaling is off or at its maximum);
- ``default``: the engine's defaults (no ``--max-num-seqs``: 64);
- ``static-N``: each ``--static`` setting fixed for the whole day, so the best one in hindsight
  (the most goodput over the whole day, in the same repeat) is known.

Every system is scraped at the same moments (the tuner's), so observing costs each the same.

Scored per run, per phase over the requests that arrived in it and over the day: goodput (output
tokens/s of requests that completed within both SLOs), the share of requests within the SLO,
throughput (output tokens/s of completed requests; tokens counted from ``usage``), TPOT P99 and
TTFT P99 (of completed requests), preemptions (``kvpilot_preemptions_total``). A request turned
away (the bounded queue's 429) or still unfinished ``--drain`` seconds after the last arrival
counts as outside the SLO. For the tuner: its settings over time; per phase the intervals until
its ``max_num_seqs`` stays within 10% of the phase's last setting ("never" when it still moved in
the phase's last interval) and the reversals of direction. The goals: tuned goodput over the best
static's and over the defaults' (ratios per repeat), and >= 95% of requests within the SLO in
every phase after its first two intervals. Medians over ``--repeat`` runs with min-max; every run
is printed, and a miss like a hit. The load client shares the cores with the engine (as do other
processes on this machine): expect noise, and read the spread.

    python benchmarks/tuning_day.py --json /tmp/tuning-day.json --plot docs/tuning-day.png   # ~5 h on 2 cores
    python benchmarks/tuning_day.py --quick      # a smoke run, not a measurement
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from kvpilot import engine_contract as names
from kvpilot.operator import tuner
from kvpilot.operator.engine_client import EngineClient
from kvpilot.operator.engine_metrics import MetricsCollector, parse_snapshot
from kvpilot.operator.plan import settle_seconds
from kvpilot.operator.spec import EngineSettings, Tuning
from prometheus_client.parser import text_string_to_metric_families
from serving_common import WORDS, ServerProcess, cpu_description, free_port, generated_model, native_dtype

ADMIN_TOKEN = "benchmark-admin-token-0123456789abcdef"
SERVED_NAME = "small"
POD = "engine"  # the collector's key for the one engine
MAX_MODEL_LEN = 2048
CHAT_WORDS, CHAT_OUTPUT = (8, 48), (16, 160)
RAG_TOKENS, RAG_OUTPUT = (512, 1500), (16, 64)
TOKEN_IDS = (100, 8000)  # inside the small preset's vocabulary, clear of its special tokens
CALIBRATION_CLIENTS = {"chat": 64, "rag": 16}
SETTLE_BAND = 0.10  # a setting within this of the phase's last one has settled
GOAL_SHARE, GOAL_SKIP_INTERVALS = 0.95, 2
NEIGHBOUR = "import os\nos.sched_setaffinity(0, {%d})\nwhile True:\n    pass\n"


@dataclass(frozen=True)
class PhasePlan:
    name: str
    kind: str  # "chat" | "rag"
    load: float  # times the capacity for its kind
    noisy: bool = False


DAY = (
    PhasePlan("1 chat", "chat", 0.4),
    PhasePlan("2 rag", "rag", 0.4),
    PhasePlan("3 burst", "chat", 2.0),
    PhasePlan("4 quiet", "chat", 0.15),
    PhasePlan("5 chat+noisy", "chat", 0.4, noisy=True),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tpot-ms", type=float, default=200.0, help="TPOT P99 SLO, ms")
    parser.add_argument("--ttft-s", type=float, default=10.0, help="TTFT P99 SLO, seconds")
    parser.add_argument("--tuner-slo", choices=("tpot", "itl"), default="tpot",
                        help="the tuner's per-token SLO (at --tpot-ms): the day's own TPOT, or an ITL P99")
    parser.add_argument("--interval", type=float, default=10.0, help="tuning interval, seconds")
    parser.add_argument("--phase-intervals", type=int, default=12, help="tuning intervals per phase")
    parser.add_argument("--static", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64],
                        help="max_num_seqs settings each fixed for a whole day")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--drain", type=float, default=60.0,
                        help="seconds after the last arrival for outstanding requests; the rest miss the SLO")
    parser.add_argument("--calibration-seconds", type=float, default=60.0,
                        help="ramp, then window, of each capacity measurement")
    parser.add_argument("--max-waiting-seconds", type=float, default=None, metavar="SECONDS",
                        help="every system's --max-waiting-seconds (turn away what would wait longer to start); "
                             "default: none, a first-come-first-served queue of up to 1,024")
    parser.add_argument("--capacity", type=float, nargs=2, default=None, metavar=("CHAT", "RAG"),
                        help="requests/s of each kind from an earlier calibration on this machine, instead of "
                             "calibrating: the same trace as that run")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 with AVX-512 BF16, else float32")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="every system's KV cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write everything here")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of the tuned run against the best static")
    parser.add_argument("--quick", action="store_true", help="tiny phases, two static settings: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.interval, args.phase_intervals, args.static, args.repeat = 4.0, 3, [4, 16], 1
        args.drain, args.calibration_seconds = 10.0, 15.0
    elif args.phase_intervals < 12:
        print(f"warning: {args.phase_intervals} intervals a phase is fewer than the 12 the tuner is judged on")
    args.dtype = args.dtype or native_dtype()
    return args


# ------------------------------------------------------------------------------------------ the day


@dataclass(frozen=True)
class Phase:
    name: str
    kind: str
    start: float  # seconds from the day's start
    end: float
    rate: float  # requests per second
    noisy: bool


@dataclass(frozen=True)
class Request:
    at: float  # seconds from the day's start
    phase: int
    prompt: str | list[int]
    max_tokens: int

    @property
    def prompt_length(self) -> int:  # words of a chat prompt, tokens of a RAG prompt
        return len(self.prompt) if isinstance(self.prompt, list) else len(self.prompt.split())


def draw_prompt(rng: random.Random, kind: str) -> tuple[str | list[int], int]:
    if kind == "chat":
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*CHAT_WORDS))), rng.randint(*CHAT_OUTPUT)
    return [rng.randint(*TOKEN_IDS) for _ in range(rng.randint(*RAG_TOKENS))], rng.randint(*RAG_OUTPUT)


def make_day(capacity: dict[str, float], phase_seconds: float, seed: int) -> tuple[list[Phase], list[Request]]:
    rng = random.Random(f"{seed}/day")
    phases, trace = [], []
    for i, plan in enumerate(DAY):
        phase = Phase(plan.name, plan.kind, i * phase_seconds, (i + 1) * phase_seconds,
                      plan.load * capacity[plan.kind], plan.noisy)
        phases.append(phase)
        t = phase.start + rng.expovariate(phase.rate)
        while t < phase.end:
            trace.append(Request(t, i, *draw_prompt(rng, phase.kind)))
            t += rng.expovariate(phase.rate)
    return phases, trace


# -------------------------------------------------------------------------------------- the engines


def engine_server(model: Path, max_num_seqs: int | None, args: argparse.Namespace) -> tuple[ServerProcess, str]:
    """A fresh `kvpilot serve` and its admin API's base URL; ``max_num_seqs`` None: the engine's default."""
    port, admin_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "kvpilot", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME, "--device", "cpu", "--dtype", args.dtype,
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", args.kv_cache_memory,
        "--admin-token", ADMIN_TOKEN, "--admin-port", str(admin_port), "--log-level", "warning",
    ]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    if args.max_waiting_seconds is not None:
        command += ["--max-waiting-seconds", str(args.max_waiting_seconds)]
    name = f"day-mns{max_num_seqs or 'default'}"
    # Not from the repo root: `python -m` puts the cwd first on sys.path, where operator/ would
    # shadow the standard library's module.
    server = ServerProcess(name, command, port, env=dict(os.environ), cwd=tempfile.gettempdir())
    return server, f"http://127.0.0.1:{admin_port}"


def tuning_spec(args: argparse.Namespace) -> Tuning:
    return Tuning.model_validate({
        "slo": {f"{args.tuner_slo}_p99_seconds": args.tpot_ms / 1000, "ttft_p99_seconds": args.ttft_s},
        "max_num_seqs": {"min": 1, "max": 128},
        "max_num_batched_tokens": {"min": 64, "max": 2048},
    })


# -------------------------------------------------------------------------------------- the client


@dataclass
class Outcome:
    sent: float | None = None  # seconds from the day's start
    ttft: float | None = None
    tpot: float | None = None
    output_tokens: int = 0
    error: str | None = None

    def within(self, tpot_slo: float, ttft_slo: float) -> bool:
        return (self.error is None and self.ttft is not None and self.ttft <= ttft_slo
                and (self.tpot is None or self.tpot <= tpot_slo))


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: str | list[int], max_tokens: int,
                     outcome: Outcome, t0: float) -> None:
    """One streamed completion; TTFT from the send to the first text, TPOT between first and last."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    outcome.sent = sent - t0
    first = last = None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}"
                return
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if event.get("choices") and event["choices"][0].get("text"):
                    last = time.monotonic()
                    first = first or last
                if usage := event.get("usage"):
                    outcome.output_tokens = usage["completion_tokens"]
    except asyncio.CancelledError:
        outcome.error = "unfinished at the end of the drain"
        raise
    except Exception as exc:  # noqa: BLE001 - any client failure is a request outside the SLO
        outcome.error = type(exc).__name__
        return
    if first is None or outcome.output_tokens == 0:
        outcome.error = "no tokens"
        return
    outcome.ttft = first - sent
    outcome.tpot = (last - first) / (outcome.output_tokens - 1) if outcome.output_tokens > 1 else None


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))


async def closed_loop(url: str, kind: str, clients: int, ramp: float, seconds: float, rng: random.Random) -> None:
    """``clients`` clients, started evenly over ``ramp`` seconds (so their prompts do not all arrive in
    one step), each sending its next request of ``kind`` when the last ends, until ``seconds`` have passed."""
    async with session() as s:
        async def client(start: float) -> None:
            await asyncio.sleep(start)
            while True:
                prompt, max_tokens = draw_prompt(rng, kind)
                await stream_one(s, url, prompt, max_tokens, Outcome(), time.monotonic())

        tasks = [asyncio.create_task(client(i * ramp / clients)) for i in range(clients)]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def scrape(url: str) -> str:
    text = EngineClient().scrape({POD: url})[POD]
    if isinstance(text, Exception):
        raise RuntimeError(f"cannot scrape {url}: {text}")
    return text


def tokens_computed(text: str) -> float:
    """Tokens the engine has computed: decode rows plus prefill tokens over its steps (a long prompt
    counts chunk by chunk as it is computed, not all at its first token)."""
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == names.STEP_COST_SUMS and sample.labels.get(names.TERM_LABEL) in ("rows", "prefill"))


async def chat_prompt_tokens(url: str, rng: random.Random, count: int = 16) -> float:
    """The mean chat prompt in tokens: one completion of ``count`` prompts, one token each, read from ``usage``."""
    body = {"model": SERVED_NAME, "prompt": [draw_prompt(rng, "chat")[0] for _ in range(count)], "max_tokens": 1}
    async with session() as s, s.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"calibration: HTTP {response.status}: {await response.text()}")
        return (await response.json())["usage"]["prompt_tokens"] / count


async def calibrate(url: str, seconds: float, seed: int) -> dict[str, float]:
    """Requests/s of each kind that the engine's defaults serve under a saturating closed loop.

    The clients ramp up over ``seconds``, then a window of ``seconds`` is measured: the tokens the
    engine computed per second (prompt and output), over a request's mean prompt and output. Counting
    both keeps the figure from depending on how far the window is from a steady mix (all prefill at
    first, then mostly decode, then both)."""
    rng, capacity = random.Random(f"{seed}/calibration"), {}
    mean_tokens = {"chat": await chat_prompt_tokens(url, rng) + sum(CHAT_OUTPUT) / 2,
                   "rag": (sum(RAG_TOKENS) + sum(RAG_OUTPUT)) / 2}
    for kind, clients in CALIBRATION_CLIENTS.items():
        load = asyncio.create_task(closed_loop(url, kind, clients, seconds, 2 * seconds, rng))
        await asyncio.sleep(seconds)
        before, began = tokens_computed(await asyncio.to_thread(scrape, url)), time.monotonic()
        await asyncio.sleep(seconds)
        after, elapsed = tokens_computed(await asyncio.to_thread(scrape, url)), time.monotonic() - began
        await load
        tokens = after - before
        if tokens <= 0:
            raise SystemExit(f"calibration: no {kind} request got a token in {elapsed:.0f} s: "
                             "give a longer --calibration-seconds")
        capacity[kind] = tokens / elapsed / mean_tokens[kind]
        print(f"  {kind}: {tokens / elapsed:.0f} prompt + output tok/s computed with {clients} clients, "
              f"{mean_tokens[kind]:.0f} tokens a request: {capacity[kind]:.2f} req/s", flush=True)
    return capacity


async def replay(url: str, trace: list[Request], day_end: float, drain: float, t0: float) -> list[Outcome]:
    """Open loop: every request at its arrival time, whatever is outstanding."""
    outcomes = [Outcome() for _ in trace]
    async with session() as s:
        tasks = []
        for request, outcome in zip(trace, outcomes):
            await asyncio.sleep(max(0.0, t0 + request.at - time.monotonic()))
            tasks.append(asyncio.create_task(stream_one(s, url, request.prompt, request.max_tokens, outcome, t0)))
        await asyncio.sleep(max(0.0, t0 + day_end - time.monotonic()))
        _, pending = await asyncio.wait(tasks, timeout=drain) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for outcome in outcomes:
        if outcome.error is None and outcome.ttft is None:  # cancelled before it began
            outcome.error = "unfinished at the end of the drain"
    return outcomes


async def neighbour(phases: list[Phase], t0: float) -> None:
    """A CPU-bound process pinned to the first core during the noisy phases."""
    core = min(os.sched_getaffinity(0))
    for phase in (p for p in phases if p.noisy):
        await asyncio.sleep(max(0.0, t0 + phase.start - time.monotonic()))
        process = subprocess.Popen([sys.executable, "-c", NEIGHBOUR % core])
        try:
            await asyncio.sleep(max(0.0, t0 + phase.end - time.monotonic()))
        finally:
            process.kill()
            process.wait()


def live_settings(settings: EngineSettings) -> tuple:
    """What the engine takes through its admin API."""
    return tuple(getattr(settings, name) for name in names.LIVE_SETTINGS)


@dataclass
class Tick:
    t: float  # seconds from the day's start
    max_num_seqs: int | None  # in effect after this tick (the tuner's decision, or the engine's gauge)
    max_num_batched_tokens: int | None
    running: float | None
    waiting: float | None
    preemptions: float | None  # kvpilot_preemptions_total at the scrape
    reason: str = ""
    observation: dict | None = None  # the window the tuner read, to replay its decisions offline


async def watch(url: str, admin: str, ticks: int, interval: float, t0: float, tuning: Tuning | None) -> list[Tick]:
    """Scrapes every interval; with ``tuning``, the operator's loop: ingest, tune, push, restart windows."""
    client, collector = EngineClient(), MetricsCollector(window_seconds=2 * interval)
    settings, history, trace = None, tuner.TuningHistory(), []
    for k in range(ticks + 1):
        await asyncio.sleep(max(0.0, t0 + k * interval - time.monotonic()))
        texts = await asyncio.to_thread(client.scrape, {POD: url})
        now = time.time()
        metrics = collector.ingest(texts, now)
        gauges, count = {}, {}
        if isinstance(texts[POD], str):
            snapshot = parse_snapshot(texts[POD], now)
            gauges, count = snapshot.gauges, snapshot.counters
        seqs = int(gauges[names.MAX_NUM_SEQS]) if names.MAX_NUM_SEQS in gauges else None
        tokens = int(gauges[names.MAX_NUM_BATCHED_TOKENS]) if names.MAX_NUM_BATCHED_TOKENS in gauges else None
        reason, changed = "", False
        if tuning is not None:
            if settings is None:  # a user who turns tuning on over the engine's defaults
                settings = EngineSettings(max_num_seqs=seqs, gpu_memory_utilization=0.9, max_num_batched_tokens=(
                    tokens if getattr(tuning, "max_num_batched_tokens", None) is not None else None))
            elif k > 0:
                decision = tuner.tune(metrics.service, settings, tuning, history, now, replicas_can_grow=False)
                changed = live_settings(decision.settings) != live_settings(settings)
                if changed:
                    failed = await asyncio.to_thread(client.set_scheduler_limits, {POD: admin}, decision.settings,
                                                     ADMIN_TOKEN)
                    if failed:
                        raise RuntimeError(f"the engine did not take {decision.settings}: {failed[POD]}")
                    collector.restart_windows(expect_max_num_seqs=decision.settings.max_num_seqs)
                settings, history, reason = decision.settings, decision.history, decision.reason
            seqs, tokens = settings.max_num_seqs, settings.max_num_batched_tokens or tokens
        observed = asdict(metrics.service) if tuning is not None and metrics.service is not None else None
        trace.append(Tick(time.monotonic() - t0, seqs, tokens, gauges.get(names.REQUESTS_RUNNING),
                          gauges.get(names.REQUESTS_WAITING), count.get(names.PREEMPTIONS), reason, observed))
        if changed:  # as the operator: the next window starts after the admission burst
            await asyncio.sleep(settle_seconds(interval))
            collector.ingest(await asyncio.to_thread(client.scrape, {POD: url}), time.time())
            collector.restart_windows(expect_max_num_seqs=settings.max_num_seqs)
    return trace


async def warm_up(url: str, seed: int) -> None:
    """First forwards are slow (allocator, caches): two chat requests and one long prompt, not scored."""
    rng = random.Random(f"{seed}/warmup")
    async with session() as s:
        await asyncio.gather(*(stream_one(s, url, draw_prompt(rng, kind)[0], 16, Outcome(), time.monotonic())
                               for kind in ("chat", "chat", "rag")))


async def run_day(url: str, admin: str, phases: list[Phase], trace: list[Request], args: argparse.Namespace,
                  tuning: Tuning | None) -> tuple[list[Outcome], list[Tick], float]:
    await warm_up(url, args.seed)
    t0 = time.monotonic() + 1.0
    ticks = round(phases[-1].end / args.interval)
    outcomes, watched, _ = await asyncio.gather(
        replay(url, trace, phases[-1].end, args.drain, t0),
        watch(url, admin, ticks, args.interval, t0, tuning),
        neighbour(phases, t0))
    final = parse_snapshot(scrape(url), time.time()).counters.get(names.PREEMPTIONS)  # after the drain
    return outcomes, watched, final


# ------------------------------------------------------------------------------------------ scoring


@dataclass
class Stats:
    requests: int
    completed: int
    within_slo: float | None  # share of the requests
    goodput: float  # output tok/s of requests within both SLOs
    throughput: float  # output tok/s of completed requests
    tpot_p99: float | None
    ttft_p99: float | None
    preemptions: float | None


def p99(values: list[float]) -> float | None:
    values = sorted(values)
    return values[min(len(values) - 1, round(0.99 * (len(values) - 1)))] if values else None


def share_within(outcomes: list[Outcome], slo: tuple[float, float]) -> float | None:
    return sum(o.within(*slo) for o in outcomes) / len(outcomes) if outcomes else None


def stats(outcomes: list[Outcome], seconds: float, slo: tuple[float, float], preemptions: float | None) -> Stats:
    done = [o for o in outcomes if o.error is None]
    within = [o for o in done if o.within(*slo)]
    return Stats(len(outcomes), len(done), share_within(outcomes, slo),
                 sum(o.output_tokens for o in within) / seconds, sum(o.output_tokens for o in done) / seconds,
                 p99([o.tpot for o in done if o.tpot is not None]), p99([o.ttft for o in done if o.ttft is not None]),
                 preemptions)


def settle_and_reversals(settings: list[int]) -> tuple[int | None, int]:
    """Intervals until the setting stays within SETTLE_BAND of the phase's last (None: still moving at
    the end), and the changes of direction."""
    last, settled = settings[-1], len(settings) - 1
    while settled > 0 and abs(settings[settled - 1] - last) <= SETTLE_BAND * last:
        settled -= 1
    moves = [b - a for a, b in zip(settings, settings[1:]) if b != a]
    reversals = sum(1 for x, y in zip(moves, moves[1:]) if (x > 0) != (y > 0))
    return (None if settled == len(settings) - 1 and len(settings) > 1 else settled), reversals


@dataclass
class Run:
    system: str
    repeat: int
    phases: list[Stats]
    day: Stats
    goal_shares: list[float | None]  # within the SLO after each phase's first GOAL_SKIP_INTERVALS
    settle: list[int | None]
    reversals: list[int]
    ticks: list[Tick]
    errors: dict[str, int]
    outcomes: list[Outcome] = field(repr=False)


def score(system: str, repeat: int, phases: list[Phase], trace: list[Request], outcomes: list[Outcome],
          ticks: list[Tick], final_preemptions: float | None, args: argparse.Namespace) -> Run:
    slo = (args.tpot_ms / 1000, args.ttft_s)
    per_phase, goal, settle, reversals = [], [], [], []
    for i, phase in enumerate(phases):
        arrived = [(r, o) for r, o in zip(trace, outcomes) if r.phase == i]
        mine = [o for _, o in arrived]
        late = [o for r, o in arrived if r.at >= phase.start + GOAL_SKIP_INTERVALS * args.interval]
        first, last = i * args.phase_intervals, (i + 1) * args.phase_intervals
        pre = [ticks[j].preemptions for j in (first, last) if j < len(ticks)]
        per_phase.append(stats(mine, phase.end - phase.start, slo,
                               pre[1] - pre[0] if len(pre) == 2 and None not in pre else None))
        goal.append(share_within(late, slo))
        in_phase = [t.max_num_seqs for t in ticks[first:last] if t.max_num_seqs is not None]
        s, r = settle_and_reversals(in_phase) if in_phase else (None, 0)
        settle.append(s)
        reversals.append(r)
    start = ticks[0].preemptions if ticks else None
    day = stats(outcomes, phases[-1].end, slo,
                final_preemptions - start if None not in (start, final_preemptions) else None)
    errors = dict(Counter(o.error for o in outcomes if o.error is not None))
    return Run(system, repeat, per_phase, day, goal, settle, reversals, ticks, errors, outcomes)


# ---------------------------------------------------------------------------------------- reporting


def ms(value: float | None) -> str:
    return "   n/a" if value is None else f"{value * 1000:6.0f}"


def sec(value: float | None) -> str:
    return "  n/a" if value is None else f"{value:5.1f}"


def share(value: float | None) -> str:
    return " n/a" if value is None else f"{value:4.0%}"


def stats_line(label: str, s: Stats) -> str:
    pre = "n/a" if s.preemptions is None else f"{s.preemptions:.0f}"
    return (f"    {label:13s} goodput {s.goodput:6.1f} tok/s, within SLO {share(s.within_slo)}, throughput "
            f"{s.throughput:6.1f} tok/s, TPOT P99 {ms(s.tpot_p99)} ms, TTFT P99 {sec(s.ttft_p99)} s, "
            f"preemptions {pre}, {s.completed}/{s.requests} completed")


def print_run(run: Run, phases: list[Phase]) -> None:
    print(f"  {run.system}, repeat {run.repeat}:")
    for phase, s in zip(phases, run.phases):
        print(stats_line(phase.name, s))
    print(stats_line("day", run.day))
    if run.errors:
        print(f"    not completed: {run.errors}")
    if run.system == "tuned":
        setting = [(t.max_num_seqs, t.max_num_batched_tokens) for t in run.ticks]
        moves = [f"{seqs}/{tokens}@{t.t:.0f}s" for i, (t, (seqs, tokens)) in enumerate(zip(run.ticks, setting))
                 if i == 0 or setting[i - 1] != (seqs, tokens)]
        print(f"    max_num_seqs/max_num_batched_tokens over time: {' -> '.join(moves)}")
        for phase, settled, reversals, goal in zip(phases, run.settle, run.reversals, run.goal_shares):
            print(f"    {phase.name:13s} settled after {'never' if settled is None else settled} intervals, "
                  f"{reversals} reversals; within SLO after its first {GOAL_SKIP_INTERVALS} intervals "
                  f"{share(goal)}: {'MET' if goal is not None and goal >= GOAL_SHARE else 'missed'}")
        for t in run.ticks:
            print(f"      t={t.t:5.0f}s max_num_seqs {t.max_num_seqs}, running {t.running}, waiting {t.waiting} "
                  f"| {t.reason}")
    print(flush=True)


def spread(values: list[float | None], fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def ratios(runs: list[Run], phases: list[Phase]) -> dict:
    """Per repeat: tuned over the best static and over the defaults; and what switching among the fixed
    settings measured (the defaults' 64 included) at each phase's start, picking each phase's best in
    hindsight, makes over the best one of them for the whole day (``per_phase_best_over_best_fixed``):
    how much this trace rewards moving between those settings at all. A setting between them, or
    moves within a phase, can do better."""
    out = {"tuned_over_best_static": [], "best_static": [], "tuned_over_default": [],
           "per_phase_best_over_best_fixed": [], "per_phase_best": []}
    for repeat in sorted({r.repeat for r in runs}):
        mine = {r.system: r for r in runs if r.repeat == repeat}
        statics = [r for name, r in mine.items() if name.startswith("static-")]
        best = max(statics, key=lambda r: r.day.goodput, default=None)
        tuned, default = mine.get("tuned"), mine.get("default")
        fixed = [r for name, r in mine.items() if name != "tuned"]
        if len(fixed) > 1:
            picks = [max(fixed, key=lambda r: r.phases[i].goodput) for i in range(len(phases))]
            switching = sum(r.phases[i].goodput * (p.end - p.start)
                            for i, (r, p) in enumerate(zip(picks, phases))) / phases[-1].end
            best_fixed = max(r.day.goodput for r in fixed)
            out["per_phase_best"].append([r.system for r in picks])
            out["per_phase_best_over_best_fixed"].append(round(switching / best_fixed, 3) if best_fixed else None)
        if tuned is None:
            continue
        out["best_static"].append(best.system if best else None)
        for key, other in (("tuned_over_best_static", best), ("tuned_over_default", default)):
            out[key].append(round(tuned.day.goodput / other.day.goodput, 3) if other and other.day.goodput else None)
    return out


def report(runs: list[Run], phases: list[Phase], systems: list[str]) -> dict:
    print("results (median [min-max] over repeats)")
    for index, label in [(i, p.name) for i, p in enumerate(phases)] + [(None, "day")]:
        print(f"  {label}:")
        for system in systems:
            picked = [r.day if index is None else r.phases[index] for r in runs if r.system == system]

            def of(name: str, fmt: str, scale: float = 1.0) -> str:
                values = [getattr(s, name) for s in picked]
                return spread([None if v is None else v * scale for v in values], fmt)

            print(f"    {system:10s} goodput {of('goodput', '.1f')} tok/s, within SLO {of('within_slo', '.0%')}, "
                  f"throughput {of('throughput', '.1f')}, TPOT P99 {of('tpot_p99', '.0f', 1000)} ms, "
                  f"TTFT P99 {of('ttft_p99', '.1f')} s, preemptions {of('preemptions', '.0f')}")
    found = ratios(runs, phases)
    print(f"  tuned goodput / best static's (chosen over the day, same repeat; {found['best_static']}): "
          f"{spread(found['tuned_over_best_static'], '.2f')}, per repeat {found['tuned_over_best_static']}")
    print(f"  tuned goodput / the defaults': {spread(found['tuned_over_default'], '.2f')}, "
          f"per repeat {found['tuned_over_default']}")
    print(f"  each phase's best of the fixed settings measured ({found['per_phase_best']}) / the best of them for "
          f"the whole day, in hindsight: {spread(found['per_phase_best_over_best_fixed'], '.2f')}, per repeat "
          f"{found['per_phase_best_over_best_fixed']} (what switching among them between phases could win)")
    tuned = [r for r in runs if r.system == "tuned"]
    for i, phase in enumerate(phases):
        shares = [r.goal_shares[i] for r in tuned]
        met = sum(1 for s in shares if s is not None and s >= GOAL_SHARE)
        print(f"  goal >= {GOAL_SHARE:.0%} within SLO after {GOAL_SKIP_INTERVALS} intervals, {phase.name}: tuned "
              f"{spread(shares, '.0%')}, met in {met} of {len(shares)} repeats")
    return found


def plot(runs: list[Run], phases: list[Phase], trace: list[Request], args: argparse.Namespace, path: Path) -> None:
    """The tuned run of median day goodput against the best static of the same repeat, per interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tuned = sorted((r for r in runs if r.system == "tuned"), key=lambda r: r.day.goodput)
    if not tuned:
        return
    pick = tuned[len(tuned) // 2]
    statics = [r for r in runs if r.repeat == pick.repeat and r.system.startswith("static-")]
    shown = [pick] + ([max(statics, key=lambda r: r.day.goodput)] if statics else [])
    slo = (args.tpot_ms / 1000, args.ttft_s)
    bins = round(phases[-1].end / args.interval)
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for run in shown:
        by_bin: list[list[Outcome]] = [[] for _ in range(bins)]
        for request, outcome in zip(trace, run.outcomes):
            by_bin[min(bins - 1, int(request.at // args.interval))].append(outcome)
        t = [(b + 0.5) * args.interval for b in range(bins)]
        good = [sum(o.output_tokens for o in b if o.within(*slo)) / args.interval for b in by_bin]
        tpot = [(p99([o.tpot for o in b if o.tpot is not None and o.error is None]) or math.nan) * 1000
                for b in by_bin]
        axes[0].step([x.t for x in run.ticks], [x.max_num_seqs for x in run.ticks], where="post", label=run.system)
        axes[1].plot(t, tpot, marker=".", label=run.system)
        axes[2].plot(t, good, marker=".", label=run.system)
    axes[1].axhline(args.tpot_ms, color="red", linestyle="--", label="SLO")
    for ax in axes:
        for phase in phases[1:]:
            ax.axvline(phase.start, color="grey", linewidth=0.8)
    for phase in phases:
        axes[0].text(phase.start, 1.02, phase.name, fontsize="small", transform=axes[0].get_xaxis_transform())
    axes[0].set_yscale("log", base=2)
    axes[0].set_ylabel("max_num_seqs")
    axes[1].set_ylabel("TPOT P99 (ms), by arrival")
    axes[2].set_ylabel("goodput (tok/s), by arrival")
    axes[2].set_xlabel("seconds into the day")
    for ax in axes:
        ax.legend(loc="upper right", fontsize="small")
    fig.suptitle(f"A day of changing traffic, repeat {pick.repeat} (CPU, {args.dtype})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------- main


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the servers' cleanup
    model = generated_model("small", args.seed)
    phase_seconds = args.phase_intervals * args.interval
    print(f"machine: {cpu_description()}; engine dtype {args.dtype}; load average {os.getloadavg()[0]:.1f}")
    print(f"SLO: TPOT P99 <= {args.tpot_ms:g} ms and TTFT P99 <= {args.ttft_s:g} s; tuning interval "
          f"{args.interval:g} s, {args.phase_intervals} a phase ({phase_seconds:g} s)", flush=True)
    tuning = tuning_spec(args)
    print(f"tuning spec: {tuning.model_dump(by_alias=True, exclude_none=True)}")
    if args.max_waiting_seconds is not None:
        print(f"admission (every system): --max-waiting-seconds {args.max_waiting_seconds:g}")
    if args.capacity is not None:
        capacity = dict(zip(("chat", "rag"), args.capacity, strict=True))
        print(f"capacity as given (--capacity): chat {capacity['chat']:.2f} req/s, RAG {capacity['rag']:.2f} req/s")
    else:
        print("calibration on a fresh server with the engine's defaults:", flush=True)
        server, _ = engine_server(model, None, args)
        try:
            server.wait_ready()
            asyncio.run(warm_up(server.url, args.seed))
            capacity = asyncio.run(calibrate(server.url, args.calibration_seconds, args.seed))
        finally:
            server.stop()
    phases, trace = make_day(capacity, phase_seconds, args.seed)
    for i, phase in enumerate(phases):
        count = sum(1 for r in trace if r.phase == i)
        print(f"  phase {phase.name:13s} {phase.start:5.0f}-{phase.end:5.0f} s: {phase.kind}, {phase.rate:.2f} req/s, "
              f"{count} requests{', a busy loop on the first core' if phase.noisy else ''}")

    systems = ["tuned", "default"] + [f"static-{m}" for m in args.static]
    runs: list[Run] = []
    for repeat in range(1, args.repeat + 1):
        shift = (repeat - 1) * max(1, len(systems) // args.repeat)
        for system in systems[shift % len(systems):] + systems[:shift % len(systems)]:
            mns = int(system.split("-")[1]) if system.startswith("static-") else None
            server, admin = engine_server(model, mns, args)
            try:
                server.wait_ready()
                outcomes, ticks, final = asyncio.run(run_day(server.url, admin, phases, trace, args,
                                                             tuning if system == "tuned" else None))
            finally:
                server.stop()
            runs.append(score(system, repeat, phases, trace, outcomes, ticks, final, args))
            print_run(runs[-1], phases)
    found = report(runs, phases, systems)
    print(f"machine: {cpu_description()}; load average at the end {os.getloadavg()[0]:.1f}")
    if args.plot is not None:
        plot(runs, phases, trace, args, args.plot)
        print(f"plot: {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()}, "machine": cpu_description(),
            "slo": {"tpot_p99_seconds": args.tpot_ms / 1000, "ttft_p99_seconds": args.ttft_s},
            "tuning": tuning.model_dump(by_alias=True, exclude_none=True), "capacity_requests_per_second": capacity,
            "phases": [asdict(p) for p in phases],
            "trace": [{"at": r.at, "phase": r.phase, "prompt_length": r.prompt_length, "max_tokens": r.max_tokens}
                      for r in trace],
            "runs": [asdict(r) for r in runs], "ratios": found,
        }, indent=1) + "\n")
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
