"""What the operator writes into the cluster and the gateway reads back: the InferenceService
resource's API names, the labels on its children, when a pod counts as Ready, how an engine pod
is addressed, and which namespaces a component watches.

Like ``engine_contract`` (which it builds on for the engine's port), it imports nothing heavy,
so the gateway never imports the operator, nor the operator the gateway.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kvpilot.engine_contract import ENGINE_PORT

# --- the InferenceService resource ------------------------------------------------------

GROUP = "kvpilot.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"

# --- labels on everything the operator makes for a service ------------------------------

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"  # the InferenceService's name
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
APP_NAME = "kvpilot"
ENGINE_COMPONENT = "engine"
MANAGED_BY = "kvpilot-operator"
ENGINE_LABELS = {NAME_LABEL: APP_NAME, COMPONENT_LABEL: ENGINE_COMPONENT, MANAGED_BY_LABEL: MANAGED_BY}

# --- pods ---------------------------------------------------------------------------------


def pod_ready(pod: Mapping[str, Any]) -> bool:
    """The pod's Ready condition is True (what Services and the gateway route by)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def pod_url(pod_ip: str) -> str:
    """The base URL of an engine pod's OpenAI API and /metrics."""
    return f"http://{pod_ip}:{ENGINE_PORT}"


# --- namespaces ---------------------------------------------------------------------------

NAMESPACES_ENV = "KVPILOT_NAMESPACES"  # comma-separated, or "*" for all
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def watched_namespaces(all_namespaces: bool, namespaces: list[str] | None, env: Mapping[str, str],
                       command: str) -> list[str] | None:
    """Namespaces a component watches, or None for all of them: the flags, else NAMESPACES_ENV, else
    the pod's own namespace; raises SystemExit naming ``command``'s flags when none says."""
    if all_namespaces:
        return None
    if namespaces:
        return list(namespaces)
    configured = [ns.strip() for ns in env.get(NAMESPACES_ENV, "").split(",") if ns.strip()]
    if configured == ["*"]:
        return None
    if configured:
        return configured
    if os.path.exists(NAMESPACE_FILE):
        with open(NAMESPACE_FILE) as f:
            return [f.read().strip()]
    raise SystemExit(f"{command}: give --namespace NS (repeatable) or --all-namespaces (or set {NAMESPACES_ENV})")
