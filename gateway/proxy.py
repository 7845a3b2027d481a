"""One OpenAI request through the gateway: route by model, pick a pod, forward, stream back.

The body is read once (the model and the prompt's prefix are in it) and sent
upstream byte for byte. The response streams back as it arrives: headers as soon
as the engine sends them, then every chunk as the engine flushes it, so a
streamed completion's tokens reach the client at the engine's pace.

Retry rule: a request goes to a second pod at most once, and only while nothing
has reached the client: the first pod answered 429 (queue full) or 503
(draining, engine stopped), or the connection failed or dropped before the
response headers. A 429 moves only to another Ready pod; the others may also
wait for a new one (the pod is going away). Once the first byte is out, a
broken upstream breaks the client's response too: replaying would send tokens
twice.

No Ready pod (the service is starting, or at zero replicas): the request is held,
at most ``max_held_requests`` per model for at most ``hold_timeout_seconds``, and
goes out the moment a pod is Ready; at zero replicas the gateway asks for one
(``Waker``). Past either bound: 503 with Retry-After.

A client that goes away cancels its handler (the server runs with handler
cancellation), which closes the upstream connection: the engine sees the
disconnect and aborts the request, freeing its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvpilot import gateway_contract as contract
from kvpilot.gateway.discovery import RouteTable
from kvpilot.gateway.engine_load import LoadBoard
from kvpilot.gateway.errors import error_response
from kvpilot.gateway.metrics import UNKNOWN_MODEL, GatewayMetrics
from kvpilot.gateway.picker import PickPolicy, pick
from kvpilot.gateway.prefix import RecentPrefixes, affinity_key
from kvpilot.gateway.routes import Backend, Route
from kvpilot.gateway.settings import GatewaySettings
from kvpilot.gateway.waker import Waker

log = logging.getLogger("kvpilot.gateway.proxy")

# Not forwarded either way: they describe one connection, not the request.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
})
RETRY_STATUSES = (429, 503)
CLIENT_GONE = 499  # the code label of a request whose client disconnected (nginx's convention)
WAKE_RECHECK_SECONDS = 5.0  # a held request for a service at zero asks for a replica again this often


@dataclass(frozen=True)
class Refusal:
    """A pod's answer that allows a retry elsewhere: a 429/503 response read in full, or a failed connection."""

    reason: str  # the retries metric's reason label
    status: int | None = None
    headers: CIMultiDict[str] | None = None
    body: bytes = b""
    error: str = ""

    def response(self, backend: Backend, model: str) -> web.Response:
        if self.status is None:
            return error_response(502, f"Could not reach engine pod {backend.key} of model {model!r}: {self.error}. "
                                       "Retry; if it persists, check the InferenceService's pods.",
                                  code="upstream_unreachable")
        return web.Response(status=self.status, body=self.body, headers=_forwardable(self.headers or {}))


class UpstreamBroken(ConnectionError):
    """The engine's response broke off after the client got part of it; the client's connection is closed."""


def _forwardable(headers: Any) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in HOP_BY_HOP)


class Proxy:
    def __init__(self, settings: GatewaySettings, table: RouteTable, board: LoadBoard, metrics: GatewayMetrics,
                 waker: Waker | None) -> None:
        self.settings = settings
        self.table = table
        self.board = board
        self.metrics = metrics
        self.waker = waker
        self.session: aiohttp.ClientSession | None = None  # opened with the app (server.build_app)
        self.policy = PickPolicy(load_factor=settings.load_factor)
        self.recent_prefixes = RecentPrefixes()
        self.held: dict[str, int] = {}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions."""
        model = UNKNOWN_MODEL
        code = CLIENT_GONE  # unless the request gets an answer
        try:
            parsed = await self._parse(request)
            if isinstance(parsed, web.Response):
                code = parsed.status
                return parsed
            raw, body = parsed
            route = self.table.routes.get(body["model"])
            if route is None:
                response = self.unknown_model(body["model"])
                code = response.status
                return response
            model = route.model
            response = await self._serve(request, model, raw, body)
            code = response.status
            return response
        except UpstreamBroken:
            code = 502
            raise
        finally:
            self.metrics.requests.labels(model, str(code)).inc()

    async def _parse(self, request: web.Request) -> tuple[bytes, dict[str, Any]] | web.Response:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"The request body is over {self.settings.max_body_bytes} bytes.")
        try:
            body = json.loads(raw)
        except ValueError:
            return error_response(400, "The request body is not valid JSON.")
        if not isinstance(body, dict):
            return error_response(400, "The request body must be a JSON object.")
        if not isinstance(body.get("model"), str):
            return error_response(400, "model: this field is required (a string naming a model from /v1/models).",
                                  param="model")
        return raw, body

    def unknown_model(self, model: str) -> web.Response:
        names = sorted(self.table.routes)
        available = ", ".join(names) if names else "none (no InferenceService is visible to this gateway)"
        return error_response(404, f"The model {model!r} does not exist. Available models: {available}.",
                              param="model", code="model_not_found")

    async def _serve(self, request: web.Request, model: str, raw: bytes, body: dict[str, Any]) -> web.StreamResponse:
        affinity = affinity_key(body, self.settings.prefix_chars)
        last_pod = None if affinity is None else self.recent_prefixes.last_pod(affinity)
        request_hash = os.urandom(8)
        tried: set[str] = set()
        refusal: Refusal | None = None
        failed: Backend | None = None
        while True:
            may_hold = refusal is None or refusal.reason != "status_429"
            acquired = await self._acquire(model, affinity, last_pod, request_hash, frozenset(tried), may_hold)
            if isinstance(acquired, web.Response):
                return acquired
            if acquired is None:  # nowhere else to go: the first pod's answer stands
                assert refusal is not None and failed is not None
                return refusal.response(failed, model)
            backend, reason = acquired
            if affinity is not None:
                self.recent_prefixes.record(affinity, backend.key)
            if refusal is not None:
                self.metrics.retries.labels(model, refusal.reason).inc()
            self.metrics.decisions.labels(model, reason).inc()
            outcome = await self._attempt(request, model, backend, raw, reason, last=bool(tried))
            if not isinstance(outcome, Refusal):
                return outcome
            log.info("%s: pod %s refused (%s)%s", model, backend.key, outcome.reason,
                     "" if tried else "; trying another pod")
            if tried:
                return outcome.response(backend, model)
            tried.add(backend.key)
            refusal, failed = outcome, backend

    async def _acquire(self, model: str, affinity: bytes | None, last_pod: str | None, request_hash: bytes,
                       tried: frozenset[str], may_hold: bool) -> tuple[Backend, str] | web.Response | None:
        """A pod for the request and why; a response when there is none in time; None when a retry
        finds no other pod and may not wait for one."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        try:
            while True:
                route = self.table.routes.get(model)
                if route is None:
                    return self.unknown_model(model)
                choice = pick(self.board.candidates(route.backends, tried), affinity, request_hash, self.policy,
                              last_pod=last_pod, new_prefix=affinity is not None and last_pod is None)
                if choice is not None:
                    backend = next(b for b in route.backends if b.key == choice.key)
                    return backend, contract.REASON_RETRY if tried else choice.reason
                if not may_hold:
                    return None
                if deadline is None:
                    if self.held.get(model, 0) >= self.settings.max_held_requests:
                        return self._unavailable(route, f"{self.held.get(model, 0)} requests already wait for it")
                    deadline = loop.time() + self.settings.hold_timeout_seconds
                    self.held[model] = self.held.get(model, 0) + 1
                    self.metrics.held.labels(model).inc()
                if route.replicas == 0 and self.waker is not None:
                    await self.waker.wake(route)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return self._unavailable(route, f"none became Ready within {self.settings.hold_timeout_seconds:g} s")
                await self.table.wait_for_change(min(remaining, WAKE_RECHECK_SECONDS))
        finally:
            if deadline is not None:
                self.held[model] -= 1
                self.metrics.held.labels(model).dec()

    def _unavailable(self, route: Route, why: str) -> web.Response:
        state = "is scaled to zero" if route.replicas == 0 else f"has no Ready pod of {route.replicas}"
        return error_response(
            503, f"Model {route.model!r} (InferenceService {route.namespace}/{route.service}) {state}: {why}. "
                 f"Retry after {self.settings.retry_after_seconds} s; `kubectl describe kvis {route.service} "
                 f"-n {route.namespace}` says what it waits for.",
            code="model_not_ready", retry_after=self.settings.retry_after_seconds)

    async def _attempt(self, request: web.Request, model: str, backend: Backend, raw: bytes, reason: str,
                       last: bool) -> web.StreamResponse | Refusal:
        """Sends the request to ``backend``; streams its response back, or returns why it refused."""
        assert self.session is not None, "the app's upstream session opens at its start-up"
        headers = _forwardable(request.headers)
        self.board.started(backend.key)
        self.metrics.in_flight.labels(model).inc()
        sent = time.monotonic()
        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                upstream = await self.session.post(backend.url + request.path, data=raw, headers=headers)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
                kind = "connect_error" if isinstance(exc, aiohttp.ClientConnectorError) else "disconnected"
                return Refusal(kind, error=f"{type(exc).__name__}: {exc}")
            self.metrics.upstream_latency.labels(model).observe(time.monotonic() - sent)
            if upstream.status in RETRY_STATUSES and not last:
                try:
                    body = await upstream.read()
                except aiohttp.ClientError as exc:
                    return Refusal("disconnected", error=f"{type(exc).__name__}: {exc}")
                return Refusal(f"status_{upstream.status}", upstream.status, CIMultiDict(upstream.headers), body)
            return await self._stream(request, upstream, backend, reason)
        finally:
            if upstream is not None:
                upstream.close()  # a no-op once fully read; otherwise the engine sees the disconnect
            self.board.finished(backend.key)
            self.metrics.in_flight.labels(model).dec()

    async def _stream(self, request: web.Request, upstream: aiohttp.ClientResponse, backend: Backend,
                      reason: str) -> web.StreamResponse:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                      headers=_forwardable(upstream.headers))
        response.headers[contract.POD_HEADER] = backend.key
        response.headers[contract.ROUTE_REASON_HEADER] = reason
        await response.prepare(request)
        chunks = upstream.content.iter_any().__aiter__()
        while True:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except aiohttp.ClientError as exc:
                raise UpstreamBroken(f"engine pod {backend.key} broke off its response: {exc!r}") from exc
            await _to_client(response.write(chunk))
        await _to_client(response.write_eof())
        return response


async def _to_client(write: Awaitable[None]) -> None:
    """A write to the client; one that went away before its handler was cancelled ends the handler as that
    cancellation would (the caller's cleanup closes the upstream; aiohttp drops the connection quietly)."""
    try:
        await write
    except ConnectionResetError:
        raise asyncio.CancelledError from None
