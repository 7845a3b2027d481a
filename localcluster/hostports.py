"""hostPort on the local kubelet: 127.0.0.1:HOSTPORT forwards to the pods that claim it.

A real node's CNI maps a container's ``hostPort`` to the pod through the node's
address. Here every pod has its own 127.0.B.N and the node's address is
127.0.0.1, so the kubelet listens on 127.0.0.1:HOSTPORT itself and copies bytes
both ways between each accepted connection and PODIP:CONTAINERPORT. This is how
a Service-less path from the host reaches a pod (the local cluster runs no
kube-proxy): `kvpilot local-cluster` users reach the gateway on
http://127.0.0.1:HOSTPORT.

Both fake nodes share 127.0.0.1, so two pods claiming one hostPort (which a real
scheduler would put on two nodes) share one listener; each new connection goes
to the next of them in turn. The listener closes when the last one goes.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading

log = logging.getLogger("kvpilot.localcluster.hostports")

HOST_IP = "127.0.0.1"
BUFFER_BYTES = 65536


def host_ports(pod: dict) -> list[tuple[int, int]]:
    """(hostPort, containerPort) of every TCP container port of the pod that asks for a hostPort."""
    found = []
    for container in pod["spec"].get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("hostPort") and port.get("protocol", "TCP") == "TCP":
                found.append((int(port["hostPort"]), int(port["containerPort"])))
    return found


class _Listener:
    def __init__(self, host_port: int) -> None:
        self.host_port = host_port
        self.targets: dict[str, tuple[str, int]] = {}  # pod uid -> (pod IP, container port)
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self.sock = socket.create_server((HOST_IP, host_port), reuse_port=False)
        self.sock.settimeout(0.5)
        self.closed = threading.Event()
        threading.Thread(target=self._accept, name=f"hostport-{host_port}", daemon=True).start()

    def _next_target(self) -> tuple[str, int] | None:
        with self._lock:
            targets = list(self.targets.values())
        return targets[next(self._turn) % len(targets)] if targets else None

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            target = self._next_target()
            if target is None:
                client.close()
                continue
            threading.Thread(target=_connect, args=(client, target), daemon=True).start()
        self.sock.close()


def _connect(client: socket.socket, target: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(target, timeout=5)
    except OSError:
        client.close()  # as a refused connection to the pod would look
        return
    upstream.settimeout(None)
    client.settimeout(None)
    back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    back.start()
    _pump(client, upstream)
    back.join()
    client.close()
    upstream.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copies until ``source`` ends, then passes the end on (half-close) so the other way may finish;
    on an error both ways stop, so a client that went away reaches the pod as a closed connection."""
    try:
        while chunk := source.recv(BUFFER_BYTES):
            sink.sendall(chunk)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class HostPorts:
    """The kubelet's hostPort listeners."""

    def __init__(self) -> None:
        self._listeners: dict[int, _Listener] = {}
        self._lock = threading.Lock()

    def add(self, pod: dict, pod_ip: str) -> list[str]:
        """Forwards the pod's hostPorts to it; returns a message for each one that could not be opened."""
        problems = []
        uid = pod["metadata"]["uid"]
        for host_port, container_port in host_ports(pod):
            with self._lock:
                listener = self._listeners.get(host_port)
                if listener is None:
                    try:
                        listener = self._listeners[host_port] = _Listener(host_port)
                    except OSError as exc:
                        problems.append(f"hostPort {host_port}: cannot listen on {HOST_IP}:{host_port}: {exc}")
                        continue
                    log.info("hostPort %d: listening on %s", host_port, HOST_IP)
                with listener._lock:
                    listener.targets[uid] = (pod_ip, container_port)
        return problems

    def remove(self, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            for host_port in [p for p, _ in host_ports(pod)]:
                listener = self._listeners.get(host_port)
                if listener is None:
                    continue
                with listener._lock:
                    listener.targets.pop(uid, None)
                    empty = not listener.targets
                if empty:
                    listener.closed.set()
                    del self._listeners[host_port]
                    log.info("hostPort %d: closed", host_port)

    def close(self) -> None:
        with self._lock:
            for listener in self._listeners.values():
                listener.closed.set()
            self._listeners.clear()
