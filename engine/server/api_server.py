"""The HTTP app: routes (routes.py), middleware (middleware.py) and error handlers (errors.py)
put together over one ServerState (state.py), and uvicorn with a graceful drain. Endpoints:

- ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``:
  OpenAI API; ``Authorization: Bearer <api key>`` when ``--api-key`` is set.
- ``GET /health``: 200 while serving; 503 once the engine loop died or the
  server is draining for shutdown (so readiness fails first).
- ``GET /metrics``: Prometheus text exposition (see docs/metrics.md).
- ``GET /admin/v1/scheduler``, ``POST /admin/v1/scheduler``: read / change
  ``max_num_seqs``, ``max_num_batched_tokens`` and ``num_speculative_tokens`` live, with
  ``Authorization: Bearer <admin token>``; only on the admin port (``--admin-port``),
  which answers nothing else, and only with an admin token configured. The API port
  answers 404 for them, so exposing it (the Service does) never exposes the admin API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from kvpilot.engine.server.engine_protocol import Engine
from kvpilot.engine.server.errors import EXCEPTION_HANDLERS
from kvpilot.engine.server.middleware import add_middleware
from kvpilot.engine.server.routes import admin_routes, monitoring_routes, openai_routes
from kvpilot.engine.server.state import ServerSettings, ServerState

logger = logging.getLogger(__name__)


def build_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving ``engine`` (a started LLMEngine); the engine thread runs for the app's lifespan.

    One app answers on both ports: the admin routes only on the admin port (middleware.py).
    """
    app = FastAPI(title="kvpilot", lifespan=_lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.kvpilot = ServerState(engine, settings)
    add_middleware(app, settings)
    for routes in (openai_routes, monitoring_routes, admin_routes):
        app.include_router(routes)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    state: ServerState = app.state.kvpilot
    state.loop = asyncio.get_running_loop()
    state.async_engine.start()
    yield
    await state.async_engine.shutdown()


class DrainingServer(uvicorn.Server):
    """uvicorn with kvpilot's shutdown: the first SIGTERM/SIGINT drains, a second one forces.

    uvicorn's own handler would close the listening socket at once; here the
    signal starts ``ServerState.drain`` instead and only when that is done does
    uvicorn's normal shutdown run (close listeners, finish responses, lifespan).
    """

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_requested or self.state.loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._drain_requested = True
        logger.info("received signal %d: draining before shutdown (send it again to stop at once)", sig)
        self.state.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self.state.drain())
        self._drain_task.add_done_callback(lambda _: setattr(self, "should_exit", True))
