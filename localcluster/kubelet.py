"""The local kubelet stand-in: runs the pods bound to the fake GPU nodes, each container as a local
process (process mode) or with podman from its image (image mode, podman.py).

Started by `kvpilot local-cluster up` as ``python -m kvpilot.localcluster.kubelet``.
It registers the nodes and keeps them Ready (Leases + status heartbeats),
watches pods bound to them, runs one PodWorker thread per pod (see
podworker.py), gives each pod its own loopback address 127.0.B.N as pod IP (B: the cluster's block),
forwards 127.0.0.1:hostPort to the pods that ask for one (hostports.py), and
serves container logs to the API server so `kubectl logs` works. On SIGTERM it
stops every pod's processes before it exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import threading
import time
from pathlib import Path

from kvpilot.localcluster import podman, processes
from kvpilot.localcluster.api import KubeApi
from kvpilot.localcluster.hostports import HostPorts
from kvpilot.localcluster.logserver import serve_logs
from kvpilot.localcluster.nodes import HEARTBEAT_S, NODE_NAMES, heartbeat, now_rfc3339, register_nodes
from kvpilot.localcluster.podworker import PodWorker
from kvpilot.localcluster.state import StateDir

log = logging.getLogger("kvpilot.localcluster.kubelet")
WATCH_TIMEOUT_S = 60
TERMINAL_PHASES = ("Succeeded", "Failed")
HOST_IP = "127.0.0.1"


class PodIPs:
    """Hands out 127.0.B.1, 127.0.B.2, … (B: the cluster's block) round-robin, never one in use."""

    def __init__(self, block: int) -> None:
        self._block = block
        self._in_use: set[str] = set()
        self._next = 0
        self._lock = threading.Lock()

    def allocate(self) -> str:
        with self._lock:
            for _ in range(254 * 254):
                index = self._next
                self._next = (self._next + 1) % (254 * 254)
                ip = f"127.0.{(self._block - 1 + index // 254) % 254 + 1}.{1 + index % 254}"
                if ip not in self._in_use:
                    self._in_use.add(ip)
                    return ip
        raise RuntimeError("no free pod IP left")

    def release(self, ip: str) -> None:
        with self._lock:
            self._in_use.discard(ip)


class Kubelet:
    def __init__(self, state: StateDir, port: int) -> None:
        self.state = state
        self.port = port
        record = state.read_record()
        if record is None:
            raise SystemExit(f"no cluster record in {state.root}: the kubelet is started by `up`")
        self.apiserver_port = record.ports["apiserver"]
        self.api = KubeApi(record.apiserver_url, state.pki)
        self.ips = PodIPs(record.pod_ip_block)
        # Image mode: the podman executable every container runs with (checked at start).
        self.podman: str | None = podman.check() if record.containers == "podman" else None
        self.host_ports = HostPorts()
        self.workers: dict[str, PodWorker] = {}
        self.finished: set[str] = set()  # uids run to completion here: never start them again
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}
        self.stopping = threading.Event()
        self.since = now_rfc3339()

    # Pod process bookkeeping, so `down` can clean up even after a kubelet crash.
    def track_pid(self, process: subprocess.Popen | None) -> None:
        start = processes.proc_start_time(process.pid) if process else None
        if start is not None:
            with self._lock:
                self._pids[process.pid] = start
                self._write_pids()

    def untrack_pid(self, process: subprocess.Popen | None) -> None:
        if process is not None:
            with self._lock:
                self._pids.pop(process.pid, None)
                self._write_pids()

    def _write_pids(self) -> None:
        tmp = self.state.pod_pids.with_suffix(".tmp")
        tmp.write_text("".join(f"{pid}:{start}\n" for pid, start in self._pids.items()))
        tmp.replace(self.state.pod_pids)

    def worker_done(self, worker: PodWorker) -> None:
        with self._lock:
            if self.workers.get(worker.uid) is worker:
                del self.workers[worker.uid]
            if worker.phase in TERMINAL_PHASES:
                self.finished.add(worker.uid)
        for run in worker.init_runs + worker.runs:
            self.untrack_pid(run.process)
        self.host_ports.remove(worker.pod)
        self.ips.release(worker.pod_ip)

    def find_worker(self, namespace: str, name: str) -> PodWorker | None:
        with self._lock:
            for worker in self.workers.values():
                meta = worker.pod["metadata"]
                if meta["namespace"] == namespace and meta["name"] == name:
                    return worker
        return None

    def sync(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
            if worker is None:
                if uid in self.finished or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
                    return
                # A hostNetwork pod shares the node's address, as on a real node.
                ip = HOST_IP if pod["spec"].get("hostNetwork") else self.ips.allocate()
                worker = PodWorker(self, pod, ip)
                self.workers[uid] = worker
                if not pod["spec"].get("hostNetwork"):  # a hostNetwork pod listens on the host port itself
                    for problem in self.host_ports.add(pod, ip):
                        log.warning("pod %s/%s: %s", pod["metadata"]["namespace"], pod["metadata"]["name"], problem)
                worker.start()
                return
        worker.update(pod)

    def forget(self, pod: dict) -> None:
        with self._lock:
            worker = self.workers.get(pod["metadata"]["uid"])
        if worker is not None:
            worker.gone()

    def _watch_pods(self) -> None:
        path = "/api/v1/pods"
        while not self.stopping.is_set():
            try:
                bound = {"fieldSelector": "spec.nodeName!="}
                listing = self.api.get(path, query=bound)
                alive = set()
                for pod in listing["items"]:
                    if pod["spec"].get("nodeName") in NODE_NAMES:
                        alive.add(pod["metadata"]["uid"])
                        self.sync(pod)
                with self._lock:
                    vanished = [w for uid, w in self.workers.items() if uid not in alive]
                for worker in vanished:
                    worker.gone()
                version = listing["metadata"]["resourceVersion"]
                for event in self.api.watch(path, version, WATCH_TIMEOUT_S, bound):
                    if self.stopping.is_set():
                        return
                    kind, pod = event["type"], event["object"]
                    if kind == "ERROR":
                        break  # e.g. 410 Gone: relist
                    if kind == "BOOKMARK" or pod["spec"].get("nodeName") not in NODE_NAMES:
                        continue
                    if kind == "DELETED":
                        self.forget(pod)
                    else:
                        self.sync(pod)
            except Exception:
                log.exception("pod watch failed; relisting in 1s")
                time.sleep(1.0)

    def _heartbeats(self) -> None:
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                heartbeat(self.api, self.since)
            except Exception:
                log.exception("node heartbeat failed")

    def run(self) -> None:
        register_nodes(self.api, self.port, self.since)
        heartbeat(self.api, self.since)
        serve_logs(self, self.port)
        threading.Thread(target=self._heartbeats, name="heartbeats", daemon=True).start()
        threading.Thread(target=self._watch_pods, name="pod-watch", daemon=True).start()
        log.info("kubelet up: nodes %s, logs on 127.0.0.1:%d", ", ".join(NODE_NAMES), self.port)
        self.stopping.wait()
        log.info("stopping: terminating every pod's processes")
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.shutdown()
        for worker in workers:
            worker.join(timeout=10.0)
        self.host_ports.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.localcluster.kubelet")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True, help="port for the log endpoint (kubectl logs)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(message)s")
    kubelet = Kubelet(StateDir(args.state_dir), args.port)
    signal.signal(signal.SIGTERM, lambda *_: kubelet.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: kubelet.stopping.set())
    kubelet.run()


if __name__ == "__main__":
    main()
