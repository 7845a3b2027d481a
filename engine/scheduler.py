"""Iteration-level scheduling: which sequences run this step, and how many tokens each computes.

One rule, no phases: every sequence's ``num_computed_tokens`` catches up to its
``num_tokens`` (prompt + output so far) plus its proposed tokens, if any. A fresh
prompt catches up over one or more steps (chunked prefill), a generating sequence
by one token a step (1 + k with k proposals from speculative decoding), a
preempted one by recomputing everything — all through the same loop, so
prefill, decode and verification mix freely in one batch. After a step verified
proposals, ``rollback`` un-computes the rejected ones.

Per step: running sequences first (oldest first), then waiting ones (first
come, first served), within a budget of ``max_num_batched_tokens`` tokens and
at most ``max_num_seqs`` running. When the KV cache has no room, the newest
running sequence is preempted: its blocks are freed and it waits, first in
line, to be recomputed. A lowered ``max_num_seqs`` takes effect the same way,
in the next step: the newest running sequences above it are preempted (the
prefix cache keeps their full blocks, so re-admission recomputes little).
A sequence with a LoRA adapter is admitted only once its adapter has one of the
model's ``max_loras`` slots (engine/lora/manager.py); until then it waits and
the sequences behind it are admitted past it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvpilot.engine.lora.manager import LoRAManager


@dataclass
class SchedulerOutput:
    """One step for the model runner; lists are parallel, in batch order."""

    requests: list[Request]
    num_scheduled_tokens: list[int]  # new tokens each computes this step
    num_computed_before: list[int]  # tokens already in the KV cache when the step starts
    block_ids: list[list[int]]  # each sequence's block table (the KV manager's lists: read only)
    total_num_scheduled_tokens: int
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass
class StepUpdate:
    """What a step's output did to the sequences, in batch order."""

    sampled: list[Request] = field(default_factory=list)  # took tokens this step
    still_running: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool,
        lora: LoRAManager | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.lora = lora  # where sequences with an adapter get their adapter's slot
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.limits = SchedulerLimits(max_num_seqs, max_num_batched_tokens)
        self.set_limits(max_num_seqs, max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # oldest admission first
        self._by_id: dict[str, Request] = {}
        self.num_preemptions = 0  # for want of KV blocks (not those that obey a lowered max_num_seqs)

    def set_limits(self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> None:
        """Change the batch limits; the next step obeys them: running sequences above a lowered
        max_num_seqs are preempted there, newest first."""
        seqs = self.limits.max_num_seqs if max_num_seqs is None else max_num_seqs
        tokens = self.limits.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        for name, value in (("max_num_seqs", seqs), ("max_num_batched_tokens", tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if tokens < seqs:
            raise ValueError(
                f"max_num_batched_tokens ({tokens}) must be at least max_num_seqs ({seqs}): "
                "every running sequence needs one token per step"
            )
        if not self.enable_chunked_prefill and tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({tokens}) is below max_model_len ({self.max_model_len}) with chunked "
                "prefill disabled, so a long prompt could never run"
            )
        self.limits = SchedulerLimits(seqs, tokens)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        self._by_id[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._by_id)

    def get_request(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.limits.max_num_batched_tokens
        scheduled: list[Request] = []
        num_tokens: list[int] = []
        preempted: list[Request] = []
        while len(self.running) > self.limits.max_num_seqs:  # max_num_seqs was lowered
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens_with_spec - request.num_computed_tokens, budget)
            assert num_new > 0, f"{request} is running with nothing to compute"
            while kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()  # newest; never one already scheduled (those sit before index)
                self._preempt(victim)
                self.num_preemptions += 1
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(request)
                num_tokens.append(num_new)
                budget -= num_new
                index += 1

        # Admitting while preempting would only thrash the cache. A sequence whose adapter finds no
        # slot (every slot is needed by running sequences) waits, and the ones behind it go ahead.
        passed_over: list[Request] = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            request = self.waiting[0]
            if request.lora is not None and not self.lora.assign_slot(request, self.running):
                passed_over.append(self.waiting.popleft())
                continue
            computed = kv.get_computed_blocks(request)
            num_new = request.num_tokens - computed.num_tokens
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            if kv.allocate_slots(request, num_new, computed) is None:
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = computed.num_tokens
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_tokens
            self.running.append(request)
            scheduled.append(request)
            num_tokens.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))

        computed_before = [request.num_computed_tokens for request in scheduled]
        for request, num_new in zip(scheduled, num_tokens):
            request.num_computed_tokens += num_new
        return SchedulerOutput(
            requests=scheduled,
            num_scheduled_tokens=num_tokens,
            num_computed_before=computed_before,
            block_ids=[kv.get_block_ids(request.request_id) for request in scheduled],
            total_num_scheduled_tokens=self.limits.max_num_batched_tokens - budget,
            preempted=preempted,
        )

    def update_from_output(
        self,
        sampled: Iterable[tuple[Request, Sequence[int], int]],
        on_token: Callable[[Request, int], RequestStatus | None],
    ) -> StepUpdate:
        """After a forward: each sampled sequence (with its new tokens — one, or its accepted
        proposals plus one — and how many proposals it verified) takes its tokens one at a time
        until ``on_token`` (the engine's detokenizer and stop checks) says it finished; the rejected
        proposals of the others are rolled back; finished sequences are retired, their blocks freed."""
        update = StepUpdate()
        finished: dict[RequestStatus, list[Request]] = {}
        for request, token_ids, num_drafts in sampled:
            update.sampled.append(request)
            request.spec_token_ids = []
            status = None
            for token_id in token_ids:
                request.append_output_token(token_id)
                status = on_token(request, token_id)
                if status is not None:
                    break
            if status is not None:
                finished.setdefault(status, []).append(request)
                update.finished.append(request)
            else:
                if num_drafts:
                    self.rollback(request, num_drafts - (len(token_ids) - 1))
                update.still_running.append(request)
        for status, requests in finished.items():
            self.finish_requests(requests, status)
        return update

    def finish_requests(self, requests: Iterable[Request], status: RequestStatus) -> None:
        """Retire sequences (finished or aborted): their KV blocks are freed at once."""
        finished_ids = set()
        for request in requests:
            if request.request_id not in self._by_id:
                continue
            del self._by_id[request.request_id]
            finished_ids.add(request.request_id)
            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(request)
            request.status = status
            self.kv_cache_manager.free(request)
        if finished_ids:
            self.running = [r for r in self.running if r.request_id not in finished_ids]

    def rollback(self, request: Request, num_rejected: int) -> None:
        """After a step that verified proposals: un-compute the last ``num_rejected`` tokens (the
        proposals the target rejected); slots past the computed tokens are released and blocks past
        them freed."""
        request.num_computed_tokens -= num_rejected
        assert request.num_computed_tokens < request.num_tokens, f"{request}: rolled back below its verified tokens"
        self.kv_cache_manager.trim(request, request.num_computed_tokens)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()  # proposals were made for the KV just dropped
        request.lora_slot = None  # its adapter's slot may go to another adapter while it waits
        self.waiting.appendleft(request)
