"""The kvpilot inference engine: paged KV cache, continuous batching, OpenAI-compatible server.

``from kvpilot.engine import LLM, SamplingParams`` works as in vLLM. The names
load lazily so that ``import kvpilot.engine.cli`` (and ``kvpilot --help``)
never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY_EXPORTS = {
    "LLM": "kvpilot.engine.llm",
    "LLMEngine": "kvpilot.engine.llm_engine",
    "EngineStats": "kvpilot.engine.llm_engine",
    "EngineConfig": "kvpilot.engine.config",
    "SamplingParams": "kvpilot.engine.sampling_params",
    "RequestOutputKind": "kvpilot.engine.sampling_params",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
    "InvalidRequestError": "kvpilot.engine.request",
    "LoRARequest": "kvpilot.engine.lora.adapter",
}

__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_EXPORTS))
