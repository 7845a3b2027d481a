"""The gateway's HTTP server: routes, the background loops, start and stop.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (proxied,
``proxy.py``), ``GET /v1/models`` (every model it can route to), ``GET /health``
(200 once the first listing is in) and ``GET /metrics``. Two loops run beside
the server: the discovery watches (``discovery.py``) and the load scrape
(``engine_load.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvpilot import gateway_contract as contract
from kvpilot.gateway.discovery import Discovery, RouteTable
from kvpilot.gateway.engine_load import LoadBoard
from kvpilot.gateway.kube import Kube, load_configuration
from kvpilot.gateway.metrics import GatewayMetrics
from kvpilot.gateway.proxy import Proxy
from kvpilot.gateway.settings import GatewaySettings
from kvpilot.gateway.waker import Waker

log = logging.getLogger("kvpilot.gateway")

SHUTDOWN_SECONDS = 30.0  # in-flight streams get this long to finish when the gateway stops


def build_app(settings: GatewaySettings, table: RouteTable, waker: Waker | None = None,
              metrics: GatewayMetrics | None = None) -> web.Application:
    """The gateway's app over ``table``; the load scrape runs for the app's lifetime."""
    metrics = metrics or GatewayMetrics()
    board = LoadBoard()
    proxy = Proxy(settings, table, board, metrics, waker)
    app = web.Application(client_max_size=settings.max_body_bytes)

    async def upstream_session(app: web.Application) -> AsyncIterator[None]:
        proxy.session = session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            # No read timeout: a long generation may pause; the client's disconnect ends it.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            auto_decompress=False,  # bytes pass through as the engine encoded them
        )
        scraper = asyncio.create_task(_scrape_forever(board, table, session, settings.scrape_interval_seconds))
        yield
        scraper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await scraper
        await session.close()

    async def models(_: web.Request) -> web.Response:
        data = [{"id": route.model, "object": "model", "owned_by": "kvpilot", "parent": route.parent,
                 "namespace": route.namespace, "service": route.service, "replicas": route.replicas,
                 "ready_replicas": len(route.backends)}
                for route in sorted(table.routes.values(), key=lambda r: r.model)]
        return web.json_response({"object": "list", "data": data})

    async def health(_: web.Request) -> web.Response:
        if not table.synced:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ok", "models": len(table.routes)})

    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.cleanup_ctx.append(upstream_session)
    app.router.add_post("/v1/completions", proxy.handle)
    app.router.add_post("/v1/chat/completions", proxy.handle)
    app.router.add_get("/v1/models", models)
    app.router.add_get(contract.HEALTH_PATH, health)
    app.router.add_get(contract.METRICS_PATH, prometheus)
    return app


async def _scrape_forever(board: LoadBoard, table: RouteTable, session: aiohttp.ClientSession,
                          interval: float) -> None:
    while True:
        backends = [b for route in table.routes.values() for b in route.backends]
        try:
            await board.scrape(session, backends)
        except Exception:  # the next round tries again; routing falls back to in-flight counts
            log.exception("load scrape failed")
        await asyncio.sleep(interval)


async def serve(settings: GatewaySettings, namespaces: list[str] | None, kubeconfig: str | None,
                context: str | None) -> None:
    """Runs the gateway until SIGTERM or SIGINT: watches, scrape, server; then finishes in-flight requests."""
    kube = Kube(load_configuration(kubeconfig, context))
    table = RouteTable()
    watches = asyncio.create_task(Discovery(kube, namespaces, table).run())
    runner = await start(build_app(settings, table, Waker(kube)), settings.host, settings.port)
    scope = "all namespaces" if namespaces is None else ", ".join(namespaces)
    log.info("kvpilot gateway on %s:%d, routing to InferenceServices in %s", settings.host, settings.port, scope)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: finishing in-flight requests (up to %.0f s)", SHUTDOWN_SECONDS)
    await runner.cleanup()
    watches.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watches
    await kube.close()


async def start(app: web.Application, host: str, port: int,
                shutdown_seconds: float = SHUTDOWN_SECONDS) -> web.AppRunner:
    """Serves ``app``; a client that disconnects cancels its handler (and so its upstream request)."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_seconds, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
