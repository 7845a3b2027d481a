"""The HTTP layer: FastAPI routes, auth, OpenAI-shaped errors, graceful drain.

Routes only translate: the serving logic is in serving.py, the engine thread in
async_engine.py. Endpoints:

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
import hmac
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine.server import protocol as p
from kvpilot.engine.server.async_engine import AsyncLLMEngine, EngineDeadError
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.errors import ApiError
from kvpilot.engine.server.serving import ChatSettings, ModelInfo, OpenAIServing, param_from_message
from kvpilot.engine_contract import ADMIN_SCHEDULER_PATH, HEALTH_PATH, METRICS_PATH

logger = logging.getLogger(__name__)


DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # far above any prompt a context window holds, as text or token ids


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    admin_token: str | None = None
    admin_port: int | None = None  # the local port whose requests are the admin API's; None: admin API off
    max_waiting_requests: int | None = None
    shutdown_grace_period: float = 30.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    chat: ChatSettings = ChatSettings()


class ServerState:
    """Everything one app instance serves with."""

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics(
            model_name=settings.served_model_name,
            stats=lambda: self.async_engine.stats(),
            num_waiting=lambda: self.async_engine.num_waiting,
            gpu_memory_utilization=engine.config.gpu_memory_utilization,
            model_info=_model_info(engine),
        )
        self.async_engine = AsyncLLMEngine(
            engine, max_waiting_requests=settings.max_waiting_requests, observer=self.metrics
        )
        self.serving = OpenAIServing(
            self.async_engine,
            engine.tokenizer,
            ModelInfo(settings.served_model_name, engine.config.model, engine.max_model_len),
            engine.grammars,
            settings.chat,
        )
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None

    async def drain(self) -> None:
        """Fail readiness, refuse new requests, let in-flight ones finish within the grace period."""
        if self.draining:
            return
        self.draining = True
        self.async_engine.stop_accepting()
        grace = self.settings.shutdown_grace_period
        logger.info(
            "draining: /health now returns 503 and new requests get 503; waiting up to %.0fs for %d in-flight "
            "request(s)",
            grace,
            self.async_engine.num_in_flight,
        )
        deadline = time.monotonic() + grace
        while self.async_engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.async_engine.num_in_flight:
            logger.warning(
                "grace period of %.0fs over: aborting %d request(s)", grace, self.async_engine.num_in_flight
            )
            self.async_engine.abort_all()
        else:
            logger.info("drained: no requests in flight")


def _model_info(engine: Any) -> dict[str, str]:
    config, resolved = engine.config, engine.resolved
    return {
        "architecture": engine.arch.architecture,
        "dtype": resolved.dtype,
        "device": resolved.device,
        "attention_backend": resolved.attention_backend,
        "block_size": str(config.block_size),
        "max_model_len": str(resolved.max_model_len),
        # The matmul kernels picked at load for this CPU and file (w4a8/w8a8: int8 activations).
        "weight_layouts": weight_layouts(engine.runner.model),
    }


def weight_layouts(model: Any) -> str:
    """The layouts of a model's packed weights, e.g. "w4a8,w8a8"; "dense" when none is packed."""
    from kvpilot.engine.linear import Linear

    layouts = sorted({m.layout for m in model.modules() if isinstance(m, Linear)} - {"dense"})
    return ",".join(layouts) or "dense"


ADMIN_PATH_PREFIX = "/admin/"


def _local_port(request: Request) -> int | None:
    server = request.scope.get("server")
    return server[1] if server else None


def _limits(stats: Any) -> p.SchedulerLimits:
    return p.SchedulerLimits(
        max_num_seqs=stats.max_num_seqs,
        max_num_batched_tokens=stats.max_num_batched_tokens,
        num_speculative_tokens=stats.num_speculative_tokens,
    )


def _bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _check_token(request: Request, expected: str, what: str) -> None:
    token = _bearer_token(request)
    if token is None:
        raise ApiError(401, f"Missing {what}: send the header `Authorization: Bearer <{what}>`.")
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise ApiError(401, f"Invalid {what}.", code="invalid_api_key")


class RequestBodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes gets an OpenAI-shaped 413, refused before a
    byte is read when Content-Length announces it, or once the count passes the limit when it arrives
    chunked. (FastAPI's own max_body_size answers a plain-text 413 whenever Content-Length is too large,
    whatever the app's exception handlers say.)"""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        announced = dict(scope["headers"]).get(b"content-length", b"")
        if announced.isdigit() and int(announced) > self.limit:
            await body_too_large(self.limit).response()(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI passes an HTTPException raised while it reads the body on to the handlers.
                    raise StarletteHTTPException(413)
            return message

        await self.app(scope, counting_receive, send)


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes): send a shorter prompt or fewer prompts per request.")


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone: the ASGI channel's http.disconnect message."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _render(result: Any) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(result.model_dump_json(), media_type="application/json")


def _validation_param(loc: tuple[Any, ...], message: str) -> str | None:
    parts = [str(part) for part in loc if part != "body"]
    # Union members show up as their type name in the location ("str", "list[int]"); drop them.
    parts = [part for part in parts if not any(ch in part for ch in "[]") and part not in ("str", "int", "float")]
    if parts:
        param = parts[0]
        for part in parts[1:]:
            param += f"[{part}]" if part.isdigit() else f".{part}"
        return param
    return param_from_message(message, _REQUEST_FIELDS)


# What a whole body that is not a JSON object of fields fails with (a model validator's errors sit there too).
_NOT_AN_OBJECT = ("missing", "model_type", "model_attributes_type", "dict_type")

_REQUEST_FIELDS = tuple(
    sorted(
        set(p.CompletionRequest.model_fields) | set(p.ChatCompletionRequest.model_fields)
        | set(p.SchedulerLimitsUpdate.model_fields),
        key=len,
        reverse=True,
    )
)


def build_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The ASGI app serving ``engine`` (a started LLMEngine); the engine thread runs for the app's lifespan."""
    state = ServerState(engine, settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        state.async_engine.start()
        yield
        await state.async_engine.shutdown()

    app = FastAPI(title="kvpilot", lifespan=lifespan)
    app.state.kvpilot = state
    app.add_middleware(RequestBodyLimit, limit=settings.max_request_bytes)

    @app.middleware("http")
    async def close_connections_while_draining(request: Request, call_next):
        # A client must not keep a connection to a server about to exit: a request it sends on
        # that connection as the server closes it is lost ("connection reset") instead of being
        # answered with the 503 that tells it to go to another replica.
        response = await call_next(request)
        if state.draining:
            response.headers["Connection"] = "close"
        return response

    @app.middleware("http")
    async def api_key_before_the_body(request: Request, call_next):
        # Checked before the body is read: a client without the key costs no JSON parsing and
        # learns nothing about what the API would accept.
        if settings.api_key is not None and request.url.path.startswith("/v1/"):
            try:
                _check_token(request, settings.api_key, "API key")
            except ApiError as exc:
                return exc.response()
        return await call_next(request)

    @app.middleware("http")
    async def admin_api_on_its_own_port(request: Request, call_next):
        on_admin_port = settings.admin_port is not None and _local_port(request) == settings.admin_port
        if request.url.path.startswith(ADMIN_PATH_PREFIX) != on_admin_port:
            if on_admin_port:
                refusal = ApiError(404, "Not found: this port serves only the admin API (/admin/v1/...).")
            else:
                refusal = ApiError(404, "Not found: the admin API listens on its own port (--admin-port), "
                                        "and only when the server has an --admin-token.")
            return refusal.response()
        return await call_next(request)

    def require_admin(request: Request) -> None:
        if settings.admin_token is None:
            raise ApiError(404, "Not found: the admin API is off (start the server with --admin-token).")
        _check_token(request, settings.admin_token, "admin token")

    def refuse_if_unavailable() -> None:
        if state.draining:
            raise ApiError(503, "The server is shutting down; send the request to another replica.",
                           code="shutting_down")
        if state.async_engine.dead_error is not None:
            raise ApiError(503, f"The engine has stopped: {state.async_engine.dead_error!r}",
                           code="engine_dead", error_type="server_error")

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0]
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        param = _validation_param(tuple(first.get("loc", ())), message)
        if first.get("type") == "json_invalid":
            message, param = "The request body is not valid JSON.", None
        elif tuple(first.get("loc", ())) == ("body",) and first.get("type") in _NOT_AN_OBJECT:
            message, param = ("The request body must be a JSON object of the request's fields, sent with "
                              "`Content-Type: application/json`."), None
        elif first.get("type") == "missing":
            message = f"{param}: this field is required"
        elif param and not message.startswith(param.split("[")[0].split(".")[0] + ":"):
            message = f"{param}: {message}"
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 413:
            return body_too_large(settings.max_request_bytes).response()
        return ApiError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        return ApiError(500, f"Internal server error: {exc!r}").response()

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        refuse_if_unavailable()
        return _render(await state.serving.create_completion(body, lambda: _until_disconnected(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        refuse_if_unavailable()
        return _render(await state.serving.create_chat_completion(body, lambda: _until_disconnected(request)))

    @app.get("/v1/models")
    async def models() -> Response:
        return _render(state.serving.list_models())

    @app.get(HEALTH_PATH)
    async def health() -> Response:
        if state.async_engine.dead_error is not None or not state.async_engine.is_alive:
            reason = repr(state.async_engine.dead_error) if state.async_engine.dead_error else "not running"
            return JSONResponse({"status": "engine_dead", "error": reason}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get(METRICS_PATH)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(ADMIN_SCHEDULER_PATH)
    async def get_scheduler(request: Request) -> Response:
        require_admin(request)
        return _render(_limits(state.async_engine.stats()))

    @app.post(ADMIN_SCHEDULER_PATH)
    async def set_scheduler(body: p.SchedulerLimitsUpdate, request: Request) -> Response:
        require_admin(request)
        if body.max_num_seqs is None and body.max_num_batched_tokens is None and body.num_speculative_tokens is None:
            raise ApiError(400, "Give max_num_seqs, max_num_batched_tokens and/or num_speculative_tokens to change.")
        before = state.async_engine.stats()
        try:
            after = await state.async_engine.set_scheduler_limits(
                body.max_num_seqs, body.max_num_batched_tokens, body.num_speculative_tokens
            )
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), code="engine_dead", error_type="server_error") from None
        except ValueError as exc:
            candidates = ("max_num_batched_tokens", "max_num_seqs", "num_speculative_tokens")
            raise ApiError(400, str(exc), param=param_from_message(str(exc), candidates)) from None
        logger.info(
            "admin: scheduler limits changed: max_num_seqs %d -> %d, max_num_batched_tokens %d -> %d",
            before.max_num_seqs, after.max_num_seqs, before.max_num_batched_tokens, after.max_num_batched_tokens,
        )  # fmt: skip
        if after.num_speculative_tokens != before.num_speculative_tokens:
            logger.info("admin: num_speculative_tokens changed: %d -> %d",
                        before.num_speculative_tokens, after.num_speculative_tokens)
        return _render(_limits(after))

    return app


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

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_requested or self.state.loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._drain_requested = True
        logger.info("received signal %d: draining before shutdown (send it again to stop at once)", sig)
        self.state.loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self.state.drain())
        self._drain_task.add_done_callback(lambda _: setattr(self, "should_exit", True))
