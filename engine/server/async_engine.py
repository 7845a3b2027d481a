"""Runs the synchronous ``LLMEngine`` on one background thread for the asyncio server.

The engine is not thread-safe, so exactly one thread ever calls it. The event
loop hands it work through a command queue (add, abort, change limits, load or
unload a LoRA adapter); the
engine thread applies the queued commands between steps, runs ``step()``, and
delivers each step's outputs to per-request asyncio queues with one
``loop.call_soon_threadsafe`` per step. If the loop raises, the engine is
marked dead: every open request and every later one fails, and /health says so.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpilot.engine.server.admission import StartRate
from kvpilot.engine.server.engine_protocol import Engine

if TYPE_CHECKING:
    from kvpilot.engine.llm_engine import EngineStats
    from kvpilot.engine.lora import LoRAAdapter, LoRARequest

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps before re-checking for shutdown; new
# commands wake it at once.
_IDLE_WAIT_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after an error; the server cannot generate any more."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``reason``: one of engine_contract.REJECT_REASONS); the client should
    retry later."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineDrainingError(RuntimeError):
    """The server is shutting down and accepts no new requests."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (client gone, or shutdown ran out of grace time)."""


class StepObserver(Protocol):
    """Receives engine events on the engine thread (metrics.py implements it)."""

    def on_step(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str, num_sequences: int) -> None: ...

    def on_reject(self, reason: str) -> None: ...  # on the event loop: admission turned a request away


class RequestStream:
    """The outputs of one engine request, as an async iterator that ends after the finished one.

    A consumer that falls behind gets what was queued in one output: the deltas joined (DELTA),
    or the newest (CUMULATIVE, which holds all the others).
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.num_sequences = params.n
        self._joins_deltas = params.output_kind is RequestOutputKind.DELTA
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        while not isinstance(item, BaseException) and not item.finished and not self._queue.empty():
            later = self._queue.get_nowait()
            if self._joins_deltas and not isinstance(later, BaseException):
                item.add(later)
            else:
                item = later
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    arrival_time: float
    future: asyncio.Future
    lora_request: LoRARequest | None = None


@dataclass
class _Abort:
    request_ids: list[str]
    num_sequences: int


@dataclass
class _SetLimits:
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    num_speculative_tokens: int | None
    future: asyncio.Future


@dataclass
class _LoRA:
    """Load (``request``) or unload (``name``) a LoRA adapter between steps."""

    request: LoRARequest | None
    name: str | None
    future: asyncio.Future


_Command = _Add | _Abort | _SetLimits | _LoRA


class AsyncLLMEngine:
    """The asyncio face of one ``LLMEngine``; create and call it on the server's event loop."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting_requests: int | None = None,
        max_waiting_seconds: float | None = None,
        observer: StepObserver | None = None,
    ) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests: must be >= 0, got {max_waiting_requests}")
        if max_waiting_seconds is not None and max_waiting_seconds <= 0:
            raise ValueError(f"max_waiting_seconds: must be > 0, got {max_waiting_seconds}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_seconds = max_waiting_seconds
        self._observer = observer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wakeup = threading.Condition()
        self._commands: collections.deque[_Command] = collections.deque()  # guarded by _wakeup
        self._stopping = False  # guarded by _wakeup
        # Admission accounting, guarded by _wakeup: adds queued for the engine
        # thread plus the engine's own waiting requests at the last snapshot.
        self._pending_adds = 0
        self._engine_waiting = 0
        self._start_rate = StartRate()  # how fast waiting requests start, for --max-waiting-seconds
        self._stats = engine.stats()
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._live_ids: set[str] = set()  # engine thread only: added and not finished or aborted
        self._accepting = True
        self.dead_error: BaseException | None = None
        # The LoRA adapters requests may name, by name: event-loop thread only, changed by load_lora and
        # unload_lora (the engine's own list is the engine thread's).
        self.loras: dict[str, LoRAAdapter] = {adapter.name: adapter for adapter in engine.list_loras()}

    # ---- lifecycle (event loop) ------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        self._accepting = False
        self.abort_all()
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Requests accepted and not yet finished."""
        return len(self._streams)

    def stats(self) -> EngineStats:
        """The engine's stats as of its last step (safe from any thread)."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet scheduled: queued for the engine thread plus the engine's waiting."""
        with self._wakeup:
            return self._pending_adds + self._engine_waiting

    # ---- requests (event loop) -------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises the engine's ValueError for an invalid request, EngineOverloadedError
        when the waiting queue is full (by count or by predicted wait), EngineDrainingError
        while shutting down and EngineDeadError after the loop died.
        """
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")
        if not self._accepting:
            raise EngineDrainingError("the server is shutting down and accepts no new requests")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        assert self._loop is not None, "start() the engine first"
        future = self._loop.create_future()
        stream = RequestStream(request_id, params)
        with self._wakeup:
            try:
                self._check_admission(self._pending_adds + self._engine_waiting)
            except EngineOverloadedError as exc:
                if self._observer is not None:
                    self._observer.on_reject(exc.reason)
                raise
            self._pending_adds += 1
            self._streams[request_id] = stream
            self._commands.append(
                _Add(request_id, prompt_token_ids, params, prompt, arrival_time or time.monotonic(), future,
                     lora_request)
            )
            self._wakeup.notify()
        try:
            await future
        except BaseException as exc:
            self._streams.pop(request_id, None)
            if isinstance(exc, asyncio.CancelledError):
                # The engine may have taken it already: make sure it does not run on.
                self._enqueue(_Abort([request_id], stream.num_sequences))
            raise
        return stream

    def _check_admission(self, waiting: int) -> None:
        """Raises EngineOverloadedError when a request queued behind ``waiting`` others is over a limit."""
        if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
            raise EngineOverloadedError(
                f"the waiting queue is full ({self.max_waiting_requests} requests, --max-waiting-requests); "
                "retry later", reason="queue_full",
            )
        if self.max_waiting_seconds is None:
            return
        wait = self._start_rate.predicted_wait(waiting)
        if wait is not None and wait > self.max_waiting_seconds:
            rate = self._start_rate.per_second or 0.0
            raise EngineOverloadedError(
                f"a request now would wait about {min(wait, 3600):.0f} s for a batch slot ({waiting} waiting, "
                f"{rate:.1f} starting per second), over --max-waiting-seconds {self.max_waiting_seconds:g}; "
                "retry later or on another replica", reason="queue_wait",
            )

    def abort(self, request_id: str) -> None:
        """Abort a request now: its stream ends with RequestAbortedError, its KV blocks are freed."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        if not stream.finished:
            stream.put(RequestAbortedError(f"request {request_id} was aborted"))
        self._enqueue(_Abort([request_id], stream.num_sequences))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    async def set_scheduler_limits(
        self,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        num_speculative_tokens: int | None = None,
    ) -> EngineStats:
        """Change the engine's limits between steps (all or none); returns the stats after the change."""
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")
        assert self._loop is not None, "start() the engine first"
        future = self._loop.create_future()
        self._enqueue(_SetLimits(max_num_seqs, max_num_batched_tokens, num_speculative_tokens, future))
        return await future

    async def load_lora(self, request: LoRARequest) -> LoRAAdapter:
        """Read an adapter between steps (raises its LoRAError); requests may name it once this returns."""
        return await self._lora_command(_LoRA(request, None, self._new_future()))

    async def unload_lora(self, name: str) -> LoRAAdapter:
        """Forget an adapter between steps: new requests cannot name it, running ones finish with it."""
        return await self._lora_command(_LoRA(None, name, self._new_future()))

    async def _lora_command(self, command: _LoRA) -> LoRAAdapter:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead_error!r}")
        self._enqueue(command)
        adapter = await command.future
        if command.request is not None:
            self.loras[adapter.name] = adapter
        else:
            self.loras.pop(adapter.name, None)
        return adapter

    def _new_future(self) -> asyncio.Future:
        assert self._loop is not None, "start() the engine first"
        return self._loop.create_future()

    def _enqueue(self, command: _Command) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted on this side while the step ran
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(EngineDeadError(f"the engine loop has stopped: {error!r}"))

    # ---- the engine thread -------------------------------------------------------

    def _run(self) -> None:
        commands: list[_Command] | None = []
        try:
            while True:
                commands = self._take_commands()
                if commands is None:
                    break
                self._apply(commands)
                commands = []
                if self.engine.has_unfinished_requests():
                    queued = self._engine_waiting  # as of the commands just applied
                    started_at = time.monotonic()
                    outputs = self.engine.step()
                    now = time.monotonic()
                    self._snapshot()
                    with self._wakeup:
                        self._start_rate.observe(now - started_at, queued, queued - self._engine_waiting)
                    if self._observer is not None:
                        self._observer.on_step(outputs, now)
                    self._live_ids.difference_update(o.request_id for o in outputs if o.finished)
                    if outputs:
                        self._call_soon(self._dispatch, outputs)
        except BaseException as exc:  # noqa: BLE001 - any failure kills the loop and must be reported
            logger.exception("engine loop died; the server now answers 503")
            self.dead_error = exc
            self._fail_commands(exc, in_hand=commands or [])
            self._call_soon(self._fail_all, exc)

    def _take_commands(self) -> list[_Command] | None:
        """The queued commands; blocks while the engine is idle. None means: stop."""
        with self._wakeup:
            while not self._commands and not self.engine.has_unfinished_requests():
                if self._stopping:
                    return None
                self._wakeup.wait(_IDLE_WAIT_S)
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, commands: Iterable[_Command]) -> None:
        applied_adds = 0
        for command in commands:
            if isinstance(command, _Add):
                applied_adds += 1
                self._apply_add(command)
            elif isinstance(command, _Abort):
                live = [request_id for request_id in command.request_ids if request_id in self._live_ids]
                if not live:
                    continue  # finished or never accepted
                self.engine.abort_request(live)
                self._live_ids.difference_update(live)
                if self._observer is not None:
                    for request_id in live:
                        self._observer.on_abort(request_id, command.num_sequences)
            elif isinstance(command, _LoRA):
                self._apply_lora(command)
            else:
                self._apply_set_limits(command)
        self._snapshot(applied_adds)

    def _apply_add(self, command: _Add) -> None:
        if command.future.done():  # the client went away before the engine saw it
            return
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                arrival_time=command.arrival_time,
                prompt=command.prompt,
                lora_request=command.lora_request,
            )
        except ValueError as exc:
            self._resolve(command.future, exc)
        else:
            self._live_ids.add(command.request_id)
            self._resolve(command.future, None)

    def _apply_lora(self, command: _LoRA) -> None:
        try:
            if command.request is not None:
                adapter = self.engine.add_lora(command.request)
            else:
                adapter = self.engine.remove_lora(command.name)
        except ValueError as exc:  # LoRAError, or LoRA off (InvalidRequestError): both say what to do
            self._resolve(command.future, exc)
            return
        self._resolve(command.future, adapter)

    def _apply_set_limits(self, command: _SetLimits) -> None:
        before = self.engine.stats()
        try:
            self.engine.set_scheduler_limits(
                max_num_seqs=command.max_num_seqs, max_num_batched_tokens=command.max_num_batched_tokens
            )
            if command.num_speculative_tokens is not None:
                try:
                    self.engine.set_num_speculative_tokens(command.num_speculative_tokens)
                except ValueError:
                    self.engine.set_scheduler_limits(before.max_num_seqs, before.max_num_batched_tokens)
                    raise
        except ValueError as exc:
            self._resolve(command.future, exc)
            return
        self._stats = self.engine.stats()
        self._resolve(command.future, self._stats)

    def _snapshot(self, applied_adds: int = 0) -> None:
        stats = self.engine.stats()
        with self._wakeup:
            self._pending_adds -= applied_adds
            self._engine_waiting = stats.num_waiting
        self._stats = stats

    def _fail_commands(self, error: BaseException, in_hand: list[_Command]) -> None:
        """Fails the queued commands and those taken but not all applied when the loop died (the
        one that raised among them: its client would otherwise wait forever)."""
        with self._wakeup:
            commands = in_hand + list(self._commands)
            self._commands.clear()
        for command in commands:
            if isinstance(command, (_Add, _SetLimits)):
                self._resolve(command.future, EngineDeadError(f"the engine loop has stopped: {error!r}"))

    def _resolve(self, future: asyncio.Future, result: object) -> None:
        def resolve() -> None:
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

        self._call_soon(resolve)

    def _call_soon(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is left to deliver to
