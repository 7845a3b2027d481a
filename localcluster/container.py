"""One container of a pod as a local process: start, watch, probe, restart, stop."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.localcluster import podman
from kvpilot.localcluster.nodes import now_rfc3339
from kvpilot.localcluster.probes import ProbeState, new_probe_state, run_probe

BACKOFF_BASE_S = 1.0  # kubelet's is 10s; short here so tests see restarts quickly
BACKOFF_MAX_S = 60.0
BACKOFF_RESET_AFTER_S = 120.0


class RunCommandError(RuntimeError):
    """The container's command cannot be run (missing, not executable, no command at all)."""


@dataclass
class ContainerRun:
    spec: dict
    log_path: Path
    init: bool = False
    process: subprocess.Popen | None = None
    started_at: str | None = None
    started_monotonic: float = 0.0
    restart_count: int = 0
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    terminated: dict | None = None
    last_state: dict | None = None
    backoff_until: float = 0.0
    backoff_s: float = BACKOFF_BASE_S
    readiness: ProbeState | None = None
    liveness: ProbeState | None = None
    startup: ProbeState | None = None
    env: dict[str, str] = field(default_factory=dict)
    # Image mode (podman.py): the process is `podman run`, and this names its container.
    podman: str | None = None
    container: str | None = None

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def running(self) -> bool:
        return self.process is not None and self.terminated is None

    @property
    def started(self) -> bool:
        return self.running and (self.startup is None or self.startup.result)

    @property
    def ready(self) -> bool:
        return self.started and (self.readiness is None or self.readiness.result)

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, container: str | None = None) -> None:
        """Runs ``argv`` (``podman run ... --name container`` in image mode); a command that cannot run
        raises RunCommandError."""
        if not argv:
            raise RunCommandError(
                "the container sets no command: the local kubelet ignores images, "
                "so every container needs `command` (and `args`)"
            )
        executable = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=env.get("PATH"))
        if executable is None:
            raise RunCommandError(
                f'exec: "{argv[0]}": executable file not found in $PATH ({env.get("PATH")})'
            )
        if self.log_path.exists():
            self.log_path.replace(self.log_path.with_suffix(".previous.log"))
        with open(self.log_path, "ab") as log:
            try:
                self.process = subprocess.Popen(
                    [executable, *argv[1:]],
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stop takes its children too
                    close_fds=True,
                )
            except OSError as exc:
                raise RunCommandError(f"exec: {argv[0]}: {exc.strerror or exc}") from exc
        self.env = env
        self.container = container
        self.started_at = now_rfc3339()
        self.started_monotonic = time.monotonic()
        self.waiting = None
        self.terminated = None
        self.readiness = new_probe_state(self.spec.get("readinessProbe"), initial=False)
        self.liveness = new_probe_state(self.spec.get("livenessProbe"), initial=True)
        self.startup = new_probe_state(self.spec.get("startupProbe"), initial=False)

    def fail_to_start(self, reason: str, message: str) -> None:
        self.waiting = (reason, message)
        self._schedule_backoff()

    def poll(self) -> bool:
        """Notices an exit; returns True if the process has just terminated."""
        if not self.running:
            return False
        assert self.process is not None
        code = self.process.poll()
        if code is None:
            return False
        self._record_exit(code)
        return True

    def _record_exit(self, code: int, reason: str | None = None) -> None:
        if code < 0:  # killed by a signal: report as a shell would
            code = 128 - code
        self.terminated = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": self.started_at,
            "finishedAt": now_rfc3339(),
            "containerID": self.container_id,
        }
        self.readiness = self.liveness = self.startup = None

    @property
    def container_id(self) -> str:
        if self.container:
            return f"podman://{self.container}"
        return f"kvpilot://{self.process.pid}" if self.process else ""

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        return (self.podman, "exec", self.container) if self.podman and self.container else ()

    def prepare_restart(self) -> None:
        """After an exit under a restarting policy: back off, then start again."""
        if time.monotonic() - self.started_monotonic > BACKOFF_RESET_AFTER_S:
            self.backoff_s = BACKOFF_BASE_S
        self.last_state = {"terminated": self.terminated}
        self.restart_count += 1
        self.process = None
        self.terminated = None
        self.waiting = (
            "CrashLoopBackOff",
            f"back-off {self.backoff_s:.0f}s restarting failed container={self.name}",
        )
        self._schedule_backoff()

    def _schedule_backoff(self) -> None:
        self.backoff_until = time.monotonic() + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, BACKOFF_MAX_S)

    def can_start(self) -> bool:
        return self.process is None and time.monotonic() >= self.backoff_until

    def probe(self, pod_ip: str) -> tuple[str | None, list[str]]:
        """Runs due probes: (a reason to kill the container, if liveness/startup failed;
        a message per failed attempt, for the pod's events)."""
        now = time.monotonic()
        failed: list[str] = []
        if self.startup is not None and not self.startup.result:
            if self.startup.due(now):
                ok, message = run_probe(self.startup.probe, self.spec, pod_ip, self.env, self.exec_prefix)
                self.startup.record(ok, message, now)
                if not ok:
                    failed.append(f"Startup probe failed: {message}")
                    if self.startup.failures >= int(self.startup.probe.get("failureThreshold", 3)):
                        return f"startup probe failed: {message}", failed
            return None, failed
        if self.liveness is not None and self.liveness.due(now):
            ok, message = run_probe(self.liveness.probe, self.spec, pod_ip, self.env, self.exec_prefix)
            self.liveness.record(ok, message, now)
            if not ok:
                failed.append(f"Liveness probe failed: {message}")
            if not self.liveness.result:
                return f"liveness probe failed: {message}", failed
        if self.readiness is not None and self.readiness.due(now):
            ok, message = run_probe(self.readiness.probe, self.spec, pod_ip, self.env, self.exec_prefix)
            self.readiness.record(ok, message, now)
            if not ok:
                failed.append(f"Readiness probe failed: {message}")
        return None, failed

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def kill_group(self) -> None:
        """SIGKILLs whatever is left of the process group, leader gone or not, and in image mode the
        container (it outlives a killed `podman run`)."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.podman and self.container:
            podman.remove(self.podman, self.container)

    def stop(self, grace_s: float, reason: str | None = None) -> None:
        """SIGTERM, SIGKILL after ``grace_s``; records the exit."""
        if not self.running:
            self.kill_group()
            return
        assert self.process is not None
        self.signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=max(grace_s, 0.0))
        except subprocess.TimeoutExpired:
            self.kill_group()
            code = self.process.wait()
        self.kill_group()
        self._record_exit(code, reason)

    def status(self) -> dict:
        if self.running:
            state = {"running": {"startedAt": self.started_at}}
        elif self.terminated is not None:
            state = {"terminated": self.terminated}
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        status = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": self.last_state or {},
        }
        if self.process is not None:
            status["containerID"] = self.container_id
        return status
