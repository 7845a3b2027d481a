"""Turns a SchedulerOutput into one forward pass over the whole mixed batch, then samples.

The batch is flat: sequence i's new tokens are rows ``query_start_loc[i] :
query_start_loc[i+1]``, whether they are a whole prompt, a prompt chunk on top
of a cached prefix, a recomputation after preemption or one decode token. Only
rows that end a sequence's catch-up (its computed tokens reach its length) go
through the LM head and the sampler; a partial prefill chunk samples nothing.
A sequence that also computes proposed tokens (speculative decoding) gets logits
at its last verified token and at each proposal, and the rejection sampler decides
how many proposals to keep.

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
from kvpilot.engine.lora.layer import LoRAMapping
from kvpilot.engine.models import CausalLM
from kvpilot.engine.request import Request
from kvpilot.engine.sampler import Sampler
from kvpilot.engine.scheduler import SchedulerOutput
from kvpilot.engine.spec_decode.rejection_sampler import rejection_sample
from kvpilot.engine.structured_outputs import start_bitmask

if TYPE_CHECKING:
    from kvpilot.engine.cpu_decode import CpuDecodePath
    from kvpilot.engine.cuda_graphs import DecodeCudaGraphs
    from kvpilot.engine.lora.manager import LoRAManager


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] int64 rows whose hidden state is sampled from
    sampled_requests: list[Request]  # each owns 1 + len(its drafts) consecutive logits_indices
    drafts: list[list[int]]  # per sampled request: the proposals this step verifies (mostly none)
    is_decode_only: bool  # every sequence computes exactly one token (the CUDA-graph case)
    lora: LoRAMapping | None = None  # rows running with a LoRA adapter, by slot; None when none does


@dataclass(frozen=True)
class StepResult:
    sampled_requests: list[Request]
    # Per sampled request: its new tokens (one, or its accepted proposals plus one), and the
    # logprobs of the one when it asked for them (requests with proposals never do).
    token_ids: list[list[int]]
    logprobs: list[dict[int, float] | None]
    num_drafts: list[int]  # per sampled request: proposals verified (accepted: len(token_ids) - 1)
    inputs: ModelInputs  # what the forward ran (a draft model runs the same batch)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        device: torch.device,
        block_size: int,
        backend: AttentionBackend,
        sampler: Sampler,
        lora: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # the adapters and their slots when LoRA is enabled
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.sampler = sampler
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: DecodeCudaGraphs | None = None  # set by enable_cuda_graphs on CUDA
        self.cpu_decode: CpuDecodePath | None = None  # set by enable_cpu_decode_path on the CPU
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
        # Constrained rows' token masks are computed while the forward runs (llguidance's threads).
        grammar_mask = None if any(inputs.drafts) else start_bitmask(
            [r.sampling_input.matcher for r in inputs.sampled_requests], self.model.arch.vocab_size)
        start = time.perf_counter()
        hidden = self.run_model(inputs)  # [num_tokens, hidden_size]
        requests = inputs.sampled_requests
        if not requests:
            self.forward_seconds += time.perf_counter() - start
            return StepResult([], [], [], [], inputs)
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_logits, vocab] float32
        self.forward_seconds += time.perf_counter() - start
        num_drafts = [len(d) for d in inputs.drafts]
        if not any(num_drafts):
            out = self.sampler.sample(logits, [r.sampling_input for r in requests], grammar_mask)
            return StepResult(requests, [[t] for t in out.token_ids], out.logprobs, num_drafts, inputs)
        return self._verify(logits, inputs, num_drafts)

    def _verify(self, logits: torch.Tensor, inputs: ModelInputs, num_drafts: list[int]) -> StepResult:
        """Plain sampling for requests without proposals, rejection sampling for the others."""
        requests, drafts = inputs.sampled_requests, inputs.drafts
        last_rows = list(accumulate(n + 1 for n in num_drafts))  # one past each request's rows
        plain = [i for i, n in enumerate(num_drafts) if n == 0]
        spec = [i for i, n in enumerate(num_drafts) if n > 0]
        token_ids: list[list[int]] = [[] for _ in requests]
        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        if plain:
            out = self.sampler.sample(
                logits[[last_rows[i] - 1 for i in plain]], [requests[i].sampling_input for i in plain]
            )
            for i, token, lp in zip(plain, out.token_ids, out.logprobs):
                token_ids[i], logprobs[i] = [token], lp
        spec_rows = [row for i in spec for row in range(last_rows[i] - num_drafts[i] - 1, last_rows[i])]
        emitted = rejection_sample(
            logits[spec_rows], [drafts[i] for i in spec], [requests[i].sampling_input for i in spec]
        )
        for i, tokens in zip(spec, emitted):
            token_ids[i] = tokens
        return StepResult(requests, token_ids, logprobs, num_drafts, inputs)

    def enable_cpu_decode_path(self) -> bool:
        """Run decode-only steps in one C call where the model allows it (after allocate_kv_cache;
        not with LoRA adapters, whose rows change per step); returns whether it does."""
        from kvpilot.engine.cpu_decode import CpuDecodePath

        if self.lora is None and getattr(self.backend, "decode_kernel", False):
            self.cpu_decode = CpuDecodePath.for_model(self.model, self.kv_caches)
        return self.cpu_decode is not None

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
        if self.cpu_decode is not None and inputs.is_decode_only:
            return self.cpu_decode.run(inputs.input_ids, inputs.positions, inputs.metadata)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, self.backend,
                          inputs.lora)

    def prepare_inputs(self, step: SchedulerOutput) -> ModelInputs:
        input_ids: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Request] = []
        drafts: list[list[int]] = []
        # Per attention sequence (a scheduled sequence, or one row of a verifying sequence): its new
        # tokens, its context length after the step, its block table.
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        row_slots: list[int | None] = []  # each row's adapter slot, when LoRA is enabled
        row = 0
        for request, num_new, num_before, block_ids in zip(
            step.requests, step.num_scheduled_tokens, step.num_computed_before, step.block_ids
        ):
            tokens = request.all_token_ids
            seq_len = num_before + num_new
            num_verified = len(tokens)
            if num_new == 1 and seq_len <= num_verified:
                input_ids.append(tokens[num_before])
            elif seq_len <= num_verified:
                input_ids.extend(tokens[num_before : num_before + num_new])
            else:
                input_ids.extend((tokens + request.spec_token_ids)[num_before:seq_len])
            row += num_new
            if self.lora is not None:
                row_slots.extend([request.lora_slot] * num_new)
            if seq_len > num_verified:
                # Verifying proposals: each row attends as a decode row of its own (row j sees the
                # context up to itself), so the decode attention path serves the whole step.
                q_lens.extend([1] * num_new)
                seq_lens.extend(range(num_before + 1, seq_len + 1))
                tables.extend([block_ids] * num_new)
            else:
                q_lens.append(num_new)
                seq_lens.append(seq_len)
                tables.append(block_ids)
            if seq_len >= num_verified:
                # Logits after the last verified token and after each proposal computed this step
                # (the token budget may have cut the proposals short).
                num_drafts = seq_len - num_verified
                logit_rows.extend(range(row - 1 - num_drafts, row))
                sampled.append(request)
                drafts.append(request.spec_token_ids[:num_drafts])
        query_start_loc = [0, *accumulate(q_lens)]
        num_tokens = query_start_loc[-1]
        is_decode_only = num_tokens == len(seq_lens)

        max_blocks = max(map(len, tables))
        block_tables = torch.tensor(
            [ids + [0] * (max_blocks - len(ids)) for ids in tables], dtype=torch.int32
        )  # [num_seqs, max_blocks]
        num_before_t = torch.tensor(seq_lens, dtype=torch.int64) - torch.tensor(q_lens, dtype=torch.int64)
        if is_decode_only:
            positions = num_before_t  # [num_tokens]
            token_seq = torch.arange(num_tokens)
        else:
            q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
            starts = torch.tensor(query_start_loc[:-1], dtype=torch.int64)
            # Row r of sequence i sits at position num_before_i + (r - start_i).
            token_seq = torch.repeat_interleave(torch.arange(len(seq_lens)), q_lens_t)  # [num_tokens]
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
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return ModelInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=positions.to(device),
            metadata=metadata,
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=device),
            sampled_requests=sampled,
            drafts=drafts,
            is_decode_only=is_decode_only,
            lora=LoRAMapping.from_row_slots(row_slots, device),
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

