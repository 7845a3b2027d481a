"""hostPort on the local kubelet: 127.0.0.1:HOSTPORT reaches the pods that claim it, until the last one goes."""

from __future__ import annotations

import socket
import threading

import pytest

from kvpilot.localcluster.hostports import HostPorts, host_ports


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class NamedServer:
    """A TCP server on 127.0.0.1 that answers each connection with its name and what it read, then closes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = conn.recv(1024)
                conn.sendall(self.name.encode() + b":" + data)

    def close(self) -> None:
        self.sock.close()


def _pod(uid: str, host_port: int, container_port: int) -> dict:
    return {"metadata": {"uid": uid, "namespace": "ns", "name": uid},
            "spec": {"containers": [{"name": "c", "ports": [
                {"name": "http", "containerPort": container_port, "hostPort": host_port, "protocol": "TCP"},
                {"name": "other", "containerPort": 9999}]}]}}


def _ask(port: int, text: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(text)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(1024):
            answer += chunk
        return answer


@pytest.fixture()
def servers():
    started = [NamedServer("a"), NamedServer("b")]
    yield started
    for server in started:
        server.close()


def test_only_ports_with_a_host_port_are_forwarded():
    assert host_ports(_pod("p", 18000, 8000)) == [(18000, 8000)]


def test_connections_reach_the_pods_in_turn_until_the_last_one_goes(servers):
    a, b = servers
    ports = HostPorts()
    host_port = _free_port()
    pod_a, pod_b = _pod("a", host_port, a.port), _pod("b", host_port, b.port)
    try:
        assert ports.add(pod_a, "127.0.0.1") == []
        assert _ask(host_port, b"hello") == b"a:hello"
        assert ports.add(pod_b, "127.0.0.1") == []
        assert {_ask(host_port, b"x") for _ in range(4)} == {b"a:x", b"b:x"}
        ports.remove(pod_a)
        assert {_ask(host_port, b"y") for _ in range(3)} == {b"b:y"}
        ports.remove(pod_b)
        with pytest.raises(OSError):
            for _ in range(20):  # the listener closes within its accept timeout
                _ask(host_port, b"z")
                threading.Event().wait(0.1)
    finally:
        ports.close()


def test_a_host_port_taken_by_another_process_is_reported(servers):
    a, _ = servers
    with socket.create_server(("127.0.0.1", 0)) as taken:
        ports = HostPorts()
        problems = ports.add(_pod("a", taken.getsockname()[1], a.port), "127.0.0.1")
        ports.close()
    assert len(problems) == 1 and "cannot listen on 127.0.0.1" in problems[0]
