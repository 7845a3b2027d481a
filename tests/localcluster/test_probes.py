"""Probes against real local servers, with Kubernetes' thresholds."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpilot.localcluster.probes import ProbeState, resolve_port, run_probe


@pytest.fixture
def server():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/ready" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def test_http_tcp_and_exec_probes(server):
    container = {"ports": [{"name": "http", "containerPort": server}]}
    assert run_probe({"httpGet": {"path": "/ready", "port": "http"}}, container, "127.0.0.1", {})[0]
    ok, message = run_probe({"httpGet": {"path": "/nope", "port": server}}, container, "127.0.0.1", {})
    assert not ok and "503" in message
    assert run_probe({"tcpSocket": {"port": server}}, container, "127.0.0.1", {})[0]
    assert not run_probe({"tcpSocket": {"port": 1}}, container, "127.0.0.1", {})[0]
    assert run_probe({"exec": {"command": ["true"]}}, container, "127.0.0.1", {"PATH": "/usr/bin:/bin"})[0]
    assert not run_probe({"exec": {"command": ["false"]}}, container, "127.0.0.1", {"PATH": "/usr/bin:/bin"})[
        0
    ]


def test_named_port_must_be_declared():
    with pytest.raises(ValueError, match="does not declare"):
        resolve_port("metrics", {"ports": []})


def test_thresholds():
    state = ProbeState({"failureThreshold": 2, "successThreshold": 2, "periodSeconds": 1}, 0.0, result=True)
    state.record(False, "x", 1.0)
    assert state.result  # one failure is below the threshold
    state.record(False, "x", 2.0)
    assert not state.result
    state.record(True, "", 3.0)
    assert not state.result
    state.record(True, "", 4.0)
    assert state.result and state.next_at == 5.0
