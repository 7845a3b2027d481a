"""What every request passes before a route: the admin API's own port, the API key, the body limit.

Middleware runs outside the app's exception handlers, so a refusal here is rendered on the spot
(``ApiError.response()``). The server's state is ``request.app.state.kvpilot``.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpilot.engine.server.errors import ApiError
from kvpilot.engine.server.state import ServerSettings, ServerState
from kvpilot.engine_contract import ADMIN_LOAD_LORA_PATH, ADMIN_UNLOAD_LORA_PATH

ADMIN_PATH_PREFIX = "/admin/"
# vLLM's paths for loading adapters live (clients written for it call them), served as admin API.
ADMIN_LORA_PATHS = (ADMIN_LOAD_LORA_PATH, ADMIN_UNLOAD_LORA_PATH)


def is_admin_path(path: str) -> bool:
    """The admin API's paths: answered only on the admin port, behind the admin token, never the API key."""
    return path.startswith(ADMIN_PATH_PREFIX) or path in ADMIN_LORA_PATHS

CallNext = Callable[[Request], Awaitable[Response]]


def add_middleware(app: FastAPI, settings: ServerSettings) -> None:
    """The last added runs first: a request meets the admin-port check, the API key, the drain's
    Connection: close, then the body limit."""
    app.add_middleware(RequestBodyLimit, limit=settings.max_request_bytes)
    for dispatch in (close_connections_while_draining, api_key_before_the_body, admin_api_on_its_own_port):
        app.add_middleware(BaseHTTPMiddleware, dispatch=dispatch)


def _state(request: Request) -> ServerState:
    return request.app.state.kvpilot


async def close_connections_while_draining(request: Request, call_next: CallNext) -> Response:
    # A client must not keep a connection to a server about to exit: a request it sends on
    # that connection as the server closes it is lost ("connection reset") instead of being
    # answered with the 503 that tells it to go to another replica.
    response = await call_next(request)
    if _state(request).draining:
        response.headers["Connection"] = "close"
    return response


async def api_key_before_the_body(request: Request, call_next: CallNext) -> Response:
    # Checked before the body is read: a client without the key costs no JSON parsing and
    # learns nothing about what the API would accept.
    api_key = _state(request).settings.api_key
    if api_key is not None and request.url.path.startswith("/v1/") and not is_admin_path(request.url.path):
        try:
            check_token(request, api_key, "API key")
        except ApiError as exc:
            return exc.response()
    return await call_next(request)


async def admin_api_on_its_own_port(request: Request, call_next: CallNext) -> Response:
    admin_port = _state(request).settings.admin_port
    server = request.scope.get("server")
    on_admin_port = admin_port is not None and server is not None and server[1] == admin_port
    if is_admin_path(request.url.path) != on_admin_port:
        if on_admin_port:
            refusal = ApiError(404, "Not found: this port serves only the admin API (/admin/v1/...).")
        else:
            refusal = ApiError(404, "Not found: the admin API listens on its own port (--admin-port), "
                                    "and only when the server has an --admin-token.")
        return refusal.response()
    return await call_next(request)


def check_token(request: Request, expected: str, what: str) -> None:
    """Raises a 401 unless the request carries ``Authorization: Bearer <expected>``."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, f"Missing {what}: send the header `Authorization: Bearer <{what}>`.")
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise ApiError(401, f"Invalid {what}.", code="invalid_api_key")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes): send a shorter prompt or fewer prompts per request.")


class RequestBodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets an OpenAI-shaped 413, refused before a
    byte is read when Content-Length announces it, or once the count passes the limit when it arrives
    chunked. (FastAPI's own max_body_size answers a plain-text 413 whenever Content-Length is too large,
    whatever the app's exception handlers say.)"""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = dict(scope["headers"]).get(b"content-length", b"")
        if announced.isdigit() and int(announced) > self.limit:
            await body_too_large(self.limit).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI passes an HTTPException raised while it reads the body on to the app's
                    # handlers, which render it as an ApiError of the same status and message.
                    raise StarletteHTTPException(413, body_too_large(self.limit).message)
            return message

        await self.app(scope, counting_receive, send)
