"""Operator settings, read once from the environment (``KVPILOT_*``) and then frozen.

The Helm chart sets these on the operator's Deployment; a laptop run takes the
same variables (or the defaults) and the ``kvpilot operator`` flags override them.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpilot import __version__


class SettingsError(ValueError):
    """An environment variable holds a value the operator cannot use; the message names it."""


@dataclass(frozen=True)
class OperatorSettings:
    # Engine image for InferenceServices that do not name one.
    engine_image: str = f"ghcr.io/kvpilot/kvpilot:{__version__}"
    engine_image_pull_policy: str | None = None
    # Seconds the engine gets to finish in-flight requests after SIGTERM (its --shutdown-grace-period).
    engine_shutdown_grace_seconds: int = 30
    # Seconds a terminating pod keeps serving before SIGTERM, so endpoints drop it first.
    engine_drain_seconds: int = 5
    # Seconds the startup probe allows for loading the model before the kubelet restarts the pod.
    engine_startup_seconds: int = 1800
    # Seconds between level-triggered resyncs of every InferenceService (children and status).
    resync_seconds: float = 30.0
    # Default seconds between tuning decisions (spec.tuning.intervalSeconds overrides).
    tuning_interval_seconds: int = 30
    # Listen on the pod IP instead of 0.0.0.0: for clusters whose "pods" share one network
    # namespace (the local test cluster), where every engine would otherwise claim the same port.
    engine_bind_pod_ip: bool = False
    log_level: str = "INFO"
    # Port of the /healthz endpoint (0 disables it).
    health_port: int = 8080
    # Port of the operator's own Prometheus /metrics: tuning decisions, scrape errors (0 disables it).
    metrics_port: int = 8081
    # Address the /healthz and /metrics endpoints listen on (the pod IP on the local cluster, where
    # pods share the host's network).
    listen_address: str = "0.0.0.0"
    # Leader election: the Lease "NAMESPACE/NAME" that one replica at a time holds (None: off, this
    # process is the only operator), how long an unrenewed Lease lasts, and this replica's name in it.
    leader_election_lease: tuple[str, str] | None = None
    leader_election_lease_seconds: float = 15.0
    leader_election_identity: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    # Seconds of lower demand the autoscaler waits out before removing a replica.
    scale_down_stabilization_seconds: float = 300.0
    # Base URL of the kvpilot gateway (the chart's gateway.url), reported as every service's
    # status.url; None: each service's own in-cluster Service URL.
    gateway_url: str | None = None
    # Where the gateway's pods run, (namespace, label selector): the autoscaler reads the requests
    # they hold for each service. None: no gateway to read.
    gateway_pods: tuple[str, str] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorSettings:
        env = os.environ if env is None else env
        defaults = cls()
        return cls(
            engine_image=env.get("KVPILOT_ENGINE_IMAGE") or defaults.engine_image,
            engine_image_pull_policy=_choice(env, "KVPILOT_ENGINE_IMAGE_PULL_POLICY", ("Always", "IfNotPresent", "Never")),
            engine_shutdown_grace_seconds=_int(env, "KVPILOT_ENGINE_SHUTDOWN_GRACE_SECONDS", defaults.engine_shutdown_grace_seconds, 0),
            engine_drain_seconds=_int(env, "KVPILOT_ENGINE_DRAIN_SECONDS", defaults.engine_drain_seconds, 0),
            engine_startup_seconds=_int(env, "KVPILOT_ENGINE_STARTUP_SECONDS", defaults.engine_startup_seconds, 10),
            resync_seconds=_float(env, "KVPILOT_RESYNC_SECONDS", defaults.resync_seconds, 1.0),
            tuning_interval_seconds=_int(env, "KVPILOT_TUNING_INTERVAL_SECONDS", defaults.tuning_interval_seconds, 5),
            engine_bind_pod_ip=_bool(env, "KVPILOT_ENGINE_BIND_POD_IP", defaults.engine_bind_pod_ip),
            log_level=_choice(env, "KVPILOT_LOG_LEVEL", ("DEBUG", "INFO", "WARNING", "ERROR"), upper=True)
            or defaults.log_level,
            health_port=_int(env, "KVPILOT_HEALTH_PORT", defaults.health_port, 0),
            metrics_port=_int(env, "KVPILOT_METRICS_PORT", defaults.metrics_port, 0),
            scale_down_stabilization_seconds=_float(env, "KVPILOT_SCALE_DOWN_STABILIZATION_SECONDS",
                                                    defaults.scale_down_stabilization_seconds, 0.0),
            listen_address=env.get("KVPILOT_LISTEN_ADDRESS") or defaults.listen_address,
            leader_election_lease=_lease(env, "KVPILOT_LEADER_ELECTION_LEASE"),
            leader_election_lease_seconds=_float(env, "KVPILOT_LEADER_ELECTION_LEASE_SECONDS",
                                                 defaults.leader_election_lease_seconds, 5.0),
            leader_election_identity=env.get("KVPILOT_POD_NAME") or defaults.leader_election_identity,
            gateway_url=(env.get("KVPILOT_GATEWAY_URL") or "").rstrip("/") or None,
            gateway_pods=_gateway_pods(env, "KVPILOT_GATEWAY_NAMESPACE", "KVPILOT_GATEWAY_SELECTOR"),
        )

    @property
    def termination_grace_seconds(self) -> int:
        """Pod terminationGracePeriodSeconds: the drain sleep, then the engine's own grace, plus a margin."""
        return self.engine_drain_seconds + self.engine_shutdown_grace_seconds + 5


def _int(env: Mapping[str, str], name: str, default: int, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: must be an integer >= {minimum}") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r}: must be an integer >= {minimum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: must be a number >= {minimum}") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r}: must be a number >= {minimum}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r}: must be true or false")


def _lease(env: Mapping[str, str], name: str) -> tuple[str, str] | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    namespace, _, lease = raw.partition("/")
    if not namespace or not lease or "/" in lease:
        raise SettingsError(f"{name}={raw!r}: must be NAMESPACE/NAME of the Lease to hold")
    return namespace, lease


def _gateway_pods(env: Mapping[str, str], namespace_name: str, selector_name: str) -> tuple[str, str] | None:
    namespace, selector = env.get(namespace_name) or "", env.get(selector_name) or ""
    if not namespace and not selector:
        return None
    if not namespace or not selector:
        missing = namespace_name if not namespace else selector_name
        raise SettingsError(f"{missing} is empty: {namespace_name} and {selector_name} (the gateway pods' label "
                            "selector) go together")
    return namespace, selector


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], *, upper: bool = False) -> str | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    value = raw.upper() if upper else raw
    if value not in choices:
        raise SettingsError(f"{name}={raw!r}: must be one of {', '.join(choices)}")
    return value
