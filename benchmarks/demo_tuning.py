"""Tuning on the demo, as a user tries it: does turning tuning on lose throughput to its SLO?

Runs against the demo that ``scripts/demo.sh`` leaves running (SmolLM2-135M-Instruct GGUF, default
settings, the gateway at the service's ``status.url``). ``--clients`` streaming chat clients, each
sending its next request when the last one ends (8-48 words, 16-160 output tokens, EOS ignored),
load the service through the gateway: first with tuning off at a fixed ``max_num_seqs`` (the
demo's 16), then with tuning patched in as issue 27's user did (``kubectl patch kvis demo`` with
``tuning: {intervalSeconds: 15, slo: {itlP99Seconds: S}, maxNumSeqs: {min: 2, max: 64}}``). Every
interval prints the output tokens/s the clients received, the P99 of the gaps between the tokens
they saw (from each answer's first token on: a stream's opening role chunk comes before the queue),
and the service's ``max_num_seqs`` and tuning reason; the end reports each phase's median tokens/s
[min-max], the tuned/fixed ratio, the settings the tuner went through and its Events. The goal:
tuning loses no throughput, also to an SLO no setting can meet.

    bash scripts/demo.sh && python benchmarks/demo_tuning.py --slo-ms 250   # ~8 minutes
    python benchmarks/demo_tuning.py --slo-ms 15                            # an SLO out of reach

The service is left with tuning on; ``kubectl patch kvis demo --type merge -p '{"spec":{"tuning":null}}'``
turns it off again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import threading
import time
from datetime import datetime, timezone

import httpx

from serving_common import cpu_description

WORDS = "the a model cluster engine token batch kernel python memory cache sequence request latency".split()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slo-ms", type=float, default=250.0, help="the ITL P99 SLO patched in (ms)")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--fixed", type=int, default=16, help="max_num_seqs with tuning off")
    parser.add_argument("--fixed-seconds", type=float, default=120.0)
    parser.add_argument("--tuned-seconds", type=float, default=300.0)
    parser.add_argument("--interval", type=float, default=15.0,
                        help="seconds per printed interval and per tuning interval")
    parser.add_argument("--name", default="demo", help="the InferenceService")
    return parser.parse_args()


def kubectl_env() -> dict[str, str]:
    """KUBECONFIG and PATH for the local cluster's kubectl, as `kvpilot local-cluster` prints them."""
    def ask(*args: str) -> str:
        return subprocess.run(["kvpilot", "local-cluster", *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    return {**os.environ, "KUBECONFIG": ask("kubeconfig"), "PATH": f"{ask('bin-dir')}:{os.environ['PATH']}"}


class Service:
    def __init__(self, name: str) -> None:
        self.name, self.env = name, kubectl_env()

    def kubectl(self, *args: str) -> str:
        return subprocess.run(["kubectl", *args], check=True, capture_output=True, text=True, env=self.env).stdout

    def get(self) -> dict:
        return json.loads(self.kubectl("get", "kvis", self.name, "-o", "json"))

    def patch(self, spec: dict) -> None:
        self.kubectl("patch", "kvis", self.name, "--type", "merge", "-p", json.dumps({"spec": spec}))

    def events(self, since: str) -> list[str]:
        """The tuner's Events (Tuned, SLOUnreachable) from ``since`` (RFC 3339, UTC) on."""
        out = self.kubectl("get", "events", "--field-selector", f"involvedObject.name={self.name}",
                           "--sort-by", ".lastTimestamp", "-o", "custom-columns=T:.lastTimestamp,R:.reason,M:.message",
                           "--no-headers")
        return [line for line in out.splitlines()
                if line[:20] >= since and (" Tuned " in line or " SLOUnreachable " in line)]


class Load:
    """Streaming chat clients through the gateway; tokens and gaps per interval."""

    def __init__(self, url: str, clients: int) -> None:
        self.url, self.clients = url, clients
        self.lock = threading.Lock()
        self.tokens, self.gaps, self.errors = 0, [], []
        self.stop = threading.Event()

    def take(self) -> tuple[int, list[float]]:
        with self.lock:
            taken = self.tokens, self.gaps
            self.tokens, self.gaps = 0, []
        return taken

    def run_client(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=None) as client:
            while not self.stop.is_set():
                body = {"model": "smollm2", "stream": True, "ignore_eos": True, "max_tokens": rng.randint(16, 160),
                        "messages": [{"role": "user", "content": " ".join(rng.choice(WORDS)
                                                                          for _ in range(rng.randint(8, 48)))}]}
                last = None
                try:
                    with client.stream("POST", f"{self.url}/chat/completions", json=body) as response:
                        response.raise_for_status()  # an error status is counted, not read as a stream
                        for line in sse_lines(response):
                            if not line.startswith("data: {"):
                                continue
                            delta = json.loads(line[6:])["choices"][0]["delta"]
                            if not delta.get("content"):
                                continue  # the role chunk, sent before the request waits for a slot
                            now = time.monotonic()
                            with self.lock:
                                self.tokens += 1
                                if last is not None:
                                    self.gaps.append(now - last)
                            last = now
                except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:  # counted; the client goes on
                    with self.lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(1)


def sse_lines(response: httpx.Response):
    """The stream's lines, split where SSE splits them (a token may hold U+2028, which str.splitlines and
    httpx's iter_lines also split at)."""
    pending = ""
    for text in response.iter_text():
        *lines, pending = (pending + text).split("\n")
        yield from (line.rstrip("\r") for line in lines)
    if pending:
        yield pending


def phase(label: str, service: Service, url: str, args: argparse.Namespace, seconds: float) -> list[float]:
    load = Load(url, args.clients)
    threads = [threading.Thread(target=load.run_client, args=(i,), daemon=True) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    rates = []
    for k in range(int(seconds // args.interval)):
        time.sleep(args.interval)
        tokens, gaps = load.take()
        gaps.sort()
        p99 = gaps[int(0.99 * (len(gaps) - 1))] * 1e3 if gaps else float("nan")
        status = service.get().get("status") or {}
        tuning = status.get("tuning") or {}
        rates.append(tokens / args.interval)
        print(f"{label:5} t={(k + 1) * args.interval:4.0f}s  {rates[-1]:6.1f} tok/s  gaps P99 {p99:5.0f} ms  "
              f"max_num_seqs {(status.get('engine') or {}).get('maxNumSeqs')}  {tuning.get('reason') or ''}",
              flush=True)
    load.stop.set()
    for thread in threads:
        thread.join()
    if load.errors:
        print(f"{label}: {len(load.errors)} requests failed, e.g. {load.errors[0]}")
    return rates


def summary(rates: list[float]) -> str:
    return f"{statistics.median(rates):.1f} [{min(rates):.1f}-{max(rates):.1f}] tok/s over {len(rates)} intervals"


def main() -> int:
    args = parse_args()
    service = Service(args.name)
    url = (service.get().get("status") or {}).get("url")
    if not url:
        raise SystemExit(f"InferenceService {args.name} has no status.url: run `bash scripts/demo.sh` first")
    started = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"machine: {cpu_description()}\nservice {args.name} at {url}; {args.clients} streaming clients; "
          f"SLO ITL P99 <= {args.slo_ms:g} ms")
    service.patch({"tuning": None, "engine": {"maxNumSeqs": args.fixed}})
    time.sleep(20)  # the fixed setting reaches the engine
    fixed = phase("fixed", service, url, args, args.fixed_seconds)
    service.patch({"tuning": {"intervalSeconds": int(args.interval), "slo": {"itlP99Seconds": args.slo_ms / 1e3},
                              "maxNumSeqs": {"min": 2, "max": 64}}})
    tuned = phase("tuned", service, url, args, args.tuned_seconds)
    print("\ntuner's decisions:\n" + "\n".join(service.events(started)))
    print(f"\nfixed max_num_seqs {args.fixed}: {summary(fixed)}\ntuned: {summary(tuned)}\n"
          f"tuned / fixed (medians): {statistics.median(tuned) / statistics.median(fixed):.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
