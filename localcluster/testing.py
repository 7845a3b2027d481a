"""One local cluster shared by every test suite of a pytest session (tests/e2e, tests/localcluster).

The session fixture ``local_cluster`` in tests/conftest.py calls ``acquire()``
and, at teardown, ``release()``; the cluster comes up on the first acquire and
goes down on the last release, so a session pays for one start however many
suites use it. Nothing here imports pytest.

To iterate quickly, set KVPILOT_TEST_CLUSTER_DIR to a state folder: the tests
then use the cluster running there (starting it if needed) and leave it up.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.localcluster import processes
from kvpilot.localcluster.cluster import LocalCluster, read_pod_pids
from kvpilot.localcluster.nodes import GPU_RESOURCE, NODE_NAMES
from kvpilot.localcluster.state import ClusterRecord


@dataclass
class ClusterHandle:
    """What a test needs to use the cluster."""

    cluster: LocalCluster
    record: ClusterRecord
    up_seconds: float
    _api_clients: list = field(default_factory=list)

    nodes = NODE_NAMES
    gpu_resource = GPU_RESOURCE

    @property
    def state_dir(self) -> Path:
        return self.cluster.state.root

    @property
    def kubeconfig(self) -> Path:
        return self.cluster.kubeconfig

    @property
    def bin_dir(self) -> Path:
        return Path(self.record.bin_dir)

    @property
    def server(self) -> str:
        return self.record.apiserver_url

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG, kubectl/helm on PATH and helm's folders in the state dir."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        for name in ("CACHE", "CONFIG", "DATA"):
            env[f"HELM_{name}_HOME"] = str(self.state_dir / "helm" / name.lower())
        return env

    def api_client(self):
        """A fresh kubernetes.client.ApiClient for the admin user; closed at teardown."""
        from kubernetes import config

        client = config.new_client_from_config(config_file=str(self.kubeconfig))
        self._api_clients.append(client)
        return client

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                timeout: float = 60) -> subprocess.CompletedProcess:  # fmt: skip
        return self._run("kubectl", args, input, check, timeout)

    def helm(self, *args: str, input: str | None = None, check: bool = True,
             timeout: float = 120) -> subprocess.CompletedProcess:  # fmt: skip
        return self._run("helm", args, input, check, timeout)

    def _run(self, tool: str, args, input, check, timeout) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(self.bin_dir / tool), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{tool} {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def pod_pids(self) -> list[tuple[int, int]]:
        """(pid, start time) of every container process the kubelet runs now."""
        return read_pod_pids(self.cluster.state)

    def pod_log(self, namespace: str, pod: str, container: str) -> str:
        folders = sorted(self.cluster.state.pods.glob(f"{namespace}_{pod}_*"))
        return "".join(
            (f / f"{container}.log").read_text(errors="replace")
            for f in folders
            if (f / f"{container}.log").exists()
        )

    def down(self) -> list[str]:
        """Stops everything; returns a description of each process left behind (should be none)."""
        for client in self._api_clients:
            client.close()
        record = self.cluster.state.read_record() or self.record  # a restarted component has a new pid
        started = [(p.name, p.pid, p.start_time) for p in record.processes]
        started += [("pod process", pid, start) for pid, start in self.pod_pids()]
        self.cluster.down()
        return [f"{name} pid {pid}" for name, pid, start in started if processes.is_alive(pid, start)]


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.2):
    """Polls ``predicate`` until it returns something truthy; returns that, or fails naming ``what``."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # a transient API error counts as "not yet"
            last_error = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:.0f}s waiting for {what}"
        + (f" (last error: {last_error})" if last_error else "")
    )


REUSE_ENV = "KVPILOT_TEST_CLUSTER_DIR"
_shared: ClusterHandle | None = None
_users = 0
_owned = True


def acquire() -> ClusterHandle:
    """The session's cluster, started on first use (state in a fresh temp folder)."""
    global _shared, _users, _owned
    if _shared is None:
        reuse = os.environ.get(REUSE_ENV)
        _owned = not reuse
        state_dir = Path(reuse) if reuse else Path(tempfile.mkdtemp(prefix="kvpilot-local-cluster-"))
        cluster = LocalCluster(state_dir)
        result = cluster.up()  # an interrupted start stops what it started
        _shared = ClusterHandle(cluster, result.record, result.seconds)
        atexit.register(_down_if_left)
    _users += 1
    return _shared


def _down_if_left() -> None:
    """At interpreter exit: stops an owned cluster whose users never released it (a teardown cut short by a
    second Ctrl-C, a session that ended before its fixtures' teardown): its processes run in their own
    sessions and would outlive the run."""
    global _shared
    if _shared is not None and _owned:
        handle, _shared = _shared, None
        handle.down()


def release() -> list[str]:
    """Drops one user; the last one stops the cluster and gets the processes left behind."""
    global _shared, _users
    _users -= 1
    if _users > 0 or _shared is None:
        return []
    handle = _shared
    # A cluster the developer asked to reuse stays up.
    leftovers = handle.down() if _owned else []
    _shared = None  # only now: a down() cut short is finished at exit
    atexit.unregister(_down_if_left)
    return leftovers
