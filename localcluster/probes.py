"""Container probes (httpGet, tcpSocket, exec) with Kubernetes' timing and thresholds."""

from __future__ import annotations

import http.client
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field


def resolve_port(port: int | str, container: dict) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ValueError(f"probe names port {port!r}, which the container does not declare")


def run_probe(probe: dict, container: dict, pod_ip: str, env: dict[str, str],
              exec_prefix: tuple[str, ...] = ()) -> tuple[bool, str]:
    """One probe attempt: (success, message). An exec probe's command runs behind ``exec_prefix``
    (``podman exec NAME`` for a container run from its image)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            spec = probe["httpGet"]
            host = spec.get("host") or pod_ip
            port = resolve_port(spec["port"], container)
            if spec.get("scheme", "HTTP").upper() == "HTTPS":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    host, port, timeout=timeout, context=ssl._create_unverified_context()
                )  # kubelet does not verify probe certificates either
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
            try:
                headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
                conn.request("GET", spec.get("path", "/"), headers=headers)
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400, f"HTTP probe failed with statuscode: {status}"
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            port = resolve_port(spec["port"], container)
            with socket.create_connection((spec.get("host") or pod_ip, port), timeout=timeout):
                return True, ""
        if "exec" in probe:
            result = subprocess.run(
                [*exec_prefix, *probe["exec"]["command"]], env=env, capture_output=True, timeout=timeout, check=False
            )
            output = (result.stdout + result.stderr).decode(errors="replace").strip()
            return result.returncode == 0, output or f"exit code {result.returncode}"
    except (OSError, ValueError, subprocess.TimeoutExpired, http.client.HTTPException) as exc:
        return False, f"probe failed: {exc}"
    return True, "probe kind not supported by the local kubelet; treated as passing"


@dataclass
class ProbeState:
    """Tracks one probe of one container run: when to probe next and the current verdict."""

    probe: dict
    started_at: float
    result: bool
    successes: int = 0
    failures: int = 0
    next_at: float = field(default=0.0)
    message: str = ""

    def __post_init__(self) -> None:
        self.next_at = self.started_at + float(self.probe.get("initialDelaySeconds", 0))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, success: bool, message: str, now: float) -> None:
        self.next_at = now + float(self.probe.get("periodSeconds", 10))
        self.message = message
        if success:
            self.successes += 1
            self.failures = 0
            if self.successes >= int(self.probe.get("successThreshold", 1)):
                self.result = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= int(self.probe.get("failureThreshold", 3)):
                self.result = False


def new_probe_state(probe: dict | None, initial: bool) -> ProbeState | None:
    return None if probe is None else ProbeState(probe, time.monotonic(), initial)
