"""The memory fraction tuned for real, end to end, on the local control plane.

On a CPU the fraction sizes an engine's KV cache within its container's memory limit
(``spec.resources.memory``): the fraction of the limit less what the process holds. A service is
sized so that its KV cache holds fewer long prompts than its batch runs; under that load the engine
preempts, the tuner raises ``gpuMemoryUtilization`` one step, the Deployment replaces the pod (the
new one Ready before the old one goes), and the new engine, with a larger KV cache, serves the same
load without preempting and without a failed request. The restart's cost is measured and printed.
The tests run in file order and share the service.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from kvpilot import engine_contract as contract
from kvpilot.kube_contract import pod_ready, pod_url
from kvpilot.localcluster.testing import wait_until
from kvpilot.operator.engine_metrics import parse_snapshot
from kvpilot.operator.tuner import TunerConfig

from .service_reads import engine_arg, engine_pods, service_events, service_status

pytestmark = pytest.mark.e2e

NS = "kvpilot-memory-e2e"
RELEASE = "kvm"
NAME = "memory"
OPERATOR_HEALTH_PORT = 18561  # pods share the host's network: clear of the other e2e modules' ports
LIMIT_BYTES = 4 * 1024**3
BLOCK_SIZE = 16
MAX_NUM_SEQS = 16
TIGHT_BLOCKS = 400  # ~6,400 tokens: 16 sequences admitted at ~290 tokens grow to ~610 (~620 blocks)
STEP = TunerConfig().memory_step  # 0.02 of 4 GiB: ~5,000 blocks more
ENGINE_READY_S = 240


def _manifest(model_dir: Path, fraction: float, tuning: dict | None) -> dict:
    spec = {
        "model": {"uri": f"file://{model_dir}"},
        "resources": {"gpus": 0, "memory": f"{LIMIT_BYTES // 1024**2}Mi"},
        "engine": {"maxNumSeqs": MAX_NUM_SEQS, "maxModelLen": 1024, "blockSize": BLOCK_SIZE,
                   "gpuMemoryUtilization": fraction, "extraArgs": ["--device", "cpu"]},
    }
    if tuning is not None:
        spec["tuning"] = tuning
    return {"apiVersion": "kvpilot.io/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": NAME, "namespace": NS}, "spec": spec}


def _block_bytes(model_dir: Path) -> int:
    """One KV-cache block of the float32 model: keys and values of every layer for BLOCK_SIZE tokens."""
    config = json.loads((model_dir / "config.json").read_text())
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4 * BLOCK_SIZE


def _engine_metrics(pod: dict):
    text = httpx.get(f"{pod_url(pod['status']['podIP'])}/metrics", timeout=10).text
    return parse_snapshot(text, time.time())


def _fraction(pod: dict) -> float:
    return float(engine_arg(pod, "--gpu-memory-utilization"))


def _the_pod_at(kube, fraction: float) -> dict | None:
    """The one Ready engine pod, when it runs ``fraction``."""
    pods = engine_pods(kube, NS, NAME)
    return pods[0] if len(pods) == 1 and pod_ready(pods[0]) and _fraction(pods[0]) == fraction else None


def _wait(kube, load, predicate, timeout: float, what: str):
    """wait_until, and on a timeout what the load and each engine pod saw."""
    try:
        return wait_until(predicate, timeout, what, interval=0.5)
    except AssertionError as exc:
        seen = []
        for pod in engine_pods(kube, NS, NAME):
            try:
                m = _engine_metrics(pod)
                seen.append(f"{pod['metadata']['name']} at {_fraction(pod)}: gauges {m.gauges}, counters {m.counters}")
            except httpx.HTTPError as error:
                seen.append(f"{pod['metadata']['name']}: {error}")
        raise AssertionError(f"{exc}\nload: {load.ok} ok, {load.not_routed} not routed, failures "
                             f"{load.failures[:3]}\n" + "\n".join(seen)
                             + f"\nstatus: {service_status(kube, NS, NAME)}") from None


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> Path:
    return Path(tiny_model_dir).resolve()


@pytest.fixture(scope="module")
def tight(cluster, kube, chart_operator, model_dir) -> dict:
    """The service at a fraction whose KV cache is ~TIGHT_BLOCKS blocks, tuned within one step above it.

    What an engine holds besides its KV cache (libraries, weights, activations) differs from machine to
    machine, so the service first runs at 0.5 and the tight fraction is read from its KV cache's size;
    then the user's edit (a new fraction, tuning on) rolls the pod."""
    # The chart's own grace period: the replaced pod finishes the long requests it is running (the
    # fixture's 2 s would abort some, as it would any user's shortened one).
    chart_operator(NS, RELEASE, OPERATOR_HEALTH_PORT, "engine.shutdownGraceSeconds=30")
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_manifest(model_dir, 0.5, None)))
    first = wait_until(lambda: _the_pod_at(kube, 0.5), ENGINE_READY_S, "the engine at 0.5", interval=0.5)
    blocks = _engine_metrics(first).gauges[contract.KV_CACHE_BLOCKS]
    besides_kv = 0.5 * LIMIT_BYTES - blocks * _block_bytes(model_dir)
    fraction = round((besides_kv + TIGHT_BLOCKS * _block_bytes(model_dir)) / LIMIT_BYTES, 4)
    tuning = {"intervalSeconds": 5, "slo": {"itlP99Seconds": 30.0},
              "maxNumSeqs": {"min": MAX_NUM_SEQS, "max": MAX_NUM_SEQS},
              "gpuMemoryUtilization": {"min": fraction, "max": round(fraction + STEP, 4)}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(_manifest(model_dir, fraction, tuning)))
    pod = wait_until(lambda: _the_pod_at(kube, fraction), ENGINE_READY_S, f"the engine at {fraction}", interval=0.5)
    return {"pod": pod, "fraction": fraction, "blocks": _engine_metrics(pod).gauges[contract.KV_CACHE_BLOCKS]}


@pytest.fixture(scope="module")
def long_prompts(engine_load, tight):
    """24 clients, each request a prompt of ~290 tokens no other shares (no prefix-cache hits) and 320
    tokens out: the running sequences outgrow the KV cache they were admitted into."""
    def body(n: int) -> dict:
        return {"model": NAME, "prompt": f"{n} " + "the quick brown fox jumps over the lazy dog " * 32,
                "max_tokens": 320, "ignore_eos": True}

    with engine_load(NS, NAME, 24, body) as running:
        yield running


def test_the_fraction_sizes_the_kv_cache_within_the_memory_limit(tight):
    # Within 10% of the aim: what a process holds differs a little from one start to the next.
    assert 0.9 * TIGHT_BLOCKS <= tight["blocks"] <= 1.1 * TIGHT_BLOCKS, tight


def test_preemptions_raise_the_memory_fraction_and_the_new_pod_stops_preempting(cluster, kube, tight, long_prompts,
                                                                               model_dir):
    old, low = tight["pod"], tight["fraction"]
    high = round(low + STEP, 4)
    _wait(kube, long_prompts, lambda: _engine_metrics(old).counters.get(contract.PREEMPTIONS, 0) > 0, 60,
          "the tight engine to preempt")
    ok_tight, tight_from = long_prompts.ok, time.monotonic()
    _wait(kube, long_prompts,
          lambda: (service_status(kube, NS, NAME).get("engine") or {}).get("gpuMemoryUtilization") == high, 120,
          f"the tuner to raise the fraction to {high}")
    decided = time.monotonic()
    tight_rate = (long_prompts.ok - ok_tight) / (decided - tight_from)
    preempted = _engine_metrics(old).counters[contract.PREEMPTIONS]
    new = wait_until(lambda: next((p for p in engine_pods(kube, NS, NAME) if pod_ready(p) and _fraction(p) == high),
                                  None), ENGINE_READY_S, f"a Ready engine at {high}", interval=0.5)
    ready = time.monotonic()
    wait_until(lambda: _the_pod_at(kube, high), 60, "the old pod to go", interval=0.5)

    message = service_events(cluster, NS, NAME, "TunedMemory")
    assert f"gpu_memory_utilization {low:g} → {high:g}" in message and "preempting" in message, message
    # The cost of the restart, said: the pods go one at a time, each new one as slow to start as the last.
    assert "replacing 1 pod(s) one at a time, each new one beside the old until Ready (the newest engine took " \
        in message, message
    blocks = _engine_metrics(new).gauges[contract.KV_CACHE_BLOCKS]
    grown = STEP * LIMIT_BYTES / _block_bytes(model_dir)
    assert 0.9 * grown <= blocks - tight["blocks"] <= 1.1 * grown, (blocks, tight["blocks"], grown)

    # The same load, on the new engine: its batch fits the KV cache.
    ok_before, served_from = long_prompts.ok, time.monotonic()
    time.sleep(15)
    after = _engine_metrics(new)
    assert after.counters.get(contract.PREEMPTIONS, 0) == 0, after.counters
    assert long_prompts.ok > ok_before
    assert long_prompts.failures == []
    print(f"\nmemory {low:g} -> {high:g}: KV cache {tight['blocks']:.0f} -> {blocks:.0f} blocks; tight: "
          f"{preempted:.0f} preemptions, {tight_rate:.2f} req/s; after: 0 preemptions, "
          f"{(long_prompts.ok - ok_before) / (time.monotonic() - served_from):.2f} req/s; decision to the new pod "
          f"Ready {ready - decided:.1f} s; {long_prompts.ok} requests served, {long_prompts.not_routed} turned away "
          f"before any work, 0 failed\n{message.strip()}")
