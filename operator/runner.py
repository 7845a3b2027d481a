"""Starts the operator: connects, checks the CRD is installed, waits to lead, registers handlers, runs kopf.

With leader election on (the chart's default), a replica stands by, answering its
liveness probe, until it holds the Lease; it then runs kopf while a thread renews
the Lease. A leader that cannot renew exits at once (before a standby may take
over, see ``leader_election.py``) and its container restarts as a standby; one
that stops cleanly hands the Lease back.
"""

from __future__ import annotations

import contextlib
import http.server
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import kopf
from kubernetes import client as k8s_client

from kvpilot.operator import handlers, operator_metrics
from kvpilot.operator.engine_client import EngineClient
from kvpilot.operator.kube import Kube, KubeError, load_api_client
from kvpilot.operator.leader_election import LeaderElector, LeaseConfig
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
    operator_metrics.serve(settings.metrics_port, settings.listen_address)
    elector = None
    if settings.leader_election_lease is not None:
        namespace, name = settings.leader_election_lease
        elector = LeaderElector(kube, LeaseConfig(namespace, name, settings.leader_election_identity,
                                                  lease_seconds=settings.leader_election_lease_seconds))
        with _healthy_while_standing_by(settings):
            elector.wait_until_leader()
    stop = threading.Event()
    if elector is not None:
        threading.Thread(target=elector.keep_renewing, args=(_exit_now, stop), daemon=True).start()
    liveness = f"http://{settings.listen_address}:{settings.health_port}/healthz" if settings.health_port else None
    scope = "all namespaces" if namespaces is None else ", ".join(namespaces)
    log.info("kvpilot operator watching %s; engine image %s", scope, settings.engine_image)
    try:
        kopf.run(
            registry=registry,
            standalone=True,  # leader election is ours (a Lease), not kopf's peering by priority
            clusterwide=namespaces is None,
            namespaces=namespaces or (),
            liveness_endpoint=liveness,
        )
    finally:
        stop.set()
        if elector is not None:
            elector.release()
    return 0


def _exit_now() -> None:
    """Leadership lost: stop everything at once; a graceful kopf stop could outlast the Lease."""
    logging.shutdown()
    os._exit(1)


@contextlib.contextmanager
def _healthy_while_standing_by(settings: OperatorSettings) -> Iterator[None]:
    """Answers the liveness probe (``/healthz``) while kopf, which serves it when leading, is not running."""
    if not settings.health_port:
        yield
        return

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *_: Any) -> None:  # one line per probe otherwise
            pass

    server = http.server.ThreadingHTTPServer((settings.listen_address, settings.health_port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
