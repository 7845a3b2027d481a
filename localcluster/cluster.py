"""`up`, `down`, `status` of the local cluster, and `stop` / `start` / `restart` of one control-plane
component (faults for the e2e tests): one code path for the CLI and the tests."""

from __future__ import annotations

import random
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TextIO

from kvpilot.localcluster import build, components, podman, processes
from kvpilot.localcluster.api import ApiError, KubeApi
from kvpilot.localcluster.kubeconfig import write_kubeconfig
from kvpilot.localcluster.nodes import NODE_NAMES
from kvpilot.localcluster.pki import ensure_pki
from kvpilot.localcluster.state import ClusterRecord, ProcessRecord, StateDir

PORT_ATTEMPTS = 4
CONTAINER_MODES = ("process", "podman")
READY_TIMEOUT_S = 120.0
COMPONENT_STOP_S = 15.0  # SIGTERM's grace: the API server drains its requests, etcd closes its store


class ClusterError(RuntimeError):
    """`up` could not bring the cluster up; the message says which component and why."""


class Health(Enum):
    RUNNING = "running"
    CRASHED = "crashed"
    STOPPED = "stopped"  # by `stop_component`, or `up` has not reached it yet


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int | None  # None when stopped
    health: Health
    log: str


@dataclass(frozen=True)
class UpResult:
    record: ClusterRecord
    already_running: bool
    seconds: float


def component_statuses(record: ClusterRecord, state: StateDir) -> list[ComponentStatus]:
    """Every component in start order; one missing from the record is stopped."""
    recorded = {p.name: p for p in record.processes}
    statuses = []
    for name in components.ORDER:
        p = recorded.get(name)
        if p is None:
            statuses.append(ComponentStatus(name, None, Health.STOPPED, str(_log_path(state, name))))
        else:
            health = Health.RUNNING if processes.is_alive(p.pid, p.start_time) else Health.CRASHED
            statuses.append(ComponentStatus(name, p.pid, health, p.log))
    return statuses


def _log_path(state: StateDir, name: str) -> Path:
    return state.logs / f"{name}.log"


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _ssl_context(state: StateDir) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(state.pki / "ca.crt"))
    context.load_cert_chain(str(state.pki / "admin.crt"), str(state.pki / "admin.key"))
    return context


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def _health_check(name: str, state: StateDir, ports: dict[str, int]):
    """A callable telling whether ``name`` serves yet; None where liveness is all we check."""
    if name == "etcd":
        return lambda: _http_ok(f"http://127.0.0.1:{ports['etcd']}/health")
    if name == "kube-apiserver":
        context = _ssl_context(state)
        return lambda: _http_ok(f"https://127.0.0.1:{ports['apiserver']}/readyz", context)
    if name == "kubelet":
        context = _ssl_context(state)
        return lambda: _http_ok(f"https://127.0.0.1:{ports['kubelet']}/healthz", context)
    if name in ("kube-controller-manager", "kube-scheduler"):
        port = ports["controller-manager" if name == "kube-controller-manager" else "scheduler"]
        insecure = ssl._create_unverified_context()  # self-signed serving cert they generate
        return lambda: _http_ok(f"https://127.0.0.1:{port}/healthz", insecure)
    return None


class LocalCluster:
    def __init__(self, state_dir: Path, log: TextIO = sys.stderr) -> None:
        self.state = StateDir(state_dir)
        self.log = log

    @property
    def kubeconfig(self) -> Path:
        return self.state.kubeconfig

    def _say(self, message: str) -> None:
        print(f"local-cluster: {message}", file=self.log, flush=True)

    def status(self) -> list[ComponentStatus] | None:
        record = self.state.read_record()
        return None if record is None else component_statuses(record, self.state)

    def up(self, bin_dir: Path | None = None, containers: str = "process") -> UpResult:
        """Starts the cluster; ``containers`` says how its kubelet runs containers: "process" (their
        commands on the host) or "podman" (from their images, podman.py)."""
        if containers not in CONTAINER_MODES:
            raise ClusterError(f"--containers must be one of {', '.join(CONTAINER_MODES)}, not {containers!r}")
        started = time.monotonic()
        record = self.state.read_record()
        if record is not None:
            statuses = component_statuses(record, self.state)
            down = [f"{s.name} ({s.health.value})" for s in statuses if s.health is not Health.RUNNING]
            if not down and record.containers != containers:
                raise ClusterError(
                    f"the cluster in {self.state.root} runs with --containers {record.containers}; "
                    f"run `kvpilot local-cluster down` first to start it with --containers {containers}"
                )
            if not down:
                return UpResult(record, already_running=True, seconds=0.0)
            if any(s.health is Health.RUNNING for s in statuses):
                raise ClusterError(
                    f"the cluster in {self.state.root} is partly running (not running: {', '.join(down)}); "
                    "run `kvpilot local-cluster start COMPONENT` for each, or `kvpilot local-cluster down` first"
                )
            self.down()  # the control plane of a previous run is gone; stray pod processes go too

        if containers == "podman":
            try:
                podman.check()
            except podman.PodmanUnavailable as exc:
                raise ClusterError(f"--containers podman: {exc}") from None
        bin_dir = bin_dir or build.bin_dir()
        missing = build.missing_binaries(bin_dir)
        if missing:
            raise ClusterError(
                f"binaries missing in {bin_dir}: {', '.join(missing)}; "
                "run `kvpilot local-cluster build` (needs Go) first"
            )
        self._say(f"state in {self.state.root}")
        ensure_pki(self.state.pki)
        for ephemeral in (self.state.etcd_data, self.state.pods, self.state.logs):
            shutil.rmtree(ephemeral, ignore_errors=True)
        self.state.pod_pids.unlink(missing_ok=True)

        record = ClusterRecord(bin_dir=str(bin_dir), ports={}, pod_ip_block=random.randint(1, 200),
                               containers=containers)
        try:
            for name in components.ORDER:
                self._start(name, record, bin_dir)
            self._wait_for_cluster(record)
        except BaseException:
            self._say("start failed; stopping what was started")
            self.down()
            raise
        seconds = time.monotonic() - started
        self._say(f"up in {seconds:.1f}s; export KUBECONFIG={self.kubeconfig}")
        return UpResult(record, already_running=False, seconds=seconds)

    def _start(self, name: str, record: ClusterRecord, bin_dir: Path) -> None:
        """Starts one component, retrying with fresh ports if one was taken meanwhile."""
        log_path = _log_path(self.state, name)
        for attempt in range(1, PORT_ATTEMPTS + 1):
            for port_name in components.PORTS[name]:
                record.ports[port_name] = processes.free_port()
            self.state.write_record(record)
            if name == "kube-apiserver":
                self._write_kubeconfigs(record)
            outcome = self._launch(name, record, bin_dir)
            if outcome == "healthy":
                return
            log_text = _log_tail(log_path, 40)
            if "address already in use" in log_text.lower() and attempt < PORT_ATTEMPTS:
                self._say(f"{name}: a port was taken meanwhile; retrying with new ports")
                continue
            raise ClusterError(f"{name} {outcome}; last lines of {log_path}:\n{_log_tail(log_path)}")

    def _launch(self, name: str, record: ClusterRecord, bin_dir: Path) -> str:
        """Spawns ``name`` on the record's ports and waits until it serves; returns the outcome.

        The process is in the record (in start order, so `down` stops it) while it starts, and
        stays there only if it came up healthy."""
        log_path = _log_path(self.state, name)
        command = components.COMMANDS[name](bin_dir, self.state, record.ports)
        self._say(f"starting {name}")
        pid, start_time = processes.spawn(command, log_path, cwd=self.state.root)
        process = ProcessRecord(name, pid, start_time, str(log_path))
        record.processes.append(process)
        record.processes.sort(key=lambda p: components.ORDER.index(p.name))
        self.state.write_record(record)
        outcome = self._wait_healthy(name, process, record.ports)
        if outcome != "healthy":
            record.processes.remove(process)
            self.state.write_record(record)
        return outcome

    def _wait_healthy(self, name: str, process: ProcessRecord, ports: dict[str, int]) -> str:
        check = _health_check(name, self.state, ports)
        deadline = time.monotonic() + (60.0 if check else 2.0)
        while time.monotonic() < deadline:
            if not processes.is_alive(process.pid, process.start_time):
                processes.stop(process.pid, process.start_time)  # reap it
                return "exited during start-up"
            if check is not None and check():
                return "healthy"
            time.sleep(0.2)
        if check is None:
            return "healthy"  # alive through its start-up window
        processes.stop(process.pid, process.start_time)
        return "did not become healthy within 60s"

    def _write_kubeconfigs(self, record: ClusterRecord) -> None:
        for path, client in (
            (self.state.kubeconfig, "admin"),
            (self.state.root / "controller-manager.kubeconfig", "controller-manager"),
            (self.state.root / "scheduler.kubeconfig", "scheduler"),
        ):
            write_kubeconfig(path, record.apiserver_url, self.state.pki, client)

    def _wait_for_cluster(self, record: ClusterRecord) -> None:
        """Nodes Ready and the default service account made: a pod can be created right away."""
        api = KubeApi(record.apiserver_url, self.state.pki)
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting_for = "nodes"
        while time.monotonic() < deadline:
            crashed = [s for s in component_statuses(record, self.state) if s.health is Health.CRASHED]
            if crashed:
                s = crashed[0]
                raise ClusterError(f"{s.name} crashed; last lines of {s.log}:\n{_log_tail(Path(s.log))}")
            try:
                nodes = api.get("/api/v1/nodes")["items"]
                ready = {
                    n["metadata"]["name"]
                    for n in nodes
                    for c in n.get("status", {}).get("conditions", [])
                    if c["type"] == "Ready" and c["status"] == "True"
                }
                if not set(NODE_NAMES) <= ready:
                    waiting_for = f"nodes Ready (have {sorted(ready)})"
                elif api.get("/api/v1/namespaces/default/serviceaccounts/default", ok_missing=True) is None:
                    waiting_for = "the default service account"
                else:
                    return
            except (ApiError, OSError) as exc:
                waiting_for = f"the API ({exc})"
            time.sleep(0.3)
        raise ClusterError(f"timed out after {READY_TIMEOUT_S:.0f}s waiting for {waiting_for}")

    def stop_component(self, name: str) -> bool:
        """Stops one control-plane component, keeping its ports, data (etcd's) and certificates, so
        `start_component` brings it back as it was. Returns whether it was running."""
        record = self._record_for(name)
        process = next((p for p in record.processes if p.name == name), None)
        if process is None:
            return False
        was_running = processes.stop(process.pid, process.start_time, timeout=COMPONENT_STOP_S)
        record.processes.remove(process)
        self.state.write_record(record)
        self._say(f"stopped {name}" if was_running else f"{name} had exited already")
        return was_running

    def start_component(self, name: str) -> float:
        """Starts a stopped (or crashed) component on its old ports and waits until it serves;
        returns the seconds that took."""
        started = time.monotonic()
        record = self._record_for(name)
        process = next((p for p in record.processes if p.name == name), None)
        if process is not None:
            if processes.is_alive(process.pid, process.start_time):
                raise ClusterError(f"{name} is already running (pid {process.pid}); use restart to restart it")
            record.processes.remove(process)  # crashed: start it again
        outcome = self._launch(name, record, Path(record.bin_dir))
        if outcome != "healthy":
            log_path = _log_path(self.state, name)
            ports = ", ".join(f"{p} {record.ports[p]}" for p in components.PORTS[name])
            raise ClusterError(
                f"{name} {outcome} on its old ports ({ports}); last lines of {log_path}:\n{_log_tail(log_path)}"
            )
        seconds = time.monotonic() - started
        self._say(f"{name} serving again after {seconds:.1f}s")
        return seconds

    def restart_component(self, name: str, down_seconds: float = 0.0) -> float:
        """Stops ``name``, leaves it down for ``down_seconds``, and starts it again on the same ports;
        returns the seconds from the stop until it served again."""
        if down_seconds < 0:
            raise ValueError(f"down_seconds (--down-seconds) must be 0 or more, got {down_seconds}")
        began = time.monotonic()
        self.stop_component(name)
        time.sleep(down_seconds)
        self.start_component(name)
        return time.monotonic() - began

    def _record_for(self, name: str) -> ClusterRecord:
        """The running cluster's record, once ``name`` is known to be a component one may stop and start."""
        choices = ", ".join(components.RESTARTABLE)
        if name == "kubelet":
            raise ClusterError(
                "the kubelet stand-in cannot be stopped or started alone: its pods stop with it "
                f"(restart the whole cluster with `down` and `up`); the components that can: {choices}"
            )
        if name not in components.RESTARTABLE:
            raise ClusterError(f"unknown component {name!r}: the components that can be stopped and started "
                               f"are {choices}")  # fmt: skip
        record = self.state.read_record()
        if record is None:
            raise ClusterError(f"no cluster in {self.state.root}: start one with `kvpilot local-cluster up`")
        return record

    def down(self) -> list[str]:
        """Stops exactly the processes `up` started (and the pod processes its kubelet ran)."""
        record = self.state.read_record()
        if record is None:
            return []
        stopped = []
        # Reverse order: the kubelet stops its pods while the API server still answers.
        for process in reversed(record.processes):
            if processes.stop(process.pid, process.start_time, timeout=15.0):
                stopped.append(process.name)
        for pid, start_time in read_pod_pids(self.state):
            processes.stop(pid, start_time, timeout=2.0)  # only left if the kubelet was killed
        if record.containers == "podman":
            podman.remove_cluster_containers(self.state.root)  # likewise
        self.state.pod_pids.unlink(missing_ok=True)
        self.state.clear_record()
        return stopped

    def summary(self, record: ClusterRecord) -> dict:
        return {
            "state_dir": str(self.state.root),
            "kubeconfig": str(self.kubeconfig),
            "server": record.apiserver_url,
            "bin_dir": record.bin_dir,
            "nodes": list(NODE_NAMES),
        }


def read_pod_pids(state: StateDir) -> list[tuple[int, int]]:
    try:
        lines = state.pod_pids.read_text().split()
    except FileNotFoundError:
        return []
    return [tuple(int(x) for x in line.split(":")) for line in lines]  # type: ignore[misc]
