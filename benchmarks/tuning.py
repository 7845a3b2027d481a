"""Live tuning: the operator's tuner against a real `kvpilot serve` on the CPU, vs a static oracle.

One engine process serves the generated ``small`` preset model on the CPU, in the dtype the engine
picks for this CPU (bfloat16 where it is native; ``--dtype`` overrides), with a step budget of twice
the largest setting swept: room for every running sequence's decode token plus the prefill of the
arrivals, so the budget never caps the batch below ``max_num_seqs``. A load thread sends Poisson arrivals of completions with mixed prompt (4-24
words) and output (16-160 tokens, EOS ignored) lengths at a rate above what any setting can
serve, so the engine is always saturated (at most ``--max-in-flight`` requests are
outstanding; arrivals beyond that are shed at the client and counted). Prompts are short
because on a CPU every prompt token costs as much as a decode token: long prefill chunks
would make every step's latency about the chunk, not the batch.

The SLO (``--slo-ms``, ITL P99, default 100 ms) is fixed before the run. The offered load is
set from a calibration at the top setting: Poisson arrivals at 1.5x the output tokens/s the
largest ``max_num_seqs`` serves, so every setting, the top one included, is saturated and no
window measures a backlog draining.

1. Oracle: ``max_num_seqs`` swept statically through the admin endpoint. Each setting is
   measured after the running batch has drained to it and a warm-up, over a window as long as
   the tuner's (twice the interval), from the server's /metrics. The coarse grid (powers of
   two) is refined between the last setting that meets the SLO and the first that breaks it,
   in steps of at most 25%. The sweep runs once before the closed-loop runs and once after (in
   reverse), and the two are averaged, so drift in the machine's other load favours neither
   side. The oracle is the best output-token throughput whose averaged ITL P99 meets the SLO.
2. Closed loop: the tuner (kvpilot.operator.tuner) fed by the operator's metrics code
   (kvpilot.operator.engine_metrics), applying its decisions through the admin endpoint exactly
   as the operator does, from the smallest and from the largest grid setting, ``--runs`` times
   each, alternating.

The goal per run: at least 90% of the oracle within 8 intervals, holding to the end, with at
most one reversal. Scored per run: the interval from which every later interval is within 10%
of the oracle and meets the SLO ("reached"; none if it does not hold to the end), reversals of
direction over the whole trace, the throughput averaged over the intervals that met the SLO as
a fraction of the oracle, and the intervals (and seconds) over the SLO. Every run is printed.

Autoscaling has its own benchmark, on the local cluster: benchmarks/autoscaling.py.

    python benchmarks/tuning.py                 # ~45 minutes on 2 cores
    python benchmarks/tuning.py --quick         # a smoke run, not a measurement

Writes docs/tuning-sweep.png, docs/tuning-from-small.png and docs/tuning-from-large.png (every
run of a start in one plot) and a JSON of every interval (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from kvpilot.operator import tuner
from kvpilot.operator.engine_client import EngineClient
from kvpilot.operator.engine_metrics import MetricsCollector, Observation
from kvpilot.operator.plan import settle_seconds
from kvpilot.operator.spec import EngineSettings, MaxNumSeqsBounds, Slo, Tuning
from serving_common import PoissonLoad, ServerProcess, cpu_description, free_port, generated_model, native_dtype

DOCS = Path(__file__).resolve().parent.parent / "docs"
ADMIN_TOKEN = "benchmark-admin-token-0123456789abcdef"
GRID = (2, 4, 8, 16, 32, 64, 128, 256)
GOAL_INTERVALS = 8  # reach 90% of the oracle within this many intervals ...
GOAL_REVERSALS = 1  # ... with at most this many reversals
REFINE_RATIO = 1.25  # sweep steps near the SLO


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: generated small preset)")
    parser.add_argument("--grid", type=int, nargs="+", default=list(GRID),
                        help="coarse max_num_seqs settings to sweep (refined near the SLO)")
    parser.add_argument("--slo-ms", type=float, default=100.0, help="ITL P99 SLO, fixed before the run")
    parser.add_argument("--rate", type=float, default=None,
                        help="Poisson arrivals per second (default: 1.5x the top setting's capacity)")
    parser.add_argument("--max-in-flight", type=int, default=None, help="default: twice the top setting")
    parser.add_argument("--warmup", type=float, default=8.0, help="seconds after a sweep change before measuring")
    parser.add_argument("--interval", type=float, default=15.0, help="tuning interval, seconds")
    parser.add_argument("--intervals", type=int, default=12, help="tuning intervals per closed-loop run")
    parser.add_argument("--runs", type=int, default=3, help="closed-loop runs per start")
    parser.add_argument("--dtype", default=None,
                        help="engine dtype (default: the engine's own choice, bfloat16 where the CPU computes it natively)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="the engine's step budget (default: twice the largest --grid setting)")
    parser.add_argument("--engine-threads", type=int, default=None, help="OMP_NUM_THREADS for the engine")
    parser.add_argument("--nice", type=int, default=0, help="run the engine under `nice -n N` (negative: root)")
    parser.add_argument("--prompt-words", type=int, nargs=2, default=[4, 24], metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[16, 160], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quick", action="store_true", help="short windows and a small grid: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.grid, args.warmup, args.interval, args.intervals, args.runs = [2, 8, 32], 3.0, 4.0, 4, 1
    if sorted(set(args.grid)) != args.grid or args.grid[0] < 1:
        parser.error("--grid: give increasing positive max_num_seqs values")
    args.max_in_flight = args.max_in_flight or 2 * args.grid[-1]
    args.dtype = args.dtype or native_dtype()
    return args


def model_path(args: argparse.Namespace) -> Path:
    return args.model if args.model is not None else generated_model("small", args.seed)


def engine_server(model: Path, port: int, max_num_seqs: int, max_seqs_ever: int, dtype: str,
                  max_num_batched_tokens: int | None, threads: int | None, nice: int) -> ServerProcess:
    """A `kvpilot serve` subprocess on 127.0.0.1 with the admin API on."""
    command = [
        sys.executable, "-m", "kvpilot", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "small",
        "--device", "cpu", "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--max-model-len", "1024",
        # A CPU prefill chunk of thousands of tokens stalls every decode in its step for
        # seconds; a small step budget keeps ITL about the batch, as on a GPU.
        "--max-num-batched-tokens", str(max(max_num_batched_tokens or 2 * max_seqs_ever, max_seqs_ever)),
        # Sized for the largest setting, so KV space never decides the sweep.
        "--kv-cache-memory", f"{max(256, max_seqs_ever * 16)}MiB",
        "--max-waiting-requests", "100000", "--admin-token", ADMIN_TOKEN, "--admin-port", str(port + 1),
        "--log-level", "warning",
    ]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # fewer threads than busy cores beat spinning barriers
    if nice:
        # Other processes share the cores: a higher priority keeps their bursts out of the P99.
        command = ["nice", "-n", str(nice), *command]
    return ServerProcess("kvpilot-tuning", command, port, env=env)


async def set_max_num_seqs(session: aiohttp.ClientSession, url: str, value: int) -> None:
    """Through the admin API, which `engine_server` puts on the port after the OpenAI API's."""
    host, port = url.rsplit(":", 1)
    admin = f"{host}:{int(port) + 1}/admin/v1/scheduler"
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with session.post(admin, json={"max_num_seqs": value}, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"admin endpoint: HTTP {response.status}: {await response.text()}")


@dataclass
class Interval:
    t: float
    max_num_seqs: int
    tokens_per_second: float
    itl_p99: float | None
    batch: float | None
    reason: str = ""
    observation: dict | None = None  # what the tuner read (closed loops), to replay its decisions offline


def summarize(obs: Observation | None, max_num_seqs: int, t: float, reason: str = "", keep: bool = False) -> Interval:
    if obs is None:
        return Interval(t, max_num_seqs, 0.0, None, None, reason)
    return Interval(t, max_num_seqs, obs.output_tokens_per_second, obs.itl_p99, obs.mean_running_per_pod, reason,
                    asdict(obs) if keep else None)


async def measure_setting(url: str, max_num_seqs: int, warmup: float, window: float) -> Interval:
    """One static setting: drain the batch to it, warm up, then one window as long as the loop's."""
    collector = MetricsCollector(window_seconds=10 * window)
    async with aiohttp.ClientSession() as session:
        await set_max_num_seqs(session, url, max_num_seqs)
        await settle(session, url, max_num_seqs)
    await asyncio.sleep(warmup)
    collector.ingest(EngineClient().scrape({"engine": url}), time.time())
    await asyncio.sleep(window)
    obs = collector.ingest(EngineClient().scrape({"engine": url}), time.time()).service
    point = summarize(obs, max_num_seqs, time.time())
    print(f"  max_num_seqs {max_num_seqs:4d}: {point.tokens_per_second:7.1f} tok/s, ITL P99 "
          f"{_ms(point.itl_p99)}, mean batch {point.batch or 0:.1f}", flush=True)
    return point


async def sweep(url: str, grid: list[int], warmup: float, window: float) -> list[Interval]:
    return [await measure_setting(url, m, warmup, window) for m in grid]


def refine(points: list[Interval], slo: float) -> list[int]:
    """Settings between the last that meets the SLO and the first that breaks it, in steps of at
    most REFINE_RATIO (none when the crossing is at an end of the grid or already fine)."""
    meets = [p.itl_p99 is not None and p.itl_p99 <= slo for p in points]
    for i in range(len(points) - 1):
        if meets[i] and not meets[i + 1]:
            low, high = points[i].max_num_seqs, points[i + 1].max_num_seqs
            extra, value = [], low
            while value * REFINE_RATIO < high:
                value = max(value + 1, round(value * REFINE_RATIO))
                if value < high:
                    extra.append(value)
            return extra
    return []


def average(a: Interval, b: Interval) -> Interval:
    itls = [x for x in (a.itl_p99, b.itl_p99) if x is not None]
    return Interval(b.t, a.max_num_seqs, (a.tokens_per_second + b.tokens_per_second) / 2,
                    sum(itls) / len(itls) if itls else None, ((a.batch or 0) + (b.batch or 0)) / 2)


def oracle_point(points: list[Interval], slo: float) -> Interval | None:
    meeting = [p for p in points if p.itl_p99 is not None and p.itl_p99 <= slo]
    return max(meeting, key=lambda p: p.tokens_per_second, default=None)


async def calibrate(url: str, top: int, warmup: float, window: float) -> float:
    """Output tokens/s of the top setting under a saturating load."""
    point = await measure_setting(url, top, warmup, window)
    return point.tokens_per_second


async def closed_loop(url: str, start: int, slo: float, bounds: MaxNumSeqsBounds, interval: float,
                      intervals: int) -> list[Interval]:
    """The operator's loop for one pod: scrape → tune → apply through the admin endpoint."""
    collector = MetricsCollector(window_seconds=2 * interval)
    params = EngineSettings(max_num_seqs=start, gpu_memory_utilization=0.9)
    history = tuner.TuningHistory()
    trace = []
    async with aiohttp.ClientSession() as session:
        await set_max_num_seqs(session, url, start)
        await settle(session, url, start)
        began = time.time()
        await asyncio.sleep(settle_seconds(interval))  # as after any change the operator makes
        collector.ingest(EngineClient().scrape({"engine": url}), time.time())
        await asyncio.sleep(interval - settle_seconds(interval))
        for _ in range(intervals):
            obs = collector.ingest(EngineClient().scrape({"engine": url}), time.time()).service
            now = time.time()
            decision = tuner.tune(obs, params, Tuning(slo=Slo(itl_p99_seconds=slo), max_num_seqs=bounds), history, now)
            trace.append(summarize(obs, params.max_num_seqs, now - began, decision.reason, keep=True))
            print(f"  t={now - began:5.0f}s max_num_seqs {params.max_num_seqs:3d}: "
                  f"{trace[-1].tokens_per_second:6.1f} tok/s, ITL P99 {_ms(trace[-1].itl_p99)} | {decision.reason}",
                  flush=True)
            params, history = decision.settings, decision.history
            if decision.num_seqs_changed:
                # As the operator does: the next window starts after the admission burst.
                await set_max_num_seqs(session, url, params.max_num_seqs)
                pause = settle_seconds(interval)
                await asyncio.sleep(pause)
                collector.ingest(EngineClient().scrape({"engine": url}), time.time())
                collector.restart_windows(expect_max_num_seqs=params.max_num_seqs)
                await asyncio.sleep(interval - pause)
            else:
                await asyncio.sleep(interval)
    return trace


async def settle(session: aiohttp.ClientSession, url: str, max_num_seqs: int, timeout: float = 180.0) -> None:
    """Waits until requests admitted under an earlier, larger setting have finished."""
    from kvpilot import engine_contract as names
    from kvpilot.operator.engine_metrics import parse_snapshot

    deadline = time.time() + timeout
    while time.time() < deadline:
        async with session.get(f"{url}/metrics") as response:
            snapshot = parse_snapshot(await response.text(), time.time())
        if snapshot.gauges.get(names.REQUESTS_RUNNING, 0.0) <= max_num_seqs:
            return
        await asyncio.sleep(1.0)


@dataclass
class RunReport:
    start: int
    run: int
    reached_at: int | None  # first interval from which all are within 10% of the oracle and meet the SLO
    reversals: int  # changes of direction over the whole trace
    fraction_of_oracle: float | None  # mean tok/s of the intervals that met the SLO / oracle
    intervals_over_slo: int
    seconds_over_slo: float
    final_max_num_seqs: int

    @property
    def goal_met(self) -> bool:
        return self.reached_at is not None and self.reached_at <= GOAL_INTERVALS and self.reversals <= GOAL_REVERSALS


def report(trace: list[Interval], start: int, run: int, oracle: Interval, slo: float, interval: float) -> RunReport:
    def good(p: Interval) -> bool:
        return p.tokens_per_second >= 0.9 * oracle.tokens_per_second and p.itl_p99 is not None and p.itl_p99 <= slo

    reached_at = None
    for i in range(len(trace) - 1, -1, -1):
        if not good(trace[i]):
            break
        reached_at = i + 1
    settings = [p.max_num_seqs for p in trace]
    moves = [b - a for a, b in zip(settings, settings[1:]) if b != a]
    reversals = sum(1 for x, y in zip(moves, moves[1:]) if (x > 0) != (y > 0))
    meeting = [p.tokens_per_second for p in trace if p.itl_p99 is not None and p.itl_p99 <= slo]
    over = [p for p in trace if p.itl_p99 is not None and p.itl_p99 > slo]
    return RunReport(start, run, reached_at, reversals,
                     sum(meeting) / len(meeting) / oracle.tokens_per_second if meeting else None,
                     len(over), len(over) * interval, trace[-1].max_num_seqs)


def plot_runs(traces: list[list[Interval]], oracle: Interval, slo: float, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    for run, trace in enumerate(traces, 1):
        t = [p.t for p in trace]
        axes[0].plot(t, [p.tokens_per_second for p in trace], marker="o", label=f"run {run}")
        axes[1].plot(t, [(p.itl_p99 or math.nan) * 1000 for p in trace], marker="o", label=f"run {run}")
        axes[2].step(t, [p.max_num_seqs for p in trace], where="pre", marker="o", label=f"run {run}")
    axes[0].axhline(oracle.tokens_per_second, color="green", linestyle="--", label="static oracle")
    axes[0].axhline(0.9 * oracle.tokens_per_second, color="green", linestyle=":", label="90% of oracle")
    axes[0].set_ylabel("output tok/s")
    axes[0].legend(loc="lower right", fontsize="small")
    axes[1].axhline(slo * 1000, color="red", linestyle="--", label="SLO")
    axes[1].set_ylabel("ITL P99 (ms)")
    axes[1].legend(loc="upper right", fontsize="small")
    axes[2].axhline(oracle.max_num_seqs, color="green", linestyle="--", label="oracle setting")
    axes[2].set_ylabel("max_num_seqs")
    axes[2].set_xlabel("seconds (one point per tuning interval)")
    axes[2].legend(loc="upper right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(points: list[Interval], slo: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ms = [p.max_num_seqs for p in points]
    ax.plot(ms, [p.tokens_per_second for p in points], marker="o", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_num_seqs (static)")
    ax.set_ylabel("output tok/s")
    twin = ax.twinx()
    twin.plot(ms, [(p.itl_p99 or math.nan) * 1000 for p in points], marker="s", color="tab:orange", label="ITL P99")
    twin.axhline(slo * 1000, color="red", linestyle="--", label="SLO")
    twin.set_ylabel("ITL P99 (ms)")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _ms(value: float | None) -> str:
    return "   n/a" if value is None else f"{value * 1000:6.1f} ms"


def main() -> int:
    args = parse_args()
    model = model_path(args)
    slo = args.slo_ms / 1000
    window = 2 * args.interval  # the tuner's sliding window; the sweep measures the same length
    port = args.port or free_port()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below
    load_before = os.getloadavg()[0]
    server = engine_server(model, port, args.grid[0], args.grid[-1], args.dtype, args.max_num_batched_tokens,
                           args.engine_threads, args.nice)
    load = None
    mean_output = sum(args.output_tokens) / 2
    try:
        server.wait_ready()
        # Until calibrated: far more arrivals than any setting serves (the in-flight cap holds the queue).
        load = PoissonLoad(lambda: [server.url], args.rate or 1000.0, args.max_in_flight, args.seed,
                           args.prompt_words, args.output_tokens, model="small")
        load.start()
        time.sleep(2 * args.warmup)  # first forwards are slow (allocator, caches)
        if args.rate is None:
            print(f"calibration at max_num_seqs {args.grid[-1]}:", flush=True)
            capacity = asyncio.run(calibrate(server.url, args.grid[-1], args.warmup, window))
            load.rate = 1.5 * capacity / mean_output
        print(f"load: Poisson {load.rate:.1f} req/s (~{load.rate * mean_output:.0f} output tok/s offered), "
              f"≤{args.max_in_flight} in flight; SLO ITL P99 ≤ {args.slo_ms:g} ms; window {window:g} s", flush=True)
        print("sweep:", flush=True)
        coarse = asyncio.run(sweep(server.url, args.grid, args.warmup, window))
        fine_grid = refine(coarse, slo)
        print(f"refined near the SLO: {fine_grid}", flush=True)
        fine = asyncio.run(sweep(server.url, fine_grid, args.warmup, window))
        before = sorted(coarse + fine, key=lambda p: p.max_num_seqs)
        grid = [p.max_num_seqs for p in before]

        bounds = MaxNumSeqsBounds(min=args.grid[0], max=args.grid[-1])
        runs: dict[int, list[list[Interval]]] = {args.grid[0]: [], args.grid[-1]: []}
        for run in range(1, args.runs + 1):
            for start in runs:
                print(f"closed loop from max_num_seqs {start}, run {run}:", flush=True)
                runs[start].append(asyncio.run(
                    closed_loop(server.url, start, slo, bounds, args.interval, args.intervals)))

        # The machine's other load drifts: sweeping again, in reverse, and averaging makes the
        # oracle's figures time-symmetric around the closed-loop runs.
        print("sweep again, in reverse:", flush=True)
        after = asyncio.run(sweep(server.url, grid[::-1], args.warmup, window))[::-1]
        points = [average(a, b) for a, b in zip(before, after)]
        oracle = oracle_point(points, slo)
        if oracle is None:
            raise SystemExit(f"no setting meets the ITL P99 SLO of {args.slo_ms:g} ms; give a larger --slo-ms")
        reports = [report(trace, start, run, oracle, slo, args.interval)
                   for start, traces in runs.items() for run, trace in enumerate(traces, 1)]
    finally:
        if load is not None:
            load.stop()
        server.stop()

    print("\nresults")
    print("  sweep (mean of the two sweeps):")
    for p in points:
        print(f"    max_num_seqs {p.max_num_seqs:3d}: {p.tokens_per_second:6.1f} tok/s, ITL P99 {_ms(p.itl_p99)}")
    print(f"  machine: {cpu_description()}; engine dtype {args.dtype}; load average at start {load_before:.1f}, "
          f"at end {os.getloadavg()[0]:.1f} (other processes compete for the cores: expect noise)")
    edge = " (at an end of the grid: the run says little)" if oracle.max_num_seqs in (grid[0], grid[-1]) else ""
    print(f"  SLO ITL P99 {args.slo_ms:g} ms, oracle {oracle.tokens_per_second:.1f} tok/s at max_num_seqs "
          f"{oracle.max_num_seqs}{edge}, tuning interval {args.interval:g} s")
    print(f"  goal: >= 90% of the oracle within {GOAL_INTERVALS} intervals, holding to the end, "
          f"<= {GOAL_REVERSALS} reversal")
    for r in reports:
        fraction = "n/a" if r.fraction_of_oracle is None else f"{r.fraction_of_oracle:.0%}"
        print(f"  start {r.start:3d} run {r.run}: {'MET' if r.goal_met else 'missed'}; reached at interval "
              f"{r.reached_at}, {r.reversals} reversals, {fraction} of the oracle over the intervals meeting "
              f"the SLO, {r.intervals_over_slo} intervals ({r.seconds_over_slo:.0f} s) over the SLO, "
              f"final max_num_seqs {r.final_max_num_seqs}")
    met = sum(r.goal_met for r in reports)
    print(f"  goal met in {met} of {len(reports)} runs")
    print(f"  load: {load.stats.sent} sent, {load.stats.ok} ok, {load.stats.failed} failed {load.stats.errors}, "
          f"{load.stats.shed} shed at the client")

    if not args.no_plots:
        DOCS.mkdir(exist_ok=True)
        plot_sweep(points, slo, DOCS / "tuning-sweep.png")
        for start, traces in runs.items():
            label = "small" if start == args.grid[0] else "large"
            plot_runs(traces, oracle, slo, f"Live tuning from max_num_seqs {start}, {len(traces)} runs (CPU)",
                      DOCS / f"tuning-from-{label}.png")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "machine": cpu_description(), "dtype": args.dtype,
            "slo_seconds": slo, "rate": load.rate, "oracle": asdict(oracle), "sweep": [asdict(p) for p in points],
            "sweep_before": [asdict(p) for p in before], "sweep_after": [asdict(p) for p in after],
            "runs": {str(s): [[asdict(p) for p in t] for t in traces] for s, traces in runs.items()},
            "reports": [asdict(r) | {"goal_met": r.goal_met} for r in reports],
            "load": {k: v for k, v in asdict(load.stats).items() if k != "completions"},
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
