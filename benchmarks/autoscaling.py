"""Autoscaling by metrics, for real: load steps against the operator on the local cluster.

The chart installs the operator into a fresh local control plane (`kvpilot local-cluster`; pods
run as local processes). One InferenceService serves the generated ``tiny`` model from real
`kvpilot serve` pods with autoscaling on (1..``--max-replicas``, default 4) and a fixed
``max_num_seqs`` (tuning off, so capacity per replica stays put). An open-loop Poisson load goes
round-robin to the Ready pods, as a load balancer would (the local cluster gives Services no
endpoints); a request a pod turns away before any work (it is draining, or gone) is retried on
another pod and counted as rerouted. First, with autoscaling still off, the load saturates the
one replica to measure its capacity; then autoscaling is turned on and the load steps through
``--steps`` (fractions of that capacity; by default ones that need 1, 2, 3, then 1 replica).

The sizing rule is the autoscaler's: ``ceil(demand / (capacity per replica x target
utilization 0.8))`` within the bounds. It is checked twice at the end of each step (the last,
a step down, once the stabilization window has passed):
- against the operator's own inputs, from ``status.autoscaling`` (the demand it saw, the
  capacity per replica it measured): every mismatch is reported and the exit status is 1.
  Until a replica has been saturated once there is no measured capacity (the autoscaler then
  plans by batch slots), and the step is checked against the rule below instead;
- against the offered load and one replica's capacity measured alone: reported, not asserted,
  because replicas sharing this machine's cores each deliver less than one alone (below).
Reports the time from each step to the operator's decision and to the pods being Ready (or
gone), the requests that failed, and the arrivals shed at the client because too many were
outstanding: demand that went unserved. Served tokens are those the responses' ``usage``
reports. Writes docs/tuning-autoscaling.png.

    python benchmarks/autoscaling.py        # ~10 minutes on 2 cores; needs `kvpilot local-cluster build`

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
from kvpilot.operator.autoscaler import ScalingPolicy
from kvpilot.operator.kube import Kube
from kvpilot.kube_contract import pod_ready
from serving_common import PoissonLoad, generated_model

REPO = Path(__file__).resolve().parent.parent
NAMESPACE = "kvpilot-autoscaling-bench"
RELEASE = "kvpilot-bench"
NAME = "scaled"
PROMPT_WORDS = (4, 24)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=float, nargs="+", default=[0.4, 1.2, 2.0, 0.4],
                        help="offered output tokens/s of each step, as fractions of one replica's capacity")
    parser.add_argument("--step-seconds", type=float, default=90.0, help="length of each step but the last")
    parser.add_argument("--calibrate-seconds", type=float, default=20.0, help="saturating one replica to measure it")
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each replica's fixed max_num_seqs")
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--interval", type=int, default=10, help="seconds between the operator's decisions")
    parser.add_argument("--stabilization", type=int, default=60,
                        help="scale-down stabilization window, seconds (the operator's default: 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the timeline and the load's counts here")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args()
    if any(f <= 0 for f in args.steps):
        parser.error("--steps: every load must be a positive fraction of one replica's capacity")
    if args.max_replicas < 2:
        parser.error("--max-replicas must be at least 2, or there is nothing to scale")
    return args


@dataclass
class Sample:
    t: float  # seconds since the load started
    desired: int  # spec.replicas
    ready: int  # Ready engine pods
    pods: int  # engine pods not yet gone (terminating ones included)
    demand: float | None  # status.autoscaling: output tokens/s the operator planned for
    capacity: float | None  # status.autoscaling: output tokens/s per saturated replica, as measured


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
        scaling = (service.get("status") or {}).get("autoscaling") or {}
        self.samples.append(Sample(time.time() - self.start, desired, len(ready), len(pods),
                                   scaling.get("demandTokensPerSecond"), scaling.get("capacityPerReplica")))

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
    fig.suptitle("Autoscaling a real InferenceService: load steps up and down")
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


def sizing_rule(demand: float, capacity: float, max_replicas: int) -> int:
    """The autoscaler's sizing rule: replicas for ``demand`` tokens/s at ``capacity`` tokens/s each."""
    target = ScalingPolicy(min_replicas=1, max_replicas=max_replicas).target_utilization
    return min(max(1, math.ceil(demand / (capacity * target) - 1e-9)), max_replicas)


def rule_from_status(sample: Sample, max_replicas: int) -> int | None:
    """The rule applied to the operator's own inputs in one status snapshot; None before it had both."""
    if sample.demand is None or not sample.capacity:
        return None
    return sizing_rule(sample.demand, sample.capacity, max_replicas)


def main() -> int:
    args = parse_args()
    model = generated_model("tiny", args.seed)
    mean_tokens = sum(args.output_tokens) / 2
    cluster = testing.acquire()
    steps: list[tuple[float, float]] = []  # (start, fraction)
    try:
        kube = Kube(cluster.api_client())
        print(f"local cluster up in {cluster.up_seconds:.0f} s; installing the operator and the service")
        install(cluster, args, model)
        start = time.time()
        with Watcher(kube, start) as watcher:
            capacity = calibrate(watcher, args)
            print(f"one replica at max_num_seqs {args.max_num_seqs}: {capacity:.0f} output tok/s; steps "
                  + " → ".join(f"{f:g}x ({f * capacity / mean_tokens:.2f} req/s)" for f in args.steps))
            time.sleep(3)  # the calibration's requests are cancelled and leave the engine
            cluster.kubectl("patch", "kvis", NAME, "-n", NAMESPACE, "--type", "merge",
                            "-p", json.dumps({"spec": {"autoscaling": {"enabled": True}}}))
            load = PoissonLoad(lambda: watcher.targets, args.steps[0] * capacity / mean_tokens, args.max_in_flight,
                               args.seed, PROMPT_WORDS, tuple(args.output_tokens), model=NAME)
            load.start()
            for index, fraction in enumerate(args.steps):
                load.rate = fraction * capacity / mean_tokens
                steps.append((time.time() - start, fraction))
                print(f"step {index + 1}: {fraction:g}x capacity at {steps[-1][0]:.0f} s", flush=True)
                if index < len(args.steps) - 1:
                    time.sleep(args.step_seconds)
            # Scaling down waits out the stabilization window, then goes one replica at a time.
            settle_from = steps[-1][0] + args.stabilization
            watcher.wait(lambda s: s.t > settle_from and s.desired == rule_from_status(s, args.max_replicas)
                         and s.pods == s.desired, args.stabilization * 4 + 300)
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
    load_start = steps[0][0]
    served = [(load_start + t, r) for t, r in served_rate(stats.completions, start + load_start, start + end, 10.0)]
    offered = [(t, f * capacity) for t, f in steps] + [(end, steps[-1][1] * capacity)]

    def secs(value: float | None) -> str:
        return "never" if value is None else f"{value:.0f} s"

    print(f"\nAutoscaling (interval {args.interval} s, stabilization {args.stabilization} s, "
          f"max_num_seqs {args.max_num_seqs}, 1..{args.max_replicas} replicas; one replica serves "
          f"{capacity:.0f} tok/s):")
    mismatches = 0
    previous = 1
    for index, (at, fraction) in enumerate(steps):
        until = steps[index + 1][0] if index + 1 < len(steps) else end
        in_step = [s for s in watcher.samples if at <= s.t < until]
        last = in_step[-1] if in_step else None
        final = last.desired if last else None
        alone = sizing_rule(fraction * capacity, capacity, args.max_replicas)
        measured = last is not None and bool(last.capacity)
        want = rule_from_status(last, args.max_replicas) if measured else alone
        asked = watcher.first(at, lambda s, w=want: s.desired == w)
        settled = watcher.first(at, lambda s, w=want: s.desired == w and s.ready == w and s.pods == w)
        ok = want is not None and final == want
        mismatches += not ok
        direction = "up" if final > previous else "down" if final < previous else "hold"
        seen = ("no autoscaling status" if last is None or last.demand is None else
                f"demand {last.demand:.0f} tok/s vs {last.capacity:.0f} per replica" if measured else
                f"demand {last.demand:.0f} tok/s, capacity not measured yet (checked by the rule for one alone)")
        print(f"  step {index + 1} ({fraction:g}x one replica's capacity, {fraction * capacity:.0f} tok/s offered; "
              f"{alone} replica(s) at the capacity of one alone): operator saw {seen} -> the rule says {want}; "
              f"it asked for {final} at the end of the step, {direction} ({'ok' if ok else 'MISMATCH'}); "
              f"asked after {secs(asked)}, all Ready and no extra pods after {secs(settled)}")
        previous = final if final is not None else previous
    unserved = stats.failed + stats.shed
    print(f"  requests: {stats.sent + stats.shed} arrivals: {stats.ok} served, {stats.failed} failed "
          f"{stats.errors or ''}, {stats.shed} shed at the client (outstanding cap {args.max_in_flight}): "
          f"{unserved} unserved; {stats.rerouted} rerouted from a draining or removed pod; "
          f"{sum(n for _, n in stats.completions)} output tokens returned")
    if args.json:
        args.json.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "capacity": capacity, "steps": steps,
            "samples": [asdict(s) for s in watcher.samples], "served": served,
            "load": {k: v for k, v in asdict(stats).items() if k != "completions"},
        }, indent=1))
    if not args.no_plot:
        plot(watcher, served, offered, REPO / "docs" / "tuning-autoscaling.png")
    return 0 if stats.failed == 0 and mismatches == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
