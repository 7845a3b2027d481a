"""What the server needs from the engine it serves: ``LLMEngine`` has it all, a test double only this.

The types are named for the type checker alone, so importing the server never imports torch
through them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvpilot.engine.config import EngineConfig, ResolvedConfig
    from kvpilot.engine.llm_engine import EngineStats
    from kvpilot.engine.lora import LoRAAdapter, LoRARequest
    from kvpilot.engine.model_runner import ModelRunner
    from kvpilot.engine.models import ModelArch
    from kvpilot.engine.outputs import RequestOutput
    from kvpilot.engine.sampling_params import SamplingParams
    from kvpilot.engine.structured_outputs import GrammarCompiler


class Engine(Protocol):
    """A synchronous engine: requests in, one ``step()`` at a time, outputs out; one thread drives it."""

    config: EngineConfig
    resolved: ResolvedConfig
    arch: ModelArch
    tokenizer: PreTrainedTokenizerBase
    runner: ModelRunner
    grammars: GrammarCompiler
    max_model_len: int

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prompt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None: ...

    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapter: ...

    def remove_lora(self, lora_name: str) -> LoRAAdapter: ...

    def list_loras(self) -> list[LoRAAdapter]: ...

    def abort_request(self, request_ids: str | Iterable[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def set_scheduler_limits(
        self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None
    ) -> None: ...

    def set_num_speculative_tokens(self, num_speculative_tokens: int) -> None: ...
