"""Routing: the kvpilot gateway against round-robin over the same two engine replicas, same run.

Two `kvpilot serve` replicas of one model on this machine (prefix caching on, a KV cache that
holds only part of the workload's prefixes, one torch thread each so they share the cores
evenly), and a workload of groups of requests that share a long prefix (a system prompt or a
few-shot block per group, then a short distinct question). Every request streams a completion
of ``--output-tokens`` tokens (EOS ignored). The same requests, in the same order, at the same
concurrency, go

- ``gateway``: through `kvpilot gateway` (benchmarks/routing_gateway.py: the gateway's app over
  a fixed route table), which picks a replica by prefix affinity with bounded load;
- ``round-robin``: alternately to each replica, as a Kubernetes Service spreads connections.

Each system gets freshly started replicas (empty prefix caches) in each repeat; the order of
the systems alternates between repeats. Reported per run: the prefix-cache hit rate (prompt
tokens found cached / prompt tokens looked up, summed over both replicas' /metrics), TTFT P50
and P99 (send to first text), output tokens/s (over the wall time from the first send to the
last completion), and failures; then the median of each over the repeats with its min-max, and
the gateway's ratios to round-robin.

    python benchmarks/routing.py                 # ~10 min on 2 cores
    python benchmarks/routing.py --repeat 3      # medians over 3 runs per system
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

from kvpilot import engine_contract as names

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, small (generated) or a model folder")
    parser.add_argument("--groups", type=int, default=12, help="groups of requests sharing a prefix")
    parser.add_argument("--requests-per-group", type=int, default=8)
    parser.add_argument("--prefix-words", type=int, default=300, help="words of each group's shared prefix")
    parser.add_argument("--question-words", type=int, nargs=2, default=(6, 14))
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="clients, each sending its next request when "
                        "its last one ends")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="64MiB", help="per replica: about half the groups' prefixes")
    parser.add_argument("--load-factor", type=float, default=1.25, help="the gateway's --load-factor")
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


def start_gateway(engines: list[ServerProcess], args: argparse.Namespace) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-P", str(HERE / "routing_gateway.py"), "--port", str(port), "--model", SERVED_NAME,
               "--load-factor", str(args.load_factor)]
    for engine in engines:
        command += ["--backend", engine.url]
    gateway = ServerProcess("routing-gateway", command, port)
    gateway.wait_ready(timeout=60)
    return gateway


def prefix_cache_counts(engines: list[ServerProcess]) -> tuple[float, float]:
    """(hits, queries) in prompt tokens, summed over the engines."""
    hits = queries = 0.0
    for engine in engines:
        with urllib.request.urlopen(engine.url + names.METRICS_PATH, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(names.PREFIX_CACHE_HITS):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith(names.PREFIX_CACHE_QUERIES):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


# ------------------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    system: str
    repeat: int
    ok: int
    failed: int
    seconds: float
    hit_rate: float
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
        if system == "gateway":
            gateway = start_gateway(engines, args)
            targets = [gateway.url]
        else:
            targets = [engine.url for engine in engines]
        hits_before, queries_before = prefix_cache_counts(engines)
        records, seconds = asyncio.run(closed_loop(targets, prompts, args))
        hits, queries = prefix_cache_counts(engines)
    finally:
        if gateway is not None:
            gateway.stop()
        for engine in engines:
            engine.stop()
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    looked_up = queries - queries_before
    return RunResult(system, repeat, len(ok), len(records) - len(ok), seconds,
                     (hits - hits_before) / looked_up if looked_up else 0.0,
                     pct(ttft, 0.5), pct(ttft, 0.99), sum(r.output_tokens for r in ok) / seconds)


# ------------------------------------------------------------------------------------- report


def median_spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def report(results: list[RunResult]) -> None:
    print("\nevery run:")
    print(f"{'system':<12} {'run':>3} {'ok':>4} {'fail':>4} {'hit rate':>8} {'TTFT P50':>9} {'TTFT P99':>9} "
          f"{'tok/s':>7} {'seconds':>8}")
    for r in results:
        print(f"{r.system:<12} {r.repeat:>3} {r.ok:>4} {r.failed:>4} {r.hit_rate:>8.3f} {r.ttft_p50 or 0:>9.3f} "
              f"{r.ttft_p99 or 0:>9.3f} {r.output_tokens_per_s:>7.1f} {r.seconds:>8.1f}")
    print("\nmedian [min-max] over runs:")
    medians = {}
    for system in ("gateway", "round-robin"):
        mine = [r for r in results if r.system == system]
        figures = {"hit_rate": [r.hit_rate for r in mine], "ttft_p50": [r.ttft_p50 or 0 for r in mine],
                   "ttft_p99": [r.ttft_p99 or 0 for r in mine], "tok_s": [r.output_tokens_per_s for r in mine]}
        medians[system] = {k: statistics.median(v) for k, v in figures.items()}
        print(f"{system:<12} " + "  ".join(f"{k} {median_spread(v)}" for k, v in figures.items()))
    g, rr = medians["gateway"], medians["round-robin"]
    hit_ratio = f"x{g['hit_rate'] / rr['hit_rate']:.2f}" if rr["hit_rate"] else "(round-robin had none)"
    print(f"\ngateway / round-robin: hit rate {hit_ratio}, TTFT P50 x{g['ttft_p50'] / rr['ttft_p50']:.2f}, "
          f"TTFT P99 x{g['ttft_p99'] / rr['ttft_p99']:.2f}, throughput x{g['tok_s'] / rr['tok_s']:.2f}")


def main() -> None:
    args = parse_args()
    model = benchmark_model(args.model, args.seed)
    prompts = workload(args)
    print(f"model {model}; {args.groups} groups x {args.requests_per_group} requests, {args.prefix_words}-word "
          f"prefixes; concurrency {args.concurrency}; {args.output_tokens} output tokens; "
          f"KV cache {args.kv_cache_memory} per replica; gateway load factor {args.load_factor}; "
          f"{os.cpu_count()} cores", flush=True)
    results = []
    for repeat in range(args.repeat):
        order = ("gateway", "round-robin") if repeat % 2 == 0 else ("round-robin", "gateway")
        for system in order:
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
