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
from kvpilot.engine.config import (
    ConfigError,
    EngineConfig,
    ResolvedConfig,
    blocks_from_budget,
    default_cpu_kv_cache_memory,
    kv_block_bytes,
    resolve_max_model_len,
    resolve_max_num_batched_tokens,
)
from kvpilot.engine.detokenizer import IncrementalDetokenizer
from kvpilot.engine.kv_cache_manager import KVCacheManager
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.models import CausalLM, ModelArch, load_model, load_tokenizer, read_model_arch, saved_dtype
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpilot.engine.request import InvalidRequestError, Request, RequestStatus
from kvpilot.engine.sampler import Sampler, SamplingInput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.spec_decode.draft_proposer import DraftModelProposer
from kvpilot.engine.spec_decode.ngram_proposer import NgramProposer
from kvpilot.engine.spec_decode.speculator import SpecDecodeStats, Speculator
from kvpilot.engine.step_cost import StepCost, StepCostSnapshot

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
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
        )
        self.speculator = self._build_speculator(draft_model)
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
        arch = read_model_arch(config.model)
        device = _resolve_device(config.device)
        dtype = _resolve_dtype(config.dtype, config.model, device)
        max_model_len = _resolve_max_model_len(config, arch)
        max_num_batched_tokens = resolve_max_num_batched_tokens(config, max_model_len)
        backend_name = config.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if device == "cuda" else "torch"

        torch.manual_seed(config.seed)
        started = time.perf_counter()
        model = load_model(config.model, _TORCH_DTYPES[dtype], torch.device(device), config.quantization)
        if device == "cpu":
            model.pack_weights_for_cpu(batch_size_hint=config.max_num_seqs)
        draft_model = None
        if config.speculative_config is not None and config.speculative_config.method == "draft_model":
            draft_model = _load_draft_model(config, arch, _TORCH_DTYPES[dtype], device, max_model_len)
        weights_loaded = time.perf_counter()
        tokenizer = load_tokenizer(config.model)
        tokenizer_loaded = time.perf_counter()
        runner = ModelRunner(
            model,
            device=torch.device(device),
            block_size=config.block_size,
            backend=get_attention_backend(backend_name),
            sampler=Sampler(arch.eos_token_ids),
        )
        block_bytes = kv_block_bytes(
            block_size=config.block_size,
            num_layers=arch.num_layers,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            dtype_bytes=_TORCH_DTYPES[dtype].itemsize,
        )
        if draft_model is not None:  # the draft's KV cache has as many blocks as the target's
            draft_arch = draft_model.arch
            block_bytes += kv_block_bytes(
                block_size=config.block_size,
                num_layers=draft_arch.num_layers,
                num_kv_heads=draft_arch.num_kv_heads,
                head_dim=draft_arch.head_dim,
                dtype_bytes=_TORCH_DTYPES[dtype].itemsize,
            )
        budget, source = _kv_cache_budget(config, runner, device, max_model_len, max_num_batched_tokens, block_bytes)
        num_blocks = blocks_from_budget(
            budget_bytes=budget,
            block_bytes=block_bytes,
            block_size=config.block_size,
            max_model_len=max_model_len,
            source=source,
        )
        runner.allocate_kv_cache(num_blocks)
        if device == "cuda" and not config.enforce_eager and backend_name == "triton":
            # Decode batches grow to max_num_seqs; a live increase beyond it runs eagerly.
            runner.enable_cuda_graphs(max_num_seqs=config.max_num_seqs, max_model_len=max_model_len)
        resolved = ResolvedConfig(
            device=device,
            dtype=dtype,
            attention_backend=backend_name,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            num_kv_blocks=num_blocks,
            kv_block_bytes=block_bytes,
        )
        logger.info(
            "engine ready: %s on %s/%s, %d KV blocks of %d tokens (%.1f MiB), max_model_len %d; weights loaded "
            "in %.1f s, tokenizer in %.1f s, KV cache sized (profiling forward, warm-up) in %.1f s",
            arch.architecture, device, dtype, num_blocks, config.block_size,
            num_blocks * block_bytes / 1024**2, max_model_len, weights_loaded - started,
            tokenizer_loaded - weights_loaded, time.perf_counter() - tokenizer_loaded,
        )
        return cls(config, resolved, arch, tokenizer, runner, draft_model)

    def _build_speculator(self, draft_model: CausalLM | None) -> Speculator | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
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
    ) -> None:
        self._validate(request_id, prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        prompt_token_ids = list(prompt_token_ids)
        state = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            params=params,
            metrics=RequestMetrics(arrival_time=arrival),
            num_unfinished=params.n,
        )
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                # Each of the n sequences draws its own stream; the mask keeps the seed in the 64-bit range.
                seed = (params.seed + index) & 0xFFFF_FFFF_FFFF_FFFF
                generator = torch.Generator(device=self._device).manual_seed(seed)
            sequence_id = f"{request_id}#{index}@{next(self._sequence_ids)}"
            request = Request(sequence_id, prompt_token_ids, params, arrival)
            request.sampling_input = SamplingInput(
                params=params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                generator=generator,
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

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def set_scheduler_limits(
        self, max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None
    ) -> None:
        """Change the batch limits of a live engine; validated here, obeyed from the next step."""
        self.scheduler.set_limits(max_num_seqs, max_num_batched_tokens)

    def set_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Change how many tokens speculative decoding proposes per step (0 pauses it), live."""
        if self.speculator is None:
            raise ValueError(
                "num_speculative_tokens: this engine runs without speculative decoding; start it with "
                "speculative_config (kvpilot serve --speculative-config '{\"method\": \"ngram\", ...}')"
            )
        self.speculator.set_num_speculative_tokens(num_speculative_tokens)

    # ----------------------------------------------------------------- stepping

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the requests that got new tokens (cumulative outputs)."""
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
        if self.speculator is not None:
            inputs = result.inputs
            self.speculator.observe(inputs.input_ids, inputs.positions, inputs.metadata)

        now = time.monotonic()
        advanced: dict[str, _RequestState] = {}
        finished: dict[RequestStatus, list[Request]] = {}
        still_running: list[Request] = []
        for request, token_ids, logprobs, num_drafts in zip(
            result.sampled_requests, result.token_ids, result.logprobs, result.num_drafts
        ):
            sequence = sequences[request.request_id]
            state = sequence.state
            request.spec_token_ids = []
            status = None
            for token_id in token_ids:  # one token, or accepted proposals plus one: each checked for a stop
                request.append_output_token(token_id)
                self._generation_tokens_total += 1
                if sequence.logprobs is not None and logprobs is not None:
                    sequence.logprobs.append(logprobs)
                    sequence.cumulative_logprob += logprobs.get(token_id, 0.0)
                status = self._check_stop(request, sequence, token_id)
                if status is not None:
                    break
            if status is not None:
                finished.setdefault(status, []).append(request)
                state.num_unfinished -= 1
            else:
                if num_drafts:
                    self.scheduler.rollback(request, num_drafts - (len(token_ids) - 1))
                still_running.append(request)
            advanced[state.request_id] = state
            metrics = state.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self._prompt_tokens_total += len(state.prompt_token_ids)
            metrics.last_token_time = now
        for status, requests in finished.items():
            self.scheduler.finish_requests(requests, status)
        if self.speculator is not None:
            self.speculator.record(result.num_drafts, result.token_ids)
            self.speculator.propose(still_running, self.scheduler.num_running)

        outputs = []
        for state in advanced.values():
            if state.num_unfinished == 0:
                state.metrics.finished_time = now
                del self._requests[state.request_id]
                for sequence in state.sequences:
                    del sequences[sequence.request.request_id]
            outputs.append(self._make_output(state))
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
            num_speculative_tokens=None if self.speculator is None else self.speculator.num_speculative_tokens,
            spec_decode=None if self.speculator is None else self.speculator.stats(),
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

    def _make_output(self, state: _RequestState) -> RequestOutput:
        completions = []
        for sequence in state.sequences:
            request = sequence.request
            completions.append(
                CompletionOutput(
                    index=sequence.index,
                    text=sequence.detokenizer.text,
                    token_ids=list(request.output_token_ids),
                    cumulative_logprob=sequence.cumulative_logprob,
                    logprobs=list(sequence.logprobs) if sequence.logprobs is not None else None,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                )
            )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=state.num_unfinished == 0,
            num_cached_tokens=max(s.request.num_cached_tokens for s in state.sequences),
            metrics=state.metrics,
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


def _load_draft_model(
    config: EngineConfig, arch: ModelArch, dtype: torch.dtype, device: str, max_model_len: int
) -> CausalLM:
    path = config.speculative_config.model
    draft_arch = read_model_arch(path)
    if draft_arch.vocab_size != arch.vocab_size:
        raise ConfigError(
            f"speculative_config.model: the draft's vocabulary has {draft_arch.vocab_size} tokens but the target's "
            f"has {arch.vocab_size}; use a draft model with the target's tokenizer"
        )
    if draft_arch.max_position_embeddings < max_model_len:
        raise ConfigError(
            f"speculative_config.model: the draft handles {draft_arch.max_position_embeddings} positions, fewer "
            f"than max_model_len ({max_model_len}); lower max_model_len or use another draft"
        )
    draft = load_model(path, dtype, torch.device(device), quantization="auto")  # a packed draft stays packed
    if device == "cpu":
        draft.pack_weights_for_cpu(batch_size_hint=config.speculative_config.disable_by_batch_size)
    return draft


def _resolve_max_model_len(config: EngineConfig, arch: ModelArch) -> int:
    max_model_len = resolve_max_model_len(config, arch.max_position_embeddings)
    if arch.sliding_window is not None and max_model_len > arch.sliding_window:
        if config.max_model_len is not None:
            raise ConfigError(
                f"max_model_len ({max_model_len}) exceeds the model's sliding window ({arch.sliding_window}); "
                "sliding-window attention is not supported, so lower max_model_len to at most the window"
            )
        max_model_len = arch.sliding_window
    return max_model_len


def _kv_cache_budget(
    config: EngineConfig,
    runner: ModelRunner,
    device: str,
    max_model_len: int,
    max_num_batched_tokens: int,
    block_bytes: int,
) -> tuple[int, str]:
    """(bytes for the KV cache, the setting they come from, for error messages)."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory, "kv_cache_memory"
    if device == "cpu":
        return default_cpu_kv_cache_memory(config, max_model_len, block_bytes), "kv_cache_memory (default)"
    return _profile_kv_budget(runner, config, max_num_batched_tokens), "gpu_memory_utilization"


def _resolve_device(device: str) -> str:
    cuda = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if cuda else "cpu"
    if device == "cuda" and not cuda:
        raise ConfigError("device: 'cuda' was requested but no CUDA device is visible; use device='cpu'")
    return device


def _resolve_dtype(dtype: str, model_path: str, device: str) -> str:
    if dtype != "auto":
        if dtype == "float16" and device == "cpu":
            raise ConfigError("dtype: float16 is not supported on CPU; use bfloat16 or float32")
        return dtype
    saved = saved_dtype(model_path)
    if saved in _TORCH_DTYPES and not (saved == "float16" and device == "cpu"):
        return saved
    return "bfloat16" if device == "cuda" else "float32"


def _profile_kv_budget(runner: ModelRunner, config: EngineConfig, max_num_batched_tokens: int) -> int:
    """Bytes left for the KV cache: the device's share minus weights, peak activations and other users."""
    _, total = torch.cuda.mem_get_info()
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
    inputs = [
        SamplingInput(params=params, prompt_token_ids=[0], output_token_ids=[], generator=None)
        for _ in range(config.max_num_seqs)
    ]
    peak = runner.profile_peak_memory(max_num_batched_tokens, config.max_num_seqs, inputs)
    free_after, _ = torch.cuda.mem_get_info()
    # Memory held outside torch's allocator (CUDA context, other processes) counts against the share too.
    non_torch = (total - free_after) - torch.cuda.memory_reserved()
    budget = int(total * config.gpu_memory_utilization) - peak - max(non_torch, 0)
    logger.info(
        "memory profile: total %.2f GiB, share %.2f, peak torch %.2f GiB, other %.2f GiB -> KV budget %.2f GiB",
        total / 1024**3, config.gpu_memory_utilization, peak / 1024**3, non_torch / 1024**3, budget / 1024**3,
    )
    return budget
