"""`up`, `down` and `status` of the local cluster: one code path for the CLI and the tests."""

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

from kvpilot.localcluster import build, components, processes
from kvpilot.localcluster.api import ApiError, KubeApi
from kvpilot.localcluster.kubeconfig import write_kubeconfig
from kvpilot.localcluster.nodes import NODE_NAMES
from kvpilot.localcluster.pki import ensure_pki
from kvpilot.localcluster.state import ClusterRecord, ProcessRecord, StateDir

PORT_ATTEMPTS = 4
READY_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    """`up` could not bring the cluster up; the message says which component and why."""


class Health(Enum):
    RUNNING = "running"
    CRASHED = "crashed"


@dataclass(frozen=True)
class ComponentStatus:
    name: str
    pid: int
    health: Health
    log: str


@dataclass(frozen=True)
class UpResult:
    record: ClusterRecord
    already_running: bool
    seconds: float


def component_statuses(record: ClusterRecord) -> list[ComponentStatus]:
    return [
        ComponentStatus(
            p.name,
            p.pid,
            Health.RUNNING if processes.is_alive(p.pid, p.start_time) else Health.CRASHED,
            p.log,
        )
        for p in record.processes
    ]


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
        return None if record is None else component_statuses(record)

    def up(self, bin_dir: Path | None = None) -> UpResult:
        started = time.monotonic()
        record = self.state.read_record()
        if record is not None:
            statuses = component_statuses(record)
            crashed = [s.name for s in statuses if s.health is Health.CRASHED]
            if statuses and not crashed and len(statuses) == len(components.ORDER):
                return UpResult(record, already_running=True, seconds=0.0)
            if any(s.health is Health.RUNNING for s in statuses):
                raise ClusterError(
                    f"the cluster in {self.state.root} is partly running (not running: "
                    f"{', '.join(crashed) or 'some components never started'}); "
                    "run `kvpilot local-cluster down` first"
                )
            self.down()  # the control plane of a previous run is gone; stray pod processes go too

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

        record = ClusterRecord(bin_dir=str(bin_dir), ports={}, pod_ip_block=random.randint(1, 200))
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
        log_path = self.state.logs / f"{name}.log"
        for attempt in range(1, PORT_ATTEMPTS + 1):
            for port_name in components.PORTS[name]:
                record.ports[port_name] = processes.free_port()
            self.state.write_record(record)
            if name == "kube-apiserver":
                self._write_kubeconfigs(record)
            command = components.COMMANDS[name](bin_dir, self.state, record.ports)
            self._say(f"starting {name}")
            pid, start_time = processes.spawn(command, log_path, cwd=self.state.root)
            process = ProcessRecord(name, pid, start_time, str(log_path))
            record.processes.append(process)
            self.state.write_record(record)
            outcome = self._wait_healthy(name, process, record.ports)
            if outcome == "healthy":
                return
            record.processes.remove(process)
            self.state.write_record(record)
            log_text = _log_tail(log_path, 40)
            if "address already in use" in log_text.lower() and attempt < PORT_ATTEMPTS:
                self._say(f"{name}: a port was taken meanwhile; retrying with new ports")
                continue
            raise ClusterError(f"{name} {outcome}; last lines of {log_path}:\n{_log_tail(log_path)}")

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
            crashed = [s for s in component_statuses(record) if s.health is Health.CRASHED]
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
