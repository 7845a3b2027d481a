"""`stop` / `start` / `restart` of one component, on a cluster record of stand-in processes (no binaries):
the same ports and data come back, the record stays in start order, misuse is refused by name."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from kvpilot.localcluster import components, processes
from kvpilot.localcluster.cluster import ClusterError, Health, LocalCluster
from kvpilot.localcluster.state import ClusterRecord, ProcessRecord

# Answers etcd's health check (plain HTTP GET /health) on the client port it is given.
FAKE_ETCD = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"health":"true"}')
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _fake_etcd(bin_dir, state, ports):
    return [sys.executable, "-c", FAKE_ETCD, str(ports["etcd"])]


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A recorded cluster whose etcd answers its health check and whose other components sleep."""
    monkeypatch.setitem(components.COMMANDS, "etcd", _fake_etcd)
    cluster = LocalCluster(tmp_path / "state", log=io.StringIO())
    ports = {port: processes.free_port() for name in components.ORDER for port in components.PORTS[name]}
    record = ClusterRecord(bin_dir=str(tmp_path / "bin"), ports=ports)
    for name in components.ORDER:
        log = cluster.state.logs / f"{name}.log"
        command = _fake_etcd(None, None, ports) if name == "etcd" else SLEEPER
        pid, start = processes.spawn(command, log)
        record.processes.append(ProcessRecord(name, pid, start, str(log)))
    cluster.state.write_record(record)
    _wait_etcd(ports["etcd"])
    yield cluster
    cluster.down()


def _wait_etcd(port: int) -> None:
    deadline = time.monotonic() + 60  # only a guard against a hang: a loaded machine starts Python slowly
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"the stand-in etcd never answered on port {port}")


def _process(cluster: LocalCluster, name: str) -> ProcessRecord:
    return next(p for p in cluster.state.read_record().processes if p.name == name)


def test_restart_keeps_ports_data_and_order_and_replaces_the_process(cluster):
    before = cluster.state.read_record()
    old = _process(cluster, "etcd")
    marker = cluster.state.etcd_data / "member" / "marker"
    marker.parent.mkdir(parents=True)
    marker.write_text("kept")

    seconds = cluster.restart_component("etcd", down_seconds=0.2)

    after = cluster.state.read_record()
    new = _process(cluster, "etcd")
    assert seconds >= 0.2
    assert (new.pid, new.start_time) != (old.pid, old.start_time)
    assert not processes.is_alive(old.pid, old.start_time)
    assert processes.is_alive(new.pid, new.start_time)
    assert after.ports == before.ports  # the health check passed on the old client port
    assert [p.name for p in after.processes] == list(components.ORDER)  # `down` still stops in reverse
    assert marker.read_text() == "kept"
    assert all(s.health is Health.RUNNING for s in cluster.status())
    assert cluster.up().already_running


def test_stop_reports_stopped_and_start_brings_it_back(cluster):
    assert cluster.stop_component("kube-scheduler")
    assert not cluster.stop_component("kube-scheduler")  # already stopped: nothing to do
    statuses = {s.name: s for s in cluster.status()}
    assert statuses["kube-scheduler"].health is Health.STOPPED and statuses["kube-scheduler"].pid is None
    with pytest.raises(ClusterError, match=r"partly running \(not running: kube-scheduler \(stopped\)\)"):
        cluster.up()

    assert cluster.stop_component("etcd")
    cluster.start_component("etcd")
    with pytest.raises(ClusterError, match="etcd is already running"):
        cluster.start_component("etcd")
    assert [p.name for p in cluster.state.read_record().processes] == [
        n for n in components.ORDER if n != "kube-scheduler"
    ]


def test_start_recovers_a_crashed_component(cluster):
    crashed = _process(cluster, "etcd")
    processes.stop(crashed.pid, crashed.start_time)
    assert {s.name: s.health for s in cluster.status()}["etcd"] is Health.CRASHED
    cluster.start_component("etcd")
    assert {s.name: s.health for s in cluster.status()}["etcd"] is Health.RUNNING


def test_a_port_taken_while_stopped_fails_the_start_and_names_the_ports(cluster):
    port = cluster.state.read_record().ports["etcd"]
    cluster.stop_component("etcd")
    with socket.socket() as squatter:
        # The stopped etcd's health-check connections may linger in TIME_WAIT on the port.
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(ClusterError, match=rf"etcd exited during start-up on its old ports \(etcd {port}, "):
            cluster.start_component("etcd")
    assert "etcd" not in [p.name for p in cluster.state.read_record().processes]
    cluster.start_component("etcd")  # the port is free again


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("apiserver", "unknown component 'apiserver': the components that can be stopped and started are "
                      "etcd, kube-apiserver, kube-controller-manager, kube-scheduler"),
        ("kubelet", "the kubelet stand-in cannot be stopped or started alone: its pods stop with it"),
    ],
)  # fmt: skip
def test_components_that_cannot_be_restarted_are_refused_by_name(cluster, name, message):
    for action in (cluster.stop_component, cluster.start_component, cluster.restart_component):
        with pytest.raises(ClusterError, match=message):
            action(name)
    assert all(s.health is Health.RUNNING for s in cluster.status())  # nothing was touched


def test_negative_down_time_is_refused_before_anything_stops(cluster):
    with pytest.raises(ValueError, match=r"down_seconds \(--down-seconds\) must be 0 or more"):
        cluster.restart_component("etcd", down_seconds=-1)
    assert all(s.health is Health.RUNNING for s in cluster.status())


def _cli(state_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "local-cluster", *args, f"--state-dir={state_dir}"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_cli_restart_errors_and_status_of_a_stopped_component(cluster, tmp_path):
    state_dir = cluster.state.root
    unknown = _cli(state_dir, "restart", "etcdd")
    assert unknown.returncode == 1
    assert "unknown component 'etcdd'" in unknown.stderr and "kube-apiserver" in unknown.stderr
    assert "no cluster in" in _cli(tmp_path / "nothing", "restart", "etcd").stderr
    assert "must be 0 or more" in _cli(state_dir, "restart", "etcd", "--down-seconds=-2").stderr

    stop = _cli(state_dir, "stop", "kube-controller-manager")
    assert stop.returncode == 0 and stop.stdout.strip() == "stopped kube-controller-manager"
    status = _cli(state_dir, "status")
    assert status.returncode == 1
    assert "kube-controller-manager  stopped  pid -" in status.stdout
    assert "`start` them to bring them back" in status.stdout
