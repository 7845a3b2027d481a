"""Leader election over a Lease (coordination.k8s.io/v1), so the chart can run two operator replicas.

Only the holder of the Lease runs the operator; a standby waits and takes over
when the holder stops renewing. The rules are client-go's:

- the holder renews every third of the lease; when it has not managed to for
  two thirds of it, it must stop at once, before anyone else may take over;
- a standby takes the Lease when it is free (no holder: the last one handed it
  back on a clean exit) or when it has seen the same record, unrenewed, for
  ``lease_seconds`` by its own clock (so clock skew between nodes does not matter);
- every write carries the resourceVersion it read, so of two standbys racing for
  an expired Lease exactly one wins.

After a clean exit the standby takes over within ``retry_seconds`` (2 s); after a
crash, within ``lease_seconds + retry_seconds`` (15 + 2 s by default).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvpilot.operator.kube import Kube, KubeError

log = logging.getLogger("kvpilot.operator.leader_election")

API_VERSION = "coordination.k8s.io/v1"


@dataclass(frozen=True)
class LeaseConfig:
    namespace: str
    name: str
    identity: str  # this replica (its pod name)
    lease_seconds: float = 15.0

    def __post_init__(self) -> None:
        if self.lease_seconds < 3:
            raise ValueError(f"leader election needs a lease of at least 3 s, got {self.lease_seconds}")

    @property
    def renew_seconds(self) -> float:
        return self.lease_seconds / 3

    @property
    def renew_deadline_seconds(self) -> float:
        """Less than the lease: a holder that cannot renew stops before anyone else may take over."""
        return self.lease_seconds * 2 / 3

    @property
    def retry_seconds(self) -> float:
        return min(2.0, self.renew_seconds)


def _micro_time() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, kube: Kube, config: LeaseConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.config = config
        self.clock = clock
        self._observed: tuple[Any, ...] | None = None  # the holder's last record we saw, and when
        self._observed_at = 0.0

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this replica holds the Lease afterwards."""
        config = self.config
        lease = self.kube.get(API_VERSION, "Lease", config.namespace, config.name)
        now = _micro_time()
        if lease is None:
            return self.kube.create_if_missing(self._manifest(now, now, transitions=0))
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        duration = spec.get("leaseDurationSeconds") or config.lease_seconds
        if holder not in (None, config.identity) and self.clock() - self._observed_at < duration:
            return False
        transitions = (spec.get("leaseTransitions") or 0) + (holder != config.identity)
        acquired = spec.get("acquireTime") if holder == config.identity else now
        manifest = self._manifest(acquired or now, now, transitions)
        manifest["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
        try:
            self.kube.apply(manifest)
        except KubeError as exc:
            if exc.status == 409:  # another replica wrote first
                return False
            raise
        if holder != config.identity:
            log.info("%s: now the leader (Lease %s/%s, previous holder %s)", config.identity, config.namespace,
                     config.name, holder or "none")
        return True

    def wait_until_leader(self) -> None:
        """Blocks until this replica holds the Lease."""
        log.info("%s: standing by for Lease %s/%s", self.config.identity, self.config.namespace, self.config.name)
        while not self._attempt():
            time.sleep(self.config.retry_seconds)

    def keep_renewing(self, lost: Callable[[], None], stop: threading.Event) -> None:
        """Renews until ``stop``; calls ``lost`` once no renewal has succeeded for the renew deadline.

        A watchdog thread keeps that deadline, so a call to a hung API server cannot hold it up.
        """
        last_renewed = self.clock()

        def watchdog() -> None:
            while not stop.wait(self.config.retry_seconds):
                if self.clock() - last_renewed >= self.config.renew_deadline_seconds:
                    log.error("%s: could not renew Lease %s/%s for %.0f s: stopping", self.config.identity,
                              self.config.namespace, self.config.name, self.clock() - last_renewed)
                    lost()
                    return

        threading.Thread(target=watchdog, daemon=True).start()
        pause = self.config.renew_seconds
        while not stop.wait(pause):
            renewed = self._attempt()
            if renewed:
                last_renewed = self.clock()
            pause = self.config.renew_seconds if renewed else self.config.retry_seconds

    def release(self) -> None:
        """Hands the Lease back (if still ours) so that a standby takes over at once."""
        try:
            lease = self.kube.get(API_VERSION, "Lease", self.config.namespace, self.config.name)
            if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.config.identity:
                return
            now = _micro_time()
            manifest = self._manifest(now, now, (lease.get("spec") or {}).get("leaseTransitions") or 0)
            manifest["spec"].update(holderIdentity="", leaseDurationSeconds=1)
            manifest["metadata"]["resourceVersion"] = lease["metadata"]["resourceVersion"]
            self.kube.apply(manifest)
            log.info("%s: handed Lease %s/%s back", self.config.identity, self.config.namespace, self.config.name)
        except KubeError as exc:
            log.warning("%s: could not hand the Lease back (%s); a standby takes over when it expires",
                        self.config.identity, exc)

    def _attempt(self) -> bool:
        try:
            return self.try_acquire_or_renew()
        except Exception as exc:  # noqa: BLE001: an API server hiccup or outage; the deadline guards the rest
            log.warning("%s: Lease %s/%s: %s", self.config.identity, self.config.namespace, self.config.name, exc)
            return False

    def _manifest(self, acquired: str, renewed: str, transitions: int) -> dict[str, Any]:
        config = self.config
        return {
            "apiVersion": API_VERSION,
            "kind": "Lease",
            "metadata": {"name": config.name, "namespace": config.namespace,
                         "labels": {"app.kubernetes.io/name": "kvpilot", "app.kubernetes.io/component": "operator"}},
            "spec": {
                "holderIdentity": config.identity,
                "leaseDurationSeconds": int(config.lease_seconds),
                "acquireTime": acquired,
                "renewTime": renewed,
                "leaseTransitions": transitions,
            },
        }
