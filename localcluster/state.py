"""The local cluster's state folder: where everything it writes lives, and its record file.

Layout (all under one folder, default ``$KVPILOT_CACHE/local-cluster``)::

    cluster.json        ports, bin dir and the processes `up` started (pid + start time)
    kubeconfig          admin kubeconfig: export KUBECONFIG=$(kvpilot local-cluster kubeconfig)
    pki/                CA, serving and client certificates, service-account keys
    etcd/               etcd's data (wiped by every `up`: the cluster is ephemeral; kept by `restart etcd`)
    logs/               one log per component, and the kubelet stand-in's
    pods/               per pod: container logs, volumes
    pvcs/               a directory per PersistentVolumeClaim (namespace/claim)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpilot.localcluster.build import cache_root

STATE_DIR_ENV = "KVPILOT_LOCAL_CLUSTER_DIR"


def default_state_dir() -> Path:
    explicit = os.environ.get(STATE_DIR_ENV)
    return Path(explicit) if explicit else cache_root() / "local-cluster"


@dataclass(frozen=True)
class ProcessRecord:
    name: str
    pid: int
    start_time: int  # /proc/<pid>/stat field 22: tells a recycled pid from ours
    log: str


@dataclass
class ClusterRecord:
    bin_dir: str
    ports: dict[str, int]
    processes: list[ProcessRecord] = field(default_factory=list)
    # Pod IPs are 127.0.<pod_ip_block>.N: a block per cluster, chosen at random by `up`,
    # so that clusters started side by side (several test sessions) rarely share addresses.
    pod_ip_block: int = 1
    # How the kubelet stand-in runs a container: "process" (its command on the host) or "podman"
    # (from its image: podman.py).
    containers: str = "process"

    @property
    def apiserver_url(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"


class StateDir:
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()

    @property
    def record_path(self) -> Path:
        return self.root / "cluster.json"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def pods(self) -> Path:
        return self.root / "pods"

    @property
    def pvcs(self) -> Path:
        return self.root / "pvcs"

    @property
    def pod_pids(self) -> Path:
        """The kubelet stand-in's record of the pod processes it runs (one pid per line)."""
        return self.root / "pod-pids"

    def read_record(self) -> ClusterRecord | None:
        if not self.record_path.exists():
            return None
        data = json.loads(self.record_path.read_text())
        processes = [ProcessRecord(**p) for p in data.pop("processes", [])]
        return ClusterRecord(processes=processes, **data)

    def write_record(self, record: ClusterRecord) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record), indent=2) + "\n")
        tmp.replace(self.record_path)

    def clear_record(self) -> None:
        self.record_path.unlink(missing_ok=True)
