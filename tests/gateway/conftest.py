"""A real gateway server over a hand-filled route table, in front of small aiohttp stand-ins for engines.

Everything async runs on one event loop in a background thread; tests talk to it
with plain httpx over 127.0.0.1, as a client would. The stand-ins answer like the
engine's OpenAI routes, and each can be told to refuse (429/503), to stream at a
pace the test controls, or to break off; they record what reached them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from kvpilot.gateway.discovery import RouteTable
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.routes import Backend, Route
from kvpilot.gateway.server import build_app, start
from kvpilot.gateway.settings import GatewaySettings


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class FakeEngine:
    """An engine stand-in. ``behavior`` is ok (JSON, or SSE when the body says stream), a status to refuse
    with, ``paced`` (SSE, one chunk each time ``release()`` is called, the end at ``release(more=False)``)
    or ``break`` (a chunk, then the connection drops). With an ``api_key``, it answers 401 as the engine
    does (before reading the body) unless the request carries ``Authorization: Bearer <api_key>``."""

    name: str
    url: str = ""
    behavior: str | int = "ok"
    api_key: str | None = None
    requests: list[dict] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)  # each request's Authorization header
    aborted: threading.Event = field(default_factory=threading.Event)
    _pace: asyncio.Queue | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def release(self, more: bool = True) -> None:
        assert self._loop is not None and self._pace is not None
        self._loop.call_soon_threadsafe(self._pace.put_nowait, more)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.authorizations.append(request.headers.get("Authorization"))
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            error = {"message": "Invalid or missing API key.", "type": "authentication_error", "param": None,
                     "code": None}
            return web.json_response({"error": error}, status=401, headers={"WWW-Authenticate": "Bearer"})
        body = await request.json()
        self.requests.append(body)
        if isinstance(self.behavior, int):
            return web.json_response({"error": {"message": "refused", "type": "x", "param": None, "code": None}},
                                     status=self.behavior, headers={"Retry-After": "1"})
        if self.behavior == "ok" and not body.get("stream"):
            return web.json_response({"object": "text_completion", "model": body["model"], "pod": self.name,
                                      "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(1000):
                if self.behavior == "paced":
                    if not await self._pace.get():
                        break
                elif self.behavior == "break" and i == 1:
                    request.transport.close()
                    return response
                elif self.behavior == "ok" and i == 3:
                    break
                await response.write(f"data: {json.dumps({'pod': self.name, 'i': i})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):
            self.aborted.set()
            raise
        return response


@dataclass
class Harness:
    loop: LoopThread
    table: RouteTable
    url: str
    metrics: GatewayMetrics
    engines: dict[str, FakeEngine]
    wakes: list[str]

    def set_routes(self, routes: dict[str, tuple[int, list[str]]]) -> None:
        """model -> (replicas, names of its fake engines (or "dead:NAME" for a closed port))."""
        table = {}
        for model, (replicas, names) in routes.items():
            backends = []
            for name in names:
                url = f"http://127.0.0.1:{free_port()}" if name.startswith("dead:") else self.engines[name].url
                backends.append(Backend(f"ns/{name}", url))
            table[model] = Route(model, "ns", model, replicas, tuple(backends), "2026-01-01T00:00:00Z")

        async def apply() -> None:
            self.table.set(table)

        self.loop.run(apply())

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def metric_reaches(self, value: float, name: str, **labels: str) -> bool:
        """Whether the metric reaches ``value`` (a handler counts after it answered); the deadline only
        guards against a hang."""
        deadline = time.monotonic() + 60
        while self.metric(name, **labels) != value and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.metric(name, **labels) == value


class RecordingWaker:
    def __init__(self, wakes: list[str]) -> None:
        self.wakes = wakes

    async def wake(self, route: Route) -> None:
        self.wakes.append(route.service)


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


@pytest.fixture()
def harness(loop_thread) -> Iterator[Callable[..., Harness]]:
    """Starts fake engines by name and a gateway (settings overridable) on the module's loop."""
    runners: list[web.AppRunner] = []

    def make(engine_names: list[str], **settings: Any) -> Harness:
        async def setup() -> Harness:
            engines = {}
            for name in engine_names:
                engine = FakeEngine(name, _pace=asyncio.Queue(), _loop=asyncio.get_running_loop())
                app = web.Application()
                app.router.add_post("/v1/completions", engine.handle)
                app.router.add_post("/v1/chat/completions", engine.handle)
                runner = web.AppRunner(app, shutdown_timeout=1.0)
                await runner.setup()
                port = free_port()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                runners.append(runner)
                engine.url = f"http://127.0.0.1:{port}"
                engines[name] = engine
            table = RouteTable()
            table.synced = True
            metrics = GatewayMetrics()
            wakes: list[str] = []
            port = free_port()
            gateway_settings = GatewaySettings(**{"scrape_interval_seconds": 60.0, **settings})
            app = build_app(gateway_settings, table, RecordingWaker(wakes), metrics)
            runners.append(await start(app, "127.0.0.1", port, shutdown_seconds=2.0))
            return Harness(loop_thread, table, f"http://127.0.0.1:{port}", metrics, engines, wakes)

        return loop_thread.run(setup())

    yield make

    async def cleanup() -> None:
        for runner in reversed(runners):
            await runner.cleanup()

    loop_thread.run(cleanup())
