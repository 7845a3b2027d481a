"""Real uvicorn servers on 127.0.0.1 serving the generated tiny model (tests/conftest.py's tiny_model_dir)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@dataclass
class LiveServer:
    url: str
    app: Any
    server: Any
    thread: threading.Thread
    admin_url: str | None = None  # the admin API's own listener, when the server has an admin token

    @property
    def state(self) -> Any:
        return self.app.state.kvpilot

    @property
    def engine(self) -> Any:
        return self.state.async_engine.engine

    def wait_idle(self, timeout: float = 30.0) -> Any:
        """Waits until no request is in flight and the engine holds no KV blocks; returns the stats."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.state.async_engine.stats()
            if self.state.async_engine.num_in_flight == 0 and stats.num_running == 0 and stats.num_waiting == 0:
                return stats
            time.sleep(0.02)
        raise AssertionError(f"server not idle after {timeout}s: {self.state.async_engine.stats()}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class StepGate:
    """Holds the engine thread before a step, so a test decides when generation moves on however fast or
    slow the machine is. ``close_after(n)`` lets ``n`` more steps run, then the thread waits before the
    next one (``wait_held()`` returns once it does) until ``open()``. The engine thread takes its commands
    (adds, aborts) between steps, so those queued while it is held are applied right after the held step.
    """

    def __init__(self, engine: Any) -> None:
        self._step = engine.step
        self._changed = threading.Condition()
        self._allowed: int | None = None  # steps still allowed; None: open
        self._held = False

    def step(self) -> Any:
        """Stands in for ``engine.step`` (the engine thread calls it)."""
        with self._changed:
            while self._allowed == 0:
                self._held = True
                self._changed.notify_all()
                self._changed.wait()
            self._held = False
            if self._allowed is not None:
                self._allowed -= 1
        return self._step()

    def close_after(self, steps: int) -> None:
        with self._changed:
            self._allowed = steps
            self._held = steps == 0 and self._held  # a thread let through is no longer held
            self._changed.notify_all()

    def wait_held(self, timeout: float = 60.0) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self._held, timeout), "the engine never reached the gate"

    def open(self) -> None:
        with self._changed:
            self._allowed = None
            self._changed.notify_all()


def wait_until(predicate: Any, what: str, timeout: float = 60.0) -> None:
    """Polls ``predicate`` until it holds; the deadline only turns a hang into a failure naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def _listening_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def start_server(model_dir: Path, **settings: Any) -> LiveServer:
    """Loads an engine on ``model_dir`` and serves it from a uvicorn thread on a free 127.0.0.1 port
    (and the admin API on a second one when ``admin_token`` is given), as `kvpilot serve` does."""
    import uvicorn

    from kvpilot.engine.config import EngineConfig
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.server.api_server import DrainingServer, ServerSettings, build_app

    engine_kwargs = settings.pop("engine", {})
    config = EngineConfig(model=str(model_dir), device="cpu", **{"max_model_len": 512, **engine_kwargs})
    engine = LLMEngine.from_config(config)
    settings.setdefault("served_model_name", "tiny")
    sockets = [_listening_socket()]
    if settings.get("admin_token"):
        sockets.append(_listening_socket())
        settings["admin_port"] = sockets[1].getsockname()[1]
    app = build_app(engine, ServerSettings(**settings))
    port = sockets[0].getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2, lifespan="on")
    server = DrainingServer(config, app.state.kvpilot)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    admin_url = f"http://127.0.0.1:{settings['admin_port']}" if len(sockets) > 1 else None
    return LiveServer(f"http://127.0.0.1:{port}", app, server, thread, admin_url)


@pytest.fixture(scope="module")
def live_server_factory(tiny_model_dir):
    """Starts servers on the tiny model; all are stopped when the module's tests are done."""
    started: list[LiveServer] = []

    def start(**settings: Any) -> LiveServer:
        live = start_server(tiny_model_dir, **settings)
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture
def step_gate(monkeypatch):
    """``step_gate(live)``: a StepGate on that server's engine (open until closed), removed, and so
    opened, at the test's end."""
    gates: list[StepGate] = []

    def install(live: LiveServer) -> StepGate:
        gate = StepGate(live.engine)
        monkeypatch.setattr(live.engine, "step", gate.step)
        gates.append(gate)
        return gate

    yield install
    for gate in gates:
        gate.open()


@pytest.fixture(scope="module")
def smollm2_server(smollm2_gguf):
    """A server on SmolLM2-135M-Instruct's GGUF file, served as "smollm2": a trained model, for
    answers that can be checked."""
    live = start_server(smollm2_gguf, served_model_name="smollm2",
                        engine={"max_num_seqs": 4, "kv_cache_memory": 64 << 20})
    yield live
    live.stop()
