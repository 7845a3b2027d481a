"""Autoscaling by metrics, for real: a load step up and down against the operator on the local cluster.

The chart installs the operator into a fresh local control plane (`kvpilot local-cluster`; pods
run as local processes). One InferenceService serves the generated ``tiny`` model from real
`kvpilot serve` pods with autoscaling on (1..``--max-replicas``) and a fixed ``max_num_seqs``
(tuning off, so capacity per replica stays put). An open-loop Poisson load goes round-robin to
the Ready pods, as a load balancer would (the local cluster gives Services no endpoints); a
request a pod turns away before any work (it is draining, or gone) is retried on another pod
and counted as rerouted. First, with autoscaling still off, the load saturates the one replica
to measure its capacity; then autoscaling is turned on and the load runs low (``--low-load`` of
that capacity), steps up beyond it (``--high-load``), then steps back.

Reports the time from the step up to the operator's scale-up decision and to the new pods being
Ready, the time from the step down to the scale-down decision (the stabilization window,
``--stabilization``, included) and to the extra pods being gone, and the requests that failed,
above all during scale-down while pods drain. Writes docs/tuning-autoscaling.png.

    python benchmarks/autoscaling.py        # ~5 minutes on 2 cores; needs `kvpilot local-cluster build`

This machine has 2 cores, so extra CPU replicas share them: what is measured is the control loop
(how fast capacity is asked for, started, and given back, and that draining loses nothing), not
throughput scaling.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpilot.engine_contract import ENGINE_PORT
from kvpilot.localcluster import testing
from kvpilot.operator import builders
from kvpilot.operator.kube import Kube
from kvpilot.operator.status import pod_ready
from serving_common import PoissonLoad, generated_model

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "kvpilot-autoscaling-bench"
RELEASE = "kvpilot-bench"
NAME = "scaled"
PROMPT_WORDS = (4, 24)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--low-load", type=float, default=0.3,
                        help="offered output tokens/s before and after the step, as a fraction of one "
                             "replica's capacity")
    parser.add_argument("--high-load", type=float, default=2.0, help="the same during the step")
    parser.add_argument("--calibrate-seconds", type=float, default=20.0, help="saturating one replica to measure it")
    parser.add_argument("--low-seconds", type=float, default=45.0, help="low load before the step up")
    parser.add_argument("--high-seconds", type=float, default=120.0, help="length of the step")
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each replica's fixed max_num_seqs")
    parser.add_argument("--max-replicas", type=int, default=2)
    parser.add_argument("--interval", type=int, default=10, help="seconds between the operator's decisions")
    parser.add_argument("--stabilization", type=int, default=60,
                        help="scale-down stabilization window, seconds (the operator's default: 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the timeline and the load's counts here")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    if not 0 < args.low_load < args.high_load:
        parser.error("--low-load must be positive and below --high-load")
    if args.low_load >= 0.8:
        parser.error("--low-load must be below 0.8, the autoscaler's target utilization, or nothing scales down")
    if args.max_replicas < 2:
        parser.error("--max-replicas must be at least 2, or there is nothing to scale")
    return args


@dataclass
class Sample:
    t: float  # seconds since the load started
    desired: int  # spec.replicas
    ready: int  # Ready engine pods
    pods: int  # engine pods not yet gone (terminating ones included)


class Watcher:
    """Polls the service and its pods every second: the load's targets and the replica timeline."""

    def __init__(self, kube: Kube, start: float) -> None:
        self.kube, self.start = kube, start
        self.targets: list[str] = []
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._poll()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self._poll()
            except Exception as exc:  # noqa: BLE001 - a transient API error skips one sample
                print(f"  watcher: {exc}")

    def _poll(self) -> None:
        service = self.kube.get_inference_service(NAMESPACE, NAME) or {}
        pods = self.kube.list("v1", "Pod", NAMESPACE, label_selector=builders.selector_string(NAME))
        ready = [p for p in pods if pod_ready(p) and p["status"].get("podIP")
                 and not p["metadata"].get("deletionTimestamp")]
        self.targets = [f"http://{p['status']['podIP']}:{ENGINE_PORT}" for p in ready]
        desired = (service.get("spec") or {}).get("replicas", 1)
        self.samples.append(Sample(time.time() - self.start, desired, len(ready), len(pods)))

    def first(self, after: float, predicate) -> float | None:
        """Seconds from ``after`` to the first sample at or after it that meets ``predicate``."""
        return next((s.t - after for s in self.samples if s.t >= after and predicate(s)), None)

    def wait(self, predicate, timeout: float) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.samples and predicate(self.samples[-1]):
                return True
            time.sleep(0.5)
        return False


def install(cluster: testing.ClusterHandle, args: argparse.Namespace, model: Path) -> None:
    cluster.kubectl("create", "namespace", NAMESPACE)
    cluster.helm(
        "install", RELEASE, str(REPO / "charts" / "kvpilot"), "--namespace", NAMESPACE,
        "--set", "rbac.scope=namespaced", "--set", "engine.bindPodIP=true",
        "--set", f"tuning.intervalSeconds={args.interval}",
        "--set-json", "extraEnv=" + json.dumps(
            [{"name": "KVPILOT_SCALE_DOWN_STABILIZATION_SECONDS", "value": str(args.stabilization)}]),
        "--wait", "--timeout", "3m", timeout=240,
    )
    manifest = {
        "apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": NAME, "namespace": NAMESPACE},
        "spec": {
            "model": {"uri": f"file://{model}"},
            "resources": {"gpus": 1},
            "engine": {"maxNumSeqs": args.max_num_seqs, "maxModelLen": 512,
                       "extraArgs": ["--device", "cpu", "--kv-cache-memory", "64MiB"]},
            "autoscaling": {"enabled": False, "minReplicas": 1, "maxReplicas": args.max_replicas},
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))
    cluster.kubectl("wait", f"kvis/{NAME}", "-n", NAMESPACE, "--for=condition=Ready", "--timeout=300s",
                    timeout=330)


def served_rate(completions: list[tuple[float, int]], start: float, end: float, bucket: float) -> list[tuple]:
    """(bucket midpoint in seconds after ``start``, output tokens/s) of the requests completed in each bucket."""
    counts = [0] * max(1, math.ceil((end - start) / bucket))
    for t, tokens in completions:
        index = int((t - start) // bucket)
        if 0 <= index < len(counts):
            counts[index] += tokens
    return [((i + 0.5) * bucket, c / bucket) for i, c in enumerate(counts)]


def plot(watcher: Watcher, served: list[tuple], offered: list[tuple], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.5))
    top.plot([t for t, _ in served], [r for _, r in served], label="served (client side)")
    top.step([t for t, _ in offered], [r for _, r in offered], where="post", linestyle="--", label="offered")
    top.set_ylabel("output tokens/s")
    top.legend(loc="upper right")
    times = [s.t for s in watcher.samples]
    bottom.step(times, [s.desired for s in watcher.samples], where="post", label="spec.replicas")
    bottom.step(times, [s.ready for s in watcher.samples], where="post", label="Ready pods")
    bottom.step(times, [s.pods for s in watcher.samples], where="post", linestyle=":", label="pods (incl. terminating)")
    bottom.set_ylabel("replicas")
    bottom.set_yticks(range(max(s.pods for s in watcher.samples) + 2))
    bottom.set_xlabel("seconds")
    bottom.set_xlim(left=offered[0][0] - 5)  # from the load's start (the calibration before it is not shown)
    bottom.legend(loc="upper center", ncol=3, fontsize="small")
    fig.suptitle("Autoscaling a real InferenceService: a load step up and down")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibrate(watcher: Watcher, args: argparse.Namespace) -> float:
    """Output tokens/s of the one replica, saturated: arrivals far above it, a queue kept in front of it."""
    load = PoissonLoad(lambda: watcher.targets, 50.0, 4 * args.max_num_seqs, args.seed, PROMPT_WORDS,
                       tuple(args.output_tokens), model=NAME)
    load.start()
    time.sleep(args.calibrate_seconds)
    load.stop()
    measured_from = time.time() - 0.75 * args.calibrate_seconds  # the first quarter fills the batch
    tokens = sum(n for t, n in load.stats.completions if t >= measured_from)
    return tokens / (0.75 * args.calibrate_seconds)


def main() -> int:
    args = parse_args()
    model = generated_model("tiny", args.seed)
    mean_tokens = sum(args.output_tokens) / 2
    cluster = testing.acquire()
    try:
        kube = Kube(cluster.api_client())
        print(f"local cluster up in {cluster.up_seconds:.0f} s; installing the operator and the service")
        install(cluster, args, model)
        start = time.time()
        with Watcher(kube, start) as watcher:
            capacity = calibrate(watcher, args)
            low_rate, high_rate = (f * capacity / mean_tokens for f in (args.low_load, args.high_load))
            print(f"one replica at max_num_seqs {args.max_num_seqs}: {capacity:.0f} output tok/s; "
                  f"load {low_rate:.2f} → {high_rate:.2f} → {low_rate:.2f} req/s")
            time.sleep(3)  # the calibration's requests are cancelled and leave the engine
            cluster.kubectl("patch", "kvis", NAME, "-n", NAMESPACE, "--type", "merge",
                            "-p", json.dumps({"spec": {"autoscaling": {"enabled": True}}}))
            load = PoissonLoad(lambda: watcher.targets, low_rate, args.max_in_flight, args.seed, PROMPT_WORDS,
                               tuple(args.output_tokens), model=NAME)
            load_start = time.time() - start
            load.start()
            time.sleep(args.low_seconds)
            up_at = time.time() - start
            load.rate = high_rate
            print(f"step up at {up_at:.0f} s")
            time.sleep(args.high_seconds)
            down_at = time.time() - start
            failed_before_down = load.stats.failed
            load.rate = low_rate
            print(f"step down at {down_at:.0f} s")
            watcher.wait(lambda s: s.desired == 1 and s.pods == 1, args.stabilization + 300)
            time.sleep(10)
            load.stop()
        end = time.time() - start
    finally:
        cluster.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", check=False)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
        leftovers = testing.release()
        if leftovers:
            print(f"processes left behind: {leftovers}")

    stats = load.stats
    asked_up = watcher.first(up_at, lambda s: s.desired > 1)
    ready_up = watcher.first(up_at, lambda s: s.ready > 1)
    peak = max(s.desired for s in watcher.samples)
    asked_down = watcher.first(down_at, lambda s: s.desired == 1)
    gone = watcher.first(down_at, lambda s: s.desired == 1 and s.pods == 1)
    failed_in_scale_down = stats.failed - failed_before_down
    served = [(load_start + t, r) for t, r in served_rate(stats.completions, start + load_start, start + end, 10.0)]
    low, high = args.low_load * capacity, args.high_load * capacity
    offered = [(load_start, low), (up_at, high), (down_at, low), (end, low)]

    def secs(value: float | None) -> str:
        return "never" if value is None else f"{value:.0f} s"

    print(f"\nAutoscaling (interval {args.interval} s, stabilization {args.stabilization} s, "
          f"max_num_seqs {args.max_num_seqs}, 1..{args.max_replicas} replicas; one replica serves "
          f"{capacity:.0f} tok/s, offered {low:.0f} → {high:.0f} → {low:.0f} tok/s):")
    print(f"  step up: operator asked for more replicas after {secs(asked_up)} (peak {peak}); "
          f"a new replica Ready after {secs(ready_up)}")
    print(f"  step down: back to 1 replica after {secs(asked_down)}; the extra pods gone after {secs(gone)}")
    print(f"  requests: {stats.sent} sent, {stats.ok} ok, {stats.failed} failed {stats.errors or ''}"
          f"({failed_in_scale_down} during scale-down), {stats.rerouted} rerouted from a draining or "
          f"removed pod, {stats.shed} shed at the client")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "capacity": capacity, "load_start": load_start, "step_up_at": up_at, "step_down_at": down_at,
            "samples": [asdict(s) for s in watcher.samples], "served": served,
            "load": {k: v for k, v in asdict(stats).items() if k != "completions"},
        }, indent=1))
    if not args.no_plot:
        plot(watcher, served, offered, REPO / "docs" / "tuning-autoscaling.png")
    return 0 if stats.failed == 0 and ready_up is not None and gone is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
