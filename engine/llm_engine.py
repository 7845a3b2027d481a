"""LLMEngine: the synchronous core — add requests, step, read outputs.

One step = one scheduler iteration + one forward over the mixed batch + the
sampler + stop checks. A request with ``n > 1`` fans out into ``n`` sequences
(which share the prompt's KV blocks when prefix caching is on); their outputs
come back together in one RequestOutput. The engine is not thread-safe: one thread
drives it (the server serialises add/abort through its own loop).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvpilot.engine.attention import get_attention_backend
from kvpilot.engine.config import EngineConfig, ResolvedConfig
from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.lora.adapter import LoRAAdapter, LoRARequest
from kvpilot.engine.lora.manager import LoRAManager
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.models import CausalLM, ModelArch
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.request import InvalidRequestError, Request, RequestStatus
from kvpilot.engine.sampler import SamplingInput
from kvpilot.engine.sampling_params import RequestOutputKind, SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.spec_decode.draft_proposer import DraftModelProposer
from kvpilot.engine.spec_decode.ngram_proposer import NgramProposer
from kvpilot.engine.spec_decode.speculator import NoSpeculation, SpecDecodeStats, Speculator
from kvpilot.engine.startup import start
from kvpilot.engine.structured_outputs import GrammarCompiler
from kvpilot.engine.step_cost import StepCost, StepCostSnapshot

logger = logging.getLogger(__name__)

# A file to append one JSON line per step to (its composition and duration), for finding which
# steps make the latency tail under a serving load; see docs/performance.md.
STEP_TRACE_ENV = "KVPILOT_STEP_TRACE"


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # blocks referenced by live sequences / blocks total
    kv_utilization: float  # tokens stored / token slots in blocks held by live sequences (0.0 when none)
    num_kv_blocks: int
    preemptions_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    steps_total: int
    step_running_seqs_total: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # Summed over steps (after scheduling): their ratio is the time-averaged KV utilization.
    kv_tokens_stored_sum: int = 0
    kv_slots_held_sum: int = 0
    step_seconds_total: float = 0.0  # wall time inside step()
    step_cost: StepCostSnapshot | None = None  # steps that ran a forward, by composition
    forward_seconds_total: float = 0.0  # of which: model forward and LM head
    num_speculative_tokens: int | None = None  # current k; None without speculative decoding
    spec_decode: SpecDecodeStats | None = None  # None without speculative decoding

    @property
    def kv_utilization_mean(self) -> float | None:
        return self.kv_tokens_stored_sum / self.kv_slots_held_sum if self.kv_slots_held_sum else None


@dataclass
class _RequestState:
    """Engine-side state of one user request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    num_unfinished: int
    lora_request: LoRARequest | None = None
    sequences: list[_Sequence] = field(default_factory=list)


@dataclass
class _Sequence:
    """Engine-side state of one of a request's n sequences."""

    state: _RequestState
    request: Request
    index: int
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None
    num_reported_tokens: int = 0  # output tokens already handed out in DELTA outputs

    def completion(self, kind: RequestOutputKind, new_text: str) -> CompletionOutput:
        """This sequence's output: all of it, or (DELTA) the tokens since the last call and ``new_text``."""
        request = self.request
        if kind is RequestOutputKind.DELTA:
            start, self.num_reported_tokens = self.num_reported_tokens, len(request.output_token_ids)
            text = new_text
        else:
            start, text = 0, self.detokenizer.emitted_text
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=request.output_token_ids[start:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=self.logprobs[start:] if self.logprobs is not None else None,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
        )


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        resolved: ResolvedConfig,
        arch: ModelArch,
        tokenizer,
        runner: ModelRunner,
        draft_model: CausalLM | None = None,
    ) -> None:
        self.config = config
        self.resolved = resolved
        self.arch = arch
        self.tokenizer = tokenizer
        self.runner = runner
        self.num_kv_blocks = resolved.num_kv_blocks
        self.max_model_len = resolved.max_model_len
        self.kv_cache_manager = KVCacheManager(
            resolved.num_kv_blocks, config.block_size, enable_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=resolved.max_num_batched_tokens,
            max_model_len=resolved.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            lora=runner.lora,
        )
        self.speculator = self._build_speculator(draft_model)
        self.grammars = GrammarCompiler(tokenizer, arch.vocab_size)
        self.eos_token_ids = frozenset(arch.eos_token_ids)
        self._requests: dict[str, _RequestState] = {}
        self._sequences: dict[str, _Sequence] = {}  # by sequence (scheduler) id
        self._sequence_ids = itertools.count()
        self._device = torch.device(resolved.device)
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._steps_total = 0
        self._step_running_seqs_total = 0
        self._kv_tokens_stored_sum = 0
        self._kv_slots_held_sum = 0
        self._step_seconds_total = 0.0
        self._step_cost = StepCost()
        trace_path = os.environ.get(STEP_TRACE_ENV)
        self._step_trace = open(trace_path, "a", buffering=1, encoding="utf-8") if trace_path else None

    # ----------------------------------------------------------------- start-up

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        """Resolve the config, load the model and size the KV cache (engine/startup.py), then build."""
        return cls(*start(config))

    def _build_speculator(self, draft_model: CausalLM | None) -> Speculator | NoSpeculation:
        spec = self.config.speculative_config
        if spec is None:
            return NoSpeculation()
        if draft_model is None:
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            proposer = DraftModelProposer(
                draft_model,
                num_blocks=self.resolved.num_kv_blocks,
                block_size=self.config.block_size,
                backend=get_attention_backend(self.resolved.attention_backend),
                device=torch.device(self.resolved.device),
                reserve=self._reserve_slots,
            )
        return Speculator(spec, proposer, self.resolved.max_model_len)

    def _reserve_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        """Slots for ``num_tokens`` tokens after the request's computed ones (a draft model writes its
        guesses there; the next step verifies them there); the block table, or None when full."""
        if self.kv_cache_manager.allocate_slots(request, num_tokens) is None:
            return None
        return self.kv_cache_manager.get_block_ids(request.request_id)

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prompt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """``lora_request``: the adapter the request runs with (read from its folder the first time
        its name is seen); None for the base model."""
        self._validate(request_id, prompt_token_ids, params)
        adapter = None if lora_request is None else self._lora_manager("lora_request").add(lora_request)
        constraint = params.structured_outputs
        matchers = self.grammars.matchers(constraint, params.n) if constraint is not None else [None] * params.n
        arrival = time.monotonic() if arrival_time is None else arrival_time
        prompt_token_ids = list(prompt_token_ids)
        state = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival),
            num_unfinished=params.n,
            lora_request=None if adapter is None else adapter.request,
        )
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                # Each of the n sequences draws its own stream; the mask keeps the seed in the 64-bit range.
                seed = (params.seed + index) & 0xFFFF_FFFF_FFFF_FFFF
                generator = torch.Generator(device=self._device).manual_seed(seed)
            sequence_id = f"{request_id}#{index}@{next(self._sequence_ids)}"
            request = Request(sequence_id, prompt_token_ids, params, arrival, lora=adapter)
            request.sampling_input = SamplingInput(
                params=params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                generator=generator,
                matcher=matchers[index],
            )
            sequence = _Sequence(
                state=state,
                request=request,
                index=index,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            state.sequences.append(sequence)
        self._requests[request_id] = state
        for sequence in state.sequences:
            self._sequences[sequence.request.request_id] = sequence
            self.scheduler.add_request(sequence.request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop the requests now and free their KV blocks; unknown or finished ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            state = self._requests.pop(request_id, None)
            if state is None:
                continue
            live = [s.request for s in state.sequences if not s.request.is_finished]
            self.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            for sequence in state.sequences:
                self._sequences.pop(sequence.request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ----------------------------------------------------------------- LoRA adapters

    def add_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter so requests can name it; raises LoRAError naming what is wrong."""
        return self._lora_manager("add_lora").add(lora_request)

    def remove_lora(self, lora_name: str) -> LoRAAdapter:
        """Forget an adapter: new requests cannot name it, running ones finish with it."""
        return self._lora_manager("remove_lora").remove(lora_name)

    def list_loras(self) -> list[LoRAAdapter]:
        return [] if self.runner.lora is None else self.runner.lora.adapters

    def _lora_manager(self, what: str) -> LoRAManager:
        if self.runner.lora is None:
            raise InvalidRequestError(
                f"{what}: LoRA adapters are off; start the engine with enable_lora=True (--enable-lora)")
        return self.runner.lora

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def set_scheduler_limits(
        self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None
    ) -> None:
        """Change the batch limits of a live engine; validated here, obeyed from the next step."""
        self.scheduler.set_limits(max_num_seqs, max_num_batched_tokens)

    def set_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Change how many tokens speculative decoding proposes per step (0 pauses it), live."""
        self.speculator.set_num_speculative_tokens(num_speculative_tokens)

    # ----------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return an output for each request that got new tokens, shaped by its
        ``output_kind`` (a FINAL_ONLY request has one only when it finishes)."""
        start = time.perf_counter()
        step = self.scheduler.schedule()
        if step.is_empty:
            self._step_seconds_total += time.perf_counter() - start
            return []
        now = time.monotonic()
        sequences = self._sequences
        for request in step.requests:
            metrics = sequences[request.request_id].state.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        stored, held = self.kv_cache_manager.utilization_counts()
        self._kv_tokens_stored_sum += stored
        self._kv_slots_held_sum += held
        self._steps_total += 1
        self._step_running_seqs_total += len(step.requests)

        forward_before = self.runner.forward_seconds
        result = self.runner.execute(step)
        inputs = result.inputs
        self.speculator.observe(inputs.input_ids, inputs.positions, inputs.metadata)

        logprobs_of = dict(zip((r.request_id for r in result.sampled_requests), result.logprobs))

        def on_token(request: Request, token_id: int) -> RequestStatus | None:
            sequence = sequences[request.request_id]
            self._generation_tokens_total += 1
            logprobs = logprobs_of[request.request_id]
            if sequence.logprobs is not None and logprobs is not None:
                sequence.logprobs.append(logprobs)
                sequence.cumulative_logprob += logprobs.get(token_id, 0.0)
            matcher = request.sampling_input.matcher
            if matcher is not None and (not matcher.consume_token(token_id) or matcher.is_stopped()):
                sequence.detokenizer.append(token_id)
                return RequestStatus.FINISHED_STOPPED  # the grammar is complete (or, never with the mask, broken)
            return self._check_stop(request, sequence, token_id)

        update = self.scheduler.update_from_output(
            zip(result.sampled_requests, result.token_ids, result.num_drafts), on_token)
        self.speculator.record(result.num_drafts, result.token_ids)
        self.speculator.propose(update.still_running, self.scheduler.num_running)

        now = time.monotonic()
        advanced: dict[str, list[_Sequence]] = {}  # by user request: its sequences that got tokens
        for request in update.finished:
            sequences[request.request_id].state.num_unfinished -= 1
        for request in update.sampled:
            sequence = sequences[request.request_id]
            state = sequence.state
            advanced.setdefault(state.request_id, []).append(sequence)
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self._prompt_tokens_total += len(state.prompt_token_ids)
            metrics.last_token_time = now
            metrics.num_preemptions = sum(sequence.request.num_preemptions for sequence in state.sequences)

        outputs = []
        for advanced_sequences in advanced.values():
            state = advanced_sequences[0].state
            if state.num_unfinished == 0:
                state.metrics.finished_time = now
                del self._requests[state.request_id]
                for sequence in state.sequences:
                    del sequences[sequence.request.request_id]
            if (output := self._make_output(state, advanced_sequences)) is not None:
                outputs.append(output)
        elapsed = time.perf_counter() - start
        self._step_seconds_total += elapsed
        decode_rows = sum(1 for n in step.num_scheduled_tokens if n == 1)
        self._step_cost.observe(decode_rows, step.total_num_scheduled_tokens - decode_rows, elapsed)
        if self._step_trace is not None:
            self._write_step_trace(step, start, elapsed, forward_before, decode_rows)
        return outputs

    def _write_step_trace(self, step, start: float, elapsed: float, forward_before: float, decode_rows: int) -> None:
        record = {
            "t": round(start, 6),
            "seconds": round(elapsed, 6),
            "forward_seconds": round(self.runner.forward_seconds - forward_before, 6),
            "decode_rows": decode_rows,
            "prefill_seqs": len(step.num_scheduled_tokens) - decode_rows,
            "prefill_tokens": step.total_num_scheduled_tokens - decode_rows,
            "context_tokens": sum(step.num_computed_before),
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
        }
        self._step_trace.write(json.dumps(record) + "\n")

    def stats(self) -> EngineStats:
        manager = self.kv_cache_manager
        limits = self.scheduler.limits
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=manager.usage(),
            kv_utilization=manager.utilization() or 0.0,
            num_kv_blocks=manager.num_blocks,
            preemptions_total=self.scheduler.num_preemptions,
            prefix_cache_queries_total=manager.prefix_cache_queries,
            prefix_cache_hits_total=manager.prefix_cache_hits,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            steps_total=self._steps_total,
            step_running_seqs_total=self._step_running_seqs_total,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            kv_tokens_stored_sum=self._kv_tokens_stored_sum,
            kv_slots_held_sum=self._kv_slots_held_sum,
            step_seconds_total=self._step_seconds_total,
            step_cost=self._step_cost.snapshot(),
            forward_seconds_total=self.runner.forward_seconds,
            num_speculative_tokens=self.speculator.num_speculative_tokens if self.speculator.enabled else None,
            spec_decode=self.speculator.stats(),
        )

    # ----------------------------------------------------------------- helpers

    def _check_stop(self, request: Request, sequence: _Sequence, token_id: int) -> RequestStatus | None:
        params = request.params
        num_output = len(request.output_token_ids)
        stop_string = sequence.detokenizer.append(token_id)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if stop_string is not None:
                request.stop_reason = stop_string
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, state: _RequestState, advanced: list[_Sequence]) -> RequestOutput | None:
        """The request's output after a step in which ``advanced`` (some of its sequences) got tokens;
        None while a FINAL_ONLY request runs on.

        Text comes from each detokenizer's ``pop_delta``, which holds back a tail that may still
        become a stop string: no output, of any kind, shows text that a stop string later removes.
        """
        new_text = {s.index: s.detokenizer.pop_delta(finished=s.request.is_finished) for s in advanced}
        kind = state.params.output_kind
        finished = state.num_unfinished == 0
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        # A delta names only the sequences that changed; the other kinds all of them.
        shown = sorted(advanced, key=lambda s: s.index) if kind is RequestOutputKind.DELTA else state.sequences
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[sequence.completion(kind, new_text.get(sequence.index, "")) for sequence in shown],
            finished=finished,
            num_cached_tokens=max(s.request.num_cached_tokens for s in state.sequences),
            metrics=state.metrics,
            lora_request=state.lora_request,
        )

    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use by an unfinished request")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab_size = self.arch.vocab_size
        for token_id in prompt_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"prompt token id {token_id!r} is outside the model's vocabulary [0, {vocab_size})"
                )
        num_prompt = len(prompt_token_ids)
        if num_prompt >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens but max_model_len is {self.max_model_len}: the prompt must "
                "leave room for at least one generated token; shorten the prompt"
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) exceeds max_model_len "
                f"({self.max_model_len}); lower max_tokens to at most {self.max_model_len - num_prompt} "
                "or shorten the prompt"
            )
        for token_id in params.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"stop_token_ids: {token_id} is outside the model's vocabulary [0, {vocab_size})"
                )
        if params.logprobs is not None and params.logprobs > vocab_size:
            raise InvalidRequestError(f"logprobs: at most the vocabulary size ({vocab_size}), got {params.logprobs}")
