"""The kubelet's log endpoint, so `kubectl logs [-f] [--previous]` works against local pods.

The API server proxies ``/containerLogs/<namespace>/<pod>/<container>`` to the
node's address and kubelet port; only clients with a certificate from the
cluster CA (the API server's kubelet-client identity) are served.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlparse

if TYPE_CHECKING:
    from kvpilot.localcluster.kubelet import Kubelet


def _log_file(kubelet: Kubelet, namespace: str, pod: str, container: str, previous: bool) -> Path | None:
    worker = kubelet.find_worker(namespace, pod)
    if worker is not None:
        folder = worker.folder
    else:  # finished pods keep their folder until the next `up`
        folders = sorted(kubelet.state.pods.glob(f"{namespace}_{pod}_*"), key=lambda p: p.stat().st_mtime)
        if not folders:
            return None
        folder = folders[-1]
    path = folder / (f"{container}.previous.log" if previous else f"{container}.log")
    return path if path.exists() else None


def _handler(kubelet: Kubelet) -> type[BaseHTTPRequestHandler]:
    class LogHandler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes: suits follow

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            if url.path == "/healthz":
                self._reply(200, b"ok")
                return
            if len(parts) != 4 or parts[0] != "containerLogs":
                self._reply(404, b"the local kubelet serves only /containerLogs/<ns>/<pod>/<container>")
                return
            query = parse_qs(url.query)
            flag = lambda name: query.get(name, ["false"])[0] in ("true", "1")  # noqa: E731
            path = _log_file(kubelet, parts[1], parts[2], parts[3], flag("previous"))
            if path is None:
                self._reply(404, f"no logs for container {parts[3]} of pod {parts[1]}/{parts[2]}".encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.end_headers()
            with open(path, "rb") as log:
                lines = log.readlines()
                tail = query.get("tailLines", [None])[0]
                if tail is not None:
                    lines = list(deque(lines, maxlen=int(tail)))
                self.wfile.writelines(lines)
                self.wfile.flush()
                if flag("follow"):
                    self._follow(log, parts[1], parts[2])

        def _follow(self, log, namespace: str, pod: str) -> None:
            while True:
                chunk = log.read()
                if chunk:
                    self.wfile.write(chunk)
                    self.wfile.flush()
                elif kubelet.find_worker(namespace, pod) is None or kubelet.stopping.is_set():
                    return
                else:
                    time.sleep(0.2)

        def _reply(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.end_headers()
            self.wfile.write(body)

    return LogHandler


def serve_logs(kubelet: Kubelet, port: int) -> ThreadingHTTPServer:
    pki = kubelet.state.pki
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(pki / "kubelet.crt"), str(pki / "kubelet.key"))
    context.load_verify_locations(str(pki / "ca.crt"))
    context.verify_mode = ssl.CERT_REQUIRED
    server = ThreadingHTTPServer(("127.0.0.1", port), _handler(kubelet))
    server.daemon_threads = True
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="log-server", daemon=True).start()
    return server
