"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.lora.adapter import LoRARequest
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.request import InvalidRequestError
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.spec_decode.config import SpeculativeConfig

PromptType = str | Sequence[int]


class LLM:
    """Generate for a batch of prompts with continuous batching over a paged KV cache.

    >>> llm = LLM(model="/models/tiny", dtype="float32")       # doctest: +SKIP
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8))  # doctest: +SKIP
    >>> out[0].outputs[0].text                                 # doctest: +SKIP
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        device: str = "auto",
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory: int | None = None,
        cpu_memory_limit: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        seed: int = 0,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        quantization: str = "auto",
        speculative_config: dict[str, Any] | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
    ) -> None:
        config = EngineConfig(
            model=str(model),
            dtype=dtype,
            device=device,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory=kv_cache_memory,
            cpu_memory_limit=cpu_memory_limit,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            seed=seed,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            quantization=quantization,
            speculative_config=SpeculativeConfig.from_dict(speculative_config),
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
        )
        self.llm_engine = LLMEngine.from_config(config)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        ``prompts``: a string, a list of token ids, or a list of either.
        ``sampling_params``: one for all prompts or one per prompt (default: SamplingParams()).
        ``lora_request``: the LoRA adapter for all prompts, or one (or None) per prompt (needs enable_lora).
        """
        prompt_list = _as_prompt_list(prompts)
        params_list = _per_prompt("sampling_params", sampling_params or SamplingParams(), SamplingParams,
                                  len(prompt_list))
        lora_list = _per_prompt("lora_request", lora_request, LoRARequest, len(prompt_list))
        engine = self.llm_engine
        tokenizer = engine.tokenizer
        request_ids = []
        try:
            for index, (prompt, params, lora) in enumerate(zip(prompt_list, params_list, lora_list)):
                if isinstance(prompt, str):
                    text, token_ids = prompt, tokenizer(prompt).input_ids
                else:
                    text, token_ids = None, list(prompt)
                request_id = str(next(self._request_counter))
                try:
                    engine.add_request(request_id, token_ids, params, prompt=text, lora_request=lora)
                except InvalidRequestError as exc:
                    raise InvalidRequestError(f"prompt {index}: {exc}") from exc
                request_ids.append(request_id)
        except BaseException:
            engine.abort_request(request_ids)  # none of this batch runs if one prompt is bad
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` messages) or a list
        of them, rendered with the model's chat template (or ``chat_template``, a Jinja template) and
        generated as ``generate`` does. ``tools`` (OpenAI's function definitions) reach the template,
        as in vLLM; the answer is text (constrain it with ``SamplingParams.structured_outputs``)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        try:
            texts = [tokenizer.apply_chat_template(list(conversation), tokenize=False, chat_template=chat_template,
                                                   add_generation_prompt=add_generation_prompt, tools=tools)
                     for conversation in conversations]
        except (ValueError, TypeError) as exc:  # no template, or a template that rejects the messages
            raise InvalidRequestError(f"messages: the chat template cannot render them: {exc}") from None
        # The rendered template already holds the BOS text, if the model uses one.
        outputs = self.generate([tokenizer.encode(text, add_special_tokens=False) for text in texts],
                                sampling_params, use_tqdm, lora_request)
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while len(finished) < len(wanted) and engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in wanted:
                        finished[output.request_id] = output
                        if progress is not None:
                            progress.update(1)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        finally:
            if progress is not None:
                progress.close()
        return [finished[request_id] for request_id in request_ids]


def _per_prompt(name: str, value: Any, one: type, num_prompts: int) -> list:
    """``value`` for every prompt when it is one ``one`` (or None), else its items, one per prompt."""
    if value is None or isinstance(value, one):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise InvalidRequestError(
            f"{name}: got {len(values)} for {num_prompts} prompts; pass one {one.__name__}, or one per prompt"
        )
    return values


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise InvalidRequestError(
            f"prompts: expected a string, a list of token ids, or a list of either; got {type(prompts).__name__}"
        )
    if not prompts:
        return []
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [list(prompts)]
    result: list[PromptType] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            result.append(prompt)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            result.append(list(prompt))
        else:
            raise InvalidRequestError(
                f"prompt {index}: expected a string or a list of token ids, got {type(prompt).__name__}"
            )
    return result
