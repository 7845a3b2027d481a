"""`kvpilot local-cluster build|bin-dir|up|down|status|kubeconfig|stop|start|restart`
(argparse only at import)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "local-cluster",
        help="a real local Kubernetes control plane with fake GPU nodes",
        description=(
            "etcd, kube-apiserver, kube-controller-manager and kube-scheduler built from the "
            "Go module proxy, two fake GPU nodes (nvidia.com/gpu: 4 each) and a local kubelet "
            "that runs pods as processes on their own 127.0.B.N and forwards a container's hostPort "
            "from 127.0.0.1 (how the host reaches the kvpilot gateway). "
            "Start with: kvpilot local-cluster up && export KUBECONFIG=$(kvpilot local-cluster kubeconfig)"
        ),
    )
    commands = parser.add_subparsers(dest="local_cluster_command", metavar="ACTION", required=True)

    def add(name: str, func, help_text: str, state: bool = True) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if state:
            sub.add_argument(
                "--state-dir",
                type=Path,
                default=None,
                help="folder holding the cluster's state "
                "(default: $KVPILOT_LOCAL_CLUSTER_DIR or $KVPILOT_CACHE/local-cluster)",
            )
        sub.set_defaults(func=func)
        return sub

    add(
        "build",
        _build,
        "build the missing control-plane binaries (needs Go; cached per pinned versions)",
        False,
    )
    add(
        "bin-dir",
        _bin_dir,
        "print the folder holding the built binaries (etcd, kube-*, kubectl, helm)",
        False,
    )
    up = add("up", _up, "start the cluster (reports it if already running) and wait until nodes are Ready")
    up.add_argument(
        "--containers", choices=("process", "podman"), default="process",
        help="how the kubelet runs a container: its command as a host process from this virtualenv "
        "(process, the default), or with podman from the image the pod names (podman: image mode; "
        "scripts/build-image.sh builds kvpilot's image and sets podman up)",
    )  # fmt: skip
    add("down", _down, "stop exactly the processes `up` started, and their pods")
    add("status", _status, "report each component as running, crashed or stopped")
    add("kubeconfig", _kubeconfig, "print the admin kubeconfig's path")
    component_help = "etcd, kube-apiserver, kube-controller-manager or kube-scheduler"
    stop = add(
        "stop",
        _stop,
        "stop one control-plane component, keeping its ports and data (a fault to test against; "
        "bring it back with `start`)",
    )
    stop.add_argument("component", help=component_help)
    start = add("start", _start, "start a stopped or crashed component on its old ports and wait until it serves")
    start.add_argument("component", help=component_help)
    restart = add(
        "restart",
        _restart,
        "stop one control-plane component and start it again on the same ports, with its data "
        "(etcd's store, the API server's address in every kubeconfig)",
    )
    restart.add_argument("component", help=component_help)
    restart.add_argument(
        "--down-seconds", type=float, default=0.0, help="how long to leave it stopped (default: 0)"
    )


def _cluster(args):
    from kvpilot.localcluster.cluster import LocalCluster
    from kvpilot.localcluster.state import default_state_dir

    return LocalCluster(args.state_dir or default_state_dir())


def _build(args) -> int:
    from kvpilot.localcluster.build import BuildError, build

    try:
        build()
    except BuildError as exc:
        print(f"kvpilot local-cluster build: {exc}", file=sys.stderr)
        return 1
    return 0


def _bin_dir(args) -> int:
    from kvpilot.localcluster.build import BuildError, bin_dir

    try:
        print(bin_dir())
    except BuildError as exc:
        print(f"kvpilot local-cluster bin-dir: {exc}", file=sys.stderr)
        return 1
    return 0


def _up(args) -> int:
    from kvpilot.localcluster.build import BuildError
    from kvpilot.localcluster.cluster import ClusterError

    cluster = _cluster(args)
    try:
        result = cluster.up(containers=args.containers)
    except (ClusterError, BuildError) as exc:
        print(f"kvpilot local-cluster up: {exc}", file=sys.stderr)
        return 1
    summary = cluster.summary(result.record)
    if result.already_running:
        print(f"already running: {summary['server']} (state in {summary['state_dir']})")
    else:
        print(
            f"cluster up in {result.seconds:.1f}s: {summary['server']}, nodes {', '.join(summary['nodes'])}, "
            f"containers run as {'podman containers' if result.record.containers == 'podman' else 'host processes'}"
        )
    print(f"export KUBECONFIG={summary['kubeconfig']}")
    print(f"export PATH={summary['bin_dir']}:$PATH   # kubectl and helm")
    return 0


def _down(args) -> int:
    stopped = _cluster(args).down()
    print(f"stopped: {', '.join(stopped)}" if stopped else "no running cluster")
    return 0


def _status(args) -> int:
    from kvpilot.localcluster.cluster import Health

    cluster = _cluster(args)
    statuses = cluster.status()
    if statuses is None:
        print(f"no cluster in {cluster.state.root} (start one with `kvpilot local-cluster up`)")
        return 3
    for status in statuses:
        pid = "-" if status.pid is None else status.pid
        print(f"{status.name:<24} {status.health.value:<8} pid {pid:<8} log {status.log}")
    crashed = [s for s in statuses if s.health is Health.CRASHED]
    stopped = [s for s in statuses if s.health is Health.STOPPED]
    if crashed:
        print("crashed: " + ", ".join(s.name for s in crashed) + "; see their logs, then `down` and `up` "
              "(or `start` a control-plane component)")  # fmt: skip
    if stopped:
        print("stopped: " + ", ".join(s.name for s in stopped) + "; `start` them to bring them back")
    return 1 if crashed or stopped else 0


def _stop(args) -> int:
    from kvpilot.localcluster.cluster import ClusterError

    try:
        was_running = _cluster(args).stop_component(args.component)
    except ClusterError as exc:
        print(f"kvpilot local-cluster stop: {exc}", file=sys.stderr)
        return 1
    print(f"stopped {args.component}" if was_running else f"{args.component} was not running")
    return 0


def _start(args) -> int:
    from kvpilot.localcluster.cluster import ClusterError

    try:
        seconds = _cluster(args).start_component(args.component)
    except ClusterError as exc:
        print(f"kvpilot local-cluster start: {exc}", file=sys.stderr)
        return 1
    print(f"{args.component} serving in {seconds:.1f}s")
    return 0


def _restart(args) -> int:
    from kvpilot.localcluster.cluster import ClusterError

    try:
        seconds = _cluster(args).restart_component(args.component, args.down_seconds)
    except (ClusterError, ValueError) as exc:
        print(f"kvpilot local-cluster restart: {exc}", file=sys.stderr)
        return 1
    print(f"{args.component} restarted: serving again {seconds:.1f}s after it stopped")
    return 0


def _kubeconfig(args) -> int:
    cluster = _cluster(args)
    if not cluster.kubeconfig.exists():
        print(f"no kubeconfig in {cluster.state.root}: run `kvpilot local-cluster up` first", file=sys.stderr)
        return 1
    print(cluster.kubeconfig)
    return 0
