"""Command lines of the control plane's processes, one function per component.

Each takes the bin dir, the state folder and the ports chosen for this start,
so a port that turns out taken is fixed by calling it again with new ports.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvpilot.localcluster.pki import SERVICE_CIDR
from kvpilot.localcluster.state import StateDir

# Ports each component needs, by name in ClusterRecord.ports.
PORTS = {
    "etcd": ("etcd", "etcd-peer"),
    "kube-apiserver": ("apiserver",),
    "kube-controller-manager": ("controller-manager",),
    "kube-scheduler": ("scheduler",),
    "kubelet": ("kubelet",),
}
ORDER = tuple(PORTS)
# What `stop` / `start` / `restart` may take down alone: the control plane. The kubelet stand-in
# is left out, since its pods stop with it (a real kubelet's containers outlive a restart).
RESTARTABLE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def etcd(bin_dir: Path, state: StateDir, ports: dict[str, int]) -> list[str]:
    client = f"http://127.0.0.1:{ports['etcd']}"
    peer = f"http://127.0.0.1:{ports['etcd-peer']}"
    return [
        str(bin_dir / "etcd"),
        "--name=kvpilot",
        f"--data-dir={state.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=kvpilot={peer}",
        # A throwaway test store: durability buys nothing and fsyncs cost seconds on slow disks.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def kube_apiserver(bin_dir: Path, state: StateDir, ports: dict[str, int]) -> list[str]:
    pki = state.pki
    return [
        str(bin_dir / "kube-apiserver"),
        f"--etcd-servers=http://127.0.0.1:{ports['etcd']}",
        "--bind-address=127.0.0.1",
        "--advertise-address=127.0.0.1",
        f"--secure-port={ports['apiserver']}",
        f"--cert-dir={state.root / 'apiserver-certs'}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        "--authorization-mode=RBAC",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # No kube-proxy or real node network: the "kubernetes" Endpoints would point nowhere.
        "--endpoint-reconciler-type=none",
        "--allow-privileged=true",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        "--kubelet-preferred-address-types=InternalIP",
        "--profiling=false",
        # Ends open watch streams 2 s into a shutdown (their clients re-open them): without it the API
        # server waits out every watch and `stop` / `down` reach SIGKILL after 15 s.
        "--shutdown-watch-termination-grace-period=2s",
        "--v=1",
    ]


def kube_controller_manager(bin_dir: Path, state: StateDir, ports: dict[str, int]) -> list[str]:
    kubeconfig = state.root / "controller-manager.kubeconfig"
    return [
        str(bin_dir / "kube-controller-manager"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['controller-manager']}",
        f"--cert-dir={state.root / 'controller-manager-certs'}",
        "--leader-elect=false",
        f"--service-account-private-key-file={state.pki / 'sa.key'}",
        f"--root-ca-file={state.pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={state.pki / 'ca.crt'}",
        f"--cluster-signing-key-file={state.pki / 'ca.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--controllers=*",
        # Each controller acts as its own service account (system:controller:*), which RBAC
        # grants what it needs; the manager's own identity may not create ReplicaSets or EndpointSlices.
        "--use-service-account-credentials=true",
        "--profiling=false",
        "--v=1",
    ]


def kube_scheduler(bin_dir: Path, state: StateDir, ports: dict[str, int]) -> list[str]:
    kubeconfig = state.root / "scheduler.kubeconfig"
    return [
        str(bin_dir / "kube-scheduler"),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1",
        f"--secure-port={ports['scheduler']}",
        f"--cert-dir={state.root / 'scheduler-certs'}",
        "--leader-elect=false",
        "--profiling=false",
        "--v=1",
    ]


def kubelet(bin_dir: Path, state: StateDir, ports: dict[str, int]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvpilot.localcluster.kubelet",
        f"--state-dir={state.root}",
        f"--port={ports['kubelet']}",
    ]


COMMANDS = {
    "etcd": etcd,
    "kube-apiserver": kube_apiserver,
    "kube-controller-manager": kube_controller_manager,
    "kube-scheduler": kube_scheduler,
    "kubelet": kubelet,
}
