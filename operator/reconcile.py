"""The level-triggered reconcile: read the world, apply the desired children, report status.

``reconcile`` never looks at what changed, only at what is: the spec and the
engine settings in effect (the tuning ConfigMap) give the desired children,
server-side apply makes them so (a
no-op when they already are), and the status is recomputed from what the
children report. Running it twice, or after an operator restart, or halfway
through and again, converges on the same objects. ``refresh_status`` is the
cheap half, run whenever an engine pod or the Deployment changes.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kvpilot.kube_contract import pod_ready
from kvpilot.operator import builders, operator_metrics, status, tuning_configmap
from kvpilot.operator.engine_client import EngineClient, admin_url
from kvpilot.operator.kube import Kube, KubeError
from kvpilot.operator.settings import OperatorSettings
from kvpilot.operator.spec import (
    EngineSettings,
    InferenceServiceSpec,
    lora_name_problem,
    parse_spec,
    spec_error_message,
)


@dataclass
class Outcome:
    """What a reconcile did, for Kubernetes Events: normal actions and newly found problems."""

    actions: list[str] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (reason, message)
    status: dict[str, Any] = field(default_factory=dict)
    subject: dict[str, Any] | None = None  # the InferenceService as last read, for posting Events


def read_settings_in_effect(kube: Kube, name: str, namespace: str, spec: InferenceServiceSpec) -> EngineSettings:
    configmap = kube.get("v1", "ConfigMap", namespace, builders.tuning_configmap_name(name))
    return tuning_configmap.settings_in_effect(spec, (configmap or {}).get("data"))


def reconcile(kube: Kube, body: dict[str, Any], settings: OperatorSettings, engines: EngineClient | None = None
              ) -> Outcome:
    """Brings one InferenceService's children to the desired state and writes its status; with
    ``engines``, also brings each Ready engine pod's LoRA adapters to spec.loras."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    outcome = Outcome()
    try:
        spec = parse_spec(body.get("spec") or {})
        message = lora_name_problem(builders.served_model_name(name, spec), spec)
    except ValidationError as exc:
        message = spec_error_message(exc)
    if message is not None:
        outcome.warnings.append((status.INVALID_SPEC, message))
        outcome.status = _write_status(kube, body, status.invalid_spec_status(
            meta.get("generation"), message, _conditions(body), status.rfc3339(time.time())))
        return outcome

    token = secrets.token_urlsafe(32)
    if kube.create_if_missing(builders.build_admin_secret(name, namespace, token), owner=body):
        outcome.actions.append(f"Created Secret {builders.admin_secret_name(name)} (engine admin token)")
    in_effect = _settle_tuning_configmap(kube, body, spec, outcome)
    children = builders.build_children(name, namespace, spec, in_effect, settings)
    for manifest in (children.service, children.deployment):
        _apply(kube, manifest, body, outcome)
    if children.pdb is not None:
        _apply(kube, children.pdb, body, outcome)
    elif kube.delete("policy/v1", "PodDisruptionBudget", namespace, name):
        outcome.actions.append(f"Deleted PodDisruptionBudget {name} (one replica needs none)")
    if engines is not None:
        _sync_loras(kube, engines, body, spec, outcome)

    refreshed = refresh_status(kube, body, spec=spec, in_effect=in_effect, gateway_url=settings.gateway_url)
    outcome.warnings.extend(refreshed.warnings)
    outcome.status = refreshed.status
    return outcome


def _sync_loras(kube: Kube, engines: EngineClient, body: dict[str, Any], spec: InferenceServiceSpec,
                outcome: Outcome) -> None:
    """Loads and unloads adapters on the Ready pods until each holds spec.loras, and writes
    status.loras. New pods start with every adapter (the tuning file lists them); this keeps the
    running ones in step with spec edits."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    previous = (body.get("status") or {}).get("loras")
    if not spec.loras:
        if previous is not None:
            kube.patch_status(namespace, name, {"loras": None})
        return
    pods = kube.list("v1", "Pod", namespace, label_selector=builders.selector_string(name))
    ready = {p["metadata"]["name"]: admin_url(p["status"]["podIP"]) for p in pods
             if pod_ready(p) and (p.get("status") or {}).get("podIP")}
    token = builders.admin_token(kube.get("v1", "Secret", namespace, builders.admin_secret_name(name)))
    results = engines.sync_loras(ready, builders.lora_paths(spec), token)
    before = {(entry["name"], pod["pod"]): pod["state"] for entry in previous or [] for pod in entry.get("pods") or []}
    loras = []
    serving = sorted(pod for pod, states in results.items() if states)  # not pods started without LoRA
    for source in spec.loras:
        pods_state = []
        for pod in serving:
            error = results[pod].get(source.name)
            state = "Loaded" if error is None else "Failed"
            pods_state.append({"pod": pod, "state": state, "message": error})
            if before.get((source.name, pod)) != state:
                if error is None:
                    outcome.actions.append(f"LoRA adapter {source.name} loaded on pod {pod}")
                else:
                    outcome.warnings.append(
                        (status.LORA_FAILED, f"LoRA adapter {source.name} failed to load on pod {pod}: {error}"))
        loras.append({"name": source.name, "loadedPods": sum(p["state"] == "Loaded" for p in pods_state),
                      "pods": pods_state})
    if _without_nones(loras) != previous:
        kube.patch_status(namespace, name, {"loras": loras})


CONFLICT_RETRIES = 3


def _settle_tuning_configmap(kube: Kube, body: dict[str, Any], spec: InferenceServiceSpec,
                             outcome: Outcome) -> EngineSettings:
    """Reads the settings in effect and writes the ConfigMap back (seeded or clamped as needed), guarded
    by its resourceVersion: if the tuner wrote new settings in between, read again rather than undo them."""
    name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
    for attempt in range(CONFLICT_RETRIES):
        configmap = kube.get("v1", "ConfigMap", namespace, builders.tuning_configmap_name(name))
        in_effect = tuning_configmap.settings_in_effect(spec, (configmap or {}).get("data"))
        manifest = builders.build_tuning_configmap(name, namespace, spec, in_effect)
        if configmap is not None:
            manifest["metadata"]["resourceVersion"] = configmap["metadata"]["resourceVersion"]
        try:
            _apply_over(kube, manifest, body, outcome, configmap)
            return in_effect
        except KubeError as exc:
            if exc.status != 409 or attempt == CONFLICT_RETRIES - 1:
                raise
    raise AssertionError("the loop returns or raises")


def _apply(kube: Kube, manifest: dict[str, Any], owner: dict[str, Any], outcome: Outcome) -> None:
    meta = manifest["metadata"]
    before = kube.get(manifest["apiVersion"], manifest["kind"], meta["namespace"], meta["name"])
    _apply_over(kube, manifest, owner, outcome, before)


def _apply_over(kube: Kube, manifest: dict[str, Any], owner: dict[str, Any], outcome: Outcome,
                before: dict[str, Any] | None) -> None:
    """Applies ``manifest`` over ``before`` (None: absent) and records what changed."""
    meta = manifest["metadata"]
    after = kube.apply(manifest, owner=owner)
    kind, name = manifest["kind"], meta["name"]
    if before is None:
        outcome.actions.append(f"Created {kind} {name}")
    elif before["metadata"].get("resourceVersion") != after["metadata"].get("resourceVersion"):
        outcome.actions.append(f"Updated {kind} {name}")


# One status writer per service at a time in this process: pod events, the resync and the
# create/update handlers all refresh status, and each must see the status the last one wrote,
# or a new problem would be announced once per concurrent refresh.
_status_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)


def refresh_status(kube: Kube, body: dict[str, Any], *, spec: InferenceServiceSpec | None = None,
                   in_effect: EngineSettings | None = None, gateway_url: str | None = None) -> Outcome:
    """Recomputes the status from the children and writes it when it changed. Only the name and
    namespace of ``body`` are read: the service is read afresh. ``gateway_url``: the operator's setting."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    # A caller that applied a spec reports that spec's generation, even if a newer one has arrived.
    applied_generation = meta.get("generation") if spec is not None else None
    with _status_locks[(namespace, name)]:
        body = kube.get_inference_service(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return Outcome()
        if spec is None:
            try:
                spec = parse_spec(body.get("spec") or {})
            except ValidationError:
                return Outcome(status=body.get("status") or {})  # the next full reconcile reports it
        if in_effect is None:
            in_effect = read_settings_in_effect(kube, name, namespace, spec)
        deployment = kube.get("apps/v1", "Deployment", namespace, name)
        pods = kube.list("v1", "Pod", namespace, label_selector=builders.selector_string(name))
        unready = {p["metadata"]["name"] for p in pods if not pod_ready(p)}
        events = kube.pod_events(namespace, unready)
        new_status = status.compute_status(
            name=name, namespace=namespace, spec=spec, loras=(body.get("status") or {}).get("loras"),
            generation=applied_generation or body["metadata"].get("generation"),
            settings=in_effect, deployment=deployment, pods=pods, events=events,
            previous_conditions=_conditions(body), now=status.rfc3339(time.time()),
            url=builders.status_url(name, namespace, gateway_url),
        )
        operator_metrics.record_replicas(namespace, name, spec.replicas, new_status["readyReplicas"])
        return Outcome(warnings=_new_problems(body, new_status), status=_write_status(kube, body, new_status),
                       subject=body)


def _conditions(body: dict[str, Any]) -> list[dict[str, Any]]:
    return list((body.get("status") or {}).get("conditions") or [])


def _new_problems(body: dict[str, Any], new_status: dict[str, Any]) -> list[tuple[str, str]]:
    """A Degraded condition that appeared or changed reason since the last status: worth an Event."""
    old = {c.get("type"): c for c in _conditions(body)}.get("Degraded") or {}
    new = {c["type"]: c for c in new_status["conditions"]}["Degraded"]
    if new["status"] == "True" and (old.get("status") != "True" or old.get("reason") != new["reason"]):
        return [(new["reason"], new["message"])]
    return []


def _write_status(kube: Kube, body: dict[str, Any], new_status: dict[str, Any]) -> dict[str, Any]:
    """Patches only when something changed, so a quiet service causes no writes (and no watch events)."""
    old = body.get("status") or {}
    unchanged = all(
        key not in old if value is None else _without_nones(value) == old.get(key)
        for key, value in new_status.items()
    )
    if not unchanged:
        kube.patch_status(body["metadata"]["namespace"], body["metadata"]["name"], new_status)
    return new_status


def _without_nones(value: Any) -> Any:
    """What a merge patch leaves behind: keys set to None are removed."""
    if isinstance(value, dict):
        return {k: _without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nones(v) for v in value]
    return value
