"""What one app serves with: its settings, the async engine, the serving logic, metrics, the drain.

build_app (api_server.py) makes one ``ServerState`` and keeps it as ``app.state.kvpilot``, where
routes and middleware reach it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.lora import LoRARequest
from kvpilot.engine.server.async_engine import AsyncLLMEngine
from kvpilot.engine.server.engine_protocol import Engine
from kvpilot.engine.server.errors import ApiError
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.server.serving import ChatSettings, ModelInfo, OpenAIServing

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 32 << 20  # far above any prompt a context window holds, as text or token ids


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    admin_token: str | None = None
    admin_port: int | None = None  # the local port whose requests are the admin API's; None: admin API off
    max_waiting_requests: int | None = None
    max_waiting_seconds: float | None = None
    shutdown_grace_period: float = 30.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    chat: ChatSettings = ChatSettings()


class ServerState:
    """Everything one app instance serves with."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics(
            model_name=settings.served_model_name,
            stats=lambda: self.async_engine.stats(),
            num_waiting=lambda: self.async_engine.num_waiting,
            gpu_memory_utilization=engine.config.gpu_memory_utilization,
            model_info=_model_info(engine),
        )
        self.async_engine = AsyncLLMEngine(
            engine,
            max_waiting_requests=settings.max_waiting_requests,
            max_waiting_seconds=settings.max_waiting_seconds,
            observer=self.metrics,
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
        # Each adapter load gets an id of its own, so the prefix cache never mixes two loads' blocks.
        self._lora_ids = itertools.count(1 + max((a.request.lora_int_id for a in engine.list_loras()), default=0))

    def next_lora_request(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(name, next(self._lora_ids), path)

    def check_available(self) -> None:
        """Refuses a new request with a 503 while draining or after the engine loop died."""
        if self.draining:
            raise ApiError(503, "The server is shutting down; send the request to another replica.",
                           code="shutting_down")
        if self.async_engine.dead_error is not None:
            raise ApiError(503, f"The engine has stopped: {self.async_engine.dead_error!r}",
                           code="engine_dead", error_type="server_error")

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


def _model_info(engine: Engine) -> dict[str, str]:
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


def weight_layouts(model: torch.nn.Module) -> str:
    """The layouts of a model's packed weights, e.g. "w4a8,w8a8"; "dense" when none is packed."""
    from kvpilot.engine.linear import Linear

    layouts = sorted({m.layout for m in model.modules() if isinstance(m, Linear)} - {"dense"})
    return ",".join(layouts) or "dense"
