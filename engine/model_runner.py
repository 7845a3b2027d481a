"""Turns a SchedulerOutput into one forward pass over the whole mixed batch, then samples.

The batch is flat: sequence i's new tokens are rows ``query_start_loc[i] :
query_start_loc[i+1]``, whether they are a whole prompt, a prompt chunk on top
of a cached prefix, a recomputation after preemption or one decode token. Only
rows that end a sequence's catch-up (its computed tokens reach its length) go
through the LM head and the sampler; a partial prefill chunk samples nothing.

Per-step Python work is kept to one pass over the scheduled sequences; every
tensor is built from a list with one ``torch.tensor`` call or derived with a
few vectorised ops.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.attention import AttentionBackend, AttentionMetadata
from kvpilot.engine.models import CausalLM
from kvpilot.engine.request import Request
from kvpilot.engine.sampler import Sampler, SamplerOutput
from kvpilot.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from kvpilot.engine.cuda_graphs import DecodeCudaGraphs


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled] int64 rows whose hidden state is sampled from
    sampled_requests: list[Request]  # parallel to logits_indices
    is_decode_only: bool  # every sequence computes exactly one token (the CUDA-graph case)


@dataclass(frozen=True)
class StepResult:
    sampled_requests: list[Request]
    sampler_output: SamplerOutput  # token_ids / logprobs parallel to sampled_requests


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        device: torch.device,
        block_size: int,
        backend: AttentionBackend,
        sampler: Sampler,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.sampler = sampler
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: DecodeCudaGraphs | None = None  # set by enable_cuda_graphs on CUDA
        # Host seconds in the model forward and LM head, summed over steps (on CUDA the
        # sampler's copy of the sampled ids to the host waits for the forward; on CPU it is exact).
        self.forward_seconds = 0.0

    def kv_block_shape(self, num_blocks: int) -> tuple[int, ...]:
        arch = self.model.arch
        return (2, num_blocks, self.block_size, arch.num_kv_heads, arch.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = self.kv_block_shape(num_blocks)
        # Zeroed, not empty: a padded attention tile may read unwritten slots before masking them.
        self.kv_caches = [
            torch.zeros(shape, dtype=self.model.dtype, device=self.device) for _ in range(self.model.arch.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        inputs = self.prepare_inputs(step)
        start = time.perf_counter()
        hidden = self.run_model(inputs)  # [num_tokens, hidden_size]
        if not inputs.sampled_requests:
            self.forward_seconds += time.perf_counter() - start
            return StepResult([], SamplerOutput(token_ids=[], logprobs=[]))
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_sampled, vocab] float32
        self.forward_seconds += time.perf_counter() - start
        sampler_output = self.sampler.sample(logits, [r.sampling_input for r in inputs.sampled_requests])
        return StepResult(inputs.sampled_requests, sampler_output)

    def enable_cuda_graphs(self, *, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode batches of up to max_num_seqs sequences (after allocate_kv_cache)."""
        from kvpilot.engine.cuda_graphs import DecodeCudaGraphs

        self.cuda_graphs = DecodeCudaGraphs.for_model(
            self.model,
            self.kv_caches,
            self.backend,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            block_size=self.block_size,
            device=self.device,
        )

    def run_model(self, inputs: ModelInputs) -> torch.Tensor:
        """The one forward call of a step: decode-only batches replay a CUDA graph when one fits."""
        graphs = self.cuda_graphs
        if graphs is not None and inputs.is_decode_only and graphs.can_run(inputs.metadata):
            return graphs.run(inputs.input_ids, inputs.positions, inputs.metadata)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, self.backend)

    def prepare_inputs(self, step: SchedulerOutput) -> ModelInputs:
        input_ids: list[int] = []
        seq_lens: list[int] = []
        last_rows: list[int] = []
        sampled: list[Request] = []
        row = 0
        for request, num_new, num_before in zip(step.requests, step.num_scheduled_tokens, step.num_computed_before):
            tokens = request.all_token_ids
            if num_new == 1:
                input_ids.append(tokens[num_before])
            else:
                input_ids.extend(tokens[num_before : num_before + num_new])
            seq_len = num_before + num_new
            seq_lens.append(seq_len)
            row += num_new
            if seq_len == len(tokens):
                last_rows.append(row - 1)
                sampled.append(request)
        query_start_loc = [0, *accumulate(step.num_scheduled_tokens)]
        num_tokens = query_start_loc[-1]
        is_decode_only = num_tokens == len(seq_lens)

        block_ids = step.block_ids
        max_blocks = max(map(len, block_ids))
        block_tables = torch.tensor(
            [ids + [0] * (max_blocks - len(ids)) for ids in block_ids], dtype=torch.int32
        )  # [num_seqs, max_blocks]
        num_before_t = torch.tensor(step.num_computed_before, dtype=torch.int64)  # [num_seqs]
        if is_decode_only:
            positions = num_before_t  # [num_tokens]
            token_seq = torch.arange(num_tokens)
        else:
            q_lens = torch.tensor(step.num_scheduled_tokens, dtype=torch.int64)
            starts = torch.tensor(query_start_loc[:-1], dtype=torch.int64)
            # Row r of sequence i sits at position num_before_i + (r - start_i).
            token_seq = torch.repeat_interleave(torch.arange(len(seq_lens)), q_lens)  # [num_tokens]
            positions = torch.arange(num_tokens) + (num_before_t - starts)[token_seq]
        slot_mapping = block_tables[token_seq, positions // self.block_size].long() * self.block_size + (
            positions % self.block_size
        )  # [num_tokens] int64

        device = self.device
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=block_tables.to(device),
            slot_mapping=slot_mapping.to(device),
            max_query_len=max(step.num_scheduled_tokens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            metadata=metadata,
            logits_indices=torch.tensor(last_rows, dtype=torch.int64, device=device),
            sampled_requests=sampled,
            is_decode_only=is_decode_only,
        )

    @torch.inference_mode()
    def profile_peak_memory(self, num_tokens: int, num_seqs: int, sampling_inputs: Sequence[object]) -> int:
        """Peak CUDA bytes allocated by a forward over ``num_tokens`` tokens in ``num_seqs`` prompts
        plus logits and sampling for every sequence: the activations the KV cache must leave room for."""
        assert self.device.type == "cuda", "memory profiling needs a CUDA device"
        num_seqs = max(1, min(num_seqs, num_tokens))
        q_lens = [num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0) for i in range(num_seqs)]
        query_start_loc = [0, *accumulate(q_lens)]
        max_blocks = -(-max(q_lens) // self.block_size)
        # One scratch block per layer, every table entry pointing at it; slots of -1 store nothing.
        scratch = [torch.zeros(self.kv_block_shape(1), dtype=self.model.dtype, device=self.device)] * len(
            self.model.layers
        )
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            max_query_len=max(q_lens),
            max_seq_len=max(q_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=q_lens,
        )
        positions = torch.cat([torch.arange(n, device=self.device) for n in q_lens])
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        hidden = self.model(input_ids, positions, scratch, metadata, self.backend)
        last_rows = torch.tensor(query_start_loc[1:], device=self.device) - 1
        logits = self.model.compute_logits(hidden[last_rows])
        self.sampler.sample(logits, list(sampling_inputs)[:num_seqs])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del hidden, logits, scratch
        torch.cuda.empty_cache()
        return peak

