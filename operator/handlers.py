"""kopf handlers: decorators only, each delegating to ``reconcile``.

- create / update / resume of an InferenceService -> one full, level-triggered reconcile;
- a daemon every ``resync_seconds`` -> the same reconcile, which heals drift
  (a deleted child, a lost event) and keeps the status fresh;
- any change of an engine pod or Deployment -> a status refresh of its
  InferenceService, so Ready and Degraded follow the pods within a second;
- a change of a tuning ConfigMap (the control loop wrote new settings) -> the
  same reconcile, which renders them into the children and status.engine;
- a daemon per service with tuning or autoscaling -> ``control_loop.ControlLoop``.

Handlers are registered on an explicit registry by ``register`` (no module
globals), so the CLI and the tests build the operator the same way.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import kopf

from kvpilot import kube_contract
from kvpilot.operator import builders, control_loop, operator_metrics, reconcile
from kvpilot.operator.engine_client import EngineClient
from kvpilot.operator.kube import Kube
from kvpilot.operator.settings import OperatorSettings

ANNOTATION_PREFIX = kube_contract.GROUP
FINALIZER = f"{kube_contract.GROUP}/finalizer"
# A failed reconcile (API server hiccup, a conflict) is retried this soon.
RETRY_BACKOFF_SECONDS = 5.0


@dataclass(frozen=True)
class OperatorContext:
    """What every handler needs: built once by the CLI, shared by all handlers."""

    settings: OperatorSettings
    kube: Kube
    engines: EngineClient


def configure_kopf(kopf_settings: kopf.OperatorSettings, log_level: str) -> None:
    # kopf keeps its bookkeeping in annotations under our group, never in status: the
    # status schema is structural, and status belongs to the reconcile.
    kopf_settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    kopf_settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    kopf_settings.persistence.finalizer = FINALIZER
    # The CRD is installed before the operator (Helm's crds/), so there is nothing to discover
    # later, and no RBAC is needed to watch CRDs or namespaces.
    kopf_settings.scanning.disabled = True
    kopf_settings.posting.level = logging.INFO
    kopf_settings.posting.reporting_component = "kvpilot-operator"  # the "From" of our Events
    kopf_settings.execution.max_workers = 8
    logging.getLogger().setLevel(log_level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # one line per liveness probe otherwise


def post_outcome(body: Any, outcome: reconcile.Outcome) -> None:
    for action in outcome.actions:
        kopf.info(body, reason="Applied", message=action)
    for reason, message in outcome.warnings:
        kopf.warn(body, reason=reason, message=message)


def register(registry: kopf.OperatorRegistry, context: OperatorContext) -> None:
    resource = (kube_contract.GROUP, kube_contract.VERSION, kube_contract.PLURAL)
    child_labels = {builders.MANAGED_BY_LABEL: builders.MANAGED_BY}

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings, context.settings.log_level)

    @kopf.on.resume(*resource, registry=registry, id="reconcile", backoff=RETRY_BACKOFF_SECONDS)
    @kopf.on.create(*resource, registry=registry, id="reconcile", backoff=RETRY_BACKOFF_SECONDS)
    @kopf.on.update(*resource, registry=registry, id="reconcile", backoff=RETRY_BACKOFF_SECONDS)
    def reconcile_service(body: kopf.Body, **_: Any) -> None:
        post_outcome(body, reconcile.reconcile(context.kube, _plain(body), context.settings, context.engines))

    # A daemon rather than a timer: kopf would post a "succeeded" Event for every timer run.
    # On deletion it gets a few seconds to finish a reconcile before kopf cancels it.
    @kopf.daemon(*resource, registry=registry, id="resync", cancellation_backoff=5.0, cancellation_timeout=1.0)
    def resync_service(body: kopf.Body, stopped: kopf.DaemonStopped, logger: logging.Logger, **_: Any) -> None:
        while not stopped.wait(context.settings.resync_seconds):
            try:
                post_outcome(body, reconcile.reconcile(context.kube, _plain(body), context.settings, context.engines))
            except Exception:  # the next resync retries; the daemon must outlive API hiccups
                logger.exception("resync failed")
        operator_metrics.forget(body["metadata"]["namespace"], body["metadata"]["name"])

    @kopf.on.event("apps", "v1", "deployments", labels=child_labels, registry=registry, id="deployment-changed")
    @kopf.on.event("v1", "pods", labels=child_labels, registry=registry, id="pod-changed")
    def child_changed(body: kopf.Body, namespace: str, **_: Any) -> None:
        owner_name = (body.get("metadata", {}).get("labels") or {}).get(builders.INSTANCE_LABEL)
        if not owner_name:
            return
        outcome = reconcile.refresh_status(context.kube, {"metadata": {"name": owner_name, "namespace": namespace}},
                                           gateway_url=context.settings.gateway_url)
        if outcome.subject is not None:
            post_outcome(outcome.subject, outcome)

    @kopf.on.event("v1", "configmaps", labels=child_labels, registry=registry, id="tuning-configmap-changed")
    def tuning_configmap_changed(body: kopf.Body, event: dict[str, Any], namespace: str, **_: Any) -> None:
        owner_name = (body.get("metadata", {}).get("labels") or {}).get(builders.INSTANCE_LABEL)
        if event.get("type") is None or not owner_name \
                or body["metadata"]["name"] != builders.tuning_configmap_name(owner_name):
            return  # the initial listing: the resume handlers reconcile every service anyway
        owner = context.kube.get_inference_service(namespace, owner_name)
        if owner is not None and not owner["metadata"].get("deletionTimestamp"):
            post_outcome(owner, reconcile.reconcile(context.kube, owner, context.settings, context.engines))

    loop = control_loop.ControlLoop(context.kube, context.engines, context.settings)

    @kopf.daemon(*resource, registry=registry, initial_delay=control_loop.TICK_SECONDS, cancellation_timeout=30.0,
                 when=lambda spec, **_: control_loop.wants_loop(dict(spec)))
    def control_service(body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any) -> None:
        loop.run(lambda: _plain(body), stopped, control_loop.post_event)


def _plain(body: kopf.Body) -> dict[str, Any]:
    """kopf's Body is a read-only view; the reconcile works on plain dicts."""
    return copy.deepcopy(dict(body))
