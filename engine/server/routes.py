"""The HTTP routes, one router per surface: the OpenAI API, the admin API, health and metrics.

Routes only translate: the serving logic is in serving.py, the engine thread in async_engine.py.
A route reaches the server's state as a dependency (``app.state.kvpilot``) and refuses a request
by raising ``ApiError``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from kvpilot.engine.lora import LoRAAdapter, LoRAError
from kvpilot.engine.server import protocol as p
from kvpilot.engine.server.async_engine import EngineDeadError
from kvpilot.engine.server.errors import ApiError, param_from_message
from kvpilot.engine.server.middleware import check_token
from kvpilot.engine.server.state import ServerState
from kvpilot.engine_contract import (
    ADMIN_LOAD_LORA_PATH,
    ADMIN_LORA_ADAPTERS_PATH,
    ADMIN_SCHEDULER_PATH,
    ADMIN_UNLOAD_LORA_PATH,
    HEALTH_PATH,
    METRICS_PATH,
)

if TYPE_CHECKING:
    from kvpilot.engine.llm_engine import EngineStats

logger = logging.getLogger(__name__)


def _server_state(request: Request) -> ServerState:
    return request.app.state.kvpilot


State = Annotated[ServerState, Depends(_server_state)]


def _render(result: BaseModel | AsyncIterator[str]) -> Response:
    if isinstance(result, AsyncIterator):
        return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return Response(result.model_dump_json(), media_type="application/json")


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone: the ASGI channel's http.disconnect message."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the OpenAI API ---------------------------------------------------------------------

openai_routes = APIRouter()


@openai_routes.post("/v1/completions")
async def completions(body: p.CompletionRequest, request: Request, state: State) -> Response:
    state.check_available()
    return _render(await state.serving.create_completion(body, lambda: _until_disconnected(request)))


@openai_routes.post("/v1/chat/completions")
async def chat_completions(body: p.ChatCompletionRequest, request: Request, state: State) -> Response:
    state.check_available()
    return _render(await state.serving.create_chat_completion(body, lambda: _until_disconnected(request)))


@openai_routes.get("/v1/models")
async def models(state: State) -> Response:
    return _render(state.serving.list_models())


# ---- health and metrics -------------------------------------------------------------------

monitoring_routes = APIRouter()


@monitoring_routes.get(HEALTH_PATH)
async def health(state: State) -> Response:
    dead_error = state.async_engine.dead_error
    if dead_error is not None or not state.async_engine.is_alive:
        reason = repr(dead_error) if dead_error else "not running"
        return JSONResponse({"status": "engine_dead", "error": reason}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


@monitoring_routes.get(METRICS_PATH)
async def metrics(state: State) -> Response:
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# ---- the admin API (reached only on the admin port: middleware.py) ---------------------------

admin_routes = APIRouter()


def _require_admin(request: Request, state: ServerState) -> None:
    admin_token = state.settings.admin_token
    if admin_token is None:
        raise ApiError(404, "Not found: the admin API is off (start the server with --admin-token).")
    check_token(request, admin_token, "admin token")


def _limits(stats: EngineStats) -> p.SchedulerLimits:
    return p.SchedulerLimits(
        max_num_seqs=stats.max_num_seqs,
        max_num_batched_tokens=stats.max_num_batched_tokens,
        num_speculative_tokens=stats.num_speculative_tokens,
    )


@admin_routes.get(ADMIN_SCHEDULER_PATH)
async def get_scheduler(request: Request, state: State) -> Response:
    _require_admin(request, state)
    return _render(_limits(state.async_engine.stats()))


@admin_routes.post(ADMIN_SCHEDULER_PATH)
async def set_scheduler(body: p.SchedulerLimitsUpdate, request: Request, state: State) -> Response:
    # Checked here, after FastAPI validated the body: a malformed body is a 400 whatever the token.
    _require_admin(request, state)
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


@admin_routes.get(ADMIN_LORA_ADAPTERS_PATH)
async def list_lora_adapters(request: Request, state: State) -> Response:
    _require_admin(request, state)
    adapters = sorted(state.async_engine.loras.values(), key=lambda a: a.name)
    return _render(p.LoRAAdapterList(
        enabled=state.async_engine.engine.config.enable_lora,
        data=[p.LoRAAdapterInfo(name=a.name, path=a.request.lora_path, rank=a.rank) for a in adapters]))


@admin_routes.post(ADMIN_LOAD_LORA_PATH)
async def load_lora_adapter(body: p.LoadLoRAAdapterRequest, request: Request, state: State) -> Response:
    """vLLM's endpoint: the adapter is read and checked now, and requests may name it once this answers."""
    _require_admin(request, state)
    if body.lora_name == state.settings.served_model_name:
        raise ApiError(400, f"lora_name: `{body.lora_name}` is the served model's own name; pick another",
                       param="lora_name")
    loaded = state.async_engine.loras.get(body.lora_name)
    if loaded is not None and loaded.request.lora_path != body.lora_path:
        raise ApiError(400, f"The LoRA adapter `{body.lora_name}` is already loaded from {loaded.request.lora_path}; "
                            "unload it first to load another under that name", param="lora_name")
    # The same name from the same folder again answers as the first load did (the operator's syncs
    # may race), where vLLM answers 400.
    adapter = loaded or await _lora_call(
        state.async_engine.load_lora(state.next_lora_request(body.lora_name, body.lora_path)))
    logger.info("admin: LoRA adapter %r loaded from %s (rank %d)", adapter.name, body.lora_path, adapter.rank)
    return Response(f"Success: LoRA adapter '{adapter.name}' added successfully.", media_type="text/plain")


@admin_routes.post(ADMIN_UNLOAD_LORA_PATH)
async def unload_lora_adapter(body: p.UnloadLoRAAdapterRequest, request: Request, state: State) -> Response:
    _require_admin(request, state)
    if body.lora_name not in state.async_engine.loras:
        loaded = ", ".join(f"`{n}`" for n in sorted(state.async_engine.loras)) or "none"
        raise ApiError(404, f"The LoRA adapter `{body.lora_name}` is not loaded; loaded: {loaded}",
                       param="lora_name", code="model_not_found")
    adapter = await _lora_call(state.async_engine.unload_lora(body.lora_name))
    state.metrics.forget_lora(adapter.name)
    logger.info("admin: LoRA adapter %r unloaded", adapter.name)
    return Response(f"Success: LoRA adapter '{adapter.name}' removed successfully.", media_type="text/plain")


async def _lora_call(call: Awaitable[LoRAAdapter]) -> LoRAAdapter:
    try:
        return await call
    except EngineDeadError as exc:
        raise ApiError(503, str(exc), code="engine_dead", error_type="server_error") from None
    except LoRAError as exc:  # names the adapter and the field of its folder at fault
        raise ApiError(400, str(exc), param="lora_path") from None
    except ValueError as exc:  # LoRA off: says which flag turns it on
        raise ApiError(400, str(exc)) from None
