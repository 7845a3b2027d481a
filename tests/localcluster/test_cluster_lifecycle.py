"""`up` / `status` / `down` of a cluster of its own: idempotent up, crash reporting, clean teardown."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from kvpilot.localcluster import processes
from kvpilot.localcluster.cluster import ClusterError, Health, LocalCluster
from kvpilot.localcluster.testing import ClusterHandle, wait_until

pytestmark = pytest.mark.e2e


def _cli(state_dir, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvpilot.cli", "local-cluster", *args, f"--state-dir={state_dir}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_up_twice_status_crash_and_down_leaves_no_process(tmp_path, monkeypatch):
    # The first port handed out (etcd's) is taken by the time etcd binds it: `up` must retry.
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    ports = iter([taken])
    real_free_port = processes.free_port
    monkeypatch.setattr(processes, "free_port", lambda: next(ports, None) or real_free_port())
    log = io.StringIO()
    cluster = LocalCluster(tmp_path / "state", log=log)
    with squatter:
        result = cluster.up()
    assert "a port was taken meanwhile; retrying" in log.getvalue()
    assert taken not in result.record.ports.values()
    handle = ClusterHandle(cluster, result.record, result.seconds)
    try:
        print(f"up in {result.seconds:.1f}s")
        again = cluster.up()
        assert again.already_running and again.record.ports == result.record.ports
        assert "already running" in _cli(tmp_path / "state", "up").stdout
        assert _cli(tmp_path / "state", "kubeconfig").stdout.strip() == str(cluster.kubeconfig)

        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "sleeper"},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": "ignored", "command": ["sleep", "300"]}],
            },
        }
        handle.kubectl("apply", "-f", "-", input=json.dumps(pod))
        pod_pids = wait_until(handle.pod_pids, 30, "the pod's process")

        scheduler = next(p for p in result.record.processes if p.name == "kube-scheduler")
        os.kill(scheduler.pid, signal.SIGKILL)
        wait_until(
            lambda: any(s.name == "kube-scheduler" and s.health is Health.CRASHED for s in cluster.status()),
            10,
            "status to report the crash",
        )
        status = _cli(tmp_path / "state", "status")
        assert status.returncode == 1
        assert "kube-scheduler" in status.stdout and "crashed" in status.stdout
        with pytest.raises(ClusterError, match="partly running"):
            cluster.up()
    finally:
        started = [(p.pid, p.start_time) for p in result.record.processes] + handle.pod_pids()
        cluster.down()
    assert pod_pids and all(pid in {p for p, _ in started} for pid, _ in pod_pids)
    left = [pid for pid, start in started if processes.is_alive(pid, start)]
    assert not left, f"processes left behind: {left}"
    assert _cli(tmp_path / "state", "status").returncode == 3  # no cluster recorded any more
