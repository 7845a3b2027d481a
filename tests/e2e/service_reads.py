"""What the end-to-end modules read back about an InferenceService on the cluster: its engine pods, its
status, its Events, a `kvpilot serve` flag of an engine pod, and the maxNumSeqs an engine runs with."""

from __future__ import annotations

import httpx

from kvpilot import engine_contract as contract
from kvpilot.kube_contract import pod_url
from kvpilot.operator import builders
from kvpilot.operator.engine_metrics import parse_snapshot
from kvpilot.operator.kube import Kube


def engine_pods(kube: Kube, namespace: str, name: str) -> list[dict]:
    """The service's engine pods that are not being deleted."""
    pods = kube.list("v1", "Pod", namespace, label_selector=builders.selector_string(name))
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def service_status(kube: Kube, namespace: str, name: str) -> dict:
    """The service's status ({} before the operator wrote one, or when the service is gone)."""
    return (kube.get_inference_service(namespace, name) or {}).get("status") or {}


def service_events(cluster, namespace: str, name: str, reason: str) -> str:
    """The messages of the service's Events with ``reason``, one a line."""
    return cluster.kubectl("get", "events", "-n", namespace, "--field-selector",
                           f"involvedObject.kind=InferenceService,involvedObject.name={name},reason={reason}",
                           "-o", "custom-columns=MESSAGE:.message", "--no-headers").stdout


def engine_arg(pod_or_template: dict, flag: str) -> str:
    """The value of one `kvpilot serve` flag in an engine pod's (or pod template's) arguments."""
    args = pod_or_template["spec"]["containers"][0]["args"]
    return args[args.index(flag) + 1]


def engine_max_num_seqs(pod: dict) -> int:
    """The maxNumSeqs the engine runs with, from its own /metrics."""
    text = httpx.get(f"{pod_url(pod['status']['podIP'])}/metrics", timeout=10).text
    return int(parse_snapshot(text, 0.0).gauges[contract.MAX_NUM_SEQS])
