"""Starts the operator: connects, checks the CRD is installed, registers handlers, runs kopf."""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes import client as k8s_client

from kvpilot.operator import handlers, operator_metrics
from kvpilot.operator.engine_client import EngineClient
from kvpilot.operator.kube import Kube, KubeError, load_api_client
from kvpilot.operator.settings import OperatorSettings

log = logging.getLogger("kvpilot.operator")


def connection_info(configuration: k8s_client.Configuration) -> kopf.ConnectionInfo:
    """kopf's credentials from the same configuration our own client uses (in-cluster or kubeconfig)."""
    header = configuration.get_api_key_with_prefix("BearerToken") or \
        configuration.get_api_key_with_prefix("authorization")
    scheme, token = None, None
    if header:
        parts = header.split(" ", 1)
        scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, parts[0])
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def build_registry(settings: OperatorSettings, kube: Kube,
                   configuration: k8s_client.Configuration) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return connection_info(configuration)

    handlers.register(registry, handlers.OperatorContext(settings=settings, kube=kube, engines=EngineClient()))
    return registry


def run_operator(settings: OperatorSettings, *, namespaces: list[str] | None, kubeconfig: str | None = None,
                 context: str | None = None) -> int:
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_client = load_api_client(kubeconfig, context)
    kube = Kube(api_client)
    try:
        installed = kube.crd_installed()
    except KubeError as exc:
        raise SystemExit(f"kvpilot operator: cannot reach the API server: {exc}") from None
    if not installed:
        raise SystemExit("kvpilot operator: the InferenceService CRD is not installed; apply it first "
                         "(`kvpilot crd | kubectl apply -f -`, or install the Helm chart)")
    registry = build_registry(settings, kube, api_client.configuration)
    operator_metrics.serve(settings.metrics_port)
    liveness = f"http://0.0.0.0:{settings.health_port}/healthz" if settings.health_port else None
    scope = "all namespaces" if namespaces is None else ", ".join(namespaces)
    log.info("kvpilot operator watching %s; engine image %s", scope, settings.engine_image)
    kopf.run(
        registry=registry,
        standalone=True,  # one replica; no peering objects or their RBAC
        clusterwide=namespaces is None,
        namespaces=namespaces or (),
        liveness_endpoint=liveness,
    )
    return 0
