"""The serving logic behind /v1/completions and /v1/chat/completions.

A request becomes prompt token ids (the chat template comes from the model's
tokenizer) and SamplingParams, goes to the async engine, and its delta outputs
(RequestOutputKind.DELTA) become one OpenAI response or a stream of Server-Sent Events. Every
method returns a response model or an async iterator of SSE lines, and raises
``ApiError`` for a request it refuses.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kvpilot.engine.outputs import CompletionOutput, RequestOutput
from kvpilot.engine.request import InvalidRequestError
from kvpilot.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpilot.engine.server import protocol as p
from kvpilot.engine.server import tool_calls
from kvpilot.engine.server.errors import ApiError, param_from_message
from kvpilot.engine.structured_outputs import GrammarCompiler, StructuredOutputsParams
from kvpilot.engine.server.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineDrainingError,
    EngineOverloadedError,
    RequestAbortedError,
    RequestStream,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvpilot.engine.lora import LoRARequest

logger = logging.getLogger(__name__)

# What the two endpoints' builders take and make.
_Request = p.CompletionRequest | p.ChatCompletionRequest
_Chunk = p.CompletionChunk | p.ChatCompletionChunk
_StreamChoice = p.CompletionChoice | p.ChatStreamChoice
_Response = p.CompletionResponse | p.ChatCompletionResponse

# SamplingParams names its field first in every message ("temperature: must be ...").
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop_token_ids", "stop", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "skip_special_tokens", "include_stop_str_in_output", "structured_outputs", "response_format",
)  # fmt: skip


def _constraint(request: p.SamplingFields) -> StructuredOutputsParams | None:
    """The request's structured-output constraint: the one tool_choice puts on the tools' arguments,
    vLLM's structured_outputs, or OpenAI's response_format."""
    if isinstance(request, p.ChatCompletionRequest) and request.tools:
        tools = [tool.model_dump() for tool in request.tools]
        choice = tool_calls.constraint(tools, request.effective_tool_choice(), request.parallel_tool_calls)
        if choice is not None:
            return choice
    if request.structured_outputs is not None:
        return StructuredOutputsParams.from_dict(request.structured_outputs)
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    schema = response_format.json_schema.schema_
    if not schema:
        raise ValueError("response_format.json_schema.schema: give the JSON schema the output must match")
    return StructuredOutputsParams(json=schema)


@dataclass
class ModelInfo:
    served_name: str
    root: str
    max_model_len: int


@dataclass(frozen=True)
class ChatSettings:
    """How chat requests become prompts and answers (`kvpilot serve --chat-template`, --tool-call-parser)."""

    chat_template: str | None = None  # Jinja text overriding the model's own template
    tool_call_parser: str | None = None  # a name in tool_calls.PARSERS; None: tool_choice auto is refused


@dataclass
class _PromptInput:
    token_ids: list[int]
    text: str | None


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: PreTrainedTokenizerBase, model: ModelInfo,
                 grammars: GrammarCompiler, chat: ChatSettings = ChatSettings()) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.model = model
        self.chat = chat
        self._token_text: dict[int, str] = {}

    # ---- models ----------------------------------------------------------------

    def list_models(self) -> p.ModelList:
        """The model, then each LoRA adapter with the model as its parent (as vLLM lists them)."""
        cards = [p.ModelCard(id=self.model.served_name, root=self.model.root, max_model_len=self.model.max_model_len)]
        for name, adapter in sorted(self.engine.loras.items()):
            cards.append(p.ModelCard(id=name, root=adapter.request.lora_path, parent=self.model.served_name,
                                     max_model_len=self.model.max_model_len))
        return p.ModelList(data=cards)

    def resolve_model(self, requested: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, None for the model itself; 404 for anything else."""
        if requested is None or requested == self.model.served_name:
            return None
        adapter = self.engine.loras.get(requested)
        if adapter is not None:
            return adapter.request
        names = ", ".join(f"`{n}`" for n in [self.model.served_name, *sorted(self.engine.loras)])
        raise ApiError(
            404,
            f"The model `{requested}` does not exist; this server serves {names}.",
            param="model",
            code="model_not_found",
        )

    # ---- completions -------------------------------------------------------------

    async def create_completion(
        self, request: p.CompletionRequest, until_disconnected: Callable[[], Awaitable[None]]
    ) -> p.CompletionResponse | AsyncIterator[str]:
        lora = self.resolve_model(request.model)
        prompts = [self._completion_prompt(prompt) for prompt in _split_prompts(request.prompt)]
        params = [
            self._sampling_params(request, prompt, request.max_tokens, request.logprobs, "prompt")
            for prompt in prompts
        ]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        await self._check_constraint(request, params[0])
        streams = await self._add_all(request_id, prompts, params, "prompt", lora)
        builder = _CompletionBuilder(self, request, request_id, prompts)
        if request.stream:
            return self._stream(streams, builder, until_disconnected)
        return await self._collect(streams, builder, until_disconnected)

    def _completion_prompt(self, prompt: str | list[int]) -> _PromptInput:
        if isinstance(prompt, str):
            return _PromptInput(self.tokenizer.encode(prompt, add_special_tokens=True), prompt)
        return _PromptInput(list(prompt), None)

    # ---- chat ----------------------------------------------------------------------

    async def create_chat_completion(
        self, request: p.ChatCompletionRequest, until_disconnected: Callable[[], Awaitable[None]]
    ) -> p.ChatCompletionResponse | AsyncIterator[str]:
        lora = self.resolve_model(request.model)
        parser = self._tool_call_parser(request)
        prompt = self._chat_prompt(request)
        top_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        params = [self._sampling_params(request, prompt, request.output_token_limit(), top_logprobs, "messages")]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        await self._check_tools(request)
        await self._check_constraint(request, params[0])
        streams = await self._add_all(request_id, [prompt], params, "messages", lora)
        builder = _ChatBuilder(self, request, request_id, [prompt], parser)
        if request.stream:
            return self._stream(streams, builder, until_disconnected)
        return await self._collect(streams, builder, until_disconnected)

    def _tool_call_parser(self, request: p.ChatCompletionRequest) -> tool_calls.ToolCallParser | None:
        choice = request.effective_tool_choice()
        if choice == "auto" and self.chat.tool_call_parser is None:
            raise ApiError(
                400,
                "tool_choice: auto needs a server started with --tool-call-parser (one of "
                f"{', '.join(tool_calls.PARSERS)}) to find the calls in the model's text; send tool_choice "
                "required or a named function (the output is then constrained to the tools), or none",
                param="tool_choice",
            )
        return tool_calls.parser_for(choice, self.chat.tool_call_parser)

    def _chat_prompt(self, request: p.ChatCompletionRequest) -> _PromptInput:
        if not (self.chat.chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ApiError(
                400,
                f"The model `{self.model.served_name}` has no chat template (no chat_template in its "
                "tokenizer_config.json), so /v1/chat/completions cannot format messages; use "
                "/v1/completions with a plain prompt, or serve a model that ships a chat template.",
                param="messages",
                code="chat_template_missing",
            )
        messages = [_template_message(i, message) for i, message in enumerate(request.messages)]
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                chat_template=self.chat.chat_template,
                tokenize=False,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
            )
        except Exception as exc:  # the template is the model's own Jinja code and may raise anything
            raise ApiError(400, f"The chat template rejected these messages: {exc}", param="messages") from None
        # The rendered template already holds the BOS text, if the model uses one.
        return _PromptInput(self.tokenizer.encode(text, add_special_tokens=False), text)

    # ---- shared ---------------------------------------------------------------------

    def _sampling_params(
        self,
        request: p.SamplingFields,
        prompt: _PromptInput,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
    ) -> SamplingParams:
        limit = self.model.max_model_len
        num_prompt = len(prompt.token_ids)
        if num_prompt >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens, but the prompt has {num_prompt} "
                f"tokens, leaving no room to generate. Shorten the {prompt_param}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = limit - num_prompt
        elif num_prompt + max_tokens > limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens, but you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the "
                f"completion). Lower max_tokens to at most {limit - num_prompt} or shorten the {prompt_param}.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        # Those the client left out keep SamplingParams' defaults.
        given: dict[str, float] = {
            name: value
            for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty")  # fmt: skip
            if (value := getattr(request, name)) is not None
        }
        try:
            return SamplingParams(
                n=request.n,
                seed=request.seed,
                stop=request.stop or [],
                stop_token_ids=request.stop_token_ids or [],
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=request.skip_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                structured_outputs=_constraint(request),
                output_kind=RequestOutputKind.DELTA,
                **given,
            )
        except ValueError as exc:
            raise ApiError(400, str(exc), param=param_from_message(str(exc), _SAMPLING_FIELDS)) from None

    async def _check_tools(self, request: p.ChatCompletionRequest) -> None:
        """Each tool's parameters compiled as a JSON schema (cached across requests), so a schema the
        constraint could not use is a 400 naming the tool, whatever tool_choice is."""
        for i, tool in enumerate(request.tools or ()):
            schema = tool.function.parameters or tool_calls.ANY_OBJECT
            try:
                # compact, as tool_calls.constraint compiles it: the named-function case finds it cached
                params = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
                await asyncio.to_thread(self.grammars.check, params)
            except InvalidRequestError as exc:
                problem = str(exc).partition(": ")[2]
                field = f"tools[{i}].function.parameters"
                raise ApiError(400, f"{field}: {problem}", param=field) from None

    async def _check_constraint(self, request: p.SamplingFields, params: SamplingParams) -> None:
        """A structured-output constraint compiled off the engine's thread (it takes the vocabulary's
        llguidance view a second the first time), and refused with a 400 before anything is queued,
        naming the field the client sent."""
        if params.structured_outputs is None:
            return
        try:
            await asyncio.to_thread(self.grammars.check, params.structured_outputs)
        except InvalidRequestError as exc:
            field, _, problem = str(exc).partition(": ")
            if isinstance(request, p.ChatCompletionRequest) and request.tool_choice not in (None, "none", "auto"):
                field = "tool_choice"  # the tools' schemas compile one by one (_check_tools), not together
            elif request.structured_outputs is None:  # it came from response_format
                field = "response_format.json_schema.schema" if field.endswith(".json") else "response_format"
            raise ApiError(400, f"{field}: {problem}", param=field) from None

    async def _add_all(
        self, request_id: str, prompts: list[_PromptInput], params: list[SamplingParams], prompt_param: str,
        lora: LoRARequest | None,
    ) -> list[RequestStream]:
        arrival = time.monotonic()
        streams: list[RequestStream] = []
        try:
            for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(
                    await self.engine.add_request(
                        engine_id, prompt.token_ids, sampling, prompt=prompt.text, arrival_time=arrival,
                        lora_request=lora,
                    )
                )
        except BaseException as exc:
            for stream in streams:
                self.engine.abort(stream.request_id)
            if isinstance(exc, EngineOverloadedError):
                raise ApiError(429, str(exc), code="queue_full") from None
            if isinstance(exc, EngineDrainingError):
                raise ApiError(503, str(exc), code="shutting_down") from None
            if isinstance(exc, EngineDeadError):
                raise ApiError(503, str(exc), code="engine_dead", error_type="server_error") from None
            if isinstance(exc, ValueError):
                # The engine refuses prompts (empty, token id outside the vocabulary) and names them.
                param = param_from_message(str(exc), _SAMPLING_FIELDS) or prompt_param
                raise ApiError(400, str(exc), param=param) from None
            raise
        return streams

    async def _collect(
        self, streams: list[RequestStream], builder: _ResponseBuilder, until_disconnected: Callable[[], Awaitable[None]]
    ) -> _Response:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async with _AbortOnDisconnect(self.engine, streams, until_disconnected):
                async for index, output in _merge(streams):
                    if (so_far := finals[index]) is None:
                        finals[index] = output
                    else:
                        so_far.add(output)
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), code="engine_dead", error_type="server_error") from None
        except RequestAbortedError as exc:
            raise ApiError(503, str(exc), code="aborted", error_type="server_error") from None
        return builder.full_response(finals)

    async def _stream(
        self, streams: list[RequestStream], builder: _ResponseBuilder, until_disconnected: Callable[[], Awaitable[None]]
    ) -> AsyncIterator[str]:
        try:
            async with _AbortOnDisconnect(self.engine, streams, until_disconnected):
                for chunk in builder.first_chunks():
                    yield _sse(chunk)
                async for index, output in _merge(streams):
                    for chunk in builder.chunks(index, output):
                        yield _sse(chunk)
                if (usage := builder.final_usage_chunk()) is not None:
                    yield _sse(usage)
        except (EngineDeadError, RequestAbortedError) as exc:
            yield _sse(ApiError(503, str(exc), error_type="server_error").body)
        yield "data: [DONE]\n\n"

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


def _template_message(index: int, message: p.ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: tool calls' arguments as objects (templates write them
    with ``tojson``), the call id on tool results."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        rendered["name"] = message.name
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        rendered["tool_calls"] = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                field = f"messages[{index}].tool_calls[{j}].function.arguments"
                raise ApiError(400, f"{field}: not valid JSON ({exc})", param=field) from None
            rendered["tool_calls"].append({"id": call.id, "type": "function",
                                           "function": {"name": call.function.name, "arguments": arguments}})
    return rendered


def _split_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]  # one prompt given as token ids
    return list(prompt)


def _sse(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()  # None: it ended

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            queue.put_nowait((index, exc))
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class _AbortOnDisconnect:
    """Aborts the streams' engine requests when the client disconnects or the consumer stops early.

    ``until_disconnected`` is awaited in a side task; it returns once the client's
    connection is gone (api_server.py passes a listener on the ASGI receive channel).
    """

    def __init__(
        self, engine: AsyncLLMEngine, streams: list[RequestStream], until_disconnected: Callable[[], Awaitable[None]]
    ) -> None:
        self._engine = engine
        self._streams = streams
        self._until_disconnected = until_disconnected
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> None:
        self._watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        await self._until_disconnected()
        unfinished = [s for s in self._streams if not s.finished]
        if unfinished:
            logger.info("client disconnected; aborting %s", ", ".join(s.request_id for s in unfinished))
        self._abort_unfinished()

    def _abort_unfinished(self) -> None:
        for stream in self._streams:
            if not stream.finished:
                self._engine.abort(stream.request_id)

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._watcher is not None
        self._watcher.cancel()
        # Reached early (an exception, or the consumer closed the stream): free the blocks now.
        self._abort_unfinished()


class _ResponseBuilder(abc.ABC):
    """Turns the engine's delta outputs into stream chunks, or their sum into one response."""

    def __init__(self, serving: OpenAIServing, request: _Request, request_id: str, prompts: list[_PromptInput]) -> None:
        self.serving = serving
        self.request = request
        self.request_id = request_id
        self.prompts = prompts
        self.n = request.n
        self.created = int(time.time())
        self.model_name = request.model or serving.model.served_name  # an adapter's name when it names one
        # Per choice (prompt index * n + sequence index): characters streamed so far, and a delta
        # without text (a partial character, text the engine holds back) waiting for the next one.
        self._sent_text: dict[int, int] = {}
        self._held: dict[int, CompletionOutput] = {}
        self._completion_tokens = 0
        self._cached_tokens: dict[int, int] = {}  # per prompt

    def usage(self, completion_tokens: int, cached_tokens: int) -> p.UsageInfo:
        prompt_tokens = sum(len(prompt.token_ids) for prompt in self.prompts)
        return p.UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached_tokens),
        )

    def include_usage(self) -> bool:
        return bool(self.request.stream_options and self.request.stream_options.include_usage)

    def first_chunks(self) -> list[_Chunk]:
        return []

    def chunks(self, prompt_index: int, output: RequestOutput) -> list[_Chunk]:
        """Chunks for the delta ``output``."""
        self._cached_tokens[prompt_index] = output.num_cached_tokens
        chunks = []
        for seq in output.outputs:
            self._completion_tokens += len(seq.token_ids)
            choice = prompt_index * self.n + seq.index
            if (held := self._held.pop(choice, None)) is not None:
                held.add(seq)
                seq = held
            if not seq.text and seq.finish_reason is None:
                self._held[choice] = seq
                continue
            if (chunk := self.delta_chunk(choice, prompt_index, seq)) is not None:
                chunks.append(chunk)
            self._sent_text[choice] = self._sent_text.get(choice, 0) + len(seq.text)
        return chunks

    def final_usage_chunk(self) -> _Chunk | None:
        if not self.include_usage():
            return None
        usage = self.usage(self._completion_tokens, sum(self._cached_tokens.values()))
        return self.chunk_model(choices=[], usage=usage)

    def final_usage(self, finals: list[RequestOutput]) -> p.UsageInfo:
        completion_tokens = sum(len(seq.token_ids) for output in finals for seq in output.outputs)
        return self.usage(completion_tokens, sum(output.num_cached_tokens for output in finals))

    @abc.abstractmethod
    def delta_chunk(self, choice: int, prompt_index: int, seq: CompletionOutput) -> _Chunk | None:
        """The chunk carrying the delta ``seq``'s text and logprobs (None: nothing to send yet)."""

    @abc.abstractmethod
    def chunk_model(self, choices: list[_StreamChoice], usage: p.UsageInfo | None = None) -> _Chunk:
        """A stream chunk of this endpoint's type."""

    @abc.abstractmethod
    def full_response(self, finals: list[RequestOutput]) -> _Response:
        """The non-streamed response from each prompt's finished output."""


class _CompletionBuilder(_ResponseBuilder):
    request: p.CompletionRequest

    def _echo_prefix(self, prompt_index: int, choice: int) -> str:
        if not self.request.echo or choice in self._sent_text:
            return ""
        prompt = self.prompts[prompt_index]
        return prompt.text if prompt.text is not None else self.serving.tokenizer.decode(prompt.token_ids)

    def _logprobs(self, seq: CompletionOutput, text_offset: int) -> p.CompletionLogprobs | None:
        if self.request.logprobs is None or seq.logprobs is None:
            return None
        result = p.CompletionLogprobs()
        offset = text_offset
        for token_id, top in zip(seq.token_ids, seq.logprobs, strict=True):
            token = self.serving.token_text(token_id)
            result.tokens.append(token)
            result.token_logprobs.append(_finite(top.get(token_id)))
            result.top_logprobs.append({self.serving.token_text(t): _finite(lp) for t, lp in top.items()})
            result.text_offset.append(offset)
            offset += len(token)
        return result

    def delta_chunk(self, choice: int, prompt_index: int, seq: CompletionOutput) -> p.CompletionChunk:
        prefix = self._echo_prefix(prompt_index, choice)
        offset = self._sent_text.get(choice, 0)
        return self.chunk_model(
            [
                p.CompletionChoice(
                    index=choice,
                    text=prefix + seq.text,
                    logprobs=self._logprobs(seq, offset + len(prefix)),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            ]
        )

    def chunk_model(self, choices: list[_StreamChoice], usage: p.UsageInfo | None = None) -> p.CompletionChunk:
        return p.CompletionChunk(
            id=self.request_id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )

    def full_response(self, finals: list[RequestOutput]) -> p.CompletionResponse:
        choices = []
        for prompt_index, output in enumerate(finals):
            for seq in output.outputs:
                choice = prompt_index * self.n + seq.index
                prefix = self._echo_prefix(prompt_index, choice)
                choices.append(
                    p.CompletionChoice(
                        index=choice,
                        text=prefix + seq.text,
                        logprobs=self._logprobs(seq, len(prefix)),
                        finish_reason=seq.finish_reason,
                        stop_reason=seq.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return p.CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=self.final_usage(finals),
        )


class _ChatBuilder(_ResponseBuilder):
    request: p.ChatCompletionRequest

    def __init__(self, serving: OpenAIServing, request: p.ChatCompletionRequest, request_id: str,
                 prompts: list[_PromptInput], parser: tool_calls.ToolCallParser | None) -> None:
        super().__init__(serving, request, request_id, prompts)
        self.parser = parser
        self._text: dict[int, str] = {}  # per choice, with a parser: the text streamed through it
        self._sent_content: dict[int, int] = {}
        self._sent_calls: dict[int, list[int]] = {}  # per choice: arguments characters sent per call
        self._call_ids: dict[tuple[int, int], str] = {}

    def _call_id(self, choice: int, index: int) -> str:
        return self._call_ids.setdefault((choice, index), f"call_{uuid.uuid4().hex[:24]}")

    def _parse(self, text: str, final: bool) -> tool_calls.Parsed:
        parsed = self.parser.parse(text, final)
        parsed.calls = [call for call in parsed.calls if call.name]  # unnamed ones are not calls (yet)
        return parsed

    def _tool_delta(self, choice: int, seq: CompletionOutput) -> tuple[p.DeltaMessage, str | None]:
        """What the parser makes of the text so far, less what was sent, and the finish reason."""
        text = self._text[choice] = self._text.get(choice, "") + seq.text
        parsed = self._parse(text, seq.finish_reason is not None)
        sent_content = self._sent_content.get(choice, 0)
        content = parsed.content[sent_content:]
        self._sent_content[choice] = len(parsed.content)
        sent = self._sent_calls.setdefault(choice, [])
        calls = []
        for index, call in enumerate(parsed.calls):
            if index == len(sent):
                sent.append(0)
                first = p.DeltaToolCall(index=index, id=self._call_id(choice, index), type="function",
                                        function=p.DeltaFunctionCall(name=call.name, arguments=""))
                calls.append(first)
            if len(call.arguments) > sent[index]:
                piece = p.DeltaFunctionCall(arguments=call.arguments[sent[index]:])
                calls.append(p.DeltaToolCall(index=index, function=piece))
                sent[index] = len(call.arguments)
        delta = p.DeltaMessage(content=content or None, tool_calls=calls or None)
        return delta, self._finish_reason(seq, parsed)

    @staticmethod
    def _finish_reason(seq: CompletionOutput, parsed: tool_calls.Parsed) -> str | None:
        return "tool_calls" if parsed.calls and seq.finish_reason == "stop" else seq.finish_reason

    def _logprobs(self, seq: CompletionOutput) -> p.ChatLogprobs | None:
        if not self.request.logprobs or seq.logprobs is None:
            return None
        k = self.request.top_logprobs or 0
        content = []
        for token_id, top in zip(seq.token_ids, seq.logprobs, strict=True):
            best = sorted(top.items(), key=lambda item: item[1], reverse=True)[:k]
            content.append(
                p.ChatTokenLogprob(
                    **self._entry(token_id, top.get(token_id)).model_dump(),
                    top_logprobs=[self._entry(t, lp) for t, lp in best],
                )
            )
        return p.ChatLogprobs(content=content)

    def _entry(self, token_id: int, logprob: float | None) -> p.TopLogprob:
        token = self.serving.token_text(token_id)
        return p.TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode("utf-8")))

    def first_chunks(self) -> list[_Chunk]:
        # OpenAI opens every choice with the assistant role and empty content.
        return [
            self.chunk_model([p.ChatStreamChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))])
            for i in range(self.n)
        ]

    def delta_chunk(self, choice: int, prompt_index: int, seq: CompletionOutput) -> p.ChatCompletionChunk | None:
        if self.parser is not None:
            delta, finish_reason = self._tool_delta(choice, seq)
            if delta == p.DeltaMessage() and finish_reason is None and not self.request.logprobs:
                return None  # text held back while it may still be a call
        else:
            delta = p.DeltaMessage(content=seq.text) if seq.text else p.DeltaMessage()
            finish_reason = seq.finish_reason
        return self.chunk_model(
            [
                p.ChatStreamChoice(
                    index=choice,
                    delta=delta,
                    logprobs=self._logprobs(seq),
                    finish_reason=finish_reason,
                    stop_reason=seq.stop_reason,
                )
            ]
        )

    def chunk_model(self, choices: list[_StreamChoice], usage: p.UsageInfo | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model_name, choices=choices, usage=usage
        )

    def full_response(self, finals: list[RequestOutput]) -> p.ChatCompletionResponse:
        (output,) = finals
        choices = []
        for seq in sorted(output.outputs, key=lambda s: s.index):
            message, finish_reason = p.ChatResponseMessage(content=seq.text), seq.finish_reason
            if self.parser is not None:
                parsed = self._parse(seq.text, final=True)
                calls = [p.ToolCall(id=self._call_id(seq.index, i),
                                    function=p.ToolCallFunction(name=call.name, arguments=call.arguments))
                         for i, call in enumerate(parsed.calls)]
                content = parsed.content.strip() if calls else parsed.content  # the space before a call
                message = p.ChatResponseMessage(content=content or None, tool_calls=calls)
                finish_reason = self._finish_reason(seq, parsed)
            choices.append(p.ChatCompletionChoice(index=seq.index, message=message, logprobs=self._logprobs(seq),
                                                  finish_reason=finish_reason, stop_reason=seq.stop_reason))
        return p.ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=choices,
            usage=self.final_usage(finals),
        )


def _finite(logprob: float | None) -> float | None:
    """JSON has no -inf; a token masked to -inf is reported with the lowest float."""
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) else -9999.0
