"""Routing: the kvpilot gateway against round-robin over the same two engine replicas, same run.

Two `kvpilot serve` replicas of one model on this machine (prefix caching on, a KV cache that
holds only part of the workload's prefixes, one torch thread each so they share the cores
evenly), and a workload of groups of requests that share a long prefix (a system prompt or a
few-shot block per group, then a short distinct question). Every request streams a completion
of ``--output-tokens`` tokens (EOS ignored). The same requests, in the same order, at the same
concurrency, go

- ``gateway@F``: through `kvpilot gateway` (benchmarks/routing_gateway.py: the gateway's app over
  a fixed route table) with ``--load-factor F``, which picks a replica by prefix affinity with
  bounded load (one such system per factor given);
- ``round-robin``: alternately to each replica, as a Kubernetes Service spreads connections.

Each system gets freshly started replicas (empty prefix caches) in each repeat; the order of
the systems rotates between repeats. Reported per run: the prefix-cache hit rate (prompt
tokens found cached / prompt tokens, over every request, from the `cached_tokens` of each
response's usage: what the replica found when it first admitted the request), TTFT P50 and P99
(send to first text), output tokens/s (over the wall time from the first send to the last
completion), and failures; as context, the engines' own hit-rate counters (which also count the
re-admission of a preempted request, often a hit on its own blocks), their preemptions and, for
the gateway, the share of its decisions that spilled a prefix to its second pod. Then the median
of each over the repeats with its min-max, and the gateway's ratios to round-robin.

    python benchmarks/routing.py                 # ~2 min on 2 cores
    python benchmarks/routing.py --repeat 3      # medians over 3 runs per system
    python benchmarks/routing.py --load-factor 1.25 1.5 2 --repeat 2   # affinity against balance
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from serving import SERVED_NAME, RequestRecord, stream_one
from serving_common import ServerProcess, benchmark_model, free_port

from prometheus_client.parser import text_string_to_metric_families

from kvpilot import engine_contract as names
from kvpilot import gateway_contract

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, small (generated) or a model folder")
    parser.add_argument("--groups", type=int, default=32, help="groups of requests sharing a prefix")
    parser.add_argument("--requests-per-group", type=int, default=6)
    parser.add_argument("--prefix-words", type=int, default=300, help="words of each group's shared prefix")
    parser.add_argument("--question-words", type=int, nargs=2, default=(6, 14))
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="clients, each sending its next request when "
                        "its last one ends")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="200MiB", help="per replica: about half the groups' prefixes "
                        "(SmolLM2 in bfloat16: 22.5 KiB a token)")
    parser.add_argument("--load-factor", type=float, nargs="+", default=[1.25],
                        help="the gateway's --load-factor (default: its default); several: one gateway system "
                             "each, the trade-off between prefix affinity and balance")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    return parser.parse_args()


# ------------------------------------------------------------------------------------- workload


def workload(args: argparse.Namespace) -> list[str]:
    """Every request's prompt, groups interleaved at random (the same list for every system)."""
    from kvpilot.engine.tokenizer_files import ENGLISH_TEXT

    rng = random.Random(args.seed)
    vocabulary = sorted({w.strip(".,?!:;()\"'").lower() for w in ENGLISH_TEXT.split()} - {""})
    prompts = []
    for group in range(args.groups):
        prefix = f"Instructions for group {group}: " + " ".join(rng.choice(vocabulary)
                                                                for _ in range(args.prefix_words))
        for _ in range(args.requests_per_group):
            question = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(*args.question_words)))
            prompts.append(f"{prefix}\nQuestion: {question}?\nAnswer:")
    rng.shuffle(prompts)
    return prompts


# ------------------------------------------------------------------------------------- servers


def start_engines(model: Path, args: argparse.Namespace) -> list[ServerProcess]:
    env = dict(os.environ, OMP_NUM_THREADS="1")  # two replicas on the machine's cores, one thread each
    engines = []
    for i in range(2):
        port = free_port()
        command = [sys.executable, "-P", "-m", "kvpilot", "serve", str(model), "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", SERVED_NAME, "--device", "cpu",
                   "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "1024",
                   "--kv-cache-memory", args.kv_cache_memory,
                   "--enable-prefix-caching", "--log-level", "warning"]
        engines.append(ServerProcess(f"routing-engine-{i}", command, port, env=env))
    for engine in engines:
        engine.wait_ready()
    return engines


def start_gateway(engines: list[ServerProcess], load_factor: float) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-P", str(HERE / "routing_gateway.py"), "--port", str(port), "--model", SERVED_NAME,
               "--load-factor", str(load_factor)]
    for engine in engines:
        command += ["--backend", engine.url]
    gateway = ServerProcess("routing-gateway", command, port)
    gateway.wait_ready(timeout=60)
    return gateway


def scrape(servers: list[ServerProcess], wanted: set[str]) -> dict[tuple[str, str], float]:
    """{(sample name, its reason label or ""): value}, summed over the servers' /metrics."""
    totals: dict[tuple[str, str], float] = {}
    for server in servers:
        with urllib.request.urlopen(server.url + names.METRICS_PATH, timeout=10) as response:
            for family in text_string_to_metric_families(response.read().decode()):
                for sample in family.samples:
                    if sample.name in wanted:
                        key = (sample.name, sample.labels.get(gateway_contract.REASON_LABEL, ""))
                        totals[key] = totals.get(key, 0.0) + sample.value
    return totals


ROUND_ROBIN = "round-robin"
ENGINE_COUNTERS = {names.PREFIX_CACHE_HITS, names.PREFIX_CACHE_QUERIES, names.PREEMPTIONS}


# ------------------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    system: str
    repeat: int
    ok: int
    failed: int
    seconds: float
    hit_rate: float  # cached prompt tokens / prompt tokens, over the requests' usage
    engine_hit_rate: float  # the engines' counters (re-admissions after preemption included)
    preemptions: int
    spill_share: float | None  # gateway decisions that went to a prefix's second pod
    ttft_p50: float | None
    ttft_p99: float | None
    output_tokens_per_s: float


async def closed_loop(targets: list[str], prompts: list[str], args: argparse.Namespace) -> tuple[list[RequestRecord], float]:
    """``args.concurrency`` clients take the prompts in order; request i goes to targets[i % len(targets)]."""
    queue = list(enumerate(prompts))
    queue.reverse()
    records: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def client() -> None:
            while queue:
                i, prompt = queue.pop()
                records.append(await stream_one(session, targets[i % len(targets)], prompt, args.output_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        return records, time.perf_counter() - start


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run(system: str, repeat: int, model: Path, prompts: list[str], args: argparse.Namespace) -> RunResult:
    engines = start_engines(model, args)
    gateway = None
    try:
        if system != ROUND_ROBIN:
            gateway = start_gateway(engines, load_factor=float(system.removeprefix("gateway@")))
            targets = [gateway.url]
        else:
            targets = [engine.url for engine in engines]
        before = scrape(engines, ENGINE_COUNTERS)
        records, seconds = asyncio.run(closed_loop(targets, prompts, args))
        after = scrape(engines, ENGINE_COUNTERS)
        decisions = scrape([gateway], {gateway_contract.ROUTING_DECISIONS}) if gateway else {}
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            engine.stop()
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    delta = {name: after.get((name, ""), 0.0) - before.get((name, ""), 0.0) for name in ENGINE_COUNTERS}
    looked_up = delta[names.PREFIX_CACHE_QUERIES]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    spills = decisions.get((gateway_contract.ROUTING_DECISIONS, gateway_contract.REASON_PREFIX_SPILL), 0.0)
    return RunResult(system, repeat, len(ok), len(records) - len(ok), seconds,
                     sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
                     delta[names.PREFIX_CACHE_HITS] / looked_up if looked_up else 0.0,
                     int(delta[names.PREEMPTIONS]),
                     spills / sum(decisions.values()) if decisions else None,
                     pct(ttft, 0.5), pct(ttft, 0.99), sum(r.output_tokens for r in ok) / seconds)


# ------------------------------------------------------------------------------------- report


def median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def report(results: list[RunResult]) -> None:
    print("\nevery run:")
    print(f"{'system':<14} {'run':>3} {'ok':>4} {'fail':>4} {'hit rate':>8} {'TTFT P50':>9} {'TTFT P99':>9} "
          f"{'tok/s':>7} {'seconds':>8} {'engine hit rate':>15} {'preempted':>9} {'spilled':>7}")
    for r in results:
        spilled = "-" if r.spill_share is None else f"{r.spill_share:.3f}"
        print(f"{r.system:<14} {r.repeat:>3} {r.ok:>4} {r.failed:>4} {r.hit_rate:>8.3f} {r.ttft_p50 or 0:>9.3f} "
              f"{r.ttft_p99 or 0:>9.3f} {r.output_tokens_per_s:>7.1f} {r.seconds:>8.1f} {r.engine_hit_rate:>15.3f} "
              f"{r.preemptions:>9} {spilled:>7}")
    print("\nmedian [min-max] over runs:")
    medians = {}
    systems = list(dict.fromkeys(r.system for r in results))
    for system in systems:
        mine = [r for r in results if r.system == system]
        figures = {"hit_rate": [r.hit_rate for r in mine], "ttft_p50": [r.ttft_p50 or 0 for r in mine],
                   "ttft_p99": [r.ttft_p99 or 0 for r in mine], "tok_s": [r.output_tokens_per_s for r in mine]}
        medians[system] = {k: statistics.median(v) for k, v in figures.items()}
        print(f"{system:<14} " + "  ".join(f"{k} {median_spread(v)}" for k, v in figures.items()))
    rr = medians[ROUND_ROBIN]
    print("\nratios of medians to round-robin (goal: hit rate >= 2x with a lower TTFT P99):")
    for system in systems:
        if system == ROUND_ROBIN:
            continue
        g = medians[system]
        hit_ratio = g["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else float("inf")
        met = hit_ratio >= 2 and g["ttft_p99"] < rr["ttft_p99"]
        print(f"  {system}: hit rate x{hit_ratio:.2f}, TTFT P50 x{g['ttft_p50'] / rr['ttft_p50']:.2f}, "
              f"TTFT P99 x{g['ttft_p99'] / rr['ttft_p99']:.2f}, throughput x{g['tok_s'] / rr['tok_s']:.2f} "
              f"[{'met' if met else 'MISSED'}]")


def main() -> None:
    args = parse_args()
    model = benchmark_model(args.model, args.seed)
    prompts = workload(args)
    print(f"model {model}; {args.groups} groups x {args.requests_per_group} requests, {args.prefix_words}-word "
          f"prefixes; concurrency {args.concurrency}; {args.output_tokens} output tokens; "
          f"KV cache {args.kv_cache_memory} per replica; gateway load factors {args.load_factor}; "
          f"{os.cpu_count()} cores", flush=True)
    results = []
    systems = [f"gateway@{factor:g}" for factor in args.load_factor] + [ROUND_ROBIN]
    for repeat in range(args.repeat):
        shift = repeat % len(systems)  # each system goes first in turn
        for system in systems[shift:] + systems[:shift]:
            result = run(system, repeat, model, prompts, args)
            print(f"  {system} run {repeat}: hit rate {result.hit_rate:.3f}, TTFT P50 {result.ttft_p50 or 0:.3f} s "
                  f"P99 {result.ttft_p99 or 0:.3f} s, {result.output_tokens_per_s:.1f} tok/s, "
                  f"{result.failed} failed", flush=True)
            results.append(result)
    report(results)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
